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
    with pytest.raises(TypeError, match=r"indices must be an integer tensor .* got torch.float32"):
        topk_attention(q, k, v, torch.zeros(B, 1, L, K))
    with pytest.raises(TypeError, match=r"indices must be an integer tensor .* got torch.bool"):
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
