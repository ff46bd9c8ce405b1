"""`MARSConfig`: TRL's `SFTConfig` plus the fields of the MARS objective, with CPU-aware defaults.

Kept apart from the trainer because it is what users build first (YAML, `TrlParser`, scripts) and because its
defaults (bf16, activation checkpointing, pinned memory) depend only on the machine, not on the training loop.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from trl import SFTConfig

from ..generation import check_block_size
from .tokens import DEFAULT_MASK_TOKEN

__all__ = ["MARSConfig", "checkpointing_argument"]

_NORMALIZATIONS = ("sequence", "token")


def _fast_bf16_available(use_cpu: bool) -> bool:
    """bf16 autocast pays off on CUDA GPUs with native bf16 (Ampere+) and Intel XPUs, not on CPUs."""
    if use_cpu:
        return False
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return bool(hasattr(torch, "xpu") and torch.xpu.is_available())


def _accelerator_available(use_cpu: bool) -> bool:
    if use_cpu:
        return False
    return torch.cuda.is_available() or bool(hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class MARSConfig(SFTConfig):
    r"""
    Configuration class for the [`MARSTrainer`].

    Extends [`~trl.SFTConfig`] (every SFT option keeps its meaning) with the parameters of the MARS objective: the
    model input is ``[z ; x]`` where the noisy stream ``z`` is ``x`` with every trained position replaced by the mask
    token, the attention follows the MARS block rule, and the loss is ``noisy CE + ar_weight * clean CE``.

    Parameters:
        > Parameters that control the MARS objective

        block_size (`int`, *optional*, defaults to `4`):
            Block size `B`: the number of future tokens the model learns to predict from mask tokens in one forward
            pass. Position `p` belongs to block `p // B`, counted from the start of its own sequence. The paper
            uses 4 (also 8 and 16). Recorded in the saved `config.json` under `mars.block_size`, so generation
            defaults to it.
        ar_weight (`float`, *optional*, defaults to `1.0`):
            Weight `α` of the AR (clean-stream) loss, which is exactly the ordinary SFT loss. With `0.0` the AR
            quality decays as `block_size` grows; the paper uses `1.0`.
        mask_token (`str` or `None`, *optional*, defaults to `None`):
            The mask token. `None`: the tokenizer's own registered mask token when it has one (Gemma's `<mask>`),
            else `"<|mask|>"`. Added to the tokenizer (and a row to the embeddings, initialised at the mean
            embedding) when absent. A token the tokenizer already uses for anything else (EOS, padding, BOS, chat
            markers, ordinary vocabulary) or a plain word is refused, with the role it has.
        loss_normalization (`str`, *optional*, defaults to `"sequence"`):
            How the summed token losses are normalised. `"sequence"` (the reference): each sequence's loss is
            divided by its number of trained tokens, then averaged over the sequences of the batch (with packing,
            over the packed sequences). `"token"`: divided by the number of trained tokens in the batch. Both are
            exact under gradient accumulation and data parallelism (the denominator is counted over the whole
            accumulated, all-process batch).
        pad_to_block_multiple (`bool`, *optional*, defaults to `True`):
            Whether the data collator pads every example (every packed sequence, with packing) with trained EOS
            tokens up to a multiple of `block_size`, as the reference does, so that the model learns that EOS
            follows EOS and the last block is complete. A sequence may then exceed `max_length` by up to
            `block_size - 1` tokens.

        > Defaults that differ from [`~trl.SFTConfig`]

        bf16 (`bool`, *optional*):
            Whether to use bf16 mixed precision. If not set, it is `True` only where bf16 is fast: a CUDA GPU with
            native bf16 support or an Intel XPU (and `fp16` is not set). On CPU it defaults to `False`, unlike
            SFTConfig: bf16 autocast made a tiny-model step about 8x slower on a 2-core CPU.
        gradient_checkpointing (`bool`, *optional*):
            Whether to trade compute for memory by recomputing activations (`activation_checkpointing` in
            transformers >= 5.24, of which this is the deprecated alias). If neither is set, it is `True` on a GPU/XPU
            (MARS sequences are twice as long, so activations double) and `False` on CPU, where memory is rarely the
            limit and the recomputation costs ~20% of the step.
        dataloader_pin_memory (`bool`, *optional*):
            Whether to pin the dataloader's host memory. If not set, it is `True` only where there is an accelerator
            to copy to; on CPU pinning does nothing and torch warns that it does nothing.
    """

    block_size: int = field(
        default=4,
        metadata={"help": "Block size B: the number of future tokens predicted from mask tokens per forward pass."},
    )
    ar_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the AR (clean-stream) loss added to the noisy-stream (mask) loss."},
    )
    mask_token: str | None = field(
        default=None,
        metadata={"help": "The mask token. Default: the tokenizer's own registered mask token if it has one, else "
                  f"{DEFAULT_MASK_TOKEN!r}, added to the tokenizer and embeddings. A token the tokenizer already uses "
                  "for anything else is refused."},
    )
    loss_normalization: str = field(
        default="sequence",
        metadata={
            "help": "'sequence': per-sequence mean over its trained tokens, then mean over sequences (reference). "
            "'token': sum over the batch divided by its trained-token count.",
            "choices": list(_NORMALIZATIONS),
        },
    )
    pad_to_block_multiple: bool = field(
        default=True,
        metadata={"help": "Pad every example with trained EOS tokens up to a multiple of block_size."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Whether to use bf16 mixed precision. If not set: True on a GPU with native bf16 or an XPU, "
            "False on CPU (bf16 autocast is slow there)."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Recompute activations in the backward pass to save memory. If not set: True on a GPU/XPU, "
            "False on CPU."
        },
    )

    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin the dataloader's host memory. If not set: True when an accelerator is used, False on "
                  "CPU (where pinning does nothing)."},
    )

    def __post_init__(self):
        check_block_size(self.block_size, "block_size")
        if self.ar_weight is None or not math.isfinite(float(self.ar_weight)) or float(self.ar_weight) < 0:
            raise ValueError(f"ar_weight must be a finite number >= 0 (the paper uses 1.0), got {self.ar_weight!r}.")
        self.ar_weight = float(self.ar_weight)
        if self.loss_normalization not in _NORMALIZATIONS:
            raise ValueError(
                f"loss_normalization must be one of {_NORMALIZATIONS}, got {self.loss_normalization!r}."
            )
        if self.mask_token is not None and (not isinstance(self.mask_token, str) or not self.mask_token):
            raise ValueError("mask_token must be a non-empty string, e.g. '<|mask|>' (or None for the default).")
        if self.loss_type not in ("nll", "chunked_nll"):
            raise ValueError(
                f"MARSTrainer computes its own objective; loss_type={self.loss_type!r} is not supported. Leave "
                "loss_type at 'nll'."
            )
        if self.bf16 is None:
            self.bf16 = (not self.fp16) and _fast_bf16_available(self.use_cpu)
        if self.gradient_checkpointing is None and getattr(self, "activation_checkpointing", None) is None:
            # transformers >= 5.24 names it activation_checkpointing (gradient_checkpointing is its deprecated alias)
            if hasattr(self, "activation_checkpointing"):
                self.activation_checkpointing = _accelerator_available(self.use_cpu)
            else:
                self.gradient_checkpointing = _accelerator_available(self.use_cpu)
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = _accelerator_available(self.use_cpu)
        super().__post_init__()


def checkpointing_argument(config_cls, enabled: bool) -> dict:
    """``{name: enabled}`` for activation checkpointing under the name the installed transformers uses:
    ``activation_checkpointing`` from 5.24 (``gradient_checkpointing`` is its deprecated alias there, and
    warns), ``gradient_checkpointing`` before."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}

