"""The functional core against ``torch.nn.functional.scaled_dot_product_attention``.

Every configuration is drawn from a seeded generator; sizes are distinct primes
(L=5, S=7, E=11, Ev=13, leading dims 2 and 3) so a swapped axis changes a shape.
Outputs and the gradients of query, key and value are compared in float64
(tight), float32 and bfloat16 (tolerances in conftest.py).
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from attention_ref import attention_weights, scaled_dot_product_attention

L, S, E, EV = 5, 7, 11, 13

# name -> leading dims of (query, key/value); "bcast" broadcasts (2, 1) with (1, 3).
LEADING = {
    "0d": ((), ()),
    "1d": ((3,), (3,)),
    "2d": ((2, 3), (2, 3)),
    "bcast": ((2, 1), (1, 3)),
}
MASKS = ["none", "bool", "bool_LS", "bool_keys", "float", "float_LS"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _make_mask(
    kind: str, batch: tuple[int, ...], Lq: int, Sk: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor | None:
    """A mask of the given kind; bool masks keep ~70% of the pairs (some rows may be empty)."""
    if kind == "none":
        return None
    shape = {
        "bool": (*batch, Lq, Sk),
        "bool_LS": (Lq, Sk),
        "bool_keys": (1, Sk),
        "float": (*batch, Lq, Sk),
        "float_LS": (Lq, Sk),
    }[kind]
    if kind.startswith("bool"):
        return torch.rand(shape, generator=gen) < 0.7
    mask = _randn(gen, *shape, dtype=dtype)
    if kind == "float_LS":
        # Block a few pairs with -inf, never a whole row, as a padding mask would.
        blocked = torch.rand(shape, generator=gen) < 0.3
        blocked[..., 0] = False
        mask = mask.masked_fill(blocked, float("-inf"))
    return mask


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _compare_with_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    torch_sdpa,
    assert_close,
    gen: torch.Generator,
    **kwargs,
) -> torch.Tensor:
    """Compare output and the gradients of q, k, v; return attention_ref's output."""
    ours_in, ref_in = _leaves(q, k, v), _leaves(q, k, v)
    ours = scaled_dot_product_attention(*ours_in, mask, **kwargs)
    ref = torch_sdpa(*ref_in, mask, **kwargs)
    assert ours.shape == ref.shape
    assert ours.dtype == q.dtype
    assert_close(ours, ref, q.dtype)
    cotangent = _randn(gen, *ours.shape, dtype=q.dtype)  # a random upstream gradient, not just sum()
    ours.backward(cotangent)
    ref.backward(cotangent)
    for name, a, b in zip("qkv", ours_in, ref_in):
        assert a.grad is not None and torch.isfinite(a.grad).all(), name
        assert_close(a.grad, b.grad, q.dtype)
    return ours


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("leading", list(LEADING), ids=list(LEADING))
def test_parity_with_torch(leading, mask_kind, is_causal, dtype, torch_sdpa, assert_close):
    seed = zlib.crc32(f"{leading}-{mask_kind}-{is_causal}-{dtype}".encode())  # stable across runs
    gen = torch.Generator().manual_seed(seed)
    q_lead, kv_lead = LEADING[leading]
    batch = tuple(torch.broadcast_shapes(q_lead, kv_lead))
    q = _randn(gen, *q_lead, L, E, dtype=dtype)
    k = _randn(gen, *kv_lead, S, E, dtype=dtype)
    v = _randn(gen, *kv_lead, S, EV, dtype=dtype)
    mask = _make_mask(mask_kind, batch, L, S, dtype, gen)
    out = _compare_with_torch(q, k, v, mask, torch_sdpa, assert_close, gen, is_causal=is_causal)
    assert out.shape == (*batch, L, EV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Lq,Sk", [(7, 5), (1, 13), (13, 1), (5, 5)])
def test_parity_query_and_key_lengths(Lq, Sk, is_causal, dtype, torch_sdpa, assert_close):
    gen = torch.Generator().manual_seed(Lq * 100 + Sk)
    q, k, v = _randn(gen, 3, Lq, E, dtype=dtype), _randn(gen, 3, Sk, E, dtype=dtype), _randn(gen, 3, Sk, EV, dtype=dtype)
    mask = _make_mask("bool_keys", (3,), Lq, Sk, dtype, gen)
    mask[..., 0] = True
    out = _compare_with_torch(q, k, v, mask, torch_sdpa, assert_close, gen, is_causal=is_causal)
    assert out.shape == (3, Lq, EV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float_LS"])
@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])
def test_parity_custom_scale(scale, mask_kind, dtype, torch_sdpa, assert_close):
    gen = torch.Generator().manual_seed(int(scale * 1000) + len(mask_kind))
    q, k, v = _randn(gen, 2, L, E, dtype=dtype), _randn(gen, 2, S, E, dtype=dtype), _randn(gen, 2, S, EV, dtype=dtype)
    mask = _make_mask(mask_kind, (2,), L, S, dtype, gen)
    _compare_with_torch(q, k, v, mask, torch_sdpa, assert_close, gen, scale=scale)


def test_default_scale_is_inverse_sqrt_of_E(generator):
    q, k, v = _randn(generator, 3, L, E), _randn(generator, 3, S, E), _randn(generator, 3, S, EV)
    default = scaled_dot_product_attention(q, k, v)
    explicit = scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(E))
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    # and the scale really is used: another value gives another result
    assert not torch.allclose(default, scaled_dot_product_attention(q, k, v, scale=1.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("mask_kind,is_causal", [("none", False), ("none", True), ("bool", False), ("float_LS", True)])
def test_parity_grouped_query_attention(kv_heads, mask_kind, is_causal, dtype, torch_sdpa, assert_close):
    gen = torch.Generator().manual_seed(kv_heads * 10 + int(is_causal))
    H = 6
    q = _randn(gen, 2, H, L, E, dtype=dtype)
    k = _randn(gen, 2, kv_heads, S, E, dtype=dtype)
    v = _randn(gen, 2, kv_heads, S, EV, dtype=dtype)
    mask = _make_mask(mask_kind, (2, H), L, S, dtype, gen)
    out = _compare_with_torch(q, k, v, mask, torch_sdpa, assert_close, gen, is_causal=is_causal, enable_gqa=True)
    assert out.shape == (2, H, L, EV)
    # GQA is the same as repeating each key/value head for its group of query heads
    reps = H // kv_heads
    expanded = scaled_dot_product_attention(
        q, k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1), mask, is_causal=is_causal
    )
    torch.testing.assert_close(out, expanded, atol=0, rtol=0)


def test_gqa_weights_have_query_heads(generator):
    q, k = _randn(generator, 2, 6, L, E), _randn(generator, 2, 3, S, E)
    w = attention_weights(q, k, enable_gqa=True)
    assert w.shape == (2, 6, L, S)
    # query heads 0 and 1 share key head 0: same keys, different queries
    torch.testing.assert_close(w[:, 0], attention_weights(q[:, 0], k[:, 0]))
    torch.testing.assert_close(w[:, 1], attention_weights(q[:, 1], k[:, 0]))


# --- half precision and large scores ------------------------------------------------------------


def _float64_reference(q, k, v, scale):
    """softmax(scale q k^T) v in float64, written out in full (no max subtraction needed here)."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    return torch.softmax(scores, dim=-1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_softmax_does_not_overflow(dtype, generator):
    # Scores far beyond float16's largest value (65504): computing them in float16 overflows.
    q = (_randn(generator, 2, L, E) * 100).to(dtype)
    k = (_randn(generator, 2, S, E) * 100).to(dtype)
    v = _randn(generator, 2, S, EV, dtype=dtype)
    if dtype == torch.float16:
        assert torch.isinf(q @ k.transpose(-2, -1)).any(), "precondition: float16 scores overflow"
    out, w = scaled_dot_product_attention(q, k, v, scale=1.0, return_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    expected = _float64_reference(q, k, v, 1.0)
    atol, rtol = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_matches_float64_reference(dtype, generator):
    q, k, v = _randn(generator, 3, L, E, dtype=dtype), _randn(generator, 3, S, E, dtype=dtype), _randn(generator, 3, S, EV, dtype=dtype)
    out = scaled_dot_product_attention(q, k, v)
    expected = _float64_reference(q, k, v, 1 / math.sqrt(E))
    atol, rtol = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    w = attention_weights(q, k)
    # the row sums are 1 up to one rounding to the half dtype per entry
    torch.testing.assert_close(w.double().sum(-1), torch.ones(3, L, dtype=torch.float64), atol=S * atol, rtol=0)


def test_large_scores_in_float32_do_not_overflow(generator):
    # exp(1e4) overflows float32 (and float64): the row max must be subtracted first.
    q = _randn(generator, 2, L, E, dtype=torch.float32) * 1e3
    k = _randn(generator, 2, S, E, dtype=torch.float32) * 1e3
    v = _randn(generator, 2, S, EV, dtype=torch.float32)
    out = scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _float64_reference(q, k, v, 1 / math.sqrt(E)), atol=1e-5, rtol=1e-5)
    q, k, v = _leaves(q, k, v)
    scaled_dot_product_attention(q, k, v).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# --- fully masked rows, empty sequences -------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal_and_bool"])
def test_fully_masked_row_gives_zero_output_weights_and_finite_grads(mask_kind, generator, torch_sdpa):
    q, k, v = _randn(generator, 2, L, E), _randn(generator, 2, S, E), _randn(generator, 2, S, EV)
    keep = torch.rand(2, L, S, generator=generator) < 0.7
    keep[..., 0] = True
    empty_rows = [(0, 1), (1, 3)]
    for b, i in empty_rows:
        keep[b, i] = False
    is_causal = mask_kind == "causal_and_bool"
    if is_causal:
        keep[1, 2, :3] = False  # keys 0..2 removed by the mask, keys 3.. by the causal mask
        empty_rows.append((1, 2))
    mask = keep if mask_kind != "float" else torch.zeros(2, L, S, dtype=torch.float64).masked_fill(~keep, float("-inf"))

    ours_in, ref_in = _leaves(q, k, v), _leaves(q, k, v)
    out, w = scaled_dot_product_attention(*ours_in, mask, is_causal=is_causal, return_weights=True)
    for b, i in empty_rows:
        assert (out[b, i] == 0).all()
        assert (w[b, i] == 0).all()
    others = torch.ones(2, L, dtype=torch.bool)
    for b, i in empty_rows:
        others[b, i] = False
    torch.testing.assert_close(w.sum(-1)[others], torch.ones(int(others.sum()), dtype=torch.float64))

    ref = torch_sdpa(*ref_in, mask, is_causal=is_causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    cotangent = _randn(generator, *out.shape)
    out.backward(cotangent)
    ref.backward(cotangent)
    for a, b in zip(ours_in, ref_in):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10)
    for b, i in empty_rows:
        assert (ours_in[0].grad[b, i] == 0).all()  # an empty row does not depend on its query


def test_zero_query_length(generator):
    q, k, v = _leaves(_randn(generator, 3, 0, E), _randn(generator, 3, S, E), _randn(generator, 3, S, EV))
    out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    assert out.shape == (3, 0, EV) and w.shape == (3, 0, S)
    out.sum().backward()
    assert k.grad.shape == k.shape and (k.grad == 0).all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_key_length_means_every_row_is_empty(is_causal, generator, torch_sdpa):
    q, k, v = _leaves(_randn(generator, 3, L, E), _randn(generator, 3, 0, E), _randn(generator, 3, 0, EV))
    out, w = scaled_dot_product_attention(q, k, v, is_causal=is_causal, return_weights=True)
    assert out.shape == (3, L, EV) and w.shape == (3, L, 0)
    assert (out == 0).all()
    torch.testing.assert_close(out, torch_sdpa(q, k, v))
    out.sum().backward()
    assert q.grad.shape == q.shape and (q.grad == 0).all()
    assert attention_weights(q, k).shape == (3, L, 0)


# --- returned weights and dropout -------------------------------------------------------------


@pytest.mark.parametrize("mask_kind,is_causal", [("none", False), ("bool", True), ("float_LS", False)])
def test_returned_weights_are_attention_weights_and_give_the_output(mask_kind, is_causal, generator):
    q, k, v = _randn(generator, 2, 3, L, E), _randn(generator, 2, 3, S, E), _randn(generator, 2, 3, S, EV)
    mask = _make_mask(mask_kind, (2, 3), L, S, torch.float64, generator)
    out, w = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, return_weights=True, scale=0.7)
    torch.testing.assert_close(w, attention_weights(q, k, mask, is_causal=is_causal, scale=0.7), atol=0, rtol=0)
    torch.testing.assert_close(out, w @ v, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.7), atol=0, rtol=0)


def test_dropout_zeroes_and_rescales_and_is_reproducible(generator):
    p = 0.4
    q, k, v = _randn(generator, 3, 11, E), _randn(generator, 3, 13, E), _randn(generator, 3, 13, EV)
    w = attention_weights(q, k)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        out1, w1 = scaled_dot_product_attention(q, k, v, dropout_p=p, return_weights=True)
        torch.manual_seed(3)
        out2, w2 = scaled_dot_product_attention(q, k, v, dropout_p=p, return_weights=True)
        torch.manual_seed(5)
        out3 = scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.testing.assert_close(out1, out2, atol=0, rtol=0)
    torch.testing.assert_close(w1, w2, atol=0, rtol=0)
    assert not torch.allclose(out1, out3)
    dropped = w1 == 0
    fraction = dropped.double().mean().item()
    assert 0.25 < fraction < 0.55  # 3 * 11 * 13 = 429 draws with p = 0.4
    torch.testing.assert_close(w1[~dropped], w[~dropped] / (1 - p))  # kept weights are rescaled
    torch.testing.assert_close(out1, w1 @ v)  # the returned weights are the ones used


def test_dropout_zero_is_no_dropout(generator):
    q, k, v = _randn(generator, 3, L, E), _randn(generator, 3, S, E), _randn(generator, 3, S, EV)
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, dropout_p=0.0), scaled_dot_product_attention(q, k, v), atol=0, rtol=0
    )


def test_attention_weights_parity_with_softmax_of_scores(generator):
    # attention_weights is softmax(scale q k^T + mask): check every mask kind, causal, in float64
    for kind, is_causal in itertools.product(MASKS, [False, True]):
        q, k = _randn(generator, 2, L, E), _randn(generator, 2, S, E)
        mask = _make_mask(kind, (2,), L, S, torch.float64, generator)
        scores = q @ k.transpose(-2, -1) / math.sqrt(E)
        if is_causal:
            scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        expected = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows: nan -> 0
        torch.testing.assert_close(attention_weights(q, k, mask, is_causal=is_causal), expected, msg=f"{kind} {is_causal}")
