"""attention_ref.sparse: top-k sparse attention equals dense attention with the selection as a mask.

The semantics under test (the module docstring): the keys listed per query are a set, ``-1``
is no key, a value outside ``[0, S)`` other than ``-1`` raises, a key listed twice raises,
causality is applied only when asked. Two references hold ``topk_attention`` in float64,
outputs and gradients: dense attention with a mask built by hand, element by element, and a
gather over the listed keys with the softmax over the ``k`` slots (FlashMLA's reference form,
written here). Grouped-query heads, sinks, the tiled backend, and DeepSeek V3.2 through
`attention_ref.hf` (its ``indices`` keyword) against transformers' eager path complete it.
Sizes are distinct primes: B=2, H=3, L=5, S=7, E=11, Ev=13, k=3.
"""

from __future__ import annotations

import pytest
import torch

from attention_ref import causal_mask, scaled_dot_product_attention, tiled
from attention_ref.sparse import _selected_keys, topk_attention, topk_mask

B, H, L, S, E, Ev, K = 2, 3, 5, 7, 11, 13, 3


def _qkv(Hkv=H, dtype=torch.float64, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, S, Ev, generator=gen, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _indices(shape=(B, H, L), k=K, seed=1, pad=True):
    """Distinct keys per row (a random permutation's first k), some slots -1 when ``pad``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(torch.Size(shape).numel())])
    rows = rows.reshape(*shape, k)
    if pad:
        rows[..., 0, 1:] = -1  # query 0: one key only
        rows[..., 2, :] = -1  # query 2: no key at all
    return rows


def _mask_by_hand(indices, S):
    """The keep-mask, one element at a time: True where the row lists the key."""
    keep = torch.zeros(*indices.shape[:-1], S, dtype=torch.bool)
    flat_i, flat_k = indices.reshape(-1, indices.shape[-1]), keep.view(-1, S)
    for r in range(flat_i.shape[0]):
        for j in flat_i[r].tolist():
            if j != -1:
                flat_k[r, j] = True
    return keep


def _gathered(q, k, v, indices, scale=None):
    """FlashMLA's reference form: gather the listed keys, softmax over the k slots, -1 slots out."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    slots = indices.clamp(min=0).expand(*q.shape[:-2], L, indices.shape[-1])  # (B, H, L, k)
    flat = slots.reshape(*slots.shape[:-2], -1)  # (B, H, L * k)
    k_sel = torch.gather(k, -2, flat.unsqueeze(-1).expand(*flat.shape, k.shape[-1])).unflatten(-2, slots.shape[-2:])
    v_sel = torch.gather(v, -2, flat.unsqueeze(-1).expand(*flat.shape, v.shape[-1])).unflatten(-2, slots.shape[-2:])
    scores = (q.unsqueeze(-2) * k_sel).sum(-1) * scale  # (B, H, L, 1, E) * (B, H, L, k, E) -> (B, H, L, k)
    scores = scores.masked_fill(indices.expand_as(scores) == -1, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(dim=-1))  # a row of -1 only: NaN -> 0
    return (weights.unsqueeze(-1) * v_sel).sum(-2)  # (B, H, L, k, 1) * (B, H, L, k, Ev) -> (B, H, L, Ev)


def _grads(out, *tensors):
    return torch.autograd.grad(out.square().sum(), tensors)


# --- the mask ---------------------------------------------------------------------------------


def test_topk_mask_by_hand():
    indices = torch.tensor([[2, 0, -1], [-1, -1, -1], [4, 3, 1]], dtype=torch.int32)
    assert topk_mask(indices, 5).int().tolist() == [[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 1]]
    assert torch.equal(topk_mask(_indices(), S), _mask_by_hand(_indices(), S))


def test_order_within_a_row_does_not_matter():
    indices = _indices()
    shuffled = indices.flip(-1)
    q, k, v = _qkv()
    assert torch.equal(topk_attention(q, k, v, indices), topk_attention(q, k, v, shuffled))


# --- equal to dense attention -------------------------------------------------------------------


def test_equals_dense_attention_with_the_mask_outputs_and_gradients():
    q, k, v = _qkv(grad=True)
    indices = _indices()
    ours = topk_attention(q, k, v, indices, scale=0.3)
    dense = scaled_dot_product_attention(q, k, v, _mask_by_hand(indices, S), scale=0.3)
    gathered = _gathered(q, k, v, indices, scale=0.3)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours, gathered, rtol=0, atol=1e-12)
    for a, b, c in zip(_grads(ours, q, k, v), _grads(dense, q, k, v), _grads(gathered, q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-12)


def test_minus_one_is_no_key():
    q, k, v = _qkv()
    indices = _indices()
    out, weights = topk_attention(q, k, v, indices, return_weights=True)
    assert torch.equal(out[:, :, 2], torch.zeros(B, H, Ev, dtype=q.dtype))  # a row of -1 only: output 0
    assert torch.equal(weights[:, :, 2], torch.zeros(B, H, S, dtype=q.dtype))
    assert torch.equal(weights[:, :, 0] > 0, topk_mask(indices, S)[:, :, 0])  # query 0: its one key, weight 1
    shorter = indices[..., :1]  # a -1 slot is the same as no slot
    torch.testing.assert_close(out[:, :, 0], topk_attention(q, k, v, shorter)[:, :, 0], rtol=0, atol=0)


def test_one_selection_shared_by_all_heads():
    q, k, v = _qkv()
    shared = _indices(shape=(B, 1, L))  # DSA: (B, 1, L, k)
    out = topk_attention(q, k, v, shared)
    torch.testing.assert_close(out, topk_attention(q, k, v, shared.expand(B, H, L, K)), rtol=0, atol=0)
    torch.testing.assert_close(out, _gathered(q, k, v, shared), rtol=0, atol=1e-12)


# --- what raises ------------------------------------------------------------------------------


def test_duplicates_raise():
    q, k, v = _qkv()
    indices = _indices()
    indices[1, 2, 4] = torch.tensor([6, 1, 6])
    with pytest.raises(ValueError, match=r"each key at most once .* key 6 appears more than once in "
                                         r"indices\[1, 2, 4\]"):
        topk_attention(q, k, v, indices)
    with pytest.raises(ValueError, match=r"key 6 appears more than once"):
        topk_mask(indices, S)
    topk_mask(torch.tensor([[-1, -1, 3]]), S)  # -1 repeated: padding, not a duplicate


@pytest.mark.parametrize("bad", [7, 100, -2])
def test_out_of_range_raises_with_value_place_and_range(bad):
    q, k, v = _qkv()
    indices = _indices()
    indices[0, 1, 3, 2] = bad
    with pytest.raises(ValueError, match=rf"indices must hold key positions in \[0, S\) = \[0, 7\), or -1 for "
                                         rf"no key; got {bad} at indices\[0, 1, 3, 2\]"):
        topk_attention(q, k, v, indices)


def test_wrong_type_and_shape_raise():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"indices must be a signed integer tensor .* got torch.float32"):
        topk_attention(q, k, v, torch.zeros(B, 1, L, K))
    with pytest.raises(TypeError, match=r"indices must be a signed integer tensor .* got torch.bool"):
        topk_attention(q, k, v, torch.ones(B, 1, L, K, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"with L = 5 \(the query's length\), got shape \(2, 1, 4, 3\)"):
        topk_attention(q, k, v, _indices(shape=(B, 1, 4)))
    with pytest.raises(ValueError, match=r"leading dims must broadcast to the output's \(\.\.\., H\) = \(2, 3\)"):
        topk_attention(q, k, v, _indices(shape=(B, L)))  # (B, L, k): the heads dim is missing


# --- causality, grouped-query heads, sinks, backends ----------------------------------------------


def test_causality_is_reapplied_only_when_asked():
    """transformers' top-k lists future keys when fewer than k are valid: they must not take part."""
    q, k, v = _qkv(grad=True)
    everything = torch.arange(S).expand(B, 1, L, S)  # every key listed, as topk(S) of -inf scores would
    ours = topk_attention(q, k, v, everything, is_causal=True)
    dense = scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-12)
    for a, b in zip(_grads(ours, q, k, v), _grads(dense, q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    leaky = topk_attention(q, k, v, everything)  # not asked: the future keys take part
    assert (leaky - dense).abs().max() > 1e-2
    bottom_right = causal_mask(L, S, alignment="bottom_right")  # decoding: queries are the last L positions
    torch.testing.assert_close(topk_attention(q, k, v, _indices(), bottom_right),
                               scaled_dot_product_attention(q, k, v, bottom_right & topk_mask(_indices(), S)),
                               rtol=0, atol=1e-12)


def test_grouped_query_heads():
    q, k, v = _qkv(Hkv=1, grad=True)
    indices = _indices()
    ours = topk_attention(q, k, v, indices, enable_gqa=True)
    k3, v3 = k.expand(B, H, S, E), v.expand(B, H, S, Ev)
    torch.testing.assert_close(ours, _gathered(q, k3, v3, indices), rtol=0, atol=1e-12)
    for a, b in zip(_grads(ours, q, k, v), _grads(_gathered(q, k3, v3, indices), q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_sinks():
    q, k, v = _qkv(grad=True)
    sinks = torch.tensor([1.5, -0.5, 0.0], dtype=torch.float64, requires_grad=True)
    indices = _indices()
    ours = topk_attention(q, k, v, indices, sinks=sinks)
    dense = scaled_dot_product_attention(q, k, v, _mask_by_hand(indices, S), sinks=sinks)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-12)
    for a, b in zip(_grads(ours, q, sinks), _grads(dense, q, sinks)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.equal(ours[:, :, 2], torch.zeros(B, H, Ev, dtype=q.dtype))  # no key: 0, sink or not
    assert (ours - topk_attention(q, k, v, indices)).abs().max() > 1e-2  # the sink took its share


def test_the_tiled_backend_equals_math_and_skips_the_blocks_no_query_selects():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    indices = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(40)]).reshape(1, 1, 40, 4)
    itself = torch.arange(40).reshape(1, 1, 40, 1)
    indices = torch.cat([itself, indices[..., 1:].masked_fill(indices[..., 1:] == itself, -1)], -1)
    # each query keeps itself and up to 3 of keys 0..15: keys 16..39 only on the diagonal
    ours = topk_attention(q, k, v, indices, backend="tiled")
    torch.testing.assert_close(ours, topk_attention(q, k, v, indices), rtol=0, atol=1e-12)
    block_mask = tiled.create_block_mask(_selected_keys(topk_mask(indices, 40), (1, 2)), 1, 2, 40, 40,
                                         block_q=8, block_k=8)
    assert block_mask.counts()["empty"] >= 6  # key blocks 2..4 are empty for every query block but their own


# --- DeepSeek V3.2 through the Hugging Face adapter ---------------------------------------------


transformers = pytest.importorskip("transformers")
from attention_ref import hf

NAME = hf.register()


class Layer(torch.nn.Module):
    is_causal, layer_idx, training = True, 0, False


def test_the_adapter_consumes_indices():
    """``indices`` (B, L, k), int32, as DeepSeek V3.2 passes it, with the causal mask kept."""
    q, k, v = _qkv(dtype=torch.float32)
    i = torch.arange(L)
    # query i keeps itself, key i - 2 (-1 where none) and key 6, in the future of every query
    chosen = torch.stack([i, (i - 2).clamp(min=-1), torch.full_like(i, S - 1)], -1).int().expand(B, L, K)
    eager_mask = torch.zeros(B, 1, L, S).masked_fill(~causal_mask(L, S), torch.finfo(torch.float32).min)
    ours, _ = hf.attention_forward(Layer(), q, k, v, eager_mask, indices=chosen)
    keep = causal_mask(L, S) & topk_mask(chosen.unsqueeze(1), S)
    expected = scaled_dot_product_attention(q, k, v, keep).transpose(1, 2)
    torch.testing.assert_close(ours, expected)
    with pytest.raises(ValueError, match=r"passed indices of shape \(2, 1, 5, 3\); expected .* \(B, L, k\)"):
        hf.attention_forward(Layer(), q, k, v, eager_mask, indices=chosen.unsqueeze(1))
    with pytest.raises(NotImplementedError, match=r"passed the keyword 'top_k_keys'"):  # unknown: still raises
        hf.attention_forward(Layer(), q, k, v, eager_mask, indices=chosen, top_k_keys=chosen)


def _deepseek_v32():
    config = transformers.DeepseekV32Config(
        vocab_size=101, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=8, index_n_heads=4, index_head_dim=16,
        index_topk=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    with torch.no_grad():  # weights 3x the init's: peaked attention, so the selection matters
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def _logits(model, impl, ids):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_deepseek_v32_with_top_k_shorter_than_the_prompt_equals_eager():
    model = _deepseek_v32()
    ids = torch.randint(3, 101, (2, 13), generator=torch.Generator().manual_seed(1))  # 4 of 13 keys kept
    eager = _logits(model, "eager", ids)
    ours = _logits(model, NAME, ids)
    assert ((ours - eager).abs().max() / eager.abs().max()).item() < 1e-5

    def dense(module, *args, indices=None, **kwargs):  # the failure this module fixes: indices dropped
        return hf.attention_forward(module, *args, **kwargs)

    transformers.AttentionInterface.register("attention_ref_dense", dense)
    transformers.AttentionMaskInterface.register("attention_ref_dense", transformers.AttentionMaskInterface()[NAME])
    assert ((_logits(model, "attention_ref_dense", ids) - eager).abs().max() / eager.abs().max()).item() > 1e-2

    model.set_attn_implementation("eager")
    expected = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation(NAME)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), expected)


# --- the lightning indexer --------------------------------------------------------------------


from torch.overrides import TorchFunctionMode
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Indexer,
    DeepseekV32RotaryEmbedding,
    apply_rotary_pos_emb,
)

from attention_ref.positional import apply_rope
from attention_ref.sparse import (
    LightningIndexer,
    assert_topk_close,
    indexer_rope,
    lightning_indexer,
)


class _TopkInput(TorchFunctionMode):
    """Records the tensor ``topk`` is called on: transformers' indexer returns indices only, not its scores."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.scores = args[0]
        return func(*args, **(kwargs or {}))


def _hf_indexer(seed=0):
    """transformers' indexer of the tiny V3.2 (E=16, R=8, H=4, k=4), every weight random, its inputs for L=13."""
    config = _deepseek_v32().config
    torch.manual_seed(seed)
    indexer = DeepseekV32Indexer(config, 0)
    with torch.no_grad():
        for p in indexer.parameters():  # LayerNorm's weight and bias too
            p.copy_(torch.randn_like(p))
    gen = torch.Generator().manual_seed(seed + 1)
    Lh = 13
    x, c_q = torch.randn(B, Lh, 64, generator=gen), torch.randn(B, Lh, 32, generator=gen)
    cos, sin = DeepseekV32RotaryEmbedding(config)(x, torch.arange(Lh).expand(B, Lh))  # (B, L, R) each
    return indexer, x, c_q, (cos, sin)


def test_lightning_indexer_by_hand():
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)  # (H, L, E)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 2.0]], dtype=torch.float64)  # (S, E)
    w = torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=torch.float64)  # (H, L)
    idx, scores = lightning_indexer(q, k, w, 2, scale=1.0, return_scores=True)
    # query 0: relu(q_0 . k) = [1, 0, 0] and [0, 1, 2]: 1 * [1, 0, 0] + 0.5 * [0, 1, 2]
    # query 1: [0, 2, 4] and [1, 1, 1]: 0.5 * [0, 2, 4] + 2 * [1, 1, 1]
    assert scores.tolist() == [[1.0, 0.5, 1.0], [2.0, 3.0, 4.0]]
    assert idx[1].tolist() == [2, 1] and sorted(idx[0].tolist()) == [0, 2]
    assert_topk_close(idx, scores)
    _, half = lightning_indexer(q, k, w, 2, return_scores=True)  # the default scale 1/sqrt(E)
    torch.testing.assert_close(half, scores / 2 ** 0.5, rtol=0, atol=1e-15)
    causal, masked = lightning_indexer(q, k, w, 2, is_causal=True, scale=1.0, return_scores=True)
    assert causal.tolist() == [[0, -1], [1, 0]]  # query 0 sees key 0 only: -1 pads
    assert masked[0, 1:].isneginf().all()
    assert lightning_indexer(q, k, w, 9).shape == (2, 3)  # (L, min(topk, S))


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_lightning_indexer_equals_transformers(mask_kind):
    """Scores equal transformers' (the tensor its topk reads), and the same keys are selected."""
    hf_indexer, x, c_q, (cos, sin) = _hf_indexer()
    Lh = x.shape[1]
    keep = causal_mask(Lh).expand(B, Lh, Lh)  # (B, L, S) as transformers passes it to its indexer
    mask = keep if mask_kind == "bool" else torch.zeros(B, Lh, Lh).masked_fill(~keep, torch.finfo(torch.float32).min)
    with _TopkInput() as seen:
        theirs = hf_indexer(x, c_q, (cos, sin), mask, None)  # (B, L, k) int32
    ours = LightningIndexer.from_hf(hf_indexer)
    idx, scores = ours(x, c_q, (cos[..., :4], sin[..., :4]), mask, return_scores=True)
    torch.testing.assert_close(scores, seen.scores, rtol=1e-6, atol=1e-5)
    assert_topk_close(theirs, scores)  # theirs judged by our scores, and ours by theirs
    assert_topk_close(idx, seen.scores)
    valid = [[sorted(j for j in row if j <= i) for i, row in enumerate(batch)] for batch in theirs.tolist()]
    assert [[sorted(j for j in row if j != -1) for row in batch] for batch in idx.tolist()] == valid \
        if mask_kind == "bool" else idx.tolist() == theirs.long().tolist()
    assert (idx[:, :3] == -1).sum() == (B * (3 + 2 + 1) if mask_kind == "bool" else 0)  # queries 0-2: < k keys


def test_indexer_rope_is_half_split_on_the_first_dims():
    """Not MLA's convention (interleaved, last dims): the two give other keys."""
    _, _, _, (cos, sin) = _hf_indexer()
    q = torch.randn(B, 1, 13, 16, generator=torch.Generator().manual_seed(5))  # (B, H, L, E)
    theirs, _ = apply_rotary_pos_emb(q[..., :8], q[..., :8], cos, sin, unsqueeze_dim=1)
    ours = indexer_rope(q, cos[:, None, :, :4], sin[:, None, :, :4])
    torch.testing.assert_close(ours[..., :8], theirs, rtol=0, atol=1e-6)
    assert torch.equal(ours[..., 8:], q[..., 8:])
    interleaved = apply_rope(q[..., :8], cos[:, None, :, :4], sin[:, None, :, :4], interleaved=True)
    assert (interleaved - theirs).abs().max() > 0.1


def test_scale_changes_the_scores_never_the_selection():
    gen = torch.Generator().manual_seed(6)
    q, k, w = torch.randn(H, L, E, generator=gen), torch.randn(S, E, generator=gen), torch.rand(H, L, generator=gen)
    idx, scores = lightning_indexer(q, k, w, K, return_scores=True)
    idx3, scores3 = lightning_indexer(q, k, w, K, scale=3 * E ** -0.5, return_scores=True)
    torch.testing.assert_close(scores3, 3 * scores)
    assert torch.equal(idx, idx3)


def test_the_selection_feeds_topk_attention():
    hf_indexer, x, c_q, (cos, sin) = _hf_indexer()
    idx = LightningIndexer.from_hf(hf_indexer)(x, c_q, (cos[..., :4], sin[..., :4]), is_causal=True)  # (B, L, k)
    q, k, v = (torch.randn(B, 3, 13, 8, generator=torch.Generator().manual_seed(7)) for _ in range(3))
    out = topk_attention(q, k, v, idx.unsqueeze(-3))  # (B, 1, L, k): one selection for all heads
    keep = topk_mask(idx.unsqueeze(1), 13)
    assert not (keep & ~causal_mask(13)).any()  # -1, never a future key
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, keep))


# --- judging an indexer by the scores it selects ------------------------------------------------


def test_ties_do_not_fail_a_correct_indexer():
    scores = torch.tensor([[5.0, 2.0, 7.0, 2.0, 1.0], [0.0, 1.0, 1.0, 1.0, -3.0]])  # (L, S)
    for choice in ([2, 0, 1], [3, 0, 2], [0, 2, 3]):  # row 0: key 1 or key 3, the tie at the boundary
        for other in ([1, 2, 3], [3, 2, 1]):  # row 1: three equal scores, any order
            assert_topk_close(torch.tensor([choice, other]), scores)
    nudged = scores[:1].double() + torch.tensor([[0, 1e-6, 0, 0, 0]], dtype=torch.float64)  # key 1 now ahead
    assert_topk_close(torch.tensor([[2, 0, 3]]), nudged)  # within rtol=1e-5: key 3 still passes
    with pytest.raises(AssertionError, match=r"2\.000001 \(key 1\) is not selected, key 3 with score 2 is"):
        assert_topk_close(torch.tensor([[2, 0, 3]]), nudged, rtol=0, atol=1e-7)


def test_a_wrong_selection_fails_naming_the_row_and_the_missed_score():
    scores = torch.arange(2 * 3 * 7, dtype=torch.float32).reshape(2, 3, 7) % 5  # (B, L, S)
    right = scores.topk(3, dim=-1).indices
    assert_topk_close(right, scores)
    wrong = right.clone()
    wrong[1, 2, 0] = int((scores[1, 2] == scores[1, 2].min()).nonzero()[0])  # its best key -> its worst
    best = int(right[1, 2, 0])
    with pytest.raises(AssertionError, match=rf"indices\[1, 2\] misses a top-3 score: 4 \(key {best}\) is not "
                                             rf"selected, key \d+ with score 0 is \(1 of 6 rows differ"):
        assert_topk_close(wrong, scores)
    short = right.clone()
    short[0, 0, 2] = -1
    with pytest.raises(AssertionError, match=r"indices\[0, 0\] misses .* a -1 slot \(no key\) is"):
        assert_topk_close(short, scores)
    twice = right.clone()
    twice[0, 1, 1] = twice[0, 1, 0]
    with pytest.raises(AssertionError, match=r"appears more than once in indices\[0, 1\]"):
        assert_topk_close(twice, scores)
    with pytest.raises(AssertionError, match=r"key positions in \[0, S\) = \[0, 7\), .* got 7"):
        assert_topk_close(right.masked_fill(right == right.max(), 7), scores)


def test_masked_slots_pass_as_minus_one_or_as_masked_keys():
    scores = torch.tensor([[2.0, float("-inf"), float("-inf")], [1.0, 3.0, float("-inf")]])  # causal, L=2, S=3
    assert_topk_close(torch.tensor([[0, -1], [1, 0]]), scores)  # ours
    assert_topk_close(torch.tensor([[0, 2], [1, 0]]), scores)  # transformers': a masked (future) key
    with pytest.raises(AssertionError, match=r"indices\[1\] misses a top-2 score: 1 \(key 0\)"):
        assert_topk_close(torch.tensor([[0, 1], [1, 2]]), scores)


def _buggy_indices(bug):
    """The tiny V3.2 indexer with one bug from a real port (variants-2026 section 3.1), causal."""
    hf_indexer, x, c_q, (cos, sin) = _hf_indexer()
    ours = LightningIndexer.from_hf(hf_indexer)
    cos, sin = cos[..., :4], sin[..., :4]
    q, k, w = ours.project(x, c_q, (cos, sin))
    if bug == "no relu":  # mlx-lm #531
        scores = (w.unsqueeze(-1) * q @ k.unsqueeze(1).transpose(-1, -2) / 4).sum(1)
        return scores.masked_fill(~causal_mask(13), float("-inf")).topk(4, dim=-1).indices
    if bug == "interleaved rope":  # MLA's convention on the indexer
        qr = ours.wq_b(c_q).view(B, 13, 4, 16).transpose(1, 2)
        kr = ours.k_norm(ours.wk(x))

        def rope(t, c, s):
            return torch.cat([apply_rope(t[..., :8], c, s, interleaved=True), t[..., 8:]], -1)

        q, k = rope(qr, cos.unsqueeze(1), sin.unsqueeze(1)), rope(kr, cos, sin)
    if bug == "no layernorm":
        k = indexer_rope(ours.wk(x), cos, sin)
    if bug == "no mask":  # lablup/mlxcel #619: future keys chosen
        return lightning_indexer(q, k, w, 4)
    return lightning_indexer(q, k, w, 4, is_causal=True)


@pytest.mark.parametrize("bug", ["no relu", "interleaved rope", "no layernorm", "no mask"])
def test_indexers_with_known_port_bugs_fail(bug):
    hf_indexer, x, c_q, (cos, sin) = _hf_indexer()
    _, scores = LightningIndexer.from_hf(hf_indexer)(x, c_q, (cos[..., :4], sin[..., :4]), is_causal=True,
                                                     return_scores=True)
    with pytest.raises(AssertionError, match=r"misses a top-4 score"):
        assert_topk_close(_buggy_indices(bug), scores)


# --- what the indexer raises ----------------------------------------------------------------------


def test_indexer_errors_have_messages():
    q, k, w = torch.randn(H, L, E), torch.randn(S, E), torch.randn(H, L)
    with pytest.raises(ValueError, match=r"key must have shape \(\.\.\., S, E\) with E = 11 .* key \(7, 10\)"):
        lightning_indexer(q, k[:, :10], w, K)
    with pytest.raises(ValueError, match=r"weights must have shape \(\.\.\., H, L\) = \(\.\.\., 3, 5\), .* got \(5, 3\)"):
        lightning_indexer(q, k, w.T, K)
    with pytest.raises(ValueError, match=r"topk must be a positive int, got 0"):
        lightning_indexer(q, k, w, 0)
    with pytest.raises(TypeError, match=r"attn_mask must be bool .* got torch.int64"):
        lightning_indexer(q, k, w, K, torch.ones(L, S, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_mask must broadcast to \(\.\.\., L, S\) = \(\.\.\., 5, 7\)"):
        lightning_indexer(q, k, w, K, torch.ones(S, L, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"query must have a floating-point dtype, got torch.int64"):
        lightning_indexer(q.long(), k, w, K)
    with pytest.raises(ValueError, match=r"cos must have last dim R/2 <= E/2 .* \(R = 12\) .* \(E = 11\)"):
        indexer_rope(q, torch.ones(L, 6), torch.ones(L, 6))
    with pytest.raises(TypeError, match=r"indexer must be a transformers DeepseekV32Indexer, got Linear"):
        LightningIndexer.from_hf(torch.nn.Linear(2, 2))
    indexer = LightningIndexer(16, 8, num_heads=3, head_dim=6, rope_dim=4, topk=2)
    with pytest.raises(ValueError, match=r"rotary's cos must have last dim R/2 = 2, got shape \(5, 4\)"):
        indexer(torch.randn(1, 5, 16), torch.randn(1, 5, 8), (torch.ones(5, 4), torch.ones(5, 4)))
    with pytest.raises(ValueError, match=r"rope_dim must be even and at most head_dim = 6, got 5"):
        LightningIndexer(16, 8, num_heads=3, head_dim=6, rope_dim=5, topk=2)


def test_checker_errors_have_messages():
    scores = torch.randn(L, S)
    right = scores.topk(K, dim=-1).indices
    with pytest.raises(ValueError, match=r"must share \(\.\.\., L\), got indices \(4, 3\) and scores \(5, 7\)"):
        assert_topk_close(right[:4], scores)
    with pytest.raises(ValueError, match=r"min\(k, S\) = min\(4, 7\) = 4 slots per row, got shape \(5, 3\)"):
        assert_topk_close(right, scores, 4)
    assert_topk_close(scores.topk(S, dim=-1).indices, scores, 9)  # k > S: all S keys
    with pytest.raises(TypeError, match=r"indices must be a signed integer tensor .* got torch.float32"):
        assert_topk_close(right.float(), scores)
    with pytest.raises(TypeError, match=r"scores must be a floating-point tensor, got torch.int64"):
        assert_topk_close(right, scores.long())


# ---- block top-k (MiniMax-M3): the keys of the listed blocks -----------------------------------------


def test_block_topk_is_topk_over_the_keys_of_the_listed_blocks():
    """Blocks of 3 keys over S = 11 (the last block holds 2): against a mask built key by key."""
    from attention_ref.sparse import block_topk_attention, block_topk_indices

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for n in (5, 11, 11))
    blocks = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 0], [3, 2]])  # (L, k): block 3 is keys 9, 10
    keep = torch.zeros(5, 11, dtype=torch.bool)
    for i, row in enumerate(blocks.tolist()):
        for b in row:
            if b >= 0:
                keep[i, 3 * b:min(3 * b + 3, 11)] = True
    assert block_topk_indices(blocks, 3, 11)[0].tolist() == [0, 1, 2, 9, 10, -1]
    out = block_topk_attention(q, k, v, blocks, 3, is_causal=False)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, keep))
    assert out[:, :, 2].abs().max() == 0  # a row with no block: output 0, as a fully masked row
    causal = block_topk_attention(q, k, v, blocks, 3, causal_mask(5, 11, alignment="bottom_right"))
    torch.testing.assert_close(causal, scaled_dot_product_attention(
        q, k, v, keep & causal_mask(5, 11, alignment="bottom_right")))


def test_block_topk_names_a_bad_block():
    from attention_ref.sparse import block_topk_indices

    with pytest.raises(ValueError, match=r"block_indices must hold block positions in \[0, n\) = \[0, 4\), "
                       r"or -1 for no block; got 4 at block_indices\[1, 0\]"):
        block_topk_indices(torch.tensor([[0, 1], [4, -1]]), 3, 11)
    with pytest.raises(ValueError, match=r"block_indices must list each block at most once .* block 2 appears"):
        block_topk_indices(torch.tensor([[2, 2]]), 3, 11)
    with pytest.raises(TypeError, match=r"block_indices must be a signed integer tensor"):
        block_topk_indices(torch.tensor([[0.0]]), 3, 11)
    with pytest.raises(ValueError, match=r"block_size"):
        block_topk_indices(torch.tensor([[0]]), 0, 11)
