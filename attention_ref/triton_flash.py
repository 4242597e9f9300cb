r"""A FlashAttention kernel in Triton: forward and backward, with causal, sliding-window and
key-padding masks and logit soft-capping.

``flash_attention(q, k, v, is_causal=..., scale=..., key_padding_mask=..., window=(left, right),
window_offset=..., softcap=...)`` equals the reference (``backend="math"``)

```python
attention_ref.scaled_dot_product_attention(
    q, k, v, attn_mask=key_padding_mask[:, None, None, :], is_causal=is_causal, scale=scale,
    mask_mod=mods.sliding_window(left, right, offset=window_offset), score_mod=mods.softcap(softcap),
)
```

in its output and its gradients, up to floating-point rounding (``tests/test_triton_flash.py``
holds it to the float64 reference), but never materialises the ``L x S`` score matrix:
its extra memory is one float32 log-sum-exp per query row. The kernels themselves live in
``attention_ref/_triton_kernels.py``; this module validates, launches and differentiates.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` query length,
``S`` key length, ``D`` head size (``E = Ev = D`` here).

**Program grid.** The forward pass launches ``(cdiv(L, BLOCK_M), B, H)`` programs.
Program ``(m, b, h)`` owns the query tile ``q[b, h, m*BLOCK_M : (m+1)*BLOCK_M, :]``
(``BLOCK_M x BLOCK_D``, kept in registers) and streams the key and value tiles
(``BLOCK_N x BLOCK_D``) of the same ``(b, h)`` through an online softmax: a running
row max ``m_i``, a running row sum ``l_i`` and an unnormalised accumulator ``acc``
(``BLOCK_M x BLOCK_D``, float32). It writes the output tile and the row log-sum-exp
(base 2) that the backward pass reuses. ``BLOCK_D`` is ``D`` rounded up to a power of
two; the padded columns are loaded as zeros and never stored.

**Masking.** The key loop is split in two: blocks that need no mask (every key
exists and, under ``is_causal``, lies left of the diagonal for every query row of
the tile) run without bounds checks; the remaining blocks (the diagonal, the last
partial block) mask keys ``j >= S`` and, under ``is_causal``, keys ``j > i``
(top-left aligned: query ``i`` sees key ``j`` when ``j <= i``, also for ``L != S``).
Blocks right of the diagonal are never visited (causal block skipping); causal
programs start with the longest rows so the GPU is not left with a tail of heavy
programs. A sliding window (query ``i`` sees key ``j`` when
``i + window_offset - left <= j <= i + window_offset + right``) bounds the key loop the
same way on both sides: a query tile visits only the key blocks that one of its rows can
see, and only the blocks on the window's two edges are masked; the backward kernels bound
their loops alike (``docs/contributors/triton-kernel.md`` derives the bounds). Soft-capping
replaces each scaled score ``s`` by ``cap * tanh(s / cap)`` before any mask (the backward
multiplies ``dS`` by ``1 - tanh^2``). The window and the cap are compile-time options: a
call without them runs none of their code. The key-padding mask (``True`` = takes part,
the opposite of ``torch.nn.MultiheadAttention``) is loaded once per key block and sets
masked scores to ``-inf`` (the dK/dV kernel instead zeroes the padded keys' rows at the
end). A query row where no key takes part gets output 0, log-sum-exp ``+inf`` and zero
gradients, like the reference.

**Backward (FlashAttention-2).** Three launches: (1) ``delta_i = sum_d dO_id * O_id``;
(2) one program per key block (``BLOCK_N1`` keys, grid ``(cdiv(S, BLOCK_N1), B, H)``)
keeps ``k``, ``v``, ``dk``, ``dv`` on chip and loops over the query blocks that can see
those keys, recomputing ``P^T = exp2(scale*log2(e) * k q^T - lse)`` from the saved
log-sum-exp; (3) one program per query block (grid ``(cdiv(L, BLOCK_M2), B, H)``)
loops over key blocks to accumulate ``dq``. With ``dS = P * (dP - delta)``:
``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``. No atomics: every
output tile is written by exactly one program.

**Where it runs.** On CUDA tensors (block sizes, warps and pipeline stages from a
small table per head size and dtype, chosen for an H100), or on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before triton is first
imported in the process, since Triton defines its own library functions then; 16 x 16 tiles;
float32 and float16 only: the interpreter mishandles bfloat16). Triton is imported on first
use, so this module imports without it, and each mode (compiled or interpreted) gets its own
copy of this package's kernels. The test suite and the docs build set ``TRITON_INTERPRET=1``
at start-up on machines without CUDA.
float32 inputs use exact float32 dot products (``input_precision="ieee"``), not TF32.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from attention_ref._validation import check_scale, fmt_shape, require_tensor

__all__ = ["MAX_HEAD_DIM", "MIN_HEAD_DIM", "SUPPORTED_DTYPES", "flash_attention", "is_available", "kernel_source"]

MIN_HEAD_DIM = 16
"""The smallest head size ``D`` the kernel accepts."""
MAX_HEAD_DIM = 128
"""The largest head size ``D`` the kernel accepts (any ``D`` in between, padded to a power of two)."""
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes the kernel accepts (bfloat16 is tested on CUDA only: the interpreter mishandles it)."""

_LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernels work in base 2


@dataclass(frozen=True)
class _Options:
    """What the kernels compute besides plain attention: masks and the score cap (validated).

    The window is kept as the two diagonals ``win_lo <= j - i <= win_hi`` that bound it
    (``None``: no bound on that side), as `_window_diagonals` fits them to the grid.
    """

    is_causal: bool
    win_lo: int | None = None
    win_hi: int | None = None
    softcap: float | None = None

    def kernel_args(self, scale: float) -> tuple[tuple[float, float, int, int], dict[str, bool]]:
        """The runtime scalars ``(qk_scale, tanh_scale, win_lo, win_hi)`` and the compile-time flags."""
        if self.softcap is None:
            scalars = (scale * _LOG2_E, 1.0)  # base-2 score = qk_scale * q.k
        else:  # base-2 score = qk_scale * tanh(tanh_scale * q.k) = log2(e) * cap * tanh(scale * q.k / cap)
            scalars = (self.softcap * _LOG2_E, scale / self.softcap)
        flags = {"IS_CAUSAL": self.is_causal, "WINDOW_LEFT": self.win_lo is not None,
                 "WINDOW_RIGHT": self.win_hi is not None, "HAS_SOFTCAP": self.softcap is not None}
        return (*scalars, self.win_lo or 0, self.win_hi or 0), flags


def _window_diagonals(
    window: tuple[int | None, int | None] | None, offset: int, is_causal: bool, L: int, S: int
) -> tuple[int | None, int | None]:
    """The window ``(left, right)`` at ``offset`` as diagonals ``win_lo <= j - i <= win_hi``.

    On the ``L x S`` grid ``j - i`` runs from ``1 - L`` to ``S - 1`` (to ``0`` under
    ``is_causal``). A side that every pair satisfies is dropped (``None``: its masks and
    loop bounds are not compiled in); a band that no pair satisfies becomes
    ``(S, None)`` (every row empty); so the diagonals fit in 32 bits whatever the offset.

    Examples:
        >>> _window_diagonals((2, 0), 0, False, 8, 8)  # i - 2 <= j <= i
        (-2, 0)
        >>> _window_diagonals((None, 1), 3, False, 8, 8)  # j <= i + 4, no left side
        (None, 4)
        >>> _window_diagonals((2, 1), 0, True, 8, 8)  # is_causal's j <= i is the tighter right side
        (-2, None)
        >>> _window_diagonals((100, 100), 0, False, 8, 8)  # wider than the grid: no window at all
        (None, None)
        >>> _window_diagonals((0, 0), 10**12, False, 8, 8)  # no query sees a key
        (8, None)
    """
    if window is None:
        return None, None
    left, right = window
    win_lo = None if left is None else offset - left
    win_hi = None if right is None else offset + right
    bottom, top = 1 - L, (min(S - 1, 0) if is_causal else S - 1)  # the range of j - i
    if win_lo is not None and win_lo <= bottom:
        win_lo = None
    if win_hi is not None and win_hi >= top:
        win_hi = None
    if (bottom if win_lo is None else win_lo) > (top if win_hi is None else win_hi):
        return S, None  # j - i >= S: no pair
    return win_lo, win_hi


# --------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    """Tile sizes and launch options of the three kernels (forward, dK/dV, dQ).

    Constraints (checked in ``__post_init__``): every block is a power of two >= 16,
    ``block_m % block_n == 0`` (the forward's causal split), ``block_n1 % block_m1 == 0``
    (the dK/dV kernel's) and ``block_m2 % block_n2 == 0`` (the dQ kernel's).
    """

    block_m: int  # forward: queries per program
    block_n: int  # forward: keys per loop step
    num_warps: int
    num_stages: int
    block_m1: int  # dK/dV kernel: queries per loop step
    block_n1: int  # dK/dV kernel: keys per program
    block_m2: int  # dQ kernel: queries per program
    block_n2: int  # dQ kernel: keys per loop step
    bwd_num_warps: int
    bwd_num_stages: int
    # load the tiles streamed by the inner loops (K, V forward and in dQ; Q, dO in dK/dV)
    # through tensor descriptors (TMA on Hopper) where rows are 16-byte aligned; an option
    # for tuning on a GPU (notes/triton.md), off in the table
    tma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_m1", "block_n1", "block_m2", "block_n2"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for big, small in (("block_m", "block_n"), ("block_n1", "block_m1"), ("block_m2", "block_n2")):
            if getattr(self, big) % getattr(self, small):
                raise ValueError(
                    f"{big} ({getattr(self, big)}) must be a multiple of {small} ({getattr(self, small)})"
                )


# Under the interpreter every program runs as NumPy code on the CPU: the smallest tiles
# that tl.dot accepts keep it fast and make small test shapes span several blocks.
_INTERPRETER_CONFIG = _Config(16, 16, 4, 1, 16, 16, 16, 16, 4, 1)


def _gpu_config(head_dim_block: int, dtype: torch.dtype) -> _Config:
    """The launch table for CUDA, chosen for an H100 (sm_90); see notes/triton.md.

    The forward entries are the largest tiles whose kernels compile for sm_90 without
    register spills, read from ptxas reports made on a CPU machine (128-query tiles, 8
    warps, ``wgmma`` tensor-core instructions for 16-bit inputs). The D = 128 backward was
    timed (H100, triton 3.6, bf16 L = 8192, the sweeps in benchmarks/results/
    gpu-session-2026-11-26*/): 128 keys per dK/dV program and 64 queries per step (the dQ
    kernel mirrored: 128 queries, 64 keys per step), 8 warps, run forward + backward in
    8.7 ms non-causal and 4.9 ms causal, against 19.5 and 9.9 ms for the 64 x 32 tiles it had
    (which spilled fewer registers: wider tiles won over fewer spills), 1.37x torch's flash
    backend. At D = 64 the same sweep put 4 backward warps 9% ahead of 8 (10.2 against
    11.2 ms non-causal, 5.4 against 5.9 ms causal, 128 x 32 tiles, L = 8192, H = 32).
    float32 uses exact (non-tensor-core) products: smaller tiles.
    """
    if dtype == torch.float32:
        if head_dim_block <= 64:
            return _Config(64, 32, 8, 1, 16, 64, 64, 16, 8, 1)
        return _Config(32, 16, 8, 1, 16, 32, 32, 16, 8, 1)
    if head_dim_block <= 32:
        return _Config(128, 64, 4, 3, 32, 128, 128, 32, 4, 3)
    if head_dim_block <= 64:
        return _Config(128, 64, 8, 3, 32, 128, 128, 32, 4, 3)
    return _Config(128, 64, 8, 3, 64, 128, 128, 64, 8, 3)


# --------------------------------------------------------------------------------------
# The kernels live in attention_ref/_triton_kernels.py; they are loaded on first use, once
# per mode (compiled for CUDA, or interpreted under TRITON_INTERPRET=1), because triton.jit
# fixes the mode when a kernel is defined.
# --------------------------------------------------------------------------------------

_KERNEL_FILE = Path(__file__).with_name("_triton_kernels.py")
_KERNELS: dict[bool, ModuleType] = {}
_KERNELS_LOCK = threading.Lock()


def _import_triton() -> Any:
    try:
        import triton
    except ImportError as exc:  # ModuleNotFoundError, or a broken install
        raise ImportError(
            "attention_ref.triton_flash needs the 'triton' package, which could not be imported "
            f"({exc}). Install it with `pip install triton` (or the project's 'gpu' extra)."
        ) from exc
    return triton


def _interpret_requested(triton: Any) -> bool:
    """Whether Triton would build interpreted kernels now (the TRITON_INTERPRET switch)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels_for(device: torch.device) -> ModuleType:
    """The kernels for ``device``: compiled ones for CUDA, interpreted ones for CPU."""
    triton = _import_triton()
    interpret = _interpret_requested(triton)
    if device.type == "cpu" and not interpret:
        raise RuntimeError(
            "flash_attention runs its Triton kernel on CUDA tensors, or on CPU tensors under "
            "Triton's interpreter; got tensors on cpu and TRITON_INTERPRET is not set. Move the "
            "tensors to a CUDA device, or set the environment variable TRITON_INTERPRET=1 "
            "(slow; for testing) before calling it."
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(
            f"flash_attention runs its Triton kernel on CUDA tensors (or CPU tensors under "
            f"TRITON_INTERPRET=1), got tensors on {device}"
        )
    with _KERNELS_LOCK:
        if interpret not in _KERNELS:
            _KERNELS[interpret] = _load_kernels(interpret)
        return _KERNELS[interpret]


def _load_kernels(interpret: bool) -> ModuleType:
    """A fresh copy of ``_triton_kernels.py`` whose kernels were defined in the current mode."""
    if interpret:
        from triton.language import standard

        # Triton defines its own library functions (tl.sum, tl.max, ...) when it is first
        # imported; if that happened before TRITON_INTERPRET=1 was set, they are compiled-mode
        # functions that an interpreted kernel cannot call.
        if type(standard.sum).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was first imported in this process, so "
                "Triton's own library functions were defined for compiled kernels; set "
                "TRITON_INTERPRET=1 before anything imports triton (e.g. at the top of the script)"
            )
    name = f"attention_ref._triton_kernels_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, _KERNEL_FILE)
    if spec is None or spec.loader is None:  # pragma: no cover - the file ships with the package
        raise ImportError(f"cannot load the Triton kernels from {_KERNEL_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect (used by triton.jit) looks the module up by name
    spec.loader.exec_module(module)
    if module.INTERPRETED != interpret:  # pragma: no cover - the switch flipped while loading
        raise RuntimeError(
            f"the Triton kernels were defined with TRITON_INTERPRET={int(module.INTERPRETED)}, "
            f"expected {int(interpret)}: do not change TRITON_INTERPRET while the first call runs"
        )
    return module


def is_available(device: torch.device | str = "cuda") -> bool:
    """Whether ``flash_attention`` can run on ``device`` in this process now.

    True when triton imports and ``device`` is a CUDA device that torch can use, or when
    ``device`` is the CPU and ``TRITON_INTERPRET=1`` is set (Triton's interpreter).

    Args:
        device: the device the tensors would live on.

    Returns:
        Whether a call would get past the runtime checks (input validation aside).

    Examples:
        >>> from attention_ref.triton_flash import is_available
        >>> is_available("meta")  # no Triton kernel runs on torch's shape-only device
        False
    """
    device = torch.device(device)
    try:
        triton = _import_triton()
    except ImportError:
        return False
    if _interpret_requested(triton):
        return device.type in ("cpu", "cuda")
    return device.type == "cuda" and torch.cuda.is_available()


# --------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------


def _head_dim_block(D: int) -> int:
    return max(16, 1 << (D - 1).bit_length())  # D rounded up to a power of two


def _config_for(kernels: ModuleType, D: int, dtype: torch.dtype) -> _Config:
    return _INTERPRETER_CONFIG if kernels.INTERPRETED else _gpu_config(_head_dim_block(D), dtype)


def _launch_context(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()


_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dims (batch, heads)


def _grid_chunks(B: int, Hkv: int, group: int = 1) -> list[tuple[slice, slice, slice]]:
    """(batch, query head, key/value head) slices small enough for one launch; one in practice.

    Key/value head ``g`` serves query heads ``g * group .. (g + 1) * group - 1``, so the
    query-head slices are the key/value ones times ``group``.
    """
    step = max(1, _MAX_GRID_YZ // group)
    return [
        (slice(b, min(B, b + _MAX_GRID_YZ)), slice(h * group, min(Hkv, h + step) * group), slice(h, min(Hkv, h + step)))
        for b in range(0, B, _MAX_GRID_YZ)
        for h in range(0, Hkv, step)
    ]


def _forward(
    kernels: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpm: torch.Tensor | None,
    options: _Options,
    scale: float,
    config: _Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``o (B, H, L, D)`` and ``lse (B, H, L)`` (float32, base 2)."""
    B, H, L, D = q.shape
    S = k.shape[2]
    o = torch.empty_like(q)  # contiguous, like q: o shares q's strides
    use_tma = config.tma and _tma_fits(k, v)  # q is loaded once per program: masked loads
    lse = torch.empty((B, H, L), device=q.device, dtype=torch.float32)
    block_d = _head_dim_block(D)
    scalars, flags = options.kernel_args(scale)
    group = H // k.shape[1]  # query heads per key/value head
    with _launch_context(q.device):
        for bs, hs, hkv in _grid_chunks(B, k.shape[1], group):
            qc, kc, vc, oc, lc = q[bs, hs], k[bs, hkv], v[bs, hkv], o[bs, hs], lse[bs, hs]
            kpm_c = kpm[bs] if kpm is not None else None
            grid = (_cdiv(L, config.block_m), qc.shape[0], qc.shape[1])
            kernels._attn_fwd[grid](
                qc, kc, vc, kpm_c if kpm_c is not None else qc, oc, lc,  # qc: unused dummy pointer
                qc.stride(0), qc.stride(1), qc.stride(2),
                kc.stride(0), kc.stride(1), kc.stride(2),
                vc.stride(0), vc.stride(1), vc.stride(2),
                kpm_c.stride(0) if kpm_c is not None else 0, lc.stride(0), lc.stride(1),
                L, S, D, *scalars, GROUP=group, HAS_KPM=kpm is not None, **flags,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
                EVEN_D=block_d == D, DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=use_tma,
                num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=True,
            )
    return o, lse


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's scratch allocator for descriptors made in a kernel: bytes on the current CUDA device."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether the tensors can be read through tensor descriptors; sets Triton's scratch allocator.

    A descriptor needs 16-byte aligned row strides and base addresses (rows of D elements,
    every (batch, head) slab starting on one): D * element size a multiple of 16. Descriptors
    made inside a kernel need global scratch memory on a GPU, which Triton asks for through
    the allocator set with ``triton.set_allocator``. That setting is a context variable, so
    it holds only in the thread that set it: autograd runs a CUDA backward in its own
    thread, where an allocator set once in the forward's thread is missing (seen on an H100,
    triton 3.6: "Kernel requires a runtime memory allocation, but no allocator was set").
    So it is set here, in the launching thread, before every launch that reads through
    descriptors.
    """
    rows_aligned = all((t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)
    if not rows_aligned:
        return False
    if tensors[0].device.type == "cuda":
        import triton

        triton.set_allocator(_scratch)
    return True


def _backward(
    kernels: ModuleType,
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpm: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    options: _Options,
    scale: float,
    config: _Config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward kernels; returns ``dq, dk, dv`` in the input dtype."""
    B, H, L, D = q.shape
    S = k.shape[2]
    do = do.to(q.dtype).contiguous()  # contiguous like q and o: the kernels use q's strides for all three
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)  # (B, H, L) float32, same layout as lse
    block_d = _head_dim_block(D)
    scalars, flags = options.kernel_args(scale)
    use_tma = config.tma and _tma_fits(q, k, v, do)
    common = dict(**flags, HAS_KPM=kpm is not None, BLOCK_D=block_d, EVEN_D=block_d == D,
                  DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=use_tma, num_warps=config.bwd_num_warps,
                  num_stages=config.bwd_num_stages, enable_fp_fusion=True)
    group = H // k.shape[1]  # query heads per key/value head
    with _launch_context(q.device):
        for bs, hs, hkv in _grid_chunks(B, k.shape[1], group):
            qc, kc, vc, oc, doc = q[bs, hs], k[bs, hkv], v[bs, hkv], o[bs, hs], do[bs, hs]
            lc, deltac = lse[bs, hs], delta[bs, hs]
            dqc, dkc, dvc = dq[bs, hs], dk[bs, hkv], dv[bs, hkv]
            kpm_c = kpm[bs] if kpm is not None else None
            kpm_arg = kpm_c if kpm_c is not None else qc  # unused dummy pointer without a mask
            stride_mb = kpm_c.stride(0) if kpm_c is not None else 0
            nb, nh = qc.shape[0], qc.shape[1]
            q_strides = (qc.stride(0), qc.stride(1), qc.stride(2))
            k_strides = (kc.stride(0), kc.stride(1), kc.stride(2))
            kernels._attn_bwd_preprocess[(_cdiv(L, config.block_m2), nb, nh)](
                oc, doc, deltac, *q_strides, lc.stride(0), lc.stride(1), L, D,
                BLOCK_M=config.block_m2, BLOCK_D=block_d, enable_fp_fusion=True,
            )
            kernels._attn_bwd_dkdv[(_cdiv(S, config.block_n1), nb, kc.shape[1])](  # one per key/value head
                qc, kc, vc, kpm_arg, doc, lc, deltac, dkc, dvc, *q_strides, *k_strides,
                stride_mb, lc.stride(0), lc.stride(1), L, S, D, scale, *scalars, GROUP=group,
                BLOCK_M1=config.block_m1, BLOCK_N1=config.block_n1, **common,
            )
            kernels._attn_bwd_dq[(_cdiv(L, config.block_m2), nb, nh)](
                qc, kc, vc, kpm_arg, doc, lc, deltac, dqc, *q_strides, *k_strides,
                stride_mb, lc.stride(0), lc.stride(1), L, S, D, scale, *scalars, GROUP=group,
                BLOCK_M2=config.block_m2, BLOCK_N2=config.block_n2, **common,
            )
    return dq, dk, dv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact float32 products, as the reference computes; 16-bit inputs use
    # the tensor cores natively (the setting does not apply to them).
    return "ieee" if dtype == torch.float32 else "tf32"


class _FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: Triton forward, Triton backward (inputs already validated, contiguous)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kpm: torch.Tensor | None,
        options: _Options,
        scale: float,
        config: _Config | None,
    ) -> torch.Tensor:
        ctx.options, ctx.scale = options, scale
        if q.numel() == 0 or k.numel() == 0:
            # L = 0 (nothing to compute) or S = 0 (every row fully masked): output 0
            ctx.empty = True
            ctx.shapes = (q.shape, k.shape, v.shape)
            return q.new_zeros(q.shape)
        ctx.empty = False
        kernels = _kernels_for(q.device)
        config = config or _config_for(kernels, q.shape[-1], q.dtype)
        o, lse = _forward(kernels, q, k, v, kpm, options, scale, config)
        ctx.kernels, ctx.config = kernels, config
        ctx.save_for_backward(q, k, v, kpm, o, lse)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.empty:
            q_shape, k_shape, v_shape = ctx.shapes
            return do.new_zeros(q_shape), do.new_zeros(k_shape), do.new_zeros(v_shape), None, None, None, None
        q, k, v, kpm, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.kernels, do, q, k, v, kpm, o, lse, ctx.options, ctx.scale, ctx.config)
        return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------


def _validate(
    q: object, k: object, v: object, is_causal: object, scale: object, key_padding_mask: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    tensors = {}
    for name, value, layout in (("q", q, "(B, H, L, D)"), ("k", k, "(B, H, S, D)"), ("v", v, "(B, H, S, D)")):
        tensor = require_tensor(name, value)
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims {layout}, got {tensor.dim()} dims with shape {fmt_shape(tensor.shape)}"
            )
        tensors[name] = tensor
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    for name in ("k", "v"):
        other = tensors[name]
        if other.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {other.dtype}")
        if other.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {other.device}")
        if other.shape[0] != q.shape[0] or other.shape[1] == 0 or q.shape[1] % other.shape[1]:
            raise ValueError(
                f"{name} must have q's batch B and a number of heads Hkv that divides q's H: q "
                f"{fmt_shape(q.shape)} has (B, H) = {fmt_shape(q.shape[:2])}, {name} {fmt_shape(other.shape)} "
                f"has {fmt_shape(other.shape[:2])}"
            )
        if other.shape[3] != q.shape[3]:
            raise ValueError(
                f"{name} must have the same head size D as q: q {fmt_shape(q.shape)} has D={q.shape[3]}, "
                f"{name} {fmt_shape(other.shape)} has D={other.shape[3]}"
            )
    if v.shape[1] != k.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads Hkv (dim 1): k {fmt_shape(k.shape)}, "
            f"v {fmt_shape(v.shape)}"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(
            f"k and v must have the same length S (dim 2): k {fmt_shape(k.shape)} has S={k.shape[2]}, "
            f"v {fmt_shape(v.shape)} has S={v.shape[2]}"
        )
    D = q.shape[3]
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(
            f"head size D must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got D={D} (q shape {fmt_shape(q.shape)})"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    check_scale(scale)  # type: ignore[arg-type]
    mask = None
    if key_padding_mask is not None:
        mask = require_tensor("key_padding_mask", key_padding_mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = takes part), got {mask.dtype}")
        expected = (q.shape[0], k.shape[2])
        if tuple(mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must have shape (B, S) = {fmt_shape(expected)}, got {fmt_shape(mask.shape)}"
            )
        if mask.device != q.device:
            raise ValueError(f"key_padding_mask must be on the same device as q ({q.device}), got {mask.device}")
    return q, k, v, mask


_WINDOW_EXPECTED = "a (left, right) pair of ints >= 0 or None (unbounded), or None (no window)"


def _validate_window(window: object, window_offset: object) -> tuple[int | None, int | None] | None:
    if isinstance(window_offset, bool) or not isinstance(window_offset, int):
        raise TypeError(f"window_offset must be an int, got {type(window_offset).__name__}")
    if window is None:
        if window_offset != 0:
            raise ValueError(
                f"window_offset={window_offset} needs a window: pass window=(left, right) too "
                "(is_causal is always top-left aligned; a bottom-right causal mask is "
                "window=(None, 0), window_offset=S - L)"
            )
        return None
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"window must be {_WINDOW_EXPECTED}, got {type(window).__name__}")
    if len(window) != 2:
        raise ValueError(f"window must be {_WINDOW_EXPECTED}, got {len(window)} values: {tuple(window)}")
    for index, (side, value) in enumerate(zip(("left", "right"), window)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"window[{index}] ({side}) must be a non-negative int or None (unbounded), got {type(value).__name__}"
            )
        if value < 0:
            raise ValueError(f"window[{index}] ({side}) must be a non-negative int or None (unbounded), got {value}")
    return window[0], window[1]


def _validate_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a positive finite float or None, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap}")
    return float(softcap)


def _apply(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    key_padding_mask: torch.Tensor | None,
    config: _Config | None,
    window: tuple[int | None, int | None] | None = None,
    window_offset: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    q, k, v, mask = _validate(q, k, v, is_causal, scale, key_padding_mask)
    window = _validate_window(window, window_offset)
    cap = _validate_softcap(softcap)
    if q.numel() and k.numel():
        _kernels_for(q.device)  # fail early with a clear message (no triton, wrong device)
    resolved = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    win_lo, win_hi = _window_diagonals(window, window_offset, is_causal, q.shape[2], k.shape[2])
    options = _Options(is_causal, win_lo, win_hi, cap)
    kpm = None if mask is None else mask.contiguous().view(torch.uint8)  # (B, S), 1 = takes part
    fn = _FlashAttentionFunction
    out = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), kpm, options, resolved, config)
    return out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    window_offset: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    r"""Scaled dot-product attention by a Triton FlashAttention kernel (forward and backward).

    Equal, up to rounding, to the reference (``backend="math"``)
    ``attention_ref.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal,
    scale=scale, mask_mod=mods.sliding_window(left, right, offset=window_offset),
    score_mod=mods.softcap(softcap))`` with ``attn_mask = key_padding_mask[:, None, None, :]``
    and ``(left, right) = window`` (each part left out when its argument is ``None``):

    $$
    \mathrm{out} = \mathrm{softmax}\!\left(c\,\tanh\!\left(\frac{\text{scale}\cdot q k^\top}{c}\right)
        + M\right) v
    $$

    with ``c = softcap`` (no ``tanh`` without it) and ``M`` 0 where the pair takes part,
    ``-inf`` elsewhere, computed tile by tile with an online softmax, never forming the
    ``L x S`` matrix. Key blocks that no query of a tile can see (causal, window) are
    never loaded.

    Args:
        q: ``(B, H, L, D)`` queries, float16, bfloat16 or float32, ``16 <= D <= 128``
            (any ``D`` in that range; it is padded to a power of two inside the kernel).
        k: ``(B, Hkv, S, D)`` keys, same dtype and device; ``Hkv`` divides ``H``:
            query head ``h`` reads key/value head ``h // (H // Hkv)`` in place
            (grouped-query attention; ``Hkv = H`` is multi-head attention).
        v: ``(B, Hkv, S, D)`` values.
        is_causal: top-left aligned causal mask: query ``i`` sees key ``j`` when
            ``j <= i`` (also for ``L != S``, as ``torch.nn.functional.scaled_dot_product_attention``).
        scale: multiplies the scores; defaults to ``1 / sqrt(D)``.
        key_padding_mask: ``(B, S)`` bool, ``True`` = the key takes part (the opposite of
            ``torch.nn.MultiheadAttention``'s ``key_padding_mask``); combined with ``is_causal``.
        window: ``(left, right)``, a sliding window: key ``j`` takes part for query ``i`` when
            ``i + window_offset - left <= j <= i + window_offset + right`` (both ends
            inclusive, ``left + 1 + right`` keys); ``None`` for a side leaves it unbounded,
            ``None`` for ``window`` means no window. ``(None, 0)`` is a causal mask at
            ``window_offset`` (`attention_ref.mods.causal`). Combined (AND) with
            ``is_causal`` and ``key_padding_mask``.
        window_offset: query ``i`` sits at key position ``i + window_offset``: ``0`` aligns
            the window top-left, ``S - L`` bottom-right (decoding after ``S - L`` cached
            keys). Only with a ``window``.
        softcap: logit soft-capping (Gemma 2): each scaled score ``s`` becomes
            ``softcap * tanh(s / softcap)`` before any mask; a positive finite float, or
            ``None`` for none.

    Returns:
        ``(B, H, L, D)`` in ``q``'s dtype (softmax and accumulation in float32). A query
            row where no key takes part gives output 0, and zero gradients.

    Raises:
        TypeError: non-tensor inputs, a dtype other than float16/bfloat16/float32,
            mismatched dtypes, a non-bool mask, a non-bool ``is_causal``, a ``window``
            that is not a pair of ints or None, a non-int ``window_offset``, a
            non-number ``softcap``.
        ValueError: shapes that do not fit, ``D`` outside ``[16, 128]``, a bad scale,
            tensors on different devices, a negative window side, a ``window`` of other
            than 2 values, a ``window_offset`` without a window, a ``softcap`` that is
            not positive and finite.
        ImportError: triton is not installed.
        RuntimeError: tensors on the CPU without ``TRITON_INTERPRET=1``, or on a device
            Triton cannot run on.

    Examples:
        >>> import torch
        >>> from attention_ref.triton_flash import flash_attention, is_available
        >>> q = k = v = torch.randn(1, 2, 8, 16, device="cuda" if torch.cuda.is_available() else "cpu")
        >>> out = flash_attention(q, k, v, is_causal=True) if is_available(q.device) else q
        >>> out.shape
        torch.Size([1, 2, 8, 16])
        >>> local = flash_attention(q, k, v, window=(3, 0), softcap=30.0) if is_available(q.device) else q
        >>> local.shape  # query i sees keys i - 3 .. i, scores capped to (-30, 30)
        torch.Size([1, 2, 8, 16])
    """
    return _apply(q, k, v, is_causal, scale, key_padding_mask, None, window, window_offset, softcap)


def kernel_source(name: str) -> str:
    """The source code of one of the Triton kernels, read from ``attention_ref/_triton_kernels.py``.

    Reads the file with Python's ``ast`` module (no triton needed), so the documentation can show the
    code that runs instead of a copy that could drift.

    Args:
        name: a kernel defined in ``_triton_kernels.py``, e.g. ``"_attn_fwd_inner"``, ``"_attn_fwd"``,
            ``"_attn_bwd_preprocess"``, ``"_attn_bwd_dkdv_inner"``, ``"_attn_bwd_dkdv"``,
            ``"_attn_bwd_dq_inner"``, ``"_attn_bwd_dq"``, ``"_load_2d"``.

    Returns:
        The function's source, decorator included.

    Raises:
        ValueError: no kernel of that name.

    Examples:
        >>> from attention_ref.triton_flash import kernel_source
        >>> kernel_source("_attn_bwd_preprocess").splitlines()[0]
        '@triton.jit'
    """
    source = _KERNEL_FILE.read_text(encoding="utf-8")
    lines = source.splitlines()
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.decorator_list:
            names.append(node.name)
            if node.name == name:
                start = min(d.lineno for d in node.decorator_list) - 1
                return "\n".join(lines[start : node.end_lineno])
    raise ValueError(f"no kernel named {name!r} in attention_ref/_triton_kernels.py; kernels: {', '.join(names)}")
