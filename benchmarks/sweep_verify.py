"""Verify mode's draft settings on a MARS checkpoint: tokens per forward on the demo's held-out split and
batch-1 wall-clock against plain `generate`, interleaved in one run (the output is identical for every setting).

    hf-mars demo --output-dir runs/demo
    python benchmarks/sweep_verify.py --model runs/demo/mars-checkpoint
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_common import load, parser, score, speedups  # noqa: E402


def main(argv=None):
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.5, 0.7])
    args = p.parse_args(argv)
    tok, model, examples = load(args)
    B = model.config.mars["block_size"]
    settings = {f"drafts={d} tau={t:g}": {"mars": True, "mars_verify": True, "mars_threshold": t,
                                          "mars_block_size": B, "mars_use_last_mask": d == B}
                for d in (B - 1, B) for t in args.thresholds}
    scored = score(model, tok, examples, settings)
    ref = next(iter(scored.values()))["predictions"]
    for name, res in scored.items():
        assert res["predictions"] == ref, f"{name}: verify output changed"
    speed = speedups(model, tok, examples[:args.timing_prompts], settings, 1, args.repeats)
    rows = {name: {"tokens_per_forward": round(res["tokens_per_forward"], 3), "accuracy": res["accuracy"],
                   "speedup_vs_plain": round(speed[name], 3)} for name, res in scored.items()}
    print("| drafts per step | draft τ | tokens/forward (320 held-out) | batch-1 speed-up vs plain generate |")
    print("|---|---|---|---|")
    for name, kw in settings.items():
        d = B if kw["mars_use_last_mask"] else B - 1
        print(f"| {d} | {kw['mars_threshold']:g} | {rows[name]['tokens_per_forward']:.2f} | "
              f"{rows[name]['speedup_vs_plain']:.2f}× |")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
