"""Shared fixtures: tiny tokenizers and random Qwen2 models built locally (no Hub, no network)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from hf_mars import add_mask_token
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2


@pytest.fixture(autouse=True)
def _masks_on_every_step(request, monkeypatch):
    """Threshold mode's default plain-step policy (``mars_plain_steps=True``) drops a step's masks by the timing this
    process measured, so two tau < 1 runs of one call can differ. The suite compares tau < 1 outputs across paths
    (batch layouts, caches, engines, clients), so a call that leaves the option unset anywhere runs with the masks on
    every step, as ``mars_plain_steps=False`` would; tests marked ``plain_step_policy`` see the library's default."""
    if request.node.get_closest_marker("plain_step_policy"):
        return
    from hf_mars.generation.config import MARSGenerationConfig

    resolve = MARSGenerationConfig.resolve.__func__

    def masks_unless_set(cls, model, generation_config=None, base=None, **given):
        config = resolve(cls, model, generation_config, base, **given)
        saved = getattr(generation_config, "__dict__", {}).get("mars_plain_steps")
        if "plain_steps" not in config._from_call and saved is None:
            config.plain_steps = False
        return config

    monkeypatch.setattr(MARSGenerationConfig, "resolve", classmethod(masks_unless_set))


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


@pytest.fixture
def modules_cache(tmp_path):
    """A private HF_MODULES_CACHE for the code ``trust_remote_code`` copies (a checkpoint's custom_generate/).

    A checkpoint's generate.py imports its sibling modules relatively, so the ``transformers_modules`` package
    must be importable from this cache: the constant, the import path and ``sys.modules`` all point here for
    the test, and are put back after it (patching the constant alone leaves ``transformers_modules`` bound to
    whichever cache was imported first in the process)."""
    import sys

    import transformers.dynamic_module_utils as dmu

    cache = tmp_path / "modules"
    ours = lambda: [m for m in sys.modules if m == "transformers_modules" or m.startswith("transformers_modules.")]  # noqa: E731
    saved = {m: sys.modules.pop(m) for m in ours()}
    old_cache, old_path = dmu.HF_MODULES_CACHE, list(sys.path)
    dmu.HF_MODULES_CACHE = str(cache)
    sys.path.insert(0, str(cache))
    try:
        yield cache
    finally:
        for m in ours():
            del sys.modules[m]
        sys.modules.update(saved)
        dmu.HF_MODULES_CACHE = old_cache
        sys.path[:] = old_path
