"""The decoding options that are not defaults, measured on a MARS checkpoint so each has a reason to exist:
acceptance rules (probability / entropy / margin), the per-step cap, and the block cache's two layouts.

    hf-mars demo --output-dir runs/demo
    python benchmarks/sweep_options.py --model runs/demo/mars-checkpoint

Accuracy and tokens per forward over the demo's 320 held-out questions; wall-clock against plain `generate` on
48 of them at batch 1 and 4, interleaved in one run (best of 2).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_common import load, parser, score, speedups  # noqa: E402

SETTINGS = {
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


def main(argv=None):
    args = parser(__doc__.split("\n")[0]).parse_args(argv)
    tok, model, examples = load(args)
    settings = {k: {"mars": True, **v} for k, v in SETTINGS.items()}
    scored = score(model, tok, examples, settings)
    speed = {bs: speedups(model, tok, examples[:args.timing_prompts], settings, bs, args.repeats) for bs in (1, 4)}
    rows = {name: {"accuracy": res["accuracy"], "tokens_per_forward": res["tokens_per_forward"],
                   "speedup_b1": speed[1][name], "speedup_b4": speed[4][name]} for name, res in scored.items()}
    print("| setting | accuracy | tokens/forward | speed-up batch 1 | speed-up batch 4 |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} | {r['speedup_b1']:.2f}× | "
              f"{r['speedup_b4']:.2f}× |")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
