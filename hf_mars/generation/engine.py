"""Rows that come and go: a running MARS batch that requests join between steps and leave when done.

`generate(mars=True)` is `MARSDecoder` with every row added at the start. A server wants more: a request that
arrives while others decode joins the running batch at the next step instead of waiting for the whole batch.
`MARSEngine.add` runs the newcomer's first step alone (``model.generate`` prepares its processors, criteria and
cache as for any call; the prefill emits its first tokens) and merges it into the batch (`merge`:
its cache rows left-padded to the batch's columns, masked). `MARSEngine.step` advances every row one step,
each at its own tau, and hands back each row's new tokens; finished and cancelled rows leave the batch
(`keep_rows`). A row whose settings cannot share a batch (processors or criteria that read the
history, a block-level or static cache, a sliding window the call does not fit in) still steps, round-robin beside
the batch, on its own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch

from .api import _stop_strings_as_criterion, _with_option_parameters, start_decoder
from .policy import choices_for, record_for


def _first_step(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                mars_config=None, mars_row_tau=None, **model_kwargs):
    """A custom_generate that returns the decoder after its first step (the prefill), for `MARSEngine.add`
    (no streamer: the engine hands each row's tokens out itself)."""
    decoder = start_decoder(model, input_ids, logits_processor, stopping_criteria, generation_config, None,
                            mars_config, model_kwargs)
    if mars_row_tau is not None:
        decoder.set_row_taus([mars_row_tau])
    with torch.no_grad():
        decoder.step()
    return decoder


_with_option_parameters(_first_step)


def joinable(dec) -> bool:
    """Whether a generation's rows can share a batch with other generations' rows: nothing reads the token history
    (the buffer is per call), nothing holds rows together (stateful clients, block chunks, static caches, a
    sliding window the call does not fit in), no per-step records.

    A sliding-window call that fits inside its window (`RollbackCache.ragged_rows`) joins: compaction keeps the
    merged cache within the longest row's real columns and its slack, each row's columns within its own call's
    size, so the merged batch never fills a window either and no row's window cuts."""
    return not (dec.history.kept or dec.clients.exact or dec.clients.lagging is not None or dec.shape.block
                or not dec.cache.ragged_rows or dec.cache.static or dec.outputs.records is not None)


def _settings(dec):
    """What rows sharing a batch must share: options (tau aside, it is per row), sampling, processors, stops."""
    chain = [(type(p), {k: v.tolist() if torch.is_tensor(v) else v for k, v in vars(p).items()})
             for p in dec.clients.processors]
    return (dataclasses.replace(dec.opts, threshold=0.0), dec.do_sample, chain, dec.clients.suppress,
            dec.clients.eos_ids, dec.limits.pad, dec.device, dataclasses.replace(dec.shape, one_token=False),
            getattr(dec, "tree_shape", None))


def can_merge(dec, other) -> bool:
    return joinable(dec) and joinable(other) and _settings(dec) == _settings(other)


def merge(dec, other) -> None:
    """Take another generation's rows into ``dec``'s batch, between steps (`MARSDecoder.merge`): each side's cache
    columns are left-padded to the longer one and masked; keys carry their rotary positions and a row's position
    ids follow its own real-token count, so no row's attention changes."""
    dec.merge(other)


def keep_rows(dec, keep: list) -> None:
    """Only the rows ``keep`` go on (`MARSDecoder.keep_rows`)."""
    dec.keep_rows(keep)


@dataclasses.dataclass
class StepCounts:
    """One batch step as `call_record.CallRecord.observe` reads a call: the rows that stepped, those that started it
    with drafts, and the tokens those emitted."""

    row_steps: int
    drafted_steps: int
    drafted_tokens: int


def measured_step(dec) -> str | None:
    """One step of a served batch in the layout this process measured fastest for the model and this many rows
    (`call_record.CallRecord`, loop "engine": the draft tree or the chain, as verify's default 'auto' chooses per
    `generate` call; here per step, since rows join and leave). A batch that decodes no tree, or whose tree shape
    was asked for, steps as it is. Returns the layout taken (None: the batch's own)."""
    if getattr(dec, "tree_shape", None) is None or dec.opts.draft_tree != "auto":
        dec.step()
        return None
    rows = dec.rows
    active = [r for r in range(dec.batch) if rows.unfinished[r]]
    drafted = [r for r in active if rows.drafts[r]]
    emitted = [len(tokens) for tokens in rows.tokens]
    record = record_for(dec.model, len(active), "engine", dec.opts.draft_vocab)
    layout = record.choose()
    dec.drafting_as(layout)
    started = time.perf_counter()
    try:
        dec.step()
    finally:
        dec.drafting_as("tree")
    seconds = time.perf_counter() - started
    counts = StepCounts(len(active), len(drafted), sum(len(rows.tokens[r]) - emitted[r] for r in drafted))
    record.observe(layout, counts, 1, seconds)
    history = choices_for(dec.model, len(active), "engine")
    history[layout] = history.get(layout, 0) + 1
    return layout


@dataclasses.dataclass
class Row:
    """One request in the engine: the caller's handle, its own tau (None: the step's), tokens handed out so far."""

    handle: object
    tau: float | None
    sent: int = 0


class Event(NamedTuple):
    """A row's news after a step: the tokens it emitted, whether it finished, its forward passes so far."""

    handle: object
    tokens: list
    finished: bool
    forwards: int


class MARSEngine:
    """In-flight MARS decoding: one shared batch plus the rows that must decode alone."""

    def __init__(self, model, threshold_placeholder: float = 0.5):
        self.model = model
        self.batch = None  # the shared MARSDecoder
        self.batch_rows: list[Row] = []
        self.solo: list[tuple] = []  # (decoder, Row): rows that cannot share the batch
        # decoders are built with a tau below 1 (so that masks are fed at all); each row's own tau applies per step
        self.placeholder = threshold_placeholder

    def __len__(self) -> int:
        return len(self.batch_rows) + len(self.solo)

    def add(self, handle, input_ids, generation_config, tau: float | None, default_tau: float | None = None,
            **mars_args) -> list:
        """Prefill a newcomer (its first step) and put it into the batch, or beside it. ``tau``: the row's own
        (None: each step's ``default_tau``). Returns the `Event` of that step."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.model.device).view(1, -1)
        kwargs = dict(mars_args, input_ids=ids, attention_mask=torch.ones_like(ids),
                      generation_config=generation_config, mars_row_tau=tau if tau is not None else default_tau,
                      mars_threshold=mars_args.get("mars_threshold") or self.placeholder)
        _stop_strings_as_criterion(self.model, kwargs)
        decoder = type(self.model).generate(self.model, custom_generate=_first_step, **kwargs)
        row = Row(handle, tau)
        events = self._events(decoder, [row])
        if not decoder.rows.unfinished[0]:
            return events
        if joinable(decoder) and (self.batch is None or can_merge(self.batch, decoder)):
            if self.batch is None:
                self.batch, self.batch_rows = decoder, [row]
            else:
                merge(self.batch, decoder)
                self.batch_rows.append(row)
        else:
            self.solo.append((decoder, row))
        return events

    def step(self, default_tau: float) -> list:
        """One step of the batch and of each solo row, every row at its own tau (``default_tau``: the ladder's,
        for rows without one). Returns [(handle, new tokens, finished)]; finished rows have left."""
        events = []
        if self.batch is not None:
            self.batch.set_row_taus([default_tau if r.tau is None else r.tau for r in self.batch_rows])
            with torch.no_grad():
                measured_step(self.batch)
            events += self._events(self.batch, self.batch_rows)
            self._drop_finished()
        still = []
        for decoder, row in self.solo:
            decoder.set_row_taus([default_tau if row.tau is None else row.tau])
            with torch.no_grad():
                decoder.step()
            events += self._events(decoder, [row])
            if decoder.rows.unfinished[0]:
                still.append((decoder, row))
        self.solo = still
        return events

    def handles(self) -> list:
        """The handles of every row decoding now."""
        return [r.handle for r in self.batch_rows] + [r.handle for _, r in self.solo]

    def cancel(self, handles) -> None:
        """Rows whose client went away leave at once."""
        gone = {id(h) for h in handles}
        if self.batch is not None:
            keep = [i for i, r in enumerate(self.batch_rows) if id(r.handle) not in gone]
            self._keep(keep)
        self.solo = [(d, r) for d, r in self.solo if id(r.handle) not in gone]

    def _events(self, decoder, rows):
        events = []
        for i, row in enumerate(rows):
            tokens = decoder.rows.tokens[i]
            finished = not decoder.rows.unfinished[i]
            if len(tokens) > row.sent or finished:
                events.append(Event(row.handle, tokens[row.sent:], finished, decoder.rows.forwards[i]))
                row.sent = len(tokens)
        return events

    def _drop_finished(self):
        keep = [i for i in range(len(self.batch_rows)) if self.batch.rows.unfinished[i]]
        if len(keep) < len(self.batch_rows):
            self._keep(keep)

    def _keep(self, keep):
        if not keep:
            self.batch, self.batch_rows = None, []
            return
        if len(keep) < len(self.batch_rows):
            keep_rows(self.batch, keep)
            self.batch_rows = [self.batch_rows[i] for i in keep]
