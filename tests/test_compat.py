"""The private transformers / TRL APIs hf-mars reads (hf_mars/_compat.py), checked against the installed versions.

A failure here means an upgrade moved one: fix the accessor in hf_mars/_compat.py, nowhere else (the one private
torch record the generation package reads, which ships standalone, is in hf_mars/generation/forward.py).
"""

import pytest
import torch
from datasets import Dataset

from hf_mars import MARSConfig, MARSTrainer, _compat
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2


def test_trl_private_state(tmp_path):
    tok = build_char_tokenizer()
    trainer = MARSTrainer(tiny_qwen2(tok), args=MARSConfig(output_dir=str(tmp_path), report_to=[], max_steps=1),
                          train_dataset=Dataset.from_list([{"prompt": "a", "completion": " b"}] * 2),
                          processing_class=tok)
    assert isinstance(_compat.trl_metrics(trainer, "train"), dict) and isinstance(_compat.trl_metrics(trainer, "eval"), dict)
    assert _compat.trl_count_train_tokens(trainer, 0) == 0
    assert _compat.trl_count_train_tokens(trainer, 10 * trainer._tp_size) == 10
    # SFTTrainer built its default collator from the class MARSDataCollator extends, and MARSTrainer swapped it
    assert issubclass(type(trainer.data_collator), _compat.trl_lm_collator())


def test_trl_loading(tmp_path):
    """A model and processing class given by path, loaded as SFTTrainer loads them."""
    tok = build_char_tokenizer()
    tiny_qwen2(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    args = MARSConfig(output_dir=str(tmp_path / "out"), report_to=[], model_init_kwargs={"dtype": "bfloat16"})
    model, revision = _compat.trl_load_model(str(tmp_path), args)
    assert model.dtype == torch.bfloat16 and revision is None and args.model_init_kwargs is None
    assert _compat.trl_processing_class(model, args).get_vocab() == tok.get_vocab()


def test_trl_fused_forward_fields(tmp_path):
    tok = build_char_tokenizer()
    trainer = MARSTrainer(tiny_qwen2(tok), args=MARSConfig(output_dir=str(tmp_path), report_to=[], max_steps=1),
                          train_dataset=Dataset.from_list([{"prompt": "a", "completion": " b"}] * 2),
                          processing_class=tok)
    model = trainer.model  # SFTTrainer's fused LM-head forward
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, shift_labels=torch.tensor([[6, 7, 8, -100]]), fused_lm_head=True)
    for field in _compat.FUSED_OUTPUT_FIELDS:
        assert getattr(out, field).shape == ids.shape, field


def test_trl_fused_head_compaction_switch():
    """TRL's fused forward still decides with ``trl.trainer.utils._use_triton`` whether it scores only the
    positions with a target; the switch asks for that on a CPU, keeps TRL's choice elsewhere, and is undone."""
    import inspect

    import trl.trainer.utils as trl_utils

    assert "compact = _use_triton(hidden_states.device)" in inspect.getsource(trl_utils.add_fused_lm_head), \
        "TRL's fused LM head no longer chooses compaction with _use_triton: update _compat.fused_head_on_targets_only"
    original = trl_utils._use_triton
    with _compat.fused_head_on_targets_only():
        assert trl_utils._use_triton(torch.device("cpu")) is True
        assert trl_utils._use_triton(torch.device("meta")) == original(torch.device("meta"))
    assert trl_utils._use_triton is original


def test_transformers_private_hooks():
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

    tok = build_char_tokenizer()
    assert _compat.attn_implementation(tiny_qwen2(tok).config) == "sdpa"
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    target, index = _compat.router_logits_recorder(moe)
    assert any(isinstance(m, target) for m in moe.modules()) and index == 0
    assert callable(_compat.load_balancing_loss(moe))
    assert _compat.router_logits_recorder(tiny_qwen2(tok)) is None
    gen = GenerationConfig.from_model_config(tiny_qwen2(tok).config)
    assert gen._from_model_config is True
    _compat.keep_generation_extras(gen)
    assert gen._from_model_config is False


def test_torch_helper_threads_leave_compiled_steps_alone():
    """Once torch.compile has used one of its thread pools their non-daemon workers live on: the prefetch executor
    (torch 2.15: every compile) and inductor's async-compile pool (used or not depending on how soon the compile
    worker processes are ready, so on a loaded CI machine: every later step there ran full guards). They are torch's
    own, not a thread running generate. A user's non-daemon thread still counts."""
    import threading

    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch.utils import _functools

    from hf_mars.generation.forward import _alone

    _functools._prefetch_executor.submit(lambda: None).result()
    pools = [_functools._prefetch_executor]
    if get_compile_threads() > 1:  # (with one, inductor compiles in the caller's thread and keeps no such pool)
        AsyncCompile.pool().submit(lambda: None).result()
        pools.append(AsyncCompile.pool())
    for pool in pools:
        assert any(not t.daemon for t in pool._threads), pool
    assert _alone(), [(t.name, getattr(t, "_target", None)) for t in threading.enumerate() if not t.daemon]
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not _alone()
    finally:
        release.set()
        other.join()


def test_torch_compile_stance_record():
    """`hf_mars/generation/forward.py` reads torch's private stance record (to leave a user's ``set_stance`` alone)
    and recognises the error a ``skip_guard_eval_unsafe`` call raises when its checks find no graph (to rerun the
    step with full guards). If torch moved either, `GuardedSteps` must be updated."""
    from hf_mars.generation.forward import _stance_is_default

    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    assert stance is not None and {"stance", "skip_guard_eval_unsafe", "backend"} <= set(vars(stance)), (
        "torch._dynamo.eval_frame._stance moved: update forward._stance_is_default")
    assert _stance_is_default()
    for other in (dict(stance="force_eager"), dict(stance="default", skip_guard_eval_unsafe=True)):
        with torch.compiler.set_stance(**other):
            assert not _stance_is_default(), other
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    torch._dynamo.reset()
    double(torch.ones(2))
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True), pytest.raises(RuntimeError) as error:
            double(torch.ones(3))
        assert "skip_guard_eval_unsafe" in str(error.value), (
            "torch's error for a skip_guard_eval_unsafe call that matches no graph changed: update GuardedSteps")
    finally:
        torch._dynamo.reset()
