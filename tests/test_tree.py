"""Verify mode with draft trees (`hf_mars.generation.tree`): identical to plain greedy for every tree shape, batch
1 and a left-padded batch, with the accepted path deep, off the top-1 chain, ending in EOS, or cut by
max_new_tokens; and clear refusals where a tree cannot be used.

Random tiny models accept few drafts, so the deep paths come from a "token map" model: its layers add nothing
(attention and MLP outputs zeroed), so the logits at a position depend only on that position's token: AR decoding
follows a fixed map (a -> b -> c -> ...) and every mask predicts the same ranking, chosen so that the accepted
path goes where a test needs it.
"""

import inspect

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    Qwen2ForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
)

import hf_mars.generation.tree as tree_module
from hf_mars.generation import STATIC_CACHE_SUPPORTED, enable_mars
from hf_mars.generation.cache import RollbackCache
from hf_mars.generation.tree import Tree, _row_pattern

# the cache argument's name: `cache` from transformers 5.24 (`past_key_values` before)
CACHE_ARG = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"
SHAPES = ["auto", "chain", "1,1", "2,1,1", "3,2,1,1", "2,2,2,2"]
PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=1.0)
    enable_mars(model)
    return model, tok


def _generate(model, enc, max_new_tokens=20, **kw):
    return model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **kw)


def _token_map_model(make_model, mapping, mask_ranking):
    """A model whose next token after ``x`` is ``mapping[x]`` and whose masks all rank ``mask_ranking`` first
    (best first). Tokens are characters of the tiny tokenizer (or its special tokens)."""
    model, tok = make_model(seed=0)
    ids = {t: tok.convert_tokens_to_ids(t) for t in set(mapping) | set(mapping.values()) | set(mask_ranking)}
    mask_id = model.config.mars["mask_token_id"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.config.hidden_size
        controlled = sorted(ids.values()) + [mask_id]
        assert len(controlled) <= hidden
        emb = model.model.embed_tokens.weight
        head = torch.zeros(emb.shape[0], hidden)
        for slot, token in enumerate(controlled):
            emb[token] = torch.nn.functional.one_hot(torch.tensor(slot), hidden).float()
        for source, target in mapping.items():
            head[ids[target], controlled.index(ids[source])] = 1.0
        for rank, token in enumerate(mask_ranking):
            head[ids[token], controlled.index(mask_id)] = 0.9 - 0.1 * rank
        model.lm_head.weight = torch.nn.Parameter(head)
        model.config.tie_word_embeddings = False
    enable_mars(model)
    return model, tok


def _count_gathers(monkeypatch):
    calls = []
    original = RollbackCache.keep_chunk_columns
    monkeypatch.setattr(RollbackCache, "keep_chunk_columns",
                        lambda self, *a, **k: (calls.append(1), original(self, *a, **k))[1])
    return calls


# ------------------------------------------------------------------------------------------ the tree itself


def _candidates(*depths):
    return [[(t, p) for t, p in depth] for depth in depths]


def test_tree_grows_depth_first_with_top1_first():
    tree = Tree.grow(_candidates([(10, .6), (11, .3)], [(20, .9), (21, .1)], [(30, .5)]), (2, 2, 1))
    assert tree.tokens == [10, 20, 30, 21, 30, 11, 20, 30, 21, 30]
    assert tree.depths == [1, 2, 3, 2, 3, 1, 2, 3, 2, 3]
    assert tree.parents == [-1, 0, 1, 0, 3, -1, 5, 6, 5, 8]
    assert tree.paths()[2] == [0, 1, 2]  # the all-top-1 path leads the nodes: accepting it is a crop
    assert Tree.grow(_candidates([(10, .6), (11, .3)]), (2, 2, 1)).tokens == [10, 11]  # fewer depths than the shape


def test_mask_groups_go_where_the_path_is_likely_to_end():
    tree = Tree.grow(_candidates([(10, .95)], [(20, .5)], [(30, .99)]), (1, 1, 1))
    # P(end at root) = .05, at 10: .95 x .5, at 20: .475 x .01, at 30 (the leaf): .47
    tree.choose_groups(0.03)
    assert tree.grouped == [-1, 0, 2]
    tree.choose_groups(0.0)
    assert tree.grouped == [-1, 0, 1, 2]
    tree.choose_groups(0.99)
    assert tree.grouped == [0]  # the likeliest end always keeps its masks


def test_attention_pattern_sees_committed_tokens_and_the_path():
    tree = Tree.grow(_candidates([(7, .5), (8, .4)], [(9, .5)]), (2, 1))  # nodes 0 (7), 1 (9|7), 2 (8), 3 (9|8)
    tree.grouped = [-1, 0, 1, 2, 3]
    u, g, left, width = 1, 2, 1, 1 + 1 + 4 + 5 * 2
    flat = _row_pattern(tree, u, g, left, width)
    seen = [[c for c in range(width) if flat[q * width + c]] for q in range(width)]
    assert seen[0] == [0]  # a pad sees itself only
    assert seen[1] == [1]  # the root
    assert seen[2 + 1] == [1, 2, 3]  # node 1: root, its parent node 0, itself
    assert seen[2 + 3] == [1, 4, 5]  # node 3: root, node 2, itself
    first_mask_of_node_3 = 2 + 4 + 4 * g
    assert seen[first_mask_of_node_3 + 1] == [1, 4, 5, first_mask_of_node_3, first_mask_of_node_3 + 1]
    assert seen[2 + 4] == [1, 6]  # the root's first mask: the committed token and itself


# ------------------------------------------------------------------------------------------ equal to greedy


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_equals_greedy_left_padded_batch_and_batch1(peaky, shape):
    model, tok = peaky
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()
    ref = _generate(model, enc)
    out = _generate(model, enc, mars_verify=True, mars_threshold=0.0, mars_draft_tree=shape)
    assert torch.equal(out, ref)
    one = tok(["the quick brown fox"], return_tensors="pt")
    assert torch.equal(_generate(model, one, mars_verify=True, mars_draft_tree=shape), _generate(model, one))


def test_deep_paths_off_the_top1_chain(make_model, monkeypatch):
    """a -> b -> c -> y -> y ...; every mask ranks z before y, so the accepted path runs through second children
    (a gather, not a crop) to the full depth."""
    model, tok = _token_map_model(make_model, {"a": "b", "b": "c", "c": "y", "y": "y", "z": "z"}, ["z", "y"])
    gathers = _count_gathers(monkeypatch)
    monkeypatch.setattr(tree_module, "GROUP_MIN_SHARE", 0.0)  # masks after every node (the masks misjudge here)
    for prompts in (["qa"], ["qa", "hello b", "c", "xyz y"]):
        enc = tok(prompts, return_tensors="pt", padding=True)
        ref = _generate(model, enc, max_new_tokens=24)
        assert tok.convert_ids_to_tokens(ref[0, -3:].tolist()) == ["y"] * 3
        out = _generate(model, enc, max_new_tokens=24, mars_verify=True, mars_threshold=0.0,
                        mars_draft_tree="2,2,2,2", return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        per_forward = out.mars_emitted_tokens.float() / out.mars_forward_passes
        assert bool((per_forward > 3.0).all()), per_forward  # 5 tokens per forward once on the y path
    assert gathers
    # the chain (top-1 only, z) accepts nothing here
    chain = _generate(model, enc, max_new_tokens=24, mars_verify=True, mars_draft_tree="chain",
                      return_dict_in_generate=True)
    assert torch.equal(chain.sequences, ref) and torch.equal(chain.mars_forward_passes, chain.mars_emitted_tokens)


@pytest.mark.parametrize("min_share", [0.0, 0.03, 0.5, 1.0])
def test_paths_ending_without_masks_draft_from_an_ancestor(make_model, monkeypatch, min_share):
    """With few mask groups, a path that ends at a node without one takes its next candidates from the later masks
    of its deepest ancestor that has one: still plain greedy's output, still several tokens per forward."""
    model, tok = _token_map_model(make_model, {"a": "b", "b": "c", "c": "y", "y": "y", "z": "z"}, ["z", "y"])
    monkeypatch.setattr(tree_module, "GROUP_MIN_SHARE", min_share)
    enc = tok(["qa", "hello b", "c", "xyz y"], return_tensors="pt", padding=True)
    ref = _generate(model, enc, max_new_tokens=24)
    out = _generate(model, enc, max_new_tokens=24, mars_verify=True, mars_draft_tree="2,2,2,2",
                    return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert bool((out.mars_emitted_tokens > 1.5 * out.mars_forward_passes).all())


def test_eos_inside_the_tree(make_model):
    """a -> b -> c -> EOS; the masks rank c, then EOS: the step after b accepts c, then EOS as a second child, and
    the row ends there (the AR token after EOS is never emitted)."""
    eos = "<|im_end|>"
    model, tok = _token_map_model(make_model, {"a": "b", "b": "c", "c": eos, eos: "a"}, ["c", eos])
    for prompts in (["qa"], ["qa", "hello world a", "pa"]):
        enc = tok(prompts, return_tensors="pt", padding=True)
        ref = _generate(model, enc, max_new_tokens=12)
        out = _generate(model, enc, max_new_tokens=12, mars_verify=True, mars_threshold=0.0,
                        mars_draft_tree="2,2,2", return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert tok.convert_ids_to_tokens(out.sequences[0, -3:].tolist()) == ["b", "c", eos]
        assert out.mars_forward_passes.tolist() == [2] * len(prompts)  # the prefill emits b; one forward c, EOS


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5, 6, 7])
def test_max_new_tokens_cuts_inside_the_tree(make_model, max_new):
    model, tok = _token_map_model(make_model, {"a": "y", "y": "y"}, ["y"])
    enc = tok(["qa", "hello a"], return_tensors="pt", padding=True)
    ref = _generate(model, enc, max_new_tokens=max_new)
    for shape in ("auto", "2,2,2,2"):
        out = _generate(model, enc, max_new_tokens=max_new, mars_verify=True, mars_draft_tree=shape,
                        return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.mars_emitted_tokens.tolist() == [max_new] * 2


def test_scores_and_streamer_follow_the_accepted_path(make_model):
    model, tok = _token_map_model(make_model, {"a": "b", "b": "c", "c": "y", "y": "y", "z": "z"}, ["z", "y"])
    enc = tok(["qa"], return_tensors="pt")
    kw = dict(max_new_tokens=10, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = _generate(model, enc, **kw)
    out = _generate(model, enc, mars_verify=True, mars_draft_tree="2,2,2,2", **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in ((out.scores, ref.scores), (out.logits, ref.logits)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, atol=1e-4)


def test_rows_joining_a_running_tree_batch(make_model):
    from hf_mars.generation.engine import MARSEngine

    model, tok = _token_map_model(make_model, {"a": "b", "b": "c", "c": "y", "y": "y", "z": "z"}, ["z", "y"])
    prompts = ["qa", "hello b", "c", "xyz y"]
    engine, got = MARSEngine(model), {}
    gc = model.generation_config
    gc.max_new_tokens, gc.do_sample = 16, False
    for i, p in enumerate(prompts):  # one joins per step
        for ev in engine.add(i, tok(p).input_ids, gc, None, mars_verify=True, mars_draft_tree="2,2,2,2"):
            got.setdefault(ev.handle, []).extend(ev.tokens)
        for ev in engine.step(0.3):
            got.setdefault(ev.handle, []).extend(ev.tokens)
    while len(engine):
        for ev in engine.step(0.3):
            got.setdefault(ev.handle, []).extend(ev.tokens)
    for i, p in enumerate(prompts):
        enc = tok([p], return_tensors="pt")
        assert got[i] == _generate(model, enc, max_new_tokens=16)[0, enc.input_ids.shape[1]:].tolist()


# ------------------------------------------------------------------------------------------ where a tree cannot be


def test_auto_falls_back_to_the_chain_where_a_tree_cannot_be(peaky):
    model, tok = peaky
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = _generate(model, enc, repetition_penalty=1.5)
    assert torch.equal(_generate(model, enc, repetition_penalty=1.5, mars_verify=True), ref)


@pytest.mark.parametrize("case", ["history_processor", "static_cache", "eager_flash"])
def test_an_asked_for_tree_is_refused_clearly(peaky, case):
    model, tok = peaky
    enc = tok(["hello world"], return_tensors="pt")
    kw = dict(mars_verify=True, mars_draft_tree="2,1")
    if case == "history_processor":
        kw["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
        match = "read the token history"
    elif case == "static_cache":
        if not STATIC_CACHE_SUPPORTED:
            pytest.skip("static cache layers roll back from transformers 5.24 on (refused before that anyway)")
        kw["cache_implementation"] = "static"
        match = "a static cache, or a sliding window"
    else:
        model.config._attn_implementation = "flash_attention_2"
        match = "4D attention mask"
    try:
        with pytest.raises(ValueError, match=match):
            _generate(model, enc, **kw)
    finally:
        model.config._attn_implementation = "sdpa"


def test_sampling_with_an_asked_for_tree_uses_the_chain(peaky, caplog):
    """Accepted with a warning, not refused (the README's "Decode" and docs/generation.md's "Draft trees" say so)."""
    from transformers.utils import logging as hf_logging

    model, tok = peaky
    enc = tok(["hello world"], return_tensors="pt")
    torch.manual_seed(0)
    tree_module._logger.warning_once.cache_clear()  # the warning is given once per process
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            out = model.generate(**enc, max_new_tokens=8, do_sample=True, mars_verify=True, mars_draft_tree="2,1")
    finally:
        hf_logging.disable_propagation()
    assert out.shape[1] == enc.input_ids.shape[1] + 8
    assert "decoding with the draft chain instead of a tree: sampling" in caplog.text


@pytest.mark.parametrize("value,match", [("0,1", "ints >= 1"), ("abc", "ints >= 1"), ("1,1,1,1,1,1", "deep"),
                                         ([], "ints >= 1"), ("1.5", "ints >= 1")])
def test_bad_tree_shapes(peaky, value, match):
    model, tok = peaky
    with pytest.raises(ValueError, match=match):
        _generate(model, tok(["hi"], return_tensors="pt"), mars_verify=True, mars_draft_tree=value)


def test_a_tree_needs_verify_mode(peaky):
    model, tok = peaky
    with pytest.raises(ValueError, match="mars_verify=True"):
        _generate(model, tok(["hi"], return_tensors="pt"), mars_threshold=0.9, mars_draft_tree="2,1")


def test_tree_with_a_passed_static_cache_is_refused(peaky):
    if not STATIC_CACHE_SUPPORTED:
        pytest.skip("static cache layers roll back from transformers 5.24 on (refused before that anyway)")
    model, tok = peaky
    enc = tok(["hello"], return_tensors="pt")
    cache = StaticCache(config=model.config, max_cache_len=128)
    with pytest.raises(ValueError, match="a static cache, or a sliding window"):
        _generate(model, enc, mars_verify=True, mars_draft_tree="1,1", **{CACHE_ARG: cache})
