"""MARS on the decoder architectures people use: training consistency, decoding equivalences, the Hub path.

Each architecture is a tiny random config built from the model's own config class (tests/architectures.py).
`python tests/compat_table.py` renders docs/architectures.md's compatibility table from these tests' outcomes.
"""

import inspect
import random

import pytest
import torch
from architectures import ARCHITECTURES, SDPA_UNSUPPORTED, WINDOW, build
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_mars import MARSConfig, MARSTrainer, enable_mars, save_for_hub
from hf_mars.generation import STATIC_CACHE_SUPPORTED
from hf_mars.generation.cache import RollbackCache
from hf_mars.testing_utils import build_char_tokenizer
from hf_mars.training.masking import build_model_mars_mask, build_noisy_input_ids
from hf_mars.training.tokens import set_mars_metadata

ARCHS = list(ARCHITECTURES)
PROMPTS = ["hello world, a long prompt", "a", "the quick brown fox", "xy"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _plain_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0].float()


# ------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_training_consistency(arch, attn, tok):
    """Noisy outputs of the joint forward == a plain causal forward over [x[:kB], z[kB:kB+B]] per block; clean
    outputs == a plain forward over x. A padded row and a packed row, sequences longer than any sliding window."""
    if attn == "sdpa" and arch in SDPA_UNSUPPORTED:
        pytest.skip(f"transformers has no sdpa attention for {arch} (eager is tested)")
    model = build(arch, tok, attn_implementation=attn)
    mask_id, B = model.config.mars["mask_token_id"], 4
    rng = random.Random(0)
    vocab = [i for i in range(4, len(tok)) if i != mask_id]
    examples = []
    for length, prompt in ((13, 3), (9, 2)):
        ids = [rng.choice(vocab) for _ in range(length)]
        examples.append((ids, [-100] * prompt + ids[prompt:]))

    def check(ids, labels, pos, am, spans):
        ids_t, labels_t, pos_t = torch.tensor([ids]), torch.tensor([labels]), torch.tensor([pos])
        am_t = None if am is None else torch.tensor([am])
        z = build_noisy_input_ids(ids_t, labels_t, mask_id)
        mask = build_model_mars_mask(model.config, pos_t, B, am_t, attn, torch.float32)
        with torch.no_grad():
            joint = model(input_ids=torch.cat([z, ids_t], 1), attention_mask=mask,
                          position_ids=torch.cat([pos_t, pos_t], 1)).logits[0].float()
        n = len(ids)
        for start, length in spans:
            x, zz = ids[start:start + length], z[0, start:start + length].tolist()
            torch.testing.assert_close(joint[n + start:n + start + length], _plain_logits(model, x),
                                       atol=2e-4, rtol=1e-3)
            for k0 in range(0, length, B):
                ref = _plain_logits(model, x[:k0] + zz[k0:k0 + B])
                torch.testing.assert_close(joint[start + k0:start + min(k0 + B, length)], ref[k0:],
                                           atol=2e-4, rtol=1e-3)

    ids, labels = examples[0]
    pad = 3
    check(ids + [0] * pad, labels + [-100] * pad, list(range(len(ids))) + [len(ids) - 1] * pad,
          [1] * len(ids) + [0] * pad, [(0, len(ids))])
    packed_ids = examples[0][0] + examples[1][0]
    packed_labels = examples[0][1] + examples[1][1]
    packed_pos = list(range(13)) + list(range(9))
    check(packed_ids, packed_labels, packed_pos, None, [(0, 13), (13, 9)])


@pytest.mark.parametrize("arch", ARCHS)
def test_training_steps_lower_the_loss_and_checkpoint_loads(arch, tok, tmp_path):
    model = build(arch, tok)
    rows = [{"prompt": f"copy {w} ->", "completion": f" {w}{w}"} for w in ("abc", "xyz", "hello", "moon")] * 4
    args = MARSConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=8,
                      learning_rate=5e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                      dataloader_num_workers=0, block_size=4)
    trainer = MARSTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses
    trainer.save_model(str(tmp_path / "ckpt"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.mars["trained_steps"] == 8 and loaded.config.mars["block_size"] == 4
    assert type(loaded).__name__ == type(model).__name__


# ------------------------------------------------------------------------------------------ decoding


def _generate(model, enc, **kw):
    return model.generate(**enc, max_new_tokens=kw.pop("max_new_tokens", 16), do_sample=False,
                          return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_equivalences(arch, tok):
    """tau = 1 and verify == plain greedy, token for token, at batch 1 and on a left-padded batch of 4, sliding
    and block cache; tau = 0 emits exactly B tokens per forward."""
    model = enable_mars(build(arch, tok))
    set_mars_metadata(model.config, block_size=4, trained_steps=1)  # the metadata a MARS checkpoint carries
    for prompts in (PROMPTS[:1], PROMPTS):
        enc = tok(prompts, return_tensors="pt", padding=True)
        plain = _generate(model, enc).sequences
        for kw in (dict(mars_threshold=1.0), dict(mars_threshold=1.0, mars_cache="block", mars_cache_block=8),
                   dict(mars_verify=True, mars_threshold=0.0), dict(mars_verify=True)):
            out = _generate(model, enc, **kw)
            assert torch.equal(out.sequences, plain), (arch, len(prompts), kw)
    enc = tok(PROMPTS[:1], return_tensors="pt")
    out = _generate(model, enc, mars_threshold=0.0, eos_token_id=[], max_new_tokens=16)
    assert int(out.mars_emitted_tokens[0]) == 16 and int(out.mars_forward_passes[0]) == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_hub_custom_generate_decodes_identically(arch, tok, tmp_path, modules_cache):
    model = enable_mars(build(arch, tok))
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    folder = save_for_hub(model, tok, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    # the masks on every step (mars_plain_steps=False): the default's plain steps follow each process's timing
    want = _generate(model, enc, mars_threshold=0.5, mars_plain_steps=False).sequences
    got = _generate(loaded, enc, mars_threshold=0.5, mars_plain_steps=False).sequences
    assert torch.equal(got, want)


def test_sliding_window_prompt_longer_than_window(tok):
    """A prompt longer than the window, and a generation that runs far past it, stay exact."""
    model = enable_mars(build("mistral", tok))
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    prompts = ["a prompt much longer than six", "and another long prompt here"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc.input_ids.shape[1] > 4 * WINDOW
    plain = _generate(model, enc, max_new_tokens=40).sequences
    for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0)):
        assert torch.equal(_generate(model, enc, max_new_tokens=40, **kw).sequences, plain)


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_window_rows_are_ragged_while_the_call_fits_the_window(arch, cache, tok, monkeypatch):
    """A call that fits inside the window whole (prompt, new tokens, one step, the compaction slack) moves its rows
    at their own pace: no window cuts, so the masked columns ragged rows leave change no row's attention. tau = 1
    and verify equal plain greedy; threshold mode's rows each equal the row decoded alone (evened rows would not).
    With a window the call runs past, the rows move in lockstep again (as many forwards each), still exact."""
    if cache == "static" and not STATIC_CACHE_SUPPORTED:
        pytest.skip("static cache layers roll back from transformers 5.24 on")
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    P, opts = enc.input_ids.shape[1], dict(max_new_tokens=16, eos_token_id=[])
    if cache == "static":
        opts["cache_implementation"] = "static"
    modes = (dict(mars_threshold=1.0), dict(mars_verify=True), dict(mars_threshold=0.3, mars_plain_steps=False))
    tree = dict(mars_verify=True, mars_draft_tree="2,2,1,1")  # a tree's gathered path leaves gaps too
    for window, ragged in ((256, True), (12, False)):
        model = enable_mars(build(arch, tok, sliding_window=window))
        set_mars_metadata(model.config, block_size=4, trained_steps=1)
        plain = _generate(model, enc, max_new_tokens=16, eos_token_id=[]).sequences
        forwards = []
        for kw in modes:
            out = _generate(model, enc, **opts, **kw)
            forwards.append(set(out.mars_forward_passes.tolist()))
            if "mars_plain_steps" not in kw:
                assert torch.equal(out.sequences, plain), (window, kw)
            elif ragged:
                for r, prompt in enumerate(PROMPTS):
                    alone = _generate(model, tok([prompt], return_tensors="pt"), **opts, **kw)
                    assert out.sequences[r, P:].tolist() == alone.sequences[0, -16:].tolist(), (r, kw)
        if ragged:
            assert any(len(f) > 1 for f in forwards), f"no row moved at its own pace: {forwards}"
        else:
            assert all(len(f) == 1 for f in forwards), f"rows not in lockstep past the window: {forwards}"
        if cache == "static":  # (a tree never runs on a static cache)
            continue
        if ragged:  # (a window layer's length, which a chain step's mask sizes read, follows the gathered path)
            monkeypatch.setattr(RollbackCache, "keep_chunk_columns", _lengths_checked(RollbackCache.keep_chunk_columns))
            assert torch.equal(_generate(model, enc, **opts, **tree).sequences, plain)
            monkeypatch.undo()
        else:
            with pytest.raises(ValueError, match="a sliding window the call does not fit in"):
                _generate(model, enc, **opts, **tree)


def _lengths_checked(keep_chunk_columns):
    def checked(self, *args):
        keep_chunk_columns(self, *args)
        for layer in self.cache.layers:
            if type(layer) is DynamicSlidingWindowLayer:
                assert layer.get_seq_length() == layer.keys.shape[2] == self.length
    return checked


def test_a_call_fits_the_window_with_the_compaction_slack(tok):
    """Ragged rows' masked columns are compacted once over `COMPACT_THRESHOLD` of the cache, and a dynamic window
    layer keeps ``window - 1`` columns: a call of ``needed`` columns fits while needed / (1 - threshold) does."""
    from hf_mars.generation.cache import COMPACT_THRESHOLD, call_fits_window

    model = build("gemma3_text", tok, sliding_window=101)
    most = max(n for n in range(1, 101) if n / (1 - COMPACT_THRESHOLD) <= 100)
    assert call_fits_window(model, most) and not call_fits_window(model, most + 1)
    assert not call_fits_window(build("llama", tok), 1)  # no window: nothing to fit (full attention is ragged)


@pytest.mark.skipif(not STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
@pytest.mark.parametrize("arch", [a for a in ARCHS if "sliding_window" in ARCHITECTURES[a][1]])
def test_static_cache_of_sliding_window_models(arch, tok):
    """cache_implementation="static" on a sliding-window model (what compiled decoding uses): a static window layer
    overwrites its oldest column once full, so MARS decodes into full-length static layers, the model's mask
    keeping the window. Generations that run far past the window: tau = 1 and verify equal plain greedy; threshold
    mode and tau = 0 (masks accepted across the window's edge) equal the same calls on the dynamic cache."""
    model = enable_mars(build(arch, tok))
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    for prompts in (PROMPTS[:1], PROMPTS):
        enc = tok(prompts, return_tensors="pt", padding=True)
        plain = _generate(model, enc, max_new_tokens=40).sequences
        for kw in (dict(mars_threshold=1.0), dict(mars_verify=True, mars_threshold=0.0)):
            out = _generate(model, enc, max_new_tokens=40, cache_implementation="static", **kw)
            assert torch.equal(out.sequences, plain), (arch, len(prompts), kw)
        for kw in (dict(mars_threshold=0.5), dict(mars_threshold=0.0, eos_token_id=[])):
            kw["mars_plain_steps"] = False  # the masks on every step: the default's plain steps follow timing
            dynamic = _generate(model, enc, max_new_tokens=40, **kw)
            static = _generate(model, enc, max_new_tokens=40, cache_implementation="static", **kw)
            assert torch.equal(static.sequences, dynamic.sequences), (arch, len(prompts), kw)
            assert torch.equal(static.mars_forward_passes, dynamic.mars_forward_passes)
        assert int(static.mars_forward_passes[0]) == 10  # tau = 0: 4 tokens a forward, across the window's edge


@pytest.mark.skipif(not STATIC_CACHE_SUPPORTED, reason="static cache layers roll back from transformers 5.24 on")
def test_user_static_cache_with_a_prefix_on_a_sliding_window_model(tok):
    """A StaticCache the user filled with a prefix is used as it is: its window layers roll back only while the
    whole call fits in the window (transformers' `is_croppable`); beyond it, a clear error before any step."""
    from transformers import StaticCache

    window = 64
    model = enable_mars(build("gemma3_text", tok, sliding_window=window))
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    enc = tok(["the quick brown fox"], return_tensors="pt")
    plain = _generate(model, enc, max_new_tokens=8).sequences

    def prefilled(length):
        cache = StaticCache(config=model.config, max_cache_len=length)
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            model(input_ids=enc.input_ids[:, :-1], **{cache_arg: cache})
        return {cache_arg: cache}

    assert torch.equal(_generate(model, enc, max_new_tokens=8, mars_verify=True, **prefilled(window)).sequences,
                       plain)
    with pytest.raises(ValueError, match="rolls back only while the whole call fits in its window"):
        _generate(model, enc, max_new_tokens=8, mars_verify=True, **prefilled(2 * window))


def test_unsupported_layer_types_are_refused_before_any_step(tok, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_mars.training.masking import model_attention_layout

    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"'qwen2'.*linear_attention.*cannot roll back"):
        model_attention_layout(config)
    config.layer_types = ["full_attention", "full_attention"]
    model = Qwen2ForCausalLM(config)
    model.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        MARSTrainer(model, args=MARSConfig(output_dir=str(tmp_path), report_to=[], max_steps=1),
                    train_dataset=Dataset.from_list([{"prompt": "a", "completion": " b"}] * 2), processing_class=tok)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_aux_loss_is_the_models_own_on_the_clean_stream(arch, tok, tmp_path):
    """With a router aux coefficient, MARSTrainer adds the model's own load-balancing loss of the clean stream."""
    model = build(arch, tok, attn_implementation="eager")
    rows = [{"prompt": f"copy {w} ->", "completion": f" {w}{w}"} for w in ("abc", "xyz", "hello", "moon")]
    args = MARSConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                      save_strategy="no", dataloader_num_workers=0, block_size=4)
    trainer = MARSTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef > 0
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    got = trainer._metrics["train"]["aux_loss"][-1]
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_router_logits=True).aux_loss
    assert torch.isfinite(loss) and abs(got - float(own)) < 1e-4 * max(1.0, abs(float(own))), (got, float(own))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_tau1_is_greedy(arch, dtype, tok):
    """One-token steps are plain AR steps, so tau = 1 stays identical to greedy in bf16 / fp16 (verify mode may
    round differently with wider steps: measured by benchmarks/half_precision.py, exact only in float32)."""
    model = enable_mars(build(arch, tok)).to(dtype)
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    for prompts in (PROMPTS[:1], PROMPTS):
        enc = tok(prompts, return_tensors="pt", padding=True)
        plain = _generate(model, enc).sequences
        assert torch.equal(_generate(model, enc, mars_threshold=1.0).sequences, plain)
