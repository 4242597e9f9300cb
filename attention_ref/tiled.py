r"""Tiled attention: the FlashAttention algorithm in plain PyTorch.

The reference path (`attention_ref.scaled_dot_product_attention` with
``backend="math"``) forms the whole ``(L, S)`` score matrix per head. This
module never does: it walks over blocks of ``block_q`` queries and, for each,
over blocks of ``block_k`` keys, and keeps per query row only three running
quantities (the names of the FlashAttention papers and of Triton's fused
attention tutorial):

- ``m_i``: the running maximum of the scores seen so far,
- ``l_i``: the running sum of ``exp(score - m_i)``,
- ``acc``: the running sum of ``exp(score - m_i) * v``, rescaled whenever
  ``m_i`` grows.

When a new block of scores $s$ arrives (online softmax,
Milakov & Gimelshein 2018; Dao et al. 2022):

$$
m_{\text{new}} = \max(m_i, \max_j s_j), \qquad
\alpha = e^{m_i - m_{\text{new}}}, \qquad
p_j = e^{s_j - m_{\text{new}}}
$$

$$
l_i \leftarrow \alpha\, l_i + \textstyle\sum_j p_j, \qquad
\mathrm{acc} \leftarrow \alpha\, \mathrm{acc} + p\, V_{\text{block}}, \qquad
m_i \leftarrow m_{\text{new}}
$$

and after the last block ``out = acc / l_i``. As in Triton's tutorial kernel the
exponentials are taken in base 2: ``log2(e)`` is folded into the scale once, so
every ``exp`` is an ``exp2`` (about twice as fast on CPU) with the same result.

The lazy step. Taking each block's maximum costs a pass over the block, and
subtracting it another. Neither is needed for the result: ``l_i`` and ``acc``
only have to be taken against the *same* shift, not against the true maximum.
So after the first key block (the exact step above), a query block keeps its
``m_i`` and sums $p_j = 2^{s_j - m_i}$ as they come, with ``-m_i`` added inside
the matrix product (``baddbmm``) instead of in a pass of its own. The row sums of
the block tell whether that was safe: if every one is at most ``2**32`` (no score
rose more than about 32 powers of 2 above ``m_i``; weights far below it round to
0 as they would anyway), the block is accepted; otherwise (a larger sum, ``inf``
or NaN) it is redone with the exact step, which raises ``m_i``. Rows that have
seen no key yet (``m_i = -inf``) always take the exact step. The check reads one
number back per key block, a synchronisation on a GPU. FlashAttention-4 skips
rescaling below a threshold in the same spirit, but still takes each block's max.

The backward pass is that of
FlashAttention-2: it keeps only the per-row log-sum-exp ``lse = m_i + log l_i``
from the forward pass and recomputes each block of weights as
``exp(s - lse)``, so training needs no ``(L, S)`` tensor either.

Extra memory (beyond inputs, output and gradients): one
``(B, H, block_q, block_k)`` buffer of scores, reused by every block (two in
the backward pass), and a few vectors of length ``L``; with the default blocks
that is a few MiB at any sequence length.
Shapes use the package legend (``B``, ``H``, ``L``, ``S``, ``E``, ``Ev``).
"""

from __future__ import annotations

import math
import sys
import types

import torch
from torch.autograd.function import once_differentiable

from attention_ref import _inputs, mods, threads
from attention_ref._validation import check_positive_int
from attention_ref.block_mask import (  # the block mask, which this path reads and skips by
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    EMPTY,
    PARTIAL,
    BlockMask,
    block_spans,
    bool_to_bias,
    call_grids,
    check_block_mask,
    create_block_mask,
    mod_sizes,
    resolve_mask_mod,
)
from attention_ref.sinks import add_sinks, check_sinks, heads_of

from attention_ref.threads import fitting_threads

# BlockMask, create_block_mask and the default block sizes live in attention_ref.block_mask, the
# thread budget (ADAPT_THREADS, fitting_threads) in attention_ref.threads; the names stay importable
# from here, as the same objects, and `tiled.ADAPT_THREADS = False` still sets the flag (below)
__all__ = ["fitting_threads", "tiled_attention"]


_NEG_INF = float("-inf")
_LOG2E = math.log2(math.e)  # scores * log2(e) turn exp(.) into exp2(.)
_LN2 = math.log(2.0)
#: The lazy step keeps the old running max while a block's weights against it sum to at most
#: 2**_LAZY_GROWTH (a score at most 32 powers of 2 above it); a larger sum redoes the block exactly.
_LAZY_GROWTH = 32
#: With a block mask, neighbouring non-empty key blocks are computed together, up to this many keys.
_SPAN_KEYS = 512
def _pairs(q: torch.Tensor, k: torch.Tensor) -> int:
    """(query, key) pairs of a call on `_TiledAttention`'s layouts: q (NK, G, L, E), k (NK, S, E)."""
    NK, G, L, _ = q.shape
    return NK * G * L * k.shape[-2]


def _check_score_mod(score_mod: mods.ScoreMod, batch: tuple[int, ...], L: int, S: int, query: torch.Tensor) -> None:
    """Check the sizes a score mod carries, and refuse one whose result would need gradients of its own."""
    B, H = mod_sizes(batch)
    mods.validate_sizes(score_mod, B, H, L, S)
    if L == 0 or S == 0:
        return
    probe = torch.zeros((1,) * (len(batch) + 2), dtype=torch.promote_types(query.dtype, torch.float32),
                        device=query.device)
    with torch.enable_grad():
        _, _, b, h, q_idx, kv_idx = mods.index_grids((1,) * len(batch), 1, 1, query.device)
        result = score_mod(probe, b, h, q_idx, kv_idx)
    if isinstance(result, torch.Tensor) and result.requires_grad:
        raise ValueError(
            "backend 'tiled' cannot differentiate a score_mod with respect to the tensors it captures "
            "(its result requires grad); use backend='math'"
        )


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention computed block by block with an online softmax; never forms ``(L, S)``.

    Equals `attention_ref.scaled_dot_product_attention` with
    ``backend="math"`` (the reference) for every argument it takes, within
    floating-point rounding: same masks, same causal alignment, same
    grouped-query heads, same result (0) for a query row that no key may
    attend to, and gradients for ``query``, ``key``, ``value`` and a float
    ``attn_mask``. ``scaled_dot_product_attention(..., backend="tiled")`` calls
    it with the default block sizes.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        value: ``(..., S, Ev)``. Leading dims of the three broadcast together.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., L, S)``. Only the block being computed is
            read (and, for a float mask, broadcast) at a time.
        is_causal: top-left aligned causal mask (key ``j`` allowed for query
            ``i`` when ``j <= i``), combined with ``attn_mask``. Blocks above
            the diagonal are skipped, not computed and masked.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: ``H`` query heads, a multiple of
            the ``Hkv`` key/value heads at dim -3. The key/value heads are
            shared by matmul broadcasting, never copied ``H / Hkv`` times.
        block_q: queries per block; ``None`` = ``block_mask.block_q`` when a
            ``block_mask`` is given, else `attention_ref.block_mask.DEFAULT_BLOCK_Q`.
        block_k: keys per block; ``None`` = ``block_mask.block_k``, else
            `attention_ref.block_mask.DEFAULT_BLOCK_K`. Neither needs to divide ``L`` or ``S``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, applied to each
            block of scaled scores before the masks (the order of
            `attention_ref.functional`). Gradients flow through it to the
            scores; a tensor it captures gets none, so a mod whose result
            requires grad (a learned bias) is refused: use the math backend.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)``, ``True`` = takes part,
            combined (AND) with ``attn_mask`` and ``is_causal``. Blocks it
            removes entirely are skipped, forward and backward; blocks it keeps
            entirely are computed without evaluating it (see `attention_ref.block_mask.BlockMask`).
        block_mask: a `attention_ref.block_mask.BlockMask` made in advance by `attention_ref.block_mask.create_block_mask` with the
            same ``mask_mod`` and block sizes (built here when omitted), so the
            classification of the blocks can be reused across calls. Its mod is
            the call's: ``mask_mod`` may be left out, and if given must be that
            same function.
        return_lse: also return the log-sum-exp of each query row's scores,
            which the online softmax keeps anyway (see
            `attention_ref.scaled_dot_product_attention`); gradients flow
            through it too.
        sinks: ``(H,)`` learned sink logits, one per query head, or one per
            query broadcastable to ``(..., H, L)`` (see `attention_ref.sinks`): added once, after the last key block, by
            `attention_ref.add_sinks` (whose backward is the closed form, so
            no ``(L, S)`` tensor is formed for it either); ``lse`` then
            includes the sink.

    Returns:
        ``(..., L, Ev)`` in ``query``'s dtype, computed in at least float32;
        with ``return_lse`` also ``lse`` ``(..., L)`` in the compute dtype
        (``-inf`` on a row with no key).

    Raises:
        ValueError, TypeError: as `attention_ref.scaled_dot_product_attention`
            (the same validation runs), for block sizes that are not positive
            ints, a ``block_mask`` made for other sizes or another mod, and a
            ``score_mod`` whose result requires grad.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 7, 8), torch.randn(2, 13, 8), torch.randn(2, 13, 4)
        >>> out = tiled_attention(q, k, v, is_causal=True, block_q=3, block_k=5)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    _inputs.check_mods(score_mod, mask_mod)
    _inputs.check_bool("return_lse", return_lse)
    resolve_mask_mod(mask_mod, block_mask)  # a BlockMask, of the same mod
    if block_q is None:
        block_q = DEFAULT_BLOCK_Q if block_mask is None else block_mask.block_q
    if block_k is None:
        block_k = DEFAULT_BLOCK_K if block_mask is None else block_mask.block_k
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if sinks is not None:
        batch = _inputs.batch_shape(query, key, value, enable_gqa)
        sinks = check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))
    return tiled_attention_prepared(query, key, value, mask, is_causal=is_causal, scale=resolved,
                                    enable_gqa=enable_gqa, block_q=block_q, block_k=block_k, score_mod=score_mod,
                                    mask_mod=mask_mod, block_mask=block_mask, return_lse=return_lse, sinks=sinks)


def tiled_attention_prepared(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The tiled path on validated inputs: `tiled_attention` after its checks, and the dispatcher's entry point
    (`attention_ref.backends` checks the call once, then routes here). Not in ``__all__``: call `tiled_attention`."""
    if query.is_meta:
        raise ValueError("backend='tiled' cannot run on meta tensors: its online softmax reads the values (which "
                         "rows are empty, which blocks to skip); backend='math' gives the shapes on meta")
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    H = query.shape[-3] if enable_gqa else 1
    Hkv = key.shape[-3] if enable_gqa else 1
    G = H // Hkv  # query heads per key/value head (1 without grouped-query attention)
    batch = _inputs.batch_shape(query, key, value, enable_gqa)
    kinds = pieces = None
    if block_mask is not None or mask_mod is not None:
        if block_mask is None:
            block_mask = create_block_mask(mask_mod, *mod_sizes(batch), L, S, block_q=block_q, block_k=block_k,
                                           device=query.device)
        check_block_mask(block_mask, mask_mod, batch, L, S, block_q, block_k)
        mask_mod, kinds, pieces = block_mask.mask_mod, block_mask.kinds.tolist(), block_mask._pieces
    if score_mod is not None:
        _check_score_mod(score_mod, batch, L, S, query)
    prefix = batch[:-1] if enable_gqa else batch  # the dims in front of the heads
    N = math.prod(prefix)
    compute = torch.promote_types(query.dtype, torch.float32)
    _check_float_mask(mask, compute)
    _inputs.check_scores_bounded(query, key, scale, compute)  # its blocks' scores are never held: bound them
    # Differentiable layout changes (autograd sums broadcast dims back for us). The scale and
    # log2(e) are folded into the queries once: (q * scale * log2 e) @ k^T = log2(e) * scores.
    q = (query.to(compute) * (scale * _LOG2E)).expand(*batch, L, E)
    if enable_gqa:
        q = q.reshape(N * Hkv, G, L, E)  # (..., H, L, E) -> (N * Hkv, G, L, E): head h = hkv * G + g
        k = key.to(compute).expand(*prefix, Hkv, S, E).reshape(N * Hkv, S, E)
        v = value.to(compute).expand(*prefix, Hkv, S, Ev).reshape(N * Hkv, S, Ev)
    else:
        q = q.reshape(N, 1, L, E)  # (..., L, E) -> (N, 1, L, E)
        k = key.to(compute).expand(*batch, S, E).reshape(N, S, E)
        v = value.to(compute).expand(*batch, S, Ev).reshape(N, S, Ev)
    mods_ = (score_mod, mask_mod, kinds, pieces)
    # (N * Hkv, G, L, Ev) and (N * Hkv, G, L, 1), the log-sum-exp in natural-log units
    with threads.threads_for(_pairs(q, k), q.device):  # fewer threads while other processes keep cores busy
        out, lse = _TiledAttention.apply(q, k, v, mask, is_causal, batch, block_q, block_k, mods_)
    out, lse = out.reshape(*batch, L, Ev), lse.reshape(*batch, L)  # -> (..., L, Ev), (N * Hkv, G, L, 1) -> (..., L)
    if sinks is not None:  # once, over all keys: sink-free blocks merged first, then the sink
        out, lse = add_sinks(out, lse, sinks)
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out



def _mask_block(mask: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """The part of ``mask`` (broadcastable to ``(..., L, S)``) that covers rows i0:i1, cols j0:j1.

    A dim of size 1 broadcasts, so it is kept whole instead of sliced.
    """
    if mask.dim() == 0:
        return mask
    cols = slice(j0, j1) if mask.shape[-1] != 1 else slice(None)
    if mask.dim() == 1:
        return mask[cols]
    rows = slice(i0, i1) if mask.shape[-2] != 1 else slice(None)
    return mask[..., rows, cols]


def _scores_block(
    q_blk: torch.Tensor,
    kT_blk: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    batch: tuple[int, ...],
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    *,
    offset: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    score_mod: mods.ScoreMod | None = None,
    keep: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
    grids: tuple[torch.Tensor, ...] = (),
    offset_last: bool = False,
) -> torch.Tensor:
    """Masked scores (times log2 e) of query rows i0:i1 against keys j0:j1, plus ``offset``: ``(N * Hkv, G * bq, bk)``.

    ``q_blk`` is ``(N * Hkv, G * bq, E)`` (already scaled by ``scale * log2 e``),
    ``kT_blk`` ``(N * Hkv, E, bk)``; ``offset`` ``(N * Hkv, G * bq, 1)`` is added to
    every score of its row (the callers pass minus a running max or minus the
    log-sum-exp). The offset and the masks are written first and the matrix
    product is added onto them (``baddbmm_``): one pass over the block fewer than
    adding them afterwards. ``out`` is a buffer with room for the largest block;
    the result is a contiguous view of its start. ``score_mod`` modifies the
    scores first (then the product cannot be added onto the terms); ``keep``
    lists ``(first column, bias)`` pieces of a ``mask_mod`` (0 / -inf in the
    scores' dtype, each broadcastable to ``(..., H, bq, its width)``) to add to
    those columns.
    """
    NK, GB, _ = q_blk.shape
    bq, bk = i1 - i0, j1 - j0
    s = _buffer(q_blk, NK, GB, bk) if out is None else _start_of(out, NK, GB, bk)
    terms = []  # (a view of s, a term that broadcasts to it), summed into s before the product
    # offset_last (a float mask): the offset is added after the masked scores, in the order of the
    # math path, so that a huge mask value rounds the score away first (transformers' finfo.min rows)
    late = offset if offset_last else None
    if offset is not None and not offset_last:
        terms.append((s, offset))
    if is_causal and j1 - 1 > i0:  # the block reaches above the diagonal: hide keys j > i
        above = torch.full((bq, bk), _NEG_INF, dtype=s.dtype, device=s.device).triu_(i0 - j0 + 1)  # -inf where j > i
        terms.append((s.view(NK, GB // bq, bq, bk), above))  # (bq, bk) broadcasts over the heads
    if mask is not None:
        m_blk = _mask_block(mask, i0, i1, j0, j1)
        # A float mask is added to the scores (times log2 e, like them); a boolean one adds 0 or -inf.
        bias = bool_to_bias(m_blk, s.dtype) if m_blk.dtype == torch.bool else _float_bias(m_blk, s.dtype)
        terms.append((s.view(*batch, bq, bk), bias))  # (N*Hkv, G*bq, bk) -> (..., H, bq, bk), a view
    for first, piece in keep:  # (..., H, bq, bk) -> the columns of the piece, a strided view
        terms.append((s.view(*batch, bq, bk)[..., first:first + piece.shape[-1]], piece))
    if score_mod is not None:
        # (N*Hkv, G*bq, E) @ (N*Hkv, E, bk) -> (N*Hkv, G*bq, bk), then modified in natural units
        torch.bmm(q_blk, kT_blk, out=s)
        view = s.view(*batch, bq, bk)  # (N*Hkv, G*bq, bk) -> (..., H, bq, bk)
        view.copy_(_modified_scores(score_mod, view, grids, i0, j0)).mul_(_LOG2E)
        for view, term in terms:
            view.add_(term)
        return s if late is None else s.add_(late)
    # (N*Hkv, G*bq, E) @ (N*Hkv, E, bk) -> (N*Hkv, G*bq, bk), added onto the terms
    if not terms:
        torch.bmm(q_blk, kT_blk, out=s)
        return s if late is None else s.add_(late)
    terms.sort(key=lambda vt: vt[0].numel() != s.numel())  # a term over the whole block first
    (view, term), *rest = terms
    if view.numel() == s.numel():
        view.copy_(term.expand_as(view))
    else:  # only pieces (some columns of a span): start from 0
        s.zero_()
        rest = terms
    for view, term in rest:
        view.add_(term)
    s.baddbmm_(q_blk, kT_blk)
    return s if late is None else s.add_(late)


def _modified_scores(
    score_mod: mods.ScoreMod, scores2: torch.Tensor, grids: tuple[torch.Tensor, ...], i0: int, j0: int
) -> torch.Tensor:
    """``score_mod`` applied to a block of scores given in log2 units ``(..., H, bq, bk)``; natural units out."""
    bq, bk = scores2.shape[-2:]
    b, h, q_idx, kv_idx = grids
    return score_mod(scores2 * _LN2, b, h, q_idx[..., i0:i0 + bq, :], kv_idx[..., j0:j0 + bk])


def _float_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask block in log2 units. ``finfo(dtype).min`` (transformers' padding value) times
    log2 e overflows to -inf; it stays ``finfo.min``, so that a row masked with it everywhere
    gives what the math path gives (scores + finfo.min round to finfo.min: a uniform row, the
    mean of the values), not a row with no key. `_check_float_mask` refuses the values between
    ``finfo.min`` and ``finfo.min / log2 e``, which no log2-unit score can represent."""
    mask = mask.to(dtype)
    bias = mask * _LOG2E
    return bias.masked_fill_(torch.isneginf(bias) & torch.isfinite(mask), torch.finfo(dtype).min)


def _check_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Refuse a float mask with a value in ``(finfo.min, finfo.min / log2 e)``: log2-unit scores
    cannot hold it, and rounding it to ``finfo.min`` could change which keys a row keeps."""
    if mask is None or mask.dtype == torch.bool or mask.device.type == "meta":
        return
    finfo = torch.finfo(dtype)
    m = mask.to(dtype)
    band = (m > finfo.min) & (m < finfo.min / _LOG2E)
    if bool(band.any()):
        value = float(m[band].flatten()[0])
        raise ValueError(
            f"attn_mask: the tiled backend computes in log2 units and cannot represent float mask values "
            f"between finfo({dtype}).min = {finfo.min:.4g} and finfo.min / log2(e) = {finfo.min / _LOG2E:.4g}; "
            f"got {value:.4g}. Use finfo.min, -inf or a boolean mask (or backend='math')"
        )


def _buffer(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s dtype and device; the loops allocate one per call and reuse it."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _start_of(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous ``shape`` view of the start of ``buffer`` (a smaller last block reuses the full one)."""
    if buffer.shape == shape:
        return buffer
    return buffer.view(-1)[: math.prod(shape)].view(shape)


def _key_spans(
    kinds: list[list[int]] | None, qi: int, last: int, block_k: int, span: int
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(j0, j1, partial)``: the keys below ``last`` that query block ``qi`` computes, in spans.

    Without a block mask, every block. With one, the blocks it does not mark
    empty, neighbours merged into spans of at most ``span`` keys (fewer, larger
    matrix products); ``partial`` lists the ``(j0, j1)`` of the span's partial
    blocks, the only keys on which the ``mask_mod`` is evaluated.
    """
    if kinds is None:
        return [(j0, j1, []) for j0, j1 in block_spans(last, block_k)]
    spans: list[tuple[int, int, list[tuple[int, int]]]] = []
    for kj, kind in enumerate(kinds[qi]):
        j0 = kj * block_k
        if kind == EMPTY or j0 >= last:
            continue
        j1 = min(j0 + block_k, last)
        partial = [(j0, j1)] if kind == PARTIAL else []
        if spans and spans[-1][1] == j0 and j1 - spans[-1][0] <= span:
            start, _, before = spans.pop()
            j0, partial = start, before + partial
        spans.append((j0, j1, partial))
    return spans


class _TiledAttention(torch.autograd.Function):
    """softmax(q k^T / log2(e) + mask) v over blocks, q pre-scaled by ``scale * log2 e``.

    Shapes: q (N*Hkv, G, L, E), k (N*Hkv, S, E), v (N*Hkv, S, Ev), all in the compute
    dtype; returns (N*Hkv, G, L, Ev) and the log-sum-exp (N*Hkv, G, L, 1) in natural-log
    units. Inside, ``m_i`` and ``lse`` are in log2 units.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, batch, block_q, block_k, mods_):  # type: ignore[override]
        score_mod, mask_mod, kinds, pieces = mods_
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        out = torch.empty(NK, G, L, Ev, dtype=q.dtype, device=q.device)
        lse = torch.empty(NK, G, L, 1, dtype=q.dtype, device=q.device)
        # With a float mask the backward also needs each row's max and sum apart: a huge mask value
        # (finfo.min) absorbs log2(l) in lse = m + log2(l), and P = exp(S - lse) would lose l.
        float_mask = mask is not None and mask.dtype != torch.bool
        m_rows = torch.empty(NK, G, L, 1, dtype=q.dtype, device=q.device) if float_mask else None
        l_rows = torch.empty_like(m_rows) if m_rows is not None else None
        kT = k.transpose(1, 2)  # (NK, S, E) -> (NK, E, S), a view
        span = max(block_k, _SPAN_KEYS)  # a block mask's neighbouring key blocks are computed together
        float_mask = mask is not None and mask.dtype != torch.bool
        scores = _buffer(q, NK, G * min(block_q, L), min(span if kinds else block_k, S))  # reused by every block
        grids = call_grids(batch, L, S, q.device) if score_mod is not None or mask_mod is not None else ()
        for qi, (i0, i1) in enumerate(block_spans(L, block_q)):
            bq = i1 - i0
            q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)  # (NK, G, bq, E) -> (NK, G*bq, E)
            # m_i running max, l_i running sum of exp, acc running sum of exp * v: set by the first span
            m_i = l_i = acc = None
            lazy, neg_m = False, None  # lazy: every row has a finite m_i (then neg_m = -m_i)
            last = min(S, i1) if is_causal else S  # causal: keys j > i1 - 1 are masked for every row
            for j0, j1, partial in _key_spans(kinds, qi, last, block_k, span):
                kT_blk, v_blk = kT[:, :, j0:j1], v[:, j0:j1]
                # The mask_mod runs on the partial blocks only: a block it keeps whole never evaluates it
                # (is_causal still masks the diagonal blocks).
                keep = [(a - j0, pieces.get(mask_mod, grids, i0, i1, a, b, q.dtype)) for a, b in partial]
                if lazy:
                    # Lazy step: p = exp(s - m_i) against the old max, m_i subtracted inside the matmul;
                    # no max of this block, no rescaling. Kept unless the row sums exceed 2**_LAZY_GROWTH.
                    p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                      offset=neg_m, out=scores, score_mod=score_mod, keep=keep, grids=grids,
                                      offset_last=float_mask).exp2_()
                    l_blk = p.sum(dim=-1, keepdim=True)
                    if l_blk.max().item() <= 2.0**_LAZY_GROWTH:  # False on inf, and on NaN (max keeps NaN)
                        l_i += l_blk
                        acc.baddbmm_(p, v_blk)  # (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                        continue
                s = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1, out=scores,
                                  score_mod=score_mod, keep=keep, grids=grids)
                if m_i is None:  # the first span: nothing accumulated yet, nothing to rescale
                    m_i = s.amax(dim=-1, keepdim=True)  # (NK, G*bq, 1)
                    # a row with every score -inf keeps max -inf; shift it by 0 so exp gives 0, not NaN
                    p = s.sub_(m_i.masked_fill(m_i == _NEG_INF, 0.0)).exp2_()
                    l_i = p.sum(dim=-1, keepdim=True)
                    acc = torch.bmm(p, v_blk)  # (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                    lazy = bool((m_i > _NEG_INF).all())
                    neg_m = -m_i
                    continue
                # New running max over the old max and this block's scores.
                m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
                # A row with every score so far -inf keeps max -inf; shift it by 0 so exp gives 0, not NaN.
                m_shift = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                # alpha rescales what was accumulated under the old max: exp(m_i - m_new).
                alpha = torch.exp2(m_i - m_shift)
                # p = exp(s - m_new): this block's unnormalised weights, in place on the scores.
                p = s.sub_(m_shift).exp2_()
                # l_i <- alpha * l_i + rowsum(p)
                l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                # acc <- alpha * acc + p @ v_block: (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                acc.mul_(alpha).baddbmm_(p, v_blk)
                # m_i <- m_new
                m_i = m_new
                lazy = bool((m_i > _NEG_INF).all())
                neg_m = -m_i
            if m_i is None:  # no key block to compute (a block mask emptied the row block): no key takes part
                m_i = torch.full((NK, G * bq, 1), _NEG_INF, dtype=q.dtype, device=q.device)
                l_i = torch.zeros(NK, G * bq, 1, dtype=q.dtype, device=q.device)
                acc = torch.zeros(NK, G * bq, Ev, dtype=q.dtype, device=q.device)
            # out = acc / l_i; a row where no key took part has l_i = 0 and acc = 0: it gives 0.
            out[:, :, i0:i1] = (acc / l_i.masked_fill(l_i == 0, 1.0)).view(NK, G, bq, Ev)
            # lse = m_i + log(l_i), the log of the softmax denominator (-inf on fully masked rows).
            lse[:, :, i0:i1] = (m_i + torch.log2(l_i)).view(NK, G, bq, 1)
            if m_rows is not None:
                m_rows[:, :, i0:i1] = m_i.view(NK, G, bq, 1)
                l_rows[:, :, i0:i1] = l_i.view(NK, G, bq, 1)
        none = torch.empty(0)
        ctx.save_for_backward(q, k, v, out, lse, mask if mask is not None else none,
                              m_rows if m_rows is not None else none, l_rows if l_rows is not None else none)
        ctx.has_mask = mask is not None
        ctx.options = (is_causal, batch, block_q, block_k, score_mod, mask_mod, kinds, pieces, grids)
        return out, lse * _LN2  # log2 units -> natural log (-inf stays -inf)

    @staticmethod
    @once_differentiable  # the blockwise backward is not itself differentiable
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        q, k = ctx.saved_tensors[:2]
        with threads.threads_for(_pairs(q, k), q.device):  # as the forward, on the threads that fit now
            return _TiledAttention._backward(ctx, d_out, d_lse)

    @staticmethod
    def _backward(ctx, d_out, d_lse):
        q, k, v, out, lse, mask, m_rows, l_rows = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        float_mask = mask is not None and mask.dtype != torch.bool
        is_causal, batch, block_q, block_k, score_mod, mask_mod, kinds, pieces, grids = ctx.options
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        d_out = d_out.to(q.dtype)
        # D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the term the softmax Jacobian subtracts. It and
        # lse enter the blocks' matmuls negated, as their starting values: negated once here.
        # A gradient of the returned lse adds d lse_i / d s_ij = P_ij: dS = P * (dP - (D_i - dlse_i)).
        neg_delta = (d_out * out).sum(dim=-1, keepdim=True).neg_().add_(d_lse.to(q.dtype))  # (NK, G, L, 1)
        # A fully masked row has lse = -inf; +inf makes every recomputed weight exp(-inf - inf) = 0.
        neg_lse = lse.masked_fill(lse == _NEG_INF, float("inf")).neg_()  # (NK, G, L, 1)
        if float_mask:  # P = exp(S - m) / l, the order of the forward (see m_rows there)
            neg_lse = m_rows.masked_fill(m_rows == _NEG_INF, float("inf")).neg_()
            inv_l = 1.0 / l_rows.masked_fill(l_rows == 0, 1.0)  # (NK, G, L, 1)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need_dmask = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if need_dmask else None
        kT, vT = k.transpose(1, 2), v.transpose(1, 2)  # (NK, E, S), (NK, Ev, S): views
        scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for P by every block
        d_scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for dP and dS
        for kj, (j0, j1) in enumerate(block_spans(S, block_k)):
            bk = j1 - j0
            k_blk, kT_blk, vT_blk = k[:, j0:j1], kT[:, :, j0:j1], vT[:, :, j0:j1]
            first = j0 if is_causal else 0  # causal: rows i < j0 see none of these keys
            for qi, (i0, i1) in enumerate(block_spans(L, block_q)):
                if i1 <= first or (kinds is not None and kinds[qi][kj] == EMPTY):
                    continue
                bq = i1 - i0
                q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)
                partial = kinds is not None and kinds[qi][kj] == PARTIAL
                keep = [(0, pieces.get(mask_mod, grids, i0, i1, j0, j1, q.dtype))] if partial else []
                # Recompute the block's weights from the saved log-sum-exp: P = exp(S - lse).
                p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                  offset=neg_lse[:, :, i0:i1].reshape(NK, G * bq, 1), out=scores,
                                  offset_last=float_mask,
                                  score_mod=score_mod, keep=keep, grids=grids).exp2_()
                if float_mask:
                    p.mul_(inv_l[:, :, i0:i1].reshape(NK, G * bq, 1))
                do_blk = d_out[:, :, i0:i1].reshape(NK, G * bq, Ev)
                # dV_j += P^T dO: (NK, bk, G*bq) @ (NK, G*bq, Ev) -> (NK, bk, Ev)
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_blk)
                # dP - D_i = dO V_j^T - D_i: (NK, G*bq, Ev) @ (NK, Ev, bk) -> (NK, G*bq, bk), added onto -D_i
                dp = _start_of(d_scores, *p.shape)
                dp.copy_(neg_delta[:, :, i0:i1].reshape(NK, G * bq, 1).expand_as(dp)).baddbmm_(do_blk, vT_blk)
                # dS = P * (dP - D_i), the softmax backward, in place.
                ds = dp.mul_(p)
                if dmask is not None:  # the mask is added to the scores: its gradient is dS
                    target = _mask_block(dmask, i0, i1, j0, j1)
                    target += ds.view(*batch, bq, bk).sum_to_size(target.shape)
                # Through the score_mod: dS_raw = dS * d score_mod / d raw score (its vector-Jacobian product).
                ds_raw = ds if score_mod is None else _score_mod_vjp(score_mod, q_blk, kT_blk, ds, batch, grids, i0, j0)
                # dQ_i += dS K_j: (NK, G*bq, bk) @ (NK, bk, E) -> (NK, G*bq, E)
                dq[:, :, i0:i1] += torch.bmm(ds_raw, k_blk).view(NK, G, bq, E)
                # dK_j += dS^T Q_i: (NK, bk, G*bq) @ (NK, G*bq, E) -> (NK, bk, E), summed over the group
                dk[:, j0:j1].baddbmm_(ds_raw.transpose(1, 2), q_blk)
        # The scores were log2(e) * q k^T: the chain rule gives dq and dk a factor ln 2 back.
        return dq.mul_(_LN2), dk.mul_(_LN2), dv, dmask, None, None, None, None, None


def _score_mod_vjp(
    score_mod: mods.ScoreMod,
    q_blk: torch.Tensor,
    kT_blk: torch.Tensor,
    ds: torch.Tensor,
    batch: tuple[int, ...],
    grids: tuple[torch.Tensor, ...],
    i0: int,
    j0: int,
) -> torch.Tensor:
    """``ds`` (the gradient of the modified scores) carried back through ``score_mod`` to the raw scores."""
    NK, GB, bk = ds.shape
    raw2 = torch.bmm(q_blk, kT_blk)  # (NK, G*bq, E) @ (NK, E, bk) -> (NK, G*bq, bk), log2 units
    view = raw2.view(*batch, -1, bk)  # -> (..., H, bq, bk)
    with torch.enable_grad():
        raw2 = view.detach().requires_grad_(True)
        modified = _modified_scores(score_mod, raw2, grids, i0, j0)
        (grad,) = torch.autograd.grad(modified, raw2, ds.view_as(raw2))
    # d modified / d raw2 = d modified / d raw * ln 2; the caller's final factor ln 2 is for q k^T itself.
    return (grad * _LOG2E).reshape(NK, GB, bk)


class _TiledModule(types.ModuleType):
    """This module's type: ``tiled.ADAPT_THREADS`` reads and sets `attention_ref.threads.ADAPT_THREADS`.

    The flag lived here before the thread budget got a module of its own; a plain copy would make
    ``tiled.ADAPT_THREADS = False`` change nothing, without a word.
    """

    @property
    def ADAPT_THREADS(self) -> bool:  # noqa: N802 (the flag's public name)
        return threads.ADAPT_THREADS

    @ADAPT_THREADS.setter
    def ADAPT_THREADS(self, value: bool) -> None:  # noqa: N802
        threads.ADAPT_THREADS = value


sys.modules[__name__].__class__ = _TiledModule
