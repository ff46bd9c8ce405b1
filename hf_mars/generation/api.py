"""Three ways into MARS decoding, one loop (`decoder.MARSDecoder`):

- ``model.generate(..., custom_generate=mars_generate, mars_threshold=0.9)``: transformers prepares everything
  (generation config, logits processors, stopping criteria, cache, attention mask) and hands the loop to
  `mars_generate`.
- ``enable_mars(model)``; then ``model.generate(..., mars=True, mars_threshold=0.9)``. Any ``mars_*`` argument
  implies ``mars=True``; without them ``generate`` is the ordinary one. The mask token is suppressed in both.
- `generate(*args, model, **kwargs)`: the entry point transformers calls when this package is a checkpoint's
  ``custom_generate/`` (``from_pretrained(..., trust_remote_code=True)`` or ``generate(custom_generate=dir)``);
  it behaves like ``enable_mars``'d generate.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import logging
import os
import warnings

import torch
from transformers import GenerationMixin
from transformers.generation import stopping_criteria as _sc
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import check_rollback
from .config import MARS_ARGUMENTS, MARSGenerationConfig, mask_token_id
from .decoder import MARSDecoder
from .model_calls import LOOP_KWARGS, cache_key
from .tree import TreeDecoder

#: One DEBUG record per MARS call (emitted tokens and forwards per row, tau, verify) on a fixed name, whether this
#: package runs installed or as a checkpoint's custom_generate/: what a server that never sees the output object
#: (``transformers serve``, lm-evaluation-harness) can still report. Off unless the logger is set to DEBUG.
STATS_LOGGER = logging.getLogger("hf_mars.generation.stats")


@functools.lru_cache(maxsize=None)
def _stats_file_removed() -> None:
    warnings.warn("HF_MARS_STATS is no longer read: MARS's per-call statistics are DEBUG records on the "
                  "'hf_mars.generation.stats' logger (and mars_forward_passes / mars_emitted_tokens on the output "
                  "object).", FutureWarning, stacklevel=3)


@dataclasses.dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus MARS statistics, one entry per row.

    ``scores`` / ``logits`` hold one tensor per emitted token position (like AR decoding); after a row finished,
    its entries are certain of the pad token (0 there, ``-inf`` elsewhere), so ``compute_transition_scores`` gives
    0, not NaN. ``mars_forward_passes``: forwards a row took part in until it finished; ``mars_emitted_tokens``:
    tokens it emitted. Their ratio is tokens per forward.
    """

    mars_forward_passes: torch.LongTensor | None = None
    mars_emitted_tokens: torch.LongTensor | None = None


_ASSISTED = ("MARS decoding cannot be combined with assisted generation (assistant_model / prompt_lookup_num_tokens): "
             "MARS already drafts its own tokens. For lossless self-speculative decoding use mars_verify=True.")


def check_supported(model, generation_config, model_kwargs, input_ids) -> int:
    """Clear errors for what a MARS loop cannot do, before any forward. Returns the (checked) mask token id."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            "MARS decoding needs a prompt of at least one token per row; got input_ids of shape "
            f"{tuple(input_ids.shape)}. Start the prompt with BOS or the chat template's generation prompt.")
    gc = generation_config
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("MARS decoding supports decoder-only models only.")
    if (gc.num_beams or 1) > 1:
        raise ValueError(f"MARS decoding cannot be combined with beam search (num_beams={gc.num_beams}); use "
                         "num_beams=1 (greedy or sampling).")
    if gc.prompt_lookup_num_tokens:
        raise ValueError(_ASSISTED)
    if gc.use_cache is False:
        raise ValueError("MARS decoding needs the KV cache; do not pass use_cache=False.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("MARS decoding needs input_ids (it appends mask tokens); inputs_embeds are not supported.")
    if gc.output_attentions or gc.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not supported by MARS decoding (a forward "
                         "covers several tokens and masks); use output_scores / output_logits.")
    if getattr(gc, "prefill_chunk_size", None) is not None:
        raise ValueError("prefill_chunk_size is not supported by MARS decoding.")
    cache = model_kwargs.get(cache_key(model_kwargs))
    if cache is not None:
        check_rollback(model, cache)
        cached = int(cache.get_seq_length())
        if cached >= input_ids.shape[1]:
            raise ValueError(
                f"The cache passed in already holds {cached} positions and the prompt has "
                f"{input_ids.shape[1]}: MARS feeds the prompt's tokens past the cached ones, so a reused cache must "
                "hold fewer positions than the prompt (cache it without the prompt's last token).")
    for key, value in model_kwargs.items():
        if key not in LOOP_KWARGS and torch.is_tensor(value):
            raise ValueError(f"MARS decoding does not know how to extend the per-token model input {key!r} over "
                             "several tokens per step; it is not supported.")
    mask_id = mask_token_id(model)
    embeddings = model.get_output_embeddings()
    vocab = embeddings.weight.shape[0] if embeddings is not None else getattr(model.config.get_text_config(),
                                                                              "vocab_size", None)
    if vocab is not None and mask_id >= vocab:
        raise ValueError(f"mask_token_id {mask_id} is outside the model's vocabulary ({vocab}); resize the "
                         "embeddings (hf_mars.add_mask_token does it).")
    return mask_id


_DISTRIBUTED = torch.distributed.is_available()


def _sharded_across_ranks(model) -> bool:
    """True when generation must step in lockstep across ranks (DeepSpeed ZeRO-3 or FSDP, world size > 1):
    what transformers' `generate` infers for `synced_gpus`, which it does not pass to a callable custom_generate."""
    if not (_DISTRIBUTED and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def mars_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                  synced_gpus=None, streamer=None, mars=True, mars_config=None, mars_streamer=None, **model_kwargs):
    """The MARS decoding loop, for ``model.generate(..., custom_generate=mars_generate, mars_threshold=...)``.

    transformers has already built the generation config, logits processors, stopping criteria, attention mask
    and cache; this runs the loop. The options are `MARSGenerationConfig`'s fields, as ``mars_<field>`` arguments
    (None: generation_config.mars_<field>, then the default) or a whole ``mars_config=MARSGenerationConfig(...)``.
    ``mars_streamer``: transformers hands a callable custom_generate neither ``streamer=`` nor ``tokenizer=`` (nor
    assistant_model / synced_gpus), so on that route pass ``mars_streamer=``; `enable_mars` and a checkpoint's
    custom_generate route ``streamer=`` here themselves. tau = 1 accepts exactly the AR token each step.
    """
    if not mars:
        raise ValueError(
            "mars_generate runs MARS decoding; for plain decoding call generate without custom_generate=mars_generate "
            "(or, after enable_mars, without mars arguments).")
    # parameters sharded across ranks (ZeRO-3 / FSDP): every rank must forward in lockstep until all are done.
    # transformers does not hand a callable its synced_gpus, so infer it as transformers does
    synced = _sharded_across_ranks(model) if synced_gpus is None else bool(synced_gpus)
    if synced and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("synced_gpus=True needs an initialised torch.distributed process group.")
    if mars_streamer is not None:
        streamer = mars_streamer
    decoder = start_decoder(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            mars_config, model_kwargs)
    opts = decoder.opts
    sequences = decoder.run(synced=synced)
    if streamer is not None:
        streamer.end()
    if "HF_MARS_STATS" in os.environ:
        _stats_file_removed()
    if STATS_LOGGER.isEnabledFor(logging.DEBUG):  # for a serving stack that cannot read the output object
        STATS_LOGGER.debug("MARS call: %s", json.dumps(
            {"emitted_tokens": decoder.rows.emitted, "forward_passes": decoder.rows.forwards,
             "threshold": opts.threshold, "verify": opts.verify}))
    if not generation_config.return_dict_in_generate:
        return sequences
    # the cache is returned only when it has no masked-out columns (it can then be reused as is)
    clean_cache = decoder.cache.cache if decoder.cache.attn is None and decoder.prompt.attn is None else None
    fields = MARSGenerateOutput.__dataclass_fields__
    return MARSGenerateOutput(
        sequences=sequences,
        scores=decoder.assemble(0) if decoder.outputs.scores else None,
        logits=decoder.assemble(1) if decoder.outputs.logits else None,
        mars_forward_passes=torch.tensor(decoder.rows.forwards, dtype=torch.long, device=decoder.device),
        mars_emitted_tokens=torch.tensor(decoder.rows.emitted, dtype=torch.long, device=decoder.device),
        **{("cache" if "cache" in fields else "past_key_values"): clean_cache},
    )


_OPTION_ARGUMENTS = frozenset(MARSGenerationConfig.argument_names())


def start_decoder(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, mars_config,
                  model_kwargs) -> MARSDecoder:
    """Check the call, resolve its options (the ``mars_*`` arguments are popped from ``model_kwargs``) and set up
    its decoder; the streamer gets the prompt first, as generate hands it."""
    given = {k: model_kwargs.pop(k) for k in _OPTION_ARGUMENTS.intersection(model_kwargs)}
    mask_id = check_supported(model, generation_config, model_kwargs, input_ids)
    opts = MARSGenerationConfig.resolve(model, generation_config, base=mars_config, **given)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    decoder = TreeDecoder if opts.verify else MARSDecoder  # (a tree decoder falls back to the chain by itself)
    return decoder(model, input_ids, logits_processor, stopping_criteria, generation_config, opts, streamer,
                   model_kwargs, mask_id)


def _with_option_parameters(func):
    """Give `mars_generate` one keyword parameter per `MARSGenerationConfig` field in its signature: transformers
    hands a callable custom_generate only the arguments its signature names (the rest become model inputs)."""
    signature = inspect.signature(func)
    params = list(signature.parameters.values())
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in MARSGenerationConfig.argument_names()]
    func.__signature__ = signature.replace(parameters=params[:-1] + options + params[-1:])
    return func


_with_option_parameters(mars_generate)


# ------------------------------------------------------------------ generate() routing


_GENERATE_PARAMS = None


def _bind_generate_args(args, kwargs) -> dict:
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


def _split_mars_arguments(model, kwargs):
    """Pop the MARS arguments; returns (them, whether MARS decodes this call)."""
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
    return mars_args, bool(use_mars)


def _check_routable(kwargs, mars_args):
    """What cannot be combined with MARS decoding, said before generate prepares anything."""
    custom = kwargs.pop("custom_generate", None)
    if custom is not None and getattr(custom, "__name__", None) != "mars_generate":
        asked = ", ".join(f"{k}={v!r}" for k, v in mars_args.items()) or "mars=True"
        raise ValueError(
            f"generate(custom_generate={getattr(custom, '__name__', custom)!r}) was combined with MARS decoding "
            f"({asked}): MARS runs its own decoding loop. Drop custom_generate, or drop the MARS arguments to run "
            "your custom_generate.")
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(_ASSISTED)
    if (kwargs.get("num_beams") or 1) > 1:
        raise ValueError(f"MARS decoding cannot be combined with beam search (num_beams={kwargs['num_beams']}).")


def _stop_strings_as_criterion(model, kwargs):
    """transformers drops `tokenizer` for a callable custom_generate, so it cannot build StopStringCriteria
    itself: build it here."""
    gc = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(gc, "stop_strings", None))
    if not stop_strings:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError(
            "There are stop strings, but no tokenizer: pass `tokenizer=` to generate together with `stop_strings`.")
    criteria = _sc.StoppingCriteriaList(list(kwargs.get("stopping_criteria") or []))
    criteria.append(_sc.StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def route_generate(model, *args, **kwargs):
    """`generate` with MARS routing: MARS when asked (mars=True or any mars_* argument), plain otherwise."""
    kwargs = _bind_generate_args(args, kwargs)
    mars_args, use_mars = _split_mars_arguments(model, kwargs)
    mask_id = mask_token_id(model, required=use_mars)
    base_generate = type(model).generate
    if not use_mars:  # (the MARS loop suppresses the mask itself: no processor for transformers to build)
        if mask_id is not None:
            _with_mask_suppressed(model, kwargs, mask_id)
        return base_generate(model, **kwargs)
    synced_gpus = kwargs.pop("synced_gpus", None)  # transformers would not hand it to a callable: bind it
    _check_routable(kwargs, mars_args)
    streamer = kwargs.pop("streamer", None)
    if streamer is not None:
        mars_args["mars_streamer"] = streamer
    _stop_strings_as_criterion(model, kwargs)
    loop = mars_generate if synced_gpus is None else functools.partial(mars_generate, synced_gpus=bool(synced_gpus))
    return base_generate(model, custom_generate=loop, **mars_args, **kwargs)


def generate(*args, model, **kwargs):
    """Entry point when this package is a checkpoint's ``custom_generate/``.

    transformers calls it as ``generate(*args, model=model, **kwargs)``. It is the ordinary ``generate`` (with the
    mask token suppressed) unless ``mars=True`` or a ``mars_*`` argument asks for MARS decoding.
    """
    return route_generate(model, *args, **kwargs)


def enable_mars(model):
    """Make ``model.generate(..., mars=True, mars_threshold=0.9)`` run MARS decoding. Idempotent.

    Without MARS arguments ``generate`` is unchanged except that the mask token is never emitted. Returns the model.
    """
    current = getattr(model, "generate", None)
    if getattr(model, "_hf_mars_enabled", False) and isinstance(current, functools.partial):
        return model
    model.generate = functools.partial(generate, model=model)
    model._hf_mars_enabled = True
    return model
