"""The MARS speculator inside vLLM >= 0.34's GPU model runner (``speculator.py`` registers it). NOT YET RUN in an
engine (no CPU build of 0.34); built by vLLM 0.34.0's own init_speculator and run on its InputBatch on CPU
(tests/test_vllm_registered.py).

Each step a request is fed ``[last token | pending drafts | masks]`` as its speculative tokens; vLLM's rejection
sampler verifies them and stops at the first mask (``forbid_mask``); ``propose`` reads the hidden states at the
first B masks through the target's LM head, and ``drafts.py`` decides which masks count and what comes next. The
same bookkeeping as the 0.32 proposer (``proposer.py``); what 0.34 changes:

- One width for every request. ``propose`` returns a ``[num_reqs, num_speculative_tokens]`` tensor and vLLM
  schedules up to that many tokens for each request (dropping what ``max_model_len`` or the token budget cuts);
  a proposal cannot be shorter. So after a rejection a request feeds 2B masks, not B: the first B draft, the
  other B are rejected with them (B extra positions that 0.32 did not feed). Under ``batch_ladder`` the width
  of the next step is ``num_speculative_tokens`` (vLLM sets the columns beyond it to -1).
- The target model reaches only ``DraftModelSpeculator`` subclasses (``load_model``), and we need its LM head.
  So this is one, but it loads no draft model (``self.model`` stays None, so vLLM sees no draft model: no
  weight sharing, reload or sleep-mode handling of one), has no attention layers and no KV cache of its own
  (``set_attn``), and captures no CUDA graph (``capture``).
- The scheduled tokens are read back from the step's own inputs: request i's logits rows ``cu_num_logits[i] ..
  + n`` hold its last token, then its n speculative tokens, in ``input_ids[logits_indices]``.

Cost: two device-to-host copies a step (the scheduled tokens with ``num_sampled``, then the drafts' argmax) and
one host-to-device copy of the proposals, in plain Python per request. Correct, and small beside a forward, but
they hold the CPU until the forward ends, which a GPU run has still to measure.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from hf_mars.generation.rules import confidence

from .drafts import forbid_mask, mask_span, proposal
from .options import checkpoint_facts
from .trusted_drafts import shared_state


class MarsSpeculator(DraftModelSpeculator):
    """Built by vLLM's ``init_speculator`` with ``(vllm_config, device)``."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.mask_id, _ = checkpoint_facts(vllm_config.model_config.hf_config)
        self.width = self.num_speculative_steps  # 2B (MarsSpeculatorConfig)
        self.block = self.width // 2
        self.model = None  # no draft model: vLLM's get_draft_model() reports none
        self.draft_attn_layer_names = set()  # nor draft attention layers
        self.target = None
        self.proposals = torch.full((self.max_num_reqs, self.width), self.mask_id, dtype=torch.int64, device=device)
        self.trust = shared_state(vllm_config, self.max_num_reqs, device)  # threshold mode's (trusted_drafts.py)

    def load_model(self, target_model) -> None:
        """Keep the target and forbid its mask token; there is no draft model to load."""
        self.target = target_model
        forbid_mask(target_model, self.mask_id)

    def load_draft_model(self, target_model, target_attn_layer_names):
        # MARS's load_model replaces this on the vLLM it was written for: a call means vLLM's speculator API moved
        raise RuntimeError("hf_mars: vLLM asked the MARS speculator to load a draft model, which MARS does not have "
                           "(the target drafts for itself): this vLLM's speculator API differs from 0.34.0's. Run "
                           "without speculative_config, or use vLLM 0.32 (pip install -e '.[vllm]').")

    def set_attn(self, *args, **kwargs) -> None:
        return None  # no attention of its own: the masks ran in the target's forward

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        return None

    def capture(self) -> None:
        return None

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None) -> torch.Tensor:
        """Next step's speculative tokens, ``[num_reqs, 2B]`` in batch order: ``[new drafts | masks]``.

        ``last_hidden_states``: the target's hidden states at every position of the step; ``num_sampled``: tokens
        each request emitted (accepted drafts + the target's own; 0 for a prefill chunk);
        ``num_speculative_tokens``: the next step's width (2B, less under ``batch_ladder``)."""
        num_reqs = input_batch.num_reqs
        width = self.width if num_speculative_tokens is None else min(self.width, num_speculative_tokens)
        if dummy_run or num_reqs == 0 or width == 0:  # a warm-up step, or a plain step next: vLLM writes -1
            return self.proposals[:num_reqs]
        block = min(self.block, width // 2)
        counts = input_batch.num_draft_tokens_per_req  # None when no request had speculative tokens
        cu = input_batch.cu_num_logits_np
        step = torch.cat([num_sampled[:num_reqs].long(), input_batch.input_ids[input_batch.logits_indices].long()])
        step = step.tolist()
        sampled, tokens = step[:num_reqs], step[num_reqs:]
        rows, owners = [], []
        for i in range(num_reqs):
            start, n = int(cu[i]) + 1, 0 if counts is None else int(counts[i])
            first, count = mask_span(tokens[start:start + n], sampled[i], self.mask_id, block)
            if count:
                rows.extend(range(start + first, start + first + count))
                owners.append((i, count))
        slots = input_batch.idx_mapping_np[:num_reqs]
        # each draft's confidence is kept while a request here trusts drafts, and always under a tau ladder: the load
        # may lower a tau before the next step, whose drafts these are (the processor must never read stale ones)
        trusting = self.trust.ladder is not None or self.trust.trusting(slots)
        drafts, sure = {}, {}
        if rows:
            positions = input_batch.logits_indices[torch.tensor(rows, device=input_batch.logits_indices.device)]
            logits = self.target.compute_logits(last_hidden_states[positions])
            argmax = logits.argmax(-1).tolist()
            top = (confidence("probability", None, scores=logits.float(), of_distribution=True).tolist()
                   if trusting else [0.0] * len(argmax))
            at = 0
            for i, count in owners:
                drafts[i], sure[i], at = argmax[at:at + count], top[at:at + count], at + count
        pad = [self.mask_id] * (self.width - width)
        rows_out = [proposal(drafts.get(i, []), self.mask_id, block, width) + pad for i in range(num_reqs)]
        self.proposals[:num_reqs].copy_(torch.tensor(rows_out, dtype=torch.int64))
        if trusting:  # each slot's drafts' top probabilities, 0 under its masks (never trusted)
            columns = self.trust.confidence.shape[1]
            sure_rows = [(sure.get(i, [])[:block] + [0.0] * columns)[:columns] for i in range(num_reqs)]
            self.trust.confidence[torch.as_tensor(slots, device=self.trust.confidence.device)] = torch.tensor(
                sure_rows, dtype=torch.float32, device=self.trust.confidence.device)
        return self.proposals[:num_reqs]
