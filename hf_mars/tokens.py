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
    from .generation import read_mars_metadata  # the one reader (generation.py also ships standalone)

    return read_mars_metadata(config) or None


def set_mars_metadata(config, **fields) -> dict:
    """Merge ``fields`` into ``config.mars`` (creating it) and return the result."""
    meta = dict(get_mars_metadata(config) or {})
    meta.update({k: v for k, v in fields.items() if v is not None})
    setattr(config, MARS_CONFIG_KEY, meta)
    return meta


def add_mask_token(model, tokenizer, mask_token: str = DEFAULT_MASK_TOKEN) -> int:
    """Make ``mask_token`` a special token of ``tokenizer`` and a row of ``model``'s embeddings.

    Idempotent. Embeddings are resized only when the vocabulary outgrows them
    (so a padded embedding matrix keeps its padding), and new rows start at the
    mean embedding, which keeps the untrained mask from dominating attention.
    The id is recorded in ``model.config.mars["mask_token_id"]``.

    Returns the mask token id.
    """
    if not isinstance(mask_token, str) or not mask_token:
        raise ValueError("mask_token must be a non-empty string, e.g. '<|mask|>'.")
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens)
    added = set(getattr(tokenizer, "added_tokens_encoder", {}) or {})
    if mask_token in vocab and mask_token not in special and mask_token not in added:
        raise ValueError(
            f"{mask_token!r} is an ordinary token of this tokenizer's vocabulary; using it as the MARS mask "
            "would make real text look like a mask. Choose a string that is not in the vocabulary, e.g. '<|mask|>'."
        )
    if mask_token not in vocab:
        tokenizer.add_special_tokens({"mask_token": mask_token})
    elif getattr(tokenizer, "mask_token", None) != mask_token:
        tokenizer.mask_token = mask_token
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
