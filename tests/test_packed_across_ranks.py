"""Packed sequences across ranks (Megatron's THD batches): `ring_attention` and `ulysses_attention`
with ``cu_seqlens``, equal to `attention_ref.varlen.varlen_attention` and to dense attention with
the block-diagonal mask, outputs and gradients in float64.

One `spawn` of 4 CPU processes (gloo) runs every case in process groups of 1, 2, 3 and 4 ranks
(`tests/ranks.py`).
N = 24 positions hold four packed sequences of 5, 0, 8 and 11 tokens: boundaries fall inside
the ranks' slices and chunks, and one sequence is empty.
"""

from __future__ import annotations

import pytest
import torch

from attention_ref import scaled_dot_product_attention
from attention_ref.distributed import count_communication, ring_attention, shard, ulysses_attention, unshard
from attention_ref.varlen import varlen_attention
from ranks import WORLDS, run_in_every_group  # tests/ranks.py

H, E, EV, N = 12, 5, 7, 24
CU = [0, 5, 5, 13, 24]
CASES = [(strategy, causal) for strategy in ("ring zigzag", "ring contiguous", "ulysses") for causal in (True, False)]


def _documents():
    return torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor(CU).diff())  # (N,)


def _case(group, strategy, causal, seed=0):
    hkv = H if strategy == "ulysses" else 4  # grouped key/value heads in the ring
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, h, N, e, generator=gen, dtype=torch.float64)
                      for h, e in ((H, E), (hkv, E), (hkv, EV), (H, EV)))
    layout = "zigzag" if strategy == "ring zigzag" else "contiguous"
    local = [shard(t, group=group, layout=layout).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor(CU)
    with count_communication() as stats:
        if strategy == "ulysses":
            out = ulysses_attention(*local, is_causal=causal, group=group, cu_seqlens=cu)
        else:
            out = ring_attention(*local, is_causal=causal, enable_gqa=True, group=group, layout=layout,
                                 cu_seqlens=cu)
        out.backward(shard(d_out, group=group, layout=layout))
    gathered = [unshard(t.detach(), group=group, layout=layout) for t in (out, *(x.grad for x in local))]
    docs = _documents()
    keep = docs[:, None] == docs[None, :]  # (N, N): block-diagonal
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = scaled_dot_product_attention(*full, keep, is_causal=causal, enable_gqa=hkv != H)
    grads = torch.autograd.grad(dense, full, d_out)
    # varlen_attention takes (H, total, E): the one batch row's heads first
    group_size = H // hkv
    packed = varlen_attention(q[0], k[0].repeat_interleave(group_size, 0), v[0].repeat_interleave(group_size, 0),
                              cu, cu, is_causal=causal)
    unpacked = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != H)
    return {"errors": [(a - b).abs().max().item() for a, b in zip(gathered, (dense.detach(), *grads))],
            "varlen_error": (gathered[0][0] - packed).abs().max().item(),
            "packing_matters": (dense.detach() - unpacked).abs().max().item(),
            "sent": stats.forward_bytes + stats.forward_all_to_all_bytes}


def _cases(group, world):
    mine = {case: _case(group, *case) for case in CASES}
    if world > 1:
        try:
            ring_attention(*(torch.zeros(1, 2, N // world, 4, dtype=torch.float64) for _ in range(3)),
                           group=group, layout="contiguous", cu_seqlens=torch.tensor([0, 5, N - 1]))
        except ValueError as error:
            mine["message"] = str(error)
    return mine


@pytest.fixture(scope="module")
def runs():
    return run_in_every_group(_cases)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].replace(' ', '-')}-{'causal' if c[1] else 'full'}")
@pytest.mark.parametrize("world", WORLDS)
def test_packed_sequences_equal_varlen_and_dense_attention(runs, world, case):
    for rank, mine in runs[world].items():
        run = mine[case]
        assert max(run["errors"]) < 1e-10, f"rank {rank}: errors of out, dq, dk, dv {run['errors']}"
        assert run["varlen_error"] < 1e-10, run["varlen_error"]
        assert run["packing_matters"] > 1e-2  # attention across the boundaries would differ
        # the last rank of a causal contiguous ring holds the last keys, which no other rank's queries see
        silent = case == ("ring contiguous", True) and rank == world - 1
        assert (run["sent"] > 0) == (world > 1 and not silent)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_offsets_that_miss_the_full_length_are_named(runs, world):
    for mine in runs[world].values():
        assert mine["message"] == (f"cu_seqlens must end at the packed length the full length (the local length x "
                                   f"world) = {N}, got cu_seqlens[-1] = {N - 1} ([0, 5, {N - 1}])")
