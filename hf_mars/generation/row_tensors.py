"""The per-row values a generation keeps on the device rather than the host (`state.Rows`): each row's own tau,
and in verify sampling the distributions its pending drafts were drawn from.

They must follow the rows when rows join or leave a batch, exactly as `Rows` does on the host: one object that
merges and selects them keeps `MARSDecoder.merge` / `keep_rows` generic.
"""

from __future__ import annotations

import torch

from .rules import take_columns


class RowTensors:
    """``tau``: (batch, 1) float32, the rows' taus (None: the call's mars_threshold for every row); ``q_drafts``:
    (batch, max_drafts, vocab), verify sampling's draft distributions (None: none drawn yet)."""

    def __init__(self):
        self.tau = None
        self.q_drafts = None

    def set_taus(self, taus: list, device) -> None:
        self.tau = torch.tensor(taus, dtype=torch.float32).view(-1, 1).to(device)

    def keep_draft_distributions(self, probs, q_idx) -> None:
        """The distributions the next drafts are drawn from: each row's slots ``q_idx`` of ``probs``."""
        self.q_drafts = take_columns(probs, q_idx)

    def extend(self, other: RowTensors, rows: tuple, max_drafts: int, device) -> None:
        """Append another generation's rows (``rows``: each side's row count; a side that drew no drafts gets
        zeros, never read: its rows have no pending drafts)."""
        if self.q_drafts is not None or other.q_drafts is not None:
            vocab = next(d.q_drafts.shape[-1] for d in (self, other) if d.q_drafts is not None)
            self.q_drafts = torch.cat([d.q_drafts if d.q_drafts is not None else torch.zeros(
                n, max_drafts, vocab, device=device) for d, n in zip((self, other), rows)])

    def select(self, index) -> None:
        """Keep only the rows ``index`` (a device tensor)."""
        if self.q_drafts is not None:
            self.q_drafts = self.q_drafts.index_select(0, index)
        if self.tau is not None:
            self.tau = self.tau.index_select(0, index)
