"""`hf-mars demo`: MARS end to end on a laptop CPU, offline, in minutes.

What it does, from the tiny AR-SFT model shipped in ``hf_mars/demo/assets/tiny-base``
(a character-level Qwen2 trained by plain TRL SFT on the bundled tasks,
see ``examples/build_tiny_base.py``):

1. MARS fine-tune with `MARSTrainer` (block size 4 by default) on fresh bundled examples, half of them
   cut at a random point of the answer (see `completion_rows`: it teaches the masks the layout they
   meet when decoding);
2. a compute-matched AR-SFT baseline: plain `SFTTrainer` from the same base on the same examples
   (uncut), same steps, batch and LR;
3. evaluation on the held-out split (``hf_mars.demo.data``): exact-match accuracy per task and overall and
   tokens per forward, for every threshold in the sweep and for the lossless verify mode;
4. wall-clock against plain `generate` (greedy, KV cache) on the same checkpoint, batch sizes 1/4/16,
   sliding and block cache, timed in the same run, interleaved;
5. writes ``report.json``, ``per_task.md``, ``pareto.png`` and a Hub-ready checkpoint (``mars-checkpoint/``).

``--quick`` is the same pipeline at toy size (CI, tests): its figures mean nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

THRESHOLDS = (1.0, 0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.5)
BATCH_SIZES = (1, 4, 16)
CACHES = ("sliding", "block")
from hf_mars.demo.bench import _generate_batch, time_interleaved  # noqa: E402  (the one timing harness)

QUALITY_MARGIN = 0.015  # "quality-keeping": within 1.5 accuracy points of tau = 1.0 (our quality-keeping criterion)
MAX_NEW_TOKENS = 64  # the longest bundled answer is ~50 characters


def base_model_path() -> Path:
    """The shipped AR-SFT base (weights, config, tokenizer)."""
    return Path(__file__).resolve().parent / "assets" / "tiny-base"


# ----------------------------------------------------------------------------- helpers

def _log(msg: str) -> None:
    print(f"[hf-mars demo] {msg}", flush=True)


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
    from hf_mars.demo.data import accuracy

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


def _mars_kwargs(threshold, block_size, cache="sliding", verify=False):
    return {"mars": True, "mars_threshold": float(threshold), "mars_block_size": int(block_size),
            "mars_cache": cache, "mars_verify": bool(verify)}


# ----------------------------------------------------------------------------- training

def _train_config(cls, output_dir, args, **extra):
    from hf_mars.trainer import checkpointing_argument

    return cls(
        output_dir=str(output_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20),
        weight_decay=0.0,
        max_length=256,
        bf16=False,  # fp32: bf16 autocast is ~8x slower on CPU
        dataloader_pin_memory=False,  # CPU only: pinning does nothing (and torch warns so)
        **checkpointing_argument(cls, False),  # recomputing activations is pure overhead for a ~1M-parameter model
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
        **extra,
    )


def completion_rows(examples, tokenizer, cut_fraction=0.0, seed=0):
    """Chat examples as text prompt/completion rows; a share of them cut at a random point of the answer.

    Why the cut: decoding feeds masks right after *any* committed length ``c``, so inside the current
    block the masks follow real answer tokens. A full-answer MARS example never shows that layout
    (every answer token of a block is masked), and a small model then keys on the block position
    instead of counting masks: confidently wrong drafts in threshold mode. A cut example moves the
    first ``r`` answer characters into the prompt, so the noisy stream holds real tokens, then
    masks, at every offset inside a block — exactly the inference layout. The loss covers the
    completion only; ``cut_fraction=0`` gives the plain SFT rows (the AR baseline's data).
    """
    import random

    rng = random.Random(f"hf-mars-cut|{seed}")
    rows = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template([ex["messages"][0]], tokenize=False, add_generation_prompt=True)
        answer = ex["messages"][1]["content"]
        r = rng.randint(1, len(answer) - 1) if len(answer) > 1 and rng.random() < cut_fraction else 0
        rows.append({"prompt": prompt + answer[:r], "completion": answer[r:] + tokenizer.eos_token})
    return rows


def _load_base(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return model, tokenizer


def train_mars(base_path, train_examples, args, work_dir):
    from datasets import Dataset

    from hf_mars import MARSConfig, MARSTrainer

    model, tokenizer = _load_base(base_path)
    train_ds = Dataset.from_list(completion_rows(train_examples, tokenizer, args.cut_fraction, args.seed))
    config = _train_config(MARSConfig, work_dir / "mars-trainer", args, block_size=args.block_size, ar_weight=1.0)
    trainer = MARSTrainer(model=model, args=config, train_dataset=train_ds, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    return trainer.model.eval(), tokenizer, time.time() - t0


def train_ar_baseline(base_path, train_examples, args, work_dir):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _load_base(base_path)
    train_ds = Dataset.from_list(completion_rows(train_examples, tokenizer, 0.0, args.seed))
    config = _train_config(SFTConfig, work_dir / "ar-trainer", args)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    return trainer.model.eval(), tokenizer, time.time() - t0


# ----------------------------------------------------------------------------- outputs

def wilson_interval(hits: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a proportion (well-behaved near 0 and 1, unlike the normal one)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def paired_comparison(a: list[bool], b: list[bool]) -> dict:
    """Paired comparison of two scorings of the same questions: exact McNemar test and a 95% interval of a - b.

    Only the discordant questions (right in one, wrong in the other) carry information; the interval's half
    width says how small a difference this many questions can resolve.
    """
    n = len(a)
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    m = only_a + only_b
    k = min(only_a, only_b)
    p_value = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m)
    diff = (only_a - only_b) / max(n, 1)
    se = math.sqrt(max(m - (only_a - only_b) ** 2 / max(n, 1), 0.0)) / max(n, 1)
    half = max(1.96 * se, 1.0 / max(n, 1))  # never claim more resolution than one question
    verdict = (f"differs (p = {p_value:.3g})" if p_value < 0.05 else
               f"no significant difference (p = {p_value:.2g}); with {n} paired questions the 95% interval of the "
               f"difference is ±{100 * half:.1f} points, so smaller differences cannot be told from noise")
    return {"n": n, "only_first_right": only_a, "only_second_right": only_b, "difference": round(diff, 4),
            "difference_ci95": [round(diff - half, 4), round(diff + half, 4)], "p_value_mcnemar_exact": p_value,
            "verdict": verdict}


def _ci(acc: float, ci) -> str:
    text = f"{100 * acc:.1f}%"
    return text if not ci else text + f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"


def pick_quality_threshold(mars_rows, margin=QUALITY_MARGIN):
    """The sweep entry with the most tokens per forward whose accuracy is within ``margin`` of tau = 1.0."""
    one = next(r for r in mars_rows if r["threshold"] >= 1.0)
    ok = [r for r in mars_rows if r["accuracy"] >= one["accuracy"] - margin - 1e-9]
    return max(ok, key=lambda r: (r["tokens_per_forward"], r["threshold"]))


def per_task_table(report) -> str:
    """Markdown table: rows = tasks (+ overall), columns = AR-SFT, MARS at tau = 1, the chosen tau, verify."""
    chosen = report["chosen_threshold"]
    cols = [("AR-SFT (compute-matched)", "ar_sft", None), ("MARS τ=1.0", "mars", 1.0)]
    if chosen < 1.0:
        cols.append((f"MARS τ={chosen:g}", "mars", chosen))
    if 0.9 not in (c[2] for c in cols):
        cols.append(("MARS τ=0.9", "mars", 0.9))
    cols.append(("MARS verify", "verify", None))
    header = "| task | " + " | ".join(c[0] for c in cols) + " |"
    sep = "|---|" + "---|" * len(cols)
    lines = [header, sep]
    tasks = list(report["per_task"]) + ["overall"]
    for task in tasks:
        cells = []
        for _, kind, tau in cols:
            if task == "overall":
                if kind == "ar_sft":
                    acc, tpf = report["ar_sft"]["accuracy"], None
                elif kind == "verify":
                    acc, tpf = report["verify"]["accuracy"], report["verify"]["tokens_per_forward"]
                else:
                    row = next(r for r in report["mars"] if r["threshold"] == tau)
                    acc, tpf = row["accuracy"], row["tokens_per_forward"]
            else:
                entry = report["per_task"][task]
                if kind == "ar_sft":
                    acc, tpf = entry["ar_sft"], None
                elif kind == "verify":
                    acc, tpf = entry["verify"]["accuracy"], entry["verify"]["tokens_per_forward"]
                else:
                    e = entry["mars"][f"{tau:g}"]
                    acc, tpf = e["accuracy"], e["tokens_per_forward"]
            cells.append(f"{100 * acc:.1f}%" + ("" if tpf is None else f" · {tpf:.2f} tok/fwd"))
        name = f"**{task}**" if task == "overall" else task
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table(report) -> str:
    lines = ["| mode | τ | tokens/forward | accuracy (95% interval) | batch-1 speed-up vs plain generate |",
             "|---|---|---|---|---|"]
    a = report["ar_sft"]
    lines.append(f"| AR-SFT baseline (plain generate) | – | 1.00 | {_ci(a['accuracy'], a.get('accuracy_ci95'))} | – |")
    for r in report["mars"]:
        lines.append(f"| MARS | {r['threshold']:g} | {r['tokens_per_forward']:.2f} | "
                     f"{_ci(r['accuracy'], r.get('accuracy_ci95'))} | {r['speedup_vs_ar']:.2f}× |")
    v = report["verify"]
    lines.append(f"| MARS verify (lossless) | – | {v['tokens_per_forward']:.2f} | "
                 f"{_ci(v['accuracy'], v.get('accuracy_ci95'))} | {v['speedup_vs_ar']:.2f}× |")
    paired = report.get("paired_tau1_vs_ar_sft")
    if paired:
        lines += ["", f"MARS τ = 1 against AR-SFT on the same {paired['n']} questions: "
                      f"{100 * paired['difference']:+.1f} points ({paired['only_first_right']} right only with MARS, "
                      f"{paired['only_second_right']} only with AR-SFT); {paired['verdict']}."]
    lines += ["", "| batch size | mode | cache | speed-up vs plain generate |", "|---|---|---|---|"]
    for r in report["batch_speedup"]:
        mode = "verify" if r.get("mode") == "verify" else f"τ={r['threshold']:g}"
        lines.append(f"| {r['batch_size']} | {mode} | {r['cache']} | {r['speedup_vs_ar']:.2f}× |")
    return "\n".join(lines)


def pareto_plot(report, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["mars"], key=lambda r: r["tokens_per_forward"])
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    xs = [r["tokens_per_forward"] for r in rows]
    ys = [100 * r["accuracy"] for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue", label="MARS, threshold τ")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=8)
    v = report["verify"]
    ax.plot([v["tokens_per_forward"]], [100 * v["accuracy"]], "*", color="tab:green", markersize=14,
            label="MARS verify (lossless)")
    ax.axhline(100 * report["ar_sft"]["accuracy"], color="tab:red", linestyle="--",
               label="AR-SFT baseline (compute-matched)")
    ax.set_xlabel("tokens per forward pass")
    ax.set_ylabel("exact-match accuracy, held-out split (%)")
    ax.set_title(f"hf-mars demo: tiny Qwen2, B = {report['block_size']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


# (full run, --quick) for the run-size options; --help and _resolve both read them
_SIZE_DEFAULTS = {"steps": (600, 6), "batch_size": (32, 8), "num_eval": (320, 16), "timing_prompts": (48, 8),
                  "timing_repeats": (2, 1)}


def _size_help(name: str) -> str:
    full, quick = _SIZE_DEFAULTS[name]
    return f"default {full}; {quick} with --quick"

def add_arguments(parser) -> None:
    parser.add_argument("--output-dir", default="mars-demo", help="where report.json, the plot, the table and the "
                        "checkpoint go (default: ./mars-demo)")
    parser.add_argument("--quick", action="store_true", help="toy-sized run for CI and tests (~1 minute; its figures "
                        "mean nothing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=4, help="MARS block size B (default 4, as in the paper)")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps for MARS and for the AR-SFT "
                        f"baseline each ({_size_help('steps')})")
    parser.add_argument("--batch-size", type=int, default=None, help=f"training batch size ({_size_help('batch_size')})")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--num-eval", type=int, default=None, help=f"held-out examples ({_size_help('num_eval')})")
    parser.add_argument("--timing-prompts", type=int, default=None, help="prompts in the wall-clock runs "
                        f"({_size_help('timing_prompts')})")
    parser.add_argument("--timing-repeats", type=int, default=None, help="repeats per timing (min is kept; "
                        f"{_size_help('timing_repeats')})")
    parser.add_argument("--cut-fraction", type=float, default=0.5, help="share of MARS training examples cut at a "
                        "random point of the answer (the prefix joins the prompt), so the masks learn the layout "
                        "they meet when decoding; 0 disables")
    parser.add_argument("--verify-threshold", type=float, default=None, help="verify mode proposes a mask prediction "
                        "as a draft when its probability is >= this (accuracy is unaffected: every draft is checked)")
    parser.add_argument("--base", default=None, help="AR-SFT base checkpoint (default: the shipped tiny base)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _resolve(args) -> None:
    quick = args.quick
    for name, (full, small) in _SIZE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    for name in ("steps", "batch_size", "num_eval", "timing_prompts", "timing_repeats", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0.0 <= args.cut_fraction <= 1.0:
        raise ValueError(f"--cut-fraction must be in [0, 1], got {args.cut_fraction}.")
    if args.verify_threshold is None:
        from hf_mars.generation import DEFAULT_VERIFY_THRESHOLD

        args.verify_threshold = DEFAULT_VERIFY_THRESHOLD
    if not 0.0 <= args.verify_threshold <= 1.0:
        raise ValueError(f"--verify-threshold must be in [0, 1], got {args.verify_threshold}.")
    if args.timing_prompts > args.num_eval:
        args.timing_prompts = args.num_eval


DEMO_MARKER = ".hf-mars-demo"


def _prepare_output_dir(out: Path) -> Path:
    """Create the output folder, or reuse one that a previous `hf-mars demo` made; refuse anything else."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {out} exists and is not a folder.")
    if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARKER).is_file():
        raise ValueError(f"--output-dir {out} is not empty and was not made by `hf-mars demo`; "
                         "pass a new or empty folder (the demo never overwrites files it did not write).")
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("written by hf-mars demo; its outputs here are replaced by the next run\n")
    return out


def _require_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("hf-mars demo draws pareto.png with matplotlib, which is not installed: "
                         "pip install 'hf-mars[demo]' (or pip install matplotlib).")


def run(args) -> int:
    _require_matplotlib()  # before minutes of training, not after
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _resolve(args)
    t_start = time.time()
    import torch
    from tqdm.auto import tqdm
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from hf_mars.demo.data import TASKS, generate_examples
    from hf_mars.generation import enable_mars

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = Path(args.base) if args.base else base_model_path()
    if not (base / "config.json").is_file():
        raise ValueError(f"No AR-SFT base checkpoint at {base}. Rebuild the shipped one with "
                         "`python examples/build_tiny_base.py`, or pass --base DIR.")
    out = _prepare_output_dir(Path(args.output_dir))
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="_work-", dir=out))  # this run's own scratch folder, removed at the end
    set_seed(args.seed)
    B = args.block_size

    _log(f"base: {base}; {args.steps} fine-tuning steps x batch {args.batch_size} for MARS (B={B}) and for the "
         f"AR-SFT baseline; {args.num_eval} held-out examples; torch threads: {torch.get_num_threads()}")
    train_ds = generate_examples(args.steps * args.batch_size, seed=args.seed + 1, split="train")
    eval_examples = generate_examples(args.num_eval, seed=args.seed, split="eval")

    _log("1/5 MARS fine-tune (MARSTrainer)")
    mars_model, tokenizer, mars_train_s = train_mars(base, train_ds, args, work)
    _log(f"    done in {mars_train_s:.0f}s")
    _log("2/5 compute-matched AR-SFT baseline (SFTTrainer, same steps, batch and learning rate)")
    ar_model, ar_tokenizer, ar_train_s = train_ar_baseline(base, train_ds, args, work)
    _log(f"    done in {ar_train_s:.0f}s")

    enable_mars(mars_model)
    n_eval = len(eval_examples)
    eval_bs = 64
    _log("3/5 accuracy on the held-out split")
    with tqdm(total=n_eval * (2 + len(THRESHOLDS) + 1), desc="evaluating", unit="ex") as bar:
        ar_res = evaluate_ar(ar_model, ar_tokenizer, eval_examples, eval_bs, progress=bar)
        greedy_res = evaluate_ar(mars_model, tokenizer, eval_examples, eval_bs, progress=bar)  # plain generate
        sweep = {}
        for tau in THRESHOLDS:
            bar.set_postfix_str(f"tau={tau:g}")
            sweep[tau] = _per_task_tpf(eval_examples, mars_model, tokenizer, eval_bs, bar, **_mars_kwargs(tau, B))
        bar.set_postfix_str("verify")
        verify_res = _per_task_tpf(eval_examples, mars_model, tokenizer, eval_bs, bar,
                                   **_mars_kwargs(args.verify_threshold, B, verify=True))

    from hf_mars.demo.data import score

    def hits(predictions):  # per-question correctness, for intervals and the paired test
        return [score(ex["task"], p, ex["messages"][1]["content"]) for ex, p in zip(eval_examples, predictions)]

    ar_hits, tau1_hits = hits(ar_res["predictions"]), hits(sweep[1.0]["predictions"])
    mars_rows = [{"threshold": tau, "accuracy": sweep[tau]["accuracy"],
                  "accuracy_ci95": wilson_interval(sum(hits(sweep[tau]["predictions"])), n_eval),
                  "tokens_per_forward": sweep[tau]["tokens_per_forward"]} for tau in THRESHOLDS]
    chosen = pick_quality_threshold(mars_rows)
    tau_star = chosen["threshold"]

    _log("4/5 wall-clock against plain generate (greedy, KV cache) on the same checkpoint")
    timing_prompts = _prompts(tokenizer, eval_examples[:args.timing_prompts])
    timings = {}
    n_runs = (1 + len(THRESHOLDS) + 1) + 2 * (2 + len(CACHES)) + 1
    with tqdm(total=n_runs * args.timing_repeats, desc="timing", unit="run") as bar:
        batches = _encode_batches(tokenizer, timing_prompts, 1)
        runs = {"ar": {}}
        runs.update({f"tau={tau:g}": _mars_kwargs(tau, B) for tau in THRESHOLDS})
        runs["verify"] = _mars_kwargs(args.verify_threshold, B, verify=True)
        timings[1] = time_interleaved(mars_model, batches, runs, args.timing_repeats, bar)
        for bs in BATCH_SIZES[1:]:
            batches = _encode_batches(tokenizer, timing_prompts, bs)
            runs = {"ar": {}}
            for cache in CACHES:
                runs[f"tau*:{cache}"] = _mars_kwargs(tau_star, B, cache=cache)
            runs["verify:sliding"] = _mars_kwargs(args.verify_threshold, B, verify=True)  # verify keeps its own sliding cache
            timings[bs] = time_interleaved(mars_model, batches, runs, args.timing_repeats, bar)
        # batch 1, block cache (the sliding figures at batch 1 come from the sweep above)
        batches = _encode_batches(tokenizer, timing_prompts, 1)
        runs = {"tau*:block": _mars_kwargs(tau_star, B, cache="block")}
        timings[1].update(time_interleaved(mars_model, batches, runs, args.timing_repeats, bar))
        timings[1]["tau*:sliding"] = timings[1][f"tau={tau_star:g}"]
        timings[1]["verify:sliding"] = timings[1]["verify"]

    for row in mars_rows:
        row["speedup_vs_ar"] = timings[1]["ar"] / timings[1][f"tau={row['threshold']:g}"]
    batch_speedup = []
    for bs in BATCH_SIZES:
        for cache in CACHES:
            batch_speedup.append({"batch_size": bs, "threshold": tau_star, "cache": cache, "mode": "threshold",
                                  "speedup_vs_ar": timings[bs]["ar"] / timings[bs][f"tau*:{cache}"]})
        batch_speedup.append({"batch_size": bs, "threshold": args.verify_threshold, "cache": "sliding", "mode": "verify",
                              "speedup_vs_ar": timings[bs]["ar"] / timings[bs]["verify:sliding"]})

    per_task = {}
    for task in TASKS:
        if task not in ar_res["per_task"]:
            continue
        per_task[task] = {
            "ar_sft": ar_res["per_task"][task],
            "mars": {f"{tau:g}": sweep[tau]["per_task"][task] for tau in THRESHOLDS},
            "verify": verify_res["per_task"][task],
        }
    report = {
        "block_size": B,
        "quick": bool(args.quick),
        "ar_sft": {"accuracy": ar_res["accuracy"], "accuracy_ci95": wilson_interval(sum(ar_hits), n_eval),
                   "tokens_per_forward": 1.0, "train_seconds": round(ar_train_s, 1)},
        "paired_tau1_vs_ar_sft": paired_comparison(tau1_hits, ar_hits),
        "mars_greedy": {"accuracy": greedy_res["accuracy"],
                        "identical_to_tau_1": greedy_res["predictions"] == sweep[1.0]["predictions"]},
        "mars": mars_rows,
        "verify": {"accuracy": verify_res["accuracy"],
                   "accuracy_ci95": wilson_interval(sum(hits(verify_res["predictions"])), n_eval),
                   "tokens_per_forward": verify_res["tokens_per_forward"],
                   "speedup_vs_ar": timings[1]["ar"] / timings[1]["verify"],
                   "threshold": args.verify_threshold,  # verify: tau only truncates the drafts
                   "identical_to_greedy": verify_res["predictions"] == greedy_res["predictions"]},
        "chosen_threshold": tau_star,
        "batch_speedup": batch_speedup,
        "per_task": per_task,
        "timing": {"prompts": args.timing_prompts, "repeats": args.timing_repeats,
                   "seconds": {str(bs): {k: round(v, 4) for k, v in t.items()} for bs, t in timings.items()},
                   "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
                     "cut_fraction": args.cut_fraction,
                     "mars_seconds": round(mars_train_s, 1), "ar_sft_seconds": round(ar_train_s, 1),
                     "base": str(base)},
        "num_examples": n_eval,
        "max_new_tokens": MAX_NEW_TOKENS,
        "task": "hf_mars.demo.data held-out split (" + ", ".join(per_task) + ")",
        "device": f"CPU, {torch.get_num_threads()} threads",
        "command": "hf-mars demo" + (" --quick" if args.quick else ""),
        "description": "Tiny character-level Qwen2 fine-tuned with MARS by `hf-mars demo` on the bundled tasks.",
    }

    _log("5/5 writing outputs")
    table = per_task_table(report)
    speeds = speed_table(report)
    (out / "per_task.md").write_text("## Per-task accuracy and tokens per forward\n\n" + table +
                                     "\n\n## Speed\n\n" + speeds + "\n", encoding="utf-8")
    pareto_plot(report, out / "pareto.png")
    from hf_mars.hub import save_for_hub

    ckpt = out / "mars-checkpoint"
    if ckpt.exists():  # a previous demo run's checkpoint: written fresh, so no stale file is ever pushed
        import shutil

        shutil.rmtree(ckpt)
    mars_model.generation_config.do_sample = False
    example = eval_examples[0]["messages"][0]["content"]
    save_for_hub(mars_model, tokenizer, ckpt, benchmark=report, mars_threshold=tau_star, mars_block_size=B,
                 model_name="tiny-mars-demo", description=report["description"], example_prompt=example)
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["outputs"] = {"plot": str(out / "pareto.png"), "table": str(out / "per_task.md"),
                         "checkpoint": str(ckpt)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    import shutil

    shutil.rmtree(work, ignore_errors=True)

    print()
    print(table)
    print()
    print(speeds)
    print()
    _log(f"chosen quality-keeping threshold: {tau_star:g} (within {100 * QUALITY_MARGIN:.1f} points of τ=1.0)")
    _log(f"wrote {out / 'report.json'}, {out / 'per_task.md'}, {out / 'pareto.png'} and {ckpt}/ "
         f"in {report['wall_seconds']:.0f}s")
    return 0
