r"""Native Sparse Attention (DeepSeek): compressed, selected and sliding-window branches, gated per head and token.

Each query ``t`` of head ``h`` reads three sets of keys and mixes the three
results with its own gates (sigmoids of a linear map of the hidden state):

$$
o_t = g^{\mathrm{cmp}}_t\, \mathrm{Attn}(q_t, \tilde K, \tilde V)
    + g^{\mathrm{slc}}_t\, \mathrm{Attn}(q_t, K_{\mathrm{sel}(t)}, V_{\mathrm{sel}(t)})
    + g^{\mathrm{swa}}_t\, \mathrm{Attn}(q_t, K_{[t - w + 1,\, t]}, V_{[t - w + 1,\, t]}) .
$$

The conventions are those of fla's reference (fla-org/flash-linear-attention
``fla/ops/nsa/naive.py`` at ``bc3b101d``: ``naive_nsa_compression``,
``naive_nsa_topk``, ``naive_nsa_selection``, ``naive_nsa``), which every public
NSA kernel is tested against; each is a function here:

- **compressed** (`compress_blocks`, `compressed_attention`): the keys and
  values of each block of ``block_size`` tokens are pooled into one (their mean
  by default); query ``t`` sees compressed block ``c`` iff the block ends at or
  before it, ``(c + 1) * block_size - 1 <= t``. A query with no such block
  (``t < block_size - 1``) gets output 0 and ``lse = -inf``.
- **selection** (`select_blocks`): the compressed attention's probabilities,
  averaged over the query heads of each key/value group (one selection per
  ``Hkv`` head, shared by its ``H // Hkv`` query heads); the first block, the
  query's own block and the one before it are forced (score 1.0, ranked first);
  the best ``block_counts`` blocks per query (an int, or one count per query
  and group), unused slots ``-1``. Among equal scores the lower block index
  comes first (``torch.topk`` picks any: judge a kernel with
  `attention_ref.sparse.assert_topk_close` on the scores ``return_scores=True`` gives).
- **selected** (`selected_attention`): one softmax over the keys of the
  selected blocks, causal inside them (keys ``> t`` masked, the own block
  included): `attention_ref.sparse.block_topk_attention` with ``is_causal=True``.
- **sliding window** (`window_attention`): keys ``t - w + 1 .. t``, FlashAttention's
  ``window_size=(w - 1, 0), causal=True`` (`attention_ref.conventions.from_flash_attn_window`),
  where fla's "naive" reference calls ``flash_attn_func``.
- **gates**: ``o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa``, one gate per
  query head and token, already through the sigmoid (fla's ``NativeSparseAttention``
  layer: ``g_proj(x).sigmoid().unbind(-1)``). A gate of 0 turns a branch off (fla's
  ``window_size=0`` is ``g_swa = 0``; its ungated selection, ``g_slc=None``, is
  ``g_slc = 1``).

Each branch runs through `attention_ref.scaled_dot_product_attention`, in at
least float32 (float64 for float64 inputs), with gradients by autograd to the
queries, keys, values and gates (none through the hard selection).

What this reference does not take from fla: its constraint that ``H // Hkv``
be a power of 2 and at least 16 (a kernel tile size; any ``Hkv`` dividing ``H``
works here). What it does not have from the paper (arXiv 2502.11089, not
checked against its text here): overlapping compression blocks (length ``l``,
stride ``d < l``) and selection blocks of another size than the compression's.
A learned compression of non-overlapping blocks (an MLP over a block with
position encodings) goes in ``compress=``.

Shapes use the package legend, heads first: ``query`` ``(..., H, L, E)``,
``key`` ``(..., Hkv, S, E)``, ``value`` ``(..., Hkv, S, Ev)``, gates
``(..., H, L)``, block indices ``(..., Hkv, L, k)``; NSA is causal
self-attention, ``S = L``. fla's layout is ``(B, T, H, D)``: pass
``q.transpose(1, 2)``, and ``block_indices.transpose(1, 2)`` for its ``[B, T, H, S]``.
``n`` is the number of blocks, ``ceil(L / block_size)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attention_ref import _inputs, conventions
from attention_ref import mods as _mods
from attention_ref._validation import (
    check_cu_seqlens,
    check_positive_int,
    fmt_shape,
    require_float_tensor,
    require_int_tensor,
    require_same_dtype_and_device,
    require_tensor,
)
from attention_ref.functional import attention_weights, scaled_dot_product_attention
from attention_ref.sparse import NO_KEY, block_topk_attention

__all__ = [
    "compress_blocks",
    "compressed_attention",
    "nsa_attention",
    "select_blocks",
    "selected_attention",
    "window_attention",
]

Compress = Callable[[torch.Tensor], torch.Tensor]


# --- argument checks ----------------------------------------------------------------------------


def _check_heads(query: object, key: object, value: object | None = None,
                 key_name: str = "key", value_name: str = "value") -> tuple[torch.Tensor, ...]:
    """``query`` ``(..., H, L, E)``, ``key`` ``(..., Hkv, S, E)`` (and ``value``) with ``Hkv`` dividing ``H``."""
    query = require_float_tensor("query", query, 3, "(..., H, L, E)")
    key = require_float_tensor(key_name, key, 3, "(..., Hkv, S, E)")
    tensors = {"query": query, key_name: key}
    if value is not None:
        value = require_float_tensor(value_name, value, 3, "(..., Hkv, S, Ev)")
        tensors[value_name] = value
    require_same_dtype_and_device(**tensors)
    H, Hkv = query.shape[-3], key.shape[-3]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{key_name} must have Hkv heads (dim -3) dividing the query's H = {H}, "
                         f"got {key_name} {fmt_shape(key.shape)} with Hkv = {Hkv}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"query and {key_name} must share their batch dims (...), got query "
                         f"{fmt_shape(query.shape)} and {key_name} {fmt_shape(key.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{key_name} must have E = {query.shape[-1]} (the query's last dim), "
                         f"got {key_name} {fmt_shape(key.shape)}")
    if value is not None and value.shape[:-1] != key.shape[:-1]:
        raise ValueError(f"{value_name} must have shape (..., Hkv, S, Ev) = {fmt_shape(key.shape[:-1])} + (Ev,), "
                         f"got {fmt_shape(value.shape)}")
    return (query, key) if value is None else (query, key, value)


def _check_block_indices(block_indices: object, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``(..., Hkv, L, k)`` integer; the values are checked by `attention_ref.sparse.block_topk_indices`."""
    block_indices = require_tensor("block_indices", block_indices)
    expected = (*key.shape[:-2], query.shape[-2])  # (..., Hkv, L)
    if block_indices.dim() != len(expected) + 1 or tuple(block_indices.shape[:-1]) != expected:
        raise ValueError(f"block_indices must have shape (..., Hkv, L, k) = {fmt_shape(expected)[:-1]}, k), "
                         f"one list per key/value head and query, got {fmt_shape(block_indices.shape)}")
    if block_indices.device != query.device:
        raise ValueError(f"block_indices must be on the same device as query ({query.device}), "
                         f"got {block_indices.device}")
    return block_indices


def _check_block_counts(block_counts: object, query: torch.Tensor, Hkv: int) -> int | torch.Tensor:
    """An int ``>= 0``, or an integer tensor ``(..., Hkv, L)`` of counts ``>= 0``."""
    if isinstance(block_counts, torch.Tensor):
        shape = (*query.shape[:-3], Hkv, query.shape[-2])
        counts = require_int_tensor("block_counts", block_counts, "(..., Hkv, L)", dims=(len(shape),), shape=shape,
                                    device=query.device)
        if counts.numel() and int(counts.min()) < 0:
            raise ValueError(f"block_counts must hold counts >= 0, got {int(counts.min())}")
        return counts
    if isinstance(block_counts, bool) or not isinstance(block_counts, int):
        raise TypeError(f"block_counts must be an int or an integer tensor (..., Hkv, L), "
                        f"got {type(block_counts).__name__}")
    return check_positive_int("block_counts", block_counts, allow_zero=True)


def _check_gate(name: str, gate: object, query: torch.Tensor) -> torch.Tensor:
    gate = require_float_tensor(name, gate, 1, "(..., H, L)")
    if gate.shape != query.shape[:-1]:
        raise ValueError(f"{name} must have shape (..., H, L) = {fmt_shape(query.shape[:-1])}, one gate per "
                         f"query head and token, got {fmt_shape(gate.shape)}")
    require_same_dtype_and_device(query=query, **{name: gate})
    return gate


# --- the compressed branch ----------------------------------------------------------------------


def _mean(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.mean(-2)  # (..., n, block_size, D) -> (..., n, D)


def compress_blocks(x: torch.Tensor, block_size: int, compress: Compress | None = None) -> torch.Tensor:
    """One token per complete block of ``block_size``: its mean, or ``compress(blocks)``.

    Only the ``S // block_size`` complete blocks are pooled: a last, partial
    block ends after every query, so no query ever sees it (fla's
    ``mean_pooling`` keeps it, averaged over its own tokens; it is masked there).

    Args:
        x: ``(..., S, D)`` keys or values.
        block_size: tokens per block.
        compress: ``(..., n, block_size, D) -> (..., n, D')``, applied to the blocks;
            ``None`` (the default) takes their mean. A learned compression (the
            paper's MLP with an intra-block position encoding) goes here.

    Returns:
        ``(..., n, D')``, ``n = S // block_size``.

    Raises:
        TypeError: ``x`` not a float tensor, ``compress`` not callable or not returning a tensor.
        ValueError: a non-positive ``block_size``; ``compress`` returning another shape than ``(..., n, D')``.

    Examples:
        >>> compress_blocks(torch.arange(5.0).reshape(5, 1), 2).tolist()  # blocks [0, 1], [2, 3]
        [[0.5], [2.5]]
    """
    x = require_float_tensor("x", x, 2, "(..., S, D)")
    block_size = check_positive_int("block_size", block_size)
    if compress is not None and not callable(compress):
        raise TypeError(f"compress must be a callable (..., n, block_size, D) -> (..., n, D') or None, "
                        f"got {type(compress).__name__}")
    n = x.shape[-2] // block_size
    blocks = x[..., : n * block_size, :].unflatten(-2, (n, block_size))  # (..., n * bs, D) -> (..., n, bs, D)
    pooled = (compress or _mean)(blocks)
    if not isinstance(pooled, torch.Tensor) or pooled.dim() != blocks.dim() - 1 or pooled.shape[:-1] != blocks.shape[:-2]:
        got = fmt_shape(pooled.shape) if isinstance(pooled, torch.Tensor) else type(pooled).__name__
        raise ValueError(f"compress must return (..., n, D') = {fmt_shape(blocks.shape[:-2])[:-1]}, D') for blocks "
                         f"{fmt_shape(blocks.shape)}, got {got}")
    return pooled


def _visible(block_size: int) -> _mods.MaskMod:
    """Compressed block ``c`` is visible to query ``t`` iff it ends at or before ``t``."""

    def nsa_compressed_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                                kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx + 1) * block_size - 1 <= q_idx

    return nsa_compressed_mask_mod


def compressed_attention(
    query: torch.Tensor,
    key_cmp: torch.Tensor,
    value_cmp: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The compressed branch: attention over the blocks that end at or before each query.

    Query ``t`` sees compressed block ``c`` iff ``(c + 1) * block_size - 1 <= t``
    (fla's ``naive_nsa_compression``); computed as
    `attention_ref.scaled_dot_product_attention` with that ``mask_mod``.

    Args:
        query: ``(..., H, L, E)``.
        key_cmp: ``(..., Hkv, n, E)``, the compressed keys (`compress_blocks`).
        value_cmp: ``(..., Hkv, n, Ev)``.
        block_size: tokens per compressed block.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.

    Returns:
        ``(output, lse)``: ``(..., H, L, Ev)`` in ``query``'s dtype and
        ``(..., H, L)``, the natural-log sum of exponentials. A query with no
        visible block gets output 0 and ``lse = -inf`` (fla's kernel returns
        ``lse = 0`` there; its naive reference ``-inf``).

    Raises:
        TypeError: non-float tensors, different dtypes.
        ValueError: shapes that do not fit, ``Hkv`` not dividing ``H``, a non-positive ``block_size``.

    Examples:
        >>> q, k, v = torch.zeros(1, 4, 2), torch.zeros(1, 2, 2), torch.tensor([[[1.0], [3.0]]])
        >>> out, lse = compressed_attention(q, k, v, block_size=2)
        >>> out[0, :, 0].tolist(), lse[0].exp().tolist()   # query 0 sees nothing, 3 sees both blocks
        ([0.0, 1.0, 1.0, 2.0], [0.0, 1.0, 1.0, 2.0])
    """
    query, key_cmp, value_cmp = _check_heads(query, key_cmp, value_cmp, "key_cmp", "value_cmp")
    block_size = check_positive_int("block_size", block_size)
    return scaled_dot_product_attention(query, key_cmp, value_cmp, mask_mod=_visible(block_size), scale=scale,
                                        enable_gqa=True, return_lse=True)


# --- block selection ----------------------------------------------------------------------------


def select_blocks(
    query: torch.Tensor,
    key_cmp: torch.Tensor,
    *,
    block_size: int,
    block_counts: int | torch.Tensor,
    scale: float | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""The blocks each query's key/value group selects: forced blocks first, then the best by compressed attention.

    fla's ``naive_nsa_topk``. The score of block ``c`` for query ``t`` and group
    ``g`` is the compressed attention's probability, averaged over the group's
    ``H // Hkv`` query heads (heads ``g * G .. g * G + G - 1``, ``G = H // Hkv``):

    $$
    p_{tc} = \frac{1}{G} \sum_{h \in g} \mathrm{softmax}_c\big(\mathrm{scale}\; q_{ht} \cdot \tilde k_c\big),
    $$

    over the visible blocks (``(c + 1) * block_size - 1 <= t``), 0 on a query
    with none. Blocks ``0``, ``t // block_size`` and ``t // block_size - 1``
    are forced: score 1.0, ranked before every other block. Then the first
    ``block_counts`` blocks by score, the visible and forced ones only, equal
    scores by index (the lower first).

    Args:
        query: ``(..., H, L, E)``.
        key_cmp: ``(..., Hkv, n', E)``, the compressed keys, ``n' = L // block_size``
            (`compress_blocks`) or ``ceil(L / block_size)`` (fla's ``mean_pooling``,
            whose partial block is never visible).
        block_size: tokens per block.
        block_counts: blocks per query: an int ``>= 0``, or an integer tensor
            ``(..., Hkv, L)``, one count per group and query (fla's ``[B, T, H]``).
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        return_scores: also return the scores ``(..., Hkv, L, n)``: ``p``, 1.0 on
            the forced blocks, ``-inf`` on the others neither visible nor forced;
            `attention_ref.sparse.assert_topk_close` takes them (with an int ``block_counts``).

    Returns:
        ``block_indices`` ``(..., Hkv, L, k)`` int64, ``k = block_counts`` (the
        largest count for a tensor), best first, ``-1`` in the unused slots; with
        ``return_scores``, ``(block_indices, scores)``. Computed without gradient.

    Raises:
        TypeError: non-float tensors; ``block_counts`` neither an int nor an integer tensor.
        ValueError: shapes that do not fit, a negative count, ``key_cmp`` with another number of blocks.

    Examples:
        >>> q = torch.zeros(1, 7, 2)                   # (H, L, E): uniform scores
        >>> select_blocks(q, torch.zeros(1, 3, 2), block_size=2, block_counts=3)[0].tolist()
        [[0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 2, 3]]
    """
    query, key_cmp = _check_heads(query, key_cmp, None, "key_cmp")
    block_size = check_positive_int("block_size", block_size)
    _inputs.check_bool("return_scores", return_scores)
    H, L = query.shape[-3], query.shape[-2]
    Hkv, N = key_cmp.shape[-3], key_cmp.shape[-2]
    counts = _check_block_counts(block_counts, query, Hkv)
    n = -(-L // block_size)
    if N not in (L // block_size, n):
        raise ValueError(f"key_cmp must have L // block_size = {L // block_size} (or ceil(L / block_size) = {n}) "
                         f"compressed blocks at dim -2 for L = {L}, got {fmt_shape(key_cmp.shape)}")
    with torch.no_grad():
        probs = attention_weights(query, key_cmp, mask_mod=_visible(block_size), scale=scale, enable_gqa=True)
        # (..., H, L, N) -> (..., Hkv, G, L, N) -> (..., Hkv, L, N): the mean over each group's query heads
        scores = probs.unflatten(-3, (Hkv, H // Hkv)).mean(-3)
        scores = F.pad(scores, (0, n - N))  # (..., Hkv, L, n): a partial last block, never visible, scores 0
        t = torch.arange(L, device=query.device).unsqueeze(-1)  # (L, 1)
        c = torch.arange(n, device=query.device)  # (n,)
        own = t // block_size
        forced = (c == 0) | (c == own) | (c == own - 1)  # (L, n)
        visible = (c + 1) * block_size - 1 <= t  # (L, n)
        scores = torch.where(forced, 1.0, scores).masked_fill(~(visible | forced), float("-inf"))
        # forced blocks rank first even against a probability of exactly 1; stable: equal scores by index
        ranked = torch.sort(scores.masked_fill(forced, float("inf")), dim=-1, descending=True, stable=True)
        k = counts if isinstance(counts, int) else int(counts.max()) if counts.numel() else 0
        slots = min(k, n)
        values, chosen = ranked.values[..., :slots], ranked.indices[..., :slots]  # (..., Hkv, L, slots)
        quota = counts if isinstance(counts, int) else counts.unsqueeze(-1)  # int or (..., Hkv, L, 1)
        keep = (values > float("-inf")) & (torch.arange(slots, device=query.device) < quota)
        chosen = torch.where(keep, chosen, NO_KEY)
        chosen = F.pad(chosen, (0, k - slots), value=NO_KEY)  # (..., Hkv, L, k): slots past n unused
    return (chosen, scores) if return_scores else chosen


# --- the selected and sliding-window branches ---------------------------------------------------


def selected_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The selected branch: one softmax over the keys of each query's blocks, causal inside them.

    fla's ``naive_nsa_selection``: the block list of group ``g`` serves its
    query heads (repeated, ``'b t h s -> b t (h g) s'``), keys ``> t`` are masked,
    the own block included. Computed as `attention_ref.sparse.block_topk_attention`
    with ``is_causal=True``. A query with no block (all ``-1``) gets output 0
    (fla's naive reference gives NaN there).

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., Hkv, S, E)``, ``S = L``.
        value: ``(..., Hkv, S, Ev)``.
        block_indices: ``(..., Hkv, L, k)`` integer, blocks in ``[0, n)`` or ``-1``
            (no block), each at most once per row. (The native-sparse-attention
            README pads with ``T`` instead: replace those by ``-1``.)
        block_size: tokens per block.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        return_lse: also return the log-sum-exp ``(..., H, L)``.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype; with ``return_lse``, ``(output, lse)``.

    Raises:
        TypeError: non-float tensors, ``block_indices`` not a signed integer tensor.
        ValueError: shapes that do not fit, ``S != L``, a block outside ``[0, n)``
            other than ``-1`` or listed twice (`attention_ref.sparse.block_topk_indices`).

    Examples:
        >>> q, k, v = torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.arange(4.0).reshape(1, 4, 1)
        >>> blocks = torch.tensor([[[0], [0], [1], [1]]])  # (Hkv, L, k): one block each
        >>> selected_attention(q, k, v, blocks, block_size=2)[0, :, 0].tolist()
        [0.0, 0.5, 2.0, 2.5]
    """
    query, key, value = _check_heads(query, key, value)
    _inputs.check_self_attention(query, key, "NSA")
    block_indices = _check_block_indices(block_indices, query, key)
    per_head = block_indices.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)  # (..., Hkv, L, k) -> (..., H, L, k)
    return block_topk_attention(query, key, value, per_head, block_size, is_causal=True, scale=scale,
                                enable_gqa=True, return_lse=return_lse)


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window_size: int,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The sliding-window branch: keys ``t - window_size + 1 .. t``.

    FlashAttention's ``window_size=(window_size - 1, 0), causal=True``, as fla's
    reference calls it, through `attention_ref.conventions.from_flash_attn_window`.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., Hkv, S, E)``, ``S = L``.
        value: ``(..., Hkv, S, Ev)``.
        window_size: ``w >= 1``, the keys a query sees, itself included.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        return_lse: also return the log-sum-exp ``(..., H, L)``.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype; with ``return_lse``, ``(output, lse)``.

    Raises:
        TypeError: non-float tensors; ``window_size`` not an int.
        ValueError: shapes that do not fit, ``S != L``, ``window_size < 1``.

    Examples:
        >>> q, k, v = torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.arange(4.0).reshape(1, 4, 1)
        >>> window_attention(q, k, v, window_size=2)[0, :, 0].tolist()
        [0.0, 0.5, 1.5, 2.5]
    """
    query, key, value = _check_heads(query, key, value)
    _inputs.check_self_attention(query, key, "NSA")
    window_size = check_positive_int("window_size", window_size)
    L = query.shape[-2]
    mask_mod = conventions.from_flash_attn_window((window_size - 1, 0), L, L, causal=True)
    return scaled_dot_product_attention(query, key, value, mask_mod=mask_mod, scale=scale, enable_gqa=True,
                                        return_lse=return_lse)


# --- the three, gated ---------------------------------------------------------------------------


def nsa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    *,
    block_size: int,
    block_counts: int | torch.Tensor,
    window_size: int,
    scale: float | None = None,
    block_indices: torch.Tensor | None = None,
    compress: Compress | tuple[Compress, Compress] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_block_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Native Sparse Attention: the gated sum of the compressed, selected and sliding-window branches.

    $$
    o = g_{\mathrm{cmp}}\, o_{\mathrm{cmp}} + g_{\mathrm{slc}}\, o_{\mathrm{slc}} + g_{\mathrm{swa}}\, o_{\mathrm{swa}},
    $$

    fla's ``naive_nsa`` with every branch on: `compress_blocks` of the keys and
    values, `compressed_attention`, `select_blocks` (unless ``block_indices`` is
    given), `selected_attention` and `window_attention`, gated per query head and
    token. The conventions: `attention_ref.nsa`.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., Hkv, S, E)``, ``S = L``, ``Hkv`` dividing ``H``.
        value: ``(..., Hkv, S, Ev)``.
        g_cmp: ``(..., H, L)``, the compressed branch's gate (after the sigmoid).
        g_slc: ``(..., H, L)``, the selected branch's gate.
        g_swa: ``(..., H, L)``, the sliding-window branch's gate.
        block_size: tokens per block, for compression and selection (fla: 64).
        block_counts: blocks selected per query (fla: 16), an int or ``(..., Hkv, L)``.
        window_size: the sliding window, ``w >= 1`` keys (fla: 512).
        scale: multiplies the scores of every branch; defaults to ``1 / sqrt(E)``.
        block_indices: ``(..., Hkv, L, k)``, a selection to use instead of
            `select_blocks`' (``-1`` = no block), as fla's ``block_indices=``.
        compress: how a block is pooled (`compress_blocks`): ``None`` (the mean),
            one callable for keys and values, or a pair ``(for_keys, for_values)``.
        cu_seqlens: ``(n + 1,)`` cumulative lengths of sequences packed along dim
            -2 (``L`` the total): each is split into blocks from its own start and
            attends within itself; ``block_counts`` (a tensor), ``block_indices``
            (block numbers within each sequence) and the gates are packed alike.
        return_block_indices: also return the selection used, ``(..., Hkv, L, k)``.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype; with ``return_block_indices``,
        ``(output, block_indices)``.

    Raises:
        TypeError: non-float tensors or gates, different dtypes; ``block_size``,
            ``window_size`` or ``block_counts`` of the wrong type; ``compress``
            not callable.
        ValueError: each argument whose shape or value does not fit (the message
            names it, with the expected and the actual value).

    Examples:
        >>> gen = torch.Generator().manual_seed(0)
        >>> q = torch.randn(1, 4, 9, 3, generator=gen, dtype=torch.float64)   # (B, H, L, E)
        >>> k, v = (torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64) for _ in range(2))
        >>> on, off = torch.ones(1, 4, 9, dtype=torch.float64), torch.zeros(1, 4, 9, dtype=torch.float64)
        >>> out = nsa_attention(q, k, v, off, off, on, block_size=2, block_counts=2, window_size=3)
        >>> torch.allclose(out, window_attention(q, k, v, window_size=3))   # only the window gated on
        True
    """
    query, key, value = _check_heads(query, key, value)
    _inputs.check_self_attention(query, key, "NSA")
    gates = [_check_gate(name, g, query) for name, g in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa))]
    block_size = check_positive_int("block_size", block_size)
    window_size = check_positive_int("window_size", window_size)
    counts = _check_block_counts(block_counts, query, key.shape[-3])
    if block_indices is not None:
        block_indices = _check_block_indices(block_indices, query, key)
    if isinstance(compress, tuple):
        if len(compress) != 2:
            raise ValueError(f"compress must be a callable, a pair (for_keys, for_values) or None, "
                             f"got a tuple of {len(compress)}")
        compress_k, compress_v = compress
    else:
        compress_k = compress_v = compress
    _inputs.check_bool("return_block_indices", return_block_indices)

    def one(q, k, v, gates, counts, chosen):
        k_cmp, v_cmp = compress_blocks(k, block_size, compress_k), compress_blocks(v, block_size, compress_v)
        o_cmp, _ = compressed_attention(q, k_cmp, v_cmp, block_size=block_size, scale=scale)
        if chosen is None:
            chosen = select_blocks(q, k_cmp, block_size=block_size, block_counts=counts, scale=scale)
        o_slc = selected_attention(q, k, v, chosen, block_size=block_size, scale=scale)
        o_swa = window_attention(q, k, v, window_size=window_size, scale=scale)
        g_c, g_s, g_w = (g.unsqueeze(-1) for g in gates)  # (..., H, L) -> (..., H, L, 1), one per query head and token
        return g_c * o_cmp + g_s * o_slc + g_w * o_swa, chosen  # (..., H, L, 1) * (..., H, L, Ev)

    if cu_seqlens is None:
        out, chosen = one(query, key, value, gates, counts, block_indices)
    else:
        cu = check_cu_seqlens("cu_seqlens", cu_seqlens, query.shape[-2], "L (the query's dim -2)").tolist()
        k_slots = counts if isinstance(counts, int) else int(counts.max()) if counts.numel() else 0
        outs, lists = [], []
        for a, b in itertools.pairwise(cu):
            part_counts = counts if isinstance(counts, int) else counts[..., a:b]
            part_chosen = None if block_indices is None else block_indices[..., a:b, :]
            o, c = one(query[..., a:b, :], key[..., a:b, :], value[..., a:b, :], [g[..., a:b] for g in gates],
                       part_counts, part_chosen)
            outs.append(o)
            lists.append(c if block_indices is not None else F.pad(c, (0, k_slots - c.shape[-1]), value=NO_KEY))
        out, chosen = torch.cat(outs, dim=-2), torch.cat(lists, dim=-2)  # the sequences, packed again
    return (out, chosen) if return_block_indices else out
