"""The prompt of one generation and the positions every step's tokens take after it.

Left padding makes each row's positions start at its first real token, and a step's trailing drafts and masks may
reach past a model's learned position table although the answer fits: both are settled here once, so that the
prefill's chunk and every later forward read their positions from one place.
"""

from __future__ import annotations

import torch

from .plan import device_constant, positions, to_device


class Prompt:
    """The prompt's tokens, its padding (None: none) and the position ids the chunks slice."""

    def __init__(self, model, input_ids, attn, needed_positions: int, max_positions: int):
        """``needed_positions``: the last position a step may feed (prompt + answer + one step's slots);
        ``max_positions``: how many position ids the chunks may slice."""
        b, P = input_ids.shape
        dev = input_ids.device
        self.ids = input_ids
        self.tokens = [P] * b if attn is None else attn.long().sum(-1).tolist()  # each row's real prompt tokens
        if attn is not None and min(self.tokens) == 0:
            raise ValueError("MARS decoding needs at least one real (unpadded) prompt token in every row; a row of "
                             "the attention_mask is all zeros.")
        if attn is not None and min(self.tokens) == P:  # no padding: as if no mask was passed
            attn = None
        self.attn = attn
        if attn is not None:  # (unpadded rows all count positions from 0: `prefill_chunk` slices them)
            self.real = to_device(self.tokens, dev)
            self.pos = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0)
        # learned absolute positions (GPT-2 / OPT) index past their table there: only tokens past max_new read
        # those columns, so their positions are clamped to the last one (the emitted tokens are unchanged)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.max_positions = limit if isinstance(limit, int) else None
        self.last_position = limit - 1 if self.max_positions and needed_positions > limit else None
        self.positions = positions(max_positions, dev)

    def prefill_chunk(self, masks: int, mask_token_id: int, cached: int = 0):
        """The prefill's inputs: [prompt | masks], the same number of masks in every row, without the prompt's
        first ``cached`` columns (a cache passed in holds them: prompt reuse). Returns input_ids, position_ids and
        which columns are real (None when all are)."""
        b, P = self.ids.shape
        dev = self.ids.device
        mask_block = device_constant(((mask_token_id,) * masks,) * b, dev)
        input_ids = torch.cat((self.ids[:, cached:], mask_block), 1)
        if self.attn is None:  # no padding: positions 0.. in every row
            position_ids = self.positions[:, cached:P + masks]
            return input_ids, position_ids if b == 1 else position_ids.expand(b, -1), None
        position_ids = torch.cat([self.pos[:, cached:], self.real[:, None] + self.positions[:, :masks]], dim=1)
        col_real = torch.cat([self.attn[:, cached:].bool(), torch.ones(b, masks, dtype=torch.bool, device=dev)],
                             dim=1)
        return input_ids, position_ids, col_real

    def clamped(self, position_ids):
        """Position ids no further than the model's table reaches."""
        return position_ids if self.last_position is None else position_ids.clamp(max=self.last_position)

    def take_limit(self, other: Prompt) -> None:
        """Rows of another generation join (`MARSDecoder.merge`): the tighter position clamp holds for all."""
        if other.last_position is not None:
            self.last_position = min(x for x in (self.last_position, other.last_position) if x is not None)
