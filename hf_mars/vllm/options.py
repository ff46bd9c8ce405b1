"""The ``{"method": "mars"}`` speculative setting: validated, checked against the checkpoint, and turned into the
vLLM setting that runs it. Pure Python (no vLLM import), so it is testable and importable anywhere.

vLLM's ``SpeculativeConfig.method`` is a closed ``Literal``; "mars" runs as its ``custom_class`` method with our
proposer and ``num_speculative_tokens = 2B`` (B pending drafts, then B mask tokens: see ``proposer.py``). The
translation happens before vLLM validates the setting, so a user writes only ``{"method": "mars"}``.
"""

from __future__ import annotations

METHOD = "mars"
PROPOSER = "hf_mars.vllm.proposer.MarsProposer"
OPTIONS = ("block_size", "batch_ladder")  # what a user may set next to the method; the rest comes from config.mars


def speculative_config(**options) -> dict:
    """The ``speculative_config`` for ``vllm.LLM`` / ``--speculative-config``: ``{"method": "mars", **options}``.

    ``block_size``: how many mask tokens (and so drafts) per step, at most the trained block size (the
    default). ``batch_ladder``: ``"BATCH:B,..."``, the block size by the number of requests in a step's batch,
    e.g. ``"1:4,16:2,48:0"`` (B = 0: plain steps, no masks); it runs on vLLM's dynamic speculative decoding
    (``num_speculative_tokens_per_batch_size``). Unknown options are refused here rather than deep inside engine
    start-up."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"hf_mars.vllm.speculative_config: unknown option(s) {unknown}; MARS takes only "
                         f"{list(OPTIONS)} (B and the mask token come from the checkpoint's config.mars).")
    if "block_size" in options:
        _check_block_size(options["block_size"])
    if "batch_ladder" in options:
        parse_batch_ladder(options["batch_ladder"])
    return {"method": METHOD, **options}


def parse_batch_ladder(spec) -> list[tuple[int, int]]:
    """``"1:4,16:2,48:0"`` -> [(1, 4), (16, 2), (48, 0)]: from a batch of 1 request B = 4, from 16 B = 2, from 48
    plain steps. Why by batch size: a MARS step feeds 2B + 1 positions per request; at large batches a forward is
    compute-bound and those extra positions cost more than the accepted drafts save."""
    rungs = []
    for part in str(spec).split(","):
        batch, sep, block = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            rungs.append((int(batch), int(block)))
        except ValueError:
            raise ValueError(f"batch_ladder: {part.strip()!r} is not BATCH:B (e.g. '1:4,16:2,48:0')") from None
    batches = [b for b, _ in rungs]
    if batches[0] != 1 or batches != sorted(set(batches)):
        raise ValueError(f"batch_ladder: batch sizes must start at 1 and increase strictly, got {batches}")
    if any(block < 0 for _, block in rungs):
        raise ValueError(f"batch_ladder: block sizes must be >= 0, got {[b for _, b in rungs]}")
    return rungs


def is_mars(spec) -> bool:
    return isinstance(spec, dict) and spec.get("method") == METHOD


def _check_block_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MARS block_size must be an int >= 1 (e.g. the trained 4), got {value!r}.")
    return value


def checkpoint_facts(hf_config) -> tuple[int, int]:
    """(mask token id, trained block size) from ``config.mars``, refusing what MARS-in-vLLM cannot serve exactly.

    Refused: no ``config.mars`` (a plain checkpoint: its masks predict nothing), a mask id outside the vocabulary
    or equal to EOS/pad, and attention other than full causal everywhere (a sliding window would see different
    context at the mask positions than training did)."""
    meta = getattr(hf_config, "mars", None)
    if not isinstance(meta, dict) or meta.get("mask_token_id") is None:
        raise ValueError(
            "speculative method 'mars' needs a MARS checkpoint: this model's config.json has no 'mars' entry with a "
            "mask_token_id. Fine-tune it with hf_mars.MARSTrainer (hf_mars.add_mask_token first), or serve it "
            "without speculative_config.")
    mask_id, block = meta["mask_token_id"], meta.get("block_size", 4)
    vocab = getattr(hf_config, "vocab_size", None)
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0 or (vocab and mask_id >= vocab):
        raise ValueError(f"config.mars['mask_token_id'] = {mask_id!r} is not a token of this model's "
                         f"vocabulary (size {vocab}).")
    specials = {name: getattr(hf_config, name, None) for name in ("eos_token_id", "pad_token_id", "bos_token_id")}
    for name, value in specials.items():
        if mask_id == value or (isinstance(value, list) and mask_id in value):
            raise ValueError(f"config.mars['mask_token_id'] = {mask_id} is also the model's {name}: not a MARS "
                             "mask token (MARS adds its own).")
    _check_layers(hf_config)
    return mask_id, _check_block_size(block)


def _check_layers(hf_config) -> None:
    layer_types = getattr(hf_config, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention"})
    sliding = getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None)
    if other or sliding:
        raise ValueError(f"speculative method 'mars' supports full-attention decoders only; this model has "
                         f"{other or ['sliding_window=' + str(hf_config.sliding_window)]} layers.")


def check_mask_token(tokenizer, hf_config) -> None:
    """The id in config.mars must be the checkpoint's own mask token (``config.mars['mask_token']``), not an id
    that happens to exist (e.g. a config copied onto another tokenizer)."""
    meta = hf_config.mars
    name = meta.get("mask_token")
    if name is None or tokenizer is None:
        return
    found = tokenizer.convert_tokens_to_ids(name)
    if found != meta["mask_token_id"]:
        raise ValueError(f"config.mars names mask token {name!r} with id {meta['mask_token_id']}, but the "
                         f"tokenizer maps {name!r} to {found}: not this checkpoint's MARS mask token.")


def to_vllm(spec: dict, hf_config) -> dict:
    """``{"method": "mars"[, "block_size": b]}`` -> the vLLM ``custom_class`` setting that runs it."""
    other = sorted(k for k in spec if k not in (("method",) + OPTIONS))
    if other:
        raise ValueError(f"speculative method 'mars' cannot be combined with other speculative settings {other}: "
                         f"the target model drafts for itself (B from config.mars, or {list(OPTIONS)}).")
    _, trained = checkpoint_facts(hf_config)
    block = _check_block_size(spec.get("block_size", trained))
    if block > trained:
        raise ValueError(f"MARS block_size={block} is larger than the trained block size {trained}: masks beyond "
                         "the trained distance predict poorly.")
    out = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 2 * block}
    if "batch_ladder" in spec:
        rungs = parse_batch_ladder(spec["batch_ladder"])
        if max(b for _, b in rungs) > block:
            raise ValueError(f"batch_ladder: a block size above block_size={block} (the trained or given one).")
        ends = [start - 1 for start, _ in rungs[1:]] + [1 << 20]
        out["num_speculative_tokens_per_batch_size"] = [(s, e, 2 * b) for (s, b), e in zip(rungs, ends)]
    return out
