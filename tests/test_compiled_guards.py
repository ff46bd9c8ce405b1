"""Compiled decode steps skip torch.compile's non-differentiating guards only within one generation
(`forward.GuardedSteps`): whatever changed between two calls, the next call's first step checks every guard. Here
the model's dtype changes between calls (float32 -> float64 -> float32): the compiled steps must decode what the
eager model decodes at each dtype, never a stale graph of the other. (A dtype is a tensor guard, which even the
skipping stance checks; a replaced module is a non-tensor one, caught by each call's fully guarded first step:
tests/test_generation.py::test_compiled_steps_see_a_model_changed_between_generations.)"""

import pytest
import torch
from transformers import CompileConfig

from hf_mars import _compat as lib_compat
from hf_mars.demo.tiny import build_char_tokenizer, tiny_qwen2
from hf_mars.generation import STATIC_CACHE_SUPPORTED, enable_mars
from hf_mars.tokens import add_mask_token, set_mars_metadata


def _forget_compiled(model):
    torch._dynamo.reset()
    for key in ("_mars_compiled_call", "_mars_compiled_read", "_mars_compiled_prefill", "_mars_static_cache_length"):
        model.__dict__.pop(key, None)


@pytest.mark.skipif(not STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.timeout(600)
def test_a_dtype_changed_between_calls_never_runs_a_stale_graph():
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    add_mask_token(model, tok)
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    enable_mars(model.eval())
    enc = tok(["Reverse: abcdef"], return_tensors="pt")
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", mars_threshold=0.5)
    compiled = dict(kw, compile_config=lib_compat.compile_on_any_device(CompileConfig(backend="eager")))
    _forget_compiled(model)
    try:
        outputs = {}
        for dtype in (torch.float32, torch.float64, torch.float32):
            model.to(dtype)
            eager = model.generate(**enc, **kw, return_dict_in_generate=True, output_scores=True)
            fast = model.generate(**enc, **compiled, return_dict_in_generate=True, output_scores=True)
            assert torch.equal(fast.sequences, eager.sequences), dtype
            assert "_mars_compiled_call" in model.__dict__, "the steps were compiled"
            outputs.setdefault(dtype, eager.sequences)
            assert torch.equal(eager.sequences, outputs[dtype])
    finally:
        model.to(torch.float32)
        _forget_compiled(model)
