"""assert_fp8_attention_close: right FP8 kernels pass on every seed, planted bugs fail on every seed, the term named.

The right kernels are `fp8_attention`'s emulations of the kernels' P path (FlashAttention-3/4's 2^8 offset
in e4m3fn or e5m2 with the unrounded row sum, SageAttention's offset log2(448), a rounded row sum), and
a SageAttention-style kernel written out here (INT8 Q and K per block after smoothing K, FP8 V per
channel). Each is judged against the float64 attention of the dequantized inputs, with nothing but the
allowance of the kernel's own contract, on 20 seeds. The planted bugs are the FP8 mistakes kernels and
their callers make (a descale applied twice, inverted or left out; the bytes read in another format;
K's and V's scales swapped; a per-head scale on the wrong axis; P saturating; a tail of small weights
flushed to zero); each must fail on every seed, its message naming the term it breaks.

Sizes: B=2, H=6 query heads on Hkv=3 KV heads (pairs share one), L=7 queries, S=129 keys (one past a
tile of 128) or 1, E=11, Ev=5. Keys are 3 times larger than values, so their scales differ (a swap of
the two is visible); with ``per_head`` the heads' descales span 10^3 (FlashInfer's per-head test data,
widened).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_ref import attention_weights
from attention_ref.quant import (
    FORMATS,
    decode_fp8,
    dequantize_int8_blocks,
    fp8_attention,
    quantize_fp8,
    quantize_int8_blocks,
    round_to_fp8,
    smooth_k,
    to_torch_float8,
)
from attention_ref.testing import FP8CheckReport, assert_fp8_attention_close

B, H, HKV, L, S, E, EV = 2, 6, 3, 7, 129, 11, 5
G = H // HKV
SEEDS = range(20)


def _inputs(seed, *, length=L, keys=S, per_head=False, fmt="e4m3fn"):
    """FP8 q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) and FlashAttention-3's descales (B, Hkv)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, E, generator=gen, dtype=torch.float64)
    k = 1.5 * torch.randn(B, HKV, keys, E, generator=gen, dtype=torch.float64)
    v = 0.5 * torch.randn(B, HKV, keys, EV, generator=gen, dtype=torch.float64) + 0.25
    if per_head:
        # KV head h: Q's and V's magnitudes times 10^(1.5 h), K's divided by it (the scores unchanged)
        magnitude = 10.0 ** (1.5 * torch.arange(HKV, dtype=torch.float64)).reshape(HKV, 1, 1)
        q, k, v = q * magnitude.repeat_interleave(G, dim=0), k / magnitude, v * magnitude
    q8, sq = quantize_fp8(q, fmt, granularity="batch_kvhead", kv_heads=HKV)
    k8, sk = quantize_fp8(k, fmt, granularity="batch_head")
    v8, sv = quantize_fp8(v, fmt, granularity="batch_head")
    return q8, k8, v8, sq, sk, sv


def _kernel(q8, k8, v8, sq, sk, sv, **p_path):
    """A right kernel with FlashAttention's GQA: `fp8_attention`'s emulation of the P path."""
    return fp8_attention(q8, k8, v8, sq, sk, sv, enable_gqa=True, **p_path)


def _check(actual, q8, k8, v8, sq, sk, sv, **kw):
    return assert_fp8_attention_close(actual, q8, k8, v8, sq, sk, sv, enable_gqa=True, **kw)


# ---- right kernels pass ----------------------------------------------------------------------------------------

P_PATHS = {
    "flash-attention e4m3fn": {"p_format": "e4m3fn"},
    "flash-attention-4 e5m2": {"p_format": "e5m2"},
    "sage offset log2(448)": {"p_format": "e4m3fn", "p_offset_log2": math.log2(448)},
    "rounded row sum": {"p_format": "e4m3fn", "denominator": "rounded"},
    "rounded row sum e5m2": {"p_format": "e5m2", "denominator": "rounded"},
}
SHAPES = {
    "S=129": {},
    "S=1": {"keys": 1},
    "decode L=1": {"length": 1},
    "causal L=S=129": {"length": S, "causal": True},
    "per-head 10^3": {"per_head": True},
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p_path", P_PATHS)
def test_right_kernels_pass_on_every_seed(p_path, shape):
    kw = dict(SHAPES[shape])
    causal = kw.pop("causal", False)
    worst = 0.0
    for seed in SEEDS:
        inputs = _inputs(seed, **kw)
        kernel = _kernel(*inputs, is_causal=causal, **P_PATHS[p_path])
        report = _check(kernel, *inputs, is_causal=causal, **P_PATHS[p_path])
        worst = max(worst, report.worst_ratio)
    assert worst < 1
    if shape != "S=1":  # one key: its weight 2^c is on the grid, nothing rounds
        assert worst > 0.05  # the P rounding happened and the allowance is not vacuous


def test_a_bfloat16_output_passes_given_or_read_from_its_dtype_and_fa3s_22_bits_change_little():
    for seed in SEEDS:
        inputs = _inputs(seed)
        out = _kernel(*inputs, p_format="e4m3fn").to(torch.bfloat16)
        read = _check(out, *inputs)  # actual's dtype: bfloat16
        given = _check(out.to(torch.float32), *inputs, output_dtype=torch.bfloat16, accumulate_bits=22)
        assert read.worst_ratio < 1 and given.worst_ratio < 1
        # the output term rounds |O| plus the other terms: the larger accumulation term moves it a little
        assert torch.allclose(read.terms["output rounding"], given.terms["output rounding"], rtol=1e-2, atol=0)
        assert (given.terms["accumulation"] > read.terms["accumulation"]).all()  # 2^-22 > 2^-24
        upcast = _check(out.to(torch.float32), *inputs)  # float32 claimed: bfloat16's rounding not allowed
        assert (upcast.terms["output rounding"] < read.terms["output rounding"] / 1000).all()


def test_a_float32_kernel_without_p_rounding_is_held_to_its_sums_and_output():
    """p_format=None: P stays in float32; torch's float32 attention of the dequantized inputs passes, and the
    allowance is float32-sized (a kernel off by 1e-4 fails, breaking the accumulation term)."""
    for seed in range(5):
        q8, k8, v8, sq, sk, sv = _inputs(seed)
        qd, kd = (q8 * sq.double().repeat_interleave(G, 1)[..., None, None]).float(), (k8 * sk[..., None, None]).float()
        vd = (v8 * sv[..., None, None]).float()
        out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)  # float32
        report = _check(out, q8, k8, v8, sq, sk, sv, p_format=None)
        assert report.worst_ratio < 1 and set(report.terms) == {"accumulation", "output rounding"}
        assert report.allowance.max() < 1e-4
        with pytest.raises(AssertionError, match=r"breaks (accumulation|output rounding), the largest term"):
            _check(out + 1e-4, q8, k8, v8, sq, sk, sv, p_format=None)
        # rounded to bfloat16, it passes as bfloat16, and fails claiming float32 (the largest term of that
        # contract, the accumulation, named)
        rounded = out.to(torch.bfloat16)
        assert _check(rounded, q8, k8, v8, sq, sk, sv, p_format=None).worst_ratio < 1
        with pytest.raises(AssertionError, match=r"breaks accumulation, the largest term"):
            _check(rounded.to(torch.float32), q8, k8, v8, sq, sk, sv, p_format=None)


def test_the_row_sum_a_kernel_divides_by_is_told_apart_on_values_with_a_common_offset():
    """Values 10 + noise: a kernel dividing by the rounded row sum renormalizes the rounding of P away from the
    offset (its error follows |V - O|); one dividing by the unrounded sum keeps it (its error follows |V|). Each
    passes its own contract; the unrounded kernel fails the rounded one."""
    for seed in range(5):
        q8, k8, v8, sq, sk, sv = _inputs(seed)
        v8 = round_to_fp8(v8 / 32 + 100)  # 100 +- 14 on the grid (steps of 8): mostly a common offset
        inputs = (q8, k8, v8, sq, sk, sv)
        rounded = _kernel(*inputs, p_format="e4m3fn", denominator="rounded")
        unrounded = _kernel(*inputs, p_format="e4m3fn")
        assert _check(rounded, *inputs, denominator="rounded").worst_ratio < 1
        assert _check(unrounded, *inputs).worst_ratio < 1
        with pytest.raises(AssertionError, match=r"denominator='rounded'"):
            _check(unrounded, *inputs, denominator="rounded")


def test_the_layout_of_flash_attention_gives_the_same_verdict():
    inputs = _inputs(3)
    out = _kernel(*inputs, p_format="e4m3fn")
    q8, k8, v8, sq, sk, sv = inputs
    bhld = _check(out, *inputs)
    blhd = assert_fp8_attention_close(out.transpose(1, 2), q8.transpose(1, 2), k8.transpose(1, 2),
                                      v8.transpose(1, 2), sq, sk, sv, enable_gqa=True, layout="blhd")
    assert torch.equal(blhd.allowance, bhld.allowance.transpose(1, 2)) and blhd.worst_ratio == bhld.worst_ratio
    h, i = bhld.worst_position[1:3]
    assert blhd.worst_position == (bhld.worst_position[0], i, h, bhld.worst_position[3])
    with pytest.raises(AssertionError, match=r"worst element \(\d, \d, \d, \d\)"):
        assert_fp8_attention_close(out.transpose(1, 2) * 2, q8.transpose(1, 2), k8.transpose(1, 2),
                                   v8.transpose(1, 2), sq, sk, sv, enable_gqa=True, layout="blhd")


def test_torch_float8_inputs_are_read_as_their_bytes():
    q8, k8, v8, sq, sk, sv = _inputs(4)
    out = _kernel(q8, k8, v8, sq, sk, sv, p_format="e4m3fn")
    as_torch = _check(out, *(to_torch_float8(t) for t in (q8, k8, v8)), sq, sk, sv)
    assert torch.equal(as_torch.allowance, _check(out, q8, k8, v8, sq, sk, sv).allowance)


def test_the_p_rounding_term_on_a_row_worked_by_hand():
    """Scores [ln 3, 0]: P = [3/4, 1/4], P-hat = [256, 85.33] rounds to [256, 88]; with v = [0, 1] the kernel gives
    88 / (1024/3) = 0.2578125 against 1/4. The second weight moves by at most u P = 1/64 (85.33 is normal in
    e4m3fn: max(u P, min(P, mu / 2l)) = u P), the first carries v = 0: the P-rounding term is 1/64, the
    error 1/128, half of it."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    v = torch.tensor([0.0, 1.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    kernel = fp8_attention(q, k, v, 2.0, 1.0, 1.0, scale=math.log(3) / 2, p_format="e4m3fn")
    report = assert_fp8_attention_close(kernel, q, k, v, 2.0, 1.0, 1.0, scale=math.log(3) / 2)
    assert kernel.item() == 0.2578125 and report.reference.item() == pytest.approx(0.25, abs=1e-15)
    assert report.terms["P rounding"].item() == pytest.approx(1 / 64, rel=1e-5)  # times e^(2 eps): float32 scores
    assert report.worst_ratio == pytest.approx(0.5, rel=1e-4)
    assert str(report).startswith("passed (output; largest error 0.50 of its allowance, at (0, 0, 0, 0), where the "
                                  "largest term is P rounding)")


def _tail_mass(seed):
    """FlashAttention-4's tail-mass test: 1023 keys of probability ~5e-5 each, ~5% together, and one key with the
    rest; v = 1 on the tail, 0 on the big key, so the output is the tail's mass. The seed moves the big key and
    sets the query's size (16 or 18) and the tail keys' (-7 or -7.5): tails of 0.4% to 5%, every tail weight in
    e4m3fn's subnormal range after the offset 2^8."""
    gen = torch.Generator().manual_seed(seed)
    keys, head_dim = 1024, 128
    q = torch.zeros(1, 1, 1, head_dim, dtype=torch.float64)
    q[..., 0] = (16.0, 18.0)[int(torch.randint(0, 2, (1,), generator=gen))]  # on e4m3fn's grid
    k = torch.zeros(1, 1, keys, head_dim, dtype=torch.float64)
    k[..., 0] = (-7.0, -7.5)[int(torch.randint(0, 2, (1,), generator=gen))]
    v = torch.ones(1, 1, keys, 1, dtype=torch.float64)
    big = int(torch.randint(0, keys, (1,), generator=gen))
    k[..., big, 0] = 0.0
    v[..., big, 0] = 0.0
    return q, k, v


@pytest.mark.parametrize("p_format", ["e4m3fn", "e5m2"])
def test_the_tail_mass_survives_a_right_kernel(p_format):
    for seed in SEEDS:
        q, k, v = _tail_mass(seed)
        out = fp8_attention(q, k, v, p_format=p_format)
        report = assert_fp8_attention_close(out, q, k, v, p_format=p_format)
        assert 0.003 < report.reference.item() < 0.06 and report.worst_ratio < 1


def _sage_like_kernel(q, k, v, *, q_block=4, k_block=16, causal=False, round_p=True, round_v=True, v_dims=(-2,)):
    """SageAttention's plan in float64: K smoothed, Q and K in INT8 per block of tokens (scale amax / 127, half away
    from zero), V in e4m3fn per channel, P scaled to (0, 448] and rounded to e4m3fn, the unrounded row sum.
    ``round_p``, ``round_v`` False leave P, V unrounded; ``v_dims=(-2, -1)`` gives V one scale per (batch, head)."""
    ks, _ = smooth_k(k)
    qi, qs = quantize_int8_blocks(q, q_block)
    ki, ks_scale = quantize_int8_blocks(ks, k_block)
    qd, kd = dequantize_int8_blocks(qi, qs, q_block), dequantize_int8_blocks(ki, ks_scale, k_block)
    v_scale = v.abs().amax(dim=v_dims, keepdim=True) / 448  # (B, Hkv, 1, Ev): one per channel (or (B, Hkv, 1, 1))
    v8 = round_to_fp8(v / v_scale) if round_v else v / v_scale
    weights = attention_weights(qd, kd, is_causal=causal, scale=1 / math.sqrt(q.shape[-1]), enable_gqa=True)
    p_hat = weights / weights.amax(-1, keepdim=True) * 448  # (B, H, L, S) in (0, 448]
    p_tilde = round_to_fp8(p_hat) if round_p else p_hat
    values = (v8 * v_scale).repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, Ev)
    return (p_tilde @ values) / p_hat.sum(-1, keepdim=True)  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


@pytest.mark.parametrize("causal", [False, True])
def test_a_kernel_that_quantizes_internally_passes_with_the_softmax_perturbation(causal):
    sage = {"quantizes_internally": True, "fmt": "int8", "v_fmt": "e4m3fn", "p_offset_log2": math.log2(448)}
    worst = 0.0
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64)
        k = 1.5 * torch.randn(B, HKV, S, E, generator=gen, dtype=torch.float64) + 2.0  # an offset to smooth away
        v = 0.5 * torch.randn(B, HKV, S, EV, generator=gen, dtype=torch.float64) + 0.25
        out = _sage_like_kernel(q, k, v, causal=causal).to(torch.bfloat16)
        report = assert_fp8_attention_close(out, q, k, v, enable_gqa=True, is_causal=causal, **sage)
        assert set(report.terms) == {"P rounding", "accumulation", "softmax perturbation", "V rounding",
                                     "output rounding"}
        worst = max(worst, report.worst_ratio)
        # Q and K rounded alone: the softmax perturbation is the term that covers the error
        only_qk = _sage_like_kernel(q, k, v, causal=causal, round_p=False, round_v=False)
        report = assert_fp8_attention_close(only_qk, q, k, v, enable_gqa=True, is_causal=causal,
                                            quantizes_internally=True, fmt="int8", p_format=None)
        error = (only_qk - report.reference).abs()
        assert (error > report.terms["accumulation"] + report.terms["output rounding"]).any()
    assert 0.02 < worst < 1


def test_one_key_shows_the_v_rounding_term_alone():
    """With one key the weights are 1 whatever Q and K are: the output is V rounded to e4m3fn (one scale per batch
    and head), within u |V| + mu amax / (2 max) of V, the V-rounding term, which no other term covers."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64), torch.randn(B, HKV, 1, E, generator=gen,
                                                                                     dtype=torch.float64)
    v = torch.randn(B, HKV, 1, EV, generator=gen, dtype=torch.float64)
    out = _sage_like_kernel(q, k, v, round_p=False, v_dims=(-2, -1))  # (B, H, L, Ev): each query reads the value
    report = assert_fp8_attention_close(out, q, k, v, enable_gqa=True, quantizes_internally=True, fmt="int8",
                                        v_fmt="e4m3fn", p_format=None)
    f = FORMATS["e4m3fn"]
    amax = v.abs().amax(dim=(-2, -1), keepdim=True).repeat_interleave(G, dim=1)  # (B, H, 1, 1)
    expected = (f.unit_roundoff + 2.0**-24) * v.abs().repeat_interleave(G, dim=1) + f.min_subnormal * amax / (2 * f.max)
    grown = report.terms["V rounding"] / expected  # at least 1: times e^{2 eps}, the Q/K rounding's bound
    assert (grown >= 1).all() and (grown < 1.2).all()
    others = sum(t for name, t in report.terms.items() if name != "V rounding")
    assert ((out - report.reference).abs() > others).any()


# ---- planted bugs fail -----------------------------------------------------------------------------------------


def _per_query_head(q8, k8, v8, sq, sk, sv, **p_path):
    """A kernel reading one descale per query head (B, H) for each of Q, K, V: fp8_attention one head at a time."""
    outs = []
    for h in range(H):
        kv = h // G
        outs.append(fp8_attention(q8[:, h:h + 1], k8[:, kv:kv + 1], v8[:, kv:kv + 1], sq[:, h:h + 1],
                                  sk[:, h:h + 1], sv[:, h:h + 1], **p_path))
    return torch.cat(outs, dim=1)  # H x (B, 1, L, Ev) -> (B, H, L, Ev)


def _decoded_as(fmt, q8, k8, v8, sq, sk, sv):
    """e4m3fn bytes read as ``fmt``: the same bits, other values (inf and NaN included), then attention as usual."""
    q, k, v = (decode_fp8(to_torch_float8(t).view(torch.uint8), fmt) for t in (q8, k8, v8))
    return torch.nn.functional.scaled_dot_product_attention(
        q * sq.double().repeat_interleave(G, 1)[..., None, None], k * sk.double()[..., None, None],
        v * sv.double()[..., None, None], enable_gqa=True)  # (B, H, L, Ev)


def _bug(name, seed):
    """(the buggy kernel's output, the inputs the checker is given, the checker's keywords)."""
    fa = {"p_format": "e4m3fn"}
    if name.split()[-1] in ("twice", "inverted", "omitted"):  # "q descale twice" etc.
        which, how = name[0], name.split()[-1]
        inputs = list(_inputs(seed))
        i = "qkv".index(which) + 3
        d = inputs[i].double()
        inputs_kernel = list(inputs)
        inputs_kernel[i] = {"twice": d * d, "inverted": 1 / d, "omitted": torch.ones_like(d)}[how]
        return _kernel(*inputs_kernel, **fa), inputs, {}
    if name.startswith("decoded as"):
        inputs = _inputs(seed)
        return _decoded_as(name.split()[-1], *inputs), inputs, {}
    if name == "k and v scales swapped":
        q8, k8, v8, sq, sk, sv = inputs = _inputs(seed)
        return _kernel(q8, k8, v8, sq, sv, sk, **fa), inputs, {}
    if name == "q descale by repeat, not repeat_interleave":
        q8, k8, v8, sq, sk, sv = inputs = _inputs(seed, per_head=True)
        per_head = [d.repeat(1, G) if d is sq else d.repeat_interleave(G, dim=1) for d in (sq, sk, sv)]  # (B, H)
        return _per_query_head(q8, k8, v8, *per_head, **fa), inputs, {}
    if name == "per-query-head q scales read as per KV head":
        # the caller holds one q scale per query head (B, H), equal within a group, and hands the kernel the first
        # Hkv columns instead of every G-th: KV group g reads query head g's scale, not query head g * G's
        q8, k8, v8, sq, sk, sv = inputs = _inputs(seed, per_head=True)
        per_query_head = sq.repeat_interleave(G, dim=1)  # (B, H)
        return _kernel(q8, k8, v8, per_query_head[:, :HKV], sk, sv, **fa), inputs, {}
    if name == "P saturating, the row sum counting it in full":
        # FlashAttention issue #2716: max_offset 8 + a stale row maximum 4 behind: P up to 2^12 in e4m3fn
        inputs = _inputs(seed, length=S)
        return _kernel(*inputs, is_causal=True, p_format="e4m3fn", p_offset_log2=12), inputs, {"is_causal": True}
    if name in ("tail flushed to zero", "tail flushed by a zero offset"):
        q, k, v = _tail_mass(seed)
        if name == "tail flushed by a zero offset":
            return fp8_attention(q, k, v, p_format="e4m3fn", p_offset_log2=0), (q, k, v, 1.0, 1.0, 1.0), {}
        # the P cast flushes e4m3fn's subnormals (below 2^-6) to zero
        weights = attention_weights(q, k)  # (1, 1, 1, S)
        p_hat = weights / weights.amax(-1, keepdim=True) * 256
        p_tilde = round_to_fp8(p_hat)
        p_tilde = torch.where(p_tilde < FORMATS["e4m3fn"].min_normal, 0.0, p_tilde)
        return (p_tilde @ v) / p_hat.sum(-1, keepdim=True), (q, k, v, 1.0, 1.0, 1.0), {}
    raise AssertionError(name)


BUGS = [f"{t} descale {how}" for t in "qkv" for how in ("twice", "inverted", "omitted")] + [
    "decoded as e5m2", "decoded as e4m3fnuz", "k and v scales swapped", "q descale by repeat, not repeat_interleave",
    "per-query-head q scales read as per KV head", "P saturating, the row sum counting it in full",
    "tail flushed to zero", "tail flushed by a zero offset",
]


@pytest.mark.parametrize("bug", BUGS)
def test_each_planted_bug_fails_on_every_seed_naming_the_term_it_breaks(bug):
    for seed in SEEDS:
        actual, inputs, kw = _bug(bug, seed)
        gqa = inputs[0].shape[1] != inputs[1].shape[1]
        with pytest.raises(AssertionError) as failure:
            assert_fp8_attention_close(actual, *inputs, enable_gqa=gqa, p_format="e4m3fn", **kw)
        message = str(failure.value)
        assert message.startswith("assert_fp8_attention_close: ")
        assert "breaks P rounding, the largest term, by " in message
        assert "allowance: 1 * (P rounding " in message and "+ accumulation " in message


def test_the_failure_message_gives_the_numbers():
    inputs = _inputs(0)
    sv = inputs[-1]
    twice = _kernel(*inputs, p_format="e4m3fn") * sv.double().repeat_interleave(G, 1)[..., None, None]
    with pytest.raises(AssertionError) as failure:
        _check(twice.to(torch.bfloat16), *inputs)
    lines = str(failure.value).splitlines()
    assert lines[0].endswith(f"of {B * H * L * EV} output elements out of bounds")
    assert lines[1].startswith("  rule: |actual - ref| <= factor * (sum of the terms) + atol")
    assert lines[2].startswith("  worst element (") and "actual " in lines[2] and "reference " in lines[2]
    assert "x its allowance " in lines[3] and lines[3].startswith("    |actual - reference| = ")
    assert lines[4].startswith("    allowance: 1 * (P rounding ") and "output rounding" in lines[4]
    assert "each term alone: P rounding " in lines[5] and ", accumulation " in lines[5]
    config = "\n".join(lines[-3:])
    assert "p_format='e4m3fn', p_offset_log2=8, denominator='unrounded', accumulate_bits=24, output bfloat16 " \
           "(1 rounding)" in config and "enable_gqa=True" in config
    nan = _kernel(*inputs, p_format="e4m3fn")
    nan[1, 2, 3, 4] = math.nan
    with pytest.raises(AssertionError, match=r"(?s)1 of \d+ output elements.*worst element \(1, 2, 3, 4\).*not "
                                             r"finite there \(nan\)"):
        _check(nan, *inputs)


def test_factor_and_atol_widen_the_allowance():
    inputs = _inputs(1)
    out = _kernel(*inputs, p_format="e4m3fn")
    base = _check(out, *inputs)
    wide = _check(out, *inputs, factor=2.0, atol=1e-3)
    assert torch.allclose(wide.allowance, 2 * base.allowance + 1e-3, rtol=1e-15, atol=0)
    assert isinstance(base, FP8CheckReport)


# ---- refusals --------------------------------------------------------------------------------------------------


def test_the_checker_refuses_what_it_cannot_judge_by_name():
    q8, k8, v8, sq, sk, sv = inputs = _inputs(0, keys=5)
    out = _kernel(*inputs, p_format="e4m3fn")
    cases = [
        ((out[..., :3], *inputs), {}, ValueError,
         r"actual must have the shape of the attention output \(2, 6, 7, 5\) \(B, H, L, Ev\), got \(2, 6, 7, 3\)"),
        ((out, q8, k8[..., :4], v8, sq, sk, sv), {}, ValueError,
         r"k \(B, Hkv, S, E\) and v \(B, Hkv, S, Ev\) must fit q \(B, H, L, E\) = \(2, 6, 7, 11\), got k \(2, 3, 5, 4\)"),
        ((out, q8[0], k8, v8, sq, sk, sv), {}, ValueError, r"q must have 4 dims \(B, H, L, E\), got shape \(6, 7, 11\)"),
        ((out.tolist(), *inputs), {}, TypeError, r"actual must be a torch.Tensor, got list"),
        ((out.long(), *inputs), {}, TypeError, r"actual must be a floating-point tensor, got dtype torch.int64"),
        ((out, q8.long(), k8, v8, sq, sk, sv), {}, TypeError, r"q must be a floating-point tensor, got dtype"),
        ((out, q8 + 0.01, k8, v8, sq, sk, sv), {}, ValueError, r"q must hold values on the e4m3fn grid"),
        ((out, q8, k8, v8, torch.ones(B, H), sk, sv), {}, ValueError, r"q_descale must be a number or a tensor \(2, 3\)"),
        ((out, *inputs), {"fmt": "e4m3"}, ValueError, r"fmt must be one of \['e4m3fn', .*\], got 'e4m3'"),
        ((out, *inputs), {"fmt": "int8"}, ValueError, r"\('int8' only with quantizes_internally=True\), got 'int8'"),
        ((out, *inputs), {"p_format": "fp8"}, ValueError, r"p_format must be None or one of \[.*\], got 'fp8'"),
        ((out, *inputs), {"p_offset_log2": 10}, ValueError,
         (r"p_offset_log2=10 scales P up to 2\^10 = 1024, above e4m3fn's largest value 448: .* issue #2716\); a "
          r"right kernel keeps p_offset_log2 <= log2\(448\) = 8.8074")),
        ((out, *inputs), {"p_offset_log2": "8"}, TypeError, r"p_offset_log2 must be a real number, got str"),
        ((out, *inputs), {"denominator": "fp32"}, ValueError, r"denominator must be 'unrounded' or 'rounded', got 'fp32'"),
        ((out, *inputs), {"accumulate_bits": 7}, ValueError, r"accumulate_bits must lie in \[8, 53\] .*, got 7"),
        ((out, *inputs), {"accumulate_bits": 22.0}, TypeError, r"accumulate_bits must be None or an int, got float"),
        ((out, *inputs), {"output_dtype": torch.int32}, TypeError, r"output_dtype must be None or a floating-point"),
        ((out.bfloat16(), *inputs), {"output_dtype": torch.float32}, ValueError,
         r"output_dtype=float32 is finer than actual's dtype bfloat16"),
        ((out, *inputs), {"output_roundings": 0}, ValueError, r"output_roundings must be >= 1, got 0"),
        ((out, *inputs), {"v_fmt": "e4m3fn"}, ValueError, r"v_fmt is for a kernel that rounds V itself"),
        ((out, *inputs), {"quantizes_internally": True, "fmt": "int8"}, ValueError,
         r"q_descale must be None when quantizes_internally=True .*, got a tensor of shape \(2, 3\)"),
        ((out, *inputs), {"quantizes_internally": 1}, TypeError, r"quantizes_internally must be a bool, got int"),
        ((out, *inputs), {"layout": "bshd"}, ValueError, r"layout must be one of 'bhld', 'blhd', got 'bshd'"),
        ((out, *inputs), {"factor": 0}, ValueError, r"factor must be finite and > 0, got 0"),
        ((out, *inputs), {"atol": -1.0}, ValueError, r"atol must be finite and >= 0, got -1.0"),
        ((out, *inputs), {"scale": math.inf}, ValueError, r"scale must be None or a finite number, got inf"),
    ]
    for args, kw, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            assert_fp8_attention_close(*args, enable_gqa=True, **kw)
    with pytest.raises(ValueError, match=r"q has H=6 heads and k Hkv=3: pass enable_gqa=True"):
        assert_fp8_attention_close(out, *inputs)
