"""Every private API of transformers and TRL that hf-mars relies on, in one place.

Each accessor says what it reads and why no public API does the job, and a test checks each one against the
installed versions (`tests/test_compat.py`), so an upgrade that moves one fails loudly there instead of silently
elsewhere. The `transformers serve` internals `hf-mars serve` uses are in `hf_mars/serve/_compat.py`. (`hf_mars/generation/` ships
standalone inside checkpoints, so it cannot import this module.)
"""

from __future__ import annotations

import contextlib

# TRL's fused LM-head forward (``model(..., fused_lm_head=True, shift_labels=...)``) returns these per-token fields
# instead of logits; the MARS loss and metrics read them.
FUSED_OUTPUT_FIELDS = ("log_probs", "is_top1", "entropy")


@contextlib.contextmanager
def fused_head_on_targets_only():
    """Within it, TRL's fused LM-head forward projects only the positions that have a target on a CPU too.

    TRL decides per call with ``trl.trainer.utils._use_triton(device)``: on CUDA / XPU it scores only the positions
    whose label is not -100; everywhere else every position, because on Neuron a varying number of positions would
    recompile each batch. A CPU recompiles nothing, and a MARS batch is two streams whose prompt and padding
    positions have no target, so scoring them there is pure cost: the same TRL kernel on the target rows alone
    gives the same per-token outputs, and a MARS step on Gemma 3 270M (262k-row head, fp32) 1.2-1.4x faster
    (docs/training.md, "Cost of a training step"). Other devices keep TRL's own choice."""
    import trl.trainer.utils as trl_utils

    original = trl_utils._use_triton

    def compact_on_cpu(device):
        return device.type == "cpu" or original(device)

    trl_utils._use_triton = compact_on_cpu
    try:
        yield
    finally:
        trl_utils._use_triton = original


def attn_implementation(config) -> str:
    """The attention backend a loaded model uses (``config._attn_implementation``; transformers documents it, but
    it has no public getter)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def router_logits_recorder(model):
    """``(module class, output index)`` transformers hooks to collect router logits (``_can_record_outputs``), or
    None for a dense model. MARS records them itself to compute the MoE loss on the clean stream only."""
    base = getattr(model, "model", model)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, getattr(recorder, "index", 0))


def trl_metrics(trainer, mode: str) -> dict:
    """SFTTrainer's per-mode metric store (``_metrics``), which its ``log`` averages and reports."""
    return trainer._metrics[mode]


def trl_count_train_tokens(trainer, tokens: int) -> int:
    """Add to SFTTrainer's ``num_tokens`` counter (``_total_train_tokens``, divided by its ``_tp_size``) and return it."""
    trainer._total_train_tokens += int(tokens) // trainer._tp_size
    return trainer._total_train_tokens


def keep_generation_extras(generation_config) -> None:
    """A generation config flagged as derived from the model config (``_from_model_config``) drops unknown
    attributes — the MARS defaults — when loaded; clear the flag before saving."""
    generation_config._from_model_config = False


def compile_on_any_device(compile_config):
    """Let ``generate`` compile the forward on CPU too (``CompileConfig._compile_all_devices``; transformers keeps
    auto-compilation to accelerators otherwise)."""
    compile_config._compile_all_devices = True
    return compile_config


def load_balancing_loss(model):
    """A MoE model's own router load-balancing loss (``load_balancing_loss_func`` of its modeling module; transformers
    exports no public one). MARSTrainer applies it to the clean stream's router logits only."""
    import sys

    return getattr(sys.modules[type(model).__module__], "load_balancing_loss_func")


def trl_lm_collator():
    """TRL's ``DataCollatorForLanguageModeling``, SFTTrainer's default collator, which `MARSDataCollator` extends and
    `MARSTrainer` replaces; TRL exports it only from ``trl.trainer.sft_trainer``."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling


def trl_load_model(model_id: str, args, quantization_config=None):
    """Load a model given by name as SFTTrainer does (``trl.trainer.utils.create_model_from_path`` with
    ``args.model_init_kwargs``); return ``(model, revision)``.

    SFTTrainer loads a named model inside ``__init__`` and hands it to PEFT a few lines later, with no overridable
    method in between, while the mask token must be in the embeddings before PEFT wraps them. So `MARSTrainer` loads
    the model here first and gives SFTTrainer the instance; ``args.model_init_kwargs`` is consumed (SFTTrainer would
    warn that it is ignored for an instance)."""
    from transformers import set_seed
    from trl.trainer.utils import create_model_from_path

    set_seed(args.seed)  # as SFTTrainer: a PEFT adapter is initialised at random right after
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None  # a device map of "auto" fails under a distributed launcher
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    model = create_model_from_path(model_id, **kwargs)
    args.model_init_kwargs = None
    return model, kwargs.get("revision")


def trl_processing_class(model, args, revision=None):
    """The processing class SFTTrainer loads when none is given: ``AutoProcessor`` of the model's name or path
    (``trl.trainer.utils.get_config_model_id``). The mask token goes into it before SFTTrainer sees it."""
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    return AutoProcessor.from_pretrained(get_config_model_id(model.config), revision=revision,
                                         trust_remote_code=args.trust_remote_code)
