"""FP8 key/value caches: quantize on append as vLLM does, attend to the dequantized values, count the bytes.

The stored bytes are held bit for bit to `attention_ref.quant.quantize_fp8` (and read back with
`decode_fp8`'s bit rule, not a cast), per tensor and per key/value head, saturation included.
`attention_with_kv_cache` over an FP8 cache, contiguous or paged, with grouped-query heads,
several new queries, a causal mask and ragged lengths, is held in float64 to the oracle
`fp8_attention` on the same quantized inputs and to PyTorch's SDPA on the dequantized keys and
values. `memory_bytes` is held to the tensors and to `complexity.kv_scale_bytes`. The page-11
model generating greedily with FP8 caches is held, token for token, to the same model run
without a cache whose keys and values are quantized and dequantized with the same scales.
Every refusal is checked with its message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_ref import complexity, lm, scaled_dot_product_attention
from attention_ref.kv_cache import KVCache, PagedKVCache, attention_with_kv_cache
from attention_ref.positional import rope
from attention_ref.quant import (
    FORMATS,
    decode_fp8,
    dequantize_fp8,
    fp8_attention,
    quantize_fp8,
    to_torch_float8,
)

B, H, HKV, E, EV = 2, 6, 3, 7, 5  # H = 2 query heads per key/value head
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
DTYPES = {name: getattr(torch, f.torch_dtype) for name, f in FORMATS.items()}


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def _scales(granularity, gen):
    """k and v scales, distinct per head (a head or k/v swap shows) and far from 1."""
    if granularity == "tensor":
        return 0.5, 2.0  # vLLM's k != v pair
    return 0.01 * (1 + torch.rand(HKV, generator=gen, dtype=F64)), 0.02 * (1 + torch.arange(HKV, dtype=F64))


def _tokens(shape, scale, fmt, gen):
    """Random values around the scale's range, with one above ``max * scale`` and a -inf per tensor."""
    x = _randn(*shape, gen=gen) * torch.as_tensor(scale, dtype=F64).reshape(-1, 1, 1) * 100
    x[0, 0, 0, 0] = 3 * FORMATS[fmt].max * float(torch.as_tensor(scale).max())  # saturates to +max
    x[-1, -1, -1, -1] = -float("inf")  # saturates to -max
    return x


def _expected(x, scale, fmt):
    """``quantize_fp8``'s values and their 8-bit patterns."""
    granularity = "tensor" if torch.as_tensor(scale).dim() == 0 else "head"
    q, _ = quantize_fp8(x, fmt, scale, granularity=granularity)
    return q, to_torch_float8(q, fmt).view(torch.uint8)


# --- quantize on append ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_append_stores_quantize_fp8_bit_for_bit_saturating(fmt, granularity):
    gen = torch.Generator().manual_seed(len(fmt) + len(granularity))
    k_scale, v_scale = _scales(granularity, gen)
    k, v = _tokens((B, HKV, 4, E), k_scale, fmt, gen), _tokens((B, HKV, 4, EV), v_scale, fmt, gen)
    cache = KVCache(B, HKV, 11, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
    cache.append(k[:, :, :3], v[:, :, :3])  # a prefill, then one step
    keys, values = cache.append(k[:, :, 3:], v[:, :, 3:])
    pool = PagedKVCache(7, 3, HKV, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
    pool.allocate("a"), pool.allocate("b")
    pool.append(["b", "a"], k.flip(0)[:, :, :2], v.flip(0)[:, :, :2])  # b takes block 0
    pool.append(["a", "b"], k[:, :, 2:], v[:, :, 2:])
    table = pool.block_table(["a", "b"])
    for x, scale, stored, blocks in ((k, k_scale, cache.key_cache, pool.key_blocks),
                                     (v, v_scale, cache.value_cache, pool.value_blocks)):
        q, bits = _expected(x, scale, fmt)
        assert stored.dtype == DTYPES[fmt] and blocks.dtype == DTYPES[fmt]
        assert torch.equal(stored[:, :, :4].view(torch.uint8), bits)
        assert torch.equal(decode_fp8(stored[:, :, :4].view(torch.uint8), fmt), q)  # the format's bit rule
        assert (stored[:, :, 4:].view(torch.uint8) == 0).all(), "nothing past the tokens held"
        assert q[0, 0, 0, 0] == FORMATS[fmt].max and q[-1, -1, -1, -1] == -FORMATS[fmt].max  # saturated
        for b in range(B):
            for p in range(4):  # position p of sequence b: slot p % 3 of its block p // 3
                assert torch.equal(blocks[table[b, p // 3], :, p % 3].view(torch.uint8), bits[b, :, p])
    # kept in float32, as vLLM keeps them and quantize_fp8 uses them; append returns x8 * scale in key's dtype
    assert torch.equal(cache.k_scale, torch.as_tensor(k_scale, dtype=torch.float32))
    assert torch.equal(pool.v_scale, torch.as_tensor(v_scale, dtype=torch.float32))
    assert keys.dtype == F64 and torch.equal(keys, dequantize_fp8(_expected(k, k_scale, fmt)[0], cache.k_scale,
                                                                  granularity))
    assert torch.equal(values, dequantize_fp8(_expected(v, v_scale, fmt)[0], cache.v_scale, granularity))


@pytest.mark.parametrize("fmt, stored, read", [("e4m3fn", [2.5, 448.0, -448.0], [1.25, 224.0, -224.0]),
                                               ("e5m2", [2.5, 2048.0, -57344.0], [1.25, 1024.0, -28672.0])])
def test_a_hand_computed_append(fmt, stored, read):
    # 1.3 / 0.5 = 2.6: the grid steps by 0.25 (e4m3) or 0.5 (e5m2) in [2, 4), so 2.5; 1000 / 0.5 = 2000
    # saturates at 448 in e4m3fn, rounds to 2048 in e5m2 (step 256 in [1024, 2048)); -inf gives -max
    cache = KVCache(1, 1, 2, 3, dtype=DTYPES[fmt], k_scale=0.5, v_scale=1.0)
    keys, _ = cache.append(torch.tensor([1.3, 1000.0, -float("inf")]).reshape(1, 1, 1, 3), torch.zeros(1, 1, 1, 3))
    assert cache.key_cache[0, 0, 0].to(F64).tolist() == stored
    assert keys.dtype == torch.float32 and keys[0, 0, 0].tolist() == read


def test_the_quotient_is_taken_exactly_not_rounded_to_float32_first():
    # (1.1875 + 2^-23) / (1 + 2^-23) lies just below e4m3's midpoint 1.1875 between 1.125 and 1.25:
    # the exact quotient (quantize_fp8's, in float64) rounds down; a float32 division (vLLM's kernel)
    # lands on the midpoint first, which ties to even, 1.25 (quantize_fp8's note)
    scale, key = torch.tensor(1 + 2**-23), torch.tensor(1.1875 + 2**-23).reshape(1, 1, 1, 1)
    assert (key / scale).item() == 1.1875
    cache = KVCache(1, 1, 1, 1, dtype=torch.float8_e4m3fn, k_scale=scale, v_scale=1.0)
    cache.append(key, key)
    assert cache.key_cache.item() == 1.125 and cache.value_cache.item() == 1.25  # the value: 1.1875... / 1


# --- attention over an FP8 cache ------------------------------------------------------------------------


def _oracles(query, q8, q_descale, k8, v8, kd, vd, lengths, Lq, fmt):
    """Per sequence and query row: `fp8_attention` on the quantized inputs, and SDPA on the dequantized ones.

    Query ``i`` of sequence ``b`` sees its first ``lengths[b] - Lq + i + 1`` keys (bottom-right causal),
    so each row is its own call without a mask. ``kd``/``vd`` are the descales as ``()`` or ``(Hkv,)``.
    """
    granularity = {0: "tensor", 1: "head"}
    fa3 = [d if d.dim() == 0 else d.reshape(1, HKV) for d in (kd, vd)]  # fp8_attention takes () or (B, Hkv)
    oracle, dequantized = torch.zeros(B, H, Lq, EV, dtype=F64), torch.zeros(B, H, Lq, EV, dtype=F64)
    for b, n in enumerate(lengths):
        K = dequantize_fp8(k8[b:b + 1], kd, granularity[kd.dim()])  # (1, Hkv, S, E)
        V = dequantize_fp8(v8[b:b + 1], vd, granularity[vd.dim()])
        for i in range(Lq):
            seen = n - Lq + i + 1
            oracle[b, :, i] = fp8_attention(q8[b:b + 1, :, i:i + 1], k8[b:b + 1, :, :seen], v8[b:b + 1, :, :seen],
                                            q_descale, *fa3, fmt=fmt, enable_gqa=True)[0, :, 0]
            dequantized[b, :, i] = F.scaled_dot_product_attention(query[b:b + 1, :, i:i + 1], K[:, :, :seen],
                                                                  V[:, :, :seen], enable_gqa=True)[0, :, 0]
    return oracle, dequantized


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("paged", [False, True])
def test_attention_over_an_fp8_cache_equals_fp8_attention_and_the_dequantized_inputs(fmt, granularity, paged):
    gen = torch.Generator().manual_seed(3 * len(fmt) + len(granularity) + paged)
    lengths, Lq, S = [11, 6], 4, 13  # ragged: sequence 1 holds fewer tokens
    k_scale, v_scale = _scales(granularity, gen)
    k, v = _randn(B, HKV, S, E, gen=gen) * 2, _randn(B, HKV, S, EV, gen=gen) * 3
    q8, q_descale = quantize_fp8(_randn(B, H, Lq, E, gen=gen), fmt)  # the query on the grid, float64
    query = q8 * q_descale.double()  # exactly its dequantized value
    if paged:  # the sequences' blocks interleaved in the pool
        cache = PagedKVCache(10, 3, HKV, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
        cache.allocate(0), cache.allocate(1)
        for start in range(0, S, 5):
            ids = [b for b in (1, 0) if start < lengths[b]]
            end = min(start + 5, max(lengths[b] for b in ids))
            if len(ids) == 2 and end > lengths[1]:
                cache.append([1], k[1:, :, start:lengths[1]], v[1:, :, start:lengths[1]])
                ids = [0]
            cache.append(ids, k[ids][:, :, start:end], v[ids][:, :, start:end])
        key_cache, value_cache = cache.key_blocks, cache.value_blocks
        extra = dict(block_table=cache.block_table([0, 1]))
        assert cache.seqlens([0, 1]).tolist() == lengths
    else:
        cache = KVCache(B, HKV, S, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
        cache.append(k, v)
        key_cache, value_cache, extra = cache.key_cache, cache.value_cache, {}
    seqlens = torch.tensor(lengths)
    out = attention_with_kv_cache(query, key_cache, value_cache, seqlens, is_causal=True,
                                  k_descale=cache.k_scale, v_descale=cache.v_scale, **extra)
    k8, v8 = _expected(k, k_scale, fmt)[0], _expected(v, v_scale, fmt)[0]
    oracle, dequantized = _oracles(query, q8, q_descale, k8, v8, cache.k_scale, cache.v_scale, lengths, Lq, fmt)
    torch.testing.assert_close(out, oracle, **TOL)
    torch.testing.assert_close(out, dequantized, **TOL)
    # the stored bytes are what the oracles quantized: the paged pool's gathered, the contiguous cache's as is
    if not paged:
        assert torch.equal(cache.key_cache.to(F64), k8) and torch.equal(cache.value_cache.to(F64), v8)


def test_a_float32_query_reads_the_cache_in_float32_and_the_model_passes_the_scales():
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(B, HKV, 9, E, value_dim=EV, dtype=torch.float8_e4m3fn, k_scale=0.01, v_scale=0.02)
    k, v = _randn(B, HKV, 9, E, gen=gen).float(), _randn(B, HKV, 9, EV, gen=gen).float()
    keys, values = cache.append(k, v)
    assert keys.dtype == torch.float32 and values.dtype == torch.float32
    q = _randn(B, H, 1, E, gen=gen).float()
    out = attention_with_kv_cache(q, cache.key_cache, cache.value_cache, cache.lengths, is_causal=True,
                                  k_descale=cache.k_scale, v_descale=cache.v_scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, scaled_dot_product_attention(q, keys, values, enable_gqa=True), atol=1e-6, rtol=0)


# --- bytes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_memory_bytes_count_one_byte_per_element_and_the_scales(fmt, granularity):
    k_scale, v_scale = _scales(granularity, torch.Generator().manual_seed(0))
    cache = KVCache(B, HKV, 11, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
    tensors = (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)
    assert cache.memory_bytes == sum(t.numel() * t.element_size() for t in tensors)
    per_token = complexity.kv_bytes_per_token(HKV, E, EV, bytes_per_element=1)
    scales = complexity.kv_scale_bytes(HKV, granularity)
    assert scales == 2 * 4 * (1 if granularity == "tensor" else HKV)
    assert cache.memory_bytes == B * 11 * per_token + scales == B * 11 * HKV * (E + EV) + scales
    assert (cache.memory_bytes - scales) * 4 == KVCache(B, HKV, 11, E, value_dim=EV, dtype=torch.float32).memory_bytes
    pool = PagedKVCache(5, 3, HKV, E, value_dim=EV, dtype=DTYPES[fmt], k_scale=k_scale, v_scale=v_scale)
    assert pool.bytes_per_block == 3 * per_token
    assert pool.memory_bytes == 5 * 3 * per_token + scales
    pool.allocate(0)
    pool.append([0], torch.zeros(1, HKV, 4, E), torch.zeros(1, HKV, 4, EV))
    assert pool.bytes_in_use == 2 * pool.bytes_per_block


# --- generation ------------------------------------------------------------------------------------------------


def _fake_quant(x, scale, fmt):
    granularity = "tensor" if scale.dim() == 0 else "head"
    return dequantize_fp8(quantize_fp8(x, fmt, scale, granularity=granularity)[0], scale, granularity).to(x.dtype)


def _forward(model, ids, fmt=None, scales=None, granularity="tensor"):
    """`lm.Block.forward` without a cache, written out: the logits ``(B, L, V)`` and, without ``scales``,
    each layer's ``(k_scale, v_scale)`` (`quantize_fp8`'s ``amax / max``, of ``granularity``) for ``fmt``;
    with ``scales``, each layer's keys and values quantized and dequantized by them (the oracle)."""
    Bn, L = ids.shape
    positions = torch.arange(L)
    x = model.embed(ids)  # (B, L, d)
    found = []
    for block, scale in zip(model.blocks, scales or [None] * len(model.blocks)):
        heads, d = block.config.heads, x.shape[-1]
        q, k, v = block.qkv(block.norm1(x)).view(Bn, L, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = rope(q, positions), rope(k, positions)  # each (B, H, L, D)
        if scale is None and fmt is not None:
            found.append(tuple(quantize_fp8(t, fmt, granularity=granularity)[1] for t in (k, v)))
        elif scale is not None:
            k, v = _fake_quant(k, scale[0], fmt), _fake_quant(v, scale[1], fmt)
        out, _ = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
        x = x + block.out(out.transpose(1, 2).reshape(Bn, L, d))
        x = x + block.down(F.gelu(block.up(block.norm2(x)), approximate="tanh"))
    return model.norm(x) @ model.embed.weight.T, found


@pytest.fixture(scope="module")
def shipped():
    model, tok, _ = lm.load_char_lm()
    return model, tok


@pytest.mark.parametrize("fmt, granularity", [("e4m3fn", "tensor"), ("e5m2", "tensor"), ("e4m3fn", "head")])
@torch.no_grad()
def test_greedy_generation_with_fp8_caches_equals_the_model_with_quantized_keys_and_values(shipped, fmt, granularity):
    """Scales: ``amax / max`` of each layer's keys and values over the prompt, in the unquantized model's forward."""
    model, tok = shipped
    prompt = tok.encode("OTHELLO.\n")  # page 11's prompt
    logits, scales = _forward(model, prompt[None], fmt, granularity=granularity)
    assert torch.equal(logits, model(prompt[None])), "the written-out forward is the model's"
    c = model.config
    caches = [KVCache(1, c.heads, c.context, c.width // c.heads, dtype=DTYPES[fmt], k_scale=ks, v_scale=vs)
              for ks, vs in scales]
    got = lm.generate(model, prompt, 40, temperature=0, caches=caches)
    ids = prompt[None]
    for _ in range(40):  # the oracle: no cache, everything recomputed, K and V quantized and dequantized
        ids = torch.cat([ids, _forward(model, ids, fmt, scales)[0][:, -1].argmax(dim=-1)[:, None]], dim=1)
    assert torch.equal(got, ids[0]), (tok.decode(got), tok.decode(ids[0]))
    assert caches[0].length == len(prompt) + 39  # the last token is not run


def test_generate_refuses_caches_it_cannot_fill(shipped):
    model, tok = shipped
    prompt = tok.encode("OTHELLO.\n")
    caches = model.new_caches()
    with pytest.raises(ValueError, match=r"^caches: only with use_cache=True$"):
        lm.generate(model, prompt, 2, caches=caches, use_cache=False)
    caches[1].append(torch.zeros(1, 4, 2, 32), torch.zeros(1, 4, 2, 32))
    with pytest.raises(ValueError, match=r"^caches must be empty \(reset them\), got caches holding \[0, 2, 0, 0\] "
                                         r"tokens$"):
        lm.generate(model, prompt, 2, caches=caches)


# --- refusals ---------------------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn
SCALE_SHAPES = r"a number, a 0-dim tensor or a tensor \(Hkv,\) = \(3,\)"


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dtype=E4M3, v_scale=1.0), ValueError,
     r"^k_scale is required with dtype=torch.float8_e4m3fn: a number, a 0-dim tensor or a tensor \(Hkv,\) = \(3,\), "
     r"the descale x ≈ x8 \* k_scale per tensor or per key/value head \(vLLM's k_scale\), got None$"),
    (dict(dtype=E4M3, k_scale=1.0), ValueError, r"^v_scale is required with dtype=torch.float8_e4m3fn: "),
    (dict(dtype=torch.float32, k_scale=0.5), ValueError,
     r"^k_scale is for an FP8 cache \(dtype torch.float8_e4m3fn or torch.float8_e5m2 or torch.float8_e4m3fnuz or "
     r"torch.float8_e5m2fnuz\), got k_scale=0.5 with dtype=torch.float32: leave it None, or pass an FP8 dtype$"),
    (dict(dtype=None, v_scale=torch.tensor(2.0)), ValueError, r"^v_scale is for an FP8 cache .* got "
     r"v_scale=tensor\(2.\) with dtype=torch.float32: leave it None"),
    (dict(dtype=E4M3, k_scale=0.0, v_scale=1.0), ValueError, r"^k_scale must be finite and > 0 everywhere, got 0.0$"),
    (dict(dtype=E4M3, k_scale=1.0, v_scale=torch.tensor([1.0, -2.0, 1.0])), ValueError,
     r"^v_scale must be finite and > 0 everywhere, got \[1.0, -2.0, 1.0\]$"),
    (dict(dtype=E4M3, k_scale=float("inf"), v_scale=1.0), ValueError, r"^k_scale must be finite and > 0 everywhere, "
     r"got inf$"),
    (dict(dtype=E4M3, k_scale=float("nan"), v_scale=1.0), ValueError, r"^k_scale must be finite and > 0 everywhere"),
    (dict(dtype=E4M3, k_scale=torch.ones(2), v_scale=1.0), ValueError,
     rf"^k_scale must be {SCALE_SHAPES}, got shape \(2,\)$"),
    (dict(dtype=E4M3, k_scale=1.0, v_scale=torch.ones(1, 3)), ValueError,
     rf"^v_scale must be {SCALE_SHAPES}, got shape \(1, 3\)$"),
    (dict(dtype=E4M3, k_scale=torch.ones(3, dtype=torch.long), v_scale=1.0), TypeError,
     rf"^k_scale must be {SCALE_SHAPES} of a floating-point dtype, got torch.int64$"),
    (dict(dtype=E4M3, k_scale=True, v_scale=1.0), TypeError, rf"^k_scale must be {SCALE_SHAPES}, got bool True$"),
    (dict(dtype=E4M3, k_scale="0.5", v_scale=1.0), TypeError, rf"^k_scale must be {SCALE_SHAPES}, got str '0.5'$"),
    (dict(dtype=torch.float8_e8m0fnu, k_scale=1.0, v_scale=1.0), TypeError,
     r"^dtype must be a floating-point torch.dtype \(float16, bfloat16, float32, float64\), an FP8 one "
     r"\(torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz\) or None, "
     r"got torch.float8_e8m0fnu$"),
])
def test_both_caches_refuse_bad_scales_with_one_message(kwargs, error, message):
    with pytest.raises(error, match=message) as contiguous:
        KVCache(2, HKV, 4, E, **kwargs)
    with pytest.raises(error) as paged:
        PagedKVCache(4, 2, HKV, E, **kwargs)
    assert str(paged.value) == str(contiguous.value)


def test_an_fp8_cache_takes_float_tokens_of_one_dtype():
    cache = KVCache(2, HKV, 4, E, dtype=E4M3, k_scale=1.0, v_scale=1.0)
    pool = PagedKVCache(4, 2, HKV, E, dtype=E4M3, k_scale=1.0, v_scale=1.0)
    pool.allocate("a"), pool.allocate("b")
    x = torch.ones(2, HKV, 1, E)
    for append in (cache.append, lambda k, v: pool.append(["a", "b"], k, v)):
        with pytest.raises(TypeError, match=r"^key must have a float dtype \(float16, bfloat16, float32, float64\) "
                                            r"for a cache of torch.float8_e4m3fn, which quantizes on append, got "
                                            r"torch.float8_e4m3fn$"):
            append(x.to(E4M3), x)
        with pytest.raises(TypeError, match=r"^value must have the same dtype as key \(torch.float32\), got "
                                            r"torch.float64$"):
            append(x, x.double())
        with pytest.raises(ValueError, match=r"^key must be on the same device as the cache \(cpu\), got meta$"):
            append(x.to("meta"), x)
    assert cache.length == 0 and pool.seqlens(["a", "b"]).tolist() == [0, 0], "nothing written"
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        cache.append(x.to(dtype), x.to(dtype))
    assert cache.length == 3 and (cache.key_cache[:, :, :3].float() == 1).all()


def _fp8_args():
    cache = KVCache(B, HKV, 5, E, value_dim=EV, dtype=E4M3, k_scale=0.5, v_scale=torch.tensor([1.0, 2.0, 3.0]))
    cache.append(torch.ones(B, HKV, 5, E), torch.ones(B, HKV, 5, EV))
    return (torch.ones(B, H, 1, E), cache.key_cache, cache.value_cache, cache.lengths), cache


def test_attention_with_kv_cache_refuses_what_does_not_fit_the_cache():
    args, cache = _fp8_args()
    descales = dict(k_descale=cache.k_scale, v_descale=cache.v_scale)
    assert attention_with_kv_cache(*args, **descales).shape == (B, H, 1, EV)
    with pytest.raises(ValueError, match=r"^k_descale and v_descale are required with an FP8 cache \(key_cache is "
                                         r"torch.float8_e4m3fn\): pass the cache's k_scale and v_scale, a number or "
                                         r"\(Hkv,\) = \(3,\) each$"):
        attention_with_kv_cache(*args)
    with pytest.raises(ValueError, match=r"^v_descale is required with an FP8 cache"):
        attention_with_kv_cache(*args, k_descale=0.5)
    with pytest.raises(ValueError, match=rf"^v_descale must be {SCALE_SHAPES}, got shape \(2,\)$"):
        attention_with_kv_cache(*args, k_descale=0.5, v_descale=torch.ones(2))
    with pytest.raises(ValueError, match=r"^k_descale must be finite and > 0 everywhere, got -0.5$"):
        attention_with_kv_cache(*args, k_descale=-0.5, v_descale=1.0)
    q, k, v, lengths = args
    with pytest.raises(TypeError, match=r"^query must have a float dtype \(float16, bfloat16, float32, float64\) "
                                        r"with an FP8 cache, got torch.float8_e4m3fn: pass the query \(or its "
                                        r"dequantized values\), not FP8 bytes$"):
        attention_with_kv_cache(q.to(E4M3), k, v, lengths, **descales)
    with pytest.raises(TypeError, match=r"^value_cache must have the same dtype as key_cache "
                                        r"\(torch.float8_e4m3fn\), got torch.float8_e5m2$"):
        attention_with_kv_cache(q, k, v.float().to(torch.float8_e5m2), lengths, **descales)
    with pytest.raises(ValueError, match=r"^k_descale is for an FP8 cache, got k_descale=0.5 with a key_cache of "
                                         r"torch.float32: leave it None$"):
        attention_with_kv_cache(q, k.float(), v.float(), lengths, k_descale=0.5)
    with pytest.raises(ValueError, match=r"^v_descale is for an FP8 cache"):
        attention_with_kv_cache(q, k.float(), v.float(), lengths, v_descale=0.5)


def test_kv_scale_bytes_refuses_other_granularities():
    with pytest.raises(ValueError, match=r"^granularity must be 'tensor' or 'head' \(per key/value head\), got "
                                         r"'batch_head'$"):
        complexity.kv_scale_bytes(8, "batch_head")
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int, got 0"):
        complexity.kv_scale_bytes(0)
