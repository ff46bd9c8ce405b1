"""Real structured-output clients: grammar-constrained decoding libraries plugged in as `logits_processor=`.

Their processors advance a parser by one token per call (xgrammar's HF processor asserts that the token it
is handed is accepted; outlines advances a guide per row), so a speculative or rolled-back call corrupts
them. Plain generate, tau = 1 and verify mode must give identical tokens; tau < 1 must give output that is
valid under the grammar.
"""

import json
import re

import pytest
import torch
from transformers import LogitsProcessorList

from hf_mars.testing_utils import build_char_tokenizer
from hf_mars.generation import enable_mars

xgr = pytest.importorskip("xgrammar")
outlines = pytest.importorskip("outlines")

PROMPTS = ["hello world", "a", "the quick brown fox", "xy"]
SCHEMA = {
    "type": "object",
    "properties": {"pet": {"enum": ["cat", "dog", "fish"]}, "age": {"type": "integer"}},
    "required": ["pet", "age"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
EBNF = 'root ::= "(" [a-c] [a-c]? [a-c]? ")" [0-9]'
EBNF_AS_REGEX = r"\([a-c]{1,3}\)[0-9]"
MAX_NEW = 64


@pytest.fixture(scope="module", params=["qwen2", "gpt2-aligned"])
def model_and_tok(request):
    from hf_mars import add_mask_token
    from hf_mars.testing_utils import tiny_qwen2

    tok = build_char_tokenizer()
    if request.param == "qwen2":
        model = tiny_qwen2(tok, seed=1, initializer_range=0.5)
        add_mask_token(model, tok)
        enable_mars(model)
    else:
        from test_stateful_clients import position_only_model

        model = position_only_model(tok)
    return model, tok


def _valid_json(text):
    obj = json.loads(text)
    assert set(obj) == {"pet", "age"} and obj["pet"] in SCHEMA["properties"]["pet"]["enum"]
    assert isinstance(obj["age"], int)


def _xgr_prefix_ok(compiled):
    def check(tokens):
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tokens)
    return check


def _outlines_prefix_ok(factory):
    from outlines_core import Guide

    index = factory().index

    def check(tokens):
        guide = Guide(index)
        for t in tokens:
            if t not in guide.get_tokens():
                return False
            guide.advance(t, return_tokens=False)
        return True
    return check


def _factories(model, tok):
    """(name, fresh-processor factory, validator of a finished output, the library's own prefix check)."""
    V = model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info)
    xgr_json = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    xgr_ebnf = compiler.compile_grammar(EBNF)
    from outlines.backends import (
        get_json_schema_logits_processor,
        get_regex_logits_processor,
    )

    om = outlines.from_transformers(model, tok)
    ol_json = lambda: get_json_schema_logits_processor("outlines_core", om, json.dumps(SCHEMA))  # noqa: E731
    ol_regex = lambda: get_regex_logits_processor("outlines_core", om, REGEX)  # noqa: E731
    return [
        ("xgrammar-json", lambda: xgr.contrib.hf.LogitsProcessor(xgr_json), _valid_json, _xgr_prefix_ok(xgr_json)),
        ("xgrammar-ebnf", lambda: xgr.contrib.hf.LogitsProcessor(xgr_ebnf),
         lambda t: re.fullmatch(EBNF_AS_REGEX, t) or pytest.fail(f"{t!r} violates the grammar"),
         _xgr_prefix_ok(xgr_ebnf)),
        ("outlines-json", ol_json, _valid_json, _outlines_prefix_ok(ol_json)),
        ("outlines-regex", ol_regex, lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r} violates the regex"),
         _outlines_prefix_ok(ol_regex)),
    ]


def _generate(model, enc, factory, **kw):
    return model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=kw.pop("do_sample", False),
                          logits_processor=LogitsProcessorList([factory()]), return_dict_in_generate=True, **kw)


def _check(tok, sequences, P, validate, prefix_ok):
    """Finished rows must be complete, valid documents; rows cut by the token budget a valid prefix."""
    for r in range(sequences.shape[0]):
        row = sequences[r, P:].tolist()
        if tok.eos_token_id in row:
            validate(tok.decode(row[:row.index(tok.eos_token_id)], skip_special_tokens=True))
        else:
            assert prefix_ok(row), f"{tok.decode(row)!r} leaves the grammar"


@pytest.mark.parametrize("batch", [1, 4])
def test_grammar_processors_lossless_and_valid(model_and_tok, batch):
    model, tok = model_and_tok
    enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    for name, factory, validate, prefix_ok in _factories(model, tok):
        plain = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False,
                               logits_processor=LogitsProcessorList([factory()]))
        _check(tok, plain, P, validate, prefix_ok)
        for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0),
                   dict(mars_verify=True, mars_threshold=0.9), dict(mars_threshold=1.0, mars_cache="block")):
            out = _generate(model, enc, factory, **kw)
            assert torch.equal(out.sequences, plain), (name, kw)
        for kw in (dict(mars_threshold=0.5), dict(mars_threshold=0.0), dict(mars_threshold=0.0, mars_cache="block")):
            out = _generate(model, enc, factory, **kw)  # lossy, but always inside the grammar
            _check(tok, out.sequences, P, validate, prefix_ok)


def test_grammar_processor_verify_sampling_valid(model_and_tok):
    model, tok = model_and_tok
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    for name, factory, validate, prefix_ok in _factories(model, tok):
        torch.manual_seed(0)
        out = _generate(model, enc, factory, do_sample=True, mars_verify=True, mars_threshold=0.0)
        _check(tok, out.sequences, P, validate, prefix_ok)


# ------------------------------------------------------------------ transformers-cfg
CFG_GRAMMARS = [  # (EBNF, the same language as a regex)
    ('root ::= [0-9] (" " [0-9])*', r"[0-9]( [0-9])*"),
    ('root ::= "(" [a-c]+ ")" ("," "(" [a-c]+ ")")*', r"\([a-c]+\)(,\([a-c]+\))*"),
]


@pytest.fixture(scope="module")
def cfg_model_and_tok(tmp_path_factory):
    """transformers-cfg reads the tokenizer's byte map: a qwen2 checkpoint's tokenizer, reloaded from disk (the
    library reloads it by path). Offline shim: GPT-2's byte map comes from transformers, not from the Hub."""
    pytest.importorskip("transformers_cfg")
    import transformers_cfg.tokenization.middle.ByteProxyMapping as byte_proxy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from hf_mars import add_mask_token
    from hf_mars.testing_utils import tiny_qwen2

    class _OfflineGPT2ByteMap:
        @staticmethod
        def from_pretrained(name, **kwargs):
            if name != "gpt2":
                return AutoTokenizer.from_pretrained(name, **kwargs)
            maps = type("GPT2ByteMap", (), {})()
            maps.byte_encoder = bytes_to_unicode()
            maps.byte_decoder = {v: k for k, v in maps.byte_encoder.items()}
            return maps

    mp = pytest.MonkeyPatch()
    mp.setattr(byte_proxy, "AutoTokenizer", _OfflineGPT2ByteMap)
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=3, initializer_range=0.5)
    add_mask_token(model, tok)
    path = tmp_path_factory.mktemp("cfg-ckpt")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    enable_mars(model)
    yield model, AutoTokenizer.from_pretrained(path)
    mp.undo()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_transformers_cfg_lossless_and_valid(cfg_model_and_tok, prompt):
    """transformers-cfg's matcher raises when handed a history that goes on past EOS (AR decoding at batch 1
    never does that): tau < 1 must raise nothing and stay inside the grammar; tau = 1 and verify equal plain
    decoding. Batch 1 only: in a batch, plain generate itself hands a finished row's EOS to the matcher, and
    transformers-cfg 0.2.7 then raises whenever the parser's first stack is not the empty one."""
    from transformers_cfg.generation.logits_process import (
        GrammarConstrainedLogitsProcessor,
    )
    from transformers_cfg.grammar_utils import IncrementalGrammarConstraint

    model, tok = cfg_model_and_tok
    enc = tok([prompt], return_tensors="pt")
    P = enc.input_ids.shape[1]
    ended_early = 0
    for grammar, as_regex in CFG_GRAMMARS:
        def factory():
            return GrammarConstrainedLogitsProcessor(IncrementalGrammarConstraint(grammar, "root", tok))

        recognizer = factory().grammar_constraint.string_recognizer

        def check(sequences):
            for r in range(sequences.shape[0]):
                row = sequences[r, P:].tolist()
                if tok.eos_token_id in row:
                    text = tok.decode(row[:row.index(tok.eos_token_id)], skip_special_tokens=True)
                    assert recognizer._accept_string(text) and re.fullmatch(as_regex, text), (grammar, text)
                else:
                    text = tok.decode(row, skip_special_tokens=True)
                    assert recognizer._accept_prefix(text), (grammar, text)

        plain = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False,
                               logits_processor=LogitsProcessorList([factory()]))
        check(plain)
        ended_early += int((plain[:, P:] == tok.eos_token_id).any(1).sum())
        for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0),
                   dict(mars_verify=True, mars_threshold=0.9)):
            out = _generate(model, enc, factory, **kw)
            assert torch.equal(out.sequences, plain), (grammar, kw)
        for kw in (dict(mars_threshold=0.9), dict(mars_threshold=0.5), dict(mars_threshold=0.0),
                   dict(mars_threshold=0.0, mars_cache="block")):
            out = _generate(model, enc, factory, **kw)  # lossy, but inside the grammar, and nothing raises
            check(out.sequences)
    assert ended_early > 0, "no answer reached EOS: the test would not exercise a history past EOS"
