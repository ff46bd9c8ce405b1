"""Lossless under every client: stateful logits processors and stopping criteria see AR decoding's calls only.

A stateful processor (a grammar matcher, a user object that counts tokens) or criterion (lm-eval's sticky
stop-sequence flags) must see exactly the calls plain decoding of the same output would make: one call per
emitted position, on every row's exact history, in order, never rolled back. The recorders below fail on
any other call; the output must still equal plain greedy at tau = 1 and in verify mode.
"""

import copy

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hf_mars.generation import enable_mars

PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]


def position_only_model(tok, seed=0, n_positions=256):
    """A GPT-2 whose input embeddings are all equal (mask included): its predictions depend on positions only,
    so mask predictions equal the AR ones and verify mode accepts most drafts, exercising multi-slot steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_mars import add_mask_token

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=n_positions, initializer_range=0.5,
                     tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    add_mask_token(model, tok)
    with torch.no_grad():
        model.transformer.wte.weight[:] = model.transformer.wte.weight[0]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return enable_mars(model)


@pytest.fixture(params=["peaky", "aligned"])
def peaky(request, make_model):
    """Two tiny models: a random Qwen2 with peaked distributions (acceptance varies per row) and a
    position-only GPT-2 (drafts mostly right)."""
    if request.param == "aligned":
        from hf_mars.testing_utils import build_char_tokenizer

        tok = build_char_tokenizer()
        return position_only_model(tok), tok
    model, tok = make_model(seed=1, initializer_range=0.5)
    enable_mars(model)
    return model, tok


def _enc(tok, batch):
    return tok(PROMPTS[:batch] if batch > 1 else PROMPTS[:1], return_tensors="pt", padding=True)


class StrictRecorder(LogitsProcessor):
    """Records every call; fails on a call AR decoding would not make (not one token longer, or a prefix that
    changed). Its output depends on its own state: the token that ended the history two calls ago is banned."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        if self.calls:
            prev = self.calls[-1]
            assert input_ids.shape[1] == prev.shape[1] + 1, f"call of length {input_ids.shape[1]} after {prev.shape[1]}"
            assert torch.equal(input_ids[:, :-1], prev), "the history changed between two calls (rolled back)"
        self.calls.append(input_ids.clone())
        if len(self.calls) >= 3:  # state-dependent rule: depends on what this object saw, not on input_ids
            seen = self.calls[-3][:, -1]
            scores = scores.clone()
            scores.scatter_(1, seen[:, None], -float("inf"))
        return scores


class UncopyableRecorder(StrictRecorder):
    """Like a processor holding a native matcher: it cannot be deep-copied."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy a native matcher")


class StickyCriterion(StoppingCriteria):
    """lm-eval-style: a per-row 'done' flag set once the row's last token is `token`, never cleared."""

    def __init__(self, token):
        self.token = token
        self.calls = []
        self.done = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.calls:
            assert input_ids.shape[1] == self.calls[-1].shape[1] + 1
            assert torch.equal(input_ids[:, :-1], self.calls[-1])
        self.calls.append(input_ids.clone())
        hit = input_ids[:, -1] == self.token
        self.done = hit if self.done is None else self.done | hit
        return self.done.clone()


def _run(model, enc, proc_cls=StrictRecorder, crit_token=None, max_new_tokens=24, **kw):
    proc = proc_cls()
    crit = StickyCriterion(crit_token) if crit_token is not None else None
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=kw.pop("do_sample", False),
                         logits_processor=LogitsProcessorList([proc]),
                         stopping_criteria=StoppingCriteriaList([crit]) if crit else None,
                         return_dict_in_generate=True, output_scores=True, **kw)
    return out, proc, crit


def _same_calls(a, b):
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _calls_follow_output(calls, sequences, P, offset):
    """Call i saw the output's first P + i + offset tokens (offset 0: processors, 1: criteria)."""
    assert calls, "never called"
    for i, ids in enumerate(calls):
        assert torch.equal(ids, sequences[:, :P + i + offset]), f"call {i} is not the output's history"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mars_kw", [
    dict(mars_threshold=1.0),
    dict(mars_threshold=1.0, mars_cache="block", mars_cache_block=8),
    dict(mars_verify=True, mars_threshold=0.0),
    dict(mars_verify=True, mars_threshold=0.5),
    dict(mars_verify=True, mars_threshold=0.0, mars_use_last_mask=True),
])
def test_stateful_objects_see_ar_calls_tau1_and_verify(peaky, batch, mars_kw):
    model, tok = peaky
    enc = _enc(tok, batch)
    e = tok.convert_tokens_to_ids("e")
    plain, p_proc, p_crit = _run(model, enc, crit_token=e)
    mars, m_proc, m_crit = _run(model, enc, crit_token=e, **mars_kw)
    assert torch.equal(plain.sequences, mars.sequences)
    _same_calls(p_proc.calls, m_proc.calls)
    _same_calls(p_crit.calls, m_crit.calls)
    if mars_kw.get("mars_verify") and mars_kw["mars_threshold"] == 0.0 and model.config.model_type == "gpt2":  # several slots per step were verified
        assert int(mars.mars_emitted_tokens.sum()) > int(mars.mars_forward_passes.sum())
    live = mars.mars_emitted_tokens  # the scores of emitted positions are AR's
    for i, (a, b) in enumerate(zip(plain.scores, mars.scores)):
        rows = live > i
        assert torch.allclose(a[rows], b[rows], atol=1e-4)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mars_kw", [
    dict(mars_threshold=0.0),
    dict(mars_threshold=0.5),
    dict(mars_threshold=0.0, mars_cache="block", mars_cache_block=8),
    dict(mars_threshold=0.3, mars_use_last_mask=True),
])
def test_stateful_objects_threshold_mode(peaky, batch, mars_kw):
    """tau < 1: the output may differ from AR, but each object saw AR's calls *for that output*, and the
    processor's state-dependent rule holds in the output; copyable processors still allow several tokens."""
    model, tok = peaky
    enc = _enc(tok, batch)
    P = enc.input_ids.shape[1]
    out, proc, crit = _run(model, enc, crit_token=tok.convert_tokens_to_ids("e"), **mars_kw)
    _calls_follow_output(proc.calls, out.sequences, P, 0)
    _calls_follow_output(crit.calls, out.sequences, P, 1)
    assert len(proc.calls) == out.sequences.shape[1] - P
    gen = out.sequences[:, P:]
    for r in range(gen.shape[0]):  # the processor's rule: never the token emitted three positions earlier
        n = int(out.mars_emitted_tokens[r])
        for i in range(3, n):
            assert gen[r, i] != gen[r, i - 3]
    if mars_kw["mars_threshold"] == 0.0:  # copyable stateful processors keep multi-token steps
        assert int(out.mars_emitted_tokens.sum()) > int(out.mars_forward_passes.sum())


def test_uncopyable_processor_falls_back_to_one_token(peaky, caplog):
    model, tok = peaky
    enc = _enc(tok, 4)
    plain, p_proc, _ = _run(model, enc, proc_cls=UncopyableRecorder)
    from transformers.utils import logging as hf_logging

    import hf_mars.generation.config as gen

    gen._logger.warning_once.cache_clear()  # the warning is given once per process
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            mars, m_proc, _ = _run(model, enc, proc_cls=UncopyableRecorder, mars_threshold=0.5)
    finally:
        hf_logging.disable_propagation()
    assert torch.equal(plain.sequences, mars.sequences)  # one token per step: plain greedy
    _same_calls(p_proc.calls, m_proc.calls)
    assert "mars_verify=True" in caplog.text
    assert torch.equal(mars.mars_forward_passes, mars.mars_emitted_tokens)
    # verify mode needs no copy and stays multi-token
    ver, v_proc, _ = _run(model, enc, proc_cls=UncopyableRecorder, mars_verify=True, mars_threshold=0.0)
    assert torch.equal(plain.sequences, ver.sequences)
    _same_calls(p_proc.calls, v_proc.calls)


def test_declared_stateless_processor_keeps_fast_path(peaky):
    """`mars_stateless = True` opts a pure user processor into speculative (ragged, per-row) use."""
    model, tok = peaky
    enc = _enc(tok, 4)

    class Pure(LogitsProcessor):
        mars_stateless = True

        def __call__(self, input_ids, scores):
            return scores - 0.1 * (input_ids[:, -1:] % 3).float()

    plain = model.generate(**enc, max_new_tokens=16, do_sample=False, logits_processor=LogitsProcessorList([Pure()]))
    mars = model.generate(**enc, max_new_tokens=16, do_sample=False, mars_verify=True, mars_threshold=0.0,
                          logits_processor=LogitsProcessorList([Pure()]), return_dict_in_generate=True)
    assert torch.equal(plain, mars.sequences)
    # ragged acceptance (no lockstep): rows take different numbers of tokens per forward
    fast = model.generate(**enc, max_new_tokens=24, do_sample=False, mars_threshold=0.5, eos_token_id=[],
                          logits_processor=LogitsProcessorList([Pure()]), return_dict_in_generate=True)
    assert len(set(fast.mars_forward_passes.tolist())) > 1
    del Pure.mars_stateless  # the same processor, undeclared: stateful, rows move in lockstep
    locked = model.generate(**enc, max_new_tokens=24, do_sample=False, mars_threshold=0.5, eos_token_id=[],
                            logits_processor=LogitsProcessorList([Pure()]), return_dict_in_generate=True)
    assert len(set(locked.mars_forward_passes.tolist())) == 1


def test_verify_sampling_with_stateful_processor(peaky):
    model, tok = peaky
    enc = _enc(tok, 4)
    P = enc.input_ids.shape[1]
    torch.manual_seed(3)
    out, proc, crit = _run(model, enc, crit_token=tok.convert_tokens_to_ids("e"), do_sample=True, top_k=20,
                           mars_verify=True, mars_threshold=0.0)
    _calls_follow_output(proc.calls, out.sequences, P, 0)
    _calls_follow_output(crit.calls, out.sequences, P, 1)


def test_exact_path_matches_copied_processor_state(peaky):
    """The real processor ends in the state AR decoding leaves it in (a copy replayed on plain output)."""
    model, tok = peaky
    enc = _enc(tok, 4)
    out, proc, _ = _run(model, enc, mars_threshold=0.2)
    replay = StrictRecorder()
    P = enc.input_ids.shape[1]
    for i in range(out.sequences.shape[1] - P):
        replay(out.sequences[:, :P + i], torch.zeros(4, len(tok) + 1))
    _same_calls(replay.calls, proc.calls)
    assert copy.deepcopy(proc).calls[-1].shape == proc.calls[-1].shape


class _Collect:
    """A batch-aware streamer: each row's streamed tokens."""

    def __init__(self, batch):
        self.rows, self.first = [[] for _ in range(batch)], True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.rows[0] += value.reshape(-1).tolist()

    def put_rows(self, rows):
        for r, tokens in enumerate(rows):
            self.rows[r] += tokens.tolist()

    def end(self):
        pass


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mars_kw", [
    dict(mars_threshold=1.0),
    dict(mars_verify=True, mars_threshold=0.0),
    dict(mars_threshold=1.0, mars_cache="block", mars_cache_block=8),
    dict(mars_verify=True, mars_threshold=0.5, mars_use_last_mask=True),
])
def test_stateful_criterion_alone_lags_behind_ragged_rows(peaky, batch, mars_kw):
    """A stateful criterion without a stateful processor: AR's calls, one for one, and AR's output, while the rows
    are not held in lockstep (they take different numbers of tokens per forward); streaming follows the calls."""
    model, tok = peaky
    enc = _enc(tok, batch)
    e = tok.convert_tokens_to_ids("e")

    def run(**kw):
        crit = StickyCriterion(e)
        streamer = _Collect(batch)
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, stopping_criteria=StoppingCriteriaList([crit]),
                             return_dict_in_generate=True, streamer=streamer, **kw)
        return out, crit, streamer

    plain, p_crit, _ = run(mars=False)
    mars, m_crit, streamer = run(**mars_kw)
    assert torch.equal(plain.sequences, mars.sequences)
    _same_calls(p_crit.calls, m_crit.calls)
    P = enc.input_ids.shape[1]
    for r in range(batch):
        assert streamer.rows[r] == mars.sequences[r, P:P + int(mars.mars_emitted_tokens[r])].tolist()
    if mars_kw.get("mars_verify") and mars_kw["mars_threshold"] == 0.0 and model.config.model_type == "gpt2":
        assert int(mars.mars_emitted_tokens.sum()) > int(mars.mars_forward_passes.sum())


def test_lagging_criterion_costs_no_forwards(make_model):
    """A stateful criterion alone does not hold the batch back: with one that never fires, every row takes the
    forwards it takes without it (rows stay ragged), where lockstep (the exact path, which output_scores keeps)
    takes more."""
    from hf_mars.generation import enable_mars

    model, tok = make_model(seed=1, initializer_range=0.5)
    enable_mars(model)
    enc = _enc(tok, 4)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, return_dict_in_generate=True, mars=True,
              mars_verify=True, mars_threshold=0.0)
    never = tok.convert_tokens_to_ids("<|mask|>")  # never emitted

    def forwards(**extra):
        crit = StoppingCriteriaList([StickyCriterion(never)]) if extra.pop("criterion", True) else None
        out = model.generate(**enc, stopping_criteria=crit, **kw, **extra)
        return out.mars_forward_passes.tolist(), out.sequences

    free, want = forwards(criterion=False)
    lagging, got = forwards()
    lockstep, _ = forwards(output_scores=True)
    assert torch.equal(got, want)
    assert lagging == free and len(set(free)) > 1, (lagging, free)  # ragged rows, each at its own pace
    assert sum(lockstep) > sum(lagging), (lockstep, lagging)


@pytest.mark.parametrize("mars_kw", [dict(mars_threshold=0.0), dict(mars_threshold=0.5, mars_use_last_mask=True)])
def test_lagging_criterion_threshold_mode_sees_the_outputs_history(peaky, mars_kw):
    """τ < 1: the output may differ from AR's, but the criterion saw AR's calls for that output, rows it stopped end
    right at the stop, and the stream is the output."""
    model, tok = peaky
    enc = _enc(tok, 4)
    P = enc.input_ids.shape[1]
    e = tok.convert_tokens_to_ids("e")
    crit, streamer = StickyCriterion(e), _Collect(4)
    out = model.generate(**enc, max_new_tokens=24, do_sample=False, stopping_criteria=StoppingCriteriaList([crit]),
                         return_dict_in_generate=True, streamer=streamer, mars=True, **mars_kw)
    _calls_follow_output(crit.calls, out.sequences, P, 1)
    for r in range(4):
        n = int(out.mars_emitted_tokens[r])
        row = out.sequences[r, P:P + n].tolist()
        assert streamer.rows[r] == row
        if e in row:  # stopped by the criterion at its first `e` (or by EOS / the length limit before it)
            assert row.index(e) == n - 1
