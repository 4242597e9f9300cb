"""Judge anyone's attention kernel by FlashAttention's own rule.

A kernel in float16 cannot match a float64 reference to ``1e-6``, and a fixed
tolerance per dtype is either too loose for small inputs or too tight for long
sequences. FlashAttention's tests (Dao et al. 2022, https://arxiv.org/abs/2205.14135)
judge a kernel against what plain PyTorch achieves in the same precision:

1. ``reference``: attention in float64 (this package's
   `attention_ref.functional.scaled_dot_product_attention`, ``backend="math"``);
2. ``low_precision``: plain PyTorch attention in the inputs' own dtype, with no
   upcasting anywhere (scores, a ``score_mod``, softmax and the product with
   ``value`` all in that dtype: FlashAttention's ``upcast=False``);
3. the kernel passes when, for the output and for each gradient,

   ``max|actual - reference| <= factor * max|low_precision - reference| + atol``.

A kernel may be at most ``factor`` times worse than the naive computation in its
own precision. Shapes use the package legend: ``B`` batch, ``H`` query heads,
``Hkv`` key/value heads, ``L`` query length, ``S`` key length, ``E`` query/key
size, ``Ev`` value size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_ref import mods
from attention_ref._inputs import expand_kv_heads
from attention_ref.functional import scaled_dot_product_attention
from attention_ref.masks import causal_mask

__all__ = ["assert_attention_close"]

_ATTENTION_KWARGS = ("attn_mask", "is_causal", "scale", "enable_gqa", "score_mod", "mask_mod")


def assert_attention_close(
    actual: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    grad_output: torch.Tensor | None = None,
    actual_grads: Sequence[torch.Tensor] | None = None,
    factor: float = 2.0,
    atol: float = 1e-6,
    **attention_kwargs: Any,
) -> None:
    """Check a kernel's attention output (and gradients) by FlashAttention's rule.

    The reference is `attention_ref.functional.scaled_dot_product_attention` on
    float64 copies of the inputs. The low-precision baseline is plain PyTorch in
    the inputs' dtype with no upcasting: ``scale * query @ key^T``, a float
    ``attn_mask`` added, the boolean conditions (a bool ``attn_mask`` with
    ``True`` = takes part, the opposite of ``torch.nn.MultiheadAttention``;
    ``is_causal``, top-left aligned) set to ``-inf``, softmax, ``@ value``, all in
    that dtype (a query row with no key, whether a bool mask or ``-inf`` in a float
    mask removed them all, gives 0, as the reference does). With
    ``enable_gqa`` the ``Hkv`` key/value heads are repeated to ``H``. The mods
    are applied plainly too, in the reference's order and with its
    ``(b, h, q_idx, kv_idx)`` index grids (`attention_ref.mods.index_grids`): a
    ``score_mod`` to the scaled scores in the inputs' dtype (its result rounded
    to that dtype), before the float mask; a ``mask_mod`` evaluated into a
    boolean mask that joins the others. Nothing falls back to the package's
    ``"math"`` path: its softmax runs in float32, so its error is little more
    than the rounding of the result, a bound stricter than FlashAttention's.

    Args:
        actual: the kernel's output, ``(..., L, Ev)``.
        query: ``(..., L, E)``, the inputs the kernel was given (any float dtype;
            ``query``, ``key`` and ``value`` share it).
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        grad_output: ``(..., L, Ev)``, the gradient fed to the kernel's backward;
            give it together with ``actual_grads`` to check the gradients.
        actual_grads: ``(dq, dk, dv)``, the kernel's gradients with respect to
            ``query``, ``key`` and ``value`` (same shapes as those).
        factor: how many times the low-precision error the kernel may have
            (FlashAttention uses 2); a finite number > 0.
        atol: added to the bound, so that float64 inputs (whose low-precision
            error is ~1e-16) are judged sensibly; a finite number >= 0.
        **attention_kwargs: the attention arguments the kernel used:
            ``attn_mask``, ``is_causal``, ``scale``, ``enable_gqa``,
            ``score_mod``, ``mask_mod``.

    Raises:
        AssertionError: an error above its bound. The message gives, for each
            failing quantity (output, dq, dk, dv), the kernel's error, the
            low-precision error, the bound, the worst position and the config.
        TypeError: a non-tensor or non-float argument, mixed input dtypes, a bad
            ``factor``/``atol`` type or an unknown keyword.
        ValueError: shapes that do not fit, ``grad_output`` without
            ``actual_grads`` (or the reverse), a bad ``factor`` or ``atol``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from attention_ref.testing import assert_attention_close
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
        >>> out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> assert_attention_close(out, q, k, v, is_causal=True)  # passes: no output
        >>> assert_attention_close(out * 1.01, q, k, v, is_causal=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: assert_attention_close: 1 of 1 quantities out of bounds
        ...
    """
    _check_arguments(actual, query, key, value, grad_output, actual_grads, factor, atol)
    _check_attention_kwargs(attention_kwargs)
    with_grads = grad_output is not None

    inputs64 = [t.detach().to(torch.float64).requires_grad_(with_grads) for t in (query, key, value)]
    kwargs64 = dict(attention_kwargs)
    mask = kwargs64.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        kwargs64["attn_mask"] = mask.detach().to(torch.float64)
    with torch.enable_grad():
        reference = scaled_dot_product_attention(*inputs64, **kwargs64)
    if reference.shape != actual.shape:
        raise ValueError(
            f"actual must have the shape of the attention output {tuple(reference.shape)}, "
            f"got {tuple(actual.shape)}"
        )

    inputs_low = [t.detach().clone().requires_grad_(with_grads) for t in (query, key, value)]
    with torch.enable_grad():
        low_precision = _low_precision_attention(*inputs_low, **attention_kwargs)

    quantities = [("output", actual, reference, low_precision)]
    if with_grads:
        assert grad_output is not None and actual_grads is not None  # checked above
        if tuple(grad_output.shape) != tuple(reference.shape):
            raise ValueError(
                f"grad_output must have the shape of the attention output "
                f"{tuple(reference.shape)}, got {tuple(grad_output.shape)}"
            )
        grads64 = torch.autograd.grad(reference, inputs64, grad_output.detach().to(torch.float64))
        grads_low = torch.autograd.grad(
            low_precision, inputs_low, grad_output.detach().to(query.dtype)
        )
        for name, got, ref, low in zip(("dq", "dk", "dv"), actual_grads, grads64, grads_low):
            quantities.append((name, got, ref, low))

    failures = []
    for name, got, ref, low in quantities:
        report = _judge(name, got.detach(), ref.detach(), low.detach(), factor, atol)
        if report is not None:
            failures.append(report)
    if failures:
        config = _describe_config(query, key, value, attention_kwargs, factor, atol)
        raise AssertionError(
            f"assert_attention_close: {len(failures)} of {len(quantities)} quantities "
            "out of bounds\n"
            "  rule: max|actual - ref| <= factor * max|low_precision - ref| + atol\n"
            + "\n".join(failures)
            + f"\n  config: {config}"
        )


def _low_precision_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    score_mod: Callable[..., torch.Tensor] | None = None,
    mask_mod: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain attention in the inputs' dtype, nothing upcast (FlashAttention's ``upcast=False``).

    The steps in the reference's order (`attention_ref.functional`): scale,
    ``score_mod``, float mask added, boolean conditions, softmax, ``@ value``.
    """
    dtype = query.dtype
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E), as the reference expands them
        key, value = expand_kv_heads(query, key, "key"), expand_kv_heads(query, value, "value")
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (..., L, E) x (..., E, S) -> (..., L, S)
    if score_mod is not None:
        # on the scores in the inputs' dtype, with the reference's index grids; rounded to dtype
        scores = mods.apply_score_mod(score_mod, scores)  # (..., L, S) -> (..., L, S)
    allowed = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask
        else:
            scores = scores + attn_mask.to(dtype)
    if is_causal:
        causal = causal_mask(L, S, device=query.device)  # (L, S), top-left
        allowed = causal if allowed is None else allowed & causal
    if mask_mod is not None:
        keep = mods.apply_mask_mod(mask_mod, scores.shape[:-2], L, S, scores.device)  # broadcasts to (..., L, S)
        allowed = keep if allowed is None else allowed & keep
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # (L, S) masks broadcast
    # A row with no finite score (every key masked, by a bool mask or by -inf in a float one)
    # gives 0, as the reference does; its scores are set finite first so softmax makes no NaN.
    row_has_key = (scores != float("-inf")).any(dim=-1, keepdim=True)  # (..., L, 1)
    scores = scores.masked_fill(~row_has_key, 0.0)
    weights = torch.softmax(scores, dim=-1).masked_fill(~row_has_key, 0.0)  # in the inputs' dtype
    return weights @ value  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)


def _judge(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    low_precision: torch.Tensor,
    factor: float,
    atol: float,
) -> str | None:
    """The report line for one quantity, or ``None`` when it is within its bound."""
    if actual.shape != reference.shape:
        raise ValueError(
            f"actual_grads' {name} must have shape {tuple(reference.shape)}, "
            f"got {tuple(actual.shape)}"
        )
    diff = (actual.to(torch.float64) - reference).abs().nan_to_num(nan=math.inf)
    actual_error = diff.max().item() if diff.numel() else 0.0
    low_diff = (low_precision.to(torch.float64) - reference).abs()
    low_error = low_diff.max().item() if low_diff.numel() else 0.0
    bound = factor * low_error + atol
    if actual_error <= bound:  # False for NaN: a NaN fails
        return None
    flat = int(diff.argmax().item())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    dtype = str(low_precision.dtype).removeprefix("torch.")
    return (
        f"  {name}:\n"
        f"    max|actual - reference|        = {actual_error:.3e}\n"
        f"    max|low_precision - reference| = {low_error:.3e} ({dtype}, no upcasting)\n"
        f"    allowed: {factor:g} * {low_error:.3e} + {atol:g} = {bound:.3e}\n"
        f"    worst position {worst}: actual {actual[worst].item():.6g}, "
        f"reference {reference[worst].item():.6g}"
    )


def _describe_config(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_kwargs: dict[str, Any],
    factor: float,
    atol: float,
) -> str:
    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            return f"tensor{tuple(value.shape)} {dtype}"
        if callable(value):
            return getattr(value, "__qualname__", repr(value))
        return repr(value)

    kwargs = ", ".join(f"{k}={describe(v)}" for k, v in sorted(attention_kwargs.items()))
    return (
        f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}\n"
        f"    dtype {str(query.dtype).removeprefix('torch.')}, factor={factor:g}, atol={atol:g}\n"
        f"    kwargs {{{kwargs}}}"
    )


def _check_arguments(
    actual: Any,
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    actual_grads: Any,
    factor: Any,
    atol: Any,
) -> None:
    for name, tensor in (("actual", actual), ("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            "query, key and value must share one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    if (grad_output is None) != (actual_grads is None):
        raise ValueError(
            "grad_output and actual_grads must be given together, got "
            f"grad_output={'a tensor' if grad_output is not None else None} and "
            f"actual_grads={'given' if actual_grads is not None else None}"
        )
    if grad_output is not None:
        if not isinstance(grad_output, torch.Tensor) or not grad_output.is_floating_point():
            raise TypeError(
                f"grad_output must be a floating-point torch.Tensor, got {type(grad_output).__name__}"
            )
        if not isinstance(actual_grads, (tuple, list)) or len(actual_grads) != 3:
            raise ValueError(
                "actual_grads must be a tuple (dq, dk, dv) of 3 tensors, got "
                f"{type(actual_grads).__name__} of length {_length(actual_grads)}"
            )
        for name, grad in zip(("dq", "dk", "dv"), actual_grads):
            if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
                raise TypeError(
                    f"actual_grads' {name} must be a floating-point torch.Tensor, "
                    f"got {type(grad).__name__}"
                )
    for name, number, low in (("factor", factor, "> 0"), ("atol", atol, ">= 0")):
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(f"{name} must be a real number, got {type(number).__name__}")
        bad = number <= 0 if name == "factor" else number < 0
        if not math.isfinite(number) or bad:
            raise ValueError(f"{name} must be finite and {low}, got {number}")


def _check_attention_kwargs(attention_kwargs: dict[str, Any]) -> None:
    for name in attention_kwargs:
        if name not in _ATTENTION_KWARGS:
            raise TypeError(
                f"assert_attention_close got an unexpected keyword {name!r}; "
                f"expected one of {', '.join(_ATTENTION_KWARGS)}"
            )
    mask = attention_kwargs.get("attn_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")


def _length(value: Any) -> int | str:
    try:
        return len(value)
    except TypeError:
        return "none"
