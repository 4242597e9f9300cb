"""Properties of attention that hold for every input, checked with hypothesis.

Hypothesis draws the shapes, the mask and a seed; the tensors come from a torch
generator with that seed (fast, and a failing example replays exactly).
Everything is float64 with tight tolerances.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_ref import MultiHeadAttention, attention_weights, scaled_dot_product_attention, to_additive

FAST = settings(max_examples=40, deadline=None)
TOL = {"atol": 1e-12, "rtol": 1e-10}

leading = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
length = st.integers(1, 6)
seeds = st.integers(0, 2**31 - 1)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@FAST
@given(lead=leading, L=length, S=st.integers(0, 6), E=st.integers(1, 5), density=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
       additive=st.booleans(), is_causal=st.booleans(), seed=seeds)
def test_rows_sum_to_one_or_zero_when_fully_masked(lead, L, S, E, density, additive, is_causal, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = _randn(gen, *lead, L, E), _randn(gen, *lead, S, E)
    keep = torch.rand(*lead, L, S, generator=gen) < density
    mask = to_additive(keep, torch.float64) if additive else keep
    w = attention_weights(q, k, mask, is_causal=is_causal)
    assert w.shape == (*lead, L, S)
    taking_part = keep & torch.ones(L, S, dtype=torch.bool).tril() if is_causal else keep
    has_key = taking_part.any(-1)
    assert (w >= 0).all()
    assert (w[~taking_part] == 0).all()
    torch.testing.assert_close(w.sum(-1), has_key.double(), **TOL)


@FAST
@given(lead=leading, L=length, S=length, E=st.integers(1, 5), Ev=st.integers(1, 5), use_mask=st.booleans(), seed=seeds, data=st.data())
def test_permuting_queries_permutes_outputs(lead, L, S, E, Ev, use_mask, seed, data):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _randn(gen, *lead, L, E), _randn(gen, *lead, S, E), _randn(gen, *lead, S, Ev)
    mask = (torch.rand(*lead, L, S, generator=gen) < 0.7) if use_mask else None
    perm = torch.tensor(data.draw(st.permutations(range(L))))
    out = scaled_dot_product_attention(q, k, v, mask)
    permuted_mask = None if mask is None else mask[..., perm, :]
    torch.testing.assert_close(scaled_dot_product_attention(q[..., perm, :], k, v, permuted_mask), out[..., perm, :], **TOL)


@FAST
@given(lead=leading, L=length, S=length, E=st.integers(1, 5), Ev=st.integers(1, 5), use_mask=st.booleans(), seed=seeds, data=st.data())
def test_permuting_keys_and_values_together_changes_nothing(lead, L, S, E, Ev, use_mask, seed, data):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _randn(gen, *lead, L, E), _randn(gen, *lead, S, E), _randn(gen, *lead, S, Ev)
    mask = _randn(gen, *lead, L, S) if use_mask else None  # a float mask moves with its keys
    perm = torch.tensor(data.draw(st.permutations(range(S))))
    out = scaled_dot_product_attention(q, k, v, mask)
    permuted_mask = None if mask is None else mask[..., perm]
    torch.testing.assert_close(scaled_dot_product_attention(q, k[..., perm, :], v[..., perm, :], permuted_mask), out, **TOL)


@FAST
@given(lead=leading, n=st.integers(2, 7), E=st.integers(1, 5), seed=seeds, data=st.data())
def test_causal_outputs_do_not_see_later_tokens(lead, n, E, seed, data):
    t = data.draw(st.integers(0, n - 2))  # positions 0..t stay, t+1.. change
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _randn(gen, *lead, n, E), _randn(gen, *lead, n, E), _randn(gen, *lead, n, E)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[..., t + 1 :, :] = _randn(gen, *lead, n - t - 1, E) * 10
    before = scaled_dot_product_attention(q, k, v, is_causal=True)
    after = scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    torch.testing.assert_close(after[..., : t + 1, :], before[..., : t + 1, :], **TOL)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 6), seed=seeds, data=st.data())
def test_causal_multihead_does_not_see_later_tokens(n, seed, data):
    t = data.draw(st.integers(0, n - 2))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mha = MultiHeadAttention(6, 2, dtype=torch.float64)
    x = _randn(gen, 2, n, 6)
    x2 = x.clone()
    x2[:, t + 1 :] = _randn(gen, 2, n - t - 1, 6)
    torch.testing.assert_close(mha(x2, is_causal=True)[:, : t + 1], mha(x, is_causal=True)[:, : t + 1], **TOL)


@FAST
@given(lead=leading, L=length, S=length, E=st.integers(1, 5), Ev=st.integers(1, 5), additive=st.booleans(), seed=seeds)
def test_masked_keys_have_no_influence(lead, L, S, E, Ev, additive, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _randn(gen, *lead, L, E), _randn(gen, *lead, S, E), _randn(gen, *lead, S, Ev)
    keep = torch.rand(*lead, 1, S, generator=gen) < 0.6  # a key padding mask, (..., 1, S)
    mask = to_additive(keep, torch.float64) if additive else keep
    masked_keys = ~keep.squeeze(-2).unsqueeze(-1)  # (..., S, 1)
    k2 = torch.where(masked_keys, _randn(gen, *lead, S, E) * 10, k)
    v2 = torch.where(masked_keys, _randn(gen, *lead, S, Ev) * 10, v)
    before = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(scaled_dot_product_attention(q, k2, v2, mask), before, **TOL)
