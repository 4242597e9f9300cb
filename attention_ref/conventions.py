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

**Multi-head latent attention in three kernels.** Decoding kernels for MLA run its
absorbed form (`attention_ref.mla.mla_absorbed`): the query ``q_nope W_UK`` (``C``
values per head) and its RoPE part (``R``) against one key/value head read from
the latent cache, ``[c_KV | k_pe]`` (``C + R``) with value ``c_KV`` (``C``).
They never see ``W_UK`` or ``W_UV``, and they lay the same numbers out in three
ways. ``to_*`` takes `attention_ref.mla`'s arguments and returns the kernel's
keyword arguments, with the softmax scale always set to MLA's
(`attention_ref.mla.softmax_scale`); ``from_*`` takes the kernel's arguments
(its default scale included) and returns keyword arguments of ``mla_absorbed``
(the absorbed query as ``q_nope``, ``w_uk = w_uv = I``);
`from_mla_kernel_output` applies ``W_UV`` to the kernel's output. DeepSeek-V3's
sizes: ``C = 512``, ``R = 64``, ``P + R = 192``.

| library | call | query | key / value | default scale | functions here |
| --- | --- | --- | --- | --- | --- |
| FlashAttention 4 | ``flash_attn_func(q, k, v, qv=)`` | ``q`` = ``q_pe`` ``(B, L, H, R)``, ``qv`` = absorbed ``(B, L, H, C)`` | ``k`` ``(B, S, 1, R)``, ``v`` ``(B, S, 1, C)``; scores ``q k^T + qv v^T`` | ``1/sqrt(R + C)`` (wrong for MLA) | `to_flash_attn_qv`, `from_flash_attn_qv` |
| FlashMLA (dense decode, "MQA mode") | ``flash_mla_with_kvcache`` | ``q`` ``(B, L, H, C + R)``, absorbed first | ``k_cache`` ``(blocks, page, 1, C + R)``; value = the first ``head_dim_v = C`` | ``1/sqrt(C + R)`` (wrong for MLA) | `to_flash_mla`, `from_flash_mla` |
| FlashInfer | ``BatchMLAPagedAttentionWrapper`` ``plan``, ``run`` | ``q_nope`` (absorbed) ``(nnz, H, C)``, ``q_pe`` ``(nnz, H, R)`` | ``ckv_cache`` ``(pages, page, C)``, ``kpe_cache`` ``(pages, page, R)`` | none (``sm_scale`` required) | `to_flashinfer_mla`, `from_flashinfer_mla` |

MLA's scale is ``mscale^2 / sqrt(P + R)`` (``1/sqrt(192)`` times YaRN's factor in
DeepSeek-V3), whatever the absorbed query's size: a DeepSeek caller of
FlashAttention 4 or FlashMLA must pass ``softmax_scale``. Sources (snapshots read
2026-08): FlashAttention ``0251105a`` ``flash_attn/cute/interface.py``
(``_flash_attn_fwd``: ``1 / sqrt(head_dim + head_dim_v)`` when ``q`` and ``qv``
are given); FlashMLA ``02fe0d02`` ``flash_mla/flash_mla_interface.py``
(``softmax_scale = q.shape[-1] ** (-0.5)``, ``head_dim_v`` 512); FlashInfer
``fb28d724`` ``flashinfer/mla/_core.py`` (``plan(..., head_dim_ckv, head_dim_kpe,
page_size, causal, sm_scale)``, ``run(q_nope, q_pe, ckv_cache, kpe_cache)``; its
example passes ``sm_scale = 1.0 / ((128 + 64) ** 0.5)``, "use head dimension before
matrix absorption", as ``tests/attention/test_deepseek_mla.py`` does).

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
    require_int_tensor,
    require_same_dtype_and_device,
)
from attention_ref.sinks import check_sinks, heads_of

__all__ = [
    "from_attention_gym_sliding_window",
    "from_flash_attn_alibi",
    "from_flash_attn_causal",
    "from_flash_attn2_lse",
    "from_flash_attn_lse",
    "from_flash_attn_qv",
    "from_flash_attn_window",
    "from_flash_mla",
    "from_flash_mla_lse",
    "from_flashinfer_lse",
    "from_flashinfer_mla",
    "from_hf_alibi",
    "from_hf_sliding_window",
    "from_mla_kernel_output",
    "gpt_oss_sink_attention",
    "granite_swa_sink_attention",
    "to_flash_attn2_lse",
    "to_flash_attn_lse",
    "to_flash_attn_qv",
    "to_flash_mla",
    "to_flash_mla_lse",
    "to_flashinfer_lse",
    "to_flashinfer_mla",
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


def from_flash_attn2_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention 2's (and 3's) ``lse`` as this package's: ``+inf`` on a row with no key becomes ``-inf``.

    FlashAttention 2 and 3 return the natural-log LSE ``(B, H, L)`` (``(H,
    total_q)`` with ``cu_seqlens_q``), the same as this package's on every row
    that sees a key. On a row with no key (bottom-right causal with ``L > S``, a
    window that empties it) their kernels write ``+inf`` (``-inf`` only in a
    split-KV partial result), where this package writes ``-inf``, the log of an
    empty sum. Pass theirs through this before
    `attention_ref.testing.assert_attention_close` (``actual_lse=``).

    Args:
        lse: ``(..., H, L)``, FlashAttention 2's or 3's log-sum-exp.

    Returns:
        A new tensor, ``+inf`` replaced by ``-inf``.

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import torch
        >>> from_flash_attn2_lse(torch.tensor([[float("inf"), 0.5]])).tolist()  # row 0 saw no key
        [[-inf, 0.5]]
    """
    lse = _lse(lse)
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def to_flash_attn2_lse(lse: torch.Tensor) -> torch.Tensor:
    """This package's ``lse`` as FlashAttention 2's (and 3's): ``-inf`` on a row with no key becomes ``+inf``.

    The inverse of `from_flash_attn2_lse`.

    Args:
        lse: ``(..., H, L)``, this package's natural-log LSE (without sinks: FlashAttention 2 has none).

    Returns:
        A new tensor, ``-inf`` replaced by ``+inf``.

    Raises:
        TypeError: ``lse`` not a floating-point tensor.
        ValueError: ``lse`` with no dim.

    Examples:
        >>> import torch
        >>> to_flash_attn2_lse(torch.tensor([float("-inf"), 1.0])).tolist()
        [inf, 1.0]
    """
    lse = _lse(lse)
    return lse.masked_fill(lse == float("-inf"), float("inf"))


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


# --- multi-head latent attention: three kernels' layouts -----------------------------------------
#
# The kernels below run MLA's absorbed form (`attention_ref.mla.mla_absorbed`): they see
# the absorbed query q_latent = q_nope W_UK (C values per head), the query's RoPE part
# (R), and one key/value head read from the latent cache. They never see W_UK or W_UV.
# `to_*` lays this package's MLA arguments out as the kernel's; `from_*` turns the
# kernel's arguments into keyword arguments of `mla_absorbed` (and `mla_naive`): the
# absorbed query passed as ``q_nope`` with ``w_uk`` and ``w_uv`` the identity, so the
# package's ``(B, H, L, C)`` result is the kernel's output, transposed.


def _check_kernel_scale(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive finite float or None, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float or None, got {value}")
    return float(value)


def _check_latent_args(
    q_nope: object, q_pe: object, latent: object, k_pe: object, w_uk: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This package's MLA arguments (those the kernels need) checked against each other."""
    layouts = {"q_nope": "(B, H, L, P)", "q_pe": "(B, H, L, R)", "latent": "(B, S, C)",
               "k_pe": "(B, S, R)", "w_uk": "(H, P, C)"}
    given = {"q_nope": q_nope, "q_pe": q_pe, "latent": latent, "k_pe": k_pe, "w_uk": w_uk}
    tensors = {}
    for name, value in given.items():
        dims = layouts[name].count(",") + 1
        tensor = require_float_tensor(name, value, dims, layouts[name])
        if tensor.dim() != dims:
            raise ValueError(f"{name} must have shape {layouts[name]}, got {fmt_shape(tensor.shape)}")
        tensors[name] = tensor
    require_same_dtype_and_device(**tensors)
    B, H, L, P = tensors["q_nope"].shape
    R = tensors["q_pe"].shape[-1]
    S, C = tensors["latent"].shape[1:]
    expected = {"q_pe": (B, H, L, R), "latent": (B, S, C), "k_pe": (B, S, R), "w_uk": (H, P, C)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{name} must have shape {layouts[name]} = {fmt_shape(shape)} (B, H, L, P from q_nope "
                f"{fmt_shape(tensors['q_nope'].shape)}, S, C from latent {fmt_shape(tensors['latent'].shape)}), "
                f"got {fmt_shape(tensors[name].shape)}"
            )
    return tensors["q_nope"], tensors["q_pe"], tensors["latent"], tensors["k_pe"], tensors["w_uk"]


def _absorbed_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_latent = q_nope W_UK`` in the kernels' layout ``(B, L, H, C)``."""
    q_latent = torch.einsum("bhlp,hpc->bhlc", q_nope, w_uk)  # (B, H, L, P) x (H, P, C) -> (B, H, L, C)
    return q_latent.transpose(1, 2)  # (B, H, L, C) -> (B, L, H, C)


def _mla_kwargs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, scale: float
) -> dict[str, torch.Tensor | float]:
    """Keyword arguments of `mla_absorbed` for an absorbed query: ``W_UK = W_UV = I``.

    ``q_latent`` ``(B, L, H, C)`` and ``q_pe`` ``(B, L, H, R)`` in the kernels'
    layout, ``latent`` ``(B, S, C)`` and ``k_pe`` ``(B, S, R)``.
    """
    H, C = q_latent.shape[2], q_latent.shape[3]
    eye = torch.eye(C, dtype=q_latent.dtype, device=q_latent.device).expand(H, C, C)  # (H, C, C)
    return {
        "q_nope": q_latent.transpose(1, 2),  # (B, L, H, C) -> (B, H, L, C): "P" = C
        "q_pe": q_pe.transpose(1, 2),  # (B, L, H, R) -> (B, H, L, R)
        "latent": latent,
        "k_pe": k_pe,
        "w_uk": eye,
        "w_uv": eye,
        "scale": scale,
    }


def _one_kv_head(name: str, tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """``(B, S, 1, D)`` -> ``(B, S, D)``: the absorbed form has one key/value head."""
    if tensor.dim() != 4 or tensor.shape[2] != 1:
        raise ValueError(
            f"{name} must have shape {layout} with one key/value head (MLA's absorbed form), "
            f"got {fmt_shape(tensor.shape)}"
        )
    return tensor[:, :, 0]


def to_flash_attn_qv(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    *,
    scale: float | None = None,
) -> dict[str, torch.Tensor | float | None]:
    r"""This package's MLA arguments as FlashAttention 4's ``flash_attn_func(q, k, v, qv=, softmax_scale=)``.

    FlashAttention 4 (``flash_attn.cute``, Blackwell) runs MLA's absorbed form
    through an extra query ``qv`` that scores against the values:

    $$
    O = \mathrm{softmax}\big(\text{scale}\cdot(q k^\top + q_v v^\top)\big)\, v ,
    $$

    with ``q`` the RoPE query ``q_pe`` ``(B, L, H, R)``, ``k`` the cached RoPE
    key ``(B, S, 1, R)``, ``v`` the cached latent ``c_KV`` ``(B, S, 1, C)`` and
    ``qv`` the absorbed query ``q_nope W_UK`` ``(B, L, H, C)``; its output is
    ``(B, L, H, C)`` (`from_mla_kernel_output` applies ``W_UV``).

    **The trap.** Without ``softmax_scale``, FlashAttention 4 uses
    ``1 / sqrt(head_dim + head_dim_v) = 1 / sqrt(R + C)`` (``1 / sqrt(576)``
    in DeepSeek-V3; ``flash_attn/cute/interface.py``, ``_flash_attn_fwd``).
    MLA's scores are the naive form's, regrouped, and need the naive scale
    ``mscale^2 / sqrt(P + R)`` (``1 / sqrt(192)`` times YaRN's factor). So a
    DeepSeek caller must pass ``softmax_scale``; this function always returns
    it, `attention_ref.mla.softmax_scale` ``(P, R)`` unless ``scale`` is given.

    With ``R = 0`` (Kimi Linear's NoPE MLA) ``q`` and ``k`` are None:
    FlashAttention 4 then scores with ``qv`` alone.

    Args:
        q_nope: ``(B, H, L, P)``.
        q_pe: ``(B, H, L, R)``, already rotated.
        latent: ``(B, S, C)``, the cached ``c_KV``.
        k_pe: ``(B, S, R)``, the cached RoPE key, already rotated.
        w_uk: ``(H, P, C)``, from `attention_ref.mla.split_kv_b_proj`.
        scale: the scale `attention_ref.mla.mla_absorbed` would use: default
            ``1 / sqrt(P + R)``; pass `attention_ref.mla.softmax_scale` with
            YaRN's ``mscale``.

    Returns:
        ``{"q", "k", "v", "qv", "softmax_scale"}``, keyword arguments of
        ``flash_attn_func`` (add ``causal=`` and the rest yourself).

    Raises:
        TypeError: non-float tensors, tensors of different dtypes, a scale
            that is not a number.
        ValueError: shapes that do not fit, a non-positive scale.

    Examples:
        >>> import torch
        >>> B, H, L, S, P, R, C = 2, 3, 1, 7, 11, 4, 13
        >>> args = (torch.randn(B, H, L, P), torch.randn(B, H, L, R), torch.randn(B, S, C),
        ...         torch.randn(B, S, R), torch.randn(H, P, C))
        >>> fa4 = to_flash_attn_qv(*args)
        >>> {name: tuple(t.shape) for name, t in fa4.items() if name != "softmax_scale"}
        {'q': (2, 1, 3, 4), 'k': (2, 7, 1, 4), 'v': (2, 7, 1, 13), 'qv': (2, 1, 3, 13)}
        >>> fa4["softmax_scale"] == 1 / (11 + 4) ** 0.5  # the naive form's, not 1 / sqrt(4 + 13)
        True
    """
    from attention_ref.mla import softmax_scale

    q_nope, q_pe, latent, k_pe, w_uk = _check_latent_args(q_nope, q_pe, latent, k_pe, w_uk)
    scale = _check_kernel_scale("scale", scale)
    P, R = q_nope.shape[-1], q_pe.shape[-1]
    return {
        "q": q_pe.transpose(1, 2) if R else None,  # (B, H, L, R) -> (B, L, H, R)
        "k": k_pe.unsqueeze(2) if R else None,  # (B, S, R) -> (B, S, 1, R)
        "v": latent.unsqueeze(2),  # (B, S, C) -> (B, S, 1, C)
        "qv": _absorbed_query(q_nope, w_uk),  # (B, L, H, C)
        "softmax_scale": softmax_scale(P, R) if scale is None else scale,
    }


def from_flash_attn_qv(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor,
    qv: torch.Tensor,
    softmax_scale: float | None = None,
) -> dict[str, torch.Tensor | float]:
    r"""FlashAttention 4's ``qv`` call as keyword arguments of `attention_ref.mla.mla_absorbed`.

    ``flash_attn_func(q, k, v, qv=qv, softmax_scale=s)`` computes
    ``softmax(s * (q k^T + qv v^T)) v`` (see `to_flash_attn_qv`). The returned
    arguments compute the same: ``qv`` as ``q_nope``, ``q`` as ``q_pe``, ``v``
    as ``latent``, ``k`` as ``k_pe``, ``w_uk = w_uv = I``, so that
    ``mla_absorbed(**args)`` ``(B, H, L, C)`` is FlashAttention 4's output
    ``(B, L, H, C)`` transposed.

    ``softmax_scale=None`` gives FlashAttention 4's default, the trap:
    ``1 / sqrt(R + C)`` (``1 / sqrt(C)`` without ``q``), not MLA's
    ``1 / sqrt(P + R)``: the call reproduced here is the kernel's, mistake
    included.

    Args:
        q: ``(B, L, H, R)``, the RoPE query, or None (with ``k``) for NoPE MLA.
        k: ``(B, S, 1, R)``, the RoPE key cache, or None.
        v: ``(B, S, 1, C)``, the latent cache.
        qv: ``(B, L, H, C)``, the absorbed query ``q_nope W_UK``.
        softmax_scale: as passed to FlashAttention 4; None for its default.

    Returns:
        ``{"q_nope", "q_pe", "latent", "k_pe", "w_uk", "w_uv", "scale"}``.

    Raises:
        TypeError: non-float tensors, tensors of different dtypes, a scale
            that is not a number.
        ValueError: shapes that do not fit (more than one key/value head
            included), only one of ``q`` and ``k``, a non-positive scale.

    Examples:
        >>> import math, torch
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 5, 1, 4)
        >>> v, qv = torch.randn(1, 5, 1, 7), torch.randn(1, 2, 3, 7)
        >>> args = from_flash_attn_qv(q, k, v, qv)
        >>> args["scale"] == 1 / math.sqrt(4 + 7)  # FlashAttention 4's default
        True
        >>> from attention_ref.mla import mla_absorbed
        >>> mla_absorbed(**args).shape  # (B, H, L, C)
        torch.Size([1, 3, 2, 7])
    """
    if (q is None) != (k is None):
        raise ValueError(
            f"q and k must both be tensors or both be None (NoPE MLA), got q {type(q).__name__} "
            f"and k {type(k).__name__}"
        )
    qv = require_float_tensor("qv", qv, 4, "(B, L, H, C)")
    v = require_float_tensor("v", v, 4, "(B, S, 1, C)")
    if qv.dim() != 4:
        raise ValueError(f"qv must have shape (B, L, H, C), got {fmt_shape(qv.shape)}")
    B, L, H, C = qv.shape
    latent = _one_kv_head("v", v, "(B, S, 1, C)")  # (B, S, C)
    S = latent.shape[1]
    if tuple(latent.shape) != (B, S, C):
        raise ValueError(
            f"v must have shape (B, S, 1, C) = ({B}, S, 1, {C}) (B, C from qv {fmt_shape(qv.shape)}), "
            f"got {fmt_shape(v.shape)}"
        )
    if q is None:
        q_pe = qv.new_zeros(B, L, H, 0)  # (B, L, H, 0): no RoPE part
        k_pe = qv.new_zeros(B, S, 0)  # (B, S, 0)
    else:
        q_pe = require_float_tensor("q", q, 4, "(B, L, H, R)")
        k = require_float_tensor("k", k, 4, "(B, S, 1, R)")
        R = q_pe.shape[-1]
        if q_pe.dim() != 4 or tuple(q_pe.shape[:3]) != (B, L, H):
            raise ValueError(
                f"q must have shape (B, L, H, R) = ({B}, {L}, {H}, R) (from qv {fmt_shape(qv.shape)}), "
                f"got {fmt_shape(q_pe.shape)}"
            )
        k_pe = _one_kv_head("k", k, "(B, S, 1, R)")  # (B, S, R)
        if tuple(k_pe.shape) != (B, S, R):
            raise ValueError(
                f"k must have shape (B, S, 1, R) = ({B}, {S}, 1, {R}) (from q {fmt_shape(q_pe.shape)} "
                f"and v {fmt_shape(v.shape)}), got {fmt_shape(k.shape)}"
            )
        require_same_dtype_and_device(qv=qv, v=v, q=q_pe, k=k)
    require_same_dtype_and_device(qv=qv, v=v)
    scale = _check_kernel_scale("softmax_scale", softmax_scale)
    if scale is None:  # FlashAttention 4's default: head_dim + head_dim_v with q, head_dim_v without
        scale = 1.0 / math.sqrt(q_pe.shape[-1] + C)
    return _mla_kwargs(qv, q_pe, latent, k_pe, scale)


def to_flash_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    *,
    scale: float | None = None,
) -> dict[str, torch.Tensor | int | float]:
    """This package's MLA arguments as FlashMLA's ``flash_mla_with_kvcache`` (dense decoding, "MQA mode").

    FlashMLA takes the absorbed query and the RoPE query in one tensor, ``q``
    ``(B, L, H, C + R)`` (576 in DeepSeek-V3: ``[q_nope W_UK | q_pe]``), and
    one key cache ``k_cache`` ``(num_blocks, page_block_size, 1, C + R)``
    whose rows are ``[c_KV | k_pe]``; the value is the first ``head_dim_v = C``
    (512) features of the same rows. Its output is ``(B, L, H, C)``
    (`from_mla_kernel_output` applies ``W_UV``). Here every sequence gets one
    page of ``S`` rows: ``k_cache`` ``(B, S, 1, C + R)``, ``block_table``
    ``[[0], [1], ...]``, ``cache_seqlens`` all ``S`` (FlashMLA's kernels want
    pages of 64 rows: re-page for a real call).

    Without ``softmax_scale`` FlashMLA uses ``q.shape[-1] ** -0.5``,
    ``1 / sqrt(576)``: the wrong scale for MLA. This function always returns
    the naive form's (`attention_ref.mla.softmax_scale`) unless ``scale`` is given.

    Args:
        q_nope: ``(B, H, L, P)``.
        q_pe: ``(B, H, L, R)``, already rotated.
        latent: ``(B, S, C)``.
        k_pe: ``(B, S, R)``, already rotated.
        w_uk: ``(H, P, C)``.
        scale: default ``1 / sqrt(P + R)``.

    Returns:
        ``{"q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
        "softmax_scale"}``, keyword arguments of ``flash_mla_with_kvcache``
        (add ``tile_scheduler_metadata`` and ``causal``); ``block_table`` and
        ``cache_seqlens`` are int32.

    Raises:
        TypeError: non-float tensors, tensors of different dtypes, a scale
            that is not a number.
        ValueError: shapes that do not fit, a non-positive scale.

    Examples:
        >>> import torch
        >>> B, H, L, S, P, R, C = 2, 3, 1, 7, 11, 4, 13
        >>> mla = to_flash_mla(torch.randn(B, H, L, P), torch.randn(B, H, L, R), torch.randn(B, S, C),
        ...                    torch.randn(B, S, R), torch.randn(H, P, C))
        >>> tuple(mla["q"].shape), tuple(mla["k_cache"].shape), mla["head_dim_v"]
        ((2, 1, 3, 17), (2, 7, 1, 17), 13)
    """
    from attention_ref.mla import softmax_scale

    q_nope, q_pe, latent, k_pe, w_uk = _check_latent_args(q_nope, q_pe, latent, k_pe, w_uk)
    scale = _check_kernel_scale("scale", scale)
    (B, S, C), (P, R) = latent.shape, (q_nope.shape[-1], q_pe.shape[-1])
    # (B, L, H, C) and (B, H, L, R) -> (B, L, H, R) -> (B, L, H, C + R)
    q = torch.cat((_absorbed_query(q_nope, w_uk), q_pe.transpose(1, 2)), dim=-1)
    k_cache = torch.cat((latent, k_pe), dim=-1).unsqueeze(2)  # (B, S, C + R) -> (B, S, 1, C + R)
    return {
        "q": q,
        "k_cache": k_cache,
        "block_table": torch.arange(B, dtype=torch.int32, device=latent.device)[:, None],  # (B, 1)
        "cache_seqlens": torch.full((B,), S, dtype=torch.int32, device=latent.device),  # (B,)
        "head_dim_v": C,
        "softmax_scale": softmax_scale(P, R) if scale is None else scale,
    }


def _equal_lengths(name: str, lengths: torch.Tensor, what: str) -> int:
    """The one length every sequence has; this package's form has one ``L`` and one ``S`` per batch."""
    values = sorted({int(n) for n in lengths.tolist()})
    if len(values) != 1 or values[0] < 0:
        raise ValueError(
            f"{name} must give every sequence the same {what} (this package's form is (B, ..., S)), "
            f"got {lengths.tolist()}; convert sequences of different lengths one by one"
        )
    return values[0]


def _gather_pages(name: str, cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of ``cache[pages]``: ``(num_pages, page_size, ...)`` -> ``(length, ...)``."""
    num_pages, page_size = cache.shape[0], cache.shape[1]
    needed = -(-length // page_size) if page_size else 0
    if pages.numel() < needed:
        raise ValueError(
            f"{name} lists {pages.numel()} pages of {page_size} rows for a sequence of {length} tokens, "
            f"which needs {needed}"
        )
    used = pages[:needed].long()
    if bool(((used < 0) | (used >= num_pages)).any()):
        raise ValueError(f"{name} must hold page numbers in [0, {num_pages}), got {used.tolist()}")
    return cache[used].flatten(0, 1)[:length]  # (needed, page_size, ...) -> (length, ...)


def from_flash_mla(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float | None = None,
) -> dict[str, torch.Tensor | float]:
    """FlashMLA's ``flash_mla_with_kvcache`` call as keyword arguments of `attention_ref.mla.mla_absorbed`.

    FlashMLA's dense decoding computes, for sequence ``b``, head ``h``, query ``i``:
    ``softmax(softmax_scale * q[b, i, h] @ K^T) @ K[:, :head_dim_v]`` with ``K``
    the first ``cache_seqlens[b]`` rows of ``k_cache[block_table[b]]`` (its
    pages, in order). The returned arguments compute the same: ``q[..., :C]``
    as ``q_nope`` (the absorbed query), ``q[..., C:]`` as ``q_pe``, the rows'
    first ``C = head_dim_v`` features as ``latent``, the rest as ``k_pe``,
    ``w_uk = w_uv = I``; ``mla_absorbed(**args)`` ``(B, H, L, C)`` is
    FlashMLA's output ``(B, L, H, C)`` transposed. Every sequence must hold the
    same number of keys (this package's form has one ``S``).

    ``softmax_scale=None`` gives FlashMLA's default, ``q.shape[-1] ** -0.5``
    (``1 / sqrt(576)``), not MLA's ``1 / sqrt(P + R)``.

    Args:
        q: ``(B, L, H, C + R)``.
        k_cache: ``(num_blocks, page_block_size, 1, C + R)``.
        block_table: ``(B, max_blocks)`` ints, the pages of each sequence.
        cache_seqlens: ``(B,)`` ints, the keys each sequence holds (all equal).
        head_dim_v: ``C``, the value size: the first ``C`` features of a row.
        softmax_scale: as passed to FlashMLA; None for its default.

    Returns:
        ``{"q_nope", "q_pe", "latent", "k_pe", "w_uk", "w_uv", "scale"}``.

    Raises:
        TypeError: a non-float ``q`` or ``k_cache``, non-integer page tables
            or lengths, different dtypes, a scale or ``head_dim_v`` of the wrong type.
        ValueError: shapes that do not fit, more than one key/value head,
            ``head_dim_v`` outside ``1 .. C + R``, sequences of different
            lengths, a page table too short or out of range.

    Examples:
        >>> import torch
        >>> q, k_cache = torch.randn(2, 1, 3, 17), torch.randn(2, 7, 1, 17)
        >>> args = from_flash_mla(q, k_cache, torch.tensor([[0], [1]]), torch.tensor([7, 7]), 13)
        >>> args["scale"] == 17 ** -0.5  # FlashMLA's default: 1/sqrt(576) for DeepSeek
        True
        >>> tuple(args["latent"].shape), tuple(args["k_pe"].shape)
        ((2, 7, 13), (2, 7, 4))
    """
    q = require_float_tensor("q", q, 4, "(B, L, H, C + R)")
    k_cache = require_float_tensor("k_cache", k_cache, 4, "(num_blocks, page_block_size, 1, C + R)")
    require_same_dtype_and_device(q=q, k_cache=k_cache)
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, L, H, C + R), got {fmt_shape(q.shape)}")
    B, D = q.shape[0], q.shape[-1]
    rows = _one_kv_head("k_cache", k_cache, "(num_blocks, page_block_size, 1, C + R)")  # (blocks, size, D)
    if rows.shape[-1] != D:
        raise ValueError(
            f"k_cache must have shape (num_blocks, page_block_size, 1, C + R) with C + R = {D} "
            f"(from q {fmt_shape(q.shape)}), got {fmt_shape(k_cache.shape)}"
        )
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise TypeError(f"head_dim_v must be an int, got {type(head_dim_v).__name__}")
    if not 0 < head_dim_v <= D:
        raise ValueError(f"head_dim_v must be in 1 .. C + R = 1 .. {D}, got {head_dim_v}")
    block_table = require_int_tensor("block_table", block_table, "(B, max_blocks)", (2,))
    cache_seqlens = require_int_tensor("cache_seqlens", cache_seqlens, "(B,)", (1,))
    if block_table.shape[0] != B or cache_seqlens.shape[0] != B:
        raise ValueError(
            f"block_table (B, max_blocks) and cache_seqlens (B,) must have B = {B} rows (from q "
            f"{fmt_shape(q.shape)}), got {fmt_shape(block_table.shape)} and {fmt_shape(cache_seqlens.shape)}"
        )
    S = _equal_lengths("cache_seqlens", cache_seqlens, "number of keys")
    scale = _check_kernel_scale("softmax_scale", softmax_scale)
    # B times (S, D) -> (B, S, D): each sequence's pages in order, cut at S rows
    kv = torch.stack([_gather_pages("block_table", rows, block_table[b], S) for b in range(B)]) if B else \
        rows.new_zeros(0, S, D)
    C = head_dim_v
    return _mla_kwargs(q[..., :C], q[..., C:], kv[..., :C], kv[..., C:], D ** -0.5 if scale is None else scale)


def to_flashinfer_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[dict[str, torch.Tensor | int | float], dict[str, torch.Tensor]]:
    """This package's MLA arguments as FlashInfer's ``BatchMLAPagedAttentionWrapper.plan`` and ``.run``.

    FlashInfer keeps the latent and the RoPE key in two paged caches,
    ``ckv_cache`` ``(num_pages, page_size, C)`` and ``kpe_cache``
    ``(num_pages, page_size, R)``, and takes the query in two parts, ragged
    over the batch: ``q_nope`` ``(nnz, H, C)``, the **absorbed** query
    ``q_nope W_UK`` despite its name, and ``q_pe`` ``(nnz, H, R)``. It computes
    ``softmax(sm_scale * (q_nope ckv^T + q_pe kpe^T)) ckv``, output
    ``(nnz, H, C)``. Here the ``B`` sequences of ``L`` queries are laid end to
    end (``nnz = B L``, ``qo_indptr = [0, L, 2L, ...]``) and each gets one
    page of ``S`` rows.

    ``sm_scale`` has no default in FlashInfer; its docstring example passes
    ``1 / sqrt(128 + 64)``, "the head dimension before matrix absorption",
    which is what this function returns (`attention_ref.mla.softmax_scale`)
    unless ``scale`` is given.

    Args:
        q_nope: ``(B, H, L, P)``.
        q_pe: ``(B, H, L, R)``, already rotated.
        latent: ``(B, S, C)``.
        k_pe: ``(B, S, R)``, already rotated.
        w_uk: ``(H, P, C)``.
        scale: default ``1 / sqrt(P + R)``.

    Returns:
        ``(plan, run)``: ``plan`` = ``{"qo_indptr", "kv_indptr", "kv_indices",
        "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size",
        "sm_scale"}`` (int32 index tensors; add ``causal`` and the dtypes) and
        ``run`` = ``{"q_nope", "q_pe", "ckv_cache", "kpe_cache"}``.

    Raises:
        TypeError: non-float tensors, tensors of different dtypes, a scale
            that is not a number.
        ValueError: shapes that do not fit, a non-positive scale.

    Examples:
        >>> import torch
        >>> B, H, L, S, P, R, C = 2, 3, 1, 7, 11, 4, 13
        >>> plan, run = to_flashinfer_mla(torch.randn(B, H, L, P), torch.randn(B, H, L, R),
        ...                               torch.randn(B, S, C), torch.randn(B, S, R), torch.randn(H, P, C))
        >>> {name: tuple(t.shape) for name, t in run.items()}
        {'q_nope': (2, 3, 13), 'q_pe': (2, 3, 4), 'ckv_cache': (2, 7, 13), 'kpe_cache': (2, 7, 4)}
        >>> plan["qo_indptr"].tolist(), plan["kv_len_arr"].tolist()
        ([0, 1, 2], [7, 7])
    """
    from attention_ref.mla import softmax_scale

    q_nope, q_pe, latent, k_pe, w_uk = _check_latent_args(q_nope, q_pe, latent, k_pe, w_uk)
    scale = _check_kernel_scale("scale", scale)
    (B, H, L, P), (S, C), R = q_nope.shape, latent.shape[1:], q_pe.shape[-1]
    index = {"dtype": torch.int32, "device": latent.device}
    plan: dict[str, torch.Tensor | int | float] = {
        "qo_indptr": torch.arange(B + 1, **index) * L,  # (B + 1,): sequence b's queries at [b L, (b + 1) L)
        "kv_indptr": torch.arange(B + 1, **index),  # (B + 1,): one page per sequence
        "kv_indices": torch.arange(B, **index),  # (B,): sequence b's page is page b
        "kv_len_arr": torch.full((B,), S, **index),  # (B,)
        "num_heads": H,
        "head_dim_ckv": C,
        "head_dim_kpe": R,
        "page_size": S,
        "sm_scale": softmax_scale(P, R) if scale is None else scale,
    }
    run = {
        "q_nope": _absorbed_query(q_nope, w_uk).reshape(B * L, H, C),  # (B, L, H, C) -> (B L, H, C)
        "q_pe": q_pe.transpose(1, 2).reshape(B * L, H, R),  # (B, H, L, R) -> (B L, H, R)
        "ckv_cache": latent,  # (B, S, C): B pages of S rows
        "kpe_cache": k_pe,  # (B, S, R)
    }
    return plan, run


def from_flashinfer_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    *,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len_arr: torch.Tensor,
    sm_scale: float,
    num_heads: int | None = None,
    head_dim_ckv: int | None = None,
    head_dim_kpe: int | None = None,
    page_size: int | None = None,
) -> dict[str, torch.Tensor | float]:
    """FlashInfer's MLA ``plan`` and ``run`` arguments as keyword arguments of `attention_ref.mla.mla_absorbed`.

    For request ``b``, FlashInfer's queries are rows ``qo_indptr[b]`` to
    ``qo_indptr[b + 1]`` of ``q_nope`` and ``q_pe``, and its keys the first
    ``kv_len_arr[b]`` rows of the pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``
    of ``ckv_cache`` and ``kpe_cache``; it computes
    ``softmax(sm_scale * (q_nope ckv^T + q_pe kpe^T)) ckv``. The returned
    arguments compute the same, with ``q_nope`` (already absorbed) passed as
    this package's ``q_nope`` and ``w_uk = w_uv = I``; ``mla_absorbed(**args)``
    is ``(B, H, L, C)``: FlashInfer's output ``(B L, H, C)`` is its
    ``.transpose(1, 2).reshape(B * L, H, C)``. Every request must have the same
    number of queries and of keys. ``from_flashinfer_mla(**run, **plan)``
    undoes `to_flashinfer_mla`.

    Args:
        q_nope: ``(nnz, H, C)``, the absorbed query.
        q_pe: ``(nnz, H, R)``.
        ckv_cache: ``(num_pages, page_size, C)``.
        kpe_cache: ``(num_pages, page_size, R)``.
        qo_indptr: ``(B + 1,)`` ints, where each request's queries start.
        kv_indptr: ``(B + 1,)`` ints, where each request's pages start in ``kv_indices``.
        kv_indices: ints, page numbers.
        kv_len_arr: ``(B,)`` ints, the keys each request holds.
        sm_scale: FlashInfer's softmax scale (it has no default).
        num_heads: ``plan``'s, checked against the tensors when given.
        head_dim_ckv: ``plan``'s, checked against the tensors when given.
        head_dim_kpe: ``plan``'s, checked against the tensors when given.
        page_size: ``plan``'s, checked against the tensors when given.

    Returns:
        ``{"q_nope", "q_pe", "latent", "k_pe", "w_uk", "w_uv", "scale"}``.

    Raises:
        TypeError: non-float tensors, non-integer index tensors, different
            dtypes, a scale that is not a number.
        ValueError: shapes that do not fit, ``plan`` sizes that disagree with
            the tensors, requests of different lengths, bad page lists.

    Examples:
        >>> import torch
        >>> q_nope, q_pe = torch.randn(4, 3, 13), torch.randn(4, 3, 5)  # 2 requests of 2 queries
        >>> ckv, kpe = torch.randn(6, 4, 13), torch.randn(6, 4, 5)  # 6 pages of 4 rows
        >>> args = from_flashinfer_mla(q_nope, q_pe, ckv, kpe, qo_indptr=torch.tensor([0, 2, 4]),
        ...     kv_indptr=torch.tensor([0, 2, 4]), kv_indices=torch.tensor([5, 0, 3, 1]),
        ...     kv_len_arr=torch.tensor([7, 7]), sm_scale=0.1)
        >>> tuple(args["q_nope"].shape), tuple(args["latent"].shape)  # (B, H, L, C), (B, S, C)
        ((2, 3, 2, 13), (2, 7, 13))
        >>> torch.equal(args["latent"][0, 4:], ckv[0, :3])  # request 0: page 5, then page 0
        True
    """
    q_nope = require_float_tensor("q_nope", q_nope, 3, "(nnz, H, C)")
    q_pe = require_float_tensor("q_pe", q_pe, 3, "(nnz, H, R)")
    ckv_cache = require_float_tensor("ckv_cache", ckv_cache, 3, "(num_pages, page_size, C)")
    kpe_cache = require_float_tensor("kpe_cache", kpe_cache, 3, "(num_pages, page_size, R)")
    require_same_dtype_and_device(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache)
    for name, tensor, layout in (("q_nope", q_nope, "(nnz, H, C)"), ("q_pe", q_pe, "(nnz, H, R)"),
                                 ("ckv_cache", ckv_cache, "(num_pages, page_size, C)"),
                                 ("kpe_cache", kpe_cache, "(num_pages, page_size, R)")):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must have shape {layout}, got {fmt_shape(tensor.shape)}")
    nnz, H, C = q_nope.shape
    num_pages, size, R = kpe_cache.shape
    expected = {"q_pe": ((nnz, H, R), q_pe), "ckv_cache": ((num_pages, size, C), ckv_cache)}
    for name, (shape, tensor) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape {fmt_shape(shape)} (nnz, H, C from q_nope {fmt_shape(q_nope.shape)}, "
                f"num_pages, page_size, R from kpe_cache {fmt_shape(kpe_cache.shape)}), got {fmt_shape(tensor.shape)}"
            )
    for name, given, actual in (("num_heads", num_heads, H), ("head_dim_ckv", head_dim_ckv, C),
                                ("head_dim_kpe", head_dim_kpe, R), ("page_size", page_size, size)):
        if given is not None and given != actual:
            raise ValueError(f"{name} = {given} disagrees with the tensors, which have {actual}")
    qo_indptr = require_int_tensor("qo_indptr", qo_indptr, "(B + 1,)", (1,))
    kv_indptr = require_int_tensor("kv_indptr", kv_indptr, "(B + 1,)", (1,))
    kv_indices = require_int_tensor("kv_indices", kv_indices, "(total pages,)", (1,))
    kv_len_arr = require_int_tensor("kv_len_arr", kv_len_arr, "(B,)", (1,))
    B = kv_len_arr.shape[0]
    if qo_indptr.shape[0] != B + 1 or kv_indptr.shape[0] != B + 1:
        raise ValueError(
            f"qo_indptr and kv_indptr must have shape (B + 1,) = ({B + 1},) (B from kv_len_arr "
            f"{fmt_shape(kv_len_arr.shape)}), got {fmt_shape(qo_indptr.shape)} and {fmt_shape(kv_indptr.shape)}"
        )
    if int(qo_indptr[0]) != 0 or int(qo_indptr[-1]) != nnz:
        raise ValueError(f"qo_indptr must run from 0 to nnz = {nnz}, got {qo_indptr.tolist()}")
    L = _equal_lengths("qo_indptr", qo_indptr.diff(), "number of queries")
    S = _equal_lengths("kv_len_arr", kv_len_arr, "number of keys")
    scale = _check_kernel_scale("sm_scale", sm_scale)
    if scale is None:
        raise TypeError("sm_scale must be a positive finite float (FlashInfer has no default), got None")
    pages = [kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])] for b in range(B)]
    # B times (S, C) -> (B, S, C), and (B, S, R): each request's pages in order, cut at S rows
    latent = torch.stack([_gather_pages("kv_indices", ckv_cache, p, S) for p in pages]) if B else \
        ckv_cache.new_zeros(0, S, C)
    k_pe = torch.stack([_gather_pages("kv_indices", kpe_cache, p, S) for p in pages]) if B else \
        kpe_cache.new_zeros(0, S, R)
    # (B L, H, C) -> (B, L, H, C): the kernels' batch-first layout
    return _mla_kwargs(q_nope.reshape(B, L, H, C), q_pe.reshape(B, L, H, R), latent, k_pe, scale)


def from_mla_kernel_output(
    out: torch.Tensor, w_uv: torch.Tensor | None = None, *, batch_size: int | None = None
) -> torch.Tensor:
    """A latent kernel's output ``(B, L, H, C)`` as `attention_ref.mla.mla_absorbed`'s ``(B, H, L, Ev)``.

    FlashAttention 4 (``qv``), FlashMLA and FlashInfer return each head's
    weighted sum of latents, ``(B, L, H, C)`` (FlashInfer: ``(B L, H, C)``,
    pass ``batch_size``); the model then applies ``W_UV`` per head. This
    transposes to this package's layout and applies ``w_uv``.

    Args:
        out: ``(B, L, H, C)``, or ``(B L, H, C)`` with ``batch_size``.
        w_uv: ``(H, Ev, C)``, from `attention_ref.mla.split_kv_b_proj`; None
            to keep the latent, ``(B, H, L, C)``.
        batch_size: ``B`` for a ragged ``(B L, H, C)`` output.

    Returns:
        ``(B, H, L, Ev)`` (``(B, H, L, C)`` without ``w_uv``).

    Raises:
        TypeError: non-float tensors, different dtypes, ``batch_size`` not an int.
        ValueError: shapes that do not fit.

    Examples:
        >>> import torch
        >>> from_mla_kernel_output(torch.randn(2, 5, 3, 13), torch.randn(3, 7, 13)).shape
        torch.Size([2, 3, 5, 7])
        >>> from_mla_kernel_output(torch.randn(10, 3, 13), batch_size=2).shape
        torch.Size([2, 3, 5, 13])
    """
    out = require_float_tensor("out", out, 3, "(B, L, H, C)")
    if batch_size is not None:
        check_positive_int("batch_size", batch_size)
        if out.dim() != 3 or out.shape[0] % batch_size:
            raise ValueError(
                f"out must have shape (B L, H, C) with B = batch_size = {batch_size} dividing its dim 0, "
                f"got {fmt_shape(out.shape)}"
            )
        out = out.reshape(batch_size, out.shape[0] // batch_size, *out.shape[1:])  # (B L, H, C) -> (B, L, H, C)
    if out.dim() != 4:
        raise ValueError(f"out must have shape (B, L, H, C) (or (B L, H, C) with batch_size), got {fmt_shape(out.shape)}")
    latent_out = out.transpose(1, 2)  # (B, L, H, C) -> (B, H, L, C)
    if w_uv is None:
        return latent_out
    w_uv = require_float_tensor("w_uv", w_uv, 3, "(H, Ev, C)")
    require_same_dtype_and_device(out=out, w_uv=w_uv)
    H, C = out.shape[2], out.shape[3]
    if w_uv.dim() != 3 or (w_uv.shape[0], w_uv.shape[2]) != (H, C):
        raise ValueError(
            f"w_uv must have shape (H, Ev, C) = ({H}, Ev, {C}) (from out {fmt_shape(out.shape)}), "
            f"got {fmt_shape(w_uv.shape)}"
        )
    return torch.einsum("bhlc,hvc->bhlv", latent_out, w_uv)  # (B, H, L, C) x (H, Ev, C) -> (B, H, L, Ev)
