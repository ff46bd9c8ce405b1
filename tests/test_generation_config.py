"""`MARSGenerationConfig`: the one place the mars_* options live (fields, defaults, checks, flags)."""

import argparse
import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from hf_mars import MARSGenerationConfig
from hf_mars.generation import MARS_ARGUMENTS, enable_mars, mars_generate


@pytest.fixture
def peaky(make_model):
    model, tok = make_model(seed=1, initializer_range=0.5)
    enable_mars(model)
    return model, tok


def test_every_field_is_documented_and_is_a_generate_argument():
    import inspect

    params = inspect.signature(mars_generate).parameters
    for f in dataclasses.fields(MARSGenerationConfig):
        assert len(f.metadata.get("help", "")) > 40, f.name
        assert "mars_" + f.name in MARS_ARGUMENTS and "mars_" + f.name in params, f.name


def test_defaults_and_the_verify_defaults():
    c = MARSGenerationConfig()
    assert (c.threshold, c.block_size, c.acceptance, c.cache, c.verify, c.use_last_mask) == (
        0.95, 4, "probability", "sliding", False, False)
    v = MARSGenerationConfig(verify=True)
    assert v.threshold == 0.3 and v.use_last_mask is True


@pytest.mark.parametrize("bad,says", [
    (dict(threshold=1.5), "mars_threshold"), (dict(threshold=True), "mars_threshold"),
    (dict(block_size=0), "mars_block_size"), (dict(acceptance="vibes"), "mars_acceptance"),
    (dict(max_accept=0), "mars_max_accept"), (dict(cache="paged"), "mars_cache"),
    (dict(cache_block=1.5), "mars_cache_block"), (dict(verify="yes"), "mars_verify"),
    (dict(verify=True, cache="block"), "mars_cache='sliding'"), (dict(use_last_mask=1), "mars_use_last_mask"),
    (dict(compile_prefill="yes"), "mars_compile_prefill"), (dict(guard_every_step=0), "mars_guard_every_step")])
def test_bad_values_are_refused_when_built(bad, says):
    with pytest.raises(ValueError, match=says):
        MARSGenerationConfig(**bad)


def test_resolution_order_argument_config_object_generation_config_checkpoint(peaky):
    model, _ = peaky
    gc = GenerationConfig(mars_threshold=0.7, mars_acceptance="margin")
    model.config.mars["block_size"] = 3
    try:
        c = MARSGenerationConfig.resolve(model, gc)
        assert (c.threshold, c.acceptance, c.block_size) == (0.7, "margin", 3)
        base = MARSGenerationConfig(threshold=0.6)
        c = MARSGenerationConfig.resolve(model, gc, base=base)
        assert (c.threshold, c.acceptance, c.block_size) == (0.6, "margin", 3)  # only what base set
        c = MARSGenerationConfig.resolve(model, gc, base=base, mars_threshold=0.5, mars_block_size=2)
        assert (c.threshold, c.block_size) == (0.5, 2)
        assert MARSGenerationConfig.resolve(model, gc, mars_verify=True).threshold == 0.3  # verify's own
    finally:
        model.config.mars["block_size"] = 4
    with pytest.raises(ValueError, match="MARSGenerationConfig"):
        MARSGenerationConfig.resolve(model, gc, base={"threshold": 0.5})


def test_resolved_options_are_each_calls_own_and_checked_every_call(peaky):
    """Options are resolved on every call into a config of the call's own (changing it changes no later call), and
    a bad value is refused every time."""
    model, _ = peaky
    gc = GenerationConfig(mars_acceptance="margin")
    first = MARSGenerationConfig.resolve(model, gc, mars_threshold=0.8)
    again = MARSGenerationConfig.resolve(model, gc, mars_threshold=0.8)
    assert again is not first and (first.threshold, first.acceptance) == (0.8, "margin")
    first.threshold = 0.1
    assert MARSGenerationConfig.resolve(model, gc, mars_threshold=0.8).threshold == 0.8
    saved = MARSGenerationConfig.resolve(model, GenerationConfig(mars_threshold=0.8, mars_acceptance="margin"))
    assert saved._from_call == frozenset() and again._from_call == frozenset({"threshold"})
    tree = MARSGenerationConfig.resolve(model, gc, mars_verify=True, mars_draft_tree=[2, 1])
    assert tree.draft_tree == "2,1"
    for _ in range(2):
        with pytest.raises(ValueError, match="mars_threshold"):
            MARSGenerationConfig.resolve(model, gc, mars_threshold=2.0)


def test_generate_takes_a_config_object(peaky):
    model, tok = peaky
    enc = tok(["hello world", "a"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    by_args = model.generate(**enc, mars_threshold=0.4, mars_block_size=3, **kw)
    by_config = model.generate(**enc, mars_config=MARSGenerationConfig(threshold=0.4, block_size=3), **kw)
    assert torch.equal(by_args.sequences, by_config.sequences)
    assert torch.equal(by_args.mars_forward_passes, by_config.mars_forward_passes)
    verify = model.generate(**enc, mars_config=MARSGenerationConfig(verify=True), **kw)
    assert torch.equal(verify.sequences, model.generate(**enc, **kw).sequences)


def test_command_flags_come_from_the_fields():
    parser = argparse.ArgumentParser()
    MARSGenerationConfig.add_arguments(parser, ("acceptance", "block_size", "verify"))
    args = parser.parse_args(["--mars-acceptance", "entropy", "--mars-verify"])
    assert MARSGenerationConfig.from_arguments(args, ("acceptance", "block_size", "verify")) == {
        "mars_acceptance": "entropy", "mars_verify": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["--mars-acceptance", "vibes"])
    assert "entropy" in parser.format_help()


def test_draft_tree_option_forms():
    from hf_mars.generation.config import parse_draft_tree

    assert MARSGenerationConfig().draft_tree == "auto"
    assert MARSGenerationConfig(verify=True, draft_tree=[2, 1, 1]).draft_tree == "2,1,1"
    assert MARSGenerationConfig(verify=True, draft_tree=" Chain ").draft_tree == "chain"
    assert parse_draft_tree((3, 2)) == parse_draft_tree("3, 2") == "3,2"
    # B = 4 with the last mask (verify's default): 4 depths; without it, 3
    assert MARSGenerationConfig(verify=True, draft_tree="1,1,1,1").draft_tree == "1,1,1,1"
    with pytest.raises(ValueError, match="3 draft masks"):
        MARSGenerationConfig(verify=True, use_last_mask=False, draft_tree="1,1,1,1")
    for bad in ("", "0", "2,-1", "x", [1.5], True):
        with pytest.raises(ValueError, match="mars_draft_tree"):
            parse_draft_tree(bad)
