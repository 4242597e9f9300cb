"""Tests of the backend dispatcher (attention_ref.backends).

- Every backend that runs here (math, tiled, sdpa, and auto) agrees with the float64
  reference on random shapes (L != S, odd sizes, broadcast batch dims, bool/float
  masks, key padding, causal, causal + mask, GQA, fully masked rows), in its output
  and its gradients, with a tolerance per dtype.
- The translation to ``torch.nn.functional.scaled_dot_product_attention`` is checked
  on the arguments torch actually receives.
- The ``"auto"`` rule's choices, on CPU tensors and on fake CUDA tensors.
- Every refusal raises ``ValueError`` naming the backend and the reason.
- The routing to the Triton kernel under Triton's interpreter (tiny shapes), when
  triton is installed, and compiled on the GPU under ``--device cuda``; the kernel
  itself is tested in tests/test_triton_flash.py.

Tests that take the ``device`` fixture run on ``--device cuda`` too (tests/conftest.py);
the inputs are drawn on the CPU and moved, so both devices see the same numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from attention_ref import _inputs
from attention_ref import MultiHeadAttention, backends, mods, scaled_dot_product_attention
from attention_ref.backends import CPU_TILED_MIN_LENGTH, select_backend

RUNNABLE = ("math", "tiled", "sdpa", "auto")

# (atol, rtol) against the float64 reference, per input dtype; gradients get 4x.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _random_case(seed: int) -> dict:
    """A random call: shapes with odd sizes, L != S mostly, and one mask kind."""
    rng = random.Random(seed)
    L, S = rng.choice([1, 3, 7, 13, 16]), rng.choice([1, 5, 11, 13, 17])
    E, Ev = rng.choice([2, 5, 8]), rng.choice([3, 4, 7])
    gqa = rng.random() < 0.3
    H, Hkv = (6, rng.choice([1, 2, 3])) if gqa else (rng.choice([1, 3]), None)
    lead_q = rng.choice([(), (2,), (2, H)]) if not gqa else (2, H)
    lead_kv = lead_q if not gqa else (2, Hkv)
    if not gqa and lead_q and rng.random() < 0.3:
        lead_kv = (1,) * len(lead_q)  # broadcast key/value over the batch
    batch = tuple(torch.broadcast_shapes(lead_q, lead_kv if not gqa else (2, H)))
    gen = torch.Generator().manual_seed(seed)
    kind = rng.choice(["none", "bool", "bool-empty-rows", "key-padding", "float", "float-inf-rows"])
    mask = None
    if kind.startswith("bool"):
        mask = torch.rand(*batch[-1:], L, S, generator=gen) > 0.35
        if kind == "bool-empty-rows":
            mask[..., rng.randrange(L), :] = False
    elif kind == "key-padding":
        mask = torch.rand(*batch[:1], *([1] * max(len(batch) - 1, 0)), 1, S, generator=gen) > 0.3
    elif kind.startswith("float"):
        mask = torch.randn(L, S, generator=gen)
        if kind == "float-inf-rows":
            mask[rng.randrange(L)] = float("-inf")
    return dict(
        shapes=((*lead_q, L, E), (*lead_kv, S, E), (*lead_kv, S, Ev)),
        mask=mask,
        is_causal=rng.random() < 0.5,
        enable_gqa=gqa,
        scale=rng.choice([None, 0.37]),
        desc=f"lead={lead_q}/{lead_kv} L={L} S={S} E={E} Ev={Ev} mask={kind}",
    )


SEEDS = list(range(16))


def _run_and_grad(backend, case, dtype, seed, device):
    gen = torch.Generator().manual_seed(100 + seed)
    base = [torch.randn(*s, generator=gen, dtype=torch.float64).to(device) for s in case["shapes"]]
    kw = dict(is_causal=case["is_causal"], enable_gqa=case["enable_gqa"], scale=case["scale"])
    mask = case["mask"] if case["mask"] is None else case["mask"].to(device)
    leaves = [t.to(dtype).requires_grad_() for t in base]
    cast_mask = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    out = scaled_dot_product_attention(*leaves, cast_mask, backend=backend, **kw)
    assert out.device == device
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, leaves, g.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_mask = cast_mask.double() if cast_mask is not None and cast_mask.is_floating_point() else cast_mask
    ref = scaled_dot_product_attention(*ref_leaves, ref_mask, backend="math", **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g)
    return out, grads, ref, ref_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_every_backend_matches_float64_reference(backend, seed, dtype, device):
    case = _random_case(seed)
    out, grads, ref, ref_grads = _run_and_grad(backend, case, dtype, seed, device)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape, case["desc"]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{case['desc']}: {m}")
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(
            got.double(), want, atol=4 * atol, rtol=4 * rtol, msg=lambda m, n=name: f"{case['desc']} d{n}: {m}"
        )


def test_random_cases_cover_the_features():
    cases = [_random_case(s) for s in SEEDS]
    descs = " ".join(c["desc"] for c in cases)
    for kind in ("none", "bool", "bool-empty-rows", "key-padding", "float", "float-inf-rows"):
        assert f"mask={kind} " in descs + " ", kind
    assert any(c["enable_gqa"] for c in cases) and any(c["is_causal"] and c["mask"] is not None for c in cases)
    assert any(c["shapes"][0][-2] != c["shapes"][1][-2] for c in cases)


@pytest.mark.parametrize("backend", RUNNABLE)
def test_fully_masked_rows_give_zero_and_finite_grads(backend, device):
    q, k, v = (torch.randn(2, 3, n, 5, device=device, requires_grad=True) for n in (7, 13, 13))
    mask = torch.rand(2, 1, 7, 13, device=device) > 0.3
    mask[:, :, [0, 4]] = False
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=True, backend=backend)
    zeros = torch.zeros(2, 3, 2, 5, device=device)
    assert torch.equal(out[:, :, [0, 4]], zeros)
    out.sum().backward()
    assert torch.equal(q.grad[:, :, [0, 4]], zeros)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# --- the translation to torch's SDPA ---------------------------------------------------------


@pytest.fixture
def torch_sdpa_calls(monkeypatch):
    """Record the arguments each call to torch's scaled_dot_product_attention receives."""
    calls = []
    original = F.scaled_dot_product_attention

    def recorder(q, k, v, **kwargs):
        calls.append(dict(q=q, k=k, v=v, **kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    return calls


def test_sdpa_gets_4d_inputs_and_one_combined_mask(torch_sdpa_calls, device):
    q, k, v = (torch.randn(3, n, e, device=device) for n, e in ((7, 8), (13, 8), (13, 5)))
    mask = torch.rand(3, 7, 13, device=device) > 0.3
    mask[..., 0] = True  # no empty row: off the CPU, _sdpa unmasks those before torch's call
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=True, scale=0.3, backend="sdpa")
    (call,) = torch_sdpa_calls
    assert call["q"].shape == (1, 3, 7, 8) and call["k"].shape == (1, 3, 13, 8)
    # torch refuses attn_mask with is_causal=True: the causal mask is folded into attn_mask,
    # with the same polarity (True = takes part).
    assert call["is_causal"] is False and call["scale"] == 0.3
    expected = torch.ones(7, 13, dtype=torch.bool, device=device).tril() & mask
    assert torch.equal(call["attn_mask"].expand(1, 3, 7, 13)[0], expected)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, mask, is_causal=True, scale=0.3))


def test_sdpa_keeps_a_key_padding_mask_small(torch_sdpa_calls, device):
    q, k = torch.randn(2, 4, 7, 8, device=device), torch.randn(2, 4, 13, 8, device=device)
    mask = torch.rand(2, 1, 1, 13, device=device) > 0.3
    scaled_dot_product_attention(q, k, k, mask, backend="sdpa")
    assert torch_sdpa_calls[0]["attn_mask"].shape == (2, 1, 1, 13)  # no (L, S) copy


def test_sdpa_float_mask_with_causal_adds_minus_inf(torch_sdpa_calls, device):
    q, k, v = (torch.randn(1, 2, n, 4, device=device) for n in (5, 7, 7))
    bias = torch.randn(5, 7, device=device)
    scaled_dot_product_attention(q, k, v, bias, is_causal=True, backend="sdpa")
    got = torch_sdpa_calls[0]["attn_mask"].reshape(5, 7)
    expected = bias.masked_fill(~torch.ones(5, 7, dtype=torch.bool, device=device).tril(), float("-inf"))
    assert torch.equal(got, expected)


def test_sdpa_passes_grouped_heads_without_copying(torch_sdpa_calls, device):
    q, k, v = (torch.randn(2, h, n, 8, device=device) for h, n in ((6, 7), (2, 13), (2, 13)))
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="sdpa")
    call = torch_sdpa_calls[0]
    assert call["enable_gqa"] is True and call["k"].shape == (2, 2, 13, 8)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5, rtol=1e-5)


@pytest.mark.cpu_only("torch's choice of CPU kernel")
@pytest.mark.skipif(not hasattr(torch, "_fused_sdp_choice"), reason="torch._fused_sdp_choice not available")
def test_sdpa_on_3d_cpu_inputs_reaches_torchs_flash_kernel(torch_sdpa_calls):
    # Why the backend makes inputs 4-D: given 3-D inputs, torch's CPU SDPA may take its math kernel (an
    # (L, S) matrix; torch 2.13 does) or flash (later releases may). Probed, not dated: whichever torch
    # picks for the 3-D inputs themselves, the inputs ours hands over reach flash.
    q = torch.randn(3, 64, 16)
    untranslated = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(q, q, q)).name
    scaled_dot_product_attention(q, q, q, backend="sdpa")
    call = torch_sdpa_calls[0]
    ours = torch.nn.attention.SDPBackend(
        torch._fused_sdp_choice(call["q"], call["k"], call["v"], attn_mask=call["attn_mask"])).name
    assert call["q"].dim() == 4 and ours == "FLASH_ATTENTION", (
        f"torch {torch.__version__} picks {ours} for the inputs backend='sdpa' hands over "
        f"{tuple(call['q'].shape)}, and {untranslated} for the 3-D inputs {tuple(q.shape)} themselves")


def test_sdpa_fully_masked_fix_up_path(device):
    # The fix-up used off-CPU (unmask empty rows, zero them after) gives the reference, on CPU too.
    q, k, v = (torch.randn(2, 3, n, 5, dtype=torch.float64, device=device, requires_grad=True) for n in (7, 13, 13))
    for mask in (torch.rand(2, 1, 7, 13, device=device) > 0.3, torch.randn(2, 1, 7, 13, dtype=torch.float64, device=device)):
        if mask.dtype == torch.bool:
            mask[:, :, 3] = False
        else:
            mask[:, :, 3] = float("-inf")
        out = backends._sdpa(q, k, v, mask, is_causal=True, scale=0.4, dropout_p=0.0, enable_gqa=False,
                             fix_fully_masked=True)
        ref = scaled_dot_product_attention(q, k, v, mask, is_causal=True, scale=0.4)
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(out)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
            torch.testing.assert_close(got, want)


def test_sdpa_dropout_is_torchs_own(device):
    q, k, v = (torch.randn(2, 3, n, 8, device=device) for n in (7, 13, 13))
    torch.manual_seed(0)
    ours = scaled_dot_product_attention(q, k, v, dropout_p=0.4, backend="sdpa")
    torch.manual_seed(0)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.testing.assert_close(ours, theirs)


# --- validation once, errors ------------------------------------------------------------------


def test_arguments_are_validated_once(monkeypatch, device):
    calls = []
    original = _inputs.prepare

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(_inputs, "prepare", counting)
    q = torch.randn(2, 7, 8, device=device)
    for backend in RUNNABLE:
        calls.clear()
        scaled_dot_product_attention(q, q, q, backend=backend)
        assert len(calls) == 1, backend


@pytest.mark.parametrize("backend", RUNNABLE)
def test_shape_errors_are_the_cores_for_every_backend(backend):
    with pytest.raises(ValueError, match=r"query and key must have the same last dim E"):
        scaled_dot_product_attention(torch.randn(7, 5), torch.randn(13, 4), torch.randn(13, 4), backend=backend)


def test_unknown_backend():
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"backend must be one of \('math', 'tiled', 'sdpa', 'triton', 'auto'\), got 'flash'"):
        scaled_dot_product_attention(q, q, q, backend="flash")
    with pytest.raises(TypeError, match=r"backend must be a str, one of .*, got NoneType"):
        scaled_dot_product_attention(q, q, q, backend=None)


@pytest.mark.parametrize("backend", ["tiled", "sdpa", "triton"])
def test_weights_only_from_math(backend):
    q = torch.randn(3, 4)
    match = rf"backend='{backend}' cannot run this call: it never forms the \(L, S\) attention weights; use backend='math'"
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, q, q, return_weights=True, backend=backend)


@pytest.mark.parametrize(
    ("backend", "match"),
    [
        ("tiled", r"backend='tiled' cannot run this call: dropout is not implemented in the tiled path \(dropout_p=0.1\)"),
        ("triton", r"backend='triton' cannot run this call: the Triton kernel has no dropout \(dropout_p=0.1\)"),
    ],
)
def test_dropout_refused(backend, match):
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1, backend=backend)


def test_triton_needs_a_device_it_runs_on(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 7, 16)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: the Triton kernel needs the triton package and CUDA tensors .* got tensors on cpu"):
        scaled_dot_product_attention(q, q, q, backend="triton")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda q: dict(attn_mask=torch.zeros(7, 7)), r"takes only boolean key-padding masks, got a float attn_mask"),
        (lambda q: dict(attn_mask=torch.ones(7, 7, dtype=torch.bool)), r"takes only key-padding masks, .* got attn_mask of shape \(7, 7\)"),
        (lambda q: dict(value=torch.randn(1, 2, 7, 32)), r"needs the same head size for query/key and value, got E=16, Ev=32"),
        (lambda q: dict(query=q.double(), key=q.double(), value=q.double()), r"supports float16, bfloat16 and float32, got torch.float64"),
        (lambda q: dict(query=q[..., :8], key=q[..., :8], value=q[..., :8]), r"supports head sizes 16..128, got E=8"),
    ],
    ids=["float mask", "(L, S) mask", "E != Ev", "float64", "E=8"],
)
def test_triton_refusals_name_the_reason(monkeypatch, make, match):
    monkeypatch.setattr(backends, "_triton_available", lambda device: True)
    q = torch.randn(1, 2, 7, 16)
    args = dict(query=q, key=q, value=q)
    args.update(make(q))
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: the Triton kernel " + match):
        scaled_dot_product_attention(**args, backend="triton")


# --- the auto rule ---------------------------------------------------------------------------


def test_auto_rule_on_cpu():
    n = CPU_TILED_MIN_LENGTH
    short = torch.randn(1, 2, 64, 8)
    long_q = torch.randn(1, 1, n, 1)
    dense = torch.ones(n, 1, dtype=torch.bool)  # (L, 1): may vary over queries, unlike key padding
    pad = torch.ones(1, 1, 1, n, dtype=torch.bool)
    assert select_backend(short, short, short) == "sdpa"
    assert select_backend(short, short, short, return_weights=True) == "math"
    assert select_backend(long_q, long_q, long_q) == "sdpa"  # no mask: torch's CPU kernel is lean
    assert select_backend(long_q, long_q, long_q, pad) == "sdpa"  # key padding: no (L, S) copy either
    assert select_backend(long_q, long_q, long_q, dense) == "tiled"
    assert select_backend(long_q, long_q, long_q, dense.float()) == "tiled"
    assert select_backend(long_q, long_q, long_q, dense, return_weights=True) == "math"
    assert select_backend(long_q, long_q, long_q, dense, dropout_p=0.1) == "sdpa"  # tiled has no dropout
    below = torch.randn(1, 1, n - 1, 1)
    assert select_backend(below, below, below, dense[1:]) == "sdpa"
    one = torch.randn(1, 1, 2, 1)
    assert select_backend(one, long_q, long_q, dense[:2]) == "tiled"  # max(L, S) counts
    assert select_backend(long_q, long_q, long_q, dense, backend="sdpa") == "sdpa"  # explicit names are kept


def test_auto_rule_on_other_devices():
    meta = torch.empty(1, 2, CPU_TILED_MIN_LENGTH, 8, device="meta")
    dense = torch.ones(CPU_TILED_MIN_LENGTH, CPU_TILED_MIN_LENGTH, dtype=torch.bool, device="meta")
    assert select_backend(meta, meta, meta, dense) == "sdpa"  # rule 5 is for CPU tensors only


def test_auto_with_weights_returns_the_maths_weights():
    q, k, v = torch.randn(2, 7, 5), torch.randn(2, 13, 5), torch.randn(2, 13, 3)
    out, w = scaled_dot_product_attention(q, k, v, backend="auto", return_weights=True)
    ref_out, ref_w = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert torch.equal(out, ref_out) and torch.equal(w, ref_w)


def test_auto_rule_on_cuda(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
        pad = torch.ones(2, 1, 1, 256, device="cuda", dtype=torch.bool)
        dense = torch.ones(256, 256, device="cuda", dtype=torch.bool)
        monkeypatch.setattr(backends, "_triton_available", lambda device: True)
        monkeypatch.setattr(backends, "TRITON_VERIFIED_ON_GPU", False)
        assert select_backend(q, q, q) == "sdpa"  # not verified on a GPU: auto keeps to torch's kernels
        monkeypatch.setattr(backends, "TRITON_VERIFIED_ON_GPU", True)
        monkeypatch.setattr(backends, "_triton_available", lambda device: False)
        assert select_backend(q, q, q) == "sdpa"  # no kernel: torch's
        monkeypatch.setattr(backends, "_triton_available", lambda device: True)
        # Plain calls stay with torch's kernels (cuDNN's is faster on Hopper); mods go to it.
        assert select_backend(q, q, q) == "sdpa"
        assert select_backend(q, q, q, pad, is_causal=True) == "sdpa"
        assert select_backend(q, q, q, mask_mod=mods.sliding_window(8)) == "triton"
        assert select_backend(q, q, q, pad, mask_mod=mods.sliding_window(8)) == "triton"
        assert select_backend(q, q, q, score_mod=mods.softcap(9.0), is_causal=True) == "triton"
        # The mods the kernel implements go to it; others to torch's kernels (a mask_mod
        # materialised) or the reference (a score_mod).
        assert select_backend(q, q, q, mask_mod=mods.sliding_window(8), score_mod=mods.softcap(9.0)) == "triton"
        assert select_backend(q, q, q, mask_mod=mods.chunked(8)) == "sdpa"
        assert select_backend(q, q, q, score_mod=mods.alibi(8)) == "math"
        assert select_backend(q, q, q, return_weights=True) == "math"
        assert select_backend(q, q, q, dense) == "sdpa"  # not a key-padding mask
        assert select_backend(q, q, q, pad.to(q.dtype)) == "sdpa"  # float mask
        assert select_backend(q, q, q, dropout_p=0.1) == "sdpa"
        big = torch.empty(2, 8, 256, 256, device="cuda", dtype=torch.bfloat16)
        assert select_backend(big, big, big) == "sdpa"  # head size outside 16..128
        n = CPU_TILED_MIN_LENGTH
        long_q = torch.empty(1, 1, n, 64, device="cuda", dtype=torch.float16)
        dense = torch.ones(n, n, device="cuda", dtype=torch.bool)
        assert select_backend(long_q, long_q, long_q) == "sdpa"
        assert select_backend(long_q, long_q, long_q, dense) == "sdpa"  # never tiled on CUDA


# --- MultiHeadAttention ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tiled", "sdpa", "auto"])
def test_multihead_backend(backend, device):
    torch.manual_seed(0)
    ref = MultiHeadAttention(16, 4, num_kv_heads=2).to(device)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).to(device)
    mha.load_state_dict(ref.state_dict())
    x, mem = torch.randn(2, 7, 16, device=device), torch.randn(2, 13, 16, device=device)
    pad = torch.rand(2, 1, 1, 13, device=device) > 0.2
    torch.testing.assert_close(mha(x, mem, attn_mask=pad), ref(x, mem, attn_mask=pad), atol=1e-5, rtol=1e-5)
    assert f"backend={backend!r}" in repr(mha)


def test_multihead_backend_errors():
    with pytest.raises(ValueError, match=r"backend must be one of"):
        MultiHeadAttention(16, 4, backend="fast")
    mha = MultiHeadAttention(16, 4, backend="tiled")
    with pytest.raises(ValueError, match=r"backend='tiled' cannot run this call: it never forms"):
        mha(torch.randn(2, 7, 16), return_weights=True)
    mha.backend = "auto"
    out, w = mha(torch.randn(2, 7, 16), return_weights=True)  # auto picks math for weights
    assert w.shape == (2, 7, 7)


# --- routing to the Triton kernel (interpreter or GPU, tiny shapes) -----------------------------
# Triton's interpreter must be on before the kernels are defined, and switching it on in the
# pytest process would leak into other modules (see tests/test_triton_flash.py). So the routing
# cases run once in a child process (this file, run as a script), which prints the largest error
# of each case as JSON: on CPU tensors with TRITON_INTERPRET=1, or, under --device cuda, compiled
# on the GPU with the variable removed.

ROUTING_CASES = {
    "3-D causal": (((2, 7, 16), (2, 13, 16), (2, 13, 16)), None, dict(is_causal=True)),
    "gqa + key padding (B, 1, 1, S)": (((1, 4, 7, 16), (1, 2, 13, 16), (1, 2, 13, 16)), (1, 1, 1, 13), dict(enable_gqa=True)),
    "per-head padding + empty rows": (((2, 2, 5, 16), (2, 2, 11, 16), (2, 2, 11, 16)), (2, 2, 1, 11), dict(is_causal=True, scale=0.3)),
    # The mods the kernel implements, passed as mods and recognised by mods.describe:
    "sliding window, bottom-right, softcap": (((2, 3, 7, 16), (2, 3, 13, 16), (2, 3, 13, 16)), None,
                                              dict(mask_mod=mods.sliding_window(3, 1, offset=6),
                                                   score_mod=mods.softcap(0.8))),
    "gqa + causal mod + padding": (((1, 4, 9, 16), (1, 2, 9, 16), (1, 2, 9, 16)), (1, 1, 1, 9),
                                   dict(enable_gqa=True, mask_mod=mods.causal(2))),
    # grouped heads read in place (the mask is the same for every head) ...
    "gqa in place, batch padding (B, 1, 1, S)": (((3, 6, 7, 16), (3, 2, 13, 16), (3, 2, 13, 16)), (3, 1, 1, 13),
                                                 dict(enable_gqa=True, is_causal=True)),
    # ... or expanded, when the mask differs per head
    "gqa, per-head padding (B, H, 1, S)": (((2, 4, 7, 16), (2, 2, 13, 16), (2, 2, 13, 16)), (2, 4, 1, 13),
                                           dict(enable_gqa=True)),
}


def _routing_worker(device: str) -> dict:
    """Each routing case through backend="triton" vs the float64 reference: max errors."""
    results = {}
    for name, (shapes, mask_shape, kw) in ROUTING_CASES.items():
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(*s, generator=gen).to(device).requires_grad_() for s in shapes)
        mask = None
        if mask_shape is not None:
            mask = torch.rand(*mask_shape, generator=gen) > 0.3
            if "empty" in name:
                mask[1, 0] = False  # one (batch, head) with every key padded: its rows give 0
            mask = mask.to(device)
        expanded = []  # key/value heads repeated for the kernel (grouped heads not read in place)
        original = _inputs.expand_kv_heads
        _inputs.expand_kv_heads = lambda *a, **k: expanded.append(a[2]) or original(*a, **k)
        try:
            out = scaled_dot_product_attention(q, k, v, mask, backend="triton", **kw)
        finally:
            _inputs.expand_kv_heads = original
        assert out.device == q.device
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = scaled_dot_product_attention(*leaves, mask, **kw)
        g = torch.randn(out.shape, generator=gen).to(device)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, leaves, g.double())
        results[name] = {
            "out": (out.double() - ref).abs().max().item(),
            "grad": max((a.double() - b).abs().max().item() for a, b in zip(got, want)),
            "empty_rows_zero": bool(torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))) if "empty" in name else True,
            "expanded": expanded,
        }
    return results


@pytest.fixture(scope="module")
def routing_results(device) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    if device.type == "cuda":
        del env["TRITON_INTERPRET"]  # compiled for the GPU
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--triton-routing-worker", device.type],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"the routing worker failed (exit status {proc.returncode}):\n{proc.stderr[-4000:]}\n"
                    f"its output:\n{proc.stdout[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("attention_ref.triton_flash") is None,
    reason="triton (pip install triton) and attention_ref.triton_flash are needed",
)


@needs_triton
@pytest.mark.triton_kernel
@pytest.mark.parametrize("name", list(ROUTING_CASES))
def test_routing_to_triton_matches_reference(routing_results, name):
    result = routing_results[name]
    assert result["out"] < 1e-5 and result["grad"] < 2e-5, result
    assert result["empty_rows_zero"], result
    # grouped key/value heads are read in place unless the mask differs per head
    per_head = "per-head" in name and ROUTING_CASES[name][2].get("enable_gqa")
    assert result["expanded"] == (["key", "value"] if per_head else []), result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--triton-routing-worker"]:
        print(json.dumps(_routing_worker(sys.argv[2])), flush=True)
        # Skip the interpreter's shutdown: on an H200 (torch 2.11, triton 3.6) it aborted there once,
        # "terminate called without an active exception", after the results were complete.
        os._exit(0)
