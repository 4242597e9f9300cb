r"""`assert_fp8_attention_close`: an FP8 (or INT8) kernel, element by element, against an allowance set in advance.

A kernel that takes FP8 inputs computes attention of the *dequantized* inputs
(`attention_ref.quant`'s module docstring); the rounding of Q, K and V is the
caller's, so the reference is `attention_ref.quant.fp8_attention` without P
emulation, in float64. What a right kernel may add on top is known before its
output is looked at: each output element ``(b, h, i, d)`` gets an allowance, the
sum of named terms, each a bound on one source of rounding (derived below, in
the order the kernel rounds):

$$
|O^{\mathrm{kernel}}_{id} - O_{id}| \le \mathrm{factor}\,\big(T^{P}_{id} + T^{\mathrm{acc}}_{id}
  + T^{\mathrm{soft}}_{id} + T^{V}_{id} + T^{\mathrm{out}}_{id}\big) + \mathrm{atol}.
$$

No term is fitted to the data or to a baseline run, so a failure is a statement
about the kernel: the message names the element, its error, the allowance, each
term, and the term the error breaks (the largest one: a failing error exceeds
every term alone).

**Notation.** Per query row ``i`` (one batch, query head and position): ``P_ij``
the exact weights of the dequantized scores, ``V_jd`` the dequantized values
(``V_8 s_v``, any ``s_v`` layout), ``O_id = Σ_j P_ij V_jd``, ``n_i`` the keys
that take part, ``E`` the head size. P is scaled to ``P̂_ij = 2^c e^{S_ij - m_i}``
(``c = p_offset_log2``), so ``ℓ_i = Σ_j P̂_ij = 2^c / max_j P_ij ≥ 2^c``. ``u_P``,
``ν_P``, ``μ_P``: ``p_format``'s unit roundoff, smallest normal and smallest
subnormal (``u ν = μ / 2`` in every format); ``u_a = 2^-bits`` the kernel's
accumulator (``accumulate_bits``: 24 for float32, 22 for FP8 tensor cores);
``u_32 = 2^-24``; ``γ_k = k u_a / (1 - k u_a)``, the classical bound on a
sum of ``k`` rounded operations in any order.

**Score perturbations** (used by two terms). If the kernel's scores are
``S_ij + δ_ij`` with ``|δ_ij| ≤ ε_ij``, its weights are
``P'_ij = P_ij e^{δ_ij} / Z_i`` with ``Z_i = Σ_k P_ik e^{δ_ik}`` between
``Z⁻_i = Σ_k P_ik e^{-ε_ik}`` and ``Z⁺_i = Σ_k P_ik e^{ε_ik}``, so
``P'_ij / P_ij`` lies between ``lo_ij = e^{-ε_ij} / Z⁺_i`` and
``up_ij = e^{ε_ij} / Z⁻_i``, and since ``Σ_j (P'_ij - P_ij) = 0``,

$$
|O'_{id} - O_{id}| = \Big|\sum_j (P'_{ij} - P_{ij})(V_{jd} - O_{id})\Big|
  \le \sum_j P_{ij}\,\max(\mathrm{up}_{ij} - 1,\ 1 - \mathrm{lo}_{ij})\,|V_{jd} - O_{id}| ,
$$

exact, not first order. With ``ε_i = max_j ε_ij`` it is at most
``(e^{2ε_i} - 1) Σ_j P_ij |V_jd - O_id|``, the research note's form, often far
less (the keys with most weight decide ``Z±``). The other terms are computed
from the exact weights; at the kernel's weights each ``P_ij`` is at most
``up_ij P_ij``, and so it enters them.

**P rounding** ``T^P`` (with ``p_format``; the P·V product's FP8 operand,
`attention_ref.quant.fp8_attention`'s docstring). Rounding moves ``P̂_ij`` by at
most ``max(u_P P̂_ij, min(P̂_ij, μ_P / 2))``: relatively by ``u_P`` in the normal
range, by half a subnormal step below it, and to 0 from below ``μ_P / 2``
(the two bounds meet at ``ν_P``). Divided by ``ℓ_i``, at the kernel's weights, a
weight moves by at most
``e_ij = max(u_P up_ij P_ij, up_i min(P_ij, μ_P max_k P_ik / 2^{c+1}))``,
``up_i = max_j up_ij`` (the kernel's largest weight is at most ``up_i max_k P_ik``).
The kernel's row sum of the unrounded ``P̂`` (FlashAttention-3/4, ``"unrounded"``)
leaves the error unnormalized: ``T^P_id = Σ_j e_ij |V_jd|``. A kernel dividing
by the rounded sum ``ℓ̃_i`` (``"rounded"``) renormalizes,
``ΔO_id = Σ_j (P̃_ij - P̂_ij)(V_jd - O'_id) / ℓ̃_i``:
``T^P_id = ρ_i (Σ_j e_ij |V_jd - O_id| + Σ_j e_ij · T^{pert}_id)``,
``ρ_i ≥ ℓ_i / ℓ̃_i`` from ``|ℓ̃_i - ℓ_i| ≤ ℓ_i Σ_j e_ij`` (or, failing that,
from ``ℓ̃_i ≥ 2^c (1 - u_P)`` and the kernel's largest weight), ``T^{pert}`` the
two score-perturbation terms together. Both need ``2^c ≤`` the format's largest
value; above it the largest weights saturate (FlashAttention issue #2716),
which the checker refuses as an argument and catches in a kernel. Without
perturbations (``up = 1``) this is a sharper form of `fp8_attention`'s bound:
``max(a, b) ≤ a + b`` and ``max_k P_ik ≤ 1`` give its
``u Σ_j P_ij |V_jd| + n_i (μ/2) 2^-c max_j |V_jd|``.

**Accumulation** ``T^acc``: the kernel's sums, in ``u_a``. The scores are sums
of ``E`` products, off by ``γ_E a_ij``, ``a_ij = |scale| Σ_e |Q_ie| |K_je|``;
folding the scale and descales in, subtracting the row maximum and ``exp2``
(float32: four roundings of ``|S_ij|`` and ``|m_i| ≤ max_j a_ij``, ``exp2``'s
approximation within ``2^-22``) add ``4 u_32 (a_ij + max_j a_ij) + 2^-21``.
That is a score perturbation ``ε^acc_ij``, whose term above (with
``|V_jd| + |O_id|`` for ``|V_jd - O_id|``: a product, not a sum per element, for
a term this small) is the first part.
The numerator ``Σ_j P̃_ij V_jd`` and the row sum ``ℓ_i`` are sums of at most
``k_i = 2 n_i + 2`` roundings per term (the adds, a product, and an online
softmax's rescale of the partial sums once per tile), so relative to ``ℓ_i``
they are off by ``γ_{k_i} ρ_i Σ_j (up_ij P_ij + e_ij) |V_jd|`` and
``γ_{k_i} |O'_id|``, the latter growing to ``γ_{k_i} / (1 - γ_{k_i})`` in the
quotient; the final division and the product by ``s_v`` add ``3 u_32 |O'_id|``.
``|O'_id|`` is taken as ``|O_id|`` plus the other terms. ``ρ_i = 1`` for the
unrounded sum.

**Softmax perturbation** ``T^soft`` (``quantizes_internally``: SageAttention,
torchao). The kernel rounds Q and K itself, ``|ΔQ_ie| ≤ δQ_ie``,
``|ΔK_je| ≤ δK_je``, so

$$
|\Delta S_{ij}| \le |\mathrm{scale}| \sum_e \big(|Q_{ie}|\, \delta K_{je}
  + \delta Q_{ie}\, |K_{je}| + \delta Q_{ie}\, \delta K_{je}\big) ,
$$

exact, one more score perturbation. For INT8 (``fmt="int8"``:
``round(x / s)``, ``s = amax / 127`` over a block of tokens) ``δ ≤ s / 2``; for FP8
``δ ≤ u |x| + μ s / 2``, ``s ≤ amax / max``. The checker takes ``amax`` over one
(batch, head), which bounds the amax of every block inside it: right for any
scale granularity from per (batch, head) down to per token. SageAttention
smooths K first (`attention_ref.quant.smooth_k`): ``ε^quant`` is computed for
``K`` and for ``K - K̄`` (``K̄`` the (batch, head)'s mean key; ``a_ij`` too) and
the larger taken, so it holds whether the kernel smooths or not. The term is
the perturbation bound with ``ε^acc + ε^quant``, less the accumulation's part.
It is a worst case, every rounding of a score's ``E`` products in one
direction, and so loose: for SageAttention's INT8 rounding of random inputs it
is about 40 times a right kernel's mean error at ``E = 11``, and at ``E = 128``
larger than the output itself, where it catches only the bugs that are larger
still. A kernel whose quantizer can be reproduced bit for bit is better checked
on its quantized inputs. With ``v_fmt`` the kernel rounds V too
(SageAttention: FP8 per channel), ``δV_jd = u_V |V_jd| + μ_V amax_V / (2 max_V)``:
``T^V_id = Σ_j up_ij P_ij δV_jd``.

**Output rounding** ``T^out``: the result rounded to ``output_dtype`` (by
default ``actual``'s dtype; bfloat16 for FlashAttention-3/4), ``r`` times
(FlashInfer multiplies the rounded output by ``v_scale`` and rounds again: 2):
``((1 + u_o)^r - 1)(|O_id| + the other terms) + r μ_o / 2``.

What the allowance assumes: P scaled so its row maximum is ``2^c`` (an online
softmax's running maximum gives at most ``2^c`` and, after the final rescale,
the same bound), float32 arithmetic outside the accumulators, and no other
rounding of P or the scores (a kernel that stores P in 16 bits is not
described). A kernel outside those assumptions can be given ``factor > 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from attention_ref.functional import attention_weights, scaled_dot_product_attention
from attention_ref.quant import FORMATS, fp8_attention
from attention_ref.testing.arguments import check_number
from attention_ref.testing.messages import (
    caller_position,
    caller_shape,
    counted,
    dtype_name,
    value_at,
)
from attention_ref.testing.verdict import abs_diff

#: The allowance's terms, in the order the kernel rounds.
TERMS = ("P rounding", "accumulation", "softmax perturbation", "V rounding", "output rounding")

_U32 = 2.0**-24  # float32's unit roundoff: the arithmetic outside the accumulators
_EXP2 = 2.0**-21  # exp2's approximation (2^-22) and the subtraction of the row maximum, in the score's units
_INT8_SLACK = 2.0**-16  # SageAttention divides by the scale in float32 before rounding half away from zero
_CHUNK = 1 << 22  # elements of one (B, H, rows, S, Ev) block in the deviation sums


@dataclass(frozen=True)
class FP8CheckReport:
    """What a passing `assert_fp8_attention_close` judged, with the numbers behind it.

    Attributes:
        reference: float64, ``actual``'s shape (in the caller's layout): attention
            of the dequantized inputs.
        allowance: float64, the same shape: ``factor * (sum of the terms) + atol``.
        terms: each term of `TERMS` that applies, float64, the same shape.
        worst_ratio: the largest ``|actual - reference| / allowance`` (0 where both are 0).
        worst_position: where it is, in the caller's layout.
    """

    reference: torch.Tensor = field(repr=False)
    allowance: torch.Tensor = field(repr=False)
    terms: dict[str, torch.Tensor] = field(repr=False)
    worst_ratio: float
    worst_position: tuple[int, ...]

    def __str__(self) -> str:
        largest = max(self.terms, key=lambda name: float(self.terms[name][self.worst_position])) if self.terms else "none"
        return (f"passed (output; largest error {self.worst_ratio:.2f} of its allowance, at "
                f"{self.worst_position}, where the largest term is {largest})")


def assert_fp8_attention_close(
    actual: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | float | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    *,
    fmt: str = "e4m3fn",
    p_format: str | None = "e4m3fn",
    p_offset_log2: float = 8.0,
    denominator: str = "unrounded",
    accumulate_bits: int | None = None,
    output_dtype: torch.dtype | None = None,
    output_roundings: int = 1,
    quantizes_internally: bool = False,
    v_fmt: str | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "bhld",
    factor: float = 1.0,
    atol: float = 0.0,
) -> FP8CheckReport:
    r"""Check an FP8 attention kernel's output, element by element, against an a priori allowance.

    The reference is float64 attention of the dequantized inputs
    (`attention_ref.quant.fp8_attention` without ``p_format``), or of the given
    inputs when the kernel quantizes them itself. Each element passes when
    ``|actual - reference| <= factor * (sum of the terms) + atol``; the terms (P
    rounding, accumulation, softmax perturbation, V rounding, output rounding)
    are derived in `attention_ref.testing.low_precision`'s module docstring.

    The kernels' contracts, as arguments (the research behind them:
    `attention_ref.quant`): FlashAttention-3 is ``p_format="e4m3fn"``,
    ``p_offset_log2=8``, ``denominator="unrounded"``, ``accumulate_bits=22``
    (its FP8 tensor-core sums), a bfloat16 output; FlashAttention-4 the same with
    ``p_format`` ``"e4m3fn"`` or ``"e5m2"``; SageAttention ``quantizes_internally=True,
    fmt="int8", v_fmt="e4m3fn", p_offset_log2=math.log2(448)``; FlashInfer
    (``v_scale`` applied to the rounded output) ``output_roundings=2``.

    Args:
        actual: the kernel's output, ``(B, H, L, Ev)`` (``layout="bhld"``), any
            float dtype (bfloat16 for FlashAttention-3/4).
        q: ``(B, H, L, E)``, the FP8 values the kernel was given, on ``fmt``'s grid
            (`attention_ref.quant.quantize_fp8`'s output, or torch's float8 dtype);
            with ``quantizes_internally``, the float tensor it was given.
        k: ``(B, Hkv, S, E)``, the same.
        v: ``(B, Hkv, S, Ev)``, the same.
        q_descale: as `attention_ref.quant.fp8_attention` takes it: ``None`` (1.0),
            a number (per tensor) or ``(B, Hkv)`` (FlashAttention-3/4; other layouts
            convert with `attention_ref.quant.to_flash_attn3`). ``None`` with
            ``quantizes_internally``.
        k_descale: the same.
        v_descale: the same, or ``(B, Hkv, Ev)`` per channel.
        fmt: the FP8 format of ``q``, ``k``, ``v`` (a name of
            `attention_ref.quant.FORMATS`); with ``quantizes_internally`` the format
            the kernel rounds Q and K into, that or ``"int8"``.
        p_format: the format P is rounded to before the P·V product, a name of
            `attention_ref.quant.FORMATS`, or ``None`` (P kept in float32).
        p_offset_log2: ``c``: P is scaled to ``(0, 2^c]`` before rounding; ``2^c``
            at most ``p_format``'s largest value.
        denominator: ``"unrounded"`` (the row sum of the float32 P:
            FlashAttention-3/4) or ``"rounded"``.
        accumulate_bits: the significand bits of the kernel's accumulators: ``None``
            for float32's 24, 22 for FP8 tensor cores (FlashAttention-3,
            SageAttention's "22 valid bits"); an int from 8 to 53.
        output_dtype: the dtype the kernel rounded its output to; ``None`` for
            ``actual``'s. Not finer than ``actual``'s dtype.
        output_roundings: how many times the output was rounded to it (an int >= 1).
        quantizes_internally: the kernel rounds Q and K itself (to ``fmt``, with its
            own scales of at most one (batch, head) each); ``q``, ``k``, ``v`` are
            then its float inputs and the reference their attention.
        v_fmt: with ``quantizes_internally``, the FP8 format the kernel rounds V
            into (SageAttention: ``"e4m3fn"``), or ``None`` (V used as given).
        is_causal: top-left causal mask.
        scale: the softmax scale before the descales; default ``1 / sqrt(E)``.
        enable_gqa: ``H`` a multiple of ``Hkv``; query head ``h`` reads KV head
            ``h // (H // Hkv)``.
        layout: ``"bhld"`` or ``"blhd"`` (FlashAttention's ``(B, L, H, E)``), for
            ``actual``, ``q``, ``k`` and ``v``.
        factor: multiplies the sum of the terms; a finite number > 0 (1: the terms
            are bounds, not estimates).
        atol: added to every allowance; a finite number >= 0.

    Returns:
        An `FP8CheckReport` (the reference, the allowance and its terms).

    Raises:
        AssertionError: an element above its allowance (a NaN or inf fails). The
            message gives the element with the largest error / allowance, its
            error, its allowance and each term with the error's multiple of it,
            the term it breaks (the largest), how many elements fail and the
            configuration.
        TypeError: an argument of the wrong type (named).
        ValueError: a wrong shape, format, layout, offset or option (named, with
            the expected and the actual value); what
            `attention_ref.quant.fp8_attention` refuses (values off ``fmt``'s grid,
            descales of the wrong shape or not > 0).

    Example:
        >>> import torch
        >>> from attention_ref.quant import fp8_attention, quantize_fp8
        >>> from attention_ref.testing import assert_fp8_attention_close
        >>> g = torch.Generator().manual_seed(0)
        >>> (q8, sq), (k8, sk), (v8, sv) = (quantize_fp8(torch.randn(1, 2, 5, 8, generator=g)) for _ in range(3))
        >>> kernel = fp8_attention(q8, k8, v8, sq, sk, sv, p_format="e4m3fn").to(torch.bfloat16)
        >>> assert_fp8_attention_close(kernel, q8, k8, v8, sq, sk, sv).worst_ratio < 1
        True
        >>> assert_fp8_attention_close(kernel * sv, q8, k8, v8, sq, sk, sv)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: assert_fp8_attention_close: 77 of 80 output elements out of bounds
        ...
    """
    options = _check_options(actual, fmt, p_format, p_offset_log2, denominator, accumulate_bits, output_dtype,
                             output_roundings, quantizes_internally, v_fmt, is_causal, scale, enable_gqa, layout,
                             factor, atol)
    swap = layout == "blhd"
    _check_tensors(actual, q, k, v, swap)
    q, k, v, actual = (t.transpose(1, 2) if swap else t for t in (q, k, v, actual))
    _check_fit(q, k, v, enable_gqa, swap)
    if quantizes_internally:
        for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None:
                raise ValueError(f"{name} must be None when quantizes_internally=True (the kernel computes its own "
                                 f"scales from the float inputs), got {_what(d)}")
        qd, kd, vd = (t.detach().to(torch.float64) for t in (q, k, v))
        reference = scaled_dot_product_attention(qd, kd, vd, is_causal=is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)  # (B, H, L, Ev)
    else:
        reference = fp8_attention(q, k, v, q_descale, k_descale, v_descale, fmt=fmt, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)  # (B, H, L, Ev); checks the grid, the descales
        qd, kd, vd = _dequantized(q, k, v, q_descale, k_descale, v_descale)
    if tuple(actual.shape) != tuple(reference.shape):
        raise ValueError(f"actual must have the shape of the attention output {caller_shape(reference.shape, swap)} "
                         f"{'(B, L, H, Ev)' if swap else '(B, H, L, Ev)'}, got {caller_shape(actual.shape, swap)}")
    out_dtype = options["output_dtype"] or actual.dtype
    terms = allowance_terms(qd, kd, vd, reference, fmt=fmt, p_format=p_format, p_offset_log2=p_offset_log2,
                            denominator=denominator, accumulate_bits=options["accumulate_bits"],
                            output_dtype=out_dtype, output_roundings=output_roundings,
                            quantizes_internally=quantizes_internally, v_fmt=v_fmt, is_causal=is_causal,
                            scale=scale)
    allowance = factor * sum(terms.values()) + atol  # (B, H, L, Ev)
    error = abs_diff(actual, reference)  # inf where actual is NaN
    ratio = torch.where(error > 0, error / allowance, torch.zeros_like(error)).nan_to_num(nan=math.inf)
    failing = ~(error <= allowance)
    worst = _position(ratio)
    if bool(failing.any()):
        lines = _failure_lines(actual, reference, error, allowance, ratio, failing, terms, worst, factor, atol,
                               swap)
        lines.append("  config: " + _config(q, k, v, swap, fmt, p_format, p_offset_log2, denominator,
                                            options["accumulate_bits"], out_dtype, output_roundings,
                                            quantizes_internally, v_fmt, is_causal, scale, enable_gqa, layout,
                                            factor, atol))
        raise AssertionError("\n".join(lines))

    def back(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if swap else t

    return FP8CheckReport(back(reference), back(allowance), {name: back(t) for name, t in terms.items()},
                          float(ratio[worst]) if ratio.numel() else 0.0, caller_position(worst, swap))


def allowance_terms(
    qd: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    reference: torch.Tensor,
    *,
    fmt: str,
    p_format: str | None,
    p_offset_log2: float,
    denominator: str,
    accumulate_bits: int,
    output_dtype: torch.dtype,
    output_roundings: int,
    quantizes_internally: bool,
    v_fmt: str | None,
    is_causal: bool,
    scale: float | None,
) -> dict[str, torch.Tensor]:
    """Each term of the module docstring, per output element: ``{name: float64 (B, H, L, Ev)}``.

    ``qd``, ``kd``, ``vd`` are the dequantized inputs (or the float ones, with
    ``quantizes_internally``) in float64, ``reference`` their attention; the
    arguments are `assert_fp8_attention_close`'s, already checked.
    """
    B, H, L, E = qd.shape
    Hkv, S = kd.shape[1], kd.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(E) if scale is None else abs(scale)
    k_heads = kd.repeat_interleave(group, dim=1)  # (B, Hkv, S, E) -> (B, H, S, E)
    v_heads = vd.repeat_interleave(group, dim=1)  # (B, Hkv, S, Ev) -> (B, H, S, Ev)
    weights = attention_weights(qd, k_heads, is_causal=is_causal, scale=scale)  # (B, H, L, S)
    takes_part = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        takes_part = takes_part.tril()  # top-left: query i sees keys 0..i
    n = takes_part.sum(-1, keepdim=True).to(torch.float64)  # (L, 1): n_i
    out = reference
    u_a = 2.0 ** -accumulate_bits

    def gamma(count: torch.Tensor | float) -> torch.Tensor:
        count = torch.as_tensor(count, dtype=torch.float64)
        return count * u_a / (1 - count * u_a)

    # the keys the kernel may multiply: K, and with internal quantization also K smoothed (SageAttention's K - mean K)
    keys = [k_heads]
    if quantizes_internally and S:
        keys.append(k_heads - k_heads.mean(dim=-2, keepdim=True))  # (B, H, S, E)
    # the scores' sizes a_ij = scale * sum_e |Q_ie| |K_je|, the larger of the two forms:
    # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    a = torch.stack([scale * (qd.abs() @ key.abs().transpose(-2, -1)) for key in keys]).amax(0)
    a = torch.where(takes_part, a, 0.0)
    eps_acc = gamma(E) * a + 4 * _U32 * (a + a.amax(-1, keepdim=True)) + _EXP2  # (B, H, L, S)
    eps_acc = torch.where(takes_part, eps_acc, 0.0)
    eps_all = eps_acc
    if quantizes_internally:
        dq = _rounding_radius(qd, fmt)  # (B, H, L, E)

        def radius(key: torch.Tensor) -> torch.Tensor:
            """|dS_ij| <= scale * sum_e (|Q_ie| dK_je + dQ_ie |K_je| + dQ_ie dK_je): (B, H, L, S)."""
            dk = _rounding_radius(key, fmt)  # (B, H, S, E): amax per query head's copy of its KV head, the same
            # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
            return scale * (qd.abs() @ dk.transpose(-2, -1) + dq @ (key.abs() + dk).transpose(-2, -1))

        eps_quant = torch.stack([radius(key) for key in keys]).amax(0)  # plain or smoothed: the larger
        eps_all = eps_acc + torch.where(takes_part, eps_quant, 0.0)

    def factors(eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For scores off by at most eps (B, H, L, S): P'_ij / P_ij lies in [lo_ij, up_ij]; |P'_ij / P_ij - 1| too."""
        low = (weights * torch.exp(-eps)).sum(-1, keepdim=True)  # (B, H, L, 1): Z_i >= sum_k P_ik e^{-eps_ik}
        high = (weights * torch.exp(eps)).sum(-1, keepdim=True)  # Z_i <= sum_k P_ik e^{eps_ik}
        up = torch.exp(eps) / torch.where(low > 0, low, 1.0)  # (B, H, L, S): e^{eps_ij} / Z-
        lo = torch.exp(-eps) / torch.where(high > 0, high, 1.0)  # e^{-eps_ij} / Z+
        return up, lo, torch.maximum(up - 1, 1 - lo)

    grows, shrinks, moves_acc = factors(eps_acc)
    if quantizes_internally:
        grows, shrinks, moves_all = factors(eps_all)
    grows_most = grows.amax(-1, keepdim=True) if S else grows.new_ones(B, H, L, 1)  # (B, H, L, 1)
    v_abs = v_heads.abs()
    # the accumulation's share, tiny: |V_jd - O_id| <= |V_jd| + |O_id| spares the (B, H, L, S, Ev) sums
    # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)
    moved_acc = weights * moves_acc
    score_acc = moved_acc @ v_abs + moved_acc.sum(-1, keepdim=True) * out.abs()
    # with the internal rounding, the sharp form; the two shares together bound it
    score_all = torch.maximum(_deviation(weights * moves_all, v_heads, out), score_acc) if quantizes_internally \
        else score_acc
    terms: dict[str, torch.Tensor] = {}
    spread = torch.ones(B, H, L, 1, dtype=torch.float64)  # rho_i: l_i / l~_i bounds, 1 for the unrounded sum
    moved = torch.zeros_like(weights)  # e_ij
    if p_format is not None:
        pf = FORMATS[p_format]
        top = weights.amax(-1, keepdim=True) if S else weights.new_zeros(B, H, L, 1)  # max_k P_ik = 2^c / l_i
        half_step = pf.min_subnormal * top / 2.0 ** (p_offset_log2 + 1)  # mu / (2 l_i), in units of the weights
        # e_ij at the kernel's weights P' <= up P, whose largest is at most grows_most * max_k P_ik: (B, H, L, S)
        moved = torch.maximum(pf.unit_roundoff * grows * weights, grows_most * torch.minimum(weights, half_step))
        if denominator == "unrounded":
            terms["P rounding"] = moved @ v_abs  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)
        else:
            total = moved.sum(-1, keepdim=True)  # (B, H, L, 1): |l~ - l| / l
            least_top = (shrinks * weights).amax(-1, keepdim=True) if S else top  # max_k P'_ik, at least
            floor = torch.where(least_top > 0, 1.0 / ((1 - pf.unit_roundoff)
                                                      * torch.where(least_top > 0, least_top, 1.0)), 1.0)
            below = total < 1
            spread = torch.where(below, torch.minimum(1.0 / torch.where(below, 1 - total, 1.0), floor), floor)
            terms["P rounding"] = spread * (_deviation(moved, v_heads, out) + total * score_all)
    else:
        terms["P rounding"] = torch.zeros_like(out)
    v_term = torch.zeros_like(out)
    if v_fmt is not None:
        radius_v = _rounding_radius(vd, v_fmt).repeat_interleave(group, dim=1)  # (B, H, S, Ev)
        v_term = (grows * weights) @ radius_v  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)
    soft = score_all - score_acc  # the internal quantization's share of the perturbation
    size = out.abs() + terms["P rounding"] + score_all + v_term  # |O'_id|, at most
    g = gamma(2 * n + 2)  # (L, 1): k_i = 2 n_i + 2 roundings per term
    # sum_j P~_ij |V_jd| / l_i: (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)
    numerator = spread * ((grows * weights + moved) @ v_abs)
    terms["accumulation"] = g * numerator + (g / (1 - g) + 3 * _U32) * size + score_acc
    if quantizes_internally:
        terms["softmax perturbation"] = soft
    if v_fmt is not None:
        terms["V rounding"] = v_term
    if p_format is None:
        del terms["P rounding"]
    info = torch.finfo(output_dtype)
    u_out, tiny = info.eps / 2, info.smallest_normal * info.eps  # unit roundoff, smallest subnormal
    rest = sum(terms.values())
    terms["output rounding"] = ((1 + u_out) ** output_roundings - 1) * (out.abs() + rest) \
        + output_roundings * tiny / 2
    return {name: terms[name] for name in TERMS if name in terms}


def _rounding_radius(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``δx``: how far a kernel's own rounding of ``x`` (B, H, N, E) may move each entry, scales per (b, h) or finer."""
    size = x.abs()  # (B, H, N, E)
    amax = size.amax(dim=(-2, -1), keepdim=True) if size.numel() else size.new_zeros(*size.shape[:2], 1, 1)
    if fmt == "int8":
        return (0.5 + _INT8_SLACK) * amax / 127.0 * torch.ones_like(size)  # s / 2, s = amax / 127
    f = FORMATS[fmt]
    return (f.unit_roundoff + _U32) * size + f.min_subnormal * amax / (2 * f.max)  # u |x| + mu s / 2, s <= amax / max


def _deviation(w: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``sum_j w_ij |v_jd - out_id|``: (B, H, L, S), (B, H, S, Ev), (B, H, L, Ev) -> (B, H, L, Ev), by row blocks."""
    B, H, L, S = w.shape
    result = torch.zeros_like(out)
    rows = max(1, _CHUNK // max(1, B * H * S * v.shape[-1]))
    for start in range(0, L, rows):
        stop = min(L, start + rows)
        # (B, H, l, S, 1) * |(B, H, 1, S, Ev) - (B, H, l, 1, Ev)| summed over S -> (B, H, l, Ev)
        gap = (v.unsqueeze(2) - out[:, :, start:stop].unsqueeze(3)).abs()
        result[:, :, start:stop] = (w[:, :, start:stop].unsqueeze(-1) * gap).sum(3)
    return result


def _dequantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Any, k_descale: Any,
                 v_descale: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_8 * s`` in float64, the descales as `attention_ref.quant.fp8_attention` reads them (already checked)."""
    B, H = q.shape[:2]
    Hkv = k.shape[1]

    def per_head(d: Any, heads: int, repeat: int) -> torch.Tensor:
        t = torch.as_tensor(1.0 if d is None else d, dtype=torch.float64)
        if t.dim() == 3:  # (B, Hkv, Ev): one per channel
            return t.repeat_interleave(repeat, dim=1).unsqueeze(-2)  # (B, heads, 1, Ev)
        t = t.reshape(1, 1) if t.dim() == 0 else t  # (B, Hkv)
        return t.expand(B, Hkv).repeat_interleave(repeat, dim=1).reshape(B, heads, 1, 1)

    qd = q.to(torch.float64) * per_head(q_descale, H, H // Hkv)  # query head h reads KV group h // (H // Hkv)
    kd = k.to(torch.float64) * per_head(k_descale, Hkv, 1)
    vd = v.to(torch.float64) * per_head(v_descale, Hkv, 1)
    return qd, kd, vd


def _check_options(actual: Any, fmt: Any, p_format: Any, p_offset_log2: Any, denominator: Any,
                   accumulate_bits: Any, output_dtype: Any, output_roundings: Any, quantizes_internally: Any,
                   v_fmt: Any, is_causal: Any, scale: Any, enable_gqa: Any, layout: Any, factor: Any,
                   atol: Any) -> dict[str, Any]:
    if not isinstance(actual, torch.Tensor):
        raise TypeError(f"actual must be a torch.Tensor, got {type(actual).__name__}")
    if not actual.is_floating_point():
        raise TypeError(f"actual must be a floating-point tensor, got dtype {actual.dtype}")
    for name, flag in (("quantizes_internally", quantizes_internally), ("is_causal", is_causal),
                       ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    formats = sorted(FORMATS) + (["int8"] if quantizes_internally else [])
    if fmt not in formats:
        hint = "" if quantizes_internally or fmt != "int8" else " ('int8' only with quantizes_internally=True)"
        raise ValueError(f"fmt must be one of {formats}{hint}, got {fmt!r}")
    if v_fmt is not None:
        if not quantizes_internally:
            raise ValueError(f"v_fmt is for a kernel that rounds V itself: pass quantizes_internally=True, or "
                             f"v_fmt=None (v is given quantized, in fmt={fmt!r}), got v_fmt={v_fmt!r}")
        if v_fmt not in FORMATS:
            raise ValueError(f"v_fmt must be None or one of {sorted(FORMATS)}, got {v_fmt!r}")
    if p_format is not None and p_format not in FORMATS:
        raise ValueError(f"p_format must be None or one of {sorted(FORMATS)}, got {p_format!r}")
    if isinstance(p_offset_log2, bool) or not isinstance(p_offset_log2, (int, float)):
        raise TypeError(f"p_offset_log2 must be a real number, got {type(p_offset_log2).__name__}")
    if not math.isfinite(p_offset_log2):
        raise ValueError(f"p_offset_log2 must be finite, got {p_offset_log2}")
    if p_format is not None:
        largest = FORMATS[p_format].max
        if 2.0**p_offset_log2 > largest * (1 + 1e-12):
            raise ValueError(
                f"p_offset_log2={p_offset_log2:g} scales P up to 2^{p_offset_log2:g} = {2.0**p_offset_log2:g}, above "
                f"{p_format}'s largest value {largest:g}: the largest weights would saturate while the row sum "
                f"counts them in full (FlashAttention issue #2716); a right kernel keeps p_offset_log2 <= "
                f"log2({largest:g}) = {math.log2(largest):.4f}"
            )
    if denominator not in ("unrounded", "rounded"):
        raise ValueError(f"denominator must be 'unrounded' or 'rounded', got {denominator!r}")
    bits = 24 if accumulate_bits is None else accumulate_bits
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"accumulate_bits must be None or an int, got {type(accumulate_bits).__name__}")
    if not 8 <= bits <= 53:
        raise ValueError(f"accumulate_bits must lie in [8, 53] (24 for float32, 22 for FP8 tensor cores), "
                         f"got {accumulate_bits}")
    if output_dtype is not None:
        if not isinstance(output_dtype, torch.dtype) or not output_dtype.is_floating_point:
            raise TypeError(f"output_dtype must be None or a floating-point torch.dtype, got {output_dtype!r}")
        if torch.finfo(actual.dtype).eps > torch.finfo(output_dtype).eps:
            raise ValueError(f"output_dtype={dtype_name(output_dtype)} is finer than actual's dtype "
                             f"{dtype_name(actual.dtype)}, which already rounded the output: pass "
                             f"output_dtype=None or torch.{dtype_name(actual.dtype)}")
    if isinstance(output_roundings, bool) or not isinstance(output_roundings, int):
        raise TypeError(f"output_roundings must be an int, got {type(output_roundings).__name__}")
    if output_roundings < 1:
        raise ValueError(f"output_roundings must be >= 1, got {output_roundings}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    if layout not in ("bhld", "blhd"):
        raise ValueError(f"layout must be one of 'bhld', 'blhd', got {layout!r}")
    check_number("factor", factor)
    check_number("atol", atol)
    return {"accumulate_bits": bits, "output_dtype": output_dtype}


def _legend(swap: bool) -> dict[str, str]:
    if swap:
        return {"actual": "(B, L, H, Ev)", "q": "(B, L, H, E)", "k": "(B, S, Hkv, E)", "v": "(B, S, Hkv, Ev)"}
    return {"actual": "(B, H, L, Ev)", "q": "(B, H, L, E)", "k": "(B, Hkv, S, E)", "v": "(B, Hkv, S, Ev)"}


def _check_tensors(actual: torch.Tensor, q: Any, k: Any, v: Any, swap: bool) -> None:
    legend = _legend(swap)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    for name, t in (("actual", actual), ("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {legend[name]}, got shape {tuple(t.shape)}")


def _check_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, swap: bool) -> None:
    legend = _legend(swap)
    B, H, _, E = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != B or v.shape[0] != B or v.shape[1] != Hkv or v.shape[2] != k.shape[2] or k.shape[3] != E:
        raise ValueError(f"k {legend['k']} and v {legend['v']} must fit q {legend['q']} = "
                         f"{caller_shape(q.shape, swap)}, got k {caller_shape(k.shape, swap)} and "
                         f"v {caller_shape(v.shape, swap)}")
    if H != Hkv and not (enable_gqa and Hkv and H % Hkv == 0):
        raise ValueError(f"q has H={H} heads and k Hkv={Hkv}: pass enable_gqa=True with H a multiple of Hkv")


def _position(ratio: torch.Tensor) -> tuple[int, ...]:
    if not ratio.numel():
        return tuple(0 for _ in ratio.shape)
    return tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))


def _failure_lines(actual: torch.Tensor, reference: torch.Tensor, error: torch.Tensor, allowance: torch.Tensor,
                   ratio: torch.Tensor, failing: torch.Tensor, terms: dict[str, torch.Tensor],
                   worst: tuple[int, ...], factor: float, atol: float, swap: bool) -> list[str]:
    at = caller_position(worst, swap)
    err = error[worst].item()
    parts = " + ".join(f"{name} {t[worst].item():.3e}" for name, t in terms.items())
    largest = max(terms, key=lambda name: terms[name][worst].item())
    size = terms[largest][worst].item()
    lines = [
        f"assert_fp8_attention_close: {int(failing.sum())} of {failing.numel()} output elements out of bounds",
        ("  rule: |actual - ref| <= factor * (sum of the terms) + atol per element, ref = float64 attention of "
         "the dequantized inputs"),
        (f"  worst element {at} (the largest error / allowance): actual {value_at(actual, worst)}, "
         f"reference {value_at(reference, worst)}"),
        (f"    |actual - reference| = {err:.3e}, {_times(ratio[worst].item())} its allowance "
         f"{allowance[worst].item():.3e}"),
        f"    allowance: {factor:g} * ({parts}) + {atol:g}",
        (f"    breaks {largest}, the largest term, by {_times(err / size if size > 0 else math.inf)}; each term alone: "
         + ", ".join(f"{name} {_times(err / t[worst].item() if t[worst].item() > 0 else math.inf)}"
                     for name, t in terms.items())),
    ]
    if not math.isfinite(err):
        lines.append(f"    actual is not finite there ({value_at(actual, worst)}): no allowance covers it")
    largest_error = _position(torch.where(failing, error, torch.zeros_like(error)))
    if largest_error != worst:
        lines.append(f"  largest failing error {error[largest_error].item():.3e} at "
                     f"{caller_position(largest_error, swap)} (allowance {allowance[largest_error].item():.3e})")
    return lines


def _times(x: float) -> str:
    return "inf times" if not math.isfinite(x) else f"{x:.3g}x"


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def _config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, swap: bool, fmt: str, p_format: str | None,
            p_offset_log2: float, denominator: str, bits: int, out_dtype: torch.dtype, output_roundings: int,
            quantizes_internally: bool, v_fmt: str | None, is_causal: bool, scale: float | None, enable_gqa: bool,
            layout: str, factor: float, atol: float) -> str:
    inputs = (f"q {caller_shape(q.shape, swap)}, k {caller_shape(k.shape, swap)}, v {caller_shape(v.shape, swap)}, "
              f"{'rounded by the kernel to ' if quantizes_internally else ''}fmt={fmt!r}"
              f"{f', v_fmt={v_fmt!r}' if v_fmt else ''}")
    p_path = ("P not rounded (p_format=None)" if p_format is None else
              f"p_format={p_format!r}, p_offset_log2={p_offset_log2:g}, denominator={denominator!r}")
    return (f"{inputs}\n    {p_path}, accumulate_bits={bits}, output {dtype_name(out_dtype)} "
            f"({counted(output_roundings, 'rounding')})\n    is_causal={is_causal}, scale={scale!r}, "
            f"enable_gqa={enable_gqa}, layout={layout!r}, factor={factor:g}, atol={atol:g}")
