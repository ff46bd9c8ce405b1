"""`MARSGenerationConfig`: the one place the ``mars_*`` options, their defaults and their checks live.

Also the owner of the checkpoint's MARS metadata (``model.config.mars``: the mask token id, the trained block
size, the training steps) and of the tau / B rules the trainer, the hub code and the server reuse. This module
ships inside checkpoints (``custom_generate/``): it imports only torch, transformers and the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses

from transformers.utils import logging as _hf_logging

from .draft_vocab import parse_draft_vocab

_logger = _hf_logging.get_logger(__name__)

DEFAULT_THRESHOLD = 0.95  # the paper's multi-token setting (1.0 = one token per forward = AR greedy)
DEFAULT_VERIFY_THRESHOLD = 0.3  # verify mode: drafts kept while their probability is >= this (output unaffected)
DEFAULT_BLOCK_SIZE = 4  # the paper's default block size
DEFAULT_CACHE_BLOCK = 16  # block-cache chunk; the paper's best is 16-32
ACCEPTANCE_MODES = ("probability", "entropy", "margin")
CACHE_MODES = ("sliding", "block", "block_trained")
DRAFT_TREE_MODES = ("auto", "chain", "tree", "cost")  # besides a shape "k1,k2,...": see `parse_draft_tree`
BOOL_FIELDS = ("verify", "use_last_mask", "compile_prefill", "guard_every_step", "plain_steps")


def _fields(cls) -> tuple:
    """(name, default) of each field of the dataclass ``cls``, in order."""
    return tuple((f.name, f.default) for f in dataclasses.fields(cls))


def _argument_names(cls) -> tuple:
    return tuple("mars_" + name for name, _ in _fields(cls))


def _field(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass
class MARSGenerationConfig:
    """How MARS decodes: one field per ``mars_*`` argument of ``generate`` (``mars_threshold`` is ``threshold``).

    ``None`` means "not given": `resolve` fills it from the generation config's ``mars_*`` field, then the
    checkpoint's ``config.mars``, then the built-in default. Built directly, ``None`` fields take the built-in
    defaults. Every field is checked in ``__post_init__``, so a config that exists is a valid one.

    Pass one to ``generate(..., mars_config=MARSGenerationConfig(threshold=0.9))``; ``mars_*`` arguments given
    beside it override its fields.
    """

    threshold: float | None = _field(None, (
        "tau in [0, 1]. Threshold mode: after the AR token, mask candidates are accepted left to right while their "
        f"confidence is >= tau (default {DEFAULT_THRESHOLD}; 1.0 = one token per forward, exactly greedy AR). "
        f"Verify mode: drafts are kept while confident (default {DEFAULT_VERIFY_THRESHOLD}); the output never "
        "depends on it."))
    block_size: int | None = _field(None, (
        "B, mask tokens appended per step (candidates: the AR token + B - 1 masks). Default: the block size the "
        f"checkpoint was trained with (config.mars['block_size']), else {DEFAULT_BLOCK_SIZE}."))
    acceptance: str = _field("probability", (
        f"Confidence rule, one of {ACCEPTANCE_MODES}: the chosen token's probability, exp(-entropy) (>= tau means "
        "entropy <= -ln tau nats) or the top-1 minus top-2 margin; all on the processed distribution."))
    max_accept: int | None = _field(None, "Cap on tokens accepted per forward (None: no cap).")
    cache: str = _field("sliding", (
        f"KV-cache mode, one of {CACHE_MODES}: 'sliding' (masks are cropped after every step; rows never wait), "
        "'block' (the paper's block-level cache: chunks of cache_block positions over a frozen prefix) or "
        "'block_trained' (the same chunks, fed as [accepted | B masks])."))
    cache_block: int = _field(DEFAULT_CACHE_BLOCK, "Block-cache chunk length (the paper's best is 16-32).")
    verify: bool = _field(False, (
        "Lossless self-speculative mode: the masks' predictions are drafts that the next forward verifies; the "
        "output equals plain greedy decoding (plain sampling in distribution). Needs cache='sliding'."))
    use_last_mask: bool | None = _field(None, (
        "Read the last mask's prediction too (B + 1 candidates). Default: on in verify mode (a wrong draft only "
        "costs its rejection), off in threshold mode (it costs accuracy there)."))
    draft_tree: str | None = _field(None, (
        "Verify mode's drafts: 'auto' (default: where the call allows a tree, the tree, the chain or plain "
        "one-token steps, whichever this process measured fastest for the model and batch size; else the chain), "
        "'chain' (one draft per depth, new drafts only after all were accepted), 'tree' (one draft per depth and "
        "masks after every likely end, every call), 'cost' (drafts sized per step: each row's "
        "layout (tree depth, branching, mask groups, or a plain 1-token step) chosen for the most expected tokens "
        "per second from the masks' probabilities and the measured cost of a step's width; the choice depends on "
        "timing, so it is opt-in) or a tree shape 'k1,k2,...' (depth d offers its mask's top-k_d tokens; masks "
        "after every node, so the next drafts are ready whichever path is accepted). The output never depends on "
        "it: every layout decodes exactly what plain greedy decodes."))
    draft_vocab: tuple | None = _field(None, (
        "Verify mode only: token ids (a list, tuple or 1-D tensor) that mask columns may draft; those columns get "
        "logits over these ids alone, every other column the full vocabulary. The output never depends on it (each "
        "draft is checked against a full-vocabulary column); it removes most of the LM head's cost at the masks on "
        "a large vocabulary. Runs eager decode steps (refused with a compiled static cache). See draft_vocab.py."))
    compile_prefill: bool = _field(False, (
        "Where decode steps are compiled (a static cache with a compile config), compile the prefill too: the "
        "[prompt | masks] forward is padded at the end with masks to the next power of two (at most the cache's "
        "length), so any prompt runs one of a few graphs; each new width compiles once. Worth it where per-call "
        "overhead dominates (short prompts, small models, CPU); padding costs up to twice the prefill's compute "
        "where the prefill is compute-bound. Without compiled decode steps it has no effect."))
    guard_every_step: bool = _field(False, (
        "Where decode steps are compiled: evaluate torch.compile's guards in full before every step, as plain "
        "generate does. By default they are evaluated in full on a generation's first step of each input layout; "
        "later steps check only the tensor guards and those that tell the call's graphs apart (torch's "
        "skip_guard_eval_unsafe stance, process-wide: used only while every other Python thread is a daemon), "
        "which saves 0.3-0.5 ms per step on CPU. Set it if code run between steps (a streamer, a logits "
        "processor) changes the model, or a daemon thread runs compiled code while generate runs."))
    plain_steps: bool = _field(True, (
        "Threshold mode (sliding cache, eager steps): take plain 1-token steps while the masks do not pay: per "
        "generate call (drafting or plain calls, whichever this process measured faster for the model and batch "
        "size) and, in a drafting call, per step, from the measured cost of a step by width and the tokens the wide "
        "steps accepted. Tau is untouched: a plain step emits greedy's token, so it only shortens a run of accepted "
        "masks, and threshold mode never runs below plain decoding's speed for long. Which steps drop their masks "
        "depends on the measured timing, so two runs of a tau < 1 call can differ; set False for run-to-run "
        "identical tau < 1 output (the masks on every step). Verify mode (lossless) chooses its layouts with "
        "draft_tree='auto'."))

    def __post_init__(self):
        # the fields set to something other than their default: what a `mars_config=` passed to generate imposes
        self._explicit = frozenset(name for name, default in _fields(type(self)) if getattr(self, name) != default)
        self._from_call = self._explicit
        if self.use_last_mask is None:
            self.use_last_mask = self.verify is True
        if self.threshold is None:
            self.threshold = DEFAULT_VERIFY_THRESHOLD if self.verify is True else DEFAULT_THRESHOLD
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE
        self.threshold = check_threshold(self.threshold)
        check_block_size(self.block_size)
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"mars_acceptance must be one of {ACCEPTANCE_MODES}, got {self.acceptance!r}.")
        m = self.max_accept
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"mars_max_accept must be None or an int >= 1, got {m!r}.")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"mars_cache must be one of {CACHE_MODES}, got {self.cache!r}.")
        c = self.cache_block
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"mars_cache_block must be an int >= 1 (the paper's best is 16-32), got {c!r}.")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"mars_{name} must be True or False, got {getattr(self, name)!r}.")
        # (a tree's depth is checked for verify calls only: threshold mode drafts no tree, and a checkpoint's saved
        # verify tree may use the last mask, one deeper than a threshold call's masks)
        self.draft_tree = parse_draft_tree(self.draft_tree, self.block_size + self.use_last_mask - 1 if self.verify
                                           else None)
        self.draft_vocab = parse_draft_vocab(self.draft_vocab)
        if self.verify and self.cache != "sliding":
            raise ValueError(
                "mars_verify=True keeps its own sliding cache (rejected drafts are masked out in place); "
                f"it cannot be combined with mars_cache={self.cache!r}. Use mars_cache='sliding'.")

    @classmethod
    def argument_names(cls) -> tuple:
        """The ``generate`` arguments, ``mars_<field>``, in field order."""
        return _argument_names(cls)

    @classmethod
    def resolve(cls, model, generation_config=None, base: MARSGenerationConfig | None = None, **given):
        """This call's options. Per field: the ``mars_*`` argument > ``base`` (a ``mars_config=``) > the
        generation config's ``mars_*`` > ``config.mars`` (block size) > the built-in default. In verify mode tau
        comes only from the call: a generation config's ``mars_threshold`` is the threshold-mode knob."""
        if base is not None and not isinstance(base, cls):
            raise ValueError(f"mars_config must be a MARSGenerationConfig, got {type(base).__name__}.")
        meta = read_mars_metadata(getattr(model, "config", None))
        saved = getattr(generation_config, "__dict__", {})  # (its mars_* values are extra attributes: no lookups)
        values, from_call = {}, set()
        for (name, _), argument in zip(_fields(cls), _argument_names(cls)):
            value = given.get(argument)
            if value is None and base is not None and name in base._explicit:
                value = getattr(base, name)
            if value is not None:
                from_call.add(name)
            if value is None and name != "threshold":
                value = saved.get(argument)
            if value is not None:
                values[name] = value
        if "threshold" not in values and values.get("verify") is not True:
            values["threshold"] = saved.get("mars_threshold")
        if values.get("block_size") is None:
            values["block_size"] = meta.get("block_size") or DEFAULT_BLOCK_SIZE
        config = _build(cls, tuple(values.items()), frozenset(from_call))
        config.warn_about(meta)
        return config

    @classmethod
    def add_arguments(cls, parser, names) -> None:
        """Command-line flags ``--mars-<field>`` for the fields ``names`` (their help, type and choices come from
        here, so a command never respells them); an unset flag is None, so `resolve`'s defaults apply."""
        choices = {"acceptance": ACCEPTANCE_MODES, "cache": CACHE_MODES}
        types = {"threshold": float, "block_size": int, "max_accept": int, "cache_block": int}
        for f in dataclasses.fields(cls):
            if f.name not in names:
                continue
            flag = "--mars-" + f.name.replace("_", "-")
            text = f.metadata["help"]
            if f.name in BOOL_FIELDS:
                parser.add_argument(flag, default=None, action=argparse.BooleanOptionalAction, help=text)
            else:
                parser.add_argument(flag, default=None, type=types.get(f.name, str), choices=choices.get(f.name),
                                    help=text)

    @classmethod
    def from_arguments(cls, args, names) -> dict:
        """The ``mars_*`` generate arguments a command's flags set (see `add_arguments`)."""
        return {"mars_" + n: getattr(args, "mars_" + n) for n in names if getattr(args, "mars_" + n, None) is not None}

    def warn_about(self, meta: dict) -> None:
        """Warnings for options that decode poorly on this checkpoint (they stay allowed)."""
        if not meta.get("trained_steps"):
            _logger.warning_once(
                "This model's mask token was never MARS-trained (config.mars has no `trained_steps`): MARS decoding "
                "will accept poor guesses (verify mode stays exact but slow). Fine-tune with hf_mars.MARSTrainer.")
        trained = meta.get("block_size")
        if isinstance(trained, int) and self.block_size > trained:
            _logger.warning_once(
                f"mars_block_size={self.block_size} is larger than the block size this model was trained with "
                f"({trained}): masks beyond the trained distance predict poorly. Use mars_block_size <= {trained}.")


def _build(cls, items: tuple, from_call: frozenset):
    config = cls(**dict(items))
    config._from_call = from_call  # what this call asked for (not a saved default)
    if "draft_tree" in from_call and config.draft_tree != "auto" and not config.verify:
        raise ValueError(f"mars_draft_tree={config.draft_tree!r} shapes verify mode's drafts; pass "
                         "mars_verify=True with it (threshold mode accepts mask predictions without drafts).")
    if config.draft_vocab is not None and not config.verify:
        if "draft_vocab" in from_call:
            raise ValueError("mars_draft_vocab restricts verify mode's drafts; pass mars_verify=True with it "
                             "(threshold mode emits mask predictions, so a smaller vocabulary would change them).")
        config.draft_vocab = None  # a saved default of verify mode, not this threshold-mode call's
    return config


def parse_draft_tree(value, max_depth: int | None = None):
    """A draft-tree option in its one form: 'auto', 'chain', 'tree', 'cost' or a shape string 'k1,k2,...' (from a string, a list
    or a tuple of ints >= 1, at most ``max_depth`` deep: mask d predicts depth d, and there are B - 1 masks, B with
    the last one)."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value.strip().lower() in DRAFT_TREE_MODES:
        return value.strip().lower()
    parts = value.split(",") if isinstance(value, str) else value
    try:
        shape = tuple(int(p) if isinstance(p, str) else p for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if not shape or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in shape):
        raise ValueError(f"mars_draft_tree must be 'auto', 'chain', 'tree', 'cost' or a shape like '2,1,1' (top-k per depth, "
                         f"ints >= 1), got {value!r}.")
    if max_depth is not None and len(shape) > max_depth:
        raise ValueError(f"mars_draft_tree {value!r} is {len(shape)} deep, but this call has {max_depth} draft "
                         f"masks (B - 1, or B with the last mask): give at most {max_depth} depths.")
    return ",".join(map(str, shape))


MARS_ARGUMENTS = ("mars", "mars_config") + MARSGenerationConfig.argument_names() + ("mars_streamer",)


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


def mask_token_id(model, required: bool = True) -> int | None:
    """The mask token id recorded in ``model.config.mars`` (the MARS metadata contract)."""
    mask_id = read_mars_metadata(getattr(model, "config", None)).get("mask_token_id")
    if mask_id is None:
        if not required:
            return None
        raise ValueError(
            "MARS decoding needs a mask token, but model.config.mars['mask_token_id'] is not set: this model was "
            "never prepared for MARS. Add the mask token with `hf_mars.add_mask_token(model, tokenizer)` and fine-tune "
            "with `hf_mars.MARSTrainer` (an untrained mask token predicts nothing useful), or load a MARS checkpoint.")
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
        raise ValueError(f"model.config.mars['mask_token_id'] must be a non-negative int, got {mask_id!r}.")
    return mask_id
