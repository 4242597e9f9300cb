"""attention_ref.linear: the delta-rule family, its two forms held equal, and transformers as an oracle.

Sizes are distinct where they can be (B=3, L=11, H=2, Hv=6, E=5, Ev=7), so a swapped axis
fails. Equalities between forms are checked in float64 to 1e-10; the oracle (transformers'
torch fallbacks, which compute in float32) to a stated float32 tolerance.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import attention_ref.linear as linear
from attention_ref.linear import (
    gated_delta_rule,
    gated_linear_attention,
    kimi_delta_attention,
    l2_normalize,
    linear_attention,
    ssd,
    state_kv_to_vk,
    state_vk_to_kv,
)
from transformers_api import returned_cache, with_cache  # tests/transformers_api.py

F64 = torch.float64
B, L, H, HV, E, EV = 3, 11, 2, 6, 5, 7
TIGHT = {"rtol": 1e-10, "atol": 1e-10}  # float64, two orders of the same sums
CHUNK_SIZES = [1, 3, 4, 11, 16]  # 11 = L, 16 > L; 3 and 4 leave a short last chunk


def make(kind="gdn", *, b=B, length=L, h=H, hv=HV, e=E, ev=EV, seed=0, dtype=F64, requires_grad=False):
    """Random inputs; g <= 0 (log decay), beta in (0, 1), a random initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, h, e, generator=gen, dtype=dtype)
    k = torch.randn(b, length, h, e, generator=gen, dtype=dtype)
    v = torch.randn(b, length, hv, ev, generator=gen, dtype=dtype)
    g_shape = (b, length, hv) if kind == "gdn" else (b, length, hv, e)
    g = -torch.rand(g_shape, generator=gen, dtype=dtype)
    beta = torch.rand(b, length, hv, generator=gen, dtype=dtype)
    h0 = torch.randn(b, hv, e, ev, generator=gen, dtype=dtype)
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    if requires_grad:
        for t in tensors.values():
            t.requires_grad_(True)
    return tensors


FUNCTIONS = {"gdn": gated_delta_rule, "kda": kimi_delta_attention}


def run(kind, x, **kw):
    x = dict(x)
    return FUNCTIONS[kind](x.pop("q"), x.pop("k"), x.pop("v"), x.pop("g"), x.pop("beta"), **x, **kw)


# --- chunked == recurrent ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunked_equals_recurrent_outputs_states_and_gradients(kind, chunk_size):
    x = make(kind, requires_grad=True)
    ref_out, ref_state = run(kind, x, output_final_state=True)
    out, state = run(kind, x, output_final_state=True, mode="chunked", chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(state, ref_state, **TIGHT)
    gen = torch.Generator().manual_seed(1)
    w_out, w_state = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(state.shape, generator=gen,
                                                                                   dtype=F64)
    inputs = list(x.values())  # q, k, v, g, beta, initial_state
    ref_grads = torch.autograd.grad((ref_out * w_out).sum() + (ref_state * w_state).sum(), inputs)
    grads = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), inputs)
    for name, got, want in zip(x, grads, ref_grads):
        assert want.abs().max() > 1e-3, f"d/d{name} vanished: the comparison would prove nothing"
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m, name=name: f"d/d{name}: {m}")


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_strong_decay_and_no_decay_stay_finite_and_equal(mode):
    x = make()
    for g in (torch.zeros_like(x["g"]), torch.full_like(x["g"], -30.0)):  # DeltaNet; forget at once
        y = dict(x, g=g)
        out, state = run("gdn", y, output_final_state=True, mode=mode, chunk_size=4)
        ref_out, ref_state = run("gdn", y, output_final_state=True)
        assert torch.isfinite(out).all() and torch.isfinite(state).all()
        torch.testing.assert_close(out, ref_out, **TIGHT)
        torch.testing.assert_close(state, ref_state, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strength,path", [(0.3, "whole chunk"), (1.0, "blocks"), (8.0, "exact blocks")])
def test_kda_chunked_factors_its_decay_only_within_range(dtype, strength, path, monkeypatch):
    """A decay per channel is factored into the rows (one matmul) for the whole chunk while its log decay
    stays within 40, else block by block, else exactly: each path equals the recurrence."""
    import attention_ref.linear as linear_module

    x = make("kda", length=48, seed=4)
    x["g"] = x["g"] * strength * 2  # gates in (-2 strength, 0]: a chunk of 32 sums to about -32 strength
    exact, rows = [], []
    decay, factor = linear_module._decay, linear_module._factored_scores
    monkeypatch.setattr(linear_module, "_decay", lambda gamma: exact.append(gamma.shape) or decay(gamma))
    monkeypatch.setattr(linear_module, "_factored_scores", lambda a, *r: rows.append(a.shape[-2]) or factor(a, *r))
    ref = run("kda", x, output_final_state=True)
    x = {n: t.to(dtype) for n, t in x.items()}
    out, state = run("kda", x, output_final_state=True, mode="chunked", chunk_size=32)
    assert (path == "exact blocks") == bool(exact), exact  # the elementwise decays only where needed
    assert (path == "whole chunk") == (max(rows) == 32), rows  # one matmul per chunk while in range
    tol = TIGHT if dtype == F64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref[0], **tol)
    torch.testing.assert_close(state.double(), ref[1], **tol)
    factored = linear_module._channel_scores
    calls = []
    monkeypatch.setattr(linear_module, "_channel_scores", lambda *a: calls.append(1) or factored(*a))
    run("kda", x, mode="chunked", chunk_size=32)
    assert calls  # the per-channel scores never go through a (C, C, E) decay


# --- the recurrence itself, on cases computed by hand ---------------------------------------------


def test_delta_rule_overwrites_where_linear_attention_adds():
    # orthonormal keys, beta = 1, no decay: writing (k0, a) then (k0, b) leaves b under k0;
    # plain linear attention leaves a + b. q = k0 reads it back (scale 1, no l2 norm needed).
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=F64).reshape(1, 3, 1, 2)
    v = torch.tensor([[2.0], [5.0], [7.0]], dtype=F64).reshape(1, 3, 1, 1)
    q = torch.tensor([[1.0, 0.0]] * 3, dtype=F64).reshape(1, 3, 1, 2)
    zeros, ones = torch.zeros(1, 3, 1, dtype=F64), torch.ones(1, 3, 1, dtype=F64)
    for mode in ("recurrent", "chunked"):
        out, state = gated_delta_rule(q, k, v, zeros, ones, scale=1.0, mode=mode, chunk_size=2,
                                      output_final_state=True, use_qk_l2norm=False)
        assert out.flatten().tolist() == [2.0, 5.0, 5.0]
        assert state.flatten().tolist() == [5.0, 7.0]  # S = k0 5^T + k1 7^T
    plain, _ = linear_attention(q, k, v, scale=1.0)
    assert plain.flatten().tolist() == [2.0, 7.0, 7.0]


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_initial_state_is_read_by_the_queries(mode):
    # beta = 0 writes nothing and g = 0 keeps everything: o_t = S_0^T (scale * q_t / |q_t|)
    x = make()
    y = dict(x, g=torch.zeros_like(x["g"]), beta=torch.zeros_like(x["beta"]))
    out, state = run("gdn", y, output_final_state=True, mode=mode, chunk_size=4)
    q = l2_normalize(x["q"]).repeat_interleave(HV // H, dim=2) * E**-0.5  # (B, L, Hv, E)
    torch.testing.assert_close(out, torch.einsum("blhe,bhef->blhf", q, x["initial_state"]), **TIGHT)
    torch.testing.assert_close(state, x["initial_state"], **TIGHT)
    no_state, _ = run("gdn", dict(x, initial_state=None), mode=mode, chunk_size=4)
    zero_state, _ = run("gdn", dict(x, initial_state=torch.zeros_like(x["initial_state"])), mode=mode, chunk_size=4)
    torch.testing.assert_close(no_state, zero_state, **TIGHT)
    with_state, _ = run("gdn", x, mode=mode, chunk_size=4)
    assert (with_state - no_state).abs().max() > 1e-2


def test_grouped_value_heads_read_query_key_head_j_over_group():
    x = make()
    out, state = run("gdn", x, output_final_state=True)
    group = HV // H
    for j in range(HV):
        qk_head = j // group  # value head j reads query/key head j // group
        one = {"q": x["q"][:, :, qk_head, None], "k": x["k"][:, :, qk_head, None], "v": x["v"][:, :, j, None],
               "g": x["g"][:, :, j, None], "beta": x["beta"][:, :, j, None],
               "initial_state": x["initial_state"][:, j, None]}
        out_j, state_j = run("gdn", one, output_final_state=True)
        torch.testing.assert_close(out[:, :, j, None], out_j, **TIGHT)
        torch.testing.assert_close(state[:, j, None], state_j, **TIGHT)


# --- carrying the state: split, varlen -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("m", [0, 1, 6, 11])
def test_split_and_carry_equals_one_run(kind, mode, m):
    x = make(kind)
    whole, whole_state = run(kind, x, output_final_state=True, mode=mode, chunk_size=4)
    first = {name: t[:, :m] if name != "initial_state" else t for name, t in x.items()}
    second = {name: t[:, m:] for name, t in x.items() if name != "initial_state"}
    out_1, state_m = run(kind, first, output_final_state=True, mode=mode, chunk_size=4)
    out_2, state = run(kind, dict(second, initial_state=state_m), output_final_state=True, mode=mode, chunk_size=4)
    torch.testing.assert_close(torch.cat([out_1, out_2], dim=1), whole, **TIGHT)
    torch.testing.assert_close(state, whole_state, **TIGHT)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_varlen_equals_each_sequence_alone(kind, mode):
    bounds = [0, 3, 3, 8, 13]  # an empty sequence, lengths 3 and 5 (not multiples of 4) and 5
    x = make(kind, b=1, length=bounds[-1])
    h0 = make(kind, b=len(bounds) - 1, seed=5)["initial_state"]  # (N, Hv, E, Ev)
    cu = torch.tensor(bounds, dtype=torch.int32)
    packed, states = run(kind, dict(x, initial_state=h0), output_final_state=True, mode=mode, chunk_size=4,
                         cu_seqlens=cu)
    assert states.shape == (len(bounds) - 1, HV, E, EV)
    for n, (start, end) in enumerate(pairwise(bounds)):
        alone = {name: t[:, start:end] for name, t in x.items() if name != "initial_state"}
        out, state = run(kind, dict(alone, initial_state=h0[n:n + 1]), output_final_state=True)
        torch.testing.assert_close(packed[:, start:end], out, **TIGHT)
        torch.testing.assert_close(states[n:n + 1], state, **TIGHT)
    # without the reset, sequence 3 would start from sequence 1's state: it must differ
    run_on, _ = run(kind, dict(x, initial_state=h0[:1]), mode=mode, chunk_size=4)
    assert (run_on[:, 3:8] - packed[:, 3:8]).abs().max() > 1e-3


# --- spans and reused tensors: how long inputs run ----------------------------------------------


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("chunk_size", [1, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_short_spans_and_reused_tensors_give_the_one_span_numbers(kind, mode, chunk_size, packed, monkeypatch):
    # 23 tokens; packed: sequences of 3, 0, 11 and 9 tokens. Spans of at most 4 tokens below
    # (whole chunks for the chunked form), against one span: the test sizes fit in one by default.
    bounds = [0, 3, 3, 14, 23]
    x = make(kind, b=1 if packed else B, length=bounds[-1], requires_grad=True)
    if packed:
        x["initial_state"] = make(kind, b=len(bounds) - 1, seed=5, requires_grad=True)["initial_state"]
    kw = dict(output_final_state=True, mode=mode, chunk_size=chunk_size,
              cu_seqlens=torch.tensor(bounds) if packed else None)
    assert linear._span_tokens(B, HV, max(E, EV)) >= bounds[-1]
    want = run(kind, x, **kw)  # one span; gradients recorded, so every tensor is new
    monkeypatch.setattr(linear, "_SPAN_ELEMENTS", 4 * B * HV * max(E, EV))
    assert linear._span_tokens(B, HV, max(E, EV)) == 4
    fresh = run(kind, x, **kw)  # spans of 4, new tensors
    with torch.no_grad():
        reused = run(kind, x, **kw)  # spans of 4, the chunked form's tensors reused and written in place
    for got in (fresh, reused):
        for g, w, what in zip(got, want, ("out", "final state")):
            torch.testing.assert_close(g, w, **TIGHT, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("sizes", [{}, {"b": 1, "h": 1, "hv": 1}])  # one head: a transposed input is contiguous
def test_no_input_is_written(mode, use_qk_l2norm, sizes):
    x = make(**sizes)
    before = {name: t.clone() for name, t in x.items()}
    with torch.no_grad():  # where the chunked form writes its own tensors in place
        run("gdn", x, mode=mode, chunk_size=4, use_qk_l2norm=use_qk_l2norm, output_final_state=True)
    for name, t in x.items():
        assert torch.equal(t, before[name]), f"{name} was written"


# --- the family's corners ------------------------------------------------------------------------


def test_beta_to_zero_gives_gated_linear_attention():
    # S stays O(beta), so the correction beta * S^T k is O(beta^2): out / beta -> GLA(q, k, v)
    x = make()
    eps = 1e-7
    out, state = run("gdn", dict(x, beta=torch.full_like(x["beta"], eps), initial_state=None),
                     output_final_state=True)
    qn, kn = l2_normalize(x["q"]), l2_normalize(x["k"])
    for mode in ("recurrent", "quadratic"):
        gla, gla_state = gated_linear_attention(qn, kn, x["v"], x["g"], mode=mode, output_final_state=True)
        torch.testing.assert_close(out / eps, gla, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state / eps, gla_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_kda_with_equal_channels_is_the_gated_delta_rule(mode):
    x = make("gdn")
    gdn, gdn_state = run("gdn", x, output_final_state=True, mode=mode, chunk_size=4)
    kda, kda_state = run("kda", dict(x, g=x["g"][..., None].expand(B, L, HV, E)), output_final_state=True,
                         mode=mode, chunk_size=4)
    torch.testing.assert_close(kda, gdn, **TIGHT)
    torch.testing.assert_close(kda_state, gdn_state, **TIGHT)


def test_kda_decays_each_channel_at_its_own_rate():
    # no writes (beta = 0): the state's row e is multiplied by exp(sum_t g_te)
    x = make("kda")
    _, state = run("kda", dict(x, beta=torch.zeros_like(x["beta"])), output_final_state=True, mode="chunked",
                   chunk_size=4)
    torch.testing.assert_close(state, x["initial_state"] * x["g"].sum(1).exp()[..., None], **TIGHT)


def test_gated_linear_attention_forms_and_carry():
    x = make()
    args = (x["q"], x["k"], x["v"], x["g"])
    loop, loop_state = gated_linear_attention(*args, initial_state=x["initial_state"], output_final_state=True)
    matrix, matrix_state = gated_linear_attention(*args, initial_state=x["initial_state"], output_final_state=True,
                                                  mode="quadratic")
    torch.testing.assert_close(matrix, loop, **TIGHT)
    torch.testing.assert_close(matrix_state, loop_state, **TIGHT)
    cu = torch.tensor([0, 4, 11])
    packed, _ = gated_linear_attention(*(t[:1] for t in args), mode="quadratic", cu_seqlens=cu)
    for start, end in ((0, 4), (4, 11)):
        alone, _ = gated_linear_attention(*(t[:1, start:end] for t in args))
        torch.testing.assert_close(packed[:, start:end], alone, **TIGHT)


def _gla_by_hand(q, k, v, g, h0):
    """Gated linear attention as the formula reads, one token at a time: S <- diag(exp g_t) S + k_t v_t^T,
    o_t = S^T (q_t E^-1/2). Hv == H; g (B, L, H) per head or (B, L, H, E) per key channel."""
    g = g if g.dim() == 4 else g[..., None].expand(*q.shape)  # (B, L, H, E)
    S, outs = h0.clone(), []
    for t in range(q.shape[1]):
        S = g[:, t, :, :, None].exp() * S + k[:, t, :, :, None] * v[:, t, :, None, :]  # (B, H, E, Ev)
        outs.append(torch.einsum("bhe,bhef->bhf", q[:, t] * q.shape[-1] ** -0.5, S))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("mode,chunk_size", [("recurrent", 64), ("quadratic", 64)]
                         + [("chunked", c) for c in CHUNK_SIZES])
def test_gla_forms_equal_the_recurrence_outputs_states_and_gradients(per_channel, mode, chunk_size):
    x = make("kda" if per_channel else "gdn", h=HV, requires_grad=True)
    inputs = [x["q"], x["k"], x["v"], x["g"], x["initial_state"]]
    by_hand = _gla_by_hand(*inputs)
    ref = gated_linear_attention(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    for want, got in zip(by_hand, ref):  # the recurrence is the formula
        torch.testing.assert_close(got, want, **TIGHT)
    out, state = gated_linear_attention(*inputs[:4], initial_state=inputs[4], output_final_state=True,
                                        mode=mode, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref[0], **TIGHT)
    torch.testing.assert_close(state, ref[1], **TIGHT)
    gen = torch.Generator().manual_seed(1)
    w_out, w_state = (torch.randn(t.shape, generator=gen, dtype=F64) for t in (out, state))
    want = torch.autograd.grad((ref[0] * w_out).sum() + (ref[1] * w_state).sum(), inputs)
    got = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "g", "initial_state"), got, want):
        assert b.abs().max() > 1e-3, f"d/d{name} vanished: the comparison would prove nothing"
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, name=name: f"d/d{name}: {m}")


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("mode", ["quadratic", "chunked"])
def test_gla_packed_sequences_equal_each_alone(per_channel, mode):
    x = make("kda" if per_channel else "gdn", b=1, h=HV)
    cu = torch.tensor([0, 4, 5, 11])  # three sequences, one of a single token
    h0 = torch.randn(3, HV, E, EV, generator=torch.Generator().manual_seed(2), dtype=F64)
    args = (x["q"], x["k"], x["v"], x["g"])
    packed, states = gated_linear_attention(*args, initial_state=h0, output_final_state=True, mode=mode,
                                            chunk_size=3, cu_seqlens=cu)
    for n, (start, end) in enumerate(pairwise(cu.tolist())):
        alone, state = gated_linear_attention(*(t[:, start:end] for t in args), initial_state=h0[n:n + 1],
                                              output_final_state=True)
        torch.testing.assert_close(packed[:, start:end], alone, **TIGHT)
        torch.testing.assert_close(states[n:n + 1], state, **TIGHT)


def test_gla_per_channel_decays_each_key_channel_at_its_own_rate():
    x = make("kda", h=HV)
    g = torch.zeros_like(x["g"])
    g[..., 0] = float("-inf")  # channel 0 forgets everything at each step, the others nothing
    _, state = gated_linear_attention(x["q"], x["k"], x["v"], g, initial_state=x["initial_state"],
                                      output_final_state=True, mode="chunked", chunk_size=4)
    last = x["k"][:, -1, :, 0, None] * x["v"][:, -1]  # (B, H, Ev): channel 0 keeps only the last write
    torch.testing.assert_close(state[:, :, 0], last, **TIGHT)
    kept = x["initial_state"][:, :, 1:] + torch.einsum("blhe,blhf->bhef", x["k"][..., 1:], x["v"])
    torch.testing.assert_close(state[:, :, 1:], kept, **TIGHT)


@pytest.mark.parametrize("mode", ["recurrent", "quadratic"])
def test_linear_attention_with_and_without_normalisation(mode):
    x = make(h=HV)
    q, k, v = x["q"].exp(), x["k"].exp(), x["v"]  # positive features, as normalisation needs
    scores = torch.einsum("bihe,bjhe->bhij", q, k) * E**-0.5  # (B, H, L, L)
    scores = scores * torch.ones(L, L, dtype=F64).tril()
    plain, _ = linear_attention(q, k, v, mode=mode)
    torch.testing.assert_close(plain, torch.einsum("bhij,bjhf->bihf", scores, v), **TIGHT)
    normed, state = linear_attention(q, k, v, normalize=True, mode=mode, output_final_state=True)
    weights = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(normed, torch.einsum("bhij,bjhf->bihf", weights, v), **TIGHT)
    assert state.shape == (B, HV, E, EV + 1)
    torch.testing.assert_close(state[..., -1], k.sum(1), **TIGHT)  # z = sum of keys
    first, s_m = linear_attention(q[:, :4], k[:, :4], v[:, :4], normalize=True, output_final_state=True)
    second, _ = linear_attention(q[:, 4:], k[:, 4:], v[:, 4:], normalize=True, initial_state=s_m, mode=mode)
    torch.testing.assert_close(torch.cat([first, second], 1), normed, **TIGHT)


def _mamba2_scan(x, dt, A, B_, C_, D, h):
    """Mamba-2's recurrence as its papers write it, state (batch, H, P, N) value channels first."""
    group = x.shape[2] // B_.shape[2]
    Bh, Ch = B_.repeat_interleave(group, 2), C_.repeat_interleave(group, 2)  # (batch, L, H, N)
    ys = []
    for t in range(x.shape[1]):
        h = (dt[:, t] * A).exp()[..., None, None] * h + torch.einsum("bhp,bhn->bhpn", dt[:, t, :, None] * x[:, t],
                                                                     Bh[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, 1), h


def test_ssd_quadratic_equals_recurrence_and_mamba2_scan():
    gen = torch.Generator().manual_seed(3)
    batch, length, heads, groups, P, N = 2, 11, 6, 3, 5, 7
    x = torch.randn(batch, length, heads, P, generator=gen, dtype=F64)
    dt = torch.rand(batch, length, heads, generator=gen, dtype=F64)
    A = -torch.rand(heads, generator=gen, dtype=F64) * 2
    B_ = torch.randn(batch, length, groups, N, generator=gen, dtype=F64)
    C_ = torch.randn(batch, length, groups, N, generator=gen, dtype=F64)
    D = torch.randn(heads, generator=gen, dtype=F64)
    h0 = torch.randn(batch, heads, N, P, generator=gen, dtype=F64)  # (batch, H, N, P): key channels first
    y, state = ssd(x, dt, A, B_, C_, D=D, initial_state=h0, output_final_state=True)
    y_scan, state_scan = ssd(x, dt, A, B_, C_, D=D, initial_state=h0, output_final_state=True, mode="recurrent")
    torch.testing.assert_close(y, y_scan, **TIGHT)
    torch.testing.assert_close(state, state_scan, **TIGHT)
    y_m2, h_m2 = _mamba2_scan(x, dt, A, B_, C_, D, state_kv_to_vk(h0))
    torch.testing.assert_close(y, y_m2, **TIGHT)
    torch.testing.assert_close(state_kv_to_vk(state), h_m2, **TIGHT)
    for chunk_size in (1, 4, 11, 16):  # Mamba-2's chunked algorithm, a short last chunk included
        y_c, state_c = ssd(x, dt, A, B_, C_, D=D, initial_state=h0, output_final_state=True, mode="chunked",
                           chunk_size=chunk_size)
        torch.testing.assert_close(y_c, y_scan, **TIGHT)
        torch.testing.assert_close(state_c, state_scan, **TIGHT)


@pytest.mark.parametrize("mode", ["quadratic", "recurrent", "chunked"])
def test_ssd_packed_sequences_equal_each_alone(mode):
    """cu_seqlens: no state, decay or skip term crosses a boundary; each sequence's own entry and final state."""
    gen = torch.Generator().manual_seed(5)
    length, heads, groups, P, N = 12, 4, 2, 3, 5
    cu = torch.tensor([0, 3, 4, 12])  # three sequences, one of a single token
    x = torch.randn(1, length, heads, P, generator=gen, dtype=F64)
    dt = torch.rand(1, length, heads, generator=gen, dtype=F64)
    A = -torch.rand(heads, generator=gen, dtype=F64) * 2
    B_, C_ = (torch.randn(1, length, groups, N, generator=gen, dtype=F64) for _ in range(2))
    D = torch.randn(heads, generator=gen, dtype=F64)
    h0 = torch.randn(3, heads, N, P, generator=gen, dtype=F64)  # one entry state per sequence
    y, states = ssd(x, dt, A, B_, C_, D=D, initial_state=h0, output_final_state=True, mode=mode, chunk_size=3,
                    cu_seqlens=cu)
    assert states.shape == (3, heads, N, P)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = slice(start, end)
        alone, state = ssd(x[:, part], dt[:, part], A, B_[:, part], C_[:, part], D=D, initial_state=h0[n:n + 1],
                           output_final_state=True, mode=mode)
        torch.testing.assert_close(y[:, part], alone, **TIGHT)
        torch.testing.assert_close(states[n:n + 1], state, **TIGHT)
    whole, _ = ssd(x, dt, A, B_, C_, D=D, initial_state=h0[:1], mode=mode)  # unpacked: the state crosses
    assert not torch.allclose(whole[:, 3:], y[:, 3:])


def test_state_layout_converters_round_trip():
    s = torch.randn(3, 6, 5, 7, dtype=F64)  # (B, Hv, E, Ev)
    vk = state_kv_to_vk(s)
    assert vk.shape == (3, 6, 7, 5) and vk.is_contiguous()
    assert torch.equal(state_vk_to_kv(vk), s)
    assert torch.equal(state_kv_to_vk(state_vk_to_kv(vk)), vk)
    q = torch.randn(3, 6, 5, dtype=F64)
    read_kv = torch.einsum("bhef,bhe->bhf", s, q)  # o = S^T q, key channels first
    read_vk = (vk @ q[..., None])[..., 0]  # (B, Hv, Ev, E) x (B, Hv, E, 1): o = S q, value channels first
    torch.testing.assert_close(read_vk, read_kv, **TIGHT)


# --- precision: low-precision forms against the float64 recurrence -------------------------------


def test_float32_chunked_within_twice_the_float32_recurrence_error():
    # the rule of attention-gym's KDA check: |fast - ref64| <= 2 (|slow32 - ref64| + eps32 max|ref64|)
    x = make(length=64, seed=7)
    ref, ref_state = run("gdn", x, output_final_state=True)
    x32 = {n: t.float() for n, t in x.items()}
    slow, slow_state = run("gdn", x32, output_final_state=True)
    fast, fast_state = run("gdn", x32, output_final_state=True, mode="chunked", chunk_size=16)
    eps = torch.finfo(torch.float32).eps
    for got, base, want in ((fast, slow, ref), (fast_state, slow_state, ref_state)):
        budget = 2 * ((base.double() - want).abs().max() + eps * want.abs().max())
        assert (got.double() - want).abs().max() <= budget


def test_half_inputs_give_half_output_and_a_float32_state():
    x = {n: t.half() for n, t in make().items()}
    out, state = run("gdn", x, output_final_state=True, mode="chunked", chunk_size=4)
    assert out.dtype == torch.float16 and state.dtype == torch.float32


# --- oracle: transformers' own torch fallbacks ---------------------------------------------------


def _transformers_module(name):
    pytest.importorskip("transformers")
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


ORACLE_TOL = {"rtol": 1e-5, "atol": 2e-6}  # they compute in float32; float64 here; L = 11


@pytest.mark.parametrize("which", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_oracle_qwen3_next_gated_delta_rule(which):
    fn = getattr(_transformers_module("qwen3_next"), which)
    x = make()
    kw = {"chunk_size": 4} if "chunk" in which else {}
    theirs, their_state = fn(*(x[n].float() for n in ("q", "k", "v", "g", "beta")),
                             initial_state=x["initial_state"].float(), output_final_state=True,
                             use_qk_l2norm_in_kernel=True, **kw)
    ours, our_state = run("gdn", x, output_final_state=True, mode="chunked" if kw else "recurrent", chunk_size=4)
    torch.testing.assert_close(theirs.double(), ours, **ORACLE_TOL)
    torch.testing.assert_close(their_state.double(), our_state, **ORACLE_TOL)


@pytest.mark.parametrize("which", ["recurrent_kimi_delta_attention", "chunk_kimi_delta_attention"])
def test_oracle_kimi_linear_kda(which):
    fn = getattr(_transformers_module("kimi_linear"), which)
    x = make("kda", h=HV)  # Kimi Linear's functions have as many q/k heads as v heads
    kw = {"chunk_size": 4} if "chunk" in which else {}
    theirs, their_state = fn(*(x[n].float() for n in ("q", "k", "v", "g", "beta")),
                             initial_state=x["initial_state"].float(), output_final_state=True,
                             use_qk_l2norm_in_kernel=True, **kw)
    ours, our_state = run("kda", x, output_final_state=True, mode="chunked" if kw else "recurrent", chunk_size=4)
    torch.testing.assert_close(theirs.double(), ours, **ORACLE_TOL)
    torch.testing.assert_close(their_state.double(), our_state, **ORACLE_TOL)


# --- errors --------------------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_values():
    x = make()
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=r"g is the log of the decay and must be <= 0.*torch.log\(alpha\)"):
        gated_delta_rule(q, k, v, g.exp(), beta)
    with pytest.raises(ValueError, match=r"g must have shape \(B, L, Hv, E\)=\(3, 11, 6, 5\), got \(3, 11, 6\)"):
        kimi_delta_attention(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"Hv=6 must be a multiple of q's and k's heads H=4"):
        gated_delta_rule(q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1), v, g, beta)
    with pytest.raises(ValueError, match=r"mode must be one of 'recurrent', 'chunked', got 'quadratic'"):
        gated_delta_rule(q, k, v, g, beta, mode="quadratic")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match=r"B must be 1, got B=3"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 11]))
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length L = 11, got cu_seqlens\[-1\] = 10"):
        gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be an integer tensor"):
        gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0.0, 11.0]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, Hv, E, Ev\)=\(3, 6, 5, 7\)"):
        gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(3, 6, 7, 5, dtype=F64))
    with pytest.raises(TypeError, match=r"v must have the same dtype as q \(torch.float64\), got torch.float32"):
        gated_delta_rule(q, k, v.float(), g, beta)
    with pytest.raises(ValueError, match=r"beta must have shape \(B, L, Hv\)=\(3, 11, 6\), got \(3, 11, 2\)"):
        gated_delta_rule(q, k, v, g, beta[..., :2])
    with pytest.raises(TypeError, match=r"normalize must be a bool, got int"):
        linear_attention(q, k, v, normalize=1)
    dt, A = torch.rand(1, 4, 2, dtype=F64), torch.rand(2, dtype=F64)
    Bm = torch.randn(1, 4, 1, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"A must be <= 0 \(A = -exp\(A_log\)\)"):
        ssd(torch.randn(1, 4, 2, 5, dtype=F64), dt, A, Bm, Bm)
    with pytest.raises(ValueError, match=r"dt must be >= 0"):
        ssd(torch.randn(1, 4, 2, 5, dtype=F64), -dt, -A, Bm, Bm)
    with pytest.raises(ValueError, match=r"state must have at least 2 dims \(\.\.\., E, Ev\), got shape \(5,\)"):
        state_kv_to_vk(torch.zeros(5))
    x = make()
    for flag, fn in (("use_qk_l2norm", "gdn"), ("output_final_state", "kda")):  # a truthy str is no bool
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got str"):
            run(fn, make(fn), **{flag: "no"})
    with pytest.raises(TypeError, match="output_final_state must be a bool, got int"):
        gated_linear_attention(x["q"], x["k"], x["v"], x["g"], output_final_state=1)
    q, k, v = make(h=HV)["q"], make(h=HV)["k"], make(h=HV)["v"]
    with pytest.raises(ValueError, match=r"g must have shape \(B, L, Hv\) per head \(or \(B, L, Hv, E\) per key "
                                         r"channel\)=\(3, 11, 6\), got \(3, 11\)"):
        gated_linear_attention(q, k, v, -torch.rand(B, L, dtype=F64))
    with pytest.raises(ValueError, match=r"g must have shape \(B, L, Hv, E\) per key channel=\(3, 11, 6, 5\), "
                                         r"got \(3, 11, 6, 4\)"):
        gated_linear_attention(q, k, v, -torch.rand(B, L, HV, 4, dtype=F64))
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        gated_linear_attention(q, k, v, -torch.rand(B, L, HV, dtype=F64), mode="chunked", chunk_size=0)
    with pytest.raises(ValueError, match=r"mode must be one of 'recurrent', 'quadratic', 'chunked', got 'scan'"):
        gated_linear_attention(q, k, v, -torch.rand(B, L, HV, dtype=F64), mode="scan")


def test_oracle_tiny_qwen3_next_with_attention_ref_linear_layers(monkeypatch):
    """A tiny random Qwen3-Next (3 linear layers, 1 full) gives the same logits, prefill and one
    decoding step, when its linear layers call gated_delta_rule instead of transformers' own."""
    module = _transformers_module("qwen3_next")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, layer_types=["linear_attention"] * 3
                             + ["full_attention"])
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 9))

    def logits():
        with torch.no_grad():
            prefill = model(ids[:, :8], use_cache=True)
            step = model(ids[:, 8:], **with_cache(returned_cache(prefill)), use_cache=True)
        return prefill.logits, step.logits

    theirs = logits()
    calls = []

    def ours(mode):
        def gdn(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **model_kwargs):
            assert set(model_kwargs) <= {"use_cache", "output_router_logits"}, model_kwargs  # unused
            calls.append(mode)
            return gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                    output_final_state=output_final_state, mode=mode, chunk_size=chunk_size,
                                    cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm_in_kernel)
        return gdn

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", ours("chunked"))
    monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule", ours("recurrent"))
    mine = logits()
    assert calls == ["chunked"] * 3 + ["recurrent"] * 3  # prefill chunked, the decoding step recurrent
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 model


# Issue 39: a gate of -inf (a full reset, a legitimate value) or -1e38 made the chunked form NaN
# (gamma_i - gamma_j = -inf - -inf); the recurrence was right.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_form_takes_gates_of_minus_infinity(dtype, per_channel):
    g0 = torch.Generator().manual_seed(5)
    B, L, H, E = 2, 23, 2, 8
    q, k, v = (torch.randn(B, L, H, E, generator=g0, dtype=dtype) for _ in range(3))
    gate_shape = (B, L, H, E) if per_channel else (B, L, H)
    g = -torch.rand(gate_shape, generator=g0, dtype=dtype)
    g[0, 5] = float("-inf")  # a full reset inside the first chunk
    g[1, 13] = -1e38  # huge: the cumulative sum overflows in float32
    g[1, 20] = float("-inf")
    beta = torch.rand(B, L, H, generator=g0, dtype=dtype)
    fn = linear.kimi_delta_attention if per_channel else linear.gated_delta_rule
    results = []
    for mode in ("recurrent", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        out, state = fn(leaves[0], leaves[1], leaves[2], g, leaves[3], mode=mode, chunk_size=8,
                        output_final_state=True)
        (out.sum() + state.sum()).backward()
        results.append([out, state] + [t.grad for t in leaves])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for a, b in zip(*results):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, **tol)
