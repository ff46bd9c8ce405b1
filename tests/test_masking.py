"""The MARS attention rule: against a brute-force construction, and the method's consistency property (docs/method.md)."""

import random

import pytest
import torch

from hf_mars.training.masking import (
    build_mars_attention_mask,
    build_noisy_input_ids,
    mars_allowed,
    mars_mask_mod,
    sequence_ids_from_positions,
    shift_labels_for_positions,
)


def brute_force(layout, block_size):
    """Rule table straight from docs/method.md, from an explicit per-token layout.

    ``layout[i] = (sequence, position)`` or None for padding. Returns a (2n, 2n) bool list of lists.
    """
    n = len(layout)
    out = [[False] * (2 * n) for _ in range(2 * n)]
    for qs in range(2):  # 0 = noisy, 1 = clean
        for i in range(n):
            q = qs * n + i
            if layout[i] is None:
                out[q][q] = True  # padding query: itself only
                continue
            for ks in range(2):
                for j in range(n):
                    if layout[j] is None or layout[j][0] != layout[i][0]:
                        continue
                    bi, bj = layout[i][1] // block_size, layout[j][1] // block_size
                    if qs == 1 and ks == 1:
                        ok = j <= i
                    elif qs == 0 and ks == 0:
                        ok = bi == bj and j <= i
                    elif qs == 0 and ks == 1:
                        ok = bj < bi
                    else:
                        ok = False
                    out[q][ks * n + j] = ok
    return out


def random_row(rng, n, mode):
    """(layout, position_ids, padding_mask) of one row. mode: 'right', 'left', 'packed', 'padfree'."""
    if mode in ("right", "left"):
        length = rng.randint(1, n)
        pad = n - length
        layout = [(0, p) for p in range(length)]
        layout = layout + [None] * pad if mode == "right" else [None] * pad + layout
        am = [0 if x is None else 1 for x in layout]
        pos = torch.tensor(am).cumsum(0).sub(1).clamp(min=0).tolist()
        return layout, pos, am
    layout, pos, seq = [], [], 0
    while len(layout) < n:
        length = rng.randint(1, n - len(layout))
        layout += [(seq, p) for p in range(length)]
        pos += list(range(length))
        seq += 1
        if mode == "packed" and rng.random() < 0.3 and len(layout) < n:
            # trailing padding of a padded packed row (attention mask 0)
            k = n - len(layout)
            layout += [None] * k
            pos += [0] * k
    am = [0 if x is None else 1 for x in layout]
    return layout, pos, am


@pytest.mark.parametrize("mode", ["right", "left", "packed", "padfree"])
def test_mask_matches_brute_force(mode):
    rng = random.Random(hash(mode) % 1000)
    for _ in range(40):
        n = rng.randint(1, 13)
        block_size = rng.choice([1, 2, 3, 4, 5, 8])
        rows = [random_row(rng, n, mode) for _ in range(rng.randint(1, 3))]
        pos = torch.tensor([r[1] for r in rows])
        am = torch.tensor([r[2] for r in rows])
        got = mars_allowed(pos, block_size, am)
        for r, (layout, _, _) in enumerate(rows):
            want = torch.tensor(brute_force(layout, block_size))
            assert torch.equal(got[r], want), (mode, n, block_size, layout)


def test_padding_free_rows_without_attention_mask():
    """Padding-free batches carry no attention mask: sequences come from position ids alone."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]])
    layout = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    for block_size in (1, 2, 3, 4):
        assert torch.equal(mars_allowed(pos, block_size)[0], torch.tensor(brute_force(layout, block_size)))
    assert sequence_ids_from_positions(pos).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 2, 2]]


def test_mask_formats_for_each_attention_implementation():
    pos = torch.tensor([[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 2]])
    am = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    allowed = mars_allowed(pos, 2, am)
    sdpa = build_mars_attention_mask(pos, 2, am, "sdpa")
    assert sdpa.dtype == torch.bool and sdpa.shape == (2, 1, 12, 12)
    assert torch.equal(sdpa[:, 0], allowed)
    eager = build_mars_attention_mask(pos, 2, am, "eager", dtype=torch.float32)
    assert eager.dtype == torch.float32
    assert torch.equal(eager[:, 0] == 0, allowed)
    assert (eager[:, 0][~allowed] == torch.finfo(torch.float32).min).all()
    with pytest.raises(ValueError, match="sdpa"):
        build_mars_attention_mask(pos, 2, am, "flash_attention_2")


def test_flex_mask_mod_matches_dense():
    from torch.nn.attention.flex_attention import create_mask

    rng = random.Random(3)
    for mode in ("right", "packed", "padfree"):
        for _ in range(5):
            n = rng.randint(2, 11)
            block_size = rng.choice([1, 2, 3, 4])
            rows = [random_row(rng, n, mode) for _ in range(2)]
            pos = torch.tensor([r[1] for r in rows])
            am = torch.tensor([r[2] for r in rows])
            dense = create_mask(mars_mask_mod(pos, block_size, am), 2, 1, 2 * n, 2 * n, device="cpu")
            assert torch.equal(dense[:, 0], mars_allowed(pos, block_size, am))


def test_noisy_stream_and_shifted_targets():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[-100, -100, 7, 8, -100, 10]])
    assert build_noisy_input_ids(ids, labels, 99).tolist() == [[5, 6, 99, 99, 9, 99]]
    pos = torch.tensor([[0, 1, 2, 3, 0, 1]])  # two packed sequences
    assert shift_labels_for_positions(labels, pos).tolist() == [[-100, 7, 8, -100, 10, -100]]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        mars_allowed(torch.tensor([[0, 1]]), 0)


# ---------------------------------------------------------------- the method's consistency property (docs/method.md)


def _plain_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_consistency_property(make_model, attn, block_size):
    """Noisy outputs of the joint forward == plain causal forwards over [x[:kB], z[kB:kB+B]];
    clean outputs == a plain forward over x. Padded rows, and a padding-free packed row."""
    model, tok = make_model(attn_implementation=attn)
    mask_id = model.config.mars["mask_token_id"]
    rng = random.Random(block_size)
    vocab = [i for i in range(4, len(tok)) if i != mask_id]

    def example(length, prompt):
        ids = [rng.choice(vocab) for _ in range(length)]
        labels = [-100] * prompt + ids[prompt:]
        return ids, labels

    examples = [example(11, 3), example(7, 2), example(9, 0)]
    examples[2][1][0] = -100  # position 0 is never a target

    def check(ids, labels, pos, am, spans):
        ids_t, labels_t, pos_t = torch.tensor([ids]), torch.tensor([labels]), torch.tensor([pos])
        am_t = None if am is None else torch.tensor([am])
        z = build_noisy_input_ids(ids_t, labels_t, mask_id)
        mask = build_mars_attention_mask(pos_t, block_size, am_t, attn, dtype=torch.float32)
        with torch.no_grad():
            joint = model(input_ids=torch.cat([z, ids_t], 1), attention_mask=mask,
                          position_ids=torch.cat([pos_t, pos_t], 1)).logits[0]
        n = len(ids)
        for start, length in spans:  # one sequence of the row
            x = ids[start:start + length]
            zz = z[0, start:start + length].tolist()
            torch.testing.assert_close(joint[n + start:n + start + length], _plain_logits(model, x),
                                       atol=2e-5, rtol=1e-4)
            for k0 in range(0, length, block_size):
                ref = _plain_logits(model, x[:k0] + zz[k0:k0 + block_size])
                got = joint[start + k0:start + min(k0 + block_size, length)]
                torch.testing.assert_close(got, ref[k0:], atol=2e-5, rtol=1e-4)

    # padded batch rows (right padding), one at a time and as a batch
    n = max(len(e[0]) for e in examples)
    for ids, labels in examples:
        pad = n - len(ids)
        check(ids + [0] * pad, labels + [-100] * pad, list(range(len(ids))) + [len(ids) - 1] * pad,
              [1] * len(ids) + [0] * pad, [(0, len(ids))])
    # padding-free packed row: sequences follow each other, position ids restart
    ids = sum((e[0] for e in examples), [])
    labels = sum((e[1] for e in examples), [])
    pos = sum((list(range(len(e[0]))) for e in examples), [])
    starts = [0, len(examples[0][0]), len(examples[0][0]) + len(examples[1][0])]
    check(ids, labels, pos, None, [(s, len(e[0])) for s, e in zip(starts, examples)])


def test_consistency_batched_padding(make_model):
    """Rows of different lengths in one padded batch give the same outputs as each row alone."""
    model, tok = make_model()
    mask_id = model.config.mars["mask_token_id"]
    ids = torch.tensor([[7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 0, 0, 0]])
    am = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    labels = torch.tensor([[-100, -100, 9, 10, 11, 12, 13], [-100, 21, 22, 23, -100, -100, -100]])
    pos = (am.cumsum(1) - 1).clamp(min=0)
    z = build_noisy_input_ids(ids, labels, mask_id)
    with torch.no_grad():
        out = model(input_ids=torch.cat([z, ids], 1), attention_mask=build_mars_attention_mask(pos, 2, am),
                    position_ids=torch.cat([pos, pos], 1)).logits
        alone = model(input_ids=torch.cat([z[1:, :4], ids[1:, :4]], 1),
                      attention_mask=build_mars_attention_mask(pos[1:, :4], 2),
                      position_ids=torch.cat([pos[1:, :4], pos[1:, :4]], 1)).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1, :4], alone[0, :4], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[1, 7:11], alone[0, 4:], atol=2e-5, rtol=1e-4)


def test_flex_attention_forward_matches_sdpa(make_model):
    """The BlockMask path gives the joint forward of the dense path (forward only: no flex backward on CPU)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    sdpa, _ = make_model(attn_implementation="sdpa")
    flex, _ = make_model(attn_implementation="flex_attention")
    mask_id = sdpa.config.mars["mask_token_id"]
    ids = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14, 30, 31, 32, 33, 34], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                                                              40, 41, 42]])
    labels = ids.clone()
    labels[:, :3] = -100
    pos = torch.tensor([list(range(13)), list(range(6)) + list(range(7))])  # row 2: two packed sequences
    z = build_noisy_input_ids(ids, labels, mask_id)
    inputs = dict(input_ids=torch.cat([z, ids], 1), position_ids=torch.cat([pos, pos], 1))
    with torch.no_grad():
        want = sdpa(**inputs, attention_mask=build_mars_attention_mask(pos, 4, None, "sdpa")).logits
        got = flex(**inputs, attention_mask=build_mars_attention_mask(pos, 4, None, "flex_attention")).logits
        causal = sdpa(**inputs).logits  # plain causal attention over [z ; x]: must differ
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(causal, want, atol=1e-3)
