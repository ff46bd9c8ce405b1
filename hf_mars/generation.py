"""MARS decoding inside ``model.generate``: sliding window, block-level KV cache, lossless verify mode.

This file imports only torch, transformers and the standard library: it ships
verbatim inside every MARS checkpoint as ``custom_generate/generate.py``.

Three ways in, one decoding loop:

- ``model.generate(..., custom_generate=mars_generate, mars_threshold=0.9)``:
  transformers prepares everything (generation config, logits processors,
  stopping criteria, cache, attention mask) and hands the loop to
  `mars_generate`.
- ``enable_mars(model)``; then ``model.generate(..., mars=True, mars_threshold=0.9)``.
  Any ``mars_*`` argument implies ``mars=True``; without them ``generate`` is
  the ordinary one. The mask token is suppressed in both.
- The module-level `generate(*args, model, **kwargs)` is the entry point
  transformers calls when this file is a checkpoint's ``custom_generate/generate.py``
  (``from_pretrained(..., trust_remote_code=True)`` or ``generate(custom_generate=dir)``);
  it behaves like ``enable_mars``'d generate.

The method in one screen is `reference_decode` below (docs/method.md of the hf-mars repository says it in
words). One step of the fast loop, `_MARSDecoder.step`, reads top to bottom: plan the step (per-row counts),
build the chunk (each row's uncached committed tokens, pending drafts, mask tokens), one forward over the KV
cache, read the candidate slots, choose and accept (logits processors, confidence >= tau or draft verification,
stops; one host sync), crop the masks out of the cache, commit. Acceptance runs on the host (`_accept_on_host`:
each slot's token and whether it clears tau come over, the rest is list work) unless a processor reads the
history, a criterion beyond EOS / length stops rows, or verify samples (`_accept_on_device`).

Batched rows accept different counts: each step every row's uncached tokens sit right-aligned in the chunk
(left-padded; pads stay masked in the 2D attention mask), position ids follow each row's real-token count, so
the masks occupy the same columns in every row and one ``cache.crop`` drops them for all rows. Two cases move the
rows in lockstep instead (the same count per step): stateful logits processors or stopping criteria (they must
see exactly the calls plain decoding makes: `_decide_exact`), and sliding-window attention layers (a window
counts cache columns, so no masked column may sit inside it).
"""

from __future__ import annotations

import array
import copy
import dataclasses
import functools
import inspect
import json
import math
import os

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer
from transformers.generation import logits_process as _lp
from transformers.generation import stopping_criteria as _sc
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging as _hf_logging

_logger = _hf_logging.get_logger(__name__)

DEFAULT_THRESHOLD = 0.95  # the paper's multi-token setting (1.0 = one token per forward = AR greedy)
DEFAULT_VERIFY_THRESHOLD = 0.3  # verify mode: drafts kept while their probability is >= this (output unaffected)
DEFAULT_BLOCK_SIZE = 4  # the paper's default block size
DEFAULT_CACHE_BLOCK = 16  # block-cache chunk; the paper's best is 16-32
COMPACT_THRESHOLD = 0.1  # batched caches are compacted once masked pad columns exceed this share of them
ACCEPTANCE_MODES = ("probability", "entropy", "margin")
CACHE_MODES = ("sliding", "block", "block_trained")
MARS_ARGUMENTS = (
    "mars",
    "mars_threshold",
    "mars_block_size",
    "mars_acceptance",
    "mars_max_accept",
    "mars_cache",
    "mars_cache_block",
    "mars_verify",
    "mars_use_last_mask",
    "mars_streamer",
)

# Processors that ignore `input_ids` (they only reshape the distribution): a chain made of these alone is
# applied to all candidates of a step at once. Anything else (penalties, n-gram bans, bad words, length
# rules, user processors) is applied candidate by candidate on the exact history AR decoding would see.
_HISTORY_FREE_PROCESSORS = tuple(
    cls
    for cls in (
        getattr(_lp, name, None)
        for name in (
            "TemperatureLogitsWarper",
            "TopKLogitsWarper",
            "TopPLogitsWarper",
            "TopHLogitsWarper",
            "MinPLogitsWarper",
            "TypicalLogitsWarper",
            "EpsilonLogitsWarper",
            "EtaLogitsWarper",
            "SuppressTokensLogitsProcessor",
            "InfNanRemoveLogitsProcessor",
            "LogitNormalization",
        )
    )
    if cls is not None
)


# Processors that are pure functions of (input_ids, scores): calling them on speculative candidates (histories
# extended by tokens that may be rejected) leaves nothing behind, so MARS applies them to every candidate, as
# AR decoding would apply them to that history. Exact types only: a subclass may add state. Anything else (a
# grammar matcher, a user processor, a prefix function) is treated as stateful: it only ever sees the calls
# plain AR decoding makes. An object can declare itself pure with a ``mars_stateless = True`` attribute.
_STATELESS_PROCESSORS = _HISTORY_FREE_PROCESSORS + tuple(
    cls
    for cls in (
        getattr(_lp, name, None)
        for name in (
            "MinLengthLogitsProcessor",
            "MinNewTokensLengthLogitsProcessor",
            "RepetitionPenaltyLogitsProcessor",
            "NoRepeatNGramLogitsProcessor",
            "SequenceBiasLogitsProcessor",
            "NoBadWordsLogitsProcessor",
            "ForcedBOSTokenLogitsProcessor",
            "ForcedEOSTokenLogitsProcessor",
            "ExponentialDecayLengthPenalty",
            "SuppressTokensAtBeginLogitsProcessor",
            "WatermarkLogitsProcessor",
        )
    )
    if cls is not None
)
_STATELESS_CRITERIA = tuple(
    cls
    for cls in (
        getattr(_sc, name, None)
        for name in ("MaxLengthCriteria", "MaxTimeCriteria", "StopStringCriteria", "EosTokenCriteria",
                     "ConfidenceCriteria")
    )
    if cls is not None
)


def _is_stateless(obj, known) -> bool:
    declared = getattr(obj, "mars_stateless", None)
    if declared is not None:
        return bool(declared)
    return type(obj) in known


@dataclasses.dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus MARS statistics, one entry per row.

    ``scores`` / ``logits`` hold one tensor per emitted token position (like AR
    decoding); after a row finished, its entries are certain of the pad token
    (0 there, ``-inf`` elsewhere), so ``compute_transition_scores`` gives 0, not NaN.
    ``mars_forward_passes``: forwards a row took part in until it finished;
    ``mars_emitted_tokens``: tokens it emitted. Their ratio is tokens per forward.
    """

    mars_forward_passes: torch.LongTensor | None = None
    mars_emitted_tokens: torch.LongTensor | None = None


# ----------------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Options:
    tau: float
    block_size: int
    acceptance: str
    max_accept: int | None
    cache: str
    cache_block: int
    verify: bool
    use_last_mask: bool
    mask_token_id: int


# ----------------------------------------------------------------------------------------------------------------
# The one owner of the MARS metadata and of the B / tau rules (trainer, hub and tokens use these too)
# ----------------------------------------------------------------------------------------------------------------


def read_mars_metadata(config) -> dict:
    """``config.mars`` (``{}`` when the model was never prepared for MARS); a non-dict value is an error."""
    meta = getattr(config, "mars", None)
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ValueError(f"config.mars must be a dict, got {type(meta).__name__}.")
    return meta


def check_threshold(value, name: str = "mars_threshold") -> float:
    """tau is a number in [0, 1]; 1.0 is one token per forward, exactly AR."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1] (1.0 = one token per forward, exactly AR), got {value!r}.")
    return float(value)


def check_block_size(value, name: str = "mars_block_size") -> int:
    """B is an int >= 1 (the paper trains with 4)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (the trained block size, e.g. 4), got {value!r}.")
    return value


def _mars_metadata(model) -> dict:
    return read_mars_metadata(getattr(model, "config", None))


def _mask_token_id(model, required: bool = True) -> int | None:
    """The mask token id recorded in ``model.config.mars`` (the MARS metadata contract)."""
    mask_id = _mars_metadata(model).get("mask_token_id")
    if mask_id is None:
        if not required:
            return None
        raise ValueError(
            "MARS decoding needs a mask token, but model.config.mars['mask_token_id'] is not set: this model was "
            "never prepared for MARS. Add the mask token with `hf_mars.add_mask_token(model, tokenizer)` and fine-tune "
            "with `hf_mars.MARSTrainer` (an untrained mask token predicts nothing useful), or load a MARS checkpoint."
        )
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
        raise ValueError(f"model.config.mars['mask_token_id'] must be a non-negative int, got {mask_id!r}.")
    return mask_id


def _resolve_options(model, generation_config, **given) -> _Options:
    """Defaults: generate argument > generation_config.mars_* > config.mars > built-in; then validate."""
    mask_id = _mask_token_id(model)
    meta = _mars_metadata(model)

    def pick(name, fallback):
        value = given.get(name)
        if value is None:
            value = getattr(generation_config, name, None)
        return fallback if value is None else value

    verify = pick("mars_verify", False)
    # verify mode: tau only truncates drafts (every draft is checked), so its default is its own; a checkpoint's
    # generation_config.mars_threshold is the threshold-mode knob and does not apply there
    tau = given.get("mars_threshold")
    if tau is None:
        tau = DEFAULT_VERIFY_THRESHOLD if verify is True else pick("mars_threshold", DEFAULT_THRESHOLD)
    block_size = pick("mars_block_size", meta.get("block_size") or DEFAULT_BLOCK_SIZE)
    acceptance = pick("mars_acceptance", "probability")
    max_accept = pick("mars_max_accept", None)
    cache = pick("mars_cache", "sliding")
    cache_block = pick("mars_cache_block", DEFAULT_CACHE_BLOCK)
    # the last mask's prediction: off in threshold mode (it costs accuracy there), on in verify mode (a wrong
    # draft costs only its rejection; measured: more tokens per forward)
    use_last_mask = pick("mars_use_last_mask", None)
    if use_last_mask is None:
        use_last_mask = verify is True

    tau = check_threshold(tau)
    check_block_size(block_size)
    if not meta.get("trained_steps"):
        _logger.warning_once(
            "This model's mask token was never MARS-trained (config.mars has no `trained_steps`): MARS decoding "
            "will accept poor guesses (verify mode stays exact but slow). Fine-tune with hf_mars.MARSTrainer."
        )
    trained = meta.get("block_size")
    if isinstance(trained, int) and block_size > trained:
        _logger.warning_once(
            f"mars_block_size={block_size} is larger than the block size this model was trained with ({trained}): "
            f"masks beyond the trained distance predict poorly. Use mars_block_size <= {trained}."
        )
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"mars_acceptance must be one of {ACCEPTANCE_MODES}, got {acceptance!r}.")
    if max_accept is not None and (isinstance(max_accept, bool) or not isinstance(max_accept, int) or max_accept < 1):
        raise ValueError(f"mars_max_accept must be None or an int >= 1, got {max_accept!r}.")
    if cache not in CACHE_MODES:
        raise ValueError(f"mars_cache must be one of {CACHE_MODES}, got {cache!r}.")
    if isinstance(cache_block, bool) or not isinstance(cache_block, int) or cache_block < 1:
        raise ValueError(f"mars_cache_block must be an int >= 1 (the paper's best is 16-32), got {cache_block!r}.")
    if not isinstance(verify, bool):
        raise ValueError(f"mars_verify must be True or False, got {verify!r}.")
    if not isinstance(use_last_mask, bool):
        raise ValueError(f"mars_use_last_mask must be True or False, got {use_last_mask!r}.")
    if verify and cache != "sliding":
        raise ValueError(
            "mars_verify=True keeps its own sliding cache (rejected drafts are masked out in place); "
            f"it cannot be combined with mars_cache={cache!r}. Use mars_cache='sliding'."
        )
    return _Options(
        tau=float(tau),
        block_size=block_size,
        acceptance=acceptance,
        max_accept=max_accept,
        cache=cache,
        cache_block=cache_block,
        verify=verify,
        use_last_mask=use_last_mask,
        mask_token_id=mask_id,
    )


# model kwargs the loop manages itself ("past_key_values" is the cache's name before transformers 5.2x)
# cache layers MARS can crop back exactly (a static layer moves its write position back: nothing is copied;
# static layers can crop from transformers 5.24 on)
STATIC_CACHE_SUPPORTED = hasattr(StaticLayer, "crop")
_ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer) + ((StaticLayer,) if STATIC_CACHE_SUPPORTED else ())
_LOOP_KWARGS = ("cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep",
                "inputs_embeds")


STATIC_CACHE_BUCKET = 256  # static caches MARS creates hold a multiple of this many positions


def _static_cache_length(model, generation_config, needed: int) -> int:
    """Positions of the static cache MARS decodes into: every compiled graph is specialised to the cache's shape,
    so a length per prompt length would recompile per prompt length (and soon exhaust Dynamo's recompile limit,
    falling back to eager). As plain `generate` does, the length only grows across calls (the largest so far is
    kept on the model) and honours `generation_config.max_cache_len`; beyond that it is rounded up to a multiple
    of `STATIC_CACHE_BUCKET`, so a stream of prompts of every length compiles a handful of graphs at most."""
    floor = max(needed, getattr(model, "_mars_static_cache_length", 0),
                getattr(generation_config, "max_cache_len", None) or 0)
    size = -(-floor // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    model._mars_static_cache_length = size
    return size


def _cache_key(model_kwargs) -> str:
    return "past_key_values" if "past_key_values" in model_kwargs and "cache" not in model_kwargs else "cache"


def _check_supported(model, generation_config, model_kwargs, assistant_model=None):
    """Clear errors for what a MARS loop cannot do, before any forward."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("MARS decoding supports decoder-only models only.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"MARS decoding cannot be combined with beam search (num_beams={generation_config.num_beams}); "
            "use num_beams=1 (greedy or sampling)."
        )
    if assistant_model is not None or generation_config.prompt_lookup_num_tokens:
        raise ValueError(
            "MARS decoding cannot be combined with assisted generation (assistant_model / prompt_lookup_num_tokens): "
            "MARS already drafts its own tokens. For lossless self-speculative decoding use mars_verify=True."
        )
    if generation_config.use_cache is False:
        raise ValueError("MARS decoding needs the KV cache; do not pass use_cache=False.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("MARS decoding needs input_ids (it appends mask tokens); inputs_embeds are not supported.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not supported by MARS decoding (a forward covers several "
            "tokens and masks); use output_scores / output_logits."
        )
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        raise ValueError("prefill_chunk_size is not supported by MARS decoding.")
    cache = model_kwargs.get(_cache_key(model_kwargs))
    if cache is not None:
        # cropping must restore the cache exactly: dynamic full-attention and sliding-window layers and static
        # layers roll back; quantized, offloaded and linear-attention / state-space layers do not
        layers = getattr(cache, "layers", None) or []
        odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in _ROLLBACK_LAYERS})
        if odd or getattr(cache, "is_croppable", True) is False:  # (is_croppable: transformers >= 5.17)
            model_type = getattr(model.config, "model_type", type(model).__name__)
            raise ValueError(
                f"MARS decoding rolls the KV cache back after every step; {type(cache).__name__} of {model_type!r} "
                f"({', '.join(odd) or 'not croppable'}) cannot do that. Use the default dynamic cache or "
                "cache_implementation='static' (transformers >= 5.24; quantized and offloaded caches cannot roll "
                "back); models with linear-attention or state-space layers are not supported."
            )
    for key, value in model_kwargs.items():
        if key in _LOOP_KWARGS:
            continue
        if torch.is_tensor(value):
            raise ValueError(
                f"MARS decoding does not know how to extend the per-token model input {key!r} over several "
                "tokens per step; it is not supported."
            )


# ----------------------------------------------------------------------------------------------------------------
# The algorithm in one screen (no cache, one row, greedy): what the fast loop below computes
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_decode(model, prompt_ids, mask_token_id, block_size=4, threshold=0.95, max_new_tokens=32,
                     eos_token_ids=(), use_last_mask=False):
    """MARS threshold decoding of one prompt, literally: a full forward over [committed | masks] per step.

    Slow (no KV cache) and greedy only; it exists to be read, and the tests hold the fast loop to it.
    Returns (generated token ids, forward passes).
    """
    tokens, generated, forwards = list(prompt_ids), [], 0
    candidates = block_size + 1 if use_last_mask else block_size  # the AR token + masks 1..candidates-1
    while len(generated) < max_new_tokens:
        masks = 0 if threshold >= 1.0 else candidates - 1
        logits = model(torch.tensor([tokens + [mask_token_id] * masks])).logits[0].float()
        forwards += 1
        last_committed = len(tokens) - 1
        for j in range(min(1 + masks, max_new_tokens - len(generated))):
            scores = logits[last_committed + j].clone()  # candidate j: the AR position, then mask j
            scores[mask_token_id] = -math.inf  # the mask token is never emitted
            token = int(scores.argmax())
            if j > 0 and float(torch.softmax(scores, -1)[token]) < threshold:
                break  # candidate 0 is always accepted; then left to right while confident
            tokens.append(token)
            generated.append(token)
            if token in eos_token_ids:
                return generated, forwards
        # (the fast loop also drops the masks' KV-cache entries here)
    return generated, forwards


# ----------------------------------------------------------------------------------------------------------------
# The decoding loop
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _StepPlan:
    """What one step feeds and may accept, per row (python lists), and what follows from it."""

    first: bool  # the prefill step: the prompt is not in the cache yet
    active: list  # rows that may accept tokens (unfinished, and not waiting for the block cache's chunk)
    uncached: list  # committed tokens not in the cache yet, fed first
    drafts: list  # verify mode: pending drafts, fed after them
    masks: list  # mask tokens, fed last
    slots: list  # candidate slots the row may accept from
    rows: list = dataclasses.field(default_factory=list)  # indices of the active rows
    lens: list = dataclasses.field(default_factory=list)  # real columns per row
    max_slots: int = 0
    logits_kept: int = 0  # logits kept from the end of the chunk: from candidate 0 (before drafts and masks) on
    uniform: bool = False  # every active row has the same drafts and masks: its slots are a plain slice
    all_active: bool = False  # no row has finished or waits (no row masks needed)
    width: int = 0  # columns of the chunk (set when it is built)
    # batches, decode steps: laid out on the host and sent in one copy (see `_lay_out_batch`)
    src_t: torch.Tensor | None = None  # the chunk's tokens (host acceptance) or where each is in `seq`
    pos_t: torch.Tensor | None = None  # position ids of the chunk
    real_t: torch.Tensor | None = None  # 1 where a chunk column is real, 0 where it is left padding
    slot_col_t: torch.Tensor | None = None  # rows of different layouts: the logits column each slot reads
    # ... and for acceptance on the device
    active_t: torch.Tensor | None = None
    drafts_t: torch.Tensor | None = None  # verify mode: the pending drafts per row
    slot_pos_t: torch.Tensor | None = None  # where each candidate slot's token goes in `seq`
    valid_t: torch.Tensor | None = None  # which slots a row may accept
    forced_t: torch.Tensor | None = None  # verify: which slots hold a pending draft
    draft_idx_t: torch.Tensor | None = None  # verify, rows of different layouts: the slots new drafts come from
    draft_ok_t: torch.Tensor | None = None  # ... and which of them exist (within the slots the row may accept)


class _MARSDecoder:
    """State and steps of one MARS generation (threshold, block-cache or verify mode)."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, opts, streamer,
                 model_kwargs):
        self.model = model
        self.opts = opts
        self.gc = generation_config
        self.streamer = streamer
        self.device = input_ids.device
        self.on_cuda, self.on_cpu = self.device.type == "cuda", self.device.type == "cpu"
        b, P = input_ids.shape
        self.batch, self.prompt_len = b, P

        # --- processors and stopping criteria (prepared by generate; reused, never rebuilt) ---
        # SuppressTokens processors (enable_mars adds one for the mask) are folded into one in-place -inf
        # on the raw logits: same result (they only ever write -inf), fewer ops per step
        processors = list(logits_processor) if logits_processor is not None else []
        suppressed = {opts.mask_token_id}
        kept = []
        for proc in processors:
            if type(proc) is _lp.SuppressTokensLogitsProcessor:
                suppressed.update(torch.as_tensor(proc.suppress_tokens).flatten().tolist())
            else:
                kept.append(proc)
        self.processors = _lp.LogitsProcessorList(kept)
        # stateful processors / criteria get AR's calls only (see `_decide_exact`); the stateless part of the
        # chain still processes speculative candidates (verify mode drafts from it)
        pure = [_is_stateless(p, _STATELESS_PROCESSORS) for p in kept]
        self.stateful_procs = [p for p, is_pure in zip(kept, pure) if not is_pure]
        self.stateless_chain = _lp.LogitsProcessorList([p for p, is_pure in zip(kept, pure) if is_pure])
        self.copies_failed = False  # threshold mode: a stateful processor could not be copied (one token per step)
        self.suppress = sorted(suppressed)
        self.suppress_t = torch.tensor(self.suppress, dtype=torch.long, device=self.device)
        eos_ids, max_length, other = [], None, []
        for crit in stopping_criteria if stopping_criteria is not None else []:
            if isinstance(crit, _sc.EosTokenCriteria):
                eos_ids.extend(torch.as_tensor(crit.eos_token_id).flatten().tolist())
            elif isinstance(crit, _sc.MaxLengthCriteria):
                max_length = crit.max_length if max_length is None else min(max_length, crit.max_length)
            else:
                other.append(crit)
        stateful_criteria = [c for c in other if not _is_stateless(c, _STATELESS_CRITERIA)]
        # stateful criteria beside no stateful processor need not hold rows together: a criterion decides where a
        # row stops, never which tokens it gets, so it is called in AR's order behind the rows (`_check_lagging`;
        # with output_scores it keeps the exact path, which hands it each position's scores)
        lag = bool(stateful_criteria) and not self.stateful_procs and not (
            generation_config.return_dict_in_generate and generation_config.output_scores)
        self.lagging = _sc.StoppingCriteriaList(stateful_criteria) if lag else None
        self.other_criteria = _sc.StoppingCriteriaList([c for c in other if not (lag and c in stateful_criteria)])
        # otherwise, with anything stateful, every emitted position is decided in order and batch rows move in
        # lockstep (the same count per step), so one batched call is every row's exact AR history
        self.exact = bool(self.stateful_procs or (stateful_criteria and not lag))
        if max_length is None:
            max_length = generation_config.max_length
        if max_length is None:
            raise ValueError("MARS decoding needs a length limit: pass max_new_tokens or max_length.")
        self.max_new = int(max_length) - P
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device) if eos_ids else None
        self.eos_ids = frozenset(eos_ids)
        self._eos_scan = {}  # slots S -> (1..S, S + 1): the EOS scan's constants, made once per width
        pad = generation_config.pad_token_id
        if pad is None and eos_ids:
            pad = eos_ids[0]
        self.pad = int(torch.as_tensor(pad).flatten()[0]) if pad is not None else 0

        self.do_sample = bool(generation_config.do_sample)
        self.output_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.output_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)

        # --- geometry ---
        B = opts.block_size
        self.block_size = B
        self.candidates = B + 1 if opts.use_last_mask else B  # candidates per step (AR + masks)
        self.one_token = opts.tau >= 1.0
        self.block = opts.cache in ("block", "block_trained")
        self.chunk = opts.cache_block
        # verify mode: drafts per step come from the masks (B - 1, or B with the last mask)
        self.max_drafts = (self.candidates - 1) if not self.one_token else 0
        max_slots = (self.max_drafts + 1 + self.max_drafts) if opts.verify else self.candidates
        self.buf_len = P + max(self.max_new, 0) + max_slots + 2
        # a step's trailing drafts and masks may reach past the model's context (learned absolute positions,
        # GPT-2 / OPT, then index past their table) although the answer fits: only tokens past max_new read
        # those columns, so their positions are clamped to the last one (the emitted tokens are unchanged)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.last_position = limit - 1 if isinstance(limit, int) and P + self.max_new + max_slots > limit else None

        # --- token buffer: prompt | generated (pad-filled: finished rows read like AR's padded rows) ---
        # plus two constant columns, pad and mask, so that one gather builds a batched chunk
        self.seq = torch.full((b, self.buf_len + 2), self.pad, dtype=torch.long, device=self.device)
        self.seq[:, :P] = input_ids
        self.seq[:, self.buf_len + 1] = opts.mask_token_id
        attn = model_kwargs.get("attention_mask")
        self.prompt_attn = attn
        if attn is not None:
            self.prompt_real = attn.long().sum(-1)
            pos0 = attn.long().cumsum(-1) - 1
            self.prompt_pos = pos0.masked_fill(attn == 0, 0)
        else:
            self.prompt_real = torch.full((b,), P, dtype=torch.long, device=self.device)
            self.prompt_pos = torch.arange(P, device=self.device).unsqueeze(0).expand(b, P)
        self.cache_key = _cache_key(model_kwargs)
        self.cache = model_kwargs.get(self.cache_key)
        if self.cache is None:  # generate always prepares one; be safe if it did not
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        # sliding-window layers count cache columns, so a masked-out column inside the window would shorten it:
        # they keep their past until each crop (rollback), and batch rows move in lockstep (no ragged columns)
        self.sliding = any(type(layer) is DynamicSlidingWindowLayer for layer in getattr(self.cache, "layers", []))
        if self.sliding:
            self.cache.activate_past_recording()
        # a static cache holds a fixed number of columns: rows move in lockstep (no masked pad columns pile up) and
        # it must fit the prompt, the new tokens and one step's masks / drafts beyond them
        self.static = any(type(layer) is StaticLayer for layer in getattr(self.cache, "layers", []))
        if self.static:
            needed = P + max(self.max_new, 0) + 3 * self.candidates + 2  # one step's (fixed-width) chunk beyond
            capacity = min(layer.max_cache_len for layer in self.cache.layers)
            if self.cache.get_seq_length() > 0:  # a cache that holds a prefix is used as it is
                if capacity < needed:
                    raise ValueError(
                        f"This StaticCache holds {capacity} positions; MARS decoding needs {needed} (prompt + new "
                        f"tokens + one step's masks and drafts). Pass StaticCache(config, max_cache_len={needed})."
                    )
            else:  # an empty one (generate's, sized for this call's plain decoding): see `_static_cache_length`
                size = _static_cache_length(model, generation_config, needed)
                if capacity != size:
                    self.cache = StaticCache(config=model.config, max_cache_len=size)
        self.static_len = min(layer.max_cache_len for layer in self.cache.layers) if self.static else 0
        # torch.compile, as generate decides it for plain decoding: a compileable (static) cache, an accelerator or
        # compile_config._compile_all_devices, not disabled. Decode steps only (the prefill runs eagerly); each
        # distinct step width is one graph (dynamo turns the width dynamic after the second)
        self.decode_forward = model.__call__
        compile_config = getattr(generation_config, "compile_config", None)
        wants = not getattr(generation_config, "disable_compile", False) and (
            self.device.type in ("cuda", "xpu", "neuron", "tpu")
            or bool(compile_config is not None and getattr(compile_config, "_compile_all_devices", None)))
        # a compiled decode step keeps one width (extra masks at the end change nothing before them under causal
        # attention) so that one graph serves every step: the widest [committed | drafts] run plus the K-1 masks
        self.fixed_width = None
        if wants and self.static and getattr(self.cache, "is_compileable", False) and (
                getattr(getattr(model, "hf_quantizer", None), "is_compileable", True)):
            self.decode_forward = model.get_compiled_call(compile_config)
            if not self.block and not (self.one_token and not opts.verify):
                self.fixed_width = (1 + self.max_drafts if opts.verify else self.candidates) + self.candidates - 1
        self.cache_attn = None  # 2D mask over the cache's columns (None while every column is real)
        self.cache_len = 0
        self.extra_forward_kwargs = {k: v for k, v in model_kwargs.items() if k not in _LOOP_KWARGS}
        self.supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # positions reach prompt + generated + one chunk of drafts/masks
        self.arange = torch.arange(self.buf_len + 2 * (self.chunk + self.candidates) + 8, device=self.device)
        self.mask_col = torch.full((1, 1), opts.mask_token_id, dtype=torch.long, device=self.device)

        # --- per-row state: python mirrors (one host sync per step) + device tensors ---
        self.emitted = [0] * b  # emitted tokens
        self.fed = [-P] * b  # generated index of the first token not in the cache (-P: prompt not fed yet)
        self.unfinished = [True] * b
        self.in_chunk = [0] * b  # block cache: tokens accepted in the current chunk
        self.pending = [0] * b  # verify: pending drafts (in `seq` right after the committed tokens, or draft_tokens)
        self.chunk_start = True
        self.q_drafts = None  # verify + sampling: distributions the pending drafts were drawn from
        self.forwards = [0] * b  # forward passes each row took part in
        self.checked = 0  # lagging criteria: positions 1..checked have had their AR call
        self.streamed = [0] * b  # lagging criteria: tokens streamed per row (never past `checked`)
        # Acceptance on the host: when no processor reads the history and nothing but EOS and the length limit
        # stops a row (and verify does not sample), a step needs from the device only each slot's token and
        # whether it clears tau. Those come to the host in the step's one sync; which run to accept, EOS, new
        # drafts and the next chunk's tokens are decided there on short python lists instead of by a few dozen
        # small device ops (each a kernel launch on a GPU). `seq` then holds the prompt only until the end.
        self.host_accept = (not self.exact and len(self.other_criteria) == 0 and self.lagging is None
                            and all(isinstance(p, _HISTORY_FREE_PROCESSORS) for p in self.processors)
                            and not (opts.verify and self.do_sample))
        self.tokens = [[] for _ in range(b)]  # host acceptance: each row's emitted tokens
        self.draft_tokens = [[] for _ in range(b)]  # ... and its pending drafts
        self.compactions = 0
        self.records = [] if (self.output_scores or self.output_logits) else None
        self.model_forward = model.__call__
        self.prompt_real_int = int(self.prompt_real[0]) if b == 1 else None
        self.prompt_real_host = self.prompt_real.tolist()  # per-row prompt lengths, for the compaction check
        # ragged rows leave masked columns in the cache, which every later forward pays for: compact them away
        # once they are more than this share of it (dynamic full-attention caches, unlocked batches only)
        self.compactable = b > 1 and not self.exact and not self.block and not self.sliding and not self.static
        # sliding-window and static caches need every batch row to accept the same count each step (the stateful
        # path of `_decide_exact` already moves rows that way)
        self.lockstep = b > 1 and not self.exact and (self.sliding or self.static)
        self.one = torch.ones(1, dtype=torch.long, device=self.device)

    # ---------------------------------------------------------------- one step
    def _to_device(self, values, dtype=torch.long):
        """Per-row host values as a device tensor without a synchronising copy (pinned memory, non-blocking on GPU).
        A flat list of ints goes through an int64 array (torch.tensor reads a list element by element: 3x slower)."""
        if dtype is torch.long and values and not isinstance(values[0], list):
            t = torch.frombuffer(array.array("q", values), dtype=torch.long)
        else:
            t = torch.tensor(values, dtype=dtype)
        if self.on_cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t if self.on_cpu else t.to(self.device)

    def _plan(self) -> _StepPlan:
        """Per-row counts for this step (python lists; cheap for any realistic batch)."""
        b, opts = self.batch, self.opts
        max_accept = opts.max_accept or self.max_new
        plan = _StepPlan(first=self.fed[0] == -self.prompt_len, active=[False] * b, uncached=[0] * b,
                         drafts=[0] * b, masks=[0] * b, slots=[0] * b)
        for r in range(b):
            if not self.unfinished[r] or (self.block and not self.chunk_start and self.in_chunk[r] >= self.chunk):
                continue  # finished, or waiting for the slowest row to fill the block cache's chunk
            plan.active[r] = True
            remaining = self.max_new - self.emitted[r]
            plan.uncached[r] = self.emitted[r] - self.fed[r]
            if opts.cache == "block":
                plan.masks[r] = self.chunk - self.in_chunk[r]
            else:
                # candidates read masks 1..K-1 only, and under causal attention a later mask changes nothing
                # before it: feed K-1 masks (B-1 by default; none in one-token mode, an exact AR step)
                plan.masks[r] = 0 if (self.one_token and not self.block and not opts.verify) else self.candidates - 1
            if opts.verify:
                plan.drafts[r] = self.pending[r]
                # new drafts + the AR token must fit the length limit and the per-step cap
                new_drafts = min(self.max_drafts, max(0, remaining - plan.drafts[r] - 2), max_accept - 1)
                plan.slots[r] = plan.drafts[r] + 1 + new_drafts
            else:
                slots = 1 if self.one_token else 1 + min(self.candidates - 1, plan.masks[r])
                if self.block:
                    slots = min(slots, self.chunk - self.in_chunk[r])
                plan.slots[r] = min(slots, remaining, max_accept)
        plan.rows = [r for r in range(b) if plan.active[r]]
        if self.fixed_width and not plan.first:  # compiled steps: pad with masks to the one width
            for r in plan.rows:
                plan.masks[r] = self.fixed_width - plan.uncached[r] - plan.drafts[r]
        plan.lens = [plan.uncached[r] + plan.drafts[r] + plan.masks[r] for r in range(b)]
        plan.max_slots = max(plan.slots)
        plan.logits_kept = max(plan.masks[r] + plan.drafts[r] + 1 for r in plan.rows)
        if self.fixed_width and not plan.first:
            plan.logits_kept = self.fixed_width
        plan.uniform = len({(plan.masks[r], plan.drafts[r]) for r in plan.rows}) == 1
        plan.all_active = all(plan.active)
        if b > 1:
            self._lay_out_batch(plan)
        elif opts.verify and not self.host_accept:
            plan.drafts_t = self._to_device(plan.drafts)
        return plan

    def _lay_out_batch(self, plan):
        """Every per-row value a batched step needs on the device, laid out on the host and sent in one
        host->device copy: the chunk itself, ragged rows' logits columns and, when acceptance runs on the device,
        the slots (where each candidate's token goes, which a row may accept, pending drafts, new-draft slots).
        Building these on the device took a dozen small ops per piece, each a kernel launch on a GPU."""
        b, opts, host = self.batch, self.opts, self.host_accept
        W, S, P, kept = max(plan.lens), plan.max_slots, self.prompt_len, plan.logits_kept
        flat, sizes = [], []
        forced = draft_rows = False
        slot_rows = 0 if plan.uniform else 1
        if not host:
            flat += plan.active + plan.drafts
            sizes.append(2 * b)
            # per slot: where its token goes in `seq`, whether the row may accept it, [verify with drafts: whether
            # it holds a pending draft]
            forced = opts.verify and max(plan.drafts) > 0
            slot_rows += 2 + forced
            for r in range(b):
                flat += range(P + self.emitted[r], P + self.emitted[r] + S)
            for r in range(b):
                flat += [1] * plan.slots[r] + [0] * (S - plan.slots[r])
            if forced:
                for r in range(b):
                    flat += [1] * min(plan.drafts[r], S) + [0] * (S - min(plan.drafts[r], S))
        if not plan.uniform:  # rows of different layouts: which logits column each slot reads
            for r in range(b):
                c0 = kept - (plan.masks[r] + plan.drafts[r] + 1) if plan.active[r] else 0
                flat += [min(c0 + s, kept - 1) for s in range(S)]
        if slot_rows:
            sizes.append(slot_rows * b * S)
        # verify on the device, rows of different layouts: the slots each row's new drafts are read from, and
        # which exist
        M = self.max_drafts
        draft_rows = bool(not host and opts.verify and not plan.uniform and M > 0 and S > max(plan.drafts) + 1)
        if draft_rows:
            for r in range(b):
                flat += [min(plan.drafts[r] + 1 + j, S - 1) for j in range(M)]
            for r in range(b):
                flat += [int(plan.drafts[r] + 1 + j < S and min(plan.drafts[r] + 1 + j, S - 1) < plan.slots[r])
                         for j in range(M)]
            sizes.append(2 * b * M)
        if not plan.first:  # the chunk, right-aligned: [pad | committed + drafts | masks]
            pad, mask = (self.pad, opts.mask_token_id) if host else (self.buf_len, self.buf_len + 1)
            src, pos, real = [], [], []
            for r in range(b):
                n, u, d, f, left = plan.lens[r], plan.uncached[r], plan.drafts[r], self.fed[r], W - plan.lens[r]
                if host:  # the tokens themselves
                    content = self.tokens[r][f:f + u] + self.draft_tokens[r][:d]
                else:  # where they are in `seq` (pad and mask: its constant columns)
                    content = range(P + f, P + f + u + d)
                src += [pad] * left
                src += content
                src += [mask] * (n - u - d)
                p0 = self.prompt_real_host[r] + f
                pos += [0] * left
                pos += range(p0, p0 + n)
                real += [0] * left + [1] * n
            flat += src + pos + real
            sizes.append(3 * b * W)
        if not flat:
            return
        parts = self._to_device(flat).split(sizes)
        i = 0
        if not host:
            active, plan.drafts_t = parts[0].view(2, b).unbind(0)
            plan.active_t = active.bool()
            i = 1
        if slot_rows:
            slot_parts = parts[i].view(slot_rows, b, S).unbind(0)
            i += 1
            if not host:
                plan.slot_pos_t, plan.valid_t = slot_parts[0], slot_parts[1].bool()
                plan.forced_t = slot_parts[2].bool() if forced else None
            plan.slot_col_t = slot_parts[-1] if not plan.uniform else None
        if draft_rows:
            plan.draft_idx_t, in_range = parts[i].view(2, b, M).unbind(0)
            plan.draft_ok_t = in_range.bool()
            i += 1
        if not plan.first:
            plan.src_t, plan.pos_t, plan.real_t = parts[i].view(3, b, W).unbind(0)

    def step(self) -> bool:
        """One forward and everything it decides; False once every row has finished. Reads top to bottom:
        plan the chunk, build it, forward, read the candidate slots, choose and accept (processors, stops;
        one host sync), crop the cache, commit."""
        plan = self._plan()
        input_ids, position_ids, col_real = self._build_chunk(plan)
        logits = self._forward(plan, input_ids, position_ids, col_real)
        slot_logits, raw_logits = self._candidate_slots(plan, logits)
        accept = self._accept_on_host if self.host_accept else self._accept_on_device
        scores, accepted, stopped, drafts_next, host_tokens = accept(plan, slot_logits)
        if self.records is not None:
            self.records.append((scores if self.output_scores else None, raw_logits, list(self.emitted), accepted))
        b = self.batch
        finished = [plan.active[r] and (bool(stopped[r]) or self.emitted[r] + accepted[r] >= self.max_new)
                    for r in range(b)]
        keep_cols = self._crop_cache(plan, col_real, accepted, finished)
        self._commit(plan, keep_cols, accepted, drafts_next, finished, host_tokens)
        if self.compactable and self.cache_attn is not None:
            self._compact_cache()
        if self.lagging is not None:
            self._check_lagging()
        return any(self.unfinished)

    # ---------------------------------------------------------------- the phases of a step
    def _build_chunk(self, plan):
        """Inputs: per row [uncached committed | drafts | masks], right-aligned in a (batch, width) chunk.

        Returns input_ids, position_ids and which columns are real (None when all are)."""
        b, P, dev = self.batch, self.prompt_len, self.device
        if plan.first:  # prefill: [prompt | masks], the same number of masks in every row
            masks = plan.masks[plan.rows[0]]
            plan.width = P + masks
            input_ids = torch.cat([self.seq[:, :P], self.mask_col.expand(b, masks)], dim=1)
            position_ids = torch.cat([self.prompt_pos, self.prompt_real[:, None] + self.arange[:masks][None]], dim=1)
            col_real = None if self.prompt_attn is None else torch.cat(
                [self.prompt_attn.bool(), torch.ones(b, masks, dtype=torch.bool, device=dev)], dim=1)
        elif b == 1:  # no padding ever: plain slices
            plan.width, fed = plan.lens[0], self.fed[0]
            if self.host_accept:
                tokens = self.tokens[0][fed:fed + plan.uncached[0]] + self.draft_tokens[0][:plan.drafts[0]]
                input_ids = self._to_device(tokens + [self.opts.mask_token_id] * plan.masks[0])[None]
            else:
                input_ids = self.seq[:, P + fed:P + fed + plan.uncached[0] + plan.drafts[0]]
                if plan.masks[0]:
                    input_ids = torch.cat([input_ids, self.mask_col.expand(1, plan.masks[0])], dim=1)
            offset = self.prompt_real_int + fed
            position_ids = self.arange[offset:offset + plan.width][None]
            col_real = None if self.cache_attn is None else torch.ones(1, plan.width, dtype=torch.bool, device=dev)
        else:  # laid out on the host by _plan: the tokens, or one gather (pad and mask: seq's constant columns)
            plan.width = max(plan.lens)
            input_ids = plan.src_t if self.host_accept else self.seq.gather(1, plan.src_t)
            position_ids, col_real = plan.pos_t, plan.real_t
            # pads only matter in rows still decoding; with none there and none in the cache, no mask at all
            if self.cache_attn is None and all(plan.lens[r] == plan.width for r in plan.rows):
                col_real = None
        return input_ids, position_ids, col_real

    def _forward(self, plan, input_ids, position_ids, col_real):
        """The model forward over the chunk (the cache is updated in place); the logits from candidate 0 on."""
        attention_mask = None
        if col_real is not None:
            cache_attn = self.cache_attn
            if cache_attn is None:
                cache_attn = torch.ones(self.batch, self.cache_len, dtype=torch.long, device=self.device)
            attention_mask = torch.cat([cache_attn, col_real.long()], dim=1)
            if self.static_len:  # the cache's full length: one mask shape every step (one compiled graph); the
                # columns past the chunk are unwritten and causally masked anyway
                attention_mask = torch.nn.functional.pad(attention_mask, (0, self.static_len - attention_mask.shape[1]))
        kwargs = dict(self.extra_forward_kwargs)
        kwargs[self.cache_key] = self.cache
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = plan.logits_kept
        if self.last_position is not None:
            position_ids = position_ids.clamp(max=self.last_position)
        forward = self.model_forward if plan.first else self.decode_forward
        out = forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=True, return_dict=True, **kwargs)
        for r in range(self.batch):
            self.forwards[r] += self.unfinished[r]
        return out.logits[:, -plan.logits_kept:]

    def _candidate_slots(self, plan, logits):
        """Slot s of row r reads the logits column before its drafts and masks, plus s.

        Returns the float32 slot logits (mask token suppressed) and the raw ones for output_logits."""
        S, kept = plan.max_slots, plan.logits_kept
        if plan.uniform:
            r0 = plan.rows[0]
            offset = kept - (plan.masks[r0] + plan.drafts[r0] + 1)
            slot_logits = logits[:, offset:offset + S]
        else:  # (batches only: one row is always uniform)
            slot_logits = logits.gather(1, plan.slot_col_t[:, :, None].expand(-1, -1, logits.shape[-1]))
        slot_logits = slot_logits.to(dtype=torch.float32, copy=True)
        raw_logits = slot_logits.clone() if self.output_logits else None  # output_logits: before any processing
        slot_logits.index_fill_(-1, self.suppress_t, -math.inf)  # the mask token is never emitted
        return slot_logits, raw_logits

    def _slot_positions(self, plan):
        """Acceptance on the device: where each slot's token lives in `seq`, and which slots a row may accept
        (None: all)."""
        b, P, S = self.batch, self.prompt_len, plan.max_slots
        if b == 1:
            n = self.emitted[0]
            return self.arange[P + n:P + n + S][None], None
        if plan.all_active and min(plan.slots) == S:  # every row may accept every slot
            return plan.slot_pos_t, None
        return plan.slot_pos_t, plan.valid_t

    def _accept_on_host(self, plan, slot_logits):
        """Choose every slot's token on the device, bring the tokens and whether each clears tau to the host (the
        step's one sync), and decide there: threshold mode accepts candidate 0 and then slots while confident;
        verify accepts the pending drafts the AR tokens agree with plus one AR token, and when all were accepted
        proposes the confident mask slots after it as the next drafts. EOS cuts the run after it.

        Returns (scores, accepted count, stopped, new draft count or None) per row, as python lists, and (the
        accepted tokens, the new drafts) per row."""
        b, S, opts = self.batch, plan.max_slots, self.opts
        scores = self._history_free(self.processors, slot_logits)
        chosen = self._choose(scores)
        if self.one_token or S == 1:  # nothing beyond slot 0 can be accepted
            host, ok = chosen.view(-1).tolist(), None
        else:
            confident = self._confidence(scores, chosen, of_distribution=not self.do_sample) >= opts.tau
            host = torch.cat([chosen.view(-1), confident.view(-1)]).tolist()
            ok = host[b * S:]
        accepted, stopped = [0] * b, [False] * b
        new_tokens, new_drafts = [[] for _ in range(b)], [[] for _ in range(b)]
        for r in plan.rows:
            o, n = r * S, plan.slots[r]
            row = host[o:o + S]
            if opts.verify:
                d, pending = plan.drafts[r], self.draft_tokens[r]
                k = 0
                while k < d and row[k] == pending[k]:
                    k += 1
                tokens = pending[:k] + [row[k]]
                if k == d and ok is not None:
                    j = d + 1
                    while j < n and ok[o + j]:
                        j += 1
                    new_drafts[r] = row[d + 1:j]
            else:
                a = 1
                if ok is not None:
                    while a < n and ok[o + a]:
                        a += 1
                tokens = row[:a]
            for i, t in enumerate(tokens):
                if t in self.eos_ids:
                    del tokens[i + 1:]
                    stopped[r] = True
                    break
            new_tokens[r], accepted[r] = tokens, len(tokens)
        if self.lockstep:  # rows that go on accept the fewest tokens any of them accepted (see `_lockstep`)
            going = [r for r in plan.rows if not stopped[r]]
            if going:
                m = min(accepted[r] for r in going)
                c = min(len(new_drafts[r]) if m == plan.drafts[r] + 1 else 0 for r in going)
                for r in going:
                    del new_tokens[r][m:]
                    del new_drafts[r][c:]
                    accepted[r] = m
        drafts_next = [len(x) for x in new_drafts] if opts.verify else None
        return scores, accepted, stopped, drafts_next, (new_tokens, new_drafts)

    def _accept_on_device(self, plan, slot_logits):
        """Acceptance with history-reading processors, stopping criteria or verify sampling: decided on the device
        (the chosen tokens are written into `seq`, where processors and criteria read them), then the counts
        come to the host in the step's one sync.

        Returns (scores, accepted count, stopped, new draft count or None) per row, as python lists."""
        slot_pos, valid = self._slot_positions(plan)
        scores, acc, stop, new_drafts = self._choose_and_accept(plan, slot_logits, slot_pos, valid)
        parts = [acc] + ([stop.long()] if stop is not None else []) + ([new_drafts] if new_drafts is not None else [])
        host = torch.cat(parts).tolist() if len(parts) > 1 else acc.tolist()
        b = self.batch
        accepted = [host[r] if plan.active[r] else 0 for r in range(b)]
        stopped = host[b:2 * b] if stop is not None else [0] * b
        drafts_next = host[-b:] if new_drafts is not None else None
        return scores, accepted, stopped, drafts_next, None

    def _choose_and_accept(self, plan, slot_logits, slot_pos, valid):
        """Process the candidates, choose their tokens, accept a run of them and apply the stops.

        Returns (scores, accepted count, stopped or None, new drafts or None) as device tensors."""
        S, verify = plan.max_slots, self.opts.verify
        active_t = None if self.batch == 1 or plan.all_active else plan.active_t
        forced = forced_mask = None
        if verify and max(plan.drafts) > 0:  # the pending drafts sit right after the committed tokens
            forced_mask = self.arange[:S][None, :] < plan.drafts_t[:, None] if self.batch == 1 else plan.forced_t
            forced = self.seq.gather(1, slot_pos)
        if self.exact:  # stateful processors or criteria: one position at a time, AR's calls only
            return self._decide_exact(slot_logits, S, plan.rows, active_t, forced, forced_mask, slot_pos, valid,
                                      plan.drafts)
        scores, chosen = self._process(slot_logits, S, plan.rows, active_t, forced, forced_mask, slot_pos,
                                       self.processors)
        if verify:
            draft_slots = None if plan.draft_idx_t is None else (plan.draft_idx_t, plan.draft_ok_t)
            acc, new_drafts = self._accept_verify(scores, chosen, forced, forced_mask, valid, plan.drafts, slot_pos,
                                                  active_t, S, plan.drafts[plan.rows[0]] if plan.uniform else None,
                                                  plan.drafts_t, draft_slots)
            n = self.emitted[0]
            emitted = self.seq[:, self.prompt_len + n:self.prompt_len + n + S] if self.batch == 1 else \
                self.seq.gather(1, slot_pos)
        else:
            acc, new_drafts, emitted = self._accept_threshold(scores, chosen, valid), None, chosen
        # stops, checked after every accepted token: EOS, then any other criteria
        stop = None
        if self.eos is not None:
            if S not in self._eos_scan:
                self._eos_scan[S] = (self.arange[1:S + 1].clone(),
                                     torch.full((1,), S + 1, dtype=torch.long, device=self.device))
            at, never = self._eos_scan[S]
            eos_at = torch.where(torch.isin(emitted, self.eos), at, never).amin(1)
            stop = eos_at <= acc
            acc = torch.minimum(acc, eos_at)
        if len(self.other_criteria) > 0:
            acc, hit = self._other_criteria(acc, S, plan.rows, scores)
            stop = hit if stop is None else stop | hit
        if self.lockstep:
            acc, new_drafts = self._lockstep(plan, acc, stop, new_drafts)
        return scores, acc, stop, new_drafts

    def _lockstep(self, plan, acc, stop, new_drafts):
        """Rows that go on accept the fewest tokens any of them accepted (a row that stops keeps its count and
        finishes); new drafts only where a row emitted all its pending drafts and the AR token, then the same
        number in every row. Emitting fewer accepted tokens changes no token: each is the one AR decoding picks."""
        going = plan.active_t if stop is None else plan.active_t & ~stop
        never = torch.iinfo(acc.dtype).max
        acc = torch.where(going, torch.minimum(acc, torch.where(going, acc, never).amin()), acc)
        if new_drafts is not None:
            new_drafts = torch.where(going & (acc == plan.drafts_t + 1), new_drafts, 0)
            new_drafts = torch.where(going, torch.where(going, new_drafts, never).amin(), 0)
        return acc, new_drafts

    def _crop_cache(self, plan, col_real, accepted, finished) -> int:
        """Drop the masks' (and rejected drafts') cache entries; returns how many columns of the chunk stay.

        Block cache inside a chunk: everything fed is dropped (back to the frozen prefix). Verify: rejected
        drafts every row shares are cropped; the rest stay, masked out in the 2D attention mask."""
        b, dev, width = self.batch, self.device, plan.width
        keep_cols = width - max(plan.masks)  # the masks are the last columns whenever anything is kept
        leftover = False
        if self.block and not plan.first and not self.chunk_start:
            drop, keep_cols = width, 0
        elif self.opts.verify and not plan.first:
            # rejected drafts sit at the right end of each row's kept columns: crop what every row rejected
            rejected = [plan.drafts[r] - (accepted[r] - 1) for r in plan.rows if not finished[r]]
            extra = max(0, min(min(rejected) if rejected else 0, keep_cols))
            leftover = any(x > extra for x in rejected)
            drop = width - keep_cols + extra
            keep_cols -= extra
        else:
            drop = width - keep_cols
        if drop or self.sliding:  # crop(0) trims sliding layers back to their window
            self.cache.crop(-drop)
        if keep_cols:
            if col_real is not None or self.cache_attn is not None or leftover:
                if leftover:  # (batches only) a draft column stays real only if its draft was accepted: the
                    # row's committed tokens and acc - 1 drafts, counted from its first real column (host-known)
                    kept = []
                    for r in range(b):
                        first = width - plan.lens[r]
                        lo = 0 if col_real is None else min(first, keep_cols)
                        hi = max(lo, min(first + plan.uncached[r] + accepted[r] - 1, keep_cols))
                        kept += [0] * lo + [1] * (hi - lo) + [0] * (keep_cols - hi)
                    kept = self._to_device(kept).view(b, keep_cols)
                else:
                    kept = col_real[:, :keep_cols] if col_real is not None else torch.ones(
                        b, keep_cols, dtype=torch.bool, device=dev)
                base = self.cache_attn
                if base is None:
                    base = torch.ones(b, self.cache_len, dtype=torch.long, device=dev)
                self.cache_attn = torch.cat([base, kept.long()], dim=1)
            self.cache_len += keep_cols
        return keep_cols

    def _compact_cache(self, threshold: float = COMPACT_THRESHOLD):
        """Move each row's real cache columns to the right end and drop the columns that are padding in every row.

        Keys already carry their rotary positions and attention does not care where a key sits, only whether it is
        masked, so the output is unchanged; the cache then holds no more columns than the longest row needs."""
        longest = max(p + f for p, f in zip(self.prompt_real_host, self.fed))
        waste = self.cache_len - longest
        if waste <= max(threshold * self.cache_len, 0):
            return
        order = torch.argsort(self.cache_attn, dim=1, stable=True)[:, waste:]  # pads first, real columns in order
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            idx = order[:, None, :, None]
            layer.keys = layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.cache_attn = self.cache_attn.gather(1, order)
        self.cache_len -= waste
        self.compactions += 1

    def _commit(self, plan, keep_cols, accepted, drafts_next, finished, host_tokens=None):
        """Advance the per-row state on the host; finished rows read as pads from here on (like AR's)."""
        b, verify = self.batch, self.opts.verify
        runs = []
        for r in range(b):
            a = accepted[r]
            if host_tokens is not None:
                self.tokens[r] += host_tokens[0][r]
                self.draft_tokens[r] = [] if finished[r] else host_tokens[1][r]
            if keep_cols and self.unfinished[r]:
                if plan.first:
                    self.fed[r] = 0
                elif verify:
                    self.fed[r] = self.emitted[r] + max(a - 1, 0)  # accepted drafts are cached, the AR token not
                else:
                    self.fed[r] = self.emitted[r]
            runs.append((self.emitted[r], a))
            self.emitted[r] += a
            if self.block:
                self.in_chunk[r] += a
            if verify:
                self.pending[r] = 0 if finished[r] else drafts_next[r]
            if finished[r]:
                self.unfinished[r] = False
        if any(finished) and host_tokens is None:  # (host acceptance never writes past a row's end)
            fin_t = self._to_device(finished, torch.bool)
            emitted_t = self._to_device(self.emitted)
            tail = self.arange[:self.buf_len][None, :] >= (self.prompt_len + emitted_t)[:, None]
            self.seq[:, :self.buf_len].masked_fill_(fin_t[:, None] & tail, self.pad)
        if self.block:
            self._start_chunk_if_filled()
        if self.streamer is not None and self.lagging is None:  # (lagging criteria: streamed once checked)
            self._stream(runs)

    def _start_chunk_if_filled(self):
        """Block cache: a new chunk starts once every row still decoding has filled the current one."""
        self.chunk_start = all((not self.unfinished[r]) or self.in_chunk[r] >= self.chunk for r in range(self.batch))
        if self.chunk_start:
            self.in_chunk = [0] * self.batch

    def _check_lagging(self):
        """Stateful stopping criteria (no stateful processor): AR's calls, made behind the rows instead of holding
        them in lockstep. The call for position t comes once every row still decoding has reached t, on the batch's
        AR history there (pads after a row that ended before t); a row that ran past a stop it is told of now is
        cut back to it, as AR would have stopped it. Tokens are streamed only once checked, so nothing streamed
        is ever taken back."""
        b, P = self.batch, self.prompt_len
        while True:
            going = [self.emitted[r] for r in range(b) if self.unfinished[r]]
            t = self.checked + 1
            if t > (min(going) if going else max(self.emitted)):
                break
            hit = torch.as_tensor(self.lagging(self.seq[:, :P + t], None), device=self.device).expand(b).tolist()
            for r in range(b):
                if hit[r] and self.emitted[r] >= t:  # the row has a token at t: it ends there
                    if self.emitted[r] > t:
                        self.seq[r, P + t:self.buf_len] = self.pad
                        self.emitted[r] = t
                    self.unfinished[r], self.pending[r] = False, 0
            self.checked = t
        if self.block and not self.chunk_start:  # a cut row no longer holds the others' chunk open
            self._start_chunk_if_filled()
        if self.streamer is not None:
            runs = [(self.streamed[r], max(min(self.emitted[r], self.checked) - self.streamed[r], 0)) for r in range(b)]
            self.streamed = [start + a for start, a in runs]
            self._stream(runs)

    # ---------------------------------------------------------------- processing candidates
    def _choose(self, scores):
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(scores.shape[:-1])
        return scores.argmax(-1)

    def _history_free(self, chain, slot_logits):
        """A chain that ignores input_ids, applied to every slot in one call."""
        if len(chain) == 0:
            return slot_logits
        b, S, V = slot_logits.shape
        dummy = self.seq[:, :1].repeat_interleave(S, dim=0)
        return chain(dummy, slot_logits.reshape(-1, V)).view(b, S, V)

    def _process(self, slot_logits, S, rows, active_t, forced, forced_mask, slot_pos, chain, stop_at_ends=False):
        """Run the logits-processor chain on every slot and pick a token for it.

        Slot s of row r is processed with input_ids = the row's history extended by the tokens of slots
        0..s-1 (drafts where forced, chosen tokens otherwise): exactly what AR decoding would pass. The
        tokens are written into `seq` at their positions (inactive rows keep pads there). ``stop_at_ends``
        (a chain holding stateful objects): no history goes on past a row's EOS, as in AR decoding.
        """
        P = self.prompt_len
        if all(isinstance(p, _HISTORY_FREE_PROCESSORS) for p in chain):
            scores = self._history_free(chain, slot_logits)
            chosen = self._choose(scores)
            ext = chosen if forced_mask is None else torch.where(forced_mask, forced, chosen)
            if active_t is not None:
                ext = torch.where(active_t[:, None], ext, self.pad)
            self.seq.scatter_(1, slot_pos, ext)
            return scores, chosen
        # exact path: one slot at a time; rows grouped by history length. Every call gets the full batch
        # (processors may hold per-row state); rows outside the group are discarded. With `stop_at_ends` a
        # history never goes on past a row's end, as in AR decoding: after a row's EOS (its token or its draft
        # there) the row continues with pads, and once every row has ended no further slot is processed (no
        # slot after an EOS can be emitted). Grammar matchers raise when handed a history past EOS.
        groups = {}
        for r in rows:
            groups.setdefault(self.emitted[r], []).append(r)
        group_rows = {g: self._to_device(rs) for g, rs in groups.items()}
        scores = torch.empty_like(slot_logits)
        chosen = torch.full(slot_logits.shape[:2], self.pad, dtype=torch.long, device=self.device)
        stop_at_ends = stop_at_ends and self.eos is not None
        ended = None if active_t is None else ~active_t  # rows whose history takes pads from here on
        if stop_at_ends and ended is None:
            ended = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        for s in range(S):
            if s > 0 and stop_at_ends and bool(ended.all()):  # the rest is never emitted: raw logits, pads
                scores[:, s:] = slot_logits[:, s:]
                self.seq.scatter_(1, slot_pos[:, s:], self.pad)
                break
            for g, rs in group_rows.items():
                processed = chain(self.seq[:, :P + g + s], slot_logits[:, s].clone())
                if len(group_rows) == 1:
                    scores[:, s] = processed
                else:
                    scores[rs, s] = processed[rs]
            tok = self._choose(scores[:, s])
            chosen[:, s] = tok
            ext = tok if forced_mask is None else torch.where(forced_mask[:, s], forced[:, s], tok)
            if ended is not None:
                ext = torch.where(ended, self.pad, ext)
            self.seq.scatter_(1, slot_pos[:, s:s + 1], ext[:, None])
            if stop_at_ends:
                ended = ended | torch.isin(ext, self.eos) | torch.isin(tok, self.eos)
        return scores, chosen

    def _confidence(self, scores, chosen, probs=None, of_distribution=False):
        """Confidence on one scale for every acceptance rule: accepted when >= tau."""
        if probs is None:
            probs = torch.softmax(scores, dim=-1)
        mode = self.opts.acceptance
        if mode == "probability":
            if of_distribution:
                return probs.amax(-1)
            return probs.gather(-1, chosen[..., None]).squeeze(-1)
        if mode == "entropy":
            # exp(-H): 1 for a certain distribution, 1/k for uniform over k tokens; >= tau <=> H <= -ln(tau)
            return torch.exp(-torch.special.entr(probs).sum(-1))
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]

    def _accept_threshold(self, scores, chosen, valid):
        """Candidate 0 always; then left to right while confidence >= tau (first failure stops)."""
        S = scores.shape[1]
        if self.one_token or S == 1:
            return self.one.expand(self.batch) if valid is None else valid[:, 0].long()
        # greedy: the chosen token is the argmax, so its probability is the distribution's largest
        ok = self._confidence(scores[:, 1:], chosen[:, 1:], of_distribution=not self.do_sample) >= self.opts.tau
        if valid is not None:
            ok &= valid[:, 1:]
        acc = 1 + ok.long().cumprod(1).sum(1)
        return acc if valid is None else acc * valid[:, 0]

    def _accept_verify(self, scores, chosen, forced, forced_mask, valid, d, slot_pos, active_t, S, d_uniform,
                       d_t, draft_slots=None):
        """Accept the longest prefix of drafts AR agrees with, plus one AR token; propose new drafts.

        Greedy: a draft is accepted when it equals the AR argmax. Sampling: speculative-sampling acceptance
        (accept with probability min(1, p/q), on rejection resample from normalised max(p - q, 0)), so the
        output is distributed exactly as AR sampling.
        """
        b, dev = self.batch, self.device
        Dm = max(d)
        probs = None
        if Dm == 0:
            k = ar_tok = None
        elif not self.do_sample:
            agree = (chosen == forced) & forced_mask  # forced_mask is False past each row's drafts
            k = agree.long().cumprod(1).sum(1)
            ar_tok = chosen.gather(1, k[:, None]).squeeze(1)
        else:
            probs = torch.softmax(scores, dim=-1)
            q = self.q_drafts[:, :Dm]
            dtok = forced[:, :Dm, None]
            pd = probs[:, :Dm].gather(-1, dtok).squeeze(-1)
            qd = q.gather(-1, dtok).squeeze(-1)
            keep = (torch.rand(b, Dm, device=dev) * qd < pd) & forced_mask[:, :Dm]
            k = keep.long().cumprod(1).sum(1)
            V = probs.shape[-1]
            pk = probs.gather(1, k[:, None, None].expand(-1, 1, V)).squeeze(1)
            qk = q.gather(1, k.clamp(max=Dm - 1)[:, None, None].expand(-1, 1, V)).squeeze(1)
            residual = (pk - qk).clamp_min(0)
            rsum = residual.sum(-1, keepdim=True)
            dist = torch.where(rsum > 0, residual / rsum.clamp_min(1e-30), pk)
            resampled = torch.multinomial(dist, 1).squeeze(1)
            # all drafts accepted: the bonus token is the one already drawn from p at that slot
            ar_tok = torch.where(k < d_t, resampled, chosen.gather(1, k[:, None]).squeeze(1))
        # the token at slot k is the AR token (correction or bonus); with no drafts it is already there (slot 0)
        if Dm > 0:
            tok_k = ar_tok if active_t is None else torch.where(active_t, ar_tok, self.pad)
            self.seq.scatter_(1, slot_pos.gather(1, k[:, None]), tok_k[:, None])
            acc = k + 1 if active_t is None else (k + 1) * active_t
        else:
            acc = self.one.expand(b) if active_t is None else active_t.long()
        # new drafts: the mask slots after the AR token, kept only where every pending draft was accepted
        newd = self._propose_drafts(scores, chosen, probs, valid, d, S, d_uniform, d_t, draft_slots)
        if Dm > 0:
            newd = torch.where(k == d_t, newd, 0)
        return acc, newd

    def _propose_drafts(self, scores, chosen, probs, valid, d, S, d_uniform, d_t=None, draft_slots=None):
        """Drafts for the next step: the mask slots after each row's AR token, truncated at the first one whose
        distribution is less confident than tau. With sampling, remembers the distributions they were drawn from.
        ``draft_slots``: (slot index, exists) per row and draft, when `_plan` laid them out on the host."""
        b, dev = self.batch, self.device
        if not (self.max_drafts > 0 and S > max(d) + 1):
            return torch.zeros(b, dtype=torch.long, device=dev)
        if d_uniform is not None:  # every active row has its mask slots at the same place: slice
            lo = d_uniform + 1
            mscores = scores[:, lo:lo + self.max_drafts]
            mprobs = probs[:, lo:lo + self.max_drafts] if probs is not None else torch.softmax(mscores, dim=-1)
            in_range = None if valid is None else valid[:, lo:lo + self.max_drafts]
            mtok = chosen[:, lo:lo + self.max_drafts]
        else:
            if draft_slots is not None:
                idx, in_range = draft_slots
            else:
                d_t = self._to_device(d) if d_t is None else d_t
                idx_raw = (d_t + 1)[:, None] + self.arange[:self.max_drafts][None]
                idx = idx_raw.clamp(max=S - 1)
                in_range = idx_raw < S
                if valid is not None:
                    in_range &= valid.gather(1, idx)
            mprobs = probs if probs is not None else torch.softmax(scores, dim=-1)
            mprobs = mprobs.gather(1, idx[:, :, None].expand(-1, -1, mprobs.shape[-1]))
            mtok = chosen.gather(1, idx)
        # truncation looks at the draft distribution only (not the drawn token), so it cannot bias sampling
        ok = self._confidence(None, mtok, probs=mprobs, of_distribution=True) >= self.opts.tau
        if in_range is not None:
            ok &= in_range
        if self.do_sample:
            self.q_drafts = mprobs
        return ok.long().cumprod(1).sum(1)

    # ---------------------------------------------------------------- stateful processors and criteria
    def _disposable_chain(self):
        """The processor chain with every stateful processor deep-copied (speculation must not touch them).

        None when a processor cannot be copied (C++/Rust matchers usually cannot): the step then accepts one
        token, decided by the real chain alone, and later steps stay one token per step."""
        if self.copies_failed:
            return None
        try:
            return _lp.LogitsProcessorList(
                [copy.deepcopy(p) if any(p is q for q in self.stateful_procs) else p for p in self.processors])
        except Exception as err:  # noqa: BLE001 - any failure to copy means: do not speculate
            self.copies_failed = True
            self.one_token = True
            names = ", ".join(sorted({type(p).__name__ for p in self.stateful_procs}))
            _logger.warning_once(
                f"MARS threshold decoding with a stateful logits processor ({names}) that cannot be copied "
                f"({type(err).__name__}): decoding one token per forward so that the processor sees exactly the "
                "calls of plain decoding (the output is plain greedy/sampling). Use mars_verify=True for lossless "
                "multi-token decoding with this processor."
            )
            return None

    def _decide_exact(self, slot_logits, S, rows, active_t, forced, forced_mask, slot_pos, valid, d):
        """Choose, accept and stop so that stateful processors and criteria see only AR decoding's calls.

        Every unfinished row is at the same length (rows accept the same count each step), so one batched call
        holds each row's exact history. Speculation runs on disposable copies (threshold mode) or the stateless
        part of the chain (verify drafts); then the real objects are called once per emitted position, in
        order: the processors on the history before it, the criteria on the history that ends with it. A
        position is processed only once it is certain to be emitted (verify: every earlier draft accepted;
        threshold: accepted on the copies' scores, which the real call must reproduce).
        Returns (scores, accepted count, stopped, new drafts or None).
        """
        b, P, dev, opts = self.batch, self.prompt_len, self.device, self.opts
        live = torch.ones(b, dtype=torch.bool, device=dev) if active_t is None else active_t.clone()
        n = self.emitted[rows[0]]
        d0 = d[rows[0]] if opts.verify else 0
        scores = chosen = None
        if opts.verify:
            chain = self.stateless_chain if self.stateful_procs else self.processors
            scores, chosen = self._process(slot_logits, S, rows, active_t, forced, forced_mask, slot_pos, chain)
            limit = d0 + 1  # slots 0..d0-1 verify the drafts, slot d0 is the AR token after them
        else:
            chain = None
            if not self.one_token:  # one-token steps need no speculation: the real chain decides slot 0
                chain = self._disposable_chain() if self.stateful_procs else self.processors
            if chain is None:
                limit = 1
            else:
                scores, chosen = self._process(slot_logits, S, rows, active_t, None, None, slot_pos, chain,
                                               stop_at_ends=True)
                spec_acc = self._accept_threshold(scores, chosen, valid)
                limit = int(spec_acc[live].min()) if b > 1 else int(spec_acc[0])
        out = torch.empty_like(slot_logits) if scores is None else scores.clone()
        acc = torch.zeros(b, dtype=torch.long, device=dev)
        stop = torch.zeros(b, dtype=torch.bool, device=dev)
        all_drafts = False
        for s in range(limit):
            if self.stateful_procs or scores is None:
                real = self.processors(self.seq[:, :P + n + s], slot_logits[:, s].clone())
            else:
                real = scores[:, s]
            agreed = None
            if opts.verify:
                tok, agreed = self._verify_slot(real, s, d0, forced)
            elif scores is not None and torch.equal(real[live], scores[live, s]):
                tok = chosen[:, s]
            else:  # the real call disagrees with its copy (or there is no copy): this token ends the step
                tok, limit = self._choose(real), s + 1
            tok = torch.where(live, tok, self.pad)
            self.seq[:, P + n + s] = tok
            out[:, s] = real
            acc = torch.where(live, s + 1, acc)
            hit = torch.isin(tok, self.eos) if self.eos is not None else torch.zeros_like(live)
            if len(self.other_criteria) > 0:
                crit = self.other_criteria(self.seq[:, :P + n + s + 1], (real,) if self.output_scores else None)
                hit = hit | torch.as_tensor(crit, device=dev).expand(b)
            hit &= live
            stop |= hit
            live &= ~hit
            if s + 1 >= limit or not bool(live.any()):
                all_drafts = opts.verify and s == d0
                break
            if opts.verify and not bool(agreed[live].all()):
                break
        newd = None
        if opts.verify:
            newd = torch.zeros(b, dtype=torch.long, device=dev)
            if all_drafts:  # every live row emitted all its drafts and the AR token: propose from its masks
                newd = self._propose_drafts(scores, chosen, None, valid, d, S, d0)
                newd = torch.where(live, newd, 0)
                if b > 1 and bool(live.any()):
                    newd = torch.where(live, newd[live].min(), 0)  # the same count in every row (lockstep)
        return out, acc, stop, newd

    def _verify_slot(self, real, s, d0, forced):
        """The AR token at slot s and whether it is the pending draft there (speculative sampling when sampling)."""
        if not self.do_sample:
            tok = real.argmax(-1)
            return tok, (tok == forced[:, s]) if s < d0 else None
        p = torch.softmax(real, dim=-1)
        if s >= d0:
            return torch.multinomial(p, 1).squeeze(1), None
        draft = forced[:, s]
        q = self.q_drafts[:, s]
        pd, qd = p.gather(1, draft[:, None]).squeeze(1), q.gather(1, draft[:, None]).squeeze(1)
        keep = torch.rand(draft.shape[0], device=self.device) * qd < pd
        residual = (p - q).clamp_min(0)
        rsum = residual.sum(-1, keepdim=True)
        resampled = torch.multinomial(torch.where(rsum > 0, residual / rsum.clamp_min(1e-30), p), 1).squeeze(1)
        return torch.where(keep, draft, resampled), keep

    def _other_criteria(self, acc, S, rows, scores):
        """Stopping criteria beyond EOS / length, checked after each accepted token on the exact AR history."""
        b, P = self.batch, self.prompt_len
        groups = {}
        for r in rows:
            groups.setdefault(self.emitted[r], []).append(r)
        stop_at = torch.full((b,), S + 1, dtype=torch.long, device=self.device)
        for i in range(1, S + 1):
            for g, rs in groups.items():
                hit = self.other_criteria(self.seq[:, :P + g + i], (scores[:, i - 1],) if self.output_scores else None)
                hit = torch.as_tensor(hit, device=self.device).expand(b).clone()
                in_group = torch.zeros(b, dtype=torch.bool, device=self.device)
                in_group[rs] = True
                hit &= in_group & (i <= acc) & (stop_at > i)
                stop_at = torch.where(hit, i, stop_at)
        stop = stop_at <= S
        return torch.where(stop, stop_at, acc), stop

    def _stream(self, runs):
        """The tokens each row emitted this step, to the streamer (CPU tensors, as generate hands them)."""
        P = self.prompt_len
        if self.host_accept:
            new = [torch.tensor(self.tokens[r][start:start + a], dtype=torch.long) for r, (start, a) in enumerate(runs)]
        else:
            cpu = self.seq[:, P:P + max(start + a for start, a in runs)].cpu()
            new = [cpu[r, start:start + a] for r, (start, a) in enumerate(runs)]
        if self.batch == 1:
            if runs[0][1]:
                self.streamer.put(new[0])
            return
        width = max(a for _, a in runs)
        if width == 0:
            return
        if hasattr(self.streamer, "put_rows"):  # a batch-aware streamer gets each row's own new tokens (maybe none)
            self.streamer.put_rows(new)
            return
        block = torch.full((self.batch, width), self.pad, dtype=torch.long)
        for r, row in enumerate(new):
            block[r, :row.shape[0]] = row
        self.streamer.put(block)

    # ---------------------------------------------------------------- results
    def run(self, synced: bool = False):
        """Step until every row has finished. ``synced`` (parameters sharded across ranks): every rank forwards in
        lockstep until all ranks are done, a finished rank running a throwaway forward, as transformers does."""
        if self.max_new <= 0:
            self.unfinished = [False] * self.batch
            if not synced:
                return self.seq[:, :self.prompt_len]
        with torch.no_grad():
            while True:
                if synced:
                    finished_ranks = torch.tensor(0.0 if any(self.unfinished) else 1.0, device=self.device)
                    torch.distributed.all_reduce(finished_ranks)
                    if int(finished_ranks.item()) == torch.distributed.get_world_size():
                        break
                    if not any(self.unfinished):
                        self.model_forward(input_ids=self.seq[:, :1], use_cache=False)  # keep the shards moving
                        continue
                if not self.step() and not synced:
                    break
        T = max(self.emitted)
        if self.host_accept and T:  # the emitted tokens into `seq`, pad-filled after each row's end
            self.seq[:, self.prompt_len:self.prompt_len + T] = self._to_device(
                [row + [self.pad] * (T - len(row)) for row in self.tokens])
        return self.seq[:, :self.prompt_len + T]

    def assemble(self, which):
        """One (b, V) tensor per emitted position, from the per-step records."""
        if not self.records:
            return None
        T = max(self.emitted)
        if T == 0:
            return ()
        V = None
        per_row = [[] for _ in range(self.batch)]
        for rec in self.records:
            tensor = rec[which]
            if tensor is None:
                return None
            V = tensor.shape[-1]
            a_l = rec[3]
            for r in range(self.batch):
                if a_l[r] > 0:
                    per_row[r].append(tensor[r, :a_l[r]])
        # positions after a row finished hold a distribution certain of the pad token (the token the sequence
        # holds there), like plain generate's finite scores: transition scores are 0 there, never NaN
        out = torch.full((self.batch, T, V), -math.inf, device=self.device)
        out[:, :, self.pad] = 0.0
        for r in range(self.batch):
            if per_row[r]:
                rows = torch.cat(per_row[r])[: self.emitted[r]]
                out[r, :rows.shape[0]] = rows
        return tuple(out.unbind(1))


def _sharded_across_ranks(model) -> bool:
    """True when generation must step in lockstep across ranks (DeepSpeed ZeRO-3 or FSDP, world size > 1):
    what transformers' `generate` infers for `synced_gpus`, which it does not pass to a callable custom_generate."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def mars_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool | None = None,
    streamer=None,
    mars: bool = True,
    mars_threshold: float | None = None,
    mars_block_size: int | None = None,
    mars_acceptance: str | None = None,
    mars_max_accept: int | None = None,
    mars_cache: str | None = None,
    mars_cache_block: int | None = None,
    mars_verify: bool | None = None,
    mars_use_last_mask: bool | None = None,
    mars_streamer=None,
    **model_kwargs,
):
    """The MARS decoding loop, for ``model.generate(..., custom_generate=mars_generate, mars_threshold=...)``.

    transformers has already built the generation config, logits processors, stopping criteria, attention
    mask and cache; this runs the loop. Arguments (None = generation_config.mars_* or the default):

    - mars_threshold (tau, default 0.95): accept mask candidates while confidence >= tau; 1.0 = exactly greedy AR.
    - mars_block_size (B, default config.mars['block_size'] or 4): masks appended per step; B candidates
      (AR + B-1 masks), B+1 with mars_use_last_mask=True.
    - mars_acceptance: "probability" (p of the chosen token), "entropy" (exp(-H) >= tau, i.e. entropy <= -ln tau
      nats), "margin" (top1 - top2 probability); all on the processed distribution.
    - mars_max_accept: cap on tokens accepted per step.
    - mars_cache: "sliding" (default; rows never wait), "block" (paper's block-level cache: chunks of
      mars_cache_block positions, each inner step forwards the chunk's accepted tokens + masks for all its
      remaining positions over a frozen prefix, rows that filled the chunk wait), "block_trained" (same chunks,
      but [accepted | B masks]). The forward that extends the cache with a completed chunk is merged with the
      next chunk's first inner step ([completed chunk | masks]), so it costs no extra forward.
    - mars_verify: lossless self-speculative mode (mask predictions are drafts verified by the next forward;
      tau truncates the drafts, output equals plain greedy / plain sampling in distribution).
    - mars_streamer: a streamer. transformers hands a callable custom_generate neither ``streamer=`` nor
      ``tokenizer=`` (nor assistant_model / synced_gpus), so on that route pass ``mars_streamer=``; `enable_mars`
      and a checkpoint's custom_generate route ``streamer=`` here themselves.
    tau >= 1 accepts exactly the AR token each step (identical to greedy decoding).
    """
    if not mars:
        raise ValueError(
            "mars_generate runs MARS decoding; for plain decoding call generate without custom_generate=mars_generate "
            "(or, after enable_mars, without mars arguments)."
        )
    # parameters sharded across ranks (ZeRO-3 / FSDP): every rank must forward in lockstep until all are done.
    # transformers does not hand a callable its synced_gpus, so infer it as transformers does
    synced = _sharded_across_ranks(model) if synced_gpus is None else bool(synced_gpus)
    if synced and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("synced_gpus=True needs an initialised torch.distributed process group.")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"MARS decoding needs a prompt of at least one token per row; got input_ids of shape {tuple(input_ids.shape)}. "
            "Start the prompt with BOS or the chat template's generation prompt."
        )
    attn = model_kwargs.get("attention_mask")
    if attn is not None and attn.ndim == 2 and bool((attn.sum(-1) == 0).any()):
        raise ValueError("MARS decoding needs at least one real (unpadded) prompt token in every row; a row of the "
                         "attention_mask is all zeros.")
    _check_supported(model, generation_config, model_kwargs)
    opts = _resolve_options(
        model, generation_config, mars_threshold=mars_threshold, mars_block_size=mars_block_size,
        mars_acceptance=mars_acceptance, mars_max_accept=mars_max_accept, mars_cache=mars_cache,
        mars_cache_block=mars_cache_block, mars_verify=mars_verify, mars_use_last_mask=mars_use_last_mask,
    )
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    if vocab is not None and opts.mask_token_id >= vocab:
        raise ValueError(
            f"mask_token_id {opts.mask_token_id} is outside the model's vocabulary ({vocab}); "
            "resize the embeddings (hf_mars.add_mask_token does it)."
        )
    if mars_streamer is not None:
        streamer = mars_streamer
        streamer.put(input_ids.cpu())
    decoder = _MARSDecoder(model, input_ids, logits_processor, stopping_criteria, generation_config, opts, streamer,
                           model_kwargs)
    sequences = decoder.run(synced=synced)
    if streamer is not None:
        streamer.end()
    stats_path = os.environ.get("HF_MARS_STATS")
    if stats_path:  # per-call statistics for a serving stack that cannot read the output object
        with open(stats_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"emitted_tokens": decoder.emitted, "forward_passes": decoder.forwards,
                                "threshold": opts.tau, "verify": opts.verify}) + "\n")
    if not generation_config.return_dict_in_generate:
        return sequences
    # the cache is returned only when it has no masked-out columns (it can then be reused as is)
    clean_cache = decoder.cache if decoder.cache_attn is None and decoder.prompt_attn is None else None
    fields = MARSGenerateOutput.__dataclass_fields__
    return MARSGenerateOutput(
        sequences=sequences,
        scores=decoder.assemble(0) if decoder.output_scores else None,
        logits=decoder.assemble(1) if decoder.output_logits else None,
        mars_forward_passes=torch.tensor(decoder.forwards, dtype=torch.long, device=decoder.device),
        mars_emitted_tokens=torch.tensor(decoder.emitted, dtype=torch.long, device=decoder.device),
        **{("cache" if "cache" in fields else "past_key_values"): clean_cache},
    )


# ----------------------------------------------------------------------------------------------------------------
# generate() routing: enable_mars and the custom_generate entry point
# ----------------------------------------------------------------------------------------------------------------

_GENERATE_PARAMS = None


def _bind_generate_args(model, args, kwargs) -> dict:
    """Turn positional generate arguments into keywords (so we can add criteria / processors safely)."""
    global _GENERATE_PARAMS
    if not args:
        return dict(kwargs)
    if _GENERATE_PARAMS is None:
        _GENERATE_PARAMS = [p for p in inspect.signature(GenerationMixin.generate).parameters
                            if p not in ("self", "kwargs")]
    if len(args) > len(_GENERATE_PARAMS):
        raise TypeError(f"generate() takes at most {len(_GENERATE_PARAMS)} positional arguments")
    bound = dict(zip(_GENERATE_PARAMS, args))
    overlap = set(bound) & set(kwargs)
    if overlap:
        raise TypeError(f"generate() got multiple values for {sorted(overlap)}")
    bound.update(kwargs)
    return bound


def _with_mask_suppressed(model, kwargs, mask_id):
    """Add the mask token to `suppress_tokens` for this call (transformers then builds the processor). With a
    `generation_config` passed and no `suppress_tokens` argument, a copy of that config carries it: transformers
    deprecates passing both a config and generation arguments."""
    existing = kwargs.get("suppress_tokens")
    given_config = kwargs.get("generation_config") if existing is None else None
    if existing is None:
        existing = getattr(given_config or model.generation_config, "suppress_tokens", None)
    existing = list(existing or [])
    if mask_id not in existing:
        existing.append(mask_id)
    if given_config is not None:
        given_config = copy.copy(given_config)  # shallow: only suppress_tokens is replaced (a new list)
        given_config.suppress_tokens = existing
        kwargs["generation_config"] = given_config
    else:
        kwargs["suppress_tokens"] = existing


def _route_generate(model, *args, **kwargs):
    """`generate` with MARS routing: MARS when asked (mars=True or any mars_* argument), plain otherwise."""
    kwargs = _bind_generate_args(model, args, kwargs)
    mars_args = {k: kwargs.pop(k) for k in list(kwargs) if k == "mars" or k.startswith("mars_")}
    unknown = sorted(set(mars_args) - set(MARS_ARGUMENTS))
    if unknown:
        raise ValueError(f"Unknown MARS argument(s) {unknown}; valid ones are {list(MARS_ARGUMENTS)}.")
    use_mars = mars_args.pop("mars", None)
    if use_mars is None:
        # a generation config can switch MARS on too (`mars: true` in the request's generation_config, as
        # `transformers serve` builds it, or in a checkpoint's generation_config.json for a server-wide default);
        # its mars_threshold / mars_block_size defaults alone do not
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        use_mars = bool(mars_args) or getattr(gc, "mars", False) is True
    mask_id = _mask_token_id(model, required=bool(use_mars))
    if mask_id is not None:
        _with_mask_suppressed(model, kwargs, mask_id)
    base_generate = type(model).generate
    if not use_mars:
        return base_generate(model, **kwargs)

    synced_gpus = kwargs.pop("synced_gpus", None)  # transformers would not hand it to a callable: bind it
    custom = kwargs.pop("custom_generate", None)
    if custom is not None and getattr(custom, "__name__", None) != "mars_generate":
        asked = ", ".join(f"{k}={v!r}" for k, v in mars_args.items()) or "mars=True"
        raise ValueError(
            f"generate(custom_generate={getattr(custom, '__name__', custom)!r}) was combined with MARS decoding "
            f"({asked}): MARS runs its own decoding loop. Drop custom_generate, or drop the MARS arguments to run "
            "your custom_generate."
        )
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            "MARS decoding cannot be combined with assisted generation (assistant_model / prompt_lookup_num_tokens): "
            "MARS already drafts its own tokens. For lossless self-speculative decoding use mars_verify=True."
        )
    if (kwargs.get("num_beams") or 1) > 1:
        raise ValueError(f"MARS decoding cannot be combined with beam search (num_beams={kwargs['num_beams']}).")
    streamer = kwargs.pop("streamer", None)
    if streamer is not None:
        mars_args["mars_streamer"] = streamer
    # transformers drops `tokenizer` for callable custom_generate, so it cannot build StopStringCriteria itself
    gc = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(gc, "stop_strings", None))
    if stop_strings:
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError(
                "There are stop strings, but no tokenizer: pass `tokenizer=` to generate together with `stop_strings`."
            )
        criteria = _sc.StoppingCriteriaList(list(kwargs.get("stopping_criteria") or []))
        criteria.append(_sc.StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
        kwargs["stop_strings"] = None
    loop = mars_generate if synced_gpus is None else functools.partial(mars_generate, synced_gpus=bool(synced_gpus))
    return base_generate(model, custom_generate=loop, **mars_args, **kwargs)


def generate(*args, model, **kwargs):
    """Entry point when this file is a checkpoint's ``custom_generate/generate.py``.

    transformers calls it as ``generate(*args, model=model, **kwargs)``. It is the ordinary ``generate``
    (with the mask token suppressed) unless ``mars=True`` or a ``mars_*`` argument asks for MARS decoding.
    """
    return _route_generate(model, *args, **kwargs)


def enable_mars(model):
    """Make ``model.generate(..., mars=True, mars_threshold=0.9)`` run MARS decoding. Idempotent.

    Without MARS arguments ``generate`` is unchanged except that the mask token is never emitted.
    Returns the model.
    """
    current = getattr(model, "generate", None)
    if getattr(model, "_hf_mars_enabled", False) and isinstance(current, functools.partial):
        return model
    model.generate = functools.partial(generate, model=model)
    model._hf_mars_enabled = True
    return model


__all__ = ["mars_generate", "enable_mars", "generate", "reference_decode", "MARSGenerateOutput", "MARS_ARGUMENTS"]
