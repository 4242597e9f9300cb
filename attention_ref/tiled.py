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

import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from attention_ref import _inputs, mods
from attention_ref._validation import check_positive_int, fmt_shape
from attention_ref.sinks import add_sinks, check_sinks, heads_of

__all__ = ["ADAPT_THREADS", "DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "BlockMask", "create_block_mask", "fitting_threads",
           "tiled_attention"]

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
#: The kinds of a (query block, key block) pair in a `BlockMask`.
_EMPTY, _PARTIAL, _FULL = 0, 1, 2
#: With a block mask, neighbouring non-empty key blocks are computed together, up to this many keys.
_SPAN_KEYS = 512
#: How many bytes of partial-block masks (as additive biases) a `BlockMask` keeps for later calls.
_PIECE_CACHE_BYTES = 64 * 2**20
#: Whether a tiled call on CPU runs on fewer intra-op threads while other processes keep cores
#: busy (read from Linux's /proc; elsewhere the threads stay as they are). The path issues many
#: small parallel operations per block, and each waits for its slowest thread: a thread that
#: shares its core with another process stalls every one of them (benchmarks/block_mask_bench.py
#: measured the tiled path 2.0x faster on one thread than on two with one of two cores busy).
ADAPT_THREADS = True
#: Calls with fewer (query, key) pairs than this keep their threads (the check costs ~0.1 ms, 8 ms more
#: when a core looks busy).
_ADAPT_MIN_PAIRS = 2**22


def _runnable() -> int:
    """Runnable tasks of the whole machine right now (the count before the slash in /proc/loadavg)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def _own_running() -> int:
    """This process's threads that are running or runnable (state ``R`` in /proc/self/task/*/stat)."""
    own = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        own += stat[stat.rindex(")") + 2] == "R"  # the state follows the command name
    return own


#: Seconds between the readings of `_others_running`: a task that runs for less than twice this
#: (a short-lived process, this process's OpenMP workers spinning down) is not load. At 1 ms, a
#: quiet process still chose one thread in 1 of 40 calls now and then (benchmarks/threads_bench.py).
_READING_GAP_S = 0.004


def _others_running() -> int:
    """Runnable tasks of other processes right now: the least of three paired readings, 4 ms apart,
    of the machine's runnable tasks minus this process's own at that moment.

    A process that keeps a core busy shows in every reading; a passing task, or this process's
    OpenMP workers still spinning just after a parallel region, does not (read back to back, the
    three readings counted them, and a quiet call ran at 0.47x: issue 30).
    """
    least = _runnable() - _own_running()
    for _ in range(2):
        if least <= 0:
            break
        time.sleep(_READING_GAP_S)
        least = min(least, _runnable() - _own_running())
    return max(least, 0)


def fitting_threads() -> int | None:
    """The intra-op threads a tiled call should use now, or ``None`` to keep ``torch.get_num_threads()``.

    ``torch.get_num_threads()`` minus the cores other processes keep busy (the
    machine's runnable tasks, least of three readings so a passing task does not
    count, minus this process's own), at least 1; ``None`` when nothing is busy,
    when `ADAPT_THREADS` is False, or where ``/proc`` cannot tell.
    """
    if not ADAPT_THREADS:
        return None
    try:
        busy = _others_running()
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux, or /proc unreadable
        return None
    threads = torch.get_num_threads()
    fitting = max(1, min(threads, cores - busy))
    return fitting if fitting < threads else None


@contextlib.contextmanager
def _threads_for(pairs: int, device: torch.device):
    """Run the body on `fitting_threads` intra-op threads (restored after) when the call is large enough."""
    threads = fitting_threads() if device.type == "cpu" and pairs >= _ADAPT_MIN_PAIRS else None
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pairs(q: torch.Tensor, k: torch.Tensor) -> int:
    """(query, key) pairs of a call on `_TiledAttention`'s layouts: q (NK, G, L, E), k (NK, S, E)."""
    NK, G, L, _ = q.shape
    return NK * G * L * k.shape[-2]


class _PieceCache:
    """A block mask's ``mask_mod`` on its partial blocks, as additive biases (0 / -inf), kept after first use.

    Keyed by the rows and columns of the piece, the dtype, the device and the shapes of
    the index grids (the call's batch and heads); at most `_PIECE_CACHE_BYTES` bytes:
    past that, the pieces not kept are evaluated on every use.
    """

    def __init__(self) -> None:
        self.pieces: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0

    def get(self, mask_mod: mods.MaskMod, grids: tuple[torch.Tensor, ...], i0: int, i1: int, j0: int, j1: int,
            dtype: torch.dtype) -> torch.Tensor:
        key = (i0, i1, j0, j1, dtype, grids[0].device, tuple(tuple(g.shape) for g in grids))
        bias = self.pieces.get(key)
        if bias is None:
            bias = _bool_to_bias(_mod_block(mask_mod, grids, i0, i1, j0, j1), dtype)
            if self.nbytes + bias.nbytes <= _PIECE_CACHE_BYTES:
                self.pieces[key] = bias
                self.nbytes += bias.nbytes
        return bias


_creating = threading.local()  # set while create_block_mask builds a BlockMask: its kinds need no check


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Which blocks of the ``(L, S)`` scores a ``mask_mod`` empties, cuts or keeps whole.

    Made by `create_block_mask`; the tiled path skips the empty pairs of
    (query block, key block) in the forward and the backward pass, computes the
    full ones without evaluating the mod, and evaluates it only on the partial
    ones. The same idea as FlexAttention's ``BlockMask``, for this path's blocks.

    Attributes:
        mask_mod: the mod it was made from.
        B, H: the batch and heads it was evaluated for (1 = the mod does not
            depend on ``b`` / ``h``).
        L, S: query and key length.
        block_q, block_k: the block sizes; the attention call must use the same.
        kinds: ``(ceil(L / block_q), ceil(S / block_k))`` int8: 0 empty (no
            pair of the block takes part, for any ``b`` and ``h``), 1 partial,
            2 full (every pair takes part).

    A block mask is a snapshot of its mod, as FlexAttention's is: besides the
    kinds, it keeps the mod's values on the partial blocks the first call
    evaluates (as additive biases, up to 64 MiB), so later calls that reuse it
    (every layer of a forward pass) evaluate the mod on no block at all. Make a
    new block mask when the data a mod reads (document ids, lengths) changes.
    """

    mask_mod: mods.MaskMod
    B: int
    H: int
    L: int
    S: int
    block_q: int
    block_k: int
    kinds: torch.Tensor
    _pieces: _PieceCache = field(default_factory=_PieceCache, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built by hand (or by dataclasses.replace): the kinds decide which blocks are skipped or
        # computed without the mod, so kinds that disagree with the mod would silently give another
        # mask. Check them (issue 39, S3); create_block_mask's own are right by construction.
        if getattr(_creating, "active", False):
            return
        for name in ("B", "H", "L", "S"):
            check_positive_int(name, getattr(self, name), allow_zero=True)
        check_positive_int("block_q", self.block_q)
        check_positive_int("block_k", self.block_k)
        mods.check_mod("mask_mod", self.mask_mod, "mask")
        made = create_block_mask(self.mask_mod, self.B, self.H, self.L, self.S, block_q=self.block_q,
                                 block_k=self.block_k, device=getattr(self.kinds, "device", None))
        if not isinstance(self.kinds, torch.Tensor) or tuple(self.kinds.shape) != tuple(made.kinds.shape):
            got = tuple(self.kinds.shape) if isinstance(self.kinds, torch.Tensor) else type(self.kinds).__name__
            raise ValueError(f"kinds must have shape (ceil(L / block_q), ceil(S / block_k)) = "
                             f"{tuple(made.kinds.shape)}, got {got}")
        wrong = (self.kinds.to(made.kinds.dtype) != made.kinds).nonzero()
        if len(wrong):
            i, j = wrong[0].tolist()
            names = {_EMPTY: "empty", _PARTIAL: "partial", _FULL: "full"}
            raise ValueError(
                f"kinds do not match mask_mod: block ({i}, {j}) is given as {names.get(int(self.kinds[i, j]), int(self.kinds[i, j]))!r} "
                f"but the mod makes it {names[int(made.kinds[i, j])]!r} ({len(wrong)} blocks differ); make "
                f"block masks with create_block_mask"
            )

    @property
    def fraction_skipped(self) -> float:
        """The fraction of blocks never computed (0.0 for an empty grid)."""
        total = self.kinds.numel()
        return float((self.kinds == _EMPTY).sum()) / total if total else 0.0

    def counts(self) -> dict[str, int]:
        """How many blocks are empty, partial and full."""
        return {name: int((self.kinds == kind).sum())
                for name, kind in (("empty", _EMPTY), ("partial", _PARTIAL), ("full", _FULL))}

    def __repr__(self) -> str:
        c = self.counts()
        return (f"BlockMask(B={self.B}, H={self.H}, L={self.L}, S={self.S}, block_q={self.block_q}, "
                f"block_k={self.block_k}, empty={c['empty']}, partial={c['partial']}, full={c['full']})")


def create_block_mask(
    mask_mod: mods.MaskMod,
    B: int | None,
    H: int | None,
    L: int,
    S: int,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    device: torch.device | str | None = None,
) -> BlockMask:
    """Classify every (query block, key block) pair of ``mask_mod`` as empty, partial or full.

    The mod is evaluated one strip of ``block_q`` query rows at a time (a
    ``(B, H, block_q, S)`` boolean at most), so this never forms the whole
    ``(L, S)`` mask. A block is empty when no ``(b, h, i, j)`` in it takes
    part and full when every one does.

    Two mods are not evaluated at all: `mods.causal` and `mods.sliding_window`
    without sink tokens, recognised by `mods.describe`, keep the band
    ``i + low <= j <= i + high`` whose ends grow by one key per query, so each
    block's kind follows exactly from its corners (``O(blocks)`` work instead
    of ``O(L * S)``; at ``L = S = 8192`` a fraction of a millisecond instead of
    tenths of a second, ``benchmarks/block_mask_bench.py``). Every other mod,
    hand-written or combined with `mods.and_masks`, is evaluated.

    Build it once and pass it as ``block_mask=`` to every call with the same
    mask and sizes (`attention_ref.scaled_dot_product_attention` and the
    functions built on it take it too); a call given only a ``mask_mod`` builds
    one each time.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ``True`` = takes part.
        B: batch size; ``None`` = 1, for a mod that does not depend on ``b``
            (as FlexAttention's ``create_block_mask``).
        H: heads; ``None`` = 1, for a mod that does not depend on ``h``.
        L: query length.
        S: key length.
        block_q: queries per block, as the attention call will use.
        block_k: keys per block, as the attention call will use.
        device: where to evaluate the mod.

    Returns:
        A `BlockMask`.

    Raises:
        TypeError: ``mask_mod`` not a mask mod, or returning a non-bool tensor.
        ValueError: negative sizes, non-positive block sizes, a mod built from
            tensors that do not fit ``(B, H, L, S)``.

    Examples:
        >>> from attention_ref import mods
        >>> bm = create_block_mask(mods.sliding_window(3), None, None, 8, 8, block_q=2, block_k=2)
        >>> bm.kinds.tolist()  # 0 empty, 1 partial, 2 full
        [[1, 0, 0, 0], [2, 1, 0, 0], [1, 2, 1, 0], [0, 1, 2, 1]]
        >>> bm.counts(), bm.fraction_skipped
        ({'empty': 7, 'partial': 6, 'full': 3}, 0.4375)
    """
    mods.check_mod("mask_mod", mask_mod, "mask")
    B = 1 if B is None else check_positive_int("B", B, allow_zero=True)
    H = 1 if H is None else check_positive_int("H", H, allow_zero=True)
    check_positive_int("L", L, allow_zero=True)
    check_positive_int("S", S, allow_zero=True)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    mods.validate_sizes(mask_mod, B, H, L, S)
    band = _band_of(mask_mod)
    if band is not None:  # a described band: from its block corners, exactly, without evaluating the mod
        kinds = _band_kinds(*band, L, S, block_q, block_k)
    else:
        kinds = _evaluated_kinds(mask_mod, B, H, L, S, block_q, block_k, device)
    _creating.active = True
    try:
        return BlockMask(mask_mod, B, H, L, S, block_q, block_k, kinds)
    finally:
        _creating.active = False


def _band_of(mask_mod: mods.MaskMod) -> tuple[int | None, int | None] | None:
    """``(low, high)`` when ``mask_mod`` keeps key ``j`` for query ``i`` exactly when
    ``i + low <= j <= i + high`` (``None`` = no bound), read from `mods.describe`; else ``None``.

    `mods.causal` and `mods.sliding_window` (without sink tokens, whose rows are two
    intervals) are such bands; every other mod, hand-written or combined, is evaluated.
    """
    made = mods.describe(mask_mod)
    if made is None:
        return None
    name, args = made
    if name == "causal":
        return None, int(args["offset"])
    if name == "sliding_window" and (args["sink_tokens"] == 0 or args["left"] is None):
        left, right, offset = args["left"], args["right"], int(args["offset"])
        return (None if left is None else offset - left), (None if right is None else offset + right)
    return None


def _band_kinds(low: int | None, high: int | None, L: int, S: int, block_q: int, block_k: int) -> torch.Tensor:
    """The kinds of the band ``i + low <= j <= i + high``, from each block's corners.

    Both ends grow with ``i`` (slope 1), so for the block of rows ``i0..i1`` and
    keys ``j0..j1`` (inclusive):

    - full  iff its bottom-left and top-right corners are kept:
      ``j0 >= i1 + low`` and ``j1 <= i0 + high``;
    - empty iff no row meets it: the rows whose window reaches ``j0`` (``i >= j0 - high``)
      and those whose window starts by ``j1`` (``i <= j1 - low``) share none in ``i0..i1``.

    Exact for every block (tested against the evaluated mask); ``O(blocks)`` work.
    """
    nq, nk = -(-L // block_q), -(-S // block_k)
    i0 = torch.arange(nq, dtype=torch.long).mul_(block_q)[:, None]  # (nq, 1): first row of each query block
    i1 = (i0 + block_q).clamp_(max=L) - 1  # its last row
    j0 = torch.arange(nk, dtype=torch.long).mul_(block_k)[None, :]  # (1, nk): first key of each key block
    j1 = (j0 + block_k).clamp_(max=S) - 1  # its last key
    full = torch.ones(nq, nk, dtype=torch.bool)
    first, last = i0.expand(nq, nk), i1.expand(nq, nk)  # the rows of a block that may meet the band
    if low is not None:
        full &= j0 >= i1 + low
        last = torch.minimum(last, j1 - low)
    if high is not None:
        full &= j1 <= i0 + high
        first = torch.maximum(first, j0 - high)
    any_ = first <= last
    return torch.where(full, _FULL, torch.where(any_, _PARTIAL, _EMPTY)).to(torch.int8)


def _evaluated_kinds(
    mask_mod: mods.MaskMod, B: int, H: int, L: int, S: int, block_q: int, block_k: int,
    device: torch.device | str | None,
) -> torch.Tensor:
    """The kinds of any mod, evaluated one strip of ``block_q`` query rows (``(B, H, bq, S)`` at most) at a time.

    Each strip is reduced in place, read as bytes: its max over a block says whether any pair takes
    part, its min whether every one does (over the dims the mod broadcasts too, which costs nothing);
    a short last key block is reduced on its own instead of padding the strip.
    """
    nq, nk = -(-L // block_q), -(-S // block_k)
    whole = S // block_k  # key blocks of full width
    kinds = torch.empty(nq, nk, dtype=torch.int8)
    if nk == 0:
        return kinds
    grids = _grids((B, H), L, S, device)
    for qi, (i0, i1) in enumerate(_blocks(L, block_q)):
        keep = _checked_strip(mask_mod, (B, H), grids, i0, i1, S)  # broadcastable to (B, H, bq, S)
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))  # 4 dims, for the views below
        u = keep.view(torch.uint8).expand(*keep.shape[:-1], S)  # (..., bq', S): 0/1 bytes, a view
        lead = tuple(range(u.dim() - 1))  # every dim but the keys'
        parts = []
        if whole:
            blocks = u[..., : whole * block_k].unflatten(-1, (whole, block_k))  # (..., bq', nk, bk), a view
            dims = (*lead, u.dim())
            parts.append((blocks.amax(dim=dims), blocks.amin(dim=dims)))  # (whole,) each
        if whole < nk:
            tail = u[..., whole * block_k:]  # the short last key block
            parts.append((tail.amax().reshape(1), tail.amin().reshape(1)))
        any_ = torch.cat([a for a, _ in parts]).bool()
        all_ = torch.cat([b for _, b in parts]).bool()
        kinds[qi] = torch.where(all_, _FULL, torch.where(any_, _PARTIAL, _EMPTY)).to(torch.int8).cpu()
    return kinds


def _checked_strip(
    mask_mod: mods.MaskMod, batch: tuple[int, ...], grids: tuple[torch.Tensor, ...], i0: int, i1: int, S: int
) -> torch.Tensor:
    """``mask_mod`` on query rows i0:i1 and every key, checked: bool, broadcastable to ``(*batch, bq, S)``."""
    keep = _mod_block(mask_mod, grids, i0, i1, 0, S)
    target = (*batch, i1 - i0, S)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = takes part), got {got}")
    try:
        fits = tuple(torch.broadcast_shapes(keep.shape, target)) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask_mod must return a tensor broadcastable to the scores (B, H, L, S), here to its "
            f"query rows {i0}..{i1 - 1}: {fmt_shape(target)}, got shape {fmt_shape(keep.shape)}"
        )
    return keep


def _mod_sizes(batch: tuple[int, ...]) -> tuple[int, int]:
    """``(B, H)`` of a call whose scores have leading dims ``batch``, as the mods index them."""
    return math.prod(batch[:-1]), (batch[-1] if batch else 1)


def _block_mask_mod(mask_mod: mods.MaskMod | None, block_mask: object) -> mods.MaskMod | None:
    """The mask mod of a call given ``mask_mod`` and/or ``block_mask``: the block mask's own mod.

    Passing both is allowed only when ``mask_mod`` *is* ``block_mask.mask_mod`` (the
    same function object): two different mods would leave it unclear which one masks.

    Raises:
        TypeError: ``block_mask`` is not a `BlockMask`.
        ValueError: ``mask_mod`` is another function than ``block_mask.mask_mod``.
    """
    if block_mask is None:
        return mask_mod
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be an attention_ref.tiled.BlockMask, got {type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod and block_mask.mask_mod must be the same function (or pass only block_mask)")
    return block_mask.mask_mod


def _made_by(block_mask: object, attribute: str, maker: str) -> tuple[mods.MaskMod, tuple]:
    """The mod of ``block_mask`` and the arguments ``maker`` recorded on it as ``attribute``.

    Raises:
        TypeError: ``block_mask`` is not a `BlockMask`.
        ValueError: its mod was not made by ``maker``.
    """
    mask_mod = _block_mask_mod(None, block_mask)  # TypeError unless a BlockMask
    made = getattr(mask_mod, attribute, None)
    if made is None:
        raise ValueError(f"block_mask must be made from {maker}, got a block mask of another mask_mod")
    return mask_mod, made


def _check_block_mask(
    block_mask: BlockMask,
    mask_mod: mods.MaskMod | None,
    batch: tuple[int, ...],
    L: int,
    S: int,
    block_q: int | None = None,
    block_k: int | None = None,
) -> None:
    """A ``block_mask`` must have been made for this call's mod, sizes and blocks (``None``: any blocks)."""
    _block_mask_mod(mask_mod, block_mask)
    B, H = _mod_sizes(batch)
    expected = {"L": L, "S": S, "block_q": block_q, "block_k": block_k}
    for name, want in expected.items():
        got = getattr(block_mask, name)
        if want is not None and got != want:
            raise ValueError(f"block_mask was made for {name}={got}, this call has {name}={want}")
    for name, want in (("B", B), ("H", H)):
        got = getattr(block_mask, name)
        if got not in (1, want):
            raise ValueError(f"block_mask was made for {name}={got}, this call has {name}={want} (1 broadcasts)")
    grid = (-(-block_mask.L // block_mask.block_q), -(-block_mask.S // block_mask.block_k))
    kinds = block_mask.kinds
    if not isinstance(kinds, torch.Tensor) or tuple(kinds.shape) != grid:
        got = fmt_shape(kinds.shape) if isinstance(kinds, torch.Tensor) else type(kinds).__name__
        raise ValueError(
            f"block_mask.kinds must have shape (ceil(L / block_q), ceil(S / block_k)) = {fmt_shape(grid)}, got {got}"
        )


def _check_score_mod(score_mod: mods.ScoreMod, batch: tuple[int, ...], L: int, S: int, query: torch.Tensor) -> None:
    """Check the sizes a score mod carries, and refuse one whose result would need gradients of its own."""
    B, H = _mod_sizes(batch)
    mods.validate_sizes(score_mod, B, H, L, S)
    if L == 0 or S == 0:
        return
    probe = torch.zeros((1,) * (len(batch) + 2), dtype=torch.promote_types(query.dtype, torch.float32),
                        device=query.device)
    with torch.enable_grad():
        _, _, b, h, q_idx, kv_idx = mods.index_grids((1,) * len(batch), 1, 1, query.device)
        result = score_mod(probe, b, h, q_idx, kv_idx)
    if isinstance(result, torch.Tensor) and result.requires_grad:
        raise ValueError(
            "backend 'tiled' cannot differentiate a score_mod with respect to the tensors it captures "
            "(its result requires grad); use backend='math'"
        )


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        block_q: queries per block; ``None`` = ``block_mask.block_q`` when a
            ``block_mask`` is given, else `DEFAULT_BLOCK_Q`.
        block_k: keys per block; ``None`` = ``block_mask.block_k``, else
            `DEFAULT_BLOCK_K`. Neither needs to divide ``L`` or ``S``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, applied to each
            block of scaled scores before the masks (the order of
            `attention_ref.functional`). Gradients flow through it to the
            scores; a tensor it captures gets none, so a mod whose result
            requires grad (a learned bias) is refused: use the math backend.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)``, ``True`` = takes part,
            combined (AND) with ``attn_mask`` and ``is_causal``. Blocks it
            removes entirely are skipped, forward and backward; blocks it keeps
            entirely are computed without evaluating it (see `BlockMask`).
        block_mask: a `BlockMask` made in advance by `create_block_mask` with the
            same ``mask_mod`` and block sizes (built here when omitted), so the
            classification of the blocks can be reused across calls. Its mod is
            the call's: ``mask_mod`` may be left out, and if given must be that
            same function.
        return_lse: also return the log-sum-exp of each query row's scores,
            which the online softmax keeps anyway (see
            `attention_ref.scaled_dot_product_attention`); gradients flow
            through it too.
        sinks: ``(H,)`` learned sink logits, one per query head, or one per
            query broadcastable to ``(..., H, L)`` (see `attention_ref.sinks`): added once, after the last key block, by
            `attention_ref.add_sinks` (whose backward is the closed form, so
            no ``(L, S)`` tensor is formed for it either); ``lse`` then
            includes the sink.

    Returns:
        ``(..., L, Ev)`` in ``query``'s dtype, computed in at least float32;
        with ``return_lse`` also ``lse`` ``(..., L)`` in the compute dtype
        (``-inf`` on a row with no key).

    Raises:
        ValueError, TypeError: as `attention_ref.scaled_dot_product_attention`
            (the same validation runs), for block sizes that are not positive
            ints, a ``block_mask`` made for other sizes or another mod, and a
            ``score_mod`` whose result requires grad.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 7, 8), torch.randn(2, 13, 8), torch.randn(2, 13, 4)
        >>> out = tiled_attention(q, k, v, is_causal=True, block_q=3, block_k=5)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    if value is None:
        raise TypeError("value must be a torch.Tensor, got NoneType")
    _inputs.check_mods(score_mod, mask_mod)
    _inputs.check_bool("return_lse", return_lse)
    _block_mask_mod(mask_mod, block_mask)  # a BlockMask, of the same mod
    if block_q is None:
        block_q = DEFAULT_BLOCK_Q if block_mask is None else block_mask.block_q
    if block_k is None:
        block_k = DEFAULT_BLOCK_K if block_mask is None else block_mask.block_k
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if sinks is not None:
        batch = _batch_shape(query, key, value, enable_gqa)
        sinks = check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))
    return _tiled(query, key, value, mask, is_causal=is_causal, scale=resolved, enable_gqa=enable_gqa,
                  block_q=block_q, block_k=block_k, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                  return_lse=return_lse, sinks=sinks)


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
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The tiled path on validated inputs (the dispatcher's entry point; mods and sinks checked)."""
    if query.is_meta:
        raise ValueError("backend='tiled' cannot run on meta tensors: its online softmax reads the values (which "
                         "rows are empty, which blocks to skip); backend='math' gives the shapes on meta")
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    H = query.shape[-3] if enable_gqa else 1
    Hkv = key.shape[-3] if enable_gqa else 1
    G = H // Hkv  # query heads per key/value head (1 without grouped-query attention)
    batch = _batch_shape(query, key, value, enable_gqa)
    kinds = pieces = None
    if block_mask is not None or mask_mod is not None:
        if block_mask is None:
            block_mask = create_block_mask(mask_mod, *_mod_sizes(batch), L, S, block_q=block_q, block_k=block_k,
                                           device=query.device)
        _check_block_mask(block_mask, mask_mod, batch, L, S, block_q, block_k)
        mask_mod, kinds, pieces = block_mask.mask_mod, block_mask.kinds.tolist(), block_mask._pieces
    if score_mod is not None:
        _check_score_mod(score_mod, batch, L, S, query)
    prefix = batch[:-1] if enable_gqa else batch  # the dims in front of the heads
    N = math.prod(prefix)
    compute = torch.promote_types(query.dtype, torch.float32)
    _check_float_mask(mask, compute)
    _inputs.check_scores_bounded(query, key, scale, compute)  # its blocks' scores are never held: bound them
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
    mods_ = (score_mod, mask_mod, kinds, pieces)
    # (N * Hkv, G, L, Ev) and (N * Hkv, G, L, 1), the log-sum-exp in natural-log units
    with _threads_for(_pairs(q, k), q.device):  # fewer threads while other processes keep cores busy
        out, lse = _TiledAttention.apply(q, k, v, mask, is_causal, batch, block_q, block_k, mods_)
    out, lse = out.reshape(*batch, L, Ev), lse.reshape(*batch, L)  # -> (..., L, Ev), (N * Hkv, G, L, 1) -> (..., L)
    if sinks is not None:  # once, over all keys: sink-free blocks merged first, then the sink
        out, lse = add_sinks(out, lse, sinks)
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out


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
    score_mod: mods.ScoreMod | None = None,
    keep: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
    grids: tuple[torch.Tensor, ...] = (),
    offset_last: bool = False,
) -> torch.Tensor:
    """Masked scores (times log2 e) of query rows i0:i1 against keys j0:j1, plus ``offset``: ``(N * Hkv, G * bq, bk)``.

    ``q_blk`` is ``(N * Hkv, G * bq, E)`` (already scaled by ``scale * log2 e``),
    ``kT_blk`` ``(N * Hkv, E, bk)``; ``offset`` ``(N * Hkv, G * bq, 1)`` is added to
    every score of its row (the callers pass minus a running max or minus the
    log-sum-exp). The offset and the masks are written first and the matrix
    product is added onto them (``baddbmm_``): one pass over the block fewer than
    adding them afterwards. ``out`` is a buffer with room for the largest block;
    the result is a contiguous view of its start. ``score_mod`` modifies the
    scores first (then the product cannot be added onto the terms); ``keep``
    lists ``(first column, bias)`` pieces of a ``mask_mod`` (0 / -inf in the
    scores' dtype, each broadcastable to ``(..., H, bq, its width)``) to add to
    those columns.
    """
    NK, GB, _ = q_blk.shape
    bq, bk = i1 - i0, j1 - j0
    s = _buffer(q_blk, NK, GB, bk) if out is None else _start_of(out, NK, GB, bk)
    terms = []  # (a view of s, a term that broadcasts to it), summed into s before the product
    # offset_last (a float mask): the offset is added after the masked scores, in the order of the
    # math path, so that a huge mask value rounds the score away first (transformers' finfo.min rows)
    late = offset if offset_last else None
    if offset is not None and not offset_last:
        terms.append((s, offset))
    if is_causal and j1 - 1 > i0:  # the block reaches above the diagonal: hide keys j > i
        above = torch.full((bq, bk), _NEG_INF, dtype=s.dtype, device=s.device).triu_(i0 - j0 + 1)  # -inf where j > i
        terms.append((s.view(NK, GB // bq, bq, bk), above))  # (bq, bk) broadcasts over the heads
    if mask is not None:
        m_blk = _mask_block(mask, i0, i1, j0, j1)
        # A float mask is added to the scores (times log2 e, like them); a boolean one adds 0 or -inf.
        bias = _bool_to_bias(m_blk, s.dtype) if m_blk.dtype == torch.bool else _float_bias(m_blk, s.dtype)
        terms.append((s.view(*batch, bq, bk), bias))  # (N*Hkv, G*bq, bk) -> (..., H, bq, bk), a view
    for first, piece in keep:  # (..., H, bq, bk) -> the columns of the piece, a strided view
        terms.append((s.view(*batch, bq, bk)[..., first:first + piece.shape[-1]], piece))
    if score_mod is not None:
        # (N*Hkv, G*bq, E) @ (N*Hkv, E, bk) -> (N*Hkv, G*bq, bk), then modified in natural units
        torch.bmm(q_blk, kT_blk, out=s)
        view = s.view(*batch, bq, bk)  # (N*Hkv, G*bq, bk) -> (..., H, bq, bk)
        view.copy_(_modified_scores(score_mod, view, grids, i0, j0)).mul_(_LOG2E)
        for view, term in terms:
            view.add_(term)
        return s if late is None else s.add_(late)
    # (N*Hkv, G*bq, E) @ (N*Hkv, E, bk) -> (N*Hkv, G*bq, bk), added onto the terms
    if not terms:
        torch.bmm(q_blk, kT_blk, out=s)
        return s if late is None else s.add_(late)
    terms.sort(key=lambda vt: vt[0].numel() != s.numel())  # a term over the whole block first
    (view, term), *rest = terms
    if view.numel() == s.numel():
        view.copy_(term.expand_as(view))
    else:  # only pieces (some columns of a span): start from 0
        s.zero_()
        rest = terms
    for view, term in rest:
        view.add_(term)
    s.baddbmm_(q_blk, kT_blk)
    return s if late is None else s.add_(late)


def _grids(batch: tuple[int, ...], L: int, S: int, device: torch.device | str | None) -> tuple[torch.Tensor, ...]:
    """``(b, h, q_idx, kv_idx)`` of the whole ``(*batch, L, S)`` scores, made once per call; blocks slice them."""
    _, _, b, h, q_idx, kv_idx = mods.index_grids(batch, L, S, device)
    return b, h, q_idx, kv_idx


def _modified_scores(
    score_mod: mods.ScoreMod, scores2: torch.Tensor, grids: tuple[torch.Tensor, ...], i0: int, j0: int
) -> torch.Tensor:
    """``score_mod`` applied to a block of scores given in log2 units ``(..., H, bq, bk)``; natural units out."""
    bq, bk = scores2.shape[-2:]
    b, h, q_idx, kv_idx = grids
    return score_mod(scores2 * _LN2, b, h, q_idx[..., i0:i0 + bq, :], kv_idx[..., j0:j0 + bk])


def _mod_block(
    mask_mod: mods.MaskMod, grids: tuple[torch.Tensor, ...], i0: int, i1: int, j0: int, j1: int
) -> torch.Tensor:
    """``mask_mod`` on queries i0:i1 and keys j0:j1: bool, broadcastable to ``(..., H, i1 - i0, j1 - j0)``."""
    b, h, q_idx, kv_idx = grids
    return mask_mod(b, h, q_idx[..., i0:i1, :], kv_idx[..., j0:j1])  # slices of the call's grids: views


def _float_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask block in log2 units. ``finfo(dtype).min`` (transformers' padding value) times
    log2 e overflows to -inf; it stays ``finfo.min``, so that a row masked with it everywhere
    gives what the math path gives (scores + finfo.min round to finfo.min: a uniform row, the
    mean of the values), not a row with no key. `_check_float_mask` refuses the values between
    ``finfo.min`` and ``finfo.min / log2 e``, which no log2-unit score can represent."""
    mask = mask.to(dtype)
    bias = mask * _LOG2E
    return bias.masked_fill_(torch.isneginf(bias) & torch.isfinite(mask), torch.finfo(dtype).min)


def _check_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Refuse a float mask with a value in ``(finfo.min, finfo.min / log2 e)``: log2-unit scores
    cannot hold it, and rounding it to ``finfo.min`` could change which keys a row keeps."""
    if mask is None or mask.dtype == torch.bool or mask.device.type == "meta":
        return
    finfo = torch.finfo(dtype)
    m = mask.to(dtype)
    band = (m > finfo.min) & (m < finfo.min / _LOG2E)
    if bool(band.any()):
        value = float(m[band].flatten()[0])
        raise ValueError(
            f"attn_mask: the tiled backend computes in log2 units and cannot represent float mask values "
            f"between finfo({dtype}).min = {finfo.min:.4g} and finfo.min / log2(e) = {finfo.min / _LOG2E:.4g}; "
            f"got {value:.4g}. Use finfo.min, -inf or a boolean mask (or backend='math')"
        )


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


def _key_spans(
    kinds: list[list[int]] | None, qi: int, last: int, block_k: int, span: int
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(j0, j1, partial)``: the keys below ``last`` that query block ``qi`` computes, in spans.

    Without a block mask, every block. With one, the blocks it does not mark
    empty, neighbours merged into spans of at most ``span`` keys (fewer, larger
    matrix products); ``partial`` lists the ``(j0, j1)`` of the span's partial
    blocks, the only keys on which the ``mask_mod`` is evaluated.
    """
    if kinds is None:
        return [(j0, j1, []) for j0, j1 in _blocks(last, block_k)]
    spans: list[tuple[int, int, list[tuple[int, int]]]] = []
    for kj, kind in enumerate(kinds[qi]):
        j0 = kj * block_k
        if kind == _EMPTY or j0 >= last:
            continue
        j1 = min(j0 + block_k, last)
        partial = [(j0, j1)] if kind == _PARTIAL else []
        if spans and spans[-1][1] == j0 and j1 - spans[-1][0] <= span:
            start, _, before = spans.pop()
            j0, partial = start, before + partial
        spans.append((j0, j1, partial))
    return spans


class _TiledAttention(torch.autograd.Function):
    """softmax(q k^T / log2(e) + mask) v over blocks, q pre-scaled by ``scale * log2 e``.

    Shapes: q (N*Hkv, G, L, E), k (N*Hkv, S, E), v (N*Hkv, S, Ev), all in the compute
    dtype; returns (N*Hkv, G, L, Ev) and the log-sum-exp (N*Hkv, G, L, 1) in natural-log
    units. Inside, ``m_i`` and ``lse`` are in log2 units.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, batch, block_q, block_k, mods_):  # type: ignore[override]
        score_mod, mask_mod, kinds, pieces = mods_
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        out = torch.empty(NK, G, L, Ev, dtype=q.dtype, device=q.device)
        lse = torch.empty(NK, G, L, 1, dtype=q.dtype, device=q.device)
        # With a float mask the backward also needs each row's max and sum apart: a huge mask value
        # (finfo.min) absorbs log2(l) in lse = m + log2(l), and P = exp(S - lse) would lose l.
        float_mask = mask is not None and mask.dtype != torch.bool
        m_rows = torch.empty(NK, G, L, 1, dtype=q.dtype, device=q.device) if float_mask else None
        l_rows = torch.empty_like(m_rows) if m_rows is not None else None
        kT = k.transpose(1, 2)  # (NK, S, E) -> (NK, E, S), a view
        span = max(block_k, _SPAN_KEYS)  # a block mask's neighbouring key blocks are computed together
        float_mask = mask is not None and mask.dtype != torch.bool
        scores = _buffer(q, NK, G * min(block_q, L), min(span if kinds else block_k, S))  # reused by every block
        grids = _grids(batch, L, S, q.device) if score_mod is not None or mask_mod is not None else ()
        for qi, (i0, i1) in enumerate(_blocks(L, block_q)):
            bq = i1 - i0
            q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)  # (NK, G, bq, E) -> (NK, G*bq, E)
            # m_i running max, l_i running sum of exp, acc running sum of exp * v: set by the first span
            m_i = l_i = acc = None
            lazy, neg_m = False, None  # lazy: every row has a finite m_i (then neg_m = -m_i)
            last = min(S, i1) if is_causal else S  # causal: keys j > i1 - 1 are masked for every row
            for j0, j1, partial in _key_spans(kinds, qi, last, block_k, span):
                kT_blk, v_blk = kT[:, :, j0:j1], v[:, j0:j1]
                # The mask_mod runs on the partial blocks only: a block it keeps whole never evaluates it
                # (is_causal still masks the diagonal blocks).
                keep = [(a - j0, pieces.get(mask_mod, grids, i0, i1, a, b, q.dtype)) for a, b in partial]
                if lazy:
                    # Lazy step: p = exp(s - m_i) against the old max, m_i subtracted inside the matmul;
                    # no max of this block, no rescaling. Kept unless the row sums exceed 2**_LAZY_GROWTH.
                    p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                      offset=neg_m, out=scores, score_mod=score_mod, keep=keep, grids=grids,
                                      offset_last=float_mask).exp2_()
                    l_blk = p.sum(dim=-1, keepdim=True)
                    if l_blk.max().item() <= 2.0**_LAZY_GROWTH:  # False on inf, and on NaN (max keeps NaN)
                        l_i += l_blk
                        acc.baddbmm_(p, v_blk)  # (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                        continue
                s = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1, out=scores,
                                  score_mod=score_mod, keep=keep, grids=grids)
                if m_i is None:  # the first span: nothing accumulated yet, nothing to rescale
                    m_i = s.amax(dim=-1, keepdim=True)  # (NK, G*bq, 1)
                    # a row with every score -inf keeps max -inf; shift it by 0 so exp gives 0, not NaN
                    p = s.sub_(m_i.masked_fill(m_i == _NEG_INF, 0.0)).exp2_()
                    l_i = p.sum(dim=-1, keepdim=True)
                    acc = torch.bmm(p, v_blk)  # (NK, G*bq, bk) @ (NK, bk, Ev) -> (NK, G*bq, Ev)
                    lazy = bool((m_i > _NEG_INF).all())
                    neg_m = -m_i
                    continue
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
            if m_i is None:  # no key block to compute (a block mask emptied the row block): no key takes part
                m_i = torch.full((NK, G * bq, 1), _NEG_INF, dtype=q.dtype, device=q.device)
                l_i = torch.zeros(NK, G * bq, 1, dtype=q.dtype, device=q.device)
                acc = torch.zeros(NK, G * bq, Ev, dtype=q.dtype, device=q.device)
            # out = acc / l_i; a row where no key took part has l_i = 0 and acc = 0: it gives 0.
            out[:, :, i0:i1] = (acc / l_i.masked_fill(l_i == 0, 1.0)).view(NK, G, bq, Ev)
            # lse = m_i + log(l_i), the log of the softmax denominator (-inf on fully masked rows).
            lse[:, :, i0:i1] = (m_i + torch.log2(l_i)).view(NK, G, bq, 1)
            if m_rows is not None:
                m_rows[:, :, i0:i1] = m_i.view(NK, G, bq, 1)
                l_rows[:, :, i0:i1] = l_i.view(NK, G, bq, 1)
        none = torch.empty(0)
        ctx.save_for_backward(q, k, v, out, lse, mask if mask is not None else none,
                              m_rows if m_rows is not None else none, l_rows if l_rows is not None else none)
        ctx.has_mask = mask is not None
        ctx.options = (is_causal, batch, block_q, block_k, score_mod, mask_mod, kinds, pieces, grids)
        return out, lse * _LN2  # log2 units -> natural log (-inf stays -inf)

    @staticmethod
    @once_differentiable  # the blockwise backward is not itself differentiable
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        q, k = ctx.saved_tensors[:2]
        with _threads_for(_pairs(q, k), q.device):  # as the forward, on the threads that fit now
            return _TiledAttention._backward(ctx, d_out, d_lse)

    @staticmethod
    def _backward(ctx, d_out, d_lse):
        q, k, v, out, lse, mask, m_rows, l_rows = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        float_mask = mask is not None and mask.dtype != torch.bool
        is_causal, batch, block_q, block_k, score_mod, mask_mod, kinds, pieces, grids = ctx.options
        NK, G, L, E = q.shape
        S, Ev = v.shape[-2:]
        d_out = d_out.to(q.dtype)
        # D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the term the softmax Jacobian subtracts. It and
        # lse enter the blocks' matmuls negated, as their starting values: negated once here.
        # A gradient of the returned lse adds d lse_i / d s_ij = P_ij: dS = P * (dP - (D_i - dlse_i)).
        neg_delta = (d_out * out).sum(dim=-1, keepdim=True).neg_().add_(d_lse.to(q.dtype))  # (NK, G, L, 1)
        # A fully masked row has lse = -inf; +inf makes every recomputed weight exp(-inf - inf) = 0.
        neg_lse = lse.masked_fill(lse == _NEG_INF, float("inf")).neg_()  # (NK, G, L, 1)
        if float_mask:  # P = exp(S - m) / l, the order of the forward (see m_rows there)
            neg_lse = m_rows.masked_fill(m_rows == _NEG_INF, float("inf")).neg_()
            inv_l = 1.0 / l_rows.masked_fill(l_rows == 0, 1.0)  # (NK, G, L, 1)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need_dmask = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if need_dmask else None
        kT, vT = k.transpose(1, 2), v.transpose(1, 2)  # (NK, E, S), (NK, Ev, S): views
        scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for P by every block
        d_scores = _buffer(q, NK, G * min(block_q, L), min(block_k, S))  # reused for dP and dS
        for kj, (j0, j1) in enumerate(_blocks(S, block_k)):
            bk = j1 - j0
            k_blk, kT_blk, vT_blk = k[:, j0:j1], kT[:, :, j0:j1], vT[:, :, j0:j1]
            first = j0 if is_causal else 0  # causal: rows i < j0 see none of these keys
            for qi, (i0, i1) in enumerate(_blocks(L, block_q)):
                if i1 <= first or (kinds is not None and kinds[qi][kj] == _EMPTY):
                    continue
                bq = i1 - i0
                q_blk = q[:, :, i0:i1].reshape(NK, G * bq, E)
                partial = kinds is not None and kinds[qi][kj] == _PARTIAL
                keep = [(0, pieces.get(mask_mod, grids, i0, i1, j0, j1, q.dtype))] if partial else []
                # Recompute the block's weights from the saved log-sum-exp: P = exp(S - lse).
                p = _scores_block(q_blk, kT_blk, mask, is_causal, batch, i0, i1, j0, j1,
                                  offset=neg_lse[:, :, i0:i1].reshape(NK, G * bq, 1), out=scores,
                                  offset_last=float_mask,
                                  score_mod=score_mod, keep=keep, grids=grids).exp2_()
                if float_mask:
                    p.mul_(inv_l[:, :, i0:i1].reshape(NK, G * bq, 1))
                do_blk = d_out[:, :, i0:i1].reshape(NK, G * bq, Ev)
                # dV_j += P^T dO: (NK, bk, G*bq) @ (NK, G*bq, Ev) -> (NK, bk, Ev)
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_blk)
                # dP - D_i = dO V_j^T - D_i: (NK, G*bq, Ev) @ (NK, Ev, bk) -> (NK, G*bq, bk), added onto -D_i
                dp = _start_of(d_scores, *p.shape)
                dp.copy_(neg_delta[:, :, i0:i1].reshape(NK, G * bq, 1).expand_as(dp)).baddbmm_(do_blk, vT_blk)
                # dS = P * (dP - D_i), the softmax backward, in place.
                ds = dp.mul_(p)
                if dmask is not None:  # the mask is added to the scores: its gradient is dS
                    target = _mask_block(dmask, i0, i1, j0, j1)
                    target += ds.view(*batch, bq, bk).sum_to_size(target.shape)
                # Through the score_mod: dS_raw = dS * d score_mod / d raw score (its vector-Jacobian product).
                ds_raw = ds if score_mod is None else _score_mod_vjp(score_mod, q_blk, kT_blk, ds, batch, grids, i0, j0)
                # dQ_i += dS K_j: (NK, G*bq, bk) @ (NK, bk, E) -> (NK, G*bq, E)
                dq[:, :, i0:i1] += torch.bmm(ds_raw, k_blk).view(NK, G, bq, E)
                # dK_j += dS^T Q_i: (NK, bk, G*bq) @ (NK, G*bq, E) -> (NK, bk, E), summed over the group
                dk[:, j0:j1].baddbmm_(ds_raw.transpose(1, 2), q_blk)
        # The scores were log2(e) * q k^T: the chain rule gives dq and dk a factor ln 2 back.
        return dq.mul_(_LN2), dk.mul_(_LN2), dv, dmask, None, None, None, None, None


def _score_mod_vjp(
    score_mod: mods.ScoreMod,
    q_blk: torch.Tensor,
    kT_blk: torch.Tensor,
    ds: torch.Tensor,
    batch: tuple[int, ...],
    grids: tuple[torch.Tensor, ...],
    i0: int,
    j0: int,
) -> torch.Tensor:
    """``ds`` (the gradient of the modified scores) carried back through ``score_mod`` to the raw scores."""
    NK, GB, bk = ds.shape
    raw2 = torch.bmm(q_blk, kT_blk)  # (NK, G*bq, E) @ (NK, E, bk) -> (NK, G*bq, bk), log2 units
    view = raw2.view(*batch, -1, bk)  # -> (..., H, bq, bk)
    with torch.enable_grad():
        raw2 = view.detach().requires_grad_(True)
        modified = _modified_scores(score_mod, raw2, grids, i0, j0)
        (grad,) = torch.autograd.grad(modified, raw2, ds.view_as(raw2))
    # d modified / d raw2 = d modified / d raw * ln 2; the caller's final factor ln 2 is for q k^T itself.
    return (grad * _LOG2E).reshape(NK, GB, bk)
