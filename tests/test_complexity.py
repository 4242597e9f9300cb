"""The cost formulas against what PyTorch counts and what the modules hold.

FLOPs are compared with ``torch.utils.flop_counter.FlopCounterMode`` running
attention_ref's reference path. FlopCounterMode counts matrix products only
(2 per multiply-add) and counts ``addmm`` (a Linear with bias) as its product,
so biases add no FLOPs in either; softmax and masking are not counted by either.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from attention_ref import (
    MultiHeadAttention,
    attention_weights,
    causal_mask,
    scaled_dot_product_attention,
)
from attention_ref.complexity import (
    attention_flops,
    attention_memory_bytes,
    cached_tokens,
    causal_pairs,
    kv_bytes_per_token,
    kv_cache_bytes,
    latent_kv_bytes_per_token,
    layer_flops,
    linear_state_bytes,
    parameter_count,
    projection_flops,
    sliding_window_pairs,
)
from attention_ref.kv_cache import KVCache
from transformers_api import with_cache  # tests/transformers_api.py


def _count(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


SIZES = [(1, 1, 5, 5, 3, 3), (2, 3, 5, 7, 11, 13), (3, 2, 7, 5, 13, 3), (2, 5, 1, 11, 7, 2)]


@pytest.mark.parametrize("B,H,L,S,E,Ev", SIZES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_flops_equal_flop_counter(B, H, L, S, E, Ev, is_causal, generator):
    q, k, v = torch.randn(B, H, L, E, generator=generator), torch.randn(B, H, S, E, generator=generator), torch.randn(B, H, S, Ev, generator=generator)
    counted = _count(scaled_dot_product_attention, q, k, v, is_causal=is_causal)
    # The reference path computes every (query, key) pair even under a causal mask.
    assert counted == attention_flops(B, H, L, S, E, Ev)
    assert _count(attention_weights, q, k) == attention_flops(B, H, L, S, E, 0)


@pytest.mark.parametrize("L,S", [(5, 5), (5, 7), (7, 5), (1, 3)])
def test_causal_attention_flops_equal_the_kept_pairs_only(L, S, generator):
    # A computation that skips masked pairs: query row i uses keys 0..i only.
    B, H, E, Ev = 2, 3, 11, 13
    q, k, v = torch.randn(B, H, L, E, generator=generator), torch.randn(B, H, S, E, generator=generator), torch.randn(B, H, S, Ev, generator=generator)

    def row_by_row():
        for i in range(L):
            n = min(i + 1, S)
            w = torch.softmax(q[..., i : i + 1, :] @ k[..., :n, :].transpose(-2, -1), dim=-1)  # (B, H, 1, n)
            w @ v[..., :n, :]  # (B, H, 1, n) @ (B, H, n, Ev)

    assert _count(row_by_row) == attention_flops(B, H, L, S, E, Ev, causal=True)


@pytest.mark.parametrize("L,S", [(0, 0), (0, 3), (3, 0), (1, 1), (5, 5), (5, 7), (7, 5), (13, 2)])
def test_causal_pairs_equal_the_causal_mask_sum(L, S):
    assert causal_pairs(L, S) == int(causal_mask(L, S).sum())


@pytest.mark.parametrize(
    "config",
    [
        {"kind": "self", "bias": False},
        {"kind": "self", "bias": True},
        {"kind": "cross", "bias": False, "kdim": 13, "vdim": 11},
        {"kind": "cross", "bias": True, "kdim": 13, "vdim": 11},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_layer_flops_equal_flop_counter(config, generator):
    B, H, L, S, embed = 2, 3, 5, 7, 15
    kdim, vdim = config.get("kdim"), config.get("vdim")
    mha = MultiHeadAttention(embed, H, kdim=kdim, vdim=vdim, bias=config["bias"])
    x = torch.randn(B, L, embed, generator=generator)
    if config["kind"] == "self":
        counted = _count(mha, x)
        assert counted == layer_flops(B, H, L, L, embed)
    else:
        y = torch.randn(B, S, kdim, generator=generator)
        z = torch.randn(B, S, vdim, generator=generator)
        counted = _count(mha, x, y, z)
        assert counted == layer_flops(B, H, L, S, embed, kdim=kdim, vdim=vdim)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
def test_grouped_query_layer_flops(num_kv_heads, generator):
    B, H, L, S, embed, kdim = 2, 6, 5, 7, 30, 13
    mha = MultiHeadAttention(embed, H, num_kv_heads=num_kv_heads, kdim=kdim, vdim=kdim)
    x, y = torch.randn(B, L, embed, generator=generator), torch.randn(B, S, kdim, generator=generator)
    D = embed // H
    expected = projection_flops(B, L, S, embed, kdim, kdim, num_kv_heads * D) + attention_flops(B, H, L, S, D, D)
    assert _count(mha, x, y) == expected


def test_flops_grow_as_n_squared_for_long_sequences():
    short, long_ = layer_flops(1, 4, 1024, 1024, 64), layer_flops(1, 4, 4096, 4096, 64)
    assert attention_flops(1, 4, 2048, 2048, 16, 16) == 4 * attention_flops(1, 4, 1024, 1024, 16, 16)
    assert long_ > 4 * short


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"bias": False},
        {"kdim": 13, "vdim": 11},
        {"kdim": 13, "vdim": 11, "bias": False},
        {"num_kv_heads": 1},
        {"num_kv_heads": 3, "kdim": 7},
    ],
    ids=str,
)
def test_parameter_count_equals_our_module(kwargs):
    mha = MultiHeadAttention(30, 6, **kwargs)
    assert parameter_count(30, num_heads=6, **kwargs) == sum(p.numel() for p in mha.parameters())


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"kdim": 13, "vdim": 11}, {"kdim": 13, "vdim": 11, "bias": False}], ids=str)
def test_parameter_count_equals_torch_module(kwargs):
    module = nn.MultiheadAttention(30, 6, **kwargs)
    assert parameter_count(30, num_heads=6, **kwargs) == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_attention_memory_bytes_equal_the_tensors(dtype, generator):
    B, H, L, S, E, Ev = 2, 3, 5, 7, 11, 13
    q, k, v = (torch.randn(B, H, n, d, generator=generator).to(dtype) for n, d in ((L, E), (S, E), (S, Ev)))
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    size = torch.empty((), dtype=dtype).element_size()
    memory = attention_memory_bytes(B, H, L, S, E, Ev, bytes_per_element=size)
    assert memory["weights"] == w.numel() * w.element_size()
    assert memory["output"] == out.numel() * out.element_size()
    assert memory["inputs"] == sum(t.numel() * t.element_size() for t in (q, k, v))
    assert attention_memory_bytes(B, H, L, S, E, Ev, bytes_per_element=size, materialize_weights=False)["weights"] == 0


@pytest.mark.parametrize("L,window", [(0, 1), (1, 1), (5, 1), (5, 2), (7, 3), (6, 6), (4, 9), (13, 5)])
def test_sliding_window_pairs_equal_the_window_mask_sum(L, window):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    window_mask = (j <= i) & (i - j < window)  # (L, L): the w most recent keys, itself included
    assert sliding_window_pairs(L, window) == int(window_mask.sum())
    if window >= L:
        assert sliding_window_pairs(L, window) == causal_pairs(L, L)


def test_sliding_window_pairs_rejects_a_window_below_one():
    with pytest.raises(ValueError, match="window"):
        sliding_window_pairs(4, 0)


# --- KV-cache bytes ------------------------------------------------------------------------


def _tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 7), (3, 5), (2, 16)])
def test_kv_bytes_per_token_equal_our_kv_cache(num_kv_heads, head_dim, dtype):
    length = 13
    cache = KVCache(batch=1, num_kv_heads=num_kv_heads, max_length=length, head_dim=head_dim, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    assert cache.memory_bytes == length * kv_bytes_per_token(num_kv_heads, head_dim, bytes_per_element=size)


def test_kv_bytes_per_token_counts_keys_and_values_of_different_sizes():
    B, Hkv, T, E, Ev = 1, 3, 11, 7, 5
    k, v = torch.empty(B, Hkv, T, E, dtype=torch.bfloat16), torch.empty(B, Hkv, T, Ev, dtype=torch.bfloat16)
    assert _tensor_bytes(k, v) == T * kv_bytes_per_token(Hkv, E, Ev)
    assert kv_bytes_per_token(8, 128) == 2 * 8 * 128 * 2  # the usual 2 Hkv E bytes in bfloat16


def _transformers_cache_after(config, model_class, tokens: int):
    """The per-layer tensors a tiny transformers model stores in its DynamicCache."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = model_class(config).eval()
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, tokens)), **with_cache(cache), use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_kv_cache_bytes_equal_what_transformers_stores_for_grouped_query_attention():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    tokens = 11
    layers = _transformers_cache_after(config, transformers.LlamaForCausalLM, tokens)
    stored = sum(_tensor_bytes(k, v) for k, v in layers)
    size = layers[0][0].element_size()
    per_token = kv_bytes_per_token(2, 8, bytes_per_element=size)
    assert stored == kv_cache_bytes([(per_token, None)] * 3, tokens)


def test_latent_kv_bytes_equal_what_transformers_stores_for_deepseek_v3():
    transformers = pytest.importorskip("transformers")
    rank, rope = 16, 8
    config = transformers.DeepseekV3Config(
        vocab_size=50, hidden_size=64, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=12, v_head_dim=10,
        n_routed_experts=4, num_experts_per_tok=2)
    tokens = 11
    layers = _transformers_cache_after(config, transformers.DeepseekV3ForCausalLM, tokens)
    size = layers[0][0].element_size()
    per_token = latent_kv_bytes_per_token(rank, rope, bytes_per_element=size)
    # the compressed latent and the shared RoPE key, not 4 heads of (12 + 8) + 10
    assert sum(_tensor_bytes(k, v) for k, v in layers) == kv_cache_bytes([(per_token, None)] * 2, tokens)
    assert per_token < kv_bytes_per_token(4, 12 + 8, 10, bytes_per_element=size)


@pytest.mark.parametrize("context,window", [(0, 3), (1, 3), (3, 3), (11, 3), (11, 1), (5, 13)])
def test_cached_tokens_are_the_keys_the_newest_query_sees(context, window):
    i, j = torch.arange(context)[:, None], torch.arange(context)[None, :]
    window_mask = (j <= i) & (i - j < window)  # (L, L): the w most recent keys, itself included
    seen = int(window_mask[-1].sum()) if context else 0
    assert cached_tokens(context, window) == seen
    assert cached_tokens(context) == context


def test_transformers_sliding_cache_holds_one_token_fewer_between_steps():
    transformers = pytest.importorskip("transformers")
    window, tokens = 5, 11
    config = transformers.MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        sliding_window=window)
    layers = _transformers_cache_after(config, transformers.MistralForCausalLM, tokens)
    # it appends the next token before attending, so that query sees cached_tokens(...) keys
    assert all(k.shape[-2] == cached_tokens(tokens, window) - 1 for k, _ in layers)


def test_kv_cache_bytes_sums_full_and_windowed_layers():
    full, local = kv_bytes_per_token(8, 128), kv_bytes_per_token(8, 128)
    layers = [(local, 1024)] * 5 + [(full, None)]
    assert kv_cache_bytes(layers, 100) == 6 * 100 * full
    assert kv_cache_bytes(layers, 32768) == 5 * 1024 * local + 32768 * full
    assert kv_cache_bytes([], 32768) == 0


def test_kv_cache_bytes_rejects_what_is_not_a_layer():
    with pytest.raises(TypeError, match=r"layers\[1\] must be a \(bytes_per_token, window\) pair"):
        kv_cache_bytes([(4096, None), 4096], 10)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        kv_cache_bytes([(4096, 0)], 10)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int, got 0"):
        kv_bytes_per_token(0, 128)


def test_linear_state_bytes_equal_the_state_tensor_and_do_not_grow_with_length():
    H, dk, dv = 3, 5, 7
    state = torch.zeros(1, H, dk, dv, dtype=torch.float32)  # (B, H, K, V), as transformers' gated delta rule
    k, v = torch.randn(11, H, dk), torch.randn(11, H, dv)
    for t in range(11):  # plain linear attention: S += k v^T at every token, in place
        state[0] += k[t, :, :, None] * v[t, :, None, :]
    assert _tensor_bytes(state) == linear_state_bytes(H, dk, dv, bytes_per_element=4)
