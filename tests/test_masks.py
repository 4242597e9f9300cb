"""Masks: build, combine, convert. Checked against loops written out by hand and against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from attention_ref import (
    causal_mask,
    combine_masks,
    from_key_padding_mask,
    padding_mask,
    padding_mask_from_tokens,
    scaled_dot_product_attention,
    to_additive,
)

LENGTHS = [(5, 5), (5, 7), (7, 5), (1, 3), (3, 1), (0, 3), (3, 0)]


@pytest.mark.parametrize("L,S", LENGTHS)
def test_causal_mask_top_left_by_loop(L, S):
    mask = causal_mask(L, S)
    assert mask.dtype == torch.bool and mask.shape == (L, S)
    for i in range(L):
        for j in range(S):
            assert bool(mask[i, j]) == (j <= i), (i, j)


@pytest.mark.parametrize("L,S", LENGTHS)
def test_causal_mask_bottom_right_by_loop(L, S):
    mask = causal_mask(L, S, alignment="bottom_right")
    assert mask.dtype == torch.bool and mask.shape == (L, S)
    for i in range(L):
        for j in range(S):
            assert bool(mask[i, j]) == (j <= i + S - L), (i, j)
    if L and S >= L:
        assert mask[-1].all()  # the last query sees every key


def test_causal_mask_defaults_and_alignments_agree_when_square():
    assert torch.equal(causal_mask(5), causal_mask(5, 5))
    assert torch.equal(causal_mask(7, alignment="bottom_right"), causal_mask(7))
    assert not torch.equal(causal_mask(5, 7, alignment="bottom_right"), causal_mask(5, 7))


def test_causal_mask_device():
    assert causal_mask(3, 5, device="meta").device.type == "meta"
    assert causal_mask(3, 5, device=torch.device("cpu")).device.type == "cpu"


@pytest.mark.parametrize("L,S", [(5, 7), (7, 5), (5, 5)])
def test_causal_mask_top_left_is_torch_is_causal(L, S, generator):
    q, k, v = torch.randn(3, L, 11, generator=generator), torch.randn(3, S, 11, generator=generator), torch.randn(3, S, 13, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    actual = scaled_dot_product_attention(q, k, v, causal_mask(L, S))
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("L,S", [(5, 7), (5, 5)])
def test_causal_mask_bottom_right_is_torch_causal_lower_right(L, S, generator):
    q, k, v = torch.randn(3, L, 11, generator=generator), torch.randn(3, S, 11, generator=generator), torch.randn(3, S, 13, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(L, S))
    actual = scaled_dot_product_attention(q, k, v, causal_mask(L, S, alignment="bottom_right"))
    torch.testing.assert_close(actual, expected)


def test_padding_mask_by_loop():
    lengths = torch.tensor([0, 3, 7, 5])
    mask = padding_mask(lengths, 7)
    assert mask.dtype == torch.bool and mask.shape == (4, 1, 1, 7)
    for b, n in enumerate(lengths.tolist()):
        assert mask[b, 0, 0].tolist() == [j < n for j in range(7)]


def test_padding_mask_empty_batch_and_zero_length():
    assert padding_mask(torch.tensor([], dtype=torch.long), 5).shape == (0, 1, 1, 5)
    assert padding_mask(torch.tensor([0, 0]), 0).shape == (2, 1, 1, 0)


def test_padding_mask_from_tokens():
    tokens = torch.tensor([[5, 7, 0, 0, 0], [3, 0, 2, 9, 0], [0, 0, 0, 0, 0]])
    mask = padding_mask_from_tokens(tokens, pad_id=0)
    assert mask.shape == (3, 1, 1, 5) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [[t != 0 for t in row] for row in tokens.tolist()]
    # trailing padding gives the same mask as the lengths
    assert torch.equal(padding_mask_from_tokens(tokens[:1], pad_id=0), padding_mask(torch.tensor([2]), 5))
    assert padding_mask_from_tokens(tokens, pad_id=5)[0, 0, 0].tolist() == [False, True, True, True, True]


def test_padding_mask_masks_the_keys_in_attention(generator):
    B, H, L, S = 3, 2, 5, 7
    q, k, v = torch.randn(B, H, L, 11, generator=generator), torch.randn(B, H, S, 11, generator=generator), torch.randn(B, H, S, 13, generator=generator)
    lengths = torch.tensor([7, 3, 5])
    out = scaled_dot_product_attention(q, k, v, padding_mask(lengths, S))
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[b], scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n]))


def test_to_additive_bool_and_float():
    mask = torch.tensor([[True, False, True], [False, False, True]])
    additive = to_additive(mask, torch.float64)
    assert additive.dtype == torch.float64 and additive.shape == mask.shape
    assert (additive[mask] == 0).all() and torch.isneginf(additive[~mask]).all()
    assert to_additive(mask).dtype == torch.float32
    floats = torch.tensor([0.5, -2.0, float("-inf")])
    converted = to_additive(floats, torch.float16)
    assert converted.dtype == torch.float16
    assert converted.tolist() == [0.5, -2.0, float("-inf")]


def test_to_additive_gives_the_same_attention(generator):
    q, k, v = torch.randn(2, 5, 11, generator=generator), torch.randn(2, 7, 11, generator=generator), torch.randn(2, 7, 13, generator=generator)
    mask = torch.rand(2, 5, 7, generator=generator) < 0.6
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, to_additive(mask)), scaled_dot_product_attention(q, k, v, mask)
    )


def test_combine_masks_bool_is_logical_and():
    causal = causal_mask(5, 7)  # (L, S)
    pad = padding_mask(torch.tensor([7, 3]), 7)  # (B, 1, 1, S)
    combined = combine_masks(causal, pad)
    assert combined.dtype == torch.bool and combined.shape == (2, 1, 5, 7)
    for b in range(2):
        for i in range(5):
            for j in range(7):
                assert bool(combined[b, 0, i, j]) == (bool(causal[i, j]) and bool(pad[b, 0, 0, j]))


def test_combine_masks_skips_none():
    causal = causal_mask(5)
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    assert combine_masks(None, causal, None) is causal
    pad = padding_mask(torch.tensor([2, 5]), 5)
    assert torch.equal(combine_masks(causal, None, pad), combine_masks(causal, pad))


def test_combine_masks_bool_with_float_gives_float(generator):
    keep = torch.rand(5, 7, generator=generator) < 0.5
    bias = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    combined = combine_masks(keep, bias)
    assert combined.dtype == torch.float64
    torch.testing.assert_close(combined[keep], bias[keep])
    assert torch.isneginf(combined[~keep]).all()
    # float + float sums, promoting the dtype
    small = torch.randn(7, generator=generator, dtype=torch.float32)
    summed = combine_masks(bias, small)
    assert summed.dtype == torch.float64
    torch.testing.assert_close(summed, bias + small.double())


def test_combine_masks_in_attention_equals_applying_both(generator):
    q, k, v = torch.randn(2, 3, 5, 11, generator=generator), torch.randn(2, 3, 7, 11, generator=generator), torch.randn(2, 3, 7, 13, generator=generator)
    pad = padding_mask(torch.tensor([6, 4]), 7)
    bias = torch.randn(5, 7, generator=generator)
    expected = scaled_dot_product_attention(q, k, v, combine_masks(pad, bias), is_causal=True)
    actual = scaled_dot_product_attention(q, k, v, combine_masks(causal_mask(5, 7), pad, bias))
    torch.testing.assert_close(actual, expected)


def test_from_key_padding_mask_bool_flips_polarity():
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # PyTorch: True = ignore
    ours = from_key_padding_mask(kpm)
    assert ours.shape == (2, 1, 1, 3) and ours.dtype == torch.bool
    assert torch.equal(ours[:, 0, 0], ~kpm)
    assert torch.equal(ours, padding_mask(torch.tensor([2, 1]), 3))


def test_from_key_padding_mask_float_is_only_reshaped(generator):
    kpm = torch.randn(2, 7, generator=generator)
    ours = from_key_padding_mask(kpm)
    assert ours.shape == (2, 1, 1, 7) and ours.dtype == kpm.dtype
    assert torch.equal(ours[:, 0, 0], kpm)
