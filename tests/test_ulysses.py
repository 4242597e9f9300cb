"""DeepSpeed-Ulysses across processes: equal to one process, with its communication counted.

One `spawn` of 4 CPU processes (gloo) runs every case in process groups of 1, 2, 3 and 4 ranks
(the groups of 2 and 3 leave out ranks, so group ranks differ from global ranks), with 12 query
heads (a multiple of every world size): plain heads, grouped key/value heads cut across the ranks
(``Hkv`` a multiple of ``W``) and repeated to them (``W`` a multiple of ``Hkv``), causal or not,
with learned sinks, in float64 against `attention_ref.scaled_dot_product_attention` on the
unsharded tensors (outputs and the gradients of q, k, v and the sinks), and once in float32.
"""

from __future__ import annotations

import pytest
import torch

from attention_ref import scaled_dot_product_attention
from attention_ref.complexity import ulysses_attention_bytes
from attention_ref.distributed import count_communication, shard, ulysses_attention, unshard
from attention_ref.mods import sliding_window
from ranks import WORLDS, run_in_every_group  # tests/ranks.py

B, H, E, EV, N = 2, 12, 5, 7, 24
# key/value heads per world: cut like the query heads (a multiple of W) or repeated (a divisor of W)
KV_HEADS = {"mha": {w: H for w in WORLDS}, "gqa cut": {1: 2, 2: 4, 3: 6, 4: 4},
            "gqa repeated": {1: 1, 2: 1, 3: 1, 4: 2}}
CASES = [(heads, causal) for heads in KV_HEADS for causal in (True, False)]


def _inputs(hkv, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, N, E), (B, hkv, N, E), (B, hkv, N, EV), (B, H, N, EV))
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _per_head(b, h, q_idx, kv_idx):
    """A causal window of 2 + 2 h + 5 b keys: a mask that reads the global head and the batch row."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 2 + 2 * h + 5 * b)


def _case(group, world, heads, causal, dtype=torch.float64, with_sinks=False, seed=0, mask_mod=None):
    hkv = KV_HEADS[heads][world]
    gqa = hkv != H
    q, k, v, d_out = _inputs(hkv, seed, dtype)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2 if with_sinks else None
    local = [shard(t, group=group, layout="contiguous").requires_grad_() for t in (q, k, v)]
    mine = None if sinks is None else sinks.clone().requires_grad_()
    with count_communication() as stats:
        out = ulysses_attention(*local, is_causal=causal, enable_gqa=gqa, group=group, sinks=mine, mask_mod=mask_mod)
        out.backward(shard(d_out, group=group, layout="contiguous"))
    gathered = [unshard(t.detach(), group=group, layout="contiguous").double()
                for t in (out, *(x.grad for x in local))]
    full = [t.double().clone().requires_grad_() for t in (q, k, v)]
    full_sinks = None if sinks is None else sinks.double().clone().requires_grad_()
    expected = scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=gqa, sinks=full_sinks,
                                            mask_mod=mask_mod, backend="math")
    wanted = full + ([] if full_sinks is None else [full_sinks])
    grads = torch.autograd.grad(expected, wanted, d_out.double())
    result = {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, (expected.detach(), *grads[:3]))],
              "stats": stats, "dtype": out.dtype, "hkv": hkv,
              "sizes": {"q": local[0].numel(), "kv": local[1].numel(), "v": local[2].numel(), "out": out.numel()}}
    if sinks is not None:
        result["sinks_grad"], result["expected_sinks_grad"] = mine.grad, grads[3]
    return result


def _messages(group, world):
    messages = {}
    q = torch.randn(1, 2 * world + 1, 4, 3, dtype=torch.float64)  # query heads not a multiple of W
    try:
        ulysses_attention(q, q, q, group=group)
    except ValueError as error:
        messages["heads"] = str(error)
    q = torch.randn(1, 12, 4, 3, dtype=torch.float64)
    # key/value heads that divide H but are neither a multiple nor a divisor of W
    k = torch.randn(1, {2: 3, 3: 2, 4: 3}[world], 4, 3, dtype=torch.float64)
    try:
        ulysses_attention(q, k, k, enable_gqa=True, group=group)
    except ValueError as error:
        messages["kv heads"] = str(error)
    try:
        ulysses_attention(q, q, q, group=group, sinks=torch.zeros(1, 12, 4, dtype=torch.float64))
    except NotImplementedError as error:
        messages["per-query sinks"] = str(error)
    return messages


def _cases(group, world):
    mine = {case: _case(group, world, *case) for case in CASES}
    mine["sinks"] = _case(group, world, "gqa cut", True, with_sinks=True, seed=2)
    mine["float32"] = _case(group, world, "gqa cut", True, torch.float32, seed=1)
    mine["per head"] = _case(group, world, "gqa repeated", False, seed=4, mask_mod=_per_head)
    mine["window"] = _case(group, world, "mha", True, seed=5, mask_mod=sliding_window(3))
    mine["messages"] = _messages(group, world) if world > 1 else {}
    return mine


@pytest.fixture(scope="module")
def runs():
    return run_in_every_group(_cases)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].replace(' ', '-')}-{'causal' if c[1] else 'full'}")
@pytest.mark.parametrize("world", WORLDS)
def test_outputs_and_gradients_equal_one_process(runs, world, case):
    for rank, mine in runs[world].items():
        errors = mine[case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("world", WORLDS)
def test_sinks_count_once_and_the_ranks_gradients_sum_to_the_whole(runs, world):
    shares = []
    for rank, mine in runs[world].items():
        run = mine["sinks"]
        assert max(run["errors"]) < 1e-10, run["errors"]
        # this rank's share: its own heads only
        heads = torch.arange(H) // (H // world) == rank
        assert (run["sinks_grad"][~heads] == 0).all() and run["sinks_grad"][heads].abs().min() > 0
        shares.append(run["sinks_grad"])
    whole = runs[world][0]["sinks"]["expected_sinks_grad"]
    torch.testing.assert_close(torch.stack(shares).sum(0), whole, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["per head", "window"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_mask_mod_reads_global_positions_and_global_heads(runs, world, case):
    for rank, mine in runs[world].items():
        errors = mine[case]["errors"]
        assert max(errors) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("world", WORLDS)
def test_float32_is_as_close_as_one_process(runs, world):
    one = max(runs[1][0]["float32"]["errors"])
    for mine in runs[world].values():
        assert mine["float32"]["dtype"] == torch.float32
        assert max(mine["float32"]["errors"]) <= 2 * one + 1e-7


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].replace(' ', '-')}-{'causal' if c[1] else 'full'}")
@pytest.mark.parametrize("world", WORLDS)
def test_communication_is_four_exchanges_each_way(runs, world, case):
    """Forward: q, k, v to head slices and the output back; backward: dO out, dq, dk, dv back. Each sends
    (W - 1) / W of the tensor (k and v after any repetition of their heads), whatever W is."""
    for mine in runs[world].values():
        run = mine[case]
        stats, sizes = run["stats"], run["sizes"]
        repeat = world // run["hkv"] if run["hkv"] % world else 1  # the copies of each kv head
        elements = sizes["q"] + repeat * (sizes["kv"] + sizes["v"]) + sizes["out"]
        sent = (world - 1) * elements // world * 8  # float64
        assert (stats.forward_all_to_all, stats.forward_all_to_all_bytes) == (4, sent)
        assert (stats.backward_all_to_all, stats.backward_all_to_all_bytes) == (4, sent)
        # the formula of attention_ref.complexity, from the sizes alone
        assert sent == ulysses_attention_bytes(B, H, run["hkv"], N, E, EV, world, bytes_per_element=8)
        assert stats.forward_steps == stats.backward_kv_steps == 0  # no ring


@pytest.mark.parametrize("world", [2, 3, 4])
def test_heads_that_do_not_divide_name_the_numbers(runs, world):
    for mine in runs[world].values():
        messages = mine["messages"]
        assert messages["heads"] == (f"ulysses_attention cuts the query heads across the ranks: H={2 * world + 1} "
                                     f"query heads must be a multiple of the world size W={world} (each rank takes "
                                     "H / W of them)")
        hkv = {2: 3, 3: 2, 4: 3}[world]
        assert f"the key/value heads Hkv={hkv} to be a multiple of the world size W={world}" in messages["kv heads"]
        assert "one per query, which ring_attention shards with the queries" in messages["per-query sinks"]


def test_the_formulas_name_what_does_not_divide():
    with pytest.raises(ValueError, match="L=10 must be a multiple of world=4"):
        ulysses_attention_bytes(1, 8, 8, 10, 4, 4, 4)
    with pytest.raises(ValueError, match="H=6 query heads must be a multiple of world=4 for Ulysses"):
        ulysses_attention_bytes(1, 6, 6, 8, 4, 4, 4)
    with pytest.raises(ValueError, match="Hkv=3 key/value heads must be a multiple or a divisor of world=4"):
        ulysses_attention_bytes(1, 12, 3, 8, 4, 4, 4)
    with pytest.raises(ValueError, match="world must be a positive int, got 0"):
        ulysses_attention_bytes(1, 12, 3, 8, 4, 4, 0)


def test_the_demo_worker_names_a_strategy_it_does_not_know():
    from attention_ref.distributed import demo_worker

    with pytest.raises(ValueError, match="strategy must be 'ring', 'ulysses' or 'usp', got 'tree'"):
        demo_worker(0, 1, strategy="tree")
    with pytest.raises(ValueError, match="Ulysses takes contiguous slices: layout must be 'contiguous', got 'zigzag'"):
        demo_worker(0, 1, strategy="ulysses")
