"""The MARS proposer: the target model drafts for itself from the forward that verifies.

Each step a running request is fed ``[last token | pending drafts | B mask tokens]``. vLLM schedules the drafts
and the masks together as its speculative tokens (``num_speculative_tokens = 2B``), so its own rejection sampler
verifies the drafts, and always stops at the first mask: the mask token's logit is -inf (``forbid_mask``), so
the target never predicts it, and the target's own token there is vLLM's usual bonus token. vLLM's bookkeeping
then rolls the KV of every rejected draft and of the masks back, as for any rejected speculative token.

Here, after that forward, the hidden states at the B mask positions go through the target's own LM head; their
argmax (mask excluded) are the next drafts. They are valid only when every draft before them was accepted (the
masks saw those drafts as context); otherwise the next step feeds B masks only, a plain AR step that also drafts.
No second model, no extra forward: the only extra work is the B masks' positions and B rows of the LM head.

Threshold mode (``drafts.py``): each draft's confidence, its mask's top probability, is kept with it per request
(``trust``); at the next step's verification ``trusted_positions`` names the scheduled drafts that pass anyway.

vLLM's ``custom_class`` interface passes a proposer token ids only, so ``_patches.py`` routes the runner's
hidden states to ``propose_mars`` (and the trusted drafts to vLLM's rejection sampler); ``propose`` itself
refuses, clearly, if that routing is missing.
"""

from __future__ import annotations

import torch

from hf_mars.generation.rules import confidence

from .drafts import forbid_mask, mask_span, proposal, trusted
from .options import GREEDY_BELOW, PLUGIN_CONFIG_KEY, checkpoint_facts, parse_tau_ladder

MISSING_PATCH = ("hf_mars.vllm: the MARS proposer was called through vLLM's plain custom_class interface, which "
                 "carries no hidden states: the hf-mars vLLM plugin is not active in this process. Check that "
                 "VLLM_PLUGINS (if set) includes 'hf_mars' and that hf-mars is installed in vLLM's environment.")


class MarsProposer:
    """Built by vLLM's custom_class loader with the engine's ``VllmConfig``."""

    def __init__(self, vllm_config):
        hf_config = vllm_config.model_config.hf_config
        self.mask_id, _ = checkpoint_facts(hf_config)
        k = vllm_config.speculative_config.num_speculative_tokens
        if k % 2:
            raise ValueError(f"MARS schedules 2B speculative tokens (B drafts + B masks); got {k}.")
        self.block = k // 2
        self.max_model_len = vllm_config.model_config.max_model_len
        self.model = None
        ours = (getattr(vllm_config, "additional_config", None) or {}).get(PLUGIN_CONFIG_KEY) or {}
        self.ladder = parse_tau_ladder(ours["tau_ladder"]) if ours.get("tau_ladder") else None
        self.trust: dict = {}  # request id -> (its drafts, which pass unverified): the last proposal's

    def load_model(self, target_model) -> None:
        """Keep the target (its LM head drafts) and make it never predict the mask token (``forbid_mask``)."""
        self.model = target_model
        forbid_mask(target_model, self.mask_id)

    def propose(self, *args, **kwargs):
        raise RuntimeError(MISSING_PATCH)

    def thresholds(self, requests, req_ids, load: int | None = None) -> list:
        """Each row's tau (None: lossless): the request's own ``mars_threshold`` (validated at admission), else for
        a greedy request the engine's ``tau_ladder`` at ``load``, the scheduler's running + waiting requests
        (without it, the step's batch)."""
        load = len(req_ids) if load is None else load
        out = []
        for req_id in req_ids:
            params = requests[req_id].sampling_params
            own = (params.extra_args or {}).get("mars_threshold") if params is not None else None
            greedy = params is not None and params.temperature < GREEDY_BELOW
            out.append(float(own) if own is not None else
                       self.ladder.tau_for(load) if self.ladder is not None and greedy else None)
        return out

    def trusted_positions(self, req_ids, spec_decode_metadata) -> list[int]:
        """The drafts scheduled this step that pass without the target's agreement, as indices into
        ``spec_decode_metadata.draft_token_ids`` (vLLM's target-logits rows): the last proposal's trusted drafts,
        while the scheduled tokens are still those drafts."""
        if not self.trust or spec_decode_metadata is None:
            return []
        scheduled = spec_decode_metadata.draft_token_ids.tolist()
        out, start = [], 0
        for req_id, count in zip(req_ids, spec_decode_metadata.num_draft_tokens):
            drafts, passes = self.trust.get(req_id, ((), ()))
            for j, (draft, passing) in enumerate(zip(drafts, passes)):
                if j >= count or scheduled[start + j] != draft:
                    break
                if passing:
                    out.append(start + j)
            start += count
        return out

    @torch.inference_mode()
    def propose_mars(self, sampled_token_ids, sample_hidden_states, spec_decode_metadata, num_tokens_no_spec,
                     num_spec_tokens=None, req_ids=None, taus=None):
        """Next speculative tokens per request, in batch order: ``[new drafts | B masks]``.

        ``sample_hidden_states`` holds, per request, one row per scheduled speculative token plus one (vLLM's
        logits rows); ``spec_decode_metadata`` says how many and which tokens were scheduled (None when none
        were). ``drafts.py`` says which masks to read and what to propose.
        ``num_spec_tokens``: what vLLM's scheduler allows next step (2B, or less under ``batch_ladder``);
        ``req_ids`` / ``taus``: the rows' request ids and thresholds (`thresholds`; None: lossless)."""
        block = self.block if num_spec_tokens is None else min(self.block, num_spec_tokens // 2)
        counts = [0] * len(sampled_token_ids)
        scheduled: list = []
        if spec_decode_metadata is not None:
            counts = list(spec_decode_metadata.num_draft_tokens)
            scheduled = spec_decode_metadata.draft_token_ids.tolist()
        rows, owners, offset, start = [], [], 0, 0
        for i, (n, sampled) in enumerate(zip(counts, sampled_token_ids)):
            first, count = mask_span(scheduled[start:start + n], len(sampled), self.mask_id, block)
            if count:  # row 0 of a request is its last token, row j + 1 its j-th scheduled token
                rows.extend(range(offset + first + 1, offset + first + count + 1))
                owners.append((i, count))
            offset, start = offset + n + 1, start + n
        drafts, sure = {}, {}
        if rows:
            index = torch.tensor(rows, device=sample_hidden_states.device)
            logits = self.model.compute_logits(sample_hidden_states[index])
            tokens = logits.argmax(-1).tolist()
            if taus is not None and any(tau is not None for tau in taus):
                confidences = confidence("probability", None, scores=logits.float(), of_distribution=True).tolist()
            else:
                confidences = [0.0] * len(tokens)
            at = 0
            for i, n in owners:
                drafts[i], sure[i], at = tokens[at:at + n], confidences[at:at + n], at + n
        self.trust = {}
        for i in drafts:
            passes = trusted(sure[i], taus[i] if taus is not None else None)
            if any(passes):
                self.trust[req_ids[i]] = (drafts[i], passes)
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled or not block:  # a prefill chunk, a discarded row, or a plain step (batch_ladder)
                out.append([])
                continue
            room = max(self.max_model_len - int(num_tokens_no_spec[i]) - 1, 0)
            out.append(proposal(drafts.get(i, []), self.mask_id, block)[:room])
        return out
