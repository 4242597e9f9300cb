r"""FP8 and INT8 quantization with one rule on every device, descale layouts, and an FP8 attention oracle.

FP8 attention as FlashAttention-3/4, FlashInfer and vLLM ship it has one contract:
the inputs arrive already quantized, ``x8 = satfinite_RNE(x / s)``, with float32
*descales* ``s`` beside them, and the kernel computes attention of the
dequantized tensors ``x8 * s``. The descales of Q and K multiply the softmax
scale, the one of V multiplies the normalized output:

$$
O = \operatorname{softmax}\!\big(\mathrm{scale}\; s_q s_k\; Q_8 K_8^\top\big)\, V_8\; s_v .
$$

**The quantizer** (`round_to_fp8`, `quantize_fp8`) clamps to the format's largest
finite value first and then rounds to nearest, ties to even, by the format's bit
rule: the step of the grid at ``|y|`` is ``2^(max(floor(log2|y|), e_min) - m)``
(``m`` mantissa bits, ``e_min`` the smallest normal exponent), and ``y / step``
is rounded with ``torch.round`` (ties to even) in float64, where it is exact.
That is what the kernels' ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)``
does, and what a cast ``x.to(torch.float8_e4m3fn)`` does only by accident:
its overflow depends on the format, the device and the release (on this
package's torch 2.13 CPU build ``470.0`` casts to 448 in e4m3fn, ``248.0`` to
NaN in e4m3fnuz, ``70000.0`` to inf in e5m2; the c10 software path, ported by
this project's research note, gives NaN above 464 in e4m3fn; CUDA builds
before 13.2 use that path too). So nothing here relies on a cast:
values come back as float tensors on the format's grid, and `to_torch_float8`
casts them afterwards, exactly, because they are representable.

| format | bits (sign-exponent-mantissa) | bias | largest finite | smallest normal | subnormal step | NaN | inf |
| --- | --- | --- | --- | --- | --- | --- | --- |
| ``e4m3fn`` | 1-4-3 | 7 | 448 | 2^-6 | 2^-9 | ``S.1111.111`` | none |
| ``e5m2`` | 1-5-2 | 15 | 57344 | 2^-14 | 2^-16 | ``S.11111.xx`` (xx ≠ 0) | ``S.11111.00`` |
| ``e4m3fnuz`` | 1-4-3 | 8 | 240 | 2^-7 | 2^-10 | ``1.0000.000`` only | none |
| ``e5m2fnuz`` | 1-5-2 | 16 | 57344 | 2^-15 | 2^-17 | ``1.00000.00`` only | none |

Saturation: ``±inf`` and every ``|x|`` above the largest finite value give
``±max`` (``__NV_SATFINITE``); NaN stays NaN. In the ``fnuz`` formats zero has
no sign (``-0`` gives ``+0``).

**Scales** (`quantize_fp8`'s ``granularity``), for a tensor ``(B, H, L, E)``
(the package's heads-first layout; FlashAttention's own is ``(B, L, H, E)``):

| granularity | descale shape | who reads it |
| --- | --- | --- |
| ``"tensor"`` | ``()`` | vLLM ``q/k/v_scale = [1]``, FlashInfer's float ``k_scale``/``v_scale`` |
| ``"head"`` | ``(H,)`` | vLLM per attention head, FlashInfer's FA3 backend |
| ``"batch_head"`` | ``(B, H)`` | torchao ``_quantize_per_head``; FA3/FA4 for K and V (``H = Hkv``) |
| ``"batch_kvhead"`` | ``(B, Hkv)`` | FA3/FA4's ``q_descale``: one per KV group of query heads |
| ``"token_head"`` | ``(B, H, L)`` | per token and head (FlashInfer PR #5272) |
| ``"block"`` | ``(B, H, ceil(L / block_size))`` | per block of tokens |

`convert_descale` moves descales between these layouts: to a finer one always,
to a coarser one only where every cell holds one value, and it refuses by name
otherwise (per-query-head Q descales that differ inside a KV group cannot
become FlashAttention-3's ``(B, Hkv)`` ``q_descale``).

**INT8** (`quantize_int8_blocks`) follows SageAttention
(``sageattention/triton/quant_per_block.py``): one scale ``amax / 127`` per
block of tokens, values rounded half away from zero. `smooth_k` subtracts the
mean key first, which changes no softmax (proved in its docstring, tested).

**The oracle** `fp8_attention` computes the contract above in float64, and can
emulate the kernels' quantization of the probabilities P (FA3/FA4: P scaled by
``2^8`` and rounded to e4m3; SageAttention: scaled into ``(0, 448]``), with
the error bound that emulation obeys.

What is exact and what is not: the quantizers, the grid, the scales' shapes and
the dequantized inputs are bit-exact against any kernel that receives the same
bytes and descales; a kernel's *output* differs from `fp8_attention` by its
float32 sums, ``exp2`` and output rounding, which no reference reproduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attention_ref._validation import fmt_shape
from attention_ref.functional import attention_weights, scaled_dot_product_attention

__all__ = [
    "FORMATS",
    "GRANULARITIES",
    "FP8Format",
    "convert_descale",
    "decode_fp8",
    "dequantize_fp8",
    "dequantize_int8_blocks",
    "expand_descale",
    "fp8_attention",
    "quantize_fp8",
    "quantize_int8_blocks",
    "round_to_fp8",
    "smooth_k",
    "to_flash_attn3",
    "to_torch_float8",
]


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit floating-point format: its bit layout and the numbers that follow from it.

    Attributes:
        name: ``"e4m3fn"``, ``"e5m2"``, ``"e4m3fnuz"`` or ``"e5m2fnuz"``.
        exponent_bits: bits of the exponent field.
        mantissa_bits: bits of the mantissa (fraction) field, ``m``.
        bias: the exponent bias.
        max: the largest finite value.
        fnuz: finite-only with an unsigned zero: the one NaN is ``0x80`` and there is no inf.
        torch_dtype: the name of torch's dtype of this format.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    fnuz: bool
    torch_dtype: str

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value, ``2^(1 - bias)``."""
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value, the step of the subnormal range: ``2^(1 - bias - m)``."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """``u = 2^-(m + 1)``: above the subnormal range, rounding moves a value by at most ``u·|x|``."""
        return 2.0 ** -(self.mantissa_bits + 1)


#: The FP8 formats by name (the table of the module docstring).
FORMATS: dict[str, FP8Format] = {
    "e4m3fn": FP8Format("e4m3fn", 4, 3, 7, 448.0, False, "float8_e4m3fn"),
    "e5m2": FP8Format("e5m2", 5, 2, 15, 57344.0, False, "float8_e5m2"),
    "e4m3fnuz": FP8Format("e4m3fnuz", 4, 3, 8, 240.0, True, "float8_e4m3fnuz"),
    "e5m2fnuz": FP8Format("e5m2fnuz", 5, 2, 16, 57344.0, True, "float8_e5m2fnuz"),
}

#: The scale granularities `quantize_fp8` takes (the second table of the module docstring).
GRANULARITIES = ("tensor", "head", "batch_head", "batch_kvhead", "token_head", "block")

_TARGET_NAMES = {
    "tensor": "one descale per tensor ()",
    "head": "one descale per head (H,)",
    "batch_head": "one descale per (batch, head) (B, H)",
    "batch_kvhead": "FlashAttention-3's one descale per (batch, KV head) (B, Hkv)",
    "token_head": "one descale per (batch, head, token) (B, H, L)",
    "block": "one descale per (batch, head, block of tokens) (B, H, ceil(L / block_size))",
}


def _format(fmt: object, name: str = "fmt") -> FP8Format:
    if isinstance(fmt, FP8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"{name} must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]  # type: ignore[index]


def decode_fp8(bits: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """The float64 values of 8-bit patterns, decoded by the format's bit rule (no torch cast).

    ``value = (-1)^s · 2^(e - bias) · (1 + f / 2^m)`` for an exponent field ``e > 0``,
    ``(-1)^s · 2^(1 - bias) · f / 2^m`` for ``e = 0`` (subnormal), with the NaN and
    inf patterns of the module docstring's table.

    Args:
        bits: an integer tensor of values in ``[0, 255]`` (``torch.uint8``, or any
            integer dtype), any shape.
        fmt: a name of `FORMATS`.

    Returns:
        float64, ``bits``' shape.

    Raises:
        TypeError: ``bits`` not an integer tensor.
        ValueError: an unknown ``fmt``, a value outside ``[0, 255]``.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import decode_fp8
        >>> decode_fp8(torch.tensor([0x7E, 0x7F, 0x01, 0xB8]), "e4m3fn").tolist()
        [448.0, nan, 0.001953125, -1.0]
        >>> decode_fp8(torch.tensor([0x7B, 0x7C, 0x80]), "e5m2").tolist()
        [57344.0, inf, -0.0]
    """
    f = _format(fmt)
    if not isinstance(bits, torch.Tensor) or bits.dtype.is_floating_point or bits.dtype == torch.bool:
        raise TypeError(f"bits must be an integer tensor, got {getattr(bits, 'dtype', type(bits).__name__)}")
    b = bits.to(torch.int64)
    if b.numel() and (b.min() < 0 or b.max() > 255):
        raise ValueError(f"bits must lie in [0, 255], got values in [{int(b.min())}, {int(b.max())}]")
    m = f.mantissa_bits
    sign = torch.where(b >= 128, -1.0, 1.0).to(torch.float64)
    exponent = (b >> m) & ((1 << f.exponent_bits) - 1)
    fraction = (b & ((1 << m) - 1)).to(torch.float64)
    normal = (1.0 + fraction / 2**m) * torch.exp2((exponent - f.bias).to(torch.float64))
    subnormal = fraction * f.min_subnormal
    value = sign * torch.where(exponent > 0, normal, subnormal)
    top = (1 << f.exponent_bits) - 1
    if f.fnuz:
        value = torch.where(b == 0x80, float("nan"), value)
    elif f.exponent_bits == 4:  # e4m3fn: the all-ones pattern is NaN, the rest of the top binade finite
        value = torch.where((exponent == top) & (fraction == 2**m - 1), float("nan"), value)
    else:  # e5m2: IEEE's inf and NaN
        value = torch.where(exponent == top, torch.where(fraction == 0, sign * float("inf"), float("nan")), value)
    return value


def round_to_fp8(x: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """``x`` clamped to ``±max`` and rounded to nearest, ties to even, on the format's grid.

    The rule of the module docstring, in float64 (where ``x / step`` is exact):
    ``step = 2^(max(floor(log2|x|), 1 - bias) - m)``, ``q = sign(x) · round(|x| / step) · step``
    with ``round`` ties-to-even. ``±inf`` saturates to ``±max``, NaN stays NaN.

    Args:
        x: a floating-point tensor, any shape and dtype.
        fmt: a name of `FORMATS`.

    Returns:
        float64, ``x``'s shape, every value on the grid (or NaN).

    Raises:
        TypeError: ``x`` not a floating-point tensor.
        ValueError: an unknown ``fmt``.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import round_to_fp8
        >>> round_to_fp8(torch.tensor([1.0625, 1.1875, 470.0, -1e9, 2.0**-10]), "e4m3fn").tolist()
        [1.0, 1.25, 448.0, -448.0, 0.0]
    """
    f = _format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    y = x.to(torch.float64).clamp(-f.max, f.max)  # SATFINITE: ±inf and |x| > max give ±max; NaN stays
    _, exponent = torch.frexp(y.abs())  # |y| = mantissa · 2^exponent, mantissa in [0.5, 1): floor(log2|y|) = exponent - 1
    binade = torch.clamp(exponent - 1, min=1 - f.bias)  # the subnormal range shares the smallest normal binade's step
    step = torch.exp2((binade - f.mantissa_bits).to(torch.float64))
    q = torch.round(y / step) * step  # |y| / step < 2^(m+1) + 1: exact in float64; round() is ties-to-even
    if f.fnuz:
        q = q + 0.0  # no signed zero: -0 + 0 = +0
    return q


def to_torch_float8(q: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """Values already on the format's grid as torch's float8 dtype: an exact cast.

    Args:
        q: a floating-point tensor whose every value is on ``fmt``'s grid or NaN
            (`round_to_fp8`'s or `quantize_fp8`'s output).
        fmt: a name of `FORMATS`.

    Returns:
        ``q`` as ``torch.float8_<fmt>``, each value unchanged.

    Raises:
        ValueError: an unknown ``fmt``, a value off the grid (the cast would round it).
        TypeError: this torch has no such dtype.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import round_to_fp8, to_torch_float8
        >>> q8 = to_torch_float8(round_to_fp8(torch.tensor([0.3, 500.0])), "e4m3fn")
        >>> q8.dtype, q8.to(torch.float64).tolist()
        (torch.float8_e4m3fn, [0.3125, 448.0])
    """
    f = _format(fmt)
    dtype = getattr(torch, f.torch_dtype, None)
    if dtype is None:
        raise TypeError(f"torch {torch.__version__} has no torch.{f.torch_dtype}")
    _check_on_grid("q", q, f)
    return q.to(dtype)


def _check_on_grid(name: str, q: torch.Tensor, f: FP8Format, *, allow_nan: bool = True) -> None:
    value = q.to(torch.float64)
    nan = torch.isnan(value)
    if not allow_nan and nan.any():
        raise ValueError(f"{name} holds NaN at {tuple(int(i) for i in nan.nonzero()[0])}")
    off = ~nan & (round_to_fp8(value, f.name) != value)
    if off.any():
        where = tuple(int(i) for i in off.nonzero()[0])
        raise ValueError(
            f"{name} must hold values on the {f.name} grid (quantize_fp8's output), got {value[where].item()!r} at "
            f"{where}, whose nearest {f.name} value is {round_to_fp8(value[where], f.name).item()!r}"
        )


def _check_granularity(granularity: object, x: torch.Tensor, block_size: int | None, kv_heads: int | None) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if granularity != "tensor" and x.dim() != 4:
        raise ValueError(
            f"granularity={granularity!r} needs a tensor (B, H, L, E), got {x.dim()} dims with shape {fmt_shape(x.shape)}"
        )
    if granularity == "block" and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"granularity='block' needs block_size, a positive int, got {block_size!r}")
    if granularity == "batch_kvhead":
        heads = x.shape[1]
        if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(
                f"granularity='batch_kvhead' needs kv_heads, a positive int dividing H={heads}, got {kv_heads!r}"
            )


def _cell_amax(x: torch.Tensor, granularity: str, block_size: int | None, kv_heads: int | None) -> torch.Tensor:
    """``max |x|`` over each cell of the granularity: a tensor of the descale's shape."""
    a = x.to(torch.float64).abs()
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    B, H, L, E = a.shape
    if granularity == "head":
        return a.amax(dim=(0, 2, 3))  # (B, H, L, E) -> (H,)
    if granularity == "batch_head":
        return a.amax(dim=(2, 3))  # (B, H, L, E) -> (B, H)
    if granularity == "batch_kvhead":
        # (B, H, L, E) -> (B, Hkv, g, L, E) -> (B, Hkv): query head h belongs to KV head h // g
        return a.reshape(B, kv_heads, H // kv_heads, L, E).amax(dim=(2, 3, 4))
    if granularity == "token_head":
        return a.amax(dim=3)  # (B, H, L, E) -> (B, H, L)
    blocks = -(-L // block_size)
    padded = torch.nn.functional.pad(a, (0, 0, 0, blocks * block_size - L))  # zeros change no max
    return padded.reshape(B, H, blocks, block_size * E).amax(dim=3)  # (B, H, n, block_size, E) -> (B, H, n)


def _descale_shape(shape: tuple[int, ...], granularity: str, block_size: int | None, kv_heads: int | None
                   ) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    B, H, L = shape[:3]
    return {"head": (H,), "batch_head": (B, H), "batch_kvhead": (B, kv_heads or H), "token_head": (B, H, L),
            "block": (B, H, -(-L // (block_size or 1)))}[granularity]


def expand_descale(descale: torch.Tensor | float, shape: tuple[int, ...], granularity: str = "tensor", *,
                   block_size: int | None = None) -> torch.Tensor:
    """A descale of any granularity as one value per ``(batch, head, token)``: float64 ``(B, H, L, 1)``.

    Multiplying a quantized ``(B, H, L, E)`` tensor by the result dequantizes it.

    Args:
        descale: a number or a tensor of the granularity's shape (the module
            docstring's table); for ``"batch_kvhead"`` ``(B, Hkv)``, the KV group
            of query head ``h`` being ``h // (H // Hkv)`` (FlashAttention-3's
            ``repeat(q_descale, "b h -> b 1 (h g) 1")``).
        shape: ``(B, H, L, E)`` of the quantized tensor (``"tensor"`` takes any shape).
        granularity: one of `GRANULARITIES`.
        block_size: tokens per block, for ``"block"``.

    Returns:
        float64 ``(B, H, L, 1)``; for ``"tensor"`` a 0-dim tensor.

    Raises:
        ValueError: an unknown granularity, a descale of the wrong shape.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import expand_descale
        >>> expand_descale(torch.tensor([[1.0, 2.0]]), (1, 4, 1, 8), "batch_kvhead").flatten().tolist()
        [1.0, 1.0, 2.0, 2.0]
    """
    d = torch.as_tensor(descale, dtype=torch.float64)
    shape = tuple(shape)
    kv_heads = None
    if granularity == "batch_kvhead":
        if d.dim() != 2:
            raise ValueError(f"a 'batch_kvhead' descale must have shape (B, Hkv), got {fmt_shape(d.shape)}")
        kv_heads = d.shape[1]
    _check_granularity(granularity, torch.empty(shape, device="meta"), block_size, kv_heads)
    expected = _descale_shape(shape, granularity, block_size, kv_heads)
    if tuple(d.shape) != expected:
        raise ValueError(
            f"a {granularity!r} descale for a tensor {fmt_shape(shape)} must have shape {fmt_shape(expected)}, "
            f"got {fmt_shape(d.shape)}"
        )
    if granularity == "tensor":
        return d
    B, H, L = shape[:3]
    if granularity == "head":
        return d.reshape(1, H, 1, 1).expand(B, H, L, 1)
    if granularity == "batch_head":
        return d.reshape(B, H, 1, 1).expand(B, H, L, 1)
    if granularity == "batch_kvhead":
        return d.repeat_interleave(H // kv_heads, dim=1).reshape(B, H, 1, 1).expand(B, H, L, 1)  # (B, Hkv) -> (B, H)
    if granularity == "token_head":
        return d.unsqueeze(-1)  # (B, H, L) -> (B, H, L, 1)
    return d.repeat_interleave(block_size, dim=2)[:, :, :L].unsqueeze(-1)  # (B, H, n) -> (B, H, L, 1)


def quantize_fp8(
    x: torch.Tensor,
    fmt: str = "e4m3fn",
    scale: torch.Tensor | float | None = None,
    *,
    granularity: str = "tensor",
    block_size: int | None = None,
    kv_heads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to FP8: ``q = round_to_fp8(x / scale)``, so that ``x ≈ q * scale``.

    The scale is a *descale* (the kernels' ``q_descale``, vLLM's ``k_scale``):
    it multiplies the stored values back. Without ``scale`` it is
    ``amax / fmt.max`` over each cell of the granularity (``1.0`` for a cell of
    zeros), rounded to float32 as the kernels take it; ``x / scale`` may then
    land a little above ``max``, which the clamp absorbs. The division is done
    in float64. A kernel that divides in float32 first rounds twice and can land
    one step away at a midpoint; to reproduce it bit for bit, pass its float32
    quotient with ``scale=1.0``.

    Per element, ``|x - q·scale| ≤ scale · step(x/scale) / 2`` inside the range
    (``step`` the grid step at ``|x/scale|``: ``≤ scale · max(u·|x/scale|, min_subnormal / 2)``),
    and ``|x| - max·scale`` beyond it.

    Args:
        x: floating point; ``(B, H, L, E)`` for every granularity but ``"tensor"``.
        fmt: a name of `FORMATS`.
        scale: the descale to use, of the granularity's shape (a number for
            ``"tensor"``); ``None`` computes it from ``x``.
        granularity: one of `GRANULARITIES` (the module docstring's table).
        block_size: tokens per block, for ``"block"``.
        kv_heads: ``Hkv``, for ``"batch_kvhead"``: one scale per group of
            ``H // Hkv`` consecutive query heads.

    Returns:
        ``(q, scale)``: float64 ``q`` of ``x``'s shape, on the grid; float32 ``scale``
        of the granularity's shape (the given one, as float32, when passed).

    Raises:
        TypeError: ``x`` not floating point.
        ValueError: an unknown format or granularity, a missing ``block_size`` or
            ``kv_heads``, a ``scale`` of the wrong shape, or not finite and > 0.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import quantize_fp8
        >>> q, s = quantize_fp8(torch.tensor([0.5, -3.0, 896.0]), "e4m3fn")
        >>> s.item(), q.tolist()
        (2.0, [0.25, -1.5, 448.0])

        FlashAttention-3's ``q_descale``, one per (batch, KV head):

        >>> q, s = quantize_fp8(torch.randn(2, 6, 5, 8), granularity="batch_kvhead", kv_heads=3)
        >>> s.shape
        torch.Size([2, 3])
    """
    f = _format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    _check_granularity(granularity, x, block_size, kv_heads)
    if scale is None:
        amax = _cell_amax(x, granularity, block_size, kv_heads)
        scale = torch.where(amax > 0, amax / f.max, torch.ones_like(amax)).to(torch.float32)
    else:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bad.any():
            raise ValueError(f"scale must be finite and > 0 everywhere, got {scale[bad][0].item()!r}")
    expanded = expand_descale(scale, tuple(x.shape), granularity, block_size=block_size)
    return round_to_fp8(x.to(torch.float64) / expanded, f.name), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, granularity: str = "tensor", *,
                   block_size: int | None = None) -> torch.Tensor:
    """``q * scale`` in float64, the scale broadcast along its granularity (`expand_descale`).

    Args:
        q: quantized values (float, or torch's float8 dtypes), ``(B, H, L, E)``
            for every granularity but ``"tensor"``.
        scale: the descale, of the granularity's shape.
        granularity: one of `GRANULARITIES`.
        block_size: tokens per block, for ``"block"``.

    Returns:
        float64, ``q``'s shape.

    Raises:
        ValueError: an unknown granularity or a scale of the wrong shape.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import dequantize_fp8, quantize_fp8
        >>> x = torch.randn(2, 3, 7, 4)
        >>> q, s = quantize_fp8(x, "e4m3fn", granularity="block", block_size=4)
        >>> bool(((dequantize_fp8(q, s, "block", block_size=4) - x).abs() <= x.abs() / 16 + 1e-9).all())
        True
    """
    return q.to(torch.float64) * expand_descale(scale, tuple(q.shape), granularity, block_size=block_size)


def convert_descale(
    descale: torch.Tensor | float,
    source: str,
    target: str,
    *,
    shape: tuple[int, ...],
    kv_heads: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """The same descales in another layout, or a ``ValueError`` naming what the target cannot express.

    The descale of every ``(batch, head, token)`` is read off ``source``
    (`expand_descale`); the target keeps one per cell, which must then hold one
    value (compared exactly). Coarse to fine always works (vLLM's per-tensor
    scale ``expand``-ed to FlashAttention-3's ``(B, Hkv)``); fine to coarse only
    where the values agree.

    Args:
        descale: a number or a tensor of ``source``'s shape.
        source: the granularity it has, one of `GRANULARITIES`.
        target: the granularity wanted.
        shape: ``(B, H, L, E)`` of the quantized tensor it belongs to.
        kv_heads: ``Hkv``, for a ``"batch_kvhead"`` target (a source infers it).
        block_size: tokens per block, for ``"block"`` (source or target).

    Returns:
        float32 of ``target``'s shape.

    Raises:
        ValueError: an unknown granularity or a descale of the wrong shape; or
            descales that differ inside one cell of the target (the message
            names the target, the cell and two of its values).

    Examples:
        >>> import torch
        >>> from attention_ref.quant import convert_descale
        >>> convert_descale(0.5, "tensor", "batch_kvhead", shape=(2, 4, 3, 8), kv_heads=2).tolist()
        [[0.5, 0.5], [0.5, 0.5]]
        >>> convert_descale(torch.tensor([1.0, 2.0, 3.0, 4.0]), "head", "batch_kvhead", shape=(1, 4, 3, 8), kv_heads=2)
        Traceback (most recent call last):
        ...
        ValueError: cannot express these 'head' descales as 'batch_kvhead' (FlashAttention-3's one descale per (batch, KV head) (B, Hkv)): batch 0, KV head 0 (query heads 0..1) holds 1.0 and 2.0; requantize that cell with one scale
    """
    shape = tuple(shape)
    full = expand_descale(descale, shape, source, block_size=block_size if source == "block" else None)
    B, H, L = shape[:3]
    full = full.expand(B, H, L, 1).squeeze(-1) if full.dim() else full.expand(B, H, L)  # (B, H, L)
    probe = torch.empty(shape, device="meta")
    _check_granularity(target, probe, block_size, kv_heads)
    if target == "tensor":
        cells, where = full.reshape(1, -1), (lambda i: "the tensor")
    elif target == "head":
        cells, where = full.permute(1, 0, 2).reshape(H, -1), (lambda i: f"head {i}")
    elif target == "batch_head":
        cells, where = full.reshape(B * H, L), (lambda i: f"batch {i // H}, head {i % H}")
    elif target == "batch_kvhead":
        g = H // kv_heads
        cells = full.reshape(B * kv_heads, g * L)  # (B, Hkv, g, L): the group's heads are consecutive
        where = (lambda i: f"batch {i // kv_heads}, KV head {i % kv_heads} (query heads "
                           f"{(i % kv_heads) * g}..{(i % kv_heads) * g + g - 1})")
    elif target == "token_head":
        return full.to(torch.float32)
    else:
        n = -(-L // block_size)
        padded = torch.cat([full, full[:, :, -1:].expand(B, H, n * block_size - L)], dim=2)  # repeat the last token
        cells = padded.reshape(B * H * n, block_size)
        where = (lambda i: f"batch {i // (H * n)}, head {i // n % H}, block {i % n}")
    differs = (cells != cells[:, :1]).any(dim=1)
    if differs.any():
        i = int(differs.nonzero()[0])
        j = int((cells[i] != cells[i, 0]).nonzero()[0])
        raise ValueError(
            f"cannot express these {source!r} descales as {target!r} ({_TARGET_NAMES[target]}): {where(i)} holds "
            f"{cells[i, 0].item()!r} and {cells[i, j].item()!r}; requantize that cell with one scale"
        )
    out_shape = _descale_shape(shape, target, block_size, kv_heads)
    return cells[:, 0].reshape(out_shape).to(torch.float32)


def to_flash_attn3(descale: torch.Tensor | float, granularity: str, *, shape: tuple[int, ...], kv_heads: int,
                   block_size: int | None = None) -> torch.Tensor:
    """A descale as FlashAttention-3/4 read it: float32 ``(B, Hkv)`` (`convert_descale` to ``"batch_kvhead"``).

    For Q, ``shape`` is the query's ``(B, H, L, E)``: one descale serves the
    ``H // Hkv`` query heads of a KV group, so per-query-head Q descales that
    differ inside a group are refused. For K and V, ``shape`` is ``(B, Hkv, S, E)``.

    Args:
        descale: a number or a tensor of ``granularity``'s shape.
        granularity: the layout it has, one of `GRANULARITIES`.
        shape: ``(B, H, L, E)`` of the tensor it belongs to.
        kv_heads: ``Hkv``.
        block_size: tokens per block, for a ``"block"`` source.

    Returns:
        float32 ``(B, Hkv)``.

    Raises:
        ValueError: what `convert_descale` refuses.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import to_flash_attn3
        >>> to_flash_attn3(torch.tensor([2.0, 2.0, 3.0, 3.0]), "head", shape=(1, 4, 5, 8), kv_heads=2).tolist()
        [[2.0, 3.0]]
    """
    return convert_descale(descale, granularity, "batch_kvhead", shape=shape, kv_heads=kv_heads,
                           block_size=block_size)


def smooth_k(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""SageAttention's smoothing of K: the mean key of each (batch, head) subtracted.

    ``km = key.mean(dim=-2, keepdim=True)``; every score of query row ``i``
    moves by the same ``scale · q_i · km``,

    $$
    \mathrm{scale}\; q_i \cdot (k_j - \bar k) = \mathrm{scale}\; q_i \cdot k_j - \mathrm{scale}\; q_i \cdot \bar k ,
    $$

    a constant per row, which the softmax removes: the weights and the output
    are unchanged, and ``lse(k) = lse(k - km) + scale · q · km``
    (SageAttention's ``lse_correction``). What changes is the range the INT8
    blocks must cover: keys that share a large common offset quantize with a
    scale set by the offset, their differences (what the softmax sees) lost.
    SageAttention's ``sageattn_varlen`` takes one mean over every packed
    sequence; this is the per-sequence one.

    Args:
        key: ``(..., S, E)``, floating point.

    Returns:
        ``(key - km, km)``, ``km`` ``(..., 1, E)``; in ``key``'s dtype.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention as sdpa
        >>> from attention_ref.quant import smooth_k
        >>> q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
        >>> ks, km = smooth_k(k + 30.0)
        >>> torch.allclose(sdpa(q, ks, v), sdpa(q, k, v), atol=1e-12)
        True
    """
    if not isinstance(key, torch.Tensor) or not key.is_floating_point():
        raise TypeError(f"key must be a floating-point tensor, got {getattr(key, 'dtype', type(key).__name__)}")
    if key.dim() < 2:
        raise ValueError(f"key must have at least 2 dims (..., S, E), got shape {fmt_shape(key.shape)}")
    km = key.mean(dim=-2, keepdim=True)  # (..., S, E) -> (..., 1, E)
    return key - km, km


def quantize_int8_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SageAttention's INT8 quantizer: one scale ``amax / 127`` per block of tokens, half away from zero.

    ``scale = max |x| / 127`` over each block of ``block_size`` tokens (all of
    ``E``), ``q = trunc(x / scale + 0.5·sign(x))`` (``quant_per_block.py``:
    ``x_int8 += 0.5 * where(x_int8 >= 0, 1, -1)`` before the truncating
    ``.to(int8)``), in float32 as that kernel computes. SageAttention blocks Q
    by 128 tokens and K by 64, and multiplies Q by ``sm_scale · log2(e)`` first
    (pass ``(q.float() * (sm_scale * 1.44269504))``); K is usually smoothed
    first (`smooth_k`). A block of zeros gets scale 0 and values 0 here;
    SageAttention computes ``0 / 0`` there (SpargeAttn adds ``1e-7`` to the scale).

    Per element, ``|x - q·scale| ≤ scale / 2`` (up to float32 rounding).

    Args:
        x: ``(B, H, L, E)``, floating point.
        block_size: tokens per block.

    Returns:
        ``(q, scale)``: ``torch.int8`` ``(B, H, L, E)`` in ``[-127, 127]``, float32
        ``(B, H, ceil(L / block_size))``.

    Raises:
        TypeError: ``x`` not floating point.
        ValueError: ``x`` not 4-dim, ``block_size`` not a positive int.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import quantize_int8_blocks
        >>> q, s = quantize_int8_blocks(torch.tensor([127.0, 0.5, -0.5, 2.5, -2.5]).reshape(1, 1, 5, 1), 8)
        >>> s.item(), q.flatten().tolist()
        (1.0, [127, 1, -1, 3, -3])
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    _check_granularity("block", x, block_size, None)
    amax = _cell_amax(x, "block", block_size, None).to(torch.float32)  # (B, H, n)
    scale = amax / 127.0
    y = x.to(torch.float32) / expand_descale(scale, tuple(x.shape), "block", block_size=block_size).to(torch.float32)
    y = torch.where(torch.isnan(y), 0.0, y)  # a block of zeros: 0 / 0
    q = torch.trunc(y + 0.5 * torch.where(y >= 0, 1.0, -1.0))  # half away from zero
    return q.to(torch.int8), scale


def dequantize_int8_blocks(q: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """``q * scale`` in float64, one scale per block of ``block_size`` tokens.

    Args:
        q: ``(B, H, L, E)``, `quantize_int8_blocks`'s values.
        scale: ``(B, H, ceil(L / block_size))``.
        block_size: tokens per block.

    Returns:
        float64 ``(B, H, L, E)``.

    Examples:
        >>> import torch
        >>> from attention_ref.quant import dequantize_int8_blocks, quantize_int8_blocks
        >>> x = torch.randn(1, 2, 9, 4)
        >>> q, s = quantize_int8_blocks(x, 4)
        >>> bool(((dequantize_int8_blocks(q, s, 4) - x).abs() <= x.abs().amax() / 254 + 1e-6).all())
        True
    """
    return q.to(torch.float64) * expand_descale(scale, tuple(q.shape), "block", block_size=block_size)


def _kernel_descale(name: str, d: object, batch: int, kv_heads: int, channels: int | None = None
                    ) -> torch.Tensor:
    """A descale as the kernels take it, as float64 ``(B, Hkv, 1)`` (or ``(B, Hkv, Ev)`` per channel).

    ``None`` (1.0: FA's ``nullptr``), a number or 0-dim tensor (per tensor), ``(B, Hkv)``, and with
    ``channels`` also ``(B, Hkv, Ev)``.
    """
    t = torch.as_tensor(1.0 if d is None else d, dtype=torch.float64)
    allowed = [(batch, kv_heads)] + ([(batch, kv_heads, channels)] if channels is not None else [])
    if t.dim() and tuple(t.shape) not in allowed:
        raise ValueError(
            f"{name} must be a number or a tensor {' or '.join(fmt_shape(s) for s in allowed)} "
            f"(B, Hkv{') or (B, Hkv, Ev' if channels is not None else ''}), got shape {fmt_shape(t.shape)}"
        )
    if not (torch.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {t.tolist()}")
    if t.dim() == 3:
        return t
    return (t if t.dim() else t.reshape(1, 1)).expand(batch, kv_heads).unsqueeze(-1)  # () or (B, Hkv) -> (B, Hkv, 1)


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | float | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    *,
    fmt: str = "e4m3fn",
    p_format: str | None = None,
    p_offset_log2: float = 8.0,
    denominator: str = "unrounded",
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""FP8 attention as FlashAttention-3/4 define it, in float64: the oracle for a kernel taking FP8 inputs.

    Without ``p_format`` it equals `attention_ref.scaled_dot_product_attention`
    on the dequantized inputs (and is computed so), the descales where the
    kernels put them: ``scale · s_q · s_k`` multiplies the scores, ``s_v`` the
    normalized output:

    $$
    O = \operatorname{softmax}\!\big(\mathrm{scale}\; s_q s_k\, Q_8 K_8^\top\big)\, V_8\, s_v .
    $$

    With ``p_format`` it emulates the kernels' P path. Per query row ``i``, with
    ``m_i`` the row max of the scores (the whole row's: FA's running max gives
    the same after its final rescale) and ``c = p_offset_log2``:

    $$
    \hat P_{ij} = 2^{c}\, e^{S_{ij} - m_i} \in (0, 2^c], \quad
    \tilde P_{ij} = \mathrm{round}_{p}(\hat P_{ij}), \quad
    O_i = \frac{\sum_j \tilde P_{ij} V_j}{\ell_i}\, s_v, \quad
    \ell_i = \sum_j \hat P_{ij}\ (\texttt{"unrounded"})\ \text{or}\ \sum_j \tilde P_{ij}\ (\texttt{"rounded"}).
    $$

    FA3 (``Max_offset = 8``, ``row_sum`` of the float32 P, ``hopper/softmax.h``)
    and FA4 (``max_offset = 8``) are ``p_format="e4m3fn"`` (FA4 also ``"e5m2"``),
    ``p_offset_log2=8``, ``denominator="unrounded"``; SageAttention is
    ``p_offset_log2=math.log2(448)`` (``S_FP8_OFFSET 8.807f``). With
    ``2^c`` above the format's max the largest weights saturate at max while an
    unrounded denominator counts them in full (FlashAttention issue #2716's
    failure), which this emulates too.

    **The bound the emulation obeys** (``2^c ≤ max`` of ``p_format``; ``u`` its
    unit roundoff ``2^-4`` for e4m3, ``2^-3`` for e5m2; ``μ`` its subnormal
    step ``2^-9`` e4m3fn, ``2^-16`` e5m2): rounding moves each ``P̂_ij`` by at
    most ``e_ij = max(u·P̂_ij, μ/2)``, and ``ℓ_i ≥ 2^c`` (the max entry is ``2^c``
    exactly, when on ``p_format``'s grid, as ``2^8`` and ``448`` are), so against the unemulated ``O`` with
    ``P_ij = P̂_ij / Σ_j P̂_ij`` the weights,

    - ``"unrounded"``: ``|ΔO_id| ≤ |s_v| (u Σ_j P_ij |V_jd| + n_i (μ/2) 2^-c max_j |V_jd|)``;
    - ``"rounded"``: ``|ΔO_id| ≤ |s_v| (u Σ_j P_ij |V_jd − O_id/s_v| · ℓ_i/ℓ̃_i + n_i (μ/2) 2^-c max_j |V_jd − O_id/s_v|)``
      with ``ℓ̃_i ≥ 2^c``, since ``ΔO_i = Σ_j (P̃_ij − P̂_ij)(V_j − O_i/s_v) s_v / ℓ̃_i``;

    ``n_i`` the keys of row ``i`` that take part and ``V`` the dequantized
    ``V_8`` (without ``s_v``). Everything here is float64, so the bound holds
    up to float64 rounding. A kernel adds its float32 sums and exp2 and its
    BF16 output rounding (``2^-8 |O|``) on top.

    Args:
        q: ``(B, H, L, E)``, values on ``fmt``'s grid (`quantize_fp8`'s output, or
            torch's float8 dtype of ``fmt``). The package's heads-first layout:
            FlashAttention's ``(B, L, H, E)`` is ``q.transpose(1, 2)``.
        k: ``(B, Hkv, S, E)``, on the grid.
        v: ``(B, Hkv, S, Ev)``, on the grid.
        q_descale: ``None`` (1.0, FA's ``nullptr``), a number (per tensor:
            vLLM, FlashInfer) or ``(B, Hkv)`` (FA3/FA4: one per KV group of
            query heads; `to_flash_attn3` converts other layouts).
        k_descale: the same layouts.
        v_descale: the same, or ``(B, Hkv, Ev)`` per channel (SageAttention's V).
        fmt: the format ``q``, ``k`` and ``v`` are on (a name of `FORMATS`).
        p_format: ``None`` (no P quantization) or a name of `FORMATS`.
        p_offset_log2: ``c``, P is scaled by ``2^c`` before rounding.
        denominator: ``"unrounded"`` (FA3/FA4) or ``"rounded"``.
        is_causal: top-left causal mask, as `attention_ref.scaled_dot_product_attention`.
        scale: the softmax scale before the descales; default ``1 / sqrt(E)``.
        enable_gqa: ``H`` a multiple of ``Hkv``; query head ``h`` reads KV head
            ``h // (H // Hkv)``.
        return_lse: also return the natural-log LSE ``(B, H, L)`` of the descaled
            scores, ``m_i + log(ℓ_i 2^-c)``: FA's (it divides the sum by ``2^8``);
            with ``"rounded"``, of the rounded sum.

    Returns:
        float64 ``(B, H, L, Ev)``; with ``return_lse``, ``(out, lse)``. A row with
        no key gives 0 (lse ``-inf``).

    Raises:
        TypeError: inputs not floating point (or not torch's float8 dtype of ``fmt``).
        ValueError: inputs not 4-dim or off ``fmt``'s grid (unquantized data
            passed by mistake), an unknown format or denominator, descales of
            the wrong shape or not finite and > 0, head counts that do not fit.

    Examples:
        A hand-computable row: scores ``[ln 3, 0]``, so ``P̂ = [256, 85.33]``, and
        e4m3fn rounds 85.33 to 88 (the grid steps by 8 in ``[64, 128)``):

        >>> import math, torch
        >>> from attention_ref.quant import fp8_attention
        >>> q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
        >>> k = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(1, 1, 2, 1)
        >>> v = torch.tensor([0.0, 1.0], dtype=torch.float64).reshape(1, 1, 2, 1)
        >>> fp8_attention(q, k, v, 2.0, 1.0, 1.0, scale=math.log(3) / 2).item()  # (1/3) / (4/3)
        0.25
        >>> fp8_attention(q, k, v, 2.0, 1.0, 1.0, scale=math.log(3) / 2, p_format="e4m3fn").item()  # 88 / 341.33
        0.2578125
    """
    f = _format(fmt)
    pf = None if p_format is None else _format(p_format, "p_format")
    if denominator not in ("unrounded", "rounded"):
        raise ValueError(f"denominator must be 'unrounded' or 'rounded', got {denominator!r}")
    if not isinstance(p_offset_log2, (int, float)) or isinstance(p_offset_log2, bool) or not math.isfinite(p_offset_log2):
        raise ValueError(f"p_offset_log2 must be a finite number, got {p_offset_log2!r}")
    tensors = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dtype in _FLOAT8 and t.dtype != getattr(torch, f.torch_dtype, None):
            raise TypeError(f"{name} is {t.dtype} but fmt={f.name!r}: pass fmt={_FLOAT8[t.dtype]!r}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L, E), got shape {fmt_shape(t.shape)}")
        t64 = t.to(torch.float64)
        _check_on_grid(name, t64, f, allow_nan=False)
        tensors[name] = t64
    q8, k8, v8 = tensors["q"], tensors["k"], tensors["v"]
    B, H, _, E = q8.shape
    Hkv = k8.shape[1]
    if k8.shape[:2] != v8.shape[:2] or k8.shape[0] != B or k8.shape[2] != v8.shape[2] or k8.shape[3] != E:
        raise ValueError(
            f"k (B, Hkv, S, E) and v (B, Hkv, S, Ev) must fit q (B, H, L, E) = {fmt_shape(q8.shape)}, got "
            f"k {fmt_shape(k8.shape)} and v {fmt_shape(v8.shape)}"
        )
    if H != Hkv and not (enable_gqa and H % Hkv == 0):
        raise ValueError(f"q has H={H} heads and k Hkv={Hkv}: pass enable_gqa=True with H a multiple of Hkv")
    group = H // Hkv
    # (B, Hkv, 1) descales -> (B, H, 1, 1): query head h reads KV head h // group (FA3's "b h -> b 1 (h g) 1")
    sq = _kernel_descale("q_descale", q_descale, B, Hkv).repeat_interleave(group, dim=1).unsqueeze(-1)
    sk = _kernel_descale("k_descale", k_descale, B, Hkv).unsqueeze(-1)  # (B, Hkv, 1, 1)
    sv = _kernel_descale("v_descale", v_descale, B, Hkv, v8.shape[3])  # (B, Hkv, 1) or (B, Hkv, Ev)
    sv = sv.repeat_interleave(group, dim=1).unsqueeze(-2)  # (B, H, 1, 1) or (B, H, 1, Ev)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    # scale · s_q · s_k · (Q8 K8ᵀ) is attention of (Q8 s_q) and (K8 s_k) with the scale: the same product in float64
    qd, kd = q8 * sq, k8 * sk
    if pf is None:
        out, lse = scaled_dot_product_attention(qd, kd, v8, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                                return_lse=True)  # (B, H, L, Ev), (B, H, L)
        out = out * sv
        return (out, lse) if return_lse else out
    weights = attention_weights(qd, kd, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)  # (B, H, L, S)
    # (B, H, L, 1): e^{S - m} = weights / top; 0 on a row with no key (S = 0 included)
    top = weights.amax(dim=-1, keepdim=True) if weights.shape[-1] else weights.new_zeros((*weights.shape[:-1], 1))
    offset = 2.0 ** p_offset_log2
    p_hat = torch.where(top > 0, weights / torch.where(top > 0, top, 1.0), 0.0) * offset  # (B, H, L, S) in [0, 2^c]
    p_tilde = round_to_fp8(p_hat, pf.name)  # the P·V GEMM's FP8 operand
    unrounded = p_hat.sum(dim=-1, keepdim=True)  # (B, H, L, 1): FA's row_sum of the float32 P
    ell = unrounded if denominator == "unrounded" else p_tilde.sum(dim=-1, keepdim=True)
    v_heads = v8.repeat_interleave(group, dim=1) if group > 1 else v8  # (B, Hkv, S, Ev) -> (B, H, S, Ev)
    # (B, H, L, S) @ (B, H, S, Ev) -> (B, H, L, Ev)
    out = torch.matmul(p_tilde, v_heads) / torch.where(ell > 0, ell, 1.0) * sv
    if not return_lse:
        return out
    _, lse = scaled_dot_product_attention(qd, kd, v8, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                          return_lse=True)  # m + log Σ e^{S - m}, the unrounded sum's
    if denominator == "rounded":
        lse = lse + torch.log(torch.where(ell > 0, ell / torch.where(unrounded > 0, unrounded, 1.0), 1.0)).squeeze(-1)
    return out, lse


_FLOAT8 = {getattr(torch, f.torch_dtype): f.name for f in FORMATS.values() if hasattr(torch, f.torch_dtype)}
