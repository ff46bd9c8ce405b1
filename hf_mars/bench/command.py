"""`hf-mars bench`'s flags and command: load a MARS checkpoint, run `benchmark_generation`, print the table and
write the JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hf_mars.bench.kernels import KERNELS, use_kernels
from hf_mars.bench.measure import benchmark_generation
from hf_mars.bench.prompts import load_prompts
from hf_mars.bench.specs import DEFAULT_ACCEPTANCE, PEERS
from hf_mars.bench.table import format_table
from hf_mars.generation import ACCEPTANCE_MODES, CACHE_MODES, DEFAULT_CACHE_BLOCK, DEFAULT_VERIFY_THRESHOLD

__all__ = ["add_arguments", "run"]


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, so a reader knows what a run measures without the flag; not for flags
    that are unset or off by default, or whose help already says what applies."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser):
    parser.formatter_class = _DefaultsHelpFormatter
    parser.add_argument("--model", required=True, help="Checkpoint folder (AutoModelForCausalLM + AutoTokenizer, with the MARS mask token).")
    parser.add_argument("--prompts", default=None,
                        help="Prompt file: .txt (one per line), .jsonl or .json (strings, {'prompt': ...}, {'messages': [...]}). "
                             "Default: the bundled tasks' held-out prompts (hf_mars.bench.tasks), with answers.")
    parser.add_argument("--num-prompts", type=int, default=16, help="Prompts per configuration and batch size (cycled if fewer).")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.95, 0.9], help="MARS tau values.")
    parser.add_argument("--caches", nargs="+", default=["sliding", "block"], choices=list(CACHE_MODES),
                        help="MARS cache modes: sliding window, the paper's block cache, or block_trained "
                             "(block chunks fed as [accepted | B masks]).")
    parser.add_argument("--acceptance", nargs="+", default=[DEFAULT_ACCEPTANCE], choices=list(ACCEPTANCE_MODES),
                        help="Threshold mode's acceptance rules (mars_acceptance), each timed at every tau and cache: "
                             "a candidate is kept while its probability, exp(-entropy) or top-1 minus top-2 "
                             "margin is >= tau (default: probability, generate's own).")
    parser.add_argument("--plain-steps", action="store_true",
                        help="Also time threshold mode at each tau < 1 (sliding cache) with mars_plain_steps=False "
                             "(the masks on every step) beside generate's default, where a step drops its masks "
                             "while the measured cost of the wide step does not pay (its layouts are reported).")
    parser.add_argument("--verify-thresholds", type=float, nargs="*", default=[DEFAULT_VERIFY_THRESHOLD],
                        help="tau values for lossless verify mode (none: skip verify).")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                        help="What a user would run instead, timed in the same run: prompt-lookup decoding (batch 1) and "
                             "plain generate with the static cache + torch.compile (warm-up compiles; none: skip).")
    parser.add_argument("--draft-trees", nargs="*", default=["auto", "chain"],
                        help="Verify mode's mars_draft_tree settings, each benchmarked ('auto', 'chain', 'tree', 'cost' or "
                             "a shape like '2,1,1,1'; 'cost' rows also report the layouts chosen per step); the "
                             "table reports each one's tokens per forward, its step cost against "
                             "a 1-token step and the speed-up limit from the widths it forwarded.")
    parser.add_argument("--short-answers", action="store_true",
                        help="Also time every prompt one call at a time (batch 1) at each --thresholds tau against "
                             "MARS without a KV cache (the method's own sampler: the whole sequence re-run every "
                             "step) and plain generate; with the static_compile peer, MARS on the static cache + "
                             "compile too. Reports ms per call and identical answers.")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="Batch sizes timed.")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt.")
    parser.add_argument("--block-size", type=int, default=None, help="MARS B (default: the checkpoint's).")
    parser.add_argument("--cache-block", type=int, default=DEFAULT_CACHE_BLOCK, help="Block cache chunk (mars_cache_block).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed repeats; the median is reported.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed warm-up generates per configuration, cycling through the "
                        "prompt batches (compiled configurations: this many passes over every batch).")
    parser.add_argument("--cost-repeats", type=int, default=30,
                        help="Timed calls per width in the step-cost table (the fastest is kept).")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice).")
    parser.add_argument("--device", default="cpu", help="Device the model runs on.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="The model's dtype.")
    parser.add_argument("--kernels", default="default", choices=list(KERNELS),
                        help="onednn: every configuration (plain generate and its peers too) runs with the model's "
                             "linear layers on oneDNN's kernels (torch.utils.mkldnn; CPU, eager, inference only): on "
                             "some CPUs MKL's few-row float32 matmuls are slow, a MARS step's most of all.")
    parser.add_argument("--no-chat-template", action="store_true", help="Feed text prompts raw instead of as a user turn.")
    parser.add_argument("--output", default=None, help="Write the JSON result here.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")


def run(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    for flag in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if args.kernels == "onednn" and "static_compile" in args.peers:
        raise ValueError("--kernels onednn times eager steps; compiling the converted layers (the static_compile peer, "
                         "MARS compiled beside it) is not supported: pass --peers prompt_lookup (or --peers alone).")
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a folder; pass a saved checkpoint directory.")
    from transformers import AutoConfig

    meta = getattr(AutoConfig.from_pretrained(args.model), "mars", None) or {}  # before loading any weights
    if "mask_token_id" not in meta:
        raise ValueError(f"{args.model} has no MARS mask token in config.json ('mars': {{'mask_token_id': ...}}); "
                         "train it with MARSTrainer or call hf_mars.add_mask_token first.")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    from hf_mars.generation import enable_mars

    use_kernels(enable_mars(model), args.kernels)
    prompts = load_prompts(args.prompts)
    result = benchmark_generation(
        model, tokenizer, prompts, thresholds=args.thresholds, batch_sizes=args.batch_sizes, caches=args.caches,
        verify_thresholds=args.verify_thresholds, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
        cache_block=args.cache_block, num_prompts=args.num_prompts, repeats=args.repeats, warmup=args.warmup,
        num_threads=args.threads, cost_repeats=args.cost_repeats, chat_template=False if args.no_chat_template else None, progress=not args.quiet,
        peers=tuple(args.peers), draft_trees=tuple(args.draft_trees), short_answers=args.short_answers,
        acceptances=tuple(args.acceptance), plain_steps=args.plain_steps,
        log=None if args.quiet else lambda msg: print(f"hf-mars bench: {msg}", file=sys.stderr, flush=True),
    )
    result["settings"]["model_path"] = str(args.model)
    result["settings"]["kernels"] = args.kernels
    result["settings"]["prompts_path"] = args.prompts
    print(format_table(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
        print(f"wrote {args.output}")
    return 0


def _json_default(o):
    if torch.is_tensor(o):
        return o.tolist()
    if hasattr(o, "to_dict"):  # e.g. a CompileConfig among the generate arguments
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
