"""What bounds one generation: how many tokens its rows may take, which tokens end a row or are never emitted, the
pad that fills a finished row, and how wide a step (and the history buffer) may grow.

Settled once from the call (the clients, the generation config, the step geometry) and read by every step; kept
apart from the decoder's moving parts so that a reader sees in one place every number a step is held to.
"""

from __future__ import annotations

import torch

from .plan import device_constant


class Limits:
    """The call's stops and limits (see the module)."""

    def __init__(self, clients, generation_config, shape, verify: bool, prompt_len: int, device):
        self.suppress_t = device_constant(tuple(clients.suppress), device)  # never emitted (the mask token among them)
        eos_ids = tuple(sorted(set(clients.eos_ids)))
        self.eos_t = device_constant(eos_ids, device) if eos_ids else None
        max_length = clients.max_length
        if max_length is None:
            max_length = generation_config.max_length
        if max_length is None:
            raise ValueError("MARS decoding needs a length limit: pass max_new_tokens or max_length.")
        self.max_new = int(max_length) - prompt_len
        pad = generation_config.pad_token_id
        if pad is None and clients.eos_ids:
            pad = clients.eos_ids[0]
        self.pad = pad if isinstance(pad, int) else int(torch.as_tensor(pad).flatten()[0]) if pad is not None else 0
        # candidate slots a step can read: verify's pending drafts, the AR token and the new drafts
        self.max_slots = 2 * shape.max_drafts + 1 if verify else shape.candidates
        self.buf_len = prompt_len + max(self.max_new, 0) + self.max_slots + 2  # the history buffer's columns
        self.step_room = step_room(shape.candidates)


def step_room(candidates: int) -> int:
    """Cache columns one step may write, an upper bound (verify's pending drafts, the AR token, the new drafts and
    masks, each at most ``candidates``), for a call's size before it runs (`cache.call_fits_window`)."""
    return 3 * candidates + 2
