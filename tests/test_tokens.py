import pytest
import torch

from hf_mars import add_mask_token, get_mars_metadata
from hf_mars.demo.tiny import build_char_tokenizer, tiny_qwen2


def test_add_mask_token_adds_resizes_and_records(tokenizer):
    model = tiny_qwen2(tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    mean = model.get_input_embeddings().weight.mean(0).clone()
    mid = add_mask_token(model, tokenizer)
    assert tokenizer.mask_token == "<|mask|>" and tokenizer.mask_token_id == mid
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == rows + 1 == mid + 1
    torch.testing.assert_close(emb[mid], mean)
    assert get_mars_metadata(model.config)["mask_token_id"] == mid
    # tokenizer round trip: the mask is one token
    assert tokenizer("a<|mask|>b")["input_ids"] == [tokenizer.convert_tokens_to_ids("a"), mid, tokenizer.convert_tokens_to_ids("b")]


def test_add_mask_token_idempotent(tokenizer):
    model = tiny_qwen2(tokenizer)
    mid = add_mask_token(model, tokenizer)
    weight = model.get_input_embeddings().weight.clone()
    assert add_mask_token(model, tokenizer) == mid
    assert len(tokenizer) == mid + 1
    torch.testing.assert_close(model.get_input_embeddings().weight, weight)


def test_add_mask_token_no_resize_when_rows_spare(tokenizer):
    from transformers import Qwen2ForCausalLM

    from hf_mars.demo.tiny import tiny_qwen2_config

    model = Qwen2ForCausalLM(tiny_qwen2_config(128))  # padded embedding matrix, as real checkpoints have
    mid = add_mask_token(model, tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == 128
    assert mid < 128


def test_add_mask_token_keeps_pad_multiple(tokenizer):
    from transformers import Qwen2ForCausalLM

    from hf_mars.demo.tiny import tiny_qwen2_config

    for _ in range(64 - len(tokenizer) % 64):
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<|x{_}|>"]}, replace_extra_special_tokens=False)
    assert len(tokenizer) % 64 == 0
    model = Qwen2ForCausalLM(tiny_qwen2_config(len(tokenizer)))
    add_mask_token(model, tokenizer)
    assert model.get_input_embeddings().weight.shape[0] % 64 == 0


def test_add_mask_token_reuses_existing_special(mars_tokenizer):
    model = tiny_qwen2(mars_tokenizer)
    n = len(mars_tokenizer)
    mid = add_mask_token(model, mars_tokenizer)
    assert mid == mars_tokenizer.mask_token_id and len(mars_tokenizer) == n


def test_add_mask_token_refuses_ordinary_token(tokenizer):
    model = tiny_qwen2(tokenizer)
    with pytest.raises(ValueError, match="ordinary token"):
        add_mask_token(model, tokenizer, mask_token="a")
    with pytest.raises(ValueError, match="non-empty"):
        add_mask_token(model, tokenizer, mask_token="")
