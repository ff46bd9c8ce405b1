"""`mars_draft_vocab` (hf_mars/generation/draft_vocab.py): verify mode with the mask columns' logits restricted to a
draft vocabulary is still exactly plain greedy, the restriction is real (mask columns see only the listed ids, real
columns the full vocabulary), the model's LM head comes back after the call, and misuse is refused clearly."""

import pytest
import torch

from hf_mars.generation import MARSGenerationConfig, enable_mars
from hf_mars.generation.draft_vocab import DraftVocabulary, parse_draft_vocab, rank_tokens

PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=1.0)  # confident masks: drafts are often accepted
    enable_mars(model)
    return model, tok


def _greedy(model, enc, **kw):
    return model.generate(**enc, max_new_tokens=24, do_sample=False, **kw)


def _vocabularies(model, tok):
    """A draft vocabulary from the model's own greedy output (what the demo builds), one of a few ids, the whole
    vocabulary as a tensor."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    own = rank_tokens(_greedy(model, enc).tolist())
    return {"own-output": own, "tiny": [5, 6, 7], "all": torch.arange(model.config.vocab_size)}


@pytest.mark.parametrize("tree", ["auto", "chain"])
def test_verify_with_a_draft_vocabulary_is_plain_greedy(peaky, tree):
    model, tok = peaky
    tok.padding_side = "left"
    for name, vocab in _vocabularies(model, tok).items():
        for prompts in (PROMPTS[:1], PROMPTS):  # batch 1 and a left-padded batch
            enc = tok(prompts, return_tensors="pt", padding=True)
            plain = _greedy(model, enc, mars=False)
            out = _greedy(model, enc, mars=True, mars_verify=True, mars_draft_tree=tree, mars_draft_vocab=vocab)
            assert torch.equal(out, plain), (name, prompts)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_head_on_onednn_kernels_drafts_from_its_rows_and_stays_greedy(peaky):
    """`torch.utils.mkldnn.to_mkldnn` (a CPU speed-up the demo times: `hf_mars.demo.real.onednn_copy`) keeps every
    linear layer's weight in oneDNN's own layout, which cannot be indexed: the draft vocabulary gathers its rows
    from a dense view, and verify with it on that model is that model's plain greedy, tree or chain."""
    from hf_mars.demo.real import onednn_copy

    model, tok = peaky
    tok.padding_side = "left"
    fast = onednn_copy(model)
    assert fast.get_output_embeddings().weight.is_mkldnn
    vocab = _vocabularies(model, tok)["own-output"]
    listed = DraftVocabulary(fast, tuple(vocab), model.config.mars["mask_token_id"])
    torch.testing.assert_close(listed.weight, model.get_output_embeddings().weight.detach()[listed.ids])
    with torch.inference_mode():
        for prompts in (PROMPTS[:1], PROMPTS):
            enc = tok(prompts, return_tensors="pt", padding=True)
            plain = _greedy(fast, enc, mars=False)
            for tree in ("chain", "tree"):
                out = _greedy(fast, enc, mars=True, mars_verify=True, mars_draft_tree=tree, mars_draft_vocab=vocab)
                assert torch.equal(out, plain), (tree, prompts)


def test_mask_columns_see_only_the_draft_vocabulary(peaky):
    """The split head itself: on [prompt | masks], real columns equal the plain head's logits, mask columns equal
    them on the listed ids and are -inf elsewhere."""
    model, tok = peaky
    mask_id = model.config.mars["mask_token_id"]
    ids = tok("hello", return_tensors="pt")["input_ids"]
    input_ids = torch.cat([ids, torch.full((1, 3), mask_id)], dim=1)
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        vocab = DraftVocabulary(model, (5, 9, 11, mask_id), mask_id)
        split = vocab.wrap(model.__call__, model)(input_ids=input_ids, logits_to_keep=0).logits
    assert model.get_output_embeddings() is vocab.head  # (the split head is in place for the forward only)
    real, masks = slice(0, ids.shape[1]), slice(ids.shape[1], None)
    torch.testing.assert_close(split[:, real], plain[:, real])
    listed = torch.tensor([5, 9, 11])
    torch.testing.assert_close(split[:, masks][..., listed], plain[:, masks][..., listed])
    others = torch.ones(plain.shape[-1], dtype=torch.bool)
    others[listed] = False
    assert torch.isinf(split[:, masks][..., others]).all() and not torch.isinf(split[:, real]).any()


def test_the_model_keeps_its_own_head(peaky):
    model, tok = peaky
    head = model.get_output_embeddings()
    enc = tok(PROMPTS[:1], return_tensors="pt")
    _greedy(model, enc, mars=True, mars_verify=True, mars_draft_vocab=[5, 6])
    assert model.get_output_embeddings() is head
    vocab = DraftVocabulary(model, (5,), model.config.mars["mask_token_id"])
    with pytest.raises(RuntimeError), vocab.installed(model):
        raise RuntimeError("a failing step")
    assert model.get_output_embeddings() is head


def test_refusals(peaky):
    model, tok = peaky
    enc = tok(PROMPTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="mars_verify=True"):
        _greedy(model, enc, mars=True, mars_threshold=0.9, mars_draft_vocab=[5, 6])
    with pytest.raises(ValueError, match="outside this model"):
        _greedy(model, enc, mars=True, mars_verify=True, mars_draft_vocab=[10 ** 6])
    for bad in ([], [1.5], ["a"], [-1], 7, [True]):
        with pytest.raises(ValueError, match="mars_draft_vocab"):
            parse_draft_vocab(bad)
    assert parse_draft_vocab(torch.tensor([3, 3, 2])) == (3, 2)


def test_a_saved_draft_vocabulary_serves_verify_and_stays_out_of_threshold_mode(peaky):
    """A checkpoint may carry its draft vocabulary as a generation default (mars_draft_vocab in
    generation_config.json): verify calls use it, threshold-mode calls ignore it rather than fail."""
    model, tok = peaky
    model.generation_config.mars_draft_vocab = [5, 6, 7]
    enc = tok(PROMPTS[:1], return_tensors="pt")
    assert MARSGenerationConfig.resolve(model, model.generation_config, mars_verify=True).draft_vocab == (5, 6, 7)
    assert MARSGenerationConfig.resolve(model, model.generation_config, mars_threshold=0.9).draft_vocab is None
    plain = _greedy(model, enc, mars=False)
    assert torch.equal(_greedy(model, enc, mars=True, mars_verify=True), plain)
    _greedy(model, enc, mars=True, mars_threshold=0.9)  # no error


def test_rank_tokens_orders_by_frequency_then_id():
    assert rank_tokens([[3, 1, 3], [2, 1, 3]]) == [3, 1, 2]
    assert rank_tokens([[3, 1, 3], [2, 1, 3]], size=2) == [3, 1]


def test_auto_keeps_a_record_of_its_own_for_calls_with_a_draft_vocabulary(peaky):
    """A draft vocabulary makes verify's wide step cheaper, so which layout is fastest differs: 'auto' times those
    calls into a record (and 'cost' into step costs) of their own, not the full-vocabulary calls' (and back)."""
    from hf_mars.generation import policy
    from hf_mars.generation.cost import costs_for

    model, tok = peaky
    enc = tok(PROMPTS[:1], return_tensors="pt")
    vocab = parse_draft_vocab([5, 6, 7])
    plain, with_vocab = policy.record_for(model, 1, "call"), policy.record_for(model, 1, "call", vocab)
    assert plain is not with_vocab
    _greedy(model, enc, mars=True, mars_verify=True, mars_draft_vocab=list(vocab))
    assert sum(with_vocab.calls.values()) == 1 and sum(plain.calls.values()) == 0
    _greedy(model, enc, mars=True, mars_verify=True)
    assert sum(with_vocab.calls.values()) == 1 and sum(plain.calls.values()) == 1
    assert costs_for(model, "tree", vocab) is not costs_for(model, "tree")
    _greedy(model, enc, mars=True, mars_verify=True, mars_draft_tree="cost", mars_draft_vocab=list(vocab))
    assert costs_for(model, "tree", vocab).widths(1) and not costs_for(model, "tree").widths(1)


@pytest.mark.timeout(600)
def test_compiled_steps_refuse_an_asked_draft_vocabulary_and_pass_over_a_saved_one(peaky):
    """The draft vocabulary runs eager decode steps. Asked for beside compiled steps (a static cache with a compile
    config), it is refused; saved with the checkpoint, it gives way to the compiled steps the call asked for."""
    from transformers import CompileConfig

    from hf_mars import _compat as lib_compat
    from hf_mars.generation import STATIC_CACHE_SUPPORTED

    if not STATIC_CACHE_SUPPORTED:
        pytest.skip("static cache layers roll back from transformers 5.24 on")
    model, tok = peaky
    enc = tok(PROMPTS[:1], return_tensors="pt")
    compiled = dict(mars=True, mars_verify=True, cache_implementation="static",
                    compile_config=lib_compat.compile_on_any_device(CompileConfig(backend="eager")))
    with pytest.raises(ValueError, match="runs eager decode steps"):
        _greedy(model, enc, mars_draft_vocab=[5, 6, 7], **compiled)
    model.generation_config.mars_draft_vocab = [5, 6, 7]
    try:
        assert torch.equal(_greedy(model, enc, **compiled), _greedy(model, enc, mars=False))
        assert "_mars_compiled_call" in model.__dict__, "the steps were compiled"
    finally:
        torch._dynamo.reset()


def test_a_served_batch_drafts_from_the_saved_vocabulary_and_stays_greedy(peaky, monkeypatch):
    """`MARSEngine` (`hf-mars serve`) steps its decoders one by one: each decode forward runs with the split head,
    and the rows are still plain greedy."""
    from transformers import GenerationConfig

    from hf_mars.generation import draft_vocab
    from hf_mars.generation.engine import MARSEngine

    model, tok = peaky
    tok.padding_side = "left"
    head = model.get_output_embeddings()
    model.generation_config.mars_draft_vocab = rank_tokens(_greedy(model, tok(PROMPTS, return_tensors="pt",
                                                                           padding=True)).tolist())
    split_forwards = []
    forward = draft_vocab._SplitHead.forward
    monkeypatch.setattr(draft_vocab._SplitHead, "forward", lambda self, h: split_forwards.append(1) or forward(self, h))
    engine, got, done = MARSEngine(model), {}, set()
    for prompt in PROMPTS[:2]:
        ids = tok([prompt], return_tensors="pt").input_ids[0].tolist()
        gc = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
        for handle, tokens, finished, _ in engine.add(prompt, ids, gc, 0.3, mars_verify=True):
            got.setdefault(handle, []).extend(tokens)
    while len(engine):
        for handle, tokens, finished, _ in engine.step(0.3):
            got.setdefault(handle, []).extend(tokens)
        assert model.get_output_embeddings() is head  # (between steps, the model's own head)
    assert split_forwards, "the served steps used the draft vocabulary"
    for prompt in PROMPTS[:2]:
        enc = tok([prompt], return_tensors="pt")
        plain = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert got[prompt] == plain[0, enc.input_ids.shape[1]:].tolist(), prompt
