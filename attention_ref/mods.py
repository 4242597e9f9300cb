r"""Mask and score modifications with FlexAttention's signatures.

Each mod below is made by a *factory*: it checks its arguments and returns a
small function that runs unchanged in `attention_ref.scaled_dot_product_attention`
(``mask_mod=``, ``score_mod=``) and in
``torch.nn.attention.flex_attention.flex_attention``:

- ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, ``True`` = the pair takes part
  (the convention of every boolean mask in this package);
- ``score_mod(score, b, h, q_idx, kv_idx) -> tensor``, the modified score.

The indices are integer tensors that broadcast together: batch entry ``b``, head
``h``, query position ``q_idx`` (``i`` below) and key position ``kv_idx`` (``j``).
A mod uses only elementwise operations and indexing by them, so it works on
scalars (FlexAttention calls it under ``vmap``) and on broadcasting index grids
(`create_mask`, the math path).

Every mod that compares positions takes ``offset=0``: query ``i`` sits at
position ``i + offset``. ``offset = S - L`` aligns the queries bottom-right, so
the last query is the last key's position (decoding with a cache of ``S - L``
earlier tokens).

The helpers at the end (`index_grids`, `apply_mask_mod`, `apply_score_mod`,
`check_mod`, `validate_sizes`) are how the math path and `create_mask` run a
mod on broadcasting index tensors and check what it returns.

Examples:
    >>> import torch
    >>> from attention_ref import mods, scaled_dot_product_attention
    >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> out = scaled_dot_product_attention(q, k, v, mask_mod=mods.sliding_window(1), score_mod=mods.softcap(30.0))
    >>> mods.create_mask(mods.sliding_window(1), None, None, 3, 3)[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_ref._validation import (
    check_dense,
    check_device,
    check_positive_int,
    fmt_shape,
    require_int_tensor,
)

__all__ = [
    "alibi",
    "alibi_slopes",
    "and_masks",
    "causal",
    "chunked",
    "compose",
    "create_mask",
    "describe",
    "document",
    "or_masks",
    "padding",
    "padding_tokens",
    "prefix_lm",
    "sliding_window",
    "softcap",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_MASK_ARGS = "(b, h, q_idx, kv_idx)"
_SCORE_ARGS = "(score, b, h, q_idx, kv_idx)"


# --- argument checks ---------------------------------------------------------------------------


# Positions are int64 tensors: offsets, window sides and sizes past this would wrap around when
# added to a position (2**60, far beyond any sequence; three of them and a position stay < 2**63).
POSITION_LIMIT = 2**60


def _in_range(name: str, value: int, low: int) -> int:
    if not low <= value <= POSITION_LIMIT:
        raise ValueError(f"{name} must lie in [{low}, 2**60] (positions are int64: a larger value wraps "
                         f"around), got {value}")
    return value


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return _in_range(name, value, -POSITION_LIMIT)


def _check_window_side(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a non-negative int or None (unbounded), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int or None (unbounded), got {value}")
    return _in_range(name, value, 0)


def _positional_arity(fn: Callable[..., object]) -> tuple[int, int | None]:
    """(fewest, most) positional arguments ``fn`` accepts; most is None for ``*args``."""
    params = inspect.signature(fn).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return required, None
    return required, len(positional)


def check_mod(name: str, mod: object, kind: str) -> None:
    """Check that ``mod`` is a callable with the signature of a ``kind`` (``"mask"`` or ``"score"``) mod.

    Raises:
        TypeError: not callable, or it cannot take the mod's arguments
            (4 for a mask mod, 5 for a score mod).

    Examples:
        >>> check_mod("mask_mod", causal(), "mask")
        >>> check_mod("mask_mod", lambda q_idx, kv_idx: q_idx >= kv_idx, "mask")
        Traceback (most recent call last):
        ...
        TypeError: mask_mod must take 4 positional arguments (b, h, q_idx, kv_idx), got a function of 2: (q_idx, kv_idx)
    """
    n, args = (4, _MASK_ARGS) if kind == "mask" else (5, _SCORE_ARGS)
    if not callable(mod):
        raise TypeError(f"{name} must be a callable {args} -> tensor, got {type(mod).__name__}")
    try:
        low, high = _positional_arity(mod)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    if low > n or (high is not None and high < n):
        signature = inspect.signature(mod)
        count = f"{low}" if high == low else f"{low} to {high if high is not None else 'any'}"
        raise TypeError(f"{name} must take {n} positional arguments {args}, got a function of {count}: {signature}")


def _shape_checks(mod: Callable[..., object]) -> list[Callable[[int, int, int, int], None]]:
    return list(getattr(mod, "_attention_ref_checks", ()))


def _with_checks(mod: Callable[..., object], checks: Sequence[Callable[[int, int, int, int], None]]) -> None:
    """Attach the checks a mod needs against the call's ``(B, H, L, S)`` (run by `validate_sizes`)."""
    mod._attention_ref_checks = tuple(checks)  # type: ignore[attr-defined]


def _record_factory(mod: Callable[..., object], factory: str, **arguments: object) -> None:
    """Record which factory made ``mod`` and with what arguments (read by `describe`)."""
    mod._attention_ref_made_by = (factory, dict(arguments))  # type: ignore[attr-defined]


def describe(mod: Callable[..., object] | None) -> tuple[str, dict[str, object]] | None:
    """The factory of this module that made ``mod`` and its resolved arguments, or ``None``.

    Fused kernels use it to recognise the mods they implement natively (the
    Triton kernel: `causal`, `sliding_window`, `softcap`); a mod written by hand,
    or combined with `and_masks`, `or_masks` or `compose`, gives ``None`` and
    runs as a function. A reader must honour every argument recorded here or
    refuse the mod: the Triton kernel refuses `sliding_window` with
    ``sink_tokens > 0``.

    Examples:
        >>> describe(sliding_window(3, offset=2))
        ('sliding_window', {'left': 3, 'right': 0, 'offset': 2, 'sink_tokens': 0})
        >>> describe(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) is None
        True
    """
    return getattr(mod, "_attention_ref_made_by", None)


def validate_sizes(mod: Callable[..., object] | None, B: int, H: int, L: int, S: int) -> None:
    """Run the size checks a mod from this module carries (document ids, lengths, heads).

    Called by `create_mask` and the math path with the sizes of the call; a mod
    written by hand carries none.

    Raises:
        ValueError: a tensor the mod was built from does not fit ``(B, H, L, S)``.

    Examples:
        >>> validate_sizes(padding(torch.tensor([2, 3])), 2, 1, 3, 3)
        >>> validate_sizes(padding(torch.tensor([2, 3])), 5, 1, 3, 3)
        Traceback (most recent call last):
        ...
        ValueError: padding(lengths): lengths must have shape (B,) = (5,), got shape (2,)
    """
    if mod is None:
        return
    for check in _shape_checks(mod):
        check(B, H, L, S)


# --- mask mods ---------------------------------------------------------------------------------


def causal(offset: int = 0) -> MaskMod:
    """Causal mask: key ``j`` takes part for query ``i`` when ``j <= i + offset``.

    Args:
        offset: query ``i`` sits at position ``i + offset``. ``0`` is top-left
            alignment (``is_causal=True`` in PyTorch's SDPA and FlexAttention's
            usual ``q_idx >= kv_idx``); ``S - L`` is bottom-right (FlashAttention,
            decoding).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``offset`` not an int.

    Examples:
        >>> create_mask(causal(), None, None, 2, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0]]
        >>> create_mask(causal(offset=1), None, None, 2, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 1]]
    """
    offset = _check_int("offset", offset)

    def causal_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= q_idx + offset

    _record_factory(causal_mask_mod, "causal", offset=offset)
    return causal_mask_mod


def sliding_window(left: int | None, right: int | None = 0, offset: int = 0, *, sink_tokens: int = 0) -> MaskMod:
    """Sliding window: key ``j`` takes part for query ``i`` when ``i + offset - left <= j <= i + offset + right``.

    Both ends are inclusive, so a window sees ``left + 1 + right`` keys. With the
    default ``right=0`` it is causal: ``sliding_window(W - 1)`` is Hugging Face's
    and vLLM's ``sliding_window=W`` (W keys including the current one).

    ``sink_tokens=n`` keeps StreamingLLM's attention sinks (Xiao et al., 2023,
    arXiv 2309.17453): the first ``n`` keys are exempt from the left end only, so
    key ``j`` takes part when

    ``(i + offset - left <= j or j < sink_tokens) and j <= i + offset + right``.

    A sink key after the query's window (``j > i + offset + right``) stays hidden:
    with ``right=0`` no query sees a future sink. This is FlashAttention's reference
    ``construct_local_mask(..., sink_token_length)`` (``hopper/test_util.py``,
    ``flash_attn/cute/testing.py``), where ``col < sink_token_length`` is exempt from
    the left cut only. These sinks are real keys kept by the mask, not gpt-oss's
    learned sink logit (a term added to the softmax denominator). StreamingLLM also
    renumbers positions inside its rolling cache; that is not the mask's business.
    With ``left=None`` there is no left cut and ``sink_tokens`` changes nothing.

    Args:
        left: keys before the query's position, ``>= 0``; ``None`` = unbounded.
        right: keys after it, ``>= 0``; ``None`` = unbounded.
        offset: query ``i`` sits at position ``i + offset``.
        sink_tokens: the first keys (``j < sink_tokens``) kept by the left end of
            the window, ``>= 0``; ``0`` (the default) keeps none.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: a side that is not an int or None, ``offset`` or ``sink_tokens`` not an int.
        ValueError: a negative ``left``, ``right`` or ``sink_tokens``.

    Examples:
        >>> create_mask(sliding_window(1), None, None, 4, 4)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
        >>> create_mask(sliding_window(0, 1), None, None, 2, 3)[0, 0].int().tolist()
        [[1, 1, 0], [0, 1, 1]]

        Two sink keys and a causal window of two keys: query 4 sees keys 0, 1 (the
        sinks), 3 and 4; query 0 does not see sink key 1, which is after it.

        >>> create_mask(sliding_window(1, sink_tokens=2), None, None, 5, 5)[0, 0].int().tolist()
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 1, 1]]
    """
    left = _check_window_side("left", left)
    right = _check_window_side("right", right)
    offset = _check_int("offset", offset)
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int):
        raise TypeError(
            f"sink_tokens must be a non-negative int (the first keys kept outside the window), "
            f"got {type(sink_tokens).__name__}"
        )
    if sink_tokens < 0:
        raise ValueError(
            f"sink_tokens must be a non-negative int (the first keys kept outside the window), got {sink_tokens}"
        )
    _in_range("sink_tokens", sink_tokens, 0)

    def sliding_window_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        distance = kv_idx - (q_idx + offset)  # j - (i + offset), negative for keys before the query
        keep = torch.ones_like(distance, dtype=torch.bool)
        if left is not None:
            inside = distance >= -left
            if sink_tokens:
                inside = inside | (kv_idx < sink_tokens)  # the sinks pass the left end, not the right one
            keep = keep & inside
        if right is not None:
            keep = keep & (distance <= right)
        return keep

    _record_factory(sliding_window_mask_mod, "sliding_window", left=left, right=right, offset=offset, sink_tokens=sink_tokens)
    return sliding_window_mask_mod


def chunked(size: int, offset: int = 0, *, start: torch.Tensor | None = None) -> MaskMod:
    """Chunked (local) attention: key ``j`` takes part for query ``i`` when ``(i + offset) // size == j // size``.

    Positions are cut into consecutive chunks of ``size`` (Llama 4's chunked
    attention); a query sees every key of its own chunk, in both directions.
    Combine with `causal` (`and_masks`) for the causal version.

    With ``start``, chunks are counted from position ``start[b]`` of each
    sequence instead of 0: ``(i + offset - start[b]) // size == (j - start[b]) // size``.
    transformers does this with left padding (``chunked_overlay(chunk_size,
    left_padding)`` in ``masking_utils``): the first chunk begins at a
    sequence's first real token, not at the first (padding) slot, so a batch
    padded on the left is chunked like each sequence alone.

    Args:
        size: chunk length, ``> 0``.
        offset: query ``i`` sits at position ``i + offset``.
        start: ``(B,)`` integer tensor, where each sequence's first chunk
            begins (its number of left padding slots), each ``>= 0``; ``None``
            counts from 0.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``size`` or ``offset`` not an int, ``start`` not an integer tensor.
        ValueError: ``size <= 0``, ``start`` not 1-D or negative; when the mod
            is used, a batch that is not ``B``.

    Examples:
        >>> create_mask(chunked(2), None, None, 3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]

        One slot of left padding shifts the chunks by one:

        >>> create_mask(chunked(2, start=torch.tensor([1])), 1, None, 3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [0, 1, 1], [0, 1, 1]]
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be a positive int, got {type(size).__name__}")
    if size <= 0:
        raise ValueError(f"size must be a positive int (the chunk length), got {size}")
    _in_range("size", size, 1)
    offset = _check_int("offset", offset)
    if start is None:

        def chunked_mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return torch.div(q_idx + offset, size, rounding_mode="floor") == torch.div(kv_idx, size,
                                                                                      rounding_mode="floor")

        return chunked_mask_mod

    start = require_int_tensor("start", start, "(B,)", (1,))
    if start.numel() and int(start.min()) < 0:
        raise ValueError(f"start must be non-negative (left padding slots), got a minimum of {int(start.min())}")

    def chunked_from_start_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        first = start[b]  # where this sequence's chunks begin
        return torch.div(q_idx + offset - first, size, rounding_mode="floor") == torch.div(
            kv_idx - first, size, rounding_mode="floor")

    _with_checks(chunked_from_start_mask_mod, [_batch_check("chunked(size, start=)", "start", start)])
    return chunked_from_start_mask_mod


def prefix_lm(prefix_length: int | torch.Tensor, offset: int = 0) -> MaskMod:
    """Prefix LM: key ``j`` takes part for query ``i`` when ``j < prefix_length`` or ``j <= i + offset``.

    Every query sees the whole prefix (bidirectional there) and is causal after it.

    Args:
        prefix_length: an int ``>= 0``, or a ``(B,)`` integer tensor with one
            prefix length per batch entry (``prefix_length[b]``).
        offset: query ``i`` sits at position ``i + offset``.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``prefix_length`` neither an int nor an integer tensor.
        ValueError: a negative ``prefix_length``, a tensor that is not ``(B,)``
            (checked against the call's ``B`` when the mod is used).

    Examples:
        >>> create_mask(prefix_lm(2), None, None, 3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    """
    offset = _check_int("offset", offset)
    if isinstance(prefix_length, torch.Tensor):
        prefix = require_int_tensor("prefix_length", prefix_length, "(B,)", (1,))
        if prefix.numel() and int(prefix.min()) < 0:
            raise ValueError(f"prefix_length must be non-negative, got a minimum of {int(prefix.min())}")

        def prefix_lm_mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (kv_idx < prefix[b]) | (kv_idx <= q_idx + offset)

        _with_checks(prefix_lm_mask_mod, [_batch_check("prefix_lm(prefix_length)", "prefix_length", prefix)])
        return prefix_lm_mask_mod
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int):
        raise TypeError(f"prefix_length must be an int or a (B,) integer tensor, got {type(prefix_length).__name__}")
    if prefix_length < 0:
        raise ValueError(f"prefix_length must be non-negative, got {prefix_length}")
    length = prefix_length

    def prefix_lm_int_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx < length) | (kv_idx <= q_idx + offset)

    return prefix_lm_int_mask_mod


def _batch_check(where: str, name: str, tensor: torch.Tensor) -> Callable[[int, int, int, int], None]:
    def check(B: int, H: int, L: int, S: int) -> None:
        if tensor.shape[0] != B:
            raise ValueError(f"{where}: {name} must have shape (B,) = ({B},), got shape {fmt_shape(tensor.shape)}")

    return check


def document(document_ids: torch.Tensor, kv_document_ids: torch.Tensor | None = None) -> MaskMod:
    """Packed sequences: key ``j`` takes part for query ``i`` when ``kv_document_ids[j] == document_ids[i]``.

    With ``(B, L)`` ids the comparison is per batch entry:
    ``kv_document_ids[b, j] == document_ids[b, i]``. Combine with `causal` for
    causal attention inside each document.

    Args:
        document_ids: ``(L,)`` or ``(B, L)`` integer ids of the queries' documents.
        kv_document_ids: the keys' ids, ``(S,)`` or ``(B, S)`` with the same number
            of dims; defaults to ``document_ids`` (self-attention, ``S == L``).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ids that are not integer tensors.
        ValueError: ids that are not 1-D or 2-D, query and key ids with different
            numbers of dims or batch sizes; when the mod is used, ids whose
            length is not ``L`` (or ``S``) or whose batch is not ``B``.

    Examples:
        >>> ids = torch.tensor([0, 0, 1])
        >>> create_mask(document(ids), None, None, 3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    q_ids = require_int_tensor("document_ids", document_ids, "(L,) or (B, L)", (1, 2))
    kv_ids = q_ids if kv_document_ids is None else require_int_tensor(
        "kv_document_ids", kv_document_ids, "(S,) or (B, S)", (1, 2)
    )
    if kv_ids.dim() != q_ids.dim() or (q_ids.dim() == 2 and kv_ids.shape[0] != q_ids.shape[0]):
        raise ValueError(
            f"kv_document_ids must match document_ids in dims and batch: document_ids has shape "
            f"{fmt_shape(q_ids.shape)}, kv_document_ids has shape {fmt_shape(kv_ids.shape)}"
        )

    def check(B: int, H: int, L: int, S: int) -> None:
        where = "document(document_ids, kv_document_ids)"
        if q_ids.shape[-1] != L:
            raise ValueError(
                f"{where}: document_ids must have length L = {L} (dim -1), got shape {fmt_shape(q_ids.shape)}"
            )
        if kv_ids.shape[-1] != S:
            name = "document_ids (used for the keys too)" if kv_document_ids is None else "kv_document_ids"
            raise ValueError(f"{where}: {name} must have length S = {S} (dim -1), got shape {fmt_shape(kv_ids.shape)}")
        if q_ids.dim() == 2 and q_ids.shape[0] != B:
            raise ValueError(f"{where}: document_ids must have batch B = {B} (dim 0), got shape {fmt_shape(q_ids.shape)}")

    if q_ids.dim() == 1:

        def document_mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return q_ids[q_idx] == kv_ids[kv_idx]

    else:

        def document_mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    _with_checks(document_mask_mod, [check])
    return document_mask_mod


def padding(lengths: torch.Tensor, side: str = "right", *, total: int | None = None) -> MaskMod:
    """Key padding: key ``j`` takes part for batch entry ``b`` when ``j < lengths[b]`` (right padding).

    With ``side="left"`` the padding comes first, as in batched generation:
    key ``j`` takes part when ``j >= total - lengths[b]``. A mask mod sees
    only indices, not ``S``, so left padding needs ``total`` (the padded
    length, ``S``), checked against ``S`` when the mod is used.

    Args:
        lengths: ``(B,)`` integer tensor of valid key lengths, each ``>= 0``.
        side: ``"right"`` (the real keys first) or ``"left"`` (the padding first).
        total: the padded key length ``S``; needed with ``side="left"``, refused otherwise.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``lengths`` not an integer tensor, ``total`` not an int.
        ValueError: ``lengths`` not 1-D or negative, an unknown ``side``,
            ``total`` missing for ``side="left"`` (or given for ``"right"``),
            a length above ``total``; when the mod is used, a batch that is
            not ``B`` or an ``S`` that is not ``total``.

    Examples:
        >>> create_mask(padding(torch.tensor([1, 3])), 2, None, 1, 3)[:, 0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 1]]
        >>> left = padding(torch.tensor([1, 3]), side="left", total=3)
        >>> create_mask(left, 2, None, 1, 3)[:, 0, 0].int().tolist()
        [[0, 0, 1], [1, 1, 1]]
    """
    lengths = require_int_tensor("lengths", lengths, "(B,)", (1,))
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be non-negative, got a minimum of {int(lengths.min())}")
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if side == "right":
        if total is not None:
            raise ValueError(f"total is only for side='left' (right padding needs no length), got total={total}")

        def padding_mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return kv_idx < lengths[b]

        _with_checks(padding_mask_mod, [_batch_check("padding(lengths)", "lengths", lengths)])
        return padding_mask_mod

    if total is None:
        raise ValueError(
            "padding(lengths, side='left') needs total=S, the padded key length: a mask mod sees indices, not S"
        )
    total = _check_int("total", total)
    if lengths.numel() and int(lengths.max()) > total:
        raise ValueError(f"lengths must be at most total = {total}, got a maximum of {int(lengths.max())}")
    first = total - lengths  # (B,): the first real key of each sequence

    def check(B: int, H: int, L: int, S: int) -> None:
        if S != total:
            raise ValueError(f"padding(lengths, side='left', total={total}) used with S = {S} keys; total must be S")

    def left_padding_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx >= first[b]

    _with_checks(left_padding_mask_mod, [_batch_check("padding(lengths, side='left')", "lengths", lengths), check])
    return left_padding_mask_mod


def padding_tokens(tokens: torch.Tensor, pad_id: int) -> MaskMod:
    """Key padding from token ids: key ``j`` takes part for batch entry ``b`` when ``tokens[b, j] != pad_id``.

    Unlike `padding`, the padding may sit anywhere (left padding, or pads between
    packed sequences).

    Args:
        tokens: ``(B, S)`` integer token ids of the keys.
        pad_id: the padding token id.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``tokens`` not an integer tensor, ``pad_id`` not an int.
        ValueError: ``tokens`` not 2-D; when the mod is used, a batch that is not
            ``B`` or a key length that is not ``S``.

    Examples:
        >>> create_mask(padding_tokens(torch.tensor([[0, 5, 7]]), 0), 1, None, 1, 3)[0, 0].int().tolist()
        [[0, 1, 1]]
    """
    tokens = require_int_tensor("tokens", tokens, "(B, S)", (2,))
    pad_id = _check_int("pad_id", pad_id)
    keep = tokens != pad_id  # (B, S)

    def padding_tokens_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return keep[b, kv_idx]

    def check(B: int, H: int, L: int, S: int) -> None:
        if tuple(tokens.shape) != (B, S):
            raise ValueError(
                f"padding_tokens(tokens): tokens must have shape (B, S) = {fmt_shape((B, S))}, "
                f"got shape {fmt_shape(tokens.shape)}"
            )

    _with_checks(padding_tokens_mask_mod, [check])
    return padding_tokens_mask_mod


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """Intersection: a pair takes part when every mod keeps it (``all``; no mods keeps every pair).

    Args:
        *mask_mods: mask mods.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: an argument that is not a mask mod (not callable, or not of 4 arguments).

    Examples:
        >>> m = and_masks(causal(), padding(torch.tensor([2])))
        >>> create_mask(m, 1, None, 3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 0]]
    """
    return _combine("and_masks", mask_mods, torch.logical_and, True)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """Union: a pair takes part when any mod keeps it (``any``; no mods keeps no pair).

    Args:
        *mask_mods: mask mods.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: an argument that is not a mask mod (not callable, or not of 4 arguments).

    Examples:
        >>> m = or_masks(causal(), prefix_lm(2))
        >>> create_mask(m, None, None, 3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    """
    return _combine("or_masks", mask_mods, torch.logical_or, False)


def _combine(name: str, mask_mods: Sequence[MaskMod], op: Callable[..., torch.Tensor], empty: bool) -> MaskMod:
    for i, mod in enumerate(mask_mods):
        check_mod(f"{name}: mask_mods[{i}]", mod, "mask")
    mods = tuple(mask_mods)

    def combined_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(q_idx - kv_idx, empty, dtype=torch.bool)
        for mod in mods:
            keep = op(keep, mod(b, h, q_idx, kv_idx))
        return keep

    _with_checks(combined_mask_mod, [c for mod in mods for c in _shape_checks(mod)])
    return combined_mask_mod


# --- score mods --------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes (Press et al., 2022), float64 ``(num_heads,)``.

    For ``num_heads`` a power of two: the geometric sequence
    ``2^(-8/H), 2^(-16/H), ..., 2^(-8)``. Otherwise the paper's rule: the slopes
    of the nearest lower power of two ``P``, then every other slope of ``2P``
    heads (``2^(-4/P), 2^(-12/P), ...``) for the remaining ``num_heads - P``.

    Args:
        num_heads: ``H``, ``> 0``.

    Returns:
        ``(H,)`` float64.

    Raises:
        TypeError: not an int.
        ValueError: ``num_heads <= 0``.

    Examples:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
        >>> alibi_slopes(3).tolist()
        [0.0625, 0.00390625, 0.25]
    """
    check_positive_int("num_heads", num_heads)
    return torch.tensor(_slopes(num_heads), dtype=torch.float64)


def _slopes(n: int) -> list[float]:
    def power_of_two(m: int) -> list[float]:
        start = 2.0 ** (-8.0 / m)  # ratio = start
        return [start ** (i + 1) for i in range(m)]

    if n & (n - 1) == 0:
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + _slopes(2 * closest)[0::2][: n - closest]


def alibi(num_heads: int, *, symmetric: bool = False, offset: int = 0) -> ScoreMod:
    """ALiBi bias: ``score + slope_h * (j - (i + offset))``; symmetric: ``score - slope_h * |j - (i + offset)|``.

    ``slope_h`` is `alibi_slopes` ``(num_heads)[h]``. The default is the paper's
    form, meant for causal attention (keys with ``j <= i + offset`` get a bias
    ``<= 0``). ``symmetric=True`` is FlashAttention's ``alibi_slopes`` bias for
    bidirectional attention.

    Args:
        num_heads: ``H``, the number of query heads the mod is used with (checked
            against the call).
        symmetric: use ``-slope_h * |j - (i + offset)|``.
        offset: query ``i`` sits at position ``i + offset``.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``num_heads`` or ``offset`` not an int, ``symmetric`` not a bool.
        ValueError: ``num_heads <= 0``; when the mod is used, a call with a
            different number of heads.

    Examples:
        >>> mod = alibi(2)
        >>> mod(torch.zeros(()), 0, torch.tensor([0, 1]), 3, 1).tolist()
        [-0.125, -0.0078125]
    """
    slopes = alibi_slopes(num_heads)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    offset = _check_int("offset", offset)

    def alibi_score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        slope = slopes.to(device=score.device, dtype=score.dtype)[h]
        distance = kv_idx - (q_idx + offset)  # j - (i + offset)
        if symmetric:
            return score - slope * torch.abs(torch.as_tensor(distance))
        return score + slope * distance

    def check(B: int, H: int, L: int, S: int) -> None:
        if H != num_heads:
            raise ValueError(f"alibi(num_heads): num_heads must equal the query heads H = {H}, got num_heads={num_heads}")

    _with_checks(alibi_score_mod, [check])
    return alibi_score_mod


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2): ``cap * tanh(score / cap)``, so ``|score| < cap``.

    Args:
        cap: a positive finite float.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``cap`` not a number.
        ValueError: ``cap`` not positive and finite.

    Examples:
        >>> softcap(2.0)(torch.tensor([0.0, 100.0]), 0, 0, 0, 0).tolist()
        [0.0, 2.0]
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"cap must be a positive finite float, got {type(cap).__name__}")
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap must be a positive finite float, got {cap}")
    cap = float(cap)

    def softcap_score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    _record_factory(softcap_score_mod, "softcap", cap=cap)
    return softcap_score_mod


def compose(*score_mods: ScoreMod) -> ScoreMod:
    """Apply score mods in order, first to last: ``compose(f, g)`` gives ``g(f(score, ...), ...)``.

    Args:
        *score_mods: score mods (none gives the identity).

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: an argument that is not a score mod (not callable, or not of 5 arguments).

    Examples:
        >>> mod = compose(alibi(1), softcap(1.0))
        >>> round(mod(torch.tensor(0.0), 0, torch.tensor(0), 2, 0).item(), 4)  # tanh(2^-8 * (0 - 2))
        -0.0078
    """
    for i, mod in enumerate(score_mods):
        check_mod(f"compose: score_mods[{i}]", mod, "score")
    mods = tuple(score_mods)

    def composed_score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    _with_checks(composed_score_mod, [c for mod in mods for c in _shape_checks(mod)])
    return composed_score_mod


# --- evaluating mods on index grids (create_mask and the math path) ----------------------------


def index_grids(
    batch: Sequence[int],
    L: int,
    S: int,
    device: torch.device | str | None = None,
    *,
    q_start: int = 0,
    kv_start: int = 0,
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, H, b, h, q_idx, kv_idx)`` for scores of shape ``(*batch, L, S)``: broadcasting index tensors.

    The last leading dim is the heads ``H``; the dims before it are flattened
    into the batch index ``b`` (``B`` entries). With one leading dim it is the
    heads and ``b`` is 0; with none, ``b = h = 0``. Each index has as many dims
    as the scores, so the four broadcast to ``(*batch, L, S)``. ``q_start`` and
    ``kv_start`` shift the positions, for a block of the scores: queries
    ``q_start .. q_start + L - 1`` against keys ``kv_start .. kv_start + S - 1``
    (the tiled path evaluates mods block by block).

    Examples:
        >>> B, H, b, h, q, kv = index_grids((2, 3), 5, 7)
        >>> B, H, b.shape, h.shape, q.shape, kv.shape
        (2, 3, torch.Size([2, 1, 1, 1]), torch.Size([1, 3, 1, 1]), torch.Size([1, 1, 5, 1]), torch.Size([1, 1, 1, 7]))
    """
    batch = tuple(batch)
    ones = (1,) * (len(batch) + 2)
    H = batch[-1] if batch else 1
    B = math.prod(batch[:-1])
    zero = torch.zeros(ones, dtype=torch.long, device=device)
    # (B,) -> (*batch[:-1], 1, 1, 1): the flattened index of the dims in front of the heads
    b = torch.arange(B, device=device).reshape(*batch[:-1], 1, 1, 1) if len(batch) > 1 else zero
    h = torch.arange(H, device=device).reshape(ones[:-3] + (H, 1, 1)) if batch else zero  # (..., H, 1, 1)
    q_idx = torch.arange(q_start, q_start + L, device=device).reshape(ones[:-2] + (L, 1))
    kv_idx = torch.arange(kv_start, kv_start + S, device=device).reshape(ones[:-1] + (S,))
    return B, H, b, h, q_idx, kv_idx


def apply_mask_mod(
    mask_mod: MaskMod,
    batch: Sequence[int],
    L: int,
    S: int,
    device: torch.device | str | None = None,
    *,
    q_start: int = 0,
    kv_start: int = 0,
    sizes: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the index grids of ``(*batch, L, S)`` scores and check what it returns.

    ``q_start``, ``kv_start`` and ``sizes`` evaluate a block of larger scores: queries
    ``q_start .. q_start + L - 1`` against keys ``kv_start .. kv_start + S - 1`` of scores
    whose full query and key lengths are ``sizes`` (what `validate_sizes` checks; default
    ``(L, S)``), as `attention_ref.distributed.ring_attention` evaluates each rank's blocks.

    Returns:
        A bool tensor broadcastable to ``(*batch, L, S)`` (not expanded).

    Raises:
        TypeError: ``mask_mod`` is not a mask mod, or returns a non-bool value.
        ValueError: it returns a tensor that does not broadcast to ``(*batch, L, S)``,
            or was built from tensors that do not fit the call (`validate_sizes`).

    Examples:
        >>> apply_mask_mod(causal(), (), 2, 2).int().tolist()
        [[1, 0], [1, 1]]
    """
    check_mod("mask_mod", mask_mod, "mask")
    B, H, b, h, q_idx, kv_idx = index_grids(batch, L, S, device, q_start=q_start, kv_start=kv_start)
    validate_sizes(mask_mod, B, H, *((L, S) if sizes is None else sizes))
    keep = _call_on_grids("mask_mod", mask_mod, b, h, q_idx, kv_idx)
    target = (*tuple(batch), L, S)
    return check_mask_result(keep, target, f"the scores (..., L, S) = {fmt_shape(target)}")


def check_mask_result(keep: object, target: tuple[int, ...], what: str) -> torch.Tensor:
    """A mask mod's result ``keep``, checked: a bool tensor broadcastable to ``target`` (``what`` names it
    in the error). Raises TypeError for another type or dtype, ValueError for another shape."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = takes part), got {got}")
    try:
        fits = tuple(torch.broadcast_shapes(keep.shape, target)) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"mask_mod must return a tensor broadcastable to {what}, got shape {fmt_shape(keep.shape)}")
    return keep


def _call_on_grids(name: str, mod: Callable[..., Any], *args: torch.Tensor) -> Any:
    """Call a mod on the broadcast index grids; an IndexError says how grids differ from FlexAttention's scalars."""
    try:
        return mod(*args)
    except IndexError as error:
        raise IndexError(
            f"{name} raised IndexError on the index grids: {error}. Here a mod is called once, on "
            "broadcasting index tensors (b, h, q_idx and kv_idx, each with as many dims as the scores), "
            "not once per element as FlexAttention calls it: index a captured tensor with one subscript, "
            "bias[b, h, q_idx, kv_idx], not bias[b][h][q_idx][kv_idx] (the chained spelling also crashes "
            "torch.compile(flex_attention) on a CPU)"
        ) from error


def apply_score_mod(score_mod: ScoreMod, scores: torch.Tensor) -> torch.Tensor:
    """Apply ``score_mod`` to ``(..., L, S)`` scores on their index grids and check what it returns.

    Returns:
        The modified scores, same shape and dtype as ``scores``.

    Raises:
        TypeError: ``score_mod`` is not a score mod, or returns a bool or
            non-floating-point value.
        ValueError: it returns a tensor whose shape is not the scores' shape, or
            was built for other sizes (`validate_sizes`, e.g. `alibi`'s heads).

    Examples:
        >>> apply_score_mod(softcap(1.0), torch.zeros(2, 3)).shape
        torch.Size([2, 3])
    """
    check_mod("score_mod", score_mod, "score")
    L, S = scores.shape[-2:]
    B, H, b, h, q_idx, kv_idx = index_grids(scores.shape[:-2], L, S, scores.device)
    validate_sizes(score_mod, B, H, L, S)
    modified = _call_on_grids("score_mod", score_mod, scores, b, h, q_idx, kv_idx)
    if not isinstance(modified, torch.Tensor):
        raise TypeError(f"score_mod must return a floating-point tensor, got {type(modified).__name__}")
    if modified.dtype == torch.bool:
        raise TypeError(
            "score_mod must return a floating-point tensor (the modified scores), got torch.bool; "
            "a boolean condition belongs in mask_mod"
        )
    if not modified.is_floating_point():
        raise TypeError(f"score_mod must return a floating-point tensor, got {modified.dtype}")
    if modified.shape != scores.shape:
        raise ValueError(
            f"score_mod must return a tensor of the scores' shape (..., L, S) = {fmt_shape(scores.shape)}, "
            f"got shape {fmt_shape(modified.shape)}"
        )
    return modified.to(scores.dtype)


def create_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    L: int,
    S: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The dense boolean mask of ``mask_mod``: ``out[b, h, i, j] = mask_mod(b, h, i, j)``.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)``.
        B: batch size; ``None`` means 1 (a mod that does not depend on ``b``).
        H: heads; ``None`` means 1.
        L: query length.
        S: key length.
        device: where to build it.

    Returns:
        ``(B, H, L, S)`` bool, ``True`` = takes part (the opposite of
        ``torch.nn.MultiheadAttention``'s boolean masks).

    Raises:
        TypeError: ``mask_mod`` not a mask mod or returning a non-bool tensor; a
            size that is not an int.
        ValueError: a negative size, a result that does not broadcast to
            ``(B, H, L, S)``, tensors inside the mod that do not fit these sizes.

    Examples:
        >>> create_mask(causal(), None, None, 2, 3).shape
        torch.Size([1, 1, 2, 3])
    """
    B = 1 if B is None else check_positive_int("B", B, allow_zero=True)
    H = 1 if H is None else check_positive_int("H", H, allow_zero=True)
    check_positive_int("L", L, allow_zero=True)
    check_positive_int("S", S, allow_zero=True)
    device = check_device("device", device)
    check_dense("create_mask", (B, H, L, S), torch.bool, device, copies=1,
                        noun="the (B, H, L, S) mask", instead="block_mask.create_block_mask keeps one kind per block instead")
    keep = apply_mask_mod(mask_mod, (B, H), L, S, device)
    return keep.expand(B, H, L, S).clone()
