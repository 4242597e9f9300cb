r"""The functional core: attention weights and scaled dot-product attention.

Every other part of the package (multi-head attention, cross-attention, the
plots, the docs) calls these two functions. The math, for one query row ``i``:

$$
\mathrm{scores}_{ij} = \text{scale}\cdot q_i \cdot k_j + m_{ij}, \qquad
w_{ij} = \frac{e^{\mathrm{scores}_{ij}}}{\sum_{j'} e^{\mathrm{scores}_{ij'}}}, \qquad
\mathrm{out}_i = \sum_j w_{ij} v_j
$$

where ``m`` is 0 for pairs that take part and ``-inf`` for masked pairs (or the
values of a float mask). Shapes use the package legend: ``B`` batch, ``H`` heads,
``L`` query length, ``S`` key length, ``E`` query/key size, ``Ev`` value size.

The order of the steps, for every argument that takes part (the same in
`attention_weights` and `scaled_dot_product_attention`):

1. ``scores = scale * query @ key^T``, in at least float32;
2. ``score_mod(scores, b, h, q_idx, kv_idx)`` replaces them (FlexAttention's
   signature, see `attention_ref.mods`);
3. a float ``attn_mask`` is added;
4. every boolean condition masks: a bool ``attn_mask``, ``is_causal`` and
   ``mask_mod(b, h, q_idx, kv_idx)``; a pair takes part only when all of them
   keep it (``True`` = takes part) and its score becomes ``-inf`` otherwise;
5. softmax over the keys; a query row with no key left gives weights 0 and
   output 0, with finite gradients.

For the mods the scores' leading dims ``(..., H)`` are read as batch and heads:
``h`` indexes the last leading dim, ``b`` the others flattened (0 when there
are none), as `attention_ref.mods.index_grids` builds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_ref import _inputs
from attention_ref import backends as _backends
from attention_ref import mods as _mods
from attention_ref._validation import check_probability
from attention_ref.masks import causal_mask

__all__ = ["attention_weights", "scaled_dot_product_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax runs in at least float32: float16/bfloat16 inputs are upcast."""
    return torch.promote_types(dtype, torch.float32)


def _masked_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    score_mod: _mods.ScoreMod | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor:
    """Scaled scores with the mods and masks applied, in the compute dtype: ``(..., L, S)``.

    The steps in the order of the module docstring: scale, ``score_mod``, float
    mask added, boolean conditions (``attn_mask``, ``is_causal``, ``mask_mod``).
    """
    compute = _compute_dtype(query.dtype)
    # (..., L, E) @ (..., E, S) -> (..., L, S), in at least float32 so large scores cannot overflow.
    scores = torch.matmul(query.to(compute), key.to(compute).transpose(-2, -1)) * scale
    L, S = scores.shape[-2], scores.shape[-1]
    if score_mod is not None:
        scores = _mods.apply_score_mod(score_mod, scores)  # (..., L, S) -> (..., L, S)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(compute)  # a float mask is added to the scores
    allowed = causal_mask(L, S, device=scores.device) if is_causal else None  # (L, S)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = attn_mask if allowed is None else allowed & attn_mask  # broadcasts to (..., L, S)
    if mask_mod is not None:
        keep = _mods.apply_mask_mod(mask_mod, scores.shape[:-2], L, S, scores.device)  # broadcasts to (..., L, S)
        allowed = keep if allowed is None else allowed & keep
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim that gives 0 (not NaN) on rows where every score is -inf.

    The row max is subtracted first (softmax is unchanged by a shift), so large
    scores cannot overflow ``exp``. A fully masked row has max ``-inf``; it is
    shifted by 0 instead, its exponentials are all 0 and its weights stay 0.
    Gradients stay finite: the max is a constant shift (detached) and the
    denominator of an empty row is replaced by 1 before dividing.
    """
    if scores.shape[-1] == 0:  # S = 0: every row is fully masked, nothing to normalise
        return scores
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., L, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)  # (..., L, S), every entry in [0, 1]
    denom = exp.sum(dim=-1, keepdim=True)  # (..., L, 1)
    return exp / torch.where(denom > 0, denom, torch.ones_like(denom))


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    score_mod: _mods.ScoreMod | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor:
    r"""Attention weights ``softmax(scale * query @ key^T + mask)``.

    With mods, the steps run in the order of `attention_ref.functional`'s
    module docstring: scale, ``score_mod``, float mask, boolean conditions, softmax.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``; leading dims broadcast with ``query``'s.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., L, S)``.
        is_causal: keep key ``j`` for query ``i`` only when ``j <= i`` (top-left
            aligned, as ``torch.nn.functional.scaled_dot_product_attention``);
            combined with ``attn_mask`` when both are given.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: ``key`` has ``(..., Hkv, S, E)`` with
            ``H`` (query heads) a multiple of ``Hkv``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            the scaled scores (FlexAttention's signature; `attention_ref.mods`).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ``True`` = the pair
            takes part; combined (AND) with ``attn_mask`` and ``is_causal``.

    Returns:
        ``(..., L, S)`` weights in ``query``'s dtype, computed in at least float32.
        Each row sums to 1, except a row where no key takes part: it is all 0.

    Raises:
        ValueError: shapes that do not fit, a non-positive or non-finite scale,
            tensors on different devices.
        TypeError: non-float inputs, inputs of different dtypes, an integer mask;
            a mod of the wrong number of arguments, a ``mask_mod`` returning a
            non-bool tensor or a ``score_mod`` returning a bool one (a mod
            returning a wrongly shaped tensor is a ``ValueError``).

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> q = torch.tensor([[0.0, 2.0 ** 0.5]])
        >>> w = attention_weights(q, torch.eye(2))
        >>> torch.allclose(w, torch.tensor([[1.0, torch.e]]) / (1 + torch.e))
        True
    """
    _inputs.check_mods(score_mod, mask_mod)
    query, key, _, mask, resolved = _inputs.prepare(query, key, None, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E) for the reference math
        key = _inputs.expand_kv_heads(query, key, "key")
    weights = _safe_softmax(_masked_scores(query, key, mask, is_causal, resolved, score_mod, mask_mod))
    return weights.to(query.dtype)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_weights: bool = False,
    backend: str = "math",
    score_mod: _mods.ScoreMod | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Scaled dot-product attention, equal to ``torch.nn.functional.scaled_dot_product_attention``.

    $$
    \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt{E}} + M\right) V
    $$

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``. Leading dims of the three broadcast together.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., L, S)``.
        is_causal: top-left aligned causal mask (key ``j`` allowed for query
            ``i`` when ``j <= i``), applied together with ``attn_mask``.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        dropout_p: dropout probability on the weights, in ``[0, 1)``. Like
            PyTorch's functional form it applies whenever it is > 0, also at
            evaluation: pass 0 there.
        enable_gqa: grouped-query attention (``H`` query heads, a multiple of
            the ``Hkv`` key/value heads at dim -3).
        return_weights: also return the weights the output was computed from
            (after dropout). Only the ``"math"`` backend can (``"auto"`` picks it).
        backend: which implementation computes the result, see
            `attention_ref.backends`: ``"math"`` (this reference, the
            default), ``"tiled"`` (online softmax in PyTorch, memory linear in
            ``S``), ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``),
            ``"triton"`` (this package's Triton kernel) or ``"auto"`` (a fixed rule:
            `attention_ref.backends.select_backend`). Every backend equals
            ``"math"`` within floating-point tolerance; an argument a backend
            cannot honour raises instead of falling back.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            the scaled scores before any mask (FlexAttention's signature; see
            `attention_ref.mods` and the order in `attention_ref.functional`).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ``True`` = the pair
            takes part; combined (AND) with ``attn_mask`` and ``is_causal``.
            Mods run on the ``"math"`` backend (``"auto"`` picks it when a mod
            is given); the other backends raise.

    Returns:
        ``(..., L, Ev)`` in ``query``'s dtype, or ``(output, weights)`` with
        weights ``(..., L, S)``. A query row with no key taking part gives
        output 0 and weights 0 (with finite gradients), as PyTorch >= 2.5 does.

    Raises:
        ValueError: shapes that do not fit, a bad scale or dropout_p, tensors on
            different devices, an unknown backend, or a combination the chosen
            backend does not support (the message names the backend and why).
        TypeError: non-float inputs, inputs of different dtypes, an integer mask;
            a mod of the wrong number of arguments, a ``mask_mod`` returning a
            non-bool tensor or a ``score_mod`` returning a bool one (a mod
            returning a wrongly shaped tensor is a ``ValueError``).

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)
        >>> scaled_dot_product_attention(q, k, v).shape
        torch.Size([2, 3, 4])
    """
    check_probability("dropout_p", dropout_p)
    _inputs.check_bool("return_weights", return_weights)
    _backends.check_backend(backend)
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    _inputs.check_mods(score_mod, mask_mod)
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    # Validated once above; from here on each backend gets clean tensors.
    call = _backends.Call(query, key, value, mask, is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa,
                          return_weights=return_weights, score_mod=score_mod, mask_mod=mask_mod)
    chosen = _backends._select(backend, call)
    if chosen != "math":
        return _backends._run(chosen, call, resolved)
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E) for the reference math
        key, value = _inputs.expand_kv_heads(query, key, "key"), _inputs.expand_kv_heads(query, value, "value")
    weights = _safe_softmax(_masked_scores(query, key, mask, is_causal, resolved, score_mod, mask_mod))  # (..., L, S)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    # (..., L, S) @ (..., S, Ev) -> (..., L, Ev)
    output = torch.matmul(weights, value.to(weights.dtype)).to(query.dtype)
    if return_weights:
        return output, weights.to(query.dtype)
    return output
