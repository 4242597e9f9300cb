"""The log-sum-exp (``return_lse=True``) and `merge_attention`, the pieces ring attention is made of.

``lse`` is compared in float64 with ``torch.logsumexp`` of independently built scores and with the
log-sum-exp that torch's own CPU flash kernel returns; its gradient (it is differentiable on both
backends that return it) with autograd through ``torch.logsumexp``. `merge_attention` is shown equal
to attention over the concatenated keys for random splits, masks, fully masked parts and orders
of merging, outputs and gradients.

Tests that take the ``device`` fixture run on ``--device cuda`` too (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_ref import merge_attention, mods, scaled_dot_product_attention
from attention_ref.backends import select_backend

B, H, HKV, L, S, E, EV = 2, 6, 3, 7, 11, 5, 3
NEG_INF = float("-inf")


def _qkv(L=L, S=S, heads=(H, H), seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, heads[0], L, E), (B, heads[1], S, E), (B, heads[1], S, EV))
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(device).requires_grad_() for s in shapes]


def _scores(q, k, keep=None, score_mod=None):
    """Independent reference scores (B, H, L, S): plain matmul, the mod by broadcasting, -inf where not kept."""
    if k.shape[1] != q.shape[1]:  # grouped heads: repeat each kv head for its query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        b, h, i, j = (torch.arange(n, device=s.device).view(*([1] * d), n, *([1] * (3 - d)))
                      for d, n in enumerate(s.shape))
        s = score_mod(s, b, h, i, j)
    return s if keep is None else s.masked_fill(~keep, NEG_INF)


def _reference_lse(s):
    """torch.logsumexp, with -inf on rows of only -inf (torch gives -inf there as well)."""
    return torch.logsumexp(s, dim=-1)


def _keep(kind, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "causal":
        return torch.ones(L, S, dtype=torch.bool, device=device).tril()
    if kind in ("random with empty rows", "float mask with empty rows"):
        keep = torch.rand(B, 1, L, S, generator=gen) < 0.4
        keep[:, :, 2] = False  # row 2 sees no key at all
        return keep.to(device)
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", ["math", "tiled", "auto"])
@pytest.mark.parametrize("kind", ["none", "causal", "random with empty rows", "float mask with empty rows"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_lse_equals_logsumexp_of_the_scores_with_gradients(backend, kind, gqa, device):
    q, k, v = _qkv(heads=(H, HKV if gqa else H), device=device)
    keep = _keep(kind, device=device)
    kwargs = dict(is_causal=True) if kind == "causal" else dict(attn_mask=keep)
    if kind.startswith("float"):  # -inf added to the scores: a gradient flows through the addition
        kwargs = dict(attn_mask=torch.zeros(keep.shape, dtype=torch.float64, device=device).masked_fill(~keep, NEG_INF))
    out, lse = scaled_dot_product_attention(q, k, v, **kwargs, enable_gqa=gqa, backend=backend, return_lse=True)
    s = _scores(q, k, keep)
    expected = _reference_lse(s)
    assert lse.shape == (B, H, L) and lse.dtype == torch.float64 and lse.device == device
    assert torch.equal(torch.isinf(lse), torch.isinf(expected))  # -inf exactly on the empty rows
    torch.testing.assert_close(lse, expected, atol=1e-12, rtol=1e-12)
    # Gradient through both outputs; the reference goes through torch.logsumexp and softmax.
    weights = torch.rand(L, dtype=torch.float64, device=device)  # a different weight per row catches rows mixed up
    loss = out.sin().sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * weights).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    vv = v.repeat_interleave(H // v.shape[1], dim=1)
    ref_out = torch.nan_to_num(torch.softmax(s, dim=-1)) @ vv
    ref_lse = expected.masked_fill(torch.isinf(expected), 0.0)
    ref_grads = torch.autograd.grad(ref_out.sin().sum() + (ref_lse * weights).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.cpu_only("torch's CPU flash kernel is the comparison")
def test_lse_equals_the_one_torch_flash_kernel_returns():
    q, k, _ = (t.detach().float() for t in _qkv())
    v = torch.randn(k.shape)  # torch's flash kernel needs Ev == E
    _, lse = scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    _, torch_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2]
    torch.testing.assert_close(lse, torch_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_lse_sees_the_mods(backend, device):
    q, k, v = _qkv(device=device)
    score_mod, mask_mod = mods.softcap(0.5), mods.sliding_window(2, offset=S - L)
    _, lse = scaled_dot_product_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend,
                                          return_lse=True)
    keep = mods.create_mask(mask_mod, B, H, L, S, device=device)
    torch.testing.assert_close(lse, _reference_lse(_scores(q, k, keep, score_mod)), atol=1e-12, rtol=1e-12)


def test_the_tuple_order_with_weights_and_lse():
    q, k, v = _qkv()
    out, weights, lse = scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    assert out.shape == (B, H, L, EV) and weights.shape == (B, H, L, S) and lse.shape == (B, H, L)
    # The weights are exp(scores - lse).
    torch.testing.assert_close(weights, torch.exp(_scores(q, k) - lse.unsqueeze(-1)), atol=1e-12, rtol=0)


def test_half_inputs_give_a_float32_lse(device):
    q, k, v = (t.detach().to(torch.bfloat16) for t in _qkv(device=device))
    for backend in ("math", "tiled"):
        out, lse = scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_backends_without_lse_refuse_naming_themselves(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"backend='{backend}'.*return_lse"):
        scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True)


def test_auto_picks_a_backend_that_returns_lse():
    q, k, v = _qkv()
    assert select_backend(q, k, v) == "sdpa"
    assert select_backend(q, k, v, return_lse=True) == "math"
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        scaled_dot_product_attention(q, k, v, return_lse=1)


# --- merge_attention ----------------------------------------------------------------------------


def _part(q, k, v, keep, lo, hi):
    """Attention of every query over keys lo..hi-1 only, with the matching columns of the mask."""
    mask = None if keep is None else keep[..., lo:hi]
    return scaled_dot_product_attention(q, k[..., lo:hi, :], v[..., lo:hi, :], mask, return_lse=True)


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, S), seed=st.integers(0, 2**16), density=st.sampled_from([0.0, 0.3, 1.0]))
def test_merging_two_parts_equals_attention_over_all_keys(cut, seed, density):
    q, k, v = _qkv(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, H, L, S, generator=gen) < density
    keep[..., 0, :cut] = False  # row 0: nothing in part a (lse_a = -inf), whatever part b has
    out, lse = merge_attention(*_part(q, k, v, keep, 0, cut), *_part(q, k, v, keep, cut, S))
    full, full_lse = scaled_dot_product_attention(q, k, v, keep, return_lse=True)
    torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(out.sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v))
    full_grads = torch.autograd.grad(full.sum() + full_lse.masked_fill(full_lse.isinf(), 0).sum(), (q, k, v))
    for got, want in zip(grads, full_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_merging_in_any_order_and_grouping_gives_the_same_result():
    q, k, v = _qkv()
    cuts = [0, 3, 4, 9, S]
    parts = [_part(q, k, v, None, a, b) for a, b in zip(cuts, cuts[1:])]
    left = parts[0]
    for part in parts[1:]:  # ((p0 + p1) + p2) + p3
        left = merge_attention(*left, *part)
    right = merge_attention(*merge_attention(*parts[3], *parts[1]), *merge_attention(*parts[2], *parts[0]))
    full = scaled_dot_product_attention(q, k, v, return_lse=True)
    for merged in (left, right):
        torch.testing.assert_close(merged[0], full[0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(merged[1], full[1], atol=1e-12, rtol=1e-12)


def test_rows_empty_in_both_parts_stay_zero_with_finite_gradients():
    q, k, v = _qkv()
    keep = torch.ones(L, S, dtype=torch.bool)
    keep[4] = False  # row 4 sees no key in either part
    a, b = _part(q, k, v, keep, 0, 5), _part(q, k, v, keep, 5, S)
    out, lse = merge_attention(*a, *b)
    assert torch.equal(out[..., 4, :], torch.zeros_like(out[..., 4, :]))
    assert torch.isneginf(lse[..., 4]).all() and torch.isfinite(lse[..., :4]).all()
    grads = torch.autograd.grad(out.sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    # The same with the parts as leaves: the merge itself lets no NaN through.
    leaves = [t.detach().requires_grad_() for t in (*a, *b)]
    out, lse = merge_attention(*leaves)
    grads = torch.autograd.grad(out.sum() + lse.masked_fill(lse.isinf(), 0).sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_is_differentiable_in_its_own_arguments():
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda *a: merge_attention(*a), args)


def test_merge_errors_name_the_argument():
    out, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(TypeError, match="lse_b must be a torch.Tensor, got list"):
        merge_attention(out, lse, out, [0.0])
    with pytest.raises(ValueError, match=r"lse_a must have shape \(2, 3\).*got \(2, 4\)"):
        merge_attention(out, torch.zeros(2, 4), out, lse)
    with pytest.raises(ValueError, match=r"out_a and out_b must have one shape.*\(2, 3, 4\).*\(2, 3, 5\)"):
        merge_attention(out, lse, torch.zeros(2, 3, 5), lse)
    with pytest.raises(TypeError, match="out_b must be a floating-point tensor, got torch.int64"):
        merge_attention(out, lse, torch.zeros(2, 3, 4, dtype=torch.long), lse)


# Issue 39, S2: the factors were e^(lse_part - lse) with lse rounded in float32, which at |lse| = 1e7
# is off by 0.5: the merge of two equal halves gave 1.47 instead of 2.
@pytest.mark.parametrize("big", [0.0, 1e3, 1e6, 1e7, 3e8, 1e30, -1e30])
def test_merge_and_add_sinks_stay_exact_for_large_lse_in_float32(big):
    from attention_ref import add_sinks

    g = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    lse_a = big + torch.randn(2, 3, 5, generator=g)
    lse_b = lse_a + torch.randn(2, 3, 5, generator=g)  # close to lse_a, as parts of one row are
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    # float64, from the same float32 inputs, with the shift taken out exactly
    d = (lse_b.double() - lse_a.double())
    w_a = 1 / (1 + d.exp())
    expected = w_a[..., None] * out_a.double() + (1 - w_a[..., None]) * out_b.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    sinks = torch.tensor([0.5, -1.0, 2.0]) + big
    got, got_lse = add_sinks(out_a, lse_a, sinks)
    keys = 1 / (1 + (sinks.view(3, 1).double() - lse_a.double()).exp())
    torch.testing.assert_close(got.double(), keys[..., None] * out_a.double(), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got_lse).all()


def test_merge_of_two_equal_halves_at_lse_1e7():
    out, lse = merge_attention(torch.ones(1, 4), torch.tensor([1e7]), torch.full((1, 4), 3.0), torch.tensor([1e7]))
    torch.testing.assert_close(out, torch.full((1, 4), 2.0))
