"""Where a generation's decided tokens go besides its rows: the token history on the device (prompt | generated,
kept only when logits processors or stopping criteria read ``input_ids``) and the streamer.

Both follow the rows' commits, one write per step each; kept apart from the decoder so that its commit reads as
the rows advancing, and so that a call no processor reads pays for neither.
"""

from __future__ import annotations

import torch

from .plan import to_device


class History:
    """The token buffer ``seq`` (None when nothing reads it) and the streamer (None: none)."""

    def __init__(self, input_ids, kept: bool, limits, streamer):
        self.kept, self.streamer = kept, streamer
        self.prompt_len, self.pad, self.slots, self.buf_len = input_ids.shape[1], limits.pad, limits.max_slots, \
            limits.buf_len
        self.seq = None
        if kept:
            self.seq = torch.full((input_ids.shape[0], self.buf_len), self.pad, dtype=torch.long,
                                  device=input_ids.device)
            self.seq[:, :self.prompt_len] = input_ids

    def write(self, rows, starts, tokens, finished) -> None:
        """Put the decided tokens into `seq` after each row's history (``starts``: its length before them), for
        processors and criteria to read; a finished row's speculative slots after them become pads. One
        host->device copy."""
        P, S, idx = self.prompt_len, self.slots, ([], [], [])
        for r in rows:
            start = P + starts[r]
            values = list(tokens[r]) + ([self.pad] * S if finished[r] else [])
            values = values[:max(self.buf_len - start, 0)]
            idx[0].extend([r] * len(values))
            idx[1].extend(range(start, start + len(values)))
            idx[2].extend(values)
        if idx[2]:
            r_t, c_t, v_t = to_device(idx[0] + idx[1] + idx[2], self.seq.device).view(3, -1)
            self.seq[r_t, c_t] = v_t

    def cut(self, row: int, length: int) -> None:
        """A row stopped at ``length`` generated tokens: pads after it."""
        self.seq[row, self.prompt_len + length:self.buf_len] = self.pad

    def stream(self, row_tokens, runs) -> None:
        """The tokens each row emitted this step (``runs``: per row, where they start and how many), to the
        streamer (CPU tensors, as generate hands them)."""
        new = [torch.tensor(row_tokens[r][start:start + a], dtype=torch.long) for r, (start, a) in enumerate(runs)]
        if len(runs) == 1:
            if runs[0][1]:
                self.streamer.put(new[0])
            return
        width = max(a for _, a in runs)
        if width == 0:
            return
        if hasattr(self.streamer, "put_rows"):  # a batch-aware streamer gets each row's own new tokens (maybe none)
            self.streamer.put_rows(new)
            return
        block = torch.full((len(runs), width), self.pad, dtype=torch.long)
        for r, row in enumerate(new):
            block[r, :row.shape[0]] = row
        self.streamer.put(block)
