"""The mask token and the MARS metadata a checkpoint carries.

MARS adds exactly one thing to a model: a mask token. Its id (plus the trained
block size and AR-loss weight) is recorded under ``config.mars`` so that
generation finds it from the checkpoint alone, without the tokenizer.
"""

from __future__ import annotations

import torch

DEFAULT_MASK_TOKEN = "<|mask|>"
MARS_CONFIG_KEY = "mars"


def get_mars_metadata(config) -> dict | None:
    """Return the ``config.mars`` dict (or None when the model was never prepared for MARS)."""
    # the one reader (hf_mars/generation/ also ships standalone)
    from ..generation import read_mars_metadata

    return read_mars_metadata(config) or None


def set_mars_metadata(config, **fields) -> dict:
    """Merge ``fields`` into ``config.mars`` (creating it) and return the result."""
    meta = dict(get_mars_metadata(config) or {})
    meta.update({k: v for k, v in fields.items() if v is not None})
    setattr(config, MARS_CONFIG_KEY, meta)
    return meta


_ROLES = (("eos_token", "the EOS token (generation would never stop: MARS never emits the mask)"),
          ("pad_token", "the padding token"), ("bos_token", "the BOS token"), ("unk_token", "the unknown token"),
          ("sep_token", "the separator token"), ("cls_token", "the CLS token"))


def _existing_role(tokenizer, token: str) -> str | None:
    """What ``tokenizer`` already uses ``token`` for, or None when it is free to become the mask."""
    for attr, role in _ROLES:
        if getattr(tokenizer, attr, None) == token:
            return role
    if token in set(tokenizer.all_special_tokens):
        return "a special token of this tokenizer (e.g. a chat-template marker)"
    if token in tokenizer.get_vocab():
        return "an ordinary token of its vocabulary (real text would look like masks)"
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    if any(isinstance(t, str) and token in t for t in templates):
        return "a marker its chat template writes"
    return None


def add_mask_token(model, tokenizer, mask_token: str | None = None) -> int:
    """Make ``mask_token`` a special token of ``tokenizer`` and a row of ``model``'s embeddings.

    ``mask_token=None`` reuses the tokenizer's own registered mask token (Gemma-style ``<mask>``) when it has
    one, else adds ``<|mask|>``. A token the tokenizer already uses for anything else (EOS, padding, BOS, a
    chat marker, an ordinary vocabulary entry) is refused, and so is a string that does not look like a
    special token (``<...>`` or ``[...]``): a word such as ``cat`` would turn real text into masks.

    Idempotent. Embeddings are resized only when the vocabulary outgrows them (so a padded embedding matrix
    keeps its padding), and new rows start at the mean embedding, which keeps the untrained mask from
    dominating attention. The id is recorded in ``model.config.mars["mask_token_id"]``.

    Returns the mask token id.
    """
    if mask_token is None:
        mask_token = getattr(tokenizer, "mask_token", None) or DEFAULT_MASK_TOKEN
    if not isinstance(mask_token, str) or not mask_token:
        raise ValueError("mask_token must be a non-empty string, e.g. '<|mask|>'.")
    if getattr(tokenizer, "mask_token", None) != mask_token:  # only the registered mask token may be reused
        role = _existing_role(tokenizer, mask_token)
        if role is not None:
            raise ValueError(
                f"{mask_token!r} cannot be the MARS mask token: it is {role}. Use a new string such as '<|mask|>'."
            )
        stripped = mask_token.strip()
        if stripped != mask_token or not ((stripped[0], stripped[-1]) in (("<", ">"), ("[", "]")) and len(stripped) > 2):
            raise ValueError(
                f"{mask_token!r} does not look like a special token; as a mask it would turn real text into masks. "
                "Use a delimited string such as '<|mask|>' or '[MASK]'."
            )
        tokenizer.add_special_tokens({"mask_token": mask_token})
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    if mask_id is None or mask_id == getattr(tokenizer, "unk_token_id", None):
        raise ValueError(f"Could not register {mask_token!r} as a token of this tokenizer.")

    input_emb = model.get_input_embeddings()
    old_rows = input_emb.weight.shape[0]
    if mask_id >= old_rows:
        needed = len(tokenizer)
        # keep a pad-to-multiple layout (e.g. Qwen's 151936 = 64 * 2374) when the old matrix had one
        multiple = 64 if old_rows % 64 == 0 else None
        model.resize_token_embeddings(needed, pad_to_multiple_of=multiple, mean_resizing=False)
        with torch.no_grad():
            for emb in {id(e): e for e in (model.get_input_embeddings(), model.get_output_embeddings()) if e is not None}.values():
                weight = emb.weight
                if weight.shape[0] > old_rows:
                    weight[old_rows:] = weight[:old_rows].mean(dim=0, keepdim=True)
    set_mars_metadata(model.config, mask_token_id=int(mask_id), mask_token=mask_token)
    return int(mask_id)
