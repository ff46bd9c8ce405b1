"""The short-answer benchmark's yardstick: MARS without a KV cache decodes what generate(mars=True) decodes, with
the same forwards; `hf-mars bench --short-answers` reports it (no timing assertions)."""

import json

import pytest
import torch

from hf_mars.bench.short_answers import benchmark_short_answers, format_short_answers, no_cache_decode
from hf_mars.generation import enable_mars, mask_token_id

PROMPTS = ["hello world", "a", "the quick brown fox", "xy", "abc abc abc"]


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=0.5)
    return enable_mars(model), tok


@pytest.mark.parametrize("tau", [1.0, 0.6, 0.2])
def test_no_cache_decode_equals_generate(peaky, tau):
    """Every answer and every forward count: the uncached loop is the same algorithm as the cached one (only the
    cost differs), so the benchmark compares like with like."""
    model, tok = peaky
    eos = [tok.eos_token_id]
    eos_kw = dict(eos_token_id=eos)
    several = 0
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        new, forwards = no_cache_decode(model, ids, mask_token_id(model), 4, tau, 24, eos)
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False, mars=True,
                             mars_threshold=tau, mars_block_size=4, return_dict_in_generate=True, **eos_kw)
        ours = out.sequences[0, len(ids):].tolist()[:len(new)]
        assert new == ours, prompt
        assert forwards == int(out.mars_forward_passes[0]), prompt
        several += len(new) > forwards
    if tau < 1.0:
        assert several, "no prompt accepted several tokens per forward: the test does not reach acceptance"


def test_benchmark_rows_and_table(peaky):
    model, tok = peaky
    encoded = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    rows = benchmark_short_answers(model, encoded, [1.0, 0.5], 4, mask_token_id(model), [tok.eos_token_id],
                                   max_new_tokens=12, repeats=1)
    assert [r["threshold"] for r in rows] == [1.0, 0.5]
    for r in rows:
        assert r["identical_to_reference"] == 3 and r["prompts"] == 3
        assert r["reference_ms"] > 0 and r["mars_ms"] > 0 and r["plain_ms"] > 0 and r["mars_vs_reference"] > 0
        assert "mars_static_compile_ms" not in r
    json.dumps(rows)
    table = format_short_answers(rows)
    assert "reference ms" in table and "3/3" in table


def test_bench_cli_short_answers(tmp_path, make_model, capsys):
    import argparse

    from hf_mars.demo import bench

    model, tok = make_model(seed=0, hidden_size=32, num_layers=2)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser(prog="hf-mars bench")
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--model", str(tmp_path / "ckpt"), "--batch-sizes", "1", "--thresholds", "1.0", "0.5",
                     "--caches", "sliding", "--verify-thresholds", "--draft-trees", "--max-new-tokens", "8",
                     "--num-prompts", "2", "--repeats", "1", "--warmup", "0", "--cost-repeats", "2", "--quiet",
                     "--peers", "--short-answers", "--output", str(out)])) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["short_answers"] is True
    assert [r["threshold"] for r in result["short_answers"]] == [1.0, 0.5]
    assert all(r["prompts"] == 2 for r in result["short_answers"])
    assert "short answers, batch 1" in capsys.readouterr().out
