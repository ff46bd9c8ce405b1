"""Regression tests for defects found by trying hf-mars as a new user would (each failed before its fix)."""

import math

import pytest
import torch

import hf_mars
from hf_mars import MARSConfig, add_mask_token, enable_mars, save_for_hub
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2
from hf_mars.training.tokens import set_mars_metadata


@pytest.fixture
def model_tok():
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=1, initializer_range=0.5)
    add_mask_token(model, tok)
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    return enable_mars(model), tok


@pytest.mark.parametrize("kw", [dict(mars_threshold=1.0), dict(mars_threshold=0.5), dict(mars_verify=True)])
def test_scores_after_a_row_finishes_give_finite_log_probs(model_tok, kw):
    model, tok = model_tok
    enc = tok(["hello world", "a", "the quick brown fox", "xy"], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, **kw)
    assert (out.mars_emitted_tokens < 30).any(), "a row must finish early"
    for normalize in (False, True):
        ts = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
        assert torch.isfinite(ts).all()
    mask = out.sequences[:, enc.input_ids.shape[1]:] != tok.pad_token_id
    assert torch.isfinite((ts * mask).sum(1)).all()
    assert all(torch.isfinite(lg.amax(-1)).all() for lg in out.logits)


def test_empty_prompt_is_a_clear_error(model_tok):
    model, _ = model_tok
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4, mars=True)
    with pytest.raises(ValueError, match="all zeros"):
        model.generate(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
                       max_new_tokens=4, mars=True)


def test_block_size_above_trained_warns(model_tok, caplog):
    from transformers.utils import logging as hf_logging

    import hf_mars.generation.config as gen

    model, tok = model_tok
    enc = tok(["hello"], return_tensors="pt")
    gen._logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            model.generate(**enc, max_new_tokens=4, mars_block_size=6)
    finally:
        hf_logging.disable_propagation()
    assert "larger than the block size this model was trained with (4)" in caplog.text


def test_untrained_mask_token_warns_and_is_refused_for_the_hub(tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    import hf_mars.generation.config as gen
    from hf_mars import hub

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    add_mask_token(model, tok)  # no MARS training
    enable_mars(model)
    gen._logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            model.generate(**tok(["hi"], return_tensors="pt"), max_new_tokens=3, mars=True)
    finally:
        hf_logging.disable_propagation()
    assert "never MARS-trained" in caplog.text
    with pytest.raises(ValueError, match="never MARS-trained"):
        save_for_hub(model, tok, tmp_path / "untrained")
    folder = save_for_hub(model, tok, tmp_path / "forced", force=True)
    with pytest.raises(ValueError, match="never MARS-trained"):
        hub.push_to_hub(folder, "me/model", dry_run=True)
    assert hub.push_to_hub(folder, "me/model", dry_run=True, force=True)
    from hf_mars.cli import main

    assert main(["push", str(folder), "--repo-id", "me/model", "--dry-run"]) == 2
    assert main(["push", str(folder), "--repo-id", "me/model", "--dry-run", "--force"]) == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_non_finite_ar_weight_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="finite number >= 0"):
        MARSConfig(output_dir=str(tmp_path), ar_weight=bad, report_to=[])


def test_non_finite_loss_stops_training_with_a_clear_error(tmp_path):
    from datasets import Dataset

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    with torch.no_grad():
        model.model.norm.weight.fill_(math.nan)
    args = MARSConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2, report_to=[],
                      save_strategy="no", dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": "a b", "completion": " c d"}] * 4)
    trainer = hf_mars.MARSTrainer(model, args=args, train_dataset=data, processing_class=tok)
    with pytest.raises(FloatingPointError, match="not finite at step 0"):
        trainer.train()


def test_custom_generate_mars_generate_after_enable_mars(model_tok):
    model, tok = model_tok
    enc = tok(["hello"], return_tensors="pt")
    a = model.generate(**enc, max_new_tokens=6, custom_generate=hf_mars.mars_generate, mars_threshold=0.5)
    b = model.generate(**enc, max_new_tokens=6, mars_threshold=0.5)
    assert torch.equal(a, b)

    def other(model, input_ids, **kw):  # noqa: ARG001
        return input_ids

    with pytest.raises(ValueError, match=r"custom_generate='other'.*mars_threshold=0.5"):
        model.generate(**enc, max_new_tokens=6, custom_generate=other, mars_threshold=0.5)
