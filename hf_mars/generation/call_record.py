"""Layouts chosen per call by measured speed, for the life of the process: verify's default ``draft_tree="auto"``
(`CallRecord`: the draft tree, the draft chain or plain one-token steps), `MARSEngine`'s per-step choice between
the tree and the chain (a step weighs as a call), and threshold mode's ``plain_steps`` (`ThresholdCallRecord`:
drafting or plain calls). `policy.record_for` keeps one per model / device / dtype, batch size and loop.

Why per call: a layout's worth is tokens per second, and what a call's time shows (its host work, its batch
running until its last row is done) no step's arithmetic sees; decoding stays lossless whatever is chosen."""

from __future__ import annotations

import dataclasses

from .cost import FALL, RISE

CALL_LAYOUTS = ("tree", "chain", "plain")  # the warm-up's order; 'plain': 1-token steps (no masks), greedy's own
# `MARSEngine`'s per-step choice, a step being a short call: 8 warm-up steps per layout
ENGINE_LAYOUTS, ENGINE_WARM_STEPS = ("tree", "chain"), 8
WARM_CALLS = 3  # calls of each layout still in contention before the fastest is kept
# after one call each, a layout measured below this share of the best one's rate leaves the warm-up (successive
# elimination): a short process should not spend its few calls confirming what one call showed (plain steps at
# 1 token per forward against drafts at 2.7, say); this margin is about twice a single call's timing noise here
CONTENTION = 0.75
COLD_CALLS = 1  # a record's first call is not timed (`CallRecord.untimed`)
PROBE_CALLS = 32  # calls with the fastest layout before another is tried again (the load may have changed) ...
FAR_PROBE_CALLS = 4 * PROBE_CALLS  # ... calls since a layout below CONTENTION x the best rate last ran, for it
PROGRESS_DECAY = 0.7  # per call of a layout, the weight left to its earlier calls' answers and forwards
POOL_DECAY = 0.98  # per call, the weight left to earlier calls' draft counts (about the last 50 calls count)


@dataclasses.dataclass
class CallRecord:
    """Verify's default ('auto') per model / device / dtype and batch size: the draft tree, the draft chain or plain
    one-token steps, whichever gives the most tokens per second. Verify's output is plain greedy's whatever the
    layout, so the fastest can always be taken: on the demo checkpoint on a CPU the tree wins at batch 1 and the
    chain at larger batches; where masks do not pay for their width (a large LM head on a CPU, weakly trained
    masks), plain steps (docs/generation.md).

    A layout's tokens per forward are 1 + (the share of its row-steps that start with drafts) x (the drafts
    accepted in such a step). The share is the layout's own (the tree has drafts after a rejection, the chain has
    not) and hardly moves with the prompts; the drafts accepted are the masks' quality on the text, the same for
    every layout, so they are pooled over all calls: measured per layout on different prompts they would differ by
    more than the layouts do. A step's time is each layout's own (width, host work, load): a low quantile of its
    calls' seconds per decode step, tracked as `cost.StepCosts` tracks a step's (a call faster than the estimate
    moves it by FALL of the gap, a slower one by RISE). A mean would let one call the machine slowed (preempted,
    sharing its cores) hand the lead to another layout until the next probe, 32 calls on: on the demo checkpoint at
    batch 1 `auto` then ran 0.78-0.90x its best fixed layout. `MARSEngine` keeps one per model and number of rows
    (``ENGINE_LAYOUTS``), each step of its batch a call of one step."""

    layouts: tuple = CALL_LAYOUTS  # what it chooses between, the warm-up's order
    warm_calls: int = WARM_CALLS
    # the record's first calls whose time is not kept (their draft counts are): a process's first call for a model
    # and batch size pays one-time costs (allocations, kernel choices for new shapes) that would be charged to the
    # warm-up's first layout, the tree, and could drop it from contention after one call
    untimed: int = COLD_CALLS
    drafted_steps: float = 0.0  # every call (decayed by POOL_DECAY a call): row-steps that started with drafts ...
    drafted_tokens: float = 0.0  # ... and the tokens they emitted
    with_drafts: dict = dataclasses.field(default_factory=dict)  # layout -> [drafted row-steps, row-steps]
    step_seconds: dict = dataclasses.field(default_factory=dict)  # layout -> seconds per decode step (low quantile)
    calls: dict = dataclasses.field(default_factory=dict)
    last_call: dict = dataclasses.field(default_factory=dict)  # layout -> the call count when it last ran
    since_probe: int = 0

    def tokens_per_forward(self, layout: str) -> float:
        drafted, steps = self.with_drafts.get(layout, (0, 0))
        gain = self.drafted_tokens / self.drafted_steps - 1.0 if self.drafted_steps else 0.0
        return 1.0 + (drafted / steps if steps else 0.0) * gain

    def rate(self, layout: str) -> float:
        return self.tokens_per_forward(layout) / self.step_seconds[layout]

    def warming(self) -> str | None:
        """The layout the warm-up runs next (None: it is over): each layout until it has a timed call, in
        ``layouts`` order (the record's first call is not timed: ``untimed``), then those still in contention
        (within ``CONTENTION`` of the best measured rate) until each has WARM_CALLS."""
        untried = [layout for layout in self.layouts if layout not in self.step_seconds]
        if untried:
            return untried[0]
        top = max(self.rate(layout) for layout in self.layouts)
        short = [layout for layout in self.layouts
                 if self.calls[layout] < self.warm_calls and self.rate(layout) >= CONTENTION * top]
        return min(short, key=lambda layout: self.calls[layout]) if short else None

    def best(self) -> str | None:
        if self.warming() is not None:
            return None
        return max(self.layouts, key=self.rate)

    def choose(self) -> str:
        """The layout of the next call: the warm-up's (`warming`), then the fastest; PROBE_CALLS calls after the
        last probe, the layout tried longest ago among the contenders (within CONTENTION of the best rate) and
        those that have not run for FAR_PROBE_CALLS calls.

        A probe of a far slower layout costs what it loses (plain steps at batch 1 on the demo checkpoint: a call
        2.6x the tree's, every 64 calls, 2.5% of the time), and it only refreshes that layout's step time: its
        tokens per forward follow the pooled draft counts every call (masks that stop paying bring plain steps
        back without a probe)."""
        warm = self.warming()
        if warm is not None:
            return warm
        best = max(self.layouts, key=self.rate)
        if self.since_probe < PROBE_CALLS:
            return best
        top, calls = self.rate(best), sum(self.calls.values())
        due = [layout for layout in self.layouts if layout != best and (
            self.rate(layout) >= CONTENTION * top or calls - self.last_call.get(layout, -1) > FAR_PROBE_CALLS)]
        return min(due, key=lambda layout: self.last_call.get(layout, -1)) if due else best

    def observe(self, layout: str, outputs, steps: int, seconds: float) -> None:
        """A call ran: its draft counts (`outputs.Outputs.count_drafted`) and its time over its steps."""
        if outputs.row_steps <= 0 or steps <= 0 or seconds <= 0:
            return
        self.drafted_steps = POOL_DECAY * self.drafted_steps + outputs.drafted_steps
        self.drafted_tokens = POOL_DECAY * self.drafted_tokens + outputs.drafted_tokens
        drafted, total = self.with_drafts.get(layout, (0, 0))
        self.with_drafts[layout] = (POOL_DECAY * drafted + outputs.drafted_steps,
                                    POOL_DECAY * total + outputs.row_steps)
        self.timed(layout, seconds, steps)

    def timed(self, layout: str, seconds: float, steps: int) -> None:
        """A call of ``layout`` took ``seconds`` for its ``steps`` decode steps: counted, and, past the untimed first
        calls, moves the layout's low quantile of seconds per step (what `rate` reads, here and in
        `ThresholdCallRecord`)."""
        self.last_call[layout] = sum(self.calls.values())
        self.calls[layout] = self.calls.get(layout, 0) + 1
        if self.untimed > 0:
            self.untimed -= 1
            return
        per_step, old = seconds / steps, self.step_seconds.get(layout)
        self.step_seconds[layout] = per_step if old is None else old + (FALL if per_step < old else RISE) * (
            per_step - old)
        best = self.best()
        self.since_probe = 0 if (best is not None and layout != best) else self.since_probe + 1


THRESHOLD_CALL_LAYOUTS = ("masks", "plain")  # threshold mode with plain_steps, per call: the warm-up's order


@dataclasses.dataclass
class ThresholdCallRecord(CallRecord):
    """Threshold mode with ``plain_steps``, per model / device / dtype and batch size: whether a ``generate`` call
    drafts with its masks (each step still free to go plain: `ThresholdPolicy`) or takes plain one-token steps
    throughout, whichever this process measured faster, as verify's 'auto' (`CallRecord`).

    Why per call as well as per step: a step's choice weighs the tokens a row emits against the step's cost, but a
    call's batch runs until its last row is done, and that row emits fewer tokens per step than the rows' mean (on
    the demo checkpoint on a CPU at batch 16 the per-step choice kept drafting at 0.75-0.8x plain `generate`, plain
    steps throughout ran 1.0x). So a layout's speed is its calls' longest answer per forward (exactly 1 for plain
    calls; pooled over its calls, decayed by PROGRESS_DECAY a call) times its decode steps per second: both hardly move with the
    prompt, where a call's tokens per second moves with its answers' lengths. `MARSEngine`'s rows join and leave:
    it keeps the per-step choice."""

    layouts: tuple = THRESHOLD_CALL_LAYOUTS
    progress: dict = dataclasses.field(default_factory=dict)  # layout -> [longest answers, forwards], decayed

    def tokens_per_forward(self, layout: str) -> float:
        tokens, forwards = self.progress.get(layout, (1.0, 1.0))
        return tokens / forwards

    def observe_call(self, layout: str, longest: int, forwards: int, steps: int, seconds: float) -> None:
        """A call ran: its longest row's tokens over the batch's forwards, and its decode steps' time."""
        if longest <= 0 or forwards <= 0 or steps <= 0 or seconds <= 0:
            return
        tokens, counted = self.progress.get(layout, (0.0, 0.0))
        self.progress[layout] = (PROGRESS_DECAY * tokens + longest, PROGRESS_DECAY * counted + forwards)
        self.timed(layout, seconds, steps)
