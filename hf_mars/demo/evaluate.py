"""Held-out evaluation for `hf-mars demo`: greedy answers, exact-match accuracy, tokens per forward.

Prompts are the bundled tasks' user turns through the tokenizer's chat template; answers are scored by
`hf_mars.bench.tasks` (exact whole-answer match). Tokens per forward are MARS's own per-row counts
(``mars_emitted_tokens / mars_forward_passes``), summed before dividing, overall and per task.
"""

from __future__ import annotations

from hf_mars.bench.timing import _generate_batch

MAX_NEW_TOKENS = 64  # the longest bundled answer is ~50 characters


def _prompts(tokenizer, examples) -> list[str]:
    return [tokenizer.apply_chat_template([ex["messages"][0]], tokenize=False, add_generation_prompt=True)
            for ex in examples]


def _encode_batches(tokenizer, prompts, batch_size):
    return [tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            for i in range(0, len(prompts), batch_size)]


def _generate(model, batch, max_new_tokens=MAX_NEW_TOKENS, **gen_kwargs):
    return _generate_batch(model, batch, max_new_tokens, **gen_kwargs)


def generate_texts(model, tokenizer, prompts, batch_size=64, max_new_tokens=MAX_NEW_TOKENS, progress=None,
                   **gen_kwargs):
    """Greedy answers for ``prompts`` (chat-formatted strings), in order.

    Returns ``(texts, forward_passes, emitted_tokens)``; the counts are the MARS statistics summed over
    rows (0 for plain generate, which does one forward per token).
    """
    import torch

    texts, fwd, emitted = [], 0, 0
    with torch.inference_mode():
        for batch in _encode_batches(tokenizer, prompts, batch_size):
            out = _generate(model, batch, max_new_tokens, **gen_kwargs)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
            if getattr(out, "mars_forward_passes", None) is not None:
                fwd += int(out.mars_forward_passes.sum())
                emitted += int(out.mars_emitted_tokens.sum())
            if progress is not None:
                progress.update(new.shape[0])
    return texts, fwd, emitted


def _score(examples, texts) -> dict:
    from hf_mars.bench.tasks import accuracy

    return accuracy([ex["task"] for ex in examples], texts, [ex["messages"][1]["content"] for ex in examples])


def evaluate_ar(model, tokenizer, examples, batch_size=64, progress=None, **gen_kwargs):
    """Exact-match accuracy of greedy decoding (plain `generate` unless ``gen_kwargs`` say otherwise)."""
    examples = list(examples)
    texts, fwd, emitted = generate_texts(model, tokenizer, _prompts(tokenizer, examples), batch_size,
                                         progress=progress, **gen_kwargs)
    acc = _score(examples, texts)
    return {"accuracy": acc["overall"], "per_task": acc["per_task"], "predictions": texts,
            "forward_passes": fwd, "emitted_tokens": emitted}


def _per_task_tpf(examples, model, tokenizer, batch_size, progress, **gen_kwargs):
    """Accuracy and tokens per forward, overall and per task (tokens/forward = emitted / forwards, summed)."""
    import torch

    examples = list(examples)
    prompts = _prompts(tokenizer, examples)
    texts, fwd_rows, emit_rows = [], [], []
    with torch.inference_mode():
        for i, batch in enumerate(_encode_batches(tokenizer, prompts, batch_size)):
            out = _generate(model, batch, **gen_kwargs)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
            fwd_rows += [int(v) for v in out.mars_forward_passes]
            emit_rows += [int(v) for v in out.mars_emitted_tokens]
            progress.update(new.shape[0])
    acc = _score(examples, texts)
    per_task = {}
    for task in acc["per_task"]:
        idx = [i for i, ex in enumerate(examples) if ex["task"] == task]
        per_task[task] = {"accuracy": acc["per_task"][task],
                          "tokens_per_forward": sum(emit_rows[i] for i in idx) / max(sum(fwd_rows[i] for i in idx), 1)}
    return {"accuracy": acc["overall"], "tokens_per_forward": sum(emit_rows) / max(sum(fwd_rows), 1),
            "per_task": per_task, "predictions": texts}


def _mars_kwargs(threshold, block_size, cache="sliding", verify=False, draft_tree=None, plain_steps=None):
    """``draft_tree``: verify's layout (None: the default 'auto', which picks one per call by measured speed).
    ``plain_steps``: threshold mode's mars_plain_steps (None: the default, plain steps where the measured cost says
    the masks do not pay; the quality sweeps pass False, so a tau's tokens per forward and accuracy are its masks',
    the same in every run, as verify's are a fixed tree's)."""
    return {"mars": True, "mars_threshold": float(threshold), "mars_block_size": int(block_size),
            "mars_cache": cache, "mars_verify": bool(verify), **({"mars_draft_tree": draft_tree} if draft_tree else {}),
            **({"mars_plain_steps": bool(plain_steps)} if plain_steps is not None and not verify else {})}

