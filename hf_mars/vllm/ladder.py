"""vLLM's default ``batch_ladder`` (`options.default_batch_ladder`) from the arithmetic verify's policy weighs a
draft layout with (`hf_mars.generation.policy.tree_value`): at each batch size, the block size B whose expected
tokens per second is highest for a 2B + 1 wide step, from measured step costs and the drafts' pass rate."""

from __future__ import annotations

from hf_mars.generation.policy import Layout, tree_value


def expected_chain_tokens(per_depth: float, block: int) -> float:
    """Tokens a request emits per step with ``block`` chained drafts that each pass with ``per_depth``: 1 + the
    sum of P(reach depth d) (`tree_value` over a one-candidate-per-depth tree)."""
    if block <= 0:
        return 1.0
    return 1.0 + tree_value([[(0, per_depth)]] * block, Layout((1,) * block, block, 1.0))[2]


def per_depth_from_tokens(tokens_per_step: float, block: int) -> float:
    """The per-depth pass rate that gives ``tokens_per_step`` with ``block`` drafts (bisection on
    `expected_chain_tokens`): a measured tokens/forward turned into the rate the ladder weighs."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_chain_tokens(mid, block) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


def batch_ladder(costs, max_block: int, per_depth: float, width=lambda block: 2 * block + 1) -> list:
    """[(batch, B), ...] from 1 up: at each batch size the cost table knows, the block size B in 0..max_block
    whose expected tokens per second is highest (B = 0: plain steps); ``width``: the positions a request feeds
    per step with B drafts (vLLM's MARS step: B pending drafts, B masks and one token). Rungs repeat no B."""
    rungs = []
    for rows in sorted(costs.widths_by_rows()):
        best = max(range(max_block + 1), key=lambda block: _ladder_rate(costs, rows, block, per_depth, width) or -1.0)
        if _ladder_rate(costs, rows, best, per_depth, width) is None:
            continue
        if not rungs or rungs[-1][1] != best:
            rungs.append((rows, best))
    if rungs:
        rungs[0] = (1, rungs[0][1])
    return rungs


def _ladder_rate(costs, rows, block, per_depth, width):
    cost = costs.estimate(rows, width(block))
    return None if cost is None else expected_chain_tokens(per_depth, block) / cost
