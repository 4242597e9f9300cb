"""Where each position of the sequence lies: the layouts, `shard`, `unshard` and `shard_positions`.

The three layouts (``"contiguous"``, ``"zigzag"``, ``"zigzag-per-sequence"``) are described in
`attention_ref.distributed`. The helpers that name their chunks (`Piece`, `pieces_of`), check a
layout and its packed offsets, and find this rank in its process group are shared with the rest of
the package: the schedule, the ring and Ulysses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from attention_ref._validation import check_cu_seqlens, fmt_shape

LAYOUTS = ("zigzag", "contiguous", "zigzag-per-sequence")


def check_layout(layout: object) -> str:
    """The layout, or a ValueError naming the known ones; shared by `schedule`, `ring` and `ulysses`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def _chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds, in its local order (chunks of ``N / (world * per_rank)``)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


class Piece(NamedTuple):
    """A run of consecutive global positions that one rank holds: one chunk of its layout.

    Shared with `attention_ref.distributed.schedule`, which plans the ring over these chunks."""

    chunk: int  # the chunk's global index, in position order
    start: int  # the global position of its first element
    length: int
    local: int  # where it starts in the rank's local slice

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


def pieces_of(rank: int, world: int, local_len: int, layout: str, cu: list[int] | None = None) -> list[Piece]:
    """The chunks rank ``rank`` holds, in its local order. ``"zigzag-per-sequence"`` cuts every packed
    sequence of ``cu`` (the offsets, a list) into ``2 * world`` chunks and gives the rank chunks
    ``rank`` and ``2 * world - 1 - rank`` of each, numbered ``2 * world * sequence + chunk``.
    Shared with `attention_ref.distributed.schedule`."""
    if layout != "zigzag-per-sequence":
        c = local_len // _chunks_per_rank(layout)
        return [Piece(j, j * c, c, i * c) for i, j in enumerate(_chunk_ids(rank, world, layout))]
    pieces: list[Piece] = []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # type: ignore[index]
        c = (b - a) // (2 * world)  # this sequence's chunk length
        for j in (rank, 2 * world - 1 - rank) if c else ():
            local = pieces[-1].local + pieces[-1].length if pieces else 0
            pieces.append(Piece(2 * world * i + j, a + j * c, c, local))
    return pieces


def group_info(group: dist.ProcessGroup | None, caller: str) -> tuple[int, int]:
    """``(rank in group, group size)``, or a RuntimeError that says what to initialise.
    Shared by `shard`, `unshard` and the attention functions of `ring` and `ulysses`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller} needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first in every process "
            "(attention_ref.distributed.spawn does it for local CPU processes)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise RuntimeError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member of group")
    return rank, world


def _positions(rank: int, world: int, local_len: int, layout: str, device: torch.device | str | None = None,
               cu: list[int] | None = None) -> torch.Tensor:
    """The global positions ``(local_len,)`` that rank ``rank`` holds, in its local order."""
    pieces = pieces_of(rank, world, local_len, layout, cu)
    runs = [torch.arange(p.start, p.start + p.length, device=device) for p in pieces]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long, device=device)


def shard_positions(world: int, length: int, *, layout: str = "zigzag", cu_seqlens: torch.Tensor | None = None
                    ) -> list[torch.Tensor]:
    """The global positions each rank holds under a layout, in its local order: what `shard` takes.

    No process group is needed: a data loader can cut each rank's batch itself (as Megatron's
    ``get_batch_on_this_cp_rank`` does) with ``x.index_select(dim, shard_positions(...)[rank])``.

    Args:
        world: the number of ranks, >= 1.
        length: the full length ``N``, a multiple of ``world`` (contiguous) or ``2 * world``.
        layout: ``"zigzag"``, ``"contiguous"`` or ``"zigzag-per-sequence"``.
        cu_seqlens: the packed sequences' offsets; only with ``"zigzag-per-sequence"``, which
            needs them (every sequence a multiple of ``2 * world`` long).

    Returns:
        ``world`` int64 tensors of ``length / world`` positions each.

    Raises:
        ValueError: ``world < 1``, an unknown layout, a length that does not divide, ``cu_seqlens``
            missing with ``"zigzag-per-sequence"`` or given with another layout.
        TypeError: ``world`` or ``length`` is not an int.

    Examples:
        >>> [p.tolist() for p in shard_positions(2, 8)]
        [[0, 1, 6, 7], [2, 3, 4, 5]]
        >>> cu = torch.tensor([0, 4, 12])                   # two packed sequences, of 4 and 8
        >>> [p.tolist() for p in shard_positions(2, 12, layout="zigzag-per-sequence", cu_seqlens=cu)]
        [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    """
    for name, value in (("world", world), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    layout = check_layout(layout)
    _refuse_unused_offsets("shard_positions", layout, cu_seqlens)
    cu = layout_offsets("shard_positions", layout, cu_seqlens, length, world, None)
    if length % required_multiple(world, layout):
        raise ValueError(f"length must be a multiple of {required_multiple(world, layout)} with layout={layout!r} "
                         f"and world={world}, got {length}")
    return [_positions(rank, world, length // world, layout, cu=cu) for rank in range(world)]


def layout_offsets(caller: str, layout: str, cu_seqlens: object, total: int, world: int,
                   device: torch.device | None) -> list[int] | None:
    """The packed offsets as a list where the layout needs them (``"zigzag-per-sequence"``), checked:
    given, from 0 to ``total``, every sequence a multiple of ``2 * world`` long. None for the others.
    Shared by `shard`, `unshard`, `shard_positions`, `ring_schedule` and `ring_attention`."""
    if layout != "zigzag-per-sequence":
        return None
    if cu_seqlens is None:
        raise ValueError(f"{caller} with layout='zigzag-per-sequence' needs cu_seqlens (the packed sequences' "
                         "offsets): each sequence is cut into 2 * world chunks")
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total, "the full length", device).tolist()
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if (b - a) % (2 * world):
            raise ValueError(
                f"{caller} with layout='zigzag-per-sequence' needs every packed sequence to be a multiple of "
                f"2 * world = {2 * world} long (pad it, as Megatron does), got sequence {i} of length {b - a} "
                f"(cu_seqlens[{i}:{i + 2}] = {[a, b]})"
            )
    return cu


def required_multiple(world: int, layout: str) -> int:
    """What the full length must be a multiple of; shared by the layouts' functions and `ring_schedule`."""
    return _chunks_per_rank(layout) * world


def shard(
    x: torch.Tensor,
    dim: int = -2,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's part of a full tensor that every rank holds.

    With ``layout="contiguous"`` rank ``r`` gets the ``r``-th of ``world`` equal
    slices along ``dim``; with ``"zigzag"`` it gets chunks ``r`` and
    ``2 * world - 1 - r`` of ``2 * world`` equal chunks, concatenated in that
    order; with ``"zigzag-per-sequence"`` (Megatron's sharding of packed THD
    batches) it gets chunks ``r`` and ``2 * world - 1 - r`` of *every* packed
    sequence of ``cu_seqlens``, each cut into ``2 * world`` chunks, in sequence
    order. No communication: every rank must pass the same full tensor. The
    result is a new tensor (an ``index_select``), differentiable with respect
    to ``x``: the gradient is this rank's slice, put back in place, zeros elsewhere.

    Args:
        x: the full tensor, the same on every rank; ``x.shape[dim]`` a multiple of
            ``world`` (contiguous) or ``2 * world`` (zigzag).
        dim: the sequence dim, ``-2`` for the ``(..., L, E)`` tensors of attention.
        group: the process group (``None``: the default group).
        layout: ``"zigzag"``, ``"contiguous"`` or ``"zigzag-per-sequence"``.
        cu_seqlens: ``(S + 1,)`` offsets of the sequences packed along ``dim`` (from 0 to
            ``x.shape[dim]``, each sequence a multiple of ``2 * world`` long); only with
            ``"zigzag-per-sequence"``, which needs them.

    Returns:
        The part of ``x`` this rank holds: ``x.shape[dim] / world`` positions along ``dim``.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: an unknown layout, a length that does not divide, ``cu_seqlens``
            missing with ``"zigzag-per-sequence"`` or given with another layout.
        TypeError: ``x`` is not a tensor.

    Examples:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> shard(torch.arange(4.0)[:, None]).flatten().tolist()   # one rank holds it all
        [0.0, 1.0, 2.0, 3.0]
        >>> dist.destroy_process_group()
    """
    layout = check_layout(layout)
    rank, world = group_info(group, "shard")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    length = x.shape[dim]
    _refuse_unused_offsets("shard", layout, cu_seqlens)
    cu = layout_offsets("shard", layout, cu_seqlens, length, world, None)  # read as a list: any device
    multiple = required_multiple(world, layout)
    if length % multiple:
        raise ValueError(
            f"shard with layout={layout!r} needs x.shape[{dim}] to be a multiple of "
            f"{'world' if layout == 'contiguous' else '2 * world'} = {multiple}, got {length} "
            f"(shape {fmt_shape(x.shape)})"
        )
    index = _positions(rank, world, length // world, layout, x.device, cu)  # (length / world,) global positions
    return x.index_select(dim, index)


def _refuse_unused_offsets(caller: str, layout: str, cu_seqlens: object) -> None:
    """`shard` and `unshard` place positions by the layout alone, except for ``"zigzag-per-sequence"``."""
    if cu_seqlens is not None and layout != "zigzag-per-sequence":
        raise ValueError(
            f"{caller}: cu_seqlens changes where positions go only with layout='zigzag-per-sequence', got "
            f"layout={layout!r} (its positions do not depend on the sequences: leave cu_seqlens out, and give "
            "it to ring_attention)"
        )


class _Unshard(torch.autograd.Function):
    """All-gather of the local parts, reordered to the full tensor; backward: all-reduce, then shard."""

    @staticmethod
    def forward(ctx, x, dim, group, layout, world, cu_seqlens, cu):  # type: ignore[override]
        ctx.options = (dim, group, layout, cu_seqlens)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        # Rank order (rank 0's positions, rank 1's, ...) -> position order.
        order = torch.cat([_positions(r, world, x.shape[dim], layout, cu=cu) for r in range(world)])
        gathered = torch.cat(parts, dim=dim)
        return gathered.index_select(dim, torch.argsort(order).to(x.device))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, group, layout, cu_seqlens = ctx.options
        # Every rank's copy of the full tensor depends on this rank's part: sum the copies' gradients.
        total = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(total, group=group)
        return shard(total, dim, group=group, layout=layout, cu_seqlens=cu_seqlens), None, None, None, None, None, None


def unshard(
    x_local: torch.Tensor,
    dim: int = -2,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full tensor, on every rank, from each rank's part (the inverse of `shard`).

    An all-gather of the parts, put back in position order. Differentiable: the
    gradient of a rank's part is the **sum over all ranks** of the gradient of
    their copy of the full tensor, taken at this rank's positions (an all-reduce,
    the convention of ``torch.distributed.nn.functional.all_gather``): the
    gradient of the sum of every rank's loss. If every rank computes the *same*
    loss from the full tensor, that sum counts it ``world`` times: divide the loss
    by the world size, or compute each rank's loss on its own part instead.

    Args:
        x_local: this rank's part, the same shape on every rank.
        dim: the sequence dim.
        group: the process group (``None``: the default group).
        layout: the layout the parts were made with.
        cu_seqlens: the packed sequences' offsets the parts were made with; only with
            ``"zigzag-per-sequence"``, which needs them.

    Returns:
        The full tensor, ``world * x_local.shape[dim]`` positions along ``dim``.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: an unknown layout, an odd local length with ``"zigzag"``, ``cu_seqlens``
            missing with ``"zigzag-per-sequence"`` or given with another layout.
        TypeError: ``x_local`` is not a tensor.

    Examples:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> x = torch.randn(2, 6, 3)
        >>> torch.equal(unshard(shard(x, dim=1), dim=1), x)
        True
        >>> dist.destroy_process_group()
    """
    layout = check_layout(layout)
    _, world = group_info(group, "unshard")
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(
            f"unshard with layout='zigzag' needs an even local length (two chunks per rank), got "
            f"x_local.shape[{dim}] = {x_local.shape[dim]}"
        )
    _refuse_unused_offsets("unshard", layout, cu_seqlens)
    cu = layout_offsets("unshard", layout, cu_seqlens, x_local.shape[dim] * world, world, None)
    return _Unshard.apply(x_local, dim, group, layout, world, cu_seqlens, cu)


def documents_of(cu_seqlens: object, total: int, device: torch.device) -> torch.Tensor:
    """``(total,)`` int64: the index of the packed sequence each global position belongs to.
    Shared by `ring_schedule`, `ring_attention` and `ulysses_attention`."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total, "the full length (the local length x world)", device)
    return torch.searchsorted(cu[1:].contiguous(), torch.arange(total, device=device), right=True)
