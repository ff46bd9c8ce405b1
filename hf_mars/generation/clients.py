"""Which logits processors and stopping criteria keep state, and so which calls they may be shown.

A processor or criterion that is a pure function of (input_ids, scores) can be called on speculative
candidates (histories extended by tokens that may be rejected): nothing is left behind. Anything else (a grammar
matcher, a user processor, a prefix function, lm-eval's stop-sequence criterion) only ever sees the calls plain
AR decoding makes. `sort_clients` reads the lists `generate` prepared and says how the decoder must treat them.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation import logits_process as _lp
from transformers.generation import stopping_criteria as _sc

from ._compat import criterion_eos_ids, criterion_max_length, suppressed_ids


def _present(module, names):
    return tuple(cls for cls in (getattr(module, name, None) for name in names) if cls is not None)


# Processors that ignore `input_ids` (they only reshape the distribution): a chain made of these alone is applied
# to all candidates of a step in one call.
HISTORY_FREE_PROCESSORS = _present(_lp, (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "LogitNormalization"))
# Pure functions of (input_ids, scores): applied to every candidate, on the history AR would show it. Exact types
# only: a subclass may add state. An object can declare itself pure with a ``mars_stateless = True`` attribute.
STATELESS_PROCESSORS = HISTORY_FREE_PROCESSORS + _present(_lp, (
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor", "WatermarkLogitsProcessor"))
STATELESS_CRITERIA = _present(_sc, (
    "MaxLengthCriteria", "MaxTimeCriteria", "StopStringCriteria", "EosTokenCriteria", "ConfidenceCriteria"))


def is_stateless(obj, known) -> bool:
    declared = getattr(obj, "mars_stateless", None)
    if declared is not None:
        return bool(declared)
    return type(obj) in known


def history_free(chain) -> bool:
    """True when no processor of the chain reads input_ids (one call serves every candidate slot)."""
    return all(isinstance(p, HISTORY_FREE_PROCESSORS) for p in chain)


@dataclasses.dataclass(slots=True)
class Clients:
    """The processors and criteria of one call, sorted by what MARS may show them."""

    processors: _lp.LogitsProcessorList  # the chain, without the token suppressions (folded into `suppress`)
    suppress: list  # token ids never emitted: the mask token and every SuppressTokens processor's
    stateful_procs: list  # processors that keep state: AR's calls only
    stateless_chain: _lp.LogitsProcessorList  # the rest of the chain (verify mode drafts from it)
    eos_ids: tuple  # tokens that end a row (EosTokenCriteria), in order (the first pads when pad_token_id is unset)
    max_length: int | None  # MaxLengthCriteria's limit
    criteria: _sc.StoppingCriteriaList  # other criteria, checked after every accepted token on its AR history
    lagging: _sc.StoppingCriteriaList | None  # stateful criteria called in AR order behind the rows
    exact: bool  # stateful clients that hold rows in lockstep: every position decided in order (`acceptor._exact`)

    @property
    def reads_history(self) -> bool:
        """Whether the token history must be kept on the device for processors or criteria to read."""
        return bool(self.exact or self.criteria or self.lagging is not None or not history_free(self.processors))


def _ids(value) -> list:
    """Token ids as a flat list of ints, from a tensor of any shape, an int or a (nested) list. A tensor is read
    with one op (as_tensor + flatten cost two more, on every call)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int):
        return [value]
    return [i for item in value for i in ([item] if isinstance(item, int) else _ids(item))]


def sort_clients(logits_processor, stopping_criteria, mask_token_id: int, output_scores: bool) -> Clients:
    """Sort generate's prepared processors and criteria (reused, never rebuilt).

    SuppressTokens processors (enable_mars adds one for the mask) are folded into one in-place -inf on the raw
    logits: the same result (they only ever write -inf), fewer ops per step. Stateful criteria beside no
    stateful processor need not hold rows together: a criterion decides where a row stops, never which tokens it
    gets, so it is called in AR's order behind the rows; with output_scores the exact path hands it each
    position's scores. With anything else stateful every emitted position is decided in order, rows in lockstep.
    """
    suppressed, kept = {mask_token_id}, []
    for proc in logits_processor if logits_processor is not None else []:
        if type(proc) is _lp.SuppressTokensLogitsProcessor:
            suppressed.update(_ids(suppressed_ids(proc)))
        else:
            kept.append(proc)
    pure = [is_stateless(p, STATELESS_PROCESSORS) for p in kept]
    stateful_procs = [p for p, is_pure in zip(kept, pure) if not is_pure]
    eos_ids, max_length, other = [], None, []
    for crit in stopping_criteria if stopping_criteria is not None else []:
        if isinstance(crit, _sc.EosTokenCriteria):
            eos_ids.extend(_ids(criterion_eos_ids(crit)))
        elif isinstance(crit, _sc.MaxLengthCriteria):
            limit = criterion_max_length(crit)
            max_length = limit if max_length is None else min(max_length, limit)
        else:
            other.append(crit)
    stateful_criteria = [c for c in other if not is_stateless(c, STATELESS_CRITERIA)]
    lag = bool(stateful_criteria) and not stateful_procs and not output_scores
    return Clients(
        processors=_lp.LogitsProcessorList(kept),
        suppress=sorted(suppressed),
        stateful_procs=stateful_procs,
        stateless_chain=_lp.LogitsProcessorList([p for p, is_pure in zip(kept, pure) if is_pure]),
        eos_ids=tuple(eos_ids),
        max_length=max_length,
        criteria=_sc.StoppingCriteriaList([c for c in other if not (lag and c in stateful_criteria)]),
        lagging=_sc.StoppingCriteriaList(stateful_criteria) if lag else None,
        exact=bool(stateful_procs or (stateful_criteria and not lag)),
    )
