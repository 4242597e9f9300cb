r"""The scenario families beyond the attention matrix: NSA, MoBA and FP8, each a call of its own.

A kernel of one of these families takes other arguments than an attention
kernel (gates and block counts, chunk sizes, FP8 tensors with their descales),
so an adapter enters a family by claiming its feature, ``"nsa"``, ``"moba"`` or
``"fp8"``, and then runs that family's cases instead of the attention matrix
(`attention_ref.conformance.cases.matrix`). The scenarios are in
`attention_ref.conformance.cases`, beside the others; this module holds what a
family case is judged as, and the ranked inputs of the sparse ones:

- **NSA** (`attention_ref.nsa`, DeepSeek's Native Sparse Attention): the gates
  are 0 or 1, one branch on per query head and token, so that each output row
  is one softmax: attention over the keys and the compressed keys together,
  each row masked to its branch's keys (`nsa_as_attention`), which
  `attention_ref.testing.assert_attention_close` judges by FlashAttention's rule.
  Forward only: the compressed keys' gradient flows back through the pooling,
  which one attention over them as inputs cannot split.
- **MoBA** (`attention_ref.moba`, Kimi's Mixture of Block Attention): attention
  with the boolean mask of the chunks MoBA selects (`moba_as_attention`),
  forward and backward.
- **FP8** (`attention_ref.quant`): e4m3fn query, key and value with
  FlashAttention-3's descales, judged by
  `attention_ref.testing.assert_fp8_attention_close` with the adapter's
  `attention_ref.conformance.adapter.FP8Path`; a case's dtype is its output's.

**Selections far from a tie.** The reference selects blocks in float64; a right
kernel rounds its block scores (means of bfloat16 keys, float32 products) and
must still pick the same blocks. So the NSA and MoBA keys carry their block's
rank (`ranked_query_key`): coordinate 0 of every key of block ``c`` is
``step * level[c]``, ``level`` a random permutation per batch entry and key
head, and the other coordinates are noise with zero mean inside each block, so
a block's mean key is ``(step * level[c], 0, ..., 0)``. Coordinate 0 of each
query is the sign of its head's preference. MoBA's gate ``q . mean`` steps by
``step = sqrt(E) / 2`` from one level to the next. NSA's scaled compressed
scores span 3 over the ``N`` levels (``step = 3 sqrt(E) / (N - 1)``), and the
first query head of each group prefers the low levels, faintly (``-1/4`` where
its group's other heads have ``+1``): the group's mean still ranks the blocks as
the majority does, the first head alone the other way, so a selection by the
first head's scores picks other blocks. ``tests/test_conformance_sparse.py``
holds every case of the full matrix to a margin.

Shapes use the package legend, heads first: ``B`` batch, ``H`` query heads,
``Hkv`` key/value heads, ``L`` queries, ``S`` keys (``S = L`` for NSA and
MoBA), ``E`` query/key size, ``n`` compressed blocks (``L // block_size``).
"""

from __future__ import annotations

import torch

from attention_ref import moba as _moba
from attention_ref import nsa as _nsa
from attention_ref.sparse import block_topk_indices, topk_mask

__all__ = ["FAMILIES", "GATES", "fp8_format", "moba_as_attention", "nsa_as_attention", "ranked_query_key"]

#: The families beyond the attention matrix, each named by the feature an adapter claims to run it.
FAMILIES = ("nsa", "moba", "fp8")

#: NSA's gates, one per query head and token: the compressed, selected and sliding-window branches'.
GATES = ("g_cmp", "g_slc", "g_swa")


def ranked_query_key(g: torch.Generator, B: int, H: int, Hkv: int, L: int, E: int, block: int,
                     signs: torch.Tensor, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` ``(B, H, L, E)`` and ``key`` ``(B, Hkv, L, E)`` whose blocks' mean keys rank them apart.

    Coordinate 0 of the keys of block ``c`` is ``step * level[b, hkv, c]``
    (``level`` a random permutation of ``0 .. ceil(L / block) - 1``); the other
    coordinates are N(0, 1) less their block's mean, so each block's mean key is
    ``(step * level, 0, ..., 0)``. Coordinate 0 of the queries is ``signs``
    (``(H,)`` or ``(B, H)``), the rest N(0, 1).

    Examples:
        >>> q, k = ranked_query_key(torch.Generator().manual_seed(0), 1, 1, 1, 6, 4, 2, torch.ones(1), 0.5)
        >>> k[0, 0, :, 1:].unflatten(0, (3, 2)).mean(1).abs().max() < 1e-6  # blocks of 2: no mean but coordinate 0
        tensor(True)
        >>> k[0, 0, ::2, 0].tolist(), q[0, 0, :, 0].tolist()  # 0.5 times the levels of blocks 0, 1, 2
        ([1.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    """
    N = -(-L // block)
    key = torch.randn(B, Hkv, L, E, generator=g)
    for a in range(0, L, block):  # no mean inside a block but in coordinate 0
        key[..., a:a + block, 1:] -= key[..., a:a + block, 1:].mean(-2, keepdim=True)
    levels = torch.stack([torch.randperm(N, generator=g) for _ in range(B * Hkv)]).reshape(B, Hkv, N)
    key[..., 0] = step * levels.repeat_interleave(block, dim=-1)[..., :L]  # (B, Hkv, N) -> (B, Hkv, L)
    query = torch.randn(B, H, L, E, generator=g)
    query[..., 0] = signs.unsqueeze(-1)  # (H,) or (B, H) -> broadcast over the L positions
    return query, key


# --- NSA ------------------------------------------------------------------------------------------------


def nsa_as_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     args: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """NSA with gates of 0 or 1 as one attention: over the keys and the compressed keys, each row to its branch's.

    A row whose selected branch is on sees the keys of the blocks
    `attention_ref.nsa.select_blocks` picks for its group, causally; a row of
    the sliding window the last ``window_size`` keys up to itself; a row of the
    compressed branch the compressed blocks that end at or before it. The
    selection and the compressed keys are computed in float64 from the case's
    inputs, and the compressed keys rounded to their dtype, as a kernel's input.

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B, Hkv, L, E)``.
        value: ``(B, Hkv, L, Ev)``.
        args: the Problem's fields: ``block_size``, ``block_counts``, ``window_size``,
            ``scale`` and the gates ``(B, H, L)``, each 0 or 1, one of them 1.

    Returns:
        ``(key, value, {"attn_mask": keep})``: ``(B, Hkv, L + n, E)``, ``(B, Hkv, L + n, Ev)``
        and ``keep`` ``(B, H, L, L + n)`` bool, ``True`` = takes part (the
        opposite of ``torch.nn.MultiheadAttention``).

    Raises:
        ValueError: a gate other than 0 or 1, or a row with no branch or two on.
    """
    on = {name: args[name] == 1 for name in GATES}  # (B, H, L) bool each
    if not all(((args[name] == 0) | on[name]).all() for name in GATES) or not (sum(on.values()) == 1).all():
        raise ValueError("NSA judged as one attention needs gates of 0 or 1, one branch on per query head and token")
    q, k, v = (t.detach().to(torch.float64) for t in (query, key, value))
    block_size, L = args["block_size"], q.shape[-2]
    groups = q.shape[-3] // k.shape[-3]
    k_cmp, v_cmp = _nsa.compress_blocks(k, block_size), _nsa.compress_blocks(v, block_size)  # (B, Hkv, n, E)
    chosen = _nsa.select_blocks(q, k_cmp, block_size=block_size, block_counts=args["block_counts"],
                                scale=args.get("scale"))  # (B, Hkv, L, k)
    positions = torch.arange(L, device=q.device)
    causal = positions <= positions[:, None]  # (L, S): key j <= query i
    per_head = chosen.repeat_interleave(groups, dim=-3)  # (B, Hkv, L, k) -> (B, H, L, k): head h reads group h // G
    selected = topk_mask(block_topk_indices(per_head, block_size, L), L) & causal  # (B, H, L, S)
    window = causal & (positions > positions[:, None] - args["window_size"])  # (L, S): i - w < j <= i
    blocks = torch.arange(k_cmp.shape[-2], device=q.device)
    visible = (blocks + 1) * block_size - 1 <= positions[:, None]  # (L, n): block c ends at or before query i
    keep = torch.cat([(on["g_slc"].unsqueeze(-1) & selected) | (on["g_swa"].unsqueeze(-1) & window),
                      on["g_cmp"].unsqueeze(-1) & visible], dim=-1)  # (B, H, L, S + n)
    key_all = torch.cat([key, k_cmp.to(key.dtype)], dim=-2)  # (B, Hkv, S, E) + (B, Hkv, n, E) -> (B, Hkv, S + n, E)
    value_all = torch.cat([value, v_cmp.to(value.dtype)], dim=-2)
    return key_all, value_all, {"attn_mask": keep}


# --- MoBA -----------------------------------------------------------------------------------------------


def moba_as_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      args: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """MoBA as attention with a boolean mask: `attention_ref.moba.moba_mask` of float64 copies of the inputs.

    Returns:
        ``(key, value, {"attn_mask": keep})``, ``keep`` ``(B, H, L, S)`` bool,
        ``True`` = takes part (the opposite of ``torch.nn.MultiheadAttention``):
        the selected chunks' keys, causal.
    """
    q, k = (t.detach().to(torch.float64) for t in (query, key))
    keep = _moba.moba_mask(q, k, args["moba_chunk_size"], args["moba_topk"], enable_gqa=bool(args["enable_gqa"]))
    return key, value, {"attn_mask": keep}


# --- FP8 ------------------------------------------------------------------------------------------------


def fp8_format(dtype: torch.dtype) -> str:
    """The name of an FP8 dtype's format in `attention_ref.quant.FORMATS`.

    Examples:
        >>> fp8_format(torch.float8_e4m3fn)
        'e4m3fn'
    """
    return str(dtype).removeprefix("torch.float8_")
