"""A draft vocabulary for verify mode (``mars_draft_vocab``): the columns whose input is the mask token get logits
over a short list of frequent tokens only, every other column the full vocabulary.

Why: in verify mode a mask column only *proposes* drafts; the token emitted at every position comes from a column
whose input is a real token (the last committed token or a pending draft), and each draft is accepted only if it
equals (greedy) or passes speculative sampling against that column's full distribution. So restricting the mask
columns to K tokens cannot change the output; it only removes most of the LM head's cost at those columns, which on
a large vocabulary (Gemma 3: 262,144 rows) is most of a MARS step's extra cost on a CPU. A token outside the list
can no longer be drafted (those steps accept fewer tokens); FR-Spec (arXiv 2502.14856) cuts EAGLE's head this way.
Threshold mode emits mask predictions directly, so there it would change the output: it is refused there.

How: for each decode forward the model's LM head module is swapped for ``_SplitHead``, which computes the
full head on real-token columns and K rows on mask columns (the rest -inf), so each architecture's own forward,
including its logit soft-capping, is untouched. The decoder's forward call sets which kept columns hold masks.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ._compat import swap_child


def parse_draft_vocab(value):
    """The option in its one form: None, or a tuple of distinct token ids >= 0 (from a list, tuple or 1-D tensor)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    try:
        ids = tuple(dict.fromkeys(value))
    except TypeError:
        ids = ()
    if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"mars_draft_vocab must be a non-empty list of token ids (ints >= 0), got "
                         f"{type(value).__name__} {str(value)[:80]}.")
    return ids


def check_fits(ids: tuple, rows: int) -> None:
    """Every id a row of the model's LM head (``rows`` of them)."""
    if max(ids) >= rows:
        raise ValueError(f"mars_draft_vocab holds token id {max(ids)}, outside this model's {rows} LM-head rows.")


def rank_tokens(token_lists, size: int | None = None) -> list[int]:
    """Token ids by frequency in ``token_lists`` (most frequent first; ties by id), the first ``size`` of them: a
    draft vocabulary built from text like the model's own output (its greedy continuations, say)."""
    counts = Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return ranked if size is None else ranked[:size]


def _head_attribute(model) -> str:
    head = model.get_output_embeddings()
    for name, child in model.named_children():
        if child is head:
            return name
    raise ValueError(f"mars_draft_vocab needs the LM head as a direct module of the model; "
                     f"{type(model).__name__} keeps it elsewhere.")


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A head's weight as a strided tensor to gather rows from: a head on oneDNN kernels
    (`torch.utils.mkldnn.to_mkldnn`) keeps its weight in oneDNN's own layout, which cannot be indexed."""
    tensor = tensor.detach()
    return tensor.to_dense() if tensor.is_mkldnn else tensor


class DraftVocabulary:
    """The draft vocabulary of one generation: the head's K rows, gathered once."""

    def __init__(self, model, ids: tuple, mask_id: int):
        self.attribute = _head_attribute(model)
        self.head = getattr(model, self.attribute)
        weight = self.head.weight
        check_fits(ids, weight.shape[0])
        keep = [t for t in ids if t != mask_id]  # the mask is never a draft
        self.ids = torch.tensor(keep, dtype=torch.long, device=weight.device)
        self.weight = _dense(weight)[self.ids].contiguous()
        bias = getattr(self.head, "bias", None)
        self.bias = None if bias is None else _dense(bias)[self.ids].contiguous()
        self.mask_id, self.mask_columns = mask_id, None
        self.split = _SplitHead(self)  # (built once: it goes in and out of the model every decode forward)

    def wrap(self, forward, model):
        """``forward`` that records which of the columns it keeps logits for are mask tokens and runs with the split
        head in ``model`` (only for the forward: a decoder that `MARSEngine` steps, or code between two steps, sees
        the model's own head)."""
        def call(*args, input_ids=None, logits_to_keep=0, **kwargs):
            if input_ids is not None:
                is_mask = input_ids == self.mask_id
                if isinstance(logits_to_keep, int):
                    is_mask = is_mask[:, -logits_to_keep:] if logits_to_keep else is_mask
                else:
                    is_mask = is_mask[:, logits_to_keep]
                self.mask_columns = is_mask
            if "logits_to_keep" in kwargs or logits_to_keep != 0:
                kwargs["logits_to_keep"] = logits_to_keep
            swap_child(model, self.attribute, self.split)  # (a plain try, not `installed`: once per decode step)
            try:
                return forward(*args, input_ids=input_ids, **kwargs)
            finally:
                swap_child(model, self.attribute, self.head)
        return call

    @contextlib.contextmanager
    def installed(self, model):
        """The split head in place of the model's for the length of the block (restored however it ends)."""
        # (the registry entry itself, as nn.Module.__setattr__ ends up writing it)
        swap_child(model, self.attribute, self.split)
        try:
            yield
        finally:
            swap_child(model, self.attribute, self.head)


class _SplitHead(torch.nn.Module):
    def __init__(self, vocab: DraftVocabulary):
        super().__init__()
        self.vocab = vocab
        self.weight = vocab.head.weight  # (read by code that asks the head for its dtype or device)

    def forward(self, hidden):
        vocab, columns = self.vocab, self.vocab.mask_columns
        if columns is None or columns.shape != hidden.shape[:2] or not bool(columns.any()):
            return vocab.head(hidden)
        flat, is_mask = hidden.reshape(-1, hidden.shape[-1]), columns.reshape(-1)
        out = flat.new_full((flat.shape[0], vocab.head.weight.shape[0]), float("-inf"))
        full = (~is_mask).nonzero().squeeze(1)
        if full.numel():
            out[full] = vocab.head(flat[full])
        masks = is_mask.nonzero().squeeze(1)
        out[masks[:, None], vocab.ids[None, :]] = torch.nn.functional.linear(flat[masks], vocab.weight, vocab.bias)
        return out.view(*hidden.shape[:2], -1)
