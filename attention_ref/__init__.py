"""Reference implementations of self-attention, verified against PyTorch.

Shape legend, used in every docstring and comment of this package:

- ``B`` batch size
- ``H`` number of (query) heads
- ``Hkv`` number of key/value heads (grouped-query attention: ``H`` is a multiple of ``Hkv``)
- ``L`` query (target) sequence length
- ``S`` key/value (source) sequence length
- ``E`` query/key size (per head in the functional core), written ``d_k`` in formulas
- ``Ev`` value size
- ``D`` the head size when ``E == Ev``
- ``d`` model width (embedding size); ``d = H * D`` in multi-head attention

Mask convention: a boolean mask holds ``True`` where a query-key pair *takes part*
in attention (the convention of ``torch.nn.functional.scaled_dot_product_attention``).
``torch.nn.MultiheadAttention`` uses the opposite polarity for its boolean masks;
`attention_ref.masks.from_key_padding_mask` converts at the boundary.
A float mask is added to the scores.

``attention_ref.viz`` (plotting) needs the optional ``matplotlib`` extra and is
imported on first use, so ``import attention_ref`` needs only torch and numpy.
``attention_ref.diagrams`` (the SVG diagrams of the pages) is imported on first use
too: ``import attention_ref`` loads what computes attention, and nothing that draws.
"""

from __future__ import annotations

import importlib
from typing import Any

from attention_ref import (
    block_mask,
    complexity,
    conventions,
    distributed,
    kv_cache,
    masks,
    mods,
    positional,
    sinks,
    testing,
    tiled,
    varlen,
)
from attention_ref.functional import attention_weights, merge_attention, scaled_dot_product_attention
from attention_ref.masks import (
    causal_mask,
    combine_masks,
    from_key_padding_mask,
    padding_mask,
    padding_mask_from_tokens,
    to_additive,
)
from attention_ref.multihead import MultiHeadAttention
from attention_ref.sinks import add_sinks

__all__ = [
    "MultiHeadAttention",
    "add_sinks",
    "attention_weights",
    "block_mask",
    "causal_mask",
    "combine_masks",
    "complexity",
    "conventions",
    "diagrams",
    "distributed",
    "from_key_padding_mask",
    "kv_cache",
    "masks",
    "merge_attention",
    "mods",
    "padding_mask",
    "padding_mask_from_tokens",
    "positional",
    "scaled_dot_product_attention",
    "sinks",
    "testing",
    "tiled",
    "to_additive",
    "varlen",
    "viz",
]

__version__ = "0.1.0"


#: The modules that draw, loaded on first use (`viz` imports matplotlib, an optional extra).
_DRAWING = ("diagrams", "viz")


def __getattr__(name: str) -> Any:
    if name in _DRAWING:
        return importlib.import_module(f"attention_ref.{name}")
    raise AttributeError(f"module 'attention_ref' has no attribute {name!r}")
