"""Which callable runs each forward of a generation, decided once at its start: the prefill and the decode steps
eager or compiled (as generate decides it for plain decoding), a compiled step's guards (`GuardedSteps`), a
compiled greedy step that reads its own slots, a draft vocabulary's cut LM head; and the arguments every forward
takes besides the chunk (the cache under its name, the caller's other model inputs, ``logits_to_keep``).

Kept apart from the decoder: these are decisions about the model, torch.compile and the call's inputs, not about
the rows; a step only asks for the callable that fits it.
"""

from __future__ import annotations

import torch

from ._compat import compiles_on_any_device, default_compile_config
from .draft_vocab import DraftVocabulary
from .forward import (
    GuardedSteps,
    compiled_decode_call,
    compiled_prefill_call,
    compiled_read_call,
    takes_logits_to_keep,
)

# model kwargs the loop manages itself ("past_key_values" is the cache's name before transformers 5.2x)
LOOP_KWARGS = ("cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep",
               "inputs_embeds")


def cache_key(model_kwargs) -> str:
    return "past_key_values" if "past_key_values" in model_kwargs and "cache" not in model_kwargs else "cache"


class ModelCalls:
    """The forwards of one generation (see the module). ``eager``: the model's own call (the prefill's unless
    compiled, a synced rank's throwaway forward); ``decode``: the decode steps'; ``prefill``: a compiled prefill
    (None: eager); ``read``: a compiled decode step that reads its slots (None: none); ``fixed_width``: the one
    chunk width compiled steps are padded to (None: any width)."""

    def __init__(self, model, opts, shape, cache, generation_config, model_kwargs, reads_any: bool, mask_token_id,
                 batch: int, device):
        """``reads_any``: something reads the slots' scores between the logits and the rules (sampling, logits
        processors, criteria, output_scores / output_logits): no compiled step reads its own slots then."""
        self.eager = self.decode = model.__call__
        self.prefill = self.read = self.fixed_width = self.tau_all = None
        compile_config = getattr(generation_config, "compile_config", None)
        wants = cache.static and not getattr(generation_config, "disable_compile", False) and (
            device.type in ("cuda", "xpu", "neuron", "tpu") or compiles_on_any_device(compile_config))
        if wants and getattr(cache.cache, "is_compileable", False) and (
                getattr(getattr(model, "hf_quantizer", None), "is_compileable", True)):
            self._compile(model, opts, shape, compile_config or default_compile_config(model), reads_any)
            if self.read is not None:  # the rows' taus when no row has its own (a tensor: one graph for any value)
                self.tau_all = torch.full((batch, 1), opts.threshold, dtype=torch.float32, device=device)
        self.draft_vocab = None
        vocab = opts.draft_vocab  # (verify mode only: config.py refuses it elsewhere)
        if vocab is not None and self.decode is not self.eager:
            if "draft_vocab" in opts._from_call:
                raise ValueError("mars_draft_vocab runs eager decode steps; this call compiles them (a static cache "
                                 "with a compile config). Drop one of the two.")
            vocab = None  # a checkpoint's saved default gives way to the compiled steps this call asked for
        if vocab is not None:
            self.draft_vocab = DraftVocabulary(model, vocab, mask_token_id)
            self.eager = self.decode = self.draft_vocab.wrap(model.__call__, model)
        self.cache_key = cache_key(model_kwargs)
        self.extra_kwargs = {k: v for k, v in model_kwargs.items() if k not in LOOP_KWARGS}
        self.logits_to_keep = takes_logits_to_keep(model)

    def _compile(self, model, opts, shape, compile_config, reads_any: bool) -> None:
        """torch.compile as generate decides it for plain decoding (a compileable static cache, an accelerator or
        a compile config that compiles on any device, not disabled). The prefill runs eagerly unless
        ``mars_compile_prefill`` (then padded with masks to one of a few widths: `forward.pad_prefill`). A compiled
        step keeps one width (extra masks at the end change nothing before them under causal attention) so that
        one graph serves every step: the widest [committed | drafts] run plus the K-1 masks; its guards are
        evaluated in full once per input layout (`GuardedSteps`). Greedy with nothing reading the scores, the
        compiled step also reads its slots (`MARSDecoder.forward_read`)."""
        self.decode = GuardedSteps(compiled_decode_call(model, compile_config), opts.guard_every_step)
        if opts.compile_prefill:
            self.prefill = compiled_prefill_call(model, compile_config)
        if not shape.block and not (shape.one_token and not opts.verify):
            self.fixed_width = (1 + shape.max_drafts if opts.verify else shape.candidates) + shape.candidates - 1
        if self.fixed_width and takes_logits_to_keep(model) and not reads_any:
            self.read = GuardedSteps(compiled_read_call(model, compile_config), opts.guard_every_step)

    def inputs(self, cache, col_real, attention_mask, device) -> dict:
        """A forward's arguments besides input_ids and position_ids: the cache, the mask (``attention_mask``, a
        prepared 4D one, else the 2D one from the chunk's real columns) and the caller's other model inputs."""
        if attention_mask is None and col_real is not None:
            attention_mask = cache.attention_mask(col_real, device)
        kwargs = dict(self.extra_kwargs, attention_mask=attention_mask, use_cache=True, return_dict=True)
        kwargs[self.cache_key] = cache.cache
        return kwargs
