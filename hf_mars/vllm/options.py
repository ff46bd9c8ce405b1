"""The ``{"method": "mars"}`` speculative setting: validated, checked against the checkpoint, and turned into the
vLLM setting that runs it. Pure Python (no vLLM import), so it is testable and importable anywhere.

A user writes ``{"method": "mars"}``, options under ``speculator_options``. Either way MARS schedules
``num_speculative_tokens = 2B`` per request (B pending drafts, then B mask tokens: see ``drafts.py``), from
``mars_settings``:

- vLLM 0.32-0.33: ``SpeculativeConfig.method`` is a closed ``Literal``, so "mars" runs as its ``custom_class``
  method with our proposer (``to_vllm``), translated before vLLM validates the setting (``_patches.py``). The
  options may also be given flat there (``{"method": "mars", "block_size": 2}``, the earlier form).
- vLLM >= 0.34: "mars" is a registered method and vLLM hands ``speculator_options`` to our ``SpeculatorConfig``
  (``speculator.py``); vLLM refuses unknown top-level keys, so the flat form fails there.
"""

from __future__ import annotations

METHOD = "mars"
PROPOSER = "hf_mars.vllm.proposer.MarsProposer"
OPTIONS = ("block_size", "batch_ladder", "tau_ladder")  # what a user may set next to the method; the rest: config.mars
OPTIONS_KEY = "speculator_options"  # vLLM's field for a registered method's own options (>= 0.34)
PLUGIN_CONFIG_KEY = "hf_mars"  # VllmConfig.additional_config[...]: engine-wide options vLLM has no field for
LOAD_FIELD = "hf_mars_load"  # set on a SchedulerOutput: the scheduler's running + waiting requests (the ladder's load)
REQUEST_ARGS = ("mars_threshold",)  # a request's own, in SamplingParams.extra_args (the OpenAI server: vllm_xargs)


def speculative_config(**options) -> dict:
    """The ``speculative_config`` for ``vllm.LLM`` / ``--speculative-config``: ``{"method": "mars"}``, with any
    options as ``{"speculator_options": {...}}``, the form every supported vLLM accepts.

    ``block_size``: how many mask tokens (and so drafts) per step, at most the trained block size (the
    default). ``batch_ladder``: ``"BATCH:B,..."``, the block size by the number of requests in a step's batch,
    e.g. ``"1:4,16:2,48:0"`` (B = 0: plain steps, no masks); it runs on vLLM's dynamic speculative decoding
    (``num_speculative_tokens_per_batch_size``). Without one, a ladder is derived from measured step costs when
    $HF_MARS_STEP_COSTS names an ``hf-mars bench`` report (`default_batch_ladder`). ``tau_ladder``:
    ``"LOAD:TAU,..."``, threshold mode by load for greedy requests without their own ``mars_threshold``, e.g.
    ``"0:1.0,8:0.95"`` (from 8 requests running or waiting, trust drafts whose mask was >= 95% sure; the default is
    lossless at every load: `trusted_drafts` says what a threshold does here). Unknown options are refused here
    rather than deep inside engine start-up."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"hf_mars.vllm.speculative_config: unknown option(s) {unknown}; MARS takes only "
                         f"{list(OPTIONS)} (B and the mask token come from the checkpoint's config.mars).")
    if "block_size" in options:
        _check_block_size(options["block_size"])
    if "batch_ladder" in options:
        parse_batch_ladder(options["batch_ladder"])
    if "tau_ladder" in options:
        parse_tau_ladder(options["tau_ladder"])
    return {"method": METHOD, OPTIONS_KEY: options} if options else {"method": METHOD}


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


def parse_tau_ladder(spec):
    """``"0:1.0,8:0.95"`` -> the `TauLadder` ``hf-mars serve --tau-ladder`` reads, here keyed on the scheduler's
    live load: its running plus waiting requests, which it writes on each step's output (``LOAD_FIELD``)."""
    from hf_mars.serve.ladder import TauLadder

    return TauLadder(spec, name="tau_ladder")


def engine_tau_ladder(vllm_config) -> str | None:
    """The engine's ``tau_ladder`` (None: none), where each path keeps it: 0.32-0.33 in
    ``additional_config["hf_mars"]`` (``plugin_config``), >= 0.34 in the registered method's ``speculator_options``.
    The scheduler's load wrapper and the workers read it here."""
    ours = (getattr(vllm_config, "additional_config", None) or {}).get(PLUGIN_CONFIG_KEY) or {}
    spec = getattr(vllm_config, "speculative_config", None)
    registered = (getattr(spec, OPTIONS_KEY, None) or {}) if spec is not None else {}
    return ours.get("tau_ladder") or (registered.get("tau_ladder") if isinstance(registered, dict) else None)


def plugin_config(options: dict) -> dict:
    """What the workers need beyond vLLM's speculative fields (``VllmConfig.additional_config["hf_mars"]``)."""
    return {"tau_ladder": str(parse_tau_ladder(options["tau_ladder"]))} if "tau_ladder" in options else {}


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


def request_threshold(extra_args, temperature: float) -> float | None:
    """A request's own ``mars_threshold`` (``SamplingParams.extra_args``; the OpenAI server's ``vllm_xargs``),
    validated: None when it has none. Refused, at admission (an HTTP 400 on the server): a value outside [0, 1],
    a misspelt ``mars_*`` key, and tau < 1 on a sampling request (threshold mode trusts the masks' top token, a
    greedy choice; a sampled request is verified by vLLM's rejection sampler, exactly as without MARS)."""
    from hf_mars.generation.config import check_threshold

    args = extra_args or {}
    unknown = sorted(k for k in args if str(k).startswith("mars_") and k not in REQUEST_ARGS)
    if unknown:
        raise ValueError(f"unknown MARS request argument(s) {unknown}; vLLM's MARS reads only {list(REQUEST_ARGS)}.")
    if "mars_threshold" not in args:
        return None
    tau = check_threshold(args["mars_threshold"])
    if tau < 1.0 and temperature >= GREEDY_BELOW:
        raise ValueError(f"mars_threshold={tau:g} needs temperature 0: threshold mode trusts the masks' greedy "
                         "choice; a sampled request is served losslessly (mars_threshold 1.0 or none).")
    return tau


SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}


def is_mars(spec) -> bool:
    return isinstance(spec, dict) and spec.get("method") == METHOD


def runs_mars(speculative_config) -> bool:
    """Whether an engine's speculative config runs MARS: our proposer as vLLM 0.32-0.33's ``custom_class``, or
    the method registered on vLLM >= 0.34."""
    if getattr(speculative_config, "custom_method", None) == METHOD:
        return True
    return getattr(speculative_config, "method", None) == "custom_class" \
        and getattr(speculative_config, "model", None) == PROPOSER


def _check_block_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MARS block_size must be an int >= 1 (e.g. the trained 4), got {value!r}.")
    return value


def checkpoint_facts(hf_config) -> tuple[int, int]:
    """(mask token id, trained block size) from ``config.mars``, refusing what MARS-in-vLLM cannot serve exactly.

    Refused: no ``config.mars`` (a plain checkpoint: its masks predict nothing), a mask id outside the vocabulary
    or equal to EOS/pad, and layers other than full or sliding-window attention."""
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
    """Full attention and sliding-window attention are served; anything else (linear attention, chunked
    attention, state-space layers) is refused. A sliding window is exact here: vLLM's window, like training's
    (``hf_mars.masking``), counts positions back from the query, and the masks' positions follow the drafts', so
    a mask sees the context it saw in training; verification is the target's own forward either way."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    other = sorted(set(layer_types) - SERVED_LAYER_TYPES)
    if other:
        raise ValueError(f"speculative method 'mars' supports full-attention and sliding-window decoders only; "
                         f"this model has {other} layers.")


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


def user_options(spec: dict) -> dict:
    """The MARS options of a ``{"method": "mars", ...}`` setting: ``speculator_options``, or flat keys (the
    0.32 form). Any other speculative setting is refused: the target drafts for itself, B from config.mars."""
    nested = spec.get(OPTIONS_KEY) or {}
    if not isinstance(nested, dict):
        raise ValueError(f"speculative method 'mars': {OPTIONS_KEY} must be a dict, got {nested!r}.")
    other = sorted(k for k in spec if k not in ("method", OPTIONS_KEY) + OPTIONS)
    if other:
        raise ValueError(f"speculative method 'mars' cannot be combined with other speculative settings {other}: "
                         f"the target model drafts for itself (B from config.mars, or {OPTIONS_KEY} "
                         f"{list(OPTIONS)}).")
    unknown = sorted(set(nested) - set(OPTIONS))
    if unknown:
        raise ValueError(f"speculative method 'mars': unknown {OPTIONS_KEY} {unknown}; MARS takes only "
                         f"{list(OPTIONS)}.")
    flat = {k: spec[k] for k in OPTIONS if k in spec}
    twice = sorted(set(flat) & set(nested))
    if twice:
        raise ValueError(f"speculative method 'mars': {twice} given both flat and in {OPTIONS_KEY}.")
    options = {**flat, **nested}
    if "tau_ladder" in options:
        parse_tau_ladder(options["tau_ladder"])  # a bad ladder fails here, at configuration, not in a worker
    return options


def mars_settings(options: dict, hf_config) -> dict:
    """What MARS sets in vLLM's speculative config, on every vLLM: ``num_speculative_tokens`` = 2B, and under
    ``batch_ladder`` vLLM's dynamic schedule ``num_speculative_tokens_per_batch_size`` (2B per rung)."""
    _, trained = checkpoint_facts(hf_config)
    block = _check_block_size(options.get("block_size", trained))
    if block > trained:
        raise ValueError(f"MARS block_size={block} is larger than the trained block size {trained}: masks beyond "
                         "the trained distance predict poorly.")
    out = {"num_speculative_tokens": 2 * block}
    if "batch_ladder" not in options:
        derived = default_batch_ladder(block)
        if derived:
            options = {**options, "batch_ladder": derived}
    if "batch_ladder" in options:
        rungs = parse_batch_ladder(options["batch_ladder"])
        if max(b for _, b in rungs) > block:
            raise ValueError(f"batch_ladder: a block size above block_size={block} (the trained or given one).")
        ends = [start - 1 for start, _ in rungs[1:]] + [1 << 20]
        out["num_speculative_tokens_per_batch_size"] = [(s, e, 2 * b) for (s, b), e in zip(rungs, ends)]
    return out


DEFAULT_PER_DEPTH = 0.6  # the drafts' pass rate per depth assumed when the report has no verify row to read it from


def default_batch_ladder(block: int, report=None) -> str | None:
    """The ladder a user did not give, from measured step costs: a ``hf-mars bench`` report (``report``, or the
    path in $HF_MARS_STEP_COSTS; None without one: every step then drafts B). At each batch size the report timed,
    the B with the most expected tokens per second for a 2B + 1 wide step (`ladder.batch_ladder`), the drafts'
    pass rate read from the report's best batch-1 verify row (tokens per forward)."""
    import json
    import os

    from hf_mars.generation.cost import STEP_COSTS_ENV, StepCosts, seed_from_bench
    from .ladder import batch_ladder, per_depth_from_tokens

    if report is None:
        path = os.environ.get(STEP_COSTS_ENV)
        if not path:
            return None
        with open(path) as f:
            report = json.load(f)
    costs = seed_from_bench(StepCosts(), report)
    per_depth = DEFAULT_PER_DEPTH
    verify = [r for r in report.get("rows", ()) if r.get("mode") == "verify" and r.get("batch_size") == 1
              and r.get("tokens_per_forward")]
    trained_block = report.get("settings", {}).get("block_size")
    if verify and trained_block:
        per_depth = per_depth_from_tokens(max(r["tokens_per_forward"] for r in verify), int(trained_block))
    rungs = batch_ladder(costs, block, per_depth)
    return ",".join(f"{b}:{k}" for b, k in rungs) if rungs else None


def to_vllm(spec: dict, hf_config) -> dict:
    """``{"method": "mars"[, options]}`` -> the vLLM 0.32-0.33 ``custom_class`` setting that runs it."""
    return {"method": "custom_class", "model": PROPOSER, **mars_settings(user_options(spec), hf_config)}


def check_tokenizer(model_config) -> None:
    """``check_mask_token`` on the tokenizer vLLM will load; one that cannot be read here is left to vLLM's own
    loading (which reports it better)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer,
                                                  trust_remote_code=model_config.trust_remote_code)
    except Exception:  # noqa: BLE001 - vLLM reports an unreadable tokenizer itself
        return
    check_mask_token(tokenizer, model_config.hf_config)
