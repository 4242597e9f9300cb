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

import torch
from torch.autograd.function import once_differentiable

from attention_ref import _inputs
from attention_ref._validation import check_positive_int

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "tiled_attention"]

#: Queries per block. Tuned for CPU throughput (``benchmarks/attention_bench.py --tune``).
DEFAULT_BLOCK_Q = 256
#: Keys per block. Tuned for CPU throughput (``benchmarks/attention_bench.py --tune``).
DEFAULT_BLOCK_K = 512

_NEG_INF = float("-inf")
_LOG2E = math.log2(math.e)  # scores * log2(e) turn exp(.) into exp2(.)
_LN2 = math.log(2.0)
#: The lazy step keeps the old running max while a block's weights against it sum to at most
#: 2**_LAZY_GROWTH (a score at most 32 powers of 2 above it); a larger sum redoes the block exactly.
_LAZY_GROWTH = 32


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> torch.Tensor:
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
        block_q: queries per block.
        block_k: keys per block. Neither needs to divide ``L`` or ``S``.

    Returns:
        ``(..., L, Ev)`` in ``query``'s dtype, computed in at least float32.

    Raises:
        ValueError, TypeError: as `attention_ref.scaled_dot_product_attention`
            (the same validation runs), and for block sizes that are not
            positive ints.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 7, 8), torch.randn(2, 13, 8), torch.randn(2, 13, 4)
        >>> out = tiled_attention(q, k, v, is_causal=True, block_q=3, block_k=5)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return _tiled(query, key, value, mask, is_causal=is_causal, scale=resolved, enable_gqa=enable_gqa,
                  block_q=block_q, block_k=block_k)


def _tiled(
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
) -> torch.Tensor:
    """The tiled path on validated inputs (the dispatcher's entry point)."""
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    H = query.shape[-3] if enable_gqa else 1
    Hkv = key.shape[-3] if enable_gqa else 1
    G = H // Hkv  # query heads per key/value head (1 without grouped-query attention)
    batch = _batch_shape(query, key, value, enable_gqa)
    prefix = batch[:-1] if enable_gqa else batch  # the dims in front of the heads
    N = math.prod(prefix)
    compute = torch.promote_types(query.dtype, torch.float32)
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
    out = _TiledAttention.apply(q, k, v, mask, is_causal, batch, block_q, block_k)  # (N * Hkv, G, L, Ev)
    return out.reshape(*batch, L, Ev).to(query.dtype)  # -> (..., L, Ev)


def _batch_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> tuple[int, ...]:
    """The broadcast leading dims ``(...)`` of the output, grouped key/value heads counted as ``H``."""
    if enable_gqa:
        H = query.shape[-3]
        return tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-3] + (H,), value.shape[:-3] + (H,)))
    return tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))


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
) -> torch.Tensor:
    """Masked scores (times log2 e) of query rows i0:i1 against keys j0:j1, plus ``offset``: ``(N * Hkv, G * bq, bk)``.

    ``q_blk`` is ``(N * Hkv, G * bq, E)`` (already scaled by ``scale * log2 e``),
    ``kT_blk`` ``(N * Hkv, E, bk)``; ``offset`` ``(N * Hkv, G * bq, 1)`` is added to
    every score of its row (the callers pass minus a running max or minus the
    log-sum-exp). The offset and the masks are written first and the matrix
    product is added onto them (``baddbmm_``): one pass over the block fewer than
    adding them afterwards. ``out`` is a buffer with room for the largest block;
    the result is a contiguous view of its start.
    """
    NK, GB, _ = q_blk.shape
    bq, bk = i1 - i0, j1 - j0
    s = _buffer(q_blk, NK, GB, bk) if out is None else _start_of(out, NK, GB, bk)
    terms = []  # (a view of s, a term that broadcasts to it), summed into s before the product
    if offset is not None:
        terms.append((s, offset))
    if is_causal and j1 - 1 > i0:  # the block reaches above the diagonal: hide keys j > i
        above = torch.full((bq, bk), _NEG_INF, dtype=s.dtype, device=s.device).triu_(i0 - j0 + 1)  # -inf where j > i
        terms.append((s.view(NK, -1, bq, bk), above))  # (bq, bk) broadcasts over the heads
    if mask is not None:
        m_blk = _mask_block(mask, i0, i1, j0, j1)
        # A float mask is added to the scores (times log2 e, like them); a boolean one adds 0 or -inf.
        bias = _bool_to_bias(m_blk, s.dtype) if m_blk.dtype == torch.bool else m_blk.to(s.dtype) * _LOG2E
        terms.append((s.view(*batch, bq, bk), bias))  # (N*Hkv, G*bq, bk) -> (..., H, bq, bk), a view
    # (N*Hkv, G*bq, E) @ (N*Hkv, E, bk) -> (N*Hkv, G*bq, bk), added onto the terms
    if not terms:
        return torch.bmm(q_blk, kT_blk, out=s)
    (view, term), *rest = terms
    view.copy_(term.expand_as(view))
    for view, term in rest:
        view.add_(term)
    return s.baddbmm_(q_blk, kT_blk)


def _bool_to_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep`` is True, -inf where it is False, in ``dtype``.

    Computed as ``1 - 1/x`` on the mask read as 0/1 bytes: four vectorised passes,
    several times faster on CPU than ``masked_fill`` or ``where`` on a boolean mask.
    """
    return keep.view(torch.uint8).to(dtype).reciprocal_().neg_().add_(1.0)


def _buffer(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s dtype and device; the loops allocate one per call and reuse it."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _start_of(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous ``shape`` view of the start of ``buffer`` (a smaller last block reuses the full one)."""
    if buffer.shape == shape:
        return buffer
    return buffer.view(-1)[: math.prod(shape)].view(shape)


def _blocks(L: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, L)) for start in range(0, L, block)]


class _TiledAttention(torch.autograd.Function):
    """softmax(q k^T / log2(e) + mask) v over blocks, q pre-scaled by ``scale * log2 e``.

    Shapes: q (N*Hkv, G, L, E), k (N*Hkv, S, E), v (N*Hkv, S, Ev), all in the compute
    dtype; returns (N*Hkv, G, L, Ev). ``m_i`` and ``lse`` are in log2 units.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, batch, block_q, block_k):  # type: ignore[override]
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        out = torch.empty(NK, G, L, Ev, dtype=q.dtype, device=q.device)
        lse = torch.empty(NK, G, L, 1, dtype=q.dtype, device=q.device)
        kT = k.transpose(1, 2)  # (NK, S, E) -> (NK, E, S), a view
        scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused by every block
        for i0, i1 in _blocks(L, block_q):
            bq = i1 - i0
            q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)  # (NK, G, bq, E) -> (NK, G*bq, E)
            m_i = torch.full((NK, G * bq, 1), _NEG_INF, dtype=q.dtype, device=q.device)  # running max
            l_i = torch.zeros(NK, G * bq, 1, dtype=q.dtype, device=q.device)  # running sum of exp
            acc = torch.zeros(NK, G * bq, Ev, dtype=q.dtype, device=q.device)  # running sum of exp * v
            lazy, neg_m = False, None  # lazy: every row has a finite m_i (then neg_m = -m_i)
            last = min(S, i1) if is_causal else S  # causal: keys j > i1 - 1 are masked for every row
            for j0, j1 in _blocks(last, block_k):
                kT_blk, v_blk = kT[:, :, j0:j1], v[:, j0:j1]
                if lazy:
                    # Lazy step: p = exp(s - m_i) against the old max, m_i subtracted inside the matmul;
                    # no max of this block, no rescaling. Kept unless the row sums exceed 2**_LAZY_GROWTH.
                    p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                      offset=neg_m, out=scores).exp2_()
                    l_blk = p.sum(dim=-1, keepdim=True)
                    if l_blk.max().item() <= 2.0**_LAZY_GROWTH:  # False on inf, and on NaN (max keeps NaN)
                        l_i += l_blk
                        acc.baddbmm_(p, v_blk)  # (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                        continue
                s = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1, out=scores)
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
            # out = acc / l_i; a row where no key took part has l_i = 0 and acc = 0: it gives 0.
            out[:, :, i0:i1] = (acc / l_i.masked_fill(l_i == 0, 1.0)).view(NK, G, bq, Ev)
            # lse = m_i + log(l_i), the log of the softmax denominator (-inf on fully masked rows).
            lse[:, :, i0:i1] = (m_i + torch.log2(l_i)).view(NK, G, bq, 1)
        ctx.save_for_backward(q, k, v, out, lse, mask if mask is not None else torch.empty(0))
        ctx.has_mask = mask is not None
        ctx.options = (is_causal, batch, block_q, block_k)
        return out

    @staticmethod
    @once_differentiable  # the blockwise backward is not itself differentiable
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        is_causal, batch, block_q, block_k = ctx.options
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        d_out = d_out.to(q.dtype)
        # D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the term the softmax Jacobian subtracts. It and
        # lse enter the blocks' matmuls negated, as their starting values: negated once here.
        neg_delta = (d_out * out).sum(dim=-1, keepdim=True).neg_()  # (NK, G, L, 1)
        # A fully masked row has lse = -inf; +inf makes every recomputed weight exp(-inf - inf) = 0.
        neg_lse = lse.masked_fill(lse == _NEG_INF, float("inf")).neg_()  # (NK, G, L, 1)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need_dmask = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if need_dmask else None
        kT, vT = k.transpose(1, 2), v.transpose(1, 2)  # (NK, E, S), (NK, Ev, S): views
        scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for P by every block
        d_scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for dP and dS
        for j0, j1 in _blocks(S, block_k):
            bk = j1 - j0
            k_blk, kT_blk, vT_blk = k[:, j0:j1], kT[:, :, j0:j1], vT[:, :, j0:j1]
            first = j0 if is_causal else 0  # causal: rows i < j0 see none of these keys
            for i0, i1 in _blocks(L, block_q):
                if i1 <= first:
                    continue
                bq = i1 - i0
                q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)
                # Recompute the block's weights from the saved log-sum-exp: P = exp(S - lse).
                p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                  offset=neg_lse[:, :, i0:i1].reshape(NK, G * bq, 1), out=scores).exp2_()
                do_blk = d_out[:, :, i0:i1].reshape(NK, G * bq, Ev)
                # dV_j += P^T dO: (NK, bk, G*bq) @ (NK, G*bq, Ev) -> (NK, bk, Ev)
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_blk)
                # dP - D_i = dO V_j^T - D_i: (NK, G*bq, Ev) @ (NK, Ev, bk) -> (NK, G*bq, bk), added onto -D_i
                dp = _start_of(d_scores, *p.shape)
                dp.copy_(neg_delta[:, :, i0:i1].reshape(NK, G * bq, 1).expand_as(dp)).baddbmm_(do_blk, vT_blk)
                # dS = P * (dP - D_i), the softmax backward, in place.
                ds = dp.mul_(p)
                # dQ_i += dS K_j: (NK, G*bq, bk) @ (NK, bk, E) -> (NK, G*bq, E)
                dq[:, :, i0:i1] += torch.bmm(ds, k_blk).view(NK, G, bq, E)
                # dK_j += dS^T Q_i: (NK, bk, G*bq) @ (NK, G*bq, E) -> (NK, bk, E), summed over the group
                dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_blk)
                if dmask is not None:  # the mask is added to the scores: its gradient is dS
                    target = _mask_block(dmask, i0, i1, j0, j1)
                    target += ds.view(*batch, bq, bk).sum_to_size(target.shape)
        # The scores were log2(e) * q k^T: the chain rule gives dq and dk a factor ln 2 back.
        return dq.mul_(_LN2), dk.mul_(_LN2), dv, dmask, None, None, None, None
