"""Hub-ready MARS checkpoints: extras in the folder, a model card, and push.

A MARS checkpoint must work for someone who has only transformers. So besides
the weights (safetensors) and the tokenizer with its mask token, every saved
folder carries:

- ``config.json`` with the MARS metadata under ``"mars"`` (written by save_pretrained);
- ``generation_config.json`` with the MARS defaults ``mars_threshold`` / ``mars_block_size``;
- ``custom_generate/``: the modules of hf_mars/generation/ copied byte for byte (they import
  only torch, transformers and each other; ``generate.py`` is the entry), plus
  ``custom_generate/requirements.txt``. Loading with ``trust_remote_code=True`` makes
  transformers replace ``model.generate`` with its ``generate``;
- ``README.md``: a model card rendered from ``model_cards/mars_model_card.md``.

Without ``trust_remote_code`` the folder is the plain base-architecture AR model.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

CUSTOM_GENERATE_DIR = "custom_generate"
GENERATION_MODULE = "hf_mars.generation"
DEFAULT_THRESHOLD = 0.95  # the paper's multi-token setting; 1.0 is exact AR greedy
DEFAULT_BLOCK_SIZE = 4
CARD_TAGS = ["mars", "multi-token-prediction", "custom_generate"]
REPO_ID_PLACEHOLDER = "path/to/this/checkpoint"
DEFAULT_COMMIT_MESSAGE = "Upload MARS checkpoint"
# Floors for custom_generate/requirements.txt when hf-mars' own metadata is not available.
_FALLBACK_FLOORS = {"transformers": "transformers>=5.17.0", "torch": "torch>=2.4"}
# Never committed: pickled files, trainer state (optimizer, scheduler, RNG, DeepSpeed shards), the
# intermediate checkpoint-N/ folders of a training output_dir (as Trainer.push_to_hub), caches.
PUSH_IGNORE_PATTERNS = [
    "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.npy", "*.npz",
    "optimizer*", "scheduler*", "rng_state*", "trainer_state.json", "global_step*", "latest", "checkpoint-*",
    "*__pycache__*", "*.pyc", "*.ipynb_checkpoints*", ".DS_Store",
]
CARD_FIELDS = (
    "model_name", "repo_id", "base_model", "datasets", "license", "language", "tags", "description",
    "benchmark", "example_prompt", "mars_threshold", "mars_block_size",
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


# --------------------------------------------------------------------------- checks


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _not_mars(directory, why: str) -> ValueError:
    return ValueError(
        f"{directory} is not a MARS checkpoint: {why}. Prepare the model with "
        "`hf_mars.add_mask_token(model, tokenizer)`, train it with `hf_mars.MARSTrainer`, and save it with "
        "`trainer.save_model(...)` or `hf_mars.save_for_hub(model, tokenizer, directory)`."
    )


def _mars_from_config(config_dict: dict, where) -> dict:
    mars = config_dict.get("mars")
    if not isinstance(mars, dict) or isinstance(mars.get("mask_token_id"), bool) or not isinstance(mars.get("mask_token_id"), int):
        raise _not_mars(where, "its config has no `mars` metadata with an integer `mask_token_id`")
    return mars


def _saved_tokenizer(directory: Path):
    """The tokenizer saved in ``directory`` (None when there is none)."""
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _token_id(tokenizer, token: str) -> int | None:
    """Id of ``token`` as one token of ``tokenizer`` (None when it is not in the vocabulary)."""
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


_UNTRAINED = (
    "its mask token was never MARS-trained (config.json's `mars` has no `trained_steps`; MARSTrainer records it "
    "when it saves), so MARS decoding would emit noise. Fine-tune with `hf_mars.MARSTrainer` first, or pass "
    "force=True (`--force`) if you know the model was trained another way"
)


def check_checkpoint(directory, for_push: bool = False, force: bool = False) -> dict:
    """Raise a ValueError unless ``directory`` is a MARS checkpoint; return its ``config.mars``.

    Checks the MARS metadata in config.json and that the saved tokenizer has the mask token
    with the same id. ``for_push`` also requires safetensors weights and the MARS extras.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; pass the folder a MARS checkpoint was saved to.")
    if not (directory / "config.json").is_file():
        raise _not_mars(directory, "it has no config.json")
    mars = _mars_from_config(_read_json(directory / "config.json"), directory)
    mask_token, mask_id = mars.get("mask_token"), mars["mask_token_id"]
    tokenizer = _saved_tokenizer(directory)
    if tokenizer is None:
        raise _not_mars(directory, "it holds no tokenizer (save the tokenizer that `add_mask_token` changed)")
    found = _token_id(tokenizer, mask_token) if isinstance(mask_token, str) else None
    if found is None:
        raise _not_mars(directory, f"its tokenizer has no mask token {mask_token!r}")
    if found != mask_id:
        raise ValueError(
            f"{directory}: the tokenizer maps the mask token {mask_token!r} to id {found}, but config.json's "
            f"`mars.mask_token_id` is {mask_id}. Save the model and the tokenizer from the same `add_mask_token` call."
        )
    if for_push and not force and not mars.get("trained_steps"):
        raise _not_mars(directory, _UNTRAINED)
    if for_push:
        names = [p.name for p in directory.iterdir() if p.is_file()]
        if not any(n.endswith(".safetensors") for n in names):
            pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
            raise ValueError(
                f"{directory} holds no safetensors weights"
                + (f" (only pickled {', '.join(pickled)})" if pickled else "")
                + ". Load the model and re-save it with `model.save_pretrained(directory)` (transformers writes "
                "safetensors)."
            )
        missing = [n for n in (f"{CUSTOM_GENERATE_DIR}/generate.py", "README.md", "generation_config.json")
                   if not (directory / n).is_file()]
        if missing:
            raise ValueError(
                f"{directory} lacks the MARS Hub files {missing}. Write them with "
                f"`python -c \"from hf_mars.hub import write_mars_extras; write_mars_extras('{directory}')\"` "
                "or save the model with `hf_mars.save_for_hub(model, tokenizer, directory)`."
            )
        shipped = sorted((directory / CUSTOM_GENERATE_DIR).glob("*.py"))
        try:
            for module in shipped:
                _check_standalone(module.read_text(encoding="utf-8"), module, {p.stem for p in shipped})
        except RuntimeError as e:
            raise ValueError(f"{e} Rewrite it with `hf_mars.hub.write_mars_extras('{directory}')`.") from None
    return mars


def validate_repo_id(repo_id) -> str:
    """A Hub model repo id must be ``namespace/name``: reject anything else before touching the network."""
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    hint = "Use the form 'namespace/name', e.g. 'my-org/qwen2.5-0.5b-mars'."
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"Invalid repo id {repo_id!r}: {hint}")
    try:
        hf_validate(repo_id)
    except HFValidationError as e:
        raise ValueError(f"Invalid repo id {repo_id!r}: {e} {hint}") from None
    return repo_id


# --------------------------------------------------------------------------- custom_generate


def generation_package_files() -> list[Path]:
    """The modules of hf_mars/generation/ a checkpoint ships (found through the import system, not imported):
    ``generate.py``, the entry transformers loads, and the siblings it imports, directly or not (transformers
    copies a module's relative imports next to it; the package's ``__init__`` is not needed)."""
    import importlib.util

    spec = importlib.util.find_spec(GENERATION_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Cannot find the source of {GENERATION_MODULE} (needed for custom_generate/); "
            "reinstall hf-mars from source (`pip install -e .`)."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    needed, todo = set(), ["generate"]
    while todo:
        name = todo.pop()
        if name in needed or not (folder / f"{name}.py").is_file():
            continue
        needed.add(name)
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return sorted(folder / f"{name}.py" for name in needed)


def _check_standalone(source: str, origin, siblings: set) -> None:
    """A shipped module may import only torch, transformers, the stdlib and its siblings, the latter as
    ``from .module import ...`` (the form transformers follows when it copies a custom_generate file's imports)."""
    allowed = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or node.module not in siblings:
                bad.append("relative import from " + "." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom):
            if node.module.split(".")[0] not in allowed:
                bad.append(node.module)
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] not in allowed]
    if bad:
        raise RuntimeError(
            f"{origin} imports {sorted(set(bad))}; custom_generate/ may import only torch, transformers, the "
            "standard library and its own modules (`from .module import name`), because it runs where hf-mars is "
            "not installed."
        )


def _requirement_floors() -> list[str]:
    """transformers and torch floors, taken from hf-mars' own requirements so they stay in sync."""
    import importlib.metadata
    import re

    floors = dict(_FALLBACK_FLOORS)
    try:
        reqs = importlib.metadata.requires("hf-mars") or []
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    for req in reqs:
        if ";" in req:  # extras / markers
            continue
        m = re.match(r"^\s*(torch|transformers)\s*(>=\s*[\w.]+)", req)
        if m:
            floors[m.group(1)] = m.group(1) + m.group(2).replace(" ", "")
    return [floors["transformers"], floors["torch"]]


def write_custom_generate(save_directory) -> Path:
    """Copy the modules of hf_mars/generation/ into ``custom_generate/`` (byte for byte) with the requirements;
    returns the path of its ``generate.py``."""
    files = generation_package_files()
    siblings = {p.stem for p in files}
    if "generate" not in siblings:
        raise RuntimeError(f"{GENERATION_MODULE} has no generate.py entry point for custom_generate/.")
    out = Path(save_directory) / CUSTOM_GENERATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    for src in files:
        data = src.read_bytes()
        _check_standalone(data.decode("utf-8"), src, siblings)
        (out / src.name).write_bytes(data)
    (out / "requirements.txt").write_text("\n".join(_requirement_floors()) + "\n", encoding="utf-8")
    return out / "generate.py"


# --------------------------------------------------------------------------- generation defaults


def _check_defaults(threshold=None, block_size=None) -> None:
    """The rules hf_mars.generation applies to mars_threshold / mars_block_size (it owns them)."""
    from hf_mars.generation import check_block_size, check_threshold

    if threshold is not None:
        check_threshold(threshold)
    if block_size is not None:
        check_block_size(block_size)


def write_generation_defaults(save_directory, mars: dict, model=None, config_dict=None,
                              threshold=None, block_size=None) -> tuple[float, int]:
    """Add ``mars_threshold`` / ``mars_block_size`` to the folder's generation config, keeping everything else.

    Precedence: explicit argument > value already in the generation config > ``config.mars`` > default.
    """
    from transformers import GenerationConfig

    directory = Path(save_directory)
    if (directory / "generation_config.json").is_file():
        gen_config = GenerationConfig.from_pretrained(directory)
    elif model is not None and getattr(model, "generation_config", None) is not None:
        gen_config = GenerationConfig.from_dict(model.generation_config.to_dict())
    else:
        cfg = config_dict or {}
        gen_config = GenerationConfig(**{k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                         if cfg.get(k) is not None})
    if threshold is None:
        threshold = getattr(gen_config, "mars_threshold", None)
    if threshold is None:
        threshold = DEFAULT_THRESHOLD
    if block_size is None:
        block_size = getattr(gen_config, "mars_block_size", None) or mars.get("block_size") or DEFAULT_BLOCK_SIZE
    _check_defaults(threshold, block_size)
    gen_config.mars_threshold = float(threshold)
    gen_config.mars_block_size = block_size
    # a config flagged as derived from the model config drops unknown attributes (the MARS defaults) on load
    from hf_mars._compat import keep_generation_extras

    keep_generation_extras(gen_config)
    gen_config.save_pretrained(directory)
    if model is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config.mars_threshold = float(threshold)  # the live model decodes as the saved one
        model.generation_config.mars_block_size = block_size
    return float(threshold), block_size


# --------------------------------------------------------------------------- model card


def template_path() -> Path:
    """The Jinja model-card template: packaged copy first, else the repository's model_cards/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "assets" / "model_cards" / "mars_model_card.md",
                      here.parent / "model_cards" / "mars_model_card.md"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("The MARS model-card template (model_cards/mars_model_card.md) is not installed.")


def _looks_like_repo_id(value) -> bool:
    if not isinstance(value, str) or value.count("/") != 1 or os.path.exists(value) or value.startswith((".", "/", "~")):
        return False
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


def _from_bench(result: dict) -> dict:
    """`hf-mars bench` output in the demo's report layout (same row keys): its smallest batch size, sliding cache."""
    rows = [r for r in result["rows"] if isinstance(r, dict)]
    if not rows:
        return result
    b = min(r.get("batch_size", 1) for r in rows)
    rows = [r for r in rows if r.get("batch_size", 1) == b]
    pick = ("threshold", "accuracy", "tokens_per_forward", "speedup_vs_ar")
    report = {"block_size": (result.get("settings") or {}).get("block_size"),
              "mars": [{k: r.get(k) for k in pick} for r in rows if r.get("mode") == "mars" and r.get("cache") == "sliding"],
              "command": "hf-mars bench", "device": (result.get("machine") or {}).get("device")}
    ar = next((r for r in rows if r.get("mode") == "ar"), None)
    if ar is not None:
        report["ar"] = {k: ar.get(k) for k in ("accuracy", "tokens_per_forward", "speedup_vs_ar")}
    verify = next((r for r in rows if r.get("mode") == "verify"), None)
    if verify is not None:
        report["verify"] = {k: verify.get(k) for k in pick}
    if b != 1 or len({r.get("batch_size") for r in result["rows"]}) > 1:
        report["description"] = f"Measured with `hf-mars bench` at batch size {b}."
    return report


def _benchmark_table(report) -> dict:
    """Rows for the measured table from a benchmark report (dict or path to the demo's report.json)."""
    if isinstance(report, (str, os.PathLike)):
        report = _read_json(Path(report))
    if isinstance(report, dict) and "mars" not in report and isinstance(report.get("rows"), list):
        report = _from_bench(report)
    if not isinstance(report, dict) or not isinstance(report.get("mars"), list) or not report["mars"]:
        raise ValueError(
            "benchmark must be a report dict like the demo's report.json: {'block_size': 4, 'ar_sft': {'accuracy': ...}, "
            "'mars': [{'threshold', 'accuracy', 'tokens_per_forward', 'speedup_vs_ar'}, ...], 'verify': {...}} "
            "(or the path of such a JSON file)."
        )
    entries = [e for e in report["mars"]]
    for e in entries:
        if not isinstance(e, dict) or "threshold" not in e or "accuracy" not in e:
            raise ValueError(f"each benchmark['mars'] entry needs 'threshold' and 'accuracy'; got {e!r}.")
    accs = [e.get("accuracy") for e in entries]
    for key in ("ar", "ar_sft", "verify"):
        if isinstance(report.get(key), dict):
            accs.append(report[key].get("accuracy"))
    fraction = all(a is None or a <= 1.0 for a in accs)

    def acc(value, ci=None):
        if value is None:
            return "–"
        text = f"{100 * value:.1f}%" if fraction else f"{value:.1f}"
        if fraction and isinstance(ci, (list, tuple)) and len(ci) == 2:
            text += f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"
        return text

    def num(value, suffix=""):
        return "–" if value is None else f"{float(value):.2f}{suffix}"

    rows = []
    if isinstance(report.get("ar_sft"), dict):
        r = report["ar_sft"]
        rows.append({"name": "AR SFT baseline (a separate AR-trained model)", "threshold": "–",
                     "accuracy": acc(r.get("accuracy"), r.get("accuracy_ci95")),
                     "tokens_per_forward": num(r.get("tokens_per_forward", 1.0)),
                     "speedup": num(r.get("speedup_vs_ar"), "×")})
    if isinstance(report.get("ar"), dict):
        r = report["ar"]
        rows.append({"name": "this model, plain AR decoding", "threshold": "–", "accuracy": acc(r.get("accuracy")),
                     "tokens_per_forward": num(r.get("tokens_per_forward", 1.0)),
                     "speedup": num(r.get("speedup_vs_ar", 1.0), "×")})
    for e in sorted(entries, key=lambda e: -float(e["threshold"])):
        rows.append({"name": "MARS" + (" (one-token mode)" if float(e["threshold"]) >= 1.0 else ""),
                     "threshold": _fmt(float(e["threshold"])), "accuracy": acc(e.get("accuracy"), e.get("accuracy_ci95")),
                     "tokens_per_forward": num(e.get("tokens_per_forward")), "speedup": num(e.get("speedup_vs_ar"), "×")})
    if isinstance(report.get("verify"), dict):
        r = report["verify"]
        rows.append({"name": "MARS verify (lossless, `mars_verify=True`)",
                     "threshold": _fmt(r["threshold"]) if r.get("threshold") is not None else "–",
                     "accuracy": acc(r.get("accuracy"), r.get("accuracy_ci95")),
                     "tokens_per_forward": num(r.get("tokens_per_forward")),
                     "speedup": num(r.get("speedup_vs_ar"), "×")})
    notes = []
    if any("accuracy_ci95" in (e if isinstance(e, dict) else {}) for e in entries):
        notes.append("Accuracy in brackets: 95% Wilson interval over the held-out questions.")
    paired = report.get("paired_tau1_vs_ar_sft")
    if isinstance(paired, dict) and paired.get("verdict"):
        notes.append(f"One-token MARS (τ = 1) against the AR-SFT baseline on the same {paired.get('n')} questions "
                     f"(paired, exact McNemar test): {paired['verdict']}.")
    for key, label in (("task", "Task"), ("num_examples", "Examples"), ("max_new_tokens", "max_new_tokens"),
                       ("device", "Device"), ("command", "Reproduce with")):
        if report.get(key) is not None:
            value = f"`{report[key]}`" if key == "command" else report[key]
            notes.append(f"{label}: {value}.")
    if any(row["speedup"] != "–" for row in rows):
        notes.append("Speedup: the report's `speedup_vs_ar`, wall-clock time relative to AR decoding of the same model.")
    return {"block_size": report.get("block_size"), "description": report.get("description"), "rows": rows,
            "notes": notes}


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


def build_model_card(directory, mars: dict, config_dict: dict, threshold: float, block_size: int,
                     model=None, tokenizer=None, training_args=None, **card_fields):
    """Render the MARS model card (a huggingface_hub ModelCard) and check that it parses back."""
    from huggingface_hub import ModelCard, ModelCardData

    directory = Path(directory)
    unknown = set(card_fields) - set(CARD_FIELDS)
    if unknown:
        raise ValueError(f"Unknown model-card field(s) {sorted(unknown)}; accepted: {', '.join(CARD_FIELDS)}.")
    old = _existing_card_data(directory)

    base_model = card_fields.get("base_model") or old.get("base_model")
    if base_model is None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or config_dict.get("_name_or_path")
        base_model = name if _looks_like_repo_id(name) else None
    datasets = _as_list(card_fields.get("datasets") or old.get("datasets"))
    tags = []
    for tag in CARD_TAGS + (_as_list(card_fields.get("tags")) or []) + (_as_list(old.get("tags")) or []):
        if tag not in tags:
            tags.append(tag)
    repo_id = card_fields.get("repo_id")
    if repo_id is not None:
        validate_repo_id(repo_id)
    model_name = card_fields.get("model_name") or (repo_id.split("/")[-1] if repo_id else None) or directory.resolve().name

    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=base_model,
        datasets=datasets,
        license=card_fields.get("license") or old.get("license"),
        language=card_fields.get("language") or old.get("language"),
        tags=tags,
        model_name=model_name,
        ignore_metadata_errors=False,
    )
    if tokenizer is not None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    else:
        chat = (directory / "chat_template.jinja").is_file() or bool(
            (directory / "tokenizer_config.json").is_file()
            and _read_json(directory / "tokenizer_config.json").get("chat_template"))
    trainer_state = _read_json(directory / "trainer_state.json") if (directory / "trainer_state.json").is_file() else None
    benchmark = card_fields.get("benchmark")
    try:
        import hf_mars

        hf_mars_version = hf_mars.__version__
    except Exception:
        hf_mars_version = None
    card = ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=model_name,
        repo_id=repo_id or REPO_ID_PLACEHOLDER,
        base_model=base_model,
        datasets=datasets,
        description=card_fields.get("description"),
        architecture=(config_dict.get("architectures") or ["AutoModelForCausalLM"])[0],
        mars={"block_size": mars.get("block_size"), "ar_weight": mars.get("ar_weight"),
              "mask_token": mars.get("mask_token"), "mask_token_id": mars.get("mask_token_id")},
        threshold=_fmt(threshold),
        decode_block_size=block_size,
        chat=chat,
        # a Python string literal (quotes, newlines escaped) for the usage snippets
        example_prompt=json.dumps(card_fields.get("example_prompt") or "What is 12 * 7?", ensure_ascii=False),
        benchmark=_benchmark_table(benchmark) if benchmark is not None else None,
        training=_training_rows(mars, training_args, trainer_state),
        versions=_versions(),
        hf_mars_version=hf_mars_version,
    )
    parsed = ModelCard(str(card), ignore_metadata_errors=False)  # round trip: YAML header parses and validates
    data = parsed.data
    if (data.library_name != "transformers" or data.pipeline_tag != "text-generation"
            or not set(CARD_TAGS) <= set(data.tags or [])):
        raise RuntimeError("The rendered MARS model card lost its metadata; the template is broken.")
    return parsed


# --------------------------------------------------------------------------- public API


def write_mars_extras(save_directory, model=None, tokenizer=None, training_args=None, **card_fields) -> Path:
    """Write the MARS-specific files of a saved checkpoint folder; return the folder.

    Called by MARSTrainer for every checkpoint it saves (after save_pretrained wrote weights,
    config and tokenizer). Writes generation_config.json MARS defaults, custom_generate/ and
    README.md. ``card_fields`` go to the model card (see ``CARD_FIELDS``); ``mars_threshold`` /
    ``mars_block_size`` set the generation defaults.
    """
    directory = Path(save_directory)
    unknown = set(card_fields) - set(CARD_FIELDS)
    if unknown:
        raise ValueError(f"Unknown model-card field(s) {sorted(unknown)}; accepted: {', '.join(CARD_FIELDS)}.")
    _check_defaults(card_fields.get("mars_threshold"), card_fields.get("mars_block_size"))
    if not directory.is_dir():
        raise ValueError(f"{directory} does not exist; save the model there first (save_pretrained).")
    if (directory / "config.json").is_file():
        config_dict = _read_json(directory / "config.json")
        mars = _mars_from_config(config_dict, directory)
    elif model is not None:
        config_dict = model.config.to_dict()
        mars = _mars_from_config(config_dict, "the model")
    else:
        raise _not_mars(directory, "it has no config.json")
    processor = tokenizer
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a ProcessorMixin wraps the tokenizer
    if tokenizer is not None:
        mask = mars.get("mask_token")
        if tokenizer.convert_tokens_to_ids(mask) != mars["mask_token_id"]:
            raise ValueError(
                f"The tokenizer maps the mask token {mask!r} to {tokenizer.convert_tokens_to_ids(mask)}, but "
                f"config.mars says {mars['mask_token_id']}: pass the tokenizer that `add_mask_token` changed."
            )
        if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            processor.save_pretrained(directory)

    threshold, block_size = write_generation_defaults(
        directory, mars, model=model, config_dict=config_dict,
        threshold=card_fields.pop("mars_threshold", None), block_size=card_fields.pop("mars_block_size", None))
    write_custom_generate(directory)
    card = build_model_card(directory, mars, config_dict, threshold, block_size, model=model, tokenizer=tokenizer,
                            training_args=training_args, **card_fields)
    card.save(directory / "README.md")
    return directory


def save_for_hub(model, tokenizer, save_directory, training_args=None, force: bool = False, **card_fields) -> Path:
    """Save a MARS model as a Hub-ready folder: safetensors, tokenizer, config, MARS extras, model card.

    ``card_fields``: model_name, repo_id, base_model, datasets, license, language, tags,
    description, benchmark (report dict or report.json path), example_prompt,
    mars_threshold, mars_block_size.
    """
    from hf_mars.tokens import get_mars_metadata

    mars = get_mars_metadata(model.config)
    if not mars or not isinstance(mars.get("mask_token_id"), int):
        raise _not_mars("This model", "`model.config.mars` has no `mask_token_id`")
    mask = mars.get("mask_token")
    if (tokenizer is None or getattr(tokenizer, "mask_token", None) is None
            or tokenizer.convert_tokens_to_ids(mask) != mars["mask_token_id"]):
        raise ValueError(
            f"The tokenizer has no mask token {mask!r} with id {mars['mask_token_id']} (config.mars): pass the "
            "tokenizer that `hf_mars.add_mask_token(model, tokenizer)` changed."
        )
    if not force and not mars.get("trained_steps"):
        raise _not_mars("This model", _UNTRAINED)
    if mars["mask_token_id"] >= model.get_input_embeddings().weight.shape[0]:
        raise ValueError("The mask token id is outside the model's embedding matrix; call `add_mask_token` again.")
    unknown = set(card_fields) - set(CARD_FIELDS)
    if unknown:
        raise ValueError(f"Unknown model-card field(s) {sorted(unknown)}; accepted: {', '.join(CARD_FIELDS)}.")
    _check_defaults(card_fields.get("mars_threshold"), card_fields.get("mars_block_size"))
    if card_fields.get("benchmark") is not None:
        _benchmark_table(card_fields["benchmark"])  # a malformed report fails before anything is written
    if card_fields.get("repo_id") is not None:
        validate_repo_id(card_fields["repo_id"])
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_mars_extras(directory, model=model, tokenizer=tokenizer, training_args=training_args, **card_fields)
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickled:
        import warnings

        warnings.warn(f"{directory} also holds pickled files {pickled} from earlier; push_to_hub will skip them.")
    return directory


def upload_file_list(directory) -> list[str]:
    """Exactly the files push_to_hub commits: the folder minus PUSH_IGNORE_PATTERNS and huggingface_hub's defaults.

    Uses huggingface_hub's own filter with the same patterns upload_folder applies.
    """
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    root = Path(directory).expanduser().resolve()
    rel = [p.relative_to(root).as_posix() for p in sorted(root.glob("**/*")) if p.is_file()]
    return list(filter_repo_objects(rel, ignore_patterns=PUSH_IGNORE_PATTERNS + DEFAULT_IGNORE_PATTERNS))


def _is_connection_error(exc: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(exc, (OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    return any(cls.__module__.split(".")[0].startswith(("httpx", "httpcore", "requests", "urllib3"))
               and cls.__name__ in {"TransportError", "ConnectError", "ConnectionError", "TimeoutException"}
               for cls in type(exc).__mro__)


def push_to_hub(directory, repo_id, private=None, revision=None, create_pr=False, token=None,
                commit_message=DEFAULT_COMMIT_MESSAGE, dry_run=False, force=False):
    """Upload a MARS checkpoint folder to ``repo_id`` (create_repo + upload_folder).

    Pickled files and trainer state are never committed (PUSH_IGNORE_PATTERNS). The token
    comes from ``token``, HF_TOKEN or `hf auth login`. ``dry_run`` returns the list of
    files that would be committed, touching neither the network nor the folder. Otherwise
    returns huggingface_hub's CommitInfo; a card rendered without a repo id gets ``repo_id``
    written into its usage snippets first.
    """
    validate_repo_id(repo_id)
    directory = Path(directory)
    check_checkpoint(directory, for_push=True, force=force)
    files = upload_file_list(directory)
    if dry_run:
        return files
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        raise RuntimeError(
            "Cannot push: Hugging Face Hub offline mode is on (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE). "
            "Unset it (`export HF_HUB_OFFLINE=0`) on a machine with network access, or use dry_run / --dry-run "
            "to list what would be committed."
        )
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = token or get_token()
    if not token:
        raise RuntimeError(
            "Cannot push: not logged in to the Hugging Face Hub. Run `hf auth login`, set HF_TOKEN, or pass "
            "token=... (a token with write access to the namespace of " + repo_id + ")."
        )
    readme = directory / "README.md"
    text = readme.read_text(encoding="utf-8")
    if REPO_ID_PLACEHOLDER in text:  # the card was rendered before the repo id was known: name the repo
        readme.write_text(text.replace(REPO_ID_PLACEHOLDER, repo_id), encoding="utf-8")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision and not create_pr:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id, folder_path=str(directory), repo_type="model", revision=revision,
            create_pr=create_pr, commit_message=commit_message, ignore_patterns=list(PUSH_IGNORE_PATTERNS),
        )
    except Exception as e:
        if _is_connection_error(e):
            raise RuntimeError(
                f"Cannot reach the Hugging Face Hub ({type(e).__name__}: {e}). Check the network connection "
                "(and HF_ENDPOINT / proxy settings), then retry; --dry-run works offline."
            ) from e
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, HfHubHTTPError) and status in (401, 403):
            raise RuntimeError(
                f"The Hub refused the push to {repo_id} (HTTP {status}): the token is invalid or has no write access "
                "to that namespace. Run `hf auth login` with a write token or pass token=..."
            ) from e
        raise


# --------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.add_argument("directory", metavar="DIR", help="checkpoint folder (saved by MARSTrainer or save_for_hub)")
    parser.add_argument("--repo-id", required=True, help="target model repo, 'namespace/name'")
    parser.add_argument("--private", action="store_true", default=None, help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default=DEFAULT_COMMIT_MESSAGE)
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or `hf auth login`)")
    parser.add_argument("--dry-run", action="store_true", help="list the files that would be committed and exit")
    parser.add_argument("--force", action="store_true",
                        help="push even though config.json does not record MARS training (trained_steps)")


def run(args) -> int:
    try:
        result = push_to_hub(args.directory, args.repo_id, private=args.private, revision=args.revision,
                             create_pr=args.create_pr, token=args.token, commit_message=args.commit_message,
                             dry_run=args.dry_run, force=args.force)
    except (ValueError, RuntimeError) as e:
        print(f"hf-mars push: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    if args.dry_run:
        target = (args.repo_id + (f"@{args.revision}" if args.revision else "")
                  + (" (as a pull request)" if args.create_pr else ""))
        print(f"Dry run: would commit {len(result)} files to {target}:", file=sys.stderr)
        for rel in result:
            print(rel)
        return 0
    url = getattr(result, "pr_url", None) or getattr(result, "commit_url", None) or result
    print(f"Pushed {args.directory} to {args.repo_id}: {url}")
    return 0
