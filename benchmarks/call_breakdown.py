"""Where one short `generate(mars=True)` call's time goes, per call at batch 1, timed in place.

Wraps the decoder's pieces with timers (no profiler: its overhead would dwarf the loop's) and reports, per call:
transformers' `generate` preparation (until MARS's set-up starts), the decoder's set-up, the prefill forward, the
decode forwards (and, when compiled, the Inductor graph inside them), and the loop's own work between forwards.
Also the set-up alone of the default MARS call (dynamic cache) and of plain `generate` (each call made to stop at
its first forward; with ``--static-compile`` both again with the static cache and compile config; and MARS minus
plain as the median of adjacent calls' differences, which the machine's drift between calls does not move), and
what one eager forward costs by width, cached and as the no-cache reference loop runs it.

    OMP_NUM_THREADS=1 python benchmarks/call_breakdown.py --model runs/demo/mars-checkpoint --static-compile \
        --compile-prefill
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class _StopAtFirstForward(Exception):
    pass


def _setup_only(model, prompts, calls, repeats):
    """Median ms from ``generate(...)`` to the first forward, per way (ways interleaved)."""
    def stop(*args, **kwargs):
        raise _StopAtFirstForward

    forward, model.forward = model.forward, stop
    times = {name: [] for name in calls}
    try:
        for _ in range(repeats):
            for ids in prompts:
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    try:
                        call(ids)
                    except _StopAtFirstForward:
                        pass
                    times[name].append(time.perf_counter() - t0)
    finally:
        model.forward = forward
    medians = {name: 1000 * statistics.median(t[len(prompts):]) for name, t in times.items()}  # first: warm-up
    # the difference of adjacent calls, paired: the machine's drift between calls cancels out
    for mars, plain in (("mars", "plain"), ("mars static", "plain static")):
        if mars in times and plain in times:
            medians[f"{mars} - {plain} (paired)"] = 1000 * statistics.median(
                [a - b for a, b in zip(times[mars][len(prompts):], times[plain][len(prompts):])])
    return medians


def _forward_costs(model, prompt_len=50, repeats=350):
    """Median ms of one eager forward by width, interleaved: cached (1 and 7 new tokens over ``prompt_len``) and
    without a cache over the whole sequence (44 and 60 tokens under a dense causal mask, as the reference loop)."""
    from transformers import DynamicCache

    ids = torch.randint(3, model.config.vocab_size - 1, (1, 64))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prompt_len], cache=cache, use_cache=True)

    def cached(w):
        pos = torch.arange(prompt_len, prompt_len + w)[None]
        return lambda: (model(input_ids=ids[:, :w], cache=cache, use_cache=True, position_ids=pos,
                              logits_to_keep=w), cache.crop(-w))

    def full(n):
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        return lambda: model(input_ids=ids[:, :n], attention_mask=causal, position_ids=torch.arange(n)[None])

    ways = {"cached 1": cached(1), "cached 7": cached(7), "no cache 44": full(44), "no cache 60": full(60)}
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: 1000 * statistics.median(v[repeats // 7:]) for k, v in times.items()}


def _time_in_place(prompts, mars):
    """Run ``mars`` on every prompt with the decoder's pieces wrapped in timers; returns the summed seconds per
    piece (``preparation``: from the call to MARS's set-up) and the decode steps taken."""
    import hf_mars.generation.api as api
    import hf_mars.generation.decoder as decoder
    import torch._inductor.output_code as output_code

    t = dict(total=0.0, preparation=0.0, setup=0.0, run=0.0, prefill=0.0, decode=0.0, graph=0.0, steps=0)
    marks = {}
    start_decoder, run = api.start_decoder, decoder.MARSDecoder.run
    forwards = {name: getattr(decoder.MARSDecoder, name) for name in ("forward", "forward_read")}
    graph_call = output_code.CompiledFxGraph.__call__

    def timed_start(*a, **k):
        marks["setup"] = time.perf_counter()
        out = start_decoder(*a, **k)
        t["setup"] += time.perf_counter() - marks["setup"]
        return out

    def timed_run(self, *a, **k):
        t0 = time.perf_counter()
        out = run(self, *a, **k)
        t["run"] += time.perf_counter() - t0
        return out

    def timed(forward):  # a step's forward (`forward_read`: a compiled step that reads its slots in the graph)
        def timed_forward(self, plan, *a, **k):
            marks["decoding"] = not plan.first
            t0 = time.perf_counter()
            out = forward(self, plan, *a, **k)
            t["prefill" if plan.first else "decode"] += time.perf_counter() - t0
            t["steps"] += not plan.first
            return out
        return timed_forward

    def timed_graph(self, inputs):
        t0 = time.perf_counter()
        out = graph_call(self, inputs)
        if marks.get("decoding"):  # (a compiled prefill's graph counts in the prefill)
            t["graph"] += time.perf_counter() - t0
        return out

    api.start_decoder, decoder.MARSDecoder.run = timed_start, timed_run
    for name, forward in forwards.items():
        setattr(decoder.MARSDecoder, name, timed(forward))
    output_code.CompiledFxGraph.__call__ = timed_graph
    try:
        for ids in prompts:
            t0 = time.perf_counter()
            mars(ids)
            t["total"] += time.perf_counter() - t0
            t["preparation"] += marks["setup"] - t0
    finally:
        api.start_decoder, decoder.MARSDecoder.run = start_decoder, run
        for name, forward in forwards.items():
            setattr(decoder.MARSDecoder, name, forward)
        output_code.CompiledFxGraph.__call__ = graph_call
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--static-compile", action="store_true", help="static cache, decode steps compiled")
    p.add_argument("--compile-prefill", action="store_true", help="mars_compile_prefill=True (with --static-compile)")
    p.add_argument("--setup-repeats", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    from hf_mars._compat import compile_on_any_device
    from hf_mars.demo.prompts import encode_prompts, load_prompts
    from hf_mars.generation import enable_mars

    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [torch.tensor([ids]) for ids in
               encode_prompts(tok, [r["prompt"] for r in load_prompts(limit=args.num_prompts)])]
    extra = {}
    if args.static_compile:
        extra = dict(cache_implementation="static", compile_config=compile_on_any_device(CompileConfig()),
                     mars_compile_prefill=args.compile_prefill)

    def mars(ids):
        return model.generate(input_ids=ids, max_new_tokens=64, do_sample=False, mars=True,
                              mars_threshold=args.threshold, **extra)

    for ids in prompts:  # warm-up (compiles)
        mars(ids)
    t = _time_in_place(prompts, mars)
    n, steps = len(prompts), max(t["steps"], 1)
    print(f"per call (ms, mean of {n}): total {1000 * t['total'] / n:.2f} = generate's preparation "
          f"{1000 * t['preparation'] / n:.2f} + MARS set-up {1000 * t['setup'] / n:.2f} + prefill "
          f"{1000 * t['prefill'] / n:.2f} + {t['steps'] / n:.2f} decode steps x {1000 * t['decode'] / steps:.2f} "
          f"(graph {1000 * t['graph'] / steps:.2f}) + loop {1000 * (t['run'] - t['prefill'] - t['decode']) / n:.2f}")
    calls = {"plain": lambda ids: model.generate(input_ids=ids, max_new_tokens=64, do_sample=False),
             "mars": lambda ids: model.generate(input_ids=ids, max_new_tokens=64, do_sample=False, mars=True,
                                                mars_threshold=args.threshold)}
    if args.static_compile:  # the same two with the static cache and compile config; the prefill eager (a compiled
        # one would trace the stopped forward: Dynamo's work, not set-up), so no graph runs
        static = {k: v for k, v in extra.items() if not k.startswith("mars_")}
        calls["plain static"] = lambda ids: model.generate(input_ids=ids, max_new_tokens=64, do_sample=False, **static)
        calls["mars static"] = lambda ids: model.generate(input_ids=ids, max_new_tokens=64, do_sample=False, mars=True,
                                                          mars_threshold=args.threshold, **static)
    setup = _setup_only(model, prompts, calls, args.setup_repeats)
    print("to the first forward (median ms): " + ", ".join(f"{k} {v:+.3f}" if "paired" in k else f"{k} {v:.2f}"
                                                          for k, v in setup.items()))
    with torch.no_grad():
        costs = _forward_costs(model)
    print("one eager forward (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))


if __name__ == "__main__":
    main()
