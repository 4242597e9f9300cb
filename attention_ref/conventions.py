"""Each library's mask, ALiBi, attention-sink and log-sum-exp conventions, converted to this package's.

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

**Attention sinks and the log-sum-exp.** A learned sink is one logit ``s_h`` per
query head, in the space of the scaled (and soft-capped) scores and never
multiplied by ``scale``; it adds ``exp(s_h)`` to every row's softmax denominator
and has no value (`attention_ref.sinks`). This package's
``scaled_dot_product_attention(..., sinks=, return_lse=True)`` returns the
natural-log, sink-inclusive ``lse = log(sum_j exp(S_ij) + exp(s_h))``: ``s_h`` on
a row with no key, ``-inf`` on such a row without a sink. Libraries differ in the
base of their LSE, in whether it includes the sink, and in what an empty row
gets; the functions below convert a library's LSE to this package's and back.
They work on this package's layout ``(..., H, L)``: transpose a library's
``(L, H)`` LSE first (FlashInfer's, FlashMLA's sparse prefill). Outputs need no
conversion beyond their layout: every library below scales them as this package
does (0 on an empty row), except the sigmoid form, which gives NaN there.

| library | keyword, shape, dtype | LSE base | includes the sink? | empty-row LSE | function here |
| --- | --- | --- | --- | --- | --- |
| attention_ref | ``sinks``, ``(H,)``, any float | e | yes | ``s_h`` (``-inf`` without sinks) | |
| FlashAttention 4 (``flash_attn.cute``) | ``learnable_sink``, ``(H,)``, fp16, bf16, fp32 | e | yes | ``s_h`` (``-inf`` without) | `from_flash_attn_lse`, `to_flash_attn_lse` (the identity) |
| FlashInfer (fa2, fa3 ``run(..., sinks=)``) | ``sinks``, ``(H,)``, float32 | 2 | yes | ``s_h * log2(e)`` | `from_flashinfer_lse`, `to_flashinfer_lse` |
| FlashMLA (sparse decode, sparse prefill) | ``attn_sink``, ``(H,)``, float32 | e | no | ``+inf`` (with or without a sink) | `from_flash_mla_lse`, `to_flash_mla_lse` |
| gpt-oss ``sdpa``, transformers' gpt_oss eager | ``sinks``, ``(H,)``, bf16 | no LSE | | (output 0) | `gpt_oss_sink_attention` |
| transformers' Granite-SWA eager; vLLM's flex backend | ``sinks``, ``(H,)`` | no LSE (a sink-free one, inside) | | (output NaN) | `granite_swa_sink_attention` |

Sources (snapshots read 2026-08): FlashAttention ``0251105a``
``flash_attn/cute/interface.py`` (``seqlen_k == 0`` fills ``lse`` with
``learnable_sink``) and ``flash_attn/cute/testing.py::attention_ref``
(``lse = log(normalizer) + max(sink, rowmax)``); FlashInfer ``fb28d724``
``flashinfer/jit/attention/variants.py`` (``AttentionSink`` folds
``log_sink = sink * log2e`` into the running ``(m, d)`` before
``include/flashinfer/attention/prefill.cuh`` writes ``lse = log2(d) + m``;
``OnlineSoftmaxWithSink::finalize`` likewise); FlashMLA ``9241ae3e``
``flash_mla/flash_mla_interface.py`` (``attn_sink`` "has no effect on lse") and
``tests/ref.py`` (``torch.logsumexp``, natural log, the sink applied as
``1 / (1 + exp(sink - lse))``, ``lse = +inf`` for a query with no key; its tests
hold the kernels' LSE to it within ``8 / 65536`` relative, while the README's
sketch of sparse prefill writes it in base 2); openai/gpt-oss ``gpt_oss/torch/model.py``
(``sdpa``); transformers 5.23 ``models/gpt_oss/modeling_gpt_oss.py`` and
``models/granite_swa/modeling_granite_swa.py`` (``eager_attention_forward``).

Examples:
    >>> from attention_ref import mods
    >>> from attention_ref.conventions import from_hf_sliding_window
    >>> mods.create_mask(from_hf_sliding_window(2), None, None, 3, 3)[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attention_ref import _inputs, mods
from attention_ref._validation import (
    check_positive_int,
    fmt_shape,
    require_float_tensor,
)
from attention_ref.sinks import check_sinks, heads_of

__all__ = [
    "from_attention_gym_sliding_window",
    "from_flash_attn_alibi",
    "from_flash_attn_causal",
    "from_flash_attn_lse",
    "from_flash_attn_window",
    "from_flash_mla_lse",
    "from_flashinfer_lse",
    "from_hf_alibi",
    "from_hf_sliding_window",
    "gpt_oss_sink_attention",
    "granite_swa_sink_attention",
    "to_flash_attn_lse",
    "to_flash_mla_lse",
    "to_flashinfer_lse",
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


def from_flash_attn_window(
    window_size: Sequence[int], L: int, S: int, *, causal: bool = False, sink_token_length: int = 0
) -> mods.MaskMod:
    """FlashAttention's ``window_size=(left, right)``: ``sliding_window(left, right, offset=S - L)``.

    ``flash_attn_func`` keeps key ``j`` for query ``i`` when
    ``i + S - L - left <= j <= i + S - L + right``, both ends inclusive and
    aligned bottom-right (the last query is the last key); ``-1`` leaves that
    side unbounded. ``causal=True`` sets ``right`` to 0, as FlashAttention does.
    ``sink_token_length=n`` keeps keys ``j < n`` past the window's left end (not
    its right one), as the ``construct_local_mask`` of FlashAttention's test
    references does (StreamingLLM's sink tokens): ``sliding_window(...,
    sink_tokens=n)``.

    Args:
        window_size: ``(left, right)``, each an int ``>= -1``; ``-1`` = unbounded.
        L: query length.
        S: key length.
        causal: FlashAttention's ``causal`` flag, used together with the window.
        sink_token_length: the number of first keys kept outside the window's
            left end, ``>= 0``.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``.

    Raises:
        TypeError: ``window_size`` not a pair of ints; ``L`` or ``S`` not an int;
            ``causal`` not a bool; ``sink_token_length`` not an int.
        ValueError: a ``window_size`` entry below -1; a negative ``L``, ``S``
            or ``sink_token_length``.

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
    return mods.sliding_window(left, right, offset=offset, sink_tokens=sink_token_length)


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


# --- attention sinks and the log-sum-exp ------------------------------------------------------

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2  # FlashInfer's math::log2e


def _lse(value: object) -> torch.Tensor:
    """A log-sum-exp tensor ``(..., H, L)``: floating point, at least one dim."""
    return require_float_tensor("lse", value, 1, "(..., H, L)")


def _sink_rows(attn_sink: object, lse: torch.Tensor) -> torch.Tensor:
    """``attn_sink`` ``(H,)`` checked against ``lse`` ``(..., H, L)``, laid out like ``lse``, in its dtype."""
    heads = heads_of(lse.shape[:-1])
    if isinstance(attn_sink, torch.Tensor) and tuple(attn_sink.shape) != (heads,):
        raise ValueError(
            f"attn_sink must have shape (H,) = ({heads},), one logit per head of lse (..., H, L) = "
            f"{fmt_shape(lse.shape)}, got {fmt_shape(attn_sink.shape)}"
        )
    sinks = check_sinks(attn_sink, heads, lse, name="attn_sink").to(lse.dtype)
    # (H,) -> (H, 1) -> (..., H, L); an lse of one dim (L,) has H = 1
    return sinks[:, None].expand(lse.shape) if lse.dim() >= 2 else sinks.expand(lse.shape)


def from_flash_attn_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention 4's ``lse`` as this package's: the identity.

    FlashAttention 4 (``flash_attn.cute``'s ``flash_attn_func(...,
    learnable_sink=, return_lse=True)``) returns the natural-log LSE with the
    sink inside, as this package does: its reference ``attention_ref`` computes
    ``log(normalizer) + max(sink, rowmax)`` with ``exp(sink - max)`` in the
    normalizer, and a call with ``seqlen_k == 0`` fills ``lse`` with
    ``learnable_sink``, this package's ``s_h`` on a row with no key. Without a
    sink both give ``-inf`` there. Nothing changes: the function exists so that
    a port states the convention it checked, and the tests hold the two to one
    another.

    Layout: FlashAttention 4's ``lse`` is ``(B, H, L)`` (``(H, total_q)`` with
    ``cu_seqlens_q``), which is this package's ``(..., H, L)``; with ``qv`` (MLA)
    it is ``(B, L, H)``: transpose it.

    Args:
        lse: ``(..., H, L)``, FlashAttention 4's log-sum-exp.

    Returns:
        ``lse`` itself (no copy).

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import torch
        >>> lse = torch.tensor([[0.5, 2.0]])  # (H, L) = (1, 2)
        >>> from_flash_attn_lse(lse) is lse
        True
    """
    return _lse(lse)


def to_flash_attn_lse(lse: torch.Tensor) -> torch.Tensor:
    """This package's ``lse`` as FlashAttention 4's: the identity (see `from_flash_attn_lse`).

    Args:
        lse: ``(..., H, L)``, this package's sink-inclusive natural-log LSE.

    Returns:
        ``lse`` itself (no copy).

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import torch
        >>> to_flash_attn_lse(torch.tensor([float("-inf")])).tolist()  # no key, no sink: -inf in both
        [-inf]
    """
    return _lse(lse)


def from_flashinfer_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 ``lse`` as this package's natural-log one: ``lse * ln(2)``.

    FlashInfer's kernels keep the running max ``m`` and sum ``d`` in base 2 (the
    scores times ``sm_scale * log2(e)``) and write ``lse = m + log2(d)``. With
    ``sinks`` (``run(..., sinks=)``: the fa2 and fa3 ``AttentionSink`` variant)
    the sink enters ``(m, d)`` as ``sinks[h] * log2(e)`` before that write (in a
    split-KV run only in the first chunk, so the merged LSE counts it once), so
    the LSE includes it, as this package's does: only the base differs. A row
    with no key gets ``sinks[h] * log2(e)``, which converts to ``sinks[h]``. The
    ``sinks`` themselves need no conversion: FlashInfer takes natural-log logits
    (it multiplies them by ``log2(e)`` itself), as float32. Read from the fa2 and
    fa3 variants' source; the trtllm-gen backend, which also takes ``sinks``, was
    not checked.

    Layout: FlashInfer's ``lse`` is ``(total_q, H)``; transpose it to ``(H, L)``
    to line it up with this package's. The conversion is elementwise and keeps
    the layout.

    Args:
        lse: FlashInfer's log-sum-exp, base 2.

    Returns:
        ``lse * ln(2)``, natural log, in ``lse``'s dtype.

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import math, torch
        >>> sink = torch.tensor([2.0], dtype=torch.float64)
        >>> from_flashinfer_lse(sink * math.log2(math.e)).tolist()  # a row with no key: the sink, in base 2
        [2.0]
    """
    return _lse(lse) * _LN2


def to_flashinfer_lse(lse: torch.Tensor) -> torch.Tensor:
    """This package's natural-log ``lse`` as FlashInfer's base-2 one: ``lse * log2(e)``.

    The inverse of `from_flashinfer_lse`; both include the sink.

    Args:
        lse: this package's sink-inclusive natural-log LSE.

    Returns:
        ``lse * log2(e)``, base 2, in ``lse``'s dtype.

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import math, torch
        >>> to_flashinfer_lse(torch.tensor([math.log(8.0)], dtype=torch.float64)).round(decimals=12).tolist()
        [3.0]
    """
    return _lse(lse) * _LOG2E


def from_flash_mla_lse(lse: torch.Tensor, attn_sink: torch.Tensor | None = None) -> torch.Tensor:
    """FlashMLA's ``lse`` as this package's: the sink added, ``+inf`` read as a row with no key.

    FlashMLA's sparse kernels (``flash_mla_with_kvcache`` with ``indices``,
    ``flash_mla_sparse_fwd``) take ``attn_sink`` ``(H,)`` float32 and multiply
    the output by ``exp(lse) / (exp(lse) + exp(attn_sink))``, which is this
    package's sink. The ``lse`` they return leaves the sink out ("has no effect
    on lse"), is natural log (``tests/ref.py``), and is ``+inf`` for a query with
    no key, with or without a sink. This package's is
    ``log(exp(lse) + exp(attn_sink[h]))`` on a row with keys and
    ``attn_sink[h]`` (``-inf`` without a sink) on a row without.

    The outputs agree as they are, after the layout (FlashMLA's
    ``(B, L, H, Ev)``, this package's ``(..., H, L, Ev)``): both carry the
    sink's factor and both are 0 on a row with no key.

    Args:
        lse: ``(..., H, L)``, FlashMLA's log-sum-exp (decoding returns
            ``(B, H, L)``; transpose sparse prefill's ``(s_q, h_q)``).
        attn_sink: ``(H,)``, the sinks FlashMLA was given, or None for a call
            without.

    Returns:
        ``(..., H, L)``, this package's sink-inclusive LSE, in ``lse``'s dtype.

    Raises:
        TypeError: ``lse`` or ``attn_sink`` not a floating-point tensor.
        ValueError: ``lse`` with no dim; ``attn_sink`` not of shape ``(H,)``,
            on another device, or holding NaN or ``+inf`` (FlashMLA reads
            ``+inf`` as "zero this head's output"; this package's sinks are
            finite or ``-inf``).

    Examples:
        >>> import torch
        >>> lse = torch.tensor([[0.0, float("inf")]])  # H = 1: a row with keys, a row without
        >>> from_flash_mla_lse(lse, torch.tensor([0.0])).tolist()  # log(e^0 + e^0); the sink
        [[0.6931471824645996, 0.0]]
        >>> from_flash_mla_lse(lse).tolist()
        [[0.0, -inf]]
    """
    lse = _lse(lse)
    keys = lse.masked_fill(lse == float("inf"), float("-inf"))  # FlashMLA's empty row: no key
    if attn_sink is None:
        return keys
    return torch.logaddexp(keys, _sink_rows(attn_sink, lse))  # (..., H, L)


def to_flash_mla_lse(lse: torch.Tensor, attn_sink: torch.Tensor | None = None) -> torch.Tensor:
    """This package's ``lse`` as FlashMLA's: the sink taken out, ``+inf`` on a row with no key.

    The inverse of `from_flash_mla_lse`: ``log(exp(lse) - exp(attn_sink[h]))``,
    computed as ``lse + log(-expm1(attn_sink[h] - lse))``, and ``+inf`` where
    no key is left (``lse == attn_sink[h]``, or ``lse == -inf`` without a sink).
    Taking the sink out loses precision as the sink's weight
    ``exp(attn_sink[h] - lse)`` nears 1: the keys' share is then the difference
    of two near numbers, and a row whose keys weigh less than a few ulps of the
    sink reads as a row with no key. Without sinks this package's LSE is
    FlashMLA's with ``-inf`` made ``+inf``: pass ``attn_sink=None``.

    Args:
        lse: ``(..., H, L)``, this package's sink-inclusive natural-log LSE.
        attn_sink: ``(H,)``, the sinks it includes, or None.

    Returns:
        ``(..., H, L)``, FlashMLA's sink-free LSE, in ``lse``'s dtype.

    Raises:
        TypeError: ``lse`` or ``attn_sink`` not a floating-point tensor.
        ValueError: as `from_flash_mla_lse`; and an ``lse`` below its sink by
            more than rounding (a sink-free LSE, such as FlashMLA's own, passed
            where a sink-inclusive one belongs).

    Examples:
        >>> import math, torch
        >>> lse = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # e^0 + 2, and the sink alone
        >>> to_flash_mla_lse(lse, torch.tensor([0.0], dtype=torch.float64)).round(decimals=6).tolist()  # log 2; no key
        [[0.693147, inf]]
    """
    lse = _lse(lse)
    if attn_sink is None:
        return lse.masked_fill(lse == float("-inf"), float("inf"))
    sink = _sink_rows(attn_sink, lse)  # (..., H, L)
    gap = sink - lse  # <= 0 for a sink-inclusive lse; NaN where both are -inf
    rounding = 8 * torch.finfo(lse.dtype).eps * torch.where(torch.isfinite(sink), sink.abs(), 1.0).clamp(min=1.0)
    below = gap > rounding
    if bool(below.any()):
        at = tuple(below.nonzero()[0].tolist())
        raise ValueError(
            f"lse must include attn_sink (lse >= attn_sink[h] on every row, up to rounding), got lse = "
            f"{lse[at].item()} < attn_sink = {sink[at].item()} at index {at}; a sink-free lse, such as "
            f"FlashMLA's own, converts with from_flash_mla_lse"
        )
    empty = (gap >= 0) | (lse == float("-inf"))  # nothing but the sink: FlashMLA's +inf
    keys = lse + torch.log(-torch.expm1(gap.masked_fill(empty, -1.0)))  # log(e^lse - e^s), (..., H, L)
    return keys.masked_fill(empty, float("inf"))


def _eager_scores(
    query: object, key: object, value: object, sinks: object, attn_mask: object, scale: object, enable_gqa: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Checked inputs as the libraries' eager code sees them.

    Returns the scaled, masked scores ``(..., H, L, S)`` (``-inf`` where a
    boolean mask says False, a float mask added), ``value`` ``(..., H, S, Ev)``
    with grouped heads repeated, the sinks laid out ``(..., H, L, 1)``, all in
    the compute dtype (at least float32), and the query's dtype.
    """
    query, key, value, mask, resolved = _inputs.prepare(query, key, value, attn_mask, False, scale, enable_gqa)
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E): query head h uses kv head h // (H // Hkv)
        key = _inputs.expand_kv_heads(query, key, "key")
        value = _inputs.expand_kv_heads(query, value, "value")
    compute = torch.promote_types(query.dtype, torch.float32)
    # (..., H, L, E) @ (..., H, E, S) -> (..., H, L, S)
    scores = torch.matmul(query.to(compute), key.to(compute).transpose(-2, -1)) * resolved
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.to(compute)
    sinks = check_sinks(sinks, heads_of(scores.shape[:-2]), scores).to(compute)
    # (H,) -> (H, 1, 1) -> (..., H, L, 1); scores of two dims (L, S) have H = 1
    column = sinks[:, None, None] if scores.dim() >= 3 else sinks[:, None]
    return scores, value.to(compute), column.expand(*scores.shape[:-1], 1), query.dtype


def gpt_oss_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """gpt-oss's own form of sink attention: the sink as one more score column, softmax, the column dropped.

    openai/gpt-oss's ``sdpa`` (``gpt_oss/torch/model.py``) concatenates the
    sinks to the scaled, masked scores, takes the softmax over the ``S + 1``
    columns and drops the last; transformers' gpt_oss ``eager_attention_forward``
    does the same after subtracting the row max. This is that form in this
    package's layout and mask convention. It equals
    `attention_ref.scaled_dot_product_attention` with ``sinks`` (the tests hold
    them together, to gpt-oss's rule written out by loops in its own layout, and
    to transformers' function); the softmax runs in at least
    float32 (gpt-oss runs it in the input's bf16).

    From gpt-oss's tensors: its ``Q`` ``(T, Hkv, q_mult, D)`` is
    ``query = Q.permute(1, 2, 0, 3).reshape(H, T, D)`` (query head
    ``kv * q_mult + m``, which ``enable_gqa`` pairs with kv head ``kv``), its
    ``K`` and ``V`` ``(T, Hkv, D)`` are ``key = K.transpose(0, 1)``, its sinks
    ``(H,)`` are ``sinks``, and its causal mask with ``sliding_window=W`` (``W``
    keys, the current one included; 0 for none) is
    ``conventions.from_hf_sliding_window(W)`` (plain causal for 0).

    A row with no key gives output 0 (the sink takes all the weight), unless the
    head's sink is ``-inf``: the softmax then sees only ``-inf`` and the row is
    NaN, in gpt-oss as here, where `attention_ref.scaled_dot_product_attention`
    gives 0.

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, or ``(..., Hkv, S, E)`` with ``enable_gqa``.
        value: ``(..., H, S, Ev)``, or ``(..., Hkv, S, Ev)`` with ``enable_gqa``.
        sinks: ``(H,)``, one logit per query head, in the space of the scaled
            scores; ``-inf`` for a head without a sink.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., H, L, S)``.
        scale: multiplies the scores (not the sinks); defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: ``H`` a multiple of ``Hkv``.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype.

    Raises:
        TypeError: non-float inputs or inputs of different dtypes, an integer
            mask, ``sinks`` not a float tensor.
        ValueError: shapes that do not fit, a bad ``scale``, ``sinks`` not of
            shape ``(H,)`` or holding NaN or ``+inf``.

    Examples:
        >>> import torch
        >>> from attention_ref import scaled_dot_product_attention
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)  # H = 2
        >>> sinks = torch.tensor([0.5, -1.0])
        >>> out = gpt_oss_sink_attention(q, k, v, sinks)
        >>> torch.allclose(out, scaled_dot_product_attention(q, k, v, sinks=sinks), atol=1e-6)
        True
    """
    scores, value, column, dtype = _eager_scores(query, key, value, sinks, attn_mask, scale, enable_gqa)
    # (..., H, L, S + 1) -> softmax -> (..., H, L, S): the sink's column dropped after the softmax
    weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(weights, value).to(dtype)  # (..., H, L, S) @ (..., H, S, Ev) -> (..., H, L, Ev)


def granite_swa_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The sigmoid form of sink attention, ``softmax(S) V * sigmoid(lse - s_h)``, as Granite-SWA's eager path has it.

    transformers' Granite-SWA ``eager_attention_forward`` takes the sink-free
    ``lse = logsumexp(S)`` and scales the plain softmax's output by
    ``sigmoid(lse - sinks[h])``, because
    ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``. On a row with keys it
    equals the concatenated form (`gpt_oss_sink_attention`, this package's
    ``sinks``). On a row whose keys are all masked it does not: the softmax of a
    row of ``-inf`` is NaN, and ``NaN * sigmoid(-inf) = NaN * 0`` stays NaN, where the
    concatenated form and this package give 0. That is why this package puts the
    sink in the softmax's denominator and not after it. This function is here to
    show it; use `attention_ref.scaled_dot_product_attention` with ``sinks``.

    Where the NaN does not show: transformers builds float masks with
    ``finfo(dtype).min``, not ``-inf``, so its eager path sees a finite row,
    weights it uniformly and multiplies by ``sigmoid(≈ finfo.min) = 0`` (in
    float32 and half precision: float64 inputs meet its forced float32 softmax,
    where float64's ``finfo.min`` becomes ``-inf``, and are NaN again); and vLLM's flex
    backend applies the same factor to FlexAttention's sink-free result, which
    is 0 with ``lse = -inf`` on such a row, so the row stays 0 unless the head's
    sink is ``-inf`` (``-inf - -inf`` is NaN).

    Args:
        query: ``(..., H, L, E)``.
        key: ``(..., H, S, E)``, or ``(..., Hkv, S, E)`` with ``enable_gqa``.
        value: ``(..., H, S, Ev)``, or ``(..., Hkv, S, Ev)`` with ``enable_gqa``.
        sinks: ``(H,)``, one logit per query head, in the space of the scaled
            scores; ``-inf`` for a head without a sink.
        attn_mask: bool ``True`` = the pair takes part (the opposite of
            ``torch.nn.MultiheadAttention``), or float, added to the scores;
            broadcastable to ``(..., H, L, S)``.
        scale: multiplies the scores (not the sinks); defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: ``H`` a multiple of ``Hkv``.

    Returns:
        ``(..., H, L, Ev)`` in ``query``'s dtype, NaN on every row whose keys are
        all masked (0 when ``S = 0``: no row of ``-inf`` to take the softmax of).

    Raises:
        TypeError: non-float inputs or inputs of different dtypes, an integer
            mask, ``sinks`` not a float tensor.
        ValueError: shapes that do not fit, a bad ``scale``, ``sinks`` not of
            shape ``(H,)`` or holding NaN or ``+inf``.

    Examples:
        >>> import torch
        >>> q, k, v = torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 5)
        >>> keep = torch.tensor([[True, True, False], [False, False, False]])  # query 1 sees no key
        >>> out = granite_swa_sink_attention(q, k, v, torch.tensor([0.0]), keep)
        >>> out.isnan().all(dim=-1).tolist()
        [[False, True]]
    """
    scores, value, column, dtype = _eager_scores(query, key, value, sinks, attn_mask, scale, enable_gqa)
    lse = torch.logsumexp(scores, dim=-1)  # (..., H, L): sink-free, -inf on a row with no key
    sink_scale = torch.sigmoid(lse - column.squeeze(-1))  # e^lse / (e^lse + e^s), the keys' share: (..., H, L)
    weights = torch.softmax(scores, dim=-1)  # (..., H, L, S): NaN on a row of -inf
    out = torch.matmul(weights, value)  # (..., H, L, S) @ (..., H, S, Ev) -> (..., H, L, Ev)
    return (out * sink_scale.unsqueeze(-1)).to(dtype)  # NaN * 0 stays NaN on a row with no key
