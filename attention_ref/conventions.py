"""Each library's sliding-window, causal and ALiBi convention, as a mod of `attention_ref.mods`.

Libraries count a sliding window differently, align a causal mask to different
corners when ``L != S``, and write the ALiBi bias with different signs. Porting
``sliding_window=4`` from one library to another by copying the number is the
classic off-by-one. Each function below takes a library's parameters as that
library spells them and returns the equivalent mod, so the conversion is written,
documented and tested once.

Positions: query ``i`` and key ``j`` count from 0; ``L`` queries, ``S`` keys. A
library that aligns bottom-right puts query ``i`` at position ``i + S - L`` (the
last query is the last key: decoding with ``S - L`` cached tokens), which is
``offset = S - L`` in `attention_ref.mods`.

| library | its parameter | what it means | equivalent mod |
| --- | --- | --- | --- |
| Hugging Face transformers, vLLM | ``sliding_window=W`` (causal) | ``W`` keys, the current one included: ``i - W < j <= i`` | ``sliding_window(W - 1)`` |
| FlashAttention | ``window_size=(l, r)`` | keys ``i + S - L - l <= j <= i + S - L + r``, ``-1`` = unbounded | ``sliding_window(l, r, offset=S - L)`` |
| FlashAttention | ``causal=True`` | bottom-right aligned: ``j <= i + S - L`` | ``causal(offset=S - L)`` |
| attention-gym | ``SLIDING_WINDOW=W`` | ``i - j <= W`` and causal: ``W + 1`` keys | ``sliding_window(W)`` |
| ALiBi paper, Hugging Face (Bloom) | slopes of ``H`` heads, causal | ``+ slope_h * (j - i)`` (Bloom adds ``slope_h * j``, the same weights) | ``alibi(H)`` |
| FlashAttention | ``alibi_slopes`` | ``- slope_h * abs(i + S - L - j)`` | ``alibi(H, symmetric=True, offset=S - L)`` |

Sources: transformers ``masking_utils.py`` (``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``, with ``causal_mask_function``); vLLM's
FlashAttention backend (``window_size = (sliding_window - 1, 0)``);
FlashAttention's ``flash_attn_func`` docstring and ``tests/test_flash_attn.py``
(``construct_local_mask``, ``attn_bias_from_alibi_slopes``); attention-gym's
``generate_sliding_window`` (``q_idx - kv_idx <= window_size`` and causal);
transformers' Bloom ``build_alibi_tensor``.

Examples:
    >>> from attention_ref import mods
    >>> from attention_ref.conventions import from_hf_sliding_window
    >>> mods.create_mask(from_hf_sliding_window(2), None, None, 3, 3)[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence

from attention_ref import mods
from attention_ref._validation import check_positive_int

__all__ = [
    "from_attention_gym_sliding_window",
    "from_flash_attn_alibi",
    "from_flash_attn_causal",
    "from_flash_attn_window",
    "from_hf_alibi",
    "from_hf_sliding_window",
]


def _check_int(name: str, value: object, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def _lengths(L: object, S: object) -> int:
    """``S - L`` after checking both lengths; the offset of a bottom-right aligned query."""
    check_positive_int("L", L, allow_zero=True)
    check_positive_int("S", S, allow_zero=True)
    return S - L  # type: ignore[operator]


def from_hf_sliding_window(window: int, *, offset: int = 0) -> mods.MaskMod:
    """Hugging Face's and vLLM's causal ``sliding_window=W``: ``sliding_window(W - 1)``.

    transformers keeps key ``j`` for query ``i`` when ``j > i - W`` and
    ``j <= i`` (``sliding_window_causal_mask_function``): ``W`` keys, the
    current one included. vLLM passes FlashAttention ``window_size=(W - 1, 0)``,
    the same keys. In this package's terms that is ``W - 1`` keys to the left.

    Args:
        window: ``W``, the number of keys a query sees, itself included, ``>= 1``.
        offset: query ``i`` sits at position ``i + offset``; ``S - L`` when the
            ``S`` keys hold every earlier token (transformers' ``q_offset``
            minus ``kv_offset``).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``: ``i + offset - (W - 1) <= j <= i + offset``.

    Raises:
        TypeError: ``window`` or ``offset`` not an int.
        ValueError: ``window < 1`` (a window of 0 keys would mask every pair).

    Examples:
        >>> from attention_ref.mods import create_mask
        >>> create_mask(from_hf_sliding_window(2), None, None, 4, 4)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
        >>> from_hf_sliding_window(0)
        Traceback (most recent call last):
        ...
        ValueError: window must be an int >= 1 (Hugging Face's sliding_window counts the current token), got 0
    """
    expected = "an int >= 1 (Hugging Face's sliding_window counts the current token)"
    window = _check_int("window", window, expected)
    if window < 1:
        raise ValueError(f"window must be {expected}, got {window}")
    offset = _check_int("offset", offset, "an int")
    return mods.sliding_window(window - 1, 0, offset=offset)


def from_flash_attn_window(window_size: Sequence[int], L: int, S: int, *, causal: bool = False) -> mods.MaskMod:
    """FlashAttention's ``window_size=(left, right)``: ``sliding_window(left, right, offset=S - L)``.

    ``flash_attn_func`` keeps key ``j`` for query ``i`` when
    ``i + S - L - left <= j <= i + S - L + right``, both ends inclusive and
    aligned bottom-right (the last query is the last key); ``-1`` leaves that
    side unbounded. ``causal=True`` sets ``right`` to 0, as FlashAttention does.

    Args:
        window_size: ``(left, right)``, each an int ``>= -1``; ``-1`` = unbounded.
        L: query length.
        S: key length.
        causal: FlashAttention's ``causal`` flag, used together with the window.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``window_size`` not a pair of ints; ``L`` or ``S`` not an int;
            ``causal`` not a bool.
        ValueError: a ``window_size`` entry below -1; a negative ``L`` or ``S``.

    Examples:
        >>> from attention_ref.mods import create_mask
        >>> create_mask(from_flash_attn_window((1, 0), 2, 4), None, None, 2, 4)[0, 0].int().tolist()
        [[0, 1, 1, 0], [0, 0, 1, 1]]
        >>> from_flash_attn_window((-2, 0), 2, 4)
        Traceback (most recent call last):
        ...
        ValueError: window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), got (-2, 0)
    """
    expected = "a pair (left, right) of ints >= -1 (-1 = unbounded)"
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) or len(window_size) != 2:
        got = window_size if isinstance(window_size, Sequence) else type(window_size).__name__
        raise TypeError(f"window_size must be {expected}, got {got!r}")
    if any(isinstance(w, bool) or not isinstance(w, int) for w in window_size):
        raise TypeError(f"window_size must be {expected}, got {tuple(window_size)!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size must be {expected}, got {tuple(window_size)!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    offset = _lengths(L, S)
    left, right = (None if w == -1 else w for w in window_size)
    if causal:
        right = 0
    return mods.sliding_window(left, right, offset=offset)


def from_flash_attn_causal(L: int, S: int) -> mods.MaskMod:
    """FlashAttention's ``causal=True``, aligned bottom-right: ``causal(offset=S - L)``.

    Key ``j`` takes part for query ``i`` when ``j <= i + S - L``. With
    ``L == S`` this is PyTorch's ``is_causal=True`` (top-left aligned); with
    ``L != S`` the two differ. With ``L > S`` the first ``L - S`` queries see no
    key (FlashAttention gives them an output of 0, as this package does).

    Args:
        L: query length.
        S: key length.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``L`` or ``S`` not an int.
        ValueError: a negative ``L`` or ``S``.

    Examples:
        >>> from attention_ref.mods import create_mask
        >>> create_mask(from_flash_attn_causal(2, 5), None, None, 2, 5)[0, 0].int().tolist()
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
        >>> from_flash_attn_causal(2, -5)
        Traceback (most recent call last):
        ...
        ValueError: S must be a non-negative int, got -5
    """
    return mods.causal(offset=_lengths(L, S))


def from_attention_gym_sliding_window(window: int) -> mods.MaskMod:
    """attention-gym's ``SLIDING_WINDOW=W`` (``generate_sliding_window``): ``sliding_window(W)``.

    attention-gym keeps key ``j`` for query ``i`` when ``i - j <= W`` and
    ``i >= j``: ``W`` keys before the query plus the query's own, ``W + 1`` in
    all. Its ``W`` is this package's ``left``.

    Args:
        window: ``W``, how far back a query looks, ``>= 0``.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``: ``i - W <= j <= i``.

    Raises:
        TypeError: ``window`` not an int.
        ValueError: ``window < 0``.

    Examples:
        >>> from attention_ref.mods import create_mask
        >>> create_mask(from_attention_gym_sliding_window(1), None, None, 3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
        >>> from_attention_gym_sliding_window(-1)
        Traceback (most recent call last):
        ...
        ValueError: window must be an int >= 0 (attention-gym's SLIDING_WINDOW counts the keys before the query), got -1
    """
    expected = "an int >= 0 (attention-gym's SLIDING_WINDOW counts the keys before the query)"
    window = _check_int("window", window, expected)
    if window < 0:
        raise ValueError(f"window must be {expected}, got {window}")
    return mods.sliding_window(window)


def from_hf_alibi(num_heads: int) -> mods.ScoreMod:
    """The ALiBi paper's bias as Hugging Face's Bloom adds it: ``alibi(H)``, for causal attention.

    The paper (Press et al., 2022) adds ``slope_h * (j - i)`` to the score of
    query ``i`` and key ``j <= i``. Bloom's ``build_alibi_tensor`` adds
    ``slope_h * j``, which differs by ``slope_h * i``, the same for every key of
    a row: softmax ignores it, so the weights are those of ``alibi(H)``. So
    does a query offset (a cache): ``alibi(H)`` needs none. Use it with a causal
    mask; without one, keys after the query get a positive bias that grows with
    the distance. The slopes are the paper's (`attention_ref.mods.alibi_slopes`),
    which Bloom's ``_get_alibi_slopes`` also computes.

    Args:
        num_heads: ``H``, the number of query heads, ``> 0``.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``: ``score + slope_h * (j - i)``.

    Raises:
        TypeError: ``num_heads`` not an int.
        ValueError: ``num_heads <= 0``.

    Examples:
        >>> import torch
        >>> from_hf_alibi(4)(torch.zeros(3), 0, 0, 2, torch.arange(3)).tolist()  # slope 1/4
        [-0.5, -0.25, 0.0]
    """
    return mods.alibi(num_heads)


def from_flash_attn_alibi(num_heads: int, L: int, S: int) -> mods.ScoreMod:
    """FlashAttention's ``alibi_slopes``: ``alibi(H, symmetric=True, offset=S - L)``.

    ``flash_attn_func`` adds ``-slope_h * |i + S - L - j|`` to the score of
    query ``i`` and key ``j``: symmetric, and aligned bottom-right like its
    causal mask. FlashAttention takes the slopes as a tensor; pass it
    `attention_ref.mods.alibi_slopes` ``(H)`` (the paper's slopes) for the two
    to agree. Under FlashAttention's causal mask the kept keys have
    ``j <= i + S - L``, where this equals the paper's ``slope_h * (j - i)`` up
    to a constant per row, so the weights equal `from_hf_alibi`'s.

    Args:
        num_heads: ``H``, the number of query heads, ``> 0``.
        L: query length.
        S: key length.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``num_heads``, ``L`` or ``S`` not an int.
        ValueError: ``num_heads <= 0``; a negative ``L`` or ``S``.

    Examples:
        >>> import torch
        >>> from_flash_attn_alibi(4, 1, 3)(torch.zeros(3), 0, 0, 0, torch.arange(3)).tolist()
        [-0.5, -0.25, 0.0]
    """
    offset = _lengths(L, S)
    return mods.alibi(num_heads, symmetric=True, offset=offset)
