"""Learned attention sinks (``sinks=``, `add_sinks`): the math and tiled paths against gpt-oss's own form.

The oracle is the form of gpt-oss's reference code, built here independently in float64: append the
head's sink as one more column of scores, softmax over keys and sink, drop the column. Against it:
outputs, weights, the sink-inclusive log-sum-exp and every gradient (``q``, ``k``, ``v``, ``sinks``),
with grouped-query heads, ``L != S``, causal and windowed masks, a soft-cap, and rows with no key.
`add_sinks`'s closed-form backward is checked against autograd through the oracle and by
``gradcheck``; split-KV shows the sink must be added once, after the merge.

Tests that take the ``device`` fixture run on ``--device cuda`` too (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_ref import add_sinks, attention_weights, merge_attention, mods, scaled_dot_product_attention
from attention_ref.backends import CPU_TILED_MIN_LENGTH, select_backend
from attention_ref.sinks import _AddSinks
from attention_ref.tiled import tiled_attention

B, H, HKV, L, S, E, EV = 2, 4, 2, 7, 11, 5, 3
NEG_INF = float("-inf")


def _inputs(L=L, S=S, heads=(H, H), seed=0, device="cpu", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, heads[0], L, E), (B, heads[1], S, E), (B, heads[1], S, EV))
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() for s in shapes)
    sinks = (torch.randn(heads[0], generator=gen, dtype=torch.float64) * 2).to(device, dtype).requires_grad_()
    return q, k, v, sinks


def _oracle(q, k, v, sinks, keep=None, softcap=None):
    """gpt-oss's form in float64: scores, a sink column appended, softmax, the column dropped."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    if k.shape[1] != q.shape[1]:  # grouped heads: head h reads kv head h // (H / Hkv)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    # (H,) -> (1, H, 1, 1), or one per query (B, H, L) -> (B, H, L, 1): not scaled, not capped
    column = (sinks.view(1, -1, 1, 1) if sinks.dim() == 1 else sinks.unsqueeze(-1)).expand(*s.shape[:-1], 1)
    both = torch.cat([s, column], dim=-1)
    weights = torch.softmax(both, dim=-1)[..., :-1]
    return weights @ v, weights, torch.logsumexp(both, dim=-1)


def _keep(kind, device="cpu"):
    if kind == "none":
        return None
    keep = torch.ones(L, S, dtype=torch.bool, device=device).tril()
    if kind == "causal":
        return keep
    if kind == "window":  # 3 keys per query, shorter than the sequence
        return keep & ~torch.ones(L, S, dtype=torch.bool, device=device).tril(-3)
    if kind == "empty rows":
        keep = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(3)) < 0.5
        keep[:, :, 2] = False  # row 2 sees no key
        keep[1, :, 5] = False
        return keep.to(device)
    raise AssertionError(kind)


def _loss(out, lse):
    """Depends on the output and on the log-sum-exp, so both cotangents reach the backward."""
    return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype, device=out.device)).sin().sum() \
        + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).mul(0.3).cos().sum()


def _per_query(sinks, seed=5):
    """(B, H, L) sinks, a leaf, in sinks' dtype and device: one per query (Inkling 2)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, generator=g, dtype=torch.float64) * 2).to(sinks).detach().requires_grad_()


@pytest.mark.parametrize("backend", ["math", "tiled"])
@pytest.mark.parametrize("kind", ["none", "causal", "window", "empty rows"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("per", ["head", "query"])
def test_sinks_equal_gpt_oss_form_with_gradients(backend, kind, gqa, per, device):
    """One sink per head (gpt-oss) or per query (Inkling 2): the appended column, weights and every gradient."""
    q, k, v, per_head = _inputs(heads=(H, HKV) if gqa else (H, H), device=device)
    sinks = per_head if per == "head" else _per_query(per_head)
    keep = _keep(kind, device)
    out, lse = scaled_dot_product_attention(q, k, v, keep, sinks=sinks, return_lse=True, backend=backend,
                                            enable_gqa=gqa)
    ref, ref_weights, ref_lse = _oracle(q, k, v, sinks, keep)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(attention_weights(q, k, keep, sinks=sinks, enable_gqa=gqa), ref_weights,
                               atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad(_loss(out, lse), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(_loss(ref, ref_lse), (q, k, v, sinks))
    assert grads[3].shape == sinks.shape  # one gradient per sink
    for name, g, r in zip("q k v sinks".split(), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-9, msg=lambda m, name=name: f"d{name}: {m}")
    if per == "query":  # the sinks matter: not the per-head result
        assert (out - _oracle(q, k, v, per_head, keep)[0]).abs().max() > 1e-2


def test_weights_are_sink_renormalised_and_rows_sum_below_one():
    q, k, _, sinks = _inputs()
    weights = attention_weights(q, k, sinks=sinks)
    _, ref_weights, ref_lse = _oracle(q, k, k[..., :EV], sinks)
    torch.testing.assert_close(weights, ref_weights, atol=1e-14, rtol=1e-12)
    # Each row's mass is what the sink leaves: 1 - exp(s_h - lse).
    left = 1 - torch.exp(sinks.view(1, H, 1) - ref_lse)
    torch.testing.assert_close(weights.sum(-1), left, atol=1e-14, rtol=1e-12)
    assert (weights.sum(-1) < 1).all()
    out, returned = scaled_dot_product_attention(q, k, k[..., :EV], sinks=sinks, return_weights=True)
    torch.testing.assert_close(out, returned @ k[..., :EV])


def test_sink_is_not_scaled_and_not_soft_capped():
    """The sink lives in the space of the final scores: a scale or a soft-cap leaves it alone."""
    q, k, v, sinks = _inputs()
    cap = 0.7  # far below the sinks' size, so a capped sink would differ a lot
    out = scaled_dot_product_attention(q, k, v, sinks=sinks, score_mod=mods.softcap(cap))
    torch.testing.assert_close(out, _oracle(q, k, v, sinks, softcap=cap)[0], atol=1e-12, rtol=1e-10)
    for scale in (0.1, 3.0):
        out = scaled_dot_product_attention(q, k, v, sinks=sinks, scale=scale)
        ref = _oracle(q * (scale * math.sqrt(E)), k, v, sinks)[0]  # the oracle scales by 1/sqrt(E)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_fully_masked_row_gives_zero_output_and_the_sink_as_lse(backend, device):
    q, k, v, sinks = _inputs(device=device)
    keep = torch.zeros(L, S, dtype=torch.bool, device=device)  # no query sees any key
    out, lse = scaled_dot_product_attention(q, k, v, keep, sinks=sinks, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sinks.detach().view(1, H, 1).expand(B, H, L), atol=0, rtol=0)
    d_sinks, d_q = torch.autograd.grad(lse.sum() + out.sum(), (sinks, q), allow_unused=True)
    torch.testing.assert_close(d_sinks, torch.full_like(sinks, B * L))  # d lse_i / d s_h = 1 on an empty row
    assert d_q is None or torch.equal(d_q, torch.zeros_like(d_q))
    if backend == "math":
        weights = attention_weights(q, k, keep, sinks=sinks)
        assert torch.equal(weights, torch.zeros_like(weights))


def test_minus_inf_sink_means_no_sink_and_tiled_matches_math_in_low_precision():
    q, k, v, _ = _inputs()
    none = torch.full((H,), NEG_INF, dtype=torch.float64)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, sinks=none), scaled_dot_product_attention(q, k, v))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q2, k2, v2, s2 = _inputs(dtype=dtype, seed=5)
        math_out = scaled_dot_product_attention(q2, k2, v2, is_causal=True, sinks=s2)
        tiled_out = scaled_dot_product_attention(q2, k2, v2, is_causal=True, sinks=s2, backend="tiled")
        assert math_out.dtype == tiled_out.dtype == dtype
        ref = _oracle(q2, k2, v2, s2, _keep("causal"))[0]
        tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
        for out in (math_out, tiled_out):
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_tiled_with_many_blocks_and_a_mask_mod_equals_math():
    q, k, v, sinks = _inputs(L=23, S=29, heads=(H, HKV))
    mask_mod = mods.sliding_window(5)
    out, lse = tiled_attention(q, k, v, enable_gqa=True, block_q=4, block_k=6, mask_mod=mask_mod, sinks=sinks,
                               return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=mask_mod, sinks=sinks,
                                                return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad(_loss(out, lse), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(_loss(ref, ref_lse), (q, k, v, sinks))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-9)


def test_add_sinks_closed_form_backward():
    """The written-out backward against gradcheck, with a row that has no key and a head with no sink."""
    gen = torch.Generator().manual_seed(7)
    out = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    lse[0, 1, 2] = NEG_INF  # a row with no key
    lse.requires_grad_()
    s = torch.randn(3, generator=gen, dtype=torch.float64)
    s[2] = NEG_INF  # head 2 has no sink
    s.requires_grad_()
    torch.autograd.gradcheck(add_sinks, (out, lse, s))
    # The closed form of dsinks: sum_i p_i * (dlse'_i - rowsum(out' * dout')_i).
    new_out, new_lse = add_sinks(out, lse, s)
    d_out, d_lse = torch.randn_like(new_out), torch.randn_like(new_lse)
    (d_s,) = torch.autograd.grad((new_out * d_out).sum() + (new_lse * d_lse).sum(), s, retain_graph=True)
    p = torch.exp(s.view(3, 1) - new_lse)
    expected = (p * (d_lse - (new_out * d_out).sum(-1))).sum(dim=(0, 2))
    torch.testing.assert_close(d_s, expected)
    assert d_s[2] == 0  # no sink, no gradient
    assert _AddSinks.backward is not torch.autograd.Function.backward  # written out, not autograd's


def test_split_kv_adds_the_sink_once_after_the_merge():
    q, k, v, sinks = _inputs()
    full, full_lse = scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    for cut in (0, 4, S):  # 0 and S: one split is empty
        a = scaled_dot_product_attention(q, k[..., :cut, :], v[..., :cut, :], return_lse=True)
        b = scaled_dot_product_attention(q, k[..., cut:, :], v[..., cut:, :], return_lse=True)
        out, lse = add_sinks(*merge_attention(*a, *b), sinks)
        torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-10)
    # The trap: a sink in each part is counted twice.
    a = scaled_dot_product_attention(q, k[..., :4, :], v[..., :4, :], sinks=sinks, return_lse=True)
    b = scaled_dot_product_attention(q, k[..., 4:, :], v[..., 4:, :], sinks=sinks, return_lse=True)
    twice, twice_lse = merge_attention(*a, *b)
    assert (twice - full).abs().max() > 1e-2
    torch.testing.assert_close(twice_lse, torch.logaddexp(full_lse, sinks.view(1, H, 1).expand_as(full_lse)))


def test_auto_picks_a_backend_that_takes_sinks_and_others_refuse():
    q, k, v, sinks = _inputs()
    n = CPU_TILED_MIN_LENGTH
    long = torch.randn(1, H, n, 1, dtype=torch.float64)
    band = torch.ones(n, n, dtype=torch.bool).tril()
    assert select_backend(q, k, v, sinks=sinks) == "math"  # sdpa would be picked without sinks
    assert select_backend(q, k, v) == "sdpa"
    assert select_backend(long, long, long, band) == "tiled"
    assert select_backend(long, long, long, band, sinks=sinks) == "tiled"
    assert select_backend(long, long, long, sinks=sinks) == "math"  # sdpa without sinks
    with pytest.raises(ValueError, match=r"backend='sdpa'.*sinks"):
        scaled_dot_product_attention(q, k, v, sinks=sinks, backend="sdpa")
    with pytest.raises(ValueError, match=r"backend='triton'.*sinks"):
        select_backend(q, k, v, sinks=sinks, backend="triton")


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (torch.zeros(H + 1, dtype=torch.float64), ValueError, r"sinks must have shape \(H,\) = \(4,\).*\(5,\)"),
        (torch.zeros(1, H, dtype=torch.float64), ValueError, r"sinks must have shape"),
        (torch.zeros(H, dtype=torch.int64), TypeError, "sinks must be floating point"),
        ([0.0] * H, TypeError, "sinks must be a torch.Tensor"),
        (torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=torch.float64), ValueError, "finite logits or -inf"),
        (torch.tensor([0.0, float("inf"), 0.0, 0.0], dtype=torch.float64), ValueError, "finite logits or -inf"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks, error, match):
    q, k, v, _ = _inputs()
    for call in (lambda: scaled_dot_product_attention(q, k, v, sinks=sinks),
                 lambda: scaled_dot_product_attention(q, k, v, sinks=sinks, backend="tiled"),
                 lambda: attention_weights(q, k, sinks=sinks),
                 lambda: add_sinks(torch.zeros(B, H, L, EV), torch.zeros(B, H, L), sinks)):
        with pytest.raises(error, match=match):
            call()
    with pytest.raises(ValueError, match=r"lse must have out's shape without its last dim"):
        add_sinks(torch.zeros(B, H, L, EV), torch.zeros(B, H, L + 1), torch.zeros(H))


# ---- one sink per query (Inkling 2: computed from each token's hidden state) --------------------------


def test_sinks_broadcast_to_the_rows():
    """(H, 1) and (1, H, 1) are one per head, as (H,); (1, 1, L) is one per query position, shared by heads."""
    q, k, v, per_head = _inputs()
    expected = scaled_dot_product_attention(q, k, v, sinks=per_head)
    for shape in ((H, 1), (1, H, 1)):
        for backend in ("math", "tiled"):
            torch.testing.assert_close(scaled_dot_product_attention(q, k, v, sinks=per_head.reshape(shape),
                                                                    backend=backend), expected)
    by_position = torch.randn(1, 1, L, dtype=torch.float64)
    ref = _oracle(q, k, v, by_position.expand(B, H, L))[0]
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, sinks=by_position, backend="tiled"), ref)


def test_add_sinks_kv_cache_and_varlen_take_one_sink_per_query():
    from attention_ref.kv_cache import attention_with_kv_cache
    from attention_ref.varlen import varlen_attention

    q, k, v, per_head = _inputs(heads=(H, HKV))
    sinks = _per_query(per_head)
    ref = _oracle(q, k, v, sinks)[0]
    out, lse = scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(add_sinks(out, lse, sinks)[0], ref)
    # a cache of S keys per sequence, all valid: the L new queries are its last L positions
    cached = attention_with_kv_cache(q, k, v, torch.full((B,), S, dtype=torch.int32), sinks=sinks)
    torch.testing.assert_close(cached, ref)
    # the batch packed: (H, B * L, E) queries, each sequence's sinks beside its queries
    packed = [t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1]) for t in (q, k, v)]  # (B, H, n, E) -> (H, B n, E)
    cu_q, cu_k = (torch.arange(0, B * n + 1, n, dtype=torch.int32) for n in (L, S))
    out = varlen_attention(*packed, cu_q, cu_k, sinks=sinks.transpose(0, 1).reshape(H, B * L))  # (B, H, L) -> (H, B L)
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(H, B * L, EV))


def test_one_sink_per_query_that_does_not_fit_the_rows_is_refused_by_name():
    q, k, v, _ = _inputs()
    for sinks, rows in ((torch.zeros(3, H, L, dtype=torch.float64), r"\(2, 4, 7\)"),
                        (torch.zeros(B, H, L + 1, dtype=torch.float64), r"\(2, 4, 7\)"),
                        (torch.zeros(1, B, H, L, dtype=torch.float64), r"\(2, 4, 7\)")):
        for call in (lambda: scaled_dot_product_attention(q, k, v, sinks=sinks),
                     lambda: scaled_dot_product_attention(q, k, v, sinks=sinks, backend="tiled"),
                     lambda: add_sinks(torch.zeros(B, H, L, EV, dtype=torch.float64),
                                       torch.zeros(B, H, L, dtype=torch.float64), sinks)):
            with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\), one logit per query "
                               r"head, or broadcast to the rows \(\.\.\., H, L\) = " + rows):
                call()
    bad = torch.zeros(B, H, L, dtype=torch.float64)
    bad[1, 2, 3] = math.nan
    with pytest.raises(ValueError, match=r"finite logits or -inf \(no sink for that query\)"):
        scaled_dot_product_attention(q, k, v, sinks=bad)
