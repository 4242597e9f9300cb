"""USP across processes: Ulysses inside the rows of a grid of ranks, the ring across its columns.

One `spawn` of 4 CPU processes (gloo) runs three grids, U x R = 2 x 2, 4 x 1 and 1 x 4, each with
the ring's two layouts, causal or not, grouped key/value heads (fewer than U of them too), sinks and
packed sequences, in float64 against `attention_ref.scaled_dot_product_attention` on the unsharded
tensors (outputs and the gradients of q, k, v; the ranks' sink gradients summed); what each rank
sends against `attention_ref.complexity.usp_attention_bytes`; and `demo_worker`'s USP on its 2 x 2
grid, as the documentation runs it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from attention_ref import scaled_dot_product_attention
from attention_ref.complexity import usp_attention_bytes
from attention_ref.distributed import count_communication, demo_worker, shard, spawn, unshard, usp_attention
from attention_ref.mods import sliding_window

GRIDS = {"2x2": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),  # rows (Ulysses groups), columns (ring groups)
         "4x1": ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
         "1x4": ([[0], [1], [2], [3]], [[0, 1, 2, 3]])}
H, HKV, E, EV, N = 8, 4, 5, 7, 32
CU = [0, 7, 7, 20, 32]
CU_PER_SEQUENCE = [0, 8, 8, 24, 32]
CASES = [(layout, causal) for layout in ("contiguous", "zigzag") for causal in (True, False)]


def _groups():
    """Every rank creates every group, in the same order; this rank's row and column of each grid."""
    mine = {}
    for name, (rows, columns) in GRIDS.items():
        row = [(ranks, dist.new_group(ranks)) for ranks in rows]
        column = [(ranks, dist.new_group(ranks)) for ranks in columns]
        me = dist.get_rank()
        mine[name] = (next(g for r, g in row if me in r), next(g for r, g in column if me in r))
    return mine


def _shard(t, row, column, layout, cu=None):
    per_sequence = {"cu_seqlens": cu} if layout == "zigzag-per-sequence" else {}
    return shard(shard(t, group=column, layout=layout, **per_sequence), group=row, layout="contiguous")


def _unshard(t, row, column, layout, cu=None):
    per_sequence = {"cu_seqlens": cu} if layout == "zigzag-per-sequence" else {}
    return unshard(unshard(t, group=row, layout="contiguous"), group=column, layout=layout, **per_sequence)


def _per_head(b, h, q_idx, kv_idx):
    """A causal window of 3 + 2 h keys: a mask that reads the global query head."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 3 + 2 * h)


def _case(row, column, layout, causal, sinks=False, packed=False, seed=0, hkv=HKV, mask_mod=None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, h, N, e, generator=gen, dtype=torch.float64)
                      for h, e in ((H, E), (hkv, E), (hkv, EV), (H, EV)))
    s = torch.randn(H, generator=gen, dtype=torch.float64) if sinks else None
    offsets = CU_PER_SEQUENCE if layout == "zigzag-per-sequence" else CU
    cu = torch.tensor(offsets) if packed else None
    local = [_shard(t, row, column, layout, cu).requires_grad_() for t in (q, k, v)]
    mine = None if s is None else s.clone().requires_grad_()
    with count_communication() as stats:
        out = usp_attention(*local, ulysses_group=row, ring_group=column, is_causal=causal, enable_gqa=True,
                            layout=layout, sinks=mine, cu_seqlens=cu, mask_mod=mask_mod)
        out.backward(_shard(d_out, row, column, layout, cu))
    gathered = [_unshard(t.detach(), row, column, layout, cu) for t in (out, *(x.grad for x in local))]
    keep = None
    if packed:
        docs = torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.tensor(offsets).diff())
        keep = docs[:, None] == docs[None, :]
    full = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if s is None else [s.clone().requires_grad_()])
    dense = scaled_dot_product_attention(*full[:3], keep, is_causal=causal, enable_gqa=True,
                                         sinks=full[3] if sinks else None, mask_mod=mask_mod, backend="math")
    grads = torch.autograd.grad(dense, full, d_out)
    result = {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, (dense.detach(), *grads[:3]))],
              "all_to_all": stats.forward_all_to_all, "ring_steps": stats.forward_steps,
              "sent": stats.forward_bytes + stats.forward_all_to_all_bytes, "hkv": hkv}
    if sinks:
        result["sinks_grad"], result["expected_sinks_grad"] = mine.grad, grads[3]
    return result


def _worker(rank, world_size):
    results = {}
    for name, (row, column) in _groups().items():
        mine = {case: _case(row, column, *case) for case in CASES}
        mine["sinks"] = _case(row, column, "zigzag", True, sinks=True, seed=1)
        mine["packed"] = _case(row, column, "contiguous", True, packed=True, seed=2)
        # Megatron's layout across the ring: every sequence a multiple of 2 R = 8 (R <= 4)
        mine["per sequence"] = _case(row, column, "zigzag-per-sequence", True, packed=True, seed=4)
        mine["per head"] = _case(row, column, "contiguous", False, seed=5, mask_mod=_per_head)
        mine["window"] = _case(row, column, "contiguous", False, seed=6, mask_mod=sliding_window(5))
        # 2 key/value heads: fewer than the 4 ranks of a 4 x 1 row, each repeated twice
        mine["repeated"] = _case(row, column, "zigzag", True, seed=3, hkv=2)
        results[name] = mine
    # the documentation's worker, on its own grid (U = 2 for 4 ranks: 2 x 2)
    results["demo"] = {layout: demo_worker(rank, world_size, 0, layout, True, "usp")
                       for layout in ("zigzag", "contiguous")}
    # the worker's window, through every strategy
    results["demo window"] = {strategy: demo_worker(rank, world_size, 1, "contiguous", True, strategy, 5)
                              for strategy in ("ring", "ulysses", "usp")}
    return results


@pytest.fixture(scope="module")
def runs():
    return spawn(_worker, 4, timeout=240)


@pytest.mark.parametrize("case", CASES + ["packed", "per sequence", "repeated", "per head", "window"], ids=str)
@pytest.mark.parametrize("grid", GRIDS)
def test_usp_equals_one_process(runs, grid, case):
    for rank, results in enumerate(runs):
        errors = results[grid][case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}, grid {grid}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("grid", GRIDS)
def test_usp_communicates_in_both_directions_of_the_grid(runs, grid):
    u, r = map(int, grid.split("x"))
    for results in runs:
        # zigzag: every ring rank needs every block (causal contiguous stops early: test_distributed)
        run = results[grid][("zigzag", True)]
        assert run["all_to_all"] == 4 and run["ring_steps"] == r - 1  # 4 all-to-alls (1 rank: no bytes)


@pytest.mark.parametrize("grid", GRIDS)
def test_usp_sinks_count_once_and_the_shares_sum_to_the_whole(runs, grid):
    for results in runs:
        assert max(results[grid]["sinks"]["errors"]) < 1e-10
    total = sum(results[grid]["sinks"]["sinks_grad"] for results in runs)
    torch.testing.assert_close(total, runs[0][grid]["sinks"]["expected_sinks_grad"], rtol=1e-10, atol=1e-12)


# every rank needs every block of the ring here (no mask, or zigzag under a causal mask): the whole
# ring, which the formula counts
WHOLE_RING = [("zigzag", True), ("zigzag", False), ("contiguous", False), "sinks", "repeated"]


@pytest.mark.parametrize("case", WHOLE_RING, ids=str)
@pytest.mark.parametrize("grid", GRIDS)
def test_usp_sends_what_the_formula_says(runs, grid, case):
    """Each rank's forward bytes (the row's all-to-alls and the column's ring steps) equal
    `usp_attention_bytes`, grouped key/value heads included, repeated where there are fewer than U."""
    u, r = map(int, grid.split("x"))
    for rank, results in enumerate(runs):
        run = results[grid][case]
        expected = usp_attention_bytes(1, H, run["hkv"], N, E, EV, u, r, bytes_per_element=8)
        assert run["sent"] == expected, f"rank {rank}, grid {grid}, Hkv={run['hkv']}"


def test_usp_formula_is_ulysses_in_a_row_and_the_ring_in_a_column():
    from attention_ref.complexity import ring_attention_bytes, ulysses_attention_bytes

    sizes = dict(B=3, H=12, Hkv=2, L=7 * 60, E=5, Ev=11, bytes_per_element=4)
    for world in (1, 2, 4, 6):  # Hkv = 2 divides each: repeated beyond 2
        assert usp_attention_bytes(**sizes, ulysses=world, ring=1) == ulysses_attention_bytes(**sizes, world=world)
    for world in (1, 2, 3, 4, 7):
        assert usp_attention_bytes(**sizes, ulysses=1, ring=world) == ring_attention_bytes(**sizes, world=world)
    # U = 2, R = 3, n = 70: the all-to-alls send half of q, k, v, out; the ring 2 steps of the block
    row = 3 * 70 * (12 * 5 + 2 * (5 + 11) + 12 * 11) // 2
    assert usp_attention_bytes(**sizes, ulysses=2, ring=3) == (row + 2 * 3 * 2 * 70 * (5 + 11)) * 4


def test_usp_formula_names_what_does_not_divide():
    with pytest.raises(ValueError, match="L=10 must be a multiple of world=4"):
        usp_attention_bytes(1, 8, 8, 10, 4, 4, 2, 2)
    with pytest.raises(ValueError, match="H=6 query heads must be a multiple of ulysses=4 for USP"):
        usp_attention_bytes(1, 6, 6, 8, 4, 4, 4, 1)
    with pytest.raises(ValueError, match="Hkv=3 key/value heads must be a multiple or a divisor of ulysses=4"):
        usp_attention_bytes(1, 12, 3, 8, 4, 4, 4, 2)
    with pytest.raises(ValueError, match="ring must be a positive int, got 0"):
        usp_attention_bytes(1, 12, 4, 8, 4, 4, 4, 0)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_demo_worker_runs_usp_on_a_2_by_2_grid(runs, layout):
    """`demo_worker(..., strategy="usp")` on 4 ranks: rows [0, 1], [2, 3]; a tensor cut across the
    column with ``layout``, then in two within the row. Exact; with the zigzag ring (every rank needs
    every block) each rank sends what the formula says, the page's numbers."""
    held = [results["demo"][layout]["positions"] for results in runs]
    formula = usp_attention_bytes(1, 4, 2, 48, 8, 8, 2, 2, bytes_per_element=8)
    for rank, results in enumerate(runs):
        demo = results["demo"][layout]
        assert demo["max_error"] < 1e-12, f"rank {rank}"
        sent = demo["stats"]["forward_bytes"] + demo["stats"]["forward_all_to_all_bytes"]
        if layout == "zigzag":
            assert sent == formula == 7680, f"rank {rank}"
        else:  # causal on contiguous blocks: the formula counts the whole ring, the most it sends
            assert sent <= formula, f"rank {rank}"
    assert sorted(p for positions in held for p in positions) == list(range(48))
    if layout == "zigzag":
        # ring rank 0 (the first row, ranks 0 and 1) holds zigzag chunks 0 and 3 of 4; the row
        # splits them, rank 0 the first, rank 1 the second
        assert held[0] == list(range(12)) and held[1] == list(range(36, 48))
    else:
        assert held == [list(range(12 * r, 12 * (r + 1))) for r in range(4)]


def test_demo_worker_names_a_strategy_it_does_not_know():
    with pytest.raises(ValueError, match="strategy must be 'ring', 'ulysses' or 'usp', got 'tree'"):
        demo_worker(0, 1, strategy="tree")


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "usp"])
def test_the_demo_workers_window_runs_through_every_strategy(runs, strategy):
    for results in runs:
        assert results["demo window"][strategy]["max_error"] < 1e-12
