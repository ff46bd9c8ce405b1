"""What `mars_compile_prefill` and guards checked once per layout buy a short answer: per call at batch 1,
interleaved in one process.

Four ways, each once per prompt in rotating order after a warm-up pass (which compiles every graph), median and
total time over the repeats:

- ``reference``: MARS without a KV cache, as the method's authors sample (`hf_mars.demo.short_answers`);
- ``static+compile``: ``generate(mars=True)`` on a static cache, decode steps compiled, the prefill eager;
- ``+ compiled prefill``: the same with ``mars_compile_prefill=True``;
- ``+ compiled prefill, guards every step``: the same with ``mars_guard_every_step=True`` (torch.compile's guards
  evaluated in full before every decode step, rather than on a generation's first step of each input layout).

    OMP_NUM_THREADS=1 python benchmarks/compile_prefill.py --model runs/demo/mars-checkpoint --num-prompts 24 \
        --repeats 3 --output benchmarks/compile_prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a MARS checkpoint folder")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    from hf_mars._compat import compile_on_any_device
    from hf_mars.demo.bench import _eos_ids
    from hf_mars.demo.prompts import encode_prompts, load_prompts
    from hf_mars.demo.short_answers import no_cache_decode
    from hf_mars.generation import enable_mars
    from hf_mars.generation.config import mask_token_id, read_mars_metadata

    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = encode_prompts(tok, [r["prompt"] for r in load_prompts(limit=args.num_prompts)])
    compiled = compile_on_any_device(CompileConfig(fullgraph=False))
    tau, n, eos = args.threshold, args.max_new_tokens, _eos_ids(model)
    block = read_mars_metadata(model.config).get("block_size") or 4

    def mars(ids, **kw):
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, mars=True,
                             mars_threshold=tau, mars_block_size=block, cache_implementation="static",
                             compile_config=compiled, **kw)
        return out[0, len(ids):].tolist()

    ways = {
        "reference": lambda ids: no_cache_decode(model, ids, mask_token_id(model), block, tau, n, eos)[0],
        "static+compile": mars,
        "+ compiled prefill": lambda ids: mars(ids, mars_compile_prefill=True),
        "+ compiled prefill, guards every step": lambda ids: mars(ids, mars_compile_prefill=True,
                                                               mars_guard_every_step=True),
    }
    names = list(ways)
    answers = {w: [ways[w](ids) for ids in prompts] for w in names}  # warm-up: every graph compiles here
    times = {w: [] for w in names}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            k = (i + rep) % len(names)
            for w in names[k:] + names[:k]:
                t0 = time.perf_counter()
                ways[w](ids)
                times[w].append(time.perf_counter() - t0)
    ref = sum(times["reference"])
    result = {"settings": vars(args), "ways": {
        w: {"median_ms": 1000 * statistics.median(times[w]), "vs_reference": ref / sum(times[w]),
            "identical_to_reference": sum(a[:len(b)] == b for a, b in zip(answers[w], answers["reference"]))}
        for w in names}}
    for w, r in result["ways"].items():
        print(f"{w:>38}: {r['median_ms']:6.1f} ms/call  {r['vs_reference']:.2f}x reference  "
              f"identical {r['identical_to_reference']}/{len(prompts)}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
