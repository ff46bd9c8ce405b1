"""Verify mode's draft trees on a MARS checkpoint: tokens per forward and wall-clock per tree shape against the
chain and plain greedy `generate`, batch 1 and a left-padded batch, in one run (the outputs are checked identical).

Timing on a shared machine: every generate call of every setting runs ``--repeats`` times, the settings
interleaved call by call (plain, chain, each tree, plain, ...), and each call's fastest repeat counts (the least
disturbed estimate); the sums over the prompts give the speed-ups. Also reported per shape: the widest tree step
(1 + nodes + (nodes + 1) x depth: a mask group after every node), the mean width of the steps really forwarded
(groups go only where the path is likely to end) and their measured cost against a 1-token step on this machine
(`hf_mars.bench.timing.measure_step_costs`), and the limit tokens/forward x cost(1)/cost(mean width): the speed-up
over plain decoding with no loop overhead.

    hf-mars demo --output-dir runs/demo
    python benchmarks/tree_sweep.py --model runs/demo/mars-checkpoint --output benchmarks/tree_sweep.json

``--prompts FILE`` takes a user's prompts instead of the bundled tasks' (a pretrained base's real-text openings).

``--short-process LAYOUT`` times something else: verify's default 'auto' measures layouts per call
(`hf_mars.generation.policy.CallRecord`), and in a short process its warm-up is most of its life. One plain warm-up
call, then ``--passes`` passes over the prompts at the first batch size with ``mars_draft_tree=LAYOUT``, timed per
pass, and the layouts 'auto' chose; run each layout in a fresh process of its own:

    for layout in auto chain tree; do
        taskset -c 0 python benchmarks/tree_sweep.py --model runs/demo/mars-checkpoint --short-process $layout \
            --batch-sizes 16 --passes 3
    done
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars import enable_mars
from hf_mars.bench.prompts import encode_prompts, load_prompts
from hf_mars.bench.timing import measure_step_costs
from hf_mars.generation.policy import choices_for

SHAPES = ("chain", "tree", "1,1,1", "2,1,1,1", "2,2,1,1", "3,2,1,1", "2,2,2,2")  # fixed layouts ("auto" picks one per call)


def tree_width(shape: str, depth: int) -> int:
    """Columns of one tree step: the root, the nodes, a group of ``depth`` masks after the root and each node."""
    if shape == "chain":
        return 1 + 2 * depth
    ks = [1] * depth if shape == "tree" else [int(k) for k in shape.split(",")]
    nodes, level = 0, 1
    for k in ks:
        level *= k
        nodes += level
    return 1 + nodes + (nodes + 1) * len(ks)


def batches(tok, ids, b):
    out = []
    for i in range(0, len(ids), b):
        enc = tok.pad({"input_ids": ids[i:i + b]}, return_tensors="pt", padding_side="left")
        out.append((enc["input_ids"], enc["attention_mask"]))
    return out


def run(args):
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval())
    depth = model.config.mars["block_size"]  # verify reads B masks (the last one too) by default
    records = load_prompts(args.prompts, limit=args.num_prompts)
    ids = encode_prompts(tok, [r["prompt"] for r in records])
    settings = {"plain": {}} | {s: {"mars_verify": True, "mars_draft_tree": s} for s in args.shapes}
    result = {"model": args.model, "threads": args.threads, "num_prompts": len(ids), "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "batches": {}}
    for b in args.batch_sizes:
        calls = batches(tok, ids, b)
        best = {name: [float("inf")] * len(calls) for name in settings}
        outs, forwards, emitted, mean_width = {}, {}, {}, {}
        for name, kw in settings.items():  # warm-up + outputs, counts and the widths really forwarded
            seqs, fw, em, widths = [], 0, 0, []
            for x, am in calls:
                seen = []
                hook = model.register_forward_pre_hook(
                    lambda mod, a, k, seen=seen: seen.append(k["input_ids"].shape[1]), with_kwargs=True)
                try:
                    o = model.generate(input_ids=x, attention_mask=am, max_new_tokens=args.max_new_tokens,
                                       do_sample=False, return_dict_in_generate=True, **kw)
                finally:
                    hook.remove()
                widths += seen[1:]  # decode steps (the first forward is the prefill)
                seqs.append(o.sequences[:, x.shape[1]:].tolist())
                if hasattr(o, "mars_forward_passes"):
                    fw += int(o.mars_forward_passes.sum())
                    em += int(o.mars_emitted_tokens.sum())
            outs[name], forwards[name], emitted[name] = seqs, fw, em
            mean_width[name] = sum(widths) / max(len(widths), 1)
        for _ in range(args.repeats):
            for j, (x, am) in enumerate(calls):
                for name, kw in settings.items():
                    t0 = time.perf_counter()
                    model.generate(input_ids=x, attention_mask=am, max_new_tokens=args.max_new_tokens,
                                   do_sample=False, **kw)
                    best[name][j] = min(best[name][j], time.perf_counter() - t0)
        past = int(sum(map(len, ids)) / len(ids) + args.max_new_tokens / 2)
        widths = sorted({1} | {tree_width(s, depth) for s in args.shapes}
                        | {max(1, round(mean_width[s])) for s in args.shapes})
        costs = measure_step_costs(model, b, widths, past, args.cost_repeats, block_size=depth)
        plain = sum(best["plain"])
        rows = {}
        for name in args.shapes:
            w, mean = tree_width(name, depth), max(1, round(mean_width[name]))
            rows[name] = {
                "identical_to_plain": outs[name] == outs["plain"],
                "tokens_per_forward": round(emitted[name] / forwards[name], 3),
                "width": w, "cost_vs_1": round(costs[w] / costs[1], 3),
                "mean_width": round(mean_width[name], 2), "mean_cost_vs_1": round(costs[mean] / costs[1], 3),
                "limit_vs_plain": round(emitted[name] / forwards[name] * costs[1] / costs[mean], 3),
                "speedup_vs_plain": round(plain / sum(best[name]), 3),
                "speedup_vs_chain": round(sum(best["chain"]) / sum(best[name]), 3) if "chain" in best else None,
            }
        result["batches"][str(b)] = {"plain_seconds": round(plain, 3), "cost_1_ms": round(costs[1] * 1e3, 3),
                                     "rows": rows}
        print(f"batch {b} (cost(1) {costs[1] * 1e3:.2f} ms at cache length {past})")
        print("| tree | identical | tokens/forward | widest step (cost/cost(1)) | mean step (cost/cost(1)) | "
              "limit vs plain | vs plain | vs chain |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['identical_to_plain']} | {r['tokens_per_forward']:.2f} | {r['width']} "
                  f"({r['cost_vs_1']:.2f}) | {r['mean_width']:.1f} ({r['mean_cost_vs_1']:.2f}) | "
                  f"{r['limit_vs_plain']:.2f}× | {r['speedup_vs_plain']:.2f}× | {r['speedup_vs_chain']:.2f}× |",
                  flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def short_process(args):
    """``--short-process``: a fresh process's few calls with one layout (see the module's docstring)."""
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval())
    b = args.batch_sizes[0]
    calls = batches(tok, encode_prompts(tok, [r["prompt"] for r in load_prompts(args.prompts, args.num_prompts)]), b)
    kw = dict(mars=True, mars_verify=True, max_new_tokens=args.max_new_tokens, do_sample=False,
              mars_draft_tree=args.short_process)
    with torch.inference_mode():  # a user's first call pays the process's start-up; not what is timed here
        model.generate(input_ids=calls[0][0], attention_mask=calls[0][1], max_new_tokens=8, do_sample=False)
    times = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        with torch.inference_mode():
            for x, am in calls:
                model.generate(input_ids=x, attention_mask=am, **kw)
        times.append(round(time.perf_counter() - t0, 3))
    print(args.short_process, b, "seconds per pass:", times, "total:", round(sum(times), 3),
          "layouts chosen (calls):", dict(choices_for(model, b, "call")))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", default=None,
                   help="prompt file (.txt, .jsonl, .json: `hf_mars.bench.prompts.load_prompts`; a base model's plain "
                        "text goes in without a chat template); default: the bundled tasks' held-out prompts")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cost-repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    p.add_argument("--short-process", metavar="LAYOUT", default=None,
                   help="time a fresh process's few calls with this mars_draft_tree instead (see above)")
    p.add_argument("--passes", type=int, default=3, help="--short-process: passes over the prompts")
    args = p.parse_args(argv)
    return short_process(args) if args.short_process else run(args)


if __name__ == "__main__":
    sys.exit(main())
