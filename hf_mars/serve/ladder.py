"""The τ ladder: which τ a generate call runs at, from the load when it starts."""

from __future__ import annotations

from ..generation import check_threshold


class TauLadder:
    """``"0:1.0,2:0.99,6:0.95"``: from a load of 0 requests τ = 1.0, from 2 τ = 0.99, from 6 τ = 0.95."""

    def __init__(self, spec: str, name: str = "--tau-ladder"):
        rungs = []
        for part in str(spec).split(","):
            load, sep, tau = part.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                load_i, tau_f = int(load), float(tau)
            except ValueError:
                raise ValueError(f"{name}: {part.strip()!r} is not LOAD:TAU (e.g. '0:1.0,4:0.99')") from None
            if load_i < 0:
                raise ValueError(f"{name}: load {load_i} is negative; loads count requests (0, 1, 2, ...)")
            check_threshold(tau_f, name=f"{name} τ")
            rungs.append((load_i, tau_f))
        loads = [load for load, _ in rungs]
        if loads != sorted(set(loads)):
            raise ValueError(f"{name}: loads must increase strictly, got {loads}")
        if loads[0] != 0:
            raise ValueError(f"{name}: the first rung must start at load 0 (what an idle server uses)")
        self.rungs = rungs

    def tau_for(self, load: int) -> float:
        return [tau for start, tau in self.rungs if load >= start][-1]

    def label(self, tau: float) -> str:
        """A metrics label for any τ, from a fixed set: the lowest rung at or above it, or ``<lowest``.

        Requests may send their own τ; labelling each distinct value would let clients grow the metrics without
        bound, so a τ is counted under the rung it falls to."""
        above = [rung for _, rung in self.rungs if rung >= tau]
        return f"{min(above):g}" if above else f"<{min(rung for _, rung in self.rungs):g}"

    def __str__(self):
        return ",".join(f"{load}:{tau:g}" for load, tau in self.rungs)
