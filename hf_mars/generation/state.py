"""What a MARS generation keeps between steps on the host: the geometry of its steps (`Shape`), its rows' state
(`Rows`) and one step's slots read back from the device (`SlotRead`, `by_row`). Plain python values: reading them
costs no device sync.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


@dataclasses.dataclass(slots=True)
class Shape:
    """The geometry of every step: how many candidates, drafts and chunk columns, and how the rows move."""

    candidates: int  # candidate slots per step: the AR token + the masks read (B, or B + 1 with the last mask)
    max_drafts: int  # verify mode: drafts a step may propose
    one_token: bool  # tau >= 1 (or a stateful processor that cannot be copied): one token per forward
    block: bool  # block-level cache (chunks of `chunk` positions over a frozen prefix)
    chunk: int
    fixed_width: int | None = None  # compiled steps: the one chunk width every step is padded to
    # how the rows move together: every row accepts the same count each step (sliding-window caches, a static
    # block cache), or ragged rows' masked-out cache columns are compacted away
    lockstep: bool = False
    compactable: bool = False


@dataclasses.dataclass
class Rows:
    """Per-row state on the host (python lists, one entry per row): mirrors that cost no device sync."""

    emitted: list  # tokens emitted
    fed: list  # generated index of the first token not in the cache (< 0 before the prefill: -(prompt columns to feed))
    unfinished: list
    in_chunk: list  # block cache: tokens accepted in the current chunk
    tokens: list  # each row's emitted tokens
    drafts: list  # verify mode: each row's pending drafts
    forwards: list  # forward passes each row took part in
    streamed: list  # lagging criteria: tokens streamed (never past `checked`)
    limit: list  # new tokens each row may emit
    prompt_tokens: list  # real (unpadded) prompt tokens: a row's positions count from them
    tau: list  # the row's own tau (`MARSDecoder.set_row_taus`); None: the call's mars_threshold
    chunk_start: bool = True  # block cache: the next step starts a chunk
    checked: int = 0  # lagging criteria: positions 1..checked have had their AR call

    @classmethod
    def new(cls, b: int, prompt_len: int, limit: int, prompt_tokens: list) -> Rows:
        """``prompt_len``: the prompt columns the prefill feeds (those a cache passed in holds aside)."""
        return cls(emitted=[0] * b, fed=[-prompt_len] * b, unfinished=[True] * b, in_chunk=[0] * b,
                   tokens=[[] for _ in range(b)], drafts=[[] for _ in range(b)], forwards=[0] * b, streamed=[0] * b,
                   limit=[limit] * b, prompt_tokens=list(prompt_tokens), tau=[None] * b)

    def __len__(self) -> int:
        return len(self.emitted)

    @property
    def at_prefill(self) -> bool:
        """Whether the next step is the prefill (every row's fed is negative until it, 0 after it)."""
        return self.fed[0] < 0

    def select(self, keep: list) -> None:
        """Keep only the rows ``keep`` (in that order)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                setattr(self, f.name, [value[i] for i in keep])

    def extend(self, other: Rows) -> None:
        """Append another generation's rows."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                value.extend(getattr(other, f.name))


class SlotRead(NamedTuple):
    """A step's candidate slots on the host, per row (`acceptor.read_slots`, or a compiled step's own read): the
    token chosen at each slot, whether it clears tau (None: not read), and in verify sampling each pending draft's
    speculative-sampling outcome (kept, and the residual's token where it was not)."""

    chosen: list
    confident: list | None
    kept: list | None = None
    resampled: list | None = None
    scores: torch.Tensor | None = None  # the processed scores (output_scores; None when read in the graph)


def by_row(values: list, rows: int) -> list:
    """A flat host list of ``rows`` equal rows (row-major, as a (rows, n) tensor flattens) as one list per row."""
    n = len(values) // rows if rows else 0
    return [values[r * n:(r + 1) * n] for r in range(rows)]
