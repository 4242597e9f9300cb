"""A fuzz suite of our own (issue 39): hypothesis draws inputs over the public attention entry points,
and each call must either compute, finite wherever the reference is, the same on every backend, or
raise a ValueError / TypeError that names an argument. Never NaN from finite input, never another
exception type (ZeroDivisionError, a reshape error from deep inside).

The default tier draws a few dozen examples per test; ``ATTENTION_REF_SLOW_TESTS=1`` draws 20 times
as many (the slow tier).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_ref import linear, merge_attention, mods, scaled_dot_product_attention

SLOW = bool(os.environ.get("ATTENTION_REF_SLOW_TESTS"))
FUZZ = settings(max_examples=600 if SLOW else 30, deadline=None,
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
    if draw(st.booleans()):
        kwargs["sinks"] = torch.randn(H, generator=g, dtype=dtype) * draw(st.sampled_from([0.0, 1.0, 10.0]))
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
