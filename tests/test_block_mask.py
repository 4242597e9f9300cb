"""A block mask built once and passed as ``block_mask=`` to the public API (issue 23).

Every entry point that takes a ``mask_mod`` takes a `attention_ref.block_mask.BlockMask`:
the results equal building it per call (float64, outputs and gradients), the tiled
backend never evaluates the mod on full or empty blocks, and a block mask made for
another call raises with both values in the message. The fast, evaluation-free
classification of described bands equals the evaluated one.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from attention_ref import (
    MultiHeadAttention,
    attention_weights,
    mods,
    scaled_dot_product_attention,
    tiled,
)
from attention_ref.backends import select_backend
from attention_ref.block_mask import BlockMask, create_block_mask
from attention_ref.kv_cache import attention_with_kv_cache, kv_cache_mask_mod
from attention_ref.varlen import varlen_attention, varlen_mask_mod

B, H, L, S, E, Ev = 2, 3, 13, 17, 5, 7
BLOCKS = {"block_q": 4, "block_k": 3}


def _qkv(L=L, S=S, Hkv=H, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


def _with_grads(out, inputs):
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum(), inputs)
    return (out, *grads)


def _assert_equal_results(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


MASK_MODS = {
    "window": mods.sliding_window(4, 1, offset=S - L),
    "hand-written": lambda b, h, q_idx, kv_idx: ((q_idx // 5) == (kv_idx // 6)) | (h == 1),
}


@pytest.mark.parametrize("name", list(MASK_MODS))
@pytest.mark.parametrize("backend", ["tiled", "math", "sdpa", "auto"])
def test_public_call_with_a_block_mask_equals_building_it_per_call(name, backend):
    mask_mod = MASK_MODS[name]
    bm = create_block_mask(mask_mod, None, H, L, S, **BLOCKS)
    q, k, v = _qkv()
    with_bm = _with_grads(scaled_dot_product_attention(q, k, v, backend=backend, block_mask=bm), (q, k, v))
    # per call: the tiled path builds the same block mask inside (same blocks), the others materialise the mod
    per_call = tiled.tiled_attention(q, k, v, mask_mod=mask_mod, **BLOCKS) if backend == "tiled" else \
        scaled_dot_product_attention(q, k, v, backend=backend, mask_mod=mask_mod)
    _assert_equal_results(with_bm, _with_grads(per_call, (q, k, v)))
    reference = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod)  # the math path
    _assert_equal_results(with_bm[:1], (reference,))


def test_grouped_heads_causal_and_lse_with_a_block_mask():
    q, k, v = _qkv(Hkv=1)
    bm = create_block_mask(mods.causal(), None, None, L, S, **BLOCKS)
    got = scaled_dot_product_attention(q, k, v, block_mask=bm, backend="tiled", enable_gqa=True, return_lse=True)
    want = scaled_dot_product_attention(q, k, v, mask_mod=bm.mask_mod, enable_gqa=True, return_lse=True)
    _assert_equal_results(_with_grads(got[0], (q, k, v)) + (got[1],), _with_grads(want[0], (q, k, v)) + (want[1],))
    # passing the block mask's own mod as well is allowed (the same function)
    again = scaled_dot_product_attention(q, k, v, mask_mod=bm.mask_mod, block_mask=bm, backend="tiled",
                                         enable_gqa=True)
    _assert_equal_results((again,), (got[0],))


def test_attention_weights_and_the_module_take_a_block_mask():
    mask_mod = MASK_MODS["window"]
    bm = create_block_mask(mask_mod, None, None, L, S, **BLOCKS)
    q, k, _ = _qkv()
    _assert_equal_results((attention_weights(q, k, block_mask=bm),), (attention_weights(q, k, mask_mod=mask_mod),))
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, backend="tiled", dtype=torch.float64)
    x, y = torch.randn(B, L, 12, dtype=torch.float64), torch.randn(B, S, 12, dtype=torch.float64)
    per_call = mha(x, y, mask_mod=mask_mod)
    _assert_equal_results((mha(x, y, block_mask=bm),), (per_call,))


def test_the_mod_runs_on_partial_blocks_only_when_a_block_mask_is_passed():
    evaluated = []
    window = mods.sliding_window(9)

    def counting_mod(b, h, q_idx, kv_idx):
        evaluated.append((int(q_idx.min()), int(kv_idx.min()), q_idx.numel(), kv_idx.numel()))
        return window(b, h, q_idx, kv_idx)

    n = 32
    bm = create_block_mask(counting_mod, None, None, n, n, block_q=4, block_k=4)
    counts = bm.counts()
    assert counts["full"] > 0 and counts["empty"] > counts["partial"]
    evaluated.clear()
    q, k, v = (t.detach().requires_grad_() for t in _qkv(L=n, S=n))
    scaled_dot_product_attention(q, k, v, block_mask=bm, backend="tiled").sum().backward()
    partial = [(qi * 4, kj * 4) for qi, row in enumerate(bm.kinds.tolist()) for kj, kind in enumerate(row) if kind == 1]
    assert all(nq == 4 and nk == 4 for *_, nq, nk in evaluated)  # block by block, never a strip or the grid
    assert sorted((i0, j0) for i0, j0, _, _ in evaluated) == sorted(partial)  # once: the backward reuses them
    # Without it the call builds one first: the mod is evaluated on every pair once more.
    evaluated.clear()
    scaled_dot_product_attention(q, k, v, mask_mod=counting_mod, backend="tiled")
    assert sum(nq * nk for *_, nq, nk in evaluated) >= n * n


def test_auto_reads_the_given_block_mask_instead_of_building_one(monkeypatch):
    from attention_ref import backends

    bm = create_block_mask(mods.sliding_window(16), None, None, 1024, 1024, block_q=128, block_k=128)
    monkeypatch.setattr(backends, "create_block_mask", lambda *a, **kw: pytest.fail("built a block mask"))
    q = torch.zeros(1, 1, 1024, 8)
    assert select_backend(q, q, q, block_mask=bm) == "tiled"


def test_tiled_attention_takes_the_block_sizes_of_its_block_mask():
    q, k, v = (t.detach() for t in _qkv())
    bm = create_block_mask(MASK_MODS["window"], None, None, L, S, **BLOCKS)
    _assert_equal_results((tiled.tiled_attention(q, k, v, block_mask=bm),),
                          (tiled.tiled_attention(q, k, v, block_mask=bm, **BLOCKS),))


def test_varlen_and_kv_cache_take_a_block_mask():
    lengths = [3, 6, 4]
    cu = torch.tensor([0, 3, 9, 13])
    q = torch.randn(H, 13, E, dtype=torch.float64)
    k, v = torch.randn(1, 13, E, dtype=torch.float64), torch.randn(1, 13, Ev, dtype=torch.float64)
    bm = create_block_mask(varlen_mask_mod(cu, cu, is_causal=True), None, None, 13, 13, **BLOCKS)
    for backend in ("tiled", "math"):
        _assert_equal_results((varlen_attention(q, k, v, cu, cu, is_causal=True, block_mask=bm, backend=backend),),
                              (varlen_attention(q, k, v, cu, cu, is_causal=True),))
    assert sum(lengths) == 13
    with pytest.raises(ValueError, match=r"block_mask was made for is_causal=True, this call has is_causal=False"):
        varlen_attention(q, k, v, cu, cu, block_mask=bm)
    other = torch.tensor([0, 4, 9, 13])
    with pytest.raises(ValueError, match=r"block_mask was made for cu_seqlens_q=\[0, 3, 9, 13\], this call has "
                                         r"cu_seqlens_q=\[0, 4, 9, 13\]"):
        varlen_attention(q, k, v, other, other, is_causal=True, block_mask=bm)
    window = create_block_mask(mods.causal(), None, None, 13, 13)
    with pytest.raises(ValueError, match=r"block_mask must be made from varlen_mask_mod"):
        varlen_attention(q, k, v, cu, cu, block_mask=window)

    seqlens = torch.tensor([5, 9])
    qc = torch.randn(2, 4, 2, E, dtype=torch.float64)
    kc, vc = torch.randn(2, 2, 12, E, dtype=torch.float64), torch.randn(2, 2, 12, Ev, dtype=torch.float64)
    bm = create_block_mask(kv_cache_mask_mod(seqlens, 2, is_causal=True), 2, None, 2, 9, block_q=2, block_k=4)
    for backend in ("tiled", "math"):
        _assert_equal_results((attention_with_kv_cache(qc, kc, vc, seqlens, is_causal=True, block_mask=bm,
                                                       backend=backend),),
                              (attention_with_kv_cache(qc, kc, vc, seqlens, is_causal=True),))
    # a block mask for B=1 of a mod made for two sequences cannot be built (its kinds are checked)
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(1,\), got shape \(2,\)"):
        dataclasses.replace(bm, B=1)
    with pytest.raises(ValueError, match=r"block_mask was made for cache_seqlens=\[5, 9\], this call has "
                                         r"cache_seqlens=\[6, 9\]"):
        attention_with_kv_cache(qc, kc, vc, torch.tensor([6, 9]), is_causal=True, block_mask=bm)
    other_mod = create_block_mask(mods.causal(), None, None, 2, 9, block_q=2, block_k=4)
    with pytest.raises(ValueError, match=r"block_mask must be made from kv_cache_mask_mod\(cache_seqlens, Lq, "
                                         r"is_causal=\.\.\.\), got a block mask of another mask_mod"):
        attention_with_kv_cache(qc, kc, vc, seqlens, is_causal=True, block_mask=other_mod)
    with pytest.raises(TypeError, match=r"block_mask must be an attention_ref.block_mask.BlockMask, got str"):
        attention_with_kv_cache(qc, kc, vc, seqlens, is_causal=True, block_mask="causal")


def test_a_block_mask_made_for_another_call_raises_with_both_values():
    q, k, v = (t.detach() for t in _qkv())
    bm = create_block_mask(mods.causal(), None, 2, L, S, **BLOCKS)  # H=2, the call has 3
    sdpa = scaled_dot_product_attention
    with pytest.raises(ValueError, match=r"block_mask was made for H=2, this call has H=3 \(1 broadcasts\)"):
        sdpa(q, k, v, block_mask=bm, backend="tiled")
    bm = create_block_mask(mods.causal(), None, None, L, S, **BLOCKS)
    with pytest.raises(ValueError, match=r"block_mask was made for L=13, this call has L=12"):
        sdpa(q[..., :12, :], k, v, block_mask=bm)
    with pytest.raises(ValueError, match=r"block_mask was made for S=17, this call has S=16"):
        attention_weights(q, k[..., :16, :], block_mask=bm)
    with pytest.raises(ValueError, match=r"mask_mod and block_mask.mask_mod must be the same function"):
        sdpa(q, k, v, mask_mod=mods.causal(), block_mask=bm)  # an equal mod, but another function
    with pytest.raises(TypeError, match=r"block_mask must be an attention_ref.block_mask.BlockMask, got Tensor"):
        sdpa(q, k, v, block_mask=torch.ones(L, S, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"kinds must have shape .* = \(4, 6\), got \(3, 6\)"):
        BlockMask(bm.mask_mod, 1, 1, L, S, 4, 3, bm.kinds[:-1])
    with pytest.raises(ValueError, match=r"block_mask was made for block_k=3, this call has block_k=5"):
        tiled.tiled_attention(q, k, v, block_mask=bm, block_q=4, block_k=5)
    with pytest.raises(ValueError, match=r"block_mask was made for L=13, this call has L=12"):
        MultiHeadAttention(6, 3, backend="tiled", dtype=torch.float64)(
            torch.randn(B, 12, 6, dtype=torch.float64), torch.randn(B, S, 6, dtype=torch.float64), block_mask=bm)


def _dense_kinds(keep, block_q, block_k):
    Lk, Sk = keep.shape[-2:]
    return [[2 if bool(keep[..., i:i + block_q, j:j + block_k].all()) else
             1 if bool(keep[..., i:i + block_q, j:j + block_k].any()) else 0
             for j in range(0, Sk, block_k)] for i in range(0, Lk, block_q)]


def test_described_bands_are_classified_from_their_corners_exactly():
    rng = random.Random(23)
    side = [None, 0, 1, 2, 3, 5, 8]
    for _ in range(300):
        n_q, n_k, bq, bk = rng.randint(0, 19), rng.randint(0, 19), rng.randint(1, 7), rng.randint(1, 7)
        if rng.random() < 0.3:
            mask_mod = mods.causal(rng.randint(-9, 9))
        else:
            mask_mod = mods.sliding_window(rng.choice(side), rng.choice(side), rng.randint(-9, 9))
        calls = []
        fast = create_block_mask(mask_mod, None, None, n_q, n_k, block_q=bq, block_k=bk)

        def hidden(b, h, q_idx, kv_idx, calls=calls, mask_mod=mask_mod):
            calls.append(1)
            return mask_mod(b, h, q_idx, kv_idx)

        evaluated = create_block_mask(hidden, None, None, n_q, n_k, block_q=bq, block_k=bk)
        assert fast.kinds.tolist() == evaluated.kinds.tolist(), (n_q, n_k, bq, bk, mods.describe(mask_mod))
        if n_q and n_k:
            dense = mods.create_mask(mask_mod, None, None, n_q, n_k)
            assert fast.kinds.tolist() == _dense_kinds(dense, bq, bk)
            assert calls  # the hidden mod was evaluated, the described one was not


BENCHMARK = "block_mask_bench"  # the `bench` fixture (tests/conftest.py) loads benchmarks/block_mask_bench.py


def test_the_benchmark_runs_and_writes_its_json(bench, tmp_path):
    """A smoke run of benchmarks/block_mask_bench.py at tiny sizes (the real run takes minutes)."""
    import json

    assert bench.main(["--reps", "1", "--length", "256", "--contention-length", "64", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("block-mask-*.json")
    run = json.loads(written.read_text())
    assert set(run["forward"]["ratios"]) >= {"public_block_mask_speed_vs_tiled_attention"}
    assert run["forward"]["max_abs_diff_vs_tiled"] == 0.0
    assert set(run["contention"]["times"]) == {"quiet", "one_core_busy"}
    assert set(run["contention"]["times"]["one_core_busy"]) == {"tiled", "tiled_all_threads", "sdpa", "tiled_1_thread"}
    assert set(run["contention"]["fitting_threads_before_timing"]) == {"quiet", "one_core_busy"}
    assert "git_commit" in run["provenance"] and run["provenance"]["command"].startswith("python benchmarks/")


# Issue 39, S3: the public constructor trusted any kinds: all "full" for mods.causal() gave a
# non-causal result with no error.
def test_a_block_mask_built_by_hand_must_match_its_mod():
    made = create_block_mask(mods.causal(), None, None, 8, 8, block_q=2, block_k=2)
    same = BlockMask(made.mask_mod, 1, 1, 8, 8, 2, 2, made.kinds.clone())  # right kinds: accepted
    assert torch.equal(same.kinds, made.kinds)
    with pytest.raises(ValueError, match=r"kinds do not match mask_mod: block \(0, 0\) is given as 'full' but "
                                         r"the mod makes it 'partial' \(10 blocks differ\)"):
        BlockMask(made.mask_mod, 1, 1, 8, 8, 2, 2, torch.full_like(made.kinds, 2))
    with pytest.raises(ValueError, match=r"kinds do not match mask_mod: block \(0, 0\) is given as 7"):
        BlockMask(made.mask_mod, 1, 1, 8, 8, 2, 2, torch.full_like(made.kinds, 7))
    with pytest.raises(ValueError, match=r"kinds do not match mask_mod"):
        dataclasses.replace(made, kinds=torch.full_like(made.kinds, 2))


def test_the_block_mask_lives_beside_the_mods_and_the_tiled_module_still_names_it():
    """Issue 48: the core and every path import the block mask from attention_ref.block_mask, not from a
    backend's file; code written against attention_ref.tiled's names gets the same objects."""
    from attention_ref import block_mask

    assert BlockMask.__module__ == "attention_ref.block_mask"
    for name in ("BlockMask", "create_block_mask", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"):
        assert getattr(tiled, name) is getattr(block_mask, name), name
