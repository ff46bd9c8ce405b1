"""The KV cache a MARS call decodes into, and how it is rolled back.

Each step feeds masks (and verify mode's drafts) that must leave no trace: their columns are cropped off the
cache's end (dynamic, sliding-window and, from transformers 5.24, static layers roll back exactly). Batched rows
accept different counts, so some kept columns are padding in some rows: a 2D attention mask over the cache's
columns hides them, and `compact` removes them once they are more than a small share of the cache.

A static sliding-window layer overwrites the oldest column once its window is full, which no crop can undo: for a
sliding-window model (Gemma 2 / 3, Mistral) MARS decodes into a static cache whose every layer holds the whole
call (`full_static_cache`), and the model's own sliding-window mask still limits those layers' attention.

A window counts cache columns, so a masked column inside it would shorten it: a sliding-window model's batch rows
move in lockstep (no masked columns), unless the whole call fits inside the window (`RollbackCache.ragged_rows`).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ._compat import (
    is_static,
    layer_tensors,
    record_sliding_past,
    resize_unallocated_static,
    set_layer_tensors,
    shift_static_length,
    static_capacity,
)

COMPACT_THRESHOLD = 0.1  # batched caches are compacted once masked pad columns exceed this share of them
STATIC_CACHE_SUPPORTED = hasattr(StaticLayer, "crop")
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer) + (
    (StaticLayer, StaticSlidingWindowLayer) if STATIC_CACHE_SUPPORTED else ())
SLIDING_LAYERS = (DynamicSlidingWindowLayer, StaticSlidingWindowLayer)
STATIC_CACHE_BUCKET = 256  # static caches MARS creates hold a multiple of this many positions, or 64 / 128 below it
SMALL_STATIC_CACHES = (64, 128)


def static_cache_length(model, generation_config, needed: int) -> int:
    """Positions of the static cache MARS decodes into: every compiled graph is specialised to the cache's shape,
    so a length per prompt length would recompile per prompt length (and soon exhaust Dynamo's recompile limit,
    falling back to eager). As plain `generate` does, the length only grows across calls (the largest so far is
    kept on the model) and honours `generation_config.max_cache_len`; beyond that it is rounded up to a multiple
    of `STATIC_CACHE_BUCKET`, so a stream of prompts of every length compiles a handful of graphs at most. Short
    calls get 64 or 128 positions first: every compiled step attends over the whole cache (on the demo model, 128
    rather than 256 positions made a short answer ~6% faster)."""
    floor = max(needed, getattr(model, "_mars_static_cache_length", 0),
                getattr(generation_config, "max_cache_len", None) or 0)
    small = [n for n in SMALL_STATIC_CACHES if floor <= n < STATIC_CACHE_BUCKET]
    size = small[0] if small else -(-floor // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    model._mars_static_cache_length = size
    return size


def check_rollback(model, cache) -> None:
    """A clear error for a cache MARS cannot roll back (quantized, offloaded, linear-attention, state-space). An
    empty static cache of a sliding-window model passes: MARS decodes into `full_static_cache` instead."""
    if STATIC_CACHE_SUPPORTED and rebuilt_for_windows(cache):
        return
    odd = [layer for layer in getattr(cache, "layers", None) or [] if type(layer) not in ROLLBACK_LAYERS]
    if odd or getattr(cache, "is_croppable", True) is False:  # (is_croppable: transformers >= 5.17)
        names = sorted({type(layer).__name__ for layer in odd})
        model_type = getattr(model.config, "model_type", type(model).__name__)
        if not odd and any(type(layer) is StaticSlidingWindowLayer for layer in cache.layers):
            advice = ("A static sliding-window layer holding a prefix rolls back only while the whole call fits "
                      "in its window: pass an empty StaticCache (MARS then sizes its own) or the dynamic cache.")
        elif names and all("SlidingWindow" in name for name in names):
            advice = "For this model (sliding-window layers) use the default dynamic cache."
        else:
            advice = ("Use the default dynamic cache or cache_implementation='static' (transformers >= 5.24; "
                      "quantized and offloaded caches cannot roll back); models with linear-attention or "
                      "state-space layers are not supported.")
        raise ValueError(
            f"MARS decoding rolls the KV cache back after every step; {type(cache).__name__} of {model_type!r} "
            f"({', '.join(names) or 'not croppable'}) cannot do that. {advice}")


def rebuilt_for_windows(cache) -> bool:
    """Whether ``cache`` is an empty static cache with sliding-window layers (generate's for Gemma 3 or Mistral):
    MARS decodes into `full_static_cache` instead, which rolls back however long the call."""
    layers = getattr(cache, "layers", None) or []
    return (any(type(layer) is StaticSlidingWindowLayer for layer in layers)
            and all(type(layer) in (StaticLayer, StaticSlidingWindowLayer) for layer in layers)
            and not getattr(cache, "offloading", False) and cache.get_seq_length() == 0)


def full_static_cache(model, size: int) -> StaticCache:
    """A static cache of ``size`` positions in every layer, sliding-window ones too.

    A static sliding-window layer keeps only its window and, once full, overwrites the oldest column: the masks a
    step wrote cannot be cropped back out. A full-length layer rolls back like any static layer, and stays exact:
    the model builds its sliding-window attention mask from the cache's positions (a full layer reports its whole
    length from offset 0, `StaticLayer.get_mask_sizes`), so those layers still attend to their window only, as
    in plain decoding (rows move in lockstep, as on a dynamic sliding-window cache). The cost: sliding layers
    hold, and attend over, the whole call rather than their window."""
    cache = StaticCache(config=model.config, max_cache_len=size)
    cache.layers = [StaticLayer(max_cache_len=size) for _ in cache.layers]
    return cache


def static_rollback_problem(model) -> str | None:
    """Why MARS cannot decode ``model`` on a static cache (None: it can): `check_rollback`'s message for the
    StaticCache transformers builds for it (one with linear-attention layers, say; a sliding-window model's is
    decoded into `full_static_cache`)."""
    try:
        check_rollback(model, StaticCache(config=model.config, max_cache_len=8))
    except ValueError as exc:
        return str(exc)
    return None


def has_sliding_layers(cache) -> bool:
    """Whether ``cache`` holds sliding-window layers: then batch rows move in lockstep and a draft tree cannot run
    (`tree.refusal`). ``has_sliding_layers(DynamicCache(config=model.config))`` answers it for a model's default
    cache before any call."""
    return any(isinstance(layer, SLIDING_LAYERS) for layer in getattr(cache, "layers", []))


def call_fits_window(model, needed: int) -> bool:
    """Whether a call that needs ``needed`` columns (prompt, new tokens, one step) stays inside ``model``'s sliding
    window with ragged rows: their masked columns are compacted once they exceed `COMPACT_THRESHOLD` of the cache,
    so it can hold ``needed / (1 - COMPACT_THRESHOLD)`` columns at most; a dynamic window layer keeps the last
    ``window - 1`` columns, so that many must never be exceeded (nothing is trimmed, and every query's window
    reaches back to column 0)."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    return isinstance(window, int) and math.ceil(needed / (1 - COMPACT_THRESHOLD)) <= window - 1


class RollbackCache:
    """The cache, its real length and the 2D mask over its columns (None while every column is real)."""

    def __init__(self, model, generation_config, cache, batch: int, needed: int, prompt_attention=None):
        """``prompt_attention``: the prompt's 2D attention mask (None: no padding); a cache that already holds the
        prompt's first columns (prompt reuse) starts with those columns' share of it."""
        if cache is None:  # generate always prepares one; be safe if it did not
            cache = DynamicCache(config=model.config)
        layers = getattr(cache, "layers", [])
        # sliding-window layers count cache columns, so a masked-out column inside the window would shorten it:
        # batch rows move in lockstep (no ragged columns); dynamic ones keep their past until each crop (rollback)
        self.sliding = has_sliding_layers(cache)
        # ... unless the call fits inside the window whole: no window then cuts, every row attends to all its
        # columns, and masked ones change nothing (as with full attention)
        self.ragged_rows = not self.sliding or call_fits_window(model, needed)
        self.trims_window = any(type(layer) is DynamicSlidingWindowLayer for layer in layers)
        if self.trims_window:
            record_sliding_past(cache)
        # a static cache holds a fixed number of columns: it must fit the prompt, the new tokens and one step's
        # masks / drafts beyond them (ragged rows' masked columns are compacted away in place to keep that room)
        self.static = any(isinstance(layer, StaticLayer) for layer in layers)
        if self.static:
            capacity = min(static_capacity(layer) for layer in layers)
            if cache.get_seq_length() > 0:  # a cache that holds a prefix is used as it is
                if capacity < needed:
                    raise ValueError(
                        f"This StaticCache holds {capacity} positions; MARS decoding needs {needed} (prompt + new "
                        f"tokens + one step's masks and drafts). Pass StaticCache(config, max_cache_len={needed}).")
            else:  # an empty one (generate's, sized for this call's plain decoding): see `static_cache_length`
                size = static_cache_length(model, generation_config, needed)
                if rebuilt_for_windows(cache):
                    cache = full_static_cache(model, size)
                elif capacity != size and (getattr(cache, "offloading", False)
                                           or not resize_unallocated_static(layers, size)):
                    cache = StaticCache(config=model.config, max_cache_len=size)
        self.cache = cache
        self.static_len = min(static_capacity(layer) for layer in cache.layers) if self.static else 0
        self.batch = batch
        self.length = int(cache.get_seq_length())  # a prefix the caller cached (prompt reuse), else 0 (a static
        # layer answers with its own position tensor: copied, never aliased)
        self.attn = None
        if self.length and prompt_attention is not None and not bool(prompt_attention[:, :self.length].all()):
            self.attn = prompt_attention[:, :self.length].long()

    def attention_mask(self, col_real, device):
        """The 2D mask for a forward over the cache plus a chunk whose real columns are ``col_real``."""
        past = self.attn
        if past is None:
            past = torch.ones(self.batch, self.length, dtype=torch.long, device=device)
        mask = torch.cat([past, col_real.long()], dim=1)
        if self.static_len:  # the cache's full length: one mask shape every step (one compiled graph); the
            # columns past the chunk are unwritten and causally masked anyway
            mask = torch.nn.functional.pad(mask, (0, self.static_len - mask.shape[1]))
        return mask

    def roll_back(self, drop: int, kept_real, keep: int, device) -> None:
        """Crop the last ``drop`` columns the forward wrote; the ``keep`` before them stay (``kept_real``: which
        of those are real per row, None when all are)."""
        if drop or self.trims_window:  # crop(0) trims dynamic sliding layers back to their window
            self.cache.crop(-drop)
        self._append(kept_real, keep, device)

    def keep_chunk_columns(self, width: int, index, kept_real, device) -> None:
        """Of the ``width`` columns the forward wrote, keep per row the ones ``index`` (rows, K) names, in that
        order (a draft tree's accepted path: not a suffix to crop, so gathered; ``kept_real``: which are real)."""
        idx = index[:, None, :, None]
        for layer in self.cache.layers:
            tensors = layer_tensors(layer)
            if tensors is None:
                continue
            kept = []
            for full in tensors:
                start = full.shape[2] - width
                chunk = full[:, :, start:]
                picked = chunk.gather(2, idx.expand(-1, chunk.shape[1], -1, chunk.shape[3]))
                kept.append(torch.cat([full[:, :, :start], picked], dim=2))
            set_layer_tensors(layer, *kept)
        self._append(kept_real, index.shape[1], device)

    def _append(self, kept_real, keep: int, device) -> None:
        """Account for ``keep`` new columns at the end (``kept_real``: which are real per row, None when all)."""
        if not keep:
            return
        if kept_real is not None or self.attn is not None:
            if kept_real is None:
                kept_real = torch.ones(self.batch, keep, dtype=torch.bool, device=device)
            past = self.attn
            if past is None:
                past = torch.ones(self.batch, self.length, dtype=torch.long, device=device)
            self.attn = torch.cat([past, kept_real.long()], dim=1)
        self.length += keep

    def append_rows(self, other: RollbackCache, device) -> None:
        """Take another generation's cache rows below these (between steps). Each side's columns are left-padded
        to the longer one and masked: keys carry their rotary positions, so no row's attention changes."""
        width = max(self.length, other.length)

        def padded(t, length):  # (rows, heads, columns, dim), left-padded to `width` columns
            return torch.nn.functional.pad(t, (0, 0, width - length, 0))

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            a, b = layer_tensors(mine), layer_tensors(theirs)
            set_layer_tensors(mine, *(torch.cat([padded(x, self.length), padded(y, other.length)])
                                              for x, y in zip(a, b)))
        masks = [c.attn if c.attn is not None else torch.ones(c.batch, c.length, dtype=torch.long, device=device)
                 for c in (self, other)]
        self.attn = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in masks])
        self.length, self.batch = width, self.batch + other.batch

    def select_rows(self, index) -> None:
        """Keep only the rows ``index`` (a device tensor) names, in that order."""
        for layer in self.cache.layers:
            set_layer_tensors(layer, *(t.index_select(0, index) for t in layer_tensors(layer)))
        if self.attn is not None:
            self.attn = self.attn.index_select(0, index)
        self.batch = index.shape[0]

    def compact(self, longest: int, threshold: float = COMPACT_THRESHOLD, room: int = 0) -> bool:
        """Move each row's real columns to the right end and drop the columns that are padding in every row, once
        they are more than ``threshold`` of the cache, or a static cache would not have ``room`` for the next step
        (``longest``: the longest row's real columns).

        Keys already carry their rotary positions and attention does not care where a key sits, only whether it is
        masked, so the output is unchanged; the cache then holds no more columns than the longest row needs. A
        static cache is rewritten in place (its tensors keep their addresses: compiled graphs read them there)."""
        waste = self.length - longest
        short = bool(self.static_len) and self.length + room > self.static_len
        if self.attn is None or waste <= 0 or (waste <= threshold * self.length and not short):
            return False
        order = torch.argsort(self.attn, dim=1, stable=True)[:, waste:]  # pads first, real columns in order
        idx = order[:, None, :, None]
        for layer in self.cache.layers:
            tensors = layer_tensors(layer)
            if tensors is None:
                continue
            static = is_static(layer)
            picked = [full[:, :, :self.length].gather(2, idx.expand(-1, full.shape[1], -1, full.shape[3]))
                      for full in tensors]
            if static:  # in place: compiled graphs read the tensors at their addresses
                for full, part in zip(tensors, picked):
                    full[:, :, :longest].copy_(part)
                shift_static_length(layer, waste)
            else:
                set_layer_tensors(layer, *picked)
        self.attn = self.attn.gather(1, order)
        self.length -= waste
        return True
