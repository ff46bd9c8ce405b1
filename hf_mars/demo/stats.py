"""The statistics `hf-mars demo` reports: Wilson intervals, an exact paired test, and the quality-keeping τ.

A few hundred held-out questions resolve differences of about a point, no finer: every accuracy carries its
interval, and τ = 1 is compared with the AR-SFT baseline question by question (exact McNemar test) rather than by
headline accuracies.
"""

from __future__ import annotations

import math

QUALITY_MARGIN = 0.015  # "quality-keeping": within 1.5 accuracy points of tau = 1.0 (our quality-keeping criterion)


def wilson_interval(hits: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a proportion (well-behaved near 0 and 1, unlike the normal one)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def paired_comparison(a: list[bool], b: list[bool]) -> dict:
    """Paired comparison of two scorings of the same questions: exact McNemar test and a 95% interval of a - b.

    Only the discordant questions (right in one, wrong in the other) carry information; the interval's half
    width says how small a difference this many questions can resolve.
    """
    n = len(a)
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    m = only_a + only_b
    k = min(only_a, only_b)
    p_value = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m)
    diff = (only_a - only_b) / max(n, 1)
    se = math.sqrt(max(m - (only_a - only_b) ** 2 / max(n, 1), 0.0)) / max(n, 1)
    half = max(1.96 * se, 1.0 / max(n, 1))  # never claim more resolution than one question
    verdict = (f"differs (p = {p_value:.3g})" if p_value < 0.05 else
               f"no significant difference (p = {p_value:.2g}); with {n} paired questions the 95% interval of the "
               f"difference is ±{100 * half:.1f} points, so smaller differences cannot be told from noise")
    return {"n": n, "only_first_right": only_a, "only_second_right": only_b, "difference": round(diff, 4),
            "difference_ci95": [round(diff - half, 4), round(diff + half, 4)], "p_value_mcnemar_exact": p_value,
            "verdict": verdict}


def pick_quality_threshold(mars_rows, margin=QUALITY_MARGIN):
    """The sweep entry with the most tokens per forward whose accuracy is within ``margin`` of tau = 1.0."""
    one = next(r for r in mars_rows if r["threshold"] >= 1.0)
    ok = [r for r in mars_rows if r["accuracy"] >= one["accuracy"] - margin - 1e-9]
    return max(ok, key=lambda r: (r["tokens_per_forward"], r["threshold"]))

