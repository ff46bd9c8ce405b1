"""`hf-mars demo --quick` end to end: report.json schema, plot, table and a loadable Hub-ready checkpoint."""

import json
import math
import os
import subprocess
import sys

import pytest

from hf_mars.demo.pipeline import THRESHOLDS, base_model_path, pick_quality_threshold


def test_shipped_base_is_small_safetensors():
    base = base_model_path()
    assert (base / "model.safetensors").is_file(), "run examples/build_tiny_base.py to rebuild the shipped base"
    assert not list(base.glob("*.bin"))
    total = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    assert total < 8 * 2**20
    config = json.loads((base / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert "mars" not in config  # the AR-SFT stage: no mask token yet


def test_pick_quality_threshold():
    rows = [{"threshold": 1.0, "accuracy": 0.90, "tokens_per_forward": 1.0},
            {"threshold": 0.95, "accuracy": 0.89, "tokens_per_forward": 1.8},
            {"threshold": 0.9, "accuracy": 0.86, "tokens_per_forward": 2.2}]
    assert pick_quality_threshold(rows)["threshold"] == 0.95
    rows[1]["accuracy"] = 0.80
    assert pick_quality_threshold(rows)["threshold"] == 1.0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "hf_mars", "demo", "--quick", "--output-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _frac(x):
    return isinstance(x, float) and 0.0 <= x <= 1.0


def test_quick_demo_report(quick_run):
    out, stdout = quick_run
    report = json.loads((out / "report.json").read_text())
    paired = report["paired_tau1_vs_ar_sft"]  # honest figures: intervals and a paired test, not a bare headline
    assert paired["n"] == report["num_examples"] and 0.0 <= paired["p_value_mcnemar_exact"] <= 1.0
    for row in report["mars"] + [report["ar_sft"], report["verify"]]:
        lo, hi = row["accuracy_ci95"]
        assert lo <= row["accuracy"] <= hi
    assert isinstance(report["block_size"], int) and report["block_size"] == 4
    assert _frac(report["ar_sft"]["accuracy"])
    assert [r["threshold"] for r in report["mars"]] == list(THRESHOLDS)
    for r in report["mars"]:
        assert _frac(r["accuracy"])
        assert r["tokens_per_forward"] >= 1.0 and r["speedup_vs_ar"] > 0 and math.isfinite(r["speedup_vs_ar"])
    one = report["mars"][0]
    assert one["tokens_per_forward"] == 1.0  # tau = 1: exactly one token per forward ...
    assert report["mars_greedy"]["identical_to_tau_1"]  # ... and the same text as plain greedy generate
    v = report["verify"]
    assert _frac(v["accuracy"]) and v["tokens_per_forward"] >= 1.0 and v["speedup_vs_ar"] > 0
    assert v["accuracy"] == one["accuracy"] and v["identical_to_greedy"]  # lossless
    rows = {(r["batch_size"], r["cache"], r["mode"]) for r in report["batch_speedup"]}
    for bs in (1, 4, 16):
        assert {(bs, "sliding", "threshold"), (bs, "block", "threshold"), (bs, "sliding", "verify")} <= rows
    for r in report["batch_speedup"]:
        assert isinstance(r["batch_size"], int) and isinstance(r["threshold"], float) and r["speedup_vs_ar"] > 0
    assert set(report["per_task"]) == {"arith", "copy", "reverse", "sort", "count", "facts", "json", "code"}
    for entry in report["per_task"].values():
        assert _frac(entry["ar_sft"]) and _frac(entry["verify"]["accuracy"])
        assert set(entry["mars"]) == {f"{t:g}" for t in THRESHOLDS}
    assert "| **overall** |" in stdout  # the table is printed


def test_quick_demo_report_is_the_cards_report(quick_run):
    """The report.json the demo wrote reads back as one typed report, round-trips, and is the checkpoint card's table."""
    from hf_mars.bench.report import BenchmarkReport

    out, _ = quick_run
    raw = json.loads((out / "report.json").read_text())
    report = BenchmarkReport.load(out / "report.json")
    assert BenchmarkReport.load(report.to_dict()) == report
    assert [m.threshold for m in report.mars] == [r["threshold"] for r in raw["mars"]]
    assert report.verify.tokens_per_forward == raw["verify"]["tokens_per_forward"]
    card = (out / "mars-checkpoint" / "README.md").read_text()
    for row in report.card_table()["rows"]:
        assert f"| {row['name']} | {row['threshold']} | {row['accuracy']} |" in card, row


def test_quick_demo_files(quick_run):
    out, _ = quick_run
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (out / "per_task.md").read_text()
    assert "| task |" in table and "| **overall** |" in table
    ckpt = out / "mars-checkpoint"
    for name in ("model.safetensors", "config.json", "generation_config.json", "README.md",
                 "custom_generate/generate.py", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "config.json").read_text())["mars"]["block_size"] == 4
    assert not (out / "_work").exists()


def test_quick_demo_checkpoint_generates(quick_run):
    """The saved checkpoint loads as a plain model and decodes with MARS on a prompt the demo never saw."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mars import enable_mars

    out, _ = quick_run
    tok = AutoTokenizer.from_pretrained(out / "mars-checkpoint")
    model = AutoModelForCausalLM.from_pretrained(out / "mars-checkpoint")
    enable_mars(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Copy: unseenprompt"}], tokenize=False,
                                     add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        ar = model.generate(**enc, max_new_tokens=16, do_sample=False)
        mars = model.generate(**enc, max_new_tokens=16, do_sample=False, mars=True, mars_threshold=1.0)
    assert torch.equal(ar, mars)


def test_output_dir_is_never_clobbered(tmp_path, capsys):
    from hf_mars.cli import main
    from hf_mars.demo.pipeline import DEMO_MARKER, _prepare_output_dir

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    (foreign / "_work").mkdir()
    (foreign / "_work" / "data.txt").write_text("keep me too")
    assert main(["demo", "--quick", "--output-dir", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mars demo: error: ") and "not empty" in err and "Traceback" not in err
    assert (foreign / "notes.txt").read_text() == "keep me" and (foreign / "_work" / "data.txt").is_file()
    fresh = _prepare_output_dir(tmp_path / "new" / "run")  # created, and marked as the demo's
    assert (fresh / DEMO_MARKER).is_file()
    (fresh / "report.json").write_text("{}")
    assert _prepare_output_dir(fresh) == fresh  # a previous demo run is reused
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path / "file")]) == 2


def test_quick_demo_left_no_scratch_and_a_fresh_checkpoint(quick_run):
    out, _ = quick_run
    assert not [p for p in out.iterdir() if p.name.startswith("_work")]


def test_intervals_and_paired_test():
    from hf_mars.demo.pipeline import paired_comparison, wilson_interval

    lo, hi = wilson_interval(307, 320)
    assert 0.93 < lo < 0.935 and 0.975 < hi < 0.977  # 95.9% of 320
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    # 6 discordant questions all one way: exact two-sided McNemar p = 2 / 2**6
    a, b = [True] * 6 + [True] * 10, [False] * 6 + [True] * 10
    res = paired_comparison(a, b)
    assert res["only_first_right"] == 6 and res["only_second_right"] == 0
    assert abs(res["p_value_mcnemar_exact"] - 2 / 64) < 1e-12 and res["verdict"].startswith("differs")
    same = paired_comparison([True, False] * 50, [True, False] * 50)
    assert same["p_value_mcnemar_exact"] == 1.0 and "cannot be told from noise" in same["verdict"]
