"""Shared fixtures for the core tests: PyTorch's reference call and per-dtype tolerances.

Sizes in the tests are distinct primes (3, 5, 7, 11, 13) wherever the API allows,
so a swapped axis changes a shape and fails loudly instead of passing by accident.
"""

from __future__ import annotations

from collections.abc import Callable

import os

import pytest
import torch

# On a machine without CUDA, Triton kernels can only run under Triton's interpreter, and
# TRITON_INTERPRET=1 must be set before triton is first imported in the process (the docs
# blocks collected by tests/docs call the kernel in this process). torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.nn.functional as F

# (atol, rtol) for comparing attention_ref with PyTorch in each dtype. float64 is
# tight: the two compute the same formula, only the order of the roundings differs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype=None)`` with the tolerance of ``dtype``."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        atol, rtol = TOLERANCES[dtype or expected.dtype]
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)

    return check


def _torch_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; a causal mask is folded into ``attn_mask``.

    PyTorch refuses ``is_causal=True`` together with ``attn_mask``, while
    attention_ref applies both. Folding the top-left causal mask into the given
    mask (AND for bool, ``-inf`` added for float) is the same computation.
    """
    if is_causal and attn_mask is not None:
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()  # (L, S), j <= i
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & causal
        else:
            blocked = torch.zeros(L, S, dtype=attn_mask.dtype, device=query.device)
            attn_mask = attn_mask + blocked.masked_fill(~causal, float("-inf"))  # broadcasts
        is_causal = False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


@pytest.fixture
def torch_sdpa() -> Callable[..., torch.Tensor]:
    """PyTorch's SDPA with attention_ref's call signature (causal + mask allowed)."""
    return _torch_sdpa


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fixed seed, for tests that need one stream of random numbers."""
    return torch.Generator().manual_seed(20240607)
