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

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` queries, ``S``
keys, ``E`` query/key size, ``Ev`` value size, ``k`` keys listed per query.
"""

from __future__ import annotations

import torch

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._validation import check_positive_int, fmt_shape, require_tensor
from attention_ref.functional import scaled_dot_product_attention

__all__ = ["topk_attention", "topk_mask"]

#: The value of ``indices`` that means "no key in this slot".
NO_KEY = -1


def _position(flat: int, shape: tuple[int, ...]) -> str:
    """``indices[a, b, c]``: where the flat offset ``flat`` of a tensor of ``shape`` lies."""
    place = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        place.append(rest)
    return "indices[" + ", ".join(str(i) for i in reversed(place)) + "]"


def _check_indices(indices: object, S: int) -> torch.Tensor:
    """``indices`` is an integer tensor ``(..., L, k)`` of keys in ``[0, S)`` or -1, no key twice in a row."""
    indices = require_tensor("indices", indices)
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"indices must be an integer tensor (key positions, -1 = no key), got {indices.dtype}")
    if indices.dim() < 2:
        raise ValueError(
            f"indices must have at least 2 dims (..., L, k), got {indices.dim()} dims with shape "
            f"{fmt_shape(indices.shape)}"
        )
    shape = tuple(indices.shape)
    bad = (indices < NO_KEY) | (indices >= S)
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0])
        value = int(indices.flatten()[flat])
        raise ValueError(
            f"indices must hold key positions in [0, S) = [0, {S}), or -1 for no key; "
            f"got {value} at {_position(flat, shape)}"
        )
    if shape[-1] > 1:
        ordered = indices.sort(dim=-1).values  # (..., L, k): a repeated key sits next to itself
        repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != NO_KEY)  # (..., L, k - 1)
        if bool(repeated.any()):
            runs = repeated.reshape(-1, shape[-1] - 1)  # (rows, k - 1)
            row = int(runs.any(dim=-1).nonzero()[0])  # the first row with a repeat
            key = int(ordered.reshape(-1, shape[-1])[row, int(runs[row].nonzero()[0]) + 1])
            where = _position(row, shape[:-1])
            raise ValueError(
                f"indices must list each key at most once per query (the selected keys are a set): "
                f"key {key} appears more than once in {where} (FlashMLA would count it twice, "
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
    front = 1 if shared_front else keep[..., 0, 0].numel() // heads
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
    query of a query block selects (`attention_ref.tiled.BlockMask`).
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
