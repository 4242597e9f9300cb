"""The tiled path with mask and score mods: equal to the reference, and sparse where the mask is.

Outputs and gradients are compared in float64 with the math path (itself proven equal
to FlexAttention in tests/test_mods.py). Block skipping is proven three ways: keys in
blocks that no query block reaches hold NaN and the result is still exact (a block that
were read would turn it into NaN); the number of score blocks computed forward and
backward equals the number of non-empty blocks; and a mask mod is evaluated only on
the partial blocks (a block it keeps whole never calls it).

Tests that take the ``device`` fixture run on ``--device cuda`` too (tests/conftest.py):
inputs are drawn on the CPU and moved, and the tensors a mod closes over are made there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_ref import mods, scaled_dot_product_attention, tiled
from attention_ref.backends import CPU_MODS_TILED_MIN_LENGTH, select_backend
from attention_ref.tiled import BlockMask, create_block_mask, tiled_attention

B, H, HKV, L, S, E, EV = 2, 6, 3, 37, 41, 8, 5


def _qkv(L=L, S=S, heads=(H, H), seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, heads[0], L, E), (B, heads[1], S, E), (B, heads[1], S, EV))
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() for s in shapes]


def _doc_ids(length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (B, length), generator=gen).sort(dim=-1).values


def _cases(device="cpu"):
    """The mod cases; the tensors a mod closes over live on ``device``, as the indices it gets."""
    return {
        "window": dict(mask_mod=mods.sliding_window(5)),
        "window both sides, bottom-right": dict(mask_mod=mods.sliding_window(3, 2, offset=S - L)),
        # the sinks sit in key block 0, which the window alone leaves empty for most query blocks
        "window with sink tokens, bottom-right": dict(mask_mod=mods.sliding_window(3, offset=S - L, sink_tokens=4)),
        "causal mod and is_causal": dict(mask_mod=mods.causal(S - L), is_causal=True),
        "chunked": dict(mask_mod=mods.chunked(8)),
        "prefix_lm": dict(mask_mod=mods.prefix_lm(torch.tensor([3, 11], device=device))),
        "document": dict(mask_mod=mods.document(_doc_ids(L, 1).to(device), _doc_ids(S, 2).to(device))),
        "padding or window": dict(mask_mod=mods.or_masks(mods.padding(torch.tensor([4, 0], device=device)),
                                                         mods.sliding_window(2))),
        "softcap": dict(score_mod=mods.softcap(1.5)),
        "alibi causal": dict(score_mod=mods.alibi(H), is_causal=True),
        "alibi symmetric, window": dict(score_mod=mods.alibi(H, symmetric=True), mask_mod=mods.sliding_window(4, 4)),
        "softcap, chunked, float mask": dict(score_mod=mods.softcap(2.0), mask_mod=mods.chunked(16), float_mask=True),
        "compose, bool mask": dict(score_mod=mods.compose(mods.alibi(H), mods.softcap(3.0)),
                                   mask_mod=mods.sliding_window(None, 3), bool_mask=True),
    }


def _attn_mask(case, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    if case.get("float_mask"):
        return torch.randn(L, S, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    if case.get("bool_mask"):
        return (torch.rand(B, 1, L, S, generator=gen) > 0.2).to(device)
    return None


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_outputs_and_gradients_equal_the_reference(name, gqa, device):
    case = _cases(device)[name]
    kw = {k: v for k, v in case.items() if k not in ("float_mask", "bool_mask")}
    q, k, v = _qkv(heads=(H, HKV if gqa else H), device=device)
    mask = _attn_mask(case, device)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    out = tiled_attention(q, k, v, mask, enable_gqa=gqa, block_q=8, block_k=6, **kw)
    ref = scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa, **kw)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    assert out.device == device
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(device)
    for got, want in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9)


def test_float32_within_the_tolerance_of_the_dense_path(device):
    q, k, v = (t.detach() for t in _qkv(dtype=torch.float32, device=device))
    kw = dict(mask_mod=mods.sliding_window(7), score_mod=mods.softcap(2.0))
    out = tiled_attention(q, k, v, block_q=8, block_k=6, **kw)
    ref = scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_gradcheck_with_a_score_mod_and_a_mask_mod(device):
    q, k, v = (t.detach()[:1, :2, :7].clone().requires_grad_() for t in _qkv(L=9, S=9, device=device))
    kw = dict(score_mod=mods.softcap(0.7), mask_mod=mods.sliding_window(2, 1), block_q=3, block_k=2)
    assert torch.autograd.gradcheck(lambda q, k, v: tiled_attention(q, k, v, **kw), (q, k, v))


def test_rows_outside_every_window_give_zero_and_finite_gradients(device):
    q, k, v = _qkv(L=7, S=5, device=device)
    mask_mod = mods.sliding_window(0, 0, offset=2)  # query i sees key i + 2 only: rows 3..6 see none
    out = tiled_attention(q, k, v, mask_mod=mask_mod, block_q=2, block_k=2)
    assert torch.equal(out[..., 3:, :], torch.zeros_like(out[..., 3:, :]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][..., 3:, :], torch.zeros_like(grads[0][..., 3:, :]))


# --- block skipping ---------------------------------------------------------------------------


def _band_setup(device, block_q=4, block_k=4):
    """A narrow window, and keys that no query block reaches set to NaN."""
    Lb = Sb = 32
    mask_mod = mods.sliding_window(3)
    bm = create_block_mask(mask_mod, None, None, Lb, Sb, block_q=block_q, block_k=block_k, device=device)
    q, k, v = (t.detach() for t in _qkv(L=Lb, S=Sb, device=device))
    return mask_mod, bm, q, k, v


def test_blocks_outside_the_mask_are_never_read(device):
    mask_mod, bm, q, k, v = _band_setup(device)
    ref = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod)
    # Plant NaN in the keys and values of every key block that query block 4 never needs, and
    # in the queries of the other query blocks; a block computed anyway would spread the NaN.
    kinds = bm.kinds[4].tolist()
    k_bad, v_bad, q_bad = k.clone(), v.clone(), q.clone()
    for kj, kind in enumerate(kinds):
        if kind == 0:
            k_bad[..., kj * 4:(kj + 1) * 4, :] = float("nan")
            v_bad[..., kj * 4:(kj + 1) * 4, :] = float("nan")
    q_bad[..., :16, :] = q_bad[..., 20:, :] = float("nan")
    q_bad, k_bad, v_bad = (t.requires_grad_() for t in (q_bad, k_bad, v_bad))
    out = tiled_attention(q_bad, k_bad, v_bad, mask_mod=mask_mod, block_mask=bm, block_q=4, block_k=4)
    torch.testing.assert_close(out[..., 16:20, :], ref[..., 16:20, :], atol=1e-12, rtol=1e-10)
    assert sum(k == 0 for k in kinds) >= 5  # the test plants NaN in most key blocks
    # Backward: the gradient of query block 4 reads the same blocks only.
    (dq,) = torch.autograd.grad(out[..., 16:20, :].sum(), (q_bad,))
    assert torch.isfinite(dq[..., 16:20, :]).all()


def test_score_blocks_computed_are_the_non_empty_ones(score_blocks, device):
    mask_mod, bm, q, k, v = _band_setup(device)
    calls = score_blocks
    q.requires_grad_()
    out = tiled_attention(q, k, v, mask_mod=mask_mod, block_mask=bm, block_q=4, block_k=4)
    expected = sorted((qi * 4, kj * 4) for qi, row in enumerate(bm.kinds.tolist()) for kj, kind in enumerate(row) if kind)
    # The forward pass computes neighbouring blocks as one span: the blocks it covers, each once
    # (a lazy step redone exactly computes its span twice).
    covered = sorted({(i0, j) for i0, j0, j1 in calls for j in range(j0, j1, 4)})
    assert covered == expected and len(expected) < bm.kinds.numel() / 2
    calls.clear()
    out.sum().backward()
    assert sorted((i0, j0) for i0, j0, _ in calls) == expected  # one recomputation per non-empty block


def test_the_mask_mod_runs_only_on_partial_blocks(device):
    evaluated = []
    window = mods.sliding_window(9)

    def counting_mod(b, h, q_idx, kv_idx):
        evaluated.append((int(q_idx.min()), int(kv_idx.min()), q_idx.numel(), kv_idx.numel()))
        return window(b, h, q_idx, kv_idx)

    bm = create_block_mask(counting_mod, None, None, 32, 32, block_q=4, block_k=4, device=device)
    assert len(evaluated) == 8  # one strip of 4 query rows against every key, per query block
    assert bm.counts()["full"] > 0
    evaluated.clear()
    q, k, v = (t.detach().requires_grad_() for t in _qkv(L=32, S=32, device=device))
    tiled_attention(q, k, v, block_mask=bm, block_q=4, block_k=4).sum().backward()
    partial = [(qi * 4, kj * 4) for qi, row in enumerate(bm.kinds.tolist()) for kj, kind in enumerate(row) if kind == 1]
    blocks = [(i0, j0) for i0, j0, nq, nk in evaluated]
    assert all(nq == 4 and nk == 4 for *_, nq, nk in evaluated)
    assert sorted(blocks) == sorted(partial)  # partial blocks only, once: the backward reuses them
    evaluated.clear()
    again = tiled_attention(q, k, v, block_mask=bm, block_q=4, block_k=4)
    again.sum().backward()
    assert evaluated == []  # a block mask keeps its partial blocks: no block evaluates the mod again


def test_a_block_mask_keeps_its_pieces_per_dtype_and_batch_within_its_budget(monkeypatch):
    bm = create_block_mask(mods.sliding_window(9), None, None, 32, 32, block_q=4, block_k=4)
    q, k, v = _qkv(L=32, S=32)
    reference = tiled_attention(q, k, v, mask_mod=bm.mask_mod, block_q=4, block_k=4)  # a block mask of its own
    assert torch.equal(tiled_attention(q, k, v, block_mask=bm), reference)
    first = len(bm._pieces.pieces)
    assert first == bm.counts()["partial"]
    assert torch.equal(tiled_attention(q, k, v, block_mask=bm), reference)  # from the kept pieces
    assert len(bm._pieces.pieces) == first
    tiled_attention(q.float(), k.float(), v.float(), block_mask=bm)  # another dtype: pieces of its own
    assert len(bm._pieces.pieces) == 2 * first
    tiled_attention(q[:1, :1], k[:1, :1], v[:1, :1], block_mask=bm)  # other grids (batch 1, 1 head)
    assert len(bm._pieces.pieces) == 3 * first
    small = create_block_mask(mods.sliding_window(9), None, None, 32, 32, block_q=4, block_k=4)
    from attention_ref import block_mask  # the pieces are the block mask's: its budget

    monkeypatch.setattr(block_mask, "_PIECE_CACHE_BYTES", 3 * 4 * 4 * 8)  # room for three float64 pieces
    assert torch.equal(tiled_attention(q, k, v, block_mask=small), reference)
    assert len(small._pieces.pieces) == 3 and small._pieces.nbytes == 3 * 128
    assert torch.equal(tiled_attention(q, k, v, block_mask=small), reference)  # the rest evaluated again


# --- block masks ------------------------------------------------------------------------------


def _dense_kinds(keep, block_q, block_k):
    """The kinds of a dense (B, H, L, S) mask, by looping over the blocks."""
    Lk, Sk = keep.shape[-2:]
    rows = []
    for i0 in range(0, Lk, block_q):
        row = []
        for j0 in range(0, Sk, block_k):
            blk = keep[..., i0:i0 + block_q, j0:j0 + block_k]
            row.append(2 if bool(blk.all()) else 1 if bool(blk.any()) else 0)
        rows.append(row)
    return rows


@settings(max_examples=40, deadline=None)
@given(
    left=st.one_of(st.none(), st.integers(0, 12)),
    right=st.one_of(st.none(), st.integers(0, 12)),
    offset=st.integers(-6, 6),
    block_q=st.integers(1, 9),
    block_k=st.integers(1, 9),
    sink_tokens=st.integers(0, 20),
)
def test_block_kinds_equal_the_dense_definition(left, right, offset, block_q, block_k, sink_tokens):
    mask_mod = mods.sliding_window(left, right, offset=offset, sink_tokens=sink_tokens)
    bm = create_block_mask(mask_mod, None, None, 13, 17, block_q=block_q, block_k=block_k)
    assert bm.kinds.tolist() == _dense_kinds(mods.create_mask(mask_mod, None, None, 13, 17), block_q, block_k)


def test_block_kinds_cover_every_batch_entry_and_head():
    ids = torch.tensor([[0] * 8 + [1] * 8, [0] * 16])  # batch entry 1 is one document
    mask_mod = mods.and_masks(mods.document(ids), lambda b, h, q_idx, kv_idx: (h == 0) | (kv_idx <= q_idx))
    bm = create_block_mask(mask_mod, 2, 3, 16, 16, block_q=4, block_k=4)
    assert bm.kinds.tolist() == _dense_kinds(mods.create_mask(mask_mod, 2, 3, 16, 16), 4, 4)
    # Batch entry 1, head 0 keeps every pair: no block is empty. A block is full only if batch
    # entry 0 keeps it whole in every head: inside one of its documents and below the diagonal.
    assert bm.counts() == {"empty": 0, "partial": 14, "full": 2}


def test_block_mask_errors():
    q, k, v = (t.detach() for t in _qkv(L=8, S=8))
    bm = create_block_mask(mods.causal(), None, None, 8, 8, block_q=4, block_k=4)
    with pytest.raises(ValueError, match=r"block_mask was made for block_k=4, this call has block_k=2"):
        tiled_attention(q, k, v, block_mask=bm, block_q=4, block_k=2)
    with pytest.raises(ValueError, match=r"block_mask was made for L=8, this call has L=7"):
        tiled_attention(q[..., :7, :], k, v, block_mask=bm, block_q=4, block_k=4)
    with pytest.raises(ValueError, match=r"mask_mod and block_mask.mask_mod must be the same function"):
        tiled_attention(q, k, v, mask_mod=mods.causal(), block_mask=bm, block_q=4, block_k=4)
    with pytest.raises(ValueError, match=r"block_mask was made for H=4, this call has H=6"):
        tiled_attention(q, k, v, block_mask=create_block_mask(mods.causal(), None, 4, 8, 8, block_q=4, block_k=4),
                        block_q=4, block_k=4)
    with pytest.raises(TypeError, match=r"block_mask must be an attention_ref.block_mask.BlockMask, got Tensor"):
        tiled_attention(q, k, v, block_mask=torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"mask_mod must return a bool tensor \(True = takes part\), got torch.int64"):
        create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, None, None, 4, 4)
    with pytest.raises(ValueError, match=r"block_q must be a positive int"):
        create_block_mask(mods.causal(), None, None, 4, 4, block_q=0)


def test_a_score_mod_with_a_learned_tensor_is_refused():
    bias = torch.zeros(H, requires_grad=True)
    q, k, v = _qkv()
    learned = lambda score, b, h, q_idx, kv_idx: score + bias[h]  # noqa: E731
    with pytest.raises(ValueError, match=r"backend 'tiled' cannot differentiate a score_mod with respect to the tensors"):
        tiled_attention(q, k, v, score_mod=learned)
    # The math path differentiates it.
    scaled_dot_product_attention(q, k, v, score_mod=learned).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_sink_blocks_are_kept_and_the_rest_of_the_band_skipped():
    # 32 x 32, blocks of 4, a window of 4 keys and 2 sinks: every query block computes key block 0
    # (the sinks) besides its band, and nothing else; without the sinks block 0 is skipped from row 8 on.
    with_sinks = create_block_mask(mods.sliding_window(3, sink_tokens=2), None, None, 32, 32, block_q=4, block_k=4)
    plain = create_block_mask(mods.sliding_window(3), None, None, 32, 32, block_q=4, block_k=4)
    kinds, plain_kinds = with_sinks.kinds.tolist(), plain.kinds.tolist()
    assert all(row[0] != 0 for row in kinds) and [row[0] for row in plain_kinds[2:]] == [0] * 6
    assert [row[1:] for row in kinds] == [row[1:] for row in plain_kinds]


def test_repr_and_fraction():
    bm = create_block_mask(mods.sliding_window(3), None, None, 8, 8, block_q=2, block_k=2)
    assert isinstance(bm, BlockMask) and bm.fraction_skipped == 7 / 16
    assert repr(bm) == "BlockMask(B=1, H=1, L=8, S=8, block_q=2, block_k=2, empty=7, partial=6, full=3)"


# --- the dispatcher ---------------------------------------------------------------------------


def test_backend_tiled_takes_the_mods(device):
    q, k, v = (t.detach() for t in _qkv(device=device))
    kw = dict(mask_mod=mods.sliding_window(4, 1), score_mod=mods.softcap(2.5))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, backend="tiled", **kw),
                               scaled_dot_product_attention(q, k, v, **kw), atol=1e-12, rtol=1e-10)


def test_auto_picks_tiled_for_a_sparse_mask_mod_on_cpu():
    n = CPU_MODS_TILED_MIN_LENGTH
    q = torch.zeros(1, 1, n, 8)

    def auto(t, **kw):
        return select_backend(t, t, t, backend="auto", **kw)

    assert auto(q, mask_mod=mods.sliding_window(64)) == "tiled"
    assert auto(q, mask_mod=mods.causal()) == "tiled"  # 44% of the blocks empty at 1024 keys
    assert auto(q, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 7 != 0) == "sdpa"  # none empty
    assert auto(q, score_mod=mods.softcap(5.0)) == "tiled"
    assert auto(q, mask_mod=mods.sliding_window(64), dropout_p=0.1) == "sdpa"
    assert auto(q, score_mod=mods.softcap(5.0), dropout_p=0.1) == "math"
    short = q[..., : n // 2, :]
    assert auto(short, mask_mod=mods.sliding_window(4)) == "sdpa"
    assert auto(short, score_mod=mods.softcap(5.0)) == "math"
    assert auto(q, mask_mod=mods.sliding_window(64), return_weights=True) == "math"


def test_auto_reuses_the_block_mask_it_measured(monkeypatch):
    made = []
    original = tiled.create_block_mask

    def counting(*args, **kwargs):
        made.append(args)
        return original(*args, **kwargs)

    from attention_ref import backends as backends_module

    monkeypatch.setattr(backends_module, "create_block_mask", counting)
    monkeypatch.setattr(tiled, "create_block_mask", counting)
    n = CPU_MODS_TILED_MIN_LENGTH
    q = torch.randn(1, 2, n, 8)
    out = scaled_dot_product_attention(q, q, q, backend="auto", mask_mod=mods.sliding_window(16))
    assert len(made) == 1  # made by "auto" to measure the sparsity, then reused by the tiled path
    torch.testing.assert_close(out, scaled_dot_product_attention(q, q, q, mask_mod=mods.sliding_window(16)))
