"""`hf-mars demo`: MARS end to end on a laptop CPU, offline, in minutes.

What it does, from the tiny AR-SFT model shipped in ``hf_mars/demo/assets/tiny-base``
(a character-level Qwen2 trained by plain TRL SFT on the bundled tasks,
see ``examples/build_tiny_base.py``):

1. MARS fine-tune with `MARSTrainer` (block size 4 by default) on fresh bundled examples, half of them
   cut at a random point of the answer (see `completion_rows`: it teaches the masks the layout they
   meet when decoding);
2. a compute-matched AR-SFT baseline: plain `SFTTrainer` from the same base on the same examples
   (uncut), same steps, batch and LR;
3. evaluation on the held-out split (``hf_mars.bench.tasks``): exact-match accuracy per task and overall and
   tokens per forward, for every threshold in the sweep and for the lossless verify mode;
4. wall-clock against plain `generate` (greedy, KV cache) on the same checkpoint, batch sizes 1/4/16,
   sliding and block cache, timed in the same run, interleaved;
5. writes ``report.json``, ``per_task.md``, ``pareto.png`` and a Hub-ready checkpoint (``mars-checkpoint/``).

``--quick`` is the same pipeline at toy size (CI, tests): its figures mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

# the steps of the pipeline, one module each; their names stay importable from here (examples/, benchmarks/)
from hf_mars.demo.evaluate import (  # noqa: F401
    MAX_NEW_TOKENS,
    _encode_batches,
    _mars_kwargs,
    _per_task_tpf,
    _prompts,
    evaluate_ar,
    generate_texts,
)
from hf_mars.demo.outputs import pareto_plot, per_task_table, speed_table
from hf_mars.demo.stats import (
    QUALITY_MARGIN,
    paired_comparison,
    pick_quality_threshold,
    wilson_interval,
)
from hf_mars.bench.timing import time_interleaved
from hf_mars.demo.training import completion_rows, train_ar_baseline, train_mars  # noqa: F401

THRESHOLDS = (1.0, 0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.5)
BATCH_SIZES = (1, 4, 16)
CACHES = ("sliding", "block")


def base_model_path() -> Path:
    """The shipped AR-SFT base (weights, config, tokenizer)."""
    return Path(__file__).resolve().parent / "assets" / "tiny-base"


def _base_folder(name) -> Path:
    """``--base`` as a checkpoint folder: the shipped tiny base, a named real base (``hf_mars.pretrained``,
    converted on first use) or a folder."""
    from hf_mars.pretrained import resolve_base

    base = resolve_base(name) if name else base_model_path()
    if not (base / "config.json").is_file():
        raise ValueError(f"No base checkpoint at {base}. Rebuild the shipped one with "
                         "`python examples/build_tiny_base.py`, or pass --base DIR (or --base gemma3-270m).")
    return base


def has_chat_template(folder: Path) -> bool:
    """Whether the checkpoint's tokenizer carries a chat template (the tiny pipeline needs one; a pretrained base
    without one gets the real-text pipeline)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))


def _log(msg: str) -> None:
    print(f"[hf-mars demo] {msg}", flush=True)


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
    parser.add_argument("--learning-rate", type=float, default=None, help="default 1e-3 for the tiny base, 5e-5 for a "
                        "pretrained one")
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
    parser.add_argument("--base", default=None, help="base checkpoint folder, or 'gemma3-270m' (Gemma 3 270M from "
                        "the gemma3 extra, converted once and cached). Default: the shipped tiny AR-SFT base. A base "
                        "without a chat template runs the real-text pipeline (hf_mars/demo/real.py)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="pretrained base only: tokens per "
                        "distilled continuation and per evaluated answer (default 48; 16 with --quick)")
    parser.add_argument("--train-embeddings", action="store_true", help="pretrained base only: also train the "
                        "(tied) embedding matrix, frozen by default (on Gemma 3 270M it is 168M of 268M parameters)")
    parser.add_argument("--lora-rank", type=int, default=0, help="pretrained base only: train LoRA adapters of this "
                        "rank on every linear layer (through peft; merged into the checkpoint after training) instead "
                        "of a full fine-tune, for MARS and the SFT baseline alike. 0 (default): full fine-tune")
    parser.add_argument("--dataset", default=None, help="the real-model pipeline on your data instead of the "
                        "self-distilled default: a data file (json, jsonl, csv, parquet, txt), a save_to_disk folder "
                        "or a Hub dataset id, in any of TRL's formats (text; prompt + completion; messages); its "
                        "'test' split or last --num-eval rows are held out")
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
    if args.learning_rate is None:
        args.learning_rate = 1e-3
    if getattr(args, "lora_rank", 0) < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {args.lora_rank}.")
    if getattr(args, "lora_rank", 0) and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-rank trains LoRA adapters with peft, which is not installed: pip install peft.")
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
    base = _base_folder(args.base)
    if getattr(args, "dataset", None) or not has_chat_template(base):  # real text (hf_mars/demo/real.py)
        return _run_real(args, base)
    if getattr(args, "lora_rank", 0):
        raise ValueError("--lora-rank applies to a pretrained base (the real-text pipeline); the tiny base trains "
                         "in full.")
    _resolve(args)
    t_start = time.time()
    import shutil
    import tempfile

    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from hf_mars.bench.tasks import generate_examples
    from hf_mars.generation import enable_mars

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = _prepare_output_dir(Path(args.output_dir))
    work = Path(tempfile.mkdtemp(prefix="_work-", dir=out))  # this run's own scratch folder, removed at the end
    set_seed(args.seed)

    _log(f"base: {base}; {args.steps} fine-tuning steps x batch {args.batch_size} for MARS (B={args.block_size}) "
         f"and for the AR-SFT baseline; {args.num_eval} held-out examples; torch threads: {torch.get_num_threads()}")
    train_ds = generate_examples(args.steps * args.batch_size, seed=args.seed + 1, split="train")
    eval_examples = generate_examples(args.num_eval, seed=args.seed, split="eval")

    _log("1/5 MARS fine-tune (MARSTrainer)")
    mars_model, tokenizer, mars_train_s = train_mars(base, train_ds, args, work)
    _log(f"    done in {mars_train_s:.0f}s")
    _log("2/5 compute-matched AR-SFT baseline (SFTTrainer, same steps, batch and learning rate)")
    ar_model, ar_tokenizer, ar_train_s = train_ar_baseline(base, train_ds, args, work)
    _log(f"    done in {ar_train_s:.0f}s")

    enable_mars(mars_model)
    _log("3/5 accuracy on the held-out split")
    scores = _evaluate(mars_model, tokenizer, ar_model, ar_tokenizer, eval_examples, args)
    _log("4/5 wall-clock against plain generate (greedy, KV cache) on the same checkpoint")
    timings = _time_decoding(mars_model, tokenizer, eval_examples, scores["tau_star"], args)
    report = _build_report(args, base, scores, timings, mars_train_s, ar_train_s)

    _log("5/5 writing outputs")
    ckpt = _write_outputs(report, out, mars_model, tokenizer, eval_examples[0]["messages"][0]["content"])
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["outputs"] = {"plot": str(out / "pareto.png"), "table": str(out / "per_task.md"),
                         "checkpoint": str(ckpt)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    _print_summary(report, out, ckpt)
    return 0


def _print_summary(report: dict, out: Path, ckpt: Path) -> None:
    """The two tables, the chosen threshold and what was written where."""
    print()
    print(per_task_table(report))
    print()
    print(speed_table(report))
    print()
    _log(f"chosen quality-keeping threshold: {report['chosen_threshold']:g} (within {100 * QUALITY_MARGIN:.1f} "
         "points of τ=1.0)")
    _log(f"wrote {out / 'report.json'}, {out / 'per_task.md'}, {out / 'pareto.png'} and {ckpt}/ "
         f"in {report['wall_seconds']:.0f}s")


def _run_real(args, base: Path) -> int:
    """`hf_mars.demo.real`'s pipeline, with this command's checks, threads and quiet logging."""
    import torch
    from transformers.utils import logging as hf_logging

    from hf_mars.demo import real

    real.resolve_sizes(args)
    _resolve(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    return real.run(args, base, _prepare_output_dir(Path(args.output_dir)))


def _evaluate(mars_model, tokenizer, ar_model, ar_tokenizer, eval_examples, args) -> dict:
    """Step 3: accuracy of the AR-SFT baseline, of the MARS checkpoint under plain generate, at every τ of the sweep
    and in verify mode; per-question hits for the intervals and the paired test; the quality-keeping τ."""
    from tqdm.auto import tqdm

    from hf_mars.bench.tasks import score

    n_eval, eval_bs, B = len(eval_examples), 64, args.block_size
    with tqdm(total=n_eval * (2 + len(THRESHOLDS) + 1), desc="evaluating", unit="ex") as bar:
        ar_res = evaluate_ar(ar_model, ar_tokenizer, eval_examples, eval_bs, progress=bar)
        greedy_res = evaluate_ar(mars_model, tokenizer, eval_examples, eval_bs, progress=bar)  # plain generate
        sweep = {}
        for tau in THRESHOLDS:
            bar.set_postfix_str(f"tau={tau:g}")
            sweep[tau] = _per_task_tpf(eval_examples, mars_model, tokenizer, eval_bs, bar,
                                       **_mars_kwargs(tau, B, plain_steps=False))  # (the timing runs the default)
        bar.set_postfix_str("verify")
        verify_res = _per_task_tpf(eval_examples, mars_model, tokenizer, eval_bs, bar,
                                   **_mars_kwargs(args.verify_threshold, B, verify=True, draft_tree="tree"))

    def hits(predictions):  # per-question correctness, for intervals and the paired test
        return [score(ex["task"], p, ex["messages"][1]["content"]) for ex, p in zip(eval_examples, predictions)]

    mars_rows = [{"threshold": tau, "accuracy": sweep[tau]["accuracy"],
                  "accuracy_ci95": wilson_interval(sum(hits(sweep[tau]["predictions"])), n_eval),
                  "tokens_per_forward": sweep[tau]["tokens_per_forward"]} for tau in THRESHOLDS]
    return {"ar": ar_res, "greedy": greedy_res, "sweep": sweep, "verify": verify_res, "mars_rows": mars_rows,
            "ar_hits": hits(ar_res["predictions"]), "tau1_hits": hits(sweep[1.0]["predictions"]),
            "verify_hits": hits(verify_res["predictions"]), "n": n_eval,
            "tau_star": pick_quality_threshold(mars_rows)["threshold"]}


def _time_decoding(mars_model, tokenizer, eval_examples, tau_star, args) -> dict:
    """Step 4: ``{batch size: {setting: seconds}}`` for plain generate and MARS on the same checkpoint, timed
    interleaved (`time_interleaved`): every τ and verify at batch 1, τ* (both caches) and verify at larger batches."""
    from tqdm.auto import tqdm

    B, repeats = args.block_size, args.timing_repeats
    prompts = _prompts(tokenizer, eval_examples[:args.timing_prompts])
    timings = {}
    n_runs = (1 + len(THRESHOLDS) + 1) + 2 * (2 + len(CACHES)) + 1
    with tqdm(total=n_runs * repeats, desc="timing", unit="run") as bar:
        batches = _encode_batches(tokenizer, prompts, 1)
        runs = {"ar": {}}
        runs.update({f"tau={tau:g}": _mars_kwargs(tau, B) for tau in THRESHOLDS})
        runs["verify"] = _mars_kwargs(args.verify_threshold, B, verify=True)
        timings[1] = time_interleaved(mars_model, batches, runs, repeats, bar)
        for bs in BATCH_SIZES[1:]:
            batches = _encode_batches(tokenizer, prompts, bs)
            runs = {"ar": {}}
            for cache in CACHES:
                runs[f"tau*:{cache}"] = _mars_kwargs(tau_star, B, cache=cache)
            runs["verify:sliding"] = _mars_kwargs(args.verify_threshold, B, verify=True)  # verify keeps its own sliding cache
            timings[bs] = time_interleaved(mars_model, batches, runs, repeats, bar)
        # batch 1, block cache (the sliding figures at batch 1 come from the sweep above)
        batches = _encode_batches(tokenizer, prompts, 1)
        runs = {"tau*:block": _mars_kwargs(tau_star, B, cache="block")}
        timings[1].update(time_interleaved(mars_model, batches, runs, repeats, bar))
        timings[1]["tau*:sliding"] = timings[1][f"tau={tau_star:g}"]
        timings[1]["verify:sliding"] = timings[1]["verify"]
    return timings


def _build_report(args, base, scores, timings, mars_train_s, ar_train_s) -> dict:
    """The ``report.json`` dict (its keys are a contract: README, tests, `BenchmarkReport`, the model card)."""
    import torch

    from hf_mars.bench.tasks import TASKS

    n_eval, tau_star = scores["n"], scores["tau_star"]
    ar_res, sweep, verify_res = scores["ar"], scores["sweep"], scores["verify"]
    mars_rows = scores["mars_rows"]
    for row in mars_rows:
        row["speedup_vs_ar"] = timings[1]["ar"] / timings[1][f"tau={row['threshold']:g}"]
    batch_speedup = []
    for bs in BATCH_SIZES:
        for cache in CACHES:
            batch_speedup.append({"batch_size": bs, "threshold": tau_star, "cache": cache, "mode": "threshold",
                                  "speedup_vs_ar": timings[bs]["ar"] / timings[bs][f"tau*:{cache}"]})
        batch_speedup.append({"batch_size": bs, "threshold": args.verify_threshold, "cache": "sliding", "mode": "verify",
                              "speedup_vs_ar": timings[bs]["ar"] / timings[bs]["verify:sliding"]})
    per_task = {task: {"ar_sft": ar_res["per_task"][task],
                       "mars": {f"{tau:g}": sweep[tau]["per_task"][task] for tau in THRESHOLDS},
                       "verify": verify_res["per_task"][task]}
                for task in TASKS if task in ar_res["per_task"]}
    return {
        "block_size": args.block_size,
        "quick": bool(args.quick),
        "ar_sft": {"accuracy": ar_res["accuracy"], "accuracy_ci95": wilson_interval(sum(scores["ar_hits"]), n_eval),
                   "tokens_per_forward": 1.0, "train_seconds": round(ar_train_s, 1)},
        "paired_tau1_vs_ar_sft": paired_comparison(scores["tau1_hits"], scores["ar_hits"]),
        "mars_greedy": {"accuracy": scores["greedy"]["accuracy"],
                        "identical_to_tau_1": scores["greedy"]["predictions"] == sweep[1.0]["predictions"]},
        "mars": mars_rows,
        "verify": {"accuracy": verify_res["accuracy"],
                   "accuracy_ci95": wilson_interval(sum(scores["verify_hits"]), n_eval),
                   "tokens_per_forward": verify_res["tokens_per_forward"],
                   "speedup_vs_ar": timings[1]["ar"] / timings[1]["verify"],
                   "threshold": args.verify_threshold,  # verify: tau only truncates the drafts
                   "identical_to_greedy": verify_res["predictions"] == scores["greedy"]["predictions"]},
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
        "task": "hf_mars.bench.tasks held-out split (" + ", ".join(per_task) + ")",
        "device": f"CPU, {torch.get_num_threads()} threads",
        "command": "hf-mars demo" + (" --quick" if args.quick else ""),
        "description": "Tiny character-level Qwen2 fine-tuned with MARS by `hf-mars demo` on the bundled tasks.",
    }


def _write_outputs(report, out: Path, mars_model, tokenizer, example_prompt: str) -> Path:
    """Step 5: ``per_task.md``, ``pareto.png`` and the Hub-ready ``mars-checkpoint/`` (its card shows the report)."""
    import shutil

    from hf_mars.hub import save_for_hub

    (out / "per_task.md").write_text("## Per-task accuracy and tokens per forward\n\n" + per_task_table(report) +
                                     "\n\n## Speed\n\n" + speed_table(report) + "\n", encoding="utf-8")
    pareto_plot(report, out / "pareto.png")
    ckpt = out / "mars-checkpoint"
    if ckpt.exists():  # a previous demo run's checkpoint: written fresh, so no stale file is ever pushed
        shutil.rmtree(ckpt)
    mars_model.generation_config.do_sample = False
    save_for_hub(mars_model, tokenizer, ckpt, benchmark=report, mars_threshold=report["chosen_threshold"],
                 mars_block_size=report["block_size"], model_name="tiny-mars-demo",
                 description=report["description"], example_prompt=example_prompt)
    return ckpt
