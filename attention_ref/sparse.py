r"""Top-k sparse attention: each query attends only to the keys listed for it.

DeepSeek V3.2's sparse attention (DSA) scores every key for every query with a
small "lightning indexer" and keeps the ``k`` best (``index_topk``, 2048 in the
released model); the attention itself then runs over those keys only. Given
the list of selected keys, ``indices`` ``(..., L, k)``, this module computes

$$
\mathrm{out}_i = \sum_{j \in K_i} \frac{e^{s_{ij}}}{\sum_{j' \in K_i} e^{s_{ij'}}}\, v_j,
\qquad K_i = \{\,\text{indices}[i, t] : t < k,\ \text{indices}[i, t] \ne -1\,\} \cap M_i ,
$$

where ``s`` are the scaled scores and ``M_i`` the keys the other masks
(``attn_mask``, ``is_causal``) keep. That is exactly dense attention with one
more boolean mask, ``True`` on the selected keys: `topk_mask` builds it and
`topk_attention` hands it to `attention_ref.scaled_dot_product_attention` (the
one functional core), so every backend, ``sinks``, grouped-query heads and the
empty-row rule come from there. A fast kernel gathers the ``k`` keys instead
of masking ``S - k`` of them; the result is the same.

The semantics, one for every function here:

- **a set of keys**: the order of a row of ``indices`` does not matter;
- **-1 means "no key"**: a row may be padded with ``-1`` (fewer than ``k``
  keys valid); a row of ``-1`` only attends to nothing and gives output 0, as
  a fully masked row of the core does;
- **out of range raises**: any other value outside ``[0, S)`` is a
  ``ValueError`` naming ``indices``, the value, where it is and the valid range;
- **duplicates raise**: a key listed twice in one row is a ``ValueError``.
  Implementations disagree on what a duplicate means, so any silent rule
  would agree with some and not others (see the table);
- **causality is not implied**: the selected keys are trusted as given, except
  where another mask removes them. transformers' indexer takes ``topk`` of
  scores where future keys are ``-inf``, so when fewer than ``k`` keys are
  valid (the first ``k - 1`` queries of a prompt) its list contains future
  keys; pass ``is_causal=True`` (top-left aligned: key ``j`` for query ``i``
  when ``j <= i``, as the core) or a mask, e.g.
  ``attention_ref.causal_mask(L, S, alignment="bottom_right")`` when the
  queries are the last ``L`` of ``S`` positions (decoding with a cache).

How other implementations read the same list, from their reference code
(Dao-AILab/flash-attention ``flash_attn/cute/testing.py`` at ``0251105a``,
deepseek-ai/FlashMLA ``tests/ref.py`` at ``9241ae3e``, meta-pytorch/attention-gym
``attn_gym/sparse/selected_attention/impl/reference.py`` at ``7fdb85d0``, and
transformers 5.23 ``models/deepseek_v32/modeling_deepseek_v32.py``):

| implementation | ``-1`` / out of range | a key listed twice | causality |
| --- | --- | --- | --- |
| this module | ``-1`` no key; out of range raises | raises | only when asked |
| FlashAttention 4 ``attention_ref(gather_kv_indices=)`` | ``-1`` or out of range: a dummy column, dropped | counted once (``scatter_`` into a keep-mask) | its ``causal`` and window masks also apply |
| FlashMLA ``ref_sparse_attn_fwd`` / ``decode`` | ``-1``, ``>= s_kv`` or ``>= topk_length[i]``: no key | counted each time (``index_select`` gather, softmax over the ``k`` slots) | asserts ``causal=False``: the caller removes keys |
| attention-gym ``selected_attention`` reference | ``-1`` sentinel | weighted by its count (additive ``log(count)``) | sliding window + selection |
| transformers ``DeepseekV32Attention`` | its ``topk`` never repeats; masked positions can appear | scattered into a mask: once | kept: the causal mask stays |

So a key listed ``c`` times weighs ``e^s`` in FlashAttention 4's reference
and ``c e^s`` in FlashMLA's and attention-gym's (a gather of ``c`` copies and
an additive ``log c`` give the same); flashinfer-bench's DSA evaluator treats
duplicates as invalid. Without duplicates, and with invalid slots set to
``-1``, they all equal this module.

MiniMax-M3 selects *blocks* of keys instead (``block_indices``, ``-1`` padded):
`block_topk_attention` is `topk_attention` over the keys of the listed blocks
(`block_topk_indices`), the same semantics at block granularity.

The selection itself: `lightning_indexer` scores every key with DSA's indexer
(``sum_h w_h relu(scale q_h . k)``, one key head, RoPE half-split on the first
dims, LayerNorm'd key) and keeps the top ``k``, masked slots ``-1``;
`LightningIndexer` computes its inputs from transformers' ``DeepseekV32Indexer``
weights (`LightningIndexer.from_hf`) and equals it. `assert_topk_close` judges
any indexer by the scores it selects, so ties do not fail a correct one.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` queries, ``S``
keys, ``E`` query/key size, ``Ev`` value size, ``k`` keys listed per query.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._validation import (
    check_dense,
    check_positive_int,
    check_scale,
    fmt_shape,
    require_float_tensor,
    require_tensor,
)
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.positional import apply_rope

__all__ = [
    "LightningIndexer",
    "assert_topk_close",
    "block_topk_attention",
    "block_topk_indices",
    "indexer_rope",
    "lightning_indexer",
    "topk_attention",
    "topk_mask",
]

#: The value of ``indices`` that means "no key in this slot".
NO_KEY = -1


def _position(flat: int, shape: tuple[int, ...], name: str = "indices") -> str:
    """``indices[a, b, c]``: where the flat offset ``flat`` of a tensor of ``shape`` lies."""
    place = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        place.append(rest)
    return f"{name}[" + ", ".join(str(i) for i in reversed(place)) + "]"


def _check_indices(indices: object, S: int, name: str = "indices", unit: str = "key") -> torch.Tensor:
    """``indices`` is an integer tensor ``(..., L, k)`` of ``unit`` positions in ``[0, S)`` or -1, none twice in a row."""
    indices = require_tensor(name, indices)
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex() or not indices.is_signed():
        # unsigned: -1 (none) cannot be written, and torch compares uint8 with -1 as 255
        raise TypeError(f"{name} must be a signed integer tensor ({unit} positions, -1 = no {unit}), got {indices.dtype}")
    if indices.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dims (..., L, k), got {indices.dim()} dims with shape "
            f"{fmt_shape(indices.shape)}"
        )
    shape = tuple(indices.shape)
    if indices.is_meta:  # no values to check (shapes only)
        return indices
    bad = (indices < NO_KEY) | (indices >= S)
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0])
        value = int(indices.flatten()[flat])
        raise ValueError(
            f"{name} must hold {unit} positions in [0, {'S' if unit == 'key' else 'n'}) = [0, {S}), or -1 for no "
            f"{unit}; got {value} at {_position(flat, shape, name)}"
        )
    if shape[-1] > 1:
        ordered = indices.sort(dim=-1).values  # (..., L, k): a repeated entry sits next to itself
        repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != NO_KEY)  # (..., L, k - 1)
        if bool(repeated.any()):
            runs = repeated.reshape(-1, shape[-1] - 1)  # (rows, k - 1)
            row = int(runs.any(dim=-1).nonzero()[0])  # the first row with a repeat
            entry = int(ordered.reshape(-1, shape[-1])[row, int(runs[row].nonzero()[0]) + 1])
            where = _position(row, shape[:-1], name)
            raise ValueError(
                f"{name} must list each {unit} at most once per query (the selected {unit}s are a set): "
                f"{unit} {entry} appears more than once in {where} (FlashMLA would count it twice, "
                "FlashAttention 4 once, attention-gym by its count; remove the repeats or replace them by -1)"
            )
    return indices


def topk_mask(indices: torch.Tensor, S: int) -> torch.Tensor:
    """The boolean mask of the keys listed in ``indices``, ``True`` = takes part.

    ``True`` means the pair takes part (the convention of
    ``torch.nn.functional.scaled_dot_product_attention``; ``torch.nn.MultiheadAttention``
    uses the opposite). Row ``i`` is ``True`` exactly at the keys
    ``indices[..., i, :]`` lists; ``-1`` lists nothing. Each ``-1`` is first sent
    to a dummy key column ``S``, which is dropped after the scatter.

    Args:
        indices: ``(..., L, k)`` integer, key positions in ``[0, S)`` or ``-1``
            (no key); each key at most once per row.
        S: the number of keys.

    Returns:
        ``(..., L, S)`` bool, on ``indices``' device.

    Raises:
        TypeError: ``indices`` not an integer tensor; ``S`` not an int.
        ValueError: fewer than 2 dims, a value outside ``[0, S)`` other than
            ``-1`` (the message gives the value, its place and the range), a
            key listed twice in a row, a negative ``S``.

    Examples:
        >>> import torch
        >>> topk_mask(torch.tensor([[2, 0], [1, -1]]), 4).int().tolist()
        [[1, 0, 1, 0], [0, 1, 0, 0]]
    """
    S = check_positive_int("S", S, allow_zero=True)
    indices = _check_indices(indices, S)
    check_dense("topk_mask", (*indices.shape[:-1], S + 1), torch.bool, indices.device, copies=1,
                noun="the (..., L, S) selection mask", instead="it is formed whatever the backend: select for "
                "fewer queries at a time (a slice of the L rows of indices and of the query)")
    slots = torch.where(indices == NO_KEY, S, indices).long()  # (..., L, k): -1 -> the dummy column S
    keep = torch.zeros(*indices.shape[:-1], S + 1, dtype=torch.bool, device=indices.device)  # (..., L, S + 1)
    keep.scatter_(-1, slots, True)
    return keep[..., :S]  # (..., L, S + 1) -> (..., L, S): the dummy column dropped


def _selected_keys(keep: torch.Tensor, batch: tuple[int, ...]) -> _mods.MaskMod:
    """A mask mod that reads ``keep`` ``(..., L, S)``, whose leading dims broadcast to ``batch`` ``(..., H)``.

    The mods index the scores' leading dims as ``b`` (all but the last, flattened)
    and ``h`` (the last): ``keep`` is laid out as ``(Bk, Hk, L, S)`` with ``Bk``
    and ``Hk`` either 1 (shared) or the full size.
    """
    L, S = keep.shape[-2:]
    lead = (1,) * (len(batch) - (keep.dim() - 2)) + tuple(keep.shape[:-2])  # padded to len(batch)
    heads = lead[-1] if lead else 1
    shared_front = all(d == 1 for d in lead[:-1])
    if not shared_front:  # one selection per batch entry: the front dims in full, flattened as b is
        keep = keep.reshape(*lead, L, S).expand(*batch[:-1], heads, L, S)
    front = 1 if shared_front else math.prod(batch[:-1])  # not read off keep: L or S may be 0
    table = keep.reshape(front, heads, L, S)  # (Bk, Hk, L, S)

    def selected_keys_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                               kv_idx: torch.Tensor) -> torch.Tensor:
        # a shared dim is read at 0: b * 0 keeps b's shape, so the result still broadcasts
        return table[b * int(front > 1), h * int(heads > 1), q_idx, kv_idx]

    return selected_keys_mask_mod


def topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "math",
    return_weights: bool = False,
    return_lse: bool = False,
    score_mod: _mods.ScoreMod | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    r"""Attention of each query over the keys ``indices`` lists for it (DeepSeek V3.2's sparse attention).

    Equal to ``scaled_dot_product_attention(query, key, value, attn_mask, ...)``
    with ``topk_mask(indices, S)`` combined (AND) with every other mask: that is
    how it is computed. The selection enters the core as a ``mask_mod`` reading
    that boolean mask, so ``backend="tiled"`` skips every key block that no
    query of a query block selects (`attention_ref.block_mask.BlockMask`).
    The semantics of ``indices`` (a set, ``-1`` = no key, out of range and
    duplicates raise, causality only when asked) and how other implementations
    differ: `attention_ref.sparse`.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        value: ``(..., S, Ev)``.
        indices: ``(..., L, k)`` integer: the keys of each query, in ``[0, S)``,
            or ``-1`` for an empty slot; each key at most once per row. Its
            leading dims broadcast to the output's ``(..., H)`` like a mask's:
            ``(B, 1, L, k)`` is one selection shared by all heads (DSA's).
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., L, S)``. A selected key it removes stays removed.
        is_causal: also keep key ``j`` for query ``i`` only when ``j <= i``
            (top-left aligned, as the core and PyTorch's SDPA). For queries that
            are the last ``L`` of ``S`` positions use
            ``attn_mask=causal_mask(L, S, alignment="bottom_right")`` instead.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: ``H`` query heads, a multiple of
            the ``Hkv`` key/value heads at dim -3; ``indices`` are per query head.
        sinks: ``(H,)`` learned sink logits, one per query head (`attention_ref.sinks`).
        dropout_p: dropout on the weights, as the core.
        backend: ``"math"`` (default), ``"tiled"``, ``"sdpa"`` or ``"auto"``, as
            `attention_ref.scaled_dot_product_attention`.
        return_weights: also return the ``(..., L, S)`` weights (0 off the selection).
        return_lse: also return the log-sum-exp ``(..., L)`` over the selected keys.
        score_mod: as the core, applied to the scaled scores.
        mask_mod: as the core, combined (AND) with the selection.

    Returns:
        As `attention_ref.scaled_dot_product_attention`: ``(..., L, Ev)`` in
        ``query``'s dtype, with the weights and/or ``lse`` when asked. A query
        with no key left (all ``-1``, or every listed key masked) gives output 0.

    Raises:
        TypeError: ``indices`` not an integer tensor; the core's type errors.
        ValueError: a value of ``indices`` outside ``[0, S)`` other than ``-1``,
            a key listed twice in a row, ``indices`` whose ``L`` differs from the
            query's or whose leading dims do not broadcast to the output's,
            ``indices`` on another device; the core's value errors.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)
        >>> indices = torch.tensor([[0, 4], [2, -1], [1, 3]])     # (L, k): shared by both heads
        >>> out = topk_attention(q, k, v, indices)
        >>> dense = scaled_dot_product_attention(q, k, v, topk_mask(indices, 5))
        >>> torch.allclose(out, dense)
        True
    """
    query, key, value, batch = _inputs.check_qk(query, key, value, enable_gqa)
    L, S = query.shape[-2], key.shape[-2]
    keep = topk_mask(indices, S)  # (..., L, S)
    if indices.device != query.device:
        raise ValueError(f"indices must be on the same device as query ({query.device}), got {indices.device}")
    if indices.shape[-2] != L:
        raise ValueError(
            f"indices must have shape (..., L, k) with L = {L} (the query's length), "
            f"got shape {fmt_shape(indices.shape)}"
        )
    try:
        fits = tuple(torch.broadcast_shapes(indices.shape[:-2], batch)) == batch
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"indices' leading dims must broadcast to the output's (..., H) = {fmt_shape(batch)}, got indices "
            f"of shape {fmt_shape(indices.shape)} (one selection shared by the heads: (B, 1, L, k))"
        )
    selected = _selected_keys(keep, batch)
    combined = selected if mask_mod is None else _mods.and_masks(mask_mod, selected)
    return scaled_dot_product_attention(
        query, key, value, attn_mask,
        is_causal=is_causal, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa,
        return_weights=return_weights, backend=backend, score_mod=score_mod, mask_mod=combined,
        return_lse=return_lse, sinks=sinks,
    )


# --- block-sparse top-k (MiniMax-M3) ----------------------------------------------------------------


def block_topk_indices(block_indices: torch.Tensor, block_size: int, S: int) -> torch.Tensor:
    """The keys of the key blocks ``block_indices`` lists: ``indices`` for `topk_attention`.

    Block ``b`` holds keys ``[b * block_size, (b + 1) * block_size)``, the last
    block cut at ``S``; its listed keys past ``S`` and the keys of a ``-1`` slot
    become ``-1`` (no key).

    Args:
        block_indices: ``(..., L, k)`` integer, block positions in
            ``[0, ceil(S / block_size))`` or ``-1`` (no block); each block at
            most once per row.
        block_size: keys per block, a positive int.
        S: the number of keys.

    Returns:
        ``(..., L, k * block_size)`` int64, the keys block by block.

    Raises:
        TypeError: ``block_indices`` not a signed integer tensor; ``block_size``
            or ``S`` not an int.
        ValueError: a block outside ``[0, n)`` other than ``-1`` (the message
            gives it, its place and the range), a block listed twice in a row,
            ``block_size < 1``, ``S < 0``.

    Examples:
        >>> import torch
        >>> block_topk_indices(torch.tensor([[1, -1], [0, 2]]), 2, 5).tolist()
        [[2, 3, -1, -1], [0, 1, 4, -1]]
    """
    block_size = check_positive_int("block_size", block_size)
    S = check_positive_int("S", S, allow_zero=True)
    blocks = _check_indices(block_indices, -(-S // block_size), "block_indices", "block")
    offsets = torch.arange(block_size, device=blocks.device)  # (block_size,)
    keys = blocks.long().unsqueeze(-1) * block_size + offsets  # (..., L, k, block_size)
    keys = keys.masked_fill((blocks.unsqueeze(-1) == NO_KEY) | (keys >= S), NO_KEY)
    return keys.flatten(-2)  # (..., L, k, block_size) -> (..., L, k * block_size)


def block_topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int,
    attn_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    r"""Attention of each query over the key *blocks* ``block_indices`` lists (MiniMax-M3's sparse attention).

    MiniMax-M3's indexer scores blocks of ``block_size`` keys and keeps the best
    ``k`` per query; each query then attends to every key of its blocks that the
    other masks keep. That is `topk_attention` over the keys of those blocks
    (`block_topk_indices`), and is computed so: the same semantics (a set,
    ``-1`` = none, out of range and repeats raise, causality only when asked).

    Args:
        query: ``(..., L, E)``, as `topk_attention`.
        key: ``(..., S, E)`` (``(..., Hkv, S, E)`` with ``enable_gqa``).
        value: ``(..., S, Ev)``.
        block_indices: ``(..., L, k)`` integer, the blocks of each query, in
            ``[0, ceil(S / block_size))`` or ``-1``; its leading dims broadcast
            to the output's ``(..., H)``. (transformers' MiniMax-M3 passes one
            selection per key/value head, ``(B, Hkv, L, k)``: repeat each
            ``H // Hkv`` times along dim 1 first, as its eager mask does.)
        block_size: keys per block.
        attn_mask: as `topk_attention`.
        **kwargs: every keyword of `topk_attention` (``is_causal``, ``scale``,
            ``enable_gqa``, ``sinks``, ``backend``, ...).

    Returns:
        As `topk_attention`.

    Raises:
        TypeError, ValueError: as `block_topk_indices` and `topk_attention`.

    Examples:
        >>> import torch
        >>> q, k, v = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 2)
        >>> blocks = torch.tensor([[0, -1], [2, 0], [1, -1]])  # (L, k) with blocks of 2 keys
        >>> out = block_topk_attention(q, k, v, blocks, 2)
        >>> torch.allclose(out, topk_attention(q, k, v, block_topk_indices(blocks, 2, 6)))
        True
    """
    query, key, value, _ = _inputs.check_qk(query, key, value, kwargs.get("enable_gqa", False))
    S = key.shape[-2]
    return topk_attention(query, key, value, block_topk_indices(block_indices, block_size, S), attn_mask, **kwargs)


# --- the lightning indexer ---------------------------------------------------------------------


def indexer_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r"""The lightning indexer's RoPE: half-split pairs on the **first** ``R`` features of ``x``.

    ``R = 2 * cos.shape[-1]``. Pair ``j`` is ``(x[j], x[j + R/2])`` ("rotate_half",
    as Llama in transformers), rotated by the angle of column ``j``; features
    ``R`` and on pass through. The main MLA attention of the same model does the
    opposite on both counts: interleaved pairs on the **last** ``R`` features
    (`attention_ref.positional.apply_rope`). transformers' rotary tables are
    ``(B, L, R)`` with the two halves equal: pass ``cos[..., :R // 2]``.

    Args:
        x: ``(..., L, E)`` queries or keys, ``E >= R``.
        cos: ``(..., L, R/2)``, broadcastable against ``x``'s leading dims.
        sin: the same shape as ``cos``.

    Returns:
        ``(..., L, E)``, ``x``'s dtype.

    Raises:
        TypeError: non-float tensors.
        ValueError: ``R > E``; ``sin`` of another shape than ``cos``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0, 5.0]], dtype=torch.float64)  # (L, E): pair (x[0], x[1]), then x[2]
        >>> cos, sin = torch.tensor([[0.6]], dtype=torch.float64), torch.tensor([[0.8]], dtype=torch.float64)
        >>> indexer_rope(x, cos, sin).tolist()  # (L, R/2) = (1, 1): one pair, rotated
        [[0.6, 0.8, 5.0]]
    """
    x = require_float_tensor("x", x, 2, "(..., L, E)")
    cos = require_float_tensor("cos", cos, 1, "(..., L, R/2)")
    R = 2 * cos.shape[-1]
    if R > x.shape[-1]:
        raise ValueError(
            f"cos must have last dim R/2 <= E/2 (RoPE on the first R of E features): got cos "
            f"{fmt_shape(cos.shape)} (R = {R}) for x {fmt_shape(x.shape)} (E = {x.shape[-1]})"
        )
    rotated = apply_rope(x[..., :R], cos, sin, interleaved=False)  # (..., L, R): pairs (j, j + R/2)
    return torch.cat([rotated, x[..., R:]], dim=-1)  # (..., L, R) + (..., L, E - R) -> (..., L, E)


def _score_mask(attn_mask: object, is_causal: bool, L: int, S: int, device: torch.device) -> torch.Tensor | None:
    """The mask as a float tensor to add to the scores: 0 or a float mask's value, ``-inf`` where removed."""
    from attention_ref.masks import causal_mask

    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    added = None
    if attn_mask is not None:
        attn_mask = require_tensor("attn_mask", attn_mask)
        if attn_mask.dim() < 2 or tuple(attn_mask.shape[-2:]) not in ((L, S), (1, S), (L, 1), (1, 1)):
            raise ValueError(
                f"attn_mask must broadcast to (..., L, S) = (..., {L}, {S}), got shape {fmt_shape(attn_mask.shape)}"
            )
        if attn_mask.dtype == torch.bool:
            added = torch.zeros(attn_mask.shape, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))
        elif attn_mask.is_floating_point():
            added = attn_mask.float()
        else:
            raise TypeError(f"attn_mask must be bool (True = takes part) or float (added), got {attn_mask.dtype}")
    if is_causal:
        future = torch.zeros(L, S, device=device).masked_fill(~causal_mask(L, S, device=device), float("-inf"))
        added = future if added is None else added + future  # (..., L, S)
    return added


def lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""DeepSeek V3.2's lightning indexer: score every key, keep the ``topk`` best per query.

    The index score of query ``i`` and key ``j``, from ``H`` small heads that share
    one key, is

    $$
    I_{ij} = \sum_h w_{hi}\, \mathrm{ReLU}\big(\mathrm{scale}\; q_{hi} \cdot k_j\big) + m_{ij},
    $$

    with ``m`` the mask (``-inf`` where a pair is removed, a float mask's value
    otherwise), then the ``min(topk, S)`` largest per query, one selection shared by
    every attention head. Computed in at least float32, as transformers' indexer
    (``DeepseekV32Indexer``, which upstream runs in FP8 after a Hadamard rotation,
    orthogonal, so the dot products are the same). The inputs are the indexer's
    after projection: RoPE already applied (`indexer_rope`), the key LayerNorm'd;
    `LightningIndexer` does both from the weights.

    A positive ``scale`` commutes with the ReLU and the weights are the same for
    every key of a query, so ``scale`` (and transformers' extra ``H^{-1/2}`` on the
    weights) changes the scores, never the selection.

    Slots whose key is masked (score ``-inf``) are ``-1``, "no key" for
    `topk_attention`. transformers' ``topk`` fills them with masked positions
    instead (its future keys, arbitrary among the ties, and finite scores when its
    float mask uses ``finfo.min``); with the causal mask kept, both select the same keys.
    Among equal scores ``torch.topk`` picks any: judge an indexer by the scores it
    selects, `assert_topk_close`, not by its indices.

    Args:
        query: ``(..., H, L, E)`` the indexer's queries (``H`` its own heads).
        key: ``(..., S, E)`` its keys, one per token, shared by the heads.
        weights: ``(..., H, L)`` each head's weight for each query.
        topk: ``k``, the keys kept per query; ``min(topk, S)`` are returned.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., L, S)``.
        is_causal: also remove key ``j`` for query ``i`` when ``j > i`` (top-left
            aligned, as `attention_ref.scaled_dot_product_attention`).
        scale: multiplies ``q . k`` inside the ReLU; defaults to ``1 / sqrt(E)``.
        return_scores: also return the scores ``I``.

    Returns:
        ``indices`` ``(..., L, min(topk, S))`` int64, best first, ``-1`` where fewer
        keys are left; pass ``indices.unsqueeze(-3)`` (``(..., 1, L, k)``, shared by
        the heads) to `topk_attention`. With ``return_scores``, also the scores
        ``(..., L, S)`` float32 (float64 for float64 inputs), ``-inf`` where masked.

    Raises:
        TypeError: non-float ``query``, ``key`` or ``weights``; ``topk`` not an int;
            a mask neither bool nor float.
        ValueError: shapes that do not match (the message gives both), a
            non-positive ``topk``, a bad ``scale``.

    Example:
        >>> q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # (H, L, E) = (2, 1, 2)
        >>> k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 2.0]])  # (S, E) = (3, 2)
        >>> w = torch.tensor([[1.0], [0.5]])  # (H, L)
        >>> idx, s = lightning_indexer(q, k, w, 2, scale=1.0, return_scores=True)
        >>> s.tolist(), idx.tolist()  # key 2: relu(-1) * 1 + relu(2) * 0.5 = 1
        ([[1.0, 0.5, 1.0]], [[0, 2]])
    """
    query = require_float_tensor("query", query, 3, "(..., H, L, E)")
    key = require_float_tensor("key", key, 2, "(..., S, E)")
    weights = require_float_tensor("weights", weights, 2, "(..., H, L)")
    H, L, E = query.shape[-3:]
    S = key.shape[-2]
    if key.shape[-1] != E:
        raise ValueError(
            f"key must have shape (..., S, E) with E = {E} (the query's), got query "
            f"{fmt_shape(query.shape)} and key {fmt_shape(key.shape)}"
        )
    if tuple(weights.shape[-2:]) != (H, L):
        raise ValueError(
            f"weights must have shape (..., H, L) = (..., {H}, {L}), one per head and query, "
            f"got {fmt_shape(weights.shape)}"
        )
    topk = check_positive_int("topk", topk)
    check_scale(scale)
    scale = E ** -0.5 if scale is None else float(scale)
    compute = torch.promote_types(query.dtype, torch.float32)  # half precision -> float32
    q, k, w = query.to(compute), key.to(compute), weights.to(compute)
    logits = torch.einsum("...hle,...se->...hls", q, k)  # (..., H, L, E) x (..., S, E) -> (..., H, L, S)
    scores = (w.unsqueeze(-1) * torch.relu(logits * scale)).sum(-3)  # (..., H, L, 1) * (..., H, L, S) -> (..., L, S)
    added = _score_mask(attn_mask, is_causal, L, S, query.device)
    if added is not None:
        scores = scores + added.to(compute)  # (..., L, S)
    best = scores.topk(min(topk, S), dim=-1)  # values, indices: (..., L, k) each, best first
    indices = best.indices.masked_fill(best.values == float("-inf"), NO_KEY)  # (..., L, k): masked -> -1
    return (indices, scores) if return_scores else indices


class LightningIndexer(torch.nn.Module):
    r"""DSA's lightning indexer from its weights, as transformers' ``DeepseekV32Indexer``.

    From the hidden states ``x`` ``(B, L, d)`` and the MLA query latent
    ``c_q = q_a_layernorm(q_a_proj(x))`` ``(B, L, Cq)``:

    $$
    q_h = \mathrm{RoPE}(W^{q}_h c_q), \qquad
    k = \mathrm{RoPE}(\mathrm{LayerNorm}(W^{k} x)), \qquad
    w_h = H^{-1/2}\, W^{w}_h x,
    $$

    RoPE on the first ``R`` features, half-split (`indexer_rope`), then
    `lightning_indexer` with ``scale = 1/sqrt(E)``. The weight projection runs
    in float32 (transformers keeps it there). Sizes: ``d`` model width, ``Cq``
    ``q_lora_rank``, ``H`` ``index_n_heads``, ``E`` ``index_head_dim``, ``R``
    ``qk_rope_head_dim``, ``topk`` ``index_topk``.

    Args:
        hidden_size: ``d``.
        q_lora_rank: ``Cq``.
        num_heads: ``H``.
        head_dim: ``E``.
        rope_dim: ``R``, even, at most ``E``.
        topk: the keys kept per query.
        eps: the key LayerNorm's epsilon.
        device: where to create the parameters.
        dtype: dtype of ``wq_b``, ``wk`` and ``k_norm`` (``weights_proj`` is float32).

    Example:
        >>> indexer = LightningIndexer(16, 8, num_heads=3, head_dim=6, rope_dim=4, topk=2)
        >>> x, c_q = torch.randn(1, 5, 16), torch.randn(1, 5, 8)
        >>> angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.01])  # (L, R/2)
        >>> indexer(x, c_q, (angles.cos(), angles.sin()), is_causal=True)[0, 0].tolist()
        [0, -1]
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, *, num_heads: int, head_dim: int, rope_dim: int,
                 topk: int, eps: float = 1e-6, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("q_lora_rank", q_lora_rank), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("topk", topk)):
            check_positive_int(name, value)
        check_positive_int("rope_dim", rope_dim, allow_zero=True)
        if rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"rope_dim must be even and at most head_dim = {head_dim}, got {rope_dim}")
        self.num_heads, self.head_dim, self.rope_dim, self.topk = num_heads, head_dim, rope_dim, topk
        factory = {"device": device, "dtype": dtype}
        self.wq_b = torch.nn.Linear(q_lora_rank, num_heads * head_dim, bias=False, **factory)
        self.wk = torch.nn.Linear(hidden_size, head_dim, bias=False, **factory)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=eps, **factory)
        self.weights_proj = torch.nn.Linear(hidden_size, num_heads, bias=False, device=device, dtype=torch.float32)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, "
                f"topk={self.topk}")

    @classmethod
    def from_hf(cls, indexer: torch.nn.Module) -> LightningIndexer:
        """Copy a transformers ``DeepseekV32Indexer`` (sizes, epsilon, weights; copied, not shared).

        Raises:
            TypeError: ``indexer`` is not a ``DeepseekV32Indexer``.
        """
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32Indexer,
        )

        if not isinstance(indexer, DeepseekV32Indexer):
            raise TypeError(f"indexer must be a transformers DeepseekV32Indexer, got {type(indexer).__name__}")
        weight = indexer.wq_b.weight
        copy = cls(indexer.hidden_size, indexer.q_lora_rank, num_heads=indexer.n_heads, head_dim=indexer.head_dim,
                   rope_dim=indexer.qk_rope_head_dim, topk=indexer.index_topk, eps=indexer.k_norm.eps,
                   device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for name, param in copy.named_parameters():
                param.copy_(indexer.get_parameter(name))
        return copy

    def project(
        self, hidden_states: torch.Tensor, q_resid: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's ``(query, key, weights)``, ready for `lightning_indexer`.

        Args:
            hidden_states: ``(B, L, d)``.
            q_resid: ``(B, L, Cq)``, the MLA query latent.
            rotary: ``(cos, sin)``, each ``(B, L, R/2)`` or ``(L, R/2)``; transformers'
                rotary embedding gives ``(B, L, R)``, halves equal: pass ``cos[..., :R // 2]``.

        Returns:
            ``query`` ``(B, H, L, E)``, ``key`` ``(B, L, E)``, ``weights`` ``(B, H, L)`` float32.
        """
        hidden_states = require_float_tensor("hidden_states", hidden_states, 3, "(B, L, d)")
        q_resid = require_float_tensor("q_resid", q_resid, 3, "(B, L, Cq)")
        if not isinstance(rotary, tuple) or len(rotary) != 2:
            raise TypeError(f"rotary must be a (cos, sin) tuple, got {type(rotary).__name__}")
        cos, sin = rotary
        cos = require_float_tensor("rotary's cos", cos, 2, "(..., L, R/2)")
        if cos.shape[-1] * 2 != self.rope_dim:
            raise ValueError(
                f"rotary's cos must have last dim R/2 = {self.rope_dim // 2}, got shape {fmt_shape(cos.shape)}"
            )
        B, L, _ = hidden_states.shape
        q = self.wq_b(q_resid).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, L, H*E) -> (B, H, L, E)
        k = self.k_norm(self.wk(hidden_states))  # (B, L, d) -> (B, L, E), LayerNorm'd
        q = indexer_rope(q, cos.unsqueeze(-3), sin.unsqueeze(-3))  # cos (..., 1, L, R/2) for the heads
        k = indexer_rope(k, cos, sin)  # (B, L, E)
        w = self.weights_proj(hidden_states.float()) * self.num_heads ** -0.5  # (B, L, d) -> (B, L, H)
        return q, k, w.transpose(1, 2)  # weights (B, L, H) -> (B, H, L)

    def forward(
        self,
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None = None,
        *,
        is_causal: bool = False,
        return_scores: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The top-``topk`` keys of each of the ``L`` tokens among the same ``L`` (no cache).

        Args:
            hidden_states: as `project`.
            q_resid: as `project`.
            rotary: as `project`.
            attn_mask: as `lightning_indexer` (transformers passes its causal mask ``(B, L, S)``).
            is_causal: as `lightning_indexer`.
            return_scores: as `lightning_indexer`.

        Returns:
            As `lightning_indexer`: ``indices`` ``(B, L, min(topk, L))``, ``-1`` = no key.
        """
        query, key, weights = self.project(hidden_states, q_resid, rotary)
        return lightning_indexer(query, key, weights, self.topk, attn_mask, is_causal=is_causal,
                                 scale=self.head_dim ** -0.5, return_scores=return_scores)


# --- judging an indexer -------------------------------------------------------------------------


def assert_topk_close(
    indices: torch.Tensor,
    scores: torch.Tensor,
    k: int | None = None,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Assert that ``indices`` selects, in every row, the ``k`` largest ``scores``, judged by their values.

    The selected scores of a row, as a multiset, must equal the row's top-``k``
    scores, element by element after sorting, within ``atol + rtol * |expected|``.
    Which of two equal scores a selection takes does not matter, nor does the
    order within a row: ``torch.topk`` breaks ties arbitrarily and kernels differ,
    so comparing indices would fail correct indexers (flashinfer-bench's DSA
    indexer evaluator compares sorted scores the same way). A ``-1`` slot counts
    as the score ``-inf``, as does a listed key whose score is ``-inf`` (masked):
    where fewer than ``k`` keys are left, ``-1`` padding and transformers' padding
    with masked positions both pass.

    Args:
        indices: ``(..., L, k)`` integer: the selection under test, key positions
            in ``[0, S)`` or ``-1``.
        scores: ``(..., L, S)`` float: the reference scores, ``-inf`` where masked.
        k: the keys a row must select; defaults to ``indices.shape[-1]``.
            ``min(k, S)`` slots are expected (as transformers' ``topk``).
        rtol: relative tolerance on each selected score.
        atol: absolute tolerance on each selected score.

    Raises:
        AssertionError: a row whose selection misses a top-``k`` score (the
            message names the row, the missed score and its key, and what was
            taken instead), or ``indices`` that list a key twice in a row or a
            position outside ``[0, S)`` other than ``-1``.
        TypeError: ``indices`` not an integer tensor, ``scores`` not a float tensor.
        ValueError: ``indices`` and ``scores`` whose ``(..., L)`` differ, or
            ``indices`` without ``min(k, S)`` slots.

    Example:
        >>> scores = torch.tensor([[3.0, 2.0, 2.0, 0.0]])  # (L, S): keys 1 and 2 tie
        >>> assert_topk_close(torch.tensor([[0, 1]]), scores)  # either of the tied keys
        >>> assert_topk_close(torch.tensor([[2, 0]]), scores)
        >>> assert_topk_close(torch.tensor([[0, 3]]), scores)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: indices[0] misses a top-2 score: 2 (key 1) is not selected, key 3 with score 0 is ...
    """
    indices = require_tensor("indices", indices)
    scores = require_tensor("scores", scores)
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex() or not indices.is_signed():
        # unsigned: -1 (no key) cannot be written, and torch compares uint8 with -1 as 255
        raise TypeError(f"indices must be a signed integer tensor (key positions, -1 = no key), got {indices.dtype}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got {scores.dtype}")
    if indices.dim() < 2 or scores.dim() != indices.dim() or indices.shape[:-1] != scores.shape[:-1]:
        raise ValueError(
            f"indices (..., L, k) and scores (..., L, S) must share (..., L), got indices "
            f"{fmt_shape(indices.shape)} and scores {fmt_shape(scores.shape)}"
        )
    S = scores.shape[-1]
    k = indices.shape[-1] if k is None else check_positive_int("k", k)
    slots = min(k, S)
    if indices.shape[-1] != slots:
        raise ValueError(
            f"indices must have min(k, S) = min({k}, {S}) = {slots} slots per row, got shape {fmt_shape(indices.shape)}"
        )
    try:
        _check_indices(indices, S)
    except ValueError as error:
        raise AssertionError(str(error)) from None
    reference = scores.detach().double()  # comparisons in float64
    listed = indices.clamp(min=0).long()  # (..., L, k): -1 -> key 0, overwritten next
    picked = reference.gather(-1, listed).masked_fill(indices == NO_KEY, float("-inf"))  # (..., L, k)
    actual, order = picked.sort(dim=-1, descending=True)  # (..., L, k) each
    expected = reference.topk(slots, dim=-1).values  # (..., L, k), sorted, best first
    close = (actual == expected) | ((actual - expected).abs() <= atol + rtol * expected.abs())  # (..., L, k)
    wrong = ~close.all(dim=-1)  # (..., L)
    if not bool(wrong.any()):
        return
    row = int(wrong.flatten().nonzero()[0])
    e_row, a_row = expected.reshape(-1, slots)[row].tolist(), actual.reshape(-1, slots)[row].tolist()
    missed_at, extra_at, i, j = [], [], 0, 0  # match the two sorted lists: what is left over on each side
    while i < slots and j < slots:
        if e_row[i] == a_row[j] or abs(a_row[j] - e_row[i]) <= atol + rtol * abs(e_row[i]):
            i, j = i + 1, j + 1
        elif a_row[j] > e_row[i]:
            extra_at, j = extra_at + [j], j + 1
        else:
            missed_at, i = missed_at + [i], i + 1
    missed_at += list(range(i, slots))
    extra_at += list(range(j, slots))
    first = int((~close.reshape(-1, slots)[row]).nonzero()[0])  # the matching agrees with close; in case not
    missed_at, extra_at = missed_at or [first], extra_at or [first]
    missed, got = e_row[missed_at[0]], a_row[extra_at[-1]]  # the best score missed, the worst taken instead
    row_scores, row_listed = reference.reshape(-1, S)[row], indices.reshape(-1, slots)[row]
    chosen = set(row_listed.tolist())
    key = next((j for j in (row_scores == missed).nonzero().flatten().tolist() if j not in chosen), None)
    taken = int(row_listed[order.reshape(-1, slots)[row, extra_at[-1]]])
    instead = "a -1 slot (no key) is" if taken == NO_KEY else f"key {taken} with score {got:.8g} is"
    where = "indices[" + _position(row, tuple(indices.shape[:-1]))[len("indices["):]

    def listing(values: torch.Tensor) -> str:
        shown = ", ".join(f"{v:.8g}" for v in values[:8].tolist())
        return f"[{shown}{', ...' if len(values) > 8 else ''}]"

    raise AssertionError(
        f"{where} misses a top-{slots} score: {missed:.8g} (key {key}) is not selected, {instead} "
        f"({int(wrong.sum())} of {wrong.numel()} rows differ; top-{slots} scores "
        f"{listing(expected.reshape(-1, slots)[row])}, selected {listing(actual.reshape(-1, slots)[row])})"
    )
