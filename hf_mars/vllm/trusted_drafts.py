"""Threshold mode on vLLM >= 0.34 (a request's ``mars_threshold``, the engine's ``tau_ladder``) through vLLM's own
custom logits processors.
NOT YET RUN in an engine (no CPU build of 0.34): built and applied on vLLM 0.34.0's own types on CPU
(tests/test_vllm_registered.py), and vLLM's admission validator runs it.

The rule is the 0.32 path's (``drafts.trusted`` / ``drafts.pass_trusted``): a draft passes verification when the
target agrees with it *or* its mask was at least tau sure; the first draft that is neither gets the target's own
token. 0.34 lets a plugin do that without touching vLLM's code: a ``LogitsProcessor`` runs on every logits row
being verified, before vLLM's rejection sampler takes each row's argmax. Row ``j`` of a request verifies its
``j``-th speculative token, which is the input of row ``j + 1`` (``LogitsContext.input_ids``); where that draft
is trusted, its logit becomes the row's largest + 1, so greedy verification accepts it. vLLM's logprobs are
taken from the unprocessed logits (its default ``logprobs_mode``), so they stay the model's own.

The confidences come from ``MarsSpeculator.propose`` (``speculator_gpu.py``), which writes each request slot's
drafts' top probabilities into a buffer this processor reads: ``shared_state``, one per engine (keyed by the
``VllmConfig`` both receive in the worker). It computes them only for a batch that holds a trusting request.

The engine's ``tau_ladder`` (greedy requests without their own ``mars_threshold``) needs the scheduler's load,
running + waiting, which neither a speculator nor a logits processor sees on 0.34: ``_patches`` writes it on each
step's scheduler output (``_mars_load``, as on 0.32) and hands it to this state in the worker
(``_mars_worker_load``). vLLM imports this module in its API server too (to validate requests), so it imports no
model-runner code.
"""

from __future__ import annotations

import weakref

from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from hf_mars.generation.rules import one_token

from .drafts import pass_trusted
from .options import GREEDY_BELOW, engine_tau_ladder, parse_tau_ladder, request_threshold

PROCESSOR = "hf_mars.vllm.trusted_drafts:MarsTrustedDrafts"  # the FQCN vLLM's ModelConfig.logits_processors takes
NEVER = 2.0  # a slot's tau when it trusts nothing (no confidence reaches it)
_STATES: dict[int, tuple[weakref.ref, "SharedState"]] = {}  # id(vllm_config) -> (that config, its state)


class SharedState:
    """Per request slot: its own tau (NaN: none), whether it follows the engine's ``tau_ladder`` (a greedy request
    without its own tau), the tau in force (device), and its current drafts' confidences (device, 0: none)."""

    def __init__(self, max_num_reqs: int, width: int, device, ladder=None):
        import numpy as np
        import torch

        self.own = np.full(max_num_reqs, np.nan, dtype=np.float32)
        self.follows_ladder = np.zeros(max_num_reqs, dtype=bool)
        self.ladder = ladder  # serve.ladder.TauLadder, or None
        self.load: int | None = None  # the scheduler's running + waiting requests, this step (None: not written)
        self.tau = torch.full((max_num_reqs,), NEVER, dtype=torch.float32, device=device)
        self.confidence = torch.zeros((max_num_reqs, max(width, 1)), dtype=torch.float32, device=device)

    def taus(self, slots):
        """The tau in force for these slots (host): the own one, else the ladder's at the load (the batch's size
        when the scheduler wrote none), NEVER where none trusts a draft (tau 1 included: plain greedy)."""
        import numpy as np

        own = self.own[slots]
        taus = np.where(np.isnan(own), NEVER, own)
        if self.ladder is not None:
            load = len(slots) if self.load is None else self.load
            taus = np.where(self.follows_ladder[slots], self.ladder.tau_for(load), taus)
        return np.where(taus < 1.0, taus, NEVER).astype(np.float32)

    def trusting(self, slots) -> bool:
        """Whether any of these request slots trusts drafts now (host values: no device sync)."""
        return bool((self.taus(slots) < 1.0).any())


def shared_state(vllm_config, max_num_reqs: int, device) -> SharedState:
    """The state of this engine's worker, made by whichever of the speculator, the processor and the load wrapper
    asks first."""
    key = id(vllm_config)
    entry = _STATES.get(key)
    if entry is None or entry[0]() is not vllm_config:
        width = vllm_config.speculative_config.num_speculative_tokens
        ladder = engine_tau_ladder(vllm_config)
        state = SharedState(max_num_reqs, width, device, parse_tau_ladder(ladder) if ladder else None)
        # held weakly: an engine's state goes with its config (a process may build many engines)
        entry = _STATES[key] = (weakref.ref(vllm_config, lambda _, key=key: _STATES.pop(key, None)), state)
    return entry[1]


def register(model_config) -> None:
    """Add the processor to the target's ``logits_processors`` (once): vLLM builds it in each worker and runs its
    ``validate_params`` at admission."""
    processors = list(model_config.logits_processors or [])
    if PROCESSOR not in processors:
        model_config.logits_processors = processors + [PROCESSOR]


class MarsTrustedDrafts(LogitsProcessor):
    """vLLM's V2 ``LogitsProcessor`` for requests with a ``mars_threshold`` below 1 and, under the engine's
    ``tau_ladder``, greedy requests without one."""

    def __init__(self, vllm_config, req_states):
        self.state = shared_state(vllm_config, req_states.max_num_reqs, req_states.device)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """A bad ``mars_threshold`` (outside [0, 1], below 1 on a sampling request, a misspelt ``mars_*`` key) is
        a ValueError, which vLLM turns into a 400 at admission."""
        request_threshold(sampling_params.extra_args, sampling_params.temperature)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        import numpy as np

        own = request_threshold(sampling_params.extra_args, sampling_params.temperature)
        state = self.state
        state.own[req_idx] = np.nan if own is None else own
        state.follows_ladder[req_idx] = (own is None and state.ladder is not None
                                         and sampling_params.temperature < GREEDY_BELOW)
        return bool(state.follows_ladder[req_idx]) or (own is not None and not one_token(own))

    def apply(self, logits, ctx):
        """Row ``j`` of a request verifies the input of its row ``j + 1``: trusted where that draft's mask was at
        least tau sure (``drafts.pass_trusted`` then makes it the row's greedy choice)."""
        import torch

        slots_np = ctx.idx_mapping_np
        if not self.state.trusting(slots_np):
            return logits
        state = self.state
        state.tau[torch.as_tensor(slots_np, dtype=torch.long)] = torch.from_numpy(state.taus(slots_np)).to(
            state.tau.device, non_blocking=True)
        slots = ctx.expanded_idx_mapping.long()
        local = ctx.expanded_local_pos.long()
        verified = torch.roll(ctx.input_ids.long(), -1)
        same_request = torch.zeros_like(slots, dtype=torch.bool)
        same_request[:-1] = (slots[1:] == slots[:-1]) & (slots[:-1] >= 0)  # the last row of a request verifies none
        safe_slots = slots.clamp(min=0)
        width = state.confidence.shape[1]
        sure = state.confidence[safe_slots, local.clamp(max=width - 1)]
        trust = same_request & (local < width) & (sure >= state.tau[safe_slots])
        return pass_trusted(logits, torch.where(same_request, verified, -1), trust)
