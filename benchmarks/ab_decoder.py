"""A/B the decoding loop against an older one, in one process, interleaved: same checkpoint, prompts, batches.

The old loop is loaded from a single-file `hf_mars/generation.py` of an earlier commit (it imports only torch and
transformers, as every checkpoint's custom_generate did), the new one is this tree's `hf_mars.generation`; both run
as ``generate(custom_generate=<their mars_generate>)`` on the same model. Per configuration and batch size: the
median wall time of each side's calls over the prompt set (repeats interleaved A/B/A/B...), tokens per forward,
and whether the outputs are identical.

    git show 85bae7e:hf_mars/generation.py > /tmp/generation_85bae7e.py
    python benchmarks/ab_decoder.py --model runs/demo/mars-checkpoint --old /tmp/generation_85bae7e.py
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars.demo.data import generate_examples
from hf_mars.demo.prompts import encode_prompts, make_batches
from hf_mars.generation import mars_generate

CONFIGS = {"tau=1": dict(mars_threshold=1.0), "tau=0.95": dict(mars_threshold=0.95),
           "tau=0.9": dict(mars_threshold=0.9), "verify": dict(mars_verify=True),
           "block": dict(mars_threshold=0.95, mars_cache="block")}


def load_old(path):
    spec = importlib.util.spec_from_file_location("old_generation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_generation"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.mars_generate


def run(model, batches, loop, kw, max_new):
    """One pass over the batches: (seconds, sequences, tokens, forwards)."""
    outs, tokens, forwards = [], 0, 0
    start = time.perf_counter()
    for batch in batches:
        out = model.generate(**batch, custom_generate=loop, max_new_tokens=max_new, do_sample=False,
                             return_dict_in_generate=True, **kw)
        outs.append(out.sequences)
        tokens += int(out.mars_emitted_tokens.sum())
        forwards += int(out.mars_forward_passes.sum())
    return time.perf_counter() - start, outs, tokens, forwards


def main(args):
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = [ex["messages"][:1] for ex in generate_examples(args.prompts, seed=1, split="eval")]
    encoded = encode_prompts(tok, prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    loops = {"old": load_old(args.old), "new": mars_generate}
    rows = []
    for bs in args.batch_sizes:
        batches = [{"input_ids": ids, "attention_mask": mask} for ids, mask in make_batches(encoded, bs, pad)]
        for name, kw in CONFIGS.items():
            times = {"old": [], "new": []}
            for side in loops:  # warm-up
                run(model, batches[:1], loops[side], kw, args.max_new_tokens)
            for _ in range(args.repeats):
                for side in loops:
                    seconds, outs, tokens, forwards = run(model, batches, loops[side], kw, args.max_new_tokens)
                    times[side].append(seconds)
                    result = (outs, tokens, forwards)
                    if side == "old":
                        old_result = result
            same = all(torch.equal(a, b) for a, b in zip(old_result[0], result[0]))
            old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
            rows.append({"batch": bs, "config": name, "old_s": old_s, "new_s": new_s, "new_vs_old": old_s / new_s,
                         "tok_per_fwd_old": old_result[1] / old_result[2], "tok_per_fwd_new": result[1] / result[2],
                         "identical": same})
            r = rows[-1]
            print(f"batch {bs:2d} {name:9s} old {old_s:6.2f}s new {new_s:6.2f}s  new/old speed {r['new_vs_old']:.3f}x"
                  f"  tok/fwd {r['tok_per_fwd_old']:.2f} / {r['tok_per_fwd_new']:.2f}  identical {same}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--old", required=True, help="a single-file hf_mars/generation.py of an earlier commit")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    main(p.parse_args())
