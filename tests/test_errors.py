"""Bad input: every case raises ValueError or TypeError naming the argument, the expected and the actual value.

``_msg("a", "b")`` builds a regex that needs the literal pieces in that order.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from attention_ref import (
    MultiHeadAttention,
    attention_weights,
    causal_mask,
    combine_masks,
    from_key_padding_mask,
    padding_mask,
    padding_mask_from_tokens,
    scaled_dot_product_attention,
    to_additive,
)
from attention_ref import complexity, mods

L, S, E, EV = 5, 7, 11, 13


def _msg(*parts: str) -> str:
    return ".*".join(re.escape(p) for p in parts)


def _qkv(dtype=torch.float32):
    return torch.zeros(L, E, dtype=dtype), torch.zeros(S, E, dtype=dtype), torch.zeros(S, EV, dtype=dtype)


# --- shapes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which,bad,layout",
    [("query", (E,), "(..., L, E)"), ("key", (E,), "(..., S, E)"), ("value", (EV,), "(..., S, Ev)"), ("query", (), "(..., L, E)")],
)
def test_fewer_than_two_dims(which, bad, layout):
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v}
    args[which] = torch.zeros(bad)
    with pytest.raises(ValueError, match=_msg(which, "at least 2 dims", layout, f"got {len(bad)} dims", str(tuple(bad)))):
        scaled_dot_product_attention(**args)


def test_query_and_key_with_different_E():
    q, _, v = _qkv()
    with pytest.raises(ValueError, match=_msg("query and key", "last dim E", "(5, 11)", "E=11", "(7, 3)", "E=3")):
        scaled_dot_product_attention(q, torch.zeros(S, 3), v)
    with pytest.raises(ValueError, match=_msg("E=11", "E=3")):
        attention_weights(q, torch.zeros(S, 3))


def test_key_and_value_with_different_S():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=_msg("key and value", "length S", "(7, 11)", "S=7", "(3, 13)", "S=3")):
        scaled_dot_product_attention(q, k, torch.zeros(3, EV))


def test_leading_dims_not_broadcastable():
    with pytest.raises(ValueError, match=_msg("leading (batch) dims", "broadcast", "query (2,)", "key (3,)", "value (3,)")):
        scaled_dot_product_attention(torch.zeros(2, L, E), torch.zeros(3, S, E), torch.zeros(3, S, EV))
    with pytest.raises(ValueError, match=_msg("query (2, 3)", "key (3, 2)")):
        attention_weights(torch.zeros(2, 3, L, E), torch.zeros(3, 2, S, E))


@pytest.mark.parametrize("shape", [(L, S + 1), (L + 1, S), (3, L, S), (3, 1, S), (1, 2, L, S)])
def test_mask_not_broadcastable(shape):
    q, k, v = torch.zeros(2, L, E), torch.zeros(2, S, E), torch.zeros(2, S, EV)
    for mask in (torch.ones(shape, dtype=torch.bool), torch.zeros(shape)):
        with pytest.raises(ValueError, match=_msg("attn_mask", "broadcastable to (..., L, S) = (2, 5, 7)", f"got shape {shape}")):
            scaled_dot_product_attention(q, k, v, mask)
        with pytest.raises(ValueError, match=_msg("attn_mask", "(2, 5, 7)", str(shape))):
            attention_weights(q, k, mask)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_mask(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=_msg("attn_mask", "bool", "floating point", f"got {dtype}")):
        scaled_dot_product_attention(q, k, v, torch.ones(L, S, dtype=dtype))


def test_gqa_heads_not_a_multiple():
    q, k, v = torch.zeros(6, L, E), torch.zeros(4, S, E), torch.zeros(4, S, EV)
    with pytest.raises(ValueError, match=_msg("enable_gqa=True", "query heads (6)", "multiple", "key heads = 4")):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=_msg("enable_gqa=True", "same number of heads", "key (4, 7, 11)", "value (3, 7, 13)")):
        scaled_dot_product_attention(q, k, torch.zeros(3, S, EV), enable_gqa=True)
    with pytest.raises(ValueError, match=_msg("enable_gqa=True", "heads dim", "query (5, 11)")):
        attention_weights(torch.zeros(L, E), torch.zeros(S, E), enable_gqa=True)


# --- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_bad_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=_msg("scale", "positive finite", f"got {scale}")):
        scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=_msg("scale", f"got {scale}")):
        attention_weights(q, k, scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5)])
def test_scale_of_wrong_type(scale):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=_msg("scale", "positive finite float or None", f"got {type(scale).__name__}")):
        scaled_dot_product_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_outside_unit_interval(p):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=_msg("dropout_p", "[0, 1)", f"got {p}")):
        scaled_dot_product_attention(q, k, v, dropout_p=p)
    with pytest.raises(ValueError, match=_msg("dropout", "[0, 1)", f"got {p}")):
        MultiHeadAttention(15, 3, dropout=p)


@pytest.mark.parametrize("name", ["is_causal", "enable_gqa", "return_weights"])
def test_flags_must_be_bool(name):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=_msg(name, "must be a bool", "got int")):
        scaled_dot_product_attention(q, k, v, **{name: 1})


# --- dtypes and devices ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["key", "value"])
def test_different_float_dtypes(which):
    q, k, v = _qkv(torch.float32)
    args = {"query": q, "key": k, "value": v}
    args[which] = args[which].double()
    with pytest.raises(TypeError, match=_msg(which, "same dtype as query (torch.float32)", "got torch.float64")):
        scaled_dot_product_attention(**args)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_float_tensors(which, dtype):
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v}
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=_msg(which, "floating-point dtype", f"got {dtype}")):
        scaled_dot_product_attention(**args)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_not_a_tensor(which):
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v}
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=_msg(which, "must be a torch.Tensor", "got list")):
        scaled_dot_product_attention(**args)
    with pytest.raises(TypeError, match=_msg("value", "torch.Tensor", "got NoneType")):
        scaled_dot_product_attention(q, k, None)


@pytest.mark.parametrize("which", ["key", "value", "attn_mask"])
def test_different_devices(which):
    # 'meta' is a second device even on a CPU-only machine. Our check must fire first:
    # torch itself would fail later with its own, differently worded error.
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v, "attn_mask": torch.ones(L, S, dtype=torch.bool)}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=_msg(which, "same device as query (cpu)", "got meta")):
        scaled_dot_product_attention(**args)


def test_device_mismatch_on_query_side():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=_msg("key", "same device as query (meta)", "got cpu")):
        attention_weights(q.to("meta"), k)


# --- masks module ------------------------------------------------------------------------------


def test_bad_causal_mask_alignment_and_lengths():
    with pytest.raises(ValueError, match=_msg("alignment", "('top_left', 'bottom_right')", "got 'left'")):
        causal_mask(3, 5, alignment="left")
    with pytest.raises(ValueError, match=_msg("L", "non-negative", "got -1")):
        causal_mask(-1)
    with pytest.raises(ValueError, match=_msg("S", "non-negative", "got -2")):
        causal_mask(3, -2)
    with pytest.raises(TypeError, match=_msg("L", "int", "got float")):
        causal_mask(3.0)


def test_bad_padding_mask_lengths():
    with pytest.raises(ValueError, match=_msg("lengths", "[0, S] = [0, 5]", "from 2 to 6")):
        padding_mask(torch.tensor([2, 6]), 5)
    with pytest.raises(ValueError, match=_msg("lengths", "[0, S] = [0, 5]", "from -1 to 3")):
        padding_mask(torch.tensor([-1, 3]), 5)
    with pytest.raises(ValueError, match=_msg("lengths must have shape (B,)", "got shape (2, 1)")):
        padding_mask(torch.tensor([[2], [3]]), 5)
    with pytest.raises(TypeError, match=_msg("lengths", "integer tensor", "torch.float32")):
        padding_mask(torch.tensor([2.0]), 5)
    with pytest.raises(TypeError, match=_msg("lengths", "torch.Tensor", "list")):
        padding_mask([2, 3], 5)
    with pytest.raises(ValueError, match=_msg("S", "non-negative", "got -5")):
        padding_mask(torch.tensor([2]), -5)


def test_bad_padding_mask_from_tokens():
    with pytest.raises(ValueError, match=_msg("tokens must have shape (B, S)", "got shape (5,)")):
        padding_mask_from_tokens(torch.tensor([1, 2, 0, 0, 0]), 0)
    with pytest.raises(TypeError, match=_msg("pad_id", "int", "got float")):
        padding_mask_from_tokens(torch.tensor([[1, 0]]), 0.0)


def test_bad_to_additive_combine_and_key_padding_mask():
    with pytest.raises(TypeError, match=_msg("mask", "bool", "floating point", "torch.int64")):
        to_additive(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=_msg("dtype", "floating-point", "torch.int32")):
        to_additive(torch.ones(3, dtype=torch.bool), torch.int32)
    with pytest.raises(TypeError, match=_msg("masks[1]", "bool", "torch.int64")):
        combine_masks(causal_mask(3), torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=_msg("masks must broadcast", "(3, 3)", "(3, 5)")):
        combine_masks(causal_mask(3), causal_mask(3, 5))
    with pytest.raises(ValueError, match=_msg("key_padding_mask", "2-D (B, S)", "(2, 1, 7)")):
        from_key_padding_mask(torch.zeros(2, 1, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match=_msg("key_padding_mask", "bool", "floating point", "torch.int64")):
        from_key_padding_mask(torch.zeros(2, 7, dtype=torch.int64))


# --- MultiHeadAttention --------------------------------------------------------------------------


def test_embed_dim_not_divisible_by_num_heads():
    with pytest.raises(ValueError, match=_msg("embed_dim must be divisible by num_heads", "embed_dim=15", "num_heads=4")):
        MultiHeadAttention(15, 4)


def test_num_heads_not_divisible_by_num_kv_heads():
    with pytest.raises(ValueError, match=_msg("num_heads must be divisible by num_kv_heads", "num_heads=6", "num_kv_heads=4")):
        MultiHeadAttention(30, 6, num_kv_heads=4)


@pytest.mark.parametrize("name,value", [("embed_dim", 0), ("num_heads", -3), ("kdim", 0), ("vdim", -1), ("num_kv_heads", 0)])
def test_non_positive_sizes(name, value):
    args = {"embed_dim": 15, "num_heads": 3, name: value}
    with pytest.raises(ValueError, match=_msg(name, "positive int", f"got {value}")):
        MultiHeadAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_multihead_inputs_of_the_wrong_width():
    mha = MultiHeadAttention(15, 3, kdim=13, vdim=11)
    x, y, z = torch.zeros(2, L, 15), torch.zeros(2, S, 13), torch.zeros(2, S, 11)
    with pytest.raises(ValueError, match=_msg("query", "(B, seq, 15)", "got (2, 5, 13)")):
        mha(torch.zeros(2, L, 13), y, z)
    with pytest.raises(ValueError, match=_msg("key", "(B, seq, 13)", "got (2, 7, 15)")):
        mha(x, torch.zeros(2, S, 15), z)
    with pytest.raises(ValueError, match=_msg("value", "(B, seq, 11)", "got (2, 7, 13)")):
        mha(x, y, torch.zeros(2, S, 13))
    with pytest.raises(ValueError, match=_msg("key", "(B, seq, 13)", "got (2, 5, 15)")):
        mha(x)  # self-attention needs kdim == embed_dim
    with pytest.raises(ValueError, match=_msg("query", "(B, seq, 15)", "got (5, 15)")):
        mha(torch.zeros(L, 15), y, z)  # unbatched input is not supported: batch first, 3-D
    with pytest.raises(TypeError, match=_msg("query", "torch.Tensor", "got list")):
        mha([[0.0] * 15], y, z)


def test_multihead_batch_and_length_mismatch():
    mha = MultiHeadAttention(15, 3)
    x = torch.zeros(2, L, 15)
    with pytest.raises(ValueError, match=_msg("must share B", "query (2, 5, 15)", "key (3, 7, 15)")):
        mha(x, torch.zeros(3, S, 15), torch.zeros(3, S, 15))
    with pytest.raises(ValueError, match=_msg("key (2, 7, 15)", "value (2, 5, 15)")):
        mha(x, torch.zeros(2, S, 15), torch.zeros(2, L, 15))
    with pytest.raises(ValueError, match=_msg("attn_mask", "(2, 3, 5, 5)", "got shape (5, 7)")):
        mha(x, attn_mask=causal_mask(L, S))


def test_multihead_dtype_and_device_mismatch():
    mha = MultiHeadAttention(15, 3)
    x = torch.zeros(2, L, 15)
    with pytest.raises(TypeError, match=_msg("query", "module's dtype (torch.float32)", "got torch.float64")):
        mha(x.double())
    with pytest.raises(TypeError, match=_msg("value", "module's dtype (torch.float32)", "got torch.float16")):
        mha(x, x, x.half())
    with pytest.raises(ValueError, match=_msg("key", "module's device (cpu)", "got meta")):
        mha(x, x.to("meta"), x)


def test_from_torch_rejects_what_it_cannot_copy():
    with pytest.raises(TypeError, match=_msg("module", "torch.nn.MultiheadAttention", "got Linear")):
        MultiHeadAttention.from_torch(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=_msg("add_bias_kv=True")):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(15, 3, add_bias_kv=True))
    with pytest.raises(ValueError, match=_msg("add_zero_attn=True")):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(15, 3, add_zero_attn=True))


# --- complexity --------------------------------------------------------------------------------


def test_complexity_rejects_negative_sizes():
    with pytest.raises(ValueError, match=_msg("L", "non-negative", "got -1")):
        complexity.attention_flops(1, 1, -1, 3, 4, 4)
    with pytest.raises(ValueError, match=_msg("embed_dim must be divisible by H", "embed_dim=15", "H=4")):
        complexity.layer_flops(1, 4, 3, 3, 15)
    with pytest.raises(TypeError, match=_msg("L", "int", "got float")):
        complexity.causal_pairs(2.0, 3)
    with pytest.raises(ValueError, match=_msg("embed_dim=15", "num_heads=4", "num_kv_heads=4")):
        complexity.parameter_count(15, num_heads=4)
    with pytest.raises(ValueError, match=_msg("embed_dim=30", "num_heads=6", "num_kv_heads=4")):
        complexity.parameter_count(30, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=_msg("kdim", "positive int", "got 0")):
        complexity.parameter_count(30, kdim=0)


# Issue 39: opaque or false errors on valid or nearly valid input.
def test_head_size_zero_computes_as_torch_does():
    q, k, v = torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for backend in ("math", "tiled", "sdpa"):
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, backend=backend), expected)


def test_numpy_bool_is_named_as_such():
    import numpy as np

    q = torch.randn(1, 3, 4)
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got numpy\.bool_? \(pass bool\(is_causal\)\)"):
        scaled_dot_product_attention(q, q, q, is_causal=np.bool_(True))


def test_a_scale_that_overflows_the_compute_dtype_is_refused():
    q = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match=r"scale: 1e\+40 is infinite in torch.float32"):
        scaled_dot_product_attention(q, q, q, scale=1e40)
    scaled_dot_product_attention(q.double(), q.double(), q.double(), scale=1e40)  # finite in float64


def test_paged_cache_names_an_unhashable_sequence_id():
    from attention_ref.kv_cache import PagedKVCache

    with pytest.raises(TypeError, match=r"sequence_id must be hashable \(an int, a str, a tuple\), got list \['a'\]"):
        PagedKVCache(4, 2, 1, 8).allocate(["a"])


# Issue 39: nothing refused a dense (L, S) allocation before making it (60000 tokens: 29 GB, the
# process killed). The limit is half the machine's memory, or ATTENTION_REF_MAX_DENSE_BYTES.
def test_dense_scores_past_the_limit_are_refused_before_allocating(monkeypatch):
    from attention_ref import attention_weights
    from attention_ref.tiled import tiled_attention

    monkeypatch.setenv("ATTENTION_REF_MAX_DENSE_BYTES", str(2**20))  # 1 MiB
    q = torch.randn(2, 2, 300, 8)  # 2 * 2 * 300 * 300 float32 scores, 3 copies: 4.1 MiB
    message = (r"attention: the \(\.\.\., L, S\) scores \(2, 2, 300, 300\) in torch.float32 would take "
               r"4\.1 MiB \(3 copies at the peak\), above the limit of 1\.0 MiB .* backend='tiled'")
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match=message):
        attention_weights(q, q)
    with pytest.raises(ValueError, match=r"scores \(2, 2, 300, 300\) in torch.float32 would take"):
        MultiHeadAttention(16, 2)(torch.randn(2, 300, 16))
    assert tiled_attention(q, q, q).shape == (2, 2, 300, 8)  # forms no (L, S)
    monkeypatch.setenv("ATTENTION_REF_MAX_DENSE_BYTES", str(2**30))
    assert scaled_dot_product_attention(q, q, q).shape == (2, 2, 300, 8)
    monkeypatch.setenv("ATTENTION_REF_MAX_DENSE_BYTES", "lots")
    with pytest.raises(ValueError, match=r"ATTENTION_REF_MAX_DENSE_BYTES must be a number of bytes, got 'lots'"):
        scaled_dot_product_attention(q, q, q)


# Issue 39: an empty batch is valid input.
def test_empty_batches_compute():
    from attention_ref import linear
    from attention_ref.tiled import tiled_attention

    q0 = torch.randn(0, 2, 5, 8)
    assert tiled_attention(q0, q0, q0, is_causal=True).shape == (0, 2, 5, 8)
    x0, g0, b0 = torch.randn(0, 5, 2, 8), -torch.rand(0, 5, 2), torch.rand(0, 5, 2)
    for mode in ("recurrent", "chunked"):
        out, state = linear.gated_delta_rule(x0, x0, x0, g0, b0, mode=mode, output_final_state=True)
        assert out.shape == (0, 5, 2, 8) and state.shape == (0, 2, 8, 8)
    out, state = linear.linear_attention(x0, x0, x0, output_final_state=True)
    assert out.shape == (0, 5, 2, 8) and state.shape == (0, 2, 8, 8)


def test_multihead_refuses_an_integer_dtype_by_name():
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype .*, got torch.int64"):
        MultiHeadAttention(8, 2, dtype=torch.int64)


def test_unsigned_topk_indices_are_named_and_one_conformance_id_is_one_id():
    from attention_ref import conformance, sparse

    q = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match=r"indices must be a signed integer tensor .* got torch.uint8"):
        sparse.topk_attention(q, q, q, torch.zeros(1, 4, 2, dtype=torch.uint8))
    adapter = "attention_ref.conformance.shipped:torch_sdpa_math"
    one = conformance.run(adapter, select="causal-float32-fwd-small")  # one id, not its characters
    assert [r.id for r in one.results] == ["causal-float32-fwd-small"]
    with pytest.raises(ValueError, match=r"no quick case has the ids \['nope'\]"):
        conformance.run(adapter, select="nope")


# Issue 39: q = k = 1e20 (finite) overflowed float32 scores and gave NaN on math and tiled.
def test_scores_that_overflow_from_finite_inputs_are_refused():
    from attention_ref.tiled import tiled_attention

    q = torch.full((1, 3, 4), 1e20)
    with pytest.raises(ValueError, match=r"query, key: the scores q \. k \* scale overflow torch.float32"):
        scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match=r"query, key: scores q \. k \* scale could overflow torch.float32"):
        tiled_attention(q, q, q)
    out = scaled_dot_product_attention(q.double(), q.double(), q.double())  # float64 holds 4e40
    assert torch.isfinite(out).all()
    inf = q.clone()
    inf[0, 0, 0] = float("inf")  # inf in the input propagates, as torch's does
    assert torch.isnan(scaled_dot_product_attention(inf, inf, inf)).any()



def test_masks_caches_and_quadratic_forms_are_estimated_before_allocating(monkeypatch):
    from attention_ref import linear, mods
    from attention_ref.kv_cache import KVCache

    monkeypatch.setenv("ATTENTION_REF_MAX_DENSE_BYTES", str(2**16))  # 64 KiB
    with pytest.raises(ValueError, match=r"create_mask: the \(B, H, L, S\) mask \(2, 2, 200, 200\) in torch.bool "
                                         r"would take 160,000 bytes, above the limit of 65,536 bytes"):
        mods.create_mask(mods.causal(), 2, 2, 200, 200)
    with pytest.raises(ValueError, match=r"KVCache: the keys and values .* PagedKVCache"):
        KVCache(batch=4, num_kv_heads=2, max_length=1000, head_dim=8)
    x = torch.randn(1, 200, 2, 8)
    g = -torch.rand(1, 200, 2)
    with pytest.raises(ValueError, match=r"the quadratic form: .* mode='recurrent' keeps a fixed state"):
        linear.gated_linear_attention(x, x, x, g, mode="quadratic")
    assert linear.gated_linear_attention(x, x, x, g)[0].shape == (1, 200, 2, 8)  # the recurrence: no L x L


# ---- issue 39, the rest: no heads dim, meta tensors, dense masks outside the core, messages ----------------


def test_sinks_on_inputs_without_a_heads_dim_are_the_one_sink_of_every_row():
    from attention_ref import scaled_dot_product_attention as sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (4, 5, 5))
    sink = torch.tensor([0.7], dtype=torch.float64)
    expected = sdpa(q[None], k[None], v[None], sinks=sink)[0]  # the same with a head dim of 1
    for backend in ("math", "tiled"):
        torch.testing.assert_close(sdpa(q, k, v, sinks=sink, backend=backend), expected)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(1,\)"):
        sdpa(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))


def test_meta_tensors_give_shapes_or_say_why_not():
    from attention_ref import scaled_dot_product_attention as sdpa
    from attention_ref.sparse import topk_attention
    from attention_ref.varlen import varlen_attention

    q, k = torch.empty(1, 2, 4, 8, device="meta"), torch.empty(1, 2, 5, 8, device="meta")
    assert sdpa(q, k, k, sinks=torch.empty(2, device="meta")).shape == (1, 2, 4, 8)
    indices = torch.empty(1, 1, 4, 2, dtype=torch.long, device="meta")
    assert topk_attention(q, k, k, indices).shape == (1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"backend='tiled' cannot run on meta tensors: .* backend='math' gives"):
        sdpa(q, k, k, backend="tiled")
    packed = [torch.empty(2, n, 8, device="meta") for n in (4, 5, 5)]
    offsets = [torch.tensor([0, n], dtype=torch.int32, device="meta") for n in (4, 5)]
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on the meta device, which holds no values"):
        varlen_attention(*packed, *offsets)
    from attention_ref import linear

    x, gate = torch.empty(1, 8, 2, 4, device="meta"), torch.empty(1, 8, 2, device="meta")
    for mode in ("recurrent", "chunked"):  # the gates' checks and the choice of form read no values on meta
        assert linear.gated_delta_rule(x, x, x, gate, gate, mode=mode, chunk_size=4)[0].shape == (1, 8, 2, 4)
    assert linear.kimi_delta_attention(x, x, x, x, gate, mode="chunked", chunk_size=4)[0].shape == (1, 8, 2, 4)
    assert linear.gated_linear_attention(x, x, x, gate)[0].shape == (1, 8, 2, 4)


def test_dense_masks_outside_the_core_are_estimated_first(monkeypatch):
    from attention_ref import scaled_dot_product_attention as sdpa
    from attention_ref.sparse import topk_mask

    monkeypatch.setenv("ATTENTION_REF_MAX_DENSE_BYTES", str(2**20))  # 1 MiB
    q = torch.zeros(1, 1, 512, 4)
    with pytest.raises(ValueError, match=r"backend='sdpa' with a mask_mod: the mask_mod's \(L, S\) mask \(512, 512\) "
                       r"in torch.float32 would take 2.0 MiB .* backend='tiled' evaluates the mod block by block"):
        sdpa(q, q, q, mask_mod=mods.causal(), backend="sdpa")
    assert sdpa(q, q, q, mask_mod=mods.causal(), backend="tiled").shape == (1, 1, 512, 4)
    indices = torch.stack([torch.arange(1024), torch.arange(1024).flip(0)], -1)  # (L, k) = (1024, 2)
    with pytest.raises(ValueError, match=r"topk_mask: the \(\.\.\., L, S\) selection mask \(1024, 1025\) in torch.bool"):
        topk_mask(indices, 1024)


def test_messages_name_the_argument():
    from attention_ref import hf

    with pytest.raises(TypeError, match=r"layers must be an iterable of \(bytes_per_token, window\) pairs, one per "
                       r"layer, got int 5"):
        complexity.kv_cache_bytes(5, 10)
    with pytest.raises(ValueError, match=r"device must be a device such as 'cpu', 'cuda' or 'cuda:0', got 'nope'"):
        causal_mask(3, 3, device="nope")
    with pytest.raises(TypeError, match=r"device must be a torch.device or a device string .* got list"):
        causal_mask(3, 3, device=["cpu"])
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"module must be the transformers attention layer \(a torch.nn.Module.*"
                       r"got NoneType"):
        hf.attention_forward(None, q, q, q, None)
