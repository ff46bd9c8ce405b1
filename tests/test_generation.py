"""MARS decoding inside model.generate: equivalences on tiny random models.

The strongest checks: tau = 1 and verify mode reproduce plain greedy token for token on a
left-padded batch, and batched cached decoding equals a naive per-row, cache-free
re-implementation of the method (docs/method.md) (which exercises ragged per-row acceptance).
"""

import inspect
import math
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation import StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

import hf_mars.generation as gen
from hf_mars.generation import enable_mars, mars_generate
from hf_mars.generation.cache import RollbackCache
from hf_mars.generation.decoder import MARSDecoder
from hf_mars.generation.tree import TreeDecoder
from hf_mars.hub import write_custom_generate

# the cache argument's name: `cache` from transformers 5.24 (`past_key_values` is its deprecated alias there)
CACHE_ARG = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"

PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]
MAX_NEW = 16


@pytest.fixture
def peaky(make_model):
    """A random tiny model with a large init scale: peaked distributions, so acceptance varies per row."""
    model, tok = make_model(seed=1, initializer_range=0.5)
    enable_mars(model)
    return model, tok


@pytest.fixture
def flat(make_model):
    model, tok = make_model(seed=0)
    enable_mars(model)
    return model, tok


def _batch(tok, prompts=PROMPTS):
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any(), "the batch must be left-padded"
    return enc


def _greedy(model, enc, **kw):
    return model.generate(**enc, max_new_tokens=kw.pop("max_new_tokens", MAX_NEW), do_sample=False, **kw)


def _counting_compile_config(graphs, **kw):
    """A CompileConfig (compiling on CPU too) whose backend counts compilations and runs the captured graph as is."""
    from transformers import CompileConfig

    from hf_mars._compat import compile_on_any_device

    def backend(gm, inputs, **options):
        graphs.append(1)
        return gm.forward

    return compile_on_any_device(CompileConfig(backend=backend, mode=None, **kw))


def _forget_compiled(model):
    """Fresh Dynamo state; no compiled call or static cache size kept on the model."""
    torch._dynamo.reset()
    for key in ("_compiled_call", "_mars_compiled_call", "_mars_compiled_read", "_mars_compiled_prefill",
                "_mars_static_cache_length"):
        model.__dict__.pop(key, None)


class ForwardCounter:
    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.count += 1

    def close(self):
        self.handle.remove()


# ------------------------------------------------------------------------------------------ equivalences


@pytest.mark.parametrize("cache", ["sliding", "block", "block_trained"])
@pytest.mark.parametrize("B", [1, 4, 8])
def test_tau1_equals_greedy_left_padded(peaky, B, cache):
    model, tok = peaky
    enc = _batch(tok)
    ref = _greedy(model, enc)
    out = _greedy(model, enc, mars_threshold=1.0, mars_block_size=B, mars_cache=cache, mars_cache_block=5,
                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    # one token per forward exactly
    assert torch.equal(out.mars_forward_passes, out.mars_emitted_tokens)


def test_call_statistics_are_a_debug_log_record_and_the_old_file_variable_warns(peaky, caplog, monkeypatch,
                                                                                 tmp_path):
    """The per-call statistics a server cannot read from the output object: one DEBUG record on a fixed logger,
    equal to the output's fields; nothing at the default level; HF_MARS_STATS (no longer read) warns."""
    import json
    import logging

    from hf_mars.generation import api

    model, tok = peaky
    enc = _batch(tok)
    out = _greedy(model, enc, mars_verify=True, mars_draft_tree="chain", return_dict_in_generate=True)
    assert not [r for r in caplog.records if r.name == "hf_mars.generation.stats"]  # silent by default
    with caplog.at_level(logging.DEBUG, logger="hf_mars.generation.stats"):
        _greedy(model, enc, mars_verify=True, mars_draft_tree="chain")
    (record,) = [r for r in caplog.records if r.name == "hf_mars.generation.stats"]
    stats = json.loads(record.getMessage().removeprefix("MARS call: "))
    assert stats["forward_passes"] == out.mars_forward_passes.tolist()
    assert stats["emitted_tokens"] == out.mars_emitted_tokens.tolist() and stats["verify"] is True
    monkeypatch.setenv("HF_MARS_STATS", str(tmp_path / "stats.jsonl"))
    api._stats_file_removed.cache_clear()
    with pytest.warns(FutureWarning, match="hf_mars.generation.stats"):
        _greedy(model, enc, mars_verify=True, mars_draft_tree="chain")
    assert not (tmp_path / "stats.jsonl").exists()


def test_tau1_sliding_feeds_no_masks(peaky):
    """One-token mode reads only candidate 0, so its decode steps are plain 1-token AR steps (no mask columns)."""
    model, tok = peaky
    enc = tok(["hello world"], return_tensors="pt")
    widths = []
    handle = model.register_forward_pre_hook(lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        out = _greedy(model, enc, mars_threshold=1.0, mars_block_size=4)
    finally:
        handle.remove()
    assert torch.equal(out, _greedy(model, enc))
    assert widths[0] == enc.input_ids.shape[1] and set(widths[1:]) == {1}


@pytest.mark.parametrize("tau,B,last", [(0.0, 4, False), (0.5, 4, False), (0.0, 2, True), (0.5, 8, False)])
def test_verify_equals_greedy(peaky, tau, B, last):
    model, tok = peaky
    enc = _batch(tok)
    ref = _greedy(model, enc, max_new_tokens=24)
    out = _greedy(model, enc, max_new_tokens=24, mars_verify=True, mars_threshold=tau, mars_block_size=B,
                  mars_use_last_mask=last, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    if tau == 0.0:  # drafts got accepted somewhere (otherwise the test would not exercise verification)
        assert (out.mars_emitted_tokens > out.mars_forward_passes).any()


def test_verify_equals_greedy_flat_model_batch1(flat):
    model, tok = flat
    enc = tok(["hello"], return_tensors="pt")
    ref = _greedy(model, enc, max_new_tokens=20)
    out = _greedy(model, enc, max_new_tokens=20, mars_verify=True, mars_threshold=0.0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "tau,B,cache,last",
    [(0.3, 4, "sliding", False), (0.6, 2, "sliding", True), (0.3, 4, "block", True), (0.6, 4, "block", False),
     (0.3, 4, "block_trained", False), (0.9, 2, "block_trained", True)],
)
def test_batched_equals_per_row_reference(peaky, tau, B, cache, last):
    """Ragged acceptance, EOS mid-run, chunk waits: the batched cached loop equals the cache-free spec per row."""
    model, tok = peaky
    enc = _batch(tok)
    out = model.generate(**enc, max_new_tokens=24, do_sample=False, mars_threshold=tau, mars_block_size=B,
                         mars_cache=cache, mars_cache_block=6, mars_use_last_mask=last, return_dict_in_generate=True)
    P = enc.input_ids.shape[1]
    mask_id = model.config.mars["mask_token_id"]
    counts = set()
    for r, prompt in enumerate(PROMPTS):
        ref, forwards = gen.reference_decode(model, tok(prompt).input_ids, mask_id, block_size=B, threshold=tau,
                                             max_new_tokens=24, eos_token_ids=(tok.eos_token_id,), use_last_mask=last,
                                             cache=cache, cache_block=6)
        assert out.sequences[r, P:P + len(ref)].tolist() == ref
        assert (out.sequences[r, P + len(ref):] == tok.pad_token_id).all()
        assert int(out.mars_emitted_tokens[r]) == len(ref)
        if cache == "sliding":
            assert int(out.mars_forward_passes[r]) == forwards
        counts.add((len(ref), forwards))
    assert len(counts) > 1  # rows really went their own ways


@pytest.mark.parametrize("last,expected", [(False, 4), (True, 5)])
def test_tau0_tokens_per_forward(flat, last, expected):
    model, tok = flat
    enc = tok(["hello"], return_tensors="pt")
    counter = ForwardCounter(model)
    try:
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, mars_threshold=0.0, mars_block_size=4,
                             mars_use_last_mask=last, min_new_tokens=40)
    finally:
        counter.close()
    emitted = out.shape[1] - enc.input_ids.shape[1]
    assert emitted == 40
    assert counter.count == math.ceil(40 / expected)
    assert emitted / counter.count >= 3


def test_custom_generate_callable_and_scores(peaky):
    model, tok = peaky
    enc = _batch(tok)
    ref = model.generate(**enc, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    # transformers' own route: generate(custom_generate=callable)
    out = type(model).generate(model, **enc, max_new_tokens=10, do_sample=False, custom_generate=mars_generate,
                               mars_threshold=1.0, suppress_tokens=[model.config.mars["mask_token_id"]],
                               output_scores=True, return_dict_in_generate=True)
    assert isinstance(out, gen.MARSGenerateOutput)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for t, (a, b) in enumerate(zip(out.scores, ref.scores)):
        live = out.mars_emitted_tokens > t  # rows still decoding (AR keeps scoring finished rows)
        torch.testing.assert_close(a[live], b[live], atol=1e-4, rtol=1e-4)
        assert (a[~live].argmax(-1) == tok.pad_token_id).all() and (a[~live].amax(-1) == 0).all()
    # transition scores: finite everywhere (AR gives finite values after a row's EOS too), equal on real tokens
    P = enc.input_ids.shape[1]
    ts = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    ts_ref = model.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=True)
    assert torch.isfinite(ts).all()
    real = out.sequences[:, P:] != tok.pad_token_id
    assert (~real).any(), "some row must finish early for this check"
    torch.testing.assert_close((ts * real).sum(1), (ts_ref * real).sum(1), atol=1e-4, rtol=1e-4)
    assert torch.equal(ts[~real], torch.zeros_like(ts[~real]))
    multi = model.generate(**enc, max_new_tokens=10, mars_threshold=0.3, output_scores=True,
                           return_dict_in_generate=True)
    assert len(multi.scores) == multi.sequences.shape[1] - enc.input_ids.shape[1]
    P = enc.input_ids.shape[1]
    for t, step_scores in enumerate(multi.scores):  # the emitted token is the argmax of its processed scores
        live = multi.mars_emitted_tokens > t
        assert torch.equal(step_scores.argmax(-1)[live], multi.sequences[live, P + t])


# ------------------------------------------------------------------------------------------ stops


def test_stops_cut_exactly(peaky):
    model, tok = peaky
    enc = tok(["hello world"], return_tensors="pt")
    P = enc.input_ids.shape[1]
    free = _greedy(model, enc, max_new_tokens=30, eos_token_id=[])[0, P:].tolist()
    # a second EOS id: a token the free run produces at position 5
    stop_tok = free[5]
    first = free.index(stop_tok)
    for kw in ({"mars_threshold": 0.0, "mars_plain_steps": False}, {"mars_threshold": 0.0, "mars_cache": "block"},
               {"mars_verify": True}):
        out = model.generate(**enc, max_new_tokens=30, do_sample=False, eos_token_id=[tok.eos_token_id, stop_tok],
                             **kw)[0, P:].tolist()
        assert out[-1] == stop_tok and stop_tok not in out[:-1]
        if "mars_verify" in kw:
            assert out == free[:first + 1]
    # max_new_tokens: exactly that many
    for n in (1, 3, 7):
        out = model.generate(**enc, max_new_tokens=n, mars_threshold=0.0, eos_token_id=[])
        assert out.shape[1] == P + n
    # stop_strings (needs tokenizer=): output = the unstopped run cut right after the first occurrence
    # (the masks on every step, mars_plain_steps=False: the default's plain steps follow timing, so two runs differ)
    run = model.generate(**enc, max_new_tokens=30, mars_threshold=0.0, mars_plain_steps=False,
                         eos_token_id=[])[0, P:].tolist()
    text = tok.decode(run)
    stop = text[7:10]
    out = model.generate(**enc, max_new_tokens=30, mars_threshold=0.0, mars_plain_steps=False, stop_strings=[stop],
                         tokenizer=tok, eos_token_id=[])
    decoded = tok.decode(out[0, P:])
    assert decoded == text[:text.index(stop) + len(stop)]


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token
        self.lengths = []

    def __call__(self, input_ids, scores, **kwargs):
        self.lengths.append(input_ids.shape[1])
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_batched(peaky):
    model, tok = peaky
    enc = _batch(tok)
    P = enc.input_ids.shape[1]
    target = tok.convert_tokens_to_ids("e")
    crit = StopAfterToken(target)
    out = model.generate(**enc, max_new_tokens=30, mars_threshold=0.0, eos_token_id=[],
                         stopping_criteria=StoppingCriteriaList([crit]), return_dict_in_generate=True)
    for r in range(len(PROMPTS)):
        n = int(out.mars_emitted_tokens[r])
        row = out.sequences[r, P:P + n].tolist()
        assert target not in row[:-1]
        assert row[-1] == target or n == 30
        assert (out.sequences[r, P + n:] == tok.pad_token_id).all()
    assert any(int(n) < 30 for n in out.mars_emitted_tokens)


# ------------------------------------------------------------------------------------------ mask token


def test_mask_token_never_emitted(make_model):
    model, tok = make_model(seed=0)
    mask_id = model.config.mars["mask_token_id"]
    with torch.no_grad():  # make the mask the model's favourite prediction
        model.get_output_embeddings().weight[mask_id] *= 200
    enc = tok(["hello"], return_tensors="pt")
    plain = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert (plain == mask_id).any(), "control: without enable_mars the model emits the mask"
    enable_mars(model)
    enable_mars(model)  # idempotent
    for kw in ({}, {"mars_threshold": 0.0}, {"mars_verify": True}, {"mars_cache": "block", "mars_threshold": 0.0},
               {"do_sample": True, "mars_threshold": 0.0}):
        out = model.generate(**enc, max_new_tokens=8, **kw)
        assert not (out == mask_id).any(), kw


# ------------------------------------------------------------------------------------------ processors


@pytest.mark.parametrize(
    "kw",
    [{"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": 12},
     {"bad_words_ids": [[5], [6, 7]]}],
)
def test_history_processors_tau1_equal_ar(peaky, kw):
    model, tok = peaky
    enc = _batch(tok)
    ref = _greedy(model, enc, **kw)
    out = _greedy(model, enc, mars_threshold=1.0, **kw)
    assert torch.equal(out, ref)
    out = _greedy(model, enc, mars_verify=True, mars_threshold=0.0, **kw)
    assert torch.equal(out, ref)


def test_processors_honoured_in_multi_token_mode(peaky):
    model, tok = peaky
    enc = _batch(tok)
    P = enc.input_ids.shape[1]
    free = model.generate(**enc, max_new_tokens=20, mars_threshold=0.0, eos_token_id=[])
    banned = int(free[0, P + 2])
    out = model.generate(**enc, max_new_tokens=20, mars_threshold=0.0, eos_token_id=[], bad_words_ids=[[banned]])
    assert not (out[:, P:] == banned).any()
    out = model.generate(**enc, max_new_tokens=20, mars_threshold=0.0, eos_token_id=[], no_repeat_ngram_size=2)
    for row in out[:, P:].tolist():
        grams = list(zip(row, row[1:]))
        assert len(grams) == len(set(grams))


# ------------------------------------------------------------------------------------------ streamer / sampling


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("route", ["enable_mars", "callable"])
def test_streamer_gets_exactly_the_emitted_tokens(peaky, route):
    model, tok = peaky
    enc = tok(["hello world"], return_tensors="pt")
    streamer = Collect()
    if route == "enable_mars":
        out = model.generate(**enc, max_new_tokens=20, mars_threshold=0.3, streamer=streamer)
    else:  # transformers hands a callable neither streamer= nor tokenizer=: the callable route takes mars_streamer=
        out = type(model).generate(model, **enc, max_new_tokens=20, custom_generate=mars_generate,
                                   mars_threshold=0.3, mars_streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == enc.input_ids[0].tolist()
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, enc.input_ids.shape[1]:].tolist()
    assert any(len(c) > 1 for c in streamer.chunks[1:])  # whole accepted runs are pushed


@pytest.mark.parametrize("kw", [{"mars_threshold": 0.5}, {"mars_verify": True, "mars_threshold": 0.0}])
def test_seeded_sampling_reproducible(peaky, kw):
    model, tok = peaky
    enc = _batch(tok)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(**enc, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.95,
                                   **kw))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def _tiny_vocab_model(seed=0):
    config = Qwen2Config(vocab_size=5, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.6, tie_word_embeddings=True, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.config.mars = {"mask_token_id": 4, "mask_token": "<|mask|>", "block_size": 2}
    return enable_mars(model)


def _exact_distribution(model, prompt, steps, temperature, top_k, repetition_penalty=None):
    """P(next `steps` tokens) of plain sampling, enumerated exactly with the same processor chain."""
    chain = LogitsProcessorList([SuppressTokensLogitsProcessor([4], device="cpu"),
                                 TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    if repetition_penalty is not None:
        chain.insert(0, RepetitionPenaltyLogitsProcessor(repetition_penalty))
    probs = {(): 1.0}
    for _ in range(steps):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        nxt = torch.softmax(chain(ids, logits), -1)
        probs = {p + (t,): probs[p] * float(nxt[i, t]) for i, p in enumerate(prefixes) for t in range(4)
                 if nxt[i, t] > 0}
    return probs


def _chi2(samples, expected):
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    outside = sum(c for k, c in counts.items() if k not in expected)
    # Wilson-Hilferty: the chi2 quantile at p ~ 1e-4
    z = 3.72
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, limit, outside


def test_verify_sampling_matches_plain_sampling_distribution():
    """Speculative-sampling acceptance keeps the AR distribution exactly; threshold mode does not (control)."""
    model = _tiny_vocab_model()
    prompt, steps, temperature, top_k, n = [1, 2, 3], 3, 0.9, 3, 6000
    expected = _exact_distribution(model, prompt, steps, temperature, top_k)
    ids = torch.tensor([prompt] * n)

    def sample(**kw):
        torch.manual_seed(1234)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=True,
                             temperature=temperature, top_k=top_k, return_dict_in_generate=True, **kw)
        return [tuple(row) for row in out.sequences[:, len(prompt):].tolist()], out

    plain, _ = sample()
    stat, limit, outside = _chi2(plain, expected)
    assert outside == 0 and stat < limit, (stat, limit)
    verified, out = sample(mars_verify=True, mars_threshold=0.0, mars_block_size=3)
    assert (out.mars_emitted_tokens > out.mars_forward_passes).any()  # drafts were accepted
    stat, limit, outside = _chi2(verified, expected)
    assert outside == 0 and stat < limit, (stat, limit)
    threshold, _ = sample(mars_threshold=0.0, mars_block_size=3)
    stat, limit, _ = _chi2(threshold, expected)
    assert stat > limit, "control: unverified multi-token sampling should not match AR"


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kw,match",
    [({"mars_threshold": 1.5}, "mars_threshold"), ({"mars_threshold": -0.1}, "mars_threshold"),
     ({"mars_block_size": 0}, "mars_block_size"), ({"mars_acceptance": "vibes"}, "mars_acceptance"),
     ({"mars_cache": "paged"}, "mars_cache"), ({"mars_cache_block": 0}, "mars_cache_block"),
     ({"mars_max_accept": 0}, "mars_max_accept"), ({"mars": True, "num_beams": 2}, "beam"),
     ({"mars_verify": True, "mars_cache": "block"}, "mars_verify"), ({"mars_treshold": 0.5}, "Unknown MARS"),
     ({"mars": True, "prompt_lookup_num_tokens": 3}, "assisted"), ({"mars": True, "use_cache": False}, "cache")],
)
def test_bad_arguments(flat, kw, match):
    model, tok = flat
    enc = tok(["hi"], return_tensors="pt")
    with pytest.raises(ValueError, match=match):
        model.generate(**enc, max_new_tokens=4, **kw)


def test_model_without_mask_token(make_model):
    model, tok = make_model(with_mask=False)
    enable_mars(model)
    enc = tok(["hi"], return_tensors="pt")
    plain = model.generate(**enc, max_new_tokens=4, do_sample=False)  # plain generate is unaffected
    assert plain.shape[1] == enc.input_ids.shape[1] + 4
    with pytest.raises(ValueError, match="add_mask_token"):
        model.generate(**enc, max_new_tokens=4, mars=True)
    with pytest.raises(ValueError, match="add_mask_token"):
        type(model).generate(model, **enc, max_new_tokens=4, custom_generate=mars_generate)


def test_mars_false_is_plain_generate(flat):
    model, tok = flat
    enc = _batch(tok)
    ref = _greedy(model, enc)
    assert torch.equal(_greedy(model, enc, mars=False, mars_threshold=0.0), ref)
    torch.manual_seed(3)
    a = model.generate(**enc, max_new_tokens=8, do_sample=True)
    torch.manual_seed(3)
    b = model.generate(**enc, max_new_tokens=8, do_sample=True, mars=False)
    assert torch.equal(a, b)


def test_mars_generate_refuses_plain_and_lone_synced_gpus(flat):
    model, tok = flat
    enc = _batch(tok)
    with pytest.raises(ValueError, match="without custom_generate"):
        type(model).generate(model, **enc, max_new_tokens=4, custom_generate=mars_generate, mars=False)
    with pytest.raises(ValueError, match="initialised torch.distributed"):  # lockstep needs the ranks
        model.generate(**enc, max_new_tokens=4, mars_threshold=0.5, synced_gpus=True)
    plain = model.generate(**enc, max_new_tokens=4, mars_threshold=0.5)
    assert torch.equal(model.generate(**enc, max_new_tokens=4, mars_threshold=0.5, synced_gpus=False), plain)


def test_defaults_from_generation_config(peaky):
    model, tok = peaky
    enc = _batch(tok)
    model.generation_config.mars_threshold = 1.0
    model.generation_config.mars_block_size = 2
    ref = _greedy(model, enc)
    out = _greedy(model, enc, mars=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert torch.equal(out.mars_forward_passes, out.mars_emitted_tokens)


# ------------------------------------------------------------------------------------------ custom_generate file


@pytest.mark.parametrize("route", ["from_pretrained", "custom_generate_dir"])
def test_loaded_as_custom_generate(peaky, tmp_path, route, modules_cache):
    model, tok = peaky
    model.save_pretrained(tmp_path)
    write_custom_generate(tmp_path)  # the package's modules, as a checkpoint ships them
    enc = _batch(tok)
    ref = _greedy(model, enc)
    mask_id = model.config.mars["mask_token_id"]
    if route == "from_pretrained":
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
        assert not hasattr(loaded, "_hf_mars_enabled")  # the file's own generate, not ours
        call = loaded.generate
    else:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

        def call(**kw):
            return loaded.generate(custom_generate=str(tmp_path), trust_remote_code=True, **kw)

    assert torch.equal(call(**enc, max_new_tokens=MAX_NEW, do_sample=False), ref)
    out = call(**enc, max_new_tokens=MAX_NEW, do_sample=False, mars_threshold=1.0, mars_block_size=4,
               return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert type(out).__name__ == "MARSGenerateOutput"
    out = call(**enc, max_new_tokens=MAX_NEW, mars_verify=True, mars_threshold=0.0)
    assert torch.equal(out, ref)
    with torch.no_grad():
        loaded.get_output_embeddings().weight[mask_id] *= 200
    assert not (call(**enc, max_new_tokens=6, do_sample=False) == mask_id).any()
    assert not (call(**enc, max_new_tokens=6, mars_threshold=0.0) == mask_id).any()


# ------------------------------------------------------------------------------------------ options


@pytest.mark.parametrize("acceptance", ["entropy", "margin"])
def test_acceptance_modes(peaky, acceptance):
    model, tok = peaky
    enc = _batch(tok)
    ref = _greedy(model, enc)
    assert torch.equal(_greedy(model, enc, mars_threshold=1.0, mars_acceptance=acceptance), ref)
    out = _greedy(model, enc, mars_threshold=0.0, mars_acceptance=acceptance, eos_token_id=[],
                  return_dict_in_generate=True)
    assert torch.equal(out.mars_forward_passes, torch.full_like(out.mars_forward_passes, math.ceil(MAX_NEW / 4)))
    mid = _greedy(model, enc, mars_threshold=0.5, mars_acceptance=acceptance, eos_token_id=[],
                  return_dict_in_generate=True)
    assert (mid.mars_forward_passes >= out.mars_forward_passes).all()


@pytest.mark.parametrize("kw", [{"mars_threshold": 0.0}, {"mars_verify": True, "mars_threshold": 0.0},
                                {"mars_threshold": 0.0, "mars_cache": "block"}])
def test_max_accept_caps_tokens_per_step(flat, kw):
    model, tok = flat
    enc = tok(["hello"], return_tensors="pt")
    counter = ForwardCounter(model)
    try:
        out = model.generate(**enc, max_new_tokens=20, eos_token_id=[], mars_block_size=8, mars_max_accept=2,
                             return_dict_in_generate=True, **kw)
    finally:
        counter.close()
    assert int(out.mars_emitted_tokens[0]) == 20
    assert counter.count >= 10


def test_batched_streamer_and_logits(peaky):
    model, tok = peaky
    enc = _batch(tok)
    P = enc.input_ids.shape[1]
    streamer = Collect()
    out = model.generate(**enc, max_new_tokens=12, mars_threshold=0.3, streamer=streamer, output_logits=True,
                         return_dict_in_generate=True)
    assert streamer.ended
    assert len(out.logits) == out.sequences.shape[1] - P
    for t, raw in enumerate(out.logits):
        live = out.mars_emitted_tokens > t
        assert raw.shape == (len(PROMPTS), model.config.vocab_size)
        assert torch.isfinite(raw[live]).all()


def test_eager_attention_batched(make_model):
    """The padded-chunk layout only relies on the 2D attention mask, so any attention implementation works."""
    model, tok = make_model(seed=1, initializer_range=0.5, attn_implementation="eager")
    enable_mars(model)
    enc = _batch(tok)
    assert torch.equal(_greedy(model, enc, mars_verify=True, mars_threshold=0.0), _greedy(model, enc))
    out = model.generate(**enc, max_new_tokens=24, do_sample=False, mars_threshold=0.3)
    P = enc.input_ids.shape[1]
    mask_id = model.config.mars["mask_token_id"]
    for r, prompt in enumerate(PROMPTS):
        ref, _ = gen.reference_decode(model, tok(prompt).input_ids, mask_id, block_size=4, threshold=0.3,
                                      max_new_tokens=24, eos_token_ids=(tok.eos_token_id,))
        assert out[r, P:P + len(ref)].tolist() == ref


def test_verify_sampling_exact_with_history_processors():
    """Same check on the candidate-by-candidate processor path (repetition_penalty sees each draft prefix)."""
    model = _tiny_vocab_model(seed=1)
    prompt, steps, n = [1, 2, 3], 3, 5000
    expected = _exact_distribution(model, prompt, steps, 1.0, 4, repetition_penalty=2.0)
    ids = torch.tensor([prompt] * n)
    torch.manual_seed(99)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=True, top_k=4,
                         repetition_penalty=2.0, mars_verify=True, mars_threshold=0.0, mars_block_size=3,
                         return_dict_in_generate=True)
    assert (out.mars_emitted_tokens > out.mars_forward_passes).any()
    samples = [tuple(row) for row in out.sequences[:, len(prompt):].tolist()]
    stat, limit, outside = _chi2(samples, expected)
    assert outside == 0 and stat < limit, (stat, limit)


@pytest.mark.parametrize("tau,last", [(1.0, False), (0.3, False), (0.6, True), (0.0, False)])
def test_library_reference_loop_matches_fast_loop(peaky, tau, last):
    """`reference_decode` (the algorithm in one screen) == the fast cached loop, tokens and forwards."""
    model, tok = peaky
    mask_id = model.config.mars["mask_token_id"]
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        ref, ref_fwd = gen.reference_decode(model, ids, mask_id, block_size=4, threshold=tau, max_new_tokens=MAX_NEW,
                                            eos_token_ids=(tok.eos_token_id,), use_last_mask=last)
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             mars_threshold=tau, mars_block_size=4, mars_use_last_mask=last,
                             mars_plain_steps=False, return_dict_in_generate=True)  # the masks on every step
        assert out.sequences[0, len(ids):].tolist()[:len(ref)] == ref
        assert int(out.mars_forward_passes[0]) == ref_fwd


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch4"])
def test_static_cache_tau1_and_verify_equal_greedy(peaky, prompts):
    """cache_implementation="static": dropping the masks moves the write position back; the cache generate built
    for plain decoding is given a step more room (rows accept their own counts: see the next test)."""
    model, tok = peaky
    enc = tok(prompts, return_tensors="pt", padding=True)
    plain = _greedy(model, enc, max_new_tokens=24)
    for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0),
               dict(mars_threshold=1.0, mars_cache="block", mars_cache_block=8)):
        out = _greedy(model, enc, max_new_tokens=24, cache_implementation="static", **kw)
        assert torch.equal(out, plain), kw
    out = _greedy(model, enc, max_new_tokens=24, cache_implementation="static", mars_threshold=0.0,
                  return_dict_in_generate=True, eos_token_id=[])
    assert int(out.mars_emitted_tokens.sum()) > int(out.mars_forward_passes.sum())  # still several tokens per step


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.parametrize("kw", [dict(mars_threshold=0.3, mars_plain_steps=False),
                                dict(mars_verify=True, mars_threshold=0.0)], ids=["threshold", "verify"])
def test_static_cache_rows_are_ragged_and_compacted_in_place(peaky, monkeypatch, kw):
    """A static cache does not hold batch rows in lockstep: each row accepts its own count (its output is what it
    decodes alone, forwards differ per row). The masked columns this leaves are compacted in place (the tensors
    keep their addresses: compiled graphs read them there), at the latest when the next step would not fit: here
    the cache holds exactly what the call needs and only that rule compacts."""
    from hf_mars.generation import cache as cache_module

    model, tok = peaky
    monkeypatch.setattr(cache_module, "STATIC_CACHE_BUCKET", 1)
    model.__dict__.pop("_mars_static_cache_length", None)
    prompts = [p + s for p in PROMPTS for s in ("", " one two")]
    real, calls = RollbackCache.compact, []

    def only_when_short(self, longest, threshold=gen.COMPACT_THRESHOLD, **k):
        addresses = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in self.cache.layers]
        done = real(self, longest, 1.0, **k)  # never for the waste share alone
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in self.cache.layers] == addresses
        assert self.length + k["room"] <= self.static_len
        assert int(self.cache.layers[0].cumulative_length) == self.length
        calls.append(done)
        return done

    monkeypatch.setattr(RollbackCache, "compact", only_when_short)
    enc = tok(prompts, return_tensors="pt", padding=True)
    P, opts = enc.input_ids.shape[1], dict(max_new_tokens=32, eos_token_id=[], return_dict_in_generate=True, **kw)
    try:
        out = _greedy(model, enc, cache_implementation="static", **opts)
        assert any(calls), "the static cache never needed compacting: the test does not reach the rule"
        assert len(set(out.mars_forward_passes.tolist())) > 1  # ragged: rows took different numbers of steps
        for r, prompt in enumerate(prompts):
            alone = _greedy(model, tok([prompt], return_tensors="pt"), **opts)
            assert out.sequences[r, P:].tolist() == alone.sequences[0, -32:].tolist(), r
    finally:
        model.__dict__.pop("_mars_static_cache_length", None)


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_user_static_cache(peaky):
    from transformers import StaticCache

    model, tok = peaky
    enc = tok(PROMPTS[:1], return_tensors="pt")
    plain = _greedy(model, enc, max_new_tokens=16)
    big = StaticCache(config=model.config, max_cache_len=64)
    assert torch.equal(_greedy(model, enc, max_new_tokens=16, mars_verify=True, **{CACHE_ARG: big}), plain)
    small = StaticCache(config=model.config, max_cache_len=enc.input_ids.shape[1] + 16)
    with torch.no_grad():
        model(input_ids=enc.input_ids[:, :-1], **{CACHE_ARG: small})  # a cache with a prefix already in it
    with pytest.raises(ValueError, match="StaticCache holds"):
        _greedy(model, enc, max_new_tokens=16, mars_verify=True, **{CACHE_ARG: small})


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_prompt_reuse_a_cache_holding_the_prompts_start(peaky, kind):
    """Prompt reuse (transformers' documented pattern: a cache already holding the prompt's first tokens): MARS
    feeds only the prompt's tokens past the cached ones, on a left-padded batch too. tau = 1 and verify (chain
    and tree) equal plain generate given the same cache; a cache holding the whole prompt is refused."""
    from transformers import DynamicCache, StaticCache

    if kind == "static" and not gen.STATIC_CACHE_SUPPORTED:
        pytest.skip("static cache layers roll back from transformers 5.24 on")
    model, tok = peaky
    for prompts in (PROMPTS[:1], PROMPTS):
        enc = tok(prompts, return_tensors="pt", padding=True)
        P = enc.input_ids.shape[1]

        def cached(upto):
            cache = (StaticCache(config=model.config, max_cache_len=128) if kind == "static"
                     else DynamicCache(config=model.config))
            mask = enc.attention_mask[:, :upto]
            with torch.no_grad():  # (the positions generate gives a left-padded row)
                model(input_ids=enc.input_ids[:, :upto], attention_mask=mask,
                      position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{CACHE_ARG: cache})
            return {CACHE_ARG: cache}

        plain = _greedy(model, enc, max_new_tokens=24, **cached(P - 3))
        assert torch.equal(plain, _greedy(model, enc, max_new_tokens=24))  # the pattern holds for plain generate
        for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0),
                   dict(mars_verify=True, mars_draft_tree="chain")):
            out = _greedy(model, enc, max_new_tokens=24, return_dict_in_generate=True, **kw, **cached(P - 3))
            assert torch.equal(out.sequences, plain), (len(prompts), kw)
        assert int(out.mars_emitted_tokens.sum()) > int(out.mars_forward_passes.sum())  # drafts were accepted
        with pytest.raises(ValueError, match=f"already holds {P} positions and the prompt has {P}"):
            _greedy(model, enc, mars_verify=True, **cached(P))


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_static_cache_generate_built_is_sized_not_rebuilt(peaky, monkeypatch):
    """generate builds a static cache per call, sized for plain decoding and not yet allocated (a layer allocates
    at its first update): MARS gives it its own length rather than building another. One whose tensors exist
    cannot change length: it is replaced by a cache of that length. Outputs stay plain greedy's."""
    import hf_mars.generation.cache as cache_module

    model, tok = peaky
    made, real_static = [], cache_module.StaticCache
    monkeypatch.setattr(cache_module, "StaticCache", lambda *a, **k: made.append(k) or real_static(*a, **k))
    enc = tok(PROMPTS[:1], return_tensors="pt")
    plain = _greedy(model, enc, max_new_tokens=16)
    out = _greedy(model, enc, max_new_tokens=16, cache_implementation="static", mars_threshold=1.0,
                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and not made
    cache = out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values
    assert {layer.max_cache_len for layer in cache.layers} == {model._mars_static_cache_length}
    allocated = real_static(config=model.config, max_cache_len=enc.input_ids.shape[1] + 20)
    cfg = model.config
    allocated.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=model.dtype,
                                   device=model.device)
    out = _greedy(model, enc, max_new_tokens=16, mars_threshold=1.0, **{CACHE_ARG: allocated})
    assert torch.equal(out, plain) and made == [dict(config=model.config, max_cache_len=model._mars_static_cache_length)]


def test_cache_that_cannot_roll_back_is_refused(flat):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class NoRollbackLayer(DynamicLayer):  # like a quantized or offloaded layer
        is_croppable = False

    model, tok = flat
    enc = tok(PROMPTS[:1], return_tensors="pt")
    cache = DynamicCache(config=model.config)
    cache.layers = [NoRollbackLayer() for _ in cache.layers]
    with pytest.raises(ValueError, match="cannot do that.*static"):
        _greedy(model, enc, mars=True, **{CACHE_ARG: cache})


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_compile_config_is_honoured_with_a_static_cache(peaky):
    """generation_config.compile_config compiles the decode steps (backend "eager" here: the code path, cheaply);
    the output stays identical to greedy."""
    model, tok = peaky
    enc = _batch(tok)
    plain = _greedy(model, enc, max_new_tokens=16)
    calls = []
    config = _counting_compile_config(calls)
    for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0)):
        out = _greedy(model, enc, max_new_tokens=16, cache_implementation="static", compile_config=config, **kw)
        assert torch.equal(out, plain), kw
    assert calls, "the decode forward was never compiled"
    # one width per step (masks pad the chunk): one graph at batch 1, none more on a second call; threshold mode
    # decodes what the uncompiled loop decodes
    one = tok(PROMPTS[:1], return_tensors="pt")
    _forget_compiled(model)
    calls.clear()
    kw = dict(max_new_tokens=24, cache_implementation="static", mars_threshold=0.5, mars_plain_steps=False)
    first = _greedy(model, one, compile_config=config, **kw)
    compiled_after_first = len(calls)
    assert torch.equal(_greedy(model, one, compile_config=config, **kw), first)
    assert compiled_after_first == 1 and len(calls) == 1
    assert torch.equal(first, _greedy(model, one, **kw))


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_mars_graphs_bounded_over_prompt_lengths(peaky, batch):
    """A stream of prompts of many lengths compiles a bounded number of graphs (the static cache MARS decodes into
    has one length per `STATIC_CACHE_BUCKET`, growing only), and none after a warm-up pass; outputs stay greedy."""
    model, tok = peaky
    graphs = []
    # dynamic=False, as a user pinning static shapes would: every new cache shape is a new graph
    config = _counting_compile_config(graphs, dynamic=False)
    words = "the quick brown fox jumps over a lazy dog and then some more words follow here".split()
    prompts = [" ".join(words[:n]) for n in range(1, 10)]  # 9 distinct prompt lengths
    batches = [tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
               for i in range(0, len(prompts), batch)]
    _forget_compiled(model)
    kw = dict(max_new_tokens=8, cache_implementation="static", compile_config=config)
    for mode in (dict(mars_verify=True, mars_threshold=0.0), dict(mars_threshold=0.5)):
        warm = [_greedy(model, enc, **mode, **kw) for enc in batches]
        after_warmup = len(graphs)
        again = [_greedy(model, enc, **mode, **kw) for enc in batches]
        assert len(graphs) == after_warmup, f"{len(graphs) - after_warmup} recompiles after warm-up ({mode})"
        assert all(torch.equal(a, b) for a, b in zip(warm, again))
    assert 1 <= len(graphs) <= 4, f"{len(graphs)} graphs for 9 prompt lengths"
    for enc, out in zip(batches, warm[:2]):  # threshold mode decodes what the uncompiled loop decodes
        assert torch.equal(out, _greedy(model, enc, max_new_tokens=8, cache_implementation="static",
                                        mars_threshold=0.5))
    verify = [_greedy(model, enc, mars_verify=True, mars_threshold=0.0, **kw) for enc in batches[:2]]
    assert all(torch.equal(v, _greedy(model, enc, max_new_tokens=8)) for v, enc in zip(verify, batches))


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_compiled_mars_has_its_own_recompile_budget(peaky):
    """Plain compiled generate sizes its static cache per longest prompt so far, a graph each, all on
    `Module.__call__`'s code object; once those reach Dynamo's recompile limit, that code runs eagerly. MARS's
    compiled decode steps have a code object of their own: they still compile (and stay greedy) after plain
    calls have spent the limit."""
    model, tok = peaky
    graphs = []
    config = _counting_compile_config(graphs, dynamic=False)
    _forget_compiled(model)
    plain_generate = type(model).generate
    with torch._dynamo.config.patch(recompile_limit=2):
        for text in ("a", "a b c", "a b c d e f", "a b c d e f g h i"):  # a longer prompt each: a new cache size
            enc = tok([text], return_tensors="pt")
            plain_generate(model, **enc, max_new_tokens=4, do_sample=False, cache_implementation="static",
                           compile_config=config)
        assert len(graphs) == 2, "plain generate should have spent the recompile limit"
        enc = tok(["hello world"], return_tensors="pt")
        out = _greedy(model, enc, max_new_tokens=8, cache_implementation="static", compile_config=config,
                      mars_verify=True, mars_threshold=0.0)
    assert len(graphs) > 2, "MARS's decode steps were not compiled: they shared plain generate's recompile budget"
    assert torch.equal(out, _greedy(model, enc, max_new_tokens=8))
    _forget_compiled(model)


def _stances_of_compiled_steps(monkeypatch):
    """Record torch.compile's stance as each compiled decode step starts (what its guards ran under)."""
    from hf_mars.generation import model_calls

    stances = []

    def recording(real):
        def compiled(model, compile_config):
            call = real(model, compile_config)

            def step(**kwargs):
                stance = torch._dynamo.eval_frame._stance
                stances.append(stance.stance + ("+skip" if stance.skip_guard_eval_unsafe else ""))
                return call(**kwargs)
            return step
        return compiled

    for name in ("compiled_decode_call", "compiled_read_call"):
        monkeypatch.setattr(model_calls, name, recording(getattr(model_calls, name)))
    return stances


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_compiled_steps_check_guards_in_full_once_per_layout(peaky, monkeypatch):
    """A generation's first compiled step runs torch.compile's full guards; its later steps of the same input
    layout only the differentiating ones (skip_guard_eval_unsafe) - not with mars_guard_every_step, not while a
    non-daemon thread is alive, and never over a stance the user set. The output is the same every way."""
    import threading

    model, tok = peaky
    stances = _stances_of_compiled_steps(monkeypatch)
    enc = tok(PROMPTS[:1], return_tensors="pt")
    kw = dict(max_new_tokens=16, cache_implementation="static", compile_config=_counting_compile_config([]),
              mars_threshold=0.5)
    _forget_compiled(model)
    try:
        first = _greedy(model, enc, **kw)
        assert "_mars_compiled_read" in model.__dict__, "greedy with no processor: the compiled step reads its slots"
        assert stances[0] == "default" and len(stances) > 2 and set(stances[1:]) == {"default+skip"}, stances
        runs = {"every step": dict(mars_guard_every_step=True)}
        for name, extra in runs.items():
            stances.clear()
            assert torch.equal(_greedy(model, enc, **kw, **extra), first)
            assert set(stances) == {"default"}, (name, stances)
        for daemon, expected in ((False, {"default"}), (True, {"default", "default+skip"})):
            release = threading.Event()
            other = threading.Thread(target=release.wait, daemon=daemon)
            other.start()
            try:
                stances.clear()
                assert torch.equal(_greedy(model, enc, **kw), first)
            finally:
                release.set()
                other.join()
            assert set(stances) == expected, (daemon, stances)
        stances.clear()
        with torch.compiler.set_stance("fail_on_recompile"):  # warmed up: no recompile; the stance is kept
            assert torch.equal(_greedy(model, enc, **kw), first)
        assert set(stances) == {"fail_on_recompile"}, stances
    finally:
        _forget_compiled(model)


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_compiled_steps_see_a_model_changed_between_generations(peaky):
    """A module replaced between two generations is a change only a non-tensor guard sees: each generation's first
    step checks every guard, so the next one recompiles and decodes what the changed model decodes (and the
    graphs of both stay told apart when the module comes back)."""
    model, tok = peaky
    enc = tok(PROMPTS[:1], return_tensors="pt")
    kw = dict(max_new_tokens=16, cache_implementation="static", mars_threshold=0.5)
    compiled = dict(kw, compile_config=_counting_compile_config([]))
    mlp = model.model.layers[0].mlp
    original = mlp.act_fn
    _forget_compiled(model)
    try:
        eager = _greedy(model, enc, **kw)
        assert torch.equal(_greedy(model, enc, **compiled), eager)
        mlp.act_fn = torch.nn.Tanh()
        changed = _greedy(model, enc, **kw)
        assert not torch.equal(changed, eager), "the replaced module must change the output"
        assert torch.equal(_greedy(model, enc, **compiled), changed)
        mlp.act_fn = original
        assert torch.equal(_greedy(model, enc, **compiled), eager)
    finally:
        mlp.act_fn = original
        _forget_compiled(model)


def test_guarded_steps_rerun_with_full_guards_when_the_checks_fail():
    """An input whose layout key matches but whose tensor guards do not (another stride): the differentiating
    guards find no graph and torch raises before running one; the step is rerun with full guards (a new graph)."""
    from hf_mars.generation.forward import GuardedSteps

    graphs = []

    def backend(gm, inputs, **options):
        graphs.append(1)
        return gm.forward

    call = GuardedSteps(torch.compile(lambda x: x.cumsum(0) * 2, backend=backend, dynamic=False))
    torch._dynamo.reset()
    contiguous = torch.arange(6.0).view(2, 3)
    strided = torch.arange(6.0).view(3, 2).t()
    assert torch.equal(call(x=contiguous), contiguous.cumsum(0) * 2)
    assert torch.equal(call(x=contiguous), contiguous.cumsum(0) * 2) and len(graphs) == 1
    assert torch.equal(call(x=strided), strided.cumsum(0) * 2) and len(graphs) == 2
    assert torch.equal(call(x=strided), strided.cumsum(0) * 2) and len(graphs) == 2
    torch._dynamo.reset()


@pytest.mark.skipif(not gen.STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_prefill_runs_a_few_padded_widths(peaky, batch):
    """mars_compile_prefill pads the [prompt | masks] forward with masks to a power-of-two width: prompts of many
    lengths compile one prefill graph per width (and rows), none after a warm-up pass, and the padding leaves no
    trace: threshold mode decodes what the eager prefill decodes, tau = 1 and verify what plain greedy does."""
    from hf_mars.generation.forward import prefill_width

    model, tok = peaky
    texts = ["ab", "hello world", "the quick brown fox", "the quick brown fox jumps over",
             "the quick brown fox jumps over the lazy dog, twice over"]
    batches = [tok(texts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
               for i in range(0, len(texts), batch)]
    graphs = []
    config = _counting_compile_config(graphs, dynamic=False)
    _forget_compiled(model)
    kw = dict(max_new_tokens=8, cache_implementation="static", compile_config=config)
    try:
        for _ in range(2):  # (the second pass: the cache at its final size, as in the passes below)
            eager_prefill = [_greedy(model, enc, mars_threshold=0.5, **kw) for enc in batches]
        decode_graphs = len(graphs)
        out = [_greedy(model, enc, mars_threshold=0.5, mars_compile_prefill=True, **kw) for enc in batches]
        shapes = {(prefill_width(enc.input_ids.shape[1] + 3, 256), enc.input_ids.shape[0]) for enc in batches}
        assert len(graphs) - decode_graphs == len(shapes) < len(texts)
        again = [_greedy(model, enc, mars_threshold=0.5, mars_compile_prefill=True, **kw) for enc in batches]
        assert len(graphs) - decode_graphs == len(shapes), "recompiled after warm-up"
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(out, again, eager_prefill))
        for enc in batches:
            plain = _greedy(model, enc, max_new_tokens=8)
            for mode in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0)):
                assert torch.equal(_greedy(model, enc, mars_compile_prefill=True, **mode, **kw), plain), mode
    finally:
        _forget_compiled(model)


def test_prefill_padding_keeps_positions_in_the_table():
    from hf_mars.generation.forward import pad_prefill, prefill_width

    assert [prefill_width(w, 256) for w in (1, 16, 17, 40, 64, 65, 200)] == [16, 16, 32, 64, 64, 128, 256]
    assert prefill_width(40, 48) == 48 and prefill_width(60, 48) == 60  # never past the cache, never narrower
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[9, 10, 11]])
    padded_ids, padded_pos, pad = pad_prefill(ids, pos, 256, 1, max_positions=20)
    assert pad == 13 and padded_ids[0, :3].tolist() == [5, 6, 7] and set(padded_ids[0, 3:].tolist()) == {1}
    assert padded_pos[0].tolist() == [9, 10, 11] + list(range(12, 20)) + [19] * 5


def test_batched_cache_is_compacted_and_output_unchanged(peaky, monkeypatch):
    """Ragged acceptance leaves masked pad columns in a batched cache; they are compacted away once they exceed 10%
    of it, and every row's output is what that row decodes alone."""
    model, tok = peaky
    prompts = [p + s for p in PROMPTS for s in ("", " one", " two three")] + ["z"] * 4  # 16 rows
    waste_seen = []
    real = RollbackCache.compact

    def spy(self, longest, threshold=gen.COMPACT_THRESHOLD, **kw):
        done = real(self, longest, threshold, **kw)
        waste_seen.append((self.length - longest) / self.length)
        return done

    monkeypatch.setattr(RollbackCache, "compact", spy)
    enc = tok(prompts, return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    kw = dict(mars_threshold=0.3, mars_plain_steps=False, eos_token_id=[], return_dict_in_generate=True)
    out = _greedy(model, enc, max_new_tokens=32, **kw)
    assert max(waste_seen) <= gen.COMPACT_THRESHOLD + 1e-9 and len(waste_seen) > 5
    for r, prompt in enumerate(prompts):
        alone = _greedy(model, tok([prompt], return_tensors="pt"), max_new_tokens=32, **kw)
        assert out.sequences[r, P:].tolist() == alone.sequences[0, -32:].tolist(), r


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch4"])
@pytest.mark.parametrize("kw", [dict(mars_threshold=0.5), dict(mars_verify=True, mars_threshold=0.0),
                                dict(mars_threshold=0.5, mars_cache="block", mars_cache_block=8),
                                dict(mars_verify=True, mars_threshold=0.0, repetition_penalty=1.3),
                                dict(mars_verify=True, mars_threshold=0.0, mars_draft_tree="3,2,1")],
                         ids=["threshold", "verify", "block", "verify-device", "verify-tree"])
def test_one_host_sync_per_step(peaky, monkeypatch, prompts, kw):
    """The loop reads device values on the host once per step (per-row metadata goes host -> device without a
    sync). Counted on the CPU: every .item() / .tolist() / .cpu() / bool() / int() / float() the decoding module
    makes. (Stateful processors or criteria need a decision per emitted position: `acceptor._exact` syncs more.)"""
    import sys

    model, tok = peaky
    package = os.path.dirname(gen.__file__)
    counts = {"step": 0, "setup": 0}
    steps = []
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(package):
                counts["step" if steps and steps[-1] else "setup"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    def counting(real_step):
        def step(self):  # any sync the module makes while a step runs counts against it (once: a tree decoder's
            if steps and steps[-1]:  # step may run the chain's)
                return real_step(self)
            steps.append(True)
            try:
                return real_step(self)
            finally:
                steps[-1] = False
        return step

    for cls in (MARSDecoder, TreeDecoder):
        monkeypatch.setattr(cls, "step", counting(cls.step))
    enc = tok(prompts, return_tensors="pt", padding=True)
    _greedy(model, enc, max_new_tokens=32, eos_token_id=[], **kw)
    assert counts["step"] == len(steps) and len(steps) > 5
    assert counts["setup"] <= 6  # once per generate call (prompt lengths, options), not per step


@pytest.mark.parametrize("kw", [
    dict(mars_threshold=0.5),
    dict(mars_threshold=0.0, mars_use_last_mask=True, mars_max_accept=3),
    dict(mars_verify=True, mars_threshold=0.0),
    dict(mars_verify=True, mars_threshold=0.6, mars_block_size=6),
    dict(mars_threshold=0.5, mars_cache="block", mars_cache_block=8),
    dict(mars_threshold=0.3, cache_implementation="static"),
    dict(mars_verify=True, mars_threshold=0.3, cache_implementation="static"),
    dict(mars_threshold=0.5, mars_acceptance="margin", output_scores=True, output_logits=True),
    dict(mars_threshold=0.5, do_sample=True, temperature=0.7, top_k=5),
], ids=["threshold", "last-mask-capped", "verify", "verify-B6", "block", "static", "static-verify", "margin-scores",
        "sampling"])
@pytest.mark.parametrize("which", ["peaky", "aligned"])
def test_one_call_and_slot_by_slot_processing_decide_alike(peaky, monkeypatch, kw, which):
    """A chain that ignores the history is applied to all candidate slots in one call, with no history kept on
    the device; a history-reading one slot by slot on the history AR would show, kept in `seq`. The acceptance
    rules after either are the same functions: forcing the slot-by-slot path (and the device history) must give
    the same tokens, forwards and scores, on a ragged left-padded batch with EOS (a token of the first prompt's
    greedy output) inside it. Two models: drafts mostly rejected (peaky) and mostly right, truncated by tau per
    row (aligned). (Sampling keeps the one call: slot by slot draws the same distribution in another order.)"""
    if kw.get("cache_implementation") == "static" and not gen.STATIC_CACHE_SUPPORTED:
        pytest.skip("static cache layers roll back from transformers 5.24 on")
    model, tok = peaky
    if which == "aligned":
        from test_stateful_clients import position_only_model

        model = position_only_model(tok)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    # EOS: the token of the plain greedy outputs that appears latest (rows stop at it, after multi-token steps)
    greedy = model.generate(**enc, do_sample=False, max_new_tokens=30, eos_token_id=[], pad_token_id=0)
    rows = greedy[:, enc.input_ids.shape[1]:].tolist()
    eos = [max({t for row in rows for t in row}, key=lambda t: min(row.index(t) if t in row else 99 for row in rows))]
    args = dict(kw, mars=True, eos_token_id=eos, pad_token_id=0, max_new_tokens=40, return_dict_in_generate=True)
    args.setdefault("do_sample", False)
    if not kw.get("mars_verify"):  # the masks on every step: the default's plain steps follow each run's timing
        args["mars_plain_steps"] = False
    if kw.get("mars_verify"):  # the chain's two processing paths (a tree takes history-free chains only)
        args["mars_draft_tree"] = "chain"
    seen = []
    real_init = MARSDecoder.__init__
    import hf_mars.generation.acceptor as acceptor_module  # (it reads the slots: `acceptor.process`)

    from hf_mars.generation.clients import Clients

    reads_history = Clients.reads_history.fget

    def init(self, *a, **k):
        real_init(self, *a, **k)
        seen.append(reads_history(self.clients))
        if on_device and not kw.get("do_sample"):
            monkeypatch.setattr(acceptor_module, "history_free", lambda chain: False)

    monkeypatch.setattr(MARSDecoder, "__init__", init)
    monkeypatch.setattr(Clients, "reads_history", property(lambda clients: reads_history(clients) or on_device))
    outs = []
    for on_device in (False, True):
        torch.manual_seed(0)
        outs.append(model.generate(**enc, **args))
    assert seen == [False, False]  # (the second run was forced onto the slot-by-slot path)
    host, device = outs
    assert host.sequences.tolist() == device.sequences.tolist()
    assert host.mars_forward_passes.tolist() == device.mars_forward_passes.tolist()
    assert host.mars_emitted_tokens.tolist() == device.mars_emitted_tokens.tolist()
    if which == "aligned" or not kw.get("mars_verify"):  # multi-token steps happened
        assert (host.mars_forward_passes < host.mars_emitted_tokens).any()
    for field in ("scores", "logits"):
        if kw.get(f"output_{field}"):
            for a, b in zip(getattr(host, field), getattr(device, field), strict=True):
                torch.testing.assert_close(a, b)


def test_generation_config_object_carries_the_mask_suppression(flat, monkeypatch):
    """A `generation_config` passed with MARS (as servers do) is not mixed with a `suppress_tokens` argument
    (transformers deprecates config + arguments); the caller's object is left as it was."""
    import transformers.generation.utils as gen_utils
    from transformers import GenerationConfig

    model, tok = flat
    said = []
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    enc = tok(PROMPTS[:1], return_tensors="pt")
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    plain = model.generate(**enc, generation_config=config)
    mars = model.generate(**enc, generation_config=config, mars_threshold=1.0)
    assert torch.equal(mars, plain)
    assert config.suppress_tokens is None  # the caller's config is untouched
    mask_id = model.config.mars["mask_token_id"]
    out = model.generate(**enc, generation_config=config, mars_threshold=0.0)
    assert mask_id not in out[0].tolist()
    assert not [m for m in said if "together with generation-related" in m], said


@pytest.mark.parametrize("batch", [1, 3])
def test_answer_up_to_the_context_of_learned_positions(batch):
    """GPT-2's position table ends at n_positions: an answer that fits (prompt + max_new_tokens = n_positions)
    decodes although a step's trailing drafts and masks reach past it, and stays equal to greedy."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_mars.testing_utils import build_char_tokenizer
    from hf_mars.tokens import add_mask_token

    tok = build_char_tokenizer()
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=40, n_embd=32, n_layer=2, n_head=2,
                                       initializer_range=0.5, bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    add_mask_token(model, tok)
    enable_mars(model)
    enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True)
    new = 40 - enc.input_ids.shape[1]
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    want = model.generate(**enc, mars=False, **kw)
    assert want.shape[1] == 40
    for mars in (dict(mars_threshold=1.0), dict(mars_verify=True), dict(mars_verify=True, mars_threshold=0.0)):
        assert torch.equal(model.generate(**enc, mars=True, **mars, **kw), want), mars
    assert model.generate(**enc, mars=True, mars_threshold=0.0, **kw).shape == want.shape


def test_device_constants_are_plain_tensors_shared_between_calls(flat):
    """The suppressed ids, EOS ids and position range a call needs are made once per device and shared by later
    calls: made inside ``torch.inference_mode`` they are still ordinary tensors (inference tensors are
    restricted outside inference mode, where a later call may run), and no call writes to them."""
    from hf_mars.generation import plan as plan_module

    model, tok = flat
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    plan_module._CONSTANTS.clear()
    with torch.inference_mode():
        first = _greedy(model, enc, mars_threshold=0.5)
    made = dict(plan_module._CONSTANTS)
    assert made and not any(t.is_inference() for t in made.values())
    snapshot = {key: t.clone() for key, t in made.items()}
    assert torch.equal(_greedy(model, enc, mars_threshold=0.5), first)
    assert all(torch.equal(plan_module._CONSTANTS[key], t) for key, t in snapshot.items())


def test_mask_token_outside_the_vocabulary_is_refused_before_any_forward(flat):
    """A mask id the embeddings do not hold is a clear error before the first forward (not an index error inside
    it, or a device assert on a GPU), whether the config's vocab_size says so (the cheap check) or only the
    embeddings do (a config that disagrees with its weights)."""
    model, tok = flat
    enc = tok(PROMPTS[:1], return_tensors="pt")
    rows = model.get_output_embeddings().weight.shape[0]
    saved_meta, saved_vocab = dict(model.config.mars), model.config.vocab_size
    counter = ForwardCounter(model)
    try:
        model.config.mars = dict(saved_meta, mask_token_id=rows)
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            _greedy(model, enc, mars_threshold=0.9)
        model.config.vocab_size = rows + 8  # the config claims more rows than the embeddings hold
        with pytest.raises(ValueError, match=f"outside the model's vocabulary \\({rows}\\)"):
            _greedy(model, enc, mars_threshold=0.9)
        assert counter.count == 0
    finally:
        counter.close()
        model.config.mars, model.config.vocab_size = saved_meta, saved_vocab
