"""The arithmetic of the MARS loss that is not the forward: each stream's numerator under the chosen normalisation,
and a MoE model's load-balancing loss on the clean stream alone (`MARSTrainer.compute_loss` adds them up)."""

from __future__ import annotations

import torch

from .._compat import load_balancing_loss, router_logits_recorder

__all__ = ["RouterLogits", "normalised_sums"]


def normalised_sums(nll_noisy, nll_clean, is_target, seq, normalization: str):
    """The two streams' loss numerators and the local denominator: "token" sums every target's NLL and counts the
    targets; "sequence" averages each sequence's targets first (packed rows hold several) and counts sequences."""
    if normalization != "sequence":
        return nll_noisy.sum(), nll_clean.sum(), is_target.sum()
    b, n = is_target.shape
    gseq = (seq + torch.arange(b, device=seq.device)[:, None] * n).reshape(-1)
    counts = torch.zeros(b * n, device=nll_noisy.device).index_add_(0, gseq, is_target.reshape(-1).float())
    has = counts > 0

    def mean_per_sequence(nll):
        sums = torch.zeros(b * n, device=nll.device, dtype=nll.dtype).index_add_(0, gseq, nll.reshape(-1))
        return (sums / counts.clamp(min=1)).masked_fill(~has, 0).sum()

    return mean_per_sequence(nll_noisy), mean_per_sequence(nll_clean), has.sum()


class RouterLogits:
    """Records a MoE model's router logits during one forward (the hooks transformers itself uses for
    ``output_router_logits``), so the load-balancing loss can be computed on the clean stream alone."""

    def __init__(self, model):
        self.logits = []
        target, index = router_logits_recorder(model) or (None, 0)
        self.handles = [] if target is None else [
            module.register_forward_hook(
                lambda _m, _i, out: self.logits.append(out[index] if isinstance(out, (tuple, list)) else out))
            for module in model.modules() if isinstance(module, target)]

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def clean_stream_loss(self, model, n, valid):
        config = model.config.get_text_config()
        loss_fn = load_balancing_loss(model)
        b = valid.shape[0]
        clean = tuple(logits.reshape(b, 2 * n, -1)[:, n:].reshape(b * n, -1) for logits in self.logits)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return loss_fn(clean, experts, config.num_experts_per_tok, valid.long())
