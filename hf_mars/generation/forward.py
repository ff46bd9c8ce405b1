"""The model forward of MARS steps: whether it can skip the LM head on unread columns, and its compiled calls (the
decode steps', their guards checked in full once per input layout of a generation: `GuardedSteps`; with
``mars_compile_prefill`` the prefill's, padded to one of a few widths).

Kept apart from the loop (`decoder.py`): these are facts about the model and torch.compile, read once per model.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading

import torch

from ._compat import compile_stance_is_default, never_compiled, torch_helper_threads
from .rules import choose, confident, take_columns


def takes_logits_to_keep(model) -> bool:
    """Whether the model's forward can skip the LM head on columns nobody reads."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def _decode_call(model, **kwargs):
    return model(**kwargs)


def _read_call(model, slot_cols, suppress, tau, acceptance, **kwargs):
    """A decode step that reads its candidate slots too (greedy, no logits processor): each slot's token and whether
    it clears tau, flat as [tokens | flags] - what `acceptor.read_slots` computes eagerly after a forward, with
    the same rules, here in the graph (seven small ops a step fewer outside it). ``slot_cols``: the logits column
    each slot reads; ``tau``: a tensor (a float would specialise the graph per value)."""
    logits = model(**kwargs).logits
    slots = take_columns(logits, slot_cols).float()
    slots = slots.index_fill(-1, suppress, -math.inf)
    chosen = choose(slots, False)
    sure = confident(acceptance, chosen, tau, slots, of_distribution=True)
    return torch.cat([chosen.view(-1), sure.view(-1)])


def _prefill_call(model, **kwargs):  # the same call, another code object: Dynamo counts recompiles per code object
    return model(**kwargs)


def _compiled(model, compile_config, call, key, **override):
    """``torch.compile(call)`` bound to the model, kept on it per compile config under ``key`` (``override``:
    torch.compile arguments that replace the config's)."""
    if never_compiled(model):  # as get_compiled_call: not compiled there
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


def compiled_read_call(model, compile_config):
    """The compiled decode step that reads its own slots (`_read_call`), kept on the model per compile config (a code
    object of its own, as `compiled_decode_call`)."""
    return _compiled(model, compile_config, _read_call, "_mars_compiled_read")


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


def pad_prefill(input_ids, position_ids, capacity: int, mask_token_id: int, max_positions: int | None):
    """A compiled prefill's inputs with masks appended up to `prefill_width` (their positions continue, within the
    model's table of ``max_positions``): under causal attention nothing before them changes, and a static cache's
    2D mask already spans every cache column (the padding's are masked out as keys). Returns them and how many
    columns were added (for the caller to crop from the cache and the logits)."""
    b, width = input_ids.shape
    pad = prefill_width(width, capacity) - width
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=mask_token_id)
        extra = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)[None]
        if max_positions:
            extra = extra.clamp(max=max_positions - 1)
        position_ids = torch.cat([position_ids, extra], dim=1)
    return input_ids, position_ids, pad


def _layout(value):
    """What a guard could tell apart in one argument of a compiled call, as a hashable key: a tensor's dtype, shape
    and device; a constant's value; any other object's identity (within one generation: the cache)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.device
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return id(value)


def _alone() -> bool:
    """Whether every other Python thread is a daemon or torch's own helper: none that would run compiled code while
    a step holds the process-wide stance (a daemon thread doing so is the one case this cannot see:
    `GuardedSteps`)."""
    current = threading.current_thread()
    others = {thread for thread in threading.enumerate() if thread is not current and not thread.daemon}
    return not others or others <= torch_helper_threads()


_stance_is_default = compile_stance_is_default  # (the name tests/test_compat.py checks torch's stance record by)


class GuardedSteps:
    """A generation's compiled decode call whose guards are checked in full only on the first step of each input
    layout (unless ``mars_guard_every_step``).

    Before running a graph, torch.compile evaluates its guards: ~700 checks on a small model (every module, config
    value and tensor the forward touched), 0.3-0.5 ms per step on CPU, a tenth of a short answer. Within one
    generation nothing they check changes between steps but the step's own inputs (same shapes, the same cache
    object, its contents updated in place). So the first step of each input layout (None-ness, constants, tensor
    shapes) runs with full guards, which also catch anything changed since the last generation (weights swapped, a
    module replaced, another cache) and recompile for it; later steps of that layout run in torch's
    ``skip_guard_eval_unsafe`` stance, which still checks every tensor guard and every guard that ever told two of
    the call's graphs apart, and raises rather than run a graph its checks do not match (the step is then rerun
    with full guards). The stance is process-wide, so it is used only while every other Python thread is a daemon
    (progress-bar monitors, notebook kernels' I/O; not a thread running ``generate`` beside the main one, nor the
    main thread when ``generate`` runs in another) and torch.compile is in its default stance."""

    def __init__(self, call, every_step: bool = False):
        self.call, self.every_step = call, every_step
        self.checked = set()  # input layouts a fully guarded step of this generation has run

    def __call__(self, **kwargs):
        if self.every_step:  # (mars_guard_every_step: torch's own checks, nothing kept here)
            return self.call(**kwargs)
        layout = tuple((name, _layout(value)) for name, value in kwargs.items())
        if layout in self.checked and _alone() and compile_stance_is_default():
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self.call(**kwargs)
            except RuntimeError as error:  # raised before the graph runs: no graph matched the checks it made
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
                self.checked.discard(layout)
        out = self.call(**kwargs)
        self.checked.add(layout)
        return out
