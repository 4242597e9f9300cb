"""Mask and score mods: each against a definition written from its docstring, and against FlexAttention.

- Every mask mod is compared with a loop over ``(b, h, i, j)`` that spells out the
  inequality of its docstring, on distinct prime sizes with ``L != S`` and offsets.
- ``torch.nn.attention.flex_attention.flex_attention`` runs eagerly on CPU in
  float64 (it warns that it is unfused: that one warning is filtered) and must
  give the math path's output for every mod and some combinations, with
  grouped-query heads, ``L != S`` and fully masked rows (flex gives 0 there, as
  attention_ref does, so whole outputs are compared). Flex has no CPU backward.
- Gradients of the math path with mods equal autograd of a reference written
  out densely (bias and mask materialised as tensors).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attention_ref import attention_weights, conventions, mods, scaled_dot_product_attention

B, H, HKV, L, S, E, EV = 2, 6, 3, 5, 7, 11, 13
FLEX_UNFUSED = "ignore:flex_attention called without torch.compile:UserWarning"
TOL = {"atol": 1e-12, "rtol": 1e-10}


def _msg(*parts: str) -> str:
    return ".*".join(re.escape(p) for p in parts)


def _dense(rule, B_: int, H_: int, L_: int, S_: int) -> torch.Tensor:
    """``out[b, h, i, j] = rule(b, h, i, j)`` by loops: the definition, not the implementation."""
    out = torch.zeros(B_, H_, L_, S_, dtype=torch.bool)
    for b in range(B_):
        for h in range(H_):
            for i in range(L_):
                for j in range(S_):
                    out[b, h, i, j] = bool(rule(b, h, i, j))
    return out


# --- every mask mod against its docstring ------------------------------------------------------

SIZES = [(5, 7), (7, 5), (3, 3)]
OFFSETS = [0, 2, -3]


@pytest.mark.parametrize("Lq,Sk", SIZES)
@pytest.mark.parametrize("offset", OFFSETS + ["S-L"])
def test_causal_by_loop(Lq, Sk, offset):
    off = Sk - Lq if offset == "S-L" else offset
    expected = _dense(lambda b, h, i, j: j <= i + off, 1, 1, Lq, Sk)
    assert torch.equal(mods.create_mask(mods.causal(off), None, None, Lq, Sk), expected)


@pytest.mark.parametrize("Lq,Sk", SIZES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (None, 1), (2, None), (None, None)])
@pytest.mark.parametrize("offset", OFFSETS)
def test_sliding_window_by_loop(Lq, Sk, left, right, offset):
    def rule(b, h, i, j):
        low = -math.inf if left is None else i + offset - left
        high = math.inf if right is None else i + offset + right
        return low <= j <= high

    mask = mods.create_mask(mods.sliding_window(left, right, offset), None, None, Lq, Sk)
    assert torch.equal(mask, _dense(rule, 1, 1, Lq, Sk))


# Windows shorter than the keys (left=2: 3 keys), L != S both ways; sinks none, one, several,
# and more than there are keys.
SINK_SIZES = [(5, 11), (11, 7), (7, 7)]
SINKS = [0, 1, 4, 13]


@pytest.mark.parametrize("Lq,Sk", SINK_SIZES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (2, 1), (None, 0), (1, None)])
@pytest.mark.parametrize("offset", OFFSETS + ["S-L"])
@pytest.mark.parametrize("sink_tokens", SINKS)
def test_sliding_window_with_sink_tokens_by_loop(Lq, Sk, left, right, offset, sink_tokens):
    off = Sk - Lq if offset == "S-L" else offset

    def rule(b, h, i, j):
        low = -math.inf if left is None else i + off - left
        high = math.inf if right is None else i + off + right
        return (low <= j or j < sink_tokens) and j <= high  # a sink passes the left end only

    mask = mods.create_mask(mods.sliding_window(left, right, off, sink_tokens=sink_tokens), None, None, Lq, Sk)
    assert torch.equal(mask, _dense(rule, 1, 1, Lq, Sk))
    if sink_tokens == 0:  # the default is today's window, exactly
        assert torch.equal(mask, mods.create_mask(mods.sliding_window(left, right, off), None, None, Lq, Sk))


def _flash_attn_local_mask(seqlen_q, seqlen_k, window_size, sink_token_length):
    """FlashAttention's ``construct_local_mask`` (hopper/test_util.py), no padding: True = masked OUT.

    Transcribed from the reference, ``-1`` = unbounded side, always bottom-right (``sk - sq``).
    """
    row_idx = torch.arange(seqlen_q).reshape(-1, 1)
    col_idx = torch.arange(seqlen_k)
    sk, sq = seqlen_k, seqlen_q
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k)
    return torch.logical_or(
        col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk),
        torch.logical_and(col_idx < row_idx + sk - sq - window_size[0], col_idx >= sink_token_length),
    )


@pytest.mark.parametrize("Lq,Sk", SINK_SIZES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (2, 3), (-1, 0), (1, 100)])  # -1: unbounded; 100: past every key
@pytest.mark.parametrize("sink_tokens", SINKS)
def test_sink_tokens_are_flash_attentions_sink_token_length(Lq, Sk, left, right, sink_tokens):
    # FA's window_size=(l, r) is sliding_window(l, r, offset=S - L); its sink_token_length is sink_tokens.
    ours = mods.sliding_window(None if left < 0 else left, right, offset=Sk - Lq, sink_tokens=sink_tokens)
    expected = ~_flash_attn_local_mask(Lq, Sk, (left, right), sink_token_length=sink_tokens)
    assert torch.equal(mods.create_mask(ours, None, None, Lq, Sk)[0, 0], expected)
    # the same through the conventions function, in FlashAttention's own words
    theirs = conventions.from_flash_attn_window((left, right), Lq, Sk, sink_token_length=sink_tokens)
    assert torch.equal(mods.create_mask(theirs, None, None, Lq, Sk)[0, 0], expected)


def test_describe_records_sink_tokens():
    assert mods.describe(mods.sliding_window(2, 1, 3, sink_tokens=4)) == (
        "sliding_window", {"left": 2, "right": 1, "offset": 3, "sink_tokens": 4})
    assert mods.describe(mods.sliding_window(2))[1]["sink_tokens"] == 0


def _sink_reference(q, k, v, keep):
    """softmax(q k^T / sqrt(E) + mask) v in float64, written out: GQA heads repeated, empty rows 0."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # (B, HKV, S, .) -> (B, H, S, .)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    weights = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
    weights = torch.where(keep.any(-1, keepdim=True), weights, 0.0)  # a row with no key: weights 0
    return weights @ v  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


@pytest.mark.parametrize("backend", ["math", "tiled", "sdpa"])
@pytest.mark.parametrize("Lq,Sk,offset", [(5, 11, 6), (11, 7, -4), (7, 7, 0)])
@pytest.mark.parametrize("sink_tokens", SINKS)
def test_sink_tokens_through_each_backend_equal_the_reference(backend, Lq, Sk, offset, sink_tokens, generator):
    q, k, v = _qkv(generator, Lq, Sk)
    mask_mod = mods.sliding_window(2, 0, offset, sink_tokens=sink_tokens)
    keep = _dense(lambda b, h, i, j: (i + offset - 2 <= j or j < sink_tokens) and j <= i + offset, 1, 1, Lq, Sk)
    expected = _sink_reference(q, k, v, keep)
    got = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, enable_gqa=True, backend=backend)
    torch.testing.assert_close(got, expected, **TOL)
    if 0 < sink_tokens < Sk and Lq + offset > 4:  # the sinks change what the far queries see
        assert not torch.allclose(got, scaled_dot_product_attention(
            q, k, v, mask_mod=mods.sliding_window(2, 0, offset), enable_gqa=True, backend=backend))


@pytest.mark.parametrize("Lq,Sk", SIZES)
@pytest.mark.parametrize("size", [1, 2, 3, 11])
@pytest.mark.parametrize("offset", OFFSETS)
def test_chunked_by_loop(Lq, Sk, size, offset):
    expected = _dense(lambda b, h, i, j: (i + offset) // size == j // size, 1, 1, Lq, Sk)
    assert torch.equal(mods.create_mask(mods.chunked(size, offset), None, None, Lq, Sk), expected)


@pytest.mark.parametrize("Lq,Sk", SIZES)
@pytest.mark.parametrize("prefix", [0, 3, 11])
@pytest.mark.parametrize("offset", OFFSETS)
def test_prefix_lm_int_by_loop(Lq, Sk, prefix, offset):
    expected = _dense(lambda b, h, i, j: j < prefix or j <= i + offset, 1, 1, Lq, Sk)
    assert torch.equal(mods.create_mask(mods.prefix_lm(prefix, offset), None, None, Lq, Sk), expected)


def test_prefix_lm_per_batch_by_loop():
    prefix = torch.tensor([2, 6])
    expected = _dense(lambda b, h, i, j: j < prefix[b] or j <= i, B, 3, L, S)
    assert torch.equal(mods.create_mask(mods.prefix_lm(prefix), B, 3, L, S), expected)


def test_document_by_loop():
    q_ids = torch.tensor([[0, 0, 1, 1, 2], [3, 3, 3, 5, 5]])
    kv_ids = torch.tensor([[0, 1, 1, 1, 2, 2, 2], [3, 3, 4, 4, 4, 5, 5]])
    expected = _dense(lambda b, h, i, j: kv_ids[b, j] == q_ids[b, i], B, 3, L, S)
    assert torch.equal(mods.create_mask(mods.document(q_ids, kv_ids), B, 3, L, S), expected)
    one_d = _dense(lambda b, h, i, j: kv_ids[0, j] == q_ids[0, i], 1, 1, L, S)
    assert torch.equal(mods.create_mask(mods.document(q_ids[0], kv_ids[0]), None, None, L, S), one_d)
    same = _dense(lambda b, h, i, j: q_ids[b, j] == q_ids[b, i], B, 1, L, L)
    assert torch.equal(mods.create_mask(mods.document(q_ids), B, None, L, L), same)


def test_padding_by_loop():
    lengths = torch.tensor([0, 3, 7])
    expected = _dense(lambda b, h, i, j: j < lengths[b], 3, 2, L, S)
    assert torch.equal(mods.create_mask(mods.padding(lengths), 3, 2, L, S), expected)


def test_and_or_masks_by_loop():
    lengths = torch.tensor([4, 6])
    both = mods.and_masks(mods.causal(1), mods.padding(lengths), mods.sliding_window(2))
    either = mods.or_masks(mods.causal(), mods.chunked(3))
    assert torch.equal(
        mods.create_mask(both, B, 1, L, S),
        _dense(lambda b, h, i, j: j <= i + 1 and j < lengths[b] and i - 2 <= j <= i, B, 1, L, S),
    )
    assert torch.equal(
        mods.create_mask(either, None, None, L, S), _dense(lambda b, h, i, j: j <= i or i // 3 == j // 3, 1, 1, L, S)
    )
    assert mods.create_mask(mods.and_masks(), None, None, L, S).all()
    assert not mods.create_mask(mods.or_masks(), None, None, L, S).any()


def test_create_mask_shape_device_and_heads():
    per_head = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + h  # noqa: E731
    mask = mods.create_mask(per_head, None, 3, L, S, device="cpu")
    assert mask.shape == (1, 3, L, S) and mask.dtype == torch.bool and mask.is_contiguous()
    assert torch.equal(mask, _dense(lambda b, h, i, j: j <= i + h, 1, 3, L, S))
    assert mods.create_mask(mods.causal(), 0, 2, 0, S).shape == (0, 2, 0, S)


# --- score mods against their formulas --------------------------------------------------------

# The slopes of the ALiBi paper (Press et al., 2022, and its reference code), typed out.
PAPER_SLOPES = {
    1: [2**-8],
    2: [2**-4, 2**-8],
    3: [2**-4, 2**-8, 2**-2],  # the 2 slopes of 2 heads, then every other slope of 4 heads
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],  # 4 heads' slopes, then 8 heads' 1st and 3rd
    8: [2**-k for k in range(1, 9)],
    12: [2**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],  # 16 heads' 1st, 3rd, 5th, 7th
    16: [2 ** (-k / 2) for k in range(1, 17)],
}


@pytest.mark.parametrize("heads", sorted(PAPER_SLOPES))
def test_alibi_slopes_are_the_papers(heads):
    torch.testing.assert_close(mods.alibi_slopes(heads), torch.tensor(PAPER_SLOPES[heads], dtype=torch.float64), **TOL)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("offset", [0, 2])
def test_alibi_bias_by_loop(symmetric, offset):
    slopes = PAPER_SLOPES[6]

    def bias(b, h, i, j):
        d = j - (i + offset)
        return -slopes[h] * abs(d) if symmetric else slopes[h] * d

    expected = torch.tensor(
        [[[[bias(b, h, i, j) for j in range(S)] for i in range(L)] for h in range(6)] for b in range(B)]
    )  # (B, 6, L, S)
    scores = torch.zeros(B, 6, L, S, dtype=torch.float64)
    actual = mods.apply_score_mod(mods.alibi(6, symmetric=symmetric, offset=offset), scores)
    torch.testing.assert_close(actual, expected.double(), **TOL)


def test_softcap_and_compose():
    scores = torch.linspace(-50, 50, 11, dtype=torch.float64).reshape(1, 11)
    capped = mods.apply_score_mod(mods.softcap(30.0), scores)
    torch.testing.assert_close(capped, 30.0 * torch.tanh(scores / 30.0), **TOL)
    assert capped.abs().max() < 30.0
    shift = lambda score, b, h, q_idx, kv_idx: score + 100.0  # noqa: E731
    torch.testing.assert_close(
        mods.apply_score_mod(mods.compose(shift, mods.softcap(30.0)), scores), 30.0 * torch.tanh((scores + 100.0) / 30.0)
    )  # first to last: the shift, then the cap
    assert torch.equal(mods.apply_score_mod(mods.compose(), scores), scores)


def test_index_grids_flatten_leading_dims_into_b():
    """``h`` is the last leading dim, ``b`` the others flattened; 0 where there are none."""
    record = lambda score, b, h, q_idx, kv_idx: score + 1000 * b + 100 * h + 10 * q_idx + kv_idx  # noqa: E731
    out = mods.apply_score_mod(record, torch.zeros(2, 3, 5, 4, 7, dtype=torch.float64))
    assert out[1, 2, 4, 3, 6].item() == 1000 * (1 * 3 + 2) + 100 * 4 + 10 * 3 + 6
    assert mods.apply_score_mod(record, torch.zeros(5, 4, 7))[4, 3, 6].item() == 400 + 36  # (H, L, S)
    assert mods.apply_score_mod(record, torch.zeros(4, 7))[3, 6].item() == 36  # (L, S)


# --- the order of the steps and the weights -----------------------------------------------------


def test_score_mod_sees_the_scaled_scores_before_any_mask(generator):
    q = torch.randn(B, 3, L, E, generator=generator, dtype=torch.float64)
    k = torch.randn(B, 3, S, E, generator=generator, dtype=torch.float64)
    float_mask = torch.randn(L, S, generator=generator, dtype=torch.float64)
    seen = []

    def spy(score, b, h, q_idx, kv_idx):
        seen.append(score.clone())
        return mods.softcap(0.7)(score, b, h, q_idx, kv_idx)

    lengths = torch.tensor([3, 7])
    weights = attention_weights(q, k, float_mask, is_causal=True, scale=0.5, score_mod=spy, mask_mod=mods.padding(lengths))
    scores = 0.5 * q @ k.transpose(-2, -1)
    torch.testing.assert_close(seen[0], scores, **TOL)  # step 2 sees step 1 only
    keep = torch.ones(L, S, dtype=torch.bool).tril() & (torch.arange(S) < lengths[:, None, None, None])  # (B, 1, L, S)
    expected = torch.softmax((0.7 * torch.tanh(scores / 0.7) + float_mask).masked_fill(~keep, -math.inf), dim=-1)
    torch.testing.assert_close(weights, expected, **TOL)


def test_returned_weights_come_from_the_same_path(generator):
    q, k, v = (torch.randn(B, H, n, d, generator=generator, dtype=torch.float64) for n, d in ((L, E), (S, E), (S, EV)))
    kwargs = dict(score_mod=mods.alibi(H), mask_mod=mods.sliding_window(2, offset=S - L))
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True, **kwargs)
    torch.testing.assert_close(weights, attention_weights(q, k, **kwargs), **TOL)
    torch.testing.assert_close(out, weights @ v, **TOL)
    assert torch.equal(scaled_dot_product_attention(q, k, v, backend="auto", **kwargs), out)


def test_mask_mod_combines_with_attn_mask_and_is_causal(generator):
    q, k, v = (torch.randn(B, H, n, d, generator=generator, dtype=torch.float64) for n, d in ((L, E), (S, E), (S, EV)))
    bool_mask = torch.rand(B, 1, L, S, generator=generator) < 0.7
    window = mods.sliding_window(3, 1)
    actual = scaled_dot_product_attention(q, k, v, bool_mask, is_causal=True, mask_mod=window)
    combined = bool_mask & torch.ones(L, S, dtype=torch.bool).tril() & mods.create_mask(window, None, None, L, S)
    torch.testing.assert_close(actual, scaled_dot_product_attention(q, k, v, combined), **TOL)


# --- parity with FlexAttention (CPU eager, float64) ---------------------------------------------

Q_IDS = torch.tensor([[0, 0, 1, 1, 2, 2, 2], [4, 1, 1, 1, 1, 1, 1]])  # query 0 of batch 1: no key of document 4
KV_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1]])  # sliced to (B, L) and (B, S)
MASK_MODS = {
    "causal": lambda Lq, Sk: mods.causal(),
    "causal_bottom_right": lambda Lq, Sk: mods.causal(Sk - Lq),
    "sliding_window": lambda Lq, Sk: mods.sliding_window(1, offset=Sk - Lq),
    "sliding_window_two_sided": lambda Lq, Sk: mods.sliding_window(2, 1, offset=-1),
    "sliding_window_unbounded_left": lambda Lq, Sk: mods.sliding_window(None, 1),
    "sliding_window_sinks": lambda Lq, Sk: mods.sliding_window(1, offset=Sk - Lq, sink_tokens=2),
    "chunked": lambda Lq, Sk: mods.chunked(3, offset=1),
    "prefix_lm": lambda Lq, Sk: mods.prefix_lm(2),
    "prefix_lm_per_batch": lambda Lq, Sk: mods.prefix_lm(torch.tensor([3, 0]), offset=-2),
    "document": lambda Lq, Sk: mods.document(Q_IDS[:, :Lq], KV_IDS[:, :Sk]),
    "document_1d": lambda Lq, Sk: mods.document(Q_IDS[1, :Lq], KV_IDS[1, :Sk]),
    "padding": lambda Lq, Sk: mods.padding(torch.tensor([3, 0])),  # batch 1: every row fully masked
    "and_masks": lambda Lq, Sk: mods.and_masks(
        mods.causal(Sk - Lq), mods.sliding_window(2, offset=Sk - Lq), mods.padding(torch.tensor([4, 5]))
    ),
    "or_masks": lambda Lq, Sk: mods.or_masks(mods.prefix_lm(1), mods.chunked(2)),
}
SCORE_MODS = {
    "alibi": lambda: mods.alibi(H),
    "alibi_symmetric": lambda: mods.alibi(H, symmetric=True, offset=S - L),
    "softcap": lambda: mods.softcap(0.5),
    "compose": lambda: mods.compose(mods.alibi(H), mods.softcap(0.5)),
}


def _qkv(generator, Lq=L, Sk=S, dtype=torch.float64):
    q = torch.randn(B, H, Lq, E, generator=generator, dtype=dtype)
    k = torch.randn(B, HKV, Sk, E, generator=generator, dtype=dtype)
    v = torch.randn(B, HKV, Sk, E, generator=generator, dtype=dtype)  # flex needs Ev == E here
    return q, k, v


def _flex(q, k, v, score_mod=None, mask_mod=None):
    # a fresh dynamo each call: torch 2.15.0's eager flex_attention refuses a score_mod's captured float (the
    # soft cap) once it has traced before (the conformance suite's known failure of torch-flex records that bug)
    torch._dynamo.reset()
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cpu")
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


@pytest.mark.filterwarnings(FLEX_UNFUSED)
@pytest.mark.parametrize("Lq,Sk", [(L, S), (S, L)])
@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_equals_flex_attention(name, Lq, Sk, generator):
    mask_mod = MASK_MODS[name](Lq, Sk)
    q, k, v = _qkv(generator, Lq, Sk)
    actual = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, enable_gqa=True)
    torch.testing.assert_close(actual, _flex(q, k, v, mask_mod=mask_mod), **TOL)


@pytest.mark.filterwarnings(FLEX_UNFUSED)
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_equals_flex_attention(name, generator):
    q, k, v = _qkv(generator)
    score_mod = SCORE_MODS[name]()
    actual = scaled_dot_product_attention(q, k, v, score_mod=score_mod, enable_gqa=True)
    torch.testing.assert_close(actual, _flex(q, k, v, score_mod=score_mod), **TOL)


@pytest.mark.filterwarnings(FLEX_UNFUSED)
@pytest.mark.parametrize(
    "score,mask",
    [("alibi", "causal_bottom_right"), ("softcap", "document"), ("compose", "and_masks"), ("alibi_symmetric", "padding")],
)
def test_score_and_mask_mods_together_equal_flex_attention(score, mask, generator):
    q, k, v = _qkv(generator)
    score_mod, mask_mod = SCORE_MODS[score](), MASK_MODS[mask](L, S)
    actual = scaled_dot_product_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    torch.testing.assert_close(actual, _flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod), **TOL)


@pytest.mark.filterwarnings(FLEX_UNFUSED)
def test_fully_masked_rows_give_zero_in_both(generator):
    q, k, v = _qkv(generator)
    mask_mod = MASK_MODS["document"](L, S)
    keep = mods.create_mask(mask_mod, B, H, L, S)
    assert not keep[1, :, 0].any() and keep[0].any(-1).all()  # one query row has no key
    actual = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, enable_gqa=True)
    expected = _flex(q, k, v, mask_mod=mask_mod)
    assert torch.equal(actual[1, :, 0], torch.zeros_like(actual[1, :, 0]))
    assert torch.equal(expected[1, :, 0], torch.zeros_like(expected[1, :, 0]))
    torch.testing.assert_close(actual, expected, **TOL)


# --- gradients ---------------------------------------------------------------------------------


def _materialised(q, k, v, slopes, cap, keep):
    """The reference written out: dense ALiBi bias, softcap, dense boolean mask, plain softmax."""
    Lq, Sk = q.shape[-2], k.shape[-2]
    distance = torch.arange(Sk)[None, :] - torch.arange(Lq)[:, None]  # (L, S): j - i
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + slopes[:, None, None] * distance  # (B, H, L, S)
    scores = cap * torch.tanh(scores / cap)
    return torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ v


def test_gradients_equal_autograd_of_the_materialised_reference(generator):
    q, k, v = (
        torch.randn(B, H, n, d, generator=generator, dtype=torch.float64, requires_grad=True)
        for n, d in ((L, E), (S, E), (S, EV))
    )
    mask_mod = mods.and_masks(mods.sliding_window(3, 1), mods.padding(torch.tensor([7, 4])))
    keep = mods.create_mask(mask_mod, B, H, L, S)
    assert keep.any(-1).all()  # every row has a key: the plain softmax is defined
    grad_out = torch.randn(B, H, L, EV, generator=generator, dtype=torch.float64)
    score_mod = mods.compose(mods.alibi(H), mods.softcap(2.0))
    actual = scaled_dot_product_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    expected = _materialised(q, k, v, torch.tensor(PAPER_SLOPES[6], dtype=torch.float64), 2.0, keep)
    torch.testing.assert_close(actual, expected, **TOL)
    grads = torch.autograd.grad(actual, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, **TOL)


def test_gradcheck_with_mods_and_a_fully_masked_row(generator):
    q, k, v = (torch.randn(1, 2, n, 3, generator=generator, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    mask_mod = mods.document(torch.tensor([0, 1, 9]), torch.tensor([0, 0, 1, 1, 1]))  # query 2: no key
    score_mod = mods.compose(mods.alibi(2, symmetric=True), mods.softcap(1.5))
    fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    assert all(torch.isfinite(g).all() for g in grads)


# --- properties ----------------------------------------------------------------------------------

FAST = settings(max_examples=40, deadline=None)
sizes = st.integers(1, 9)
offsets = st.integers(-6, 6)


def _some_mask_mod(draw, Lq: int, Sk: int) -> mods.MaskMod:
    kind = draw(st.sampled_from(["causal", "window", "chunked", "prefix", "document", "padding"]))
    offset = draw(offsets)
    if kind == "causal":
        return mods.causal(offset)
    if kind == "window":
        side = st.one_of(st.none(), st.integers(0, 5))
        return mods.sliding_window(draw(side), draw(side), offset)
    if kind == "chunked":
        return mods.chunked(draw(st.integers(1, 5)), offset)
    if kind == "prefix":
        return mods.prefix_lm(draw(st.integers(0, 9)), offset)
    ids = lambda n: torch.tensor(draw(st.lists(st.integers(0, 2), min_size=2 * n, max_size=2 * n))).reshape(2, n)  # noqa: E731
    if kind == "document":
        return mods.document(ids(Lq), ids(Sk))
    return mods.padding(torch.tensor(draw(st.lists(st.integers(0, 9), min_size=2, max_size=2))))


@FAST
@given(Lq=sizes, Sk=sizes, offset=offsets)
def test_a_window_reaching_every_earlier_key_is_causal(Lq, Sk, offset):
    reach = max(0, Lq - 1 + offset)  # the farthest a query's position is from key 0: Lq - 1 keys back at offset 0
    causal = mods.create_mask(mods.causal(offset), None, None, Lq, Sk)
    assert torch.equal(mods.create_mask(mods.sliding_window(reach, 0, offset), None, None, Lq, Sk), causal)
    if reach >= 1 and Sk >= 1 and Lq - 1 + offset < Sk:  # the last query sees key 0 and key reach
        assert not torch.equal(mods.create_mask(mods.sliding_window(reach - 1, 0, offset), None, None, Lq, Sk), causal)


@FAST
@given(Lq=sizes, doc=st.integers(0, 100), seed=st.integers(0, 2**31 - 1))
def test_document_with_one_document_is_no_mask(Lq, doc, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, Lq, d, generator=gen, dtype=torch.float64) for d in (3, 3, 5))
    ids = torch.full((Lq,), doc)
    assert mods.create_mask(mods.document(ids), None, None, Lq, Lq).all()
    actual = scaled_dot_product_attention(q, k, v, mask_mod=mods.document(ids))
    torch.testing.assert_close(actual, scaled_dot_product_attention(q, k, v), **TOL)


@FAST
@given(data=st.data(), Lq=sizes, Sk=sizes)
def test_and_masks_of_a_mod_with_itself_is_the_mod(data, Lq, Sk):
    mod = _some_mask_mod(data.draw, Lq, Sk)
    alone = mods.create_mask(mod, 2, None, Lq, Sk)
    assert torch.equal(mods.create_mask(mods.and_masks(mod, mod), 2, None, Lq, Sk), alone)
    assert torch.equal(mods.create_mask(mods.or_masks(mod, mod), 2, None, Lq, Sk), alone)


# --- errors --------------------------------------------------------------------------------------


def _small():
    return torch.zeros(B, H, L, E), torch.zeros(B, H, S, E), torch.zeros(B, H, S, EV)


@pytest.mark.parametrize(
    "factory,error,message",
    [
        (lambda: mods.sliding_window(-1), ValueError, _msg("left must be a non-negative int or None", "got -1")),
        (lambda: mods.sliding_window(2, -3), ValueError, _msg("right must be a non-negative int or None", "got -3")),
        (lambda: mods.sliding_window(2.5), TypeError, _msg("left must be a non-negative int or None", "got float")),
        (lambda: mods.sliding_window(2, sink_tokens=-1), ValueError, _msg("sink_tokens must be a non-negative int", "got -1")),
        (lambda: mods.sliding_window(2, sink_tokens=4.0), TypeError, _msg("sink_tokens must be a non-negative int", "got float")),
        (lambda: mods.sliding_window(2, sink_tokens=True), TypeError, _msg("sink_tokens must be a non-negative int", "got bool")),
        (lambda: mods.chunked(0), ValueError, _msg("size must be a positive int", "got 0")),
        (lambda: mods.chunked(-4), ValueError, _msg("size must be a positive int", "got -4")),
        (lambda: mods.chunked(2.0), TypeError, _msg("size must be a positive int, got float")),
        (lambda: mods.causal(offset=1.5), TypeError, _msg("offset must be an int, got float")),
        (lambda: mods.prefix_lm(-1), ValueError, _msg("prefix_length must be non-negative, got -1")),
        (lambda: mods.prefix_lm(torch.tensor([2, -1])), ValueError, _msg("prefix_length must be non-negative", "-1")),
        (lambda: mods.prefix_lm(torch.tensor([1.0])), TypeError, _msg("prefix_length must be an integer tensor (B,), got torch.float32")),
        (lambda: mods.prefix_lm(torch.ones(2, 2, dtype=torch.long)), ValueError, _msg("prefix_length must have shape (B,)", "(2, 2)")),
        (lambda: mods.prefix_lm("3"), TypeError, _msg("prefix_length must be an int or a (B,) integer tensor, got str")),
        (lambda: mods.document(torch.zeros(5)), TypeError, _msg("document_ids must be an integer tensor (L,) or (B, L), got torch.float32")),
        (lambda: mods.document(torch.zeros(1, 2, 5, dtype=torch.long)), ValueError, _msg("document_ids must have shape (L,) or (B, L)", "(1, 2, 5)")),
        (lambda: mods.document(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)), ValueError,
         _msg("kv_document_ids must match document_ids", "(2, 5)", "(3, 7)")),
        (lambda: mods.padding([1, 2]), TypeError, _msg("lengths must be a torch.Tensor, got list")),
        (lambda: mods.padding(torch.tensor([-2, 3])), ValueError, _msg("lengths must be non-negative, got a minimum of -2")),
        (lambda: mods.alibi(0), ValueError, _msg("num_heads must be a positive int, got 0")),
        (lambda: mods.alibi(4, symmetric=1), TypeError, _msg("symmetric must be a bool, got int")),
        (lambda: mods.softcap(0.0), ValueError, _msg("cap must be a positive finite float, got 0.0")),
        (lambda: mods.softcap(math.inf), ValueError, _msg("cap must be a positive finite float, got inf")),
        (lambda: mods.softcap("30"), TypeError, _msg("cap must be a positive finite float, got str")),
        (lambda: mods.and_masks(mods.causal(), 3), TypeError, _msg("and_masks: mask_mods[1] must be a callable", "got int")),
        (lambda: mods.or_masks(lambda q_idx, kv_idx: q_idx >= kv_idx), TypeError,
         _msg("or_masks: mask_mods[0] must take 4 positional arguments (b, h, q_idx, kv_idx), got a function of 2")),
        (lambda: mods.compose(mods.causal()), TypeError,
         _msg("compose: score_mods[0] must take 5 positional arguments (score, b, h, q_idx, kv_idx), got a function of 4")),
        (lambda: mods.create_mask(mods.causal(), -1, None, L, S), ValueError, _msg("B must be a non-negative int, got -1")),
        (lambda: mods.create_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, None, None, L, S), TypeError,
         _msg("mask_mod must return a bool tensor (True = takes part), got torch.int64")),
    ],
)
def test_factory_errors(factory, error, message):
    with pytest.raises(error, match=message):
        factory()


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(mask_mod=lambda q_idx, kv_idx: q_idx >= kv_idx), TypeError,
         _msg("mask_mod must take 4 positional arguments (b, h, q_idx, kv_idx), got a function of 2: (q_idx, kv_idx)")),
        (dict(score_mod=lambda score, q_idx, kv_idx: score), TypeError,
         _msg("score_mod must take 5 positional arguments (score, b, h, q_idx, kv_idx), got a function of 3")),
        (dict(score_mod=mods.causal()), TypeError, _msg("score_mod must take 5 positional arguments", "got a function of 4")),
        (dict(mask_mod="causal"), TypeError, _msg("mask_mod must be a callable (b, h, q_idx, kv_idx) -> tensor, got str")),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).float()), TypeError,
         _msg("mask_mod must return a bool tensor (True = takes part), got torch.float32")),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: True), TypeError, _msg("mask_mod must return a bool tensor", "got bool")),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: torch.ones(S, L, dtype=torch.bool)), ValueError,
         _msg(f"mask_mod must return a tensor broadcastable to the scores (..., L, S) = ({B}, {H}, {L}, {S}), got shape ({S}, {L})")),
        (dict(score_mod=lambda score, b, h, q_idx, kv_idx: score > 0), TypeError,
         _msg("score_mod must return a floating-point tensor (the modified scores), got torch.bool")),
        (dict(score_mod=lambda score, b, h, q_idx, kv_idx: score.sum(-1)), ValueError,
         _msg(f"score_mod must return a tensor of the scores' shape (..., L, S) = ({B}, {H}, {L}, {S}), got shape ({B}, {H}, {L})")),
        (dict(score_mod=lambda score, b, h, q_idx, kv_idx: (score > 0).long()), TypeError,
         _msg("score_mod must return a floating-point tensor, got torch.int64")),
        (dict(score_mod=mods.alibi(8)), ValueError, _msg(f"alibi(num_heads): num_heads must equal the query heads H = {H}, got num_heads=8")),
        (dict(mask_mod=mods.document(torch.zeros(4, dtype=torch.long), torch.zeros(S, dtype=torch.long))), ValueError,
         _msg(f"document_ids must have length L = {L} (dim -1), got shape (4,)")),
        (dict(mask_mod=mods.document(torch.zeros(B, L, dtype=torch.long))), ValueError,
         _msg(f"document_ids (used for the keys too) must have length S = {S} (dim -1), got shape ({B}, {L})")),
        (dict(mask_mod=mods.document(torch.zeros(3, L, dtype=torch.long), torch.zeros(3, S, dtype=torch.long))), ValueError,
         _msg(f"document_ids must have batch B = {B} (dim 0), got shape (3, {L})")),
        (dict(mask_mod=mods.padding(torch.tensor([1, 2, 3]))), ValueError,
         _msg(f"padding(lengths): lengths must have shape (B,) = ({B},), got shape (3,)")),
        (dict(mask_mod=mods.and_masks(mods.causal(), mods.prefix_lm(torch.tensor([1])))), ValueError,
         _msg(f"prefix_lm(prefix_length): prefix_length must have shape (B,) = ({B},), got shape (1,)")),
    ],
)
@pytest.mark.parametrize("fn", ["sdpa", "weights"])
def test_call_errors(kwargs, error, message, fn):
    q, k, v = _small()
    with pytest.raises(error, match=message):
        if fn == "sdpa":
            scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            attention_weights(q, k, **kwargs)


@pytest.mark.parametrize("given_mods", [dict(score_mod=mods.softcap(5.0)),
                                        dict(score_mod=mods.softcap(5.0), mask_mod=mods.causal())])
def test_sdpa_refuses_a_score_mod(given_mods):
    q, k, v = _small()
    with pytest.raises(ValueError, match=_msg("backend='sdpa' cannot run this call: torch's "
                                              "scaled_dot_product_attention takes no score_mod")):
        scaled_dot_product_attention(q, k, v, backend="sdpa", **given_mods)


def test_sdpa_materialises_a_mask_mod():
    torch.manual_seed(0)
    q, k, v = (torch.randn_like(t, dtype=torch.float64) for t in _small())
    mask_mod = mods.sliding_window(1, 1)
    for attn_mask in (None, torch.rand(k.shape[-2]) > 0.3, torch.randn(q.shape[-2], k.shape[-2])):
        expected = scaled_dot_product_attention(q, k, v, attn_mask, mask_mod=mask_mod)
        got = scaled_dot_product_attention(q, k, v, attn_mask, mask_mod=mask_mod, backend="sdpa")
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "given_mods,options",
    [
        (dict(mask_mod=mods.causal(3)), {"window": (None, 0), "window_offset": 3}),
        (dict(mask_mod=mods.sliding_window(4, None, offset=-2)), {"window": (4, None), "window_offset": -2}),
        (dict(score_mod=mods.softcap(5.0)), {"softcap": 5.0}),
        (dict(score_mod=mods.softcap(2.0), mask_mod=mods.sliding_window(1, 2)),
         {"window": (1, 2), "window_offset": 0, "softcap": 2.0}),
    ],
)
def test_the_triton_kernel_takes_the_mods_it_implements(given_mods, options):
    from attention_ref import backends

    q, k, v = _small()
    assert backends._triton_options(backends.ValidatedCall(q, k, v, None, **given_mods)) == (options, None)


@pytest.mark.parametrize(
    "given_mods,named",
    [
        (dict(mask_mod=mods.chunked(2)), "mask mods mods.causal and mods.sliding_window"),
        (dict(mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(2))), "mask mods mods.causal"),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), "mask mods mods.causal"),
        (dict(score_mod=mods.alibi(3)), "score mod mods.softcap"),
        (dict(mask_mod=mods.sliding_window(2, sink_tokens=4)), "no sink tokens: it takes mods.sliding_window only "
                                                                "with sink_tokens=0, got sink_tokens=4"),
        (dict(mask_mod=mods.sliding_window(None, 1, sink_tokens=1)), "got sink_tokens=1"),
    ],
)
def test_the_triton_kernel_refuses_other_mods(given_mods, named):
    from attention_ref import backends

    q, k, v = _small()
    options, reason = backends._triton_options(backends.ValidatedCall(q, k, v, None, **given_mods))
    assert reason is not None and named in reason and "use backend='math' or 'tiled'" in reason


def test_the_triton_route_refuses_sink_tokens(monkeypatch):
    from attention_ref import backends

    monkeypatch.setattr(backends, "_triton_available", lambda device: True)  # past the device check, to the mods
    q = torch.randn(1, 2, 7, 16)
    with pytest.raises(ValueError, match=_msg("backend='triton' cannot run this call: the Triton kernel has no sink "
                                              "tokens", "got sink_tokens=4")):
        scaled_dot_product_attention(q, q, q, backend="triton", mask_mod=mods.sliding_window(2, sink_tokens=4))


def test_multihead_forward_takes_the_mods():
    from attention_ref import MultiHeadAttention

    torch.manual_seed(0)
    B, L, d, H = 2, 5, 12, 3
    mha = MultiHeadAttention(d, H).double()
    x = torch.randn(B, L, d, dtype=torch.float64)
    assert torch.equal(mha(x, mask_mod=mods.causal()), mha(x, is_causal=True))
    bias = mods.alibi(H)(torch.zeros(1, H, L, L, dtype=torch.float64), torch.arange(1)[:, None, None, None],
                         torch.arange(H)[None, :, None, None], torch.arange(L)[:, None], torch.arange(L))
    out, w = mha(x, score_mod=mods.alibi(H), return_weights=True, average_weights=False)
    expected, expected_w = mha(x, attn_mask=bias, return_weights=True,
                               average_weights=False)  # the bias as a float mask
    assert torch.allclose(out, expected, atol=1e-12) and torch.allclose(w, expected_w, atol=1e-12)
    assert not torch.allclose(out, mha(x), atol=1e-6)


# --- chunks counted from each sequence's start, left padding (transformers' convention) ---------


@pytest.mark.parametrize(("L", "q_offset"), [(11, 0), (1, 10), (4, 7)], ids=["prefill", "decode", "chunk"])
def test_chunked_from_start_and_left_padding_equal_transformers_masks(L, q_offset):
    """transformers counts chunks from each sequence's first real token; so do chunked(start=) and padding('left')."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    S, size = 11, 3
    lengths = torch.tensor([11, 7, 4, 0])
    left_padding = S - lengths  # slots of padding before each sequence
    real = torch.arange(S) >= left_padding[:, None]  # (B, S) True = a real token, as transformers' attention_mask
    expected = masking_utils.sdpa_mask(
        batch_size=4, q_length=L, kv_length=S, q_offset=q_offset,
        mask_function=masking_utils.chunked_causal_mask_function(size, left_padding),
        attention_mask=real, allow_is_causal_skip=False,
    )  # (B, 1, L, S)
    ours = mods.and_masks(mods.causal(offset=q_offset), mods.chunked(size, q_offset, start=left_padding),
                          mods.padding(lengths, side="left", total=S))
    got = mods.create_mask(ours, 4, None, L, S)  # (B, 1, L, S)
    assert torch.equal(got, expected)
    # Without start, chunks counted from slot 0 differ wherever a sequence is left padded by a non-multiple of size.
    plain = mods.and_masks(mods.causal(offset=q_offset), mods.chunked(size, q_offset),
                           mods.padding(lengths, side="left", total=S))
    assert not torch.equal(mods.create_mask(plain, 4, None, L, S), expected)


def test_left_padding_and_chunk_start_errors_name_the_argument():
    lengths = torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"side='left'\) needs total=S"):
        mods.padding(lengths, side="left")
    with pytest.raises(ValueError, match="side must be 'right' or 'left', got 'top'"):
        mods.padding(lengths, side="top")
    with pytest.raises(ValueError, match="total is only for side='left'"):
        mods.padding(lengths, total=3)
    with pytest.raises(ValueError, match="lengths must be at most total = 2, got a maximum of 3"):
        mods.padding(lengths, side="left", total=2)
    with pytest.raises(ValueError, match=r"total=5\) used with S = 4 keys"):
        mods.create_mask(mods.padding(lengths, side="left", total=5), 2, None, 1, 4)
    with pytest.raises(ValueError, match="start must be non-negative"):
        mods.chunked(2, start=torch.tensor([0, -1]))
    with pytest.raises(TypeError, match="start"):
        mods.chunked(2, start=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="start"):
        mods.create_mask(mods.chunked(2, start=torch.tensor([0, 1, 2])), 2, None, 3, 3)


def test_chained_indexing_in_a_mod_raises_and_says_to_use_one_subscript():
    """FlexAttention calls a mod per element, where bias[b][h][i][j] works; on this package's
    broadcast index grids it raises, and the message says what to write instead."""
    q = k = v = torch.randn(1, 2, 5, 4)
    bias = torch.randn(1, 2, 5, 5)
    one_subscript = scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j])
    assert torch.allclose(one_subscript, scaled_dot_product_attention(q, k, v, attn_mask=bias))
    with pytest.raises(IndexError, match=r"score_mod raised IndexError on the index grids: .* one subscript, "
                                         r"bias\[b, h, q_idx, kv_idx\]"):
        scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b][h][i][j])
    keep = torch.rand(1, 2, 5, 5) > 0.5
    with pytest.raises(IndexError, match=r"mask_mod raised IndexError on the index grids"):
        scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: keep[b][h][i][j])


# Issue 39, S4: positions are int64; causal(offset=2**63 - 1) wrapped around and masked rows 1 onward,
# chunked(2**63) was wrong, sliding_window(2**70) raised torch's OverflowError.
@pytest.mark.parametrize("make, name, value", [
    (lambda v: mods.causal(offset=v), "offset", 2**63 - 1),
    (lambda v: mods.causal(offset=v), "offset", -(2**61)),
    (lambda v: mods.chunked(v), "size", 2**63),
    (lambda v: mods.sliding_window(v), "left", 2**70),
    (lambda v: mods.sliding_window(3, right=v), "right", 2**61),
    (lambda v: mods.sliding_window(3, sink_tokens=v), "sink_tokens", 2**61),
    (lambda v: mods.prefix_lm(3, offset=v), "offset", 2**62),
])
def test_values_past_int64_positions_are_refused_by_name(make, name, value):
    with pytest.raises(ValueError, match=rf"{name} must lie in \[-?\d*[^\]]*2\*\*60\] \(positions are int64"):
        make(value)


def test_the_largest_allowed_values_still_compute():
    limit = mods.POSITION_LIMIT
    everything = mods.create_mask(mods.causal(offset=limit), None, None, 3, 4)
    assert everything.all()
    nothing = mods.create_mask(mods.causal(offset=-limit), None, None, 3, 4)
    assert not nothing.any()
    one_chunk = mods.create_mask(mods.chunked(limit), None, None, 3, 4)
    assert one_chunk.all()
    window = mods.create_mask(mods.sliding_window(limit, right=limit, sink_tokens=limit), None, None, 3, 4)
    assert window.all()
