"""`BenchmarkReport`: the one typed reading of a measured report, and the model card's table rendered from it.

Two commands write measurements: `hf-mars demo` (``report.json``: AR-SFT baseline, one row per τ, verify mode,
intervals and a paired test) and `hf-mars bench` (``--output``: one row per batch size, mode and cache). Both
layouts are written in this package, so the code that reads them back lives here too: `BenchmarkReport.load`
accepts either (a dict, a path, or a report already loaded) and checks it, and `card_table` renders what the Hub
model card shows. `hf_mars.hub` only calls those two, so a change to either layout is made in one package.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BenchmarkReport", "Measurement"]

_LAYOUT_HINT = (
    "benchmark must be a report dict like the demo's report.json: {'block_size': 4, 'ar_sft': {'accuracy': ...}, "
    "'mars': [{'threshold', 'accuracy', 'tokens_per_forward', 'speedup_vs_ar'}, ...], 'verify': {...}} "
    "(or the path of such a JSON file)."
)
_NOTES = (("task", "Task"), ("num_examples", "Examples"), ("max_new_tokens", "max_new_tokens"),
          ("device", "Device"), ("command", "Reproduce with"))


@dataclass(frozen=True)
class Measurement:
    """One decoding mode as measured: accuracy (a fraction, or a percentage), its 95% interval, tokens per forward
    pass, and wall-clock speed-up over plain AR decoding of the same model. Absent figures are None."""

    accuracy: float | None = None
    accuracy_ci95: tuple[float, float] | None = None
    tokens_per_forward: float | None = None
    speedup_vs_ar: float | None = None
    threshold: float | None = None

    @classmethod
    def from_dict(cls, entry: dict, **defaults) -> Measurement:
        """The report entry's own keys (others, such as ``train_seconds``, are not the card's and are dropped);
        ``defaults`` stand in for keys the entry lacks."""
        values = {**defaults, **{k: entry[k] for k in cls.__dataclass_fields__ if k in entry}}
        ci = values.get("accuracy_ci95")
        values["accuracy_ci95"] = tuple(ci) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None
        if values.get("threshold") is not None:
            values["threshold"] = float(values["threshold"])
        return cls(**values)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.accuracy_ci95 is not None:
            out["accuracy_ci95"] = list(self.accuracy_ci95)
        return out


@dataclass(frozen=True)
class BenchmarkReport:
    """What a model card says about measured decoding, in `hf-mars demo`'s ``report.json`` layout (same keys).

    ``mars``: one entry per threshold τ; ``ar_sft``: a separately trained AR baseline; ``ar``: this model decoded by
    plain ``generate``; ``verify``: the lossless verify mode; ``paired_tau1_vs_ar_sft``: the demo's paired test
    (``n``, ``verdict``, ...). The remaining fields become the card's notes.
    """

    mars: tuple[Measurement, ...]
    block_size: int | None = None
    ar_sft: Measurement | None = None
    ar: Measurement | None = None
    verify: Measurement | None = None
    paired_tau1_vs_ar_sft: dict | None = None
    description: str | None = None
    task: str | None = None
    num_examples: int | None = None
    max_new_tokens: int | None = None
    device: str | None = None
    command: str | None = None

    # ------------------------------------------------------------------ reading

    @classmethod
    def load(cls, source) -> BenchmarkReport:
        """A report from a demo ``report.json`` or `hf-mars bench` JSON: a dict, a path, or a BenchmarkReport.

        Raises ValueError, naming the expected layout, for anything else, so a bad ``benchmark=`` fails before a
        checkpoint is written.
        """
        if isinstance(source, cls):
            return source
        if isinstance(source, (str, os.PathLike)):
            source = json.loads(Path(source).read_text(encoding="utf-8"))
        if isinstance(source, dict) and "mars" not in source and isinstance(source.get("rows"), list):
            source = _bench_layout(source)
        if not isinstance(source, dict) or not isinstance(source.get("mars"), list) or not source["mars"]:
            raise ValueError(_LAYOUT_HINT)
        for entry in source["mars"]:
            if not isinstance(entry, dict) or "threshold" not in entry or "accuracy" not in entry:
                raise ValueError(f"each benchmark['mars'] entry needs 'threshold' and 'accuracy'; got {entry!r}.")
        return cls.from_dict(source)

    @classmethod
    def from_dict(cls, report: dict) -> BenchmarkReport:
        """The fields of a checked demo-layout dict (see `load`, which checks)."""
        def entry(key, **defaults):
            value = report.get(key)
            return Measurement.from_dict(value, **defaults) if isinstance(value, dict) else None

        paired = report.get("paired_tau1_vs_ar_sft")
        return cls(
            mars=tuple(Measurement.from_dict(e) for e in report["mars"]),
            block_size=report.get("block_size"),
            ar_sft=entry("ar_sft", tokens_per_forward=1.0),  # one token per forward: that is what AR is
            ar=entry("ar", tokens_per_forward=1.0, speedup_vs_ar=1.0),
            verify=entry("verify"),
            paired_tau1_vs_ar_sft=dict(paired) if isinstance(paired, dict) else None,
            **{key: report.get(key) for key, _ in _NOTES},
            description=report.get("description"),
        )

    def to_dict(self) -> dict:
        """The report in the demo's layout (what `load` reads back to an equal report)."""
        out = {"block_size": self.block_size, "mars": [m.to_dict() for m in self.mars]}
        for key in ("ar_sft", "ar", "verify"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key).to_dict()
        if self.paired_tau1_vs_ar_sft is not None:
            out["paired_tau1_vs_ar_sft"] = dict(self.paired_tau1_vs_ar_sft)
        for key in ("description",) + tuple(k for k, _ in _NOTES):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    # ------------------------------------------------------------------ the model card's table

    def card_table(self) -> dict:
        """``{"block_size", "description", "rows", "notes"}`` for the model-card template's measured table."""
        rows = []
        if self.ar_sft is not None:
            rows.append(self._row("AR SFT baseline (a separate AR-trained model)", self.ar_sft, threshold="–"))
        if self.ar is not None:
            rows.append(self._row("this model, plain AR decoding", self.ar, threshold="–", ci=False))
        for m in sorted(self.mars, key=lambda m: -m.threshold):
            rows.append(self._row("MARS" + (" (one-token mode)" if m.threshold >= 1.0 else ""), m))
        if self.verify is not None:
            rows.append(self._row("MARS verify (lossless, `mars_verify=True`)", self.verify))
        return {"block_size": self.block_size, "description": self.description, "rows": rows,
                "notes": self._notes(rows)}

    @property
    def _fraction(self) -> bool:
        """Accuracies as fractions (rendered as %), unless one of them exceeds 1 (then they are percentages)."""
        entries = list(self.mars) + [m for m in (self.ar, self.ar_sft, self.verify) if m is not None]
        return all(m.accuracy is None or m.accuracy <= 1.0 for m in entries)

    def _row(self, name: str, m: Measurement, threshold: str | None = None, ci: bool = True) -> dict:
        if m.accuracy is None:
            accuracy = "–"
        elif not self._fraction:
            accuracy = f"{m.accuracy:.1f}"
        else:
            accuracy = f"{100 * m.accuracy:.1f}%"
            if ci and m.accuracy_ci95 is not None:
                accuracy += f" ({100 * m.accuracy_ci95[0]:.1f}–{100 * m.accuracy_ci95[1]:.1f})"
        if threshold is None:
            threshold = "–" if m.threshold is None else f"{m.threshold:g}"
        return {"name": name, "threshold": threshold, "accuracy": accuracy,
                "tokens_per_forward": _number(m.tokens_per_forward), "speedup": _number(m.speedup_vs_ar, "×")}

    def _notes(self, rows) -> list[str]:
        notes = []
        if any(m.accuracy_ci95 is not None for m in self.mars):
            notes.append("Accuracy in brackets: 95% Wilson interval over the held-out questions.")
        paired = self.paired_tau1_vs_ar_sft
        if paired and paired.get("verdict"):
            notes.append(f"One-token MARS (τ = 1) against the AR-SFT baseline on the same {paired.get('n')} questions "
                         f"(paired, exact McNemar test): {paired['verdict']}.")
        for key, label in _NOTES:
            value = getattr(self, key)
            if value is not None:
                notes.append(f"{label}: {f'`{value}`' if key == 'command' else value}.")
        if any(row["speedup"] != "–" for row in rows):
            notes.append("Speedup: the report's `speedup_vs_ar`, wall-clock time relative to AR decoding of the same "
                         "model.")
        return notes


def _number(value, suffix: str = "") -> str:
    return "–" if value is None else f"{float(value):.2f}{suffix}"


def _bench_layout(result: dict) -> dict:
    """`hf-mars bench` output in the demo's report layout (same row keys): its smallest batch size, sliding cache,
    the default acceptance rule."""
    rows = [r for r in result["rows"] if isinstance(r, dict)]
    if not rows:
        return result
    b = min(r.get("batch_size", 1) for r in rows)
    rows = [r for r in rows if r.get("batch_size", 1) == b]
    pick = ("threshold", "accuracy", "tokens_per_forward", "speedup_vs_ar")
    report = {"block_size": (result.get("settings") or {}).get("block_size"),
              "mars": [{k: r.get(k) for k in pick} for r in rows if r.get("mode") == "mars" and r.get("cache") == "sliding"
                       and r.get("acceptance") is None],
              "command": "hf-mars bench", "device": (result.get("machine") or {}).get("device")}
    ar = next((r for r in rows if r.get("mode") == "ar"), None)
    if ar is not None:
        report["ar"] = {k: ar.get(k) for k in ("accuracy", "tokens_per_forward", "speedup_vs_ar")}
    verify = next((r for r in rows if r.get("mode") == "verify"), None)
    if verify is not None:
        report["verify"] = {k: verify.get(k) for k in pick}
    if b != 1 or len({r.get("batch_size") for r in result["rows"]}) > 1:
        report["description"] = f"Measured with `hf-mars bench` at batch size {b}."
    return report
