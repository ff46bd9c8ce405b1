"""The figures of one result row of `hf-mars bench`: what the timed runs of a configuration measured
(`summarise_runs`), then how it reads against plain `generate` (`relative_figures`: the speed-up, the limit
``tok/fwd x cost(1) / cost(1 + B)``, the efficiency and the zero-overhead ideal; `hf_mars.bench.measure`'s
docstring defines them).
"""

from __future__ import annotations

import statistics

__all__ = ["relative_figures", "summarise_runs"]


def summarise_runs(b, spec, reps, costs, bsz):
    """One configuration's row at batch size ``b`` from its repeats (``reps``: one list of per-batch runs per
    repeat): emitted tokens, median and best-of-repeats time, tokens per forward and per call, the decode widths,
    the model's time and the loop's own time per step."""
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


def relative_figures(row, ar, costs):
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
