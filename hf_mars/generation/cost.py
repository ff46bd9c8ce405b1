"""What a decode step costs, by (rows, width): measured from the decoder's own steps, kept per model / device /
dtype for the life of the process.

Why measured, not assumed: whether a wider step pays depends on the model, the device and the batch. On a laptop
CPU a step of 25 columns costs ~1.3x a 1-token step at batch 1 and ~2.7x at batch 16; on a real model or a full GPU
batch the curve is different again. The policy of the opt-in draft layout 'cost' (`policy.py`) weighs the tokens
a layout is expected to emit against what this table says its width costs.

Timing is free: a step's wall-clock from its start to the end of its one host sync (the slot read every step
already makes) is recorded; no forward is added and, on an accelerator, no sync. Asynchronous work queued after
the sync lands in the next step's time, which evens out over steps. The table can be seeded from
``hf-mars bench``'s measured step costs (`seed_from_bench`), so a process starts with a curve instead of
exploring.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import weakref

from ._compat import checkpoint_name

# a low quantile of each key's step times, tracked: a faster sample moves the estimate by FALL of the gap, a slower
# one by RISE. On a shared machine a step is sometimes preempted (10x its time); the least disturbed steps say
# what a layout costs, as the bench's fastest-of-repeats does. (RISE > 0: a load that stays follows, slowly.)
FALL, RISE = 0.5, 0.05
STEP_COSTS_ENV = "HF_MARS_STEP_COSTS"  # a bench report.json (or its step_costs) that seeds every new table


class StepCosts:
    """Seconds per decode step by (rows, width), an exponential moving average per measured key; other keys are
    read off the measured widths at the same row count (linear between them, the nearest slope beyond them)."""

    def __init__(self):
        self._by_rows: dict[int, dict[int, float]] = {}
        self._seeded: set = set()  # (rows, width) read from a bench: the first own measurement replaces it
        self._lock = threading.Lock()  # (a server steps from a worker thread; reads come from the same one)

    def record(self, rows: int, width: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1 or width < 1:
            return
        with self._lock:
            table = self._by_rows.setdefault(int(rows), {})
            old = table.get(int(width))
            if (int(rows), int(width)) in self._seeded:  # a bench times a bare forward; a step does more
                self._seeded.discard((int(rows), int(width)))
                old = None
            table[int(width)] = seconds if old is None else old + (FALL if seconds < old else RISE) * (seconds - old)

    def seed(self, rows: int, costs: dict) -> None:
        """Measured costs at one row count ({width: seconds}); a width the decoder already measured keeps its own."""
        with self._lock:
            table = self._by_rows.setdefault(int(rows), {})
            for width, seconds in costs.items():
                if seconds and seconds > 0 and int(width) not in table:
                    table[int(width)] = float(seconds)
                    self._seeded.add((int(rows), int(width)))

    def widths_by_rows(self) -> list:
        """The row counts measured (or seeded)."""
        return sorted(self._by_rows)

    def widths(self, rows: int) -> list:
        return sorted(self._by_rows.get(int(rows), ()))

    def estimate(self, rows: int, width: int) -> float | None:
        """The cost of a step, or None when this row count has fewer than two measured widths to read it from
        (one width says nothing about how cost grows with width)."""
        table = self._by_rows.get(int(rows))
        if not table:
            return None
        width = int(width)
        if width in table:
            return table[width]
        ws = sorted(table)
        if len(ws) < 2:
            return None
        i = min(max(bisect.bisect_left(ws, width), 1), len(ws) - 1)
        w0, w1 = ws[i - 1], ws[i]
        c0, c1 = table[w0], table[w1]
        slope = max((c1 - c0) / (w1 - w0), 0.0)  # (noise can make a wider step look cheaper: never below flat)
        return max(c0 + slope * (width - w0), min(c0, c1) * 0.5)

    def snapshot(self) -> dict:
        """{rows: {width: seconds}}: what `seed` takes back (and what the bench report records)."""
        with self._lock:
            return {r: dict(sorted(t.items())) for r, t in sorted(self._by_rows.items())}


_TABLES: dict = {}
_TABLES_LOCK = threading.Lock()


def model_key(model) -> tuple:
    """Which table a model's steps go to: its checkpoint (or, unnamed, the object), device and dtype."""
    name = checkpoint_name(model) or f"<{type(model).__name__} at {id(model):#x}>"
    device = getattr(model, "device", None)
    dtype = getattr(model, "dtype", None)
    return (str(name), type(model).__name__, str(device), str(dtype))


def per_model(registry: dict, key: tuple, model, make):
    """``registry[key]``, made by ``make()`` on first use. ``key`` starts with `model_key`; an unnamed model's entry
    goes with the model (its address may be reused by another). Callers hold their own lock where they need one."""
    entry = registry.get(key)
    if entry is None:
        entry = registry[key] = make()
        if key[0][0].startswith("<"):
            try:
                weakref.finalize(model, registry.pop, key, None)
            except TypeError:  # (an object that takes no weak reference: kept for the process)
                pass
    return entry


def costs_for(model, loop: str = "tree", draft_vocab: tuple | None = None) -> StepCosts:
    """The process's table for this model / device / dtype and decoding loop (a tree step and a threshold step
    of one width do different host work; made on first use, seeded from $HF_MARS_STEP_COSTS). A draft vocabulary
    (``mars_draft_vocab``) makes the mask columns cheap, so its steps have a table of their own (not seeded: the
    bench's costs are full-vocabulary forwards)."""

    def make():
        table = StepCosts()
        path = os.environ.get(STEP_COSTS_ENV)
        return seed_from_bench(table, path) if path else table

    with _TABLES_LOCK:
        return per_model(_TABLES, model_key(model) + (loop, draft_vocab), model,
                         make if draft_vocab is None else StepCosts)


def forget_all() -> None:
    """Drop every table (tests; a process whose load changed for good)."""
    with _TABLES_LOCK:
        _TABLES.clear()


def bench_tables(step_costs: dict) -> dict:
    """``hf-mars bench``'s ``step_costs`` ({batch: {"table_ms": {width: ms}, ...}}) as {rows: {width: seconds}}."""
    out = {}
    for rows, entry in (step_costs or {}).items():
        widths = entry.get("table_ms") if isinstance(entry, dict) else None
        if isinstance(widths, dict):
            out[int(rows)] = {int(w): float(ms) / 1e3 for w, ms in widths.items() if ms}
    return out


def seed_from_bench(table: StepCosts, source) -> StepCosts:
    """Seed ``table`` from a bench report (a path to report.json, or its parsed dict / ``step_costs``)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            source = json.load(f)
    step_costs = source.get("step_costs", source) if isinstance(source, dict) else {}
    for rows, costs in bench_tables(step_costs).items():
        table.seed(rows, costs)
    return table
