"""Every private API of transformers and TRL that hf-mars relies on, in one place.

Each accessor says what it reads and why no public API does the job; `tests/test_compat.py` checks each one
against the installed versions, so an upgrade that moves one fails loudly there instead of silently elsewhere.
(`hf_mars/generation.py` ships standalone inside checkpoints and uses public transformers APIs only.)
"""

from __future__ import annotations

# TRL's fused LM-head forward (``model(..., fused_lm_head=True, shift_labels=...)``) returns these per-token fields
# instead of logits; the MARS loss and metrics read them.
FUSED_OUTPUT_FIELDS = ("log_probs", "is_top1", "entropy")


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
