r"""Packed variable-length batches: attention over sequences laid end to end, without padding.

A batch of ``n`` sequences of lengths ``L_0, ..., L_{n-1}`` is stored as one
packed tensor of ``total = L_0 + ... + L_{n-1}`` tokens, and the sequence
boundaries as *cumulative lengths*, the layout of FlashAttention's
``flash_attn_varlen_func``:

$$
\text{cu\_seqlens} = (0,\; L_0,\; L_0 + L_1,\; \dots,\; \text{total}),
$$

so that sequence ``s`` holds the packed rows ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1``.
Queries and keys have their own cumulative lengths (``cu_seqlens_q``,
``cu_seqlens_k``): with a cache, or in cross-attention, sequence ``s`` has
``Lq_s`` queries and ``Lk_s`` keys.

`varlen_attention` is one call of the functional core
(`attention_ref.functional.scaled_dot_product_attention`) over the packed
tensors, with a mask mod that keeps the pairs of the same sequence (a
block-diagonal mask, `attention_ref.mods.document`) and, when causal, the
bottom-right causal rule of each sequence (`varlen_mask_mod`, which can be
drawn or passed to FlexAttention). `pack` and `unpack` convert between a
right-padded batch and the packed layout; `cu_seqlens_from_lengths` gives the
boundaries.

Shapes use the package legend: ``B`` batch, ``H`` query heads, ``Hkv``
key/value heads, ``E`` query/key size, ``Ev`` value size. Heads come first, as
everywhere in this package: ``query`` is ``(H, total_q, E)``, where FlashAttention
takes ``(total_q, H, E)`` (one ``transpose(0, 1)`` converts).

Examples:
    >>> import torch
    >>> from attention_ref.varlen import cu_seqlens_from_lengths, varlen_attention
    >>> cu = cu_seqlens_from_lengths([3, 5])
    >>> cu.tolist()
    [0, 3, 8]
    >>> q, k, v = torch.randn(4, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    >>> varlen_attention(q, k, v, cu, cu, is_causal=True).shape
    torch.Size([4, 8, 16])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attention_ref import mods
from attention_ref._inputs import check_bool
from attention_ref._validation import (
    check_cu_seqlens,
    fmt_shape,
    require_float_tensor,
    require_int_tensor,
    require_same_dtype_and_device,
    require_tensor,
    short_list,
)
from attention_ref.block_mask import BlockMask, recorded_on
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.sinks import check_sinks

__all__ = ["cu_seqlens_from_lengths", "pack", "unpack", "varlen_attention", "varlen_mask_mod"]


# --- argument checks ---------------------------------------------------------------------------


def _check_lengths(name: str, lengths: object, like: torch.Tensor | None = None) -> torch.Tensor:
    """``(B,)`` non-negative integer lengths, as int64; on ``like``'s device when given
    (a list is made there, a tensor elsewhere is refused)."""
    device = None if like is None else like.device
    tensor = require_int_tensor(name, lengths, "(B,)", device=device, device_of="x", lists=True)
    if tensor.numel() and int(tensor.min()) < 0:
        raise ValueError(f"{name} must be non-negative, got {short_list(tensor.tolist())}")
    return tensor.long()


def _check_packed(name: str, value: object, layout: str) -> torch.Tensor:
    tensor = require_float_tensor(name, value, 3, layout)
    if tensor.dim() != 3:
        raise ValueError(
            f"{name} must have 3 dims {layout} (packed, heads first), got {tensor.dim()} dims "
            f"with shape {fmt_shape(tensor.shape)}"
        )
    return tensor


def _check_same_count(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences: cu_seqlens_q has "
            f"{cu_q.numel() - 1} (shape {fmt_shape(cu_q.shape)}), cu_seqlens_k has {cu_k.numel() - 1} "
            f"(shape {fmt_shape(cu_k.shape)})"
        )


# --- the boundaries ----------------------------------------------------------------------------


def cu_seqlens_from_lengths(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Cumulative sequence lengths ``(0, L_0, L_0 + L_1, ..., total)``: the sequence boundaries.

    Sequence ``s`` occupies the packed rows ``cu[s] .. cu[s + 1] - 1``. The dtype
    is int32, as FlashAttention's ``flash_attn_varlen_func`` requires.

    Args:
        lengths: ``(B,)`` non-negative integer tensor, or a list of ints.

    Returns:
        ``(B + 1,)`` int32 on the device of ``lengths``.

    Raises:
        TypeError: not an integer tensor or list of ints.
        ValueError: not 1-D, or a negative length.

    Examples:
        >>> cu_seqlens_from_lengths([3, 0, 2]).tolist()
        [0, 3, 3, 5]
    """
    lengths = _check_lengths("lengths", lengths)
    zero = torch.zeros(1, dtype=torch.long, device=lengths.device)
    return torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)  # (B,) -> (B + 1,)


def _positions(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """Flat indices ``b * max_length + t`` of the real tokens of a right-padded batch, in packed order."""
    real = torch.arange(max_length, device=lengths.device) < lengths[:, None]  # (B, max_length)
    return real.flatten().nonzero().flatten()  # (total,), row-major: sequence by sequence


# --- padded <-> packed ---------------------------------------------------------------------------


def pack(x: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch to packed: drop the padding, lay the sequences end to end.

    The batch is dim 0 and the sequence dim -2, the layout of the package's
    attention inputs ``(B, H, L, E)`` (or ``(B, L, d)`` for token embeddings).
    Sequence ``b`` is ``x[b, ..., :lengths[b], :]``; everything after it is padding
    and is dropped. `unpack` is the inverse. Differentiable.

    Args:
        x: ``(B, ..., Lmax, F)`` right-padded batch, e.g. ``(B, H, Lmax, E)``.
        lengths: ``(B,)`` integer tensor or list of ints, ``0 <= lengths[b] <= Lmax``.

    Returns:
        ``(packed, cu_seqlens)``: ``packed`` is ``(..., total, F)`` with
        ``total = sum(lengths)`` (for ``(B, H, Lmax, E)``: ``(H, total, E)``, the
        input of `varlen_attention`), ``cu_seqlens`` is `cu_seqlens_from_lengths`
        ``(lengths)``, ``(B + 1,)`` int32.

    Raises:
        TypeError: ``x`` not a tensor, ``lengths`` not integers.
        ValueError: ``x`` with fewer than 3 dims, ``lengths`` not ``(B,)``, on
            another device, negative or longer than ``Lmax`` (nothing is truncated).

    Examples:
        >>> x = torch.arange(8.0).reshape(2, 4, 1)      # (B, Lmax, F) = (2, 4, 1)
        >>> packed, cu = pack(x, [1, 3])
        >>> packed.flatten().tolist(), cu.tolist()
        ([0.0, 4.0, 5.0, 6.0], [0, 1, 4])
    """
    x = require_tensor("x", x)
    if x.dim() < 3:
        raise ValueError(
            f"x must have at least 3 dims (B, ..., Lmax, F), got {x.dim()} dims with shape {fmt_shape(x.shape)} "
            f"(for token ids of shape (B, Lmax), pass ids[..., None])"
        )
    lengths = _check_lengths("lengths", lengths, like=x)
    B, max_length = x.shape[0], x.shape[-2]
    if lengths.shape[0] != B:
        raise ValueError(
            f"lengths must have shape (B,) = ({B},) for x of shape {fmt_shape(x.shape)}, "
            f"got {fmt_shape(lengths.shape)}"
        )
    if B and int(lengths.max()) > max_length:
        raise ValueError(
            f"lengths must be <= the padded length Lmax = {max_length} (x.shape[-2]), "
            f"got {short_list(lengths.tolist())}"
        )
    # (B, ..., Lmax, F) -> (..., B, Lmax, F) -> (..., B * Lmax, F): each sequence's rows side by side
    rows = x.movedim(0, -3).flatten(-3, -2)
    packed = rows.index_select(-2, _positions(lengths, max_length))  # (..., total, F)
    return packed, cu_seqlens_from_lengths(lengths)


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int | None = None) -> torch.Tensor:
    """Packed to right-padded batch, the inverse of `pack`; the padding is zeros.

    Args:
        packed: ``(..., total, F)``, e.g. the ``(H, total_q, Ev)`` output of
            `varlen_attention`.
        cu_seqlens: ``(B + 1,)`` cumulative lengths of ``packed`` (from 0 to ``total``).
        max_length: ``Lmax``, the padded length; defaults to the longest
            sequence. It must hold every sequence (nothing is truncated).

    Returns:
        ``(B, ..., Lmax, F)``: sequence ``b`` in ``[b, ..., :L_b, :]``, zeros after it.
        Differentiable.

    Raises:
        TypeError: ``packed`` not a tensor, ``cu_seqlens`` not integers,
            ``max_length`` not an int.
        ValueError: ``packed`` with fewer than 2 dims, ``cu_seqlens`` not from 0 to
            ``total`` non-decreasing, ``max_length`` shorter than a sequence.

    Examples:
        >>> packed = torch.tensor([[1.0], [2.0], [3.0]])    # (total, F) = (3, 1)
        >>> unpack(packed, torch.tensor([0, 1, 3]))[..., 0].tolist()
        [[1.0, 0.0], [2.0, 3.0]]
    """
    packed = require_tensor("packed", packed)
    if packed.dim() < 2:
        raise ValueError(f"packed must have at least 2 dims (..., total, F), got shape {fmt_shape(packed.shape)}")
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, packed.shape[-2], "packed.shape[-2]", packed.device)
    lengths = cu[1:] - cu[:-1]  # (B + 1,) -> (B,)
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_length is None:
        max_length = longest
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int or None, got {type(max_length).__name__}")
    if max_length < longest:
        raise ValueError(
            f"max_length must hold the longest sequence ({longest} tokens), got max_length={max_length}"
        )
    B = lengths.shape[0]
    lead, features = packed.shape[:-2], packed.shape[-1]
    rows = packed.new_zeros(*lead, B * max_length, features)  # (..., B * Lmax, F), padding = 0
    rows = rows.index_copy(-2, _positions(lengths, max_length), packed)  # real tokens in place
    # (..., B * Lmax, F) -> (..., B, Lmax, F) -> (B, ..., Lmax, F)
    return rows.unflatten(-2, (B, max_length)).movedim(-3, 0)


# --- attention ---------------------------------------------------------------------------------


def _mask_mod(cu_q: torch.Tensor, cu_k: torch.Tensor, is_causal: bool) -> mods.MaskMod:
    """The mask mod of `varlen_mask_mod`, from checked int64 cumulative lengths."""
    sequences = torch.arange(cu_q.numel() - 1, device=cu_q.device)
    q_seq = sequences.repeat_interleave(cu_q[1:] - cu_q[:-1])  # (total_q,) sequence of each packed query
    k_seq = sequences.repeat_interleave(cu_k[1:] - cu_k[:-1]).to(cu_q.device)  # (total_k,) of each packed key
    same_sequence = mods.document(q_seq, k_seq)  # the block-diagonal mask
    if not is_causal:
        same_sequence._attention_ref_varlen = (cu_q, cu_k, is_causal)  # type: ignore[attr-defined]
        return same_sequence
    # (total_q,): Lk_s - Lq_s as seen from packed coordinates, for the sequence s of each query
    shift = (cu_k[1:].to(cu_q.device) - cu_q[1:])[q_seq]

    def varlen_causal_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx <= q_idx + shift[q_idx]  # j <= i + Lk_s - Lq_s inside sequence s

    mask_mod = mods.and_masks(same_sequence, varlen_causal_mask_mod)
    # what it was made from, for varlen_attention's block_mask= check
    mask_mod._attention_ref_varlen = (cu_q, cu_k, is_causal)  # type: ignore[attr-defined]
    return mask_mod


def _block_mask_for(block_mask: object, cu_q: torch.Tensor, cu_k: torch.Tensor, is_causal: bool) -> mods.MaskMod:
    """The mod of a ``block_mask`` made from ``varlen_mask_mod`` with this call's lengths and ``is_causal``."""
    mask_mod, made = recorded_on(block_mask, "_attention_ref_varlen",
                                  "varlen_mask_mod(cu_seqlens_q, cu_seqlens_k, is_causal=...)")
    for name, want, got in (("cu_seqlens_q", cu_q, made[0]), ("cu_seqlens_k", cu_k, made[1])):
        if not torch.equal(got.to(want.device), want):
            raise ValueError(
                f"block_mask was made for {name}={got.tolist()}, this call has {name}={want.tolist()}"
            )
    if made[2] != is_causal:
        raise ValueError(f"block_mask was made for is_causal={made[2]}, this call has is_causal={is_causal}")
    return mask_mod


def varlen_mask_mod(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, is_causal: bool = False
) -> mods.MaskMod:
    r"""The mask of `varlen_attention` over the packed tokens, as a mask mod.

    Packed key ``k`` takes part for packed query ``q`` when both belong to the
    same sequence ``s`` and, with ``is_causal``, ``k <= q + cu_k[s + 1] - cu_q[s + 1]``:
    in the sequence's own positions (``i = q - cu_q[s]``, ``j = k - cu_k[s]``)
    that is ``j <= i + Lk_s - Lq_s``, the causal rule aligned bottom-right (the
    last query sees the last key). Without causal it is block-diagonal, one
    ``Lq_s x Lk_s`` block per sequence: `attention_ref.mods.document` with the
    query and key sequence ids.

    The mod has FlexAttention's signature, so it can be drawn with
    `attention_ref.mods.create_mask`, passed to
    `attention_ref.scaled_dot_product_attention` (``mask_mod=``), or to
    ``torch.nn.attention.flex_attention.create_block_mask``.

    Args:
        cu_seqlens_q: ``(n + 1,)`` cumulative query lengths (start at 0, non-decreasing).
        cu_seqlens_k: ``(n + 1,)`` cumulative key lengths.
        is_causal: add the per-sequence bottom-right causal rule.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)`` for scores ``(..., total_q, total_k)``
        (``True`` = the pair takes part); it checks these sizes when used.

    Raises:
        TypeError: non-integer ``cu_seqlens``, ``is_causal`` not a bool.
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, decreasing, or
            the two with different numbers of sequences.

    Examples:
        >>> cu = torch.tensor([0, 2, 3])
        >>> mods.create_mask(varlen_mask_mod(cu, cu), None, None, 3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
        >>> cu_k = torch.tensor([0, 3, 4])    # 3 keys for the first 2 queries: bottom-right
        >>> mods.create_mask(varlen_mask_mod(cu, cu_k, is_causal=True), None, None, 3, 4)[0, 0].int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    """
    check_bool("is_causal", is_causal)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    _check_same_count(cu_q, cu_k)
    return _mask_mod(cu_q, cu_k, is_causal)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str = "math",
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_mask: BlockMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention over packed sequences: each sequence attends to its own keys only.

    Equivalent to running every sequence alone, for ``s`` in ``range(n)``:

    ```python
    q_s = query[:, cu_seqlens_q[s]:cu_seqlens_q[s + 1]]       # (H, Lq_s, E)
    k_s = key[:, cu_seqlens_k[s]:cu_seqlens_k[s + 1]]         # (Hkv, Lk_s, E)
    v_s = value[:, cu_seqlens_k[s]:cu_seqlens_k[s + 1]]       # (Hkv, Lk_s, Ev)
    causal = mods.causal(offset=Lk_s - Lq_s) if is_causal else None
    out_s = scaled_dot_product_attention(q_s, k_s, v_s, scale=scale, sinks=sinks,
                                         enable_gqa=True, mask_mod=causal)
    ```

    and concatenating the ``out_s`` along dim 1 (and their ``lse`` with
    ``return_lse``), the semantics of FlashAttention's
    ``flash_attn_varlen_func`` (with heads first). It is computed as *one* call
    of the core over the packed tensors, with the mask mod of `varlen_mask_mod`:
    packed key ``k`` takes part for packed query ``q`` of sequence ``s`` when

    $$
    \mathrm{seq}(k) = s \;\wedge\; k \le q + \text{cu}_k[s + 1] - \text{cu}_q[s + 1],
    $$

    the second condition only when causal: a block-diagonal mask
    (`attention_ref.mods.document` with the query and key sequence ids) and,
    when causal, a bottom-right triangle in each block. On the default
    ``backend="math"`` that materialises the ``(H, total_q, total_k)`` scores,
    memory ``O(H * total_q * total_k)``, most of it masked. ``backend="tiled"``
    computes only the score blocks that touch a sequence's own block (the others
    are skipped, forward and backward) and never holds more than one block of
    scores: close to the ``sum_s Lq_s * Lk_s`` pairs a varlen kernel computes.
    ``backend="auto"`` picks it when the mask empties enough blocks
    (`attention_ref.backends.auto_rule`).

    Args:
        query: ``(H, total_q, E)``, the queries of the ``n`` sequences end to end.
        key: ``(Hkv, total_k, E)``; ``H`` must be a multiple of ``Hkv``: query
            head ``h`` uses key/value head ``h // (H // Hkv)`` (grouped-query
            attention; ``Hkv = H`` is ordinary multi-head attention).
        value: ``(Hkv, total_k, Ev)``.
        cu_seqlens_q: ``(n + 1,)`` integer tensor on ``query``'s device, the
            cumulative query lengths: starts at 0, non-decreasing, ends at
            ``total_q`` (see `cu_seqlens_from_lengths`).
        cu_seqlens_k: ``(n + 1,)``, the same for the keys, ending at ``total_k``.
        is_causal: causal inside each sequence, aligned bottom-right: query
            ``i`` of sequence ``s`` sees its keys ``j <= i + Lk_s - Lq_s``
            (FlashAttention's varlen rule; top-left when ``Lq_s == Lk_s``).
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        backend: the core's backend (``"math"``, ``"tiled"``, ``"sdpa"`` with the
            mask materialised, ``"auto"``); see
            `attention_ref.functional.scaled_dot_product_attention`.
        sinks: ``(H,)``, one learned logit per query head, the same for every
            sequence: ``exp(sinks[h])`` joins the softmax denominator of every
            query row, never scaled (`attention_ref.sinks`); or one per packed
            query, broadcastable to ``(H, total_q)``. ``"math"``,
            ``"tiled"`` and ``"auto"`` take it; ``"sdpa"`` and ``"triton"`` raise.
        return_lse: also return ``lse`` ``(H, total_q)``, the natural log of
            each query row's softmax denominator over its own sequence's keys
            (sink included), in the compute dtype (``"math"``, ``"tiled"``,
            ``"auto"`` only).
        block_mask: the packed mask's `attention_ref.block_mask.BlockMask`, made
            once with ``create_block_mask(varlen_mask_mod(cu_seqlens_q,
            cu_seqlens_k, is_causal=is_causal), None, None, total_q, total_k)``
            and reused by every layer over the same packing: ``"tiled"`` uses
            its blocks as they are, instead of classifying them on each call;
            the other backends materialise its mod. It must come from
            `varlen_mask_mod` with equal ``cu_seqlens`` and the same
            ``is_causal`` (checked: ``ValueError`` otherwise).

    Returns:
        ``(H, total_q, Ev)`` in ``query``'s dtype, or ``(output, lse)`` with
        ``return_lse``. A query with no key (a sequence with 0 keys, or with
        causal and ``Lq_s > Lk_s`` the first ``Lq_s - Lk_s`` queries) gives a
        row of zeros, not NaN, and ``lse = -inf``, or ``lse = sinks[h]`` with
        sinks. Differentiable in ``query``, ``key``, ``value`` and ``sinks``.

    Raises:
        TypeError: non-float or different dtypes of ``query``, ``key``,
            ``value``; non-integer ``cu_seqlens``; ``is_causal`` or
            ``return_lse`` not a bool; ``sinks`` not a float tensor.
        ValueError: a tensor not 3-D, ``E`` or ``total_k`` that do not match,
            ``key`` and ``value`` with different heads, ``H`` not a multiple of
            ``Hkv``; ``cu_seqlens`` not 1-D, not starting at 0, decreasing, not
            ending at ``total_q`` / ``total_k``, on another device, or the two
            with different numbers of sequences; a bad ``scale``; ``sinks`` not
            of shape ``(H,)``, on another device, NaN or ``+inf``; an unknown
            ``backend``, or one that cannot run the call (the message names it).

    Examples:
        >>> q = torch.randn(2, 5, 8)                        # (H, total_q, E): sequences of 2 and 3
        >>> k, v = torch.randn(1, 5, 8), torch.randn(1, 5, 4)   # (Hkv, total_k, E|Ev), Hkv = 1
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> out = varlen_attention(q, k, v, cu, cu)
        >>> alone = scaled_dot_product_attention(q[:, 2:], k[:, 2:], v[:, 2:], enable_gqa=True)
        >>> out.shape, torch.allclose(out[:, 2:], alone, atol=1e-6)
        (torch.Size([2, 5, 4]), True)
    """
    query = _check_packed("query", query, "(H, total_q, E)")
    key = _check_packed("key", key, "(Hkv, total_k, E)")
    value = _check_packed("value", value, "(Hkv, total_k, Ev)")
    require_same_dtype_and_device(query=query, key=key, value=value)
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    H, total_q, E = query.shape
    Hkv, total_k = key.shape[0], key.shape[1]
    if key.shape[2] != E:
        raise ValueError(
            f"query and key must have the same E (dim 2): query {fmt_shape(query.shape)}, "
            f"key {fmt_shape(key.shape)}"
        )
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"value must have the heads and length (Hkv, total_k) = {fmt_shape(key.shape[:2])} of key, "
            f"got value of shape {fmt_shape(value.shape)}"
        )
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"the query heads H = {H} (query dim 0) must be a multiple of the key/value heads "
            f"Hkv = {Hkv} (key dim 0)"
        )
    if sinks is not None:
        check_sinks(sinks, H, query, rows=(H, total_q))  # per query head (dim 0), shared by every sequence, or per query
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q (query.shape[1])", query.device)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k (key.shape[1])", query.device)
    _check_same_count(cu_q, cu_k)
    keep = _mask_mod(cu_q, cu_k, is_causal) if block_mask is None else _block_mask_for(block_mask, cu_q, cu_k, is_causal)
    # (H, total_q, E) x (Hkv, total_k, E) -> scores (H, total_q, total_k), masked -> (H, total_q, Ev);
    # a row's sink joins its denominator once, whatever its sequence, as when each runs alone.
    return scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True, mask_mod=keep,
                                        backend=backend, sinks=sinks, return_lse=return_lse, block_mask=block_mask)
