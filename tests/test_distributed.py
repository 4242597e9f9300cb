"""Ring attention across processes: equal to one process, with the communication on the page.

One `spawn` of 4 CPU processes (gloo) runs every case: inside it, process groups of 1, 2, 3
and 4 ranks (the groups of 2 and 3 leave out rank 0 and 2, so their group ranks are not their
global ranks) each run ring attention for both layouts, causal or not, with and without
grouped-query heads, and send back their errors, counters and shards; the tests below assert
on them in the parent. Errors are measured in float64 against
`attention_ref.scaled_dot_product_attention` on the unsharded tensors, with the incoming
gradient sharded the same way. Sizes: N = 24 positions at every world size (so the float32
errors of different world sizes are errors on the same problem), E = 5, Ev = 7, 6 query heads.
With learned sinks (``sinks=``, a replicated ``(H,)`` parameter) the reference is the dense math
path with the same sinks, and the ranks' ``sinks.grad`` (each its local share) sum to its gradient.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention_ref import scaled_dot_product_attention
from attention_ref.complexity import ring_attention_bytes
from attention_ref.distributed import (
    count_communication,
    ring_attention,
    ring_schedule,
    shard,
    spawn,
    unshard,
)
from ranks import WORLDS, run_in_every_group  # tests/ranks.py

B, H, E, EV, N = 2, 6, 5, 7, 24  # N: divisible by 2 * world for every world
LAYOUTS = ("zigzag", "contiguous")
CASES = [(layout, causal, gqa) for layout in LAYOUTS for causal in (True, False) for gqa in (False, True)]
SINK_CASES = [("zigzag", True, True), ("contiguous", False, False)]  # the per-block and the one-call paths


def _case_id(case):
    layout, causal, gqa = case
    return f"{layout}-{'causal' if causal else 'full'}{'-gqa' if gqa else ''}"


# --- what runs in the spawned processes ---------------------------------------------------------


def _inputs(world, gqa, seed, dtype=torch.float64):
    """The full q, k, v and incoming gradient, the same on every rank: (B, H|Hkv, N, E|Ev)."""
    gen = torch.Generator().manual_seed(seed)
    L, hkv = N, 2 if gqa else H
    shapes = ((B, H, L, E), (B, hkv, L, E), (B, hkv, L, EV), (B, H, L, EV))
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _ring_case(group, world, layout, causal, gqa, dtype=torch.float64, seed=0):
    """Ring attention forward and backward on this rank; errors against one process in float64."""
    q, k, v, d_out = _inputs(world, gqa, seed)
    local = [shard(t.to(dtype), group=group, layout=layout).requires_grad_() for t in (q, k, v)]
    with count_communication() as stats:
        out = ring_attention(*local, is_causal=causal, enable_gqa=gqa, group=group, layout=layout)
        out.backward(shard(d_out.to(dtype), group=group, layout=layout))
    gathered = [unshard(t.detach(), group=group, layout=layout).double() for t in (out, *(x.grad for x in local))]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=gqa)
    expected = [expected.detach(), *torch.autograd.grad(expected, full, d_out)]
    return {
        "errors": [(a - b).abs().max().item() for a, b in zip(gathered, expected)],
        "stats": stats,
        "numel_kv": local[1].numel() + local[2].numel(),
        "dtype": out.dtype,
    }


def _sinks_case(group, world, layout, causal, gqa, seed=2):
    """Ring attention with sinks on this rank against the dense math path with sinks, in float64.

    The sinks are a replicated parameter: every rank holds the same values in its own leaf; its
    ``.grad`` after the backward is returned as it is, with no all-reduce (this rank's share).
    """
    q, k, v, d_out = _inputs(world, gqa, seed)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    local = [shard(t, group=group, layout=layout).requires_grad_() for t in (q, k, v)]
    mine = sinks.clone().requires_grad_()
    out = ring_attention(*local, is_causal=causal, enable_gqa=gqa, group=group, layout=layout, sinks=mine)
    out.backward(shard(d_out, group=group, layout=layout))
    gathered = [unshard(t.detach(), group=group, layout=layout) for t in (out, *(x.grad for x in local))]
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    expected = scaled_dot_product_attention(*full[:3], is_causal=causal, enable_gqa=gqa, sinks=full[3],
                                            backend="math")
    expected_grads = torch.autograd.grad(expected, full, d_out)
    sink_free = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return {
        "errors": [(a - b).abs().max().item() for a, b in zip(gathered, (expected.detach(), *expected_grads[:3]))],
        "sinks_grad": mine.grad,
        "expected_sinks_grad": expected_grads[3],
        "sinks_effect": (expected - sink_free).abs().max().item(),
    }


def _per_query_sinks_case(group, world, layout="zigzag", seed=4):
    """One sink per query (Inkling 2), (B, H, N), sharded like the queries: each rank's rows are its own."""
    q, k, v, d_out = _inputs(world, True, seed)
    sinks = torch.randn(B, H, N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    local = [shard(t, group=group, layout=layout).requires_grad_() for t in (q, k, v)]
    mine = shard(sinks, dim=-1, group=group, layout=layout).requires_grad_()  # (B, H, N / world)
    out = ring_attention(*local, is_causal=True, enable_gqa=True, group=group, layout=layout, sinks=mine)
    out.backward(shard(d_out, group=group, layout=layout))
    gathered = [unshard(t.detach(), group=group, layout=layout) for t in (out, *(x.grad for x in local))]
    gathered.append(unshard(mine.grad, dim=-1, group=group, layout=layout))
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    expected = scaled_dot_product_attention(*full[:3], is_causal=True, enable_gqa=True, sinks=full[3], backend="math")
    expected_grads = torch.autograd.grad(expected, full, d_out)
    return {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, (expected.detach(), *expected_grads))],
            "sinks_effect": (expected - scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            .abs().max().item()}


def _error_message(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def _layouts_case(group, world, rank):
    """Shards of positions, the round trip, and unshard's gradient (the sum over ranks)."""
    L = N
    positions = torch.arange(L, dtype=torch.float64)
    x = torch.randn(3, L, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    result = {}
    for layout in LAYOUTS:
        local = shard(positions[:, None], group=group, layout=layout)  # (L / world, 1)
        own = shard(x, dim=1, group=group, layout=layout).requires_grad_()
        # every rank's loss weighs the full tensor differently: rank r by w_r
        weights = [torch.randn(3, L, 2, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                   for r in range(world)]
        (unshard(own, dim=1, group=group, layout=layout) * weights[rank]).sum().backward()
        expected_grad = shard(sum(weights), dim=1, group=group, layout=layout)
        result[layout] = {
            "positions": local.flatten().long().tolist(),
            "round_trip": torch.equal(unshard(own.detach(), dim=1, group=group, layout=layout), x),
            "grad_error": (own.grad - expected_grad).abs().max().item(),
        }
    return result


def _errors_case(group, world):
    """The messages of the lengths that do not divide."""
    odd = [torch.randn(1, 2, 7, 4) for _ in range(3)]  # an odd local length
    messages = {
        "ring zigzag odd": _error_message(lambda: ring_attention(*odd, group=group, layout="zigzag")),
        "ring contiguous odd": _error_message(lambda: ring_attention(*odd, group=group, layout="contiguous")),
        "shard zigzag": _error_message(lambda: shard(torch.randn(2 * world + 1, 4), group=group)),
        "shard contiguous": _error_message(
            lambda: shard(torch.randn(world + 1, 4), group=group, layout="contiguous") if world > 1 else None),
        "lengths differ": _error_message(lambda: ring_attention(
            torch.randn(1, 2, 4, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), group=group)),
        "sinks per kv head": _error_message(lambda: ring_attention(
            torch.randn(1, 4, 4, 4), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), enable_gqa=True,
            group=group, sinks=torch.zeros(2))),
    }
    return messages


def _cases(group, world):
    """Every case, in the same order on every rank of the group."""
    mine = {case: _ring_case(group, world, *case) for case in CASES}
    mine["float32"] = _ring_case(group, world, "zigzag", True, True, torch.float32, seed=1)
    mine["bfloat16"] = _ring_case(group, world, "zigzag", True, True, torch.bfloat16, seed=1)
    for case in SINK_CASES:
        mine[("sinks", *case)] = _sinks_case(group, world, *case)
    mine["sinks per query"] = _per_query_sinks_case(group, world)
    mine["layouts"] = _layouts_case(group, world, dist.get_rank(group))
    mine["messages"] = _errors_case(group, world)
    return mine


def _failing_worker(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 would wait here for rank 1 until the process group's timeout


# --- the one spawn -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    """``runs[world]``: the results of the members of the group of ``world`` ranks, by group rank."""
    return run_in_every_group(_cases)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("world", WORLDS)
def test_outputs_and_gradients_equal_one_process(runs, world, case):
    for rank, mine in runs[world].items():
        errors = mine[case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("world", WORLDS)
def test_float32_error_does_not_grow_with_the_ranks(runs, world):
    one = max(runs[1][0]["float32"]["errors"])
    here = [max(mine["float32"]["errors"]) for mine in runs[world].values()]
    assert runs[world][0]["float32"]["dtype"] == torch.float32
    assert max(here) <= 2 * one, f"float32 errors against float64: world 1 {one:.2e}, world {world} {here}"
    assert max(here) < 1e-5


@pytest.mark.parametrize("world", WORLDS)
def test_bfloat16_is_computed_in_float32(runs, world):
    for mine in runs[world].values():
        assert mine["bfloat16"]["dtype"] == torch.bfloat16
        assert max(mine["bfloat16"]["errors"]) < 5e-2


def _expected_sends(world, rank, layout, causal):
    """(key/value sends, dK/dV sends) of one rank, from the layouts' geometry.

    Every rank needs every slice (W - 1 sends of each) unless the layout is contiguous and the
    mask causal: then slice x is needed by ranks x .. W - 1 only, so rank r passes on the slices
    r, r - 1, .., 0 it holds at steps 0 .. r (the last rank passes on none), and sends one
    accumulator for each slice it received (r of them; rank W - 1's go straight home)."""
    if layout == "contiguous" and causal:
        return (rank + 1 if rank < world - 1 else 0), rank
    return world - 1, world - 1


@pytest.mark.parametrize("case", CASES + ["float32", "bfloat16"], ids=lambda c: c if isinstance(c, str) else _case_id(c))
@pytest.mark.parametrize("world", WORLDS)
def test_communication_matches_the_formulas(runs, world, case):
    """Forward: W - 1 sends of K and V; backward: W - 1 of K and V, W - 1 of dK and dV (compute dtype),
    fewer where no rank further along needs a slice; the busiest rank's bytes are the formula's."""
    busiest = 0
    for rank, mine in runs[world].items():
        run = mine[case]
        s = torch.empty(0, dtype=run["dtype"]).element_size()
        s_acc = torch.empty(0, dtype=torch.promote_types(run["dtype"], torch.float32)).element_size()
        stats = run["stats"]
        kv = run["numel_kv"]
        layout, causal = ("zigzag", True) if isinstance(case, str) else case[:2]
        kv_sends, grad_sends = _expected_sends(world, rank, layout, causal)
        assert (stats.forward_steps, stats.forward_bytes) == (kv_sends, kv_sends * kv * s)
        assert (stats.backward_kv_steps, stats.backward_kv_bytes) == (kv_sends, kv_sends * kv * s)
        assert (stats.backward_grad_steps, stats.backward_grad_bytes) == (grad_sends, grad_sends * kv * s_acc)
        skipped = (stats.forward_steps_skipped, stats.backward_kv_steps_skipped, stats.backward_grad_steps_skipped)
        assert skipped == (world - 1 - kv_sends, world - 1 - kv_sends, world - 1 - grad_sends)
        busiest = max(busiest, stats.forward_bytes)
    hkv = 2 if case in ("float32", "bfloat16") or case[2] else H  # the cases' key/value heads
    assert busiest == ring_attention_bytes(B, H, hkv, N, E, EV, world, bytes_per_element=s)


@pytest.mark.parametrize("world", WORLDS)
def test_causal_zigzag_balances_the_work(runs, world):
    """Every rank: 2W - 1 full chunk pairs, 2 diagonal ones, the rest of its 4W pairs skipped."""
    for mine in runs[world].values():
        stats = mine[("zigzag", True, False)]["stats"]
        assert (stats.blocks_full, stats.blocks_masked, stats.blocks_skipped) == (2 * world - 1, 2, 2 * world - 1)


@pytest.mark.parametrize("world", WORLDS)
def test_causal_contiguous_loads_the_last_rank(runs, world):
    """Rank r: r full blocks and its diagonal one; the keys of the ranks after it are skipped."""
    work = {}
    for rank, mine in runs[world].items():
        stats = mine[("contiguous", True, False)]["stats"]
        assert (stats.blocks_full, stats.blocks_masked, stats.blocks_skipped) == (rank, 1, world - 1 - rank)
        work[rank] = stats.blocks_full + stats.blocks_masked
    assert max(work, key=work.get) == world - 1


@pytest.mark.parametrize("world", WORLDS)
def test_without_a_mask_every_pair_is_computed(runs, world):
    for mine in runs[world].values():
        for layout, chunks in (("zigzag", 2), ("contiguous", 1)):
            stats = mine[(layout, False, False)]["stats"]
            assert (stats.blocks_full, stats.blocks_masked, stats.blocks_skipped) == (world * chunks**2, 0, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_gives_the_layouts_positions_and_unshard_undoes_it(runs, world, layout):
    c = N // (2 * world)  # zigzag: 2 * world chunks of c; contiguous: world slices of 2c
    for rank, mine in runs[world].items():
        got = mine["layouts"][layout]
        if layout == "zigzag":
            expected = [*range(rank * c, (rank + 1) * c), *range((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
        else:
            expected = list(range(rank * 2 * c, (rank + 1) * 2 * c))
        assert got["positions"] == expected
        assert got["round_trip"]
        assert got["grad_error"] < 1e-12  # unshard's gradient: the sum of every rank's


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_lengths_that_do_not_divide_name_the_multiple(runs, world):
    messages = runs[world][0]["messages"]
    assert re.search(rf"multiple of 2 \* world = {2 * world}\b.*local length 7 \(full length {7 * world}\)",
                     messages["ring zigzag odd"])
    assert messages["ring contiguous odd"] is None  # any local length: the full length is world times it
    assert re.search(rf"multiple of 2 \* world = {2 * world}, got {2 * world + 1}", messages["shard zigzag"])
    assert re.search(rf"multiple of world = {world}, got {world + 1}", messages["shard contiguous"])
    assert re.search(r"same local length.*query \(1, 2, 4, 4\) has 4, key \(1, 2, 6, 4\) has 6",
                     messages["lengths differ"])
    assert re.search(r"sinks must have shape \(H,\) = \(4,\), one logit per query head.*got \(2,\)",
                     messages["sinks per kv head"])


@pytest.mark.parametrize("case", SINK_CASES, ids=_case_id)
@pytest.mark.parametrize("world", WORLDS)
def test_sinks_are_added_once_and_their_gradient_is_each_ranks_share(runs, world, case):
    """Outputs and dq, dk, dv equal the dense path with sinks; the ranks' sinks.grad sum to its dsinks."""
    results = runs[world]
    for rank, mine in results.items():
        errors = mine[("sinks", *case)]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {errors}"
        assert mine[("sinks", *case)]["sinks_effect"] > 1e-2  # the sinks matter: the check is not vacuous
    shares = [results[rank][("sinks", *case)]["sinks_grad"] for rank in range(world)]
    expected = results[0][("sinks", *case)]["expected_sinks_grad"]
    torch.testing.assert_close(sum(shares), expected, atol=1e-10, rtol=1e-10)  # summed once: by the caller
    if world > 1:  # a share, not the total: no rank all-reduced it
        assert all((share - expected).abs().max() > 1e-3 for share in shares)


@pytest.mark.parametrize("world", WORLDS)
def test_one_sink_per_query_is_sharded_with_the_queries(runs, world):
    """Inkling 2's sinks (B, H, N): out, dq, dk, dv and dsinks, gathered, equal the dense path."""
    for rank, mine in runs[world].items():
        errors = mine["sinks per query"]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv, dsinks {errors}"
        assert mine["sinks per query"]["sinks_effect"] > 1e-2


# --- without processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_schedule_counts(world):
    for layout, chunks in (("zigzag", 2), ("contiguous", 1)):
        schedule = ring_schedule(world, layout=layout)
        for rank, blocks in enumerate(schedule):
            assert len(blocks) == world * chunks**2
            assert [b.source for b in blocks[::chunks**2]] == [(rank - s) % world for s in range(world)]
            kinds = [b.kind for b in blocks]
            if layout == "zigzag":
                assert (kinds.count("full"), kinds.count("masked")) == (2 * world - 1, 2)
            else:
                assert (kinds.count("full"), kinds.count("masked")) == (rank, 1)
        # the pairs kept by the causal mask, counted over the ranks, are those of the full matrix
        c, n = 2, chunks * world  # c positions per chunk, n chunks
        kept = sum(c * c if b.kind == "full" else c * (c + 1) // 2 if b.kind == "masked" else 0
                   for blocks in schedule for b in blocks)
        assert kept == int(torch.ones(n * c, n * c).tril().sum())


def test_zigzag_balances_every_step():
    for world in (2, 4, 8):
        for blocks in ring_schedule(world):
            for step in range(world):
                kinds = [b.kind for b in blocks if b.step == step]
                # a diagonal pair counts as half a pair: every rank computes 2 pairs' worth per step
                assert kinds.count("full") + kinds.count("masked") / 2 == 2


def test_schedule_checks_its_arguments():
    with pytest.raises(ValueError, match=r"world must be >= 1, got 0"):
        ring_schedule(0)
    with pytest.raises(TypeError, match=r"world must be an int, got float"):
        ring_schedule(2.0)
    with pytest.raises(ValueError, match=r"layout must be one of \('zigzag', 'contiguous', 'zigzag-per-sequence'\), got 'ring'"):
        ring_schedule(2, layout="ring")


@pytest.mark.parametrize("call", ["ring_attention", "shard", "unshard"])
def test_a_process_group_is_required(call):
    assert not dist.is_initialized()
    x = torch.randn(1, 2, 4, 3)
    fn = {"ring_attention": lambda: ring_attention(x, x, x), "shard": lambda: shard(x),
          "unshard": lambda: unshard(x)}[call]
    with pytest.raises(RuntimeError, match=rf"{call} needs an initialised process group"):
        fn()


def test_spawn_refuses_what_a_new_process_cannot_import():
    def local_worker(rank, world_size):  # defined inside a function: not importable
        return rank

    with pytest.raises(TypeError, match="spawn needs fn and args that a new process can import"):
        spawn(local_worker, 2)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        spawn(_failing_worker, 0)


def _where_am_i(rank, world_size):
    import os
    import sys
    return {"parent": os.getppid(), "package": "attention_ref.distributed" in sys.modules}


def test_spawn_forks_its_processes_from_a_server_not_the_caller():
    """The processes come from the forkserver (torch imported once there), not from fresh interpreters
    started by the caller; each imports this package itself, so an edit of it is what runs."""
    import os

    results = spawn(_where_am_i, 2)
    parents = {r["parent"] for r in results}
    assert len(parents) == 1 and os.getpid() not in parents, (os.getpid(), parents)
    assert all(r["package"] for r in results)


def test_a_failing_rank_stops_the_others():
    """Rank 1 raises; rank 0, waiting for it in a barrier, is stopped (or fails) instead of hanging."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose|gloo"):
        spawn(_failing_worker, 2, timeout=60)
    assert time.monotonic() - start < 50


def test_the_pages_script_with_the_main_guard_runs_from_an_empty_folder(tmp_path):
    """inference/across-devices.md shows how a script calls spawn (issue 38: without the guard it fails)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "inference" / "across-devices.md").read_text()
    script = next(block for block in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
                  if 'if __name__ == "__main__":' in block)
    (tmp_path / "run.py").write_text(script)
    done = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) < 1e-12
