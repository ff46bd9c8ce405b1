"""Draft layouts chosen by measured speed. Verify's default ``draft_tree="auto"`` (`CallRecord`): per call, the draft
tree or the draft chain, whichever this process measured faster for the model, device, dtype and batch size. The
opt-in ``draft_tree="cost"`` (`DraftPolicy`): each step, the draft tree (or chain, or plain 1-token step) that is
expected to emit the most tokens per second, from the drafts' own probabilities and the measured cost of a step's
width. Threshold mode's ``plain_steps`` (its default; False keeps the masks on every step): per call, drafting or
plain steps throughout (`ThresholdCallRecord`), and in a drafting call each step (`ThresholdPolicy`).

Why: no fixed layout is right everywhere. On the demo checkpoint on a CPU the all-top-1 tree with masks after
every node wins at batch 1 and loses to the chain at batch 16, where a wide step costs 2.7x a 1-token step; on a
real model whose masks are weak, every draft loses to plain decoding. A step's value is known before it runs:

- the tokens it should emit: per row, 1 (the AR token) + the expected accepted drafts, the sum over the tree's
  nodes of P(reach the node) = the product of the mask probabilities along its path (as `tree.Tree.choose_groups`
  reads them), times a calibration factor, the running ratio of drafts accepted to drafts predicted;
- whether the next step will have drafts: P(the accepted path ends at a node with masks after it), worth the
  running average of drafts accepted per row-step (`future`);
- what it costs: `cost.StepCosts` at the step's (rows, width).

The step's width is the widest row's, so rows are chosen together: for each candidate width, every row takes its
best layout that fits, and the width with the most value per second wins ("per row where rows differ"). A plain
step drops the drafts, and a row with no drafts emits one token whatever its layout, so plain vs drafting is a
choice between regimes: drafting continues while the drafts in hand pay now or the drafting regime's measured
rate (tokens per drafting step over its cost) beats plain steps; a plain regime probes drafting again now and
then. Costs unknown yet are explored by taking the step once (a plain step, the first time). Every choice is
lossless: a layout only decides which drafts are checked, never what is emitted (`rules.accepted_path`).

'cost' is opt-in: on the CPU measured it did not beat 'auto' (its wider layouts do not pay at batch 4 and 16), and
its per-step choice costs host time (~0.3 ms a step at batch 16). The decoder asks it at
`proposers.choose_layout` (before a step, `choose_step`) and tells it the step's time from `MARSDecoder.step`
(after it, `observe_step`). Every record is kept per model / device / dtype and batch size for the life of the
process (`record_for`), as the step costs are (`cost.costs_for`): a short call has fewer steps than a warm-up.
"""

from __future__ import annotations

import bisect
import dataclasses
import time

from .call_record import CALL_LAYOUTS, ENGINE_LAYOUTS, ENGINE_WARM_STEPS, CallRecord, ThresholdCallRecord

EMA = 0.2  # the drafting steps' width, averaged
# drafts accepted and predicted, averaged over ~1/RECORD steps; before the drafts have a record one accepted draft
# per row-step is assumed, worth PRIOR_STEPS steps, so that a few unlucky first steps do not switch drafting off
# (a running mean with the prior counted in, until its weight falls to RECORD)
RECORD, PRIOR_ACCEPTED, PRIOR_STEPS = 0.05, 1.0, 8
PROBE_EVERY = 32  # plain steps in a row before drafting is tried again (the masks may pay on this text)
# a decoder's first 16 drafting steps take the default layout (the 'auto' tree): the warm-up that times it and gives
# the drafts a record before anything narrower or plain is tried; then a plain step is taken once to time it
EXPLORE_AFTER = 16
CAL_BOUNDS = (0.05, 2.0)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One step's draft layout for a row: top-k per depth (``shape``), masks per group (``group``, 0: a plain
    1-token step) and which nodes get a group (``min_share``: `tree.Tree.choose_groups`; 1.0: only the likeliest
    end of the path, the chain's habit)."""

    shape: tuple
    group: int
    min_share: float

    @property
    def plain(self) -> bool:
        return self.group == 0

    def label(self) -> str:
        if self.plain:
            return "plain"
        one = "" if self.min_share < 1.0 else "/1g"
        return ",".join(map(str, self.shape)) + one


PLAIN = Layout((), 0, 1.0)


def menu(max_drafts: int, min_share: float) -> list:
    """The drafting layouts the policy weighs: all-top-1 trees of every depth (masks after every likely end), the
    full-depth one with a single group (chain-like width), and two branching shapes. Every group holds all
    ``max_drafts`` masks: a shallower group would propose shallower drafts, and a step choosing by the drafts in
    hand could then never see that deeper ones pay (the depth is chosen from the nodes instead)."""
    out = [Layout((1,) * d, max_drafts, min_share) for d in range(1, max_drafts + 1)]
    if max_drafts >= 1:
        out.append(Layout((1,) * max_drafts, max_drafts, 1.0))
    for wide in ((2, 1, 1, 1), (2, 2, 1, 1)):
        shape = wide[:max_drafts]
        if max_drafts >= 2 and Layout(shape, max_drafts, min_share) not in out:
            out.append(Layout(shape + (1,) * (max_drafts - len(shape)), max_drafts, min_share))
    return out


def propose_shape(layouts) -> tuple:
    """Top-k to keep per depth when proposing: enough for every layout the next step may choose."""
    depth = max((layout.group for layout in layouts), default=0)
    return tuple(max([layout.shape[j] for layout in layouts if j < len(layout.shape)] or [1]) for j in range(depth))


def tree_value(candidates, layout) -> tuple:
    """(nodes, groups, expected accepted drafts, P(the path ends at a node with masks)) of ``layout`` over one
    row's candidates (per depth, (token, probability) pairs, best first): what `tree.Tree.grow` and
    `tree.Tree.choose_groups` would build, read level by level without building it (the policy asks this for every
    row and layout each step: building the trees was most of its host time). A tree's depth-d candidates are the
    same under every parent, so a node's children carry the same probability mass at every node of a depth."""
    levels, child_mass = [[1.0]], []  # P(reach) of each node, per depth (the root first); children's mass per depth
    for depth in range(min(len(candidates), len(layout.shape))):
        probs = [prob for _, prob in candidates[depth][:layout.shape[depth]]]
        if not probs:
            break
        child_mass.append(sum(probs))
        levels.append([reach * prob for reach in levels[-1] for prob in probs])
    child_mass.append(0.0)  # the deepest nodes have no children
    ends = [reach * max(0.0, 1.0 - child_mass[d]) for d, level in enumerate(levels) for reach in level]
    grouped = [end for end in ends if end >= layout.min_share] or [max(ends)]
    nodes = sum(len(level) for level in levels[1:])
    return nodes, len(grouped), sum(sum(level) for level in levels[1:]), min(sum(grouped), 1.0)


@dataclasses.dataclass
class DraftRecord:
    """What verify's drafts did (running means: the prior first, then EMA), and the policy's exploration."""

    predicted: float = PRIOR_ACCEPTED  # drafts predicted per drafting row-step
    accepted: float = PRIOR_ACCEPTED  # ... accepted
    tokens: float | None = None  # tokens per row of a drafting step (1 + accepted)
    width: float | None = None  # a drafting step's width
    plain_run: int = 0  # plain steps in a row
    drafting_timed: int = 0  # drafting steps seen (the warm-up counts them)


@dataclasses.dataclass
class ThresholdRecord:
    """What threshold mode's wide steps emitted (a running mean from verify's prior), and the plain stretch."""

    tokens: float = 1.0 + PRIOR_ACCEPTED  # per row of a wide step
    wide_steps: int = 0
    plain_run: int = 0


@dataclasses.dataclass
class Choice:
    """A step's layouts: one per row (None for inactive rows), and what the policy expected of it."""

    layouts: list
    width: int
    expected: float  # drafts expected accepted (uncalibrated: the calibration compares against it)
    plain: bool


class DraftPolicy:
    """A decoder's layout choice over two records it shares with every call on the same model, device, dtype and
    batch size in the process: the step costs (`cost.StepCosts`) and what the drafts did (`DraftRecord`). Shared,
    because a short call has fewer steps than the warm-up: a per-call record would never leave it.
    ``layouts``: the drafting layouts it may choose (`menu`)."""

    plain_step = False  # (a chain step - the prefill - is never made plain: plain rows are in the tree's layouts)

    def __init__(self, costs, layouts, history: dict | None = None, record: DraftRecord | None = None):
        self.costs, self.layouts = costs, list(layouts)
        self.step_choice = None  # the current decode step's `Choice` (`tree.TreeDecoder.plan_tree` reads it)
        self.rec = DraftRecord() if record is None else record
        self.history = {} if history is None else history  # layout label -> steps it was chosen (`choices_for`)

    # ------------------------------------------------------------ arithmetic
    @property
    def calibration(self) -> float:
        if not self.rec.predicted:
            return 1.0
        return min(max(self.rec.accepted / self.rec.predicted, CAL_BOUNDS[0]), CAL_BOUNDS[1])

    @property
    def future(self) -> float:
        """Drafts a row is expected to have accepted in a step that starts with drafts."""
        return self.rec.accepted

    def rate(self, rows, width, tokens) -> float | None:
        cost = self.costs.estimate(rows, width)
        return None if cost is None else tokens / cost

    def drafting_rate(self, rows, n_active) -> float | None:
        """The drafting regime's measured rate (tokens per second of a drafting step), None before it is known."""
        if self.rec.tokens is None or self.rec.width is None:
            return None
        return self.rate(rows, round(self.rec.width), self.rec.tokens * n_active)

    # ------------------------------------------------------------ the choice
    def choose(self, rows: int, uncached: list, candidates: list) -> Choice:
        """The step's layouts. ``rows``: the batch's rows (what a forward computes); ``uncached`` and
        ``candidates`` per row (None: an inactive row), candidates as `tree.Tree.grow` takes them."""
        active = [r for r, u in enumerate(uncached) if u is not None]
        n = len(active)
        plain_width = max(uncached[r] for r in active)
        plain_rate = self.rate(rows, plain_width, n)
        cal, future = self.calibration, self.future
        options = {}  # row -> [(width, value, immediate, expected, layout)]
        for r in active:
            opts = [(uncached[r], 1.0, 1.0, 0.0, PLAIN)]
            for layout in self.layouts:
                nodes, groups, expected, grouped_end = tree_value(candidates[r], layout)
                width = uncached[r] + nodes + groups * layout.group
                immediate = 1.0 + cal * expected
                opts.append((width, immediate + future * grouped_end, immediate, expected, layout))
            options[r] = opts
        has_drafts = any(candidates[r] for r in active)
        if self.rec.drafting_timed < EXPLORE_AFTER:  # the warm-up
            return self._default(options)
        if plain_rate is None:
            return self._plain(uncached, plain_width)  # a plain step not timed yet at this row count: once
        best = self._best_drafting(rows, options)
        if best is None:  # too little timed yet: the default layout, timed from here on
            return self._default(options)
        width, picks, immediate = best
        regime = self.drafting_rate(rows, n)
        now = self.rate(rows, width, immediate)
        drafting_pays = (regime is None or regime >= plain_rate
                         or (has_drafts and now is not None and now >= plain_rate))
        if not drafting_pays and self.rec.plain_run < PROBE_EVERY:
            return self._plain(uncached, plain_width)
        return self._finish(picks, width)

    def _best_drafting(self, rows, options):
        """Over every width a drafting layout gives: each row's best-valued layout that fits; the width whose
        value per second is highest. None when the costs cannot tell (fewer than two widths timed)."""
        fits = {r: _best_fits(opts) for r, opts in options.items()}  # per row: (widths, best pick up to each)
        widths = sorted({w for row_widths, _ in fits.values() for w in row_widths})
        best, best_rate = None, -1.0
        for width in widths:
            cost = self.costs.estimate(rows, width)
            if cost is None:
                return None
            picks, value, immediate = {}, 0.0, 0.0
            for r, (row_widths, row_best) in fits.items():
                at = bisect.bisect_right(row_widths, width) - 1
                pick = row_best[at] if at >= 0 else options[r][0]  # nothing fits: the row's plain option
                picks[r], value, immediate = pick, value + pick[1], immediate + pick[2]
            if value / cost > best_rate:
                best, best_rate = (max(p[0] for p in picks.values()), picks, immediate), value / cost
        return best

    def _default(self, options):
        default = self.layouts[0] if len(self.layouts) == 1 else _deepest_grouped(self.layouts)
        picks = {r: next(o for o in opts if o[4] == default) for r, opts in options.items()}
        return self._finish(picks, max(p[0] for p in picks.values()))

    def _plain(self, uncached, width) -> Choice:
        self.rec.plain_run += 1
        self.history["plain"] = self.history.get("plain", 0) + 1
        return Choice([PLAIN if u is not None else None for u in uncached], width, 0.0, True)

    def _finish(self, picks, width) -> Choice:
        self.rec.plain_run = 0
        layouts = [None] * (max(picks) + 1 if picks else 0)
        for r, pick in picks.items():
            layouts[r] = pick[4]
            self.history[pick[4].label()] = self.history.get(pick[4].label(), 0) + 1
        return Choice(layouts, width, sum(p[3] for p in picks.values()), False)

    # ------------------------------------------------------------ the decoder's hooks
    def choose_step(self, dec) -> None:
        """Before a tree decode step: the layouts of ``dec``'s rows (`tree.TreeDecoder.plan_tree` reads them)."""
        uncached, candidates = dec.row_candidates()
        self.step_choice = self.choose(dec.batch, uncached, candidates)

    def observe_step(self, dec, plan, seconds: float, accepted: list) -> None:
        """After it: its time, and the drafts each active row accepted (the tokens it emitted but the AR one)."""
        if self.step_choice is not None:
            self.observe(self.step_choice, dec.batch, plan.width, seconds, [max(accepted[r] - 1, 0) for r in plan.rows])
        self.step_choice = None

    # ------------------------------------------------------------ after the step
    def observe(self, choice: Choice, rows: int, width: int, seconds: float, accepted_drafts: list) -> None:
        """A step ran: its time goes to the cost table; a drafting step's accepted drafts (per active row) update
        the calibration and the drafting rate."""
        self.costs.record(rows, width, seconds)
        if choice.plain or not accepted_drafts:
            return
        self.rec.drafting_timed += 1
        n = len(accepted_drafts)
        got = sum(accepted_drafts) / n
        weight = max(RECORD, 1.0 / (PRIOR_STEPS + self.rec.drafting_timed))
        self.rec.predicted += weight * (choice.expected / n - self.rec.predicted)
        self.rec.accepted += weight * (got - self.rec.accepted)
        self.rec.tokens = 1.0 + self.rec.accepted
        self.rec.width = _ema(self.rec.width, float(width))


class ThresholdPolicy:
    """Threshold mode's one choice: a step with its K - 1 masks or a plain 1-token step (tau is untouched: a plain
    step only shortens the run the masks would have added to the AR token). Plain steps are taken while the
    wide steps' measured rate (tokens per row-step, a running mean from the same prior as verify's, over their
    measured cost) is below a plain step's; the first plain step is taken once to time it, and a plain stretch
    tries a wide step every PROBE_EVERY steps (its tokens are how the record learns the masks pay again)."""

    def __init__(self, costs, history: dict | None = None, record: ThresholdRecord | None = None):
        self.costs = costs
        self.rec = ThresholdRecord() if record is None else record  # shared like DraftPolicy's
        self.history = {} if history is None else history
        self.plain_step = False  # the current decode step is plain (`plan.plan_step` reads it)

    def plain(self, rows: int, wide_width: int, plain_width: int) -> bool:
        plain_cost = self.costs.estimate(rows, plain_width)
        if plain_cost is None:
            take = self.rec.wide_steps >= EXPLORE_AFTER
        else:
            wide_cost = self.costs.estimate(rows, wide_width)
            take = (wide_cost is not None and self.rec.tokens / wide_cost < 1.0 / plain_cost
                    and self.rec.plain_run < PROBE_EVERY)
        self.rec.plain_run = self.rec.plain_run + 1 if take else 0
        label = "plain" if take else "masks"
        self.history[label] = self.history.get(label, 0) + 1
        return take

    def choose_step(self, dec) -> None:
        """Before a decode step: whether ``dec``'s step is plain (`plan.plan_step` reads ``plain_step``)."""
        rows = dec.rows
        uncached = max((rows.emitted[r] - rows.fed[r] for r in range(dec.batch) if rows.unfinished[r]), default=0)
        self.plain_step = self.plain(dec.batch, uncached + dec.shape.candidates - 1, uncached)

    def observe_step(self, dec, plan, seconds: float, accepted: list) -> None:
        self.observe(self.plain_step, dec.batch, plan.width, seconds, [accepted[r] for r in plan.rows])

    def observe(self, plain: bool, rows: int, width: int, seconds: float, tokens: list) -> None:
        self.costs.record(rows, width, seconds)
        if plain or not tokens:
            return
        self.rec.wide_steps += 1
        weight = max(RECORD, 1.0 / (PRIOR_STEPS + self.rec.wide_steps))
        self.rec.tokens += weight * (sum(tokens) / len(tokens) - self.rec.tokens)


_CHOICES: dict = {}


def threshold_policy(dec):
    """Threshold mode's plain-step policy where the call has it (``plain_steps``, the default) and it can apply: eager
    steps of the sliding cache (None elsewhere). Rows held in lockstep (a sliding-window model's batch) take the
    plain step together, as they take every step."""
    if not dec.opts.plain_steps or dec.opts.verify or dec.shape.one_token or dec.shape.block or dec.clients.exact \
            or dec.shape.fixed_width:
        return None
    from .cost import costs_for

    return ThresholdPolicy(costs_for(dec.model, "chunk"), choices_for(dec.model, dec.batch, "chunk"),
                           record_for(dec.model, dec.batch, "chunk", acceptance=acceptance_key(dec.opts)))


def acceptance_key(opts) -> tuple:
    """What a threshold-mode call's masks are worth depends on its acceptance (tau, the rule, the block size, the
    cap, the last mask): calls that differ there keep their own records. Shared, a tau sweep would run every tau
    by what the first one measured (tau = 0.99's masks may not pay where tau = 0.5's do)."""
    return (float(opts.threshold), opts.acceptance, int(opts.block_size), opts.max_accept, bool(opts.use_last_mask))


def choices_for(model, rows: int, loop: str = "tree") -> dict:
    """How often each layout was chosen for this model / device / dtype, loop and batch size in this process
    ({label: steps}); `hf-mars bench` reports it per batch size."""
    from .cost import model_key, per_model

    return per_model(_CHOICES, (model_key(model), int(rows), loop), model, dict)


def threshold_call(dec, synced: bool):
    """Where threshold mode's plain steps apply (`threshold_policy` gave ``dec`` a policy) and the batch is a
    ``generate`` call's, the record and this call's layout ('masks' or 'plain'); (None, None) elsewhere."""
    if synced or not isinstance(dec.policy, ThresholdPolicy):
        return None, None
    record = record_for(dec.model, dec.batch, "threshold-call", acceptance=acceptance_key(dec.opts))
    return record, record.choose()


def threshold_call_done(dec, record, layout: str) -> None:
    """The call ran: its progress and decode time to the record; a plain call's steps count as plain ones in the
    per-step shares (`choices_for`, what `hf-mars bench` reports)."""
    forwards = max(dec.rows.forwards)
    if dec.outputs.decode_started is not None:
        record.observe_call(layout, max(dec.rows.emitted), forwards, forwards - 1,
                            time.perf_counter() - dec.outputs.decode_started)
    if layout == "plain":
        history = choices_for(dec.model, dec.batch, "chunk")
        history["plain"] = history.get("plain", 0) + forwards - 1


_RECORDS: dict = {}


def record_for(model, rows: int, loop: str = "tree", draft_vocab: tuple | None = None,
               acceptance: tuple | None = None):
    """The process's `DraftRecord` ("tree"), `ThresholdRecord` ("chunk"), 'auto''s `CallRecord` ("call", "call-chain"),
    `ThresholdCallRecord` ("threshold-call") or `MARSEngine`'s ("engine") for this model / device / dtype and batch
    size, shared by successive calls. Calls with a draft vocabulary (``mars_draft_vocab``) keep their own: it makes
    a wide step cheaper, so what pays differs; so do threshold-mode calls of another acceptance (`acceptance_key`):
    their masks emit more or fewer tokens."""
    from .cost import model_key, per_model

    make = {"tree": DraftRecord, "chunk": ThresholdRecord, "call": CallRecord,
            "engine": lambda: CallRecord(ENGINE_LAYOUTS, warm_calls=ENGINE_WARM_STEPS),
            "call-chain": lambda: CallRecord(CALL_LAYOUTS[1:]),  # (no tree: the chain or plain)
            "threshold-call": ThresholdCallRecord}[loop]
    return per_model(_RECORDS, (model_key(model), int(rows), loop, draft_vocab, acceptance), model, make)


def _best_fits(opts) -> tuple:
    """One row's drafting options (width, value, ...) as (their widths, ascending; the option that
    ``max(value, -width)`` picks among those up to each width, the first listed of equals), so that a width's best
    fit is one bisection instead of a scan of every option."""
    drafting = sorted((o for o in opts if not o[4].plain), key=lambda o: o[0])  # (stable: listed order within a width)
    widths, best, kept = [], [], None
    for option in drafting:
        if kept is None or (option[1], -option[0]) > (kept[1], -kept[0]):
            kept = option
        if widths and widths[-1] == option[0]:
            best[-1] = kept
        else:
            widths.append(option[0])
            best.append(kept)
    return widths, best


def _deepest_grouped(layouts):
    """The warm-up's layout, verify's default tree ("auto"): the all-top-1 tree of full depth, masks after every
    likely end."""
    chains = [layout for layout in layouts if set(layout.shape) == {1} and layout.min_share < 1.0]
    return max(chains, key=lambda layout: len(layout.shape)) if chains else layouts[0]


def _ema(old, new):
    return new if old is None else old + EMA * (new - old)
