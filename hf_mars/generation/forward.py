"""The model forward of MARS decode steps: whether it can skip the LM head on unread columns, and its compiled call.

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


def compiled_decode_call(model, compile_config):
    """The compiled forward of MARS decode steps (what ``model.get_compiled_call`` is to plain decoding), kept on the
    model per compile config. A function of its own because Dynamo counts recompiles per code object: generate's
    compiled call is ``torch.compile(model.__call__)``, one code object with every compiled plain call in the
    process, whose static caches are sized per longest prompt so far; past the limit (8) Dynamo runs that code
    eagerly. MARS's one graph per shape must not share that budget (nor spend plain's)."""
    if "llama4" in getattr(model.config, "model_type", ""):  # as get_compiled_call: not compiled there
        return model.__call__
    cached = model.__dict__.get("_mars_compiled_call")
    if cached is None or cached[0] != compile_config:
        compiled = torch.compile(_decode_call, **compile_config.to_dict())
        cached = (compile_config, functools.partial(compiled, model))
        model.__dict__["_mars_compiled_call"] = cached
    return cached[1]
