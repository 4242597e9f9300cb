r"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi): one layer's math in its two equal forms.

MLA caches, per token, one small *latent* vector ``c_KV`` (``C`` values) and one
RoPE key ``k_pe`` (``R`` values) shared by all heads, instead of ``H`` keys and
``H`` values. Each head's key and value are linear images of the latent:

$$
k^{\mathrm{nope}}_{h,j} = W^{UK}_h c_j, \qquad v_{h,j} = W^{UV}_h c_j, \qquad
k_{h,j} = [\,k^{\mathrm{nope}}_{h,j} \mid k^{\mathrm{pe}}_j\,], \qquad
q_{h,i} = [\,q^{\mathrm{nope}}_{h,i} \mid q^{\mathrm{pe}}_{h,i}\,]
$$

where ``W_UK`` ``(H, P, C)`` and ``W_UV`` ``(H, Ev, C)`` are the two halves of
``kv_b_proj`` (`split_kv_b_proj`). The same attention computes in two ways:

- `mla_naive` (the MHA form, prefill and training): expand every key and value,
  ``H`` heads of size ``E = P + R`` and ``Ev``, and call the functional core;
- `mla_absorbed` (the MQA form, decoding): since
  ``q_nope . (W_UK c) = (q_nope W_UK) . c``, fold ``W_UK`` into the query
  (``q_latent``, ``C`` values) and ``W_UV`` into the output; attention then runs
  over one key/value head ``[c_KV | k_pe]`` (``C + R``) with value ``c_KV``
  (``C``), straight from the latent cache, nothing expanded.

Both use **the naive form's softmax scale**, ``1/sqrt(P + R)`` (times YaRN's
``mscale^2``, `softmax_scale`), never ``1/sqrt(C + R)``: absorption regroups a
product, it does not change the scores.

Shapes: the package legend (``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys,
``Ev`` value size per head) and MLA's own sizes, with DeepSeek-V3's values:
``P`` = ``qk_nope_head_dim`` (128), ``R`` = ``qk_rope_head_dim`` (64), ``E = P + R``
(192), ``C`` = ``kv_lora_rank`` (512), ``Ev`` = ``v_head_dim`` (128), ``d`` the
model width (7168) and ``Cq`` = ``q_lora_rank`` (1536).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attention_ref._validation import (
    check_positive_int,
    check_scale,
    fmt_shape,
    require_float_tensor,
    require_module_input,
    require_same_dtype_and_device,
    require_tensor,
)
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.masks import causal_mask, combine_masks
from attention_ref.positional import apply_rope  # kept here too: `from attention_ref.mla import apply_rope`

__all__ = [
    "LatentCache",
    "MultiHeadLatentAttention",
    "expanded_values_per_token",
    "latent_values_per_token",
    "mla_absorbed",
    "mla_naive",
    "softmax_scale",
    "split_kv_b_proj",
    "yarn_mscale",
]


# --- sizes and the softmax scale ---------------------------------------------------------------


def _check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive finite float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return float(value)


def yarn_mscale(factor: float, mscale_all_dim: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 when ``factor <= 1``).

    DeepSeek multiplies the softmax scale by its square (`softmax_scale`); the
    RoPE tables' own ``attention_factor`` is then 1 (transformers'
    ``yarn_get_mscale`` and ``yarn_apply_mscale``).

    Args:
        factor: YaRN's context extension factor (``rope_parameters["factor"]``, 40 in V3).
        mscale_all_dim: ``rope_parameters["mscale_all_dim"]`` (1.0 in V3).

    Returns:
        The factor ``mscale``, a float >= 1 for ``factor >= 1``.

    Raises:
        TypeError: an argument that is not a number.
        ValueError: a non-positive or non-finite ``factor``.

    Example:
        >>> round(yarn_mscale(40.0, 1.0) ** 2, 4)  # DeepSeek-V3's extra factor on the scale
        1.8739
    """
    for name, value in (("factor", factor), ("mscale_all_dim", mscale_all_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be a positive finite float, got {factor}")
    if factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int, *, mscale: float = 1.0) -> float:
    """MLA's softmax scale ``mscale^2 / sqrt(P + R)``, the same in the naive and absorbed forms.

    The absorbed form's query and key have ``C + R`` features (576 in V3), but
    its scores are the naive form's, regrouped: the scale stays that of the
    ``P + R`` (192) features each head's query and key have before absorption.

    Args:
        qk_nope_head_dim: ``P``.
        qk_rope_head_dim: ``R`` (0 for none).
        mscale: YaRN's `yarn_mscale` (1.0 without YaRN); it enters squared.

    Returns:
        The scale, a positive float.

    Raises:
        TypeError: a size that is not an int, ``mscale`` not a number.
        ValueError: a negative size, ``P + R = 0``, a non-positive ``mscale``.

    Example:
        >>> softmax_scale(128, 64) == 1 / 192 ** 0.5  # not 1 / sqrt(512 + 64)
        True
        >>> round(softmax_scale(128, 64, mscale=yarn_mscale(40.0)) * 192 ** 0.5, 4)
        1.8739
    """
    check_positive_int("qk_nope_head_dim", qk_nope_head_dim, allow_zero=True)
    check_positive_int("qk_rope_head_dim", qk_rope_head_dim, allow_zero=True)
    if qk_nope_head_dim + qk_rope_head_dim == 0:
        raise ValueError("qk_nope_head_dim + qk_rope_head_dim must be positive, got 0 + 0")
    _check_positive_float("mscale", mscale)
    return mscale * mscale / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)


def latent_values_per_token(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Values one token leaves in one layer's latent cache: ``c_KV`` and ``k_pe``, ``C + R``.

    Example:
        >>> latent_values_per_token(512, 64)  # DeepSeek-V3
        576
    """
    check_positive_int("kv_lora_rank", kv_lora_rank)
    check_positive_int("qk_rope_head_dim", qk_rope_head_dim, allow_zero=True)
    return kv_lora_rank + qk_rope_head_dim


def expanded_values_per_token(num_heads: int, qk_head_dim: int, v_head_dim: int) -> int:
    """Values one token leaves in one layer's expanded cache: ``H`` keys and ``H`` values, ``H (E + Ev)``.

    Example:
        >>> expanded_values_per_token(128, 128 + 64, 128)  # DeepSeek-V3 expanded
        40960
        >>> expanded_values_per_token(128, 192, 128) // latent_values_per_token(512, 64)
        71
    """
    check_positive_int("num_heads", num_heads)
    check_positive_int("qk_head_dim", qk_head_dim)
    check_positive_int("v_head_dim", v_head_dim)
    return num_heads * (qk_head_dim + v_head_dim)


def split_kv_b_proj(
    weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_b_proj.weight`` into ``W_UK`` ``(H, P, C)`` and ``W_UV`` ``(H, Ev, C)``.

    ``kv_b_proj`` maps a latent ``c`` ``(C,)`` to ``[k_nope_1 | v_1 | k_nope_2 | v_2 | ...]``,
    head by head (DeepSeek's and transformers' layout), so its weight
    ``(H * (P + Ev), C)`` is viewed as ``(H, P + Ev, C)`` and cut along dim 1.
    Both halves are views: gradients reach ``weight``.

    Args:
        weight: ``(H * (P + Ev), C)``.
        num_heads: ``H``.
        qk_nope_head_dim: ``P``.
        v_head_dim: ``Ev``.

    Returns:
        ``(w_uk, w_uv)``: ``k_nope_h = w_uk[h] @ c`` and ``v_h = w_uv[h] @ c``.

    Raises:
        TypeError: ``weight`` not a floating-point tensor, a size not an int.
        ValueError: ``weight`` not 2-D, or its dim 0 not ``H * (P + Ev)``.

    Example:
        >>> w_uk, w_uv = split_kv_b_proj(torch.randn(3 * (7 + 5), 11), 3, 7, 5)
        >>> w_uk.shape, w_uv.shape
        (torch.Size([3, 7, 11]), torch.Size([3, 5, 11]))
    """
    weight = require_float_tensor("weight", weight, 2, "(H * (P + Ev), C)")
    check_positive_int("num_heads", num_heads)
    check_positive_int("qk_nope_head_dim", qk_nope_head_dim)
    check_positive_int("v_head_dim", v_head_dim)
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise ValueError(
            f"weight must have shape (H * (P + Ev), C) = ({num_heads} * ({qk_nope_head_dim} + {v_head_dim}), C) "
            f"= ({rows}, C), got {fmt_shape(weight.shape)}"
        )
    per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])  # (H, P + Ev, C)
    w_uk, w_uv = per_head.split([qk_nope_head_dim, v_head_dim], dim=1)  # (H, P, C), (H, Ev, C)
    return w_uk, w_uv


# --- the two forms ------------------------------------------------------------------------------


def _check_forms(
    q_nope: object, q_pe: object, latent: object, k_pe: object, w_uk: object, w_uv: object
) -> None:
    """Check the six tensors of `mla_naive` / `mla_absorbed` against each other."""
    q_nope = require_float_tensor("q_nope", q_nope, 4, "(B, H, L, P)")
    q_pe = require_float_tensor("q_pe", q_pe, 4, "(B, H, L, R)")
    latent = require_float_tensor("latent", latent, 3, "(B, S, C)")
    k_pe = require_float_tensor("k_pe", k_pe, 3, "(B, S, R)")
    w_uk = require_float_tensor("w_uk", w_uk, 3, "(H, P, C)")
    w_uv = require_float_tensor("w_uv", w_uv, 3, "(H, Ev, C)")
    require_same_dtype_and_device(q_nope=q_nope, q_pe=q_pe, latent=latent, k_pe=k_pe, w_uk=w_uk, w_uv=w_uv)
    for name, tensor, dims in (("q_nope", q_nope, 4), ("q_pe", q_pe, 4), ("latent", latent, 3),
                               ("k_pe", k_pe, 3), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
        if tensor.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims, got shape {fmt_shape(tensor.shape)}")
    B, H, L, P = q_nope.shape
    R = q_pe.shape[-1]
    S, C = latent.shape[1], latent.shape[2]
    Ev = w_uv.shape[1]
    expected = {
        "q_pe": ((B, H, L, R), "(B, H, L, R)", q_pe),
        "latent": ((B, S, C), "(B, S, C)", latent),
        "k_pe": ((B, S, R), "(B, S, R)", k_pe),
        "w_uk": ((H, P, C), "(H, P, C)", w_uk),
        "w_uv": ((H, Ev, C), "(H, Ev, C)", w_uv),
    }
    for name, (shape, layout, tensor) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape {layout} = {fmt_shape(shape)} (B, H, L, P from q_nope "
                f"{fmt_shape(q_nope.shape)}, S, C from latent {fmt_shape(latent.shape)}), "
                f"got {fmt_shape(tensor.shape)}"
            )


def mla_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    r"""MLA in its naive (MHA) form: expand each head's key and value from the latent, then attend.

    $$
    k_h = [\,c\,W^{UK\top}_h \mid k^{\mathrm{pe}}\,], \quad v_h = c\,W^{UV\top}_h, \quad
    o_h = \mathrm{softmax}\big(\text{scale}\cdot[q^{\mathrm{nope}}_h \mid q^{\mathrm{pe}}_h]\,k_h^\top + M\big)\,v_h
    $$

    ``H`` heads of query/key size ``E = P + R`` and value size ``Ev`` go through
    `attention_ref.functional.scaled_dot_product_attention`; ``k_pe`` is one
    head, the same for every query head. This is what transformers'
    ``DeepseekV3Attention`` computes (``expand_kv``), and what prefill and
    training kernels run (FlashMLA's "MHA mode", 192/128).

    Args:
        q_nope: ``(B, H, L, P)``, the queries' position-free part.
        q_pe: ``(B, H, L, R)``, the queries' RoPE part, already rotated.
        latent: ``(B, S, C)``, ``c_KV`` of each key (after ``kv_a_layernorm``).
        k_pe: ``(B, S, R)``, the keys' RoPE part, already rotated, shared by all heads.
        w_uk: ``(H, P, C)``, from `split_kv_b_proj`.
        w_uv: ``(H, Ev, C)``, from `split_kv_b_proj`.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(B, H, L, S)``.
        is_causal: top-left aligned causal mask (key ``j`` for query ``i`` when ``j <= i``).
        scale: defaults to ``1 / sqrt(P + R)``; pass `softmax_scale` with YaRN's mscale.

    Returns:
        ``(B, H, L, Ev)``, the heads' outputs before ``o_proj``.

    Raises:
        ValueError: shapes that do not fit (the message names the tensor and
            the expected shape), tensors on different devices, a bad scale.
        TypeError: non-float tensors or tensors of different dtypes.

    Example:
        >>> B, H, L, S, P, R, C, Ev = 2, 3, 5, 7, 11, 4, 13, 6
        >>> q_nope, q_pe = torch.randn(B, H, L, P), torch.randn(B, H, L, R)
        >>> latent, k_pe = torch.randn(B, S, C), torch.randn(B, S, R)
        >>> w_uk, w_uv = torch.randn(H, P, C), torch.randn(H, Ev, C)
        >>> mla_naive(q_nope, q_pe, latent, k_pe, w_uk, w_uv).shape
        torch.Size([2, 3, 5, 6])
    """
    _check_forms(q_nope, q_pe, latent, k_pe, w_uk, w_uv)
    check_scale(scale)
    (B, H, _, P), (S, R) = q_nope.shape, k_pe.shape[1:]
    k_nope = torch.einsum("bsc,hpc->bhsp", latent, w_uk)  # (B, S, C) x (H, P, C) -> (B, H, S, P)
    value = torch.einsum("bsc,hvc->bhsv", latent, w_uv)  # (B, S, C) x (H, Ev, C) -> (B, H, S, Ev)
    shared_pe = k_pe.unsqueeze(1).expand(B, H, S, R)  # (B, S, R) -> (B, H, S, R): one head for all
    query = torch.cat((q_nope, q_pe), dim=-1)  # (B, H, L, P + R)
    key = torch.cat((k_nope, shared_pe), dim=-1)  # (B, H, S, P + R)
    scale = softmax_scale(P, R) if scale is None else scale
    # (B, H, L, P + R) x (B, H, S, P + R) x (B, H, S, Ev) -> (B, H, L, Ev)
    return scaled_dot_product_attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    r"""MLA in its absorbed (MQA) form: ``W_UK`` folded into the query, ``W_UV`` into the output.

    Equals `mla_naive` (same arguments, same result up to rounding), because
    the scores and the weighted sum regroup:

    $$
    q^{\mathrm{nope}}_h \cdot (W^{UK}_h c_j) = (q^{\mathrm{nope}}_h W^{UK}_h) \cdot c_j, \qquad
    \sum_j w_{hij}\, W^{UV}_h c_j = W^{UV}_h \sum_j w_{hij}\, c_j .
    $$

    So ``q_latent = q_nope @ W_UK`` ``(B, H, L, C)``, and attention runs with
    query ``[q_latent | q_pe]`` (``C + R``, 576 in V3) against **one** key/value
    head: key ``[c_KV | k_pe]`` (576) and value ``c_KV`` (512), read straight
    from a latent cache (FlashMLA's "MQA mode", FlashInfer's ``ckv``/``kpe``).
    The head's ``(B, H, L, C)`` result is mapped by ``W_UV`` to ``(B, H, L, Ev)``.

    The softmax scale is the naive form's, ``1 / sqrt(P + R)`` by default, **not**
    ``1 / sqrt(C + R)``, which the absorbed query's size would suggest: the
    scores are the same numbers, regrouped. (FlashAttention 4's ``qv`` defaults
    to ``1 / sqrt(576)``; DeepSeek callers pass the scale.)

    Args:
        q_nope: ``(B, H, L, P)``.
        q_pe: ``(B, H, L, R)``, already rotated.
        latent: ``(B, S, C)``, the cached ``c_KV``.
        k_pe: ``(B, S, R)``, the cached RoPE key, already rotated.
        w_uk: ``(H, P, C)``.
        w_uv: ``(H, Ev, C)``.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(B, H, L, S)``.
        is_causal: top-left aligned causal mask (key ``j`` for query ``i`` when ``j <= i``).
        scale: defaults to ``1 / sqrt(P + R)``; pass `softmax_scale` with YaRN's mscale.

    Returns:
        ``(B, H, L, Ev)``, equal to `mla_naive`'s.

    Raises:
        ValueError: shapes that do not fit, tensors on different devices, a bad scale.
        TypeError: non-float tensors or tensors of different dtypes.

    Example:
        >>> B, H, L, S, P, R, C, Ev = 2, 3, 5, 7, 11, 4, 13, 6
        >>> args = (torch.randn(B, H, L, P, dtype=torch.float64), torch.randn(B, H, L, R, dtype=torch.float64),
        ...         torch.randn(B, S, C, dtype=torch.float64), torch.randn(B, S, R, dtype=torch.float64),
        ...         torch.randn(H, P, C, dtype=torch.float64), torch.randn(H, Ev, C, dtype=torch.float64))
        >>> torch.allclose(mla_absorbed(*args, is_causal=True), mla_naive(*args, is_causal=True),
        ...                rtol=0, atol=1e-12)
        True
    """
    _check_forms(q_nope, q_pe, latent, k_pe, w_uk, w_uv)
    check_scale(scale)
    P, R = q_nope.shape[-1], q_pe.shape[-1]
    q_latent = torch.einsum("bhlp,hpc->bhlc", q_nope, w_uk)  # (B, H, L, P) x (H, P, C) -> (B, H, L, C)
    query = torch.cat((q_latent, q_pe), dim=-1)  # (B, H, L, C + R)
    key = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)  # (B, S, C + R) -> (B, 1, S, C + R): one head
    value = latent.unsqueeze(1)  # (B, S, C) -> (B, 1, S, C)
    scale = softmax_scale(P, R) if scale is None else scale  # the naive form's, never 1/sqrt(C + R)
    # (B, H, L, C + R) x (B, 1, S, C + R) x (B, 1, S, C) -> (B, H, L, C); the one head broadcasts
    latent_out = scaled_dot_product_attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale)
    return torch.einsum("bhlc,hvc->bhlv", latent_out, w_uv)  # (B, H, L, C) x (H, Ev, C) -> (B, H, L, Ev)


# --- decoupled RoPE ---------------------------------------------------------------------------


# --- the latent cache ---------------------------------------------------------------------------


class LatentCache:
    """MLA's key/value cache: per token only the latent ``c_KV`` ``(C,)`` and the RoPE key ``k_pe`` ``(R,)``.

    ``latent`` ``(B, S_max, C)`` and ``rope_key`` ``(B, S_max, R)`` are allocated
    once, zero-filled; `append` writes new tokens after the ones held (every
    sequence of the batch holds the same number). The keys and values of the
    ``H`` heads are never stored: the absorbed form (`mla_absorbed`) attends to
    the latents directly. One cache serves one layer; for inference
    (``torch.no_grad()``), since `append` writes in place.

    Per token and layer that is ``C + R`` values (`latent_values_per_token`)
    where an expanded cache holds ``H`` keys of ``P + R`` and ``H`` values of ``Ev``
    (`expanded_values_per_token`); for DeepSeek-V3's sizes, computed:

        >>> latent_values_per_token(512, 64), expanded_values_per_token(128, 192, 128)
        (576, 40960)

    Args:
        batch: ``B``.
        kv_lora_rank: ``C``.
        qk_rope_head_dim: ``R``.
        max_length: ``S_max``, the most tokens a sequence may hold.
        dtype: a floating-point dtype; defaults to torch's default dtype.
        device: where the tensors live.

    Raises:
        TypeError: a size that is not an int, a non-float dtype.
        ValueError: a size that is not positive.

    Example:
        >>> cache = LatentCache(batch=2, kv_lora_rank=11, qk_rope_head_dim=4, max_length=6)
        >>> latent, k_pe = cache.append(torch.ones(2, 3, 11), torch.ones(2, 3, 4))
        >>> latent.shape, k_pe.shape, cache.length, cache.values_per_token
        (torch.Size([2, 3, 11]), torch.Size([2, 3, 4]), 3, 15)
    """

    def __init__(self, batch: int, kv_lora_rank: int, qk_rope_head_dim: int, max_length: int, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        check_positive_int("batch", batch)
        check_positive_int("kv_lora_rank", kv_lora_rank)
        check_positive_int("qk_rope_head_dim", qk_rope_head_dim, allow_zero=True)
        check_positive_int("max_length", max_length)
        resolved = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        self.latent = torch.zeros(batch, max_length, kv_lora_rank, dtype=resolved, device=device)
        self.rope_key = torch.zeros(batch, max_length, qk_rope_head_dim, dtype=resolved, device=device)
        self._length = 0

    @property
    def length(self) -> int:
        """The number of tokens each sequence holds."""
        return self._length

    @property
    def max_length(self) -> int:
        """``S_max``: the most tokens a sequence may hold."""
        return self.latent.shape[1]

    @property
    def values_per_token(self) -> int:
        """``C + R``: the values one token takes, `latent_values_per_token`."""
        return self.latent.shape[2] + self.rope_key.shape[2]

    @property
    def memory_bytes(self) -> int:
        """Bytes of the two tensors, allocated up front for ``max_length`` tokens."""
        return sum(t.numel() * t.element_size() for t in (self.latent, self.rope_key))

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``Lnew`` new tokens of every sequence after the ones held.

        Args:
            latent: ``(B, Lnew, C)``, in the cache's dtype and device.
            k_pe: ``(B, Lnew, R)``, already rotated.

        Returns:
            ``(latent, k_pe)``: views ``(B, length, C)`` and ``(B, length, R)`` of
            every token held, the new ones included.

        Raises:
            TypeError: a non-float tensor or another dtype than the cache's.
            ValueError: wrong shapes, another device, or more tokens than
                ``max_length`` leaves room for (nothing is written then).
        """
        B, _, C = self.latent.shape
        R = self.rope_key.shape[2]
        for name, tensor, width, layout in (("latent", latent, C, "(B, Lnew, C)"),
                                            ("k_pe", k_pe, R, "(B, Lnew, R)")):
            tensor = require_float_tensor(name, tensor, 3, layout)
            if tensor.dim() != 3 or tensor.shape[0] != B or tensor.shape[2] != width:
                raise ValueError(
                    f"{name} must have shape {layout} = ({B}, Lnew, {width}), got {fmt_shape(tensor.shape)}"
                )
            require_same_dtype_and_device(cache=self.latent, **{name: tensor})
        new = latent.shape[1]
        if k_pe.shape[1] != new:
            raise ValueError(
                f"latent and k_pe must hold the same number of new tokens Lnew (dim 1): latent has shape "
                f"{fmt_shape(latent.shape)}, k_pe has shape {fmt_shape(k_pe.shape)}"
            )
        start, end = self._length, self._length + new
        if end > self.max_length:
            raise ValueError(
                f"latent: appending {new} tokens to a cache holding {start} of max_length = {self.max_length} "
                f"needs {end}; nothing was written"
            )
        self.latent[:, start:end] = latent  # positions start .. end - 1 of every sequence
        self.rope_key[:, start:end] = k_pe
        self._length = end
        return self.latent[:, :end], self.rope_key[:, :end]


# --- the module -----------------------------------------------------------------------------------


class MultiHeadLatentAttention(nn.Module):
    r"""One MLA layer (DeepSeek-V2/V3, Kimi), equal to transformers' ``DeepseekV3Attention``.

    $$
    c^Q = \mathrm{RMSNorm}(x W^{DQ}), \quad [q^{\mathrm{nope}}_h \mid q^{\mathrm{pe}}_h] = c^Q W^{UQ}_h, \quad
    [c^{KV} \mid k^{\mathrm{pe}}] = x W^{DKV}, \quad c^{KV} \leftarrow \mathrm{RMSNorm}(c^{KV})
    $$

    then RoPE on ``q_pe`` and ``k_pe`` only (decoupled RoPE), attention
    (`mla_naive` without a cache, `mla_absorbed` with a `LatentCache`), and
    ``o_proj`` on the concatenated heads. Without ``q_lora_rank`` the query is
    one projection ``q_proj``. With ``use_rope=False`` nothing is rotated
    (Kimi Linear's NoPE MLA: the ``R`` features stay, position-free).

    The parameter names are transformers': ``q_proj`` or ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj`` (``W_UK`` and ``W_UV``, `split_kv_b_proj`); ``o_proj``.

    Args:
        hidden_size: ``d``.
        num_heads: ``H``.
        kv_lora_rank: ``C``.
        qk_nope_head_dim: ``P``.
        qk_rope_head_dim: ``R`` (even with RoPE).
        v_head_dim: ``Ev``.
        q_lora_rank: ``Cq``, or ``None`` for one query projection.
        scale: the softmax scale; defaults to `softmax_scale` ``(P, R)``, i.e.
            ``1/sqrt(P + R)`` (pass ``softmax_scale(P, R, mscale=yarn_mscale(...))`` for YaRN).
        use_rope: rotate ``q_pe``/``k_pe``; ``False`` for NoPE.
        rope_theta: the RoPE base; gives ``inv_freq = rope_theta^(-2j/R)``.
        rope_interleaved: DeepSeek's pairs ``(2j, 2j + 1)`` (``True``) or half-split.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
            (transformers' ``attention_bias``).
        eps: the RMSNorms' epsilon.
        device: where to create the parameters.
        dtype: dtype of the parameters.

    Attributes:
        inv_freq: ``(R/2,)`` buffer of RoPE frequencies (YaRN's, after `from_hf`).
        rope_attention_factor: multiplies ``cos`` and ``sin`` (1.0 for DeepSeek's YaRN).

    Raises:
        TypeError: a size that is not an int, a flag that is not a bool.
        ValueError: a non-positive size, an odd ``R`` with RoPE, a bad scale.

    Example:
        >>> mla = MultiHeadLatentAttention(16, 3, kv_lora_rank=7, qk_nope_head_dim=5,
        ...                                qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=11)
        >>> x = torch.randn(2, 5, 16)
        >>> full = mla(x)  # the naive form, causal
        >>> cache = LatentCache(2, 7, 4, max_length=5)
        >>> steps = [mla(x[:, i : i + 1], cache=cache) for i in range(5)]  # absorbed, one token at a time
        >>> torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        scale: float | None = None,
        use_rope: bool = True,
        rope_theta: float = 10000.0,
        rope_interleaved: bool = True,
        bias: bool = False,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("v_head_dim", v_head_dim)):
            check_positive_int(name, value)
        check_positive_int("qk_rope_head_dim", qk_rope_head_dim, allow_zero=True)
        if q_lora_rank is not None:
            check_positive_int("q_lora_rank", q_lora_rank)
        for name, value in (("use_rope", use_rope), ("rope_interleaved", rope_interleaved), ("bias", bias)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if use_rope and qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even with RoPE (pairs rotate), got {qk_rope_head_dim}")
        check_scale(scale)
        _check_positive_float("rope_theta", rope_theta)
        self.hidden_size, self.num_heads, self.q_lora_rank = hidden_size, num_heads, q_lora_rank
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = softmax_scale(qk_nope_head_dim, qk_rope_head_dim) if scale is None else float(scale)
        self.use_rope, self.rope_interleaved = use_rope, rope_interleaved
        factory = {"device": device, "dtype": dtype}
        H, E = num_heads, self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * E, bias=False, **factory)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias, **factory)
            self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=eps, **factory)
            self.q_b_proj = nn.Linear(q_lora_rank, H * E, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, **factory)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=eps, **factory)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False, **factory)
        self.o_proj = nn.Linear(H * v_head_dim, hidden_size, bias=bias, **factory)
        j = torch.arange(qk_rope_head_dim // 2, dtype=torch.float64, device=device)  # (R/2,)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_theta ** (-2.0 * j / max(qk_rope_head_dim, 1)), persistent=False)
        self.rope_attention_factor = 1.0

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, scale={self.scale:.6g}, "
            f"use_rope={self.use_rope}, rope_interleaved={self.rope_interleaved}"
        )

    def kv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK, W_UV)``, ``(H, P, C)`` and ``(H, Ev, C)``: `split_kv_b_proj` of ``kv_b_proj``."""
        return split_kv_b_proj(self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the angles ``positions * inv_freq``, each ``(..., L, R/2)``.

        The angles are formed in float64; both tables are multiplied by
        ``rope_attention_factor``, as transformers' rotary embeddings do.

        Args:
            positions: integer positions ``(L,)`` or ``(B, L)``.
        """
        positions = require_tensor("positions", positions)
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"positions must be an integer tensor (L,) or (B, L), got {positions.dtype}")
        angles = positions.to(torch.float64)[..., None] * self.inv_freq.to(torch.float64)  # (..., L, R/2)
        return angles.cos() * self.rope_attention_factor, angles.sin() * self.rope_attention_factor

    def _check_hidden(self, x: object) -> torch.Tensor:
        return require_module_input("hidden_states", x, self.hidden_size, self.o_proj.weight.dtype,
                                    self.o_proj.weight.device)

    def _rotary_for(self, x: torch.Tensor, positions: torch.Tensor | None,
                    rotary: tuple[torch.Tensor, torch.Tensor] | None, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(cos, sin)`` tables of the ``L`` new tokens: given, from ``positions``, or ``start + 0..L-1``."""
        L = x.shape[1]
        if rotary is not None:
            if positions is not None:
                raise ValueError("pass positions or rotary, not both")
            if not isinstance(rotary, tuple) or len(rotary) != 2:
                raise TypeError(f"rotary must be a (cos, sin) tuple, got {type(rotary).__name__}")
            cos, sin = rotary
            expected = (L, self.qk_rope_head_dim // 2)
            for name, table in (("cos", cos), ("sin", sin)):
                table = require_float_tensor(f"rotary's {name}", table, 2, "(..., L, R/2)")
                if tuple(table.shape[-2:]) != expected:
                    raise ValueError(
                        f"rotary's {name} must have shape (..., L, R/2) = (..., {L}, {expected[1]}), "
                        f"got {fmt_shape(table.shape)}"
                    )
            return cos, sin
        if positions is None:
            positions = torch.arange(start, start + L, device=x.device)  # (L,)
        else:
            positions = require_tensor("positions", positions)
            if positions.shape[-1:] != (L,) or positions.dim() > 2:
                raise ValueError(
                    f"positions must have shape (L,) or (B, L) with L = {L}, got {fmt_shape(positions.shape)}"
                )
        return self.rotary(positions)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        cache: LatentCache | None = None,
    ) -> torch.Tensor:
        """Attend from each token to the tokens before it (or as ``attn_mask`` says).

        Args:
            hidden_states: ``(B, L, d)``.
            positions: integer positions ``(L,)`` or ``(B, L)`` of the new tokens;
                default ``0 .. L-1``, or after the tokens ``cache`` holds.
            rotary: ``(cos, sin)`` tables ``(..., L, R/2)`` to use instead of
                `rotary` ``(positions)``. transformers' rotary embeddings return
                ``(B, L, R)`` with the two halves equal: pass ``cos[..., :R/2]``.
            attn_mask: bool ``True`` = the pair takes part (the opposite of
                ``torch.nn.MultiheadAttention``), or float, added to the scores;
                broadcastable to ``(B, H, L, S)``; combined with ``is_causal``.
            is_causal: each query sees the keys up to its own position (aligned
                bottom-right with a cache: the last query sees every key held).
            cache: a `LatentCache`: the new tokens' ``c_KV`` and ``k_pe`` are
                appended and attention runs in the absorbed form over all held
                tokens. Without it: the naive form over the ``L`` tokens.

        Returns:
            ``(B, L, d)``.
        """
        x = self._check_hidden(hidden_states)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache or None, got {type(cache).__name__}")
        B, L, _ = x.shape
        H, P, R, C = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (B, L, d) -> (B, L, H * (P + R))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, L, d) -> (B, L, Cq) -> (B, L, H * (P + R))
        q = q.view(B, L, H, P + R).transpose(1, 2)  # (B, L, H * (P + R)) -> (B, H, L, P + R)
        q_nope, q_pe = q.split([P, R], dim=-1)  # (B, H, L, P), (B, H, L, R)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)  # (B, L, d) -> (B, L, C), (B, L, R)
        latent = self.kv_a_layernorm(latent)  # (B, L, C)
        start = 0 if cache is None else cache.length
        if self.use_rope:
            cos, sin = self._rotary_for(x, positions, rotary, start)  # (..., L, R/2) each
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            q_pe = apply_rope(q_pe, cos.unsqueeze(-3), sin.unsqueeze(-3), interleaved=self.rope_interleaved)
            k_pe = apply_rope(k_pe, cos, sin, interleaved=self.rope_interleaved)  # (B, L, R)
        w_uk, w_uv = self.kv_weights()  # (H, P, C), (H, Ev, C)
        if cache is None:
            out = mla_naive(q_nope, q_pe, latent, k_pe, w_uk, w_uv, attn_mask, is_causal=is_causal,
                            scale=self.scale)  # (B, H, L, Ev)
        else:
            latent, k_pe = cache.append(latent, k_pe)  # (B, S, C), (B, S, R), S = tokens held
            causal = causal_mask(L, latent.shape[1], alignment="bottom_right", device=x.device) if is_causal else None
            mask = combine_masks(causal, attn_mask)  # (L, S) and attn_mask broadcast to (B, H, L, S)
            out = mla_absorbed(q_nope, q_pe, latent, k_pe, w_uk, w_uv, mask, scale=self.scale)  # (B, H, L, Ev)
        out = out.transpose(1, 2).reshape(B, L, H * self.v_head_dim)  # (B, H, L, Ev) -> (B, L, H * Ev)
        return self.o_proj(out)  # (B, L, d)

    @classmethod
    def from_hf(cls, layer: nn.Module) -> MultiHeadLatentAttention:
        """Copy a transformers ``DeepseekV3Attention`` or ``KimiLinearAttention`` (NoPE) into this class.

        The sizes, RMSNorm epsilons, ``attention_bias`` and ``rope_interleave``
        come from the layer and its config; the softmax scale is recomputed by
        `softmax_scale` and `yarn_mscale` from ``config.rope_parameters`` (and
        must equal the layer's ``scaling``); the RoPE frequencies and
        ``attention_factor`` are those transformers' rotary embedding of the
        config uses (YaRN's included). Weights are copied, not shared.

        Raises:
            TypeError: ``layer`` is neither class (nor a subclass).
            ValueError: a config this class does not implement (grouped
                key/value heads), or a recomputed scale that differs from the layer's.
        """
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
        )
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            KimiLinearAttention,
        )

        if not isinstance(layer, (DeepseekV3Attention, KimiLinearAttention)):
            raise TypeError(
                f"layer must be a transformers DeepseekV3Attention or KimiLinearAttention, got {type(layer).__name__}"
            )
        config = layer.config
        if layer.num_key_value_groups != 1:
            raise ValueError(
                f"num_key_value_heads must equal num_attention_heads ({layer.num_heads}) in MLA, "
                f"got num_key_value_groups = {layer.num_key_value_groups}"
            )
        nope = isinstance(layer, KimiLinearAttention)
        P, R = layer.qk_nope_head_dim, layer.qk_rope_head_dim
        mscale = 1.0
        params = getattr(config, "rope_parameters", None) or {}
        if not nope and params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            mscale = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = softmax_scale(P, R, mscale=mscale)
        if not math.isclose(scale, layer.scaling, rel_tol=1e-12):
            raise ValueError(f"the recomputed softmax scale {scale} differs from the layer's scaling {layer.scaling}")
        weight = layer.o_proj.weight
        copy = cls(
            layer.hidden_size,
            layer.num_heads,
            kv_lora_rank=layer.kv_lora_rank,
            qk_nope_head_dim=P,
            qk_rope_head_dim=R,
            v_head_dim=layer.v_head_dim,
            q_lora_rank=layer.q_lora_rank,
            scale=scale,
            use_rope=not nope,
            rope_interleaved=bool(getattr(config, "rope_interleave", False)),
            bias=layer.o_proj.bias is not None,
            eps=layer.kv_a_layernorm.variance_epsilon,
            device=weight.device,
            dtype=weight.dtype,
        )
        if copy.q_lora_rank is not None:
            copy.q_a_layernorm.eps = layer.q_a_layernorm.variance_epsilon
        if not nope:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3RotaryEmbedding,
            )

            rope_type = params.get("rope_type", "default")
            init = (DeepseekV3RotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
                    else ROPE_INIT_FUNCTIONS[rope_type])
            inv_freq, attention_factor = init(config, device=weight.device)
            copy.inv_freq = inv_freq.to(device=weight.device, dtype=torch.float64)
            copy.rope_attention_factor = float(attention_factor)
        copy.load_state_dict(layer.state_dict(), strict=True)
        copy.train(layer.training)
        return copy
