"""USP across processes: Ulysses inside the rows of a grid of ranks, the ring across its columns.

One `spawn` of 4 CPU processes (gloo) runs three grids, U x R = 2 x 2, 4 x 1 and 1 x 4, each with
the ring's two layouts, causal or not, grouped key/value heads, sinks and packed sequences, in
float64 against `attention_ref.scaled_dot_product_attention` on the unsharded tensors (outputs and
the gradients of q, k, v; the ranks' sink gradients summed).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from attention_ref import scaled_dot_product_attention
from attention_ref.distributed import count_communication, shard, spawn, unshard, usp_attention

GRIDS = {"2x2": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),  # rows (Ulysses groups), columns (ring groups)
         "4x1": ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
         "1x4": ([[0], [1], [2], [3]], [[0, 1, 2, 3]])}
H, HKV, E, EV, N = 8, 4, 5, 7, 32
CU = [0, 7, 7, 20, 32]
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


def _shard(t, row, column, layout):
    return shard(shard(t, group=column, layout=layout), group=row, layout="contiguous")


def _unshard(t, row, column, layout):
    return unshard(unshard(t, group=row, layout="contiguous"), group=column, layout=layout)


def _case(row, column, layout, causal, sinks=False, packed=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, h, N, e, generator=gen, dtype=torch.float64)
                      for h, e in ((H, E), (HKV, E), (HKV, EV), (H, EV)))
    s = torch.randn(H, generator=gen, dtype=torch.float64) if sinks else None
    cu = torch.tensor(CU) if packed else None
    local = [_shard(t, row, column, layout).requires_grad_() for t in (q, k, v)]
    mine = None if s is None else s.clone().requires_grad_()
    with count_communication() as stats:
        out = usp_attention(*local, ulysses_group=row, ring_group=column, is_causal=causal, enable_gqa=True,
                            layout=layout, sinks=mine, cu_seqlens=cu)
        out.backward(_shard(d_out, row, column, layout))
    gathered = [_unshard(t.detach(), row, column, layout) for t in (out, *(x.grad for x in local))]
    keep = None
    if packed:
        docs = torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor(CU).diff())
        keep = docs[:, None] == docs[None, :]
    full = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if s is None else [s.clone().requires_grad_()])
    dense = scaled_dot_product_attention(*full[:3], keep, is_causal=causal, enable_gqa=True,
                                         sinks=full[3] if sinks else None, backend="math")
    grads = torch.autograd.grad(dense, full, d_out)
    result = {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, (dense.detach(), *grads[:3]))],
              "all_to_all": stats.forward_all_to_all, "ring_steps": stats.forward_steps}
    if sinks:
        result["sinks_grad"], result["expected_sinks_grad"] = mine.grad, grads[3]
    return result


def _worker(rank, world_size):
    results = {}
    for name, (row, column) in _groups().items():
        mine = {case: _case(row, column, *case) for case in CASES}
        mine["sinks"] = _case(row, column, "zigzag", True, sinks=True, seed=1)
        mine["packed"] = _case(row, column, "contiguous", True, packed=True, seed=2)
        results[name] = mine
    return results


@pytest.fixture(scope="module")
def runs():
    return spawn(_worker, 4, timeout=240)


@pytest.mark.parametrize("case", CASES + ["packed"], ids=str)
@pytest.mark.parametrize("grid", GRIDS)
def test_usp_equals_one_process(runs, grid, case):
    for rank, results in enumerate(runs):
        errors = results[grid][case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}, grid {grid}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("grid", GRIDS)
def test_usp_communicates_in_both_directions_of_the_grid(runs, grid):
    u, r = map(int, grid.split("x"))
    for results in runs:
        run = results[grid][("contiguous", True)]
        assert run["all_to_all"] == 4 and run["ring_steps"] == r - 1  # 4 all-to-alls (1 rank: no bytes)


@pytest.mark.parametrize("grid", GRIDS)
def test_usp_sinks_count_once_and_the_shares_sum_to_the_whole(runs, grid):
    for results in runs:
        assert max(results[grid]["sinks"]["errors"]) < 1e-10
    total = sum(results[grid]["sinks"]["sinks_grad"] for results in runs)
    torch.testing.assert_close(total, runs[0][grid]["sinks"]["expected_sinks_grad"], rtol=1e-10, atol=1e-12)
