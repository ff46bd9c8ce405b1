"""`hf-mars demo` (work in progress)."""

from __future__ import annotations

import torch


def _prompts(tokenizer, dataset):
    return [tokenizer.apply_chat_template([ex["messages"][0]], tokenize=False, add_generation_prompt=True)
            for ex in dataset]


@torch.no_grad()
def generate_texts(model, tokenizer, prompts, batch_size=64, max_new_tokens=64, progress=None, **gen_kwargs):
    """Greedy answers for ``prompts`` (strings), in order. Returns (texts, forward_passes, emitted_tokens)."""
    texts, fwd, emitted = [], 0, 0
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             return_dict_in_generate=True, **gen_kwargs)
        seqs = out.sequences[:, enc["input_ids"].shape[1]:]
        texts += tokenizer.batch_decode(seqs, skip_special_tokens=True)
        if getattr(out, "mars_forward_passes", None) is not None:
            fwd += int(out.mars_forward_passes.sum())
            emitted += int(out.mars_emitted_tokens.sum())
        if progress is not None:
            progress.update(len(seqs))
    return texts, fwd, emitted


def evaluate_ar(model, tokenizer, dataset, batch_size=64, **gen_kwargs):
    from hf_mars.data import accuracy

    texts, fwd, emitted = generate_texts(model, tokenizer, _prompts(tokenizer, dataset), batch_size, **gen_kwargs)
    answers = [ex["messages"][1]["content"] for ex in dataset]
    acc = accuracy(list(dataset["task"]) if hasattr(dataset, "column_names") else [ex["task"] for ex in dataset],
                   texts, answers)
    return {"accuracy": acc["overall"], "per_task": acc["per_task"], "predictions": texts,
            "forward_passes": fwd, "emitted_tokens": emitted}


def add_arguments(parser):
    pass


def run(args):
    raise NotImplementedError
