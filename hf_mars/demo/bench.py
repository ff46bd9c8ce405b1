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
size, after a warm-up; each figure is the median over ``repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_mars.demo.bench_format import COLUMNS, format_table  # noqa: F401  (importable from here)
from hf_mars.demo.prompts import (  # noqa: F401  (the prompt helpers stay importable from here)
    BUILTIN_PROMPTS,
    encode_prompts,
    load_prompts,
    make_batches,
    score_record,
    to_record,
)
from hf_mars.demo.timing import (  # noqa: F401  (the timing harness stays importable from here)
    ForwardRecorder,
    _generate_batch,
    _sync,
    count_emitted,
    machine_info,
    measure_step_cost,
    measure_step_costs,
    time_interleaved,
)
from hf_mars.generation import (
    CACHE_MODES,
    DEFAULT_CACHE_BLOCK,
    DEFAULT_VERIFY_THRESHOLD,
)


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


# ----------------------------------------------------------------------------------------------- the benchmark


@dataclass
class RunSpec:
    """One decoding configuration of the benchmark."""

    mode: str  # "ar" | "ar_static_compile" | "prompt_lookup" (plain generate and its peers) | "mars" | "verify"
    threshold: float | None = None
    cache: str | None = None
    kwargs: dict = field(default_factory=dict)
    tree: str | None = None  # verify mode's mars_draft_tree

    @property
    def label(self) -> str:
        if self.mode in PLAIN_MODES:
            return self.mode
        tree = f",tree={self.tree}" if self.tree else ""
        return f"{self.mode}(tau={self.threshold:g},cache={self.cache}{tree})"


PEERS = ("prompt_lookup", "static_compile")  # what a user would run instead of MARS
PLAIN_MODES = ("ar", "ar_static_compile", "prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


def build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, verify_cache="sliding", peers=(),
                draft_trees=("auto",)):
    """Plain `generate`, the peers asked for, then every MARS configuration (verify: once per draft tree)."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"Unknown peer(s) {unknown}: use any of {PEERS}.")
    specs = [RunSpec("ar")]
    if "static_compile" in peers:  # transformers' documented fast path: static cache + torch.compile
        from transformers import CompileConfig

        from hf_mars._compat import compile_on_any_device

        specs.append(RunSpec("ar_static_compile", kwargs={
            "cache_implementation": "static", "compile_config": compile_on_any_device(CompileConfig())}))
    if "prompt_lookup" in peers:  # lossless, no training, built in (batch 1 only in transformers)
        specs.append(RunSpec("prompt_lookup", kwargs={"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}))
    for cache in caches:
        if cache not in CACHE_MODES:
            raise ValueError(f"Unknown cache mode {cache!r}: use one of {CACHE_MODES}.")
        for tau in thresholds:
            kw = {"mars": True, "mars_threshold": float(tau), "mars_cache": cache}
            if block_size is not None:
                kw["mars_block_size"] = int(block_size)
            if cache != "sliding":
                kw["mars_cache_block"] = int(cache_block)
            specs.append(RunSpec("mars", float(tau), cache, kw))
    for tau in verify_thresholds or ():
        kw = {"mars": True, "mars_threshold": float(tau), "mars_verify": True, "mars_cache": verify_cache}
        if block_size is not None:
            kw["mars_block_size"] = int(block_size)
        for tree in draft_trees or ("auto",):
            specs.append(RunSpec("verify", float(tau), verify_cache, {**kw, "mars_draft_tree": tree}, tree))
        if "static_compile" in peers:  # MARS on the same fast path as the compiled plain peer (the chain: a static
            # cache cannot hold a tree's gathered path)
            specs.append(RunSpec("verify", float(tau), "static+compile", {**kw, **specs[1].kwargs}))
    for spec in specs:
        if spec.mode in PLAIN_MODES:
            continue
        if not 0.0 <= spec.threshold <= 1.0:
            raise ValueError(f"Thresholds must lie in [0, 1], got {spec.threshold}.")
    return specs


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


def _model_size(model) -> dict:
    cfg = model.config
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype),
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
                         draft_trees=("auto",), short_answers=False) -> dict:
    """Benchmark MARS decoding against plain greedy `generate` (KV cache) on one model, in one process.

    ``model`` must have `enable_mars` applied (done here when it is not). Returns a JSON-able dict with
    the machine, the model, the step costs per batch size and one row per (batch size, configuration):
    tokens (real emitted tokens, padding after EOS excluded), time (median over ``repeats``), tok/s,
    tok/fwd (per row, the paper's measure), tokens per forward call (batch), speed-up over AR, the
    limit and the efficiency described in the module docstring, the zero-overhead ``ideal`` speed-up,
    the loop's own overhead per step, and the share of rows whose output equals AR's. ``short_answers``: also
    time each call at batch 1 against MARS without a KV cache (`hf_mars.demo.short_answers`), under
    ``"short_answers"``.
    """
    if num_threads:
        torch.set_num_threads(int(num_threads))
    if repeats < 1:
        raise ValueError("repeats must be >= 1.")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1.")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError("batch_sizes must be a non-empty list of positive integers.")
    from hf_mars.generation import enable_mars

    enable_mars(model)  # idempotent
    records = [to_record(p, f"prompts[{i}]") for i, p in enumerate(prompts)] if prompts is not None else load_prompts()
    if not records:
        raise ValueError("The prompt set is empty.")
    specs = build_specs(thresholds, caches, verify_thresholds, block_size, cache_block, peers=peers,
                        draft_trees=draft_trees)
    bench = _Bench(model, tokenizer, records, encode_prompts(tokenizer, [r["prompt"] for r in records], chat_template),
                   specs, resolve_block_size(model, block_size), max_new_tokens, cache_block, tuple(caches),
                   num_prompts, repeats, warmup, cost_repeats)
    info = machine_info(bench.device)
    result = {
        "machine": info,
        "model": _model_size(model),
        "settings": {
            "max_new_tokens": max_new_tokens, "block_size": bench.block_size, "cache_block": cache_block,
            "repeats": repeats, "warmup": warmup, "num_prompts": num_prompts, "prompts_available": len(records),
            "accuracy_reported": bench.scored,
            "mean_prompt_tokens": statistics.mean(len(e) for e in bench.encoded), "batch_sizes": list(batch_sizes),
            "thresholds": list(thresholds), "caches": list(caches), "verify_thresholds": list(verify_thresholds or ()),
            "peers": list(peers), "draft_trees": list(draft_trees or ()),
            "short_answers": bool(short_answers), "eos_token_ids": bench.eos_ids,
        },
        "step_costs": {},
        "rows": [],
    }
    say = log or (lambda msg: None)
    bench.bar = _tqdm(total=len(batch_sizes) * len(specs) * repeats, disable=not progress, desc="bench")
    bench.past_len = int(result["settings"]["mean_prompt_tokens"] + max_new_tokens / 2)
    for b in batch_sizes:
        b = int(b)
        per_spec = bench.generate_all(b)
        costs, table = bench.step_costs(b, per_spec)
        result["step_costs"][str(b)] = costs
        say(f"batch {b}: cost(1) {costs['cost_1_ms']:.2f} ms, cost({1 + bench.block_size}) "
            f"{costs[f'cost_{1 + bench.block_size}_ms']:.2f} ms")
        result["rows"] += bench.rows(b, per_spec, costs, table)
    bench.bar.close()
    if short_answers:
        from hf_mars.demo.short_answers import benchmark_short_answers
        from hf_mars.generation import mask_token_id

        result["short_answers"] = benchmark_short_answers(
            model, bench.encoded[:num_prompts], thresholds, bench.block_size, mask_token_id(model), bench.eos_ids,
            max_new_tokens=max_new_tokens, repeats=repeats, static_compile="static_compile" in peers, progress=say)
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


@dataclass
class _Bench:
    """What every batch size of one `benchmark_generation` call shares, and the three stages of a batch size:
    the timed generate calls, the step-cost table they are read against, and the result rows."""

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

    def generate_all(self, b: int) -> dict:
        """``{label: (spec, [runs per repeat])}`` at batch size ``b``, repeats interleaved across configurations
        (load drift on a shared machine hits all of them alike); each run is one `_generate_once` per batch."""
        batches = make_batches(self.encoded, b, self.pad_id, self.num_prompts)
        batch_specs = [spec for spec in self.specs if not (spec.mode == "prompt_lookup" and b > 1)]  # batch 1 only
        per_spec = {spec.label: (spec, []) for spec in batch_specs}
        once = self._generate_once
        with ForwardRecorder(self.model, sync=False) as recorder:
            for spec in batch_specs:
                # a compiled forward compiles once per shape: warm it on every batch, so no timed call compiles
                warm = batches if "compile_config" in spec.kwargs else batches[:1]
                for _ in range(self.warmup):
                    for bt in warm:
                        once(bt, spec, recorder)
            for _ in range(self.repeats):
                for spec in batch_specs:
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
        return _generate_once(self.model, batch, spec, self.max_new_tokens, self.eos_ids, recorder, self.device)

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
            row = _summarise(b, spec, reps, costs, self.block_size)
            decode_widths = [w for run in reps[0] for w in run["widths"][1:]]
            row["_predicted_s"] = sum(table[w] for w in decode_widths)
            row["draft_tree"] = spec.tree
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
            _relative(row, ar_row, costs)
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


def _summarise(b, spec, reps, costs, bsz):
    times = [sum(r["time"] for r in runs) for runs in reps]
    model_times = [sum(r["model_time"] for r in runs) for runs in reps]
    runs = reps[0]  # greedy: token counts are the same on every repeat
    tokens = int(sum(int(r["emitted"].sum()) for r in runs))
    row_fwd = int(sum(int(r["row_forwards"].sum()) for r in runs))
    calls = int(sum(r["calls"] for r in runs))
    widths = [w for r in runs for w in r["widths"][1:]]  # decode steps (the first call is the prefill)
    t = statistics.median(times)
    mt = statistics.median(model_times)
    # best-of-repeats per generate call: on a shared machine the least disturbed estimate
    t_min = sum(min(reps[k][j]["time"] for k in range(len(reps))) for j in range(len(runs)))
    row = {
        "batch_size": b,
        "mode": spec.mode,
        "threshold": spec.threshold,
        "cache": spec.cache,
        "generate_kwargs": spec.kwargs,
        "tokens": tokens,
        "time_s": t,
        "times_s": times,
        "tokens_per_s": tokens / t if t > 0 else float("nan"),
        "time_min_s": t_min,
        "tokens_per_s_min": tokens / t_min if t_min > 0 else float("nan"),
        "tokens_per_forward": tokens / row_fwd if row_fwd else float("nan"),
        "forward_calls": calls,
        "tokens_per_call": tokens / calls if calls else float("nan"),
        "mean_decode_width": statistics.mean(widths) if widths else float("nan"),
        "model_time_s": mt,
        "overhead_ms_per_step": (t - mt) / calls * 1e3 if calls else float("nan"),
        "model_ms_per_step": mt / calls * 1e3 if calls else float("nan"),
    }
    stats_emit = [r["stats_emitted"] for r in runs]
    if all(s is not None for s in stats_emit):
        row["stats_emitted_tokens"] = int(sum(int(s.sum()) for s in stats_emit))
    if spec.mode == "ar":
        # sanity: plain generate runs exactly one forward per step until the longest row stops
        row["forward_calls_consistent"] = all(r["calls"] == int(r["emitted"].max()) for r in runs)
    return row


def _relative(row, ar, costs):
    """Speed-up over AR, the limit tok/fwd x cost(1)/cost(1+B), efficiency and the zero-overhead ideal."""
    if row["mode"] == "ar":
        row.update(speedup_vs_ar=1.0, speedup_min=1.0, limit=None, efficiency=None, limit_w=None, ideal=1.0)
        return
    speedup = row["tokens_per_s"] / ar["tokens_per_s"]
    row["speedup_min"] = row["tokens_per_s_min"] / ar["tokens_per_s_min"]
    per_call_gain = row["tokens_per_call"] / ar["tokens_per_call"]
    # a loop that appends no masks (tau = 1 one-token mode) runs 1-wide steps: its bound is the token gain alone
    one_wide = not (row["mean_decode_width"] > 1)  # also when there was no decode step at all (NaN)
    limit = per_call_gain if one_wide else per_call_gain / costs["ratio"]
    # the same bound with the widths the loop really forwarded (a sliding step re-feeds the k tokens it
    # accepted last step plus B masks, so it is k + B wide, not 1 + B), from the measured cost table
    if row["_predicted_s"] > 0 and ar["_predicted_s"] > 0:
        row["limit_w"] = (row["tokens"] / ar["tokens"]) * ar["_predicted_s"] / row["_predicted_s"]
    ar_rate_model = ar["tokens"] / ar["model_time_s"] if ar["model_time_s"] > 0 else float("nan")
    mars_rate_model = row["tokens"] / row["model_time_s"] if row["model_time_s"] > 0 else float("nan")
    row.update(
        speedup_vs_ar=speedup,
        limit=limit,
        efficiency=speedup / limit if limit > 0 else float("nan"),
        ideal=mars_rate_model / ar_rate_model,
    )


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


# ----------------------------------------------------------------------------------------------- CLI


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, so a reader knows what a run measures without the flag; not for flags
    that are unset or off by default, or whose help already says what applies."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser):
    parser.formatter_class = _DefaultsHelpFormatter
    parser.add_argument("--model", required=True, help="Checkpoint folder (AutoModelForCausalLM + AutoTokenizer, with the MARS mask token).")
    parser.add_argument("--prompts", default=None,
                        help="Prompt file: .txt (one per line), .jsonl or .json (strings, {'prompt': ...}, {'messages': [...]}). "
                             "Default: the demo's held-out prompts if available, else a built-in list.")
    parser.add_argument("--num-prompts", type=int, default=16, help="Prompts per configuration and batch size (cycled if fewer).")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.95, 0.9], help="MARS tau values.")
    parser.add_argument("--caches", nargs="+", default=["sliding", "block"], choices=list(CACHE_MODES),
                        help="MARS cache modes: sliding window, the paper's block cache, or block_trained "
                             "(block chunks fed as [accepted | B masks]).")
    parser.add_argument("--verify-thresholds", type=float, nargs="*", default=[DEFAULT_VERIFY_THRESHOLD],
                        help="tau values for lossless verify mode (none: skip verify).")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                        help="What a user would run instead, timed in the same run: prompt-lookup decoding (batch 1) and "
                             "plain generate with the static cache + torch.compile (warm-up compiles; none: skip).")
    parser.add_argument("--draft-trees", nargs="*", default=["auto", "chain"],
                        help="Verify mode's mars_draft_tree settings, each benchmarked ('auto', 'chain' or a shape "
                             "like '2,1,1,1'); the table reports each one's tokens per forward, its step cost against "
                             "a 1-token step and the speed-up limit from the widths it forwarded.")
    parser.add_argument("--short-answers", action="store_true",
                        help="Also time every prompt one call at a time (batch 1) at each --thresholds tau against "
                             "MARS without a KV cache (the method's own sampler: the whole sequence re-run every "
                             "step) and plain generate; with the static_compile peer, MARS on the static cache + "
                             "compile too. Reports ms per call and identical answers.")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="Batch sizes timed.")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt.")
    parser.add_argument("--block-size", type=int, default=None, help="MARS B (default: the checkpoint's).")
    parser.add_argument("--cache-block", type=int, default=DEFAULT_CACHE_BLOCK, help="Block cache chunk (mars_cache_block).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed repeats; the median is reported.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed warm-up generates per configuration.")
    parser.add_argument("--cost-repeats", type=int, default=30,
                        help="Timed calls per width in the step-cost table (the fastest is kept).")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice).")
    parser.add_argument("--device", default="cpu", help="Device the model runs on.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="The model's dtype.")
    parser.add_argument("--no-chat-template", action="store_true", help="Feed text prompts raw instead of as a user turn.")
    parser.add_argument("--output", default=None, help="Write the JSON result here.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")


def run(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    for flag in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a folder; pass a saved checkpoint directory.")
    from transformers import AutoConfig

    meta = getattr(AutoConfig.from_pretrained(args.model), "mars", None) or {}  # before loading any weights
    if "mask_token_id" not in meta:
        raise ValueError(f"{args.model} has no MARS mask token in config.json ('mars': {{'mask_token_id': ...}}); "
                         "train it with MARSTrainer or call hf_mars.add_mask_token first.")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    from hf_mars.generation import enable_mars

    enable_mars(model)
    prompts = load_prompts(args.prompts)
    result = benchmark_generation(
        model, tokenizer, prompts, thresholds=args.thresholds, batch_sizes=args.batch_sizes, caches=args.caches,
        verify_thresholds=args.verify_thresholds, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
        cache_block=args.cache_block, num_prompts=args.num_prompts, repeats=args.repeats, warmup=args.warmup,
        num_threads=args.threads, cost_repeats=args.cost_repeats, chat_template=False if args.no_chat_template else None, progress=not args.quiet,
        peers=tuple(args.peers), draft_trees=tuple(args.draft_trees), short_answers=args.short_answers,
    )
    result["settings"]["model_path"] = str(args.model)
    result["settings"]["prompts_path"] = args.prompts
    print(format_table(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
        print(f"wrote {args.output}")
    return 0


def _json_default(o):
    if torch.is_tensor(o):
        return o.tolist()
    if hasattr(o, "to_dict"):  # e.g. a CompileConfig among the generate arguments
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
