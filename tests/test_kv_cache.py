"""Attention over a key/value cache: decoding token by token equals one full causal pass.

Every comparison runs in float64 against PyTorch's ``scaled_dot_product_attention`` (or a
per-sequence slice of the cache given to it), with grouped-query heads (``H = 6`` query heads
over 2, 3 or 6 key/value heads). The caches are checked three ways: a prefill followed by
single-token steps gives, at every step, the rows of one full causal pass; a paged pool whose
blocks are scattered (freed by other sequences in a random order, sequences interleaved) gives
the contiguous result; and a left-padded batch gives each sequence's own result, with zeros
(not NaN) on the padding rows even when the unused cache slots hold NaN. Bad input raises an
error that names the argument.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_ref import mods, scaled_dot_product_attention
from attention_ref.kv_cache import KVCache, PagedKVCache, attention_with_kv_cache

B, H, E, EV = 2, 6, 7, 5
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-10)


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def _full_pass(q, k, v):
    """One causal pass over a whole sequence, PyTorch's SDPA (top-left = bottom-right when L == S)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _bottom_right(q, k, v):
    """PyTorch's SDPA with the bottom-right causal mask written out: key j for query i when j <= i + S - L."""
    L, S = q.shape[-2], k.shape[-2]
    keep = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


# --- decoding equals one full pass ---------------------------------------------------------------


@pytest.mark.parametrize("hkv", [2, 3, 6])
def test_prefill_then_decode_equals_one_causal_pass_contiguous(hkv):
    gen = torch.Generator().manual_seed(hkv)
    prompt, steps = 5, 7
    N = prompt + steps
    q, k, v = _randn(B, H, N, E, gen=gen), _randn(B, hkv, N, E, gen=gen), _randn(B, hkv, N, EV, gen=gen)
    expected = _full_pass(q, k, v)  # (B, H, N, Ev)
    cache = KVCache(B, hkv, max_length=N + 2, head_dim=E, value_dim=EV, dtype=F64)
    cache.append(k[:, :, :prompt], v[:, :, :prompt])
    out = attention_with_kv_cache(q[:, :, :prompt], cache.key_cache, cache.value_cache, cache.lengths,
                                  is_causal=True)
    torch.testing.assert_close(out, expected[:, :, :prompt], **TOL)
    for t in range(prompt, N):
        keys, values = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert keys.shape == (B, hkv, t + 1, E) and values.shape == (B, hkv, t + 1, EV)
        assert cache.lengths.tolist() == [t + 1] * B
        out = attention_with_kv_cache(q[:, :, t:t + 1], cache.key_cache, cache.value_cache, cache.lengths,
                                      is_causal=True)
        torch.testing.assert_close(out, expected[:, :, t:t + 1], **TOL)


def _scattered_pool(num_blocks, block_size, hkv, seed):
    """A pool whose free list is shuffled: dummy sequences take blocks and are freed in a random order."""
    pool = PagedKVCache(num_blocks, block_size, hkv, E, value_dim=EV, dtype=F64)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dummies = list(range(100, 106))
    for d in dummies:
        pool.allocate(d)
        n = rng.randint(1, 3 * block_size)
        pool.append([d], _randn(1, hkv, n, E, gen=gen), _randn(1, hkv, n, EV, gen=gen))
    rng.shuffle(dummies)
    for d in dummies:
        pool.free(d)
    assert pool.blocks_in_use == 0
    return pool


@pytest.mark.parametrize("hkv", [2, 3])
def test_prefill_then_decode_equals_one_causal_pass_paged_and_interleaved(hkv):
    gen = torch.Generator().manual_seed(10 + hkv)
    block_size, prompt, steps = 3, 5, 8
    N = prompt + steps
    q, k, v = _randn(B, H, N, E, gen=gen), _randn(B, hkv, N, E, gen=gen), _randn(B, hkv, N, EV, gen=gen)
    expected = _full_pass(q, k, v)
    pool = _scattered_pool(40, block_size, hkv, seed=hkv)
    ids = ["x", "y"]
    for sid in ids:
        pool.allocate(sid)
    pool.allocate("other")

    def step(lo, hi):
        out = attention_with_kv_cache(q[:, :, lo:hi], pool.key_blocks, pool.value_blocks, pool.seqlens(ids),
                                      block_table=pool.block_table(ids), is_causal=True)
        torch.testing.assert_close(out, expected[:, :, lo:hi], **TOL)

    pool.append(ids, k[:, :, :prompt], v[:, :, :prompt])
    step(0, prompt)
    for t in range(prompt, N):
        # another sequence takes blocks between the steps, and the two sequences append one at a time
        pool.append(["other"], _randn(1, hkv, 1, E, gen=gen), _randn(1, hkv, 1, EV, gen=gen))
        order = [0, 1] if t % 2 else [1, 0]
        for b in order:
            pool.append([ids[b]], k[b:b + 1, :, t:t + 1], v[b:b + 1, :, t:t + 1])
        step(t, t + 1)
    table = pool.block_table(ids)
    used = table[:, : -(-N // block_size)]
    assert sorted(used.flatten().tolist()) != list(range(used.numel())), "the blocks should be scattered"
    assert not torch.equal(used, used.sort(dim=-1).values), "a sequence's blocks should be out of order"


@settings(max_examples=30, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 3, 6]),
    block_size=st.integers(1, 6),
    lengths=st.lists(st.integers(0, 17), min_size=1, max_size=3),
    Lq=st.integers(1, 4),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_in_a_shuffled_pool_equals_contiguous_equals_each_sequence(hkv, block_size, lengths, Lq, causal,
                                                                          seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [max(n, Lq) for n in lengths]  # every sequence holds its Lq new tokens
    nb, S_max = len(lengths), max(lengths) + 2
    q = _randn(nb, H, Lq, E, gen=gen)
    key_cache, value_cache = _randn(nb, hkv, S_max, E, gen=gen), _randn(nb, hkv, S_max, EV, gen=gen)
    seqlens = torch.tensor(lengths)
    contiguous = attention_with_kv_cache(q, key_cache, value_cache, seqlens, is_causal=causal)
    # the same tokens in blocks taken in a random order from a larger pool
    per_seq = -(-S_max // block_size)
    num_blocks = nb * per_seq + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: nb * per_seq].reshape(nb, per_seq)  # (nb, per_seq)
    k_pool, v_pool = _randn(num_blocks, hkv, block_size, E, gen=gen), _randn(num_blocks, hkv, block_size, EV, gen=gen)
    for b in range(nb):
        for p in range(lengths[b]):
            k_pool[table[b, p // block_size], :, p % block_size] = key_cache[b, :, p]
            v_pool[table[b, p // block_size], :, p % block_size] = value_cache[b, :, p]
    paged = attention_with_kv_cache(q, k_pool, v_pool, seqlens, block_table=table, is_causal=causal)
    torch.testing.assert_close(paged, contiguous, **TOL)
    for b, n in enumerate(lengths):
        K, V = key_cache[b:b + 1, :, :n], value_cache[b:b + 1, :, :n]
        ref = _bottom_right(q[b:b + 1], K, V) if causal else F.scaled_dot_product_attention(
            q[b:b + 1], K, V, enable_gqa=True)
        torch.testing.assert_close(contiguous[b:b + 1], ref, **TOL)


@pytest.mark.parametrize("backend", ["tiled", "sdpa", "auto"])
def test_a_prefill_on_other_backends_equals_each_sequence_alone(backend, score_blocks):
    # 280 new tokens per sequence against caches holding 300 and 280 tokens (the new ones
    # included; one prompt was prefilled, the other continues a 20-token prefix), in 320 slots:
    # outputs and gradients equal each sequence alone, and the tiled backend skips the key
    # blocks above both sequences' causal diagonals.
    from attention_ref.backends import TILED_MODS_BLOCK_K, TILED_MODS_BLOCK_Q

    gen = torch.Generator().manual_seed(7)
    lengths, Lq, hkv = [300, 280], 280, 2
    q = _randn(2, H, Lq, E, gen=gen).requires_grad_()
    key_cache = _randn(2, hkv, 320, E, gen=gen).requires_grad_()
    value_cache = _randn(2, hkv, 320, EV, gen=gen)
    computed = score_blocks
    out = attention_with_kv_cache(q, key_cache, value_cache, torch.tensor(lengths), is_causal=True,
                                  backend=backend)
    g = _randn(*out.shape, gen=gen)
    dq, dk = torch.autograd.grad(out, (q, key_cache), g)
    for b, n in enumerate(lengths):
        qb = q[b:b + 1].detach().requires_grad_()
        kb = key_cache[b:b + 1, :, :n].detach().requires_grad_()
        ref = _bottom_right(qb, kb, value_cache[b:b + 1, :, :n])
        ref_dq, ref_dk = torch.autograd.grad(ref, (qb, kb), g[b:b + 1])
        torch.testing.assert_close(out[b:b + 1], ref, **TOL)
        torch.testing.assert_close(dq[b:b + 1], ref_dq, **TOL)
        torch.testing.assert_close(dk[b:b + 1, :, :n], ref_dk, **TOL)
        assert torch.equal(dk[b, :, n:], torch.zeros_like(dk[b, :, n:]))  # slots past the length
    if backend == "tiled":
        grid = -(-Lq // TILED_MODS_BLOCK_Q) * -(-max(lengths) // TILED_MODS_BLOCK_K)
        forward = {(i0, j) for i0, j0, j1 in computed for j in range(j0, j1, TILED_MODS_BLOCK_K)}
        assert 0 < len(forward) < grid
    else:
        assert not computed


# --- alignment -----------------------------------------------------------------------------------


def test_several_new_queries_are_aligned_bottom_right_not_top_left():
    gen = torch.Generator().manual_seed(3)
    Lq, S, hkv = 4, 11, 3
    q, k, v = _randn(1, H, Lq, E, gen=gen), _randn(1, hkv, S, E, gen=gen), _randn(1, hkv, S, EV, gen=gen)
    out = attention_with_kv_cache(q, k, v, torch.tensor([S]), is_causal=True)
    ours = scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=mods.causal(offset=S - Lq))
    torch.testing.assert_close(out, ours, **TOL)
    torch.testing.assert_close(out, _bottom_right(q, k, v), **TOL)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - top_left).abs().amax(dim=(0, 1, 3)).min() > 1e-3, "every row differs from top-left"
    # without is_causal, every valid key for every query
    full = attention_with_kv_cache(q, k, v, torch.tensor([S]))
    torch.testing.assert_close(full, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **TOL)


def test_weights_come_from_the_same_call_and_cover_the_valid_keys_only():
    gen = torch.Generator().manual_seed(4)
    q = _randn(B, H, 3, E, gen=gen)
    k, v = _randn(B, 2, 13, E, gen=gen), _randn(B, 2, 13, EV, gen=gen)
    seqlens = torch.tensor([5, 9])
    out, w = attention_with_kv_cache(q, k, v, seqlens, is_causal=True, return_weights=True)
    assert w.shape == (B, H, 3, 9)  # S = max(cache_seqlens)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, 3, dtype=F64), **TOL)
    assert (w[0, :, :, 5:] == 0).all()
    assert (w[0, :, 0, 3:] == 0).all() and (w[0, :, 0, :3] > 0).all()  # query 0 of 3 sits at position 2
    values = v[:, :, :9].repeat_interleave(3, dim=1)  # (B, H, S, Ev)
    torch.testing.assert_close(out, w @ values, **TOL)


def test_without_is_causal_every_valid_key_and_no_other():
    gen = torch.Generator().manual_seed(11)
    q = _randn(B, H, 2, E, gen=gen)
    k, v = _randn(B, 3, 13, E, gen=gen), _randn(B, 3, 13, EV, gen=gen)
    out = attention_with_kv_cache(q, k, v, torch.tensor([5, 9]))
    for b, n in enumerate([5, 9]):
        ref = F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1], ref, **TOL)


def test_scale_is_passed_on():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _randn(1, H, 2, E, gen=gen), _randn(1, H, 6, E, gen=gen), _randn(1, H, 6, EV, gen=gen)
    out = attention_with_kv_cache(q, k, v, torch.tensor([6]), is_causal=True, scale=0.3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(2, 6, dtype=torch.bool).tril(4), scale=0.3), **TOL)


# --- left padding ----------------------------------------------------------------------------------


def test_left_padded_prefill_then_decode_gives_zero_rows_and_each_sequence_alone():
    """Prompts of different lengths, left-padded to one length, prefilled with the core, then decoded.

    The padding keys are masked with a padding mod (key j takes part when j >= pad[b]) and the
    causal rule; padded query rows see no key: they give 0, nothing is NaN (also in the
    gradients), and the real rows equal each prompt run alone, so the padding's contents (random
    here) reach nothing. attention_with_kv_cache refuses this layout (cache_seqlens < Lq): its
    caches hold each sequence from position 0.
    """
    gen = torch.Generator().manual_seed(6)
    lengths, hkv = [2, 5, 3], 2
    Lq = max(lengths)
    nb = len(lengths)
    pad = torch.tensor([Lq - n for n in lengths])  # (B,) left padding of each prompt
    prompts = [(_randn(1, H, n, E, gen=gen), _randn(1, hkv, n, E, gen=gen), _randn(1, hkv, n, EV, gen=gen))
               for n in lengths]
    # left-padded batch; the padding holds random values, which must not reach any real row
    q, k, v = _randn(nb, H, Lq, E, gen=gen), _randn(nb, hkv, Lq, E, gen=gen), _randn(nb, hkv, Lq, EV, gen=gen)
    for b, (qb, kb, vb) in enumerate(prompts):
        q[b, :, pad[b]:], k[b, :, pad[b]:], v[b, :, pad[b]:] = qb[0], kb[0], vb[0]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    not_padding = lambda b, h, i, j: j >= pad[b]  # noqa: E731 - the keys that take part
    mask_mod = mods.and_masks(mods.causal(), not_padding)
    out = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, enable_gqa=True)
    assert not out.isnan().any()
    for b, (n, (qb, kb, vb)) in enumerate(zip(lengths, prompts)):
        assert (out[b, :, : Lq - n] == 0).all(), "padding rows give 0"
        torch.testing.assert_close(out[b:b + 1, :, Lq - n:], _full_pass(qb, kb, vb), **TOL)
    out.square().sum().backward()
    for name, t in (("query", q), ("key", k), ("value", v)):
        assert torch.isfinite(t.grad).all(), name
    assert (q.grad[0, :, : Lq - 2] == 0).all() and (k.grad[0, :, : Lq - 2] == 0).all()


def test_nan_in_unused_paged_slots_does_not_reach_the_output():
    gen = torch.Generator().manual_seed(7)
    pool = PagedKVCache(6, 4, 2, E, value_dim=EV, dtype=F64)
    pool.key_blocks.fill_(float("nan"))
    pool.value_blocks.fill_(float("nan"))
    pool.allocate(0)
    pool.allocate(1)
    pool.append([0, 1], _randn(2, 2, 3, E, gen=gen), _randn(2, 2, 3, EV, gen=gen))
    pool.append([1], _randn(1, 2, 3, E, gen=gen), _randn(1, 2, 3, EV, gen=gen))
    q = _randn(2, H, 1, E, gen=gen)
    out = attention_with_kv_cache(q, pool.key_blocks, pool.value_blocks, pool.seqlens([0, 1]),
                                  block_table=pool.block_table([0, 1]), is_causal=True)
    assert torch.isfinite(out).all()


# --- KVCache --------------------------------------------------------------------------------------


def test_kv_cache_memory_views_overflow_and_reset():
    cache = KVCache(3, 2, max_length=11, head_dim=E, value_dim=EV, dtype=torch.bfloat16)
    assert cache.memory_bytes == 3 * 2 * 11 * (E + EV) * 2
    assert cache.key_cache.shape == (3, 2, 11, E) and cache.value_cache.shape == (3, 2, 11, EV)
    k, v = torch.ones(3, 2, 4, E, dtype=torch.bfloat16), torch.ones(3, 2, 4, EV, dtype=torch.bfloat16)
    keys, _ = cache.append(k, v)
    assert keys.data_ptr() == cache.key_cache.data_ptr() and keys.shape[2] == 4  # a view, no copy
    cache.append(2 * k, 2 * v)
    assert cache.length == 8 and cache.lengths.tolist() == [8, 8, 8] and cache.lengths.dtype == torch.long
    assert (cache.key_cache[:, :, 4:8] == 2).all() and (cache.key_cache[:, :, 8:] == 0).all()
    with pytest.raises(ValueError, match=r"appending 4 tokens to a cache holding 8 of max_length = 11 needs 12"):
        cache.append(k, v)
    assert cache.length == 8 and (cache.key_cache[:, :, 8:] == 0).all(), "nothing written"
    cache.reset()
    assert cache.length == 0 and cache.lengths.tolist() == [0, 0, 0]
    assert "length=0/11" in repr(cache)


@pytest.mark.parametrize(
    "key,value,error,match",
    [
        (torch.ones(3, 2, 1, E), torch.ones(3, 2, 1, EV, dtype=F64), TypeError, r"key must have the same dtype"),
        (torch.ones(2, 2, 1, E, dtype=F64), torch.ones(3, 2, 1, EV, dtype=F64), ValueError,
         r"key must have shape \(B, Hkv, Lnew, E\) = \(3, 2, Lnew, 7\), got shape \(2, 2, 1, 7\)"),
        (torch.ones(3, 2, 1, E, dtype=F64), torch.ones(3, 2, 2, EV, dtype=F64), ValueError,
         r"same number of new tokens"),
        (torch.ones(3, 2, E, dtype=F64), torch.ones(3, 2, 1, EV, dtype=F64), ValueError, r"key must have 4 dims"),
        (torch.ones(3, 2, 1, E, dtype=torch.long), None, TypeError, r"key must have a floating-point dtype"),
    ],
)
def test_kv_cache_append_rejects_bad_tokens(key, value, error, match):
    cache = KVCache(3, 2, max_length=5, head_dim=E, value_dim=EV, dtype=F64)
    with pytest.raises(error, match=match):
        cache.append(key, value)
    assert cache.length == 0


def test_kv_cache_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_length must be a positive int, got 0"):
        KVCache(1, 1, 0, 4)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        KVCache(1, 1.5, 4, 4)
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        KVCache(1, 1, 4, 4, dtype=torch.int32)


# --- PagedKVCache --------------------------------------------------------------------------------


def test_paged_cache_takes_blocks_as_sequences_grow_and_frees_them():
    pool = PagedKVCache(5, 4, 1, 2, dtype=F64)
    assert pool.memory_bytes == 5 * 2 * (4 * 2) * 8 and pool.bytes_per_block == 2 * 4 * 2 * 8
    pool.allocate("a")
    pool.allocate("b")
    assert pool.blocks_in_use == 0 and pool.block_table(["a", "b"]).shape == (2, 0)
    pool.append(["a", "b"], torch.ones(2, 1, 4, 2, dtype=F64), torch.ones(2, 1, 4, 2, dtype=F64))
    assert pool.blocks_in_use == 2 and pool.bytes_in_use == 2 * pool.bytes_per_block
    pool.append(["a"], torch.full((1, 1, 1, 2), 5.0, dtype=F64), torch.zeros(1, 1, 1, 2, dtype=F64))
    assert pool.blocks_in_use == 3, "a new block only when the last one is full"
    assert pool.block_table(["a", "b"]).tolist() == [[0, 2], [1, 0]]  # b's row padded with 0
    assert pool.seqlens(["b", "a"]).tolist() == [4, 5]
    assert (pool.key_blocks[2, 0, 0] == 5).all()  # position 4 of "a": block 2, slot 0
    pool.free("a")
    assert pool.num_free_blocks == 4
    pool.allocate("c")
    pool.append(["c"], torch.ones(1, 1, 5, 2, dtype=F64), torch.ones(1, 1, 5, 2, dtype=F64))
    assert pool.block_table(["c"]).tolist() == [[0, 2]], "freed blocks are taken again"
    assert "blocks_in_use=3" in repr(pool)


def test_a_full_pool_raises_and_writes_nothing():
    pool = PagedKVCache(3, 2, 1, 2, dtype=F64)
    pool.allocate(0)
    pool.allocate(1)
    pool.append([0], torch.ones(1, 1, 3, 2, dtype=F64), torch.ones(1, 1, 3, 2, dtype=F64))  # 2 blocks
    before = pool.key_blocks.clone()
    with pytest.raises(RuntimeError, match=r"block pool is full: appending 2 tokens to 2 sequences needs 2 more "
                                           r"blocks of 2 tokens, 1 of 3 are free; nothing was written"):
        pool.append([0, 1], torch.full((2, 1, 2, 2), 7.0, dtype=F64), torch.ones(2, 1, 2, 2, dtype=F64))
    assert torch.equal(pool.key_blocks, before) and pool.seqlens([0, 1]).tolist() == [3, 0]
    assert pool.num_free_blocks == 1


def test_paged_cache_rejects_bad_ids():
    pool = PagedKVCache(3, 2, 1, 2, dtype=F64)
    pool.allocate(0)
    with pytest.raises(ValueError, match="sequence_id 0 is already allocated"):
        pool.allocate(0)
    with pytest.raises(ValueError, match=r"sequence_id 4 is not allocated \(call allocate\(4\) first\)"):
        pool.seqlens([4])
    with pytest.raises(ValueError, match="sequence_id 4 is not allocated"):
        pool.free(4)
    with pytest.raises(ValueError, match="must not repeat an id"):
        pool.block_table([0, 0])
    with pytest.raises(TypeError, match="sequence_ids must be a list"):
        pool.append(0, torch.ones(1, 1, 1, 2, dtype=F64), torch.ones(1, 1, 1, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"key must have shape \(n, Hkv, Lnew, E\) = \(1, 1, Lnew, 2\)"):
        pool.append([0], torch.ones(2, 1, 1, 2, dtype=F64), torch.ones(2, 1, 1, 2, dtype=F64))


def test_flash_attention_layout_is_the_transpose():
    gen = torch.Generator().manual_seed(8)
    pool = PagedKVCache(4, 3, 2, E, dtype=F64)
    pool.allocate(0)
    k = _randn(1, 2, 7, E, gen=gen)
    pool.append([0], k, k)
    flash_layout = pool.key_blocks.transpose(1, 2)  # (num_blocks, block_size, Hkv, E)
    table = pool.block_table([0])[0]
    for p in range(7):
        torch.testing.assert_close(flash_layout[table[p // 3], p % 3], k[0, :, p], **TOL)  # (Hkv, E)
    back = flash_layout.contiguous().transpose(1, 2)  # a FlashAttention pool in this package's layout
    q = _randn(1, H, 1, E, gen=gen)
    args = (pool.seqlens([0]),)
    torch.testing.assert_close(
        attention_with_kv_cache(q, back, pool.value_blocks, *args, block_table=pool.block_table([0])),
        attention_with_kv_cache(q, pool.key_blocks, pool.value_blocks, *args, block_table=pool.block_table([0])),
        **TOL)


# --- bad input to attention_with_kv_cache ------------------------------------------------------------


def _good(paged=False):
    gen = torch.Generator().manual_seed(9)
    q = _randn(2, H, 3, E, gen=gen)
    if paged:
        k, v = _randn(5, 2, 4, E, gen=gen), _randn(5, 2, 4, EV, gen=gen)
        return dict(query=q, key_cache=k, value_cache=v, cache_seqlens=torch.tensor([5, 3]),
                    block_table=torch.tensor([[0, 3], [2, 0]]))
    k, v = _randn(2, 2, 8, E, gen=gen), _randn(2, 2, 8, EV, gen=gen)
    return dict(query=q, key_cache=k, value_cache=v, cache_seqlens=torch.tensor([5, 3]))


def _with(paged=False, **changes):
    args = _good(paged)
    for name, fn in changes.items():
        args[name] = fn(args[name]) if callable(fn) else fn
    return args


BAD = {
    "seqlens longer than the cache": (_with(cache_seqlens=torch.tensor([9, 3])), ValueError,
                                      r"cache_seqlens must be at most the cache's length S_max = 8 \(key_cache "
                                      r"dim 2\), got cache_seqlens\[0\] = 9"),
    "seqlens shorter than Lq": (_with(cache_seqlens=torch.tensor([5, 2])), ValueError,
                                r"cache_seqlens must be at least the number of new queries Lq = 3 "
                                r"\(they are counted in it\), got a minimum of 2"),
    "negative seqlens": (_with(cache_seqlens=torch.tensor([5, -1])), ValueError,
                         r"cache_seqlens must be non-negative, got a minimum of -1"),
    "seqlens of the wrong shape": (_with(cache_seqlens=torch.tensor([5, 3, 4])), ValueError,
                                   r"cache_seqlens must have shape \(B,\) = \(2,\), got shape \(3,\)"),
    "2-D seqlens": (_with(cache_seqlens=torch.tensor([[5, 3]])), ValueError,
                    r"cache_seqlens must have shape \(B,\) = \(2,\), got shape \(1, 2\)"),
    "float seqlens": (_with(cache_seqlens=torch.tensor([5.0, 3.0])), TypeError,
                      r"cache_seqlens must be an integer tensor \(B,\), got torch.float32"),
    "bool seqlens": (_with(cache_seqlens=torch.tensor([True, True])), TypeError,
                     r"cache_seqlens must be an integer tensor"),
    "list seqlens": (_with(cache_seqlens=[5, 3]), TypeError, r"cache_seqlens must be a torch.Tensor, got list"),
    "block index past the pool": (_with(True, block_table=torch.tensor([[0, 5], [2, 0]])), ValueError,
                                  r"block_table must hold block indices in \[0, num_blocks\) = \[0, 5\), got 5 at "
                                  r"block_table\[0, 1\]"),
    "negative block index": (_with(True, block_table=torch.tensor([[0, 3], [-1, 0]])), ValueError,
                             r"got -1 at block_table\[1, 0\]"),
    "block table too short": (_with(True, block_table=torch.tensor([[0], [2]])), ValueError,
                              r"block_table is too short for cache_seqlens: its 1 blocks of 4 hold 4 positions, "
                              r"cache_seqlens\[0\] = 5"),
    "block table of another batch": (_with(True, block_table=torch.tensor([[0, 3]])), ValueError,
                                     r"block_table must have one row per sequence, \(B, max_blocks\) with B = 2"),
    "float block table": (_with(True, block_table=torch.tensor([[0.0, 3.0], [2.0, 0.0]])), TypeError,
                          r"block_table must be an integer tensor"),
    "H not a multiple of Hkv": (_with(key_cache=lambda k: k[:, :1].expand(2, 4, 8, E),
                                      value_cache=lambda v: v[:, :1].expand(2, 4, 8, EV)), ValueError,
                                r"the query heads H = 6 must be a multiple of the key/value heads Hkv "
                                r"\(key_cache dim 1\), got Hkv = 4"),
    "key cache of another dtype": (_with(key_cache=lambda k: k.float()), TypeError,
                                   r"key_cache must have the same dtype as query \(torch.float64\), got torch.float32"),
    "value cache of another dtype": (_with(value_cache=lambda v: v.float()), TypeError,
                                     r"value_cache must have the same dtype as query"),
    "key cache on another device": (_with(key_cache=lambda k: k.to("meta")), ValueError,
                                    r"key_cache must be on the same device as query \(cpu\), got meta"),
    "seqlens on another device": (_with(cache_seqlens=lambda s: s.to("meta")), ValueError,
                                  r"cache_seqlens must be on the same device as query \(cpu\), got meta"),
    "batch mismatch": (_with(key_cache=lambda k: k[:1], value_cache=lambda v: v[:1]), ValueError,
                       r"key_cache must have the query's batch B = 2 \(dim 0\), got shape \(1, 2, 8, 7\)"),
    "E mismatch": (_with(key_cache=lambda k: k[..., :4]), ValueError,
                   r"key_cache must have the query's size E = 7 \(dim -1\), got shape \(2, 2, 8, 4\)"),
    "value cache of another length": (_with(value_cache=lambda v: v[:, :, :6]), ValueError,
                                      r"value_cache must match key_cache in every dim but the last"),
    "3-D query": (_with(query=lambda q: q[0]), ValueError, r"query must have 4 dims \(B, H, Lq, E\), got shape"),
    "integer query": (_with(query=lambda q: q.long()), TypeError, r"query must have a floating-point dtype"),
    "bad scale": (_with(), ValueError, r"scale must be a positive finite float or None, got -1.0"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_an_error_that_names_the_argument(name):
    args, error, match = BAD[name]
    kwargs = {"scale": -1.0} if name == "bad scale" else {}
    with pytest.raises(error, match=match):
        attention_with_kv_cache(**args, **kwargs)


def test_the_good_inputs_of_the_error_table_run():
    for paged in (False, True):
        out = attention_with_kv_cache(**_good(paged))
        assert out.shape == (2, H, 3, EV) and torch.isfinite(out).all()
    # cache_seqlens shorter than Lq is refused with or without is_causal
    with pytest.raises(ValueError, match="cache_seqlens must be at least the number of new queries Lq = 3"):
        attention_with_kv_cache(**_with(cache_seqlens=torch.tensor([5, 2])), is_causal=True)


# --- learned sinks ---------------------------------------------------------------------------------
# One logit per query head in every row's softmax denominator (attention_ref.sinks). The reference
# is the dense math path with sinks=, sequence by sequence; outputs and the gradients of the query,
# the caches (contiguous or a scattered pool) and the sinks must match it.


def _sinks(gen, heads=H):
    return (_randn(heads, gen=gen) * 2).requires_grad_()


def _dense_with_sinks(q, K, V, sinks, causal, mask_mod=None):
    """The core's math path on one sequence's valid keys: the reference of every sinks test here."""
    Lq, n = q.shape[-2], K.shape[-2]
    if mask_mod is None and causal:
        mask_mod = mods.causal(offset=n - Lq)
    return scaled_dot_product_attention(q, K, V, enable_gqa=True, mask_mod=mask_mod, sinks=sinks, backend="math")


def _loss(out):
    return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sin().sum()


@pytest.mark.parametrize("backend", ["math", "tiled"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_sinks_equal_the_dense_path_with_gradients(paged, backend):
    """Two sequences of 11 and 7 keys, Lq = 3 (L != S), causal, H = 6 over Hkv = 2; a pool of blocks of 3."""
    gen = torch.Generator().manual_seed(21)
    lengths, Lq, hkv, S_max, bs = [11, 7], 3, 2, 13, 3
    q = _randn(2, H, Lq, E, gen=gen).requires_grad_()
    k_dense, v_dense = _randn(2, hkv, S_max, E, gen=gen), _randn(2, hkv, S_max, EV, gen=gen)
    sinks = _sinks(gen)
    if paged:  # each sequence's blocks scattered, out of order, in a pool of 12
        table = torch.tensor([[7, 2, 10, 0, 5], [3, 11, 1, 8, 6]])
        k_pool, v_pool = _randn(12, hkv, bs, E, gen=gen), _randn(12, hkv, bs, EV, gen=gen)
        for b in range(2):
            for p in range(S_max):
                k_pool[table[b, p // bs], :, p % bs] = k_dense[b, :, p]
                v_pool[table[b, p // bs], :, p % bs] = v_dense[b, :, p]
        caches, extra = (k_pool.requires_grad_(), v_pool.requires_grad_()), {"block_table": table}
    else:
        caches, extra = (k_dense.requires_grad_(), v_dense.requires_grad_()), {}
    out = attention_with_kv_cache(q, *caches, torch.tensor(lengths), is_causal=True, sinks=sinks,
                                  backend=backend, **extra)
    # the reference: each sequence alone, on leaves of its own valid keys and values
    qd = q.detach().requires_grad_()
    kd = [k_dense[b, :, :n].detach().clone().requires_grad_() for b, n in enumerate(lengths)]
    vd = [v_dense[b, :, :n].detach().clone().requires_grad_() for b, n in enumerate(lengths)]
    sd = sinks.detach().requires_grad_()
    ref = torch.cat([_dense_with_sinks(qd[b:b + 1], kd[b][None], vd[b][None], sd, True) for b in range(2)])
    torch.testing.assert_close(out, ref, **TOL)
    grads = torch.autograd.grad(_loss(out), (q, *caches, sinks))
    ref_grads = torch.autograd.grad(_loss(ref), (qd, *kd, *vd, sd))
    torch.testing.assert_close(grads[0], ref_grads[0], **TOL)  # dq
    torch.testing.assert_close(grads[3], ref_grads[5], **TOL)  # dsinks
    for c, (cache_grad, ref_per_seq) in enumerate(zip(grads[1:3], (ref_grads[1:3], ref_grads[3:5]))):
        for b, n in enumerate(lengths):
            if paged:  # position p of sequence b is slot p % bs of block table[b, p // bs]
                got = torch.stack([cache_grad[table[b, p // bs], :, p % bs] for p in range(n)], dim=1)
            else:
                got = cache_grad[b, :, :n]
            torch.testing.assert_close(got, ref_per_seq[b], **TOL,
                                       msg=lambda m, c=c, b=b: f"cache {c}, sequence {b}: {m}")
    assert (grads[3] != 0).all(), "every head's sink takes part"


def test_sinks_in_chunked_prefill_and_decode_steps_equal_one_dense_pass():
    """A prompt of 5 prefilled in chunks of 3 and 2, then 7 single-token steps: every step's rows are those
    of one dense causal pass with sinks (each call adds the sink once to each of its rows)."""
    gen = torch.Generator().manual_seed(22)
    hkv, prompt, N = 3, 5, 12
    q, k, v = _randn(B, H, N, E, gen=gen), _randn(B, hkv, N, E, gen=gen), _randn(B, hkv, N, EV, gen=gen)
    sinks = _sinks(gen).detach()
    expected = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)
    cache = KVCache(B, hkv, max_length=N, head_dim=E, value_dim=EV, dtype=F64)
    for lo, hi in [(0, 3), (3, prompt), *((t, t + 1) for t in range(prompt, N))]:
        cache.append(k[:, :, lo:hi], v[:, :, lo:hi])
        out = attention_with_kv_cache(q[:, :, lo:hi], cache.key_cache, cache.value_cache, cache.lengths,
                                      is_causal=True, sinks=sinks)
        torch.testing.assert_close(out, expected[:, :, lo:hi], **TOL,
                                   msg=lambda m, lo=lo, hi=hi: f"rows {lo}:{hi}: {m}")


def test_sinks_with_a_sliding_window_cache_shorter_than_the_sequence():
    """gpt-oss's sliding layers: a decoder keeps only the last W = 4 keys of 13 (a ring buffer) and still
    adds the sink to every row. Each step's cache is the window; the reference is the dense math path over
    the whole sequence with the window as a mask mod (key j for query i when i - 3 <= j <= i)."""
    gen = torch.Generator().manual_seed(23)
    hkv, W, N = 2, 4, 13
    q = _randn(1, H, N, E, gen=gen).requires_grad_()
    k, v = _randn(1, hkv, N, E, gen=gen).requires_grad_(), _randn(1, hkv, N, EV, gen=gen).requires_grad_()
    sinks = _sinks(gen)
    expected = _dense_with_sinks(q, k, v, sinks, True, mods.sliding_window(W - 1))
    steps = []
    for t in range(N):
        lo = max(0, t + 1 - W)  # the window of position t: keys lo .. t
        steps.append(attention_with_kv_cache(q[:, :, t:t + 1], k[:, :, lo:t + 1], v[:, :, lo:t + 1],
                                             torch.tensor([t + 1 - lo]), is_causal=True, sinks=sinks))
    out = torch.cat(steps, dim=2)
    torch.testing.assert_close(out, expected, **TOL)
    windowless = _dense_with_sinks(q, k, v, sinks, True)
    assert (out - windowless)[:, :, W:].abs().amax(dim=(0, 1, 3)).min() > 1e-3, "the window cuts every late row"
    grads = torch.autograd.grad(_loss(out), (q, k, v, sinks))
    for name, g, r in zip(["q", "k", "v", "sinks"], grads, torch.autograd.grad(_loss(expected), (q, k, v, sinks))):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_sinks_weights_sum_below_one_and_bad_sinks_or_backends_are_refused():
    args = _good()
    sinks = _sinks(torch.Generator().manual_seed(24)).detach()
    out, w = attention_with_kv_cache(**args, is_causal=True, sinks=sinks, return_weights=True)
    assert (w.sum(-1) < 1).all()
    torch.testing.assert_close(out, w @ args["value_cache"][:, :, :5].repeat_interleave(3, dim=1), **TOL)
    hkv_sized = torch.zeros(2, dtype=F64)  # one per key/value head: the usual mistake under GQA
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(6,\).*got \(2,\)"):
        attention_with_kv_cache(**args, sinks=hkv_sized)
    with pytest.raises(TypeError, match=r"sinks must be floating point"):
        attention_with_kv_cache(**args, sinks=torch.zeros(H, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sinks must hold finite logits or -inf"):
        attention_with_kv_cache(**_good(paged=True), sinks=torch.full((H,), float("nan"), dtype=F64))
    for backend in ("sdpa", "triton"):
        with pytest.raises(ValueError, match=rf"backend='{backend}' cannot run this call: .*sinks"):
            attention_with_kv_cache(**args, sinks=sinks, backend=backend)
