"""Every transformers internal the MARS decoder touches, in one place.

The decoder ships standalone inside checkpoints (``custom_generate/``), so it cannot import the library's own
``hf_mars/_compat.py``; this module is its counterpart for ``generation/``. Each accessor says what it reads and
why no public API does the job, and ``tests/test_generation_contract.py`` checks every one against the installed
transformers, so an upgrade that moves one fails there, naming it, instead of silently changing decoding.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer

# model types `GenerationMixin.get_compiled_call` never compiles (their forward breaks under torch.compile)
UNCOMPILED_MODEL_TYPES = ("llama4",)


# ------------------------------------------------------------------ models and compilation


def attn_implementation(config) -> str:
    """The attention backend a loaded model uses (``config._attn_implementation``; transformers documents it, but
    it has no public getter)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def checkpoint_name(model) -> str | None:
    """The checkpoint a model was loaded from (config._name_or_path; None or "" for a model built in code)."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def default_compile_config(model):
    """The compile config plain ``generate`` uses when the call passes none (``model._default_compile_config()``):
    MARS compiles its steps exactly when and as plain decoding would."""
    return model._default_compile_config()


def compiles_on_any_device(compile_config) -> bool:
    """Whether a compile config asks ``generate`` to compile on CPU too (``CompileConfig._compile_all_devices``;
    transformers keeps auto-compilation to accelerators otherwise)."""
    return bool(compile_config is not None and getattr(compile_config, "_compile_all_devices", None))


def never_compiled(model) -> bool:
    """Whether plain ``generate`` refuses to compile this model type (``PreTrainedModel.get_compiled_call``'s hard-coded list)."""
    model_type = getattr(model.config, "model_type", "") or ""
    return any(name in model_type for name in UNCOMPILED_MODEL_TYPES)


def compile_stance_is_default() -> bool:
    """Whether torch.compile runs in its default stance (a user's ``set_stance``, e.g. "force_eager", is left
    alone). Reads torch's private stance record (``torch._dynamo.eval_frame._stance``); if it moved, this says
    False and compiled steps check their guards in full."""
    import torch

    stance = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    return (stance is not None and getattr(stance, "stance", None) == "default"
            and getattr(stance, "skip_guard_eval_unsafe", True) is False and getattr(stance, "backend", 0) is None)


def torch_helper_threads() -> set:
    """Torch's own worker threads that never run a user's compiled code: the non-daemon workers of the thread pools
    torch.compile keeps for the life of the process once it has used them - ``torch.utils._functools``'s prefetch
    executor (torch 2.15 uses it on every compile) and inductor's async-compile pools (``AsyncCompile.pool()``,
    cached, and the thread pools in ``async_compile._pool_set``; which of them a compile uses depends on how soon its
    worker processes are ready, so on a loaded machine too). Read from their private ``_threads``; modules not
    imported yet are not imported; whatever moved adds nothing, and then compiled steps check their guards in full."""
    import sys

    executors = [getattr(sys.modules.get("torch.utils._functools"), "_prefetch_executor", None)]
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if getattr(pool, "cache_info", None) is not None and pool.cache_info().currsize:  # created: read, never create
        executors.append(pool())
    executors += list(getattr(async_compile, "_pool_set", None) or ())
    return {thread for executor in executors for thread in (getattr(executor, "_threads", None) or ())}


def swap_child(model, name: str, module) -> None:
    """Put ``module`` in place of the model's direct child ``name`` (torch's registry ``model._modules``, as
    ``nn.Module.__setattr__`` would, without the checks a model class may add to attribute assignment)."""
    model._modules[name] = module


# ------------------------------------------------------------------ processors and criteria


def suppressed_ids(processor):
    """The ids a ``SuppressTokensLogitsProcessor`` suppresses (its ``suppress_tokens`` tensor)."""
    return processor.suppress_tokens


def criterion_eos_ids(criterion):
    """The ids an ``EosTokenCriteria`` stops at (its ``eos_token_id`` tensor)."""
    return criterion.eos_token_id


def criterion_max_length(criterion) -> int:
    """A ``MaxLengthCriteria``'s limit (prompt included)."""
    return criterion.max_length


# ------------------------------------------------------------------ cache layers


def static_capacity(layer) -> int:
    """Positions a static layer holds (``StaticLayer.max_cache_len``; read before its lazy allocation too)."""
    return layer.max_cache_len


def resize_unallocated_static(layers, size: int) -> bool:
    """Make empty, not yet allocated static layers hold ``size`` positions (they allocate ``max_cache_len`` at
    their first update: building another StaticCache costs ~0.14 ms of Python). False, changing nothing, when a
    layer is not a plain unallocated StaticLayer (``StaticLayer.is_initialized``)."""
    if not all(type(layer) is StaticLayer and not layer.is_initialized for layer in layers):
        return False
    for layer in layers:
        layer.max_cache_len = size
    return True


def record_sliding_past(cache) -> None:
    """Sliding-window layers keep their past until the next crop (``activate_past_recording``), so a rollback can
    restore the columns the window pushed out."""
    cache.activate_past_recording()


SLIDING_LAYER = DynamicSlidingWindowLayer


def layer_tensors(layer):
    """A layer's (keys, values), or None while it holds nothing (``layer.keys`` / ``layer.values``: the cache
    API has no public setter for rewriting columns in place)."""
    keys = getattr(layer, "keys", None)
    if keys is None or keys.numel() == 0:
        return None
    return keys, layer.values


def set_layer_tensors(layer, keys, values) -> None:
    """Replace a dynamic layer's keys and values (a gathered path, a merged or filtered batch, compacted columns).
    A sliding-window layer's mask sizes come from the length it counts (``DynamicSlidingWindowLayer.
    cumulative_length``): it moves by the columns added or removed (callers change the count only while the window
    has trimmed nothing: `RollbackCache.ragged_rows`)."""
    if type(layer) is DynamicSlidingWindowLayer:
        layer.cumulative_length += keys.shape[-2] - layer.keys.shape[-2]
    layer.keys, layer.values = keys, values


def shift_static_length(layer, removed: int) -> None:
    """A static layer whose columns were compacted in place: its write position moves back by ``removed``
    (``StaticLayer.cumulative_length``, a device tensor compiled graphs read)."""
    layer.cumulative_length.sub_(removed)


def is_static(layer) -> bool:
    return type(layer) is StaticLayer
