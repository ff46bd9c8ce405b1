"""Short answers, one call at a time: `hf-mars bench --short-answers`.

Chat answers are often 10-40 tokens, so a call's fixed set-up weighs as much as its loop. This times, per call at
batch 1, three ways to get the same answer from a MARS checkpoint:

- ``reference``: the MARS sampler as the method's authors run it (`no_cache_decode`, the library's
  `reference_decode`): no KV cache, every step forwards the whole sequence ``[prompt | generated | masks]`` and
  accepts candidates left to right while confident. It is the yardstick a user would compare against.
- ``mars``: ``generate(mars=True, mars_threshold=tau)`` (and, with ``static_compile``, the same on a static cache
  with decode steps and the prefill compiled: ``mars_compile_prefill``);
- ``plain``: plain greedy ``generate``.

Calls are interleaved prompt by prompt in rotating order after a warm-up pass (load drift hits all alike); each
call's median over the repeats is kept. The answers of ``reference`` and ``mars`` should be identical (both pick the
same tokens at the same tau; float differences between a cached and an uncached forward can flip a near-tie): the
table says how many are.
"""

from __future__ import annotations

import statistics
import time

import torch

from hf_mars.generation.rules import reference_decode


def no_cache_decode(model, prompt_ids, mask_token_id, block_size, threshold, max_new_tokens, eos_token_ids):
    """MARS decoding without a KV cache, one prompt: the library's reference loop (`reference_decode`: each step
    forwards ``[prompt | new | masks]`` in full and accepts candidates while confident). Returns (new tokens,
    forwards)."""
    return reference_decode(model, prompt_ids, mask_token_id, block_size=block_size, threshold=threshold,
                            max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos_token_ids))


def _answer(tokens, eos_ids):
    """Tokens up to and including the first EOS (generate pads after it)."""
    out = []
    for t in tokens:
        out.append(t)
        if t in eos_ids:
            break
    return out


def benchmark_short_answers(model, encoded, thresholds, block_size, mask_token_id, eos_ids, max_new_tokens=64,
                            repeats=3, static_compile=False, progress=None) -> list[dict]:
    """One row per tau: median ms per call of each way (see the module docstring), the speed-up of ``mars`` over
    ``reference`` (ratio of total time), identical answers, and the forwards each made. ``encoded``: prompts as
    token-id lists (batch 1 each)."""
    from transformers import CompileConfig

    from hf_mars._compat import compile_on_any_device

    device = next(model.parameters()).device
    compiled = compile_on_any_device(CompileConfig(fullgraph=False)) if static_compile else None
    eos = set(eos_ids)

    def call(way, ids, tau):
        if way == "reference":
            new, _ = no_cache_decode(model, ids, mask_token_id, block_size, tau, max_new_tokens, eos_ids)
            return new
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
        if way != "plain":
            kw.update(mars=True, mars_threshold=tau, mars_block_size=block_size)
        if way == "mars static+compile":
            kw.update(cache_implementation="static", compile_config=compiled, mars_compile_prefill=True)
        out = model.generate(input_ids=torch.tensor([ids], device=device), **kw)
        return out[0, len(ids):].tolist()

    ways = ["reference", "mars", "plain"] + (["mars static+compile"] if static_compile else [])
    rows = []
    for tau in thresholds:
        answers = {w: [None] * len(encoded) for w in ways}
        times = {w: [[] for _ in encoded] for w in ways}
        for i, ids in enumerate(encoded):  # warm-up (a compiled way compiles here)
            for w in ways:
                answers[w][i] = _answer(call(w, ids, tau), eos)
        for rep in range(repeats):
            for i, ids in enumerate(encoded):
                order = ways[(i + rep) % len(ways):] + ways[:(i + rep) % len(ways)]
                for w in order:
                    t0 = time.perf_counter()
                    call(w, ids, tau)
                    times[w][i].append(time.perf_counter() - t0)
            if progress is not None:
                progress(f"short answers: tau {tau:g}, repeat {rep + 1}/{repeats}")
        per_call = {w: [statistics.median(t) for t in times[w]] for w in ways}
        identical = sum(a == b for a, b in zip(answers["reference"], answers["mars"]))
        row = {"threshold": tau, "prompts": len(encoded), "identical_to_reference": identical,
               "answer_tokens_median": statistics.median(len(a) for a in answers["mars"])}
        for w in ways:
            key = w.replace(" ", "_").replace("+", "_")
            row[f"{key}_ms"] = 1000 * statistics.median(per_call[w])
            if w != "reference":
                row[f"{key}_vs_reference"] = sum(per_call["reference"]) / sum(per_call[w])
        rows.append(row)
    return rows


def format_short_answers(rows: list[dict]) -> str:
    """The short-answer table: median ms per call and speed-ups over the reference loop."""
    if not rows:
        return ""
    compiled = "mars_static_compile_ms" in rows[0]
    header = ["tau", "reference ms", "mars ms", "plain ms", "mars vs reference", "plain vs reference"]
    if compiled:
        header += ["mars s+c ms", "s+c vs reference"]
    header += ["identical", "answer tokens"]
    lines = []
    for r in rows:
        cells = [f"{r['threshold']:g}", f"{r['reference_ms']:.1f}", f"{r['mars_ms']:.1f}", f"{r['plain_ms']:.1f}",
                 f"{r['mars_vs_reference']:.2f}x", f"{r['plain_vs_reference']:.2f}x"]
        if compiled:
            cells += [f"{r['mars_static_compile_ms']:.1f}", f"{r['mars_static_compile_vs_reference']:.2f}x"]
        cells += [f"{r['identical_to_reference']}/{r['prompts']}", f"{r['answer_tokens_median']:g}"]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    out = ["short answers, batch 1, per call (median ms; speed-ups: ratio of total time):",
           "  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in lines]
    out.append("reference = MARS without a KV cache (every step re-forwards the whole sequence), as the method's "
               "authors sample; s+c = mars with cache_implementation='static', decode steps and prefill compiled "
               "(mars_compile_prefill=True)")
    return "\n".join(out)
