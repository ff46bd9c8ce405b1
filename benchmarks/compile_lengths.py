"""Compiled decoding over prompts of many lengths: graphs compiled, recompiles after warm-up, and wall-clock.

A user's traffic has many prompt lengths. This runs, on one checkpoint and the demo's held-out prompts (distinct
lengths, chat template), plain `generate` and MARS verify, each dynamic (no compile) and with the static cache +
torch.compile (`CompileConfig(fullgraph=False, dynamic=False)`, compiled on CPU too), at each batch size: one
warm-up pass over every batch, then timed passes interleaved batch by batch (each batch keeps its fastest
repeat). It counts the graphs Dynamo compiled during the warm-up and after it (the target: none after).

    python benchmarks/compile_lengths.py --model runs/demo/mars-checkpoint --num-prompts 24 --batch-sizes 1 4
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _prompts(tok, n, seed):
    """``n`` chats of distinct token lengths: the held-out questions first (their templates give 23 lengths), then
    two-turn chats (an earlier held-out exchange, then the question), as a chat client with history sends them."""
    from hf_mars.demo.data import generate_examples

    def length(messages):
        return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])

    examples = list(generate_examples(40 * n, seed=seed, split="eval"))
    turns = [ex["messages"][:1] for ex in examples]
    turns += [prev["messages"][:2] + ex["messages"][:1] for prev, ex in zip(examples, examples[1:])]
    seen, out = set(), []
    for messages in turns:
        size = length(messages)
        if size not in seen:  # distinct lengths: the case that recompiled
            seen.add(size)
            out.append(messages)
        if len(out) == n:
            break
    return out


def _batches(tok, prompts, b):
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    return [tok(texts[i:i + b], return_tensors="pt", padding=True, padding_side="left")
            for i in range(0, len(texts), b)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-cache-len", type=int, default=None, help="generation_config.max_cache_len for both "
                        "compiled runs (transformers' way to size the static cache for the worst case up front, so "
                        "plain generate compiles one graph too); default: each sizes its own cache")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    from hf_mars import enable_mars
    from hf_mars._compat import compile_on_any_device

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    enable_mars(model)
    prompts = _prompts(tok, args.num_prompts, args.seed)
    compiled = dict(cache_implementation="static",
                    compile_config=compile_on_any_device(CompileConfig(fullgraph=False, dynamic=False)))
    if args.max_cache_len:
        compiled["max_cache_len"] = args.max_cache_len
    runs = {"plain": {}, "plain compiled": compiled,
            "verify": dict(mars_verify=True), "verify compiled": dict(mars_verify=True, **compiled)}
    result = {"model": args.model, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "max_cache_len": args.max_cache_len, "torch": torch.__version__, "rows": []}
    for b in args.batch_sizes:
        batches = _batches(tok, prompts, b)

        def call(kw, enc):
            return model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, **kw)

        torch._dynamo.reset()
        counters.clear()
        model.__dict__.pop("_compiled_call", None)
        outputs = {}
        with torch.inference_mode():
            for name, kw in runs.items():  # warm-up: every batch once (compiles what it needs)
                outputs[name] = [call(kw, enc) for enc in batches]
            warm_graphs = counters["stats"]["unique_graphs"]
            best = {name: [float("inf")] * len(batches) for name in runs}
            for rep in range(args.repeats):
                for i, enc in enumerate(batches):
                    names = list(runs)
                    shift = (rep + i) % len(names)
                    for name in names[shift:] + names[:shift]:
                        t0 = time.perf_counter()
                        call(runs[name], enc)
                        best[name][i] = min(best[name][i], time.perf_counter() - t0)
        after = counters["stats"]["unique_graphs"] - warm_graphs
        same = all(torch.equal(a, p) for name in runs for a, p in zip(outputs[name], outputs["plain"]))
        secs = {name: sum(v) for name, v in best.items()}
        row = {"batch_size": b, "seconds": secs, "graphs_in_warmup": warm_graphs, "graphs_after_warmup": after,
               "identical_to_plain": same,
               "verify_compiled_vs_plain_compiled": secs["plain compiled"] / secs["verify compiled"],
               "verify_compiled_vs_verify": secs["verify"] / secs["verify compiled"],
               "plain_compiled_vs_plain": secs["plain"] / secs["plain compiled"]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
