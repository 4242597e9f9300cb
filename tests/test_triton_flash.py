"""Tests of attention_ref.triton_flash: the Triton kernel against the float64 reference.

How the kernel runs here. On a machine with CUDA the kernel runs compiled on the GPU. On
a CPU-only machine it runs under Triton's interpreter, which must be switched on with
``TRITON_INTERPRET=1`` before the kernels are *defined*. Setting that variable inside the
pytest process would leak into every other test module (and which module runs first would
decide which mode the kernels get), so the numerical checks run in ONE child process:
the ``results`` fixture starts this very file as a script (``--worker``) with the variable
set, the child computes every case and prints JSON, and each parametrized test below
asserts on its own case. The pytest process itself never runs a kernel, so the rest of the
session is unaffected, and the child pays the torch + triton import only once.

The checks: output and gradients (dq, dk, dv) against
``attention_ref.scaled_dot_product_attention`` evaluated in float64 on the same (rounded)
inputs, by the relative error ``||x - ref|| / ||ref||`` with a tolerance per dtype; rows
where no key takes part must be exactly 0 in the output and in dq. Shapes are small (the
interpreter runs each program as NumPy code) but chosen so that, with the interpreter's
16 x 16 tiles, they cover several query and key blocks, partial last blocks, L != S both
ways, a padded head size (D = 24), causal block skipping, and fully masked rows. bfloat16
runs only on CUDA: the interpreter mishandles it (../shared/TOOLCHAIN.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import traceback
import zlib
from dataclasses import asdict, dataclass

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
BF16_REASON = (
    "bfloat16 is checked on CUDA only: Triton's interpreter mishandles bfloat16 "
    "(see ../shared/TOOLCHAIN.md)"
)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")

# ||x - ref|| / ||ref|| allowed, per dtype: (output, gradients). float32 uses exact float32
# dot products (input_precision="ieee"); 16-bit inputs round P and dS to 16 bits before the
# second matrix product, as every FlashAttention kernel does.
TOLERANCE = {
    "float32": (1e-5, 1e-5),
    "float16": (3e-3, 1e-2),
    "bfloat16": (2e-2, 5e-2),
}


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    L: int
    S: int
    D: int
    dtype: str
    causal: bool
    mask: str = "none"  # "none", or "pad": random padding + fully masked rows (see make_inputs)
    scale: float | None = None
    layout: str = "bhld"  # "blhd": q, k, v are transposed views (non-contiguous)
    config: tuple[int, ...] | None = None  # a _Config other than the default table's
    max_grid: int | None = None  # split the (batch, head) grid into launches of this size
    gpu_only: bool = False  # too large for the interpreter

    @property
    def id(self) -> str:
        parts = [self.dtype, f"B{self.B}H{self.H}L{self.L}S{self.S}D{self.D}",
                 "causal" if self.causal else "full", self.mask]
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.layout != "bhld":
            parts.append(self.layout)
        if self.config is not None:
            parts.append("cfg" + "x".join(map(str, self.config[:2])))
        if self.max_grid is not None:
            parts.append(f"grid{self.max_grid}")
        return "-".join(parts)


CASES = [
    Case(2, 2, 16, 16, 16, "float32", False),
    Case(2, 2, 16, 16, 16, "float32", True, "pad", max_grid=1),  # one launch per (batch, head)
    Case(2, 1, 33, 7, 16, "float32", True, "pad"),  # L > S, causal, empty rows
    Case(1, 2, 7, 33, 32, "float32", True),  # L < S, causal: keys past L never seen
    Case(2, 1, 33, 33, 64, "float32", False, "pad", scale=0.3),
    Case(1, 1, 1, 16, 16, "float32", True, "pad"),  # L = 1
    Case(1, 1, 17, 1, 24, "float32", False),  # S = 1, D padded to 32
    Case(2, 1, 16, 33, 24, "float32", True, "pad", layout="blhd"),
    Case(1, 2, 33, 16, 32, "float16", True, "pad"),
    Case(2, 1, 16, 33, 16, "float16", False),
    Case(1, 1, 7, 7, 64, "float16", True),
    # Larger tiles with unequal block sizes, as the GPU table uses (block_m = 2 block_n,
    # block_n1 = 2 block_m1, block_m2 = 2 block_n2): the block-skipping arithmetic must not
    # depend on the interpreter's square 16 x 16 tiles.
    Case(1, 1, 40, 72, 16, "float32", True, "pad", config=(32, 16, 4, 1, 16, 32, 32, 16, 4, 1)),
    Case(1, 1, 72, 40, 16, "float32", False, "pad", config=(32, 16, 4, 1, 16, 32, 32, 16, 4, 1)),
    # bfloat16 and sizes the interpreter is too slow for: CUDA only.
    Case(2, 2, 33, 17, 32, "bfloat16", True, "pad"),
    Case(1, 2, 16, 33, 64, "bfloat16", False),
    Case(2, 4, 1000, 1000, 128, "bfloat16", True, "pad", gpu_only=True),
    Case(2, 4, 1000, 1000, 128, "float16", False, gpu_only=True),
    Case(1, 2, 257, 1031, 80, "float16", True, "pad", gpu_only=True),
    Case(1, 2, 1031, 257, 64, "float32", True, "pad", gpu_only=True),
]


def _marks(case: Case) -> list[pytest.MarkDecorator]:
    marks = [needs_triton]
    if case.dtype == "bfloat16":
        marks.append(pytest.mark.skipif(not CUDA, reason=BF16_REASON))
    elif case.gpu_only:
        marks.append(pytest.mark.skipif(not CUDA, reason="too large for Triton's interpreter: CUDA only"))
    return marks


def _runnable(case: Case, cuda: bool) -> bool:
    return cuda or (case.dtype != "bfloat16" and not case.gpu_only)


# --------------------------------------------------------------------------------------
# The worker: runs in a child process (TRITON_INTERPRET=1 on CPU), prints JSON
# --------------------------------------------------------------------------------------


def make_inputs(case: Case, device: str, seed: int):
    """Random q, k, v, dO (rounded to the case's dtype) and the key-padding mask."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if case.layout == "blhd":  # (B, L, H, D) storage seen as (B, H, L, D): non-contiguous views
        q = rand(case.B, case.L, case.H, case.D).transpose(1, 2)
        k = rand(case.B, case.S, case.H, case.D).transpose(1, 2)
        v = rand(case.B, case.S, case.H, case.D).transpose(1, 2)
    else:
        q, k, v = rand(case.B, case.H, case.L, case.D), rand(case.B, case.H, case.S, case.D), rand(case.B, case.H, case.S, case.D)
    do = rand(case.B, case.H, case.L, case.D)
    mask = None
    if case.mask == "pad":
        mask = torch.rand(case.B, case.S, generator=g) > 0.3  # ~30% of keys padded
        mask[:, -1] = True  # every batch element keeps a key ...
        if case.causal:
            mask[0, 0] = False  # ... but query row 0 sees only key 0: row 0 is empty
        if case.B > 1:
            mask[-1] = False  # the last batch element has no key at all: every row empty
    q, k, v, do = (t.to(device) for t in (q, k, v, do))
    return q, k, v, do, None if mask is None else mask.to(device)


def run_case(case: Case, device: str) -> dict[str, object]:
    """Kernel vs float64 reference for one case: relative errors and exactness flags."""
    from attention_ref import scaled_dot_product_attention
    from attention_ref import triton_flash

    q, k, v, do, mask = make_inputs(case, device, seed=zlib.crc32(case.id.encode()))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    config = triton_flash._Config(*case.config) if case.config is not None else None
    max_grid = triton_flash._MAX_GRID_YZ
    if case.max_grid is not None:
        triton_flash._MAX_GRID_YZ = case.max_grid
    try:
        out = triton_flash._apply(q, k, v, case.causal, case.scale, mask, config)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    finally:
        triton_flash._MAX_GRID_YZ = max_grid

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, S)
    ref = scaled_dot_product_attention(*ref_inputs, attn_mask, is_causal=case.causal, scale=case.scale)
    refs = (ref, *torch.autograd.grad(ref, ref_inputs, do.double()))

    result: dict[str, object] = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), refs):
        got64 = got.detach().double()
        # Inputs are N(0, 1), so gradient entries are typically 0.1 .. 1: floor the norm at
        # 0.1 per entry. The floor only matters where the exact gradient cancels to ~0 (a row
        # with a single key has dq = dk = 0 exactly; the kernel leaves the rounding residue
        # of dP - delta) and keeps that from being divided by ~0.
        floor = 0.1 * math.sqrt(want.numel())
        result[name] = ((got64 - want).norm() / max(want.norm().item(), floor)).item()
        result[name + "_finite"] = bool(torch.isfinite(got64).all())
        result[name + "_dtype_ok"] = got.dtype == q.dtype and got.shape == want.shape
    # rows where no key takes part: output and dq exactly 0
    allowed = torch.ones(case.L, case.S, dtype=torch.bool, device=device)
    if case.causal:
        allowed = torch.ones_like(allowed).tril()
    allowed = allowed.expand(case.B, case.H, case.L, case.S)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    empty = ~allowed.any(-1)  # (B, H, L)
    result["empty_rows"] = int(empty.sum())
    result["empty_rows_zero"] = bool((out.detach()[empty] == 0).all() and (dq[empty] == 0).all())
    return result


def worker(device: str) -> None:
    torch.use_deterministic_algorithms(False)
    cuda = device == "cuda"
    results = {}
    for case in CASES:
        if not _runnable(case, cuda):
            continue
        try:
            results[case.id] = run_case(case, device)
        except Exception:  # report per case, keep going
            results[case.id] = {"error": traceback.format_exc()}
    print("RESULTS-JSON " + json.dumps(results))


# --------------------------------------------------------------------------------------
# The pytest side
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    """Run every case once in a child process; returns {case id: result}."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    env = dict(os.environ)
    if CUDA:
        env.pop("TRITON_INTERPRET", None)
        device = "cuda"
    else:
        env["TRITON_INTERPRET"] = "1"  # must be set before the kernels are defined
        device = "cpu"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", device],
        capture_output=True, text=True, env=env, timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS-JSON ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the worker process failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULTS-JSON "))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_matches_float64_reference(case: Case, results: dict[str, dict[str, object]]) -> None:
    result = results[case.id]
    assert "error" not in result, result.get("error")
    out_tol, grad_tol = TOLERANCE[case.dtype]
    for name in ("out", "dq", "dk", "dv"):
        assert result[name + "_finite"], f"{name} has NaN/inf"
        assert result[name + "_dtype_ok"], f"{name} has the wrong dtype or shape"
        tol = out_tol if name == "out" else grad_tol
        assert result[name] <= tol, f"{name}: relative error {result[name]:.2e} > {tol:.0e}"
    if case.mask == "pad" and (case.causal or case.B > 1):
        assert result["empty_rows"] > 0  # the case really has fully masked rows
    assert result["empty_rows_zero"], "a fully masked row has a non-zero output or dq"


# ---- no kernel needed: validation, errors, availability -----------------------------------


def _qkv(B=1, H=2, L=5, S=7, D=16, dtype=torch.float32):
    return torch.randn(B, H, L, D, dtype=dtype), torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, H, S, D, dtype=dtype)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dims \(B, H, L, D\), got 3 dims with shape \(2, 5, 16\)"),
        (lambda q, k, v: (q.double(), k, v), TypeError, "q must be float16, bfloat16 or float32, got torch.float64"),
        (lambda q, k, v: (q, k.half(), v), TypeError, r"k must have the same dtype as q \(torch.float32\), got torch.float16"),
        (lambda q, k, v: (q, k, v.int()), TypeError, "v must be float16, bfloat16 or float32, got torch.int32"),
        (lambda q, k, v: (q, k[:, :1], v), ValueError, r"k must have the same \(B, H\) as q.*\(1, 2\).*\(1, 1\)"),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, r"k and v must have the same length S.*S=7.*S=3"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, r"k must have the same head size D as q.*D=16.*D=8"),
        (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), ValueError, r"head size D must be in \[16, 128\], got D=8"),
        (lambda q, k, v: (q.repeat(1, 1, 1, 16), k.repeat(1, 1, 1, 16), v.repeat(1, 1, 1, 16)), ValueError, "got D=256"),
        (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor, got str"),
    ],
)
def test_rejects_bad_tensors(change, error, match) -> None:
    from attention_ref.triton_flash import flash_attention

    with pytest.raises(error, match=match):
        flash_attention(*change(*_qkv()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key_padding_mask": torch.ones(1, 7)}, TypeError, r"key_padding_mask must be a bool tensor \(True = takes part\), got torch.float32"),
        ({"key_padding_mask": torch.ones(1, 5, dtype=torch.bool)}, ValueError, r"key_padding_mask must have shape \(B, S\) = \(1, 7\), got \(1, 5\)"),
        ({"key_padding_mask": torch.ones(7, dtype=torch.bool)}, ValueError, r"\(B, S\) = \(1, 7\), got \(7,\)"),
        ({"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
        ({"scale": -1.0}, ValueError, "scale must be a positive finite float or None, got -1.0"),
    ],
)
def test_rejects_bad_options(kwargs, error, match) -> None:
    from attention_ref.triton_flash import flash_attention

    with pytest.raises(error, match=match):
        flash_attention(*_qkv(), **kwargs)


@needs_triton
def test_cpu_without_interpreter_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from attention_ref import triton_flash

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"CUDA tensors, or on CPU tensors under Triton's interpreter.*TRITON_INTERPRET=1"):
        triton_flash.flash_attention(*_qkv())
    assert triton_flash.is_available("cpu") is False


@needs_triton
def test_unsupported_device_is_named() -> None:
    from attention_ref.triton_flash import flash_attention, is_available

    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(RuntimeError, match="got tensors on meta"):
        flash_attention(q, k, v)
    assert is_available("meta") is False


def test_missing_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from attention_ref import triton_flash

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setattr(triton_flash, "_KERNELS", {})
    with pytest.raises(ImportError, match=r"needs the 'triton' package.*pip install triton"):
        triton_flash.flash_attention(*_qkv())
    assert triton_flash.is_available("cuda") is False


def test_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in ("attention_ref.triton_flash", "attention_ref._triton_kernels"):
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a fresh copy, imported while triton is unimportable
        assert module.__name__ == name


def test_empty_lengths_give_zeros_without_a_kernel() -> None:
    from attention_ref.triton_flash import flash_attention

    for L, S in ((0, 7), (5, 0)):
        q, k, v = (t.requires_grad_() for t in _qkv(L=L, S=S))
        out = flash_attention(q, k, v)  # no kernel launch, so no triton/device requirement
        assert out.shape == (1, 2, L, 16) and not out.any()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v)))


def test_kernel_source_shows_the_kernels() -> None:
    from attention_ref.triton_flash import kernel_source

    source = kernel_source("_attn_fwd_inner")
    assert source.startswith("@triton.jit\ndef _attn_fwd_inner(")
    assert "m_i" in source and "l_i" in source and "acc" in source
    with pytest.raises(ValueError, match="no kernel named 'nope'.*_attn_fwd"):
        kernel_source("nope")


def test_config_constraints() -> None:
    from attention_ref.triton_flash import _Config, _gpu_config

    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        _Config(64, 24, 4, 1, 16, 32, 32, 16, 4, 1)
    with pytest.raises(ValueError, match=r"block_m \(32\) must be a multiple of block_n \(64\)"):
        _Config(32, 64, 4, 1, 16, 32, 32, 16, 4, 1)
    for block_d in (16, 32, 64, 128):  # every table entry satisfies the constraints
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert isinstance(_gpu_config(block_d, dtype), _Config)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
