"""Packed variable-length attention (attention_ref.varlen) against two independent computations.

Both references are PyTorch's ``torch.nn.functional.scaled_dot_product_attention`` in float64:
once per sequence (sliced out of the packed tensors, with an explicit bottom-right causal
mask ``tril(Lk - Lq)``), and once on a right-padded batch built with ``pad_sequence`` and a
boolean mask. Outputs and gradients (dq, dk, dv) must match, with grouped-query heads, with
queries and keys of different lengths per sequence, with empty sequences, and for random
length lists (hypothesis). The mask mod (``varlen_mask_mod``) is compared with a mask written
block by block (``torch.block_diag``) and run in FlexAttention. Then the helpers (``pack``,
``unpack``, ``cu_seqlens_from_lengths``) and every error message.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.utils.rnn import pad_sequence

from attention_ref import mods, tiled
from attention_ref.backends import TILED_MODS_BLOCK_K, TILED_MODS_BLOCK_Q
from attention_ref.varlen import cu_seqlens_from_lengths, pack, unpack, varlen_attention, varlen_mask_mod

H, HKV, E, EV = 6, 2, 7, 5


def _cu(lengths):
    """Cumulative lengths, computed here independently of the module under test."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed(lq, lk, heads=(H, HKV), seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((heads[0], sum(lq), E), (heads[1], sum(lk), E), (heads[1], sum(lk), EV))
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes)
    return q, k, v, _cu(lq), _cu(lk)


def _per_sequence(q, k, v, lq, lk, causal, scale=None):
    """Each sequence alone with torch's SDPA; causal as an explicit bottom-right mask."""
    group = q.shape[0] // k.shape[0]
    outs = []
    for qs, ks, vs, n_q, n_k in zip(q.split(lq, 1), k.split(lk, 1), v.split(lk, 1), lq, lk):
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)  # (Hkv, Lk, .) -> (H, Lk, .)
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q) if causal else None
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=1)


def _padded_batch(q, k, v, lq, lk, causal):
    """A right-padded batch (B, H, Lmax, .) with a padding (and bottom-right causal) mask."""

    def pad(x, lengths):  # (Hx, total, F) -> (B, Hx, Lmax, F)
        return pad_sequence([t.transpose(0, 1) for t in x.split(lengths, 1)], batch_first=True).transpose(1, 2)

    qp, kp, vp = pad(q, lq), pad(k, lk), pad(v, lk)
    i = torch.arange(qp.shape[2])[:, None]  # (Lmax_q, 1)
    j = torch.arange(kp.shape[2])[None, :]  # (1, Lmax_k)
    mask = torch.stack([(j < n_k) & ((j <= i + n_k - n_q) if causal else True) for n_q, n_k in zip(lq, lk)])
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], enable_gqa=True)  # (B, H, Lmax_q, Ev)
    return torch.cat([out[b, :, :n] for b, n in enumerate(lq)], dim=1)  # the real rows, packed: (H, total_q, Ev)


def _assert_same_with_gradients(got, want, leaves, seed=5):
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed), dtype=got.dtype)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


LENGTHS = {
    "self": ([3, 7, 5], [3, 7, 5]),
    "cross": ([2, 7, 5, 1], [5, 3, 11, 1]),
    "empty sequences": ([0, 4, 3, 2], [3, 0, 5, 0]),
    "one sequence": ([13], [11]),
}


@pytest.mark.parametrize("name", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(H, H), (H, HKV), (H, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("reference", ["alone", "padded"])
def test_equals_each_sequence_alone_and_the_padded_batch(name, causal, heads, reference):
    lq, lk = LENGTHS[name]
    q, k, v, cu_q, cu_k = _packed(lq, lk, heads)
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal)
    assert out.shape == (heads[0], sum(lq), EV) and out.dtype == torch.float64
    want = _per_sequence(q, k, v, lq, lk, causal) if reference == "alone" else _padded_batch(q, k, v, lq, lk, causal)
    _assert_same_with_gradients(out, want, [q, k, v])


@pytest.mark.parametrize("name", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", ["tiled", "sdpa", "auto"])
def test_other_backends_give_the_same_result(name, causal, backend):
    lq, lk = LENGTHS[name]
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal, backend=backend)
    _assert_same_with_gradients(out, _per_sequence(q, k, v, lq, lk, causal), [q, k, v])


def test_the_tiled_backend_computes_only_the_blocks_of_the_sequences(score_blocks):
    # Six sequences of 40 to 300 tokens, packed: with the dispatcher's 128 x 128 tiles most of the
    # (total_q, total_k) blocks hold no pair of one sequence. The blocks whose scores are
    # computed, forward and backward, are exactly the non-empty ones of the varlen mask.
    lengths = [300, 40, 260, 120, 300, 180]
    q, k, v, cu, _ = _packed(lengths, lengths, heads=(2, 1))
    computed = score_blocks
    total = sum(lengths)
    bq, bk = TILED_MODS_BLOCK_Q, TILED_MODS_BLOCK_K  # the tiles backend="tiled" uses with a mask_mod
    for causal in (False, True):
        computed.clear()
        out = varlen_attention(q, k, v, cu, cu, is_causal=causal, backend="tiled")
        kinds = tiled.create_block_mask(varlen_mask_mod(cu, cu, is_causal=causal), None, None, total, total,
                                        block_q=bq, block_k=bk).kinds
        non_empty = sorted((qi * bq, kj * bk) for qi, row in enumerate(kinds.tolist())
                           for kj, kind in enumerate(row) if kind)
        forward = sorted({(i0, j) for i0, j0, j1 in computed for j in range(j0, j1, bk)})
        assert forward == non_empty and len(non_empty) < kinds.numel()
        computed.clear()
        out.sum().backward()
        assert sorted((i0, j0) for i0, j0, _ in computed) == non_empty


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_length_lists(pairs, heads, causal, seed):
    lq, lk = [p[0] for p in pairs], [p[1] for p in pairs]
    q, k, v, cu_q, cu_k = _packed(lq, lk, heads, seed)
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal)
    _assert_same_with_gradients(out, _per_sequence(q, k, v, lq, lk, causal), [q, k, v], seed)
    torch.testing.assert_close(out, _padded_batch(q, k, v, lq, lk, causal), atol=1e-12, rtol=1e-10)


def test_a_single_key_gives_its_value():
    # Softmax over one key is 1: the output of every query is that key's value, whatever q is.
    q, k, v, cu_q, cu_k = _packed([3, 2], [1, 1], heads=(2, 1))
    out = varlen_attention(q, k, v, cu_q, cu_k)
    assert torch.equal(out[:, :3], v[:, :1].expand(2, 3, EV))
    assert torch.equal(out[:, 3:], v[:, 1:].expand(2, 2, EV))


def test_bottom_right_causal_on_a_tiny_case():
    # One sequence of 2 queries and 4 keys, E = 1 and q = 0: every kept key gets the same weight,
    # so the output is the mean of the values the query sees. Bottom-right: query 0 sees keys
    # 0..2, query 1 sees keys 0..3.
    q = torch.zeros(1, 2, 1, dtype=torch.float64)
    k = torch.zeros(1, 4, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64).reshape(1, 4, 1)
    out = varlen_attention(q, k, v, torch.tensor([0, 2]), torch.tensor([0, 4]), is_causal=True)
    torch.testing.assert_close(out.flatten(), torch.tensor([7 / 3, 15 / 4], dtype=torch.float64), atol=1e-15, rtol=0)


def test_no_leak_across_sequences_or_from_the_future():
    lq = lk = [4, 6, 3]
    q, k, v, cu_q, cu_k = (t.detach() if t.is_floating_point() else t for t in _packed(lq, lk))
    base = varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, 4:10] += 1.0  # every key of sequence 1
    v2[:, 4:10] += 1.0
    other = varlen_attention(q, k2, v2, cu_q, cu_k, is_causal=True)
    assert torch.equal(other[:, :4], base[:, :4]) and torch.equal(other[:, 10:], base[:, 10:])
    assert not torch.allclose(other[:, 4:10], base[:, 4:10])
    k3, v3 = k.clone(), v.clone()
    k3[:, 7:10] += 1.0  # the last 3 keys of sequence 1: queries 4..6 of the packed batch must not move
    v3[:, 7:10] += 1.0
    later = varlen_attention(q, k3, v3, cu_q, cu_k, is_causal=True)
    assert torch.equal(later[:, :7], base[:, :7]) and not torch.allclose(later[:, 7:10], base[:, 7:10])


def test_empty_rows_are_zero_with_finite_gradients():
    # sequence 0 has 2 queries and no key; sequence 1, causal with Lq = 4 > Lk = 2: its first 2
    # queries see no key either.
    q, k, v, cu_q, cu_k = _packed([2, 4], [0, 2])
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    assert torch.equal(out[:, :4], torch.zeros(H, 4, EV, dtype=torch.float64))
    assert not torch.equal(out[:, 4:], torch.zeros(H, 2, EV, dtype=torch.float64))
    dq, dk, dv = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :4], torch.zeros_like(dq[:, :4]))


def test_no_sequence_at_all():
    q, k, v, cu_q, cu_k = _packed([], [])
    assert varlen_attention(q, k, v, cu_q, cu_k).shape == (H, 0, EV)


def test_scale_and_float32():
    lq, lk = [3, 5], [4, 2]
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    torch.testing.assert_close(
        varlen_attention(q, k, v, cu_q, cu_k, scale=0.3), _per_sequence(q, k, v, lq, lk, False, scale=0.3)
    )
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    out32 = varlen_attention(q32, k32, v32, cu_q.long(), cu_k.long(), is_causal=True)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, _per_sequence(q, k, v, lq, lk, True).float(), atol=1e-6, rtol=1e-5)


def test_flash_attention_layout_is_one_transpose():
    # FlashAttention's varlen takes (total, H, E): transpose(0, 1) on the way in and out.
    lq = lk = [3, 4]
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    q_fa, k_fa, v_fa = (t.detach().transpose(0, 1).contiguous() for t in (q, k, v))  # (total, H|Hkv, E|Ev)
    out = varlen_attention(q_fa.transpose(0, 1), k_fa.transpose(0, 1), v_fa.transpose(0, 1), cu_q, cu_k)
    out_fa = out.transpose(0, 1)  # (H, total_q, Ev) -> (total_q, H, Ev)
    assert out_fa.shape == (7, H, EV)
    torch.testing.assert_close(out_fa, _per_sequence(q, k, v, lq, lk, False).transpose(0, 1))


def _block_mask(lq, lk, causal):
    """The (total_q, total_k) mask written block by block: ones (or tril(Lk - Lq)) on the diagonal."""
    blocks = [torch.ones(n_q, n_k, dtype=torch.bool) for n_q, n_k in zip(lq, lk)]
    if causal:
        blocks = [b.tril(b.shape[1] - b.shape[0]) for b in blocks]
    return torch.block_diag(*blocks) if blocks else torch.zeros(0, 0, dtype=torch.bool)


@pytest.mark.parametrize("name", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_mask_mod_is_block_diagonal(name, causal):
    lq, lk = LENGTHS[name]
    keep = mods.create_mask(varlen_mask_mod(_cu(lq), _cu(lk), is_causal=causal), None, None, sum(lq), sum(lk))
    assert torch.equal(keep[0, 0], _block_mask(lq, lk, causal))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_mask_mod_runs_in_flex_attention(causal):
    lq, lk = LENGTHS["cross"]
    q, k, v, cu_q, cu_k = (t.detach() if t.is_floating_point() else t for t in _packed(lq, lk))
    v = torch.randn(HKV, sum(lk), E, dtype=torch.float64, generator=torch.Generator().manual_seed(4))  # flex: Ev == E
    block_mask = create_block_mask(varlen_mask_mod(cu_q, cu_k, is_causal=causal), None, None, sum(lq), sum(lk),
                                   device="cpu")
    flex = flex_attention(q[None], k[None], v[None], block_mask=block_mask, enable_gqa=True)[0]  # batch of 1
    torch.testing.assert_close(varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal), flex, atol=1e-12, rtol=1e-10)


def test_mask_mod_errors():
    with pytest.raises(ValueError, match="same number of sequences: cu_seqlens_q has 1 .* cu_seqlens_k has 2"):
        varlen_mask_mod(torch.tensor([0, 3]), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, got cu_seqlens_k\[0\] = 2"):
        varlen_mask_mod(torch.tensor([0, 3]), torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="is_causal must be a bool, got str"):
        varlen_mask_mod(torch.tensor([0, 3]), torch.tensor([0, 3]), is_causal="yes")
    with pytest.raises(ValueError, match="document_ids must have length L = 4"):  # used with other sizes
        mods.create_mask(varlen_mask_mod(torch.tensor([0, 3]), torch.tensor([0, 3])), None, None, 4, 3)


# --- pack, unpack, cu_seqlens_from_lengths -------------------------------------------------------


def test_cu_seqlens_from_lengths():
    cu = cu_seqlens_from_lengths(torch.tensor([3, 0, 5]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8]
    assert cu_seqlens_from_lengths([]).tolist() == [0]
    assert cu_seqlens_from_lengths([4]).tolist() == [0, 4]


@pytest.mark.parametrize("shape", [(4, 9, 3), (4, 2, 9, 3)], ids=["(B, L, d)", "(B, H, L, E)"])
def test_pack_then_unpack(shape):
    lengths = [5, 0, 9, 2]
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    packed, cu = pack(x, torch.tensor(lengths))
    # independent: the real rows of each sequence, concatenated along the sequence dim
    want = torch.cat([x[b, ..., :n, :] for b, n in enumerate(lengths)], dim=-2)
    assert torch.equal(packed, want) and cu.tolist() == [0, 5, 5, 14, 16]
    back = unpack(packed, cu, shape[-2])
    real = torch.arange(shape[-2])[:, None] < torch.tensor(lengths)[:, None, None]  # (B, Lmax, 1)
    real = real.reshape(4, *[1] * (len(shape) - 3), shape[-2], 1)  # broadcasts to x
    assert back.shape == x.shape
    assert torch.equal(back, torch.where(real, x, 0.0))  # the real tokens back, zeros in the padding
    assert unpack(packed, cu).shape[-2] == 9  # the longest sequence by default
    (grad,) = torch.autograd.grad(packed.sum(), x)
    assert torch.equal(grad, real.expand_as(x).double())
    (grad_back,) = torch.autograd.grad((back * 2).sum(), packed)
    assert torch.equal(grad_back, torch.full_like(packed, 2.0))


def test_pack_and_unpack_around_varlen_equals_the_padded_batch():
    lengths = [3, 6, 1]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, H, 6, E, generator=gen, dtype=torch.float64)  # (B, H, Lmax, E)
    k = torch.randn(3, HKV, 6, E, generator=gen, dtype=torch.float64)
    v = torch.randn(3, HKV, 6, EV, generator=gen, dtype=torch.float64)
    (qp, cu), (kp, _), (vp, _) = pack(q, lengths), pack(k, lengths), pack(v, lengths)
    out = unpack(varlen_attention(qp, kp, vp, cu, cu, is_causal=True), cu, 6)  # (B, H, Lmax, Ev)
    i, j = torch.arange(6)[:, None], torch.arange(6)
    mask = (j <= i) & (j < torch.tensor(lengths)[:, None, None, None])  # (B, 1, L, S)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :, :n], want[b, :, :n], atol=1e-12, rtol=1e-10)
        assert torch.equal(out[b, :, n:], torch.zeros_like(out[b, :, n:]))


# --- errors ------------------------------------------------------------------------------------


def _args(**change):
    q, k, v, cu_q, cu_k = (t.detach() if t.is_floating_point() else t for t in _packed([2, 3], [4, 1]))
    args = {"query": q, "key": k, "value": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args.update(change)
    return args


F64 = {"dtype": torch.float64}

ERRORS = {  # name: (argument changed, exception, message)
    "cu_seqlens_q not starting at 0": (
        {"cu_seqlens_q": torch.tensor([1, 2, 5])}, ValueError,
        r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1",
    ),
    "cu_seqlens_k decreasing": (
        {"cu_seqlens_k": torch.tensor([0, 4, 3, 5])}, ValueError,
        r"cu_seqlens_k must be non-decreasing .* cu_seqlens_k\[1\] = 4 > cu_seqlens_k\[2\] = 3",
    ),
    "cu_seqlens_q short of total_q": (
        {"cu_seqlens_q": torch.tensor([0, 2, 4])}, ValueError,
        r"cu_seqlens_q must end at the packed length total_q \(query.shape\[1\]\) = 5, got cu_seqlens_q\[-1\] = 4",
    ),
    "cu_seqlens_k beyond total_k": (
        {"cu_seqlens_k": torch.tensor([0, 4, 6])}, ValueError,
        r"cu_seqlens_k must end at the packed length total_k \(key.shape\[1\]\) = 5, got cu_seqlens_k\[-1\] = 6",
    ),
    "cu_seqlens float": (
        {"cu_seqlens_q": torch.tensor([0.0, 2.0, 5.0])}, TypeError,
        r"cu_seqlens_q must be an integer tensor \(n \+ 1,\), got torch.float32",
    ),
    "cu_seqlens bool": (
        {"cu_seqlens_k": torch.tensor([False, True])}, TypeError,
        r"cu_seqlens_k must be an integer tensor",
    ),
    "cu_seqlens 2-D": (
        {"cu_seqlens_q": torch.tensor([[0, 2, 5]])}, ValueError,
        r"cu_seqlens_q must have shape \(n \+ 1,\), got shape \(1, 3\)",
    ),
    "cu_seqlens empty": (
        {"cu_seqlens_q": torch.tensor([], dtype=torch.long)}, ValueError,
        r"cu_seqlens_q must hold n \+ 1 >= 1 offsets",
    ),
    "cu_seqlens not a tensor": (
        {"cu_seqlens_k": "0, 4, 5"}, TypeError,
        r"cu_seqlens_k must be a torch.Tensor, got str",
    ),
    "different numbers of sequences": (
        {"cu_seqlens_k": torch.tensor([0, 5])}, ValueError,
        r"same number of sequences: cu_seqlens_q has 2 .* cu_seqlens_k has 1",
    ),
    "H not a multiple of Hkv": (
        {"key": torch.randn(4, 5, E, **F64), "value": torch.randn(4, 5, EV, **F64)}, ValueError,
        r"query heads H = 6 \(query dim 0\) must be a multiple of the key/value heads Hkv = 4",
    ),
    "query 4-D": (
        {"query": torch.randn(1, H, 5, E, **F64)}, ValueError,
        r"query must have 3 dims \(H, total_q, E\) \(packed, heads first\), got 4 dims",
    ),
    "key 2-D": (
        {"key": torch.randn(5, E, **F64)}, ValueError,
        r"key must have at least 3 dims \(Hkv, total_k, E\), got 2 dims",
    ),
    "value heads": (
        {"value": torch.randn(1, 5, EV, **F64)}, ValueError,
        r"value must have the heads and length \(Hkv, total_k\) = \(2, 5\) of key, got value of shape \(1, 5, 5\)",
    ),
    "value length": (
        {"value": torch.randn(HKV, 4, EV, **F64)}, ValueError,
        r"value must have the heads and length",
    ),
    "E differs": (
        {"key": torch.randn(HKV, 5, E + 1, **F64)}, ValueError,
        r"query and key must have the same E",
    ),
    "dtype mismatch": (
        {"value": torch.randn(HKV, 5, EV)}, TypeError,
        r"value must have the same dtype as query \(torch.float64\), got torch.float32",
    ),
    "integer query": (
        {"query": torch.zeros(H, 5, E, dtype=torch.long)}, TypeError,
        r"query must have a floating-point dtype, got torch.int64",
    ),
    "device mismatch": (
        {"key": torch.randn(HKV, 5, E, **F64, device="meta")}, ValueError,
        r"key must be on the same device as query \(cpu\), got meta",
    ),
    "cu_seqlens on another device": (
        {"cu_seqlens_q": torch.tensor([0, 2, 5], device="meta")}, ValueError,
        r"cu_seqlens_q must be on the same device as query \(cpu\), got meta",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors_name_the_argument(name):
    change, error, match = ERRORS[name]
    with pytest.raises(error, match=match):
        varlen_attention(**_args(**change))


def test_is_causal_and_scale_are_checked():
    with pytest.raises(TypeError, match="is_causal must be a bool, got int"):
        varlen_attention(**_args(), is_causal=1)
    with pytest.raises(ValueError, match="scale must be a positive finite float or None, got -1.0"):
        varlen_attention(**_args(), scale=-1.0)


HELPER_ERRORS = {  # name: (call, exception, message)
    "longer than Lmax": (
        lambda: pack(torch.zeros(2, 4, 3), [1, 5]), ValueError,
        r"lengths must be <= the padded length Lmax = 4 \(x.shape\[-2\]\), got \[1, 5\]",
    ),
    "negative": (
        lambda: pack(torch.zeros(2, 4, 3), [1, -1]), ValueError,
        r"lengths must be non-negative, got \[1, -1\]",
    ),
    "wrong B": (
        lambda: pack(torch.zeros(2, 4, 3), [1, 2, 3]), ValueError,
        r"lengths must have shape \(B,\) = \(2,\) for x of shape \(2, 4, 3\), got \(3,\)",
    ),
    "float lengths": (
        lambda: pack(torch.zeros(2, 4, 3), torch.tensor([1.0, 2.0])), TypeError,
        r"lengths must be an integer tensor \(B,\), got torch.float32",
    ),
    "float in list": (
        lambda: pack(torch.zeros(2, 4, 3), [1, 2.5]), TypeError,
        r"lengths must be an integer tensor \(B,\) or a list of ints",
    ),
    "lengths on another device": (
        lambda: pack(torch.zeros(2, 4, 3), torch.tensor([1, 2], device="meta")), ValueError,
        r"lengths must be on the same device as x \(cpu\), got meta",
    ),
    "x 2-D": (
        lambda: pack(torch.zeros(2, 4), [1, 2]), ValueError,
        r"x must have at least 3 dims \(B, ..., Lmax, F\), got 2 dims",
    ),
    "max_length too short": (
        lambda: unpack(torch.zeros(5, 3), torch.tensor([0, 2, 5]), 2), ValueError,
        r"max_length must hold the longest sequence \(3 tokens\), got max_length=2",
    ),
    "cu_seqlens short": (
        lambda: unpack(torch.zeros(5, 3), torch.tensor([0, 2, 4])), ValueError,
        r"cu_seqlens must end at the packed length packed.shape\[-2\] = 5",
    ),
    "max_length float": (
        lambda: unpack(torch.zeros(5, 3), torch.tensor([0, 2, 5]), 3.0), TypeError,
        r"max_length must be an int or None, got float",
    ),
    "packed 1-D": (
        lambda: unpack(torch.zeros(5), torch.tensor([0, 5])), ValueError,
        r"packed must have at least 2 dims \(..., total, F\), got shape \(5,\)",
    ),
    "lengths 2-D": (
        lambda: cu_seqlens_from_lengths(torch.tensor([[1, 2]])), ValueError,
        r"lengths must have shape \(B,\), got shape \(1, 2\)",
    ),
}


@pytest.mark.parametrize("name", HELPER_ERRORS)
def test_helper_errors(name):
    call, error, match = HELPER_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


# --- learned sinks ---------------------------------------------------------------------------------
# One logit per query head, shared by every sequence (attention_ref.sinks). The reference is the
# dense math path with sinks=, each sequence alone; the packed call must give the same outputs, the
# same sink-inclusive lse and the same gradients of q, k, v and the sinks.

SINK_LENGTHS = ([2, 4, 0, 3, 5], [5, 0, 3, 3, 2])  # 4 queries without keys, 0 queries, Lq > Lk causal


def _alone_with_sinks(q, k, v, lq, lk, causal, sinks):
    """The math path on each sequence alone, with sinks; outputs and lse concatenated in packed order."""
    from attention_ref import scaled_dot_product_attention

    outs, lses = [], []
    for qs, ks, vs, n_q, n_k in zip(q.split(lq, 1), k.split(lk, 1), v.split(lk, 1), lq, lk):
        out, lse = scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, sinks=sinks, return_lse=True,
                                                mask_mod=mods.causal(offset=n_k - n_q) if causal else None,
                                                backend="math")
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _out_and_lse_loss(out, lse):
    """Depends on both results, so the lse's cotangent reaches the backward too."""
    return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sin().sum() + lse.mul(0.3).cos().sum()


@pytest.mark.parametrize("backend", ["math", "tiled"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_equal_each_sequence_alone_with_gradients(causal, backend):
    lq, lk = SINK_LENGTHS
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    sinks = (torch.randn(H, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2).requires_grad_()
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, is_causal=causal, sinks=sinks, return_lse=True,
                                backend=backend)
    ref, ref_lse = _alone_with_sinks(q, k, v, lq, lk, causal, sinks)
    assert lse.shape == (H, sum(lq))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    leaves = (q, k, v, sinks)
    grads = torch.autograd.grad(_out_and_lse_loss(out, lse), leaves)
    ref_grads = torch.autograd.grad(_out_and_lse_loss(ref, ref_lse), leaves)
    for name, g, r in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-9, msg=lambda m, name=name: f"d{name}: {m}")
    # the rows with no key: output 0, lse = the head's sink (exactly), in every head
    empty = [2, 3, 4, 5] + ([9, 10, 11] if causal else [])  # packed rows: sequence 1; with causal, 4's first 3
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[:, empty], sinks.detach()[:, None].expand(H, len(empty)))
    assert torch.isfinite(lse).all() and (out[:, [0, 1, 6]].abs() > 0).all()


def test_sinks_without_return_lse_and_the_errors_name_the_argument():
    lq, lk = SINK_LENGTHS
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    sinks = torch.linspace(-1, 1, H, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks)
    torch.testing.assert_close(out, _alone_with_sinks(q, k, v, lq, lk, False, sinks)[0], atol=1e-12, rtol=1e-10)
    assert not torch.allclose(out, varlen_attention(q, k, v, cu_q, cu_k)), "the sinks change the output"
    lse = varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)[1]  # no sink: a row without a key gives -inf
    assert (lse[:, 2:6] == float("-inf")).all() and torch.isfinite(lse[:, :2]).all()
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(6,\).*got \(2,\)"):
        varlen_attention(q, k, v, cu_q, cu_k, sinks=torch.zeros(HKV, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"sinks must be a torch.Tensor of shape \(H,\) = \(6,\), got list"):
        varlen_attention(q, k, v, cu_q, cu_k, sinks=[0.0] * H)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got int"):
        varlen_attention(q, k, v, cu_q, cu_k, return_lse=1)
    for backend in ("sdpa", "triton"):
        with pytest.raises(ValueError, match=rf"backend='{backend}' cannot run this call: .*sinks"):
            varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, backend=backend)
