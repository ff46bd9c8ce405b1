"""Shared fixtures: tiny tokenizers and random Qwen2 models built locally (no Hub, no network)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from hf_mars import add_mask_token
from hf_mars.demo.tiny import build_char_tokenizer, tiny_qwen2


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def mars_tokenizer():
    """A tokenizer that already has the mask token (ids match `make_model`'s embeddings)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"mask_token": "<|mask|>"})
    return tok


@pytest.fixture
def make_model():
    """Factory: a random tiny Qwen2 with the mask token added (``config.mars`` set)."""

    def _make(tokenizer=None, seed=0, attn_implementation="sdpa", with_mask=True, **config_kwargs):
        tok = tokenizer if tokenizer is not None else build_char_tokenizer()
        model = tiny_qwen2(tok, seed=seed, attn_implementation=attn_implementation, **config_kwargs)
        if with_mask:
            add_mask_token(model, tok)
        return model, tok

    return _make


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
