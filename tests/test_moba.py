"""attention_ref.moba: MoBA against its definition, written here as a loop over queries.

The plain formula (`_plain_moba`) follows MoonshotAI's ``moba_naive.py`` in words: chunk means of
the keys, gate ``q . mean`` in float32 without a softmax scale, past chunks selectable, the own
chunk forced, the best ``topk - 1`` past chunks by gate (equal gates: the lower chunk), then one
softmax over the selected chunks' keys up to the query. Properties: ``topk`` at least the number
of chunks, or ``topk = 1`` read as ``"full"``, is causal attention; ``topk = 1`` read as
``"block_local"`` is chunked causal attention; the efficient form (own chunk and past chunks
merged by LSE) equals the one softmax, outputs and gradients. Planted bugs, each a piece of
``attention_ref.moba`` swapped for a broken one while the test runs, must make the plain formula
fail, and the untouched code must pass the same check. Sizes: B=2, H=6 (Hkv=3 with grouped
heads: pairs of query heads share a key head), L=11, E=5, Ev=7, chunks of 3 (4 chunks, the last
of 2 keys).
"""

from __future__ import annotations

import pytest
import torch

import attention_ref._inputs
import attention_ref.moba
from attention_ref import mods, scaled_dot_product_attention
from attention_ref.moba import (
    moba_attention,
    moba_attention_merged,
    moba_gate,
    moba_mask,
    moba_select,
)
from attention_ref.sparse import assert_topk_close, block_topk_attention

B, H, L, E, Ev, C = 2, 6, 11, 5, 7, 3
N = -(-L // C)  # 4 chunks


def _qkv(Hkv=H, seed=0, grad=False, length=L):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, length, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, length, Ev, generator=gen, dtype=torch.float64)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _plain_chunks(q, k, t, chunk, topk, topk1):
    """The chunks query ``t`` attends to, for one head: ``q`` ``(L, E)``, ``k`` ``(S, E)``."""
    own = t // chunk
    gates = {}
    for n in range(own):  # the chunks wholly before t's chunk
        mean = k[n * chunk:(n + 1) * chunk].mean(0)
        gates[n] = float(q[t].float() @ mean.float())  # float32, no softmax scale
    past = sorted(gates, key=lambda n: (-gates[n], n))  # best first, equal gates: the lower chunk
    if topk == 1 and topk1 == "full":
        return {own, *past}
    return {own, *past[: topk - 1]}


def _plain_moba(q, k, v, chunk, topk, topk1=None, scale=None):
    """Output ``(B, H, L, Ev)`` and lse ``(B, H, L)``, query by query; grouped key heads by index."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(q.shape[:-1], dtype=torch.float64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qh, kh, vh = q[b, h], k[b, h // group], v[b, h // group]
            for t in range(q.shape[2]):
                chunks = _plain_chunks(qh, kh, t, chunk, topk, topk1)
                keys = [j for j in range(t + 1) if j // chunk in chunks]
                scores = torch.stack([scale * (qh[t] @ kh[j]) for j in keys])
                weights = torch.softmax(scores, 0)
                out[b, h, t] = sum(w * vh[j] for w, j in zip(weights, keys))
                lse[b, h, t] = torch.logsumexp(scores, 0)
    return out, lse


@pytest.mark.parametrize("topk,topk1", [(1, "block_local"), (1, "full"), (2, None), (3, None)])
@pytest.mark.parametrize("Hkv", [H, 3])
def test_equals_the_plain_formula(topk, topk1, Hkv):
    q, k, v = _qkv(Hkv)
    out, lse = moba_attention(q, k, v, chunk_size=C, topk=topk, topk1=topk1, enable_gqa=Hkv != H, return_lse=True)
    ref, ref_lse = _plain_moba(q, k, v, C, topk, topk1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_the_selection_is_the_plain_one_and_differs_between_heads():
    q, k, _ = _qkv()
    chunks = moba_select(q, k, C, 2)  # (B, H, L, 2)
    for b in range(B):
        for h in range(H):
            for t in range(L):
                listed = {int(n) for n in chunks[b, h, t] if n >= 0}
                assert listed == _plain_chunks(q[b, h], k[b, h], t, C, 2, None), (b, h, t)
    assert not torch.equal(chunks[0, 0], chunks[0, 1])  # one selection per head: the data must show it


def test_all_chunks_or_topk1_full_is_causal_attention():
    q, k, v = _qkv()
    causal = scaled_dot_product_attention(q, k, v, is_causal=True)
    for topk, topk1 in [(N, None), (N + 5, None), (1, "full")]:
        torch.testing.assert_close(moba_attention(q, k, v, chunk_size=C, topk=topk, topk1=topk1), causal,
                                   rtol=1e-12, atol=1e-12)
    assert not torch.allclose(moba_attention(q, k, v, chunk_size=C, topk=2), causal)  # selection bites


def test_topk1_block_local_is_chunked_causal_attention():
    q, k, v = _qkv()
    local = scaled_dot_product_attention(q, k, v, mask_mod=mods.and_masks(mods.causal(), mods.chunked(C)))
    out = moba_attention(q, k, v, chunk_size=C, topk=1, topk1="block_local")
    torch.testing.assert_close(out, local, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call", [moba_attention, moba_attention_merged, moba_mask, moba_select])
def test_topk1_without_topk1_raises_naming_both_meanings(call):
    q, k, v = _qkv()
    args = (q, k, v) if call in (moba_attention, moba_attention_merged) else (q, k)
    kwargs = {"chunk_size": C, "topk": 1} if len(args) == 3 else {}
    positional = () if len(args) == 3 else (C, 1)
    with pytest.raises(ValueError, match=r"topk1 must be given when topk = 1.*block_local.*full"):
        call(*args, *positional, **kwargs)


@pytest.mark.parametrize("topk,topk1", [(1, "block_local"), (1, "full"), (2, None), (3, None)])
def test_the_efficient_form_merged_by_lse_equals_one_softmax(topk, topk1):
    q, k, v = _qkv(grad=True)
    out, lse = moba_attention_merged(q, k, v, chunk_size=C, topk=topk, topk1=topk1)
    ref, ref_lse = moba_attention(q, k, v, chunk_size=C, topk=topk, topk1=topk1, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(out)
    grads = torch.autograd.grad((out * up).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * up).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_the_gate_has_no_scale_forces_the_own_chunk_and_excludes_the_future():
    q, k, _ = _qkv()
    gate = moba_gate(q, k, C)  # (B, H, L, N)
    assert gate.shape == (B, H, L, N) and gate.dtype == torch.float32
    t = 7  # chunk 2: chunks 0 and 1 are past, 3 is future
    means = [k[0, 0, n * C:(n + 1) * C].mean(0).float() for n in range(2)]
    expected = torch.stack([q[0, 0, t].float() @ m for m in means])  # no 1 / sqrt(E)
    torch.testing.assert_close(gate[0, 0, t, :2], expected, rtol=1e-6, atol=1e-6)  # float32, summed in another order
    assert gate[0, 0, t, 2] == float("inf") and gate[0, 0, t, 3] == float("-inf")
    assert gate[0, 0, 5, 1] == float("inf") and gate[0, 0, 5, 0] > float("-inf")  # query 5 ends chunk 1
    assert (gate[0, 0, 2, 1:] == float("-inf")).all()  # query 2: chunk 0 is its own, no past


def test_equal_gates_take_the_lower_chunk_and_the_gate_judges_a_kernel():
    q = torch.ones(1, 1, 9, 1, dtype=torch.float64)
    k = torch.tensor([1.0, 1, 1, 2, 2, 2, 1, 1, 1], dtype=torch.float64).reshape(1, 1, 9, 1)  # means 1, 2, 1
    chunks, gate = moba_select(q, k, 3, 2, return_gate=True)
    assert chunks[0, 0, 8].tolist() == [2, 1]
    k = torch.ones(1, 1, 9, 1, dtype=torch.float64)  # every mean 1: query 8 ties chunks 0 and 1
    chunks, gate = moba_select(q, k, 3, 2, return_gate=True)
    assert chunks[0, 0, 8].tolist() == [2, 0]
    assert_topk_close(chunks, gate)  # the reference's own choice passes
    other = chunks.clone()
    other[0, 0, 8, 1] = 1  # the other tied chunk: a kernel may take it
    assert_topk_close(other, gate)


def test_the_mask_is_the_selection_and_gives_the_attention():
    q, k, v = _qkv()
    mask = moba_mask(q, k, C, 2)  # (B, H, L, L)
    for b, h, t in [(0, 0, 10), (1, 2, 7), (0, 1, 3)]:
        chunks = _plain_chunks(q[b, h], k[b, h], t, C, 2, None)
        assert mask[b, h, t].tolist() == [j <= t and j // C in chunks for j in range(L)]
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask),
                               moba_attention(q, k, v, chunk_size=C, topk=2), rtol=1e-12, atol=1e-12)


def test_packed_sequences_are_chunked_each_from_its_start():
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 4, 11])  # lengths 4, 0, 7
    out, lse = moba_attention(q, k, v, chunk_size=C, topk=2, cu_seqlens=cu, return_lse=True)
    for a, b in [(0, 4), (4, 11)]:
        part, part_lse = moba_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], chunk_size=C, topk=2,
                                        return_lse=True)
        torch.testing.assert_close(out[..., a:b, :], part, rtol=0, atol=0)
        torch.testing.assert_close(lse[..., a:b], part_lse, rtol=0, atol=0)
    assert not torch.allclose(out, moba_attention(q, k, v, chunk_size=C, topk=2))


def test_gradcheck():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 7, 2, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return moba_attention(q, k, v, chunk_size=2, topk=2)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int, got 0"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size must be an int, got float"),
        ({"topk": 0}, ValueError, "topk must be a positive int, got 0"),
        ({"topk": 2, "topk1": "local"}, ValueError, "topk1 must be 'block_local', 'full' or None, got 'local'"),
        ({"gate_dtype": torch.int32}, TypeError, "gate_dtype must be a floating-point torch.dtype, got torch.int32"),
        ({"cu_seqlens": torch.tensor([0, 4, 10])}, ValueError, r"cu_seqlens must end at .* = 11, got cu_seqlens\[-1\] = 10"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    q, k, v = _qkv()
    call = {"chunk_size": C, "topk": 2, **kwargs}
    with pytest.raises(error, match=match):
        moba_attention(q, k, v, **call)


def test_keys_of_another_length_raise_naming_key():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"key must have S = L = 11 keys .* got key \(2, 6, 10, 5\) with S = 10"):
        moba_attention(q, k[..., :10, :], v[..., :10, :], chunk_size=C, topk=2)


# Planted bugs: (module, name, replacement), swapped in while `moba_attention` runs; the check is
# the plain formula with grouped heads (Hkv=3) and topk=2.


def _gate_without_own_chunk(query, key, chunk_size, **kwargs):
    """MoonshotAI's gate without its ``+inf`` line: the own chunk stays ``-inf``, never selected."""
    gate = moba_gate(query, key, chunk_size, **kwargs)
    return gate.masked_fill(gate == float("inf"), float("-inf"))


def _gate_without_future_mask(query, key, chunk_size, *, enable_gqa=False, gate_dtype=torch.float32):
    """MoonshotAI's gate without its ``-inf`` line: a chunk selectable before it ends, future chunks included.

    (A chunk selectable from its own last query would not show: that query is in the chunk,
    which is forced anyway. The only chunks that have not ended are the own and the future ones.)
    """
    gate = moba_gate(query, key, chunk_size, enable_gqa=enable_gqa, gate_dtype=gate_dtype)
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)  # (B, Hkv, L, E) -> (B, H, L, E)
    means = torch.stack([key[..., a:a + chunk_size, :].mean(-2) for a in range(0, key.shape[-2], chunk_size)], dim=-2)
    raw = query.to(gate_dtype) @ means.to(gate_dtype).transpose(-2, -1)  # (B, H, L, E) x (B, H, E, N) -> (B, H, L, N)
    return torch.where(gate == float("-inf"), raw, gate)


def _expand_with_repeat(query, kv, name):
    """Grouped heads expanded with ``repeat``: query head ``h`` reads key head ``h % Hkv``, not ``h // G``."""
    return kv.repeat(*[1] * (kv.dim() - 3), query.shape[-3] // kv.shape[-3], 1, 1)  # (..., Hkv, S, E) -> (..., H, S, E)


PLANTED = {
    "causal mask inside the own chunk dropped": (
        attention_ref.moba, "block_topk_attention",
        lambda *args, **kwargs: block_topk_attention(*args, **{**kwargs, "is_causal": False})),
    "own chunk not forced": (attention_ref.moba, "moba_gate", _gate_without_own_chunk),
    "a chunk selectable before it ends": (attention_ref.moba, "moba_gate", _gate_without_future_mask),
    "repeat for repeat_interleave on grouped keys and values": (attention_ref._inputs, "expand_kv_heads",
                                                                 _expand_with_repeat),
}


@pytest.fixture(scope="module")
def plain_grouped():
    """`_plain_moba` with grouped heads (Hkv=3), topk=2: ``(output, lse)``."""
    return _plain_moba(*_qkv(3), C, 2)


@pytest.mark.parametrize("bug", [pytest.param(None, id="the code as it is"), *PLANTED])
def test_planted_bugs_fail_the_plain_formula_and_the_code_passes(plain_grouped, monkeypatch, bug):
    def check():
        out, lse = moba_attention(*_qkv(3), chunk_size=C, topk=2, enable_gqa=True, return_lse=True)
        torch.testing.assert_close(out, plain_grouped[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, plain_grouped[1], rtol=1e-12, atol=1e-12)

    if bug is None:
        check()
        return
    monkeypatch.setattr(*PLANTED[bug])
    with pytest.raises(AssertionError):
        check()
