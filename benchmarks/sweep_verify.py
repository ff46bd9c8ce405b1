"""Verify mode's draft settings on a MARS checkpoint: tokens per forward on the demo's held-out split and
batch-1 wall-clock against plain `generate`, interleaved in one run (the output is identical for every setting).

    hf-mars demo --output-dir runs/demo
    python benchmarks/sweep_verify.py --model runs/demo/mars-checkpoint
"""

import argparse
import json

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars import enable_mars
from hf_mars.demo.data import generate_examples
from hf_mars.demo.bench import time_interleaved
from hf_mars.demo.pipeline import _encode_batches, _per_task_tpf, _prompts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-eval", type=int, default=320)
    parser.add_argument("--timing-prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.5, 0.7])
    args = parser.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    B = model.config.mars["block_size"]
    examples = generate_examples(args.num_eval, seed=0, split="eval")  # the demo's held-out split
    settings = {f"drafts={d} tau={t:g}": {"mars": True, "mars_verify": True, "mars_threshold": t,
                                          "mars_block_size": B, "mars_use_last_mask": d == B}
                for d in (B - 1, B) for t in args.thresholds}
    rows = {}
    with tqdm(total=len(settings) * len(examples), desc="tokens/forward", unit="ex") as bar:
        ref = None
        for name, kw in settings.items():
            res = _per_task_tpf(examples, model, tok, 64, bar, **kw)
            ref = ref or res["predictions"]
            assert res["predictions"] == ref, f"{name}: verify output changed"
            rows[name] = {"tokens_per_forward": round(res["tokens_per_forward"], 3), "accuracy": res["accuracy"]}
    batches = _encode_batches(tok, _prompts(tok, examples[:args.timing_prompts]), 1)
    runs = {"plain": {}, **settings}
    with tqdm(total=len(runs) * args.repeats, desc="timing", unit="run") as bar:
        seconds = time_interleaved(model, batches, runs, args.repeats, bar)
    print("| drafts per step | draft τ | tokens/forward (320 held-out) | batch-1 speed-up vs plain generate |")
    print("|---|---|---|---|")
    for name, kw in settings.items():
        rows[name]["speedup_vs_plain"] = round(seconds["plain"] / seconds[name], 3)
        d = B if kw["mars_use_last_mask"] else B - 1
        print(f"| {d} | {kw['mars_threshold']:g} | {rows[name]['tokens_per_forward']:.2f} | "
              f"{rows[name]['speedup_vs_plain']:.2f}× |")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
