"""The decoding options that are not defaults, measured on a MARS checkpoint so each has a reason to exist:
acceptance rules (probability / entropy / margin), the per-step cap, and the block cache's two layouts.

    hf-mars demo --output-dir runs/demo
    python benchmarks/sweep_options.py --model runs/demo/mars-checkpoint

Accuracy and tokens per forward over the demo's 320 held-out questions; wall-clock against plain `generate` on
48 of them at batch 1 and 4, interleaved in one run (best of 2).
"""

import argparse
import json

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars import enable_mars
from hf_mars.demo.bench import time_interleaved
from hf_mars.demo.data import generate_examples
from hf_mars.demo.pipeline import _encode_batches, _per_task_tpf, _prompts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-eval", type=int, default=320)
    parser.add_argument("--timing-prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    examples = generate_examples(args.num_eval, seed=0, split="eval")
    settings = {
        "probability τ=0.99": dict(mars_threshold=0.99),
        "probability τ=0.9": dict(mars_threshold=0.9),
        "entropy τ=0.99": dict(mars_threshold=0.99, mars_acceptance="entropy"),
        "entropy τ=0.9": dict(mars_threshold=0.9, mars_acceptance="entropy"),
        "margin τ=0.98": dict(mars_threshold=0.98, mars_acceptance="margin"),
        "margin τ=0.8": dict(mars_threshold=0.8, mars_acceptance="margin"),
        "probability τ=0.9, max 2 per step": dict(mars_threshold=0.9, mars_max_accept=2),
        "block cache τ=0.99": dict(mars_threshold=0.99, mars_cache="block"),
        "block_trained cache τ=0.99": dict(mars_threshold=0.99, mars_cache="block_trained"),
    }
    settings = {k: {"mars": True, **v} for k, v in settings.items()}
    rows = {}
    with tqdm(total=len(settings) * len(examples), desc="accuracy", unit="ex") as bar:
        for name, kw in settings.items():
            res = _per_task_tpf(examples, model, tok, 64, bar, **kw)
            rows[name] = {"accuracy": res["accuracy"], "tokens_per_forward": res["tokens_per_forward"]}
    prompts = _prompts(tok, examples[:args.timing_prompts])
    for bs in (1, 4):
        batches = _encode_batches(tok, prompts, bs)
        runs = {"plain": {}, **settings}
        with tqdm(total=len(runs) * args.repeats, desc=f"timing b={bs}", unit="run") as bar:
            seconds = time_interleaved(model, batches, runs, args.repeats, bar)
        for name in settings:
            rows[name][f"speedup_b{bs}"] = seconds["plain"] / seconds[name]
    print("| setting | accuracy | tokens/forward | speed-up batch 1 | speed-up batch 4 |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} | {r['speedup_b1']:.2f}× | "
              f"{r['speedup_b4']:.2f}× |")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
