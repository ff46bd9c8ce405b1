"""The benchmark: JSON structure and sanity on a tiny random checkpoint (no timing assertions)."""

import argparse
import json

import pytest
import torch

from hf_mars import bench
from hf_mars.bench.command import _json_default


def cli_main(argv):
    """`hf-mars bench ...` through the sub-command's own parser (independent of the other sub-commands)."""
    assert argv[0] == "bench"
    parser = argparse.ArgumentParser(prog="hf-mars bench")
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv[1:]))


@pytest.fixture
def checkpoint(tmp_path, make_model):
    model, tok = make_model(seed=0, hidden_size=32, num_layers=2)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Copy: abc"}, {"role": "assistant", "content": "abc"}], "task": "copy"},
        {"prompt": "Reverse: xyz", "answer": "zyx"},
        "Count to five.",
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_cli_json_structure_and_sanity(tmp_path, checkpoint, capsys):
    out = tmp_path / "bench.json"
    rc = cli_main([
        "bench", "--model", str(checkpoint), "--prompts", str(_prompt_file(tmp_path)), "--batch-sizes", "1", "2",
        "--thresholds", "1.0", "0.0", "--caches", "sliding", "block", "--cache-block", "4", "--block-size", "4",
        "--verify-thresholds", "0.0", "--max-new-tokens", "10", "--num-prompts", "2", "--repeats", "1",
        "--warmup", "0", "--cost-repeats", "2", "--threads", "1", "--output", str(out), "--quiet",
        "--peers", "prompt_lookup",  # (static_compile compiles for a minute on CPU: tested apart)
    ])
    assert rc == 0
    result = json.loads(out.read_text())
    table = capsys.readouterr().out
    for column in ("batch", "mode", "tau", "cache", "tree", "tok/fwd", "tok/s", "speedup", "limit", "eff", "step/c1"):
        assert column in table

    # one report schema: the bench's own JSON renders in a model card (threshold / speedup_vs_ar rows)
    from hf_mars.bench.report import BenchmarkReport

    report = BenchmarkReport.load(out)
    assert BenchmarkReport.load(report.to_dict()) == report  # the typed report round-trips
    assert report.block_size == 4 and [m.threshold for m in report.mars] == [1.0, 0.0]  # batch 1, sliding cache
    assert report.ar.tokens_per_forward == 1.0 and report.verify.threshold == 0.0 and report.command == "hf-mars bench"
    card_table = report.card_table()
    names = [row["name"] for row in card_table["rows"]]
    assert any(n.startswith("MARS verify") for n in names) and sum(n.startswith("MARS") for n in names) == 3
    assert all(row["speedup"].endswith("×") for row in card_table["rows"])

    assert result["machine"]["torch_threads"] == 1 and result["machine"]["cpu_count"] >= 1
    assert result["settings"]["block_size"] == 4 and result["settings"]["max_new_tokens"] == 10
    assert set(result["step_costs"]) == {"1", "2"}
    for costs in result["step_costs"].values():
        assert costs["cost_1_ms"] > 0 and costs["cost_5_ms"] > 0 and costs["ratio"] > 0
        assert {"1", "4", "5"} <= set(costs["table_ms"])  # 1, 1 + B, the block-cache chunk (+ widths used)

    rows = result["rows"]
    # per batch size: AR (+ prompt lookup at batch 1) + 2 tau x 2 caches + verify with a tree and the chain
    assert len(rows) == 8 + 7
    assert [(r["mode"], r["threshold"], r["cache"], r["draft_tree"]) for r in rows[:8]] == [
        ("ar", None, None, None), ("prompt_lookup", None, None, None), ("mars", 1.0, "sliding", None),
        ("mars", 0.0, "sliding", None), ("mars", 1.0, "block", None), ("mars", 0.0, "block", None),
        ("verify", 0.0, "sliding", "auto"), ("verify", 0.0, "sliding", "chain"),
    ]
    for r in rows:  # a tree forwards wider steps than the chain: what a step costs, in 1-token steps
        assert r["step_cost_vs_1"] > 0
    lookup = rows[1]  # lossless, and compared against the best plain path too
    assert lookup["matches_ar"] == 1.0 and lookup["tokens_per_forward"] >= 1.0
    assert all(r["speedup_vs_best_plain"] > 0 for r in rows)
    for r in rows:
        assert 0 < r["tokens"] <= 2 * 10  # two prompts per configuration, at most max_new_tokens each
        assert r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0 and r["time_s"] > 0
        assert r["tokens_per_forward"] >= 1.0
        assert r["forward_calls"] >= 1
        assert 0.0 <= r["accuracy"] <= 1.0 and r["accuracy_n"] == 2  # the 2 prompts used carry answers
        if r["mode"] == "ar":
            assert r["tokens_per_forward"] == 1.0 and r["speedup_vs_ar"] == 1.0
            assert r["forward_calls_consistent"]
        elif r["mode"] == "prompt_lookup":
            assert r["mean_decode_width"] >= 1
        else:
            assert r["limit"] > 0 and r["efficiency"] > 0 and r["ideal"] > 0 and r["limit_w"] > 0
            assert r["mean_decode_width"] >= 1
            if "stats_emitted_tokens" in r:  # the loop's own count agrees with the count from the sequences
                assert r["stats_emitted_tokens"] == r["tokens"]
    # exactness the benchmark reports: tau = 1 and verify mode reproduce greedy decoding
    for r in rows:
        if r["mode"] == "verify" or (r["mode"] == "mars" and r["threshold"] == 1.0):
            assert r["matches_ar"] == 1.0, r
            assert r["tokens"] == next(a["tokens"] for a in rows if a["mode"] == "ar" and a["batch_size"] == r["batch_size"])
    # tau = 0 on a random model accepts nearly every mask candidate (sliding window: up to B tokens per forward)
    fast = [r for r in rows if r["mode"] == "mars" and r["threshold"] == 0.0 and r["cache"] == "sliding"]
    assert all(r["tokens_per_forward"] > 2.0 for r in fast), fast


def test_benchmark_function_defaults_to_bundled_prompts(make_model):
    model, tok = make_model(seed=1, hidden_size=32)
    result = bench.benchmark_generation(model, tok, thresholds=[0.5], batch_sizes=[2], caches=["sliding"],
                                        verify_thresholds=[], max_new_tokens=6, num_prompts=2, repeats=1, warmup=0,
                                        cost_repeats=1, progress=False)
    assert [r["mode"] for r in result["rows"]] == ["ar", "mars"]
    assert result["settings"]["prompts_available"] >= 16
    text = bench.format_table(result)
    assert "ar" in text and "mars" in text and "cost(1)" in text
    json.dumps(result, default=_json_default)  # JSON-able


def test_a_saved_draft_vocabulary_is_reported(make_model):
    """A checkpoint that saved a draft vocabulary decodes its verify rows with it: the report and the table say so."""
    model, tok = make_model(seed=1, hidden_size=32)
    model.generation_config.mars_draft_vocab = list(range(5, 25))
    result = bench.benchmark_generation(model, tok, thresholds=[], batch_sizes=[1], caches=["sliding"],
                                        verify_thresholds=[0.0], max_new_tokens=6, num_prompts=1, repeats=1,
                                        warmup=0, cost_repeats=1, progress=False, peers=(), draft_trees=("chain",))
    assert result["model"]["draft_vocab_size"] == 20
    assert all(r["matches_ar"] == 1.0 for r in result["rows"] if r["mode"] == "verify")
    assert "saved draft vocabulary (20 tokens" in bench.format_table(result)


def test_count_emitted_excludes_padding_after_eos():
    new = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [3, 9, 3, 0], [2, 2, 2, 2]])
    assert bench.count_emitted(new, [2]).tolist() == [2, 4, 4, 1]
    assert bench.count_emitted(new, [2, 9]).tolist() == [2, 4, 2, 1]
    assert bench.count_emitted(new, []).tolist() == [4, 4, 4, 4]


def test_load_prompts_formats(tmp_path):
    recs = bench.load_prompts(_prompt_file(tmp_path))
    assert recs[0] == {"prompt": [{"role": "user", "content": "Copy: abc"}], "answer": "abc", "task": "copy"}
    assert recs[1] == {"prompt": "Reverse: xyz", "answer": "zyx", "task": None}
    assert recs[2] == {"prompt": "Count to five.", "answer": None, "task": None}
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert [r["prompt"] for r in bench.load_prompts(txt)] == ["one", "two"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps([[{"role": "user", "content": "hi"}]]))
    assert bench.load_prompts(js)[0]["prompt"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="does not exist"):
        bench.load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="needs one of the keys"):
        bench.load_prompts(bad)
    with pytest.raises(ValueError, match="only assistant turns"):
        bench.to_record([{"role": "assistant", "content": "x"}])


def test_make_batches_left_pads_and_cycles():
    batches = bench.make_batches([[1, 2, 3], [4]], batch_size=4, pad_id=0, num_prompts=3)
    assert len(batches) == 1
    ids, mask = batches[0]
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert len(bench.make_batches([[1]] * 5, batch_size=2, pad_id=0)) == 3


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_kernels_onednn_times_every_row_on_the_converted_model(tmp_path, checkpoint):
    """`--kernels onednn`: plain generate and MARS both on oneDNN's linear kernels (`hf_mars.bench.kernels`),
    verify and tau = 1 still plain greedy there, the model's size counted with the converted weights."""
    out = tmp_path / "bench.json"
    common = ["bench", "--model", str(checkpoint), "--batch-sizes", "1", "--thresholds", "1.0", "--caches", "sliding",
              "--max-new-tokens", "8", "--num-prompts", "2", "--repeats", "1", "--warmup", "0", "--cost-repeats", "1",
              "--threads", "1", "--quiet", "--peers", "prompt_lookup"]
    assert cli_main(common + ["--output", str(tmp_path / "default.json")]) == 0
    assert cli_main(common + ["--kernels", "onednn", "--output", str(out)]) == 0
    result, default = json.loads(out.read_text()), json.loads((tmp_path / "default.json").read_text())
    assert result["settings"]["kernels"] == "onednn" and default["settings"]["kernels"] == "default"
    assert result["model"]["parameters"] == default["model"]["parameters"]
    rows = result["rows"]
    assert {r["mode"] for r in rows} == {"ar", "prompt_lookup", "mars", "verify"}
    assert all(r["matches_ar"] == 1.0 for r in rows if r["mode"] == "verify" or r["threshold"] == 1.0)


def test_bad_arguments(tmp_path, make_model, capsys):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        bench.build_specs([1.5], ["sliding"], [], None, 16)
    with pytest.raises(ValueError, match="cache mode"):
        bench.build_specs([1.0], ["paged"], [], None, 16)

    from hf_mars.cli import main

    def one_line_error(argv, match):  # a user error: one line on stderr, exit status 2, no traceback
        assert main(argv) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("hf-mars bench: error: ") and match in last and "Traceback" not in err

    one_line_error(["bench", "--model", str(tmp_path / "nope")], "not a folder")
    one_line_error(["bench", "--model", str(tmp_path / "nope"), "--num-prompts", "0"], "--num-prompts must be >= 1")
    one_line_error(["bench", "--model", str(tmp_path / "nope"), "--kernels", "onednn"], "--peers prompt_lookup")
    model, tok = make_model(with_mask=False, hidden_size=32)
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    capsys.readouterr()
    one_line_error(["bench", "--model", str(tmp_path / "plain")], "mask token")


def test_acceptance_rules_are_timed_each(make_model):
    """`--acceptance`: each rule a threshold-mode configuration of its own; the default rule runs as generate's
    default (no extra argument), and only its rows stand for MARS in a model card."""
    from hf_mars.bench.report import BenchmarkReport
    from hf_mars.bench.specs import DEFAULT_ACCEPTANCE
    from hf_mars.generation import MARSGenerationConfig

    assert MARSGenerationConfig().acceptance == DEFAULT_ACCEPTANCE
    specs = bench.build_specs([0.9], ["sliding"], [], None, 16, acceptances=("probability", "margin"))
    assert [(s.acceptance, s.kwargs.get("mars_acceptance")) for s in specs[1:]] == [(None, None), ("margin", "margin")]
    assert specs[2].label == "mars(tau=0.9,cache=sliding,rule=margin)"
    with pytest.raises(ValueError, match="acceptance rule"):
        bench.build_specs([0.9], ["sliding"], [], None, 16, acceptances=("vibes",))

    model, tok = make_model(seed=1, hidden_size=32)
    result = bench.benchmark_generation(model, tok, thresholds=[0.5], batch_sizes=[1], caches=["sliding"],
                                        verify_thresholds=[], max_new_tokens=6, num_prompts=2, repeats=1, warmup=0,
                                        cost_repeats=1, progress=False, peers=(),
                                        acceptances=("probability", "entropy", "margin"))
    assert [(r["mode"], r["acceptance"]) for r in result["rows"]] == [
        ("ar", None), ("mars", None), ("mars", "entropy"), ("mars", "margin")]
    assert result["settings"]["acceptances"] == ["probability", "entropy", "margin"]
    assert "rule" in bench.format_table(result)
    assert [m.threshold for m in BenchmarkReport.load(result).mars] == [0.5]


def test_mars_on_a_static_cache_it_cannot_roll_back_is_skipped_up_front(make_model, monkeypatch):
    """A model whose static cache MARS cannot roll back (linear-attention layers, say): the MARS static+compile row
    is dropped before anything runs, with the reason in the report, and plain generate's static peer still runs.
    A sliding-window model's can (MARS decodes into full-length layers: `cache.full_static_cache`)."""
    from hf_mars.generation import cache as cache_module

    model, tok = make_model(seed=1, hidden_size=32, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    if cache_module.STATIC_CACHE_SUPPORTED:
        assert cache_module.static_rollback_problem(model) is None
    reason = "MARS decoding rolls the KV cache back after every step; StaticCache of 'qwen2' cannot do that."
    monkeypatch.setattr(cache_module, "static_rollback_problem", lambda m: reason)
    said = []
    result = bench.benchmark_generation(model, tok, thresholds=[], batch_sizes=[1], caches=["sliding"],
                                        verify_thresholds=[0.3], max_new_tokens=4, num_prompts=1, repeats=1,
                                        warmup=0, cost_repeats=1, progress=False, peers=("static_compile",),
                                        draft_trees=("chain",), log=said.append)
    assert [(r["mode"], r["cache"]) for r in result["rows"]] == [("ar", None), ("ar_static_compile", None),
                                                                ("verify", "sliding")]
    assert result["settings"]["skipped"]["static+compile"] == reason and "skipped" in said[0]
    assert "skipped static+compile: MARS decoding rolls the KV cache back" in bench.format_table(result)


def test_static_compile_peer_spec():
    specs = bench.build_specs([1.0], ["sliding"], [], None, 16, peers=("static_compile", "prompt_lookup"))
    modes = [s.mode for s in specs]
    assert modes[:3] == ["ar", "ar_static_compile", "prompt_lookup"]
    kw = specs[1].kwargs
    assert kw["cache_implementation"] == "static" and kw["compile_config"]._compile_all_devices is True
    with pytest.raises(ValueError, match="Unknown peer"):
        bench.build_specs([1.0], ["sliding"], [], None, 16, peers=("vllm",))


def test_help_shows_the_defaults(capsys):
    """`hf-mars bench --help` says what a run measures without each flag (through the real entry point)."""
    from hf_mars.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    text = text[text.index("-h, --help"):]  # the flags' descriptions, after the usage line
    for flag, default in [("--num-prompts", "16"), ("--max-new-tokens", "64"), ("--repeats", "3"),
                          ("--batch-sizes", "[1, 4, 16]"), ("--dtype", "float32")]:
        assert f"(default: {default})" in text.split(f"{flag} ", 1)[1].split(" --", 1)[0], flag
    assert "(default: None)" not in text and "(default: False)" not in text


def test_cost_rows_report_the_layouts_chosen(make_model):
    """`--draft-trees auto cost`: the 'cost' row records the layouts its policy chose per step in the timed calls,
    the default 'auto' row those it chose per call (tree, chain or plain), both identical to greedy, and the table
    prints the shares."""
    from hf_mars.generation.policy import menu

    model, tok = make_model(seed=1, hidden_size=32)
    result = bench.benchmark_generation(model, tok, thresholds=[], batch_sizes=[2], caches=["sliding"],
                                        verify_thresholds=[0.0], max_new_tokens=12, num_prompts=4, repeats=1,
                                        warmup=1, cost_repeats=1, progress=False, peers=(),
                                        draft_trees=("auto", "cost"))
    auto, cost = (next(r for r in result["rows"] if r.get("draft_tree") == t) for t in ("auto", "cost"))
    assert auto["matches_ar"] == 1.0 and cost["matches_ar"] == 1.0
    assert auto["policy_layouts"] and set(auto["policy_layouts"]) <= {"tree", "chain", "plain"}
    assert "'auto' chose per call:" in bench.format_table(result)
    labels = {"plain"} | {layout.label() for layout in menu(result["settings"]["block_size"], 0.03)}
    assert cost["policy_layouts"] and set(cost["policy_layouts"]) <= labels
    counts = list(cost["policy_layouts"].values())
    assert counts == sorted(counts, reverse=True)
    assert "'cost' chose per step:" in bench.format_table(result)


@pytest.mark.plain_step_policy
def test_plain_steps_rows(make_model):
    """Threshold mode's rows at tau < 1 on the sliding cache run generate's default plain-step policy and record its
    choices (plain / masks), which the table prints; `--plain-steps` times each of them again with
    mars_plain_steps=False, the masks on every step (tau = 1 and the block cache have no policy)."""
    model, tok = make_model(seed=1, hidden_size=32)
    result = bench.benchmark_generation(model, tok, thresholds=[1.0, 0.5], batch_sizes=[2], caches=["sliding", "block"],
                                        verify_thresholds=[], max_new_tokens=12, num_prompts=4, repeats=1,
                                        warmup=1, cost_repeats=1, progress=False, peers=(), plain_steps=True)
    mars = [r for r in result["rows"] if r["mode"] == "mars"]
    policy = [r for r in mars if r.get("plain_steps")]
    assert [(r["threshold"], r["cache"]) for r in policy] == [(0.5, "sliding")] and len(mars) == 5
    masks = [r for r in mars if r.get("plain_steps") is False]
    assert [(r["threshold"], r["cache"]) for r in masks] == [(0.5, "sliding")] and not masks[0].get("policy_layouts")
    assert policy[0]["policy_layouts"] and set(policy[0]["policy_layouts"]) <= {"plain", "masks"}
    assert sum(policy[0]["policy_layouts"].values()) > 0
    assert "plain_steps chose per step:" in bench.format_table(result)


def test_compiled_rows_leave_the_hook_columns_blank(make_model, monkeypatch):
    """A row whose calls pass a compile_config gets no limit / eff / lim(w) / ideal / ovh / model ms / step/c1:
    those are read from the eager forward's hooks, which miss a compiled graph's forwards. (A compile_config on a
    dynamic cache runs eagerly: the test needs no compiling, only the row's arguments.)"""
    from transformers import CompileConfig

    from hf_mars.bench import measure
    from hf_mars.bench.specs import RunSpec, build_specs

    def specs(*args, **kwargs):
        out = build_specs(*args, **kwargs)
        verify = out[-1]
        return out + [RunSpec("verify", verify.threshold, "compiled", {**verify.kwargs, "compile_config": CompileConfig()})]

    monkeypatch.setattr(measure, "build_specs", specs)
    model, tok = make_model(seed=1, hidden_size=32)
    result = bench.benchmark_generation(model, tok, thresholds=[], batch_sizes=[1], caches=["sliding"],
                                        verify_thresholds=[0.0], max_new_tokens=6, num_prompts=2, repeats=1,
                                        warmup=0, cost_repeats=1, progress=False, peers=())
    eager, compiled = result["rows"][-2:]
    assert compiled["cache"] == "compiled" and compiled["tokens_per_s"] > 0 and compiled["speedup_vs_ar"] > 0
    assert all(compiled[key] is None for key in measure.COMPILED_BLANK)
    assert eager["limit"] > 0 and eager["step_cost_vs_1"] > 0
    bench.format_table(result)


def test_warm_up_cycles_through_the_prompts():
    """A measured policy learns during the warm-up: it sees varied prompts, not the first batch again and again
    (on Gemma 3 that kept 'auto' on plain steps while the chain ran 1.19x plain); a compiled configuration warms
    every batch's shape."""
    from hf_mars.bench.measure import warm_up_batches

    assert warm_up_batches(["a", "b", "c"], 4, compiled=False) == ["a", "b", "c", "a"]
    assert warm_up_batches(["a", "b", "c"], 2, compiled=True) == ["a", "b", "c", "a", "b", "c"]
    assert warm_up_batches(["a"], 0, compiled=False) == []


def test_gpu_timings_script_runs_on_cpu(tmp_path, monkeypatch):
    """The prepared GPU script (benchmarks/gpu_timings.py) is run only when a GPU is lent, in one short try: its
    CPU smoke mode must keep working, record every mode, settle verify's 'auto' before timing it, and stop
    starting modes at its deadline."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_timings.py"
    spec = importlib.util.spec_from_file_location("gpu_timings", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "t.json"
    common = ["--device", "cpu", "--batch-sizes", "2", "--compiled-batch-sizes", "0", "--max-new-tokens", "6",
              "--past", "32", "--prompt-len", "12", "--repeats", "1"]
    assert script.main(["--shapes", "tiny", "--output", str(out)] + common) == 0
    entry = json.loads(out.read_text())["shapes"]["tiny"]["batches"]["2"]
    assert set(entry["cost_ms"]) >= {"1", "5", "25"} and entry["tree_cost_vs_1"]["1,1,1,1"] > 0
    for mode in ("ar", "sliding", "block16", "verify", "verify_chain", "verify_cost"):
        assert entry[mode]["new_tokens_per_row"] == 6, (mode, entry[mode])
    assert "ar_static_compile" not in entry and "verify_static_compile" not in entry  # not a compiled batch size
    assert entry["verify"]["auto_layout"] in ("tree", "chain", "plain")  # settled before it was timed
    assert "auto_layout" not in entry["verify_chain"]
    assert script.main(["--shapes", "tiny", "--output", str(out), "--deadline-s", "0"] + common) == 0
    entry = json.loads(out.read_text())["shapes"]["tiny"]["batches"]["2"]
    assert entry["ar"] == {"skipped": "deadline of 0 s"} and "cost_ms" in entry
