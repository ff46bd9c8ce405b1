"""The acceptance rules, each written once, and the algorithm in one screen (`reference_decode`).

Every decoding path uses these functions, through the one acceptor (`acceptor.accept`): the fast path (processors
applied to all candidate slots at once, or slot by slot on the history AR would show) and the exact path for
stateful clients (one emitted position at a time). The paths differ only in where processors are called. The
per-row rules run on the host, on short python lists (a step brings each slot's token and flags over in one sync);
the per-distribution rules run on tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@torch.no_grad()
def reference_decode(model, prompt_ids, mask_token_id, block_size=4, threshold=0.95, max_new_tokens=32,
                     eos_token_ids=(), use_last_mask=False, cache="sliding", cache_block=16):
    """MARS threshold decoding of one prompt, literally: a full forward over [committed | masks] per step.

    Slow (no KV cache) and greedy only; it exists to be read, and the tests and the short-answer bench hold the
    fast loop to it. ``cache`` 'block' / 'block_trained': a step never crosses a ``cache_block`` chunk ('block'
    feeds masks to the chunk's end). Returns (generated token ids, forward passes).
    """
    device = next(model.parameters()).device
    tokens, generated, forwards = list(prompt_ids), [], 0
    candidates = block_size + 1 if use_last_mask else block_size  # the AR token + masks 1..candidates-1
    while len(generated) < max_new_tokens:
        in_chunk = len(generated) % cache_block
        masks = 0 if one_token(threshold) else cache_block - in_chunk if cache == "block" else candidates - 1
        logits = model(torch.tensor([tokens + [mask_token_id] * masks], device=device)).logits[0].float()
        forwards += 1
        slots = 1 + min(candidates - 1, masks)
        if cache != "sliding":
            slots = min(slots, cache_block - in_chunk)
        last_committed = len(tokens) - 1
        run, sure = [], []
        for j in range(min(slots, step_room(max_new_tokens - len(generated)))):
            scores = logits[last_committed + j].clone()  # candidate j: the AR position, then mask j
            scores[mask_token_id] = -math.inf  # the mask token is never emitted
            run.append(int(scores.argmax()))
            sure.append(float(torch.softmax(scores, -1).max()) >= threshold)
        run = run[:threshold_run(sure, len(run))]  # candidate 0 always; then left to right while confident
        stopped = cut_at_stop(run, tuple(eos_token_ids))
        tokens += run
        generated += run
        if stopped:
            break
        # (the fast loop also drops the masks' KV-cache entries here)
    return generated, forwards


# ------------------------------------------------------------------ per row, on the host


@dataclasses.dataclass
class Decision:
    """What a step decided, per row: the tokens it emits, whether it stopped, verify mode's next drafts (`acceptor`
    decides it)."""

    tokens: list
    stopped: list
    drafts: list | None
    scores: torch.Tensor | None  # the processed scores of the candidate slots (output_scores)
    paths: list | None = None  # a draft tree: each row's accepted nodes (`accepted_path`), whose columns stay
    emit_slots: list | None = None  # a draft tree: the slot each emitted token was chosen at (else token i: slot i)


def one_token(tau: float) -> bool:
    """tau >= 1 accepts exactly the AR token: a step reads candidate 0 only (an exact AR step, no masks needed)."""
    return tau >= 1.0


def step_room(remaining: int, max_accept: int | None = None) -> int:
    """Tokens a row may emit in one step: what its length limit leaves, at most ``max_accept`` (mars_max_accept)."""
    return min(remaining, max_accept or remaining)


def draft_room(remaining: int, max_accept: int | None = None) -> int:
    """Drafts a verify step may offer a row whose length limit leaves ``remaining`` tokens at that step: the
    drafts and the AR token after them must fit `step_room`."""
    return max(0, step_room(remaining, max_accept) - 1)


def leading_run(flags, start: int, stop: int) -> int:
    """How many of flags[start:stop] are true before the first false one."""
    i = start
    while i < stop and flags[i]:
        i += 1
    return i - start


def threshold_run(confident, slots: int) -> int:
    """Threshold mode: candidate 0 (the AR token) always, then slots left to right while confident (>= tau)."""
    return 1 + leading_run(confident, 1, slots)


def verify_row(chosen, drafts, kept=None, resampled=None) -> list:
    """Verify mode, one row: the pending drafts it accepts (`verified_drafts`) and then AR's token, the one chosen
    at the first slot not accepted (sampling: after a rejected draft, the residual's token ``resampled``)."""
    k = verified_drafts(chosen[:len(drafts)], drafts, kept)
    return list(drafts[:k]) + [resampled[k] if resampled is not None and k < len(drafts) else chosen[k]]


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


def draft_count(confident, first: int, slots: int) -> int:
    """Draft truncation: how many mask slots from ``first`` on (within the ``slots`` the row may use) become next
    drafts, up to the first one not confident (a chain's drafts and each depth of a draft tree)."""
    return leading_run(confident, first, slots)


def proposed_drafts(chosen, confident, first: int, slots: int) -> list:
    """Verify mode, after every pending draft was accepted: the next drafts are the mask slots after the AR token
    (from ``first`` on), truncated by `draft_count`."""
    return list(chosen[first:first + draft_count(confident, first, slots)])


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
    m = lockstep_count(len(tokens[r]) for r in going)
    c = min(len(drafts_next[r]) if m == pending[r] + 1 else 0 for r in going)
    for r in going:
        del tokens[r][m:]
        del drafts_next[r][c:]


def lockstep_count(counts) -> int:
    """Rows held in lockstep all take the fewest tokens any of them may take."""
    return min(counts)


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


def confident(mode: str, chosen, tau, scores=None, probs=None, of_distribution: bool = False):
    """Confidence >= tau: whether each candidate clears the threshold (``tau``: a float, or a per-row (b, 1) tensor).
    Every path (the slots read on the host, the compiled step that reads its own slots, the exact path's
    speculation, a draft tree's candidates) decides with this."""
    return confidence(mode, chosen, scores, probs, of_distribution=of_distribution) >= tau


def stops(tokens, eos_ids):
    """Device-side `cut_at_stop` test: which tokens end their row (``eos_ids``: a tensor; None: no EOS)."""
    if eos_ids is None:
        return torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    return torch.isin(tokens, eos_ids)


def verify_slot(scores, do_sample: bool, draft=None, q=None):
    """Device-side `verify_row` for one slot of every row (the exact path, one position at a time): AR's token
    and, where a pending ``draft`` sits at the slot, whether it is accepted (greedy: it equals the argmax;
    sampling: speculative sampling against its draft distribution ``q``, the residual's token where rejected)."""
    if not do_sample:
        token = scores.argmax(-1)
        return token, None if draft is None else token == draft
    p = torch.softmax(scores, dim=-1)
    if draft is None:
        return torch.multinomial(p, 1).squeeze(1), None
    kept, resampled = speculative_sample(p, q, draft)
    return torch.where(kept, draft, resampled), kept


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
