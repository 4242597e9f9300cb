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
5. softmax over the keys, with the head's learned sink ``exp(sinks[h])`` in
   the denominator when ``sinks`` is given (`attention_ref.sinks`); a query
   row with no key left gives weights 0 and output 0, with finite gradients.

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
from attention_ref.block_mask import BlockMask, check_block_mask, resolve_mask_mod
from attention_ref.masks import causal_mask
from attention_ref.sinks import check_sinks, heads_of, sink_column

__all__ = ["attention_weights", "merge_attention", "scaled_dot_product_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax runs in at least float32: float16/bfloat16 inputs are upcast."""
    return torch.promote_types(dtype, torch.float32)


def masked_scores(
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
    Shared by the paths that compute a block's scores themselves (the ring backward of
    `attention_ref.distributed`), so that every path masks alike; it checks only the
    scores' size and finiteness: its callers have checked the arguments (not in ``__all__``).
    """
    compute = _compute_dtype(query.dtype)
    shape = (*torch.broadcast_shapes(query.shape[:-2], key.shape[:-2]), query.shape[-2], key.shape[-2])
    _inputs.check_dense("attention", shape, compute, query.device)  # before the (..., L, S) tensors exist
    # (..., L, E) @ (..., E, S) -> (..., L, S), in at least float32 so large scores cannot overflow.
    scores = torch.matmul(query.to(compute), key.to(compute).transpose(-2, -1)) * scale
    _inputs.check_scores_finite(scores, query, key, scale)  # finite inputs must not give inf scores (NaN weights)
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
        scores = torch.where(allowed, scores, float("-inf"))  # one pass: no negated mask made first
    return scores


def _sink_scores(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as one more score per row, ``(..., H, L, 1)`` beside ``scores`` ``(..., H, L, S)``; or None."""
    if sinks is None:
        return None
    column = sink_column(sinks, scores)  # (H,) -> (H, 1); one per query: (..., H, L)
    if sinks.dim() == 1 and scores.dim() < 3:  # scores (L, S), no head dim: the one sink (1,) of every row
        column = column.reshape(1)
    column = column.unsqueeze(-1)  # (H, 1, 1) or (..., H, L, 1) or (1, 1)
    return column.expand(*scores.shape[:-1], 1)  # (..., H, L, 1)


def _shift_and_denominator(
    scores: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(exp(scores - m), m, denominator)`` per row, the sink's ``exp(s_h - m)`` in the denominator.

    ``m`` is the row max over the scores and the sink (detached: a constant shift),
    0 on a row where both are ``-inf``, so ``exp`` never overflows and never sees
    ``-inf - -inf``. Shapes: ``(..., L, S)``, ``(..., L, 1)``, ``(..., L, 1)``.
    """
    sink = _sink_scores(scores, sinks)  # (..., L, 1) or None
    if scores.shape[-1]:
        row_max = scores.amax(dim=-1, keepdim=True)  # (..., L, 1)
    else:  # S = 0: no key in any row
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    row_max = row_max.detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)  # (..., L, S), every entry in [0, 1]
    denom = exp.sum(dim=-1, keepdim=True)  # (..., L, 1)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)  # the sink's mass: a logit with no value
    return exp, row_max, denom


def _log_sum_exp(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``log(sum_j exp(scores_ij) + exp(sinks[h]))`` over the last dim; ``(..., L, S) -> (..., L)``.

    ``-inf`` (with gradient 0) on a row with no key and no sink. ``torch.logsumexp``
    gives ``-inf`` there too, but a NaN gradient; here the empty row's logarithm is
    taken of 1 and replaced, so no NaN reaches autograd.
    """
    _, row_max, denom = _shift_and_denominator(scores, sinks)
    lse = row_max + torch.log(torch.where(denom > 0, denom, torch.ones_like(denom)))
    return torch.where(denom > 0, lse, torch.full_like(lse, float("-inf"))).squeeze(-1)  # (..., L, 1) -> (..., L)


def _safe_softmax(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim that gives 0 (not NaN) on rows where every score is -inf.

    The row max is subtracted first (softmax is unchanged by a shift), so large
    scores cannot overflow ``exp``. A fully masked row has max ``-inf``; it is
    shifted by 0 instead, its exponentials are all 0 and its weights stay 0.
    Gradients stay finite: the max is a constant shift (detached) and the
    denominator of an empty row is replaced by 1 before dividing. With ``sinks``
    the head's sink joins the denominator, so the weights sum to less than 1.
    """
    if scores.shape[-1] == 0:  # S = 0: every row is fully masked, nothing to normalise
        return scores
    exp, _, denom = _shift_and_denominator(scores, sinks)
    return exp / torch.where(denom > 0, denom, torch.ones_like(denom))


def _checked_sinks(sinks: object, batch: tuple[int, ...], query: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` checked against the leading dims ``(..., H)`` and the rows ``(..., H, L)``; None stays None."""
    if sinks is None:
        return None
    return check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))


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
    sinks: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
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
        sinks: ``(H,)``, one learned logit per query head (``H`` = the scores'
            dim -3), added as ``exp(sinks[h])`` to each row's denominator, never
            scaled (`attention_ref.sinks`); or one per query, any tensor of two
            or more dims broadcastable to ``(..., H, L)``.
        block_mask: a `attention_ref.block_mask.BlockMask` made once by
            `attention_ref.block_mask.create_block_mask`; its ``mask_mod`` masks, as
            if passed as ``mask_mod=`` (which may then be left out, or must be
            that same function). It is checked against the call: ``L``, ``S``,
            and ``B``, ``H`` (1 broadcasts). The weights are the whole ``(L, S)``
            matrix, so the mod is evaluated on every pair (materialised).

    Returns:
        ``(..., L, S)`` weights in ``query``'s dtype, computed in at least float32.
        Each row sums to 1, except a row where no key takes part: it is all 0.
        With ``sinks`` each row sums to ``1 - exp(sinks[h] - lse)``, less than 1.

    Raises:
        ValueError: shapes that do not fit, a non-positive or non-finite scale,
            tensors on different devices.
        TypeError: non-float inputs, inputs of different dtypes, an integer mask;
            a mod of the wrong number of arguments, a ``mask_mod`` returning a
            non-bool tensor or a ``score_mod`` returning a bool one (a mod
            returning a wrongly shaped tensor is a ``ValueError``); a
            ``block_mask`` that is not a `attention_ref.block_mask.BlockMask` (its
            sizes not those of the call, or another ``mask_mod``, are a
            ``ValueError``).

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> q = torch.tensor([[0.0, 2.0 ** 0.5]])
        >>> w = attention_weights(q, torch.eye(2))
        >>> torch.allclose(w, torch.tensor([[1.0, torch.e]]) / (1 + torch.e))
        True
    """
    _inputs.check_mods(score_mod, mask_mod)
    mask_mod = resolve_mask_mod(mask_mod, block_mask)  # a block mask brings its own mod
    query, key, _, mask, resolved = _inputs.prepare(query, key, None, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E) for the reference math
        key = _inputs.expand_kv_heads(query, key, "key")
    if block_mask is not None:  # made for these sizes; materialised below like a mask_mod
        batch = tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2]))
        check_block_mask(block_mask, None, batch, query.shape[-2], key.shape[-2])
    scores = masked_scores(query, key, mask, is_causal, resolved, score_mod, mask_mod)  # (..., L, S)
    sinks = _checked_sinks(sinks, scores.shape[:-2], query)
    return _safe_softmax(scores, sinks).to(query.dtype)


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
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
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
            ``"sdpa"`` materialises it; see `attention_ref.backends` for what
            each backend takes.
        return_lse: also return ``lse`` ``(..., L)``, the natural log of each
            query row's softmax denominator, ``log sum_j exp(scores_ij)`` over
            the scores after the mods and masks (before dropout); ``-inf`` for a
            row with no key. Two results over disjoint sets of keys merge
            exactly with it (`merge_attention`), as the tiled path, FlashAttention
            and ring attention do. The ``"math"`` and ``"tiled"`` backends return
            it (``"auto"`` picks one of them), in the compute dtype (at least
            float32), with gradients; the others raise. With ``sinks`` it
            includes the sink: ``log(sum_j exp(scores_ij) + exp(sinks[h]))``,
            ``sinks[h]`` on a row with no key.
        sinks: ``(H,)``, one learned logit per query head (``H`` = dim -3 of
            the output; under ``enable_gqa`` the query heads), in the space of
            the scaled (and modded) scores, never multiplied by ``scale``: it
            adds ``exp(sinks[h])`` to every row's softmax denominator and has no
            value (gpt-oss; `attention_ref.sinks`). ``-inf`` = no sink for that
            head. Or one logit per query (Inkling 2 computes them from the
            hidden states): any tensor of two or more dims broadcastable to the
            rows ``(..., H, L)``, e.g. ``(B, H, L)``; its gradient keeps its
            shape. The ``"math"`` and ``"tiled"`` backends take it (``"auto"``
            picks one of them), with gradients to ``sinks``; the others raise.
        block_mask: a `attention_ref.block_mask.BlockMask` made once by
            `attention_ref.block_mask.create_block_mask` and reused across calls
            (every layer of a forward pass, as with FlexAttention): its
            ``mask_mod`` masks, as if passed as ``mask_mod=`` (which may then be
            left out, or must be that same function: two different mods raise).
            It is checked against the call: ``L``, ``S``, and ``B``, ``H`` of the
            output's leading dims ``(..., H)`` (1 broadcasts). ``"tiled"`` uses
            it as is, with its block sizes: empty blocks skipped, full blocks
            computed without evaluating the mod, the mod evaluated on the
            partial blocks only, and no block mask built per call. ``"math"``
            and ``"sdpa"`` materialise its mod on every pair, as for
            ``mask_mod=``; ``"triton"`` recognises the mod as for ``mask_mod=``
            and skips blocks its own way. ``"auto"`` reads the fraction of empty
            blocks off it instead of building one.

    Returns:
        ``(..., L, Ev)`` in ``query``'s dtype; with ``return_weights`` the pair
        ``(output, weights)``, weights ``(..., L, S)``; with ``return_lse`` the
        pair ``(output, lse)``, or ``(output, weights, lse)`` with both. A query
        row with no key taking part gives output 0 and weights 0 (with finite
        gradients), as PyTorch >= 2.5 does.

    Raises:
        ValueError: shapes that do not fit, a bad scale or dropout_p, tensors on
            different devices, an unknown backend, or a combination the chosen
            backend does not support (the message names the backend and why).
        TypeError: non-float inputs, inputs of different dtypes, an integer mask;
            a mod of the wrong number of arguments, a ``mask_mod`` returning a
            non-bool tensor or a ``score_mod`` returning a bool one (a mod
            returning a wrongly shaped tensor is a ``ValueError``); a
            ``block_mask`` that is not a `attention_ref.block_mask.BlockMask` (one
            made for other sizes, or with another ``mask_mod`` than the one
            passed, is a ``ValueError`` naming both values).

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)
        >>> scaled_dot_product_attention(q, k, v).shape
        torch.Size([2, 3, 4])

        A block mask built once, reused by every call with the same mask and sizes:

        >>> from attention_ref import mods, tiled
        >>> bm = tiled.create_block_mask(mods.causal(offset=2), None, None, 3, 5, block_q=2, block_k=2)
        >>> out = scaled_dot_product_attention(q, k, v, backend="tiled", block_mask=bm)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, mask_mod=bm.mask_mod), atol=1e-6)
        True
    """
    check_probability("dropout_p", dropout_p)
    _inputs.check_bool("return_weights", return_weights)
    _inputs.check_bool("return_lse", return_lse)
    _backends.check_backend(backend)
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    _inputs.check_mods(score_mod, mask_mod)
    mask_mod = resolve_mask_mod(mask_mod, block_mask)  # a block mask brings its own mod
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    # Validated once above; from here on each backend gets clean tensors.
    batch = _inputs.batch_shape(query, key, value, enable_gqa)
    if block_mask is not None:  # made for these sizes (its blocks are the tiled backend's)
        check_block_mask(block_mask, None, batch, query.shape[-2], key.shape[-2])
    sinks = _checked_sinks(sinks, batch, query)
    call = _backends.ValidatedCall(query, key, value, mask, is_causal=is_causal, dropout_p=dropout_p,
                                   enable_gqa=enable_gqa, return_weights=return_weights, score_mod=score_mod,
                                   mask_mod=mask_mod, return_lse=return_lse, sinks=sinks, block_mask=block_mask)
    chosen = _backends.resolve_backend(backend, call)
    if chosen != "math":
        return _backends.run_backend(chosen, call, resolved)
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E) for the reference math
        key, value = _inputs.expand_kv_heads(query, key, "key"), _inputs.expand_kv_heads(query, value, "value")
    scores = masked_scores(query, key, mask, is_causal, resolved, score_mod, mask_mod)  # (..., L, S)
    weights = _safe_softmax(scores, sinks)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    # (..., L, S) @ (..., S, Ev) -> (..., L, Ev)
    output = torch.matmul(weights, value.to(weights.dtype)).to(query.dtype)
    result = (output, weights.to(query.dtype)) if return_weights else (output,)
    if return_lse:
        result += (_log_sum_exp(scores, sinks),)  # (..., L)
    return result if len(result) > 1 else output


def merge_attention(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Merge two attention results over disjoint sets of keys into the result over all of them.

    If ``out_a, lse_a`` is attention of the queries over keys ``A`` and
    ``out_b, lse_b`` over keys ``B`` (same queries, same scale, from
    ``scaled_dot_product_attention(..., return_lse=True)``), then over ``A`` and
    ``B`` together

    $$
    \mathrm{lse} = \log(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}), \qquad
    \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\, \mathrm{out}_a
                 + e^{\mathrm{lse}_b - \mathrm{lse}}\, \mathrm{out}_b ,
    $$

    exactly (up to rounding): each part's softmax was normalised by its own
    denominator ``e^lse``, and the factors put both over the common one. This is
    the step of the tiled path's online softmax, of FlashAttention's split-KV
    decoding and of ring attention. A part where a row had no key (``lse =
    -inf``) gets weight 0; a row with no key in either part stays output 0,
    ``lse = -inf``. Gradients are finite in every case.

    The parts must be sink-free: a learned sink belongs to the query, not to a
    set of keys, so it is added once, to the merged result, with
    `attention_ref.add_sinks` (a sink in each part would be counted twice).

    Args:
        out_a: ``(..., L, Ev)``.
        lse_a: ``(..., L)``, the natural-log sum of exponentials of ``out_a``'s scores.
        out_b: ``(..., L, Ev)``, the same shape as ``out_a``.
        lse_b: ``(..., L)``, the same shape as ``lse_a``.

    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype, ``lse`` in ``lse_a``'s.

    Raises:
        TypeError: non-tensors or non-float tensors.
        ValueError: shapes that do not match, or tensors on different devices.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention as sdpa
        >>> q, k, v = torch.randn(3, 4), torch.randn(10, 4), torch.randn(10, 2)
        >>> a = sdpa(q, k[:6], v[:6], return_lse=True)
        >>> b = sdpa(q, k[6:], v[6:], return_lse=True)
        >>> out, lse = merge_attention(*a, *b)
        >>> full, full_lse = sdpa(q, k, v, return_lse=True)
        >>> torch.allclose(out, full, atol=1e-6), torch.allclose(lse, full_lse, atol=1e-6)
        (True, True)
    """
    _inputs.check_merge(out_a, lse_a, out_b, lse_b)
    # lse = log(e^lse_a + e^lse_b), shifted by the larger one; -inf (gradient 0, not NaN) where both are -inf.
    shift = torch.maximum(lse_a, lse_b).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    total = torch.exp(lse_a - shift) + torch.exp(lse_b - shift)  # (..., L)
    lse = torch.where(total > 0, shift + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    # The factors e^(lse_a - lse) and e^(lse_b - lse), formed from the differences to the shift (exact
    # where the lses are close) and the sum, not from the rounded lse: at |lse| = 1e7 float32 rounds
    # lse by 0.5, which would scale the output by e^0.5. An empty row (total 0) gets factors 0.
    safe = torch.where(total > 0, total, torch.ones_like(total))
    factor_a = (torch.exp(lse_a - shift) / safe).unsqueeze(-1)  # (..., L) -> (..., L, 1)
    factor_b = (torch.exp(lse_b - shift) / safe).unsqueeze(-1)
    out = factor_a * out_a.to(factor_a.dtype) + factor_b * out_b.to(factor_b.dtype)  # (..., L, Ev)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
