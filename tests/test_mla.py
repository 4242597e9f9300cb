"""Multi-head latent attention: the naive and absorbed forms agree, the module equals transformers'.

Sizes are distinct primes (and P != C, so a scale of 1/sqrt(C + R) cannot pass for
1/sqrt(P + R)): B=2, H=3, L=5, S=7, P=11, R=6 (even: RoPE pairs), C=13, Ev=5.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_ref.mla import (
    LatentCache,
    MultiHeadLatentAttention,
    apply_rope,
    expanded_values_per_token,
    latent_values_per_token,
    mla_absorbed,
    mla_naive,
    softmax_scale,
    split_kv_b_proj,
    yarn_mscale,
)

B, H, L, S, P, R, C, Ev = 2, 3, 5, 7, 11, 6, 13, 5
F64 = torch.float64


def _inputs(seed: int = 0, L: int = L, S: int = S, requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L, P), (B, H, L, R), (B, S, C), (B, S, R), (H, P, C), (H, Ev, C)]
    return [torch.randn(*shape, generator=g, dtype=F64).requires_grad_(requires_grad) for shape in shapes]


YARN = softmax_scale(P, R, mscale=yarn_mscale(40.0, 1.0))


# --- the two forms are equal ---------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, YARN], ids=["plain", "yarn-mscale"])
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "float"])
def test_absorbed_equals_naive_outputs_and_gradients(scale: float | None, masking: str):
    args = _inputs(requires_grad=True)
    g = torch.Generator().manual_seed(1)
    mask, causal = None, masking == "causal"
    if masking == "bool":
        mask = torch.rand(B, 1, L, S, generator=g) < 0.6
        mask[..., 0] = True  # every row keeps a key
    elif masking == "float":
        mask = torch.randn(B, H, L, S, generator=g, dtype=F64)
    naive = mla_naive(*args, mask, is_causal=causal, scale=scale)
    absorbed = mla_absorbed(*args, mask, is_causal=causal, scale=scale)
    assert naive.shape == (B, H, L, Ev)
    torch.testing.assert_close(absorbed, naive, rtol=0, atol=1e-12)
    cotangent = torch.randn(B, H, L, Ev, generator=g, dtype=F64)
    grads_naive = torch.autograd.grad(naive, args, cotangent)
    grads_absorbed = torch.autograd.grad(absorbed, args, cotangent)
    names = ["q_nope", "q_pe", "latent", "k_pe", "w_uk", "w_uv"]
    for name, a, n in zip(names, grads_absorbed, grads_naive):
        assert n.abs().max() > 1e-3, name  # every input matters
        torch.testing.assert_close(a, n, rtol=0, atol=1e-12, msg=lambda m, name=name: f"d/d{name}: {m}")


def test_causal_is_top_left_with_l_not_s():
    """L=5 queries, S=7 keys: query i sees keys 0..i; the forms agree and so does the mask."""
    args = _inputs()
    out = mla_absorbed(*args, is_causal=True)
    explicit = mla_naive(*args, torch.ones(L, S, dtype=torch.bool).tril())
    torch.testing.assert_close(out, explicit, rtol=0, atol=1e-12)
    assert (out - mla_absorbed(*args)).abs().max() > 1e-2  # the mask changed something


def test_the_default_scale_is_the_naive_one():
    args = _inputs()
    torch.testing.assert_close(mla_absorbed(*args), mla_absorbed(*args, scale=1 / math.sqrt(P + R)),
                               rtol=0, atol=1e-14)
    assert softmax_scale(128, 64) == 1 / math.sqrt(192)
    assert softmax_scale(P, R, mscale=2.0) == 4 / math.sqrt(P + R)


def test_the_wrong_absorbed_scale_differs():
    """1/sqrt(C + R), the absorbed query's own size (576 in V3), is the known bug: it changes the output."""
    args = _inputs()
    right = mla_naive(*args, is_causal=True)
    wrong = mla_absorbed(*args, is_causal=True, scale=1 / math.sqrt(C + R))
    assert (wrong - right).abs().max() > 1e-2
    # and YaRN's mscale^2 must be kept too
    assert (mla_absorbed(*args, scale=YARN) - mla_naive(*args)).abs().max() > 1e-2


def test_yarn_mscale_matches_deepseek_v3():
    assert yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40.0) + 1.0)
    assert yarn_mscale(40.0, 1.0) ** 2 == pytest.approx(1.8739, abs=1e-4)
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 1.0) == 1.0


def test_split_kv_b_proj_matches_the_linear_layer():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(H * (P + Ev), C, generator=g, dtype=F64)
    c = torch.randn(C, generator=g, dtype=F64)
    w_uk, w_uv = split_kv_b_proj(weight, H, P, Ev)
    per_head = (weight @ c).view(H, P + Ev)  # kv_b_proj(c), head by head: [k_nope | v]
    torch.testing.assert_close(w_uk @ c, per_head[:, :P], rtol=0, atol=1e-13)
    torch.testing.assert_close(w_uv @ c, per_head[:, P:], rtol=0, atol=1e-13)


def test_cache_sizes():
    assert latent_values_per_token(512, 64) == 576
    assert expanded_values_per_token(128, 192, 128) == 2 * 128 * 160
    cache = LatentCache(B, C, R, max_length=S, dtype=F64)
    assert cache.values_per_token == latent_values_per_token(C, R)
    assert cache.memory_bytes == B * S * (C + R) * 8


def test_apply_rope_lives_in_positional_and_the_old_path_still_imports_it():
    from attention_ref import mla, positional

    assert mla.apply_rope is positional.apply_rope and "apply_rope" in positional.__all__
    assert "apply_rope" not in mla.__all__  # documented once, on the positional page


def test_apply_rope_interleaved_and_half_split_agree_up_to_a_permutation():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(L, R, generator=g, dtype=F64)
    angles = torch.randn(L, R // 2, generator=g, dtype=F64)
    perm = torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2)))  # interleaved -> half-split
    interleaved = apply_rope(x, angles.cos(), angles.sin())
    half = apply_rope(x[:, perm], angles.cos(), angles.sin(), interleaved=False)
    torch.testing.assert_close(interleaved[:, perm], half, rtol=0, atol=1e-14)
    torch.testing.assert_close(interleaved.norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-13)


# --- the module and its latent cache -------------------------------------------------------------


def _module(q_lora_rank: int | None = 17, seed: int = 4) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    mla = MultiHeadLatentAttention(19, H, kv_lora_rank=C, qk_nope_head_dim=P, qk_rope_head_dim=R,
                                   v_head_dim=Ev, q_lora_rank=q_lora_rank, scale=YARN, dtype=F64)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return mla


@pytest.mark.parametrize("q_lora_rank", [None, 17])
def test_cache_decode_equals_full_recompute_step_by_step(q_lora_rank: int | None):
    mla = _module(q_lora_rank)
    x = torch.randn(B, 9, 19, generator=torch.Generator().manual_seed(5), dtype=F64)
    cache = LatentCache(B, C, R, max_length=9, dtype=F64)
    with torch.no_grad():
        prefill = mla(x[:, :3], cache=cache)  # 3 tokens at once, absorbed, bottom-right causal
        torch.testing.assert_close(prefill, mla(x[:, :3]), rtol=0, atol=1e-12)
        for t in range(3, 9):
            step = mla(x[:, t : t + 1], cache=cache)  # absorbed, one query against t + 1 latents
            full = mla(x[:, : t + 1])  # naive over the whole prefix
            torch.testing.assert_close(step, full[:, -1:], rtol=0, atol=1e-12)
    assert cache.length == 9


def test_cache_holds_the_latents_not_the_heads():
    mla = _module()
    x = torch.randn(B, 4, 19, generator=torch.Generator().manual_seed(6), dtype=F64)
    cache = LatentCache(B, C, R, max_length=4, dtype=F64)
    with torch.no_grad():
        mla(x, cache=cache)
        latent = mla.kv_a_layernorm(mla.kv_a_proj_with_mqa(x)[..., :C])
    torch.testing.assert_close(cache.latent, latent, rtol=0, atol=1e-14)
    assert cache.rope_key.shape == (B, 4, R)


# --- equal to transformers ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

T, D = 9, 19  # tokens, hidden size


def _hf_layer(q_lora_rank: int | None, yarn: bool, interleave: bool, attn: str = "eager"):
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1} if yarn
            else {"rope_type": "default", "rope_theta": 1000.0})
    config = DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                              q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=P,
                              qk_rope_head_dim=R, v_head_dim=Ev, rope_interleave=interleave,
                              max_position_embeddings=64, rope_parameters=rope, attention_bias=yarn)
    config._attn_implementation = attn
    torch.manual_seed(7)
    layer = hf_v3.DeepseekV3Attention(config, layer_idx=0).to(F64).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer, hf_v3.DeepseekV3RotaryEmbedding(config)


def _hf_run(layer, rotary_emb, x):
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # (B, T)
    cos, sin = rotary_emb(x, positions)  # (B, T, R) each, the halves repeated
    mask = torch.zeros(T, T, dtype=F64).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        out, _ = layer(x, (cos, sin), mask[None, None])
    return out, (cos[..., : R // 2], sin[..., : R // 2])


@pytest.mark.parametrize(
    "q_lora_rank,yarn,interleave",
    [(None, False, True), (17, False, False), (None, True, False), (17, True, True)],
    ids=["q-proj-rope-interleaved", "q-lora-rope-half-split", "q-proj-yarn-half-split", "q-lora-yarn-interleaved"],
)
def test_from_hf_equals_deepseek_v3_attention(q_lora_rank: int | None, yarn: bool, interleave: bool):
    """transformers' own eager forward is the oracle. It runs its RMSNorms and its softmax in
    float32 even on float64 inputs, so the agreement is 1e-6, not 1e-12 (next test)."""
    layer, rotary_emb = _hf_layer(q_lora_rank, yarn, interleave)
    mla = MultiHeadLatentAttention.from_hf(layer)
    assert mla.scale == pytest.approx(layer.scaling, rel=1e-14)
    assert (mla.scale > softmax_scale(P, R)) == yarn  # YaRN's mscale^2 is in the scale
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(8), dtype=F64)
    expected, tables = _hf_run(layer, rotary_emb, x)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, rotary=tables), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(mla(x), expected, rtol=0, atol=1e-6)  # our own RoPE tables
        cache = LatentCache(B, C, R, max_length=T, dtype=F64)
        steps = torch.cat([mla(x[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 17], ids=["q-proj", "q-lora"])
def test_from_hf_equals_deepseek_v3_in_float64(monkeypatch, q_lora_rank: int | None):
    """With transformers' RMSNorm computing in the input's dtype and its SDPA path (float64
    softmax), and its rotary tables given, the two agree to rounding."""

    def rms_norm_in_input_dtype(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(hf_v3.DeepseekV3RMSNorm, "forward", rms_norm_in_input_dtype)
    layer, rotary_emb = _hf_layer(q_lora_rank, yarn=True, interleave=True, attn="sdpa")
    mla = MultiHeadLatentAttention.from_hf(layer)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(9), dtype=F64)
    expected, tables = _hf_run(layer, rotary_emb, x)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, rotary=tables), expected, rtol=0, atol=1e-12)
        cache = LatentCache(B, C, R, max_length=T, dtype=F64)
        steps = torch.cat([mla(x[:, t : t + 1], cache=cache, rotary=tuple(c[:, t : t + 1] for c in tables))
                           for t in range(T)], dim=1)
    torch.testing.assert_close(steps, expected, rtol=0, atol=1e-12)


def test_from_hf_equals_kimi_linear_nope_mla():
    config = KimiLinearConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=C,
                              qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=Ev, q_lora_rank=None)
    config._attn_implementation = "eager"
    torch.manual_seed(10)
    layer = hf_kimi.KimiLinearAttention(config, layer_idx=0).to(F64).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    mla = MultiHeadLatentAttention.from_hf(layer)
    assert not mla.use_rope and mla.scale == pytest.approx(layer.scaling, rel=1e-14)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(11), dtype=F64)
    mask = torch.zeros(T, T, dtype=F64).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        expected, _ = layer(x, mask[None, None])
        torch.testing.assert_close(mla(x), expected, rtol=0, atol=1e-6)
        cache = LatentCache(B, C, R, max_length=T, dtype=F64)
        steps = torch.cat([mla(x[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, expected, rtol=0, atol=1e-6)


# --- argument errors ------------------------------------------------------------------------------


def test_form_argument_errors():
    q_nope, q_pe, latent, k_pe, w_uk, w_uv = _inputs()
    with pytest.raises(ValueError, match=r"w_uk must have shape \(H, P, C\) = \(3, 11, 13\).*got \(3, 11, 12\)"):
        mla_naive(q_nope, q_pe, latent, k_pe, w_uk[..., :12], w_uv)
    with pytest.raises(ValueError, match=r"k_pe must have shape \(B, S, R\) = \(2, 7, 6\).*got \(2, 6, 6\)"):
        mla_absorbed(q_nope, q_pe, latent, k_pe[:, :6], w_uk, w_uv)
    with pytest.raises(TypeError, match=r"latent must have the same dtype as q_nope \(torch.float64\), "
                                        r"got torch.float32"):
        mla_absorbed(q_nope, q_pe, latent.float(), k_pe, w_uk, w_uv)
    with pytest.raises(ValueError, match=r"q_nope must have at least 4 dims \(B, H, L, P\)"):
        mla_naive(q_nope[0], q_pe, latent, k_pe, w_uk, w_uv)
    with pytest.raises(ValueError, match="scale must be a positive finite float or None, got -1.0"):
        mla_absorbed(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale=-1.0)
    with pytest.raises(ValueError, match=r"weight must have shape \(H \* \(P \+ Ev\), C\).*= \(48, C\), "
                                         r"got \(47, 13\)"):
        split_kv_b_proj(torch.randn(47, 13), H, P, Ev)
    with pytest.raises(ValueError, match=r"x must have an even last dim R.*got x \(5, 5\)"):
        apply_rope(torch.randn(5, 5), torch.randn(5, 2), torch.randn(5, 2))
    with pytest.raises(ValueError, match="factor must be a positive finite float, got 0.0"):
        yarn_mscale(0.0)
    with pytest.raises(ValueError, match="mscale must be a positive finite float, got 0"):
        softmax_scale(P, R, mscale=0)
    with pytest.raises(ValueError, match=r"qk_nope_head_dim \+ qk_rope_head_dim must be positive"):
        softmax_scale(0, 0)


def test_cache_and_module_argument_errors():
    cache = LatentCache(B, C, R, max_length=4, dtype=F64)
    cache.append(torch.zeros(B, 3, C, dtype=F64), torch.zeros(B, 3, R, dtype=F64))
    with pytest.raises(ValueError, match="appending 2 tokens to a cache holding 3 of max_length = 4 needs 5"):
        cache.append(torch.zeros(B, 2, C, dtype=F64), torch.zeros(B, 2, R, dtype=F64))
    with pytest.raises(ValueError, match=r"k_pe must have shape \(B, Lnew, R\) = \(2, Lnew, 6\), got \(2, 1, 5\)"):
        cache.append(torch.zeros(B, 1, C, dtype=F64), torch.zeros(B, 1, 5, dtype=F64))
    with pytest.raises(TypeError, match=r"latent must have the same dtype as cache \(torch.float64\)"):
        cache.append(torch.zeros(B, 1, C), torch.zeros(B, 1, R, dtype=F64))
    assert cache.length == 3  # nothing written by the failed calls
    mla = _module()
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(B, seq, 19\), batch first, "
                                         r"got \(2, 5, 18\)"):
        mla(torch.zeros(B, 5, 18, dtype=F64))
    with pytest.raises(TypeError, match=r"hidden_states must have the module's dtype \(torch.float64\)"):
        mla(torch.zeros(B, 5, 19))
    with pytest.raises(ValueError, match="pass positions or rotary, not both"):
        tables = mla.rotary(torch.arange(5))
        mla(torch.zeros(B, 5, 19, dtype=F64), torch.arange(5), rotary=tables)
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) or \(B, L\) with L = 5, got \(4,\)"):
        mla(torch.zeros(B, 5, 19, dtype=F64), torch.arange(4))
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even with RoPE"):
        MultiHeadLatentAttention(8, 2, kv_lora_rank=4, qk_nope_head_dim=3, qk_rope_head_dim=5, v_head_dim=3)
    with pytest.raises(TypeError, match="layer must be a transformers DeepseekV3Attention or "
                                        "KimiLinearAttention, got Linear"):
        MultiHeadLatentAttention.from_hf(torch.nn.Linear(2, 2))
