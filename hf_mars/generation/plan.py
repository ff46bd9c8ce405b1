"""A step's plan: per row, what the chunk feeds (uncached committed tokens, pending drafts, masks) and which
candidate slots it may accept; then the chunk itself, right-aligned, laid out on the host and sent in one copy.

Batched rows accept different counts: each step every row's uncached tokens sit right-aligned in the chunk
(left-padded; pads stay masked in the 2D attention mask) and position ids follow each row's real-token count, so
the masks occupy the same columns in every row and one ``cache.crop`` drops them for all rows.
"""

from __future__ import annotations

import array
import dataclasses

import torch

from .rules import draft_room, one_token, step_room


def to_device(values, device, dtype=torch.long):
    """Host values as a device tensor without a synchronising copy (pinned memory, non-blocking on GPU). A flat
    list of ints goes through an int64 array (torch.tensor reads a list element by element: 3x slower)."""
    if dtype is torch.long and values and not isinstance(values[0], (list, tuple)):
        t = torch.frombuffer(array.array("q", values), dtype=torch.long)
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


_CONSTANTS: dict = {}  # (values, device) -> tensor; (None, device) -> a growing arange


def device_constant(values: tuple, device) -> torch.Tensor:
    """A small long tensor of fixed values on ``device`` (the suppressed ids, the EOS ids), made once per process: a
    short answer's set-up weighs as much as its loop. Shared between calls, so never written to."""
    key = (values, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        if len(_CONSTANTS) > 1024:  # (a process that sees endless distinct id sets)
            _CONSTANTS.clear()
        with torch.inference_mode(False):  # a plain tensor whatever the first caller's mode
            tensor = _CONSTANTS[key] = to_device(list(values), device)
    return tensor


def positions(n: int, device) -> torch.Tensor:
    """``arange(m)[None]`` on ``device`` for some ``m >= n`` (position ids, one row; callers slice what they need):
    one growing arange per device, shared between calls (never written to)."""
    key = (None, device)
    base = _CONSTANTS.get(key)
    if base is None or base.shape[1] < n:
        with torch.inference_mode(False):
            base = _CONSTANTS[key] = torch.arange(max(n, 1024, 2 * (0 if base is None else base.shape[1])),
                                                  device=device)[None]
    return base


@dataclasses.dataclass(slots=True)
class StepPlan:
    """What one step feeds and may accept, per row (python lists), and the device tensors laid out from it."""

    first: bool  # the prefill step: the prompt is not in the cache yet
    active: list  # rows that may accept tokens (unfinished, and not waiting for the block cache's chunk)
    uncached: list  # committed tokens not in the cache yet, fed first
    drafts: list  # verify mode: pending drafts, fed after them
    masks: list  # mask tokens, fed last
    slots: list  # candidate slots the row may accept from
    rows: list = dataclasses.field(default_factory=list)  # indices of the active rows
    lens: list = dataclasses.field(default_factory=list)  # real columns per row
    max_slots: int = 0
    logits_kept: int = 0  # logits kept from the end of the chunk: from candidate 0 (before drafts and masks) on
    uniform: bool = False  # every active row has the same drafts and masks: its slots are a plain slice
    read_slots: int = 0  # compiled steps that read their slots in the graph: all of dec.limits.max_slots, every step
    width: int = 0  # columns of the chunk
    input_ids: torch.Tensor | None = None  # the chunk (decode steps)
    pos_t: torch.Tensor | None = None  # batches: position ids of the chunk
    real_t: torch.Tensor | None = None  # batches: 1 where a chunk column is real, 0 where it is left padding
    slot_col_t: torch.Tensor | None = None  # rows of different layouts: the logits column each slot reads
    # slot by slot processing (processors or criteria read the history kept in `seq`):
    slot_pos_t: torch.Tensor | None = None  # where each candidate slot's token goes in `seq`
    active_t: torch.Tensor | None = None  # which rows may accept (None: all)
    forced_t: torch.Tensor | None = None  # verify: the pending draft at each slot (pad past them)
    forced_mask_t: torch.Tensor | None = None  # ... and which slots hold one
    q_idx_t: torch.Tensor | None = None  # verify sampling: the slots each row's next drafts are read from


def plan_step(dec) -> StepPlan:
    """Per-row counts for this step (python lists; cheap for any realistic batch; locals, not attributes: it runs
    before every forward)."""
    b, opts, rows, shape = dec.batch, dec.opts, dec.rows, dec.shape
    unfinished, emitted, limit, in_chunk = rows.unfinished, rows.emitted, rows.limit, rows.in_chunk
    block, verify, candidates, fixed_width = shape.block, opts.verify, shape.candidates, shape.fixed_width
    first = rows.at_prefill
    # a row at tau >= 1 reads candidate 0 only; masks are fed unless every row is such a row (the masks must
    # occupy the same last columns in every row, so that one crop drops them all)
    single = [shape.one_token or (t is not None and one_token(t)) for t in rows.tau]
    if dec.policy is not None and dec.policy.plain_step:  # threshold mode's opt-in plain 1-token step (`policy.ThresholdPolicy`)
        single = [True] * b
    # (verify too: a one-token row proposes no drafts, so its masks would be read by no one; 'auto''s plain steps)
    no_masks = not block and all(single[r] for r in range(b) if unfinished[r])
    active, uncached, drafts, masks, slots = [False] * b, [0] * b, [0] * b, [0] * b, [0] * b
    for r in range(b):
        if not unfinished[r] or (block and not rows.chunk_start and in_chunk[r] >= shape.chunk):
            continue  # finished, or waiting for the slowest row to fill the block cache's chunk
        active[r] = True
        remaining = limit[r] - emitted[r]
        uncached[r] = emitted[r] - rows.fed[r]
        if opts.cache == "block":
            masks[r] = shape.chunk - in_chunk[r]
        else:
            # candidates read masks 1..K-1 only, and under causal attention a later mask changes nothing before
            # it: feed K-1 masks (B-1 by default; none in one-token mode, an exact AR step)
            masks[r] = 0 if no_masks else candidates - 1
        if verify:
            drafts[r] = len(rows.drafts[r])
            # the next step's drafts + its AR token must fit what is left once this step's are emitted
            new_drafts = 0 if single[r] else min(shape.max_drafts, draft_room(remaining - drafts[r] - 1,
                                                                             opts.max_accept))
            slots[r] = drafts[r] + 1 + new_drafts
        else:
            n = 1 if single[r] else 1 + min(candidates - 1, masks[r])
            if block:
                n = min(n, shape.chunk - in_chunk[r])
            slots[r] = min(n, step_room(remaining, opts.max_accept))
    active_rows = [r for r in range(b) if active[r]]
    if fixed_width and not first:  # compiled steps: pad with masks to the one width
        for r in active_rows:
            masks[r] = fixed_width - uncached[r] - drafts[r]
    lens = [uncached[r] + drafts[r] + masks[r] for r in range(b)]
    plan = StepPlan(
        first=first, active=active, uncached=uncached, drafts=drafts, masks=masks, slots=slots, rows=active_rows,
        lens=lens, max_slots=max(slots), width=max(lens),
        logits_kept=fixed_width if fixed_width and not first else max(masks[r] + drafts[r] + 1 for r in active_rows),
        uniform=len({(masks[r], drafts[r]) for r in active_rows}) == 1,
        read_slots=dec.limits.max_slots if dec.calls.read is not None and not first else 0)
    lay_out(dec, plan)
    return plan


def lay_out(dec, plan) -> None:
    """Every per-row value a step needs on the device, laid out on the host and sent in one host->device copy:
    the chunk itself, ragged rows' logits columns and, when processors or criteria read the history, where each
    slot's token goes. Building these on the device took a dozen small ops per piece, each a kernel launch."""
    b, opts, rows, P = dec.batch, dec.opts, dec.rows, dec.prompt_len
    W, S, kept = plan.width, plan.max_slots, plan.logits_kept
    flat, sizes, names = [], [], []

    def add(name, values):
        flat.extend(values)
        sizes.append(len(values))
        names.append(name)

    if not plan.first:  # the chunk, right-aligned: [pad | committed + drafts | masks]
        src, pos, real = [], [], []
        for r in range(b):
            n, u, d, f, left = plan.lens[r], plan.uncached[r], plan.drafts[r], rows.fed[r], W - plan.lens[r]
            src += [dec.limits.pad] * left + rows.tokens[r][f:f + u] + rows.drafts[r][:d]
            src += [dec.mask_token_id] * (n - u - d)
            p0 = rows.prompt_tokens[r] + f
            pos += [0] * left + list(range(p0, p0 + n))
            real += [0] * left + [1] * n
        add("input_ids", src)
        if b > 1:
            add("pos_t", pos)
            add("real_t", real)
    if not plan.uniform or plan.read_slots:  # rows of different layouts (or a graph's read): each slot's column
        cols = []
        for r in range(b):
            c0 = kept - (plan.masks[r] + plan.drafts[r] + 1) if plan.active[r] else 0
            cols += [min(c0 + s, kept - 1) for s in range(plan.read_slots or S)]
        add("slot_col_t", cols)
    if dec.history.kept:
        add("slot_pos_t", [P + rows.emitted[r] + s for r in range(b) for s in range(S)])
        if not all(plan.active):
            add("active_t", plan.active)
    if (dec.history.kept or dec.do_sample) and opts.verify and max(plan.drafts) > 0:
        add("forced_t", [rows.drafts[r][s] if s < plan.drafts[r] else dec.limits.pad for r in range(b) for s in range(S)])
        add("forced_mask_t", [int(s < plan.drafts[r]) for r in range(b) for s in range(S)])
    M = dec.shape.max_drafts
    if opts.verify and dec.do_sample and M > 0 and S > max(plan.drafts) + 1:
        add("q_idx_t", [min(plan.drafts[r] + 1 + j, S - 1) for r in range(b) for j in range(M)])
    if not flat:
        return
    values = to_device(flat, dec.device)
    for name, part in zip(names, values.split(sizes) if len(sizes) > 1 else (values,)):
        if name in ("input_ids", "pos_t", "real_t"):
            part = part.view(b, W)
        elif name == "active_t":
            part = part.bool()
        elif name == "q_idx_t":
            part = part.view(b, M)
        else:
            part = part.view(b, -1)
        setattr(plan, name, part.bool() if name == "forced_mask_t" else part)
