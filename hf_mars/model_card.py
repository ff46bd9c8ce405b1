"""The MARS model card: metadata, usage snippets, MARS settings, training rows and the measured table.

Rendered from the one template, ``hf_mars/assets/model_cards/mars_model_card.md`` (packaged with the library), by
huggingface_hub's ``ModelCard.from_template`` and parsed back before it is written, so a broken template fails when
the card is made rather than on the Hub. The measured table comes from `hf_mars.bench.report.BenchmarkReport`, which
owns the report layouts; this module only places its rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CARD_TAGS = ["mars", "multi-token-prediction", "custom_generate"]
REPO_ID_PLACEHOLDER = "path/to/this/checkpoint"  # push_to_hub writes the repo id over it
CARD_FIELDS = (
    "model_name", "repo_id", "base_model", "datasets", "license", "language", "tags", "description",
    "benchmark", "example_prompt", "mars_threshold", "mars_block_size", "mars_draft_tree",
    "mars_draft_vocab",
)
_TRAINING_KEYS = [
    ("learning_rate", "learning rate"),
    ("lr_scheduler_type", "LR scheduler"),
    ("warmup_ratio", "warmup ratio"),
    ("warmup_steps", "warmup steps"),
    ("num_train_epochs", "epochs"),
    ("max_steps", "max steps"),
    ("per_device_train_batch_size", "batch size per device"),
    ("gradient_accumulation_steps", "gradient accumulation steps"),
    ("weight_decay", "weight decay"),
    ("optim", "optimizer"),
    ("max_grad_norm", "max grad norm"),
    ("max_length", "max sequence length"),
    ("packing", "packing"),
    ("assistant_only_loss", "assistant-only loss"),
    ("completion_only_loss", "completion-only loss"),
    ("gradient_checkpointing", "gradient checkpointing"),
    ("seed", "seed"),
]


def check_card_fields(card_fields: dict) -> None:
    """Refuse a misspelt model-card field before anything is written."""
    unknown = set(card_fields) - set(CARD_FIELDS)
    if unknown:
        raise ValueError(f"Unknown model-card field(s) {sorted(unknown)}; accepted: {', '.join(CARD_FIELDS)}.")


def benchmark_table(benchmark) -> dict:
    """The card's measured table from a report (dict, report.json path or BenchmarkReport); ValueError if malformed."""
    from hf_mars.bench.report import BenchmarkReport

    return BenchmarkReport.load(benchmark).card_table()


def template_path() -> Path:
    """The Jinja model-card template, packaged with the library."""
    path = Path(__file__).resolve().parent / "assets" / "model_cards" / "mars_model_card.md"
    if not path.is_file():
        raise FileNotFoundError(f"The MARS model-card template ({path}) is not installed; reinstall hf-mars.")
    return path


def _looks_like_repo_id(value) -> bool:
    if not isinstance(value, str) or value.count("/") != 1 or os.path.exists(value) or value.startswith((".", "/", "~")):
        return False
    from .hub import validate_repo_id  # (hub imports this module)

    try:
        validate_repo_id(value)
    except ValueError:
        return False
    return True


def _fmt(value) -> str:
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):  # enums
        value = value.value
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _training_rows(mars: dict, training_args=None, trainer_state: dict | None = None) -> list[tuple[str, str]]:
    """(name, value) rows for the card: MARS settings, then the usual optimisation hyperparameters."""
    if training_args is None:
        args = {}
    elif isinstance(training_args, dict):
        args = dict(training_args)
    elif hasattr(training_args, "to_dict"):
        args = training_args.to_dict()
    else:
        args = dict(vars(training_args))
    rows = []
    block_size = mars.get("block_size", args.get("block_size"))
    ar_weight = mars.get("ar_weight", args.get("ar_weight"))
    if block_size is not None:
        rows.append(("MARS block size B", _fmt(block_size)))
    if ar_weight is not None:
        rows.append(("AR loss weight α", _fmt(ar_weight)))
    for key in ("loss_normalization", "pad_to_block_multiple"):  # MARSConfig's own fields
        if args.get(key) is not None:
            rows.append(("MARS " + key.replace("_", " "), _fmt(args[key])))
    for key in sorted(k for k in args if k.startswith("mars_")):  # MARS fields named with a prefix
        if args[key] is not None and key not in ("mars_block_size", "mars_ar_weight"):
            rows.append((key.replace("_", " "), _fmt(args[key])))
    for key, name in _TRAINING_KEYS:
        value = args.get(key)
        if value is None or (key == "max_steps" and value <= 0) or (key == "warmup_steps" and value == 0):
            continue
        if key == "num_train_epochs" and (args.get("max_steps") or 0) > 0:  # max_steps overrides epochs
            continue
        rows.append((name, _fmt(value)))
    if "bf16" in args or "fp16" in args:
        rows.append(("precision", "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"))
    if trainer_state:
        if trainer_state.get("global_step"):
            rows.append(("optimizer steps done", _fmt(trainer_state["global_step"])))
        if trainer_state.get("epoch"):
            rows.append(("epochs done", f"{float(trainer_state['epoch']):.2f}"))
    return rows



def _versions() -> list[tuple[str, str]]:
    import importlib.metadata

    out = []
    for dist, label in (("hf-mars", "hf-mars"), ("transformers", "Transformers"), ("torch", "PyTorch"),
                        ("trl", "TRL"), ("tokenizers", "Tokenizers")):
        try:
            out.append((label, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _existing_card_data(directory: Path) -> dict:
    """Metadata of a README.md already in the folder (e.g. TRL's card), to keep base_model/datasets/license."""
    readme = directory / "README.md"
    if not readme.is_file():
        return {}
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # an unparsable card is replaced, not fatal
        return {}


def _as_list(value):
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)




def _card_data(directory: Path, config_dict: dict, model, card_fields: dict):
    """The card's YAML metadata: the given fields, else what a card already in the folder says (e.g. TRL's)."""
    from huggingface_hub import ModelCardData

    from .hub import validate_repo_id  # (hub imports this module)

    old = _existing_card_data(directory)
    base_model = card_fields.get("base_model") or old.get("base_model")
    if base_model is None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or config_dict.get("_name_or_path")
        base_model = name if _looks_like_repo_id(name) else None
    tags = []
    for tag in CARD_TAGS + (_as_list(card_fields.get("tags")) or []) + (_as_list(old.get("tags")) or []):
        if tag not in tags:
            tags.append(tag)
    repo_id = card_fields.get("repo_id")
    if repo_id is not None:
        validate_repo_id(repo_id)
    model_name = card_fields.get("model_name") or (repo_id.split("/")[-1] if repo_id else None) or directory.resolve().name
    return ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=base_model,
        datasets=_as_list(card_fields.get("datasets") or old.get("datasets")),
        license=card_fields.get("license") or old.get("license"),
        language=card_fields.get("language") or old.get("language"),
        tags=tags,
        model_name=model_name,
        ignore_metadata_errors=False,
    )


def _has_chat_template(directory: Path, tokenizer) -> bool:
    if tokenizer is not None:
        return bool(getattr(tokenizer, "chat_template", None))
    config = directory / "tokenizer_config.json"
    return (directory / "chat_template.jinja").is_file() or bool(
        config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"))


def build_model_card(directory, mars: dict, config_dict: dict, threshold: float, block_size: int,
                     model=None, tokenizer=None, training_args=None, **card_fields):
    """Render the MARS model card (a huggingface_hub ModelCard) and check that it parses back."""
    from huggingface_hub import ModelCard

    import hf_mars

    directory = Path(directory)
    check_card_fields(card_fields)
    card_data = _card_data(directory, config_dict, model, card_fields)
    state_file = directory / "trainer_state.json"
    trainer_state = json.loads(state_file.read_text(encoding="utf-8")) if state_file.is_file() else None
    benchmark = card_fields.get("benchmark")
    gen_file = directory / "generation_config.json"  # (verify mode's saved draft defaults, when any)
    generation = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else {}
    card = ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=card_data.model_name,
        repo_id=card_fields.get("repo_id") or REPO_ID_PLACEHOLDER,
        base_model=card_data.base_model,
        datasets=card_data.datasets,
        description=card_fields.get("description"),
        architecture=(config_dict.get("architectures") or ["AutoModelForCausalLM"])[0],
        mars={"block_size": mars.get("block_size"), "ar_weight": mars.get("ar_weight"),
              "mask_token": mars.get("mask_token"), "mask_token_id": mars.get("mask_token_id")},
        threshold=_fmt(threshold),
        decode_block_size=block_size,
        draft_tree=generation.get("mars_draft_tree"),
        draft_vocab_size=len(generation.get("mars_draft_vocab") or ()),
        chat=_has_chat_template(directory, tokenizer),
        # a Python string literal (quotes, newlines escaped) for the usage snippets
        example_prompt=json.dumps(card_fields.get("example_prompt") or "What is 12 * 7?", ensure_ascii=False),
        benchmark=benchmark_table(benchmark) if benchmark is not None else None,
        training=_training_rows(mars, training_args, trainer_state),
        versions=_versions(),
        hf_mars_version=hf_mars.__version__,
    )
    parsed = ModelCard(str(card), ignore_metadata_errors=False)  # round trip: YAML header parses and validates
    data = parsed.data
    if (data.library_name != "transformers" or data.pipeline_tag != "text-generation"
            or not set(CARD_TAGS) <= set(data.tags or [])):
        raise RuntimeError("The rendered MARS model card lost its metadata; the template is broken.")
    return parsed
