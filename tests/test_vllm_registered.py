"""vLLM >= 0.34's path (a registered speculative method) against the installed vLLM package itself, no engine.

CI's vLLM 0.34 job installs vLLM 0.34.0's own package on the CPU without its CUDA kernel dependencies, which no
CPU can load, and beside torch 2.13.0's CPU build (0.34 pins 2.14.0, whose CUDA build takes several GB; none of
the code run here needs 2.14), so no engine starts there; everything vLLM runs before and around the engine does. These tests run
what of the MARS path that covers, with vLLM's own code where tests/test_vllm_speculator.py has fakes:

- the plugin, loaded by vLLM's own plugin loader: every contract check_contracts_v2 reads holds, "mars" is in
  vLLM's registry, and vLLM's CLI starts with it (and beside a release the plugin does not know, with "mars"
  refused in one sentence);
- ``{"method": "mars"}`` through vLLM's EngineArgs into its SpeculativeConfig (what MarsSpeculatorConfig sets,
  and what it refuses);
- MarsSpeculator built by vLLM's init_speculator on vLLM's DraftModelSpeculator, the attributes the V2 runner
  reads on a speculator (read from the runner's source), and propose() on vLLM's InputBatch.

Whether the V2 runner then decodes exactly as plain vLLM does needs an engine: benchmarks/gpu_check.sh on a GPU.
Skipped where the installed vLLM has no registry (0.32-0.33: tests/test_vllm.py) or where there is no vLLM.
"""

import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

from hf_mars.vllm import _patches, speculative_config

pytestmark = pytest.mark.skipif(not _patches.uses_registration(),
                                reason="needs a vLLM with register_speculative_method (>= 0.34; CI's vLLM 0.34 job)")
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2 MARS checkpoint (config.mars with the mask id and block size) on disk."""
    from hf_mars.testing_utils import save_tiny_vllm_checkpoint

    return save_tiny_vllm_checkpoint(tmp_path_factory.mktemp("mars-ckpt"), BLOCK)


@pytest.fixture(scope="module")
def plugin():
    """The plugin as vLLM loads it: its general-plugin loader, once per process."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return _patches


def _engine_args(checkpoint, spec):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(checkpoint), dtype="float32", max_model_len=256, enforce_eager=True,
                      speculative_config=spec)


def _speculative(checkpoint, spec):
    from vllm.config import ParallelConfig

    args = _engine_args(checkpoint, spec)
    return args.create_speculative_config(args.create_model_config(), ParallelConfig())


def test_vllms_plugin_loader_registers_mars_and_every_contract_holds(plugin):
    from vllm.v1.worker.gpu.spec_decode.speculator_config import registered_speculative_methods

    assert plugin.check_contracts_v2() == []
    assert plugin._problems == [], plugin._problems
    assert "mars" in registered_speculative_methods()


def test_engine_args_build_the_mars_speculative_config(plugin, checkpoint):
    from hf_mars.vllm.speculator import MarsSpeculatorConfig

    spec = _speculative(checkpoint, speculative_config(batch_ladder="1:4,16:2,64:0"))
    assert spec.custom_method == "mars" and spec.method is None  # vLLM's form for a custom method of no base
    assert isinstance(spec.speculator_config, MarsSpeculatorConfig)
    assert spec.num_speculative_tokens == 2 * BLOCK  # [pending drafts | masks], one width for every request
    assert spec.num_speculative_tokens_per_batch_size == [(1, 15, 8), (16, 63, 4), (64, 1 << 20, 0)]
    assert spec.draft_model_config is spec.target_model_config  # no draft checkpoint
    assert spec.speculator_config.num_prefill_lookahead_tokens == 0
    assert _speculative(checkpoint, speculative_config(block_size=2)).num_speculative_tokens == 4


@pytest.mark.parametrize("spec, message", [
    ({"method": "mars", "speculator_options": {"tau_ladder": "0:1,4:1.5"}}, "tau_ladder"),
    ({"method": "mars", "num_speculative_tokens": 3}, "cannot be combined"),
    ({"method": "mars", "draft_sample_method": "probabilistic"}, "cannot be combined"),
    ({"method": "mars", "speculator_options": {"blocksize": 2}}, "blocksize"),
    (speculative_config(block_size=9), "block"),
])
def test_what_breaks_exactness_is_refused_at_configuration(plugin, checkpoint, spec, message):
    with pytest.raises(Exception, match=message):
        _speculative(checkpoint, spec)


def _engine_config(checkpoint, spec):
    """vLLM's VllmConfig for a MARS engine, built on the CPU platform as vLLM builds it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("builds the engine config on the CPU platform (VLLM_TARGET_DEVICE=cpu)")
    # The CPU platform's config check refuses a vLLM without triton-cpu, which only the CPU build has; the check
    # is about running the engine, which these tests do not (a test shim, scoped to building this config).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(current_platform), "check_and_update_config", classmethod(lambda cls, config: None))
        return _engine_args(checkpoint, spec).create_engine_config()


@pytest.fixture(scope="module")
def engine_config(plugin, checkpoint):
    return _engine_config(checkpoint, speculative_config())


@pytest.fixture(scope="module")
def speculator(engine_config):
    """MarsSpeculator as vLLM's GPU runner builds it (init_speculator), on the CPU, with its target loaded."""
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    built = init_speculator(engine_config, torch.device("cpu"), None)
    built.load_model(_Target(engine_config.model_config.get_vocab_size()))
    return built


def _trusted_drafts(engine_config):
    """MarsTrustedDrafts as the V2 runner builds its custom logits processors (vLLM's own loader, from the
    model config's logits_processors), on request state shaped like the runner's."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

    states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=engine_config.scheduler_config.max_num_seqs,
                             vocab_size=engine_config.model_config.get_vocab_size(), all_token_ids=None,
                             prompt_len=None, prefill_len=None, total_len=None)
    built = build_custom_logits_processors(engine_config, states, False,
                                           engine_config.model_config.logits_processors)
    mine = [processor for processor in built if type(processor).__name__ == "MarsTrustedDrafts"]
    assert len(mine) == 1, f"vLLM built {built} from {engine_config.model_config.logits_processors}"
    return mine[0]


@pytest.fixture(scope="module")
def trusted_drafts(engine_config):
    return _trusted_drafts(engine_config)


class _Target(torch.nn.Module):
    """The target model as far as MarsSpeculator uses it: compute_logits on hidden states (here the hidden
    states are the logits, so a test writes the tokens the masks predict)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def compute_logits(self, hidden_states):
        return hidden_states[..., :self.vocab].clone()


def test_vllms_init_speculator_builds_mars_on_its_draft_model_base(speculator):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from hf_mars.vllm.speculator_gpu import MarsSpeculator

    assert type(speculator) is MarsSpeculator and isinstance(speculator, DraftModelSpeculator)
    assert (speculator.width, speculator.block) == (2 * BLOCK, BLOCK)
    assert speculator.model is None and speculator.draft_attn_layer_names == set()  # vLLM sees no draft model
    # every attribute the V2 runner reads on its speculator, from the runner's own source
    read = set(re.findall(r"self\.speculator\.([A-Za-z_]\w*)", inspect.getsource(GPUModelRunner)))
    assert read, "the V2 runner no longer reads self.speculator.<attribute>: update this test"
    written = {"pcp_manager"}  # the runner assigns it
    missing = sorted(name for name in read - written if not hasattr(speculator, name))
    assert not missing, f"the V2 runner reads {missing} on a speculator, which MarsSpeculator lacks"


def _step_batch(speculator, queries):
    """vLLM's InputBatch for one decode step, laid out as the V2 runner lays it out: request i's query ends with
    its last token then its speculative tokens, which are its logits rows (``queries``: [(context, spec)])."""
    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch

    ids, logits_indices, cu, counts = [], [], [0], []
    for context, spec in queries:
        ids += context
        logits_indices += range(len(ids) - 1, len(ids) + len(spec))  # the last token, then the spec tokens
        ids += spec
        cu.append(cu[-1] + 1 + len(spec))
        counts.append(len(spec))
    dummy = InputBatch.make_dummy(len(queries), len(ids), speculator.input_buffers, is_padding=False)
    return dataclasses.replace(
        dummy, input_ids=torch.tensor(ids), logits_indices=torch.tensor(logits_indices),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32), cu_num_logits_np=np.array(cu, dtype=np.int32),
        num_draft_tokens=sum(counts), num_draft_tokens_per_req=np.array(counts, dtype=np.int32))


def test_propose_on_vllms_input_batch(speculator):
    """Three requests of one step: every draft accepted (new drafts from the masks), masks only (the first B
    draft), a draft rejected (the masks saw a wrong context: masks only next)."""
    M, width = speculator.mask_id, speculator.width
    queries = [([10, 11, 12], [20, 21, 22, 23] + [M] * 4), ([30, 31], [M] * 8), ([40], [50, 51, 52, 53] + [M] * 4)]
    batch = _step_batch(speculator, queries)
    hidden = torch.zeros(len(batch.input_ids), speculator.vocab_size)
    predicted = {0: [60, 61, 62, 63], 1: [70, 71, 72, 73]}  # what the first B masks of requests 0 and 1 predict
    for i, tokens in predicted.items():
        first_mask = int(batch.cu_num_logits_np[i]) + 1 + (4 if i == 0 else 0)
        for j, token in enumerate(tokens):
            hidden[batch.logits_indices[first_mask + j], token] = 1.0
    hidden[:, M] = 2.0  # the mask token is never a draft (forbid_mask put -inf on it)
    num_sampled = torch.tensor([5, 1, 2])  # 4 drafts + the target's token; the target's token; 1 draft + its own
    num_rejected = torch.tensor([0, 0, 3])
    speculator.prepare_propose(batch, num_sampled, num_rejected, sampler=None)  # vLLM's base: between the steps
    out = speculator.propose(batch, None, None, hidden, None, num_sampled, num_rejected, None, None, None, None,
                             num_speculative_tokens=width)
    assert out.tolist() == [[60, 61, 62, 63] + [M] * 4, [70, 71, 72, 73] + [M] * 4, [M] * 8]
    narrower = speculator.propose(batch, None, None, hidden, None, num_sampled, num_rejected, None, None, None,
                                  None, num_speculative_tokens=4)  # batch_ladder's B = 2 for the next step
    assert narrower[:, :4].tolist() == [[60, 61, M, M], [70, 71, M, M], [M] * 4]


_UNKNOWN_RELEASE = "import vllm\nvllm.__version__ = '0.99.0'\n"
_CONFIGURE_MARS = """import sys
from vllm.config import ParallelConfig
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256, speculative_config={"method": "mars"})
try:
    args.create_speculative_config(args.create_model_config(), ParallelConfig())
    print("ACCEPTED")
except ValueError as exc:
    print("REFUSED " + str(exc))
"""


def _run(tmp_path, sitecustomize, *args):
    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("sitecustomize", ["", _UNKNOWN_RELEASE], ids=["this-release", "unknown-release"])
def test_vllms_cli_starts_with_the_plugin_and_mars_is_refused_only_where_it_does_not_fit(tmp_path, checkpoint,
                                                                                       sitecustomize):
    cli = _run(tmp_path, sitecustomize, "-c", "from vllm.entrypoints.cli.main import main; main()", "--version")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip().splitlines()[-1] in ("0.99.0", _installed()), cli.stdout
    script = tmp_path / "configure.py"
    script.write_text(_CONFIGURE_MARS)
    run = _run(tmp_path, sitecustomize, str(script), str(checkpoint))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    if sitecustomize:
        assert cli.stderr.count("does not support vLLM 0.99.0") == 1, cli.stderr[-3000:]
        refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED ")]
        assert refused and "outside the supported range" in refused[0], out[-3000:]
    else:
        assert "does not support" not in cli.stderr, cli.stderr[-3000:]
        assert "ACCEPTED" in run.stdout.splitlines(), out[-3000:]


def _installed() -> str:
    import vllm

    return str(vllm.__version__)


def test_a_bad_request_threshold_is_refused_at_admission(plugin):
    """A mars_threshold outside [0, 1], or below 1 on a sampling request, is a 400 at admission (vLLM's
    VLLMValidationError); an engine without "mars" refuses any mars_threshold. The wrapper is the one the plugin
    put on vLLM's InputProcessor, around a stand-in for vLLM's own checks (they read the whole engine's config)."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    assert getattr(InputProcessor._validate_params, "__wrapped__", None) is not None, "the plugin did not wrap it"
    admission = _patches._mars_admission(lambda self, params, supported_tasks: None)

    def admit(engine_speculative_config, threshold, temperature=0.0):
        engine = SimpleNamespace(speculative_config=engine_speculative_config)
        params = SamplingParams(temperature=temperature, extra_args={"mars_threshold": threshold})
        return admission(engine, params, ("generate",))

    mars = SimpleNamespace(custom_method="mars", method=None)  # what vLLM 0.34 makes of {"method": "mars"}
    assert admit(mars, 1.0) is None and admit(mars, 0.9) is None and admit(mars, 0.0) is None
    for threshold, temperature in ((1.5, 0.0), (-0.1, 0.0), ("high", 0.0), (0.9, 0.8)):
        with pytest.raises(VLLMValidationError, match="mars_threshold"):
            admit(mars, threshold, temperature)
    with pytest.raises(VLLMValidationError, match="does not run the speculative method 'mars'"):
        admit(None, 1.0)


def test_the_trusted_drafts_processor_reaches_vllms_engine_config_and_its_validator(engine_config):
    """MarsSpeculatorConfig puts the processor into the target's logits_processors, where the V2 runner builds it
    and vLLM's InputProcessor builds its admission validator (vLLM's own function here), which runs our
    validate_params: a 400 for a bad value, however the request reached vLLM."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors_params_validator

    from hf_mars.vllm.trusted_drafts import PROCESSOR

    assert list(engine_config.model_config.logits_processors).count(PROCESSOR) == 1
    validate = build_custom_logits_processors_params_validator(engine_config.model_config.logits_processors)
    validate(SamplingParams(temperature=0.0, extra_args={"mars_threshold": 0.7}))
    validate(SamplingParams(temperature=0.8))
    for extra, temperature in (({"mars_threshold": 2.0}, 0.0), ({"mars_threshold": 0.7}, 0.8),
                               ({"mars_treshold": 0.7}, 0.0)):
        with pytest.raises(VLLMValidationError, match="mars_t"):
            validate(SamplingParams(temperature=temperature, extra_args=extra))


def _logits_context(rows):
    """vLLM's LogitsContext for one verification step, as its sampler builds it: ``rows`` is [(slot, [the last
    token, spec tokens...])], one logits row per token, each row's input_ids its input token."""
    import numpy as np
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    slots = [slot for slot, tokens in rows for _ in tokens]
    local = [j for _, tokens in rows for j in range(len(tokens))]
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32),
        idx_mapping=torch.tensor([slot for slot, _ in rows], dtype=torch.int32),
        idx_mapping_np=np.array([slot for slot, _ in rows], dtype=np.int32),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        input_ids=torch.tensor([t for _, tokens in rows for t in tokens]),
        pos=torch.tensor(local), seq_lens_upper_bound_np=np.zeros(len(rows), dtype=np.int32))


def _greedy_verify(logits, rows):
    """What vLLM's greedy rejection sampler keeps of each request: its spec tokens while each equals the previous
    row's argmax, then that row's argmax (the target's token)."""
    argmax, kept, at = logits.argmax(-1).tolist(), [], 0
    for _, tokens in rows:
        out = []
        for j, spec in enumerate(tokens[1:]):
            out.append(argmax[at + j])
            if argmax[at + j] != spec:
                break
        else:
            out.append(argmax[at + len(tokens) - 1])
        kept.append(out)
        at += len(tokens)
    return kept


def test_trusted_drafts_pass_verification_only_where_their_mask_was_tau_sure(trusted_drafts):
    """Four requests in one step, verified as vLLM's sampler verifies them, after MarsTrustedDrafts.apply:
    tau 0.5 accepts its first draft (0.9 sure) though the target disagrees and stops at the second (0.4 sure);
    tau 1 and no mars_threshold are plain greedy (the target's own tokens); tau 0 trusts every draft but never a
    mask (its logit is -inf: forbid_mask) nor vLLM's -1 placeholder."""
    from vllm.sampling_params import SamplingParams

    state, vocab, M = trusted_drafts.state, 64, 63
    rows = [(3, [5, 20, 21, M, M]), (1, [6, 30, 31, M, M]), (7, [7, 40, 41, M, M]), (2, [8, 50, -1, M, M])]
    taus = {3: 0.5, 1: 1.0, 7: None, 2: 0.0}
    for slot, tau in taus.items():
        extra = {} if tau is None else {"mars_threshold": tau}
        trusting = trusted_drafts.add_request(slot, SamplingParams(temperature=0.0, extra_args=extra))
        assert trusting == (tau is not None and tau < 1)
    for slot in taus:
        state.confidence[slot] = 0.0
        state.confidence[slot, :2] = torch.tensor([0.9, 0.4])
    ctx = _logits_context(rows)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ctx.input_ids), vocab, generator=generator)
    logits[:, M] = float("-inf")
    logits[:, 10] = 10.0  # the target's own token is always 10: it agrees with no draft
    plain = _greedy_verify(logits, rows)
    assert plain == [[10]] * 4
    processed = trusted_drafts.apply(logits.clone(), ctx)
    assert _greedy_verify(processed, rows) == [[20, 10], [10], [10], [50, 10]]
    unchanged = [r for r, slot in enumerate(ctx.expanded_idx_mapping.tolist()) if slot in (1, 7)]
    assert torch.equal(processed[unchanged], logits[unchanged])  # other requests' logits are untouched
    for slot in taus:  # leave the slots as a fresh engine has them
        trusted_drafts.add_request(slot, SamplingParams(temperature=0.0))
    assert torch.equal(trusted_drafts.apply(logits.clone(), ctx), logits)


def test_propose_keeps_each_trusting_requests_draft_confidences(speculator, trusted_drafts):
    """The speculator and the processor share one state (by the engine's VllmConfig); propose writes a trusting
    slot's drafts' top probabilities (the masks' distributions, the mask token forbidden), 0 under its masks."""
    from vllm.sampling_params import SamplingParams

    assert speculator.trust is trusted_drafts.state
    M = speculator.mask_id
    batch = _step_batch(speculator, [([30, 31], [M] * 8)])
    slot = int(batch.idx_mapping_np[0])
    trusted_drafts.add_request(slot, SamplingParams(temperature=0.0, extra_args={"mars_threshold": 0.5}))
    hidden = torch.zeros(len(batch.input_ids), speculator.vocab_size)
    first_mask = int(batch.cu_num_logits_np[0]) + 1
    for j, token in enumerate([70, 71, 72, 73]):
        hidden[batch.logits_indices[first_mask + j], token] = 1.0 + j
    num_sampled, num_rejected = torch.tensor([1]), torch.tensor([0])
    speculator.prepare_propose(batch, num_sampled, num_rejected, sampler=None)
    out = speculator.propose(batch, None, None, hidden, None, num_sampled, num_rejected, None, None, None, None,
                             num_speculative_tokens=speculator.width)
    assert out[0, :4].tolist() == [70, 71, 72, 73]
    masks_logits = hidden[batch.logits_indices[first_mask:first_mask + 4]].clone()
    masks_logits[:, M] = float("-inf")
    expected = torch.softmax(masks_logits, -1).amax(-1)
    torch.testing.assert_close(speculator.trust.confidence[slot, :4], expected)
    assert speculator.trust.confidence[slot, 4:].eq(0).all()
    trusted_drafts.add_request(slot, SamplingParams(temperature=0.0))


def test_the_tau_ladder_follows_the_schedulers_load_into_the_worker(plugin, checkpoint):
    """speculator_options' tau_ladder: the plugin's Scheduler.schedule wrapper writes the scheduler's running +
    waiting requests on its output, the V2 runner's execute_model wrapper hands it to the worker's threshold
    state, and the processor gives a greedy request without its own mars_threshold the ladder's tau at that
    load: lossless below 4 requests, every draft trusted from 4 (but a mask never); a request's own tau 1.0, and a
    sampling request, stay lossless."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from hf_mars.vllm.options import LOAD_FIELD, engine_tau_ladder
    from hf_mars.vllm.trusted_drafts import NEVER

    config = _engine_config(checkpoint, speculative_config(tau_ladder="0:1.0,4:0.0"))
    assert engine_tau_ladder(config) == "0:1.0,4:0.0"
    for method in (Scheduler.schedule, GPUModelRunner.execute_model):
        assert getattr(method, "__wrapped__", None) is not None, f"the plugin did not wrap {method.__qualname__}"
    schedule = _patches._mars_load(lambda self: SchedulerOutput.make_empty())
    out = schedule(SimpleNamespace(vllm_config=config, get_request_counts=lambda: (2, 3)))
    assert getattr(out, LOAD_FIELD) == 5
    lossless = _engine_config(checkpoint, speculative_config())
    assert not hasattr(schedule(SimpleNamespace(vllm_config=lossless, get_request_counts=lambda: (2, 3))),
                       LOAD_FIELD)  # no ladder: nothing written

    processor = _trusted_drafts(config)
    execute = _patches._mars_worker_load(lambda self, scheduler_output, *args, **kwargs: "ran")
    runner = SimpleNamespace(vllm_config=config, max_num_reqs=processor.state.tau.shape[0], device="cpu")
    assert execute(runner, out) == "ran" and processor.state.load == 5

    M = 63
    for slot, extra, temperature in ((0, {}, 0.0), (1, {"mars_threshold": 1.0}, 0.0), (2, {}, 0.8)):
        processor.add_request(slot, SamplingParams(temperature=temperature, extra_args=extra))
        processor.state.confidence[slot] = 0.0
        processor.state.confidence[slot, :2] = torch.tensor([0.9, 0.4])
    assert processor.state.taus([0, 1, 2]).tolist() == [0.0, NEVER, NEVER]
    rows = [(0, [5, 20, 21, M, M]), (1, [6, 30, 31, M, M])]
    ctx = _logits_context(rows)
    logits = torch.randn(len(ctx.input_ids), 64, generator=torch.Generator().manual_seed(1))
    logits[:, M] = float("-inf")
    logits[:, 10] = 10.0  # the target's own token
    assert _greedy_verify(processor.apply(logits.clone(), ctx), rows) == [[20, 21, 10], [10]]
    processor.state.load = 3  # below the ladder's 4: lossless
    assert _greedy_verify(processor.apply(logits.clone(), ctx), rows) == [[10], [10]]
    # under a ladder the speculator keeps its drafts' confidences even at a load where no request trusts: the
    # load may rise before the step that verifies them
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    speculator = init_speculator(config, torch.device("cpu"), None)
    speculator.load_model(_Target(config.model_config.get_vocab_size()))
    assert speculator.trust is processor.state
    batch = _step_batch(speculator, [([30, 31], [speculator.mask_id] * 8)])
    slot = int(batch.idx_mapping_np[0])
    processor.add_request(slot, SamplingParams(temperature=0.0))
    processor.state.confidence[slot] = 0.5  # stale
    hidden = torch.zeros(len(batch.input_ids), speculator.vocab_size)
    speculator.prepare_propose(batch, torch.tensor([1]), torch.tensor([0]), sampler=None)
    speculator.propose(batch, None, None, hidden, None, torch.tensor([1]), torch.tensor([0]), None, None, None,
                       None, num_speculative_tokens=speculator.width)
    assert not processor.state.trusting([slot])  # load 3: tau 1
    assert processor.state.confidence[slot].lt(0.5).all()  # refreshed: uniform masks, 0 under the masks
    for slot in (0, 1, 2):
        processor.add_request(slot, SamplingParams(temperature=0.0, extra_args={"mars_threshold": 1.0}))
