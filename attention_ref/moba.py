r"""MoBA (Mixture of Block Attention, Kimi): each query attends to its own chunk and its top-k past chunks.

The keys are cut into chunks of ``chunk_size`` (the last one may be short).
Each query scores every chunk by the dot product of the query with the mean
of the chunk's keys, keeps the best ``topk`` chunks (its own chunk always among
them), and attends, causally, to the keys of those chunks, with one softmax over
their union. For query ``t`` in chunk ``c(t) = t // chunk_size``, with
``\bar k_n`` the mean key of chunk ``n``:

$$
g_{tn} = \begin{cases}
+\infty & n = c(t) \quad\text{(the own chunk, always selected)}\\
q_t \cdot \bar k_n & (n + 1)\,\mathrm{chunk\_size} \le t \quad\text{(a chunk wholly in the past)}\\
-\infty & \text{otherwise (a future chunk, never selected)}
\end{cases}
$$

$$
C_t = \operatorname{top-}k_n\, g_{tn}, \qquad
\mathrm{out}_t = \sum_{j \le t,\ j \in \bigcup_{n \in C_t} \mathrm{chunk}_n}
\frac{e^{s_{tj}}}{\sum_{j' \le t,\ j' \in \bigcup_{n \in C_t} \mathrm{chunk}_{n}} e^{s_{tj'}}}\, v_j ,
$$

with ``s`` the scaled scores ``scale * q . k``. The conventions, exactly as
MoonshotAI's reference ``moba_attn_varlen_naive`` (MoonshotAI/MoBA
``moba/moba_naive.py`` at ``61e456bc``):

- **the gate has no softmax scale**, and is computed in float32 (``gate_dtype``)
  from the chunk means taken in the keys' dtype ("use fp32 to avoid precision
  issue in bf16");
- **future chunks are excluded** (``-inf``) and **the own chunk is forced**
  (``+inf``): a chunk is selectable by a query only once its last key is
  before the query;
- **hard top-k**: exactly ``min(topk, N)`` chunks (``N`` chunks in all), no
  gate weight on the output (unlike NSA's gates). Equal gate values are broken
  by chunk index, the lower first; ``torch.topk`` breaks them arbitrarily, so
  judge a kernel's selection by its gate values, `attention_ref.sparse.assert_topk_close`
  (`moba_select` with ``return_gate=True`` gives both);
- **causal inside the own chunk** (``tril`` over the whole mask), one softmax
  over the union of the selected chunks: `moba_attention` is
  `attention_ref.sparse.block_topk_attention` over the chunks `moba_select` lists,
  with ``is_causal=True``, and is computed so.

**``topk = 1`` is ambiguous**, and must be chosen with ``topk1=``:

| ``topk1`` | ``topk = 1`` gives | as |
| --- | --- | --- |
| ``"block_local"`` | the own chunk only: block-local causal attention | MoonshotAI ``moba_naive.py`` |
| ``"full"`` | every chunk up to the own one: full causal attention | MoonshotAI ``moba_efficient.py`` (``moba_topk - 1 <= 0`` falls back to ``flash_attn_varlen_func(causal=True)``), fla ``parallel_moba`` (fla-org/flash-linear-attention ``fla/ops/moba/parallel.py`` at ``bc3b101d``, tested equal to causal attention in ``test_parallel_moba_topk1_short_circuits``) |

For ``topk >= 2`` all three agree. ``topk1`` is required whenever ``topk == 1``
(a ``ValueError`` naming it otherwise), even where a sequence has one chunk and
both give the same answer, so that a call does not start failing on longer inputs.

The efficient form, "self-attention over the own chunk plus attention over
the selected past chunks, merged by their log-sum-exp" (``moba_efficient.py``,
fla), is `moba_attention_merged`: `attention_ref.merge_attention` of two calls of
the core, equal to `moba_attention`.

Shapes use the package legend, heads first: ``query`` ``(..., H, L, E)``,
``key`` ``(..., H, S, E)`` (``(..., Hkv, S, E)`` with ``enable_gqa``: each query
head gates with its key head's chunk means, one selection per query head),
``value`` ``(..., H, S, Ev)``. MoBA is causal self-attention: ``S = L``.
MoonshotAI and fla take ``(total, H, E)`` packed with ``cu_seqlens``: pass
``q.transpose(0, 1)`` and the same ``cu_seqlens``. ``N`` is the number of chunks,
``ceil(L / chunk_size)``.
"""

from __future__ import annotations

import itertools

import torch

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._validation import (
    check_cu_seqlens,
    check_positive_int,
    fmt_shape,
    require_tensor,
)
from attention_ref.functional import merge_attention, scaled_dot_product_attention
from attention_ref.masks import causal_mask
from attention_ref.sparse import (
    NO_KEY,
    block_topk_attention,
    block_topk_indices,
    topk_mask,
)

__all__ = ["TOPK1", "moba_attention", "moba_attention_merged", "moba_gate", "moba_mask", "moba_select"]

#: The two meanings of ``topk = 1`` (`moba_attention`'s ``topk1=``).
TOPK1 = ("block_local", "full")


def _check_topk(topk: object, topk1: object) -> int:
    """``topk`` a positive int; ``topk1`` one of `TOPK1` or None, and given when ``topk == 1``."""
    topk = check_positive_int("topk", topk)
    if topk1 is not None and topk1 not in TOPK1:
        raise ValueError(f"topk1 must be 'block_local', 'full' or None, got {topk1!r}")
    if topk == 1 and topk1 is None:
        raise ValueError(
            "topk1 must be given when topk = 1, where MoBA's implementations disagree: "
            "topk1='block_local' attends to the own chunk only (MoonshotAI's moba_naive.py: block-local causal "
            "attention), topk1='full' to every chunk up to the own one (MoonshotAI's moba_efficient.py and "
            "fla's parallel_moba: full causal attention); got topk = 1 and topk1 = None"
        )
    return topk


def _check_gate_dtype(gate_dtype: object) -> torch.dtype:
    if not isinstance(gate_dtype, torch.dtype) or not gate_dtype.is_floating_point:
        raise TypeError(f"gate_dtype must be a floating-point torch.dtype, got {gate_dtype!r}")
    return gate_dtype


def moba_gate(
    query: torch.Tensor,
    key: torch.Tensor,
    chunk_size: int,
    *,
    enable_gqa: bool = False,
    gate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""MoBA's gate logits, masked: ``q_t . mean(chunk n's keys)``, ``+inf`` on the own chunk, ``-inf`` on the future.

    ``g[..., t, n]`` is ``+inf`` when ``n == t // chunk_size``, ``q_t . \bar k_n``
    when ``(n + 1) * chunk_size <= t`` (chunk ``n`` ends before ``t``), and
    ``-inf`` otherwise: MoonshotAI's ``gate`` after its two masking assignments.
    No softmax scale. The chunk means are taken in ``key``'s dtype, then the
    product in ``gate_dtype`` (as the reference, "fp32 to avoid precision issue
    in bf16"); pass ``torch.float64`` for the exact value.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, ``S = L`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        chunk_size: keys per chunk; the last chunk may be shorter.
        enable_gqa: grouped-query heads: query head ``h`` reads key head ``h // (H // Hkv)``.
        gate_dtype: the dtype of the product, float32 by default.

    Returns:
        ``(..., H, L, N)`` in ``gate_dtype``, ``N = ceil(L / chunk_size)``.

    Raises:
        TypeError: non-float tensors, a ``gate_dtype`` that is not a float dtype.
        ValueError: ``S != L``, a non-positive ``chunk_size``, shapes that do not fit.

    Examples:
        >>> q = torch.tensor([[1.0, 0.0]] * 4)        # (L, E): 4 queries
        >>> k = torch.tensor([[2.0, 0], [4, 0], [1, 0], [1, 0]])
        >>> moba_gate(q, k, 2).tolist()               # chunk 0's mean key is (3, 0)
        [[inf, -inf], [inf, -inf], [3.0, inf], [3.0, inf]]
    """
    query, key, _, _ = _inputs.check_qk(query, key, None, enable_gqa)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    gate_dtype = _check_gate_dtype(gate_dtype)
    _inputs.check_self_attention(query, key, "MoBA")
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E): each query head gates with its key head
        key = _inputs.expand_kv_heads(query, key, "key")
    L, S = query.shape[-2], key.shape[-2]
    starts = range(0, S, chunk_size)
    if S:  # the mean key of each chunk, the last one over its own length: (..., N, E)
        means = torch.stack([key[..., a:a + chunk_size, :].mean(-2) for a in starts], dim=-2)
    else:
        means = key.new_zeros((*key.shape[:-2], 0, key.shape[-1]))
    # (..., H, L, E) x (..., H, E, N) -> (..., H, L, N), no softmax scale
    gate = torch.matmul(query.to(gate_dtype), means.to(gate_dtype).transpose(-2, -1))
    t = torch.arange(L, device=query.device).unsqueeze(-1)  # (L, 1)
    n = torch.arange(len(starts), device=query.device)  # (N,)
    own = t // chunk_size == n  # (L, N)
    past = (n + 1) * chunk_size <= t  # (L, N): chunk n's last key, (n + 1) * chunk_size - 1, is before t
    gate = torch.where(past, gate, float("-inf"))
    return torch.where(own, float("inf"), gate).to(gate_dtype)


def moba_select(
    query: torch.Tensor,
    key: torch.Tensor,
    chunk_size: int,
    topk: int,
    *,
    topk1: str | None = None,
    enable_gqa: bool = False,
    gate_dtype: torch.dtype = torch.float32,
    return_gate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The chunks each query attends to: the top ``topk`` of `moba_gate`, the own chunk first.

    Hard top-k of the masked gate, equal values broken by chunk index (the
    lower first): exactly ``min(topk, N)`` slots, a slot whose chunk is in the
    query's future (fewer than ``topk`` chunks selectable yet) ``-1``. With
    ``topk = 1`` and ``topk1="full"``: every chunk up to the own one, ``N`` slots.
    Computed without gradient: the selection is hard.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, ``S = L`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        chunk_size: keys per chunk.
        topk: chunks per query, the own chunk counted (MoonshotAI's ``moba_topk``,
            fla's ``topk``).
        topk1: what ``topk = 1`` means, ``"block_local"`` or ``"full"`` (see
            `attention_ref.moba`); required when ``topk == 1``, ignored otherwise.
        enable_gqa: grouped-query heads, as `moba_gate`.
        gate_dtype: as `moba_gate`.
        return_gate: also return `moba_gate`'s logits, for
            `attention_ref.sparse.assert_topk_close` (``-1`` slots count as ``-inf``).

    Returns:
        ``chunks`` ``(..., H, L, k)`` int64, best first, ``-1`` = no chunk, with
        ``k = min(topk, N)`` (``N`` for ``topk1="full"`` at ``topk = 1``); with
        ``return_gate``, ``(chunks, gate)``.

    Raises:
        ValueError: ``topk = 1`` without ``topk1``, an unknown ``topk1``, and as `moba_gate`.
        TypeError: as `moba_gate`; ``topk`` not an int.

    Examples:
        >>> q = torch.tensor([[1.0], [1.0], [1.0], [1.0], [1.0]])  # (L, E)
        >>> k = torch.tensor([[1.0], [1.0], [3.0], [3.0], [0.0]])  # chunks of 2: means 1, 3, 0
        >>> moba_select(q, k, 2, 2).tolist()          # query 4 takes chunk 1 (gate 3) over chunk 0 (1)
        [[0, -1], [0, -1], [1, 0], [1, 0], [2, 1]]
    """
    topk = _check_topk(topk, topk1)
    _inputs.check_bool("return_gate", return_gate)
    with torch.no_grad():
        gate = moba_gate(query, key, chunk_size, enable_gqa=enable_gqa, gate_dtype=gate_dtype)  # (..., H, L, N)
    N = gate.shape[-1]
    slots = N if topk == 1 and topk1 == "full" else min(topk, N)
    ranked = torch.sort(gate, dim=-1, descending=True, stable=True)  # stable: equal gates by chunk index
    values, chunks = ranked.values[..., :slots], ranked.indices[..., :slots]  # (..., H, L, k) each
    chunks = chunks.masked_fill(values == float("-inf"), NO_KEY)  # a future chunk: no chunk
    return (chunks, gate) if return_gate else chunks


def moba_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    chunk_size: int,
    topk: int,
    *,
    topk1: str | None = None,
    enable_gqa: bool = False,
    gate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """MoBA's selection as a boolean mask, ``True`` = the pair takes part: the selected chunks' keys, causal.

    ``True`` means the pair takes part (the convention of
    ``torch.nn.functional.scaled_dot_product_attention``; ``torch.nn.MultiheadAttention``
    uses the opposite). ``scaled_dot_product_attention(q, k, v, moba_mask(...))``
    equals `moba_attention`.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, ``S = L`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        chunk_size: keys per chunk.
        topk: chunks per query, the own chunk counted.
        topk1: what ``topk = 1`` means, as `moba_select`.
        enable_gqa: grouped-query heads, as `moba_gate`.
        gate_dtype: as `moba_gate`.

    Returns:
        ``(..., H, L, S)`` bool.

    Raises:
        ValueError: as `moba_select`.
        TypeError: as `moba_select`.

    Examples:
        >>> q, k = torch.ones(5, 1), torch.tensor([[1.0], [1.0], [3.0], [3.0], [0.0]])
        >>> moba_mask(q, k, 2, 2).int().tolist()      # query 4: chunks 1 and 2
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    chunks = moba_select(query, key, chunk_size, topk, topk1=topk1, enable_gqa=enable_gqa, gate_dtype=gate_dtype)
    L = S = key.shape[-2]
    keep = topk_mask(block_topk_indices(chunks, chunk_size, S), S)  # (..., H, L, S): the selected chunks' keys
    return keep & causal_mask(L, S, device=keep.device)  # causal inside the own chunk


def _per_sequence(fn, cu_seqlens: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  return_lse: bool):
    """``fn(q, k, v)`` on each packed sequence of ``cu_seqlens`` (along dim -2), concatenated."""
    query, key, value = (require_tensor(n, t) for n, t in (("query", query), ("key", key), ("value", value)))
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, query.shape[-2], "L (the query's dim -2)").tolist()
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() < 2 or tensor.shape[-2] != query.shape[-2]:
            raise ValueError(f"{name} must be packed like the query, (..., L, *) with L = {query.shape[-2]}, "
                             f"got {fmt_shape(tensor.shape)}")
    parts = [fn(query[..., a:b, :], key[..., a:b, :], value[..., a:b, :]) for a, b in itertools.pairwise(cu)]
    if not return_lse:
        return torch.cat(parts, dim=-2)  # n x (..., H, L_s, Ev) -> (..., H, L, Ev)
    return torch.cat([o for o, _ in parts], dim=-2), torch.cat([lse for _, lse in parts], dim=-1)


def moba_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    chunk_size: int,
    topk: int,
    topk1: str | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    gate_dtype: torch.dtype = torch.float32,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""MoBA: causal attention over the own chunk and the ``topk - 1`` best past chunks, one softmax (the naive form).

    Equal to ``block_topk_attention(query, key, value, moba_select(...), chunk_size,
    is_causal=True)`` (`attention_ref.sparse.block_topk_attention`), and computed
    so: one masked softmax through `attention_ref.scaled_dot_product_attention`,
    in at least float32 (float64 for float64 inputs), gradients by autograd to
    ``query``, ``key`` and ``value`` through the attention (none through the hard
    selection). The conventions: `attention_ref.moba`.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, ``S = L`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        value: ``(..., H, S, Ev)`` (``(..., Hkv, S, Ev)`` with ``enable_gqa``).
        chunk_size: keys per chunk (``moba_chunk_size``).
        topk: chunks per query, the own chunk counted (``moba_topk``).
        topk1: what ``topk = 1`` means: ``"block_local"`` (the own chunk only,
            MoonshotAI's naive reference) or ``"full"`` (full causal attention,
            MoonshotAI's efficient version and fla). Required when ``topk == 1``.
        scale: multiplies the attention scores (not the gate); defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query heads (``H`` a multiple of ``Hkv``).
        gate_dtype: the gate's dtype, float32 as MoonshotAI's reference (`moba_gate`).
        cu_seqlens: ``(n + 1,)`` cumulative lengths of ``n`` sequences packed along
            dim -2 (``L`` the total): each sequence is chunked from its own start
            and attends within itself (MoonshotAI's and fla's varlen layout, heads first).
        return_lse: also return the natural-log sum of exponentials ``(..., H, L)``
            of each row's selected scores.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype; with ``return_lse``, ``(output, lse)``.
        Every query sees at least itself, so no row is empty.

    Raises:
        ValueError: ``topk = 1`` without ``topk1`` (the message gives both
            meanings), an unknown ``topk1``, ``S != L``, a non-positive
            ``chunk_size`` or ``topk``, bad ``cu_seqlens``, shapes that do not fit.
        TypeError: non-float tensors, different dtypes, a non-int ``chunk_size`` or ``topk``.

    Examples:
        >>> gen = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(3))
        >>> from attention_ref import scaled_dot_product_attention as sdpa
        >>> full = sdpa(q, k, v, is_causal=True)       # topk >= number of chunks: every past chunk
        >>> torch.allclose(moba_attention(q, k, v, chunk_size=2, topk=3), full)
        True
        >>> torch.allclose(moba_attention(q, k, v, chunk_size=2, topk=1, topk1="full"), full)
        True
    """
    _check_topk(topk, topk1)
    _inputs.check_bool("return_lse", return_lse)

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        chunks = moba_select(q, k, chunk_size, topk, topk1=topk1, enable_gqa=enable_gqa, gate_dtype=gate_dtype)
        return block_topk_attention(q, k, v, chunks, chunk_size, is_causal=True, scale=scale,
                                    enable_gqa=enable_gqa, return_lse=return_lse)

    if cu_seqlens is not None:
        return _per_sequence(one, cu_seqlens, query, key, value, return_lse)
    return one(query, key, value)


def moba_attention_merged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    chunk_size: int,
    topk: int,
    topk1: str | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    gate_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""MoBA's efficient form: the own chunk (causal) and the selected past chunks attended apart, merged by LSE.

    Equals `moba_attention` (with ``return_lse=True``). MoonshotAI's
    ``moba_efficient.py`` and fla's ``parallel_moba`` compute MoBA as two
    attentions over disjoint keys:

    1. the own chunk, causal: ``mask_mod = and_masks(causal(), chunked(chunk_size))``;
    2. the selected *past* chunks (the own chunk left out), no causal mask:
       every key of a past chunk is before the query;

    then `attention_ref.merge_attention` of the two ``(output, lse)`` pairs. A query
    with no past chunk (the first chunk, or ``topk = 1`` with
    ``topk1="block_local"``) has ``lse = -inf`` in part 2, weight 0 in the merge.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, ``S = L`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        value: ``(..., H, S, Ev)`` (``(..., Hkv, S, Ev)`` with ``enable_gqa``).
        chunk_size: keys per chunk.
        topk: chunks per query, the own chunk counted.
        topk1: what ``topk = 1`` means, as `moba_attention`.
        scale: multiplies the attention scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query heads (``H`` a multiple of ``Hkv``).
        gate_dtype: as `moba_gate`.

    Returns:
        ``(output, lse)``: ``(..., H, L, Ev)`` in ``query``'s dtype and ``(..., H, L)``.

    Raises:
        ValueError: as `moba_attention`.
        TypeError: as `moba_attention`.

    Examples:
        >>> gen = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(2, 9, 4, generator=gen, dtype=torch.float64) for _ in range(3))
        >>> out, lse = moba_attention_merged(q, k, v, chunk_size=2, topk=2)
        >>> ref, ref_lse = moba_attention(q, k, v, chunk_size=2, topk=2, return_lse=True)
        >>> torch.allclose(out, ref), torch.allclose(lse, ref_lse)
        (True, True)
    """
    chunks = moba_select(query, key, chunk_size, topk, topk1=topk1, enable_gqa=enable_gqa, gate_dtype=gate_dtype)
    L = query.shape[-2]
    own_chunk = (torch.arange(L, device=chunks.device) // chunk_size).unsqueeze(-1)  # (L, 1)
    past_chunks = chunks.masked_fill(chunks == own_chunk, NO_KEY)  # (..., H, L, k): the own chunk left out
    own = scaled_dot_product_attention(
        query, key, value, mask_mod=_mods.and_masks(_mods.causal(), _mods.chunked(chunk_size)),
        scale=scale, enable_gqa=enable_gqa, return_lse=True,
    )
    past = block_topk_attention(query, key, value, past_chunks, chunk_size, scale=scale, enable_gqa=enable_gqa,
                                return_lse=True)
    return merge_attention(*own, *past)
