"""Each library's convention (attention_ref.conventions) against that library's own rule.

- (a) every conversion against a dense definition written here from the library's
  documented rule, by loops over ``(i, j)`` or by broadcasting, on distinct prime
  sizes with ``L < S``, ``L > S`` and ``L == S``;
- (b) against transformers' own mask functions and ALiBi bias
  (``transformers.masking_utils``, Bloom's ``build_alibi_tensor``), called on index
  tensors the way transformers calls them;
- (c) the off-by-one each conversion prevents: the naive conversion (copy the
  number, or align top-left) gives a different mask, on exactly the pairs expected;
- the errors, with their messages.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from attention_ref import attention_weights, mods
from attention_ref.conventions import (
    from_attention_gym_sliding_window,
    from_flash_attn_alibi,
    from_flash_attn_causal,
    from_flash_attn_window,
    from_hf_alibi,
    from_hf_sliding_window,
)

SIZES = [(5, 7), (7, 5), (11, 11), (3, 13)]  # (L, S): L < S, L > S, L == S
TOL = {"atol": 1e-12, "rtol": 1e-10}


def _msg(*parts: str) -> str:
    return ".*".join(re.escape(p) for p in parts)


def _dense(rule, L: int, S: int) -> torch.Tensor:
    """``out[i, j] = rule(i, j)`` by loops: the library's rule, not this package's code."""
    return torch.tensor([[bool(rule(i, j)) for j in range(S)] for i in range(L)], dtype=torch.bool).reshape(L, S)


def _mask(mod, L: int, S: int) -> torch.Tensor:
    return mods.create_mask(mod, None, None, L, S)[0, 0]  # (L, S)


def _bias(mod, H: int, L: int, S: int) -> torch.Tensor:
    """What a score mod adds to zero scores: ``(H, L, S)``."""
    return mods.apply_score_mod(mod, torch.zeros(H, L, S, dtype=torch.float64))


def _paper_slopes(H: int) -> list[float]:
    """The ALiBi paper's slopes for ``H`` a power of two: ``2^(-8 (h + 1) / H)``."""
    return [2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]


# --- (a) each conversion against its library's documented rule --------------------------------


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("W", [1, 2, 3, 6])
def test_hf_sliding_window_is_w_keys_including_the_current_one(W, L, S):
    # transformers: kv_idx > q_idx - sliding_window, and causal kv_idx <= q_idx
    for offset in (0, S - L):
        expected = _dense(lambda i, j, off=offset: i + off - W < j <= i + off, L, S)
        assert torch.equal(_mask(from_hf_sliding_window(W, offset=offset), L, S), expected)
    # a query with W earlier-or-equal keys available sees exactly W of them
    full = _mask(from_hf_sliding_window(W, offset=S - L), L, S)
    rows = [i for i in range(L) if i + S - L + 1 >= W]
    assert all(int(full[i].sum()) == W for i in rows)


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("W", [1, 4])
def test_vllm_sliding_window_is_flash_window_w_minus_1(W, L, S):
    # vLLM's FlashAttention backend: window_size = (sliding_window - 1, 0), bottom-right aligned
    expected = _dense(lambda i, j: i + S - L - (W - 1) <= j <= i + S - L, L, S)
    assert torch.equal(_mask(from_flash_attn_window((W - 1, 0), L, S), L, S), expected)
    assert torch.equal(_mask(from_hf_sliding_window(W, offset=S - L), L, S), expected)


WINDOWS = [(0, 0), (1, 0), (2, 3), (0, 2), (-1, 0), (-1, 2), (3, -1), (-1, -1)]


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("window_size", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_window_by_its_docstring(window_size, L, S, causal):
    # flash_attn_func: keys in [i + S - L - left, i + S - L + right], inclusive, -1 = unbounded;
    # causal=True sets right = 0
    left, right = window_size
    right = 0 if causal else right

    def keep(i: int, j: int) -> bool:
        lo = -math.inf if left == -1 else i + S - L - left
        hi = math.inf if right == -1 else i + S - L + right
        return lo <= j <= hi

    mod = from_flash_attn_window(window_size, L, S, causal=causal)
    assert torch.equal(_mask(mod, L, S), _dense(keep, L, S))


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("window_size", [(0, 0), (1, 0), (2, 3), (4, 1)])
def test_flash_attn_window_by_its_tests_masked_out_form(window_size, L, S):
    # FlashAttention's tests build the *masked-out* pairs by broadcasting (True = excluded):
    # j > min(i + S - L + right, S) or j < i + S - L - left, for left, right >= 0
    left, right = window_size
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    masked_out = (j > torch.clamp(i + S - L + right, max=S)) | (j < i + S - L - left)
    assert torch.equal(_mask(from_flash_attn_window(window_size, L, S), L, S), ~masked_out)


def test_flash_attn_causal_matches_its_docstring_examples():
    # flash_attn_func's docstring, seqlen_q = 2, seqlen_k = 5, then 5 and 2 (1 = keep)
    assert _mask(from_flash_attn_causal(2, 5), 2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert _mask(from_flash_attn_causal(5, 2), 5, 2).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize("L,S", SIZES)
def test_flash_attn_causal_is_bottom_right(L, S):
    expected = _dense(lambda i, j: j <= i + S - L, L, S)
    assert torch.equal(_mask(from_flash_attn_causal(L, S), L, S), expected)
    # the window form with (-1, 0) is the same mask, as FlashAttention treats them
    assert torch.equal(_mask(from_flash_attn_window((-1, 0), L, S), L, S), expected)


@pytest.mark.parametrize("L,S", [(5, 5), (11, 11), (5, 7)])
@pytest.mark.parametrize("W", [0, 1, 3])
def test_attention_gym_sliding_window_is_w_plus_1_keys(W, L, S):
    # attention-gym: q_idx - kv_idx <= SLIDING_WINDOW and q_idx >= kv_idx (top-left indices)
    expected = _dense(lambda i, j: i - j <= W and i >= j, L, S)
    mask = _mask(from_attention_gym_sliding_window(W), L, S)
    assert torch.equal(mask, expected)
    assert int(mask[L - 1].sum()) == min(W + 1, L)


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("H", [1, 2, 4, 8])
def test_alibi_paper_bias_is_slope_times_j_minus_i(H, L, S):
    slopes = _paper_slopes(H)
    expected = torch.tensor(
        [[[slopes[h] * (j - i) for j in range(S)] for i in range(L)] for h in range(H)], dtype=torch.float64
    )
    torch.testing.assert_close(_bias(from_hf_alibi(H), H, L, S), expected, **TOL)


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("H", [1, 2, 4, 8])
def test_flash_attn_alibi_bias_by_its_docstring(H, L, S):
    # flash_attn_func: -alibi_slope * |i + seqlen_k - seqlen_q - j| added to the score
    slopes = _paper_slopes(H)
    expected = torch.tensor(
        [[[-slopes[h] * abs(i + S - L - j) for j in range(S)] for i in range(L)] for h in range(H)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(_bias(from_flash_attn_alibi(H, L, S), H, L, S), expected, **TOL)


@pytest.mark.parametrize("L,S", [(5, 7), (11, 11), (3, 13)])
def test_both_alibi_signs_give_the_same_weights_under_a_bottom_right_causal_mask(L, S):
    torch.manual_seed(0)
    H, E = 4, 11
    q, k = torch.randn(2, H, L, E, dtype=torch.float64), torch.randn(2, H, S, E, dtype=torch.float64)
    causal = from_flash_attn_causal(L, S)
    flash = attention_weights(q, k, mask_mod=causal, score_mod=from_flash_attn_alibi(H, L, S))
    paper = attention_weights(q, k, mask_mod=causal, score_mod=from_hf_alibi(H))
    torch.testing.assert_close(flash, paper, **TOL)


# --- (b) against transformers' own mask functions ----------------------------------------------


def _hf_indices(L: int, S: int, q_offset: int):
    """The broadcasting index tensors transformers' ``sdpa_mask`` passes to a mask function."""
    b = torch.arange(1)[:, None, None, None]
    h = torch.arange(1)[None, :, None, None]
    q = (torch.arange(L) + q_offset)[None, None, :, None]
    kv = torch.arange(S)[None, None, None, :]
    return b, h, q, kv


def _offsets(L: int, S: int) -> list[int]:
    """transformers' query offsets: 0, and ``S - L`` cached tokens when there are any."""
    return [0, S - L] if S > L else [0]


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("W", [1, 2, 3, 6])
def test_hf_sliding_window_equals_transformers(W, L, S):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for q_offset in _offsets(L, S):
        mask_function = masking_utils.sliding_window_causal_mask_function(W)
        theirs = mask_function(*_hf_indices(L, S, q_offset))[0, 0]
        ours = _mask(from_hf_sliding_window(W, offset=q_offset), L, S)
        assert torch.equal(ours, theirs)
        built = masking_utils.sdpa_mask(
            batch_size=1, q_length=L, kv_length=S, q_offset=q_offset,
            mask_function=mask_function, allow_is_causal_skip=False,
        )
        assert torch.equal(ours, built[0, 0])


@pytest.mark.parametrize("L,S", [(5, 7), (11, 11), (3, 13)])
def test_flash_attn_causal_equals_transformers_causal_with_a_cache(L, S):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    built = masking_utils.sdpa_mask(batch_size=1, q_length=L, kv_length=S, q_offset=S - L,
                                    mask_function=masking_utils.causal_mask_function,
                                    allow_is_causal_skip=False)
    assert torch.equal(_mask(from_flash_attn_causal(L, S), L, S), built[0, 0])


@pytest.mark.parametrize("L,S", [(5, 7), (11, 11), (3, 13)])
@pytest.mark.parametrize("W", [1, 3, 4])
def test_transformers_flash_call_gives_the_mask_of_its_sdpa_path(W, L, S):
    # transformers calls FlashAttention with window_size=(W - 1, W - 1) and causal=True
    # (modeling_flash_attention_utils.py); its SDPA path builds sliding_window_causal_mask_function(W)
    masking_utils = pytest.importorskip("transformers.masking_utils")
    built = masking_utils.sdpa_mask(batch_size=1, q_length=L, kv_length=S, q_offset=S - L,
                                    mask_function=masking_utils.sliding_window_causal_mask_function(W),
                                    allow_is_causal_skip=False)
    flash = _mask(from_flash_attn_window((W - 1, W - 1), L, S, causal=True), L, S)
    assert torch.equal(flash, built[0, 0])


@pytest.mark.parametrize("H", [1, 2, 3, 4, 5, 6, 8, 12])
def test_alibi_slopes_equal_bloom(H):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    alibi = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), H, torch.float64)  # (H, 1, 2)
    # slope * key 1; Bloom computes the slopes in float32 (exact when H is a power of two)
    torch.testing.assert_close(alibi[:, 0, 1], mods.alibi_slopes(H), atol=0, rtol=3e-7)


@pytest.mark.parametrize("L,S", [(5, 7), (11, 11), (3, 13)])
@pytest.mark.parametrize("H", [3, 4])
def test_hf_alibi_gives_bloom_weights(H, L, S):
    # Bloom adds slope_h * j to every row and masks causally (with S - L cached tokens)
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    masking_utils = pytest.importorskip("transformers.masking_utils")
    torch.manual_seed(1)
    E = 7
    q, k = torch.randn(1, H, L, E, dtype=torch.float64), torch.randn(1, H, S, E, dtype=torch.float64)
    bias = bloom.build_alibi_tensor(torch.ones(1, S, dtype=torch.long), H, torch.float64)  # (H, 1, S)
    keep = masking_utils.sdpa_mask(batch_size=1, q_length=L, kv_length=S, q_offset=S - L,
                                   allow_is_causal_skip=False)  # (1, 1, L, S)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(E) + bias[None]).masked_fill(~keep, -math.inf)
    theirs = scores.softmax(dim=-1)  # (1, H, L, S)
    ours = attention_weights(q, k, mask_mod=from_flash_attn_causal(L, S), score_mod=from_hf_alibi(H))
    torch.testing.assert_close(ours, theirs, **TOL)


# --- (c) the off-by-one each conversion prevents -----------------------------------------------


@pytest.mark.parametrize("L,S", [(11, 11), (5, 7)])
@pytest.mark.parametrize("W", [1, 3])
def test_copying_hf_window_into_sliding_window_keeps_one_key_too_many(W, L, S):
    right = _mask(from_hf_sliding_window(W), L, S)
    naive = _mask(mods.sliding_window(W), L, S)
    extra = naive & ~right
    assert not (right & ~naive).any()
    assert torch.equal(extra, _dense(lambda i, j: j == i - W, L, S))  # the key W steps back
    assert extra.any()


@pytest.mark.parametrize("L,S", [(5, 7), (3, 13)])
def test_top_left_causal_is_not_flash_attn_causal_when_l_lt_s(L, S):
    right = _mask(from_flash_attn_causal(L, S), L, S)
    naive = _mask(mods.causal(), L, S)
    assert torch.equal(right & ~naive, _dense(lambda i, j: i < j <= i + S - L, L, S))
    assert not (naive & ~right).any()


@pytest.mark.parametrize("L,S", [(5, 7), (7, 5)])
def test_flash_attn_window_without_the_offset_is_another_mask(L, S):
    assert not torch.equal(_mask(from_flash_attn_window((2, 1), L, S), L, S), _mask(mods.sliding_window(2, 1), L, S))


@pytest.mark.parametrize("W", [1, 3])
def test_reading_attention_gym_window_as_a_key_count_drops_a_key(W):
    naive = _mask(mods.sliding_window(W - 1), 11, 11)  # W keys: one fewer than attention-gym keeps
    right = _mask(from_attention_gym_sliding_window(W), 11, 11)
    assert torch.equal(right & ~naive, _dense(lambda i, j: j == i - W, 11, 11))


@pytest.mark.parametrize("L,S", [(5, 7), (7, 5)])
def test_flash_attn_alibi_without_the_offset_is_another_bias(L, S):
    right = _bias(from_flash_attn_alibi(4, L, S), 4, L, S)
    assert not torch.allclose(right, _bias(mods.alibi(4, symmetric=True), 4, L, S))
    assert not torch.allclose(right, _bias(mods.alibi(4, offset=S - L), 4, L, S))  # the paper's sign


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: from_hf_sliding_window(0), ValueError, _msg("window must be an int >= 1", "got 0")),
        (lambda: from_hf_sliding_window(-3), ValueError, _msg("window must be an int >= 1", "got -3")),
        (lambda: from_hf_sliding_window("4"), TypeError, _msg("window must be an int >= 1", "got str")),
        (lambda: from_hf_sliding_window(True), TypeError, _msg("window must be an int", "got bool")),
        (lambda: from_hf_sliding_window(4, offset=1.5), TypeError, _msg("offset must be an int, got float")),
        (lambda: from_flash_attn_window((-2, 0), 5, 7), ValueError,
         _msg("window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), got (-2, 0)")),
        (lambda: from_flash_attn_window((3, -5), 5, 7), ValueError, _msg("window_size must be", "got (3, -5)")),
        (lambda: from_flash_attn_window((3,), 5, 7), TypeError, _msg("window_size must be a pair", "got (3,)")),
        (lambda: from_flash_attn_window(3, 5, 7), TypeError, _msg("window_size must be a pair", "got 'int'")),
        (lambda: from_flash_attn_window("ab", 5, 7), TypeError, _msg("window_size must be a pair", "got 'ab'")),
        (lambda: from_flash_attn_window((1.0, 0), 5, 7), TypeError, _msg("window_size must be", "got (1.0, 0)")),
        (lambda: from_flash_attn_window((1, 0), -5, 7), ValueError, _msg("L must be a non-negative int, got -5")),
        (lambda: from_flash_attn_window((1, 0), 5, 7, causal=1), TypeError, _msg("causal must be a bool, got int")),
        (lambda: from_flash_attn_causal(5, 7.0), TypeError, _msg("S must be an int, got float")),
        (lambda: from_flash_attn_causal(5, -7), ValueError, _msg("S must be a non-negative int, got -7")),
        (lambda: from_attention_gym_sliding_window(-1), ValueError, _msg("window must be an int >= 0", "got -1")),
        (lambda: from_attention_gym_sliding_window(2.0), TypeError, _msg("window must be an int >= 0", "got float")),
        (lambda: from_hf_alibi(0), ValueError, _msg("num_heads must be a positive int, got 0")),
        (lambda: from_flash_attn_alibi(4, 5, -1), ValueError, _msg("S must be a non-negative int, got -1")),
        (lambda: from_flash_attn_alibi(4.0, 5, 7), TypeError, _msg("num_heads must be an int, got float")),
    ],
)
def test_bad_input_names_the_argument_and_both_values(call, error, message):
    with pytest.raises(error, match=message):
        call()
