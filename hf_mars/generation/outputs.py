"""What a generation collects for its output object besides the sequences: the scores and logits of every
emitted position (``output_scores`` / ``output_logits``) and the decoder's own statistics.

A step emits several positions per row, a different number in each row: its records are kept per step and laid
out per position only once, at the end (`assemble`), the way plain generate returns them.
"""

from __future__ import annotations

import math

import torch

from .plan import to_device
from .rules import take_columns


def in_emitted_order(tensor, emit_slots: list, device):
    """Per row, the slots of its emitted tokens first (``emit_slots``: a draft tree's root, then each accepted node):
    the distributions of the emitted positions, as output_scores and stopping criteria read them."""
    width = max(1, max(len(s) for s in emit_slots))
    index = to_device([s[i] if i < len(s) else 0 for s in emit_slots for i in range(width)], device)
    return take_columns(tensor, index.view(len(emit_slots), width))


class Outputs:
    """Which outputs the call asked for, each step's record of them, and the statistics."""

    def __init__(self, generation_config):
        wants_dict = bool(generation_config.return_dict_in_generate)
        self.scores = wants_dict and bool(generation_config.output_scores)
        self.logits = wants_dict and bool(generation_config.output_logits)
        self.records = [] if (self.scores or self.logits) else None  # per step: (scores, logits, accepted per row)
        self.raw = None  # the step's slot logits before processing (for output_logits: `keep_raw`)
        self.compactions = 0  # times the cache's masked-out columns were compacted away
        # verify's 'auto' (`tree.TreeDecoder.run` turns it on): row-steps, those that started with drafts, the tokens
        # those emitted (`count_drafted`); and, always, perf_counter() at the end of the first step (the prefill)
        self.counting = False
        self.row_steps = self.drafted_steps = self.drafted_tokens = 0
        self.decode_started = None

    def count_drafted(self, rows: list, had_drafts: list, accepted: list) -> None:
        """A step's rows: how many started with drafts and what those emitted. Tokens per drafted step are the
        masks' quality on this text, whatever the layout; the share of steps with drafts is the layout's own
        (a tree has the next drafts after a rejection, the chain has not): `call_record.CallRecord` weighs both."""
        self.row_steps += len(rows)
        for r in rows:
            if had_drafts[r]:
                self.drafted_steps += 1
                self.drafted_tokens += accepted[r]

    def record(self, decision, accepted: list, device) -> None:
        """A step's record (when output_scores or output_logits asked for one): the processed scores and the raw
        logits at the slots its tokens were chosen at, in emitted order, and how many each row ``accepted``."""
        if self.records is None:
            return
        scores = decision.scores if self.scores else None
        raw = self.raw if self.logits else None
        if decision.emit_slots is not None:  # a draft tree: the accepted path's slots
            scores = None if scores is None else in_emitted_order(scores, decision.emit_slots, device)
            raw = None if raw is None else in_emitted_order(raw, decision.emit_slots, device)
        self.records.append((scores, raw, accepted))

    def keep_raw(self, slot_logits) -> None:
        """A step's slot logits before any processing, for output_logits (a copy: processing may write in place)."""
        self.raw = slot_logits.clone() if self.logits else None

    def assemble(self, which, emitted, pad, device):
        """One (b, V) tensor per emitted position, from the per-step records (0: scores, 1: logits); ``emitted``:
        each row's emitted tokens, ``pad``: the token a finished row's sequence holds."""
        if not self.records:
            return None
        T, batch = max(emitted), len(emitted)
        if T == 0:
            return ()
        V, per_row = None, [[] for _ in range(batch)]
        for rec in self.records:
            tensor = rec[which]
            if tensor is None:
                return None
            V = tensor.shape[-1]
            for r, a in enumerate(rec[2]):
                if a > 0:
                    per_row[r].append(tensor[r, :a])
        # positions after a row finished hold a distribution certain of the pad token (the token the sequence
        # holds there), like plain generate's finite scores: transition scores are 0 there, never NaN
        out = torch.full((batch, T, V), -math.inf, device=device)
        out[:, :, pad] = 0.0
        for r in range(batch):
            if per_row[r]:
                kept = torch.cat(per_row[r])[: emitted[r]]
                out[r, :kept.shape[0]] = kept
        return tuple(out.unbind(1))
