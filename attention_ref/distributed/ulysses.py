"""DeepSpeed-Ulysses (an all-to-all from sequence slices to head slices) and USP (Ulysses inside
groups, the ring across them): `ulysses_attention`, `usp_attention`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._inputs import batch_shape
from attention_ref._validation import fmt_shape
from attention_ref.block_mask import band_of, mod_sizes
from attention_ref.distributed.counting import record
from attention_ref.distributed.layouts import check_layout, documents_of, group_info
from attention_ref.distributed.ring import ring_attention
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.sinks import check_sinks, heads_of


def _exchange(x: torch.Tensor, scatter: int, gather: int, group: dist.ProcessGroup | None, world: int,
              counter: str) -> torch.Tensor:
    """Cut ``x`` in ``world`` equal parts along dim ``scatter``, send part ``j`` to group rank ``j``, and
    join the parts received, in rank order, along dim ``gather``. Counted in `CommStats` as ``counter``."""
    parts = x.chunk(world, dim=scatter)
    send = torch.stack(parts).contiguous()  # (world, *part): part j at index j, as all_to_all_single splits
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[i]: what rank i sent this rank
    record(**{counter: 1, f"{counter}_bytes": (world - 1) * parts[0].numel() * x.element_size()})
    return torch.cat(received.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    """`_exchange` with its backward: the same exchange the other way round (it is a permutation of
    the elements across ranks, so its adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x, scatter, gather, group, world):  # type: ignore[override]
        ctx.options = (scatter, gather, group, world)
        return _exchange(x, scatter, gather, group, world, "forward_all_to_all")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        scatter, gather, group, world = ctx.options
        return _exchange(grad, gather, scatter, group, world, "backward_all_to_all"), None, None, None, None


def _head_slices(caller: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 sinks: torch.Tensor | None, enable_gqa: bool, rank: int, world: int, size_name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What Ulysses' exchange needs, checked (one local length; ``H`` a multiple of ``world``; ``Hkv`` a
    multiple or a divisor of it; per-head sinks): the key and value with each head repeated once per rank
    where there are fewer of them than ranks, and this rank's heads' sinks."""
    n = query.shape[-2]
    if key.shape[-2] != n:
        raise ValueError(
            f"{caller} needs query and key slices of one sequence, the same local length (dim -2): "
            f"query {fmt_shape(query.shape)} has {n}, key {fmt_shape(key.shape)} has {key.shape[-2]}")
    H, Hkv = query.shape[-3], key.shape[-3]
    if H % world:
        raise ValueError(f"{caller} cuts the query heads across the ranks: H={H} query heads must be "
                         f"a multiple of {size_name} W={world} (each rank takes H / W of them)")
    if Hkv % world and world % Hkv:
        raise ValueError(f"{caller} needs the key/value heads Hkv={Hkv} to be a multiple of {size_name} "
                         f"W={world} (cut like the query heads) or a divisor of it (each repeated W / Hkv times)")
    if Hkv % world:  # fewer key/value heads than ranks: one copy per rank, (..., Hkv, n, E) -> (..., W, n, E)
        key, value = (t.repeat_interleave(world // Hkv, dim=-3) for t in (key, value))
    if sinks is not None:
        batch = batch_shape(query, key, value, enable_gqa)
        check_sinks(sinks, heads_of(batch), query, rows=(*batch, n))
        if sinks.dim() != 1:
            raise NotImplementedError(
                f"{caller} takes one sink per head, (H,)=({H},); sinks of shape {fmt_shape(sinks.shape)} "
                "give one per query, which ring_attention shards with the queries")
        sinks = sinks[rank * H // world:(rank + 1) * H // world]  # this rank's query heads after the exchange
    return key, value, sinks


def _own_heads(keep: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A mask broadcastable to ``(..., H, L, S)``, cut to rank ``rank``'s ``H / world`` heads when it has them."""
    if keep.dim() < 3 or keep.shape[-3] == 1:
        return keep  # the same for every head
    per = keep.shape[-3] // world
    return keep[..., rank * per:(rank + 1) * per, :, :]


def _shifted_heads(mask_mod: _mods.MaskMod, first: int) -> _mods.MaskMod:
    """``mask_mod`` as seen by a rank holding the query heads ``first, first + 1, ...``: its ``h`` is
    the global head. A band (`attention_ref.mods.causal`, ``sliding_window``) reads no head: as it is."""
    if first == 0 or band_of(mask_mod) is not None:
        return mask_mod

    def global_heads_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
                              ) -> torch.Tensor:
        return mask_mod(b, h + first, q_idx, kv_idx)

    return global_heads_mask_mod


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: dist.ProcessGroup | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor:
    r"""DeepSpeed-Ulysses: trade the sequence slices for head slices, attend, trade back.

    Each rank holds a contiguous slice of the sequence with every head (`shard` with
    ``layout="contiguous"``). One all-to-all per tensor gives each rank ``H / W`` of the
    heads over the *whole* sequence; there the attention is the ordinary one
    (`attention_ref.functional.scaled_dot_product_attention`, any mask that needs the
    whole row: causal here), and one more all-to-all brings the output back to the
    sequence slices. The backward pass is the same four exchanges the other way round.
    Equal (up to rounding) to the attention of the unsharded tensors, sharded back:

        shard(scaled_dot_product_attention(Q, K, V, ...), layout="contiguous")
            == ulysses_attention(shard(Q, layout="contiguous"), ...)

    Each rank sends ``(W - 1) / W`` of its ``q``, ``k``, ``v`` and output slices, however
    many ranks there are: the traffic per rank stays flat as ``W`` grows, where the ring's
    grows with it; but ``W`` cannot exceed the heads (`CommStats`, `attention_ref.complexity`).

    Grouped key/value heads: with ``Hkv`` a multiple of ``W``, the key/value heads are cut
    like the query heads (rank ``r``'s query heads read only rank ``r``'s key/value heads);
    with fewer key/value heads than ranks (``W`` a multiple of ``Hkv``) each is repeated
    ``W / Hkv`` times before the exchange, so that every rank receives the one its query
    heads read, as DeepSpeed and USP do (the gradients of the copies add up).

    Args:
        query: ``(..., H, n, E)``, this rank's contiguous slice, ``n = L / W``, ``H`` a multiple of ``W``.
        key: ``(..., H, n, E)``, or ``(..., Hkv, n, E)`` with ``enable_gqa``.
        value: ``(..., H, n, Ev)``, or ``(..., Hkv, n, Ev)``.
        is_causal: causal attention over the global positions (top-left aligned).
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention.
        group: the process group (``None``: the default group).
        sinks: ``(H,)``, one learned logit per query head, the same on every rank. Rank
            ``r`` applies the sinks of its heads to every query of them; its gradient is
            **this rank's share** (nonzero on its heads only), as in `ring_attention`: the
            ranks' gradients sum to the whole.
        cu_seqlens: ``(S + 1,)`` cumulative lengths of sequences packed along the whole
            length (from 0 to ``n * W``), as in `ring_attention`: no attention across a
            boundary, ``is_causal`` within each sequence.
        mask_mod: a mask over global positions and the *global* query head, in
            FlexAttention's signature, as in `ring_attention` (combined with the others).
            Each rank evaluates it on the whole sequence for all heads and keeps its own
            heads' rows, so a mod that reads ``h`` sees the head it names.

    Returns:
        ``(..., H, n, Ev)``, this rank's slice of the output, in ``query``'s dtype.

    Raises:
        RuntimeError: no process group is initialised, or this process is not in ``group``.
        ValueError: ``H`` not a multiple of ``W``, or ``Hkv`` neither a multiple nor a divisor
            of ``W`` (each with the numbers); query and key slices of different lengths;
            ``sinks`` not of shape ``(H,)``; as `attention_ref.scaled_dot_product_attention`.
        TypeError: ``mask_mod`` not a mask mod, or returning something else than bool.
        NotImplementedError: ``sinks`` with one value per query (use `ring_attention`).

    Examples:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> from attention_ref import scaled_dot_product_attention
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
        >>> out = ulysses_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, is_causal=True))
        True
        >>> dist.destroy_process_group()
    """
    rank, world = group_info(group, "ulysses_attention")
    query, key, value, _, resolved = _inputs.prepare(query, key, value, None, is_causal, scale, enable_gqa)
    _inputs.check_mods(None, mask_mod)
    n = query.shape[-2]
    batch = batch_shape(query, key, value, enable_gqa)  # (..., H): the scores' leading dims, all heads
    key, value, sinks = _head_slices("ulysses_attention", query, key, value, sinks, enable_gqa, rank, world,
                                     "the world size")
    # (..., H, n, E) -> (..., H / W, L, E): head slices over the whole sequence, in rank (= position) order
    q, k, v = (_AllToAll.apply(t, -3, -2, group, world) for t in (query, key, value))
    keep = None
    if cu_seqlens is not None:  # (L, L): keys of the query's own sequence only
        documents = documents_of(cu_seqlens, n * world, query.device)
        keep = documents[:, None] == documents[None, :]
    if mask_mod is not None:  # (..., H | 1, L, L) over every head, then this rank's heads
        chosen = _own_heads(_mods.apply_mask_mod(mask_mod, batch, n * world, n * world, query.device), rank, world)
        keep = chosen if keep is None else keep & chosen
    out = scaled_dot_product_attention(q, k, v, keep, is_causal=is_causal, scale=resolved, enable_gqa=enable_gqa,
                                       sinks=sinks)  # (..., H / W, L, Ev)
    return _AllToAll.apply(out, -2, -3, group, world)  # (..., H / W, L, Ev) -> (..., H, n, Ev)


def usp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "contiguous",
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mask_mod: _mods.MaskMod | None = None,
) -> torch.Tensor:
    r"""USP (unified sequence parallelism): Ulysses inside a group of ranks, the ring across groups.

    ``W = U x R`` ranks form a grid: ``ulysses_group`` holds the ``U`` ranks of one row,
    ``ring_group`` the ``R`` ranks of one column (the same position in every row). The
    sequence is cut first across the ring (`shard` with ``group=ring_group`` and
    ``layout``: ``R`` blocks, or ``2R`` zigzag chunks), then each block across the row
    (`shard` with ``group=ulysses_group``, ``"contiguous"``). One all-to-all in the row
    gives each rank ``H / U`` heads over its row's block; `ring_attention` across the
    column passes the blocks around (Ulysses' heads stay on fast links inside a node,
    the ring's steps cross nodes); one all-to-all back. Equal (up to rounding) to the
    attention of the unsharded tensors, sharded the same two ways.

    Args:
        query: ``(..., H, n, E)``, this rank's slice, ``n = L / (U R)``, ``H`` a multiple of ``U``.
        key: ``(..., H, n, E)``, or ``(..., Hkv, n, E)`` with ``enable_gqa`` (``Hkv`` a
            multiple or a divisor of ``U``, as in `ulysses_attention`).
        value: ``(..., H, n, Ev)``, or ``(..., Hkv, n, Ev)``.
        ulysses_group: this rank's row (``None``: the default group, a single row).
        ring_group: this rank's column (``None``: the default group, a single column).
        is_causal: causal attention over the global positions.
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention.
        layout: the ring's layout of the blocks, ``"contiguous"``, ``"zigzag"`` or
            ``"zigzag-per-sequence"`` (with ``cu_seqlens``; each sequence a multiple of ``2 R``
            long, and `shard` across the column given the same ``cu_seqlens``).
        sinks: ``(H,)`` per-head sinks, the same on every rank; the gradient is this rank's share.
        cu_seqlens: packed sequences along the whole length, as in `ring_attention`.
        mask_mod: a mask over global positions and the global query head, as in
            `ulysses_attention`; the ring plans with it (a band is read, any other mod
            evaluated, as in `ring_attention`).

    Returns:
        ``(..., H, n, Ev)``, this rank's slice of the output.

    Raises:
        RuntimeError: no process group is initialised, or this process is not in a group.
        ValueError: ``H`` not a multiple of ``U``, or ``Hkv`` neither a multiple nor a divisor
            of it; as `ring_attention` for the blocks of the ring (lengths, layout, offsets).
        NotImplementedError: ``sinks`` with one value per query.
    """
    layout = check_layout(layout)
    u_rank, u_world = group_info(ulysses_group, "usp_attention (ulysses_group)")
    _, r_world = group_info(ring_group, "usp_attention (ring_group)")
    query, key, value, _, resolved = _inputs.prepare(query, key, value, None, is_causal, scale, enable_gqa)
    _inputs.check_mods(None, mask_mod)
    if mask_mod is not None:  # the sizes a mod was built for are the whole call's: checked here, once
        total = query.shape[-2] * u_world * r_world  # the full length
        _mods.validate_sizes(mask_mod, *mod_sizes(batch_shape(query, key, value, enable_gqa)), total, total)
        mask_mod = _shifted_heads(mask_mod, u_rank * query.shape[-3] // u_world)
    key, value, sinks = _head_slices("usp_attention", query, key, value, sinks, enable_gqa, u_rank, u_world,
                                     "the Ulysses group's size")
    # (..., H, n, E) -> (..., H / U, U n, E): this row's block of the sequence, this rank's heads
    q, k, v = (_AllToAll.apply(t, -3, -2, ulysses_group, u_world) for t in (query, key, value))
    out = ring_attention(q, k, v, is_causal=is_causal, scale=resolved, enable_gqa=enable_gqa, group=ring_group,
                         layout=layout, sinks=sinks, cu_seqlens=cu_seqlens, mask_mod=mask_mod)  # (..., H / U, U n, Ev)
    return _AllToAll.apply(out, -2, -3, ulysses_group, u_world)  # -> (..., H, n, Ev)
