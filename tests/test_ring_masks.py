"""Masks across ranks: `ring_attention` with a ``mask_mod`` (sliding windows, masks that read the
batch and head) and Megatron's per-sequence zigzag of packed batches, equal to dense attention in
float64 (outputs and gradients), with key/value slices that no rank further along needs neither
sent nor computed.

One `spawn` of 4 CPU processes (gloo) runs every case in process groups of 1, 2, 3 and 4 ranks
(`tests/ranks.py`). The
expected numbers of sends and blocks are derived here from the layouts' geometry, not read from
the schedule the code computes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attention_ref import scaled_dot_product_attention
from attention_ref.complexity import ring_attention_bytes
from attention_ref.distributed import (
    count_communication,
    ring_attention,
    ring_hops,
    ring_schedule,
    shard,
    shard_positions,
    unshard,
)
from attention_ref.mods import sliding_window
from attention_ref.block_mask import create_block_mask
from attention_ref.varlen import varlen_attention
from ranks import WORLDS, run_in_every_group  # tests/ranks.py

B, H, HKV, E, EV, N = 2, 4, 2, 5, 7, 48  # N: a multiple of 2 * world for every world
WINDOWS = [(layout, left) for layout in ("contiguous", "zigzag") for left in (5, 15)]
# Packed sequence lengths in units of 2 * world (so each one's chunks are that many positions long),
# two of them empty; chunks of at least 2, so that a diagonal chunk pair is never a single, full pair.
PER_SEQUENCE = [0, 2, 0, 3, 2]


def _per_head(b, h, q_idx, kv_idx):
    """A causal window of 4 + 3 h + 7 b keys: a mask that reads the batch row and the query head."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 4 + 3 * h + 7 * b)


def _late_queries(b, h, q_idx, kv_idx):
    """Causal, but queries before position 10 see no key at all (their rows are empty)."""
    return (kv_idx <= q_idx) & (q_idx >= 10)


# --- what runs in the spawned processes ---------------------------------------------------------


def _run(group, layout, mask_mod, *, is_causal=False, cu=None, length=N, hkv=HKV, seed=0, block_mask=None,
         sinks=False):
    """ring_attention forward and backward here; errors against dense attention with the same mask."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(B, h, length, e, generator=gen, dtype=torch.float64)
                      for h, e in ((H, E), (hkv, E), (hkv, EV), (H, EV)))
    cu_t = None if cu is None else torch.tensor(cu)
    placed = {"layout": layout, "cu_seqlens": cu_t if layout == "zigzag-per-sequence" else None}
    local = [shard(t, group=group, **placed).requires_grad_() for t in (q, k, v)]
    s = torch.randn(H, generator=gen, dtype=torch.float64) if sinks else None  # (H,): replicated
    with count_communication() as stats:
        out = ring_attention(*local, is_causal=is_causal, enable_gqa=hkv != H, group=group, mask_mod=mask_mod,
                             cu_seqlens=cu_t, layout=layout, block_mask=block_mask, sinks=s)
        out.backward(shard(d_out, group=group, **placed))
    gathered = [unshard(t.detach(), group=group, **placed) for t in (out, *(x.grad for x in local))]
    keep = None
    if cu is not None:  # (length, length): block-diagonal, no attention across sequences
        docs = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        keep = docs[:, None] == docs[None, :]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if block_mask is not None:  # the reference reads the mod the block mask was made from
        mask_mod = block_mask.mask_mod
    dense = scaled_dot_product_attention(*full, keep, is_causal=is_causal, enable_gqa=hkv != H, mask_mod=mask_mod,
                                         sinks=s, backend="math")
    expected = [dense.detach(), *torch.autograd.grad(dense, full, d_out)]
    result = {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, expected)], "stats": stats,
              "zero_rows": gathered[0][..., :10, :].abs().max().item()}
    if cu is not None and mask_mod is None:  # varlen_attention takes one row, (H, total, E), every head its own
        group_size = H // hkv
        result["varlen_error"] = max(
            (gathered[0][b] - varlen_attention(q[b], k[b].repeat_interleave(group_size, 0),
                                               v[b].repeat_interleave(group_size, 0), cu_t, cu_t,
                                               is_causal=is_causal)).abs().max().item()
            for b in range(B))
    return result


def _message(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return None


def _cases(group, world):
    mine = {}
    for layout, left in WINDOWS:
        mine["window", layout, left] = _run(group, layout, sliding_window(left))
    mine["window and causal"] = _run(group, "contiguous", sliding_window(5), is_causal=True)
    mine["block mask"] = _run(group, "contiguous", None, block_mask=create_block_mask(_per_head, B, H, N, N))
    mine["per head"] = _run(group, "zigzag", _per_head)
    mine["late queries"] = _run(group, "contiguous", _late_queries, hkv=H)
    mine["late queries and sinks"] = _run(group, "zigzag", _late_queries, sinks=True, seed=1)
    cu = [0, *itertools.accumulate(2 * world * n for n in PER_SEQUENCE)]
    for causal in (True, False):
        mine["per sequence", causal] = _run(group, "zigzag-per-sequence", None, is_causal=causal, cu=cu,
                                            length=cu[-1])
    mine["per sequence window"] = _run(group, "zigzag-per-sequence", sliding_window(3), cu=cu, length=cu[-1])
    x = torch.arange(float(cu[-1]))[:, None]
    mine["positions"] = shard(x, 0, group=group, layout="zigzag-per-sequence",
                              cu_seqlens=torch.tensor(cu)).flatten().long().tolist()
    if world > 1:
        bad = torch.tensor([0, 2 * world + 1, cu[-1]])
        zeros = torch.zeros(1, 2, cu[-1] // world, 4, dtype=torch.float64)
        mine["messages"] = {
            "odd sequence": _message(ring_attention, zeros, zeros, zeros, group=group,
                                     layout="zigzag-per-sequence", cu_seqlens=bad),
            "no offsets": _message(ring_attention, zeros, zeros, zeros, group=group, layout="zigzag-per-sequence"),
            "offsets to shard": _message(shard, x, 0, group=group, layout="zigzag", cu_seqlens=torch.tensor(cu)),
            "block mask length": _message(ring_attention, zeros, zeros, zeros, group=group,
                                          block_mask=create_block_mask(_per_head, None, None, 8, 8)),
        }
    return mine


@pytest.fixture(scope="module")
def runs():
    """``runs[world][group rank]``: what each member of the group of ``world`` ranks sent back."""
    return run_in_every_group(_cases, timeout=300)


CASE_KEYS = ([("window", layout, left) for layout, left in WINDOWS]
             + ["window and causal", "block mask", "late queries and sinks", "per head", "late queries", ("per sequence", True), ("per sequence", False),
                "per sequence window"])


@pytest.mark.parametrize("case", CASE_KEYS, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_masked_rings_equal_dense_attention(runs, world, case):
    for rank, mine in runs[world].items():
        errors = mine[case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", WORLDS)
def test_per_sequence_zigzag_equals_varlen_attention(runs, world, causal):
    for mine in runs[world].values():
        assert mine["per sequence", causal]["varlen_error"] < 1e-10


@pytest.mark.parametrize("world", WORLDS)
def test_queries_that_see_no_key_give_zeros(runs, world):
    assert runs[world][0]["late queries"]["zero_rows"] == 0.0


@pytest.mark.parametrize("left", [5, 15])
@pytest.mark.parametrize("world", WORLDS)
def test_a_contiguous_window_sends_only_the_slices_it_reaches(runs, world, left):
    """Chunks of c = N / W: rank r's queries reach k = ceil(left / c) slices back, so rank r passes on
    its own slice and the ones it received while some rank further along still needs them
    (min(k, r + 1) sends, none from the last rank), sends back one accumulator per slice it got
    (min(k, r)) and computes min(k, r) + 1 blocks; the rest of the ring is skipped."""
    c = N // world
    k = math.ceil(left / c)
    for rank, mine in runs[world].items():
        stats = mine["window", "contiguous", left]["stats"]
        kv_sends = 0 if rank == world - 1 else min(k, rank + 1)
        assert (stats.forward_steps, stats.backward_kv_steps) == (kv_sends, kv_sends)
        assert (stats.forward_steps_skipped, stats.backward_kv_steps_skipped) == (world - 1 - kv_sends,) * 2
        assert stats.backward_grad_steps == min(k, rank)
        assert stats.backward_grad_steps_skipped == world - 1 - min(k, rank)
        computed = min(k, rank) + 1
        assert (stats.blocks_full + stats.blocks_masked, stats.blocks_skipped) == (computed, world - computed)
    busiest = max(mine["window", "contiguous", left]["stats"].forward_bytes for mine in runs[world].values())
    assert busiest == ring_attention_bytes(B, H, HKV, N, E, EV, world, bytes_per_element=8, window=left)


@pytest.mark.parametrize("world", WORLDS)
def test_a_zigzag_window_still_needs_nearly_the_whole_ring(runs, world):
    """A window within one chunk (5 < N / 2W): chunk 2W - x, rank x - 1's late chunk, reaches back
    into rank x's late chunk 2W - 1 - x, so rank x's slice must travel W - 1 steps to rank x - 1;
    only rank 0's slice (chunks 0 and 2W - 1, which no chunk but chunk 1 reaches back into) stops
    after one hop. So ranks 0 and W - 1 send W - 1 times, the others W - 2 (they skip passing on
    rank 0's slice)."""
    for rank, mine in runs[world].items():
        stats = mine["window", "zigzag", 5]["stats"]
        kv_sends = world - 1 if rank in (0, world - 1) else world - 2
        assert (stats.forward_steps, stats.backward_kv_steps) == (kv_sends, kv_sends)


@pytest.mark.parametrize("left", [5, 15])
@pytest.mark.parametrize("world", [3, 4])
def test_a_window_sends_less_on_the_contiguous_layout(runs, world, left):
    def total(layout):
        return sum(mine["window", layout, left]["stats"].forward_bytes for mine in runs[world].values())

    assert total("contiguous") < total("zigzag")


@pytest.mark.parametrize("world", WORLDS)
def test_per_sequence_zigzag_places_chunks_of_every_sequence(runs, world):
    for rank, mine in runs[world].items():
        expected, start = [], 0
        for n in PER_SEQUENCE:
            c = n  # each sequence is 2 * world * n long: chunks of n
            for j in (rank, 2 * world - 1 - rank):
                expected += range(start + j * c, start + (j + 1) * c)
            start += 2 * world * n
        assert mine["positions"] == expected


@pytest.mark.parametrize("world", WORLDS)
def test_per_sequence_zigzag_balances_causal_work(runs, world):
    """Per non-empty sequence, every rank computes 2W - 1 full and 2 diagonal chunk pairs, as the
    whole-sequence zigzag does for one sequence; pairs across sequences are skipped."""
    sequences = sum(n > 0 for n in PER_SEQUENCE)
    for mine in runs[world].values():
        stats = mine["per sequence", True]["stats"]
        assert (stats.blocks_full, stats.blocks_masked) == ((2 * world - 1) * sequences, 2 * sequences)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_sequence_layout_errors_name_the_problem(runs, world):
    messages = runs[world][0]["messages"]
    assert messages["odd sequence"].startswith(
        f"ring_attention with layout='zigzag-per-sequence' needs every packed sequence to be a multiple of "
        f"2 * world = {2 * world} long (pad it, as Megatron does), got sequence 0 of length {2 * world + 1}")
    assert messages["no offsets"].startswith("ring_attention with layout='zigzag-per-sequence' needs cu_seqlens")
    assert messages["block mask length"] == f"block_mask was made for L=8, this call has L={2 * world * sum(PER_SEQUENCE)}"
    assert messages["offsets to shard"].startswith(
        "shard: cu_seqlens changes where positions go only with layout='zigzag-per-sequence', got layout='zigzag'")


# --- the schedule, without processes -----------------------------------------------------------


def test_ring_hops_of_the_plain_layouts():
    assert ring_hops(ring_schedule(4, layout="contiguous")) == [3, 2, 1, 0]
    assert ring_hops(ring_schedule(4, layout="contiguous", is_causal=False)) == [3, 3, 3, 3]
    assert ring_hops(ring_schedule(4)) == [3, 3, 3, 3]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_window_within_one_chunk_needs_one_hop(world):
    schedule = ring_schedule(world, layout="contiguous", length=16 * world, mask_mod=sliding_window(15))
    assert ring_hops(schedule) == [1] * (world - 1) + [0]
    computed = [sum(b.kind != "skipped" for b in blocks) for blocks in schedule]
    assert computed == [1] + [2] * (world - 1)


def test_a_mask_mod_reading_heads_is_evaluated_on_the_batch_it_is_given():
    def head_two_sees_everything(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h == 2)

    def schedule(**batch):
        return ring_schedule(2, layout="contiguous", is_causal=False, length=8, mask_mod=head_two_sees_everything,
                             **batch)

    one_head, three_heads = schedule(), schedule(batch=(3,))
    assert ring_hops(one_head) == [1, 0] and ring_hops(three_heads) == [1, 1]


def test_the_schedule_asks_for_the_length_where_positions_matter():
    with pytest.raises(ValueError, match=r"ring_schedule needs length= \(the full sequence length\) with mask_mod"):
        ring_schedule(2, mask_mod=sliding_window(3))
    with pytest.raises(ValueError, match=r"length must be a multiple of 4 with layout='zigzag' and world=2, got 6"):
        ring_schedule(2, length=6)
    with pytest.raises(TypeError, match=r"mask_mod must be"):
        ring_schedule(2, length=8, mask_mod="window")
    with pytest.raises(TypeError, match=r"batch must be a tuple of positive ints .*got \[3\]"):
        ring_schedule(2, length=8, mask_mod=sliding_window(3), batch=[3])
    with pytest.raises(ValueError, match=r"batch=\(3,\) only matters to a mask_mod"):
        ring_schedule(2, length=8, batch=(3,))


@pytest.mark.parametrize("world", WORLDS)
def test_shard_positions_cover_every_position_once_as_shard_places_them(runs, world):
    cu = [0, *itertools.accumulate(2 * world * n for n in PER_SEQUENCE)]
    positions = shard_positions(world, cu[-1], layout="zigzag-per-sequence", cu_seqlens=torch.tensor(cu))
    assert [p.tolist() for p in positions] == [runs[world][r]["positions"] for r in range(world)]
    for layout in ("zigzag", "contiguous", "zigzag-per-sequence"):
        extra = {"cu_seqlens": torch.tensor(cu)} if layout == "zigzag-per-sequence" else {}
        every = torch.cat(shard_positions(world, cu[-1], layout=layout, **extra))
        assert sorted(every.tolist()) == list(range(cu[-1]))


def test_shard_positions_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match=r"length must be a multiple of 8 with layout='zigzag' and world=4, got 12"):
        shard_positions(4, 12)
    with pytest.raises(ValueError, match=r"shard_positions with layout='zigzag-per-sequence' needs cu_seqlens"):
        shard_positions(2, 8, layout="zigzag-per-sequence")
    with pytest.raises(ValueError, match=r"shard_positions: cu_seqlens changes where positions go only with"):
        shard_positions(2, 8, layout="contiguous", cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError, match=r"length must be an int, got float"):
        shard_positions(2, 8.0)


def test_the_window_bytes_formula_falls_with_the_ranks_and_refuses_a_negative_window():
    llama = dict(B=1, H=32, Hkv=8, L=131072, E=128, Ev=128)
    windowed = [ring_attention_bytes(**llama, world=w, window=4096) for w in (2, 4, 8, 16, 32)]
    assert windowed == sorted(windowed, reverse=True) and windowed[0] == ring_attention_bytes(**llama, world=2)
    assert ring_attention_bytes(**llama, world=64, window=4096) == 2 * ring_attention_bytes(**llama, world=64) // 63
    assert ring_attention_bytes(**llama, world=8, window=0) == 0
    with pytest.raises(ValueError, match="window"):
        ring_attention_bytes(**llama, world=8, window=-1)


def _opaque(mask_mod):
    """The same mask, in a function `attention_ref.mods.describe` cannot read: evaluated on every pair."""
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "zigzag-per-sequence"])
@pytest.mark.parametrize("causal", [True, False])
def test_bounds_decide_the_same_kinds_as_evaluating_the_mask(world, layout, causal):
    """The plan reads a sliding window's band (and the packed sequences' bounds) instead of forming
    each chunk pair's mask; every kind must be the one the evaluated mask gives."""
    cu = [0, *itertools.accumulate(2 * world * n for n in (3, 0, 1, 4))]
    length = cu[-1]
    for packed in (False, True):
        offsets = torch.tensor(cu) if packed or layout == "zigzag-per-sequence" else None
        for window in (sliding_window(0), sliding_window(3), sliding_window(7, 2), sliding_window(None, 5),
                       sliding_window(4, 4, offset=-3)):
            def plan(mod):
                return ring_schedule(world, layout=layout, is_causal=causal, length=length, mask_mod=mod,
                                     cu_seqlens=offsets)

            assert plan(window) == plan(_opaque(window))
