"""attention_ref.quant: the FP8 grid bit by bit, scale layouts, SageAttention's INT8 rule, and fp8_attention.

The FP8 tests enumerate all 256 bit patterns of each format and decode them with the module's own
decoder, checked against torch reading the same bytes: every finite value is a fixed point of the
rounding, every midpoint between neighbours rounds to the one with the even pattern, everything
above the largest value clamps to it, NaN stays NaN. The scale tests compute each cell's amax with
a plain loop over (batch, head, token). fp8_attention is held to softmax written out in float64 on
the dequantized inputs, its P emulation to the bound of its docstring and to a row worked by hand.
Sizes: B=2, H=6 (Hkv=3, pairs of query heads share a KV head), L=7, S=5, E=11, Ev=3, blocks of 3.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attention_ref import scaled_dot_product_attention
from attention_ref.quant import (
    FORMATS,
    GRANULARITIES,
    convert_descale,
    decode_fp8,
    dequantize_fp8,
    dequantize_int8_blocks,
    fp8_attention,
    quantize_fp8,
    quantize_int8_blocks,
    round_to_fp8,
    smooth_k,
    to_flash_attn3,
    to_torch_float8,
)

B, H, HKV, L, S, E, EV, BLOCK = 2, 6, 3, 7, 5, 11, 3, 3
G = H // HKV
FMTS = sorted(FORMATS)
ALL_BITS = torch.arange(256)


def _rand(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _grid(fmt):
    """Every finite value of the format with its bit pattern: ``{value: bits}`` over the non-negative ones."""
    values = decode_fp8(ALL_BITS, fmt)
    return {float(v): int(b) for b, v in zip(ALL_BITS, values) if math.isfinite(v) and (v > 0 or b == 0)}


# ---- the FP8 grid ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_the_decoder_reads_bytes_as_torch_does(fmt):
    """Decoding the bytes is well defined everywhere: our decoder and torch's view of the bytes agree on all 256."""
    ours = decode_fp8(ALL_BITS, fmt)
    torchs = ALL_BITS.to(torch.uint8).view(getattr(torch, FORMATS[fmt].torch_dtype)).to(torch.float64)
    assert torch.equal(torch.isnan(ours), torch.isnan(torchs))
    same = ~torch.isnan(ours)
    assert torch.equal(ours[same], torchs[same])
    assert torch.equal(torch.signbit(ours[same]), torch.signbit(torchs[same]))  # -0 where the format has one


@pytest.mark.parametrize("fmt,finite,largest,smallest", [
    ("e4m3fn", 254, 448.0, 2.0**-9), ("e5m2", 248, 57344.0, 2.0**-16),
    ("e4m3fnuz", 255, 240.0, 2.0**-10), ("e5m2fnuz", 255, 57344.0, 2.0**-17),
])
def test_each_format_has_its_published_numbers(fmt, finite, largest, smallest):
    values = decode_fp8(ALL_BITS, fmt)
    assert int(torch.isfinite(values).sum()) == finite
    f = FORMATS[fmt]
    assert values[torch.isfinite(values)].max() == largest == f.max
    assert values[values > 0].min() == smallest == f.min_subnormal


@pytest.mark.parametrize("fmt", FMTS)
def test_every_finite_value_is_its_own_rounding(fmt):
    values = decode_fp8(ALL_BITS, fmt)
    finite = values[torch.isfinite(values)]
    q = round_to_fp8(finite, fmt)
    assert torch.equal(q, finite) and torch.equal(torch.signbit(q), torch.signbit(finite))  # -0 where it exists
    zeros = round_to_fp8(torch.tensor([-0.0, -1e-30]), fmt)
    assert torch.equal(torch.signbit(zeros), torch.tensor([not FORMATS[fmt].fnuz] * 2))  # fnuz's zero has no sign


@pytest.mark.parametrize("fmt", FMTS)
def test_midpoints_round_to_the_even_pattern_and_neighbours_to_the_nearest(fmt):
    grid = _grid(fmt)
    values = sorted(grid)
    lo, hi = torch.tensor(values[:-1], dtype=torch.float64), torch.tensor(values[1:], dtype=torch.float64)
    mid = (lo + hi) / 2  # exact in float64
    even = torch.tensor([a if grid[a] % 2 == 0 else b for a, b in itertools.pairwise(values)], dtype=torch.float64)
    assert torch.equal(round_to_fp8(mid, fmt), even)
    assert torch.equal(round_to_fp8(-mid, fmt), -even if not FORMATS[fmt].fnuz else -even + 0.0)
    below, above = torch.nextafter(mid, lo), torch.nextafter(mid, hi)
    assert torch.equal(round_to_fp8(below, fmt), lo) and torch.equal(round_to_fp8(above, fmt), hi)


@pytest.mark.parametrize("fmt", FMTS)
def test_above_the_largest_value_clamps_and_nan_stays(fmt):
    m = FORMATS[fmt].max
    big = torch.tensor([m * (1 + 2.0**-20), m * 1.0625, m * 1.125, m * 2, 1e30, float("inf")], dtype=torch.float64)
    assert torch.equal(round_to_fp8(big, fmt), torch.full_like(big, m))
    assert torch.equal(round_to_fp8(-big, fmt), torch.full_like(big, -m))
    assert torch.isnan(round_to_fp8(torch.tensor([float("nan")]), fmt)).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_torch_cast_agrees_inside_the_range(fmt):
    """Inside ``[-max, max]`` torch's cast is round-to-nearest-even too: the same values, random and midpoints."""
    m = FORMATS[fmt].max
    grid = sorted(_grid(fmt))
    mids = [(a + b) / 2 for a, b in itertools.pairwise(grid)]
    x = torch.cat([_rand(4000).float() * m / 4, torch.tensor(mids + grid), -torch.tensor(mids)]).clamp(-m, m).float()
    torchs = x.to(getattr(torch, FORMATS[fmt].torch_dtype)).to(torch.float64)
    assert torch.equal(round_to_fp8(x, fmt), torchs)


def test_torch_overflow_is_probed_and_ours_saturates_whatever_it_does():
    """The module docstring's account of torch's overflow (torch 2.13's CPU build): checked on that release only;
    ours saturates on every release."""
    cases = {"e4m3fn": (470.0, 448.0), "e4m3fnuz": (248.0, float("nan")), "e5m2": (70000.0, float("inf"))}
    for fmt, (x, documented) in cases.items():
        assert round_to_fp8(torch.tensor([x]), fmt).item() == FORMATS[fmt].max
        got = torch.tensor([x]).to(getattr(torch, FORMATS[fmt].torch_dtype)).item()
        if torch.__version__.startswith("2.13"):  # the release the docstring describes (CPU casts)
            assert got == documented or (math.isnan(got) and math.isnan(documented)), (fmt, got)


def test_to_torch_float8_casts_on_grid_values_exactly_and_refuses_others():
    x = round_to_fp8(_rand(50, scale=100.0), "e4m3fn")
    assert torch.equal(to_torch_float8(x, "e4m3fn").to(torch.float64), x)
    with pytest.raises(ValueError, match=r"on the e4m3fn grid .* got 0\.3 .* nearest e4m3fn value is 0\.3125"):
        to_torch_float8(torch.tensor([0.25, 0.3], dtype=torch.float64), "e4m3fn")
    with pytest.raises(ValueError, match=r"fmt must be one of \['e4m3fn', 'e4m3fnuz', 'e5m2', 'e5m2fnuz'\], got 'e4m3'"):
        round_to_fp8(x, "e4m3")


# ---- scales ----------------------------------------------------------------------------------------------------


def _cell(granularity, b, h, t):
    """The cell of ``(b, h, t)``: the index into the descale."""
    return {"tensor": (), "head": (h,), "batch_head": (b, h), "batch_kvhead": (b, h // G), "token_head": (b, h, t),
            "block": (b, h, t // BLOCK)}[granularity]


def _plain_amax(x, granularity):
    amax = {}
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            for t in range(x.shape[2]):
                key = _cell(granularity, b, h, t)
                amax[key] = max(amax.get(key, 0.0), float(x[b, h, t].abs().max()))
    return amax


def _half_step(y, fmt):
    """Half the gap between the grid neighbours around ``|y|`` (0 on the grid), read off the sorted grid."""
    grid = torch.tensor(sorted(_grid(fmt)), dtype=torch.float64)
    a = y.abs().clamp(max=grid[-1])
    i = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    return (grid[i] - grid[i - 1]) / 2


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_scales_have_the_layout_shape_amax_over_max_and_the_round_trip_bound(granularity, fmt):
    x = _rand(B, H, L, E, seed=1) * torch.linspace(0.5, 3.0, H, dtype=torch.float64).reshape(1, H, 1, 1)
    x[0, 0, 0] = 0.0
    x[1, 2, 4, 3] = 40.0  # an outlier: one cell's scale, not the others'
    q, s = quantize_fp8(x, fmt, granularity=granularity, block_size=BLOCK, kv_heads=HKV)
    shapes = {"tensor": (), "head": (H,), "batch_head": (B, H), "batch_kvhead": (B, HKV), "token_head": (B, H, L),
              "block": (B, H, -(-L // BLOCK))}
    assert tuple(s.shape) == shapes[granularity] and s.dtype == torch.float32
    m = FORMATS[fmt].max
    for key, amax in _plain_amax(x, granularity).items():  # a cell of zeros (token_head's (0, 0, 0)): scale 1
        assert s[key].item() == (torch.tensor(amax / m, dtype=torch.float32).item() if amax else 1.0), key
    assert torch.equal(round_to_fp8(q, fmt), q) and q.abs().max() == m
    per_element = dequantize_fp8(torch.ones_like(q), s, granularity, block_size=BLOCK)  # the scale of each element
    for b, h, t in [(b, h, t) for b in range(B) for h in range(H) for t in range(L)]:  # read off the right cell
        assert (per_element[b, h, t] == s[_cell(granularity, b, h, t)].item()).all(), (b, h, t)
    y = x / per_element
    err = (x - dequantize_fp8(q, s, granularity, block_size=BLOCK)).abs()
    bound = (_half_step(y, fmt) + (y.abs() - m).clamp(min=0)) * per_element  # half a step, or the clamp's excess
    assert (err <= bound * (1 + 2**-50)).all()


def test_dequantize_reads_batch_kvhead_as_flash_attention_3_does():
    """FA3's test: ``q.float() * repeat(q_descale, "b h -> b 1 (h g) 1")``: query head h takes KV head h // g."""
    q = round_to_fp8(_rand(B, H, L, E, seed=2), "e4m3fn")
    d = torch.arange(1, B * HKV + 1, dtype=torch.float32).reshape(B, HKV)
    want = torch.stack([torch.stack([q[b, h] * d[b, h // G].item() for h in range(H)]) for b in range(B)])
    assert torch.equal(dequantize_fp8(q, d, "batch_kvhead"), want)


def test_quantize_with_a_given_scale_and_its_refusals():
    x = _rand(B, H, L, E, seed=3)
    q, s = quantize_fp8(x, "e4m3fn", torch.full((B, H), 0.25), granularity="batch_head")
    assert torch.equal(q, round_to_fp8(x * 4, "e4m3fn")) and torch.equal(s, torch.full((B, H), 0.25))
    with pytest.raises(ValueError, match=r"'batch_head' descale for a tensor \(2, 6, 7, 11\) must have shape \(2, 6\), got \(6,\)"):
        quantize_fp8(x, "e4m3fn", torch.ones(H), granularity="batch_head")
    with pytest.raises(ValueError, match=r"scale must be finite and > 0 everywhere, got 0\.0"):
        quantize_fp8(x, "e4m3fn", 0.0)
    with pytest.raises(ValueError, match=r"granularity='block' needs block_size, a positive int, got None"):
        quantize_fp8(x, granularity="block")
    with pytest.raises(ValueError, match=r"granularity='batch_kvhead' needs kv_heads, a positive int dividing H=6, got 4"):
        quantize_fp8(x, granularity="batch_kvhead", kv_heads=4)
    with pytest.raises(ValueError, match=r"granularity must be one of .*, got 'channel'"):
        quantize_fp8(x, granularity="channel")
    with pytest.raises(ValueError, match=r"granularity='head' needs a tensor \(B, H, L, E\), got 2 dims"):
        quantize_fp8(x[0, 0], granularity="head")


def test_converters_go_coarse_to_fine_and_refuse_by_name():
    shape = (B, H, L, E)
    assert torch.equal(convert_descale(0.5, "tensor", "batch_kvhead", shape=shape, kv_heads=HKV),
                       torch.full((B, HKV), 0.5))
    per_head = torch.tensor([1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # vLLM's q_scale [num_heads], equal inside each group
    assert torch.equal(to_flash_attn3(per_head, "head", shape=shape, kv_heads=HKV),
                       torch.tensor([[1.0, 2.0, 4.0]] * B))
    tokens = convert_descale(per_head, "head", "token_head", shape=shape)
    assert torch.equal(convert_descale(tokens, "token_head", "head", shape=shape), per_head)  # fine and back
    assert torch.equal(convert_descale(tokens, "token_head", "block", shape=shape, block_size=BLOCK),
                       per_head.reshape(1, H, 1).expand(B, H, 3))
    differs = torch.tensor([1.0, 1.0, 2.0, 3.0, 4.0, 4.0])
    with pytest.raises(ValueError, match=r"as 'batch_kvhead' \(FlashAttention-3's one descale per \(batch, KV head\) "
                                         r"\(B, Hkv\)\): batch 0, KV head 1 \(query heads 2\.\.3\) holds 2\.0 and 3\.0"):
        to_flash_attn3(differs, "head", shape=shape, kv_heads=HKV)
    torchao = torch.ones(B, H)
    torchao[1, 5] = 2.0  # torchao's per-(batch, head) layout
    with pytest.raises(ValueError, match=r"batch 1, KV head 2 \(query heads 4\.\.5\) holds 1\.0 and 2\.0"):
        to_flash_attn3(torchao, "batch_head", shape=shape, kv_heads=HKV)
    per_token = torch.ones(B, H, L)
    per_token[0, 1, 6] = 0.5  # the last, short block (token 6 alone) differs from nothing
    short = convert_descale(per_token, "token_head", "block", shape=shape, block_size=BLOCK)
    assert short[0, 1].tolist() == [1.0, 1.0, 0.5] and short.sum() == B * H * 3 - 0.5
    per_token[0, 1, 4] = 0.5  # block 1 (tokens 3..5) now holds two values
    with pytest.raises(ValueError, match=r"as 'block' .*: batch 0, head 1, block 1 holds 1\.0 and 0\.5"):
        convert_descale(per_token, "token_head", "block", shape=shape, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"as 'tensor' .*: the tensor holds 1\.0 and 0\.5"):
        convert_descale(per_token, "token_head", "tensor", shape=shape)


# ---- INT8 (SageAttention) --------------------------------------------------------------------------------------


def test_int8_rounds_half_away_from_zero_with_scale_amax_over_127():
    x = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5]).reshape(1, 1, 8, 1)
    q, s = quantize_int8_blocks(x, 8)
    assert s.item() == 1.0 and q.dtype == torch.int8
    assert q.flatten().tolist() == [127, 1, -1, 2, -2, 3, -3, 127]  # torch.round would give 0, -0, 2, -2, 2, -2, 126
    x = _rand(B, H, L, E, seed=4)
    x[1, 3, 3:6] = 0.0  # a block of zeros
    q, s = quantize_int8_blocks(x, BLOCK)
    assert s.shape == (B, H, 3)
    for (b, h, n), amax in _plain_amax(x, "block").items():
        assert s[b, h, n].item() == (torch.tensor(amax, dtype=torch.float32) / 127).item()  # float32, as Sage
        cell = q[b, h, n * BLOCK:(n + 1) * BLOCK]
        assert cell.abs().max() == (127 if amax else 0)
    assert s[1, 3, 1] == 0 and (q[1, 3, 3:6] == 0).all()
    err = (dequantize_int8_blocks(q, s, BLOCK) - x.float().double()).abs()
    assert (err <= dequantize_int8_blocks(torch.ones_like(q), s, BLOCK) / 2 * (1 + 2**-20)).all()


def test_smoothing_k_changes_no_attention_output_and_shifts_the_lse():
    q, k, v = _rand(B, H, L, E, seed=5), _rand(B, H, S, E, seed=6) + 20.0, _rand(B, H, S, EV, seed=7)
    ks, km = smooth_k(k)
    assert km.shape == (B, H, 1, E) and torch.allclose(ks.mean(dim=-2), torch.zeros(B, H, E, dtype=torch.float64), atol=1e-12)
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    out_s, lse_s = scaled_dot_product_attention(q, ks, v, return_lse=True)
    assert torch.allclose(out_s, out, rtol=0, atol=1e-12)
    shift = (q @ km.transpose(-2, -1)).squeeze(-1) / math.sqrt(E)  # scale · q · km, (B, H, L)
    assert torch.allclose(lse, lse_s + shift, rtol=0, atol=1e-10)
    # what it is for: with the offset removed, INT8 keys carry the differences the softmax sees
    def score_error(keys):
        qk, sk = quantize_int8_blocks(keys, 64)
        return (q @ (dequantize_int8_blocks(qk, sk, 64) - keys).transpose(-2, -1)).abs().max()
    assert score_error(ks) < score_error(k) / 10


# ---- fp8_attention ---------------------------------------------------------------------------------------------


def _fp8_inputs(fmt="e4m3fn", seed=8, heads=H):
    """Quantized q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) with FA3-layout descales (B, Hkv), non-unit."""
    mags = torch.linspace(1.0, 1.5, heads, dtype=torch.float64).reshape(1, heads, 1, 1)  # per-head magnitudes
    q, qd = quantize_fp8(_rand(B, heads, L, E, seed=seed) * mags, fmt, granularity="batch_kvhead", kv_heads=HKV)
    k, kd = quantize_fp8(_rand(B, HKV, S, E, seed=seed + 1) * 2, fmt, granularity="batch_head")
    v, vd = quantize_fp8(_rand(B, HKV, S, EV, seed=seed + 2) * 3, fmt, granularity="batch_head")
    return q, k, v, qd, kd, vd


def _plain_fp8_attention(q, k, v, qd, kd, vd, causal=False):
    """softmax(scale · (q·qd)(k·kd)ᵀ) (v·vd), written out per query head with its KV head h // g."""
    out = torch.zeros(B, H, L, EV, dtype=torch.float64)
    lse = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // G
            s = (q[b, h] * qd[b, kv].item()) @ (k[b, kv] * kd[b, kv].item()).T / math.sqrt(E)  # (L, S)
            if causal:
                s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
            out[b, h] = torch.softmax(s, dim=-1) @ (v[b, kv] * vd[b, kv].item())
            lse[b, h] = torch.logsumexp(s, dim=-1)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention_without_p_emulation_is_attention_of_the_dequantized_inputs(causal):
    q, k, v, qd, kd, vd = _fp8_inputs()
    out, lse = fp8_attention(q, k, v, qd, kd, vd, is_causal=causal, enable_gqa=True, return_lse=True)
    want, want_lse = _plain_fp8_attention(q, k, v, qd, kd, vd, causal)
    assert torch.allclose(out, want, rtol=0, atol=1e-13) and torch.allclose(lse, want_lse, rtol=0, atol=1e-13)
    f8 = [to_torch_float8(t, "e4m3fn") for t in (q, k, v)]  # torch's float8 tensors: the same bytes, the same answer
    assert torch.equal(fp8_attention(*f8, qd, kd, vd, is_causal=causal, enable_gqa=True), out)
    per_tensor = fp8_attention(q, k, v, 0.5, 2.0, 3.0, enable_gqa=True)  # vLLM/FlashInfer's float scales
    ones = torch.ones(B, HKV)
    assert torch.allclose(per_tensor, _plain_fp8_attention(q, k, v, ones * 0.5, ones * 2, ones * 3)[0], atol=1e-13)


def _bound(q, k, v, qd, kd, vd, p_format, offset_log2, denominator, causal=False):
    """The docstring's bound, from plain float64 weights P (B, H, L, S) and the dequantized V without s_v."""
    out, _ = _plain_fp8_attention(q, k, v, qd, kd, torch.ones_like(vd), causal)  # O / s_v
    f = FORMATS[p_format]
    u, half_sub, c = f.unit_roundoff, f.min_subnormal / 2, 2.0**-offset_log2
    vh = v.repeat_interleave(G, dim=1)  # (B, H, S, Ev)
    s = torch.einsum("bhle,bhse->bhls", q * qd.repeat_interleave(G, 1)[..., None, None].double(),
                     (k * kd[..., None, None].double()).repeat_interleave(G, 1)) / math.sqrt(E)
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B, H, L, S)
    sv = vd.double().repeat_interleave(G, dim=1)[..., None, None]
    if denominator == "unrounded":
        dev = vh.abs()[:, :, None]  # |V_jd|, (B, H, 1, S, Ev)
        ratio = 1.0
    else:
        dev = (vh[:, :, None] - out[:, :, :, None]).abs()  # |V_jd - O_id|, (B, H, L, S, Ev)
        p_hat = p / p.amax(-1, keepdim=True) / c
        ratio = (p_hat.sum(-1) / round_to_fp8(p_hat, p_format).sum(-1))[..., None]  # ℓ / ℓ̃
    main = u * (p[..., None] * dev).sum(-2) * ratio  # (B, H, L, Ev)
    tail = S * half_sub * c * dev.amax(-2)  # n_i <= S keys
    return sv.abs() * (main + tail)


@pytest.mark.parametrize("p_format,offset_log2,causal", [
    ("e4m3fn", 8, False), ("e5m2", 8, False), ("e4m3fn", math.log2(448), False), ("e4m3fn", 8, True)])
@pytest.mark.parametrize("denominator", ["unrounded", "rounded"])
def test_p_emulation_stays_within_the_docstring_bound(p_format, offset_log2, causal, denominator):
    q, k, v, qd, kd, vd = _fp8_inputs(seed=11)
    exact = fp8_attention(q, k, v, qd, kd, vd, enable_gqa=True, is_causal=causal)
    emulated = fp8_attention(q, k, v, qd, kd, vd, enable_gqa=True, p_format=p_format, p_offset_log2=offset_log2,
                             denominator=denominator, is_causal=causal)
    err = (emulated - exact).abs()
    bound = _bound(q, k, v, qd, kd, vd, p_format, offset_log2, denominator, causal)
    assert (err <= bound * (1 + 1e-9) + 1e-14).all()
    assert err.max() > bound.max() / 50  # the rounding happened, and the bound is not vacuous


def test_p_emulation_on_a_row_worked_by_hand():
    """Scores [ln 3, 0] (scale · s_q · s_k = ln 3 / 2 · 2 · 1): P = [3/4, 1/4], P̂ = 256 · [1, 1/3] = [256, 85.33].

    e4m3fn's grid steps by 8 in [64, 128): 85.33 -> 88; e5m2's by 16: -> 80. With v = [0, 1] the output is the
    second weight: exact 1/4; unrounded denominator 88 / (1024/3) = 0.2578125; rounded 88 / 344; e5m2
    80 / (1024/3) = 0.234375; SageAttention's 448: P̂ = [448, 149.33], e4m3fn steps by 16 in [128, 256) -> 144,
    144 / (1792/3); s_v = 2 doubles it. With v = [1, 0] and 2^10 (above 448) the first weight saturates:
    P̃ = [448, 352] over the unrounded 4096/3: 448 · 3 / 4096 = 0.328125 instead of 3/4 (FA issue #2716).
    """
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    v = torch.tensor([0.0, 1.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    kw = {"scale": math.log(3) / 2}

    def run(vv=v, vd=1.0, **more):
        return fp8_attention(q, k, vv, 2.0, 1.0, vd, **kw, **more).item()

    assert run() == pytest.approx(0.25, abs=1e-15)
    assert run(p_format="e4m3fn") == 0.2578125
    assert run(p_format="e4m3fn", vd=2.0) == 0.515625
    assert run(p_format="e4m3fn", denominator="rounded") == pytest.approx(88 / 344, abs=1e-15)
    assert run(p_format="e5m2") == 0.234375
    assert run(p_format="e4m3fn", p_offset_log2=math.log2(448)) == pytest.approx(144 * 3 / 1792, abs=1e-15)
    assert run(vv=v.flip(2), p_format="e4m3fn", p_offset_log2=10) == 0.328125
    _, lse = fp8_attention(q, k, v, 2.0, 1.0, 1.0, **kw, p_format="e4m3fn", return_lse=True)
    assert lse.item() == pytest.approx(math.log(4), abs=1e-15)  # ln 3 + log(1 + 1/3): FA's, the unrounded sum's
    _, lse = fp8_attention(q, k, v, 2.0, 1.0, 1.0, **kw, p_format="e4m3fn", denominator="rounded", return_lse=True)
    assert lse.item() == pytest.approx(math.log(3) + math.log(344 / 256), abs=1e-15)


def test_fp8_attention_refuses_what_it_cannot_read():
    q, k, v, qd, kd, vd = _fp8_inputs()
    with pytest.raises(ValueError, match=r"q must hold values on the e4m3fn grid \(quantize_fp8's output\), got"):
        fp8_attention(q + 0.01, k, v, qd, kd, vd, enable_gqa=True)
    with pytest.raises(TypeError, match=r"q is torch.float8_e4m3fn but fmt='e5m2': pass fmt='e4m3fn'"):
        fp8_attention(*(to_torch_float8(t) for t in (q, k, v)), qd, kd, vd, fmt="e5m2", enable_gqa=True)
    with pytest.raises(ValueError, match=r"q_descale must be a number or a tensor \(2, 3\) \(B, Hkv\), got shape \(2, 6\)"):
        fp8_attention(q, k, v, torch.ones(B, H), kd, vd, enable_gqa=True)
    with pytest.raises(ValueError, match=r"v_descale must be finite and > 0"):
        fp8_attention(q, k, v, qd, kd, -vd, enable_gqa=True)
    with pytest.raises(ValueError, match=r"q has H=6 heads and k Hkv=3: pass enable_gqa=True"):
        fp8_attention(q, k, v, qd, kd, vd)
    with pytest.raises(ValueError, match=r"denominator must be 'unrounded' or 'rounded', got 'fp32'"):
        fp8_attention(q, k, v, qd, kd, vd, enable_gqa=True, p_format="e4m3fn", denominator="fp32")
    with pytest.raises(ValueError, match=r"p_format must be one of .*, got 'fp8'"):
        fp8_attention(q, k, v, qd, kd, vd, enable_gqa=True, p_format="fp8")


def test_per_channel_v_descale_scales_each_output_column():
    q, k, v, qd, kd, vd = _fp8_inputs()
    per_channel = vd[..., None] * torch.tensor([1.0, 2.0, 0.5])  # (B, Hkv, Ev): SageAttention's V
    out = fp8_attention(q, k, v, qd, kd, per_channel, enable_gqa=True, p_format="e4m3fn")
    base = fp8_attention(q, k, v, qd, kd, vd, enable_gqa=True, p_format="e4m3fn")
    assert torch.allclose(out, base * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("p_format", [None, "e4m3fn"])
def test_no_key_gives_zero_and_an_lse_of_minus_infinity(p_format):
    q = torch.ones(B, H, L, E, dtype=torch.float64)
    k, v = torch.ones(B, HKV, 0, E, dtype=torch.float64), torch.ones(B, HKV, 0, EV, dtype=torch.float64)
    out, lse = fp8_attention(q, k, v, enable_gqa=True, p_format=p_format, return_lse=True)
    assert out.shape == (B, H, L, EV) and (out == 0).all() and (lse == float("-inf")).all()
