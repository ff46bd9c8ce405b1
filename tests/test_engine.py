"""Rows that come and go (`MARSEngine`): a request joins the running batch between steps and leaves when done.

The contract: each row decodes exactly what it decodes alone (tau = 1 and verify: plain greedy), whichever step it
joined at, whoever left before it, at its own tau; rows that cannot share a batch step beside it, on their own.
"""

import pytest
import torch
from transformers import GenerationConfig

from hf_mars.generation import enable_mars
from hf_mars.generation.engine import MARSEngine

PROMPTS = ["hello world", "a", "the quick brown fox", "xy", "zzz top", "b c d"]


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=0.5)
    enable_mars(model)
    return model, tok


def _gc(tok, max_new, **kw):
    kw.setdefault("do_sample", False)
    return GenerationConfig(max_new_tokens=max_new, eos_token_id=kw.pop("eos_token_id", None),
                            pad_token_id=tok.pad_token_id, **kw)


def _alone(model, tok, prompt, max_new, **kw):
    """The row decoded by its own generate call, with the same generation config."""
    enc = tok([prompt], return_tensors="pt")
    gc_kw = {k: kw.pop(k) for k in ("eos_token_id", "repetition_penalty") if k in kw}
    out = model.generate(**enc, generation_config=_gc(tok, max_new, **gc_kw), **kw)
    return out[0, enc.input_ids.shape[1]:].tolist()


def _drive(engine, tok, arrivals, default_tau, **mars_args):
    """Add each (step, prompt, max_new, tau) when the engine reaches that step; run until every row is done."""
    got, done, step = {}, set(), 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or len(engine):
        while pending and pending[0][0] <= step:
            _, prompt, max_new, tau = pending.pop(0)
            ids = tok([prompt], return_tensors="pt").input_ids[0].tolist()
            events = engine.add(prompt, ids, _gc(tok, max_new), tau, **mars_args)
            _collect(events, got, done)
        if len(engine):
            _collect(engine.step(default_tau), got, done)
        step += 1
    assert done == {a[1] for a in arrivals}
    return got


def _collect(events, got, done):
    for handle, tokens, finished, _ in events:
        assert handle not in done, "no tokens after a row finished"
        got.setdefault(handle, []).extend(tokens)
        if finished:
            done.add(handle)


# threshold mode with the masks on every step: the default's plain steps follow each run's timing, so a row decoded
# in the engine and alone would differ wherever the two runs measured differently
MASKS = dict(mars_plain_steps=False)


@pytest.mark.parametrize("mode", [MASKS, dict(mars_verify=True)], ids=["threshold", "verify"])
def test_rows_joining_between_steps_decode_what_they_decode_alone(peaky, mode):
    model, tok = peaky
    verify = bool(mode.get("mars_verify"))
    arrivals = [(0, PROMPTS[0], 24, None), (0, PROMPTS[1], 6, None), (2, PROMPTS[2], 16, None),
                (3, PROMPTS[3], 30, 1.0), (7, PROMPTS[4], 12, None), (8, PROMPTS[5], 3, 0.2)]
    engine = MARSEngine(model)
    got = _drive(engine, tok, arrivals, default_tau=0.3 if verify else 0.5, **mode)
    for _, prompt, max_new, tau in arrivals:
        tau = tau if tau is not None else (0.3 if verify else 0.5)
        expected = _alone(model, tok, prompt, max_new, mars_threshold=tau, **mode)
        assert got[prompt] == expected, prompt
        if tau >= 1.0 or verify:  # exactly plain greedy
            assert got[prompt] == _alone(model, tok, prompt, max_new)
    assert engine.batch is None and not engine.solo  # everyone left


def test_a_short_request_finishes_before_a_long_one_that_came_first(peaky):
    model, tok = peaky
    engine = MARSEngine(model)
    finished_at = {}
    long_ids = tok([PROMPTS[2]], return_tensors="pt").input_ids[0].tolist()
    engine.add("long", long_ids, _gc(tok, 200), 1.0)
    step = 0
    while len(engine):
        if step == 3:
            engine.add("short", tok([PROMPTS[1]], return_tensors="pt").input_ids[0].tolist(), _gc(tok, 5), 1.0)
        for handle, _, finished, _ in engine.step(1.0):
            if finished:
                finished_at[handle] = step
        step += 1
    assert finished_at["short"] < finished_at["long"] and finished_at["short"] <= 3 + 5


def test_cancelled_rows_leave_and_the_others_are_unchanged(peaky):
    model, tok = peaky
    engine = MARSEngine(model)
    got, done = {}, set()
    for p in PROMPTS[:4]:
        _collect(engine.add(p, tok([p], return_tensors="pt").input_ids[0].tolist(), _gc(tok, 20), 0.5, **MASKS),
                 got, done)
    step = 0
    while len(engine):
        if step == 2:
            engine.cancel([PROMPTS[0], PROMPTS[2]])
            assert [r.handle for r in engine.batch_rows] == [PROMPTS[1], PROMPTS[3]]
        _collect(engine.step(0.5), got, done)
        step += 1
    for p in (PROMPTS[1], PROMPTS[3]):
        assert got[p] == _alone(model, tok, p, 20, mars_threshold=0.5, **MASKS)
    assert engine.batch is None


def test_rows_that_read_the_history_decode_beside_the_batch(peaky):
    """A repetition penalty reads each row's history: such a row steps on its own, round-robin with the batch."""
    model, tok = peaky
    engine = MARSEngine(model)
    got, done = {}, set()
    plain = tok([PROMPTS[0]], return_tensors="pt").input_ids[0].tolist()
    penal = tok([PROMPTS[2]], return_tensors="pt").input_ids[0].tolist()
    _collect(engine.add("plain", plain, _gc(tok, 16), 0.5, **MASKS), got, done)
    _collect(engine.add("penalised", penal, _gc(tok, 16, repetition_penalty=1.3), 0.5, **MASKS), got, done)
    assert len(engine.solo) == 1 and engine.batch is not None
    while len(engine):
        _collect(engine.step(0.5), got, done)
    assert got["plain"] == _alone(model, tok, PROMPTS[0], 16, mars_threshold=0.5, **MASKS)
    assert got["penalised"] == _alone(model, tok, PROMPTS[2], 16, mars_threshold=0.5, repetition_penalty=1.3,
                                      **MASKS)


def test_eos_ends_a_row_in_the_middle_of_the_batch(peaky):
    model, tok = peaky
    free = _alone(model, tok, PROMPTS[0], 12, mars_threshold=0.5, **MASKS)
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # ends the first row mid-answer
    engine = MARSEngine(model)
    got, done = {}, set()
    for p in PROMPTS[:3]:
        ids = tok([p], return_tensors="pt").input_ids[0].tolist()
        _collect(engine.add(p, ids, _gc(tok, 12, eos_token_id=eos), 0.5, **MASKS), got, done)
    while len(engine):
        _collect(engine.step(0.5), got, done)
    for p in PROMPTS[:3]:
        assert got[p] == _alone(model, tok, p, 12, mars_threshold=0.5, eos_token_id=eos, **MASKS)
    assert got[PROMPTS[0]][-1] == eos and got[PROMPTS[0]].count(eos) == 1 and len(got[PROMPTS[0]]) < 12


@pytest.mark.parametrize("mode", [MASKS, dict(mars_verify=True)], ids=["threshold", "verify"])
def test_sampling_rows_join_and_leave(peaky, mode):
    """Sampling rows (verify: speculative sampling, with the drafts' distributions carried through merges and
    departures) join at different steps: every row ends within its limit, the mask token is never emitted, and a
    seed reproduces the whole run."""
    model, tok = peaky
    mask = model.config.mars["mask_token_id"]

    def run():
        torch.manual_seed(0)
        engine = MARSEngine(model)
        got, done, step, limits = {}, set(), 0, {}
        arrivals = [(2 * i, p, 10 + 3 * i) for i, p in enumerate(PROMPTS)]  # one joins every other step
        while arrivals or len(engine):
            while arrivals and arrivals[0][0] <= step:
                _, prompt, max_new = arrivals.pop(0)
                limits[prompt] = max_new
                ids = tok([prompt], return_tensors="pt").input_ids[0].tolist()
                gc = _gc(tok, max_new, do_sample=True, temperature=0.9, top_k=20)
                _collect(engine.add(prompt, ids, gc, None, default_tau=0.3, **mode), got, done)
            if len(engine):
                _collect(engine.step(0.3), got, done)
            step += 1
        return got, limits

    got, limits = run()
    for prompt, tokens in got.items():
        assert 1 <= len(tokens) <= limits[prompt] and mask not in tokens
    assert run()[0] == got


@pytest.mark.parametrize("drafts", ["peaky", "mostly right"])
@pytest.mark.parametrize("pattern", [("chain",), ("tree", "chain"), ("chain", "chain", "tree"), "random"])
def test_a_served_batch_switching_between_tree_and_chain_decodes_plain_greedy(peaky, monkeypatch, pattern, drafts):
    """Verify's default in flight (`engine.measured_step`): each batch step in the tree or the chain, whichever the
    process measured faster for this many rows; the rows' pending drafts change form between the two (and are cut
    to what each row may still emit). Whatever the sequence of layouts (forced here, rows joining and leaving,
    drafts that are mostly right up to every row's length limit), every row decodes exactly plain greedy."""
    import random

    from test_stateful_clients import position_only_model

    from hf_mars.generation import policy

    model, tok = peaky
    if drafts == "mostly right":
        model = position_only_model(tok)
    rng, taken = random.Random(0), []

    def choose(record):
        layout = rng.choice(policy.ENGINE_LAYOUTS) if pattern == "random" else pattern[len(taken) % len(pattern)]
        taken.append(layout)
        return layout

    monkeypatch.setattr(policy.CallRecord, "choose", choose)
    arrivals = [(0, PROMPTS[0], 24, None), (0, PROMPTS[1], 6, None), (2, PROMPTS[2], 16, None),
                (3, PROMPTS[3], 30, None), (7, PROMPTS[4], 12, None), (8, PROMPTS[5], 3, None)]
    got = _drive(MARSEngine(model), tok, arrivals, default_tau=0.3, mars_verify=True)
    assert set(taken) == (set(pattern) if pattern != "random" else set(policy.ENGINE_LAYOUTS))
    for _, prompt, max_new, _ in arrivals:
        assert got[prompt] == _alone(model, tok, prompt, max_new), prompt


def test_the_served_layout_is_measured_per_number_of_rows_and_an_asked_tree_is_kept(peaky):
    """Unforced, the engine's record warms each layout up for the rows it sees and then takes the faster; a batch
    whose tree shape was asked for (or that decodes no tree) steps as it is."""
    from hf_mars.generation.policy import choices_for, record_for

    model, tok = peaky
    arrivals = [(0, p, 20, None) for p in PROMPTS[:2]]
    _drive(MARSEngine(model), tok, arrivals, default_tau=0.3, mars_verify=True)
    steps = choices_for(model, 2, "engine")
    assert set(steps) == {"tree", "chain"} and record_for(model, 2, "engine").calls == steps
    before = dict(choices_for(model, 1, "engine"))
    _drive(MARSEngine(model), tok, [(0, PROMPTS[0], 20, None)], default_tau=0.3, mars_verify=True,
           mars_draft_tree="1,1,1")
    _drive(MARSEngine(model), tok, [(0, PROMPTS[0], 20, None)], default_tau=0.3, mars_verify=True,
           mars_draft_tree="chain")
    assert dict(choices_for(model, 1, "engine")) == before


@pytest.mark.parametrize("mode", [MASKS, dict(mars_verify=True), dict(mars_verify=True, mars_draft_tree="2,2,1,1")],
                         ids=["threshold", "verify", "tree"])
def test_sliding_window_rows_join_while_their_calls_fit_the_window(mode, monkeypatch):
    """A model with sliding-window layers (Gemma 3's hybrid cache): requests whose calls fit inside the window share
    the batch (`RollbackCache.ragged_rows`), joining at different steps with prompts of different lengths, each
    decoding what it decodes alone (verify: plain greedy); with a window the calls run past, each steps on its own."""
    from architectures import build

    from hf_mars.generation import engine as engine_module
    from hf_mars.testing_utils import build_char_tokenizer
    from hf_mars.training.tokens import set_mars_metadata

    tok, verify = build_char_tokenizer(), bool(mode.get("mars_verify"))
    default_tau = 0.3 if verify else 0.5
    arrivals = [(0, PROMPTS[0], 24, None), (0, PROMPTS[1], 6, None), (2, PROMPTS[2], 16, None),
                (3, PROMPTS[3], 30, 1.0), (7, PROMPTS[4], 12, None)]
    merged = []
    monkeypatch.setattr(engine_module, "merge", lambda dec, other: merged.append(1) or dec.merge(other))
    for window, shared in ((256, True), (12, False)):
        model = enable_mars(build("gemma3_text", tok, sliding_window=window))
        set_mars_metadata(model.config, block_size=4, trained_steps=1)
        merged.clear()
        if "mars_draft_tree" in mode and not shared:  # (a tree needs the cache to hold its gaps: asked, refused)
            with pytest.raises(ValueError, match="a sliding window the call does not fit in"):
                _drive(MARSEngine(model), tok, arrivals, default_tau=default_tau, **mode)
            continue
        got = _drive(MARSEngine(model), tok, arrivals, default_tau=default_tau, **mode)
        assert bool(merged) == shared, (window, len(merged))
        for _, prompt, max_new, tau in arrivals:
            tau = default_tau if tau is None else tau
            assert got[prompt] == _alone(model, tok, prompt, max_new, mars_threshold=tau, **mode), (window, prompt)
            if tau >= 1.0 or verify:
                assert got[prompt] == _alone(model, tok, prompt, max_new), (window, prompt)
