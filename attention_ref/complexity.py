r"""Cost of one attention layer: parameters, FLOPs and memory, as closed formulas.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` query length,
``S`` key length, ``E`` query/key size per head, ``Ev`` value size per head.
A multi-head layer of width ``d = H * E`` (with ``Ev = E``) costs

$$
\underbrace{2 B L d^2 + 2 B S d\,(d_k + d_v) + 2 B L d^2}_{\text{projections}}
\;+\; \underbrace{2 B H L S (E + E_v)}_{QK^\top \text{ and } WV}
$$

multiply-add FLOPs (one multiply-add counts 2), i.e. ``O(n d^2 + n^2 d)`` for
``n = L = S``: the projections dominate for short sequences, the ``n x n``
score matrix for long ones. Softmax and masking (``O(B H L S)``) are not counted,
as ``torch.utils.flop_counter.FlopCounterMode`` does not count them either.
"""

from __future__ import annotations

from attention_ref._validation import check_positive_int

__all__ = [
    "attention_flops",
    "attention_memory_bytes",
    "causal_pairs",
    "layer_flops",
    "parameter_count",
    "projection_flops",
    "sliding_window_pairs",
]


def _nonneg(**sizes: int) -> None:
    for name, value in sizes.items():
        check_positive_int(name, value, allow_zero=True)


def causal_pairs(L: int, S: int) -> int:
    r"""Number of (query, key) pairs kept by a top-left causal mask.

    Query ``i`` sees keys ``0..min(i, S-1)``: $\sum_{i<L} \min(i+1, S)$,
    which is ``L (L + 1) / 2`` when ``L = S``.

    Examples:
        >>> causal_pairs(4, 4)
        10
    """
    _nonneg(L=L, S=S)
    full = min(L, S)  # rows 0..full-1 see i + 1 keys, later rows see all S
    return full * (full + 1) // 2 + (L - full) * S


def sliding_window_pairs(L: int, window: int) -> int:
    r"""Number of (query, key) pairs kept by a causal sliding window over ``L`` tokens.

    Query ``i`` sees the ``w = window`` most recent keys, itself included:
    key ``j`` when $i - w < j \le i$, that is $\min(i + 1, w)$ keys. With
    $w' = \min(w, L)$ the total is $w'(w' + 1)/2 + (L - w')\,w'$: linear in ``L``
    for a fixed window, where the dense causal mask keeps ``L (L + 1) / 2``
    (`causal_pairs`, which a window of ``L`` or more gives back).

    Examples:
        >>> sliding_window_pairs(5, 2)  # rows keep 1, 2, 2, 2, 2 keys
        9
    """
    _nonneg(L=L)
    check_positive_int("window", window)
    w = min(window, L)
    return w * (w + 1) // 2 + (L - w) * w


def attention_flops(B: int, H: int, L: int, S: int, E: int, Ev: int, causal: bool = False) -> int:
    r"""FLOPs of the two matrix products of scaled dot-product attention.

    $$
    \underbrace{2 B H L S E}_{Q K^\top} + \underbrace{2 B H L S E_v}_{W V}
    $$

    With ``causal=True`` only the pairs a causal mask keeps are counted
    (`causal_pairs` instead of ``L * S``): the work a kernel that skips masked
    blocks must do. The reference path computes all ``L * S`` pairs either way.

    Examples:
        >>> attention_flops(B=1, H=1, L=2, S=3, E=4, Ev=5)
        108
    """
    _nonneg(B=B, H=H, L=L, S=S, E=E, Ev=Ev)
    pairs = causal_pairs(L, S) if causal else L * S
    return 2 * B * H * pairs * (E + Ev)


def projection_flops(
    B: int, L: int, S: int, embed_dim: int, kdim: int | None = None, vdim: int | None = None, num_kv_heads_width: int | None = None
) -> int:
    r"""FLOPs of the four linear projections of a multi-head layer (biases not counted).

    $$
    \underbrace{2 B L d^2}_{W^Q} + \underbrace{2 B S d_k d_{kv}}_{W^K}
    + \underbrace{2 B S d_v d_{kv}}_{W^V} + \underbrace{2 B L d^2}_{W^O}
    $$

    ``d = embed_dim``, ``d_k = kdim``, ``d_v = vdim`` (both default to ``d``), and
    ``d_kv = num_kv_heads_width`` the width of the key/value projections
    (``num_kv_heads * head_dim``, defaults to ``d``).
    """
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    kv = embed_dim if num_kv_heads_width is None else num_kv_heads_width
    _nonneg(B=B, L=L, S=S, embed_dim=embed_dim, kdim=kdim, vdim=vdim, num_kv_heads_width=kv)
    return 2 * B * L * embed_dim * embed_dim * 2 + 2 * B * S * kv * (kdim + vdim)


def layer_flops(B: int, H: int, L: int, S: int, embed_dim: int, *, kdim: int | None = None, vdim: int | None = None, causal: bool = False) -> int:
    """FLOPs of one `attention_ref.MultiHeadAttention` forward: projections + attention.

    Examples:
        >>> layer_flops(B=1, H=2, L=3, S=3, embed_dim=4)
        528
    """
    check_positive_int("H", H)
    if embed_dim % H:
        raise ValueError(f"embed_dim must be divisible by H, got embed_dim={embed_dim}, H={H}")
    D = embed_dim // H
    return projection_flops(B, L, S, embed_dim, kdim, vdim) + attention_flops(B, H, L, S, D, D, causal)


def parameter_count(embed_dim: int, *, kdim: int | None = None, vdim: int | None = None, num_heads: int = 1, num_kv_heads: int | None = None, bias: bool = True) -> int:
    r"""Parameters of one multi-head attention layer.

    $$
    \underbrace{d^2 + d}_{W^Q, b^Q} + \underbrace{d_k d_{kv} + d_{kv}}_{W^K, b^K}
    + \underbrace{d_v d_{kv} + d_{kv}}_{W^V, b^V} + \underbrace{d^2 + d}_{W^O, b^O}
    $$

    which is ``4 d^2 + 4 d`` for self-attention. The count does not depend on the
    number of heads (heads split ``d``), except through ``d_kv = num_kv_heads * d / H``.

    Examples:
        >>> parameter_count(512)
        1050624
    """
    check_positive_int("embed_dim", embed_dim)
    check_positive_int("num_heads", num_heads)
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int("kdim", kdim)
    check_positive_int("vdim", vdim)
    check_positive_int("num_kv_heads", num_kv_heads)
    if embed_dim % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"embed_dim must be divisible by num_heads and num_heads by num_kv_heads, got "
            f"embed_dim={embed_dim}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    kv = num_kv_heads * (embed_dim // num_heads)
    weights = embed_dim * embed_dim * 2 + kdim * kv + vdim * kv
    biases = (2 * embed_dim + 2 * kv) if bias else 0
    return weights + biases


def attention_memory_bytes(B: int, H: int, L: int, S: int, E: int, Ev: int, *, bytes_per_element: int = 4, materialize_weights: bool = True) -> dict[str, int]:
    """Bytes held by one attention call's tensors.

    Returns a dict with ``inputs`` (Q, K, V: ``B H (L E + S E + S Ev)``),
    ``output`` (``B H L Ev``) and ``weights`` (the ``B H L S`` score/weight matrix
    the reference path materialises, 0 when ``materialize_weights=False`` as in
    the tiled and fused kernels), each times ``bytes_per_element``.

    Examples:
        >>> attention_memory_bytes(1, 1, 32768, 32768, 64, 64)["weights"] // 2**30
        4
    """
    _nonneg(B=B, H=H, L=L, S=S, E=E, Ev=Ev, bytes_per_element=bytes_per_element)
    per = bytes_per_element
    return {
        "inputs": B * H * (L * E + S * E + S * Ev) * per,
        "output": B * H * L * Ev * per,
        "weights": B * H * L * S * per if materialize_weights else 0,
    }
