"""Stateful processors and criteria: deciding so that they see only the calls plain AR decoding makes.

Every unfinished row is at the same length here (the rows accept the same count each step), so one batched call
holds each row's exact history. Speculation runs on disposable copies of the stateful processors (threshold
mode) or on the stateless part of the chain (verify mode's drafts); then the real objects are called once per
emitted position, in order: the processors on the history before it, the criteria on the history that ends with
it. A position is processed only once it is certain to be emitted (verify: every earlier draft accepted;
threshold: accepted on the copies' scores, which the real call must reproduce). The rules are `rules.py`'s.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation import logits_process as _lp
from transformers.utils import logging as _hf_logging

from .rules import (
    Decision,
    choose,
    lockstep,
    lockstep_count,
    proposed_drafts,
    stops,
    threshold_run,
    verify_slot,
)

_logger = _hf_logging.get_logger(__name__)


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
        scores, chosen = dec.process(plan, slot_logits, chain)
        return scores, chosen, plan.drafts[plan.rows[0]] + 1  # slots 0..d-1 verify the drafts, slot d is AR's
    chain = None
    if not dec.shape.one_token:  # one-token steps need no speculation: the real chain decides slot 0
        chain = disposable_chain(dec) if clients.stateful_procs else clients.processors
    if chain is None:
        return None, None, 1
    scores, chosen = dec.process(plan, slot_logits, chain, stop_at_ends=True)
    S = plan.max_slots
    if S == 1:
        return scores, chosen, 1
    conf = dec.confident(scores, chosen, of_distribution=not dec.do_sample).tolist()
    return scores, chosen, lockstep_count(threshold_run(conf[r], plan.slots[r]) for r in plan.rows if live[r])


def decide_exact(dec, plan, slot_logits):
    """Choose, accept and stop position by position with the real processors and criteria (see the module)."""
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
    return Decision(*_to_host(dec, plan, acc, stop, live, chosen, scores, all_drafts, n), scores=out)


def _to_host(dec, plan, acc, stop, live, chosen, scores, all_drafts, n):
    """The step's tokens, stops and (verify) next drafts as host lists: drafts only where every live row emitted
    all its drafts and the AR token, proposed from its masks, as many in every row (lockstep)."""
    b, P, S = dec.batch, dec.prompt_len, plan.max_slots
    window = dec.history.seq[:, P + n:P + n + S]
    parts = [acc, stop.long(), live.long(), window.reshape(-1)]
    propose = all_drafts and dec.shape.max_drafts > 0 and S > plan.drafts[plan.rows[0]] + 1
    if propose:
        parts += [chosen.reshape(-1), dec.confident(scores, chosen, of_distribution=True).reshape(-1)]
        if dec.do_sample and plan.q_idx_t is not None:
            probs = torch.softmax(scores, dim=-1)
            dec.row_tensors.keep_draft_distributions(probs, plan.q_idx_t)
    host = torch.cat(parts).tolist()
    acc_h, stop_h, live_h, win = host[:b], host[b:2 * b], host[2 * b:3 * b], host[3 * b:3 * b + b * S]
    tokens = [win[r * S:r * S + acc_h[r]] if plan.active[r] else [] for r in range(b)]
    drafts = None
    if dec.opts.verify:
        drafts = [[] for _ in range(b)]
        if propose:
            ch, conf = host[3 * b + b * S:3 * b + 2 * b * S], host[3 * b + 2 * b * S:]
            d0 = plan.drafts[plan.rows[0]]
            for r in plan.rows:
                if live_h[r]:
                    drafts[r] = proposed_drafts(ch[r * S:(r + 1) * S], conf[r * S:(r + 1) * S], d0 + 1, plan.slots[r])
            going = [r for r in plan.rows if live_h[r]]
            lockstep(going, tokens, drafts, [False] * b, plan.drafts)  # (the same count in every live row)
    return tokens, [bool(x) for x in stop_h], drafts
