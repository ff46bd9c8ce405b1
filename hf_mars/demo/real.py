"""`hf-mars demo --base gemma3-270m` (or any pretrained causal-LM folder without a chat template): MARS on a real
model and real text, end to end on a CPU.

1. data: paragraph openings of Python's language reference (``real_text``), split by topic; the base's own
   greedy continuations as answers (self-distillation);
2. MARS fine-tune (``MARSTrainer``) and a compute-matched SFT baseline (``SFTTrainer``: same data, steps, batch,
   learning rate), both from the base;
3. quality kept: held-out perplexity on real text (held-out topics' paragraphs, not distilled answers) of the
   base, the MARS model and the SFT model; agreement of the MARS model's greedy with the base's greedy;
4. decoding: tokens per forward at each τ and in verify (chain and tree), with the share of tokens identical to
   the model's own greedy (τ = 1 and verify must be 100%);
5. wall-clock against plain ``generate`` on the same checkpoint, interleaved, at batch 1 and 4;
6. ``report.json``, ``pareto.png`` and a Hub-ready ``mars-checkpoint/``.

Why the embedding matrix is frozen by default (``--train-embeddings`` trains it): Gemma 3 270M holds 168M of its
268M parameters in its tied 262k-row embedding; AdamW over it dominates a CPU step and gives the masks nothing
they need (the mask token's row is Gemma's own ``<mask>``; the layers learn to read it).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

THRESHOLDS = (1.0, 0.99, 0.95, 0.9, 0.8)
# (full run, --quick): the real-model run's own sizes, where the tiny demo's do not fit a 268M model on a CPU
SIZES = {"steps": (80, 3), "batch_size": (8, 4), "num_eval": (12, 3), "timing_prompts": (6, 2),
         "timing_repeats": (1, 1), "max_new_tokens": (48, 16), "learning_rate": (5e-5, 5e-5)}


def _log(msg: str) -> None:
    print(f"[hf-mars demo] {msg}", flush=True)


def resolve_sizes(args) -> None:
    for name, (full, quick) in SIZES.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)


def run(args, base: Path, out: Path) -> int:
    """The pipeline above; ``base`` is a checkpoint folder, ``out`` a prepared output folder."""
    import shutil
    import tempfile

    import torch
    from transformers import set_seed

    from hf_mars.bench.kernels import onednn_available
    from hf_mars.generation import enable_mars

    resolve_sizes(args)
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="_work-", dir=out))
    set_seed(args.seed)
    base_model, tokenizer = _load(base)
    _log(f"base: {base} ({sum(p.numel() for p in base_model.parameters()) / 1e6:.0f}M parameters); {args.steps} "
         f"steps x batch {args.batch_size} for MARS (B={args.block_size}) and for SFT; torch threads: "
         f"{torch.get_num_threads()}")
    data = _data(base_model, tokenizer, args)
    _log(f"1/5 data: {len(data['train'])} training pairs ({data['source']}) in {data['seconds']:.0f}s")
    mars_model, mars_s = _train(base, tokenizer, data["train"], args, work, mars=True)
    enable_mars(mars_model)
    _log(f"2/5 MARS fine-tune done in {mars_s:.0f}s")
    sft_model, sft_s = _train(base, tokenizer, data["train"], args, work, mars=False)
    _log(f"    SFT baseline done in {sft_s:.0f}s")
    quality = _quality(base_model, mars_model, sft_model, tokenizer, data, args)
    del sft_model
    _log("3/5 perplexity " + ", ".join(f"{k} {v:.2f}" for k, v in quality["perplexity"].items()))
    decoding = _decoding(mars_model, tokenizer, data["held_prompts"], args, data["draft_vocab"])
    _log("4/5 decoding: " + ", ".join(f"{k} {v['tokens_per_forward']:.2f} tok/fwd" for k, v in decoding.items()))
    timing = _timing(mars_model, tokenizer, data["held_prompts"][:args.timing_prompts], args, data["draft_vocab"])
    costs = {"float32": step_costs(mars_model)}
    if onednn_available():
        costs["onednn"] = step_costs(onednn_copy(mars_model))
    report = _report(args, base, quality, decoding, timing, data, costs, mars_s, sft_s)
    _log("5/5 writing outputs")
    ckpt = _write(report, out, mars_model, tokenizer, data["held_prompts"][0], data["draft_vocab"])
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["outputs"] = {"plot": str(out / "pareto.png"), "checkpoint": str(ckpt)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    print(summary(report))
    _log(f"wrote {out / 'report.json'}, {out / 'pareto.png'} and {ckpt}/ in {report['wall_seconds']:.0f}s")
    return 0


def _load(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def _data(base_model, tokenizer, args) -> dict:
    """Distilled training pairs from train-topic openings; held-out openings and held-out text for perplexity.
    With ``--dataset``, the user's rows instead (`user_data.data`)."""
    import random

    from hf_mars.demo import real_text, user_data

    if getattr(args, "dataset", None):
        return user_data.data(tokenizer, args, _draft_vocab)

    train, held = real_text.split()
    # half as many answers as the steps read, each seen twice: generating them costs about as much as training on
    # them on a CPU, and the masks learn from the pairs' many positions, not from their number
    n_train = max(args.steps * args.batch_size // 2, 1)
    rng = random.Random(args.seed)
    prompts = [real_text.opening(rng.choice(train), rng.randint(8, 24)) for _ in range(n_train)]
    t0 = time.time()
    pairs = real_text.distill(base_model, tokenizer, prompts, args.max_new_tokens, batch_size=32)
    held_prompts = held_out_prompts(args.num_eval, held)
    return {"train": pairs, "seconds": time.time() - t0, "held_prompts": held_prompts,
            "held_text": held[:max(args.num_eval, 8)], "draft_vocab": _draft_vocab(pairs),
            "source": "self-distilled: the base's greedy continuations of Python's language reference"}


def held_out_prompts(count: int, held=None) -> list[str]:
    """The openings of the first ``count`` held-out topics: the prompts every decoding figure is measured on."""
    from hf_mars.demo import real_text

    held = real_text.split()[1] if held is None else held
    return [real_text.opening(text) for text in held[:count]]


def _draft_vocab(pairs, coverage: float = 0.99) -> list[int]:
    """The draft vocabulary for verify's mask columns: the most frequent tokens of the distilled answers (what the
    masks learn to predict), as many as cover ``coverage`` of those answers' tokens."""
    from collections import Counter

    from hf_mars.generation.draft_vocab import rank_tokens

    ranked = rank_tokens([completion for _, completion in pairs])
    counts = Counter(t for _, completion in pairs for t in completion)
    total, seen = sum(counts.values()), 0
    for size, token in enumerate(ranked, 1):
        seen += counts[token]
        if seen >= coverage * total:
            return ranked[:size]
    return ranked


def _train(base, tokenizer, pairs, args, work: Path, mars: bool):
    """One fine-tune from the base: MARS (cut rows, see ``real_text.token_rows``) or the SFT baseline (uncut)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_mars import MARSConfig, MARSTrainer, add_mask_token
    from hf_mars.demo.real_text import token_rows
    from hf_mars.demo.training import _train_config

    model, _ = _load(base)
    if mars:
        add_mask_token(model, tokenizer)
    if not args.train_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    rows = Dataset.from_list(token_rows(pairs * 2, args.cut_fraction if mars else 0.0, args.seed))
    extra = {"block_size": args.block_size, "ar_weight": 1.0} if mars else {}
    cls, trainer_cls = (MARSConfig, MARSTrainer) if mars else (SFTConfig, SFTTrainer)
    config = _train_config(cls, work / ("mars" if mars else "sft"), args, completion_only_loss=True, **extra)
    trainer = trainer_cls(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                          peft_config=lora_config(args))
    t0 = time.time()
    trainer.train()
    model = trainer.model
    if hasattr(model, "merge_and_unload"):  # LoRA: one plain checkpoint again, as the full fine-tune gives
        model = model.merge_and_unload()
    model.get_input_embeddings().weight.requires_grad_(True)
    return model.eval(), time.time() - t0


def lora_config(args):
    """``--lora-rank``: LoRA adapters on every linear layer but the (tied) LM head, alpha = 2 x rank; None for a
    full fine-tune. Why offered: a low-rank update moves the base less than a full fine-tune at the same learning
    rate (held-out perplexity is the measure), and AdamW keeps state for the adapters only."""
    rank = getattr(args, "lora_rank", 0)
    if not rank:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def perplexity(model, tokenizer, texts, max_tokens: int = 128) -> float:
    """exp(mean next-token NLL) over ``texts`` (each cut to ``max_tokens``), every token weighted alike."""
    import math

    import torch

    nll, count = 0.0, 0
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"]
            out = model(input_ids=ids, labels=ids)
            n = ids.shape[1] - 1
            nll, count = nll + float(out.loss) * n, count + n
    return math.exp(nll / max(count, 1))


def _greedy_ids(model, tokenizer, prompts, max_new_tokens, **kwargs):
    """Greedy new-token ids per prompt (batch 1: no padding enters the comparison), and MARS's forward counts.
    A threshold-mode call keeps its masks on every step unless told otherwise (``mars_plain_steps=False``): the
    figures measured here are the masks', the same in every run; the timing runs the default plain steps."""
    import torch

    if kwargs.get("mars") and not kwargs.get("mars_verify"):
        kwargs = {"mars_plain_steps": False, **kwargs}

    ids, forwards, emitted = [], 0, 0
    with torch.inference_mode():
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                                 **kwargs)
            ids.append(out.sequences[0, enc["input_ids"].shape[1]:].tolist())
            if getattr(out, "mars_forward_passes", None) is not None:
                forwards += int(out.mars_forward_passes.sum())
                emitted += int(out.mars_emitted_tokens.sum())
    return ids, (emitted / forwards if forwards else 1.0)


def agreement(ids, reference) -> float:
    """Share of ``reference``'s tokens that ``ids`` reproduces at the same position."""
    same = sum(sum(a == b for a, b in zip(x, r)) for x, r in zip(ids, reference))
    return same / max(sum(len(r) for r in reference), 1)


def _quality(base_model, mars_model, sft_model, tokenizer, data, args) -> dict:
    texts = data["held_text"]
    ppl = {name: perplexity(m, tokenizer, texts) for name, m in
           (("base", base_model), ("mars", mars_model), ("sft", sft_model))}
    base_ids, _ = _greedy_ids(base_model, tokenizer, data["held_prompts"], args.max_new_tokens)
    mars_ids, _ = _greedy_ids(mars_model, tokenizer, data["held_prompts"], args.max_new_tokens)
    def coverage(vocab):  # share of the held-out greedy tokens a draft vocabulary holds
        listed = set(vocab)
        return sum(t in listed for ids in mars_ids for t in ids) / max(sum(map(len, mars_ids)), 1)

    return {"perplexity": ppl, "perplexity_texts": len(texts), "coverage": coverage,
            "greedy_agreement_mars_vs_base": agreement(mars_ids, base_ids), "greedy": mars_ids}


def tree_supported(model, prompt_tokens: int, max_new_tokens: int, block_size: int) -> bool:
    """Whether the demo asks verify for a draft tree on this model's calls (the longest ``prompt_tokens`` long,
    ``max_new_tokens`` new). Not where sliding-window layers (Gemma 3 has five to each global one) would cut a
    call: their cache holds the gaps a tree's rejected branches leave only while the call fits inside the window
    (`hf_mars.generation.cache.call_fits_window`, the rule `hf_mars.generation.tree.refusal` reads); the demo
    drafts a chain there, so no prompt of the user's data is refused."""
    from transformers import DynamicCache

    from hf_mars.generation.cache import call_fits_window, has_sliding_layers
    from hf_mars.generation.limits import step_room

    if not has_sliding_layers(DynamicCache(config=model.config)):
        return True
    return call_fits_window(model, prompt_tokens + max_new_tokens + step_room(block_size + 1))


def _tree_for(model, tokenizer, prompts, args) -> bool:
    """`tree_supported` for these prompts' calls (encoded as the decoding runs encode them)."""
    longest = max((len(tokenizer(p)["input_ids"]) for p in prompts), default=0)
    return tree_supported(model, longest, args.max_new_tokens, args.block_size)


def _modes(args, draft_vocab, thresholds=THRESHOLDS, tree: bool = True) -> dict:
    """The decoding settings compared: each τ, and verify as a chain or (``tree``: where the model's cache allows
    one) a tree, each with and without the draft vocabulary (``+vocab``)."""
    from hf_mars.demo.evaluate import _mars_kwargs

    modes = {f"tau={tau:g}": _mars_kwargs(tau, args.block_size) for tau in thresholds}
    verify = _mars_kwargs(args.verify_threshold, args.block_size, verify=True)
    for tree in ("chain", "tree") if tree else ("chain",):
        shape = {"mars_draft_tree": tree}
        modes[f"verify:{tree}"] = {**verify, **shape}
        modes[f"verify:{tree}+vocab"] = {**verify, **shape, "mars_draft_vocab": draft_vocab}
    return modes


def _decoding(model, tokenizer, prompts, args, draft_vocab) -> dict:
    """Per mode: tokens per forward, share of tokens identical to plain greedy, and whether every answer is."""
    greedy, _ = _greedy_ids(model, tokenizer, prompts, args.max_new_tokens)
    out = {}
    for name, kwargs in _modes(args, draft_vocab, tree=_tree_for(model, tokenizer, prompts, args)).items():
        ids, tpf = _greedy_ids(model, tokenizer, prompts, args.max_new_tokens, **kwargs)
        out[name] = {"tokens_per_forward": tpf, "agreement_with_greedy": agreement(ids, greedy),
                     "identical_to_greedy": ids == greedy}
    return out


def _timing(model, tokenizer, prompts, args, draft_vocab) -> dict:
    """Seconds per setting, interleaved (``time_interleaved``): float32 at batch 1 and 4 (plain generate, each
    mode); then at batch 1 plain generate and verify on two copies of the model: bfloat16 (``1-bf16``) and float32
    with its linear layers on oneDNN kernels (``1-onednn``, `onednn_copy`)."""
    from hf_mars.bench.kernels import onednn_available
    from hf_mars.bench.timing import time_interleaved

    def _encode_batches(tokenizer, prompts, size):  # with the tokenizer's BOS, as the decoding runs encode them
        return [tokenizer(prompts[i:i + size], return_tensors="pt", padding=True) for i in range(0, len(prompts), size)]

    seconds, tree = {}, _tree_for(model, tokenizer, prompts, args)
    for bs in (1, 4):
        runs = {"ar": {}, **_modes(args, draft_vocab, THRESHOLDS if bs == 1 else (0.9,), tree)}
        batches = _encode_batches(tokenizer, prompts, bs)
        seconds[str(bs)] = time_interleaved(model, batches, runs, args.timing_repeats,
                                            max_new_tokens=args.max_new_tokens)
    runs = {"ar": {}, **_modes(args, draft_vocab, (), tree)}
    copies = {"1-bf16": {"dtype": "bfloat16"}, **({"1-onednn": {"onednn": True}} if onednn_available() else {})}
    for setting, how in copies.items():
        other = _copy(model, **how)
        seconds[setting] = time_interleaved(other, _encode_batches(tokenizer, prompts, 1), runs, args.timing_repeats,
                                            max_new_tokens=args.max_new_tokens)
        del other
    return seconds


def _copy(model, dtype: str = "float32", onednn: bool = False):
    """A copy built from the config and the weights (a deep copy would keep the instance-level forward TRL's
    trainer installs, fused LM head, whose closure still calls the original); ``onednn``: its linear layers on
    oneDNN's kernels (`hf_mars.bench.kernels`: on some CPUs MKL's few-row float32 matmuls are slow, a MARS step's
    most of all), for inference only."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_mars.bench.kernels import to_onednn
    from hf_mars.generation import enable_mars

    other = AutoModelForCausalLM.from_config(model.config, dtype=getattr(torch, dtype))
    other.load_state_dict(model.state_dict())
    other.generation_config = copy.deepcopy(model.generation_config)
    other = enable_mars(other.eval())
    return to_onednn(other) if onednn else other


def onednn_copy(model):
    """A float32 copy of ``model`` on oneDNN's linear kernels (`_copy`)."""
    return _copy(model, onednn=True)


def step_costs(model, widths=(1, 5, 9, 17), past_len: int = 32, repeats: int = 6) -> dict:
    """This model's cached decode step on this machine, batch 1, split into body (the decoder layers over ``w`` new
    positions after ``past_len`` cached ones) and LM head (full-vocabulary logits at all ``w``): seconds, fastest
    of ``repeats``, and each width's total over width 1's."""
    import torch
    from transformers import DynamicCache

    from hf_mars.bench.timing import _takes

    body, head = model.get_decoder(), model.get_output_embeddings()
    vocab = min(1000, model.get_output_embeddings().weight.shape[0])
    ids = torch.randint(3, vocab, (1, past_len + max(widths)), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config) if _takes(DynamicCache.__init__, "config") else DynamicCache()
    cache_kw = "cache" if _takes(body.forward, "cache") else "past_key_values"
    out = {}
    with torch.inference_mode():
        body(input_ids=ids[:, :past_len], use_cache=True, **{cache_kw: cache})
        for w in widths:
            best_body = best_head = float("inf")
            pos = torch.arange(past_len, past_len + w)[None]
            for _ in range(repeats):
                t0 = time.perf_counter()
                hidden = body(input_ids=ids[:, past_len:past_len + w], position_ids=pos, use_cache=True,
                              **{cache_kw: cache}).last_hidden_state
                t1 = time.perf_counter()
                head(hidden).float().argmax(-1)
                t2 = time.perf_counter()
                cache.crop(-w)
                best_body, best_head = min(best_body, t1 - t0), min(best_head, t2 - t1)
            out[w] = {"body_s": best_body, "head_s": best_head}
    one = out[widths[0]]["body_s"] + out[widths[0]]["head_s"]
    for w in widths:
        out[w]["total_over_width_1"] = (out[w]["body_s"] + out[w]["head_s"]) / one
    return {str(w): {k: round(v, 5) for k, v in c.items()} for w, c in out.items()}


VERIFY_MODES = ("chain", "tree", "chain+vocab", "tree+vocab")


def _report(args, base, quality, decoding, timing, data, costs, mars_s, sft_s) -> dict:
    import torch

    def speedup(bs, name):
        return timing[bs]["ar"] / timing[bs][name]

    plain_paths = {"1": "float32", "1-bf16": "bfloat16", "1-onednn": "float32 on oneDNN"}  # batch 1, each copy
    timed = [setting for setting in plain_paths if setting in timing]
    fastest_plain = min(((plain_paths[s], timing[s]["ar"]) for s in timed), key=lambda x: x[1])
    rows = [{"threshold": tau, "accuracy": decoding[f"tau={tau:g}"]["agreement_with_greedy"],
             "tokens_per_forward": decoding[f"tau={tau:g}"]["tokens_per_forward"],
             "identical_to_greedy": decoding[f"tau={tau:g}"]["identical_to_greedy"],
             "speedup_vs_ar": speedup("1", f"tau={tau:g}")} for tau in THRESHOLDS]
    verify = {}
    for mode in (m for m in VERIFY_MODES if f"verify:{m}" in decoding):  # no tree where the cache allows none
        name, measured = f"verify:{mode}", decoding[f"verify:{mode}"]
        best = min(timing[s][name] for s in timed)
        verify[mode] = {"accuracy": measured["agreement_with_greedy"], "tokens_per_forward": measured["tokens_per_forward"],
                        "identical_to_greedy": measured["identical_to_greedy"], "speedup_vs_ar": speedup("1", name),
                        "speedup_vs_ar_batch_4": speedup("4", name), "speedup_vs_ar_bf16": speedup("1-bf16", name),
                        **({"speedup_vs_ar_onednn": speedup("1-onednn", name)} if "1-onednn" in timing else {}),
                        "speedup_vs_fastest_plain": fastest_plain[1] / best}
    default = max(verify, key=lambda m: verify[m]["speedup_vs_ar"])
    ppl, vocab = quality["perplexity"], data["draft_vocab"]
    return {
        "block_size": args.block_size, "quick": bool(args.quick),
        "perplexity": ppl, "perplexity_texts": quality["perplexity_texts"],
        "perplexity_mars_vs_sft": ppl["mars"] / ppl["sft"] - 1.0,
        "greedy_agreement_mars_vs_base": quality["greedy_agreement_mars_vs_base"],
        "mars": rows, "verify": {**verify[default], "mode": default, "threshold": args.verify_threshold},
        "verify_modes": verify,
        "draft_vocab": {"size": len(vocab), "coverage_of_training_answers": 0.99,
                        "coverage_of_held_out_greedy": quality["coverage"](vocab)},
        "fastest_plain_batch_1": fastest_plain[0],
        "step_costs": costs["float32"], **({"step_costs_onednn": costs["onednn"]} if "onednn" in costs else {}),
        "timing": {"prompts": args.timing_prompts, "repeats": args.timing_repeats,
                   "seconds": {bs: {k: round(v, 4) for k, v in t.items()} for bs, t in timing.items()},
                   "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
                     "cut_fraction": args.cut_fraction, "train_embeddings": bool(args.train_embeddings),
                     "lora_rank": int(getattr(args, "lora_rank", 0)), "examples": len(data["train"]),
                     "data": data["source"], "distill_seconds": round(data["seconds"], 1),
                     "mars_seconds": round(mars_s, 1), "sft_seconds": round(sft_s, 1), "base": str(base)},
        "num_examples": len(data["held_prompts"]), "max_new_tokens": args.max_new_tokens,
        "task": (f"held-out prompts of {args.dataset}" if getattr(args, "dataset", None) else
                 "held-out openings of Python's language reference (pydoc_data.topics, held-out topics)")
                + "; accuracy = share of tokens identical to this model's own greedy decoding",
        "device": f"CPU, {torch.get_num_threads()} threads",
        "command": f"hf-mars demo --base {args.base}" + (" --quick" if args.quick else "")
                   + (f" --lora-rank {args.lora_rank}" if getattr(args, "lora_rank", 0) else "")
                   + (f" --dataset {args.dataset}" if getattr(args, "dataset", None) else ""),
        "description": (f"{Path(str(args.base)).name} fine-tuned with MARS by `hf-mars demo` on "
                        + (f"{args.dataset}" if getattr(args, "dataset", None) else
                           "its own greedy continuations of real text")
                        + f". Held-out perplexity: base {ppl['base']:.2f}, MARS "
                        f"{ppl['mars']:.2f}, compute-matched SFT {ppl['sft']:.2f}."),
    }


def summary(report) -> str:
    lines = ["| mode | tokens/forward | tokens identical to greedy | batch-1 speed-up vs plain generate |",
             "|---|---|---|---|"]
    for r in report["mars"]:
        lines.append(f"| τ = {r['threshold']:g} | {r['tokens_per_forward']:.2f} | {100 * r['accuracy']:.1f}% | "
                     f"{r['speedup_vs_ar']:.2f}× |")
    for name, v in report["verify_modes"].items():
        lines.append(f"| verify ({name}) | {v['tokens_per_forward']:.2f} | {100 * v['accuracy']:.1f}% | "
                     f"{v['speedup_vs_ar']:.2f}× (vs the fastest plain path: {v['speedup_vs_fastest_plain']:.2f}×) |")
    p = report["perplexity"]
    lines.append(f"\nheld-out perplexity: base {p['base']:.2f}, MARS {p['mars']:.2f}, SFT {p['sft']:.2f}")
    return "\n".join(lines)


def _write(report, out: Path, mars_model, tokenizer, example_prompt: str, draft_vocab) -> Path:
    """The plot and the checkpoint; the draft vocabulary goes with the checkpoint as verify mode's default where
    this run measured verify fastest with it (a measured choice, as a saved draft tree is)."""
    import shutil

    from hf_mars.hub import save_for_hub

    _plot(report, out / "pareto.png")
    ckpt = out / "mars-checkpoint"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    mars_model.generation_config.do_sample = False
    save_for_hub(mars_model, tokenizer, ckpt, benchmark=report, mars_block_size=report["block_size"],
                 mars_threshold=1.0, model_name=f"{Path(str(report['command'].split()[3])).name}-mars",
                 description=report["description"], example_prompt=example_prompt,
                 mars_draft_vocab=draft_vocab if report["verify"]["mode"].endswith("+vocab") else None)
    return ckpt


def _plot(report, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    rows = sorted(report["mars"], key=lambda r: r["tokens_per_forward"])
    ax.plot([r["tokens_per_forward"] for r in rows], [100 * r["accuracy"] for r in rows], "o-", label="MARS, τ")
    for r in rows:
        ax.annotate(f"{r['threshold']:g}", (r["tokens_per_forward"], 100 * r["accuracy"]),
                    textcoords="offset points", xytext=(4, 5), fontsize=8)
    for (name, v), marker in zip(report["verify_modes"].items(), "s*DP"):
        ax.plot([v["tokens_per_forward"]], [100 * v["accuracy"]], marker, markersize=10,
                label=f"verify, {name} (lossless)")
    from hf_mars.demo.outputs import finish_plot

    finish_plot(fig, ax, "tokens identical to greedy (%)",
                f"hf-mars demo --base {report['command'].split()[3]}, B = {report['block_size']}", path)
