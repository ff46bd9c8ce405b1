"""Hub-ready MARS checkpoints: extras in the folder, a model card, and push.

A MARS checkpoint must work for someone who has only transformers. So besides
the weights (safetensors) and the tokenizer with its mask token, every saved
folder carries:

- ``config.json`` with the MARS metadata under ``"mars"`` (written by save_pretrained);
- ``generation_config.json`` with the MARS defaults ``mars_threshold`` / ``mars_block_size``;
- ``custom_generate/``: the modules of hf_mars/generation/ copied byte for byte (they import
  only torch, transformers and each other; ``generate.py`` is the entry), plus
  ``custom_generate/requirements.txt`` (`hf_mars.custom_generate` writes and checks them). Loading with
  ``trust_remote_code=True`` makes transformers replace ``model.generate`` with its ``generate``;
- ``README.md``: the model card (`hf_mars.model_card`, from ``hf_mars/assets/model_cards/mars_model_card.md``).

Without ``trust_remote_code`` the folder is the plain base-architecture AR model. This module owns that contract
(`check_checkpoint`, `write_mars_extras`, `save_for_hub`) and the upload (`push_to_hub`, ``hf-mars push``); the card's
text is `hf_mars.model_card`'s, and reading a benchmark report is `hf_mars.bench.report`'s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .custom_generate import (  # noqa: F401  (generation_package_files and write_custom_generate: from here too)
    CUSTOM_GENERATE_DIR,
    GENERATION_MODULE,
    check_standalone,
    generation_package_files,
    write_custom_generate,
)
# the MARS defaults a checkpoint's generation_config.json carries: hf_mars.generation.config owns them
from .generation.config import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD  # noqa: F401
from .model_card import (  # noqa: F401  (CARD_FIELDS, CARD_TAGS and build_model_card stay importable from here)
    CARD_FIELDS,
    CARD_TAGS,
    REPO_ID_PLACEHOLDER,
    benchmark_table,
    build_model_card,
    check_card_fields,
)

DEFAULT_COMMIT_MESSAGE = "Upload MARS checkpoint"
# Never committed: pickled files, trainer state (optimizer, scheduler, RNG, DeepSpeed shards), the
# intermediate checkpoint-N/ folders of a training output_dir (as Trainer.push_to_hub), caches.
PUSH_IGNORE_PATTERNS = [
    "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.npy", "*.npz",
    "optimizer*", "scheduler*", "rng_state*", "trainer_state.json", "global_step*", "latest", "checkpoint-*",
    "*__pycache__*", "*.pyc", "*.ipynb_checkpoints*", ".DS_Store",
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
                check_standalone(module.read_text(encoding="utf-8"), module, {p.stem for p in shipped})
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


# --------------------------------------------------------------------------- weights


def _give_weights_the_umask_mode(directory: Path) -> None:
    """safetensors (0.8) writes weights through a private temporary file, so they end up 0600 while every other
    file of the checkpoint gets 0666 minus the umask: a shared or served folder then has unreadable weights.
    Only files left exactly at 0600 are changed (a mode someone chose otherwise stays)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.glob("*.safetensors"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600:
            path.chmod(0o666 & ~umask)


# --------------------------------------------------------------------------- generation defaults


def _check_defaults(threshold=None, block_size=None, draft_tree=None, draft_vocab=None) -> None:
    """The rules hf_mars.generation applies to mars_threshold / mars_block_size / mars_draft_tree /
    mars_draft_vocab (it owns them)."""
    from hf_mars.generation import check_block_size, check_threshold
    from hf_mars.generation.config import parse_draft_tree
    from hf_mars.generation.draft_vocab import parse_draft_vocab

    if threshold is not None:
        check_threshold(threshold)
    if block_size is not None:
        check_block_size(block_size)
    if draft_tree is not None:
        parse_draft_tree(draft_tree)
    parse_draft_vocab(draft_vocab)


def write_generation_defaults(save_directory, mars: dict, model=None, config_dict=None,
                              threshold=None, block_size=None, draft_tree=None, draft_vocab=None) -> tuple[float, int]:
    """Add ``mars_threshold`` / ``mars_block_size`` (and, when given, verify mode's ``mars_draft_tree``, e.g. a
    shape measured with ``hf-mars bench --draft-trees``, and ``mars_draft_vocab``, the token ids its mask columns
    draft from) to the folder's generation config, keeping everything else.

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
    if draft_tree is not None:
        from hf_mars.generation.config import parse_draft_tree

        gen_config.mars_draft_tree = parse_draft_tree(draft_tree, block_size)  # (B masks with the last one)
    if draft_vocab is not None:
        from hf_mars.generation.draft_vocab import parse_draft_vocab

        gen_config.mars_draft_vocab = list(parse_draft_vocab(draft_vocab))  # (a JSON list; verify calls use it)
    # a config flagged as derived from the model config drops unknown attributes (the MARS defaults) on load
    from hf_mars._compat import keep_generation_extras

    keep_generation_extras(gen_config)
    gen_config.save_pretrained(directory)
    if model is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config.mars_threshold = float(threshold)  # the live model decodes as the saved one
        model.generation_config.mars_block_size = block_size
        if draft_tree is not None:
            model.generation_config.mars_draft_tree = gen_config.mars_draft_tree
        if draft_vocab is not None:
            model.generation_config.mars_draft_vocab = gen_config.mars_draft_vocab
    return float(threshold), block_size


# --------------------------------------------------------------------------- public API


def write_mars_extras(save_directory, model=None, tokenizer=None, training_args=None, **card_fields) -> Path:
    """Write the MARS-specific files of a saved checkpoint folder; return the folder.

    Called by MARSTrainer for every checkpoint it saves (after save_pretrained wrote weights,
    config and tokenizer). Writes generation_config.json MARS defaults, custom_generate/ and
    README.md, and gives 0600 ``*.safetensors`` files the mode the umask gives the others.
    ``card_fields`` go to the model card (see ``CARD_FIELDS``); ``mars_threshold`` /
    ``mars_block_size`` / ``mars_draft_tree`` / ``mars_draft_vocab`` set the generation defaults.
    """
    directory = Path(save_directory)
    check_card_fields(card_fields)
    _check_defaults(card_fields.get("mars_threshold"), card_fields.get("mars_block_size"),
                    card_fields.get("mars_draft_tree"), card_fields.get("mars_draft_vocab"))
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
        threshold=card_fields.pop("mars_threshold", None), block_size=card_fields.pop("mars_block_size", None),
        draft_tree=card_fields.pop("mars_draft_tree", None), draft_vocab=card_fields.pop("mars_draft_vocab", None))
    write_custom_generate(directory)
    card = build_model_card(directory, mars, config_dict, threshold, block_size, model=model, tokenizer=tokenizer,
                            training_args=training_args, **card_fields)
    card.save(directory / "README.md")
    _give_weights_the_umask_mode(directory)
    return directory


def save_for_hub(model, tokenizer, save_directory, training_args=None, force: bool = False, **card_fields) -> Path:
    """Save a MARS model as a Hub-ready folder: safetensors, tokenizer, config, MARS extras, model card.

    ``card_fields``: model_name, repo_id, base_model, datasets, license, language, tags,
    description, benchmark (report dict or report.json path), example_prompt,
    mars_threshold, mars_block_size, mars_draft_tree, mars_draft_vocab.
    """
    from hf_mars.generation.draft_vocab import check_fits, parse_draft_vocab
    from hf_mars.training.tokens import get_mars_metadata

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
    check_card_fields(card_fields)
    _check_defaults(card_fields.get("mars_threshold"), card_fields.get("mars_block_size"),
                    card_fields.get("mars_draft_tree"), card_fields.get("mars_draft_vocab"))
    if card_fields.get("mars_draft_vocab") is not None:
        check_fits(parse_draft_vocab(card_fields["mars_draft_vocab"]), model.get_output_embeddings().weight.shape[0])
    if card_fields.get("benchmark") is not None:
        benchmark_table(card_fields["benchmark"])  # a malformed report fails before anything is written
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
