"""`MARSDataCollator`: SFTTrainer's default collator, padding every example to a multiple of the block size.

TRL exports its collator only from a private module; `hf_mars._compat.trl_lm_collator` is the one place that
imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._compat import trl_lm_collator

__all__ = ["MARSDataCollator"]


@dataclass
class MARSDataCollator(trl_lm_collator()):
    """`DataCollatorForLanguageModeling` that first pads each example to a multiple of the block size.

    The padding is trained EOS (label = EOS), per packed sequence when the example carries
    ``seq_lengths``. Doing it here (not in the loss) keeps the dataloader batch identical to what
    `MARSTrainer.compute_loss` consumes, and lets the token count for gradient accumulation see it.
    """

    block_size: int = 4
    eos_token_id: int | None = None
    pad_to_block_multiple: bool = True

    def _pad_example(self, example: dict[str, Any]) -> dict[str, Any]:
        ids = list(example["input_ids"])
        labels = list(example["labels"]) if "labels" in example else list(ids)
        lengths = list(example["seq_lengths"]) if "seq_lengths" in example else [len(ids)]
        new_ids, new_labels, new_lengths, start = [], [], [], 0
        for length in lengths:
            extra = (-length) % self.block_size
            new_ids += ids[start:start + length] + [self.eos_token_id] * extra
            new_labels += labels[start:start + length] + [self.eos_token_id] * extra
            new_lengths.append(length + extra)
            start += length
        out = dict(example)
        out["input_ids"], out["labels"] = new_ids, new_labels
        if "seq_lengths" in example:
            out["seq_lengths"] = new_lengths
        return out

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.pad_to_block_multiple and self.block_size > 1:
            if self.eos_token_id is None:
                raise ValueError("MARSDataCollator needs eos_token_id to pad examples to a block multiple.")
            examples = [self._pad_example(example) for example in examples]
        return super().torch_call(examples)

