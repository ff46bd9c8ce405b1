"""The MARS training input: the noisy stream and the [noisy ; clean] attention rule.

A MARS training forward runs on the concatenation ``[z ; x]`` (length ``2n``) with position ids
``[pos ; pos]``. Query -> key is allowed when (docs/method.md, section 1):

=========  =========  ==========================================
query      key        allowed when
=========  =========  ==========================================
clean i    clean j    ``j <= i``
noisy i    noisy j    ``block(j) == block(i)`` and ``j <= i``
noisy i    clean j    ``block(j) < block(i)``
clean i    noisy j    never
=========  =========  ==========================================

``block(p) = position_id(p) // B``; both positions must lie in the same sequence (sequences are
delimited where the position ids do not continue by +1, which covers packing / padding-free
batches) and padding keys are never attended to. A padding *query* attends to itself only, so
that no softmax row is empty (an empty row gives NaN, whose gradient poisons the whole batch).

Transformers (5.x) passes a ready 4D mask or a ``BlockMask`` through untouched
(``masking_utils._preprocess_mask_arguments``), and sdpa only sets ``is_causal`` when no mask is
given, so nothing re-applies causality on top of this rule.
"""

from __future__ import annotations

import torch

__all__ = [
    "build_mars_attention_mask",
    "build_model_mars_mask",
    "model_attention_layout",
    "mars_allowed",
    "mars_mask_mod",
    "build_noisy_input_ids",
    "sequence_ids_from_positions",
    "positions_from_attention_mask",
    "shift_labels_for_positions",
]


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a padded batch (left or right padding): 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-row sequence index: a new sequence starts wherever the position ids do not continue by +1.

    This is how packed / padding-free rows (position ids restart at 0 for each packed sequence) are
    split; in a padded row every padding token becomes its own (empty-of-targets) sequence, harmlessly.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be 2D (batch, length), got shape {tuple(position_ids.shape)}")
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1] != 1).long()
    return starts.cumsum(-1) - 1


def shift_labels_for_positions(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """AR-aligned targets: ``out[p]`` is the label of ``p + 1`` (``-100`` at row ends and sequence boundaries)."""
    seq = sequence_ids_from_positions(position_ids)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    shifted[:, :-1].masked_fill_(seq[:, 1:] != seq[:, :-1], -100)
    return shifted


def build_noisy_input_ids(input_ids: torch.Tensor, labels: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The noisy stream ``z``: every trained position (``labels != -100``) replaced by the mask token."""
    return torch.where(labels != -100, torch.as_tensor(mask_token_id, dtype=input_ids.dtype,
                                                       device=input_ids.device), input_ids)


def mars_allowed(position_ids: torch.Tensor, block_size: int, padding_mask: torch.Tensor | None = None,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Dense boolean ``(batch, 2n, 2n)`` table of the MARS rule (True = query may attend key).

    Rows/columns ``0..n-1`` are the noisy stream, ``n..2n-1`` the clean stream. With ``sliding_window``
    (a sliding-attention layer) a query also sees only keys fewer than ``sliding_window`` positions back,
    as the model's own sliding-window layers do at inference.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    b, n = position_ids.shape
    device = position_ids.device
    valid = torch.ones(b, n, dtype=torch.bool, device=device) if padding_mask is None else padding_mask.bool()
    seq = sequence_ids_from_positions(position_ids)
    blk = torch.div(position_ids, block_size, rounding_mode="floor")
    idx = torch.arange(n, device=device)
    causal = (idx[None, :] <= idx[:, None])[None]  # (1, n, n): key index <= query index
    same = (seq[:, :, None] == seq[:, None, :]) & valid[:, None, :]
    if sliding_window is not None:
        same = same & (position_ids[:, :, None] - position_ids[:, None, :] < sliding_window)
    same_block = blk[:, :, None] == blk[:, None, :]
    earlier_block = blk[:, None, :] < blk[:, :, None]
    clean_clean = same & causal
    noisy_noisy = clean_clean & same_block
    noisy_clean = same & earlier_block
    top = torch.cat([noisy_noisy, noisy_clean], dim=2)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], dim=2)
    allowed = torch.cat([top, bottom], dim=1)
    # padding queries: attend to themselves only (keeps every softmax row non-empty)
    pad_q = ~torch.cat([valid, valid], dim=1)
    eye = torch.eye(2 * n, dtype=torch.bool, device=device)[None]
    return torch.where(pad_q[:, :, None], eye, allowed)


def mars_mask_mod(position_ids: torch.Tensor, block_size: int, padding_mask: torch.Tensor | None = None,
                  sliding_window: int | None = None):
    """A flex_attention ``mask_mod`` computing the same rule as `mars_allowed` index by index."""
    b, n = position_ids.shape
    valid = (torch.ones(b, n, dtype=torch.bool, device=position_ids.device) if padding_mask is None
             else padding_mask.bool())
    seq2 = sequence_ids_from_positions(position_ids).repeat(1, 2)
    blk2 = torch.div(position_ids, block_size, rounding_mode="floor").repeat(1, 2)
    pos2 = position_ids.repeat(1, 2)
    valid2 = valid.repeat(1, 2)

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        q_noisy = q_idx < n
        kv_noisy = kv_idx < n
        q_tok = torch.where(q_noisy, q_idx, q_idx - n)
        kv_tok = torch.where(kv_noisy, kv_idx, kv_idx - n)
        same = (seq2[batch_idx, q_idx] == seq2[batch_idx, kv_idx]) & valid2[batch_idx, kv_idx]
        if sliding_window is not None:
            same = same & (pos2[batch_idx, q_idx] - pos2[batch_idx, kv_idx] < sliding_window)
        causal = kv_tok <= q_tok
        bq = blk2[batch_idx, q_idx]
        bk = blk2[batch_idx, kv_idx]
        noisy_noisy = q_noisy & kv_noisy & causal & (bq == bk)
        noisy_clean = q_noisy & ~kv_noisy & (bk < bq)
        clean_clean = ~q_noisy & ~kv_noisy & causal
        rule = same & (noisy_noisy | noisy_clean | clean_clean)
        return torch.where(valid2[batch_idx, q_idx], rule, q_idx == kv_idx)

    return mask_mod


def build_mars_attention_mask(position_ids: torch.Tensor, block_size: int, padding_mask: torch.Tensor | None = None,
                              attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                              sliding_window: int | None = None):
    """The MARS attention mask over ``[z ; x]``, in the form ``attn_implementation`` consumes.

    - ``"sdpa"``: boolean ``(batch, 1, 2n, 2n)``, True = attend;
    - ``"eager"`` (and anything that adds the mask to the scores): additive float of ``dtype``,
      0 = attend, ``finfo(dtype).min`` = blocked;
    - ``"flex_attention"``: a ``BlockMask`` (masked tiles are skipped, unlike a dense mask).

    ``position_ids`` are the ``(batch, n)`` positions of one stream (both streams share them);
    ``padding_mask`` is the 2D attention mask (1 = real token); ``sliding_window`` restricts every query to
    keys fewer than that many positions back (for sliding-attention layers).
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be 2D (batch, length), got shape {tuple(position_ids.shape)}")
    if padding_mask is not None and padding_mask.shape != position_ids.shape:
        raise ValueError(f"padding_mask shape {tuple(padding_mask.shape)} != position_ids shape "
                         f"{tuple(position_ids.shape)}")
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        b, n = position_ids.shape
        return create_block_mask(mars_mask_mod(position_ids, block_size, padding_mask, sliding_window), B=b, H=None,
                                 Q_LEN=2 * n, KV_LEN=2 * n, device=position_ids.device)
    allowed = mars_allowed(position_ids, block_size, padding_mask, sliding_window)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation.startswith("flash"):
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot express the MARS attention rule (it only takes "
            "sequence boundaries). Load the model with attn_implementation='sdpa', 'eager' or 'flex_attention'."
        )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


# layer types whose attention this rule can express (a window is a restriction of the same rule)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def model_attention_layout(config) -> tuple[dict[str, int | None], bool]:
    """``({layer type: sliding window or None}, per_layer)`` for a decoder config.

    ``per_layer`` is True when the model takes one mask per layer type (a dict, keyed by
    ``config.layer_types``); otherwise one mask serves every layer (Mistral-style configs with a
    ``sliding_window`` apply it to all layers). Layer types the MARS rule cannot express (linear
    attention, state-space, chunked attention) raise a ValueError naming the model type.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", type(config).__name__)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        odd = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if odd:
            raise ValueError(
                f"MARS does not support {model_type!r}: its layer types {odd} keep a recurrent or chunked state that "
                "the MARS attention rule cannot express and whose cache cannot roll back. Supported layer types: "
                f"{list(SUPPORTED_LAYER_TYPES)}."
            )
        return {t: (window if t == "sliding_attention" else None) for t in dict.fromkeys(layer_types)}, True
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return {"full_attention": window}, False


def build_model_mars_mask(config, position_ids: torch.Tensor, block_size: int,
                          padding_mask: torch.Tensor | None = None, attn_implementation: str = "sdpa",
                          dtype: torch.dtype = torch.float32):
    """The MARS mask in the form this model's forward takes: one mask, or a dict keyed by its layer types
    (transformers 5 models with ``config.layer_types`` accept ``{"full_attention": ..., "sliding_attention": ...}``)."""
    layout, per_layer = model_attention_layout(config)
    masks = {layer_type: build_mars_attention_mask(position_ids, block_size, padding_mask, attn_implementation,
                                                   dtype, sliding_window=window)
             for layer_type, window in layout.items()}
    return masks if per_layer else masks["full_attention"]
