"""A fuzz suite of our own (issue 39): hypothesis draws inputs over the public attention entry points,
and each call must either compute, finite wherever the reference is, the same on every backend, or
raise a ValueError / TypeError that names an argument. Never NaN from finite input, never another
exception type (ZeroDivisionError, a reshape error from deep inside).

The default tier draws 150 examples per test (about 3 s in all); ``ATTENTION_REF_SLOW_TESTS=1`` draws
2,000 (the slow tier, about 30 s). Beyond the core: top-k, varlen and the KV cache against their
definitions, one sink per query, merges and mods.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_ref import linear, merge_attention, mods, scaled_dot_product_attention
from attention_ref.kv_cache import attention_with_kv_cache
from attention_ref.sparse import topk_attention
from attention_ref.varlen import varlen_attention

SLOW = bool(os.environ.get("ATTENTION_REF_SLOW_TESTS"))
FUZZ = settings(max_examples=2000 if SLOW else 150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NAMED = re.compile(r"\b(query|key|value|attn_mask|is_causal|scale|enable_gqa|sinks|mask_mod|score_mod|"
                   r"dropout_p|backend|block_mask|return_weights|return_lse|q|k|v|g|beta|indices)\b")


def _named_error(error: Exception) -> bool:
    return isinstance(error, (ValueError, TypeError)) and bool(NAMED.search(str(error)))


@st.composite
def attention_inputs(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    B, H = draw(st.integers(0, 2)), draw(st.integers(1, 3))
    L, S, E, Ev = (draw(st.integers(0, 9)) for _ in range(4))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale_q = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype) * scale_q
    k = torch.randn(B, H, S, E, generator=g, dtype=dtype)
    v = torch.randn(B, H, S, Ev, generator=g, dtype=dtype)
    kind = draw(st.sampled_from(["none", "bool", "float", "finfo-min", "-inf"]))
    mask = None
    if kind != "none":
        keep = torch.rand(L, S, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
        if kind == "bool":
            mask = keep
        else:
            low = {"float": -1e4, "finfo-min": torch.finfo(dtype).min, "-inf": float("-inf")}[kind]
            mask = torch.where(keep, torch.zeros((), dtype=dtype), torch.full((), low, dtype=dtype))
    kwargs = {"attn_mask": mask, "is_causal": draw(st.booleans()) and mask is None}
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.sampled_from([0.5, 2.0, 1e-6, 1e6]))
    if draw(st.booleans()):  # one sink per head, or one per query (Inkling 2)
        shape = draw(st.sampled_from([(H,), (B, H, L)]))
        kwargs["sinks"] = torch.randn(shape, generator=g, dtype=dtype) * draw(st.sampled_from([0.0, 1.0, 10.0]))
    if draw(st.booleans()) and not kwargs["is_causal"]:
        kwargs["mask_mod"] = mods.sliding_window(draw(st.integers(0, 4)), sink_tokens=draw(st.integers(0, 2)))
    return q, k, v, kwargs


@FUZZ
@given(attention_inputs())
def test_backends_compute_the_same_or_name_the_argument(inputs):
    q, k, v, kwargs = inputs
    results = {}
    for backend in ("math", "tiled", "sdpa"):
        try:
            results[backend] = scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
        except Exception as error:  # noqa: BLE001 - the point is which errors come out
            assert _named_error(error), f"{backend}: {type(error).__name__}: {error}"
            results[backend] = error
    kinds = {b: type(r) for b, r in results.items()}
    reference = results["math"]
    if isinstance(reference, Exception):
        return  # refused by the reference: the others may compute or refuse
    assert torch.isfinite(reference).all(), "NaN or inf from finite input on the math path"
    # Backends add a large finite mask value to the scores in their own units and order: the sum keeps
    # about u * |mask| of each score, so their weights may differ by that much (a mask of -1e4 in
    # float32: 1e-3). finfo.min and -inf are exact conventions, equal on every backend.
    mask = kwargs["attn_mask"]
    big = 0.0
    if mask is not None and mask.is_floating_point():
        finite = mask[torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min)]
        big = float(finite.abs().max()) if finite.numel() else 0.0
    tol = 1e-4 + 8 * torch.finfo(q.dtype).eps * big * float(v.abs().max()) if v.numel() else 1e-4
    for backend, result in results.items():
        if isinstance(result, Exception):
            continue  # a backend may refuse what it does not take (it named why)
        torch.testing.assert_close(result, reference, rtol=tol, atol=tol, msg=f"{backend} vs math ({kinds})")


@FUZZ
@given(st.integers(0, 2), st.integers(0, 12), st.integers(1, 2), st.integers(1, 5),
       st.sampled_from([0.0, -0.1, -5.0, -1e38, float("-inf")]), st.integers(0, 2**16))
def test_delta_rule_forms_agree_on_any_gate(B, L, H, E, low, seed):
    g0 = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, E, generator=g0, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(B, L, H, generator=g0, dtype=torch.float64)
    if B and L:
        gate[0, L // 2] = low
    beta = torch.rand(B, L, H, generator=g0, dtype=torch.float64)
    a, sa = linear.gated_delta_rule(q, k, v, gate, beta, mode="recurrent", output_final_state=True)
    b, sb = linear.gated_delta_rule(q, k, v, gate, beta, mode="chunked", chunk_size=4, output_final_state=True)
    assert torch.isfinite(b).all() and torch.isfinite(sb).all()
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sb, sa, rtol=1e-9, atol=1e-9)


@FUZZ
@given(st.floats(-1e30, 1e30), st.floats(-50, 50), st.integers(0, 2**16))
def test_merges_are_stable_for_any_finite_lse(big, gap, seed):
    g = torch.Generator().manual_seed(seed)
    out_a, out_b = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    lse_a = torch.full((3,), big)
    lse_b = lse_a + gap
    out, _ = merge_attention(out_a, lse_a, out_b, lse_b)
    w_a = 1 / (1 + torch.tensor(float(lse_b[0].double() - lse_a[0].double())).double().exp())
    expected = w_a * out_a.double() + (1 - w_a) * out_b.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@FUZZ
@given(st.integers(-(2**64), 2**64), st.sampled_from(["causal", "chunked", "window", "prefix"]))
def test_mods_compute_or_name_any_int(value, which):
    make = {"causal": lambda x: mods.causal(offset=x), "chunked": lambda x: mods.chunked(x),
            "window": lambda x: mods.sliding_window(x), "prefix": lambda x: mods.prefix_lm(3, offset=x)}[which]
    try:
        mod = make(value)
    except (ValueError, TypeError) as error:
        assert re.search(r"\b(offset|size|left)\b", str(error)), error
        return
    mask = mods.create_mask(mod, None, None, 5, 7)[0, 0]
    q_idx, kv_idx = torch.arange(5)[:, None], torch.arange(7)
    expected = {"causal": kv_idx <= q_idx + value,
                "chunked": (q_idx // value) == (kv_idx // value) if value > 0 else None,
                "window": (kv_idx <= q_idx) & (kv_idx >= q_idx - value),
                "prefix": (kv_idx < 3) | (kv_idx <= q_idx + value)}[which]
    assert torch.equal(mask, expected)


@FUZZ
@given(st.integers(1, 3), st.integers(0, 6), st.integers(0, 8), st.integers(1, 4), st.booleans(), st.integers(0, 2**16))
def test_topk_is_dense_attention_over_the_listed_keys_or_a_named_error(H, L, S, k, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, 4, generator=g, dtype=torch.float64)
    key, value = (torch.randn(2, H, S, 4, generator=g, dtype=torch.float64) for _ in range(2))
    indices = torch.randint(-1, max(S, 1), (2, 1, L, k), generator=g)  # -1 = no key; repeats possible
    try:
        out = topk_attention(q, key, value, indices, is_causal=causal)
    except (ValueError, TypeError) as error:
        assert "indices" in str(error) and ("more than once" in str(error) or S == 0), error
        return
    keep = torch.zeros(2, 1, L, S + 1, dtype=torch.bool)
    keep.scatter_(-1, torch.where(indices < 0, S, indices), True)  # the listed keys, by hand
    mask = keep[..., :S] & (torch.ones(L, S, dtype=torch.bool).tril() if causal else True)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, key, value, mask), rtol=1e-12, atol=1e-12)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4), st.booleans(),
       st.sampled_from(["math", "tiled"]), st.booleans(), st.integers(0, 2**16))
def test_varlen_is_each_sequence_alone(lengths, causal, backend, per_query_sinks, seed):
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(n for n, _ in lengths), sum(m for _, m in lengths)
    q = torch.randn(2, total_q, 4, generator=g, dtype=torch.float64)  # (H, total_q, E)
    k, v = (torch.randn(1, total_k, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn((2, total_q) if per_query_sinks else (2,), generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0] + [sum(n for n, _ in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(m for _, m in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    try:
        out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal, backend=backend, sinks=sinks)
    except (ValueError, TypeError) as error:
        assert causal and any(n > m for n, m in lengths) or "cu_seqlens" in str(error), error
        return
    for s in range(len(lengths)):
        rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        n, m = rows.stop - rows.start, keys.stop - keys.start
        causal_mod = mods.causal(offset=m - n) if causal else None
        alone = scaled_dot_product_attention(q[:, rows], k[:, keys], v[:, keys], enable_gqa=True, mask_mod=causal_mod,
                                             sinks=sinks[:, rows] if per_query_sinks else sinks)
        torch.testing.assert_close(out[:, rows], alone, rtol=1e-10, atol=1e-10)


@FUZZ
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_kv_cache_is_each_sequence_alone(B, Lq, block_size, paged, causal, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(Lq, Lq + 7, (B,), generator=g, dtype=torch.int32)  # each holds its Lq new tokens
    S_max = int(lengths.max())
    q = torch.randn(B, 4, Lq, 4, generator=g, dtype=torch.float64)  # H = 4 over Hkv = 2
    keys, values = (torch.randn(B, 2, S_max, 4, generator=g, dtype=torch.float64) for _ in range(2))
    options = {"is_causal": causal}
    if paged:  # the same keys in a shuffled pool of blocks
        n = -(-S_max // block_size)
        pool_k = keys.new_zeros(B * n, 2, block_size, 4)
        pool_v = torch.zeros_like(pool_k)
        order = torch.randperm(B * n, generator=g)
        table = order.reshape(B, n).to(torch.int32)
        padded_k = torch.nn.functional.pad(keys, (0, 0, 0, n * block_size - S_max))
        padded_v = torch.nn.functional.pad(values, (0, 0, 0, n * block_size - S_max))
        for b in range(B):
            for j in range(n):
                pool_k[table[b, j]] = padded_k[b, :, j * block_size:(j + 1) * block_size]
                pool_v[table[b, j]] = padded_v[b, :, j * block_size:(j + 1) * block_size]
        out = attention_with_kv_cache(q, pool_k, pool_v, lengths, block_table=table, **options)
    else:
        out = attention_with_kv_cache(q, keys, values, lengths, **options)
    for b in range(B):
        m = int(lengths[b])
        causal_mod = mods.causal(offset=m - Lq) if causal else None
        alone = scaled_dot_product_attention(q[b], keys[b, :, :m], values[b, :, :m], enable_gqa=True,
                                             mask_mod=causal_mod)
        torch.testing.assert_close(out[b], alone, rtol=1e-10, atol=1e-10)
