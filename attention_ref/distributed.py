r"""Context-parallel (ring) attention on ``torch.distributed``: one sequence split across devices.

When a sequence no longer fits one device, it is cut along its length: each rank
(process, usually one per GPU) holds a slice of the queries, keys and values.
The queries stay where they are; the key/value slices travel around a ring of
ranks, one hop per step, and after ``world`` steps every query slice has met
every key slice. Each rank merges its partial results with the log-sum-exp
algebra of the online softmax (`attention_ref.functional.merge_attention`), so
the result equals `attention_ref.functional.scaled_dot_product_attention` on
the whole sequence up to rounding.

Three layouts say which positions a rank holds (`shard`, `unshard`), for a full
length ``N`` and ``world`` ranks:

- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``world`` equal slices.
  Under a causal mask the last rank does most of the work: its queries see
  every key, rank 0's only its own.
- ``"zigzag"`` (the default): the sequence is cut into ``2 * world`` equal chunks
  and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``, one early and one
  late, so that every rank does the same causal work (`ring_schedule` lists it).
- ``"zigzag-per-sequence"``: Megatron's sharding of packed (THD) batches, the zigzag
  of every packed sequence (``cu_seqlens``) at once, which balances many causal
  triangles where the whole-row zigzag balances one.

What the module gives:

- `ring_attention`: the local slices in, this rank's output slice out, with a
  backward pass that sends the key/value gradients around the ring to their owners;
  a ``mask_mod`` over global positions (a sliding window, a block mask) makes it skip
  the chunk pairs no query sees and the slices no rank further along needs;
- `ulysses_attention` and `usp_attention`: DeepSpeed-Ulysses' all-to-all from sequence
  slices to head slices, and USP, Ulysses inside groups with the ring across them;
- `shard` / `unshard`: a full tensor to this rank's part and back; `shard_positions`:
  which positions each rank holds, without a process group;
- `ring_schedule`: which key/value chunk each rank meets at each step, and whether
  it is computed in full, with a mask, or skipped; `ring_hops`: how far each slice travels;
- `count_communication` / `CommStats`: the sends of `ring_attention`, counted;
- `spawn` / `demo_worker`: run a function in ``world`` local CPU processes joined
  by the gloo backend (for tests and the documentation), and a worker that
  checks the ring, Ulysses or USP against one process.

Every rank must call the collective functions in the same order with tensors of
the same shapes (as every ``torch.distributed`` program): nothing checks it, a
mismatch hangs until the process group's timeout. The code runs unchanged with
the NCCL backend on GPUs (the tensors on each rank's own device); it has been
tested on CPU with gloo. Shapes use the package legend (``B``, ``H``, ``Hkv``,
``L``, ``E``, ``Ev``); a local slice has ``L / world`` positions.

Examples:
    >>> from attention_ref.distributed import ring_schedule
    >>> for rank, blocks in enumerate(ring_schedule(2, layout="zigzag")):   # causal, 2 ranks
    ...     print(rank, [(b.step, b.q_chunk, b.kv_chunk, b.kind) for b in blocks if b.kind != "skipped"])
    0 [(0, 0, 0, 'masked'), (0, 3, 0, 'full'), (0, 3, 3, 'masked'), (1, 3, 1, 'full'), (1, 3, 2, 'full')]
    1 [(0, 1, 1, 'masked'), (0, 2, 1, 'full'), (0, 2, 2, 'masked'), (1, 1, 0, 'full'), (1, 2, 0, 'full')]
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._validation import check_cu_seqlens, fmt_shape
from attention_ref.functional import masked_scores, merge_attention, scaled_dot_product_attention
from attention_ref.sinks import add_sinks, check_sinks, heads_of
from attention_ref._inputs import batch_shape
from attention_ref.block_mask import BlockMask, band_of, check_block_mask, mod_sizes

__all__ = [
    "CommStats",
    "RingBlock",
    "count_communication",
    "demo_worker",
    "ring_attention",
    "ring_hops",
    "ring_schedule",
    "shard",
    "shard_positions",
    "spawn",
    "ulysses_attention",
    "unshard",
    "usp_attention",
]

LAYOUTS = ("zigzag", "contiguous", "zigzag-per-sequence")
# Tags keep the kinds of message apart on backends that match messages by tag (gloo); NCCL ignores
# them and matches by order, which is the same on every rank. _TAG_RET_*: a slice's dK/dV
# accumulator going back to its owner from the last rank that needed the slice.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV, _TAG_RET_DK, _TAG_RET_DV = 0, 1, 2, 3, 4, 5


# --- layouts ----------------------------------------------------------------------------------


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def _chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds, in its local order (chunks of ``N / (world * per_rank)``)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


class _Piece(NamedTuple):
    """A run of consecutive global positions that one rank holds: one chunk of its layout."""

    chunk: int  # the chunk's global index, in position order
    start: int  # the global position of its first element
    length: int
    local: int  # where it starts in the rank's local slice

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


def _pieces(rank: int, world: int, local_len: int, layout: str, cu: list[int] | None = None) -> list[_Piece]:
    """The chunks rank ``rank`` holds, in its local order. ``"zigzag-per-sequence"`` cuts every packed
    sequence of ``cu`` (the offsets, a list) into ``2 * world`` chunks and gives the rank chunks
    ``rank`` and ``2 * world - 1 - rank`` of each, numbered ``2 * world * sequence + chunk``."""
    if layout != "zigzag-per-sequence":
        c = local_len // _chunks_per_rank(layout)
        return [_Piece(j, j * c, c, i * c) for i, j in enumerate(_chunk_ids(rank, world, layout))]
    pieces: list[_Piece] = []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # type: ignore[index]
        c = (b - a) // (2 * world)  # this sequence's chunk length
        for j in (rank, 2 * world - 1 - rank) if c else ():
            local = pieces[-1].local + pieces[-1].length if pieces else 0
            pieces.append(_Piece(2 * world * i + j, a + j * c, c, local))
    return pieces


def _group_info(group: dist.ProcessGroup | None, caller: str) -> tuple[int, int]:
    """``(rank in group, group size)``, or a RuntimeError that says what to initialise."""
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


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` (point-to-point ops take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _positions(rank: int, world: int, local_len: int, layout: str, device: torch.device | str | None = None,
               cu: list[int] | None = None) -> torch.Tensor:
    """The global positions ``(local_len,)`` that rank ``rank`` holds, in its local order."""
    pieces = _pieces(rank, world, local_len, layout, cu)
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
    layout = _check_layout(layout)
    _refuse_unused_offsets("shard_positions", layout, cu_seqlens)
    cu = _layout_offsets("shard_positions", layout, cu_seqlens, length, world, None)
    if length % _required_multiple(world, layout):
        raise ValueError(f"length must be a multiple of {_required_multiple(world, layout)} with layout={layout!r} "
                         f"and world={world}, got {length}")
    return [_positions(rank, world, length // world, layout, cu=cu) for rank in range(world)]


def _layout_offsets(caller: str, layout: str, cu_seqlens: object, total: int, world: int,
                    device: torch.device | None) -> list[int] | None:
    """The packed offsets as a list where the layout needs them (``"zigzag-per-sequence"``), checked:
    given, from 0 to ``total``, every sequence a multiple of ``2 * world`` long. None for the others."""
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


def _required_multiple(world: int, layout: str) -> int:
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
    layout = _check_layout(layout)
    rank, world = _group_info(group, "shard")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    length = x.shape[dim]
    _refuse_unused_offsets("shard", layout, cu_seqlens)
    cu = _layout_offsets("shard", layout, cu_seqlens, length, world, None)  # read as a list: any device
    multiple = _required_multiple(world, layout)
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
    layout = _check_layout(layout)
    _, world = _group_info(group, "unshard")
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(
            f"unshard with layout='zigzag' needs an even local length (two chunks per rank), got "
            f"x_local.shape[{dim}] = {x_local.shape[dim]}"
        )
    _refuse_unused_offsets("unshard", layout, cu_seqlens)
    cu = _layout_offsets("unshard", layout, cu_seqlens, x_local.shape[dim] * world, world, None)
    return _Unshard.apply(x_local, dim, group, layout, world, cu_seqlens, cu)


# --- the schedule -----------------------------------------------------------------------------


class RingBlock(NamedTuple):
    """One (query chunk, key/value chunk) pair a rank meets during the ring.

    Attributes:
        step: the ring step, ``0 .. world - 1``; at step ``s`` rank ``r`` holds the
            key/value slice of rank ``(r - s) % world``.
        source: the rank whose key/value slice it is.
        q_chunk: the global index of the query chunk.
        kv_chunk: the global index of the key/value chunk.
        kind: ``"full"`` (computed without a mask), ``"masked"`` (the diagonal
            chunk of a causal mask: computed with it) or ``"skipped"`` (every key
            lies in the future of every query).
    """

    step: int
    source: int
    q_chunk: int
    kv_chunk: int
    kind: str


def _block_kind(q_chunk: int, kv_chunk: int, is_causal: bool) -> str:
    """Chunks are equal and numbered in position order: compare their global indices."""
    if not is_causal or kv_chunk < q_chunk:
        return "full"
    return "masked" if kv_chunk == q_chunk else "skipped"


class _Mask(NamedTuple):
    """What decides which key a query sees, over global positions: ``is_causal``, the packed
    sequences (``documents``: the ``(N,)`` sequence index of every position) and a ``mask_mod``
    evaluated on the scores' leading dims ``batch`` (``(..., H)``) of a full length ``total``."""

    is_causal: bool
    documents: torch.Tensor | None = None
    mask_mod: Callable[..., torch.Tensor] | None = None
    batch: tuple[int, ...] = ()
    total: int = 0

    @property
    def by_index(self) -> bool:
        """Whether the chunks' indices alone decide (equal chunks, causal or nothing)."""
        return self.documents is None and self.mask_mod is None


def _pair_keep(mask: _Mask, q: _Piece, kv: _Piece, device: torch.device | str | None) -> torch.Tensor | None:
    """Which keys of chunk ``kv`` the queries of chunk ``q`` see: bool, broadcastable to
    ``(..., H, q.length, kv.length)``; None: every key (no mask at all)."""
    q_pos = torch.arange(q.start, q.start + q.length, device=device)  # global positions
    kv_pos = torch.arange(kv.start, kv.start + kv.length, device=device)
    keep = kv_pos[None, :] <= q_pos[:, None] if mask.is_causal else None  # (lq, lk)
    if mask.documents is not None:  # no attention across packed sequences
        same = mask.documents[q_pos][:, None] == mask.documents[kv_pos][None, :]  # (lq, lk)
        keep = same if keep is None else keep & same
    if mask.mask_mod is not None:
        chosen = _mods.apply_mask_mod(mask.mask_mod, mask.batch, q.length, kv.length, device, q_start=q.start,
                                      kv_start=kv.start, sizes=(mask.total, mask.total))  # (..., H?, lq, lk)
        keep = chosen if keep is None else keep & chosen
    return keep


def _bounded_kind(mask: _Mask, q: _Piece, kv: _Piece) -> str | None:
    """The kind of a chunk pair when bounds decide it, without forming its mask; None when they do not.

    The causal mask and a `attention_ref.mods.sliding_window` (or `attention_ref.mods.causal`)
    mod keep key ``j`` for query ``i`` when ``i + low <= j <= i + high``: a band, whose kind
    on the block of rows ``i0..i1`` and keys ``j0..j1`` its corners give (as
    `attention_ref.tiled` reads its blocks). Packed sequences: a pair whose sequences do not
    overlap is empty, a pair inside one sequence is as the band says. Anything else (another
    mod, a pair across a boundary) is evaluated. So a window over a long sequence costs
    ``O(W^2)`` bounds and the evaluation of the pairs along its band only.
    """
    if q.length == 0 or kv.length == 0:
        return "skipped"
    band = None if mask.mask_mod is None else band_of(mask.mask_mod)
    decided = mask.mask_mod is None or band is not None
    lows = [band[0]] if band is not None and band[0] is not None else []
    highs = [0] if mask.is_causal else []
    highs += [band[1]] if band is not None and band[1] is not None else []
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    i0, i1, j0, j1 = q.start, q.start + q.length - 1, kv.start, kv.start + kv.length - 1
    full = (low is None or j0 >= i1 + low) and (high is None or j1 <= i0 + high)
    first = i0 if high is None else max(i0, j0 - high)  # the rows that may meet the band
    last = i1 if low is None else min(i1, j1 - low)
    if first > last:
        return "skipped"
    if mask.documents is not None:
        d = mask.documents
        q_docs, kv_docs = (int(d[i0]), int(d[i1])), (int(d[j0]), int(d[j1]))  # positions are in order
        if q_docs[1] < kv_docs[0] or kv_docs[1] < q_docs[0]:
            return "skipped"
        decided = decided and q_docs[0] == q_docs[1] == kv_docs[0] == kv_docs[1]
    if not decided:
        return None
    return "full" if full else "masked"


def _kind_of(keep: torch.Tensor | None) -> str:
    if keep is None or bool(keep.all()):
        return "full"
    return "masked" if bool(keep.any()) else "skipped"


def _rank_blocks(rank: int, world: int, pieces: list[list[_Piece]], mask: _Mask,
                 device: torch.device | str | None = None, keeps: dict | None = None) -> list[RingBlock]:
    """Rank ``rank``'s blocks in ring order; with ``keeps``, the mask of each computed one is stored
    there under ``(step, q_chunk, kv_chunk)`` (None for a full one)."""
    blocks = []
    for step in range(world):
        source = (rank - step) % world  # whose keys/values this rank holds at this step
        for q in pieces[rank]:
            for kv in pieces[source]:
                if mask.by_index:
                    kind = _block_kind(q.chunk, kv.chunk, mask.is_causal)
                    keep = _pair_keep(mask, q, kv, device) if kind == "masked" and keeps is not None else None
                else:
                    kind = _bounded_kind(mask, q, kv)
                    keep = None
                    if kind is None or (kind == "masked" and keeps is not None):
                        keep = _pair_keep(mask, q, kv, device)
                        kind = _kind_of(keep) if kind is None else kind
                blocks.append(RingBlock(step, source, q.chunk, kv.chunk, kind))
                if keeps is not None and kind != "skipped":
                    keeps[step, q.chunk, kv.chunk] = keep if kind == "masked" else None
    return blocks


def ring_hops(schedule: list[list[RingBlock]]) -> list[int]:
    """How many hops each rank's key/value slice travels in `ring_attention`.

    Rank ``x``'s slice is at rank ``x + s`` (mod ``W``) at step ``s``; it is passed on only
    while a rank further along has a block of it to compute, so it travels to the last
    step at which some rank needs it, and no further (its dK/dV accumulator then goes
    straight back to rank ``x``). ``W - 1`` for every rank means the whole ring; less
    means key/value blocks no query of those ranks sees are neither sent nor computed.

    Args:
        schedule: `ring_schedule`'s result.

    Returns:
        One number per rank, ``0 .. W - 1``.

    Examples:
        >>> ring_hops(ring_schedule(4, layout="contiguous"))   # causal: nobody needs later keys
        [3, 2, 1, 0]
        >>> ring_hops(ring_schedule(4))                        # zigzag: every rank needs every slice
        [3, 3, 3, 3]
    """
    world = len(schedule)
    hops = [0] * world
    for blocks in schedule:
        for block in blocks:
            if block.kind != "skipped":
                hops[block.source] = max(hops[block.source], block.step)
    return hops


def ring_schedule(
    world: int,
    *,
    layout: str = "zigzag",
    is_causal: bool = True,
    length: int | None = None,
    mask_mod: Callable[..., torch.Tensor] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    batch: tuple[int, ...] = (),
) -> list[list[RingBlock]]:
    """Which chunk pairs each rank computes at each step of `ring_attention`, and how.

    The sequence is cut into ``world`` (contiguous) or ``2 * world`` (zigzag)
    equal chunks, numbered in position order (``"zigzag-per-sequence"``: ``2 * world``
    chunks of every packed sequence, sequence ``i``'s numbered from ``2 * world * i``).
    Query chunk ``a`` against key chunk ``b`` is ``"full"`` when every query sees every
    key, ``"skipped"`` when no query sees any key, and ``"masked"`` otherwise (computed with
    the mask of that pair). With a causal mask alone: ``"full"`` when ``b < a``,
    ``"masked"`` when ``b == a``, ``"skipped"`` when ``b > a``. The forward and the backward
    pass of `ring_attention` follow this schedule; the ``blocks_*`` counters of
    `CommStats` count it, and `ring_hops` reads from it how far each slice travels.

    Args:
        world: the number of ranks, >= 1.
        layout: ``"zigzag"``, ``"contiguous"`` or ``"zigzag-per-sequence"``.
        is_causal: whether a causal mask applies.
        length: the full length ``N``; needed with ``mask_mod`` or ``cu_seqlens``.
        mask_mod: a FlexAttention mask mod over global positions, as `ring_attention` takes it.
        cu_seqlens: packed sequences' offsets, as `ring_attention` takes them.
        batch: the scores' leading dims ``(..., H)`` the ``mask_mod`` is evaluated on (one
            batch entry and one head by default; give them when the mod reads ``b`` or ``h``).

    Returns:
        One list per rank of its `RingBlock` entries, in the order it meets them.

    Raises:
        ValueError: ``world < 1``, an unknown layout, ``length`` missing where it is needed
            or not divisible, bad ``cu_seqlens``, ``batch`` without a ``mask_mod``.
        TypeError: ``world`` or ``length`` is not an int, ``mask_mod`` not a mask mod, ``batch``
            not a tuple of positive ints.

    Examples:
        >>> kinds = [[b.kind for b in blocks] for blocks in ring_schedule(4, layout="contiguous")]
        >>> [k.count("full") + k.count("masked") for k in kinds]   # blocks computed per rank
        [1, 2, 3, 4]
        >>> [sum(b.kind != "skipped" for b in blocks) for blocks in ring_schedule(4)]
        [9, 9, 9, 9]
        >>> from attention_ref.mods import sliding_window
        >>> window = ring_schedule(4, layout="contiguous", length=64, mask_mod=sliding_window(15))
        >>> [sum(b.kind != "skipped" for b in blocks) for blocks in window], ring_hops(window)
        ([1, 2, 2, 2], [1, 1, 1, 0])
    """
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"world must be an int, got {type(world).__name__}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    layout = _check_layout(layout)
    _inputs.check_bool("is_causal", is_causal)
    _inputs.check_mods(None, mask_mod)
    if not isinstance(batch, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                               for d in batch):
        raise TypeError(f"batch must be a tuple of positive ints (the scores' leading dims, ..., H), got {batch!r}")
    if batch and mask_mod is None:
        raise ValueError(f"batch={batch!r} only matters to a mask_mod (which reads b and h); none was given")
    needs_length = mask_mod is not None or cu_seqlens is not None or layout == "zigzag-per-sequence"
    if length is None:
        if needs_length:
            raise ValueError("ring_schedule needs length= (the full sequence length) with mask_mod, cu_seqlens "
                             "or layout='zigzag-per-sequence': the blocks' positions depend on it")
        length = _required_multiple(world, layout)  # any multiple: the chunks' indices alone decide
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"length must be an int, got {type(length).__name__}")
    if length % _required_multiple(world, layout):
        raise ValueError(f"length must be a multiple of {_required_multiple(world, layout)} with layout={layout!r} "
                         f"and world={world}, got {length}")
    cu = _layout_offsets("ring_schedule", layout, cu_seqlens, length, world, None)
    documents = None if cu_seqlens is None else _documents(cu_seqlens, length, torch.device("cpu"))
    mask = _Mask(is_causal, documents, mask_mod, batch, length)
    pieces = [_pieces(rank, world, length // world, layout, cu) for rank in range(world)]
    return [_rank_blocks(rank, world, pieces, mask) for rank in range(world)]


# --- counting ---------------------------------------------------------------------------------


@dataclasses.dataclass
class CommStats:
    r"""What `ring_attention` sent from this rank, and the chunk pairs it computed.

    With ``W`` ranks, local key and value slices of ``|K|`` and ``|V|`` elements
    of ``s`` bytes (the input dtype) and ``s_acc`` bytes for the gradient
    accumulators (the compute dtype: float32 for float16/bfloat16 inputs), one
    call and its backward pass send, from every rank:

    - forward: ``W - 1`` key/value steps, ``(W - 1) (|K| + |V|) s`` bytes;
    - backward: ``W - 1`` key/value steps, ``(W - 1) (|K| + |V|) s`` bytes, and
      ``W - 1`` steps of the dK/dV accumulators, ``(W - 1) (|K| + |V|) s_acc`` bytes.

    That is the whole ring, which every slice travels when every rank needs it (no mask,
    or the zigzag layout under a causal mask). A slice is passed on only while a rank
    further along the ring has a block of it to compute (`ring_hops`): with a causal mask
    on the contiguous layout, a sliding window or packed sequences, fewer sends; the
    ``*_skipped`` counters count the sends of the whole ring this rank did not make. A
    send is one message to rank ``r + 1``, except a dK/dV accumulator's last one, which
    goes from the last rank that needed the slice straight back to its owner.

    Attributes:
        forward_steps: key/value exchanges of the forward pass.
        forward_bytes: bytes of key/value sent in the forward pass.
        backward_kv_steps: key/value exchanges of the backward pass.
        backward_kv_bytes: bytes of key/value sent in the backward pass.
        backward_grad_steps: dK/dV accumulator exchanges of the backward pass.
        backward_grad_bytes: bytes of dK/dV accumulators sent.
        blocks_full: chunk pairs computed without a mask (forward pass).
        blocks_masked: chunk pairs computed with the causal mask (forward pass).
        blocks_skipped: chunk pairs skipped, no query seeing any key (forward pass).
        forward_steps_skipped: key/value sends of the whole ring not made in the forward pass
            (no rank further along needed the slice).
        backward_kv_steps_skipped: the same in the backward pass.
        backward_grad_steps_skipped: dK/dV accumulator sends of the whole ring not made.
        forward_all_to_all: all-to-all exchanges of `ulysses_attention`'s forward pass (4: q, k, v
            to head slices, the output back).
        forward_all_to_all_bytes: bytes this rank sent to the other ranks in them: ``(W - 1) / W``
            of each tensor it exchanged (its own share stays).
        backward_all_to_all: all-to-all exchanges of the backward pass (4: dO to head slices, dQ,
            dK, dV back).
        backward_all_to_all_bytes: bytes sent in them.
    """

    forward_steps: int = 0
    forward_bytes: int = 0
    backward_kv_steps: int = 0
    backward_kv_bytes: int = 0
    backward_grad_steps: int = 0
    backward_grad_bytes: int = 0
    blocks_full: int = 0
    blocks_masked: int = 0
    blocks_skipped: int = 0
    forward_steps_skipped: int = 0
    backward_kv_steps_skipped: int = 0
    backward_grad_steps_skipped: int = 0
    forward_all_to_all: int = 0
    forward_all_to_all_bytes: int = 0
    backward_all_to_all: int = 0
    backward_all_to_all_bytes: int = 0


_ACTIVE: list[CommStats] = []


def _record(**increments: int) -> None:
    for stats in _ACTIVE:
        for name, value in increments.items():
            setattr(stats, name, getattr(stats, name) + value)


@contextlib.contextmanager
def count_communication() -> Iterator[CommStats]:
    """Count what `ring_attention` sends in this process while the context is open.

    The forward pass counts when the call runs, the backward pass when
    ``backward()`` runs: call it inside the context to count both. Contexts nest;
    each counts everything that runs while it is open.

    Yields:
        A `CommStats`, updated in place.

    Examples:
        >>> with count_communication() as stats:
        ...     pass                              # ring_attention(...) and .backward() here
        >>> stats.forward_steps, stats.backward_grad_bytes
        (0, 0)
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


# --- the ring ---------------------------------------------------------------------------------


def _post(group: dist.ProcessGroup | None, sends: list[tuple[torch.Tensor, int, int]],
          receives: list[tuple[torch.Tensor, int, int]]) -> tuple[list[Any], list[torch.Tensor]]:
    """Post the sends ``(tensor, group rank, tag)`` (contiguous, kept unchanged until the requests are
    waited for) and the receives ``(like, group rank, tag)``; return (requests, received buffers)."""
    received = [torch.empty_like(like) for like, _, _ in receives]
    ops = [dist.P2POp(dist.isend, t, _global_rank(group, peer), group, tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, r, _global_rank(group, peer), group, tag)
            for r, (_, peer, tag) in zip(received, receives)]
    return (dist.batch_isend_irecv(ops) if ops else []), received


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _documents(cu_seqlens: object, total: int, device: torch.device) -> torch.Tensor:
    """``(total,)`` int64: the index of the packed sequence each global position belongs to."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total, "the full length (the local length x world)", device)
    return torch.searchsorted(cu[1:].contiguous(), torch.arange(total, device=device), right=True)


def _reduce_like(grad: torch.Tensor, like: torch.Tensor, group_size: int) -> torch.Tensor:
    """A gradient computed for the expanded heads and broadcast batch, summed back to ``like``'s shape."""
    if group_size > 1:
        # (..., H, n, E) -> (..., Hkv, H / Hkv, n, E) -> (..., Hkv, n, E): query head h used kv head h // group.
        grad = grad.unflatten(-3, (-1, group_size)).sum(dim=-3)
    return grad.sum_to_size(like.shape)


class _Plan(NamedTuple):
    """Everything a rank needs to know of the ring before it starts: its blocks, their masks, which
    chunks every rank holds, and how far each slice travels (`ring_hops`)."""

    blocks: list[RingBlock]  # this rank's, in ring order
    keeps: dict[tuple[int, int, int], torch.Tensor | None]  # (step, q_chunk, kv_chunk) -> mask of a computed block
    pieces: list[dict[int, _Piece]]  # per rank: chunk -> where it lies
    hops: list[int]  # per rank: the steps its slice travels
    unmasked: bool  # no mask at all: a whole slice in one call

    @staticmethod
    def make(rank: int, world: int, n: int, layout: str, mask: _Mask, cu: list[int] | None,
             device: torch.device) -> _Plan:
        pieces = [_pieces(r, world, n, layout, cu) for r in range(world)]
        keeps: dict[tuple[int, int, int], torch.Tensor | None] = {}
        # Every rank's blocks decide how far the slices travel; only this rank's masks are kept.
        schedule = [_rank_blocks(r, world, pieces, mask, device, keeps if r == rank else None) for r in range(world)]
        return _Plan(schedule[rank], keeps, [{p.chunk: p for p in ps} for ps in pieces], ring_hops(schedule),
                     mask.by_index and not mask.is_causal)

    def sends_kv(self, rank: int, world: int, step: int) -> tuple[bool, bool]:
        """Whether this rank passes its key/value slice on after ``step``, and receives the next one."""
        held, arriving = (rank - step) % world, (rank - 1 - step) % world
        return step < self.hops[held], step < self.hops[arriving]


class _RingAttention(torch.autograd.Function):
    """Ring attention of the local slices; see `ring_attention`. Shapes in the legend, ``n = L / world``."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, enable_gqa, group, layout, rank, world,  # type: ignore[override]
                plan):
        compute = torch.promote_types(query.dtype, torch.float32)
        mine = list(plan.pieces[rank].values())  # this rank's chunks, in local order
        q = query.to(compute)  # (..., H, n, E): the local queries stay here
        out: list[torch.Tensor | None] = [None] * len(mine)  # per local query chunk: (..., H, chunk, Ev)
        lse: list[torch.Tensor | None] = [None] * len(mine)  # (..., H, chunk)
        index = {p.chunk: i for i, p in enumerate(mine)}
        # The key/value slice this rank holds now, in the input dtype (contiguous: sent as it is).
        k_cur, v_cur = key.contiguous(), value.contiguous()
        for step in range(world):
            send, receive = plan.sends_kv(rank, world, step)
            # pass the slice on while computing with it, if a rank further along needs it
            requests, received = _post(group, [(k_cur, (rank + 1) % world, _TAG_K), (v_cur, (rank + 1) % world, _TAG_V)]
                                       if send else [], [(key, (rank - 1) % world, _TAG_K),
                                                         (value, (rank - 1) % world, _TAG_V)] if receive else [])
            if send:
                _record(forward_steps=1, forward_bytes=(k_cur.numel() + v_cur.numel()) * k_cur.element_size())
            elif step < world - 1:
                _record(forward_steps_skipped=1)
            blocks = [b for b in plan.blocks if b.step == step]
            k_c, v_c = k_cur.to(compute), v_cur.to(compute)  # (..., Hkv, n, E), (..., Hkv, n, Ev)
            if plan.unmasked:  # every pair is full: one call for the whole slice
                o, s = scaled_dot_product_attention(q, k_c, v_c, scale=scale, enable_gqa=enable_gqa, return_lse=True)
                for i, p in enumerate(mine):
                    o_i, s_i = o[..., p.rows, :], s[..., p.rows]
                    out[i], lse[i] = (o_i, s_i) if out[i] is None else merge_attention(out[i], lse[i], o_i, s_i)
                _record(blocks_full=len(blocks))
                blocks = []
            for block in blocks:
                _record(**{f"blocks_{block.kind}": 1})
                if block.kind == "skipped":
                    continue
                i = index[block.q_chunk]  # the local query chunk
                kv_rows = plan.pieces[block.source][block.kv_chunk].rows  # where the key chunk lies in the slice
                keep = plan.keeps[block.step, block.q_chunk, block.kv_chunk]
                # (..., H, chunk, E) against (..., Hkv, chunk', E): the partial result and its lse.
                o, s = scaled_dot_product_attention(q[..., mine[i].rows, :], k_c[..., kv_rows, :], v_c[..., kv_rows, :],
                                                    keep, scale=scale, enable_gqa=enable_gqa, return_lse=True)
                out[i], lse[i] = (o, s) if out[i] is None else merge_attention(out[i], lse[i], o, s)
            _wait(requests)
            if receive:
                k_cur, v_cur = received
        batch = batch_shape(query, key, value, enable_gqa)  # (..., H) of the output
        for i, p in enumerate(mine):  # a chunk whose queries see no key at all: output 0, lse -inf
            if out[i] is None:
                out[i] = q.new_zeros((*batch, p.length, value.shape[-1]))
                lse[i] = q.new_full((*batch, p.length), float("-inf"))
        # (..., H, n, Ev) and (..., H, n), the compute dtype (an empty part: a rank that holds nothing)
        output = torch.cat([*out, q.new_zeros((*batch, 0, value.shape[-1]))], dim=-2)  # type: ignore[list-item]
        row_lse = torch.cat([*lse, q.new_zeros((*batch, 0))], dim=-1)  # type: ignore[list-item]
        ctx.save_for_backward(query, key, value, output, row_lse)
        ctx.options = (scale, enable_gqa, group, rank, world, plan)
        return output, row_lse  # sink-free, in the compute dtype: ring_attention adds the sink and casts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        query, key, value, output, row_lse = ctx.saved_tensors
        scale, enable_gqa, group, rank, world, plan = ctx.options
        compute = output.dtype
        mine = plan.pieces[rank]
        group_size = _inputs.kv_group(query, key, "key") if enable_gqa else 1
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        q = query.to(compute)
        d_o = d_out.to(compute)  # (..., H, n, Ev)
        # D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the term the softmax backward subtracts: (..., H, n);
        # the lse's own cotangent enters as d lse_i / d S_ij = P_ij, so it is folded into D (with a minus).
        delta = (d_o * output).sum(dim=-1) - d_lse.to(compute)
        # A row with no key has lse = -inf; +inf makes its recomputed weights exp(-inf - inf) = 0, not NaN.
        lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
        dq = torch.zeros(query.shape, dtype=compute, device=query.device)
        k_cur, v_cur = key.contiguous(), value.contiguous()
        carried: list[torch.Tensor] | None = None  # dK/dV of the slice held now, from the ranks it visited before
        own: tuple[torch.Tensor, torch.Tensor] | None = None  # this rank's contribution to its own dK/dV
        returned: list[torch.Tensor] | None = None  # the other ranks' contributions to it, back from the last one
        grad_sends = 0
        for step in range(world):
            held = (rank - step) % world  # whose slice this rank holds (if it reached this rank)
            send, receive = plan.sends_kv(rank, world, step)
            kv_requests, kv_received = _post(group, [(k_cur, nxt, _TAG_K), (v_cur, nxt, _TAG_V)] if send else [],
                                             [(key, prev, _TAG_K), (value, prev, _TAG_V)] if receive else [])
            if send:
                _record(backward_kv_steps=1, backward_kv_bytes=(k_cur.numel() + v_cur.numel()) * k_cur.element_size())
            elif step < world - 1:
                _record(backward_kv_steps_skipped=1)
            grad_out: list[tuple[torch.Tensor, int, int]] = []
            if step <= plan.hops[held]:
                dk, dv = _RingAttention._block_grads(plan, step, q, k_cur.to(compute), v_cur.to(compute), d_o, delta,
                                                     lse, scale, enable_gqa, group_size, mine, dq, key, value)
                if step == 0:
                    own = (dk, dv)  # kept here: the accumulator of this slice starts at the next rank
                else:
                    if carried is not None:  # add the contributions of the ranks this slice visited before
                        dk, dv = dk + carried[0], dv + carried[1]
                    # pass it on with the slice, or, from the last rank that needs the slice, back to its owner
                    last = step == plan.hops[held]
                    peer, tags = (held, (_TAG_RET_DK, _TAG_RET_DV)) if last else (nxt, (_TAG_DK, _TAG_DV))
                    grad_out = [(dk, peer, tags[0]), (dv, peer, tags[1])]
                    grad_sends += 1
                    _record(backward_grad_steps=1, backward_grad_bytes=(dk.numel() + dv.numel()) * dk.element_size())
            # the accumulators: of the slice arriving next (from the previous rank), and after the last
            # step that needs this rank's own slice, its own (from the rank that last held it)
            dk_like, dv_like = own  # type: ignore[misc]  # set at step 0: the shapes and the compute dtype
            arriving = 1 <= step < plan.hops[(rank - 1 - step) % world]
            home = step == plan.hops[rank] >= 1
            grad_in = [(dk_like, prev, _TAG_DK), (dv_like, prev, _TAG_DV)] if arriving else []
            grad_in += [(dk_like, (rank + step) % world, _TAG_RET_DK),
                        (dv_like, (rank + step) % world, _TAG_RET_DV)] if home else []
            grad_requests, grad_received = _post(group, grad_out, grad_in)
            _wait(grad_requests)
            carried = grad_received[:2] if arriving else None
            if home:
                returned = grad_received[-2:]
            _wait(kv_requests)
            if receive:
                k_cur, v_cur = kv_received
        _record(backward_grad_steps_skipped=world - 1 - grad_sends)
        dk_total, dv_total = own  # type: ignore[misc]
        if returned is not None:  # what the other ranks added to this rank's slice
            dk_total, dv_total = dk_total + returned[0], dv_total + returned[1]
        return (dq.to(query.dtype), dk_total.to(key.dtype), dv_total.to(value.dtype),
                None, None, None, None, None, None, None, None)

    @staticmethod
    def _block_grads(plan, step, q, k_c, v_c, d_o, delta, lse, scale, enable_gqa, group_size, mine, dq, key, value):
        """This rank's contributions, at ``step``, to dQ (added in place) and to the held slice's dK/dV
        (returned, ``(..., Hkv, n, E)`` and ``(..., Hkv, n, Ev)``, compute dtype)."""
        if enable_gqa:  # (..., Hkv, n, E) -> (..., H, n, E) for the block matmuls
            k_c, v_c = _inputs.expand_kv_heads(q, k_c, "key"), _inputs.expand_kv_heads(q, v_c, "value")
        dk = torch.zeros(key.shape, dtype=q.dtype, device=key.device)  # this rank's part of the slice's dK
        dv = torch.zeros(value.shape, dtype=q.dtype, device=value.device)
        for block in (b for b in plan.blocks if b.step == step and b.kind != "skipped"):
            q_rows = mine[block.q_chunk].rows
            kv_rows = plan.pieces[block.source][block.kv_chunk].rows
            keep = plan.keeps[block.step, block.q_chunk, block.kv_chunk]
            q_b, k_b, v_b, do_b = q[..., q_rows, :], k_c[..., kv_rows, :], v_c[..., kv_rows, :], d_o[..., q_rows, :]
            # FlashAttention-2's backward of one block, with the saved lse of the whole row:
            # P = exp(S - lse), the block's exact softmax weights: (..., H, chunk, chunk')
            p = torch.exp(masked_scores(q_b, k_b, keep, False, scale) - lse[..., q_rows, None])
            # dV_j += P^T dO_i: (..., H, chunk', chunk) @ (..., H, chunk, Ev) -> (..., H, chunk', Ev)
            dv[..., kv_rows, :] += _reduce_like(p.transpose(-2, -1) @ do_b, dv[..., kv_rows, :], group_size)
            # dP = dO_i V_j^T: (..., H, chunk, Ev) @ (..., H, Ev, chunk') -> (..., H, chunk, chunk')
            dp = do_b @ v_b.transpose(-2, -1)
            # dS = P * (dP - D_i): the softmax backward
            ds = p * (dp - delta[..., q_rows, None])
            # dQ_i += scale dS K_j: (..., H, chunk, chunk') @ (..., H, chunk', E) -> (..., H, chunk, E)
            dq[..., q_rows, :] += (scale * ds @ k_b).sum_to_size(dq[..., q_rows, :].shape)
            # dK_j += scale dS^T Q_i: (..., H, chunk', chunk) @ (..., H, chunk, E) -> (..., H, chunk', E)
            dk[..., kv_rows, :] += _reduce_like(scale * ds.transpose(-2, -1) @ q_b, dk[..., kv_rows, :], group_size)
        return dk, dv


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mask_mod: _mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    r"""Attention of this rank's query slice over the whole sequence, its keys and values spread over the ranks.

    Equal (up to rounding) to `attention_ref.functional.scaled_dot_product_attention`
    on the unsharded tensors, sharded back:

        shard(scaled_dot_product_attention(Q, K, V, is_causal=..., scale=..., enable_gqa=..., sinks=...),
              layout=layout) == ring_attention(shard(Q), shard(K), shard(V), ..., sinks=...)

    At each of ``world`` steps this rank computes its queries against the
    key/value slice it holds, with ``scaled_dot_product_attention(...,
    return_lse=True)`` on the chunk pairs that `ring_schedule` lists (a pair in
    which no query sees a key is skipped, one that only some keys take part in is
    computed with its mask, built from the global positions), and merges the partial result
    into its running one with `attention_ref.functional.merge_attention`. While
    it computes, the slice is already on its way to rank ``r + 1`` and the next
    one arriving from rank ``r - 1``. A slice is passed on only while a rank further
    along needs it (`ring_hops`): under a sliding window (``mask_mod``) on the contiguous
    layout, key blocks no query of a rank sees are neither sent to it nor computed
    (`CommStats`' ``*_skipped`` counters). The partial results are sink-free; with
    ``sinks``, each query's sink is added once, to the merged result over all
    keys, by `attention_ref.add_sinks` (a sink in each partial result would be
    counted once per step).

    The backward pass is FlashAttention-2's, block by block, with the saved
    log-sum-exp of the whole row: ``P = exp(S - lse)``, ``dV += P^T dO``,
    ``dS = P * (dO V^T - D)`` with ``D = rowsum(dO * O) - dlse``, ``dQ += scale dS K``,
    ``dK += scale dS^T Q``; ``dO`` and ``dlse`` are the cotangents of the
    sink-free result (``dlse = 0`` without sinks; with them both come from
    `attention_ref.add_sinks`' closed-form backward). The key/value slices
    travel the ring again; each slice's dK/dV accumulator starts at the next
    rank, follows the slice, and goes back to its owner from the last rank that
    needed the slice: one more hop when the slice travelled the whole ring, a
    direct message otherwise (`CommStats` gives the counts).

    Everything is computed in at least float32 (float32 for float16/bfloat16
    inputs); the output and the gradients are returned in the input dtype.
    Every rank must call it with tensors of the same shapes (not checked: a
    mismatch hangs until the process group's timeout). A rank with nothing to send or
    receive at a step makes no point-to-point call; NCCL wants every rank in a group's
    *first* batched point-to-point call, so on NCCL run one collective on ``group``
    (a barrier) before the first masked ring (tested with gloo only, which needs none).

    Args:
        query: ``(..., H, n, E)``, this rank's queries, ``n = L / world``.
        key: ``(..., H, n, E)``, or ``(..., Hkv, n, E)`` with ``enable_gqa``.
        value: ``(..., H, n, Ev)``, or ``(..., Hkv, n, Ev)``.
        is_causal: causal attention over the *global* positions (top-left aligned,
            as ``torch.nn.functional.scaled_dot_product_attention``).
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention (``H`` a multiple of ``Hkv``).
        group: the process group of the ring (``None``: the default group).
        layout: how the sequence was split (`shard`): ``"zigzag"`` or ``"contiguous"``.
        sinks: ``(H,)``, one learned logit per query head (`attention_ref.sinks`),
            the same on every rank: a replicated parameter, like the model's
            weights under context parallelism (or one per local query,
            broadcastable to ``(..., H, n)``: this rank's rows, all its own). Its gradient here is **this
            rank's share**, the sum over this rank's queries only, with no
            communication (as `shard` gives a replicated tensor the gradient of
            this rank's slice): the sum of the ranks' ``sinks.grad`` is the
            gradient of the sum of their losses. The all-reduce that sums it is
            the one data/context-parallel training already runs over the
            replicated parameters' gradients (DDP, FSDP); summing here as well
            would count it ``world`` times.
        cu_seqlens: ``(S + 1,)`` cumulative lengths of ``S`` sequences packed along the
            whole length (as `attention_ref.varlen.varlen_attention` takes them, from 0 to
            ``n * world``; Megatron's THD batches): no query attends across a boundary, and
            ``is_causal`` applies within each sequence. Sharded like any packed batch, with
            any layout (``"zigzag-per-sequence"``, Megatron's, needs them); every rank passes
            the same offsets. None: one sequence.
        mask_mod: a mask over *global* positions in FlexAttention's signature
            ``(b, h, q_idx, kv_idx) -> bool`` (True = takes part; `attention_ref.mods`:
            ``sliding_window``, ``chunked``, ``prefix_lm``, ...), the same function on every
            rank, combined with ``is_causal`` and ``cu_seqlens`` (all must hold). ``b`` indexes
            the leading dims before the heads, flattened; ``h`` the query head. Every rank
            plans the whole ring (how far each slice travels): ``causal`` and
            ``sliding_window`` mods are read as bands, at no cost; any other mod is evaluated
            on every chunk pair of every rank, one pair at a time (``N^2`` booleans per call).
        block_mask: a `attention_ref.block_mask.BlockMask` made for the *full* length (``L = S =
            n * world``, as FlexAttention users make one per batch): its ``mask_mod`` masks, as
            ``mask_mod=`` would (pass both only when ``mask_mod`` is ``block_mask.mask_mod``).
            The ring plans its own chunk pairs; the mask's blocks are not used.

    Returns:
        ``(..., H, n, Ev)``, this rank's slice of the output, in ``query``'s dtype.

    Raises:
        RuntimeError: no process group is initialised, or this process is not in ``group``.
        ValueError: shapes that do not fit, query and key slices of different
            lengths, an odd local length with ``"zigzag"`` (the full length must be a
            multiple of ``2 * world``), a bad scale or layout; ``sinks`` not of
            shape ``(H,)``, on another device, NaN or ``+inf``; bad ``cu_seqlens``, or
            none (or a sequence not a multiple of ``2 * world`` long) with
            ``"zigzag-per-sequence"``; a ``mask_mod`` result that does not fit the scores, a
            ``block_mask`` made for another length or batch, or with another ``mask_mod``.
        TypeError: non-float inputs or inputs of different dtypes, ``sinks`` not a float tensor,
            ``mask_mod`` not a mask mod or not returning bool, ``block_mask`` not a `attention_ref.block_mask.BlockMask`.

    Examples:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> from attention_ref import scaled_dot_product_attention
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
        >>> out = ring_attention(shard(q), shard(k), shard(v), is_causal=True)
        >>> torch.allclose(unshard(out), scaled_dot_product_attention(q, k, v, is_causal=True))
        True
        >>> dist.destroy_process_group()
    """
    layout = _check_layout(layout)
    rank, world = _group_info(group, "ring_attention")
    query, key, value, _, resolved = _inputs.prepare(query, key, value, None, is_causal, scale, enable_gqa)
    n = query.shape[-2]
    if key.shape[-2] != n:
        raise ValueError(
            f"ring_attention needs query and key slices of one sequence, the same local length (dim -2): "
            f"query {fmt_shape(query.shape)} has {n}, key {fmt_shape(key.shape)} has {key.shape[-2]}"
        )
    if layout == "zigzag" and n % 2:
        raise ValueError(
            f"ring_attention with layout='zigzag' needs the full length to be a multiple of 2 * world = "
            f"{2 * world} (an even local length, two chunks per rank), got local length {n} "
            f"(full length {n * world})"
        )
    if sinks is not None:
        batch = batch_shape(query, key, value, enable_gqa)
        check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))  # this rank's queries
    _inputs.check_mods(None, mask_mod)
    if block_mask is not None:  # made for the whole sequence: its mod masks the global positions
        check_block_mask(block_mask, mask_mod, batch_shape(query, key, value, enable_gqa), n * world, n * world)
        mask_mod = block_mask.mask_mod
    cu = _layout_offsets("ring_attention", layout, cu_seqlens, n * world, world, query.device)
    documents = None if cu_seqlens is None else _documents(cu_seqlens, n * world, query.device)  # (n * world,)
    mask = _Mask(is_causal, documents, mask_mod, batch_shape(query, key, value, enable_gqa), n * world)
    plan = _Plan.make(rank, world, n, layout, mask, cu, query.device)
    # (..., H, n, Ev) and (..., H, n): the sink-free result over every key of the ring, compute dtype
    output, lse = _RingAttention.apply(query, key, value, is_causal, resolved, enable_gqa, group, layout, rank, world,
                                       plan)
    if sinks is not None:
        output, _ = add_sinks(output, lse, sinks)  # once per query, after the last merge
    return output.to(query.dtype)


# --- Ulysses: an all-to-all from sequence slices to head slices ----------------------------------


def _exchange(x: torch.Tensor, scatter: int, gather: int, group: dist.ProcessGroup | None, world: int,
              counter: str) -> torch.Tensor:
    """Cut ``x`` in ``world`` equal parts along dim ``scatter``, send part ``j`` to group rank ``j``, and
    join the parts received, in rank order, along dim ``gather``. Counted in `CommStats` as ``counter``."""
    parts = x.chunk(world, dim=scatter)
    send = torch.stack(parts).contiguous()  # (world, *part): part j at index j, as all_to_all_single splits
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[i]: what rank i sent this rank
    _record(**{counter: 1, f"{counter}_bytes": (world - 1) * parts[0].numel() * x.element_size()})
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
    rank, world = _group_info(group, "ulysses_attention")
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
        documents = _documents(cu_seqlens, n * world, query.device)
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
    layout = _check_layout(layout)
    u_rank, u_world = _group_info(ulysses_group, "usp_attention (ulysses_group)")
    _, r_world = _group_info(ring_group, "usp_attention (ring_group)")
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


# --- local processes --------------------------------------------------------------------------


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):  # pragma: no cover - platforms without if_nameindex
        return None
    return next((name for name in names if name.startswith("lo")), None)


def _run_worker(rank: int, world: int, fn: Callable[..., Any], args: tuple[Any, ...], folder: str, timeout: float
                ) -> None:
    """The body of one spawned process: join the group, run ``fn``, save its result, leave the group."""
    loopback = _loopback_interface()
    if loopback is not None:  # gloo listens on the loopback interface only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the processes share the cores
    # Rendezvous through a file: no TCP store listening on every interface.
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        # torch no longer waits for every rank after building the group: without this barrier a rank whose
        # `fn` does no collective can leave, closing its sockets, while another is still connecting to it
        # (gloo: "connectFullMesh failed ... Connection closed by peer", seen once in a check).
        dist.barrier()
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(folder, f"result_{rank}.pt"))
        dist.barrier()  # and none leaves while another may still be reading what it sent
    finally:
        dist.destroy_process_group()


#: What the server of new processes imports once (multiprocessing's "forkserver"): each process of `spawn`
#: is a fork of it, with torch already imported, where a fresh interpreter spends one to two seconds of a
#: core importing it (measured on 2 cores: the distributed and Ulysses tests kept the machine busy 17.5
#: CPU-seconds this way, 35 with fresh interpreters). Not this package: each process imports it anew, so
#: that an edit of it (``mkdocs serve``, a notebook) is what the next `spawn` runs.
FORKSERVER_PRELOAD = ("torch", "torch.distributed")


def _start_method() -> str:
    """``"forkserver"`` (preloading `FORKSERVER_PRELOAD`) where the platform has it, else ``"spawn"``."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return "spawn"
    mp.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return "forkserver"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes joined by gloo; return their results.

    Each process is started with ``torch.multiprocessing``, forked from a server
    process that has imported torch only (the ``"forkserver"`` method; where the
    platform has none, ``"spawn"``: a fresh interpreter). It joins a gloo process
    group of ``world_size`` ranks (rendezvous through a file in a temporary folder; gloo connects the
    processes over the loopback interface), runs ``fn``, saves what it returns,
    and destroys the process group even when ``fn`` raises. Each uses
    ``cpu_count // world_size`` threads. If a process raises, the others are
    stopped and the error is raised here; if they have not all finished after
    ``timeout`` seconds (a rank waiting for one that failed waits at most that
    long too), they are stopped and ``TimeoutError`` is raised. The new processes
    import the caller's main module again: in a script, call ``spawn`` under
    ``if __name__ == "__main__":``.

    Args:
        fn: a function defined at the top level of an importable module (the
            new processes import it), called as ``fn(rank, world_size, *args)``;
            its return value must be picklable (tensors, numbers, dicts, ...).
        world_size: the number of processes, >= 1.
        *args: passed to ``fn``; picklable.
        timeout: seconds for the whole run, and for each collective inside it.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        TypeError: ``fn`` or ``args`` cannot be sent to a new process.
        ValueError: ``world_size < 1`` or a non-positive timeout.
        TimeoutError: the processes did not finish in time.
        RuntimeError: a process exited without a result and without an error.
        torch.multiprocessing.ProcessRaisedException: a process raised (its traceback is in the message).

    Examples:
        >>> spawn(demo_worker, 1)[0]["max_error"] < 1e-12    # one process: the ring has one rank
        True
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"spawn needs fn and args that a new process can import and unpickle (fn defined at the top "
            f"level of a module, not in a notebook cell or a page), got {fn!r}: {error}"
        ) from None
    folder = tempfile.mkdtemp(prefix="attention_ref_spawn_")
    try:
        context = mp.start_processes(_run_worker, args=(world_size, fn, args, folder, float(timeout)),
                                     nprocs=world_size, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join()
                raise TimeoutError(f"spawn: the {world_size} processes did not finish within {timeout} s")
        paths = [os.path.join(folder, f"result_{rank}.pt") for rank in range(world_size)]
        missing = [rank for rank, path in enumerate(paths) if not os.path.exists(path)]
        if missing:  # e.g. a process that exited while importing the caller's main module
            raise RuntimeError(f"spawn: ranks {missing} exited without returning a result")
        return [torch.load(path, weights_only=False) for path in paths]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def demo_worker(rank: int, world: int, seed: int = 0, layout: str = "zigzag", is_causal: bool = True,
                strategy: str = "ring", window: int | None = None) -> dict[str, Any]:
    """Ring, Ulysses or USP attention on ``world`` ranks, forward and backward, checked against one process.

    Every rank draws the same full float64 tensors from ``seed`` (``B=1``,
    ``H=4`` query heads, ``Hkv=2`` key/value heads, ``L = 12 * world``
    positions, ``E=Ev=8``), takes its part with `shard`, runs `ring_attention`
    (or `ulysses_attention`, `usp_attention`) and its backward pass (incoming
    gradient ``dO`` drawn from the seed too), gathers the output and the
    gradients with `unshard`, and compares them with
    `attention_ref.functional.scaled_dot_product_attention` on the full tensors.
    Run it with `spawn`.

    USP runs on a grid of ``U x R`` ranks, ``U = 2`` when ``world`` is even (else
    1) and ``R = world / U``: each row, ``U`` consecutive ranks, is a Ulysses group,
    each column (the ranks at one place in every row) a ring. Every rank creates
    every group with ``torch.distributed.new_group``, in the same order (the rows,
    then the columns). A tensor is cut across the column first (`shard` with
    ``layout``), then within the row (``"contiguous"``), as `usp_attention` takes it.

    Args:
        rank: this process's rank (given by `spawn`).
        world: the number of ranks (given by `spawn`).
        seed: the seed of the inputs.
        layout: ``"zigzag"`` or ``"contiguous"`` (Ulysses: ``"contiguous"`` only; USP:
            the ring's layout).
        is_causal: causal attention.
        strategy: ``"ring"`` (`ring_attention`), ``"ulysses"`` (`ulysses_attention`) or
            ``"usp"`` (`usp_attention` on the grid above).
        window: a sliding window of that many earlier keys (and the query's own),
            ``mask_mod=attention_ref.mods.sliding_window(window)`` for any strategy; the
            ring's plan then skips the slices no rank further along needs.

    Returns:
        A dict: ``"inputs"`` (the full ``q, k, v``), ``"output"`` (the gathered
        output), ``"grads"`` (the gathered ``dq, dk, dv``), ``"max_error"`` (the
        largest absolute difference from one process, output and gradients),
        ``"stats"`` (this rank's `CommStats` as a dict) and ``"positions"`` (the
        global positions this rank held).

    Raises:
        ValueError: an unknown ``strategy``, or ``"ulysses"`` with a layout other than
            ``"contiguous"``.

    Examples:
        >>> import os, tempfile, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> result = demo_worker(0, 1, 3, "contiguous")     # what one of spawn's processes runs
        >>> result["output"].shape, result["max_error"] < 1e-12
        (torch.Size([1, 4, 12, 8]), True)
        >>> demo_worker(0, 1, 3, strategy="usp")["max_error"] < 1e-12   # a 1 x 1 grid
        True
        >>> dist.destroy_process_group()
    """
    if strategy not in ("ring", "ulysses", "usp"):
        raise ValueError(f"strategy must be 'ring', 'ulysses' or 'usp', got {strategy!r}")
    if strategy == "ulysses" and layout != "contiguous":
        raise ValueError(f"Ulysses takes contiguous slices: layout must be 'contiguous', got {layout!r}")
    mask_mod = None if window is None else _mods.sliding_window(window)
    gen = torch.Generator().manual_seed(seed)
    B, H, Hkv, E = 1, 4, 2, 8
    L = 12 * world

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, d_out = draw(B, H, L, E), draw(B, Hkv, L, E), draw(B, Hkv, L, E), draw(B, H, L, E)
    if strategy == "usp":
        # U x R ranks: rows of U = 2 (an even world) or 1, columns of R = world / U
        U = 2 if world % 2 == 0 else 1
        # every rank creates every group, in one order: the rows, then the columns
        rows = [dist.new_group(list(range(i, i + U))) for i in range(0, world, U)]
        columns = [dist.new_group(list(range(j, world, U))) for j in range(U)]
        row, column = rows[rank // U], columns[rank % U]
    # how a full tensor is cut: by each (group, layout) in turn
    cuts: list[tuple[dist.ProcessGroup | None, str]] = [(None, layout)]
    attend: Callable[..., torch.Tensor]
    attend = functools.partial(ring_attention, layout=layout, mask_mod=mask_mod)
    if strategy == "ulysses":
        attend = functools.partial(ulysses_attention, mask_mod=mask_mod)
    if strategy == "usp":
        # across the ring (the column), then within the row
        cuts = [(column, layout), (row, "contiguous")]
        attend = functools.partial(usp_attention, ulysses_group=row,
                                   ring_group=column, layout=layout, mask_mod=mask_mod)

    def part(t: torch.Tensor) -> torch.Tensor:
        for group, how in cuts:
            t = shard(t, group=group, layout=how)
        return t

    def whole(t: torch.Tensor) -> torch.Tensor:
        for group, how in reversed(cuts):
            t = unshard(t, group=group, layout=how)
        return t

    # this rank's parts: (B, H | Hkv, L / world, E)
    local = [part(t).requires_grad_() for t in (q, k, v)]
    with count_communication() as stats:
        out = attend(*local, is_causal=is_causal, enable_gqa=True)
        out.backward(part(d_out))  # this rank's part of dO
    # the full output and gradients, on every rank
    gathered = [whole(t.detach()) for t in (out, *(x.grad for x in local))]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = scaled_dot_product_attention(*full, is_causal=is_causal, enable_gqa=True, mask_mod=mask_mod)
    expected_grads = torch.autograd.grad(expected, full, d_out)
    error = max((a - b).abs().max().item() for a, b in zip(gathered, (expected, *expected_grads)))
    return {
        "inputs": (q, k, v),
        "output": gathered[0],
        "grads": tuple(gathered[1:]),
        "max_error": error,
        "stats": dataclasses.asdict(stats),
        "positions": part(torch.arange(L)[:, None]).flatten().tolist(),
    }
