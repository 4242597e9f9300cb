"""`attention_ref.testing.assert_attention_close`: FlashAttention's rule for judging a kernel.

Real kernels (torch's SDPA, this package's tiled path) pass in float16 and
float32; deliberately wrong ones (a scale off by 1%, a dropped causal mask, a
gradient of the wrong key) fail with a message that gives the three errors and
the worst position. Sizes are distinct primes so a swapped axis fails loudly.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from attention_ref import mods, scaled_dot_product_attention
from attention_ref.testing import assert_attention_close

DTYPES = [torch.float16, torch.float32]
NUMBER = r"(\d\.\d{3}e[-+]\d+)"
THREE_ERRORS = (  # kernel error, low-precision error, bound
    rf"max\|actual - reference\|        = {NUMBER}\n"
    rf"    max\|low_precision - reference\| = {NUMBER} \(float(?:16|32), no upcasting\)\n"
    rf"    allowed: 2 \* {NUMBER} \+ 1e-06 = {NUMBER}"
)
WORST = r"worst position \((\d+), (\d+), (\d+), (\d+)\): actual"


def make_inputs(dtype, B=2, H=3, L=11, S=13, E=16, Hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, Hkv or H, S, E, generator=g).to(dtype)
    v = torch.randn(B, Hkv or H, S, E, generator=g).to(dtype)
    return q, k, v


def reference64(q, k, v, scale=None, causal=False):
    """softmax(scale q k^T) v in float64, written out (an independent reference)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.transpose(-2, -1)  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    if causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    return scores.softmax(-1) @ v  # (B, H, L, S) x (B, H, S, E) -> (B, H, L, E)


def tiled_with_grads(q, k, v, grad_output, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*leaves, backend="tiled", **kwargs)
    out.backward(grad_output)
    return out.detach(), tuple(t.grad for t in leaves)


# ---- real kernels pass -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"is_causal": True}, {"scale": 0.3}],
    ids=["plain", "causal", "scale"],
)
def test_torch_sdpa_passes(dtype, kwargs):
    q, k, v = make_inputs(dtype)
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert_attention_close(out, q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_sdpa_passes_with_masks_and_gqa(dtype):
    q, k, v = make_inputs(dtype, H=6, Hkv=2)
    bool_mask = torch.rand(11, 13, generator=torch.Generator().manual_seed(1)) > 0.3
    bool_mask[:, 0] = True  # every query keeps a key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True)
    assert_attention_close(out, q, k, v, attn_mask=bool_mask, enable_gqa=True)
    float_mask = torch.randn(11, 13, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, enable_gqa=True)
    assert_attention_close(out, q, k, v, attn_mask=float_mask, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_tiled_forward_and_backward_pass(dtype, is_causal):
    q, k, v = make_inputs(dtype)
    grad_output = torch.randn(2, 3, 11, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    out, grads = tiled_with_grads(q, k, v, grad_output, is_causal=is_causal)
    assert_attention_close(
        out, q, k, v, grad_output=grad_output, actual_grads=grads, is_causal=is_causal
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_a_float_mask_empties_are_judged_not_nan(dtype):
    """-inf on a whole row of a float mask: the kernel's 0 passes, a wrong row still fails."""
    q, k, v = make_inputs(dtype)
    bias = torch.randn(11, 13, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias[[2, 7]] = -math.inf  # queries 2 and 7 see no key
    grad_output = torch.randn(2, 3, 11, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    out, grads = tiled_with_grads(q, k, v, grad_output, attn_mask=bias)
    assert torch.equal(out[:, :, [2, 7]], torch.zeros_like(out[:, :, [2, 7]]))
    assert_attention_close(out, q, k, v, grad_output=grad_output, actual_grads=grads, attn_mask=bias)
    wrong = out.clone()
    wrong[:, :, 2] = v.mean(-2)  # a kernel that spreads an empty row evenly over the keys
    with pytest.raises(AssertionError, match=r"worst position \(\d+, \d+, 2, \d+\)"):
        assert_attention_close(wrong, q, k, v, attn_mask=bias)


def test_float64_kernel_is_judged_by_atol():
    q, k, v = make_inputs(torch.float64)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_attention_close(out, q, k, v, is_causal=True)
    with pytest.raises(AssertionError, match=r"output:\n    max\|actual - reference\|"):
        assert_attention_close(out + 1e-5, q, k, v, is_causal=True)


def test_the_package_path_with_a_mask_mod_passes_and_a_wrong_window_fails():
    q, k, v = make_inputs(torch.float16)
    window = mods.sliding_window(3)
    out = scaled_dot_product_attention(q, k, v, mask_mod=window)
    assert_attention_close(out, q, k, v, mask_mod=window)
    with pytest.raises(AssertionError, match="kwargs {mask_mod=sliding_window"):
        assert_attention_close(out, q, k, v, mask_mod=mods.sliding_window(4))


def test_the_low_precision_baseline_itself_passes():
    """A kernel exactly as accurate as plain float16 PyTorch passes with factor 1."""
    q, k, v = make_inputs(torch.float16)
    scores = (q @ k.transpose(-2, -1)) * 0.25  # float16 throughout, as upcast=False
    plain = scores.softmax(-1) @ v
    assert_attention_close(plain, q, k, v, factor=1.0, atol=0.0)


# ---- with mods the baseline is plain 16-bit attention too ---------------------------------

LENGTHS = torch.tensor([13, 6])  # batch entry 1 keeps keys 0 .. 5


def make_bias(dtype):
    return torch.randn(11, 13, generator=torch.Generator().manual_seed(6)).to(dtype)  # (L, S) float mask


MOD_CASES = {  # name: (attention kwargs, the same built by hand: score_mod, keep(b, h, i, j), bias)
    "softcap": (
        {"score_mod": mods.softcap(2.0)},
        (lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0), None, None),
    ),
    "window": (
        {"mask_mod": mods.sliding_window(3)},
        (None, lambda b, h, i, j: (j <= i) & (j >= i - 3), None),
    ),
    "softcap-bias-window": (  # the cap comes before the float mask is added
        {"score_mod": mods.softcap(2.0), "mask_mod": mods.sliding_window(3, 2)},
        (lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0), lambda b, h, i, j: (j <= i + 2) & (j >= i - 3), "bias"),
    ),
    "alibi-padding": (  # indices b (padding), h (slopes), i and j (distance) all matter
        {"score_mod": mods.alibi(3, symmetric=True), "mask_mod": mods.padding(LENGTHS)},
        (
            lambda s, b, h, i, j: s - mods.alibi_slopes(3).to(s.dtype)[h] * (j - i).abs(),
            lambda b, h, i, j: j < LENGTHS[b],
            None,
        ),
    ),
}


def plain_attention(q, k, v, score_mod=None, keep=None, bias=None):
    """softmax(score_mod(q k^T / sqrt(E)) + bias, masked by keep) v: every step in q's dtype."""
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    b = torch.arange(B).reshape(B, 1, 1, 1)  # index grids that broadcast to (B, H, L, S)
    h = torch.arange(H).reshape(1, H, 1, 1)
    i = torch.arange(L).reshape(1, 1, L, 1)
    j = torch.arange(S).reshape(1, 1, 1, S)
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]))  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j).to(q.dtype)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep(b, h, i, j), -math.inf)
    return scores.softmax(-1) @ v  # (B, H, L, S) x (B, H, S, E) -> (B, H, L, E)


def mod_case(name, dtype):
    q, k, v = make_inputs(dtype)
    kwargs, (score_mod, keep, bias) = MOD_CASES[name]
    if bias is not None:
        bias = make_bias(dtype)
        kwargs = dict(kwargs, attn_mask=bias)
    grad_output = torch.randn(2, 3, 11, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = plain_attention(*leaves, score_mod, keep, bias)
    grads = torch.autograd.grad(out, leaves, grad_output)
    return q, k, v, kwargs, grad_output, out.detach(), grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MOD_CASES))
def test_plain_attention_with_mods_passes_with_factor_one(name, dtype):
    q, k, v, kwargs, grad_output, out, grads = mod_case(name, dtype)
    assert_attention_close(out, q, k, v, grad_output=grad_output, actual_grads=grads,
                           factor=1.0, atol=0.0, **kwargs)


@pytest.mark.parametrize("name", list(MOD_CASES))
def test_the_baseline_error_with_mods_is_that_of_plain_16_bit_attention(name):
    """With a tiny factor every quantity fails, and each shows the same error twice."""
    q, k, v, kwargs, grad_output, out, grads = mod_case(name, torch.float16)
    with pytest.raises(AssertionError) as info:
        assert_attention_close(out, q, k, v, grad_output=grad_output, actual_grads=grads,
                               factor=1e-9, atol=0.0, **kwargs)
    message = str(info.value)
    assert "4 of 4 quantities out of bounds" in message
    pairs = re.findall(r"max\|actual - reference\|        = (\S+)\n"
                       r"    max\|low_precision - reference\| = (\S+) \(float16", message)
    assert len(pairs) == 4 and all(actual == low for actual, low in pairs), message
    # ... not that of the package's math path in float16 (softmax in float32), a smaller one
    upcast = scaled_dot_product_attention(q, k, v, **kwargs)
    reference = scaled_dot_product_attention(q.double(), k.double(), v.double(), **{
        key: value.double() if key == "attn_mask" else value for key, value in kwargs.items()})
    plain_error = (out.double() - reference).abs().max().item()
    assert float(pairs[0][1]) == pytest.approx(plain_error, rel=1e-3)
    assert plain_error > (upcast.double() - reference).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("name", "wrong"),
    [
        ("softcap", (None, None, None)),  # the cap forgotten
        ("window", (None, lambda b, h, i, j: (j <= i) & (j >= i - 4), None)),  # one key too many
        ("softcap-bias-window", (lambda s, b, h, i, j: 2.0 * torch.tanh((s + make_bias(s.dtype)) / 2.0),  # bias capped
                                 lambda b, h, i, j: (j <= i + 2) & (j >= i - 3), None)),
        ("alibi-padding", (lambda s, b, h, i, j: s - mods.alibi_slopes(3).to(s.dtype)[2 - h] * (j - i).abs(),
                           lambda b, h, i, j: j < LENGTHS[b], None)),  # slopes of the wrong heads
        ("alibi-padding", (lambda s, b, h, i, j: s - mods.alibi_slopes(3).to(s.dtype)[h] * (j - i).abs(),
                           lambda b, h, i, j: j < LENGTHS[1 - b], None)),  # lengths of the wrong batch entry
    ],
    ids=["no-cap", "window-too-wide", "bias-capped", "alibi-heads-swapped", "padding-batch-swapped"],
)
def test_plain_attention_with_a_wrong_mod_fails(name, wrong, dtype):
    q, k, v, kwargs, *_ = mod_case(name, dtype)
    out = plain_attention(q, k, v, *wrong)
    with pytest.raises(AssertionError, match=r"1 of 1 quantities out of bounds[\s\S]*" + WORST):
        assert_attention_close(out, q, k, v, **kwargs)


# ---- wrong kernels fail, and say why -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_off_by_one_percent_fails_with_three_errors_and_worst_position(dtype):
    q, k, v = make_inputs(dtype)
    wrong = F.scaled_dot_product_attention(q, k, v, scale=1.01 / math.sqrt(16))
    with pytest.raises(AssertionError) as info:
        assert_attention_close(wrong, q, k, v)
    message = str(info.value)
    match = re.search(THREE_ERRORS, message)
    assert match, message
    actual_error, low_error, low_again, bound = (float(match.group(i)) for i in (1, 2, 3, 4))
    assert low_again == low_error
    assert actual_error > bound == pytest.approx(2 * low_error + 1e-6, rel=1e-3)
    # The printed kernel error and worst position are those of an independent reference.
    diff = (wrong.double() - reference64(q, k, v)).abs()
    assert actual_error == pytest.approx(diff.max().item(), rel=1e-3)
    worst = tuple(int(i) for i in re.search(WORST, message).groups())
    assert diff[worst].item() == diff.max().item()
    assert "config: query (2, 3, 11, 16), key (2, 3, 13, 16), value (2, 3, 13, 16)" in message
    assert f"dtype {str(dtype).removeprefix('torch.')}" in message


def test_low_precision_error_is_the_plain_float16_error():
    q, k, v = make_inputs(torch.float16)
    wrong = F.scaled_dot_product_attention(q, k, v, scale=0.26)
    with pytest.raises(AssertionError) as info:
        assert_attention_close(wrong, q, k, v)
    low_error = float(re.search(THREE_ERRORS, str(info.value)).group(2))
    plain = ((q @ k.transpose(-2, -1)) * 0.25).softmax(-1) @ v  # float16, no upcast
    expected = (plain.double() - reference64(q, k, v)).abs().max().item()
    assert expected > 1e-4  # float16 is visibly off
    assert low_error == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropped_causal_mask_fails(dtype):
    q, k, v = make_inputs(dtype)
    wrong = F.scaled_dot_product_attention(q, k, v)  # forgot is_causal
    with pytest.raises(AssertionError, match=r"1 of 1 quantities out of bounds[\s\S]*" + WORST):
        assert_attention_close(wrong, q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_of_the_wrong_key_fails_and_names_dk(dtype):
    q, k, v = make_inputs(dtype)
    grad_output = torch.randn(2, 3, 11, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    out, (dq, dk, dv) = tiled_with_grads(q, k, v, grad_output, is_causal=True)
    shifted = dk.roll(1, dims=-2)  # key j's gradient reported for key j + 1
    with pytest.raises(AssertionError) as info:
        assert_attention_close(
            out, q, k, v, grad_output=grad_output, actual_grads=(dq, shifted, dv), is_causal=True
        )
    message = str(info.value)
    assert "1 of 4 quantities out of bounds" in message
    assert re.search(r"\n  dk:\n    " + THREE_ERRORS, message), message
    assert re.search(WORST, message)
    assert "output:" not in message and "dq:" not in message and "dv:" not in message


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_that_ignores_scale_fails(dtype):
    q, k, v = make_inputs(dtype)
    wrong = F.scaled_dot_product_attention(q, k, v)  # 1/sqrt(16) = 0.25, asked for 0.3
    with pytest.raises(AssertionError, match=r"kwargs {scale=0\.3}"):
        assert_attention_close(wrong, q, k, v, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_kernel_that_ignores_the_mask_fails(dtype, kind):
    q, k, v = make_inputs(dtype)
    g = torch.Generator().manual_seed(4)
    if kind == "bool":
        mask = torch.rand(11, 13, generator=g) > 0.5
        mask[:, 0] = True
    else:
        mask = (3 * torch.randn(11, 13, generator=g)).to(dtype)
    wrong = F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(AssertionError, match=rf"kwargs {{attn_mask=tensor\(11, 13\) {kind}"):
        assert_attention_close(wrong, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_gqa_head_grouping_fails(dtype):
    q, k, v = make_inputs(dtype, H=6, Hkv=2)
    # query head h belongs to key/value head h // 3; tiling pairs it with h % 2 instead
    wrong = F.scaled_dot_product_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))
    with pytest.raises(AssertionError, match=r"kwargs {enable_gqa=True}"):
        assert_attention_close(wrong, q, k, v, enable_gqa=True)


def test_factor_is_the_allowed_multiple_of_the_low_precision_error():
    """A kernel 1.5x as far off as plain float16 passes with factor 2, fails with 1.4."""
    q, k, v = make_inputs(torch.float16)
    reference = reference64(q, k, v)
    plain = (((q @ k.transpose(-2, -1)) * 0.25).softmax(-1) @ v).double()
    kernel = reference + 1.5 * (plain - reference)  # float64, 1.5x the float16 error
    assert_attention_close(kernel, q, k, v, atol=0.0)
    with pytest.raises(AssertionError, match=r"allowed: 1\.4 \* "):
        assert_attention_close(kernel, q, k, v, factor=1.4, atol=0.0)


def test_nan_in_the_kernel_fails_at_its_position():
    q, k, v = make_inputs(torch.float32)
    out = F.scaled_dot_product_attention(q, k, v)
    out[1, 2, 7, 5] = math.nan
    with pytest.raises(AssertionError, match=r"max\|actual - reference\| += inf\n[\s\S]*worst position \(1, 2, 7, 5\)"):
        assert_attention_close(out, q, k, v)


# ---- argument errors ---------------------------------------------------------------------


def test_argument_errors_name_the_argument():
    q, k, v = make_inputs(torch.float32)
    out = F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="actual must be a torch.Tensor, got list"):
        assert_attention_close([1.0], q, k, v)
    with pytest.raises(TypeError, match="query must be a floating-point tensor, got dtype torch.int64"):
        assert_attention_close(out, q.long(), k, v)
    with pytest.raises(TypeError, match="share one dtype, got torch.float32, torch.float16 and torch.float32"):
        assert_attention_close(out, q, k.half(), v)
    with pytest.raises(ValueError, match=r"actual must have the shape of the attention output \(2, 3, 11, 16\), got \(2, 3, 16, 11\)"):
        assert_attention_close(out.transpose(-2, -1), q, k, v)
    with pytest.raises(ValueError, match="grad_output and actual_grads must be given together"):
        assert_attention_close(out, q, k, v, grad_output=torch.ones_like(out))
    with pytest.raises(ValueError, match="actual_grads must be a tuple .* got tuple of length 2"):
        assert_attention_close(out, q, k, v, grad_output=torch.ones_like(out), actual_grads=(q, k))
    with pytest.raises(ValueError, match=r"actual_grads' dk must have shape \(2, 3, 13, 16\), got \(2, 3, 11, 16\)"):
        assert_attention_close(out, q, k, v, grad_output=torch.ones_like(out), actual_grads=(q, q, v))
    with pytest.raises(ValueError, match=r"grad_output must have the shape .* \(2, 3, 11, 16\), got \(11, 16\)"):
        assert_attention_close(out, q, k, v, grad_output=out[0, 0], actual_grads=(q, k, v))
    with pytest.raises(ValueError, match="factor must be finite and > 0, got 0"):
        assert_attention_close(out, q, k, v, factor=0)
    with pytest.raises(TypeError, match="factor must be a real number, got str"):
        assert_attention_close(out, q, k, v, factor="2")
    with pytest.raises(ValueError, match="atol must be finite and >= 0, got -1e-06"):
        assert_attention_close(out, q, k, v, atol=-1e-6)
    with pytest.raises(TypeError, match="unexpected keyword 'backend'; expected one of attn_mask"):
        assert_attention_close(out, q, k, v, backend="tiled")
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None, got list"):
        assert_attention_close(out, q, k, v, attn_mask=[[True]])
