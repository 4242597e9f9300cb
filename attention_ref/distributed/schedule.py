"""The ring's schedule: which chunk pairs each rank computes at each step, and how far each slice travels.

`ring_schedule` and `ring_hops` are the public view; `Mask` (what decides which key a query
sees) and `Plan` (one rank's blocks, their masks and the slices' hops) are what
`attention_ref.distributed.ring` runs by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref.block_mask import band_of
from attention_ref.distributed.layouts import (
    Piece,
    check_layout,
    documents_of,
    layout_offsets,
    pieces_of,
    required_multiple,
)


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


class Mask(NamedTuple):
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


def _pair_keep(mask: Mask, q: Piece, kv: Piece, device: torch.device | str | None) -> torch.Tensor | None:
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


def _bounded_kind(mask: Mask, q: Piece, kv: Piece) -> str | None:
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


def _rank_blocks(rank: int, world: int, pieces: list[list[Piece]], mask: Mask,
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
    layout = check_layout(layout)
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
        length = required_multiple(world, layout)  # any multiple: the chunks' indices alone decide
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"length must be an int, got {type(length).__name__}")
    if length % required_multiple(world, layout):
        raise ValueError(f"length must be a multiple of {required_multiple(world, layout)} with layout={layout!r} "
                         f"and world={world}, got {length}")
    cu = layout_offsets("ring_schedule", layout, cu_seqlens, length, world, None)
    documents = None if cu_seqlens is None else documents_of(cu_seqlens, length, torch.device("cpu"))
    mask = Mask(is_causal, documents, mask_mod, batch, length)
    pieces = [pieces_of(rank, world, length // world, layout, cu) for rank in range(world)]
    return [_rank_blocks(rank, world, pieces, mask) for rank in range(world)]


class Plan(NamedTuple):
    """Everything a rank needs to know of the ring before it starts: its blocks, their masks, which
    chunks every rank holds, and how far each slice travels (`ring_hops`)."""

    blocks: list[RingBlock]  # this rank's, in ring order
    keeps: dict[tuple[int, int, int], torch.Tensor | None]  # (step, q_chunk, kv_chunk) -> mask of a computed block
    pieces: list[dict[int, Piece]]  # per rank: chunk -> where it lies
    hops: list[int]  # per rank: the steps its slice travels
    unmasked: bool  # no mask at all: a whole slice in one call

    @staticmethod
    def make(rank: int, world: int, n: int, layout: str, mask: Mask, cu: list[int] | None,
             device: torch.device) -> Plan:
        pieces = [pieces_of(r, world, n, layout, cu) for r in range(world)]
        keeps: dict[tuple[int, int, int], torch.Tensor | None] = {}
        # Every rank's blocks decide how far the slices travel; only this rank's masks are kept.
        schedule = [_rank_blocks(r, world, pieces, mask, device, keeps if r == rank else None) for r in range(world)]
        return Plan(schedule[rank], keeps, [{p.chunk: p for p in ps} for ps in pieces], ring_hops(schedule),
                    mask.by_index and not mask.is_causal)

    def sends_kv(self, rank: int, world: int, step: int) -> tuple[bool, bool]:
        """Whether this rank passes its key/value slice on after ``step``, and receives the next one."""
        held, arriving = (rank - step) % world, (rank - 1 - step) % world
        return step < self.hops[held], step < self.hops[arriving]
