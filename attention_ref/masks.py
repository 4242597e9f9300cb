"""Attention masks: build them, combine them, convert them.

One convention throughout: a boolean mask is ``True`` where a query-key pair
*takes part* in attention, as in ``torch.nn.functional.scaled_dot_product_attention``.
``torch.nn.MultiheadAttention`` uses the opposite (``True`` = ignore) for its
boolean ``key_padding_mask`` and ``attn_mask``; `from_key_padding_mask`
converts at that boundary. A float mask is added to the scores (``0`` keeps a
pair, ``-inf`` removes it).

The builders are the dense form of `attention_ref.mods`' mask mods, made with
`attention_ref.mods.create_mask`: each mask is defined once, as a mod.

Shapes: ``B`` batch, ``L`` query length, ``S`` key length. Masks returned here
broadcast against the ``(B, H, L, S)`` scores of multi-head attention.
"""

from __future__ import annotations

import torch

from attention_ref import mods
from attention_ref._validation import check_positive_int, fmt_shape, require_int_tensor, require_tensor

__all__ = [
    "causal_mask",
    "combine_masks",
    "from_key_padding_mask",
    "padding_mask",
    "padding_mask_from_tokens",
    "to_additive",
]

_ALIGNMENTS = ("top_left", "bottom_right")


def causal_mask(
    L: int,
    S: int | None = None,
    *,
    alignment: str = "top_left",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean causal (look-ahead) mask, ``True`` = takes part.

    Args:
        L: query length.
        S: key length; defaults to ``L``.
        alignment: ``"top_left"`` keeps key ``j`` for query ``i`` when ``j <= i``
            (``is_causal=True`` in PyTorch's SDPA); ``"bottom_right"`` when
            ``j <= i + S - L``, so the last query sees every key (decoding with a
            cache of ``S - L`` earlier tokens). They differ only when ``L != S``.
        device: where to build it.

    Returns:
        ``(L, S)`` bool tensor.

    Raises:
        ValueError: a negative length or an unknown alignment.

    Examples:
        >>> causal_mask(2, 3).int().tolist()
        [[1, 0, 0], [1, 1, 0]]
        >>> causal_mask(2, 3, alignment="bottom_right").int().tolist()
        [[1, 1, 0], [1, 1, 1]]
    """
    check_positive_int("L", L, allow_zero=True)
    S = L if S is None else check_positive_int("S", S, allow_zero=True)
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment must be one of {_ALIGNMENTS}, got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - L
    return mods.create_mask(mods.causal(offset), None, None, L, S, device)[0, 0]  # (1, 1, L, S) -> (L, S)


def padding_mask(lengths: torch.Tensor, S: int) -> torch.Tensor:
    """Key padding mask from the valid length of each sequence, ``True`` = real token.

    Args:
        lengths: ``(B,)`` integer tensor, each value in ``[0, S]``.
        S: padded key length.

    Returns:
        ``(B, 1, 1, S)`` bool, broadcasting over heads and queries.

    Raises:
        TypeError: ``lengths`` not an integer tensor.
        ValueError: ``lengths`` not 1-D, or a length outside ``[0, S]``.

    Examples:
        >>> padding_mask(torch.tensor([2, 3]), 4).int().squeeze(1).squeeze(1).tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0]]
    """
    lengths = require_int_tensor("lengths", lengths, "(B,)")
    check_positive_int("S", S, allow_zero=True)
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > S):
        raise ValueError(
            f"lengths must lie in [0, S] = [0, {S}], got values from {int(lengths.min())} "
            f"to {int(lengths.max())}"
        )
    B = lengths.shape[0]
    # One query row stands for all of them: (B, 1, 1, S) broadcasts over heads and queries.
    return mods.create_mask(mods.padding(lengths), B, None, 1, S, lengths.device)


def padding_mask_from_tokens(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Key padding mask from token ids, ``True`` where the token is not ``pad_id``.

    Args:
        tokens: ``(B, S)`` integer token ids.
        pad_id: the padding token id.

    Returns:
        ``(B, 1, 1, S)`` bool.

    Raises:
        ValueError: ``tokens`` not 2-D.

    Examples:
        >>> padding_mask_from_tokens(torch.tensor([[5, 7, 0]]), pad_id=0).shape
        torch.Size([1, 1, 1, 3])
    """
    tokens = require_int_tensor("tokens", tokens, "(B, S)", (2,))
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int, got {type(pad_id).__name__}")
    B, S = tokens.shape
    return mods.create_mask(mods.padding_tokens(tokens, pad_id), B, None, 1, S, tokens.device)  # (B, 1, 1, S)


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Convert a mask to the additive form: ``0`` where a pair takes part, ``-inf`` where not.

    A float mask is already additive and is only cast to ``dtype``.

    Args:
        mask: bool (``True`` = takes part) or float.
        dtype: a floating-point dtype.

    Returns:
        Float tensor of ``mask``'s shape.

    Raises:
        TypeError: an integer mask or a non-float ``dtype``.

    Examples:
        >>> to_additive(torch.tensor([True, False])).tolist()
        [0.0, -inf]
    """
    mask = require_tensor("mask", mask)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return zeros.masked_fill(~mask, float("-inf"))
    if mask.is_floating_point():
        return mask.to(dtype)
    raise TypeError(f"mask must be bool (True = takes part) or floating point, got {mask.dtype}")


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Combine masks into one that applies all of them (``None`` entries are skipped).

    Bool masks combine with logical AND (a pair takes part only if every mask
    lets it). If any mask is float, the result is float: bools become additive
    (``0`` / ``-inf``) and everything is summed. Shapes broadcast.

    Args:
        *masks: bool (``True`` = takes part) or float masks, or ``None``.

    Returns:
        The combined mask, or ``None`` if no mask was given.

    Raises:
        TypeError: an integer mask.
        ValueError: shapes that do not broadcast.

    Examples:
        >>> causal = causal_mask(3)
        >>> pad = padding_mask(torch.tensor([2]), 3)
        >>> combine_masks(causal, pad).shape
        torch.Size([1, 1, 3, 3])
    """
    given = [require_tensor(f"masks[{i}]", m) for i, m in enumerate(masks) if m is not None]
    if not given:
        return None
    for i, m in enumerate(given):
        if m.dtype != torch.bool and not m.is_floating_point():
            raise TypeError(f"masks[{i}] must be bool (True = takes part) or floating point, got {m.dtype}")
    try:
        torch.broadcast_shapes(*(m.shape for m in given))
    except RuntimeError:
        shapes = ", ".join(fmt_shape(m.shape) for m in given)
        raise ValueError(f"masks must broadcast together, got shapes {shapes}") from None
    floats = [m for m in given if m.is_floating_point()]
    if not floats:
        combined = given[0]
        for m in given[1:]:
            combined = combined & m
        return combined
    dtype = floats[0].dtype
    for m in floats[1:]:
        dtype = torch.promote_types(dtype, m.dtype)
    combined = to_additive(given[0], dtype)
    for m in given[1:]:
        combined = combined + to_additive(m, dtype)
    return combined


def from_key_padding_mask(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """Convert ``torch.nn.MultiheadAttention``'s ``key_padding_mask`` to this package's form.

    PyTorch's boolean ``key_padding_mask`` is ``True`` where a key is *ignored*;
    this package's masks are ``True`` where a key *takes part*. A float
    ``key_padding_mask`` is additive in both and is only reshaped.

    Args:
        key_padding_mask: ``(B, S)`` bool (``True`` = ignore) or float.

    Returns:
        ``(B, 1, 1, S)``: bool ``True`` = takes part, or the float mask reshaped.

    Raises:
        ValueError: not 2-D.
        TypeError: an integer mask.

    Examples:
        >>> kpm = torch.tensor([[False, False, True]])  # PyTorch: last key is padding
        >>> from_key_padding_mask(kpm).flatten().tolist()
        [True, True, False]
    """
    kpm = require_tensor("key_padding_mask", key_padding_mask)
    if kpm.dim() != 2:
        raise ValueError(f"key_padding_mask must be 2-D (B, S), got shape {fmt_shape(kpm.shape)}")
    if kpm.dtype == torch.bool:
        return (~kpm)[:, None, None, :]  # (B, S) -> (B, 1, 1, S), polarity flipped
    if kpm.is_floating_point():
        return kpm[:, None, None, :]  # (B, S) -> (B, 1, 1, S), additive in both conventions
    raise TypeError(f"key_padding_mask must be bool (True = ignore) or floating point, got {kpm.dtype}")
