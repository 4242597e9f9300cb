"""attention_ref.testing.assert_linear_attention_close: right delta-rule kernels pass, wrong ones fail.

The right kernels: this package's chunked form in float32, float16 and bfloat16 (Gated
DeltaNet and Kimi Delta Attention, a short last chunk, an initial state, packed
sequences) and transformers' own PyTorch versions of Qwen3-Next's layer. The wrong ones
are the disagreements people report between the two forms: an initial state ignored,
packed sequences run as one, the decay left out of the in-chunk mask, a short last
chunk dropped, q and k not normalised, a float16 state. Each must fail, and where a
probe can tell, the message must name the cause.
"""

from __future__ import annotations

import pytest
import torch

from attention_ref import linear
from attention_ref.linear import gated_delta_rule, kimi_delta_attention, state_kv_to_vk
from attention_ref.testing import assert_linear_attention_close

B, L, H, HV, E, EV = 2, 37, 2, 4, 8, 6  # L = 37: a short last chunk for any chunk size here
BOUNDS = [0, 9, 9, 30, 37]  # packed: sequences of 9, 0, 21 and 7 tokens


def make(kind="gdn", *, b=B, length=L, dtype=torch.float32, seed=0, states=None):
    """Random inputs in ``dtype`` (log gates in [-0.3, 0], beta in [0, 1)) and an entry state per sequence."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, length, H, E, generator=gen) for _ in range(2))
    v = torch.randn(b, length, HV, EV, generator=gen)
    g = -0.3 * torch.rand((b, length, HV) if kind == "gdn" else (b, length, HV, E), generator=gen)
    beta = torch.rand(b, length, HV, generator=gen)
    h0 = torch.randn(states or b, HV, E, EV, generator=gen)
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    return {n: t.to(dtype) for n, t in x.items()}, h0


FORMS = {"gdn": gated_delta_rule, "kda": kimi_delta_attention}


def chunked(kind, x, **kw):
    return FORMS[kind](**x, mode="chunked", chunk_size=16, output_final_state=True, **kw)


def check(out, x, **kw):
    return assert_linear_attention_close(out, *x.values(), **kw)


# --- right kernels pass --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_chunked_form_passes_in_each_dtype(kind, dtype):
    x, h0 = make(kind, dtype=dtype)
    out, state = chunked(kind, x, initial_state=h0)
    report = check(out, x, actual_state=state, initial_state=h0)
    assert report.quantities == ("output", "final_state") and report.bound == "row"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_long_sequence_of_large_values_passes(dtype):
    # 256 tokens, values ~1000, slow decay: the state grows to ~2600, and its float32 rounding with it
    x, _ = make(dtype=dtype, length=256)
    x["v"], x["g"] = x["v"] * 1000, x["g"] / 30
    out, state = chunked("gdn", x)
    check(out, x, actual_state=state)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_packed_sequences_and_the_other_state_layout_pass(kind):
    x, h0 = make(kind, b=1, states=len(BOUNDS) - 1)
    cu = torch.tensor(BOUNDS)
    out, state = chunked(kind, x, initial_state=h0, cu_seqlens=cu)
    check(out, x, actual_state=state_kv_to_vk(state), initial_state=h0, cu_seqlens=cu, state_layout="vk")


@pytest.mark.parametrize("which", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_transformers_qwen3_next_kernels_pass(which):
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, h0 = make(b=1)
    kw = {"chunk_size": 16} if "chunk" in which else {}
    out, state = getattr(module, which)(*x.values(), initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, **kw)
    check(out, x, actual_state=state, initial_state=h0)


# --- wrong kernels fail --------------------------------------------------------------------------


def failure(out, x, **kw) -> str:
    with pytest.raises(AssertionError) as caught:
        check(out, x, **kw)
    return str(caught.value)


def test_an_ignored_initial_state_fails_and_is_named():
    x, h0 = make()
    out, state = chunked("gdn", x)  # the kernel started from zeros
    message = failure(out, x, actual_state=state, initial_state=h0)
    assert "likely cause: the initial state is ignored" in message
    assert "final_state:" in message and "config: gated_delta_rule" in message


def test_packed_sequences_run_as_one_fail_and_are_named():
    x, h0 = make(b=1, states=len(BOUNDS) - 1)
    out, _ = chunked("gdn", x, initial_state=h0[:1])  # no reset at the boundaries
    message = failure(out, x, initial_state=h0, cu_seqlens=torch.tensor(BOUNDS))
    assert "likely cause: the packed sequences run as one" in message


def test_unnormalised_queries_and_keys_fail_and_are_named():
    x, _ = make()
    x["q"], x["k"] = 0.2 * x["q"], 0.2 * x["k"]  # |k|^2 ~ 0.3: the unnormalised delta rule stays stable
    out, _ = chunked("gdn", x, use_qk_l2norm=False)
    assert "likely cause: q and k are not L2-normalised" in failure(out, x)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_plain_causal_mask_inside_the_chunks_fails(kind, monkeypatch):
    # the decay left out within each chunk (a causal mask of ones), still applied between chunks
    def plain_causal(gamma):  # (..., C, 1 or E) -> (..., C, C, 1 or E): 1 where j <= i, as _decay's shape
        C = gamma.shape[-2]
        ones = torch.ones(C, C, dtype=gamma.dtype).tril()[:, :, None]  # (C, C, 1)
        return ones.expand(*gamma.shape[:-2], C, C, gamma.shape[-1])

    x, _ = make(kind)
    monkeypatch.setattr(linear, "_decay", plain_causal)
    # a decay per channel is factored into the rows (linear._channel_scores): leave it out there too
    monkeypatch.setattr(linear, "_factored_scores", lambda a, b, gamma, r: a @ b.transpose(-1, -2))
    wrong, _ = chunked(kind, x)
    monkeypatch.undo()
    right, _ = chunked(kind, x)
    assert (wrong - right).abs().max() > 1e-2, "the planted bug must change the output"
    assert "output:" in failure(wrong, x)
    check(right, x)


def test_a_dropped_short_last_chunk_fails():
    x, _ = make()
    out, _ = chunked("gdn", x)
    out[:, -(L % 16):] = 0  # the 5 tokens after the last whole chunk of 16
    message = failure(out, x)
    assert f"{B * (L % 16) * HV} of {B * L * HV} token rows out of bounds" in message


def test_a_float16_state_fails_where_a_float32_state_passes(monkeypatch):
    # large values, slow decay: a float16 state rounds each step's update away; kernels keep it in float32
    x, _ = make(dtype=torch.float16, length=64)
    x["v"] = x["v"] * 1000
    x["g"] = x["g"] / 30
    out, state = chunked("gdn", x)
    check(out, x, actual_state=state)
    monkeypatch.setattr(linear, "_compute_dtype", lambda dtype: dtype)  # the state in the inputs' float16
    out16, state16 = gated_delta_rule(**x, mode="recurrent", output_final_state=True)
    monkeypatch.undo()  # the checker's own baseline keeps its float32 state
    assert state16.dtype == torch.float16
    message = failure(out16, x, actual_state=state16)
    assert "output:" in message and "final_state:" in message


def test_a_wrong_final_state_fails_alone():
    x, h0 = make()
    out, state = chunked("gdn", x, initial_state=h0)
    message = failure(out, x, actual_state=state * 1.01, initial_state=h0)
    assert "1 of 2 quantities out of bounds" in message and "final_state:" in message


# --- arguments -----------------------------------------------------------------------------------


def test_errors_name_the_argument():
    x, _ = make()
    out, state = chunked("gdn", x)
    with pytest.raises(TypeError, match="actual must be a floating-point torch.Tensor, got list"):
        check([1.0], x)
    with pytest.raises(ValueError, match=r"actual must have shape \(B, L, Hv, Ev\) = \(2, 37, 4, 6\), got \(2, 37, 4, 5\)"):
        check(out[..., :5], x)
    with pytest.raises(ValueError, match=r"actual_state must have shape \(N, Hv, Ev, E\)"):
        check(out, x, actual_state=state, state_layout="vk")
    with pytest.raises(ValueError, match="state_layout must be one of 'kv', 'vk', got 'ek'"):
        check(out, x, state_layout="ek")
    with pytest.raises(ValueError, match=r"g must be a tensor of shape \(B, L, Hv\)"):
        assert_linear_attention_close(out, x["q"], x["k"], x["v"], x["g"][0], x["beta"])
    with pytest.raises(ValueError, match="factor must be finite and > 0, got -1"):
        check(out, x, factor=-1)
    with pytest.raises(TypeError, match="beta must be a floating-point torch.Tensor, got NoneType"):
        assert_linear_attention_close(out, x["q"], x["k"], x["v"], x["g"], None)
    with pytest.raises(TypeError, match="use_qk_l2norm must be a bool, got str"):  # checked by gated_delta_rule
        check(out, x, use_qk_l2norm="no")
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'mode'"):
        check(out, x, mode="chunked")
    with pytest.raises(ValueError, match="g is the log of the decay and must be <= 0"):  # checked by gated_delta_rule
        assert_linear_attention_close(out, x["q"], x["k"], x["v"], -x["g"], x["beta"])
