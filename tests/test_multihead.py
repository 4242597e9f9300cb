"""MultiHeadAttention against torch.nn.MultiheadAttention (via from_torch) and a hand-written computation.

Sizes: B=2 batch, H=3 heads of size D=5 (embed_dim 15), L=7 queries, S=11 keys,
kdim=13, vdim=17. Everything in float64, modules in eval mode unless dropout is tested.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attention_ref import MultiHeadAttention, causal_mask, combine_masks, from_key_padding_mask, padding_mask

B, H, D, L, S = 2, 3, 5, 7, 11
EMBED, KDIM, VDIM = H * D, 13, 17
F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-10}


def _torch_mha(kind: str, bias: bool, batch_first: bool, seed: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    extra = {"kdim": KDIM, "vdim": VDIM} if kind == "cross_kdim_vdim" else {}
    module = nn.MultiheadAttention(EMBED, H, bias=bias, batch_first=batch_first, dtype=F64, **extra)
    if bias:  # PyTorch initialises the biases to 0: make them matter
        with torch.no_grad():
            module.in_proj_bias.normal_()
            module.out_proj.bias.normal_()
    return module.eval()


def _inputs(kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch-first (query, key, value)."""
    x = torch.randn(B, L, EMBED, generator=gen, dtype=F64)
    if kind == "self":
        return x, x, x
    kdim, vdim = (KDIM, VDIM) if kind == "cross_kdim_vdim" else (EMBED, EMBED)
    return x, torch.randn(B, S, kdim, generator=gen, dtype=F64), torch.randn(B, S, vdim, generator=gen, dtype=F64)


def _run_torch(module: nn.MultiheadAttention, q, k, v, **kwargs):
    """Call the PyTorch module with batch-first inputs, whatever its batch_first."""
    if not module.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, w = module(q, k, v, **kwargs)
    if not module.batch_first:
        out = out.transpose(0, 1)
    return out, w


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kind", ["self", "cross", "cross_kdim_vdim"])
def test_from_torch_parity(kind, bias, batch_first, average):
    gen = torch.Generator().manual_seed(len(kind) + 2 * bias + 4 * batch_first + 8 * average)
    module = _torch_mha(kind, bias, batch_first, seed=11)
    ours = MultiHeadAttention.from_torch(module)
    assert (ours.q_proj.bias is None) == (not bias)
    q, k, v = _inputs(kind, gen)
    expected, expected_w = _run_torch(module, q, k, v, average_attn_weights=average)
    key = None if kind == "self" else k
    value = None if kind == "self" else v
    out, w = ours(q, key, value, return_weights=True, average_weights=average)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(w, expected_w, **TOL)
    Sk = L if kind == "self" else S
    assert w.shape == ((B, L, Sk) if average else (B, H, L, Sk))
    torch.testing.assert_close(ours(q, key, value), out, atol=0, rtol=0)


def _masks(kind: str, Sk: int, gen: torch.Generator):
    """(torch kwargs, our attn_mask) for one mask kind. No row is fully masked (torch would give NaN)."""
    keep_keys = torch.rand(B, Sk, generator=gen) < 0.6
    keep_keys[:, 0] = True
    keep_pairs = torch.rand(L, Sk, generator=gen) < 0.6
    keep_pairs[:, 0] = True
    keep_per_head = torch.rand(B * H, L, Sk, generator=gen) < 0.6
    keep_per_head[..., 0] = True
    bias_keys = torch.randn(B, Sk, generator=gen, dtype=F64)
    bias_pairs = torch.randn(L, Sk, generator=gen, dtype=F64)
    if kind == "kpm_bool":
        return {"key_padding_mask": ~keep_keys}, from_key_padding_mask(~keep_keys)
    if kind == "kpm_float":
        return {"key_padding_mask": bias_keys}, from_key_padding_mask(bias_keys)
    if kind == "attn_bool":
        return {"attn_mask": ~keep_pairs}, keep_pairs
    if kind == "attn_float":
        return {"attn_mask": bias_pairs}, bias_pairs
    if kind == "attn_bool_per_head":  # PyTorch's 3-D (B * H, L, S) mask
        return {"attn_mask": ~keep_per_head}, keep_per_head.view(B, H, L, Sk)
    if kind == "kpm_and_attn_bool":
        return (
            {"key_padding_mask": ~keep_keys, "attn_mask": ~keep_pairs},
            combine_masks(from_key_padding_mask(~keep_keys), keep_pairs),
        )
    if kind == "kpm_and_attn_float":
        return (
            {"key_padding_mask": bias_keys, "attn_mask": bias_pairs},
            combine_masks(from_key_padding_mask(bias_keys), bias_pairs),
        )
    raise AssertionError(kind)


MASK_KINDS = [
    "kpm_bool",
    "kpm_float",
    "attn_bool",
    "attn_float",
    "attn_bool_per_head",
    "kpm_and_attn_bool",
    "kpm_and_attn_float",
]


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
@pytest.mark.parametrize("kind", ["self", "cross_kdim_vdim"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_from_torch_parity_with_masks(mask_kind, kind, average):
    gen = torch.Generator().manual_seed(MASK_KINDS.index(mask_kind) + 100 * len(kind))
    module = _torch_mha(kind, True, True, seed=5)
    ours = MultiHeadAttention.from_torch(module)
    q, k, v = _inputs(kind, gen)
    Sk = L if kind == "self" else S
    torch_kwargs, our_mask = _masks(mask_kind, Sk, gen)
    expected, expected_w = module(q, k, v, average_attn_weights=average, **torch_kwargs)
    out, w = ours(q, k, v, our_mask, return_weights=True, average_weights=average)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(w, expected_w, **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_parity_is_causal(batch_first):
    gen = torch.Generator().manual_seed(3)
    module = _torch_mha("self", True, batch_first, seed=7)
    ours = MultiHeadAttention.from_torch(module)
    q, k, v = _inputs("self", gen)
    # nn.MultiheadAttention's is_causal is only a hint: it needs the mask too (True = ignore).
    expected, expected_w = _run_torch(module, q, k, v, attn_mask=~causal_mask(L), is_causal=True)
    out, w = ours(q, is_causal=True, return_weights=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(w, expected_w, **TOL)
    assert (w.triu(1) == 0).all()


def test_from_torch_gradients_match():
    gen = torch.Generator().manual_seed(4)
    module = _torch_mha("cross_kdim_vdim", True, True, seed=9)
    ours = MultiHeadAttention.from_torch(module)
    q, k, v = (t.requires_grad_(True) for t in _inputs("cross_kdim_vdim", gen))
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    keep = padding_mask(torch.tensor([11, 6]), S)
    expected, _ = module(q, k, v, key_padding_mask=~keep[:, 0, 0])
    out = ours(q2, k2, v2, keep)
    cotangent = torch.randn(out.shape, generator=gen, dtype=F64)
    expected.backward(cotangent)
    out.backward(cotangent)
    for a, b in ((q2, q), (k2, k), (v2, v)):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    torch.testing.assert_close(ours.q_proj.weight.grad, module.q_proj_weight.grad, **TOL)
    torch.testing.assert_close(ours.v_proj.weight.grad, module.v_proj_weight.grad, **TOL)
    torch.testing.assert_close(ours.k_proj.bias.grad, module.in_proj_bias.grad[EMBED : 2 * EMBED], **TOL)
    torch.testing.assert_close(ours.out_proj.weight.grad, module.out_proj.weight.grad, **TOL)


def test_from_torch_copies_mode_dropout_and_separate_weights():
    module = nn.MultiheadAttention(EMBED, H, kdim=KDIM, vdim=VDIM, dropout=0.25, dtype=F64)
    ours = MultiHeadAttention.from_torch(module)
    assert ours.training and ours.dropout == 0.25
    assert (ours.kdim, ours.vdim) == (KDIM, VDIM)
    assert torch.equal(ours.k_proj.weight, module.k_proj_weight)
    assert ours.k_proj.weight.data_ptr() != module.k_proj_weight.data_ptr()  # a copy, not a view
    assert not MultiHeadAttention.from_torch(module.eval()).training
    assert ours.q_proj.weight.dtype == F64


def test_self_attention_defaults(generator):
    mha = MultiHeadAttention(EMBED, H, dtype=F64)
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64)
    y = torch.randn(B, S, EMBED, generator=generator, dtype=F64)
    torch.testing.assert_close(mha(x), mha(x, x, x), atol=0, rtol=0)
    torch.testing.assert_close(mha(x, y), mha(x, y, y), atol=0, rtol=0)


def test_weights_shapes_and_average(generator):
    mha = MultiHeadAttention(EMBED, H, kdim=KDIM, vdim=VDIM, dtype=F64)
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64)
    k = torch.randn(B, S, KDIM, generator=generator, dtype=F64)
    v = torch.randn(B, S, VDIM, generator=generator, dtype=F64)
    out, per_head = mha(x, k, v, return_weights=True, average_weights=False)
    _, averaged = mha(x, k, v, return_weights=True)
    assert out.shape == (B, L, EMBED)
    assert per_head.shape == (B, H, L, S) and averaged.shape == (B, L, S)
    torch.testing.assert_close(averaged, per_head.mean(dim=1))
    torch.testing.assert_close(per_head.sum(-1), torch.ones(B, H, L, dtype=F64))


def _manual_gqa(mha: MultiHeadAttention, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention written head by head, without the functional core."""
    Hq, Hkv, Dh = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q = x @ mha.q_proj.weight.T + mha.q_proj.bias  # (B, L, Hq * Dh)
    k = y @ mha.k_proj.weight.T + mha.k_proj.bias  # (B, S, Hkv * Dh)
    v = y @ mha.v_proj.weight.T + mha.v_proj.bias
    heads = []
    for h in range(Hq):
        g = h // (Hq // Hkv)  # the key/value head this query head reads
        qh = q[..., h * Dh : (h + 1) * Dh]
        kh, vh = k[..., g * Dh : (g + 1) * Dh], v[..., g * Dh : (g + 1) * Dh]
        scores = qh @ kh.transpose(-2, -1) / math.sqrt(Dh)  # (B, L, S)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ vh)  # (B, L, Dh)
    return torch.cat(heads, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 6])
def test_grouped_query_module_matches_manual(num_kv_heads, generator):
    torch.manual_seed(num_kv_heads)
    mha = MultiHeadAttention(30, 6, num_kv_heads=num_kv_heads, kdim=KDIM, vdim=KDIM, dtype=F64).eval()
    with torch.no_grad():
        for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
            proj.bias.normal_()
    assert mha.k_proj.weight.shape == (num_kv_heads * 5, KDIM)
    x = torch.randn(B, L, 30, generator=generator, dtype=F64)
    y = torch.randn(B, S, KDIM, generator=generator, dtype=F64)
    keep = padding_mask(torch.tensor([S, 4]), S)  # (B, 1, 1, S)
    torch.testing.assert_close(mha(x, y), _manual_gqa(mha, x, y, None), **TOL)
    torch.testing.assert_close(mha(x, y, attn_mask=keep), _manual_gqa(mha, x, y, keep[:, 0]), **TOL)


def test_dropout_only_in_training(generator):
    torch.manual_seed(0)
    mha = MultiHeadAttention(EMBED, H, dropout=0.5, dtype=F64)
    plain = MultiHeadAttention(EMBED, H, dtype=F64)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64)
    mha.eval()
    torch.testing.assert_close(mha(x), plain(x), atol=0, rtol=0)
    mha.train()
    with torch.random.fork_rng():
        torch.manual_seed(1)
        out1, w1 = mha(x, return_weights=True, average_weights=False)
        torch.manual_seed(1)
        out2 = mha(x)
    torch.testing.assert_close(out1, out2, atol=0, rtol=0)  # same seed, same dropout
    assert not torch.allclose(out1, plain(x))
    assert (w1 == 0).any()
    kept = w1 != 0
    _, w_eval = plain(x, return_weights=True, average_weights=False)
    torch.testing.assert_close(w1[kept], w_eval[kept] / 0.5)


def test_masks_broadcast_to_batch_heads(generator):
    mha = MultiHeadAttention(EMBED, H, dtype=F64)
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64)
    pad = padding_mask(torch.tensor([L, 3]), L)  # (B, 1, 1, L)
    per_head = pad.expand(B, H, L, L)
    torch.testing.assert_close(mha(x, attn_mask=pad), mha(x, attn_mask=per_head), atol=0, rtol=0)
    _, w = mha(x, attn_mask=pad, is_causal=True, return_weights=True, average_weights=False)
    assert (w[1, :, :, 3:] == 0).all()
    assert (w.triu(1) == 0).all()


# --- learned sinks ---------------------------------------------------------------------------------


def _sink_module(num_kv_heads=H, seed=12, backend="math"):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(EMBED, H, num_kv_heads=num_kv_heads, kdim=KDIM, vdim=VDIM, dtype=F64, sinks=True,
                             backend=backend).eval()
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([1.5, -0.5, 0.7], dtype=F64))  # away from the zeros they start at
    return mha


def _dense_with_sinks(mha, x, y, z, keep):
    """The module's projections by hand, then the core's math path with the module's sinks."""
    from attention_ref import scaled_dot_product_attention

    def heads(t, n):  # (B, T, n * D) -> (B, n, T, D)
        return t.unflatten(-1, (n, D)).transpose(1, 2)

    q = heads(x @ mha.q_proj.weight.T + mha.q_proj.bias, H)
    k = heads(y @ mha.k_proj.weight.T + mha.k_proj.bias, mha.num_kv_heads)
    v = heads(z @ mha.v_proj.weight.T + mha.v_proj.bias, mha.num_kv_heads)
    out = scaled_dot_product_attention(q, k, v, keep, enable_gqa=mha.num_kv_heads != H, sinks=mha.sinks,
                                       backend="math")  # (B, H, L, D)
    return out.transpose(1, 2).flatten(-2) @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("backend", ["math", "tiled"])
@pytest.mark.parametrize("num_kv_heads", [1, 3], ids=["mqa", "mha"])
def test_sinks_parameter_equals_the_dense_path_with_gradients(num_kv_heads, backend, generator):
    mha = _sink_module(num_kv_heads, backend=backend)
    assert isinstance(mha.sinks, nn.Parameter) and mha.sinks.shape == (H,)
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64, requires_grad=True)
    y = torch.randn(B, S, KDIM, generator=generator, dtype=F64, requires_grad=True)
    z = torch.randn(B, S, VDIM, generator=generator, dtype=F64, requires_grad=True)
    keep = padding_mask(torch.tensor([S, 4]), S)  # (B, 1, 1, S)
    out = mha(x, y, z, keep)
    ref = _dense_with_sinks(mha, x, y, z, keep)
    torch.testing.assert_close(out, ref, **TOL)
    leaves = (x, y, z, mha.sinks, mha.q_proj.weight, mha.k_proj.weight)
    cotangent = torch.randn(out.shape, generator=generator, dtype=F64)
    grads = torch.autograd.grad(out, leaves, cotangent)
    for name, g, r in zip(["query", "key", "value", "sinks", "q_proj", "k_proj"], grads,
                          torch.autograd.grad(ref, leaves, cotangent)):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m, name=name: f"d{name}: {m}")
    assert (grads[3] != 0).all(), "the gradient reaches every head's sink"
    with torch.no_grad():
        mha.sinks.fill_(float("-inf"))  # -inf: no sink
        assert (mha(x, y, z, keep) - out).abs().max() > 1e-2, "the sinks change the output"


def test_sinks_start_at_zero_round_trip_the_state_dict_and_leave_from_torch_alone(generator):
    fresh = MultiHeadAttention(EMBED, H, dtype=F64, sinks=True)
    assert torch.equal(fresh.sinks, torch.zeros(H, dtype=F64)) and fresh.sinks.requires_grad
    assert "sinks" in fresh.state_dict() and "sinks=True" in repr(fresh)
    trained = _sink_module(num_kv_heads=H)
    copy = MultiHeadAttention(EMBED, H, kdim=KDIM, vdim=VDIM, dtype=F64, sinks=True).eval()
    copy.load_state_dict(trained.state_dict())
    x = torch.randn(B, L, EMBED, generator=generator, dtype=F64)
    y = torch.randn(B, S, KDIM, generator=generator, dtype=F64)
    z = torch.randn(B, S, VDIM, generator=generator, dtype=F64)
    torch.testing.assert_close(copy(x, y, z), trained(x, y, z), atol=0, rtol=0)
    _, w = copy(x, y, z, return_weights=True, average_weights=False)
    assert (w.sum(-1) < 1).all()  # the sink takes its share of every row
    plain = MultiHeadAttention(EMBED, H, kdim=KDIM, vdim=VDIM, dtype=F64)
    assert plain.sinks is None and "sinks" not in plain.state_dict()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"sinks\""):
        plain.load_state_dict(trained.state_dict())
    ours = MultiHeadAttention.from_torch(_torch_mha("self", True, True, seed=3))
    assert ours.sinks is None and "sinks" not in ours.state_dict()


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_sinks_with_a_backend_that_takes_none_is_refused_by_name(backend):
    with pytest.raises(ValueError, match=rf"sinks=True needs backend 'math', 'tiled' or 'auto', got backend='{backend}'"
                       r", which takes no learned sinks"):
        MultiHeadAttention(EMBED, H, sinks=True, backend=backend)
    with pytest.raises(TypeError, match=r"sinks must be a bool, got int"):
        MultiHeadAttention(EMBED, H, sinks=1)
    MultiHeadAttention(EMBED, H, sinks=True, backend="auto")  # auto picks a backend that takes them
