"""The acceptor: what a step emits, decided from its candidate slots by `rules.py`'s rules (`accept`).

Every proposer (`proposers.py`) lays a step out and runs the forward; the acceptor alone turns the slots' logits
into a `Decision`, as vLLM's rejection sampler is the one part of its speculative decoding that decides. It reads
the slots (the suppressed ids at -inf, the processor chain applied: `process`), brings what the rules need to the
host in the step's one sync (`to_host`; stateful clients need one per position) and applies them row by row.
The ways of accepting differ only where the rules do:

- threshold mode: candidate 0, then slots while confident (`rules.threshold_run`);
- verify mode's chain: the pending drafts AR agrees with and AR's token, the next drafts when all were accepted
  (`rules.verify_row`, `rules.proposed_drafts`);
- a draft tree: the path AR agrees with and the next candidates from its masks (`rules.accepted_path`);
- stateful processors or criteria: position by position with the real objects, rows in lockstep (`_exact`).

What they share is written once here: each run cut after its first EOS and then after the first position a
stopping criterion stops (`_cut_at_stops`), and rows that move together evened (`_decision`, `rules.lockstep`).
"""

from __future__ import annotations

import copy

import torch
from transformers.generation import logits_process as _lp
from transformers.utils import logging as _hf_logging

from .clients import history_free
from .outputs import in_emitted_order
from .plan import to_device
from .rules import (
    Decision,
    accepted_path,
    choose,
    confident,
    cut_at_stop,
    draft_count,
    lockstep,
    lockstep_count,
    proposed_drafts,
    speculative_sample,
    stops,
    threshold_run,
    verify_row,
    verify_slot,
)
from .state import SlotRead, by_row

_logger = _hf_logging.get_logger(__name__)

PROB_SCALE = 1 << 20  # a draft tree's candidate probabilities cross to the host as integers beside the token ids


def accept(dec, plan, slots, trees=None, groups=None) -> Decision:
    """Decide ``dec``'s step ``plan``, whichever proposer laid it out. ``slots``: the candidate slots' logits (rows,
    slots, vocab) as the forward gave them, or the `SlotRead` a compiled step already read in its graph (greedy, no
    processor); ``trees`` / ``groups``: a draft tree step's per-row trees and mask-group sizes."""
    if isinstance(slots, SlotRead):
        return _threshold_or_chain(dec, plan, slots)
    slot_logits = _suppressed(dec, slots)
    if trees is not None:
        return _tree(dec, plan, slot_logits, trees, groups)
    if dec.clients.exact:
        return _exact(dec, plan, slot_logits)
    return _threshold_or_chain(dec, plan, read_slots(dec, plan, slot_logits))


def _suppressed(dec, slot_logits):
    """The slots' logits in float32 with the suppressed ids (the mask token, SuppressTokens') at -inf, a new tensor
    (processors may write in place); the raw ones are kept first for output_logits (`Outputs.keep_raw`)."""
    slot_logits = slot_logits.float()  # (a view of the forward's output where it already is float32)
    dec.outputs.keep_raw(slot_logits)
    return slot_logits.index_fill(-1, dec.limits.suppress_t, float("-inf"))


def to_host(*parts) -> list:
    """Device tensors as python lists in one device->host copy, the step's one sync: each part flattened,
    concatenated (flags promote to ints) and split back."""
    if len(parts) == 1:
        return [parts[0].reshape(-1).tolist()]
    flat = torch.cat([p.reshape(-1) for p in parts]).tolist()
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + p.numel()])
        at += p.numel()
    return out


def _confident(dec, chosen, of_distribution, scores=None, probs=None):
    """Whether each slot's confidence clears its row's tau (`rules.confident`)."""
    tau = dec.opts.threshold if dec.row_tensors.tau is None else dec.row_tensors.tau
    return confident(dec.opts.acceptance, chosen, tau, scores, probs, of_distribution=of_distribution)


# ------------------------------------------------------------------ reading the slots


def process(dec, plan, slot_logits, chain, stop_at_ends=False):
    """Run a processor chain on every slot and choose a token for it. A chain that ignores input_ids is one
    call for all slots; otherwise slot s of row r is processed on the row's history extended by the tokens
    of slots 0..s-1 (drafts where pending, chosen tokens otherwise), exactly what AR decoding would pass,
    written into `seq` as it goes. Rows are grouped by history length; every call gets the full batch
    (processors may hold per-row state) and rows outside the group are discarded. ``stop_at_ends`` (a chain
    holding stateful objects): no history goes on past a row's EOS, as in AR decoding (grammar matchers raise
    when handed one); once every row has ended no further slot is processed (none can be emitted)."""
    if history_free(chain):
        if len(chain) == 0:
            return slot_logits, choose(slot_logits, dec.do_sample)
        b, S, V = slot_logits.shape
        history = torch.zeros((b * S, 1), dtype=torch.long, device=dec.device)  # (read by none of them)
        scores = chain(history, slot_logits.reshape(-1, V)).view(b, S, V)
        return scores, choose(scores, dec.do_sample)
    P, S = dec.prompt_len, plan.max_slots
    groups = {}
    for r in plan.rows:
        groups.setdefault(dec.rows.emitted[r], []).append(r)
    group_rows = {g: to_device(rs, dec.device) for g, rs in groups.items()}
    scores = torch.empty_like(slot_logits)
    pad, eos_t, seq = dec.limits.pad, dec.limits.eos_t, dec.history.seq
    chosen = torch.full(slot_logits.shape[:2], pad, dtype=torch.long, device=dec.device)
    stop_at_ends = stop_at_ends and eos_t is not None
    ended = None if plan.active_t is None else ~plan.active_t  # rows whose history takes pads from here on
    if stop_at_ends and ended is None:
        ended = torch.zeros(dec.batch, dtype=torch.bool, device=dec.device)
    for s in range(S):
        if s > 0 and stop_at_ends and bool(ended.all()):  # the rest is never emitted: raw logits, pads
            scores[:, s:] = slot_logits[:, s:]
            seq.scatter_(1, plan.slot_pos_t[:, s:], pad)
            break
        for g, rs in group_rows.items():
            processed = chain(seq[:, :P + g + s], slot_logits[:, s].clone())
            if len(group_rows) == 1:
                scores[:, s] = processed
            else:
                scores[rs, s] = processed[rs]
        tok = choose(scores[:, s], dec.do_sample)
        chosen[:, s] = tok
        ext = tok if plan.forced_mask_t is None else torch.where(plan.forced_mask_t[:, s], plan.forced_t[:, s], tok)
        if ended is not None:
            ext = torch.where(ended, pad, ext)
        seq.scatter_(1, plan.slot_pos_t[:, s:s + 1], ext[:, None])
        if stop_at_ends:
            ended = ended | stops(ext, eos_t) | stops(tok, eos_t)
    return scores, chosen


def read_slots(dec, plan, slot_logits) -> SlotRead:
    """Process the candidates and bring each slot's token and confidence flag to the host (verify sampling: each
    pending draft's speculative-sampling outcome too), in the step's one sync."""
    S, b, verify, sampling = plan.max_slots, dec.batch, dec.opts.verify, dec.do_sample
    scores, chosen = process(dec, plan, slot_logits, dec.clients.processors)
    parts, flags = [chosen], not (dec.shape.one_token or S == 1)
    if flags:
        parts.append(_confident(dec, chosen, of_distribution=verify or not sampling, scores=scores))
    Dm = max(plan.drafts)
    sampled = verify and sampling and Dm > 0
    if verify and sampling:
        probs = torch.softmax(scores, dim=-1)
        if sampled:
            parts += speculative_sample(probs[:, :Dm], dec.row_tensors.q_drafts[:, :Dm], plan.forced_t[:, :Dm])
        if plan.q_idx_t is not None:  # the distributions the next drafts are drawn from
            dec.row_tensors.keep_draft_distributions(probs, plan.q_idx_t)
    host = [by_row(values, b) for values in to_host(*parts)]
    kept, resampled = host[-2:] if sampled else (None, None)
    return SlotRead(host[0], host[1] if flags else None, kept, resampled, scores)


# ------------------------------------------------------------------ the ways of accepting


def _threshold_or_chain(dec, plan, read: SlotRead) -> Decision:
    """Threshold mode accepts candidate 0 and then slots while confident (`rules.threshold_run`; candidate 0 alone
    where no flags were read: one-token steps); verify mode's chain per `_chain_row`."""
    b, verify = dec.batch, dec.opts.verify
    tokens = [[] for _ in range(b)]
    drafts = [[] for _ in range(b)] if verify else None
    for r in plan.rows:
        sure = None if read.confident is None else read.confident[r]
        if verify:
            tokens[r], drafts[r] = _chain_row(read, r, sure, dec.rows.drafts[r], plan.slots[r])
        else:
            tokens[r] = read.chosen[r][:threshold_run(sure, plan.slots[r]) if sure is not None else 1]
    return _decision(dec, plan, tokens, _cut_at_stops(dec, plan, tokens, read.scores), drafts, read.scores)


def _chain_row(read, r, sure, pending, slots) -> tuple:
    """Verify mode's chain, row ``r``: the pending drafts AR agrees with plus AR's token (`rules.verify_row`) and,
    when all were accepted, the confident mask slots after it as the next drafts (`rules.proposed_drafts`)."""
    chosen = read.chosen[r]
    kept, resampled = (None, None) if read.kept is None else (read.kept[r], read.resampled[r])
    tokens = verify_row(chosen, pending, kept, resampled)
    if len(tokens) < len(pending) + 1 or sure is None:
        return tokens, []
    return tokens, proposed_drafts(chosen, sure, len(pending) + 1, slots)


def _tree(dec, plan, slot_logits, trees, groups) -> Decision:
    """A draft tree step (or its root, whose trees are empty): AR's token at every slot, each slot's confidence and
    each mask's top-k tokens and probabilities, in one sync; per row the accepted path plus AR's token after it
    (`rules.accepted_path`) and the next candidates (`_next_candidates`). Slot 0 is the root, 1 + n node n, then
    the mask groups."""
    b = dec.batch
    scores, chosen = process(dec, plan, slot_logits, dec.clients.processors)
    k = max(dec.propose_shape)
    probs = torch.softmax(scores, dim=-1)
    top = probs.topk(k, dim=-1)
    host = to_host(chosen, _confident(dec, chosen, of_distribution=True, probs=probs), top.indices,
                   (top.values * PROB_SCALE).round().long())
    ar, sure, top_ids, top_probs = (by_row(values, b) for values in host)
    tokens, drafts, paths, emit_slots = ([[] for _ in range(b)] for _ in range(4))
    for r in plan.rows:
        paths[r] = accepted_path(trees[r].children(), trees[r].tokens, lambda n, row=ar[r]: row[n + 1])
        tokens[r] = [trees[r].tokens[n] for n in paths[r]] + [ar[r][paths[r][-1] + 1 if paths[r] else 0]]
        emit_slots[r] = [0] + [n + 1 for n in paths[r]]
        drafts[r] = _next_candidates(trees[r], groups[r], paths[r], sure[r], top_ids[r], top_probs[r], k,
                                     dec.propose_shape)
    stopped = _cut_at_stops(dec, plan, tokens, scores, emit_slots)
    return _decision(dec, plan, tokens, stopped, drafts, scores, paths, emit_slots)


def _next_candidates(tree, group, path, sure, top_ids, top_probs, k, propose_shape) -> list:
    """A row's next tree candidates, per depth (token, probability) pairs: the masks after the path's last node;
    when it has none, the later masks of its deepest ancestor that has (they predict the same positions from a
    shorter prefix). Leading depths whose top probability clears the draft tau, as the chain truncates its drafts
    (`rules.draft_count`); none when no node on the path has masks."""
    last = path[-1] if path else -1
    anchor = last
    while anchor >= 0 and anchor not in tree.grouped:
        anchor = tree.parents[anchor]
    if not group or anchor not in tree.grouped:
        return []
    start = 1 + len(tree.tokens) + tree.grouped.index(anchor) * group
    first = start + (tree.depths[last] if last >= 0 else 0) - (tree.depths[anchor] if anchor >= 0 else 0)
    return [[(top_ids[(first + j) * k + i], top_probs[(first + j) * k + i] / PROB_SCALE)
             for i in range(propose_shape[j])] for j in range(draft_count(sure, first, start + group))]


# ------------------------------------------------------------------ what every way ends with


def _cut_at_stops(dec, plan, tokens, scores, emit_slots=None) -> list:
    """Each run cut after its first EOS (`rules.cut_at_stop`), then after the first position a stopping criterion
    stops (`_criteria_cut`, shown the scores of the emitted positions: a draft tree's in its path's order,
    ``emit_slots``). Returns which rows stopped."""
    stopped = [False] * dec.batch
    for r in plan.rows:
        stopped[r] = cut_at_stop(tokens[r], dec.clients.eos_ids)
        if emit_slots is not None:
            del emit_slots[r][len(tokens[r]):]
    if len(dec.clients.criteria) > 0:
        if emit_slots is not None:
            scores = in_emitted_order(scores, emit_slots, dec.device)
        _criteria_cut(dec, plan, tokens, stopped, scores)
    return stopped


def _criteria_cut(dec, plan, tokens, stopped, scores) -> None:
    """Stopping criteria beyond EOS / length, called after each decided token on its AR history (rows grouped
    by history length; one sync); a run is cut after the first position a criterion stops."""
    P, b = dec.prompt_len, dec.batch
    seq = dec.history.seq
    dec.history.write(plan.rows, dec.rows.emitted, tokens, [False] * b)
    longest = max((len(tokens[r]) for r in plan.rows), default=0)
    groups = {}
    for r in plan.rows:
        groups.setdefault(dec.rows.emitted[r], []).append(r)
    hits = []
    for i in range(1, longest + 1):
        for g in groups:
            hit = dec.clients.criteria(seq[:, :P + g + i], (scores[:, i - 1],) if dec.outputs.scores else None)
            hits.append(torch.as_tensor(hit, device=dec.device).expand(b))
    host = torch.stack(hits).view(longest, len(groups), b).tolist() if hits else []
    for j, (g, rs) in enumerate(groups.items()):
        for r in rs:
            if cut_at_stop(tokens[r], [host[i][j][r] for i in range(len(tokens[r]))]):
                stopped[r] = True


def _decision(dec, plan, tokens, stopped, drafts, scores, paths=None, emit_slots=None) -> Decision:
    """The step's `Decision`, rows that move together evened first (`rules.lockstep`): sliding-window caches and a
    static block cache, and stateful clients (whose rows emit as many tokens by construction: their next drafts
    are evened). A draft tree never moves in lockstep (`tree.refusal`: no such cache, no stateful client)."""
    if dec.shape.lockstep or dec.clients.exact:
        lockstep(plan.rows, tokens, drafts or [[] for _ in range(dec.batch)], stopped, plan.drafts)
    return Decision(tokens, stopped, drafts, scores, paths, emit_slots)


# ------------------------------------------------------------------ stateful processors and criteria
# Every unfinished row is at the same length here (the rows accept the same count each step), so one batched call
# holds each row's exact history. Speculation runs on disposable copies of the stateful processors (threshold
# mode) or on the stateless part of the chain (verify mode's drafts); then the real objects are called once per
# emitted position, in order: the processors on the history before it, the criteria on the history that ends with
# it. A position is processed only once it is certain to be emitted (verify: every earlier draft accepted;
# threshold: accepted on the copies' scores, which the real call must reproduce).


def disposable_chain(dec):
    """The processor chain with every stateful processor deep-copied (speculation must not touch them).

    None when a processor cannot be copied (C++/Rust matchers usually cannot): the step then accepts one token,
    decided by the real chain alone, and later steps stay one token per step."""
    procs = dec.clients.stateful_procs
    if dec.copies_failed:
        return None
    try:
        return _lp.LogitsProcessorList(
            [copy.deepcopy(p) if any(p is q for q in procs) else p for p in dec.clients.processors])
    except Exception as err:  # noqa: BLE001 - any failure to copy means: do not speculate
        dec.speculate_no_more()
        names = ", ".join(sorted({type(p).__name__ for p in procs}))
        _logger.warning_once(
            f"MARS threshold decoding with a stateful logits processor ({names}) that cannot be copied "
            f"({type(err).__name__}): decoding one token per forward so that the processor sees exactly the calls "
            "of plain decoding (the output is plain greedy/sampling). Use mars_verify=True for lossless multi-token "
            "decoding with this processor.")
        return None


def _speculate(dec, plan, slot_logits, live):
    """Candidate scores and tokens before the real calls, and how many positions may be emitted."""
    clients, verify = dec.clients, dec.opts.verify
    if verify:
        chain = clients.stateless_chain if clients.stateful_procs else clients.processors
        scores, chosen = process(dec, plan, slot_logits, chain)
        return scores, chosen, plan.drafts[plan.rows[0]] + 1  # slots 0..d-1 verify the drafts, slot d is AR's
    chain = None
    if not dec.shape.one_token:  # one-token steps need no speculation: the real chain decides slot 0
        chain = disposable_chain(dec) if clients.stateful_procs else clients.processors
    if chain is None:
        return None, None, 1
    scores, chosen = process(dec, plan, slot_logits, chain, stop_at_ends=True)
    if plan.max_slots == 1:
        return scores, chosen, 1
    conf = _confident(dec, chosen, of_distribution=not dec.do_sample, scores=scores).tolist()
    return scores, chosen, lockstep_count(threshold_run(conf[r], plan.slots[r]) for r in plan.rows if live[r])


def _exact(dec, plan, slot_logits) -> Decision:
    """Choose, accept and stop position by position with the real processors and criteria (see above)."""
    b, P, dev, verify, clients = dec.batch, dec.prompt_len, dec.device, dec.opts.verify, dec.clients
    live = torch.ones(b, dtype=torch.bool, device=dev) if plan.active_t is None else plan.active_t.clone()
    n, d0 = dec.rows.emitted[plan.rows[0]], plan.drafts[plan.rows[0]]
    scores, chosen, limit = _speculate(dec, plan, slot_logits, plan.active)
    out = torch.empty_like(slot_logits) if scores is None else scores.clone()
    acc = torch.zeros(b, dtype=torch.long, device=dev)
    stop = torch.zeros(b, dtype=torch.bool, device=dev)
    all_drafts = False
    for s in range(limit):
        if clients.stateful_procs or scores is None:
            real = clients.processors(dec.history.seq[:, :P + n + s], slot_logits[:, s].clone())
        else:
            real = scores[:, s]
        agreed = None
        if verify:
            pending = s < d0  # slots 0..d0-1 hold the pending drafts
            tok, agreed = verify_slot(real, dec.do_sample, plan.forced_t[:, s] if pending else None,
                                      dec.row_tensors.q_drafts[:, s] if pending and dec.do_sample else None)
        elif scores is not None and torch.equal(real[live], scores[live, s]):
            tok = chosen[:, s]
        else:  # the real call disagrees with its copy (or there is no copy): this token ends the step
            tok, limit = choose(real, dec.do_sample), s + 1
        tok = torch.where(live, tok, dec.limits.pad)
        dec.history.seq[:, P + n + s] = tok
        out[:, s] = real
        acc = torch.where(live, s + 1, acc)
        hit = stops(tok, dec.limits.eos_t)
        if len(clients.criteria) > 0:
            crit = clients.criteria(dec.history.seq[:, :P + n + s + 1], (real,) if dec.outputs.scores else None)
            hit = hit | torch.as_tensor(crit, device=dev).expand(b)
        hit &= live
        stop |= hit
        live &= ~hit
        if s + 1 >= limit or not bool(live.any()):
            all_drafts = verify and s == d0
            break
        if verify and not bool(agreed[live].all()):
            break
    return _exact_decision(dec, plan, acc, stop, chosen, scores, out, all_drafts)


def _exact_decision(dec, plan, acc, stop, chosen, scores, out, all_drafts) -> Decision:
    """The position-by-position step's tokens and stops on the host and (verify) its next drafts: only where every
    row still going emitted all its drafts and the AR token, proposed from its masks."""
    b, P, S, d0 = dec.batch, dec.prompt_len, plan.max_slots, plan.drafts[plan.rows[0]]
    n = dec.rows.emitted[plan.rows[0]]
    parts = [acc, stop, dec.history.seq[:, P + n:P + n + S]]
    propose = all_drafts and dec.shape.max_drafts > 0 and S > d0 + 1
    if propose:
        parts += [chosen, _confident(dec, chosen, of_distribution=True, scores=scores)]
        if dec.do_sample and plan.q_idx_t is not None:
            dec.row_tensors.keep_draft_distributions(torch.softmax(scores, dim=-1), plan.q_idx_t)
    host = to_host(*parts)
    accepted, stopped, window = host[0], [bool(x) for x in host[1]], by_row(host[2], b)
    tokens = [window[r][:accepted[r]] if plan.active[r] else [] for r in range(b)]
    drafts = [[] for _ in range(b)] if dec.opts.verify else None
    if propose and drafts is not None:
        ar, sure = by_row(host[3], b), by_row(host[4], b)
        for r in plan.rows:
            if not stopped[r]:
                drafts[r] = proposed_drafts(ar[r], sure[r], d0 + 1, plan.slots[r])
    return _decision(dec, plan, tokens, stopped, drafts, out)
