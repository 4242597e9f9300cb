"""Positions: sinusoidal encodings against the paper's formula, RoPE against complex numbers and Hugging Face.

Float64 throughout; sizes are distinct where the API allows (E must be even for RoPE).
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

from attention_ref import positional
from attention_ref.positional import rope, rope_permutation, sinusoidal

F64 = torch.float64
L, E = 7, 10  # E even, E/2 = 5 pairs


def _msg(*parts: str) -> str:
    return ".*".join(re.escape(p) for p in parts)


def _randn(*shape: int, generator: torch.Generator, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=dtype)


def _theta(E: int, base: float = 10000.0) -> torch.Tensor:
    """theta_j = base^(-2j/E) for j = 0 .. E/2 - 1, in float64: the formula, written again."""
    return torch.tensor([base ** (-2.0 * j / E) for j in range(E // 2)], dtype=F64)


def _rope_complex(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Meta's interleaved RoPE: (x[2j] + i x[2j+1]) * exp(i m theta_j), via torch.polar."""
    angles = positions.to(F64)[..., None] * _theta(x.shape[-1], base)  # (..., L, E/2)
    rotation = torch.polar(torch.ones_like(angles), angles)  # (..., L, E/2) complex, |.| = 1
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())  # (..., L, E/2)
    return torch.view_as_real(xc * rotation).flatten(-2)  # (..., L, E/2, 2) -> (..., L, E)


# --- sinusoidal ------------------------------------------------------------------------------


def test_sinusoidal_matches_the_papers_formula_by_loop():
    length, dim = 11, 6
    pe = sinusoidal(length, dim, dtype=F64)
    assert pe.shape == (length, dim) and pe.dtype == F64
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-15)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-15)


def test_sinusoidal_offset_is_a_fixed_linear_map():
    """PE[pos + k] = M_k PE[pos] with M_k a rotation of each (sin, cos) pair by k * omega_i."""
    length, dim, k = 13, 10, 3
    pe = sinusoidal(length + k, dim, dtype=F64)
    omega = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=F64) / dim)  # (dim/2,)
    M = torch.zeros(dim, dim, dtype=F64)
    for i, w in enumerate(omega.tolist()):
        c, s = math.cos(k * w), math.sin(k * w)
        # sin(a + b) = sin a cos b + cos a sin b;  cos(a + b) = cos a cos b - sin a sin b
        M[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=F64)
    torch.testing.assert_close(pe[:length] @ M.T, pe[k:], atol=1e-12, rtol=0)  # every pos, one M
    far = sinusoidal(5000 + k, dim, dtype=F64)[5000 - length :]  # positions 4987 .. 5002
    torch.testing.assert_close(far[:length] @ M.T, far[k:], atol=1e-10, rtol=0)


def test_sinusoidal_dtype_device_and_empty():
    assert sinusoidal(3, 4).dtype == torch.get_default_dtype()
    assert sinusoidal(3, 4, dtype=torch.float16).dtype == torch.float16
    assert sinusoidal(3, 4, device="meta").device.type == "meta"
    assert sinusoidal(0, 4).shape == (0, 4)
    torch.testing.assert_close(sinusoidal(5, 8), sinusoidal(5, 8, dtype=F64).float())


# --- rope: against complex numbers and by hand -------------------------------------------------


@pytest.mark.parametrize("base", [10000.0, 500000.0, 3.0])
def test_rope_interleaved_is_complex_multiplication(base, generator):
    x = _randn(2, 3, L, E, generator=generator)
    positions = torch.tensor([0, 1, 2, 5, 11, 100, 4096])
    expected = _rope_complex(x, positions, base)
    torch.testing.assert_close(rope(x, positions, base=base, interleaved=True), expected, atol=1e-12, rtol=0)


def test_rope_half_split_is_complex_multiplication_after_permutation(generator):
    """Half-split pairs (j, j + E/2); gathered into interleaved order they are the complex product."""
    x = _randn(3, L, E, generator=generator)
    positions = torch.arange(L) * 3 + 2
    perm = rope_permutation(E)
    inverse = torch.argsort(perm)
    x_interleaved = x[..., inverse]  # feature 2j <- half-split j, 2j+1 <- j + E/2
    expected = _rope_complex(x_interleaved, positions)[..., perm]
    torch.testing.assert_close(rope(x, positions), expected, atol=1e-12, rtol=0)


def test_rope_by_hand_two_features():
    """E = 2: one pair, theta_0 = 1: rotate (a, b) by the angle m."""
    x = torch.tensor([[1.0, 2.0]] * 3, dtype=F64)  # (L, E) = (3, 2)
    out = rope(x)  # positions 0, 1, 2
    for m in range(3):
        c, s = math.cos(m), math.sin(m)
        assert out[m].tolist() == pytest.approx([1 * c - 2 * s, 2 * c + 1 * s], abs=1e-15)
    torch.testing.assert_close(rope(x, interleaved=True), out, atol=0, rtol=0)  # E = 2: same pairs


def test_rope_by_hand_half_split_pairs():
    """E = 4, half-split: pairs (0, 2) rotate by m, (1, 3) by m / 100."""
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)
    m = 5
    out = rope(x, torch.tensor([m]))
    w = 10000 ** (-2 / 4)  # theta_1 = 1/100
    expected = [math.cos(m), -math.sin(m * w), math.sin(m), math.cos(m * w)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-15)
    # interleaved: pairs (0, 1) by m, (2, 3) by m / 100
    out = rope(x, torch.tensor([m]), interleaved=True)
    expected = [math.cos(m), math.sin(m), -math.sin(m * w), math.cos(m * w)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_position_zero_is_identity(interleaved, generator):
    x = _randn(2, L, E, generator=generator)
    out = rope(x, torch.zeros(L, dtype=torch.long), interleaved=interleaved)
    torch.testing.assert_close(out, x, atol=0, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_keeps_norms(interleaved, generator):
    x = _randn(2, 3, L, E, generator=generator)
    out = rope(x, torch.arange(L) * 1000, interleaved=interleaved)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-12, rtol=0)
    # and each pair separately (a rotation per pair, not a mix across pairs)
    to_interleaved = torch.arange(E) if interleaved else torch.argsort(rope_permutation(E))

    def pair_norms(t: torch.Tensor) -> torch.Tensor:
        return t[..., to_interleaved].reshape(*t.shape[:-1], E // 2, 2).norm(dim=-1)  # (..., L, E/2)

    torch.testing.assert_close(pair_norms(out), pair_norms(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shift", [1, 5, 1000, -3])
def test_rope_scores_depend_only_on_relative_position(interleaved, shift, generator):
    q, k = _randn(3, L, E, generator=generator), _randn(3, 5, E, generator=generator)
    pos_q = torch.arange(L) + 10  # (L,)
    pos_k = torch.tensor([0, 3, 4, 9, 12])  # (S,)
    scores = rope(q, pos_q, interleaved=interleaved) @ rope(k, pos_k, interleaved=interleaved).mT  # (3, L, S)
    shifted = rope(q, pos_q + shift, interleaved=interleaved) @ rope(k, pos_k + shift, interleaved=interleaved).mT
    torch.testing.assert_close(shifted, scores, atol=1e-10, rtol=0)
    # and they do depend on i - j: moving only the keys changes them
    moved = rope(q, pos_q, interleaved=interleaved) @ rope(k, pos_k + 1, interleaved=interleaved).mT
    assert not torch.allclose(moved, scores)


def test_rope_default_positions_and_broadcasting(generator):
    x = _randn(2, 3, L, E, generator=generator)  # (B, H, L, E)
    torch.testing.assert_close(rope(x), rope(x, torch.arange(L)), atol=0, rtol=0)
    positions = torch.stack([torch.arange(L), torch.arange(L) + 4])[:, None, :]  # (B, 1, L)
    out = rope(x, positions)
    torch.testing.assert_close(out[0], rope(x[0], torch.arange(L)), atol=0, rtol=0)
    torch.testing.assert_close(out[1], rope(x[1], torch.arange(L) + 4), atol=0, rtol=0)
    # float positions (interpolation) give the same as integers when they are whole
    torch.testing.assert_close(rope(x, torch.arange(L, dtype=F64)), rope(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rope_low_precision_is_computed_in_float32_and_cast_back(dtype, generator):
    x = _randn(3, L, E, generator=generator).to(dtype)
    positions = torch.arange(L) * 97
    out = rope(x, positions)
    assert out.dtype == dtype
    expected = rope(x.to(F64), positions)  # exact up to float64
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}[dtype]
    # within one rounding of the output (plus float32's own arithmetic), as if computed exactly
    torch.testing.assert_close(out.to(F64), expected, atol=1e-6, rtol=ulp)


def test_rope_large_positions_keep_float64_precision(generator):
    x = _randn(1, E, generator=generator)
    m = 1_000_003
    torch.testing.assert_close(rope(x, torch.tensor([m]), interleaved=True), _rope_complex(x, torch.tensor([m])), atol=1e-12, rtol=0)


def test_rope_gradient(generator):
    x = _randn(2, 5, 6, generator=generator).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rope(t, torch.arange(5) * 7), (x,))
    assert torch.autograd.gradcheck(lambda t: rope(t, torch.arange(5) * 7, interleaved=True), (x,))


# --- the permutation between the two conventions ------------------------------------------------


def test_rope_permutation_values():
    assert rope_permutation(2).tolist() == [0, 1]
    assert rope_permutation(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rope_permutation(4, num_heads=3).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11]
    assert rope_permutation(6).dtype == torch.int64


@pytest.mark.parametrize("head_dim", [2, 4, 10, 64])
def test_rope_permutation_interleaved_to_half_split(head_dim, generator):
    """rope(x, interleaved=True)[..., perm] == rope(x[..., perm], interleaved=False)."""
    x = _randn(2, L, head_dim, generator=generator)
    positions = torch.arange(L) * 5 + 1
    perm = rope_permutation(head_dim)
    torch.testing.assert_close(
        rope(x, positions, interleaved=True)[..., perm], rope(x[..., perm], positions), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("head_dim", [4, 10, 64])
def test_rope_permutation_half_split_to_interleaved(head_dim, generator):
    """The way back: the inverse permutation, argsort(perm)."""
    x = _randn(2, L, head_dim, generator=generator)
    positions = torch.arange(L) * 5 + 1
    inverse = torch.argsort(rope_permutation(head_dim))
    torch.testing.assert_close(
        rope(x, positions)[..., inverse], rope(x[..., inverse], positions, interleaved=True), atol=1e-12, rtol=0
    )


def test_rope_permutation_converts_a_checkpoint(generator):
    """Rows of W_Q and W_K reordered with perm: half-split RoPE gives the interleaved model's scores.

    Also both directions on the weights: w_half = w_interleaved[perm], w_interleaved = w_half[argsort(perm)].
    """
    H, D, d, T = 3, 8, 11, 5
    x = _randn(T, d, generator=generator)  # (T, d) tokens
    wq_interleaved, wk_interleaved = _randn(H * D, d, generator=generator), _randn(H * D, d, generator=generator)
    perm = rope_permutation(D, num_heads=H)
    wq_half, wk_half = wq_interleaved[perm], wk_interleaved[perm]

    def scores(wq: torch.Tensor, wk: torch.Tensor, interleaved: bool) -> torch.Tensor:
        q = (x @ wq.T).view(T, H, D).transpose(0, 1)  # (T, d) x (d, H*D) -> (H, T, D)
        k = (x @ wk.T).view(T, H, D).transpose(0, 1)  # (H, T, D)
        return rope(q, interleaved=interleaved) @ rope(k, interleaved=interleaved).mT  # (H, T, T)

    expected = scores(wq_interleaved, wk_interleaved, interleaved=True)
    torch.testing.assert_close(scores(wq_half, wk_half, interleaved=False), expected, atol=1e-10, rtol=0)
    # the wrong direction (argsort(perm) instead of perm) does not give them for D > 4
    inverse = torch.argsort(perm)
    wrong = scores(wq_interleaved[inverse], wk_interleaved[inverse], interleaved=False)
    assert not torch.allclose(wrong, expected)
    # back again
    torch.testing.assert_close(wq_half[inverse], wq_interleaved, atol=0, rtol=0)
    torch.testing.assert_close(scores(wq_half[inverse], wk_half[inverse], interleaved=True), expected, atol=1e-10, rtol=0)


def test_rope_permutation_is_hf_convert_llama_weights_permute():
    """HF's convert_llama_weights_to_hf.py: w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2)."""
    H, D, d = 3, 8, 5
    w = torch.arange(H * D * d, dtype=F64).reshape(H * D, d)
    hf = w.view(H, D // 2, 2, d).transpose(1, 2).reshape(H * D, d)
    torch.testing.assert_close(w[rope_permutation(D, num_heads=H)], hf, atol=0, rtol=0)


# --- Hugging Face transformers, when installed --------------------------------------------------


def test_rope_equals_transformers_llama_apply_rotary_pos_emb(generator):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    apply = modeling_llama.apply_rotary_pos_emb
    if "unsqueeze_dim" not in inspect.signature(apply).parameters:
        pytest.skip("this transformers' Llama apply_rotary_pos_emb predates unsqueeze_dim")
    B, H, D = 2, 3, 10
    q, k = _randn(B, H, L, D, generator=generator), _randn(B, H, L, D, generator=generator)
    position_ids = torch.stack([torch.arange(L), torch.arange(L) + 9])  # (B, L)
    # LlamaRotaryEmbedding.forward: freqs = position_ids * inv_freq, emb = cat(freqs, freqs)
    freqs = position_ids.to(F64)[..., None] * _theta(D)  # (B, L, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, L, D)
    q_hf, k_hf = apply(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    positions = position_ids[:, None, :]  # (B, 1, L) broadcasts over heads
    torch.testing.assert_close(rope(q, positions), q_hf, atol=1e-12, rtol=0)
    torch.testing.assert_close(rope(k, positions), k_hf, atol=1e-12, rtol=0)


def test_rope_equals_transformers_gptj_apply_rotary_pos_emb(generator):
    modeling_gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
    params = list(inspect.signature(modeling_gptj.apply_rotary_pos_emb).parameters)
    if params != ["tensor", "sin", "cos"]:
        pytest.skip(f"this transformers' GPT-J apply_rotary_pos_emb takes {params}")
    B, H, D = 2, 3, 10
    x = _randn(B, L, H, D, generator=generator)  # GPT-J rotates before moving heads: (B, L, H, D)
    position_ids = torch.stack([torch.arange(L), torch.arange(L) * 2 + 1])  # (B, L)
    # GPT-J's create_sinusoidal_positions: cat(sin, cos) of position * inv_freq, gathered by position_ids
    angles = position_ids.to(F64)[..., None] * _theta(D)  # (B, L, D/2)
    out_hf = modeling_gptj.apply_rotary_pos_emb(x, angles.sin(), angles.cos())  # (B, L, H, D)
    expected = rope(x.transpose(1, 2), position_ids[:, None, :], interleaved=True).transpose(1, 2)
    torch.testing.assert_close(expected, out_hf, atol=1e-12, rtol=0)


def test_rope_frequencies_equal_transformers_gptj_table(generator):
    """GPT-J's own sin/cos table (float32): same frequencies, theta_j = 10000^(-2j/E)."""
    modeling_gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
    D, n = 10, 50
    table = modeling_gptj.create_sinusoidal_positions(n, D)  # (n, D): cat(sin, cos)
    sin, cos = table[:, : D // 2], table[:, D // 2 :]  # (n, D/2) each
    x = _randn(1, n, 1, D, generator=generator).float()  # (B, L, H, D)
    out_hf = modeling_gptj.apply_rotary_pos_emb(x, sin[None], cos[None])
    torch.testing.assert_close(rope(x[:, :, 0], interleaved=True), out_hf[:, :, 0], atol=1e-5, rtol=1e-5)


# --- errors -------------------------------------------------------------------------------------


def test_sinusoidal_errors():
    with pytest.raises(ValueError, match=_msg("dim must be even", "got 5")):
        sinusoidal(3, 5)
    with pytest.raises(ValueError, match=_msg("dim must be a positive int", "got 0")):
        sinusoidal(3, 0)
    with pytest.raises(ValueError, match=_msg("length must be a non-negative int", "got -1")):
        sinusoidal(-1, 4)
    with pytest.raises(TypeError, match=_msg("length must be an int", "got float")):
        sinusoidal(3.0, 4)
    with pytest.raises(TypeError, match=_msg("dtype must be a floating-point dtype", "torch.int64")):
        sinusoidal(3, 4, dtype=torch.int64)


def test_rope_errors():
    x = torch.zeros(L, E)
    with pytest.raises(ValueError, match=_msg("x must have an even last dim E", "got E=9", "(7, 9)")):
        rope(torch.zeros(L, 9))
    with pytest.raises(ValueError, match=_msg("x must have at least 2 dims", "(..., L, E)", "got 1 dims")):
        rope(torch.zeros(E))
    with pytest.raises(TypeError, match=_msg("x must have a floating-point dtype", "torch.int64")):
        rope(torch.zeros(L, E, dtype=torch.long))
    with pytest.raises(TypeError, match=_msg("x must be a torch.Tensor", "got list")):
        rope([[0.0, 0.0]])
    with pytest.raises(ValueError, match=_msg("positions must have last dim L=7", "(7, 10)", "got shape (5,)")):
        rope(x, torch.arange(5))
    with pytest.raises(ValueError, match=_msg("positions must have last dim L=7", "got shape ()")):
        rope(x, torch.tensor(3))
    with pytest.raises(ValueError, match=_msg("positions must broadcast to x's (..., L)=(2, 7)", "got shape (3, 7)")):
        rope(torch.zeros(2, L, E), torch.zeros(3, L, dtype=torch.long))
    with pytest.raises(ValueError, match=_msg("positions must broadcast to x's (..., L)=(7,)", "got shape (2, 7)")):
        rope(x, torch.zeros(2, L, dtype=torch.long))
    with pytest.raises(TypeError, match=_msg("positions must be an integer (or float) tensor", "torch.bool")):
        rope(x, torch.zeros(L, dtype=torch.bool))
    with pytest.raises(TypeError, match=_msg("positions must be a torch.Tensor", "got range")):
        rope(x, range(L))
    with pytest.raises(ValueError, match=_msg("positions must be on the same device as x (cpu)", "meta")):
        rope(x, torch.arange(L, device="meta"))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=_msg("base must be a positive finite float", f"got {bad}")):
            rope(x, base=bad)
    with pytest.raises(TypeError, match=_msg("base must be a positive float", "got str")):
        rope(x, base="10000")
    with pytest.raises(TypeError, match=_msg("interleaved must be a bool", "got int")):
        rope(x, interleaved=1)


def test_rope_permutation_errors():
    with pytest.raises(ValueError, match=_msg("head_dim must be even", "got 7")):
        rope_permutation(7)
    with pytest.raises(ValueError, match=_msg("head_dim must be a positive int", "got 0")):
        rope_permutation(0)
    with pytest.raises(ValueError, match=_msg("num_heads must be a positive int", "got 0")):
        rope_permutation(4, num_heads=0)
    with pytest.raises(TypeError, match=_msg("head_dim must be an int", "got float")):
        rope_permutation(4.0)


def test_module_exports():
    assert set(positional.__all__) == {"apply_rope", "rope", "rope_permutation", "sinusoidal"}
