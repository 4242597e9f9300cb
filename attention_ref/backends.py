r"""The backends of `attention_ref.scaled_dot_product_attention` and the rule that picks one.

``scaled_dot_product_attention(..., backend=NAME)`` validates its arguments
once, then hands clean tensors to one of these implementations. Each equals
the reference (``"math"``) within floating-point tolerance, and the tests hold
it to that on random shapes, masks and dtypes.

| backend | what it is | weights, lse, sinks | masks | mods | dropout | devices |
|---|---|---|---|---|---|---|
| ``math`` | the reference: forms the ``(L, S)`` scores | yes, yes, yes | bool, float | every ``score_mod`` and ``mask_mod`` | yes | any |
| ``tiled`` | `attention_ref.tiled`, online softmax | no, yes, yes (`attention_ref.add_sinks` after the last block) | bool, float | every mod; skips the blocks a ``mask_mod`` empties; a ``block_mask`` used as is (its blocks) | no | any |
| ``sdpa`` | ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient / cuDNN kernels on CUDA, a flash kernel on CPU) | no, no, no | bool, float | a ``mask_mod`` (or a ``block_mask``'s), materialised as a boolean ``(..., L, S)`` mask; no ``score_mod`` | yes | any |
| ``triton`` | `attention_ref.triton_flash`, this package's Triton kernel | no, no, no | key padding (bool) | `mods.causal`, `mods.sliding_window`, `mods.softcap` (recognised by `mods.describe`) | no | CUDA (or the interpreter) |

All of them support ``is_causal`` (top-left aligned, combined with
``attn_mask``), ``scale``, grouped-query heads (``enable_gqa``) and autograd,
and give output 0 for a query row that no key may attend to.

A ``block_mask`` (`attention_ref.block_mask.BlockMask`, made once by
`attention_ref.block_mask.create_block_mask`) stands for its ``mask_mod`` on every
backend; only ``"tiled"`` reads its blocks (and runs with its block sizes), the
others materialise the mod on every pair as for ``mask_mod=``.

``"auto"`` is a fixed rule, checked in this order (see `select_backend` and
`auto_rule`):

1. weights requested (``return_weights=True``) -> ``"math"``, the only path
   that forms them; the log-sum-exp requested (``return_lse=True``) -> what
   the rules below pick if it is ``"tiled"``, else ``"math"``, the two paths
   that return it; the same for learned sinks (``sinks=``);
2. CUDA tensors with a ``score_mod`` or ``mask_mod`` -> ``"triton"`` when the
   kernel has been verified on a GPU (``TRITON_VERIFIED_ON_GPU``), is installed
   and supports the call (no dropout, a key-padding mask or none, mods it
   implements: a sliding window, causal, soft-capping; ``E == Ev`` in 16..128,
   float16/bfloat16/float32): torch's kernels would need the mask materialised,
   or the math path for a score_mod. Plain calls stay with torch (rule 4): on
   the H100 grid (notes/triton.md) the kernel beat torch's flash backend from
   4096 keys but ran at 0.6-0.7x cuDNN's, which torch 2.11 picks by default
   on Hopper;
3. a ``score_mod`` or a ``mask_mod`` (measured on CPU with
   ``benchmarks/block_sparse_bench.py``, see ``CPU_MODS_TILED_MIN_LENGTH``):
   on CPU without dropout, ``"tiled"`` for a ``score_mod`` at ``max(L, S) >=
   CPU_MODS_TILED_MIN_LENGTH``, and for a ``mask_mod`` alone when it empties at
   least ``CPU_MODS_TILED_MIN_SKIPPED`` of the tiled path's blocks there
   (``"auto"`` builds the `attention_ref.block_mask.BlockMask` to know, and the tiled
   path reuses it) or at ``max(L, S) >= CPU_TILED_MIN_LENGTH``, where a
   materialised mask grows too large (rule 5's reason). Otherwise ``"math"``
   with a ``score_mod``, ``"sdpa"`` (the mask materialised) with a ``mask_mod``
   alone. On CUDA only the Triton kernel's mods leave this rule (rule 2): the
   tiled path has not been measured on a GPU;
4. CUDA tensors -> ``"sdpa"``;
5. CPU tensors, ``max(L, S) >= CPU_TILED_MIN_LENGTH``, an ``attn_mask`` that
   varies over the queries (not a key-padding mask) and no dropout ->
   ``"tiled"``;
6. otherwise -> ``"sdpa"``.

Why rule 5 is so narrow (measured with ``benchmarks/attention_bench.py --preset
cpu``, see the "GPU path" explanation page): torch's CPU SDPA is a flash kernel
too, faster than the tiled path and as lean without a mask, so long sequences
alone are no reason to leave it. But given a boolean ``attn_mask`` it first
builds a float copy of it, 4 bytes per ``(query, key)`` pair (256 MiB at
``L = S = 8192``, 4 GiB at 32768), where the tiled path reads the mask block by
block and stays at a few tens of MiB. A key-padding mask (one row of keys)
costs torch nothing, so it stays on ``"sdpa"``.

A backend asked for explicitly never falls back to another: a combination it
cannot honour (weights from a fused kernel, dropout in the tiled path, a float
mask for the Triton kernel, ...) raises ``ValueError`` naming the backend and
the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention_ref import _inputs, mods
from attention_ref._inputs import batch_shape
from attention_ref._validation import check_probability, fmt_shape
from attention_ref.block_mask import (
    BlockMask,
    check_block_mask,
    create_block_mask,
    mod_sizes,
    resolve_mask_mod,
)
from attention_ref.masks import causal_mask, combine_masks
from attention_ref.sinks import check_sinks, heads_of
from attention_ref.tiled import tiled_attention_prepared

__all__ = ["BACKENDS", "CPU_TILED_MIN_LENGTH", "TRITON_VERIFIED_ON_GPU", "auto_rule", "check_backend", "select_backend"]

#: Every accepted value of ``backend``.
BACKENDS = ("math", "tiled", "sdpa", "triton", "auto")

#: ``"auto"`` picks ``"tiled"`` on CPU for calls with a query-dependent ``attn_mask``
#: from this sequence length (``max(L, S)``) on: there torch's CPU SDPA's float copy
#: of the mask reaches 256 MiB (measured: ``benchmarks/attention_bench.py --preset cpu``).
CPU_TILED_MIN_LENGTH = 8192

#: Blocks of the tiled path when a ``mask_mod`` is given (smaller than the dense defaults, so a
#: narrow band skips more): measured with ``benchmarks/block_sparse_bench.py``.
TILED_MODS_BLOCK_Q = 128
TILED_MODS_BLOCK_K = 128

#: ``"auto"`` with mods on CPU: from this length (``max(L, S)``) on, the tiled path takes a
#: ``score_mod``, and a ``mask_mod`` that empties at least ``CPU_MODS_TILED_MIN_SKIPPED`` of
#: its blocks. Measured with ``benchmarks/block_sparse_bench.py``
#: (``benchmarks/results/block-sparse/``, H=8, D=64, float32): at L = 1024..4096 the tiled
#: path beat SDPA with the materialised mask whenever 44% or more of the blocks were empty
#: (causal, a window; 1.1-4.6x) and lost to it with none empty (0.6-0.85x); with a score_mod
#: it beat the math path 1.3-23x. At 512 keys SDPA was fastest for a mask_mod alone and the
#: math path within 0.8-1.3x of the tiled path for a score_mod.
CPU_MODS_TILED_MIN_LENGTH = 1024
CPU_MODS_TILED_MIN_SKIPPED = 0.4

#: Whether the Triton kernel's tests (``tests/test_triton_flash.py``, bfloat16 and large
#: shapes included) and the GPU benchmark (Triton at least as fast as torch's flash backend)
#: have passed on a real GPU. Until then ``"auto"`` never picks the kernel: it is reached
#: only with ``backend="triton"``. They have (H100, torch 2.11, triton 3.6, 2026-11-26,
#: benchmarks/results/gpu-session-2026-11-26b/ and the h100-2026-11-26 grids; notes/triton.md).
TRITON_VERIFIED_ON_GPU = True

#: Head sizes the Triton kernel is verified for.
TRITON_HEAD_DIMS = (16, 128)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_backend(backend: object) -> str:
    """Check that ``backend`` is one of :data:`BACKENDS`.

    Raises:
        TypeError: not a string.
        ValueError: an unknown name.

    Examples:
        >>> check_backend("tiled")
        'tiled'
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def select_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    is_causal: bool = False,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_weights: bool = False,
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> str:
    """The backend `attention_ref.scaled_dot_product_attention` would run for these arguments.

    Takes the same arguments (and validates them the same way). For
    ``backend="auto"`` it applies the rule of this module's docstring; for an
    explicit name it returns that name, or raises if the backend cannot honour
    the arguments.

    Returns:
        One of ``"math"``, ``"tiled"``, ``"sdpa"``, ``"triton"``.

    Raises:
        ValueError: an unknown backend, or one that cannot honour the
            arguments (the message names it and says why); the validation
            errors of `attention_ref.scaled_dot_product_attention`.

    Examples:
        >>> import torch
        >>> q = torch.randn(1, 8, 16, 64)
        >>> select_backend(q, q, q), select_backend(q, q, q, return_weights=True)
        ('sdpa', 'math')
        >>> long = torch.randn(1, 1, CPU_TILED_MIN_LENGTH, 1)
        >>> band = torch.ones(CPU_TILED_MIN_LENGTH, CPU_TILED_MIN_LENGTH, dtype=torch.bool).tril()
        >>> select_backend(long, long, long), select_backend(long, long, long, band)
        ('sdpa', 'tiled')
    """
    check_probability("dropout_p", dropout_p)
    _inputs.check_bool("return_weights", return_weights)
    _inputs.check_bool("return_lse", return_lse)
    check_backend(backend)
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    _inputs.check_mods(score_mod, mask_mod)
    mask_mod = resolve_mask_mod(mask_mod, block_mask)
    query, key, value, mask, _ = _inputs.prepare(query, key, value, attn_mask, is_causal, None, enable_gqa)
    batch = batch_shape(query, key, value, enable_gqa)
    if block_mask is not None:
        check_block_mask(block_mask, None, batch, query.shape[-2], key.shape[-2])
    if sinks is not None:
        sinks = check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))
    call = ValidatedCall(query, key, value, mask, is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa,
                         return_weights=return_weights, score_mod=score_mod, mask_mod=mask_mod,
                         return_lse=return_lse, sinks=sinks, block_mask=block_mask)
    return resolve_backend(backend, call)


# --- selection -------------------------------------------------------------------------------


@dataclass
class ValidatedCall:
    """One validated call: the tensors and every option a backend may not honour (what `resolve_backend`
    judges and `run_backend` runs)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool = False
    dropout_p: float = 0.0
    enable_gqa: bool = False
    return_weights: bool = False
    score_mod: mods.ScoreMod | None = None
    mask_mod: mods.MaskMod | None = None
    return_lse: bool = False
    #: ``(H,)`` learned sink logits, or one per query broadcastable to ``(..., H, L)``, checked
    #: (`attention_ref.sinks`); only math and tiled take them.
    sinks: torch.Tensor | None = None
    #: Given by the caller (``block_mask=``, checked; then ``mask_mod`` is its mod), or made by
    #: ``"auto"`` when it looked at the mask_mod's sparsity; the tiled path uses it with its blocks.
    block_mask: BlockMask | None = None

    @property
    def has_mods(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


def resolve_backend(backend: str, call: ValidatedCall) -> str:
    """Resolve ``"auto"`` and check that the backend can honour the (validated) call: the dispatcher's first step
    (`select_backend` and `attention_ref.functional.scaled_dot_product_attention` call it; not in ``__all__``)."""
    if backend == "auto":
        chosen = _auto(call)
        if (call.return_lse or call.sinks is not None) and chosen not in ("math", "tiled"):
            return "math"  # rule 1: only these two return the log-sum-exp and take sinks
        return chosen
    reason = _unsupported(backend, call)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this call: {reason}")
    return backend


def _auto(call: ValidatedCall) -> str:
    """The facts `auto_rule` needs, read off the (validated) call."""
    query, key = call.query, call.key
    device = query.device.type
    triton_ok = TRITON_VERIFIED_ON_GPU and device == "cuda" and not call.return_weights and _unsupported(
        "triton", call
    ) is None
    length = max(query.shape[-2], key.shape[-2])
    skipped = None
    if call.block_mask is not None:  # given by the caller: its sparsity is known (for its blocks)
        skipped = call.block_mask.fraction_skipped
    elif (device == "cpu" and call.mask_mod is not None and call.score_mod is None and not call.return_weights
            and call.dropout_p == 0 and CPU_MODS_TILED_MIN_LENGTH <= length < CPU_TILED_MIN_LENGTH):
        # Only the block mask tells the sparsity; made once here, the tiled path reuses it.
        batch = batch_shape(query, key, call.value, call.enable_gqa)
        call.block_mask = create_block_mask(call.mask_mod, *mod_sizes(batch), query.shape[-2], key.shape[-2],
                                            block_q=TILED_MODS_BLOCK_Q, block_k=TILED_MODS_BLOCK_K,
                                            device=query.device)
        skipped = call.block_mask.fraction_skipped
    return auto_rule(
        device_type=device,
        length=length,
        query_dependent_mask=call.mask is not None and not _is_key_padding(call.mask),
        dropout=call.dropout_p > 0,
        return_weights=call.return_weights,
        triton_supported=triton_ok,
        score_mod=call.score_mod is not None,
        mask_mod=call.mask_mod is not None,
        fraction_skipped=skipped,
    )


def auto_rule(
    *,
    device_type: str,
    length: int,
    query_dependent_mask: bool = False,
    dropout: bool = False,
    return_weights: bool = False,
    triton_supported: bool = False,
    score_mod: bool = False,
    mask_mod: bool = False,
    fraction_skipped: float | None = None,
) -> str:
    """The ``"auto"`` rule itself, as a function of the facts it looks at.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ...
        length: ``max(L, S)``.
        query_dependent_mask: an ``attn_mask`` that may differ from one query to
            the next (its dim -2 is not 1), as opposed to a key-padding mask.
        dropout: ``dropout_p > 0``.
        return_weights: the weights are requested.
        triton_supported: the Triton kernel is verified on GPUs
            (``TRITON_VERIFIED_ON_GPU``), available on this device and supports
            the call (dtype, head size, mask kind, mods, no dropout).
        score_mod: a ``score_mod`` is given.
        mask_mod: a ``mask_mod`` is given.
        fraction_skipped: the fraction of the tiled path's blocks that the
            ``mask_mod`` empties; measured only where the rule needs it (CPU, a
            ``mask_mod`` alone, ``CPU_MODS_TILED_MIN_LENGTH <= length <
            CPU_TILED_MIN_LENGTH``), else ``None``.

    Returns:
        The backend ``"auto"`` runs.

    Examples:
        >>> auto_rule(device_type="cuda", length=4096, triton_supported=True, mask_mod=True)
        'triton'
        >>> auto_rule(device_type="cuda", length=4096, triton_supported=True)
        'sdpa'
        >>> auto_rule(device_type="cpu", length=16384, query_dependent_mask=True)
        'tiled'
        >>> auto_rule(device_type="cpu", length=4096, mask_mod=True, fraction_skipped=0.9)
        'tiled'
        >>> auto_rule(device_type="cpu", length=4096, mask_mod=True, fraction_skipped=0.0)
        'sdpa'
        >>> auto_rule(device_type="cpu", length=512, score_mod=True)
        'math'
    """
    if return_weights:
        return "math"  # 1. only the reference forms the weights
    if device_type == "cuda" and triton_supported and (score_mod or mask_mod):
        return "triton"  # 2. our kernel for the mods it implements (torch's kernels would need them materialised)
    if score_mod or mask_mod:  # 3. mods
        if device_type == "cpu" and not dropout:
            if score_mod and length >= CPU_MODS_TILED_MIN_LENGTH:
                return "tiled"  # 3a. torch's SDPA takes no score_mod; the tiled path beats the reference
            if not score_mod and (length >= CPU_TILED_MIN_LENGTH or (
                    length >= CPU_MODS_TILED_MIN_LENGTH and (fraction_skipped or 0.0) >= CPU_MODS_TILED_MIN_SKIPPED)):
                return "tiled"  # 3b. enough empty blocks to skip, or a materialised mask too large
        return "math" if score_mod else "sdpa"  # 3c. a mask_mod alone, materialised for torch's kernels
    if device_type == "cuda":
        return "sdpa"  # 4. torch's fused kernels
    if device_type == "cpu" and length >= CPU_TILED_MIN_LENGTH and query_dependent_mask and not dropout:
        return "tiled"  # 5. no float (L, S) copy of the mask
    return "sdpa"  # 6.


def _unsupported(backend: str, call: ValidatedCall) -> str | None:
    """Why ``backend`` cannot run this call, or ``None`` when it can."""
    query, value, mask, dropout_p = call.query, call.value, call.mask, call.dropout_p
    if backend == "math":
        return None
    if call.sinks is not None and backend != "tiled":
        return (
            "torch's scaled_dot_product_attention takes no learned sinks (sinks=); use backend='math' or 'tiled'"
            if backend == "sdpa" else
            "the Triton kernel takes no learned sinks (sinks=) yet; use backend='math' or 'tiled'"
        )
    if call.return_lse and backend != "tiled":
        return (
            "it does not return the log-sum-exp (return_lse=True): torch's public "
            "scaled_dot_product_attention does not expose it; use backend='math' or 'tiled'"
            if backend == "sdpa" else
            "its log-sum-exp is not exposed (return_lse=True); use backend='math' or 'tiled'"
        )
    if call.return_weights:
        return "it never forms the (L, S) attention weights; use backend='math' (or 'auto') for return_weights=True"
    if backend == "tiled":
        if dropout_p > 0:
            return f"dropout is not implemented in the tiled path (dropout_p={dropout_p}); use backend='math' or 'sdpa'"
        return None
    if backend == "sdpa":
        if call.score_mod is not None:
            return (
                "torch's scaled_dot_product_attention takes no score_mod (a mask_mod it can take, "
                "materialised as a boolean (L, S) mask); use backend='math' or 'tiled'"
            )
        return None
    # backend == "triton"
    if dropout_p > 0:
        return f"the Triton kernel has no dropout (dropout_p={dropout_p}); use backend='math' or 'sdpa'"
    if not _triton_available(query.device):
        return (
            "the Triton kernel needs the triton package and CUDA tensors (or CPU tensors under "
            f"TRITON_INTERPRET=1, Triton's interpreter), got tensors on {query.device}"
            + ("" if importlib.util.find_spec("triton") else " and triton is not installed")
        )
    if query.dtype not in _TRITON_DTYPES:
        return f"the Triton kernel supports float16, bfloat16 and float32, got {query.dtype}"
    E, Ev = query.shape[-1], value.shape[-1]
    if E != Ev:
        return f"the Triton kernel needs the same head size for query/key and value, got E={E}, Ev={Ev}"
    low, high = TRITON_HEAD_DIMS
    if not low <= E <= high:
        return f"the Triton kernel supports head sizes {low}..{high}, got E={E}"
    if mask is not None:
        if mask.dtype != torch.bool:
            return (
                "the Triton kernel takes only boolean key-padding masks, got a float attn_mask "
                "(added to the scores); use backend='math', 'tiled' or 'sdpa'"
            )
        if not _is_key_padding(mask):
            return (
                "the Triton kernel takes only key-padding masks, the same keys for every query "
                f"(broadcastable to (..., 1, S), e.g. (B, 1, 1, S)), got attn_mask of shape "
                f"{fmt_shape(mask.shape)}; use backend='math', 'tiled' or 'sdpa'"
            )
    return _triton_options(call)[1]


def _triton_options(call: ValidatedCall) -> tuple[dict[str, object], str | None]:
    """The kernel's options for the call's mods, or the reason it has none for them.

    The kernel implements `mods.causal` and `mods.sliding_window` (as its
    window) and `mods.softcap` natively; it recognises them by `mods.describe`.
    It has no sink tokens: a window with ``sink_tokens > 0`` is refused (its key
    loop starts at the window's left end and would never reach the sinks).
    """
    options: dict[str, object] = {}
    made = mods.describe(call.mask_mod)
    if call.mask_mod is not None:
        if made is None or made[0] not in ("causal", "sliding_window"):
            return options, (
                "the Triton kernel takes only the mask mods mods.causal and mods.sliding_window "
                "(recognised by mods.describe), got another mask_mod; use backend='math' or 'tiled'"
            )
        args = made[1]
        if made[0] == "sliding_window" and args["sink_tokens"] != 0:
            return options, (
                "the Triton kernel has no sink tokens: it takes mods.sliding_window only with "
                f"sink_tokens=0, got sink_tokens={args['sink_tokens']}; use backend='math' or 'tiled'"
            )
        options["window"] = (None, 0) if made[0] == "causal" else (args["left"], args["right"])
        options["window_offset"] = args["offset"]
    made = mods.describe(call.score_mod)
    if call.score_mod is not None:
        if made is None or made[0] != "softcap":
            return options, (
                "the Triton kernel takes only the score mod mods.softcap (recognised by "
                "mods.describe), got another score_mod; use backend='math' or 'tiled'"
            )
        options["softcap"] = made[1]["cap"]
    return options, None


def _triton_available(device: torch.device) -> bool:
    """The kernel module imports and says it can run on ``device`` now."""
    try:
        triton_flash = importlib.import_module("attention_ref.triton_flash")
    except ImportError:
        return False
    return bool(triton_flash.is_available(device))


# --- running ---------------------------------------------------------------------------------


def run_backend(backend: str, call: ValidatedCall,
                scale: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a non-math backend on a validated call (key/value heads not expanded): the dispatcher's second step
    (`attention_ref.functional.scaled_dot_product_attention` calls it; not in ``__all__``)."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    if backend == "tiled":
        # A block mask (the caller's, or the one "auto" made) brings its block sizes; a mask_mod
        # alone gets the sizes measured for mods; otherwise the tiled path's defaults.
        if call.block_mask is not None:
            blocks = {"block_q": call.block_mask.block_q, "block_k": call.block_mask.block_k}
        elif call.mask_mod is not None:
            blocks = {"block_q": TILED_MODS_BLOCK_Q, "block_k": TILED_MODS_BLOCK_K}
        else:
            blocks = {}
        return tiled_attention_prepared(query, key, value, mask, is_causal=call.is_causal, scale=scale,
                                        enable_gqa=call.enable_gqa, score_mod=call.score_mod, mask_mod=call.mask_mod,
                                        block_mask=call.block_mask, return_lse=call.return_lse, sinks=call.sinks,
                                        **blocks)
    if backend == "sdpa":
        if call.mask_mod is not None:  # materialised: a boolean (..., L, S) mask, combined with attn_mask
            batch = batch_shape(query, key, value, call.enable_gqa)
            # at least (L, S) bools, and torch's kernels may make an additive float copy of it
            _inputs.check_dense("backend='sdpa' with a mask_mod", (query.shape[-2], key.shape[-2]), torch.float32,
                                query.device, copies=2, noun="the mask_mod's (L, S) mask",
                                instead="backend='tiled' evaluates the mod block by block, never forming (L, S)")
            keep = mods.apply_mask_mod(call.mask_mod, batch, query.shape[-2], key.shape[-2], query.device)
            mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool
                                              else mask.masked_fill(~keep, float("-inf")))
        return _sdpa(query, key, value, mask, is_causal=call.is_causal, scale=scale, dropout_p=call.dropout_p,
                     enable_gqa=call.enable_gqa)
    if backend == "triton":
        options, _ = _triton_options(call)
        return _triton(query, key, value, mask, is_causal=call.is_causal, scale=scale, enable_gqa=call.enable_gqa,
                       **options)
    raise AssertionError(f"unreachable: backend {backend!r}")  # resolve_backend only returns known names


def _as_4d(t: torch.Tensor, batch: tuple[int, ...], heads: int) -> torch.Tensor:
    """``(..., T, D)`` broadcast to ``(*batch[:-1], heads, T, D)`` and flattened to ``(N, heads, T, D)``."""
    prefix = batch[:-1]
    # (..., T, D) -> (*prefix, heads, T, D) -> (N, heads, T, D); copies only broadcast dims.
    return t.expand(*prefix, heads, *t.shape[-2:]).reshape(math.prod(prefix), heads, *t.shape[-2:])


def _mask_4d(mask: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """A mask broadcastable to ``(*batch, L, S)`` as a 4-D mask broadcastable to ``(N, H, L, S)``.

    Size-1 dims stay size 1 (torch broadcasts them), so no ``(L, S)`` copy is made
    for a key-padding mask.
    """
    nd = len(batch) + 2
    m = mask.reshape((1,) * (nd - mask.dim()) + tuple(mask.shape))  # left-pad with 1s to (*batch', L', S')
    if not batch:
        return m.reshape(1, 1, *m.shape)  # (L', S') -> (1, 1, L', S')
    split = len(batch) - 1  # dims in front of the heads
    tail = tuple(m.shape[split:])  # (H', L', S')
    if all(d == 1 for d in m.shape[:split]):
        return m.reshape(1, *tail)
    return m.expand(*batch[:-1], *tail).reshape(math.prod(batch[:-1]), *tail)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    enable_gqa: bool,
    fix_fully_masked: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the arguments translated.

    - Inputs become 4-D ``(N, H, L, E)``: torch 2.13's CPU flash kernel runs only on 4-D
      inputs (others fall back to its math kernel, which forms the ``(L, S)`` scores;
      torch 2.14 takes 3-D inputs to flash too).
    - Bool masks keep their polarity (``True`` = takes part in both).
    - torch refuses ``attn_mask`` together with ``is_causal=True``: the causal mask
      is folded into ``attn_mask`` (AND for bool, ``-inf`` added for float).
    - Fully masked rows: torch 2.13's CPU kernels give 0 (tested); on other
      devices (``fix_fully_masked`` defaults to True there) such rows are unmasked
      before the call, so no kernel sees an empty row, and zeroed after it.
    """
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    out_batch = batch_shape(query, key, value, enable_gqa)  # the output's leading dims
    batch = out_batch or (1,)
    H = batch[-1]
    q4 = _as_4d(query, batch, H)  # (N, H, L, E)
    kv_heads = key.shape[-3] if enable_gqa else H
    k4, v4 = _as_4d(key, batch, kv_heads), _as_4d(value, batch, kv_heads)  # (N, Hkv, S, E|Ev)
    if is_causal and mask is not None:
        mask = combine_masks(causal_mask(L, S, device=query.device), mask)
        is_causal = False
    mask4 = _mask_4d(mask, batch) if mask is not None else None
    if fix_fully_masked is None:
        fix_fully_masked = query.device.type != "cpu"
    empty_rows = None
    if fix_fully_masked and mask4 is not None and S > 0:
        allowed = mask4 if mask4.dtype == torch.bool else mask4 != float("-inf")
        empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (N', H', L', 1)
        if bool(empty_rows.any()):
            mask4 = mask4 | empty_rows if mask4.dtype == torch.bool else mask4.masked_fill(empty_rows, 0.0)
        else:
            empty_rows = None
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=mask4, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa and kv_heads != H,
    )  # (N, H, L, Ev)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out.reshape(*out_batch, L, Ev)


def _is_key_padding(mask: torch.Tensor) -> bool:
    """The mask keeps the same keys for every query: broadcastable to ``(..., 1, S)``."""
    return mask.dim() < 2 or mask.shape[-2] == 1


def _triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    **options: object,
) -> torch.Tensor:
    """Call `attention_ref.triton_flash.flash_attention` on ``(N, h, L|S, D)`` tensors.

    Grouped-query heads (``enable_gqa``) with a mask that is the same for every
    head keep the heads on the kernel's head axis: ``(N, H, L, D)`` queries and
    ``(N, Hkv, S, D)`` keys and values, read in place (query head ``h`` uses
    key/value head ``h // (H / Hkv)``). Otherwise every leading dim (batch and
    heads) goes to the kernel's batch axis, ``h = 1``, so a key-padding mask may
    differ per batch entry and per head (grouped heads are expanded first). The
    mask becomes the kernel's ``(N, S)`` ``key_padding_mask``.
    """
    from attention_ref.triton_flash import flash_attention

    grouped = enable_gqa and (mask is None or mask.dim() < 3 or mask.shape[-3] == 1)
    if enable_gqa and not grouped:  # a per-head mask: as many key/value heads as query heads
        key, value = _inputs.expand_kv_heads(query, key, "key"), _inputs.expand_kv_heads(query, value, "value")
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    kept = 1 if grouped else 0  # leading dims kept on the kernel's head axis
    if grouped:
        mask_batch = mask.shape[:-3] if mask is not None and mask.dim() > 3 else ()
        batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3], mask_batch))
    else:
        batch = batch_shape(query, key, value, False)
    N = math.prod(batch)

    def to_kernel(t: torch.Tensor) -> torch.Tensor:
        # (..., [heads,] L|S, D) -> (*batch, [heads,] L|S, D) -> (N, heads or 1, L|S, D);
        # copies only broadcast dims
        tail = t.shape[t.dim() - 2 - kept:]
        return t.expand(*batch, *tail).reshape(N, tail[0] if kept else 1, *t.shape[-2:])

    key_padding = None
    if mask is not None:
        # (..., [1,] 1, S') -> (*batch, [1,] 1, S) -> (N, S): one row of keys per kernel batch entry
        key_padding = mask.expand(*batch, *(1,) * kept, 1, S).reshape(N, S)
    # The kernel itself gives 0 (and zero gradients) on rows where no key takes part.
    out = flash_attention(to_kernel(query), to_kernel(key), to_kernel(value), is_causal=is_causal, scale=scale,
                          key_padding_mask=key_padding, **options)  # type: ignore[arg-type]
    return out.reshape(*batch, *query.shape[query.dim() - 2 - kept:-2], L, Ev)
