"""The model forward of MARS steps: whether it can skip the LM head on unread columns, and its compiled calls (the
decode steps'; with ``mars_compile_prefill`` the prefill's, padded to one of a few widths).

Kept apart from the loop (`decoder.py`): these are facts about the model and torch.compile, read once per model.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=64)
def _forward_takes_logits_to_keep(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def takes_logits_to_keep(model) -> bool:
    """Whether the model's forward can skip the LM head on columns nobody reads (read once per model class: a
    signature costs ~0.2 ms, a short answer's whole set-up is a few ms)."""
    return _forward_takes_logits_to_keep(type(model).forward)


def _decode_call(model, **kwargs):
    return model(**kwargs)


def _prefill_call(model, **kwargs):  # the same call, another code object: Dynamo counts recompiles per code object
    return model(**kwargs)


def _compiled(model, compile_config, call, key, **override):
    """``torch.compile(call)`` bound to the model, kept on it per compile config under ``key`` (``override``:
    torch.compile arguments that replace the config's)."""
    if "llama4" in getattr(model.config, "model_type", ""):  # as get_compiled_call: not compiled there
        return model.__call__
    cached = model.__dict__.get(key)
    if cached is None or cached[0] != compile_config:
        compiled = torch.compile(call, **{**compile_config.to_dict(), **override})
        cached = (compile_config, functools.partial(compiled, model))
        model.__dict__[key] = cached
    return cached[1]


def compiled_decode_call(model, compile_config):
    """The compiled forward of MARS decode steps (what ``model.get_compiled_call`` is to plain decoding), kept on the
    model per compile config. A function of its own because Dynamo counts recompiles per code object: generate's
    compiled call is ``torch.compile(model.__call__)``, one code object with every compiled plain call in the
    process, whose static caches are sized per longest prompt so far; past the limit (8) Dynamo runs that code
    eagerly. MARS's one graph per shape must not share that budget (nor spend plain's)."""
    return _compiled(model, compile_config, _decode_call, "_mars_compiled_call")


def compiled_prefill_call(model, compile_config):
    """The compiled prefill (``mars_compile_prefill``): one static graph per `prefill_width` (``dynamic=False``
    whatever the config says: a dynamic-shape graph compiles many times slower, and the widths are few), a code
    object of its own (its graphs neither spend the decode steps' recompile budget nor plain generate's)."""
    return _compiled(model, compile_config, _prefill_call, "_mars_compiled_prefill", dynamic=False)


MIN_PREFILL_WIDTH = 16


def prefill_width(width: int, capacity: int) -> int:
    """The width a compiled prefill is padded to: the next power of two (at least `MIN_PREFILL_WIDTH`), at most the
    static cache's ``capacity``. Masks appended at the end change nothing before them under causal attention, so a
    prompt of any length runs one of a handful of graphs, at the price of up to twice the prefill's columns."""
    return max(width, min(1 << (max(width, MIN_PREFILL_WIDTH) - 1).bit_length(), capacity))


def pad_prefill(input_ids, position_ids, capacity: int, mask_col, max_positions: int | None):
    """A compiled prefill's inputs with masks appended up to `prefill_width` (their positions continue, within the
    model's table of ``max_positions``): under causal attention nothing before them changes, and a static cache's
    2D mask already spans every cache column (the padding's are masked out as keys). Returns them and how many
    columns were added (for the caller to crop from the cache and the logits)."""
    b, width = input_ids.shape
    pad = prefill_width(width, capacity) - width
    if pad:
        input_ids = torch.cat([input_ids, mask_col.expand(b, pad)], dim=1)
        extra = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)[None]
        if max_positions:
            extra = extra.clamp(max=max_positions - 1)
        position_ids = torch.cat([position_ids, extra], dim=1)
    return input_ids, position_ids, pad
