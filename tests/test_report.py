"""`BenchmarkReport`: the one typed reading of the demo's report.json and `hf-mars bench` JSON (hf_mars/bench/report.py).

The bench round trip on a real `hf-mars bench --output` file is in tests/test_bench.py, the demo's in tests/test_demo.py;
here: the shipped demo report (docs/demo_report.json, a full run), the layouts' corner cases and the errors.
"""

import json
from pathlib import Path

import pytest

from hf_mars.bench.report import BenchmarkReport, Measurement

DEMO_REPORT = Path(__file__).resolve().parents[1] / "docs" / "demo_report.json"


def test_demo_report_round_trips():
    raw = json.loads(DEMO_REPORT.read_text())
    report = BenchmarkReport.load(DEMO_REPORT)
    assert BenchmarkReport.load(report.to_dict()) == report and BenchmarkReport.load(report) is report
    assert BenchmarkReport.load(raw) == report
    # every figure the card reads is the report's own, under the report's own keys
    as_dict = report.to_dict()
    for key in ("ar_sft", "verify"):
        for field, value in as_dict[key].items():
            assert value == raw[key].get(field), (key, field)
    assert [m["threshold"] for m in as_dict["mars"]] == [r["threshold"] for r in raw["mars"]]
    assert as_dict["mars"] == [{f: r.get(f) for f in Measurement.__dataclass_fields__} for r in raw["mars"]]
    for key in ("block_size", "paired_tau1_vs_ar_sft", "description", "task", "num_examples", "max_new_tokens",
                "device", "command"):
        assert as_dict[key] == raw[key], key


def test_demo_report_card_table():
    table = BenchmarkReport.load(DEMO_REPORT).card_table()
    names = [row["name"] for row in table["rows"]]
    assert names[0].startswith("AR SFT baseline") and names[1] == "MARS (one-token mode)"
    assert names[-1].startswith("MARS verify") and len(names) == 2 + len(json.loads(DEMO_REPORT.read_text())["mars"])
    one = table["rows"][1]
    assert one["threshold"] == "1" and one["accuracy"] == "96.2% (93.6–97.8)" and one["speedup"] == "1.10×"
    assert table["rows"][0]["tokens_per_forward"] == "1.00" and table["rows"][0]["speedup"] == "–"
    assert any("McNemar" in note for note in table["notes"]) and any("Wilson" in note for note in table["notes"])
    assert "Reproduce with: `hf-mars demo`." in table["notes"]


def test_bench_layout_and_percentages():
    bench = {"settings": {"block_size": 2}, "machine": {"device": "cpu"}, "rows": [
        {"batch_size": 4, "mode": "ar", "accuracy": None, "tokens_per_forward": 1.0, "speedup_vs_ar": 1.0},
        {"batch_size": 4, "mode": "mars", "cache": "sliding", "threshold": 0.9, "accuracy": None,
         "tokens_per_forward": 1.7, "speedup_vs_ar": 1.2},
        {"batch_size": 4, "mode": "mars", "cache": "block", "threshold": 0.9, "accuracy": None,
         "tokens_per_forward": 1.7, "speedup_vs_ar": 1.1}]}
    report = BenchmarkReport.load(bench)
    assert report.block_size == 2 and len(report.mars) == 1 and report.mars[0].speedup_vs_ar == 1.2  # sliding only
    assert report.description == "Measured with `hf-mars bench` at batch size 4." and report.device == "cpu"
    assert [row["accuracy"] for row in report.card_table()["rows"]] == ["–", "–"]
    # accuracies above 1 are percentages: printed as given, without intervals
    pct = BenchmarkReport.load({"mars": [{"threshold": 0.9, "accuracy": 85.0, "accuracy_ci95": [80, 90]}],
                                "ar": {"accuracy": 80.0}})
    rows = pct.card_table()["rows"]
    assert [r["accuracy"] for r in rows] == ["80.0", "85.0"] and rows[0]["speedup"] == "1.00×"


@pytest.mark.parametrize("bad", [{"accuracy": 1.0}, {"mars": []}, {"mars": [{"threshold": 1.0}]}, ["mars"],
                                 {"rows": []}])
def test_malformed_reports_are_refused(bad):
    with pytest.raises(ValueError, match="benchmark|entry needs"):
        BenchmarkReport.load(bad)
