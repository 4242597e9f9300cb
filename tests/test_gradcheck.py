"""Analytic gradients against finite differences (torch.autograd.gradcheck) in float64."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from attention_ref import MultiHeadAttention, attention_weights, scaled_dot_product_attention

L, S, E, EV = 3, 5, 2, 7  # small: gradcheck perturbs every input entry


def _qkv(gen: torch.Generator, *lead: int) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.randn(*lead, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
        for n, d in ((L, E), (S, E), (S, EV))
    )


def _keep(gen: torch.Generator) -> torch.Tensor:
    keep = torch.rand(2, L, S, generator=gen) < 0.6
    keep[:, :, 0] = True
    keep[1, 1] = False  # one fully masked row
    return keep


@pytest.mark.parametrize("case", ["plain", "bool_mask", "float_mask", "causal", "causal_and_bool", "all_masked_row"])
def test_gradcheck_sdpa(case, generator):
    q, k, v = _qkv(generator, 2)
    keep = _keep(generator)
    mask = None
    is_causal = case.startswith("causal")
    if case in ("bool_mask", "causal_and_bool", "all_masked_row"):
        mask = keep
    if case == "all_masked_row":
        mask = keep.clone()
        mask[0] = False  # a whole batch entry with no key at all
    if case == "float_mask":  # the float mask is an input too: its gradient is checked as well
        mask = torch.randn(2, L, S, generator=generator, dtype=torch.float64, requires_grad=True)

    def fn(*args):
        return scaled_dot_product_attention(*args[:3], args[3] if len(args) > 3 else mask, is_causal=is_causal, scale=0.7)

    inputs = (q, k, v, mask) if case == "float_mask" else (q, k, v)
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


def test_gradcheck_weights_and_gqa(generator):
    q = torch.randn(1, 4, L, E, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, S, E, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, S, EV, generator=generator, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(L, S, dtype=torch.bool)
    keep[2] = False
    assert gradcheck(lambda a, b: attention_weights(a, b, keep, enable_gqa=True), (q, k))
    assert gradcheck(lambda a, b, c: scaled_dot_product_attention(a, b, c, keep, enable_gqa=True, is_causal=True), (q, k, v))


def test_gradcheck_multihead(generator):
    torch.manual_seed(0)
    mha = MultiHeadAttention(6, 3, kdim=5, dtype=torch.float64)
    x = torch.randn(2, L, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, S, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, S, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda a, b, c: mha(a, b, c, is_causal=True), (x, y, z))
