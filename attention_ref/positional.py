"""Positions: the Transformer's sinusoidal encodings and rotary embeddings (RoPE).

Attention by itself is blind to order: permuting the keys and values together
leaves every output unchanged. Two ways to tell it where tokens sit:

- `sinusoidal` (Vaswani et al. 2017) builds a ``(length, dim)`` table that is
  *added* to the token embeddings before the first layer;
- `rope` (Su et al. 2021, RoFormer) *rotates* queries and keys inside every
  attention layer, so that the score of query ``i`` and key ``j`` depends on
  their positions only through ``i - j``.

RoPE pairs up the ``E`` features of a head and rotates pair ``j`` by the angle
``position * theta_j``, with ``theta_j = base ** (-2 j / E)``. Checkpoints
disagree on *which* features form a pair:

- **half-split** (``interleaved=False``, "rotate_half"): pairs ``(x[j], x[j + E/2])``,
  as ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb`` and GPT-NeoX;
- **interleaved** (``interleaved=True``): pairs ``(x[2j], x[2j + 1])``, as Meta's
  original Llama code (``torch.view_as_complex``) and
  ``transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb``.

The two differ only by an order of the features, so a checkpoint converts from
one to the other by reordering the rows of ``W_Q`` and ``W_K``: `rope_permutation`.

Shapes: ``L`` sequence length, ``E`` query/key size per head (even for RoPE).
"""

from __future__ import annotations

import math

import torch

from attention_ref._validation import (
    check_positive_int,
    fmt_shape,
    require_float_tensor,
    require_tensor,
)

__all__ = ["apply_rope", "rope", "rope_permutation", "sinusoidal"]


def sinusoidal(
    length: int,
    dim: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""The sinusoidal position encodings of "Attention Is All You Need".

    .. math::
        PE[pos, 2i] = \sin(pos / 10000^{2i/dim}), \qquad
        PE[pos, 2i + 1] = \cos(pos / 10000^{2i/dim})

    Sines and cosines are interleaved, as in the paper's formula (tensor2tensor
    concatenates all the sines, then all the cosines: the same features in another
    order). For every offset ``k``, ``PE[pos + k]`` is a fixed linear function of
    ``PE[pos]`` (a rotation of each (sin, cos) pair by ``k / 10000^{2i/dim}``),
    which is the paper's argument for letting the model attend by relative position.
    Computed in float64, then cast to ``dtype``.

    Args:
        length: number of positions ``0 .. length - 1``.
        dim: the model width ``d``; must be even.
        dtype: the floating-point dtype of the result (default: torch's default dtype).
        device: where to put the result.

    Returns:
        ``(length, dim)`` tensor; row ``pos`` is the encoding of position ``pos``.

    Raises:
        TypeError: ``length`` or ``dim`` not an int, or ``dtype`` not floating-point.
        ValueError: a negative ``length``, a non-positive or odd ``dim``.

    Example:
        >>> pe = sinusoidal(3, 4)
        >>> pe.shape
        torch.Size([3, 4])
        >>> [round(v, 3) for v in pe[1].tolist()]  # sin(1), cos(1), sin(0.01), cos(0.01)
        [0.841, 0.54, 0.01, 1.0]
    """
    check_positive_int("length", length, allow_zero=True)
    check_positive_int("dim", dim)
    if dim % 2:
        raise ValueError(f"dim must be even (sines and cosines come in pairs), got {dim}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    pos = torch.arange(length, dtype=torch.float64)  # (length,)
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (dim/2,) the even feature indices 2i
    angles = pos[:, None] / 10000.0 ** (two_i / dim)  # (length, 1) / (dim/2,) -> (length, dim/2)
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (length, dim/2, 2): (sin, cos) pairs
    return pe.reshape(length, dim).to(device=device, dtype=dtype)  # (length, dim), interleaved


def rope(
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
) -> torch.Tensor:
    r"""Rotary position embedding (RoPE): rotate each feature pair of ``x`` by its position.

    Feature pair ``j`` (``0 <= j < E/2``) of the token at position ``m`` is
    rotated by the angle ``m * theta_j`` with ``theta_j = base^{-2j/E}``:

    .. math::
        (a, b) \mapsto (a \cos m\theta_j - b \sin m\theta_j,\; b \cos m\theta_j + a \sin m\theta_j)

    where ``(a, b) = (x[j], x[j + E/2])`` by default (half-split, "rotate_half", as
    Hugging Face Llama) and ``(x[2j], x[2j + 1])`` with ``interleaved=True`` (Meta's
    original code, GPT-J): there the result is the complex product
    ``(a + i b) * exp(i m theta_j)``. Rotating queries and keys by their positions
    makes ``rope(q, i) . rope(k, j)`` depend on ``i`` and ``j`` only through ``i - j``,
    and rotations keep norms. Apply it to queries and keys, never to values.

    Half-precision input is computed in float32 and cast back; the angles
    ``m * theta_j`` are always formed in float64, so long positions lose no precision.

    Args:
        x: ``(..., L, E)`` floating-point queries or keys; ``E`` must be even.
        positions: the position of each of the ``L`` tokens, an integer (or float,
            for interpolated positions) tensor broadcastable to ``(..., L)``, e.g.
            ``(L,)`` or ``(B, 1, L)`` for ``x`` of shape ``(B, H, L, E)``; its last
            dimension must be ``L``. Defaults to ``0 .. L - 1``.
        base: the frequency base, ``10000`` in the paper (``rope_theta`` in Hugging
            Face configs); must be positive.
        interleaved: pair adjacent features ``(2j, 2j + 1)`` instead of the halves
            ``(j, j + E/2)``.

    Returns:
        Tensor of the shape and dtype of ``x``: the rotated features.

    Raises:
        TypeError: ``x`` not a floating-point tensor, ``positions`` not an integer or
            float tensor, ``base`` not a number, ``interleaved`` not a bool.
        ValueError: ``x`` with fewer than 2 dims or an odd ``E``, ``positions`` whose
            last dimension is not ``L`` or that does not broadcast to ``(..., L)``, or on
            another device, a non-positive or infinite ``base``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # (L, E) = (2, 2): position 0, then 1
        >>> [[round(v, 4) for v in row] for row in rope(x).tolist()]  # (cos m, sin m)
        [[1.0, 0.0], [0.5403, 0.8415]]
        >>> q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
        >>> s = rope(q, torch.tensor([3])) @ rope(k, torch.tensor([1])).T  # i - j = 2
        >>> torch.allclose(s, rope(q, torch.tensor([7])) @ rope(k, torch.tensor([5])).T)
        True
    """
    require_float_tensor("x", x, 2, "(..., L, E)")
    L, E = x.shape[-2], x.shape[-1]
    if E % 2:
        raise ValueError(
            f"x must have an even last dim E (features are rotated in pairs), got E={E} "
            f"in shape {fmt_shape(x.shape)}"
        )
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a positive float, got {type(base).__name__}")
    if not math.isfinite(base) or base <= 0:
        raise ValueError(f"base must be a positive finite float, got {base}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if positions is None:
        positions = torch.arange(L, device=x.device)  # (L,)
    else:
        _check_positions(positions, x)

    # Angles in float64: m * theta_j for positions up to 1e6 need more than float32's 24 bits.
    j = torch.arange(E // 2, dtype=torch.float64, device=x.device)  # (E/2,)
    theta = base ** (-2.0 * j / E)  # (E/2,) theta_j = base^(-2j/E)
    angles = positions.to(torch.float64)[..., None] * theta  # (..., L, 1) * (E/2,) -> (..., L, E/2)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)  # half precision -> float32
    cos, sin = angles.cos().to(compute_dtype), angles.sin().to(compute_dtype)  # (..., L, E/2) each
    xc = x.to(compute_dtype)  # (..., L, E)
    if interleaved:
        a, b = xc[..., 0::2], xc[..., 1::2]  # (..., L, E/2) each: pairs (x[2j], x[2j+1])
    else:
        a, b = xc[..., : E // 2], xc[..., E // 2 :]  # (..., L, E/2) each: pairs (x[j], x[j+E/2])
    a_rot = a * cos - b * sin  # (..., L, E/2)
    b_rot = b * cos + a * sin  # (..., L, E/2)
    if interleaved:
        out = torch.stack((a_rot, b_rot), dim=-1).flatten(-2)  # (..., L, E/2, 2) -> (..., L, E)
    else:
        out = torch.cat((a_rot, b_rot), dim=-1)  # (..., L, E)
    return out.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = True) -> torch.Tensor:
    r"""Rotate the feature pairs of ``x`` by precomputed angles (MLA's decoupled RoPE, the sparse
    indexer's keys).

    Pair ``j`` ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)`` with the angle
    of column ``j`` of ``cos``/``sin``. With ``interleaved=True`` (DeepSeek's
    layout) the pairs are ``(x[2j], x[2j + 1])`` and the rotated pairs stay in place;
    with ``False`` they are ``(x[j], x[j + R/2])`` (half-split). Unlike
    `rope`, the angles come from the caller, so YaRN's frequencies and
    ``attention_factor`` fit in (`attention_ref.mla.MultiHeadLatentAttention.rotary`). transformers'
    ``apply_rotary_pos_emb_interleave`` writes its result de-interleaved
    (``[a' for all pairs | b' for all pairs]``): a fixed permutation of the
    features, the same for queries and keys, so every score is the same.

    Args:
        x: ``(..., L, R)``, ``R`` even.
        cos: ``(..., L, R/2)``, broadcastable against ``x``'s leading dims.
        sin: the same shape as ``cos``.
        interleaved: the pair layout.

    Returns:
        The rotated ``x``, same shape and dtype.

    Raises:
        TypeError: non-float tensors.
        ValueError: an odd ``R``, or ``cos``/``sin`` whose last dim is not ``R/2``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # pairs (1, 0), (1, 0)
        >>> angle = torch.tensor([[math.pi / 2, 0.0]], dtype=torch.float64)  # 90 degrees, then 0
        >>> apply_rope(x, angle.cos(), angle.sin()).round(decimals=4).tolist()
        [[0.0, 1.0, 1.0, 0.0]]
    """
    x = require_float_tensor("x", x, 1, "(..., L, R)")
    cos = require_float_tensor("cos", cos, 1, "(..., L, R/2)")
    sin = require_float_tensor("sin", sin, 1, "(..., L, R/2)")
    R = x.shape[-1]
    if R % 2 or cos.shape[-1] != R // 2 or sin.shape != cos.shape:
        raise ValueError(
            f"x must have an even last dim R and cos, sin the shape (..., L, R/2) = (..., {R // 2}): "
            f"got x {fmt_shape(x.shape)}, cos {fmt_shape(cos.shape)}, sin {fmt_shape(sin.shape)}"
        )
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]  # (..., L, R/2) each: pairs (x[2j], x[2j+1])
    else:
        a, b = x[..., : R // 2], x[..., R // 2 :]  # (..., L, R/2) each: pairs (x[j], x[j+R/2])
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    a_rot, b_rot = a * cos - b * sin, b * cos + a * sin  # (..., L, R/2) each
    if interleaved:
        return torch.stack((a_rot, b_rot), dim=-1).flatten(-2)  # (..., L, R/2, 2) -> (..., L, R)
    return torch.cat((a_rot, b_rot), dim=-1)  # (..., L, R)


def _check_positions(positions: object, x: torch.Tensor) -> None:
    positions = require_tensor("positions", positions)
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer (or float) tensor, got {positions.dtype}")
    L = x.shape[-2]
    if positions.dim() == 0 or positions.shape[-1] != L:
        raise ValueError(
            f"positions must have last dim L={L} (one position per token of x with shape "
            f"{fmt_shape(x.shape)}), got shape {fmt_shape(positions.shape)}"
        )
    lead = tuple(x.shape[:-1])  # (..., L)
    try:
        broadcast = torch.broadcast_shapes(tuple(positions.shape), lead)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(lead):
        raise ValueError(
            f"positions must broadcast to x's (..., L)={fmt_shape(lead)}, "
            f"got shape {fmt_shape(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions must be on the same device as x ({x.device}), got {positions.device}")


def rope_permutation(head_dim: int, *, num_heads: int = 1) -> torch.Tensor:
    """The row order that turns an interleaved-RoPE checkpoint into a half-split one.

    Direction: with ``perm = rope_permutation(E)``,

    - ``w_half = w_interleaved[perm]`` for the rows (output features) of one head's
      ``W_Q`` or ``W_K`` (``nn.Linear.weight`` of shape ``(E, d)``; a bias the same way),
      and ``rope(x, interleaved=True)[..., perm] == rope(x[..., perm], interleaved=False)``;
    - back: ``w_interleaved = w_half[torch.argsort(perm)]``.

    ``perm = [0, 2, 4, ..., E-2, 1, 3, ..., E-1]``: half-split feature ``j`` is
    interleaved feature ``2j`` and half-split feature ``j + E/2`` is interleaved
    feature ``2j + 1``, so interleaved pair ``(2j, 2j + 1)`` becomes half-split pair
    ``(j, j + E/2)`` with the same frequency. This is the ``permute`` of Hugging Face's
    ``convert_llama_weights_to_hf.py`` (Meta's interleaved Llama to HF's rotate_half).
    Attention scores are unchanged by the conversion (the same permutation hits
    queries and keys, and a dot product does not care about feature order), so
    ``W_V`` and ``W_O`` stay as they are.

    Args:
        head_dim: ``E``, the query/key size of one head; must be even.
        num_heads: for a whole ``(num_heads * E, d)`` projection whose rows are grouped
            head by head: the per-head permutation repeated, offset by ``h * E``.

    Returns:
        ``(num_heads * head_dim,)`` int64 tensor of indices.

    Raises:
        TypeError: ``head_dim`` or ``num_heads`` not an int.
        ValueError: a non-positive or odd ``head_dim``, a non-positive ``num_heads``.

    Example:
        >>> rope_permutation(6).tolist()
        [0, 2, 4, 1, 3, 5]
        >>> rope_permutation(4, num_heads=2).tolist()
        [0, 2, 1, 3, 4, 6, 5, 7]
        >>> x = torch.randn(3, 6, dtype=torch.float64)
        >>> perm = rope_permutation(6)
        >>> torch.allclose(rope(x, interleaved=True)[..., perm], rope(x[..., perm]))
        True
    """
    check_positive_int("head_dim", head_dim)
    check_positive_int("num_heads", num_heads)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates feature pairs), got {head_dim}")
    one_head = torch.arange(head_dim).view(head_dim // 2, 2).T.reshape(head_dim)  # (E,) evens, then odds
    offsets = torch.arange(num_heads)[:, None] * head_dim  # (num_heads, 1)
    return (offsets + one_head).reshape(num_heads * head_dim)  # (num_heads, E) -> (num_heads * E,)
