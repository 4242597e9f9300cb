"""`assert_attention_close`: a kernel's output, gradients and log-sum-exp, judged row by row.

The rule, the float-mask convention and the probes are described in `attention_ref.testing`; this
file holds the check itself, its argument checks and the configuration line of its messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from attention_ref.functional import scaled_dot_product_attention
from attention_ref.testing.arguments import (
    ATTENTION_KWARGS,
    check_number,
    check_options,
)
from attention_ref.testing.baseline import (
    float64_kwargs,
    gradients,
    low_precision_attention,
    masked_below_min,
    rows_without_agreed_output,
)
from attention_ref.testing.messages import (
    caller_shape,
    counted,
    describe,
    dtype_name,
    fmt_rows,
    row_indices,
)
from attention_ref.testing.probes import empty_row_lines, probe_lines
from attention_ref.testing.rounding import row_rounding
from attention_ref.testing.verdict import CheckReport, Quantity, judge_all, report


def assert_attention_close(
    actual: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    grad_output: torch.Tensor | None = None,
    actual_grads: Sequence[torch.Tensor] | None = None,
    actual_lse: torch.Tensor | None = None,
    lse_base: float = math.e,
    factor: float = 2.0,
    atol: float = 1e-6,
    bound: str = "row",
    layout: str = "bhld",
    **attention_kwargs: Any,
) -> CheckReport:
    """Check a kernel's attention output (gradients, log-sum-exp) by FlashAttention's rule, row by row.

    The reference is `attention_ref.functional.scaled_dot_product_attention` on
    float64 copies of the inputs. The low-precision baseline is plain PyTorch in
    the inputs' dtype with no upcasting (FlashAttention's suite scales ``key``
    instead, ``reorder_ops=True``):
    ``(query * scale) @ key^T``, a ``score_mod`` (its result rounded to the dtype),
    a float ``attn_mask`` added, the boolean conditions (a bool ``attn_mask`` with
    ``True`` = takes part, the opposite of ``torch.nn.MultiheadAttention``;
    ``is_causal``, top-left aligned; a ``mask_mod``) set to ``-inf``, the sinks
    appended as one more score column, softmax, ``@ value``; a query row with no
    key gives 0, as the reference does. With ``enable_gqa`` the ``Hkv``
    key/value heads are repeated to ``H`` (``repeat_interleave``). Nothing falls
    back to the package's ``"math"`` path (its softmax runs in float32).

    **The rule.** With ``bound="row"`` (the default), for every row ``r`` of each
    quantity (a query position ``(..., h, i)`` of the output, ``dq`` and ``lse``;
    a key position ``(..., hkv, j)`` of ``dk`` and ``dv``; ``dsinks`` is one row),
    with ``e_r = max_r|low_precision - ref|`` and ``m_r = max_r|ref|``:

    ``max_r|actual - ref| <= factor * max(e_r, F_r) + atol``,
    ``F_r = max(min(max(T, R * m_r), max_healthy e), U_r)``,

    ``T`` and ``R`` the 90th percentiles of the healthy rows' ``e_r`` and
    ``e_r / m_r`` (a floor against a baseline that rounds luckily on one row,
    which a minority of bad rows cannot move, capped at the largest healthy
    ``e_r``), ``U_r`` the rounding any right kernel may make on the row (its sums
    in any order, ``sqrt(n) * u * sum|terms|``, ``u`` float32's unit roundoff,
    float64's for float64; its result and stored ``P`` and ``dS`` rounded to the
    inputs' dtype; the module docstring says how). A row whose baseline is degenerate (not finite, its scores
    overflowed the dtype, or ``e_r >= 0.25 * m_r`` and ``e_r`` above the rows'
    90th percentile) has no estimate of its own and is held to
    ``factor * F_r + atol``; with no healthy row the quantity cannot be judged
    and fails, saying so. Every allowance is at most the larger of FlashAttention's
    global one and the row's rounding term ``factor * U_r + atol``. ``bound="global"`` is FlashAttention's exact rule,
    ``max|actual - ref| <= factor * max|low_precision - ref| + atol`` over the
    whole tensor with the masks taken literally: weaker, since one degenerate
    row sets everyone's bound.

    **Float masks and rows no key takes part in** (``bound="row"`` only). A
    float-mask value at or below ``torch.finfo(query.dtype).min`` counts as
    masked (``-inf``) in the reference and the baseline alike: transformers fills
    its masks with that value to mean "masked", and float16 cannot even add a
    score to it (``s - 65504`` rounds to a constant, or to ``-inf``). A query row
    in which every key is masked, at least one only by such a finite value (and
    whose head has no finite sink), has no agreed output: torch's SDPA gives the
    softmax of the masked scores, float16 eager code the mean of the values
    (or NaN), FlashAttention 0. Its output (and ``lse``) is not judged beyond being
    finite (not NaN for ``lse``) and is listed in the returned `CheckReport`. In
    the backward such a row would feed every key's ``dk`` and ``dv`` a
    convention-dependent share, so gradients are judged only when
    ``grad_output`` is 0 on those rows (then every convention gives ``dq = 0``
    there and no share to ``dk``/``dv``, and all rows are judged); otherwise a
    ``ValueError`` says which rows to zero. A loss that ignores padded positions
    does exactly that. Rows emptied by ``-inf``, a bool mask, ``is_causal`` or a
    ``mask_mod`` are judged as usual: their output is 0.

    **Layouts.** ``layout="bhld"``: ``query`` ``(..., H, L, E)``, ``key``
    ``(..., Hkv, S, E)``, ``value`` ``(..., Hkv, S, Ev)``, ``actual`` and
    ``grad_output`` ``(..., H, L, Ev)``, the gradients shaped like their inputs
    (torch's SDPA). ``layout="blhd"``: the head and sequence dims swapped
    everywhere, ``(..., L, H, E)`` (transformers and FlashAttention). Masks keep
    ``(..., L, S)`` and ``actual_lse`` keeps ``(..., H, L)`` in both (as
    FlashAttention returns it); positions in messages are in the caller's layout.

    **Log-sum-exp and sinks.** ``actual_lse`` is judged by the same rule, row by
    row, against the reference's ``log(sum_j exp(scores_ij))`` (natural log;
    ``lse_base=2`` for a base-2 one: FlashInfer's); ``-inf`` on a row with no
    key. With ``sinks=`` (one logit per query head, or per query: any shape
    `attention_ref.scaled_dot_product_attention` takes; `attention_ref.sinks`) it
    includes the sink, as this package's and FlashAttention 4's do; convert other
    conventions first (`attention_ref.conventions`, e.g. FlashMLA's sink-free
    ``lse`` with ``from_flash_mla_lse``). The sinks' gradient is judged when
    ``actual_grads`` has a 4th entry.

    **Probes.** When the output fails, the reference is recomputed in float64 with
    one planted bug at a time (boolean ``attn_mask`` inverted; causal aligned
    bottom-right when ``L != S``; head and sequence dims swapped; ``scale = 1``
    or ``1/E`` instead of ``1/sqrt(E)``, or the default instead of a given
    ``scale``; GQA heads repeated with ``repeat`` instead of
    ``repeat_interleave`` for keys and values, values only, or keys only); each
    one the output passes under the same row allowances is named in the message
    as ``likely cause: ...``.

    Args:
        actual: the kernel's output, ``(..., H, L, Ev)`` (``layout="bhld"``).
        query: ``(..., H, L, E)``, the inputs the kernel was given (any float
            dtype; ``query``, ``key`` and ``value`` share it).
        key: ``(..., Hkv, S, E)``.
        value: ``(..., Hkv, S, Ev)``.
        grad_output: ``(..., H, L, Ev)``, the gradient fed to the kernel's
            backward; give it together with ``actual_grads`` to check gradients.
        actual_grads: ``(dq, dk, dv)`` shaped like ``query``, ``key``, ``value``;
            or ``(dq, dk, dv, dsinks)`` with ``dsinks`` shaped like ``sinks``
            (needs ``sinks=``); each of its entries is judged.
        actual_lse: ``(..., H, L)``, the kernel's log-sum-exp, in base ``lse_base``.
        lse_base: the base of ``actual_lse``'s logarithm, a number > 1: ``math.e``
            (the default) or 2.
        factor: how many times the low-precision error the kernel may have
            (FlashAttention uses 2); a finite number > 0.
        atol: added to every bound, so that float64 inputs (whose low-precision
            error is ~1e-16) and rows the baseline computes exactly are judged
            sensibly; a finite number >= 0.
        bound: ``"row"`` (the default, described above) or ``"global"``
            (FlashAttention's exact rule: one maximum per quantity, masks literal).
        layout: ``"bhld"`` (the default) or ``"blhd"``.
        **attention_kwargs: the attention arguments the kernel used:
            ``attn_mask``, ``is_causal``, ``scale``, ``enable_gqa``,
            ``score_mod``, ``mask_mod``, ``sinks``.

    Returns:
        A `CheckReport` when every quantity is within its bounds.

    Raises:
        AssertionError: an error above its bound. For each failing quantity the
            message gives the kernel's error, the baseline's error and the bound
            of its worst row (the failing row with the largest error), the worst
            position, how many rows fail, which rows had a degenerate baseline
            (and whether it overflowed), the rows not judged, the probes that
            match and the config.
        TypeError: a non-tensor or non-float argument, mixed input dtypes, a bad
            ``factor``/``atol``/``lse_base`` type or an unknown keyword.
        ValueError: shapes that do not fit, ``grad_output`` without
            ``actual_grads`` (or the reverse), a bad ``factor``, ``atol``,
            ``lse_base``, ``bound`` or ``layout``, a 4th gradient without
            ``sinks``, or a non-zero ``grad_output`` on a row not judged.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from attention_ref.testing import assert_attention_close
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
        >>> out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> print(assert_attention_close(out, q, k, v, is_causal=True))
        passed (output; bound='row')
        >>> assert_attention_close(out * 1.01, q, k, v, is_causal=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: assert_attention_close: 1 of 1 quantities out of bounds
        ...
    """
    _check_arguments(actual, query, key, value, grad_output, actual_grads, factor, atol)
    check_options(bound, layout, lse_base, actual_lse)
    _check_attention_kwargs(attention_kwargs)
    swap = layout == "blhd"
    if swap:
        for name, tensor in (("actual", actual), ("query", query), ("key", key), ("value", value)):
            if tensor.dim() < 3:
                raise ValueError(
                    f"layout='blhd' needs {name} of at least 3 dims (..., L|S, H, E), "
                    f"got shape {tuple(tensor.shape)}"
                )
    query, key, value, actual = (_bhld(t, swap) for t in (query, key, value, actual))
    with_grads = grad_output is not None
    sinks = attention_kwargs.get("sinks")
    if with_grads:
        assert grad_output is not None and actual_grads is not None  # checked above
        grad_output = _bhld(grad_output, swap)
        if len(actual_grads) == 4 and sinks is None:
            raise ValueError("actual_grads has a 4th entry (dsinks) but no sinks= was given")
        actual_grads = [_bhld(g, swap) for g in actual_grads[:3]] + list(actual_grads[3:])

    dtype = query.dtype
    kwargs = masked_below_min(attention_kwargs, dtype) if bound == "row" else dict(attention_kwargs)
    with_lse = actual_lse is not None
    leaves64 = [t.detach().to(torch.float64).requires_grad_(with_grads) for t in (query, key, value)]
    kwargs64 = float64_kwargs(kwargs, with_grads)
    with torch.enable_grad():
        result = scaled_dot_product_attention(*leaves64, return_lse=with_lse, **kwargs64)
    reference, reference_lse = result if with_lse else (result, None)
    if reference.shape != actual.shape:
        raise ValueError(
            f"actual must have the shape of the attention output {caller_shape(reference.shape, swap)}, "
            f"got {caller_shape(actual.shape, swap)}"
        )
    if with_lse and tuple(actual_lse.shape) != tuple(reference.shape[:-1]):
        raise ValueError(
            f"actual_lse must have shape {tuple(reference.shape[:-1])} (..., H, L), "
            f"got {tuple(actual_lse.shape)}"
        )

    leaves_low = [t.detach().clone().requires_grad_(with_grads) for t in (query, key, value)]
    kwargs_low = dict(kwargs)
    if sinks is not None:
        kwargs_low["sinks"] = sinks.detach().clone().requires_grad_(with_grads)
    with torch.enable_grad():
        low, low_lse, overflowed = low_precision_attention(*leaves_low, **kwargs_low)

    not_judged = rows_without_agreed_output(attention_kwargs, reference, dtype) if bound == "row" else None
    rounding = row_rounding(query, key, value, grad_output if with_grads else None, kwargs64) if bound == "row" else {}
    quantities = [Quantity("output", actual, reference, low, dtype, "query", swap, not_judged, overflowed,
                            rounding.get("output"))]
    if with_grads:
        assert grad_output is not None and actual_grads is not None
        if tuple(grad_output.shape) != tuple(reference.shape):
            raise ValueError(
                f"grad_output must have the shape of the attention output "
                f"{caller_shape(reference.shape, swap)}, got {caller_shape(grad_output.shape, swap)}"
            )
        if not_judged is not None and bool((grad_output.detach() != 0).any(-1)[not_judged].any()):
            rows = row_indices(not_judged & (grad_output.detach() != 0).any(-1), swap)
            raise ValueError(
                f"grad_output must be 0 on the {counted(len(rows), 'query row')} where every key is masked "
                f"only by float-mask values <= finfo({dtype_name(dtype)}).min ({torch.finfo(dtype).min:g}): "
                f"{fmt_rows(rows)}. Libraries disagree on what such a row outputs (0, the mean of the "
                "values, or the softmax of the masked scores), so its dq and its share of every key's dk "
                "and dv have no agreed value. Zero grad_output on those rows (a loss that ignores padded "
                "positions does), mask them with -inf or a bool mask, or pass bound='global'."
            )
        wrt64 = leaves64 + ([kwargs64["sinks"]] if sinks is not None else [])
        wrt_low = leaves_low + ([kwargs_low["sinks"]] if sinks is not None else [])
        grads64 = gradients(reference, wrt64, grad_output.detach().to(torch.float64))
        grads_low = gradients(low, wrt_low, grad_output.detach().to(dtype))
        names = ("dq", "dk", "dv", "dsinks")
        for i, got in enumerate(actual_grads):
            rows = ("query", "key", "key", "head")[i]  # dsinks: one value per head (or query), each judged
            quantities.append(Quantity(names[i], got, grads64[i], grads_low[i], dtype, rows, swap and i < 3,
                                        rounding=rounding.get(names[i])))
    if with_lse:
        assert actual_lse is not None and reference_lse is not None
        ln_base = math.log(lse_base)
        quantities.append(Quantity("lse", actual_lse, reference_lse / ln_base, low_lse / ln_base, dtype,
                                    "scalar", False, not_judged, overflowed))

    verdicts, lines = judge_all("assert_attention_close", quantities, factor, atol, bound)
    if lines:
        if verdicts[0].failed:
            lines += empty_row_lines(query, key, value, actual, kwargs64, verdicts[0], swap)
            lines += probe_lines(query, key, value, actual, kwargs, verdicts[0])
        lines.append("  config: " + _describe_config(query, key, value, attention_kwargs, factor, atol,
                                                     bound, layout, swap, lse_base if with_lse else None))
        raise AssertionError("\n".join(lines))
    return report(bound, verdicts, not_judged, swap)


def _bhld(t: torch.Tensor, swap: bool) -> torch.Tensor:
    return t.transpose(-3, -2) if swap else t


def _describe_config(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_kwargs: dict[str, Any],
                     factor: float, atol: float, bound: str, layout: str, swap: bool, lse_base: float | None) -> str:
    kwargs = ", ".join(f"{k}={describe(v)}" for k, v in sorted(attention_kwargs.items()))
    lse = "" if lse_base is None else f", lse_base={'e' if lse_base == math.e else f'{lse_base:g}'}"
    return (
        f"query {caller_shape(query.shape, swap)}, key {caller_shape(key.shape, swap)}, value {caller_shape(value.shape, swap)}\n"
        f"    dtype {dtype_name(query.dtype)}, factor={factor:g}, atol={atol:g}, bound={bound!r}, layout={layout!r}{lse}\n"
        f"    kwargs {{{kwargs}}}"
    )


def _check_arguments(actual: Any, query: Any, key: Any, value: Any, grad_output: Any, actual_grads: Any,
                     factor: Any, atol: Any) -> None:
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
        if not isinstance(actual_grads, (tuple, list)) or len(actual_grads) not in (3, 4):
            raise ValueError(
                "actual_grads must be a tuple (dq, dk, dv) or (dq, dk, dv, dsinks) of tensors, got "
                f"{type(actual_grads).__name__} of length {_length(actual_grads)}"
            )
        for name, grad in zip(("dq", "dk", "dv", "dsinks"), actual_grads):
            if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
                raise TypeError(
                    f"actual_grads' {name} must be a floating-point torch.Tensor, "
                    f"got {type(grad).__name__}"
                )
    check_number("factor", factor)
    check_number("atol", atol)


def _check_attention_kwargs(attention_kwargs: dict[str, Any]) -> None:
    for name in attention_kwargs:
        if name not in ATTENTION_KWARGS:
            raise TypeError(
                f"assert_attention_close got an unexpected keyword {name!r}; "
                f"expected one of {', '.join(ATTENTION_KWARGS)}"
            )
    mask = attention_kwargs.get("attn_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    sinks = attention_kwargs.get("sinks")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point()):
        raise TypeError(f"sinks must be a floating-point torch.Tensor (H,) or None, got {type(sinks).__name__}")


def _length(value: Any) -> int | str:
    try:
        return len(value)
    except TypeError:
        return "none"
