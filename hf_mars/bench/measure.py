"""`hf-mars bench`: wall-clock and tokens per forward of MARS decoding against plain `generate`.

Why a dedicated benchmark: tokens per forward alone does not predict a speed-up.
A MARS step forwards ``1 + B`` (or more) positions where an AR step forwards one,
and the decoding loop does more Python work per step. So every MARS figure is
printed next to the limit it should be read against,

    limit = (tokens per forward call, MARS / AR) x cost(1) / cost(1 + B),

with ``cost(w)`` the measured time of one cached forward of ``w`` new positions
at the same batch size and cache length, and ``efficiency = speed-up / limit``
(the share of that limit the loop reaches). ``ideal`` is the speed-up the run
would reach if neither loop had any overhead outside the model's forward
(measured by timing every forward with hooks), and ``ovh ms/step`` is the loop's
own time per step — the part a faster loop can win back.

AR and MARS run in the same process, on the same batches, interleaved per batch
size (each repeat in its own seeded order), after a warm-up; each figure is the
median over ``repeats``.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass

import torch

from hf_mars.bench.figures import relative_figures, summarise_runs
from hf_mars.bench.prompts import encode_prompts, load_prompts, make_batches, score_record, to_record
from hf_mars.bench.specs import DEFAULT_ACCEPTANCE, RunSpec, build_specs
from hf_mars.bench.kernels import parameter_count
from hf_mars.bench.timing import ForwardRecorder, _sync, count_emitted, machine_info, measure_step_costs
from hf_mars.generation import DEFAULT_CACHE_BLOCK, DEFAULT_VERIFY_THRESHOLD
from hf_mars.generation.policy import choices_for

__all__ = ["benchmark_generation", "resolve_block_size"]


# columns read from the eager forward's hooks (model time, widths): a compiled graph's forwards are not timed one by
# one, so for compiled rows they would be meaningless (a limit of 20x for a row that ran 3x): left blank
COMPILED_BLANK = ("limit", "efficiency", "limit_w", "ideal", "overhead_ms_per_step", "model_ms_per_step",
                  "step_cost_vs_1")


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _generate_once(model, batch, spec: RunSpec, max_new_tokens: int, eos_ids, recorder: ForwardRecorder, device):
    ids, mask = (t.to(device) for t in batch)
    recorder.reset()
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         return_dict_in_generate=True, **spec.kwargs)
    _sync(device)
    elapsed = time.perf_counter() - t0
    seqs = out.sequences if hasattr(out, "sequences") else out
    new = seqs[:, ids.shape[1]:]
    emitted = count_emitted(new, eos_ids)
    stats_fwd = getattr(out, "mars_forward_passes", None)
    stats_emit = getattr(out, "mars_emitted_tokens", None)
    if spec.mode in ("ar", "ar_static_compile"):
        # each forward emits one token per active row: a row is active for its first `emitted` calls
        row_fwd = torch.clamp(emitted, max=recorder.calls)
    elif spec.mode == "prompt_lookup":  # batch 1: every call is this row's
        row_fwd = torch.full_like(emitted, recorder.calls)
    elif stats_fwd is not None:
        row_fwd = torch.as_tensor(stats_fwd).cpu().long()
    else:  # no statistics returned: the batch's calls bound every row's forwards
        row_fwd = torch.full_like(emitted, recorder.calls)
    return {
        "time": elapsed,
        "calls": recorder.calls,
        "widths": list(recorder.widths),
        "model_time": recorder.model_time,
        "emitted": emitted,
        "row_forwards": row_fwd,
        "stats_emitted": None if stats_emit is None else torch.as_tensor(stats_emit).cpu().long(),
        "new_tokens": [new[i, : int(emitted[i])].tolist() for i in range(new.shape[0])],
    }


def warm_up_batches(batches: list, warmup: int, compiled: bool) -> list:
    """The untimed calls before a configuration's timed ones. A compiled forward compiles once per shape: ``warmup``
    passes over every batch, so no timed call compiles. Otherwise ``warmup`` calls cycling through the batches: a
    measured policy ('auto', 'cost', plain steps) learns from its calls, and warmed on one prompt it would judge the
    layouts by that prompt alone (Gemma 3's first held-out opening, its chain's worst, kept 'auto' on plain steps
    while the chain ran 1.19x plain)."""
    if compiled:
        return [bt for _ in range(warmup) for bt in batches]
    return [batches[i % len(batches)] for i in range(warmup)]


def _model_size(model) -> dict:
    cfg = model.config
    return {
        "class": type(model).__name__,
        "parameters": parameter_count(model),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype),
        # verify rows decode with the checkpoint's saved draft vocabulary, when it has one (mars_draft_vocab)
        "draft_vocab_size": len(getattr(model.generation_config, "mars_draft_vocab", None) or ()) or None,
    }


def resolve_block_size(model, block_size=None) -> int:
    """The B the loop uses: explicit, else generation_config.mars_block_size, else config.mars['block_size'], else 4."""
    if block_size is not None:
        return int(block_size)
    gb = getattr(model.generation_config, "mars_block_size", None)
    if gb is not None:
        return int(gb)
    meta = getattr(model.config, "mars", None) or {}
    return int(meta.get("block_size", 4))


def benchmark_generation(model, tokenizer, prompts=None, thresholds=(1.0, 0.95, 0.9), batch_sizes=(1, 4, 16),
                         caches=("sliding", "block"), verify_thresholds=(DEFAULT_VERIFY_THRESHOLD,), max_new_tokens=64, block_size=None,
                         cache_block=DEFAULT_CACHE_BLOCK, num_prompts=16, repeats=3, warmup=1, num_threads=None, cost_repeats=30,
                         chat_template=None, progress=True, log=None, peers=("prompt_lookup",),
                         draft_trees=("auto",), short_answers=False, acceptances=(DEFAULT_ACCEPTANCE,),
                         plain_steps=False) -> dict:
    """Benchmark MARS decoding against plain greedy `generate` (KV cache) on one model, in one process.

    ``model`` must have `enable_mars` applied (done here when it is not). Returns a JSON-able dict with
    the machine, the model, the step costs per batch size and one row per (batch size, configuration):
    tokens (real emitted tokens, padding after EOS excluded), time (median over ``repeats``), tok/s,
    tok/fwd (per row, the paper's measure), tokens per forward call (batch), speed-up over AR, the
    limit and the efficiency described in the module docstring, the zero-overhead ``ideal`` speed-up,
    the loop's own overhead per step, and the share of rows whose output equals AR's. ``acceptances``: threshold
    mode's acceptance rules, each timed (the default rule's rows have ``acceptance`` None); ``plain_steps``: threshold
    mode at each tau < 1 also with mars_plain_steps=False (rows with ``plain_steps`` False). ``short_answers``: also
    time each call at batch 1 against MARS without a KV cache (`hf_mars.demo.short_answers`), under
    ``"short_answers"``.
    """
    if num_threads:
        torch.set_num_threads(int(num_threads))
    _check_counts(repeats, max_new_tokens, batch_sizes)
    from hf_mars.generation import enable_mars

    enable_mars(model)  # idempotent
    records = [to_record(p, f"prompts[{i}]") for i, p in enumerate(prompts)] if prompts is not None else load_prompts()
    if not records:
        raise ValueError("The prompt set is empty.")
    specs = build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, peers=peers,
                        draft_trees=draft_trees, acceptances=acceptances, plain_steps=plain_steps)
    say = log or (lambda msg: None)
    skipped = {}
    if any(spec.cache == "static+compile" for spec in specs):  # refused before anything runs, not minutes in
        from hf_mars.generation.cache import static_rollback_problem

        problem = static_rollback_problem(model)
        if problem:
            specs, skipped["static+compile"] = [s for s in specs if s.cache != "static+compile"], problem
            say(f"MARS on the static cache skipped (plain generate's static_compile peer still runs): {problem}")
    bench = _Bench(model, tokenizer, records, encode_prompts(tokenizer, [r["prompt"] for r in records], chat_template),
                   specs, resolve_block_size(model, block_size), max_new_tokens, cache_block, tuple(caches),
                   num_prompts, repeats, warmup, cost_repeats)
    info = machine_info(bench.device)
    settings = {
        "max_new_tokens": max_new_tokens, "block_size": bench.block_size, "cache_block": cache_block,
        "repeats": repeats, "warmup": warmup, "num_prompts": num_prompts, "prompts_available": len(records),
        "accuracy_reported": bench.scored,
        "mean_prompt_tokens": statistics.mean(len(e) for e in bench.encoded), "batch_sizes": list(batch_sizes),
        "thresholds": list(thresholds), "caches": list(caches), "verify_thresholds": list(verify_thresholds or ()),
        "peers": list(peers), "draft_trees": list(draft_trees or ()), "acceptances": list(acceptances),
        "short_answers": bool(short_answers), "eos_token_ids": bench.eos_ids, "skipped": skipped,
    }
    step_costs, rows = bench.measure(batch_sizes, progress, say)
    result = {"machine": info, "model": _model_size(model), "settings": settings, "step_costs": step_costs,
              "rows": rows}
    if short_answers:
        result["short_answers"] = _time_short_answers(bench, thresholds, "static_compile" in peers, say)
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _check_counts(repeats, max_new_tokens, batch_sizes) -> None:
    if repeats < 1:
        raise ValueError("repeats must be >= 1.")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1.")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError("batch_sizes must be a non-empty list of positive integers.")


def _time_short_answers(bench, thresholds, static_compile: bool, say) -> dict:
    """Each prompt one call at a time against MARS without a KV cache (the short-answer comparison)."""
    from hf_mars.bench.short_answers import benchmark_short_answers
    from hf_mars.generation import mask_token_id

    return benchmark_short_answers(
        bench.model, bench.encoded[:bench.num_prompts], thresholds, bench.block_size, mask_token_id(bench.model),
        bench.eos_ids, max_new_tokens=bench.max_new_tokens, repeats=bench.repeats, static_compile=static_compile,
        progress=say)


@dataclass
class _Bench:
    """What every batch size of one `benchmark_generation` call shares, and the three stages of a batch size:
    the timed generate calls, the step-cost table they are read against, and the result rows (`measure` runs
    them for every batch size)."""

    model: object
    tokenizer: object
    records: list
    encoded: list
    specs: list
    block_size: int  # the B the loop uses
    max_new_tokens: int
    cache_block: int
    caches: tuple
    num_prompts: int
    repeats: int
    warmup: int
    cost_repeats: int
    bar: object = None
    past_len: int = 0

    def __post_init__(self):
        self.device = next(self.model.parameters()).device
        self.eos_ids = _eos_ids(self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids or [0])[0]
        self.scored = any(r["answer"] is not None for r in self.records)  # accuracy over prompts with an answer
        # the cache length the step costs are measured at: a mean prompt plus half the reply
        self.past_len = int(statistics.mean(len(e) for e in self.encoded) + self.max_new_tokens / 2)

    def measure(self, batch_sizes, progress: bool, say) -> tuple[dict, list]:
        """Every batch size in turn: the timed runs, the step costs they are read against, the result rows."""
        step_costs, rows = {}, []
        self.bar = _tqdm(total=len(batch_sizes) * len(self.specs) * self.repeats, disable=not progress, desc="bench")
        for b in map(int, batch_sizes):
            per_spec = self.generate_all(b)
            costs, table = self.step_costs(b, per_spec)
            step_costs[str(b)] = costs
            say(f"batch {b}: cost(1) {costs['cost_1_ms']:.2f} ms, cost({1 + self.block_size}) "
                f"{costs[f'cost_{1 + self.block_size}_ms']:.2f} ms")
            rows += self.rows(b, per_spec, costs, table)
        self.bar.close()
        return step_costs, rows

    def generate_all(self, b: int) -> dict:
        """``{label: (spec, [runs per repeat])}`` at batch size ``b``, repeats interleaved across configurations
        (load drift on a shared machine hits all of them alike); each run is one `_generate_once` per batch.

        Each repeat runs the configurations in its own seeded order: what ran just before a configuration (another
        mode's allocations and cache state) otherwise favours or penalises the same one in every repeat. On the
        demo checkpoint at batch 16, verify 'auto' run right after 'chain' measured 1.03x it, right before it
        0.92x, the same layout chosen in both (5 repeats each)."""
        batches = make_batches(self.encoded, b, self.pad_id, self.num_prompts)
        batch_specs = [spec for spec in self.specs if not (spec.mode == "prompt_lookup" and b > 1)]  # batch 1 only
        per_spec = {spec.label: (spec, []) for spec in batch_specs}
        once = self._generate_once
        with ForwardRecorder(self.model, sync=False) as recorder:
            for spec in batch_specs:
                for bt in warm_up_batches(batches, self.warmup, compiled="compile_config" in spec.kwargs):
                    once(bt, spec, recorder)
            for repeat in range(self.repeats):
                order = list(batch_specs)
                random.Random(1000 * b + repeat).shuffle(order)
                for spec in order:
                    self.bar.set_postfix_str(f"b={b} {spec.label}")
                    per_spec[spec.label][1].append([once(bt, spec, recorder) for bt in batches])
                    self.bar.update(1)
        if self.device.type == "cuda":  # exact per-forward times need a sync per call: one extra instrumented pass
            with ForwardRecorder(self.model, sync=True) as rec2:
                for spec, reps in per_spec.values():
                    for j, bt in enumerate(batches):
                        r = once(bt, spec, rec2)
                        for runs in reps:
                            runs[j]["model_time"] = r["model_time"]
        return per_spec

    def _generate_once(self, batch, spec, recorder):
        """One generate call; with a measured policy (mars_draft_tree='auto' or 'cost', mars_plain_steps) also the
        layouts it chose (`policy.choices_for`)."""
        loop = {"cost": "tree", "auto": "call"}.get(spec.tree, "chunk" if spec.plain_steps else None)
        chosen = choices_for(self.model, batch[0].shape[0], loop) if loop else None
        before = dict(chosen or {})
        run = _generate_once(self.model, batch, spec, self.max_new_tokens, self.eos_ids, recorder, self.device)
        if chosen is not None:
            run["policy_layouts"] = {k: n - before.get(k, 0) for k, n in chosen.items() if n > before.get(k, 0)}
        return run

    def step_costs(self, b: int, per_spec: dict) -> tuple[dict, dict]:
        """Step costs at this batch size, at the runs' cache-length scale (prompt + half the reply): widths 1 and
        1 + B (the limit), the block-cache chunk, and every decode width the runs used (the width limit)."""
        bsz = self.block_size
        used = {w for _, reps in per_spec.values() for run in reps[0] for w in run["widths"][1:]}
        widths = {1, 1 + bsz} | ({self.cache_block} if any(c != "sliding" for c in self.caches) else set()) | used
        table = measure_step_costs(self.model, b, widths, self.past_len, self.cost_repeats, block_size=bsz,
                                   device=self.device)
        c1, cB = table[1], table[1 + bsz]
        costs = {"past_len": self.past_len, "cost_1_ms": c1 * 1e3, f"cost_{1 + bsz}_ms": cB * 1e3, "ratio": cB / c1,
                 "table_ms": {str(w): t * 1e3 for w, t in sorted(table.items())}}
        if self.cache_block in table:
            costs[f"cost_{self.cache_block}_ms"] = table[self.cache_block] * 1e3
        return costs, table

    def rows(self, b: int, per_spec: dict, costs: dict, table: dict) -> list[dict]:
        """One result row per configuration at batch size ``b``, each against AR and the best plain path."""
        rows, ar_row, ar_tokens = [], None, None
        for spec, reps in per_spec.values():
            row = summarise_runs(b, spec, reps, costs, self.block_size)
            decode_widths = [w for run in reps[0] for w in run["widths"][1:]]
            row["_predicted_s"] = sum(table[w] for w in decode_widths)
            row["draft_tree"] = spec.tree
            if spec.tree in ("cost", "auto") or spec.plain_steps:  # the layouts chosen (per step; auto: per call)
                row["policy_layouts"] = _layout_counts(run for runs in reps for run in runs)
            row["acceptance"] = spec.acceptance
            row["plain_steps"] = (spec.plain_steps if spec.mode == "mars" and spec.cache == "sliding"
                                  and spec.threshold < 1.0 else None)
            # what a decode step of this configuration costs, in plain decode steps (a tree is wider)
            row["step_cost_vs_1"] = row["_predicted_s"] / len(decode_widths) / table[1] if decode_widths else None
            toks = [t for run in reps[0] for t in run["new_tokens"]]  # row g of the run is records[g % len]
            if spec.mode == "ar":
                ar_row, ar_tokens = row, toks
            else:
                row["matches_ar"] = sum(x == y for x, y in zip(toks, ar_tokens)) / len(toks)
            if self.scored:
                row.update(self._accuracy(toks))
            rows.append(row)
        for row in rows:
            relative_figures(row, ar_row, costs)
            if "compile_config" in row["generate_kwargs"]:
                row.update(dict.fromkeys(COMPILED_BLANK))
        # against the fastest plain path a user can already have (plain generate, static cache + compile)
        plain = [r["tokens_per_s"] for r in rows if r["mode"] in ("ar", "ar_static_compile")]
        for row in rows:
            row["speedup_vs_best_plain"] = row["tokens_per_s"] / max(plain)
            row.pop("_predicted_s", None)
        return rows

    def _accuracy(self, toks) -> dict:
        records = self.records
        texts = self.tokenizer.batch_decode(toks, skip_special_tokens=True)
        hits = [score_record(records[g % len(records)], t) for g, t in enumerate(texts)
                if records[g % len(records)]["answer"] is not None]
        return {"accuracy": sum(hits) / len(hits) if hits else None, "accuracy_n": len(hits)}


def _layout_counts(runs) -> dict:
    """{layout: steps} summed over runs, the most chosen first."""
    total = {}
    for run in runs:
        for name, n in run.get("policy_layouts", {}).items():
            total[name] = total.get(name, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def _tqdm(**kw):
    try:
        from tqdm.auto import tqdm

        return tqdm(**kw)
    except ImportError:  # pragma: no cover
        class _Null:
            def update(self, *a):
                pass

            def set_postfix_str(self, *a):
                pass

            def close(self):
                pass

        return _Null()

