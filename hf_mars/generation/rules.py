"""The acceptance rules, each written once, and the algorithm in one screen (`reference_decode`).

Every decoding path uses these functions: the fast path (processors applied to all candidate slots at once, or
slot by slot on the history AR would show) and the exact path for stateful clients (one emitted position at a
time). The paths differ only in where processors are called. The per-row rules run on the host, on short python
lists (a step brings each slot's token and flags over in one sync); the per-distribution rules run on tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@torch.no_grad()
def reference_decode(model, prompt_ids, mask_token_id, block_size=4, threshold=0.95, max_new_tokens=32,
                     eos_token_ids=(), use_last_mask=False):
    """MARS threshold decoding of one prompt, literally: a full forward over [committed | masks] per step.

    Slow (no KV cache) and greedy only; it exists to be read, and the tests hold the fast loop to it.
    Returns (generated token ids, forward passes).
    """
    tokens, generated, forwards = list(prompt_ids), [], 0
    candidates = block_size + 1 if use_last_mask else block_size  # the AR token + masks 1..candidates-1
    while len(generated) < max_new_tokens:
        masks = 0 if threshold >= 1.0 else candidates - 1
        logits = model(torch.tensor([tokens + [mask_token_id] * masks])).logits[0].float()
        forwards += 1
        last_committed = len(tokens) - 1
        for j in range(min(1 + masks, max_new_tokens - len(generated))):
            scores = logits[last_committed + j].clone()  # candidate j: the AR position, then mask j
            scores[mask_token_id] = -math.inf  # the mask token is never emitted
            token = int(scores.argmax())
            if j > 0 and float(torch.softmax(scores, -1)[token]) < threshold:
                break  # candidate 0 is always accepted; then left to right while confident
            tokens.append(token)
            generated.append(token)
            if token in eos_token_ids:
                return generated, forwards
        # (the fast loop also drops the masks' KV-cache entries here)
    return generated, forwards


# ------------------------------------------------------------------ per row, on the host


@dataclasses.dataclass
class Decision:
    """What a step decided, per row: the tokens it emits, whether it stopped, verify mode's next drafts."""

    tokens: list
    stopped: list
    drafts: list | None
    scores: torch.Tensor | None  # the processed scores of the candidate slots (output_scores)


def leading_run(flags, start: int, stop: int) -> int:
    """How many of flags[start:stop] are true before the first false one."""
    i = start
    while i < stop and flags[i]:
        i += 1
    return i - start


def threshold_run(confident, slots: int) -> int:
    """Threshold mode: candidate 0 (the AR token) always, then slots left to right while confident (>= tau)."""
    return 1 + leading_run(confident, 1, slots)


def verified_drafts(chosen, drafts, kept=None) -> int:
    """Verify mode: how many pending drafts are accepted. Greedy: while each equals the AR token chosen at its slot;
    sampling: while speculative sampling kept it (`speculative_sample`)."""
    if kept is None:
        kept = [c == t for c, t in zip(chosen, drafts)]
    return leading_run(kept, 0, len(drafts))


def accepted_path(children, tokens, choice) -> list:
    """Verify mode with a draft tree: the longest path from the root whose every node holds the token AR chose at
    its parent. ``children[n]``: node n's children (n = -1 is the root, the last committed token); ``tokens[n]``:
    node n's draft; ``choice(n)``: the AR token chosen at node n. A chain is the tree where each node has one
    child, and this is then `verified_drafts`. Returns the accepted nodes, root first excluded."""
    path, node = [], -1
    while True:
        ar = choice(node)
        node = next((c for c in children.get(node, ()) if tokens[c] == ar), None)
        if node is None:
            return path
        path.append(node)


def proposed_drafts(chosen, confident, first: int, slots: int) -> list:
    """Verify mode, after every pending draft was accepted: the next drafts are the mask slots after the AR token
    (from ``first`` on, within the ``slots`` the row may use), truncated at the first one not confident."""
    return list(chosen[first:first + leading_run(confident, first, slots)])


def cut_at_stop(tokens: list, stops) -> bool:
    """End the run after its first token that ends the row (an EOS id, or a true entry of a per-token list of
    criteria hits); returns whether it stopped. Nothing after a stop is emitted, as in AR decoding."""
    for i, t in enumerate(tokens):
        if (t in stops) if isinstance(stops, (set, frozenset, tuple)) else stops[i]:
            del tokens[i + 1:]
            return True
    return False


def lockstep(rows, tokens, drafts_next, stopped, pending) -> None:
    """Rows that go on accept the fewest tokens any of them accepted (a row that stops keeps its run and ends);
    new drafts only where a row accepted all its pending drafts and the AR token, then as many in every row.
    Emitting fewer accepted tokens changes no token: each is the one AR decoding picks. In place."""
    going = [r for r in rows if not stopped[r]]
    if not going:
        return
    m = min(len(tokens[r]) for r in going)
    c = min(len(drafts_next[r]) if m == pending[r] + 1 else 0 for r in going)
    for r in going:
        del tokens[r][m:]
        del drafts_next[r][c:]


# ------------------------------------------------------------------ per distribution, on tensors


def take_columns(values, index):
    """Per row, the columns ``index`` (rows, K) names of ``values`` (rows, W, V): a (rows, K, V) tensor."""
    return values.gather(1, index[:, :, None].expand(-1, -1, values.shape[-1]))


def choose(scores, do_sample: bool):
    """The token of each processed distribution: argmax, or a draw when sampling."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(scores.shape[:-1])
    return scores.argmax(-1)


def confidence(mode: str, chosen, scores=None, probs=None, of_distribution: bool = False):
    """Confidence on one scale for every acceptance mode: a candidate is accepted when it is >= tau.
    ``of_distribution``: the distribution's largest probability instead of the chosen token's (greedy, where they
    are the same, and draft truncation, which must not depend on the drawn token)."""
    if probs is None:
        probs = torch.softmax(scores, dim=-1)
    if mode == "probability":
        if of_distribution:
            return probs.amax(-1)
        return probs.gather(-1, chosen[..., None]).squeeze(-1)
    if mode == "entropy":
        # exp(-H): 1 for a certain distribution, 1/k for uniform over k tokens; >= tau <=> H <= -ln(tau)
        return torch.exp(-torch.special.entr(probs).sum(-1))
    top2 = probs.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def speculative_sample(p, q, draft):
    """Speculative sampling of drafts drawn from q, against the target p (one slot (b, V) or several (b, S, V)):
    keep a draft with probability min(1, p/q); where it is rejected the token comes from normalised
    max(p - q, 0). Returns (kept, the residual's token); the output is distributed exactly as sampling p."""
    pd = p.gather(-1, draft[..., None]).squeeze(-1)
    qd = q.gather(-1, draft[..., None]).squeeze(-1)
    kept = torch.rand(pd.shape, device=p.device) * qd < pd
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
    resampled = torch.multinomial(dist.reshape(-1, dist.shape[-1]), 1).view(draft.shape)
    return kept, resampled
