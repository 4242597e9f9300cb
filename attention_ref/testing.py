"""Judge anyone's attention kernel by FlashAttention's rule, one query row at a time.

A kernel in float16 cannot match a float64 reference to ``1e-6``, and a fixed
tolerance per dtype is either too loose for small inputs or too tight for long
sequences. FlashAttention's test suite (Dao-AILab/flash-attention, ``tests/test_flash_attn.py``;
the algorithm: Dao et al. 2022, https://arxiv.org/abs/2205.14135) judges a kernel against
what plain PyTorch achieves in the same precision:

1. ``reference``: attention in float64 (this package's
   `attention_ref.functional.scaled_dot_product_attention`, ``backend="math"``);
2. ``low_precision``: plain PyTorch attention in the inputs' own dtype, with no
   upcasting anywhere (FlashAttention's ``upcast=False``): ``query * scale``
   first, then the product with ``key``, a ``score_mod``, softmax and the product
   with ``value``, all in that dtype. (FlashAttention's suite scales the keys
   instead, ``reorder_ops=True``: ``q @ (k / sqrt(d))``; either way one operand
   is rounded once more before the product);
3. the kernel passes when each error is at most ``factor`` times the baseline's,
   plus ``atol``.

FlashAttention takes one maximum over the whole tensor (``bound="global"`` here).
That single bound lets one bad row speak for all of them: a row the baseline
cannot compute (float16 rounding ``s - 65504`` to a constant, an overflowing
score) gives every position an allowance of its own size, and a kernel off by
0.4 everywhere passes. So the default, ``bound="row"``, gives each row ``r`` (a
query position for the output, ``dq`` and ``lse``; a key position for ``dk`` and
``dv``) its own allowance, from its own baseline error ``e_r = max_r|low - ref|``:

``max_r|actual - ref| <= factor * max(e_r, F_r) + atol``,
``F_r = max(min(max(T, R * m_r), max_healthy e), U_r)``

where ``m_r = max_r|ref|`` is the row's magnitude and ``T`` and ``R`` are the
90th percentiles of the healthy rows' ``e_r`` and ``e_r / m_r``. A row's ``e_r``
is the largest of a few rounding errors, a noisy estimate (a baseline that rounds
luckily on one row would demand the impossible there); the floor ``F_r`` is the
typical error in absolute terms and at the row's scale, which a minority of bad
rows cannot move, capped at the largest healthy ``e_r``. ``U_r`` is the rounding
any right kernel may make on the row: its sums in any order,
``sqrt(n) * u * sum|terms|`` with the terms' sizes from the exact weights (``u``
float32's unit roundoff, where kernels accumulate), plus its result and the
factors it stores before a product (``P``, ``dS``) rounded to the inputs' dtype.
A row whose exact value cancels to near 0, such as ``dq`` of a query that sees
one key, or whose baseline rounded luckily, can be off by that much in a right
kernel however the baseline's own order rounded it. ``U_r`` is an a priori bound, so the cap does not
apply to it: a float32 baseline whose order happens to be more exact than a tiled
kernel's on every row would otherwise fail the kernel (it did, on two machines).
A row whose baseline is
*degenerate* (not finite, its scores overflowed, or off by a quarter of its own
magnitude and by more than the typical row) has no estimate of its own: it is
held to ``factor * F_r + atol`` alone, and the message says so. So no row is
allowed more than the larger of FlashAttention's global rule and its own rounding term
``factor * U_r + atol``, and most far less.

Float-mask values at or below ``finfo(dtype).min`` count as masked (``-inf``) in
the reference and the baseline alike: that is what transformers' masks mean by
them. A query row that such values alone empty (every key masked, at least one
only by such a finite value) has no agreed output: libraries give 0, the mean of
the values, or the softmax of the masked scores. Its output is not judged beyond
being finite; it is listed in the returned `CheckReport`, and gradients are
checked only with ``grad_output`` zero on it (see `assert_attention_close`).

On a failure, cheap probes (float64 forwards with one planted bug each) name the
likely cause: an inverted boolean mask, the other causal alignment, a
transposed layout, ``scale = 1`` or ``1/E``, GQA heads grouped with ``repeat``
instead of ``repeat_interleave``. `assert_module_close` applies the same rule to
a whole multi-head module against ``torch.nn.MultiheadAttention``.

Shapes use the package legend: ``B`` batch, ``H`` query heads, ``Hkv``
key/value heads, ``L`` query length, ``S`` key length, ``E`` query/key size,
``Ev`` value size, ``d`` model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention_ref import linear, mods
from attention_ref._inputs import expand_kv_heads
from attention_ref.functional import attention_weights, scaled_dot_product_attention
from attention_ref.masks import causal_mask, combine_masks
from attention_ref.multihead import MultiHeadAttention

__all__ = ["CheckReport", "assert_attention_close", "assert_linear_attention_close", "assert_module_close"]

_ATTENTION_KWARGS = ("attn_mask", "is_causal", "scale", "enable_gqa", "score_mod", "mask_mod", "sinks")
_BOUNDS = ("row", "global")
_LAYOUTS = ("bhld", "blhd")
_DEGENERATE_SHARE = 0.25  # a baseline off by a quarter of the row's magnitude or more cannot judge that row
_TYPICAL = 0.9  # the percentile of the healthy rows' baseline errors that floors every row's own
_SHOWN = 4  # row indices printed in a message before "..."


@dataclass(frozen=True)
class CheckReport:
    """What a passing check judged; returned by `assert_attention_close` and `assert_module_close`.

    Attributes:
        bound: ``"row"`` or ``"global"``, the rule applied.
        quantities: the names judged, in order (``"output"``, ``"dq"``, ``"dk"``,
            ``"dv"``, ``"dsinks"``, ``"lse"``; for a module also its input and
            parameter gradients).
        rows_not_judged: the query rows (indices in the caller's layout:
            ``(b, h, i)`` for ``"bhld"``, ``(b, i, h)`` for ``"blhd"``, ``(b, i)``
            for a module) whose every key is masked only by float-mask values
            ``<= finfo(dtype).min``; their output was only checked to be finite.
        degenerate_rows: per quantity, how many rows had a degenerate baseline
            and were held to the typical error of that quantity's healthy rows at their magnitude.
    """

    bound: str
    quantities: tuple[str, ...]
    rows_not_judged: tuple[tuple[int, ...], ...] = ()
    degenerate_rows: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"passed ({', '.join(self.quantities)}; bound={self.bound!r})"
        if self.rows_not_judged:
            text += (f"; {_count(len(self.rows_not_judged), 'query row')} not judged (every key masked "
                     f"only by float values <= finfo(dtype).min): {_fmt_rows(list(self.rows_not_judged))}")
        degenerate = {name: n for name, n in self.degenerate_rows.items() if n}
        if degenerate:
            text += "; rows with a degenerate baseline, held to the typical error: " + ", ".join(
                f"{name} {n}" for name, n in degenerate.items())
        return text


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
    _check_options(bound, layout, lse_base, actual_lse)
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
    kwargs = _masked_below_min(attention_kwargs, dtype) if bound == "row" else dict(attention_kwargs)
    with_lse = actual_lse is not None
    leaves64 = [t.detach().to(torch.float64).requires_grad_(with_grads) for t in (query, key, value)]
    kwargs64 = _float64_kwargs(kwargs, with_grads)
    with torch.enable_grad():
        result = scaled_dot_product_attention(*leaves64, return_lse=with_lse, **kwargs64)
    reference, reference_lse = result if with_lse else (result, None)
    if reference.shape != actual.shape:
        raise ValueError(
            f"actual must have the shape of the attention output {_shape(reference.shape, swap)}, "
            f"got {_shape(actual.shape, swap)}"
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
        low, low_lse, overflowed = _low_precision_attention(*leaves_low, **kwargs_low)

    not_judged = _rows_without_agreed_output(attention_kwargs, reference, dtype) if bound == "row" else None
    rounding = _rounding(query, key, value, grad_output if with_grads else None, kwargs64) if bound == "row" else {}
    quantities = [_Quantity("output", actual, reference, low, dtype, "query", swap, not_judged, overflowed,
                            rounding.get("output"))]
    if with_grads:
        assert grad_output is not None and actual_grads is not None
        if tuple(grad_output.shape) != tuple(reference.shape):
            raise ValueError(
                f"grad_output must have the shape of the attention output "
                f"{_shape(reference.shape, swap)}, got {_shape(grad_output.shape, swap)}"
            )
        if not_judged is not None and bool((grad_output.detach() != 0).any(-1)[not_judged].any()):
            rows = _row_indices(not_judged & (grad_output.detach() != 0).any(-1), swap)
            raise ValueError(
                f"grad_output must be 0 on the {_count(len(rows), 'query row')} where every key is masked "
                f"only by float-mask values <= finfo({_name(dtype)}).min ({torch.finfo(dtype).min:g}): "
                f"{_fmt_rows(rows)}. Libraries disagree on what such a row outputs (0, the mean of the "
                "values, or the softmax of the masked scores), so its dq and its share of every key's dk "
                "and dv have no agreed value. Zero grad_output on those rows (a loss that ignores padded "
                "positions does), mask them with -inf or a bool mask, or pass bound='global'."
            )
        wrt64 = leaves64 + ([kwargs64["sinks"]] if sinks is not None else [])
        wrt_low = leaves_low + ([kwargs_low["sinks"]] if sinks is not None else [])
        grads64 = _grad(reference, wrt64, grad_output.detach().to(torch.float64))
        grads_low = _grad(low, wrt_low, grad_output.detach().to(dtype))
        names = ("dq", "dk", "dv", "dsinks")
        for i, got in enumerate(actual_grads):
            rows = ("query", "key", "key", "head")[i]  # dsinks: one value per head (or query), each judged
            quantities.append(_Quantity(names[i], got, grads64[i], grads_low[i], dtype, rows, swap and i < 3,
                                        rounding=rounding.get(names[i])))
    if with_lse:
        assert actual_lse is not None and reference_lse is not None
        ln_base = math.log(lse_base)
        quantities.append(_Quantity("lse", actual_lse, reference_lse / ln_base, low_lse / ln_base, dtype,
                                    "scalar", False, not_judged, overflowed))

    verdicts, lines = _judge_all("assert_attention_close", quantities, factor, atol, bound)
    if lines:
        if verdicts[0].failed:
            lines += _empty_row_lines(query, key, value, actual, kwargs64, verdicts[0], swap)
            lines += _probe_lines(query, key, value, actual, kwargs, verdicts[0])
        lines.append("  config: " + _describe_config(query, key, value, attention_kwargs, factor, atol,
                                                     bound, layout, swap, lse_base if with_lse else None))
        raise AssertionError("\n".join(lines))
    return _report(bound, verdicts, not_judged, swap)


def _judge_all(
    check: str, quantities: list[_Quantity], factor: float, atol: float, bound: str
) -> tuple[list[_Verdict], list[str]]:
    """Every quantity's verdict, and the failure message's lines so far (none when all pass)."""
    verdicts = [_judge(q, factor, atol, bound) for q in quantities]
    failures = [v for v in verdicts if v.failed]
    if not failures:
        return verdicts, []
    lines = [f"{check}: {len(failures)} of {len(verdicts)} quantities out of bounds", "  rule: " + _rule_text(bound)]
    for verdict in failures:
        lines += verdict.lines
    return verdicts, lines


# ---- the linear-attention check -----------------------------------------------------------


_STATE_LAYOUTS = ("kv", "vk")


def assert_linear_attention_close(
    actual: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    actual_state: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    state_layout: str = "kv",
    factor: float = 2.0,
    atol: float = 1e-6,
    bound: str = "row",
) -> CheckReport:
    """Check a delta-rule kernel's output (and final state) by the same rule, against the float64 recurrence.

    The sibling of `assert_attention_close` for the linear attention of
    `attention_ref.linear`: Gated DeltaNet when ``g`` is ``(B, L, Hv)`` (one decay per
    head, `attention_ref.linear.gated_delta_rule`), Kimi Delta Attention when it is
    ``(B, L, Hv, E)`` (one per key channel, `attention_ref.linear.kimi_delta_attention`).
    The reference is the token-by-token recurrence on float64 copies of the inputs; the
    low-precision baseline is the same recurrence in the inputs' dtype, its state in
    float32 for half-precision inputs (as kernels keep it) and its output rounded to
    ``v``'s dtype. Each row, the ``Ev`` output entries of one token and head (and the
    ``Ev`` (or ``E``) entries of one state row), passes when
    ``max_r|actual - ref| <= factor * max(e_r, F_r) + atol`` with the baseline's own error
    ``e_r`` and the typical error ``F_r`` of `assert_attention_close`, its rounding term
    ``U_r = sqrt(L) u max_r|ref|`` (``u`` the unit roundoff of the state's dtype: any order
    of accumulating ``L`` tokens may round that much away); ``bound="global"`` takes one
    maximum over the whole tensor instead.

    A kernel computed chunk by chunk (the WY/UT form) is judged like any other: the
    disagreements people report between the two forms (the decay left out of the
    in-chunk mask, a short last chunk dropped, an initial state ignored, a float16
    state, packed sequences run as one) all fail. On a failure, float64 recurrences with
    one planted bug each name the likely cause.

    Args:
        actual: the kernel's output, ``(B, L, Hv, Ev)``.
        q: the kernel's queries, ``(B, L, H, E)``, as `attention_ref.linear.gated_delta_rule`
            takes them.
        k: its keys, ``(B, L, H, E)``.
        v: its values, ``(B, L, Hv, Ev)``.
        g: the log decay, ``<= 0``: ``(B, L, Hv)`` for Gated DeltaNet, ``(B, L, Hv, E)``
            for Kimi Delta Attention.
        beta: the delta rule's steps, ``(B, L, Hv)``.
        actual_state: the kernel's final state, ``(B, Hv, E, Ev)`` (``(N, Hv, E, Ev)``
            with ``cu_seqlens``), or ``(..., Ev, E)`` with ``state_layout="vk"``; None
            to judge the output alone.
        initial_state: the entry state the kernel was given, in this package's
            ``(..., E, Ev)`` layout (`attention_ref.linear.state_vk_to_kv` converts).
        cu_seqlens: as in `attention_ref.linear.gated_delta_rule`.
        scale: as in `attention_ref.linear.gated_delta_rule`.
        use_qk_l2norm: as in `attention_ref.linear.gated_delta_rule`.
        state_layout: ``"kv"``, ``(..., E, Ev)`` (this package, fla, transformers), or
            ``"vk"``, ``(..., Ev, E)`` (flashinfer, Mamba-2), for ``actual_state``.
        factor: as in `assert_attention_close`.
        atol: as in `assert_attention_close`.
        bound: ``"row"`` or ``"global"``, as in `assert_attention_close`.

    Returns:
        A `CheckReport` naming the quantities judged (``"output"``, ``"final_state"``).

    Raises:
        AssertionError: a row is out of bounds; the message gives the numbers of the
            worst row, the rule, the likely cause and the configuration.
        TypeError, ValueError: an argument is malformed (named in the message), as in
            `attention_ref.linear.gated_delta_rule` for the inputs.

    Example:
        >>> import torch
        >>> from attention_ref.linear import gated_delta_rule
        >>> from attention_ref.testing import assert_linear_attention_close
        >>> q, k, v = torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8)
        >>> g, beta = -0.1 * torch.rand(1, 40, 2), torch.rand(1, 40, 2)
        >>> out, state = gated_delta_rule(q, k, v, g, beta, mode="chunked", chunk_size=16,
        ...                               output_final_state=True)
        >>> print(assert_linear_attention_close(out, q, k, v, g, beta, actual_state=state))
        passed (output, final_state; bound='row')
    """
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, tensor in (("actual", actual), ("actual_state", actual_state), *inputs.items()):
        if (tensor is not None or name in inputs) and not (isinstance(tensor, torch.Tensor)
                                                           and tensor.is_floating_point()):
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    if g.dim() not in (3, 4):
        raise ValueError("g must be a tensor of shape (B, L, Hv) (Gated DeltaNet) or (B, L, Hv, E) (Kimi Delta "
                         f"Attention), got {tuple(g.shape)}")
    if state_layout not in _STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {', '.join(map(repr, _STATE_LAYOUTS))}, got {state_layout!r}")
    if bound not in _BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(map(repr, _BOUNDS))}, got {bound!r}")
    _check_number("factor", factor)
    _check_number("atol", atol)
    form = linear.gated_delta_rule if g.dim() == 3 else linear.kimi_delta_attention
    settings = {"initial_state": initial_state, "cu_seqlens": cu_seqlens, "scale": scale,
                "use_qk_l2norm": use_qk_l2norm}

    def recurrence(dtype: torch.dtype | None, replace: dict[str, torch.Tensor] | None = None,
                   **changes: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The token loop on the inputs (in ``dtype``, or their own; ``replace`` swaps some of them),
        with ``changes`` to the settings."""
        kw = {**settings, **changes}
        tensors = [x.detach() if dtype is None else x.detach().to(dtype)
                   for x in {**inputs, **(replace or {})}.values()]  # q, k, v, g, beta
        if kw["initial_state"] is not None:
            kw["initial_state"] = kw["initial_state"].detach().to(dtype or tensors[2].dtype)
        with torch.no_grad():
            out, state = form(*tensors, **kw, mode="recurrent", output_final_state=True)
        return out, state if state_layout == "kv" else linear.state_kv_to_vk(state)

    reference, reference_state = recurrence(torch.float64)  # also checks the inputs, naming them
    low, low_state = recurrence(None)
    for name, got, want in (("actual", actual, reference), ("actual_state", actual_state, reference_state)):
        if got is not None and got.shape != want.shape:
            layout = {"actual": "(B, L, Hv, Ev)", "actual_state": "(N, Hv, E, Ev)" if state_layout == "kv"
                      else "(N, Hv, Ev, E)"}[name]
            raise ValueError(f"{name} must have shape {layout} = {tuple(want.shape)}, got {tuple(got.shape)}")
    dtype = v.dtype
    baseline = f"the recurrence, its state in {_name(torch.promote_types(dtype, torch.float32))}"
    # what any order of accumulating L tokens may round away on a row: sqrt(L) u max_r|ref|, u the unit
    # roundoff of the state's dtype (the row's largest entry stands for the sizes of its terms)
    roundoff = math.sqrt(max(q.shape[1], 1)) * _accumulation_roundoff(dtype)
    why = "the rounding any order of accumulating the L tokens may make, sqrt(L) * u * max|reference| of the row"
    quantities = [_Quantity("output", actual, reference, low, dtype, "token", baseline=baseline,
                            rounding=roundoff * _per_row(reference.abs(), "token"), rounding_why=why)]
    if actual_state is not None:
        quantities.append(_Quantity("final_state", actual_state, reference_state, low_state, dtype, "state",
                                    baseline=baseline, rounding=roundoff * _per_row(reference_state.abs(), "state"),
                                    rounding_why=why))
    verdicts, lines = _judge_all("assert_linear_attention_close", quantities, factor, atol, bound)
    if lines:
        if verdicts[0].failed:
            lines += _linear_probe_lines(actual, recurrence, g, beta, settings, verdicts[0])
        lines.append(f"  config: {form.__name__}, q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                     f"g {tuple(g.shape)}, beta {tuple(beta.shape)}\n    dtype {_name(dtype)}, factor={factor:g}, "
                     f"atol={atol:g}, bound={bound!r}, initial_state={_describe(initial_state)}, "
                     f"cu_seqlens={_describe(cu_seqlens)}, scale={scale}, use_qk_l2norm={use_qk_l2norm}")
        raise AssertionError("\n".join(lines))
    return _report(bound, verdicts, None, False)


def _linear_probe_lines(actual: torch.Tensor, recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                        g: torch.Tensor, beta: torch.Tensor, settings: dict[str, Any], verdict: _Verdict
                        ) -> list[str]:
    """``likely cause: ...`` for each planted bug under which the output passes its row allowances."""
    h0 = settings["initial_state"]
    probes: list[tuple[str, str, dict[str, Any]]] = [
        ("no decay", "the decay is left out (g taken as 0)", {"replace": {"g": torch.zeros_like(g)}}),
        ("beta 1", "beta is left out (taken as 1)", {"replace": {"beta": torch.ones_like(beta)}})]
    if h0 is not None:
        probes.append(("initial state ignored", "the initial state is ignored (the kernel starts from zeros)",
                       {"initial_state": None}))
    if settings["cu_seqlens"] is not None:  # one sequence, from the first one's entry state
        probes.append(("one sequence", "the packed sequences run as one: no state reset at cu_seqlens",
                       {"cu_seqlens": None, "initial_state": None if h0 is None else h0[:1]}))
    probes.append(("l2 norm", "q and k are " + ("not L2-normalised (use_qk_l2norm=True here)"
                                                if settings["use_qk_l2norm"] else
                                                "L2-normalised (use_qk_l2norm=False here)"),
                   {"use_qk_l2norm": not settings["use_qk_l2norm"]}))
    if settings["scale"] is None:
        probes.append(("scale 1", "scale = 1 (here E ** -0.5)", {"scale": 1.0}))
    matched = []
    for _, description, changes in probes:
        planted = recurrence(torch.float64, **changes)[0]
        if bool((_per_row(_abs_diff(actual, planted), "token") <= verdict.allowance).all()):
            matched.append(description)
    if matched:
        return [f"  likely cause: {description}" for description in matched]
    return [f"  probes tried, none matched: {', '.join(name for name, _, _ in probes)}"]


# ---- the module check --------------------------------------------------------------------


def assert_module_close(
    actual_module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    reference: str = "torch",
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    grad_output: torch.Tensor | None = None,
    factor: float = 2.0,
    atol: float = 1e-6,
    bound: str = "row",
) -> CheckReport:
    """Check a multi-head attention module against ``torch.nn.MultiheadAttention`` with its weights.

    ``actual_module`` is an `attention_ref.MultiHeadAttention` (``num_kv_heads ==
    num_heads`` and no sinks: torch's module has neither) or a
    ``torch.nn.MultiheadAttention`` (without ``add_bias_kv``/``add_zero_attn``).
    It is called as it is, in its own train or eval mode; without
    ``grad_output`` under ``torch.no_grad()``, so that in eval mode torch's module
    takes its fast path (``torch._native_multi_head_attention``, for
    self-attention with an even number of heads) and is judged like any kernel.

    The reference is a float64 ``torch.nn.MultiheadAttention`` holding the
    module's weights, batch first, dropout 0, on its general path. The baseline is
    plain multi-head attention in the module's dtype: the four projections
    (``F.linear``), the heads split, the same low-precision attention as
    `assert_attention_close`'s, the heads merged. The rule, the float-mask
    convention and the rows not judged are those of `assert_attention_close`; a
    row is a position ``(b, i)`` of the output (and of each input's gradient), an
    output feature of a projection's weight gradient; a bias gradient is one row.

    Args:
        actual_module: the module under test. In training mode its dropout must be 0.
        query: ``(B, L, d)``, batch first (also for a torch module built with
            ``batch_first=False``: the check transposes at the call).
        key: ``(B, S, kdim)``; ``None`` for self-attention (the module gets
            ``query`` itself, as the fast path needs).
        value: ``(B, S, vdim)``; ``None`` means ``key``.
        reference: ``"torch"``, the only reference: ``torch.nn.MultiheadAttention``.
        attn_mask: ``(L, S)``, bool ``True`` = takes part (this package's
            convention; the check gives a torch module ``~attn_mask``), or float,
            added to the scores.
        is_causal: top-left causal mask, combined with ``attn_mask`` (a torch
            module gets it inside its ``attn_mask``).
        grad_output: ``(B, L, d)``; with it the gradients of the inputs (``dquery``,
            ``dkey``, ``dvalue``; ``dquery`` alone for self-attention, the one
            input's) and of the parameters (``dq_proj.weight``, ...,
            ``dout_proj.bias``) are judged too.
        factor: as in `assert_attention_close`.
        atol: as in `assert_attention_close`.
        bound: as in `assert_attention_close`.

    Returns:
        A `CheckReport` when every quantity is within its bounds.

    Raises:
        AssertionError: an error above its bound (the message as in `assert_attention_close`).
        TypeError: a module of another class, non-tensor inputs, inputs not of
            the module's dtype.
        ValueError: an unknown ``reference`` or ``bound``, grouped heads, learned
            sinks, ``add_bias_kv``/``add_zero_attn``, dropout in training mode,
            shapes that do not fit, a non-zero ``grad_output`` on a row not judged.

    Example:
        >>> import torch
        >>> from attention_ref import MultiHeadAttention
        >>> from attention_ref.testing import assert_module_close
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> x = torch.randn(2, 5, 8)
        >>> print(assert_module_close(MultiHeadAttention(8, 2).eval(), x, is_causal=True))
        passed (output; bound='row')
    """
    if reference != "torch":
        raise ValueError(f"reference must be 'torch' (torch.nn.MultiheadAttention with the module's weights), "
                         f"got {reference!r}")
    _check_options(bound, "bhld", math.e, None)
    for name, number in (("factor", factor), ("atol", atol)):
        _check_number(name, number)
    spec = _module_spec(actual_module)
    self_attention = key is None
    key = query if key is None else key
    value = key if value is None else value
    for name, x, width in (("query", query, spec.embed_dim), ("key", key, spec.kdim), ("value", value, spec.vdim)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(f"{name} must have shape (B, seq, {width}), batch first, got {tuple(x.shape)}")
        if x.dtype != spec.dtype:
            raise TypeError(f"{name} must have the module's dtype {spec.dtype}, got {x.dtype}")
    if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
        raise ValueError(f"query (B, L, _), key and value (B, S, _) must share B, and key and value S: got "
                         f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    L, S = query.shape[1], key.shape[1]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or not (attn_mask.dtype == torch.bool
                                                            or attn_mask.is_floating_point()):
            raise TypeError(f"attn_mask must be a bool or float torch.Tensor, got "
                            f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
        if tuple(attn_mask.shape) != (L, S):
            raise ValueError(f"attn_mask must have shape (L, S) = {(L, S)}, got {tuple(attn_mask.shape)}")
    with_grads = grad_output is not None
    if with_grads and (not isinstance(grad_output, torch.Tensor)
                       or tuple(grad_output.shape) != (query.shape[0], L, spec.embed_dim)):
        got = tuple(grad_output.shape) if isinstance(grad_output, torch.Tensor) else type(grad_output).__name__
        raise ValueError(f"grad_output must have the output's shape {(query.shape[0], L, spec.embed_dim)}, "
                         f"got {got}")

    dtype = spec.dtype
    inputs = [query] if self_attention else [query, key, value]
    mask_kwargs: dict[str, Any] = {"attn_mask": attn_mask, "is_causal": is_causal}
    kwargs = _masked_below_min(mask_kwargs, dtype) if bound == "row" else dict(mask_kwargs)

    # the module under test, its own inputs and mask convention
    leaves = [x.detach().clone().requires_grad_(with_grads) for x in inputs]
    with torch.set_grad_enabled(with_grads):
        actual = spec.call(leaves, attn_mask, is_causal)
    # the float64 reference: torch's module with these weights
    weights = spec.weights()
    leaves64 = [x.detach().to(torch.float64).requires_grad_(with_grads) for x in inputs]
    torch64 = _torch_module(spec, weights)
    with torch.enable_grad():
        reference_out = _call_torch(torch64, leaves64, kwargs["attn_mask"], is_causal, batch_first=True)
    # the baseline: plain multi-head attention in the module's dtype
    params_low = {n: w.detach().clone().requires_grad_(with_grads) for n, w in weights.items()}
    leaves_low = [x.detach().clone().requires_grad_(with_grads) for x in inputs]
    with torch.enable_grad():
        low, overflowed = _low_precision_module(spec, params_low, leaves_low, kwargs)

    rows = _rows_without_agreed_output(mask_kwargs, reference_out[:, None], dtype) if bound == "row" else None
    not_judged = None if rows is None else rows[:, 0]  # (B, 1, L) -> (B, L)
    quantities = [_Quantity("output", actual, reference_out, low, dtype, "query", False, not_judged, overflowed)]
    if with_grads:
        assert grad_output is not None
        if not_judged is not None and bool((grad_output.detach() != 0).any(-1)[not_judged].any()):
            raise ValueError(
                "grad_output must be 0 on the query rows where every key is masked only by float-mask values "
                f"<= finfo({_name(dtype)}).min: {_fmt_rows(_row_indices(not_judged, False))} (libraries disagree "
                "on those rows' output, so on their gradients); zero it there or pass bound='global'"
            )
        # k_proj's bias adds q_i . b_k to every score of row i: softmax ignores it, so its gradient is 0 up
        # to rounding, pure noise on both sides, and is not judged
        names = [n for n in weights if n != "k_proj.bias"]
        mine, theirs = spec.parameters(), _torch_parameters(torch64)
        got = _grad(actual, leaves + [mine[n][0] for n in names], grad_output.detach(), [mine[n][1] for n in names])
        ref = _grad(reference_out, leaves64 + [theirs[n][0] for n in names], grad_output.detach().to(torch.float64),
                    [theirs[n][1] for n in names])
        base = _grad(low, leaves_low + [params_low[n] for n in names], grad_output.detach().to(dtype))
        input_names = ["dquery"] if self_attention else ["dquery", "dkey", "dvalue"]
        for i, name in enumerate(input_names + ["d" + n for n in names]):
            kind = "query" if i < len(input_names) or name.endswith("weight") else "one"
            quantities.append(_Quantity(name, got[i], ref[i], base[i], dtype, kind))
    verdicts, lines = _judge_all("assert_module_close", quantities, factor, atol, bound)
    if lines:
        lines.append(
            f"  config: {type(actual_module).__name__}(embed_dim={spec.embed_dim}, num_heads={spec.num_heads}, "
            f"kdim={spec.kdim}, vdim={spec.vdim}, bias={spec.bias}) in "
            f"{'training' if actual_module.training else 'eval'} mode, query {tuple(query.shape)}, "
            + ("self-attention" if self_attention else f"key {tuple(key.shape)}, value {tuple(value.shape)}")
            + f"\n    dtype {_name(dtype)}, factor={factor:g}, atol={atol:g}, bound={bound!r}, "
            f"attn_mask={_describe(attn_mask)}, is_causal={is_causal}"
        )
        raise AssertionError("\n".join(lines))
    return _report(bound, verdicts, not_judged, False)


# ---- the baseline ------------------------------------------------------------------------


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
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain attention in the inputs' dtype, nothing upcast (FlashAttention's ``upcast=False``).

    The steps in the reference's order (`attention_ref.functional`) with
    FlashAttention's product order: ``query * scale``, ``@ key^T``, ``score_mod``,
    float mask added, boolean conditions, the sinks appended as one more score
    column, softmax, the sink column dropped, ``@ value``.

    Returns:
        ``(output (..., L, Ev), lse (..., L), overflowed (..., L))``: ``lse`` the
        natural log of each row's denominator (``-inf`` with no key and no sink),
        ``overflowed`` the rows where a score that takes part is not finite
        before any mask is added (the dtype's range was exceeded).
    """
    dtype = query.dtype
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    if enable_gqa:  # (..., Hkv, S, E) -> (..., H, S, E), as the reference expands them
        key, value = expand_kv_heads(query, key, "key"), expand_kv_heads(query, value, "value")
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (query * scale) @ key.transpose(-2, -1)  # (..., L, E) x (..., E, S) -> (..., L, S)
    if score_mod is not None:
        # on the scores in the inputs' dtype, with the reference's index grids; rounded to dtype
        scores = mods.apply_score_mod(score_mod, scores)  # (..., L, S) -> (..., L, S)
    blown = ~torch.isfinite(scores.detach())  # (..., L, S): the dtype's range exceeded
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
        blown = blown & allowed
    overflowed = blown.any(dim=-1) if S else blown.sum(dim=-1).bool()  # (..., L)
    if sinks is not None:  # one more column, the sink: a score with no value
        # (H,) -> (H, 1), or (1,) for scores (L, S); one per query as given, broadcastable to (..., H, L)
        column = sinks.to(dtype).reshape(-1, 1) if scores.dim() >= 3 and sinks.dim() == 1 else sinks.to(dtype)
        column = column.expand(scores.shape[:-1]).unsqueeze(-1)  # (..., H, L, 1)
        scores = torch.cat([scores, column], dim=-1)  # (..., L, S + 1)
    # A row with no finite score (no key, no sink) gives 0, as the reference does; its scores are
    # set finite first so softmax makes no NaN.
    row_has_key = (scores != float("-inf")).any(dim=-1, keepdim=True)  # (..., L, 1)
    scores = scores.masked_fill(~row_has_key, 0.0)
    weights = torch.softmax(scores, dim=-1).masked_fill(~row_has_key, 0.0)  # in the inputs' dtype
    row_max = scores.detach().amax(dim=-1, keepdim=True) if scores.shape[-1] else scores.sum(-1, keepdim=True)
    lse = row_max + torch.log(torch.exp(scores - row_max).sum(dim=-1, keepdim=True))  # (..., L, 1), in dtype
    lse = lse.masked_fill(~row_has_key, float("-inf")).squeeze(-1)  # (..., L)
    if sinks is not None:
        weights = weights[..., :S]  # (..., L, S + 1) -> (..., L, S): the sink has no value
    return weights @ value, lse, overflowed  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)


def _rounding(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_output: torch.Tensor | None,
    kwargs64: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """Per row, the rounding a right kernel may make in any summation order, in float64 from the exact weights.

    The baseline's error estimates a kernel's on most rows, but not on a row whose
    exact value cancels to near 0 (``dq`` of a query that sees one key), nor on a
    row where the baseline's one sample of rounding happens to fall small: there
    a right kernel may be off by more, however luckily the baseline rounded. Two
    kinds of rounding, each from first-order error propagation:

    * accumulation: a sum of ``n`` terms ``t_j`` rounds by about
      ``sqrt(n) * u_acc * sum_j |t_j|`` (``u_acc`` the unit roundoff of float32,
      where kernels accumulate; float64's for float64), with the terms'
      magnitudes from the exact weights ``P`` conditioned by the scores' own
      rounding (see the body): output ``P' |V|``, ``dq`` ``scale * A |K|``,
      ``dk`` ``scale * A^T |Q|``, ``dv`` ``P'^T |dO|``,
      ``A = P' * (|dO| |V|^T + |D|)``, ``dP = dO @ V^T``, ``D = rowsum(P * dP)``;
      ``n`` the keys (query rows) or the queries of the head group (key rows);
    * storage in the inputs' dtype (unit roundoff ``u_in``): a kernel rounds its
      result, and the factors it stores before a product, as FlashAttention
      does in float16 and bfloat16 (``P`` before ``P @ V`` and ``P^T @ dO``,
      ``dS`` before ``dS @ K`` and ``dS^T @ Q``, ``dP`` in a formulation that
      stores it, the output ``O`` that ``D = rowsum(dO * O)`` reads, and each
      query head's share of ``dk`` and ``dv`` before a head group's sum):
      ``u_in * (|x| + sqrt(sum_j (f_j y_j)^2))``, ``f_j`` the stored factor's
      error in units of ``u_in``, ``y_j`` the other factor, independent
      roundings adding in quadrature.

    Each row gets its largest column. Measured (issue 32) on 500 seeds, float16
    and bfloat16, three right kernels (torch's CPU flash kernel, float16 scores
    with a float32 softmax, float32 throughout): without the storage term 8 of
    1,500 runs failed, with it none (nor any of 200 seeds with sinks), while a
    kernel 3x as far off as the baseline is still caught on every seed.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (query, key, value))
    weights_kwargs = {n: kwargs64[n] for n in _ATTENTION_KWARGS if n in kwargs64}
    if isinstance(weights_kwargs.get("sinks"), torch.Tensor):
        weights_kwargs["sinks"] = weights_kwargs["sinks"].detach()
    P = attention_weights(q, k, **weights_kwargs)  # (..., H, L, S)
    gqa = bool(weights_kwargs.get("enable_gqa"))
    k_all = expand_kv_heads(q, k, "key") if gqa else k  # (..., Hkv, S, E) -> (..., H, S, E)
    v_all = expand_kv_heads(q, v, "value") if gqa else v  # (..., Hkv, S, Ev) -> (..., H, S, Ev)
    scale = weights_kwargs.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # A score's rounding error is at most about u * a_ij, a_ij = scale * sum_e |q_ie k_je|. Softmax turns
    # errors e into P_ij ((1 - P_ij) e_ij - sum_{k != j} P_ik e_ik), so a weight's error is at most
    # u * P_ij (a_ij + sum_k P_ik a_ik - 2 P_ij a_ij), besides its own rounding, u * P_ij.
    a = abs(scale) * (q.abs() @ k_all.abs().transpose(-2, -1))  # (..., H, L, E) x (..., H, E, S) -> (..., H, L, S)
    a = torch.where(P > 0, a, torch.zeros_like(a))
    spread = a + (P * a).sum(-1, keepdim=True) - 2 * P * a  # (..., H, L, S), >= 0
    conditioned = P * (1 + spread)  # (..., H, L, S)
    unit = _accumulation_roundoff(query.dtype)
    unit_in = torch.finfo(query.dtype).eps / 2
    group = P.shape[-3] // k.shape[-3] if gqa else 1  # query heads per key/value head
    per_query = unit * math.sqrt(max(P.shape[-1], 1))  # sums over the S keys
    per_key_row = unit * math.sqrt(max(P.shape[-2] * group, 1))  # sums over the L queries of each head in the group

    def bound(accumulation: float, exact: torch.Tensor, terms: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Per column (..., R, C): sum|t|, the exact value and sum of the stored terms' squares -> (..., R)."""
        return (accumulation * terms + unit_in * (exact.abs() + stored.sqrt())).amax(-1)

    exact_out = P @ v_all  # (..., H, L, S) x (..., H, S, Ev) -> (..., H, L, Ev)
    result = {"output": bound(per_query, exact_out, conditioned @ v_all.abs(), P.square() @ v_all.square())}
    if grad_output is None:
        return result
    d_out = grad_output.detach().to(torch.float64)  # (..., H, L, Ev)
    d_weights = d_out @ v_all.transpose(-2, -1)  # (..., H, L, Ev) x (..., H, Ev, S) -> (..., H, L, S): dP
    d_rows = (P * d_weights).sum(-1, keepdim=True)  # (..., H, L, 1): D = rowsum(P * dP)
    d_scores = P * (d_weights - d_rows)  # (..., H, L, S): dS
    d_weights_terms = d_out.abs() @ v_all.abs().transpose(-2, -1)  # (..., H, L, S)
    terms = conditioned * (d_weights_terms + d_rows.abs())  # (..., H, L, S)
    # dS as stored: its own rounding u |dS_ij|, and dP's rounding u |dP_ij| through dS = P * (dP - D), which
    # gives P_ij (e_ij - sum_k P_ik e_ik), at most u P_ij (|dP_ij| + sum_k P_ik |dP_ik| - 2 P_ij |dP_ij|): 0 for a
    # query that sees one key, where every formulation's dS is 0
    dp = d_weights.abs()
    stored = d_scores.abs() + P * (dp + (P * dp).sum(-1, keepdim=True) - 2 * P * dp)  # (..., H, L, S), >= 0
    # D_i = rowsum(dO_i * O_i) read from the stored output O (FlashAttention's backward does): O rounded to the
    # inputs' dtype shifts every dS_ij of the row by P_ij times the same error. Its size, in units of u_in, from
    # the rounding of the exact O (0 where O is representable, as for a query that sees one key)
    o_error = (exact_out.to(query.dtype).to(torch.float64) - exact_out).abs()  # (..., H, L, Ev)
    d_rows_error = (d_out * o_error).square().sum(-1, keepdim=True).sqrt() / unit_in  # (..., H, L, 1)

    def per_key(x: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
        """(..., H, S, C) summed to ``like``'s (..., Hkv, S, C): over each head group and broadcast dims."""
        leaf = torch.zeros_like(like, requires_grad=True)
        with torch.enable_grad():
            copies = expand_kv_heads(q, leaf, name) if gqa else leaf.expand(x.shape)
            (summed,) = torch.autograd.grad(copies, leaf, x.sum_to_size(copies.shape))
        return summed

    def shares(x: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
        """sum_h x_h^2 over each head group: a kernel may store each query head's share before the group's sum."""
        return per_key(x.square(), like, name) if group > 1 else torch.zeros_like(like)

    scale = abs(scale)
    mean_key = P @ k_all  # (.., H, L, S) x (.., H, S, E) -> (.., H, L, E): sum_j P_ij k_j
    result["dq"] = bound(per_query, scale * (d_scores @ k_all), scale * (terms @ k_all.abs()),
                         scale ** 2 * (stored.square() @ k_all.square() + (d_rows_error * mean_key).square()))
    # (.., H, S, L) x (.., H, L, E) -> (.., H, S, E), summed over each head group -> (.., Hkv, S, E) -> (.., Hkv, S)
    stored_k = stored.square() + (P * d_rows_error).square()  # (..., H, L, S)
    d_key_heads = scale * (d_scores.transpose(-2, -1) @ q)  # (..., H, S, E): each query head's share of dk
    result["dk"] = bound(per_key_row, per_key(d_key_heads, k, "key"),
                         per_key(scale * (terms.transpose(-2, -1) @ q.abs()), k, "key"),
                         per_key(scale ** 2 * (stored_k.transpose(-2, -1) @ q.square()), k, "key")
                         + shares(d_key_heads, k, "key"))
    # (.., H, S, L) x (.., H, L, Ev) -> (.., H, S, Ev), summed over each head group -> (.., Hkv, S)
    d_value_heads = P.transpose(-2, -1) @ d_out  # (..., H, S, Ev)
    result["dv"] = bound(per_key_row, per_key(d_value_heads, v, "value"),
                         per_key(conditioned.transpose(-2, -1) @ d_out.abs(), v, "value"),
                         per_key(P.square().transpose(-2, -1) @ d_out.square(), v, "value")
                         + shares(d_value_heads, v, "value"))
    if isinstance(weights_kwargs.get("sinks"), torch.Tensor):
        # dsinks_h = -sum_i p_i D_i over every row i of head h (or over the rows one sink per query broadcasts
        # to): p_i the sink's weight, D_i = rowsum(dO_i * O_i).
        # One value per head, judged against a single sample of the baseline's rounding, which a right kernel
        # may exceed (issue 32: 6 of 100 right float16 kernels, x-transformers' formulation, failed on
        # dsinks alone). Its floor is an a priori bound in the inputs' dtype, where a kernel may keep O and
        # the result: each term off by u (p_i |D_i| + p_i sum_e |dO_ie O_ie|), those errors, independent,
        # adding in quadrature over the rows, and the stored result's own rounding u |dsinks_h|. Measured
        # on 200 seeds of that kernel: its error at most 0.65 of this floor; a dsinks 5% off is still caught.
        p_sink = (1 - P.sum(-1)).clamp_min(0)  # (..., H, L)
        d_rows = d_rows.squeeze(-1)  # (..., H, L): D_i = rowsum(dO_i * O_i)
        terms_sink = p_sink * (d_rows.abs() + (d_out.abs() * exact_out.abs()).sum(-1))  # (..., H, L)
        sinks = weights_kwargs["sinks"]
        dsinks = _summed_to_sinks(p_sink * d_rows, sinks).abs()  # sinks' shape: |dsinks|
        result["dsinks"] = unit_in * (_summed_to_sinks(terms_sink.square(), sinks).sqrt() + dsinks)  # each judged
    return result


def _summed_to_sinks(x: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Rows ``(..., H, L)`` (or ``(L,)``) summed to the sinks' shape: over every row of a head for ``(H,)``, over
    the rows each entry broadcasts to for one sink per query."""
    if sinks.dim() >= 2:
        return x.sum_to_size(sinks.shape)
    if x.dim() < 2:  # rows (L,): one head
        return x.sum().reshape(1)
    return x.movedim(-2, 0).reshape(x.shape[-2], -1).sum(-1)  # (..., H, L) -> (H, rows) -> (H,)


def _no_sink(sinks: torch.Tensor, rows_dim: int) -> torch.Tensor:
    """Bool, broadcastable to rows of ``rows_dim`` dims ``(..., H, L)``: True where no finite sink joins the row."""
    no_sink = ~torch.isfinite(sinks)
    return no_sink.reshape(-1, 1) if sinks.dim() == 1 and rows_dim >= 2 else no_sink  # (H,) -> (H, 1)


def _masked_below_min(kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``kwargs`` with a float ``attn_mask``'s values ``<= finfo(dtype).min`` set to ``-inf``."""
    mask = kwargs.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return dict(kwargs)
    lowest = torch.finfo(dtype).min
    return dict(kwargs, attn_mask=mask.masked_fill(mask.to(torch.float64) <= lowest, float("-inf")))


def _rows_without_agreed_output(
    kwargs: dict[str, Any], output: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """Query rows ``(..., H, L)`` that only float-mask values ``<= finfo(dtype).min`` empty; None if none can.

    Such a row has a key under the literal mask (a finite score) and none once
    those values count as masked, and its head has no finite sink to absorb it.
    """
    mask = kwargs.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return None
    L, S = output.shape[-2], mask.shape[-1]
    batch = output.shape[:-2]  # (..., H)
    allowed = torch.ones(L, S, dtype=torch.bool, device=output.device)
    if kwargs.get("is_causal"):
        allowed = causal_mask(L, S, device=output.device)
    if kwargs.get("mask_mod") is not None:
        allowed = allowed & mods.apply_mask_mod(kwargs["mask_mod"], batch, L, S, output.device)
    literal = allowed & (mask > float("-inf"))  # broadcasts to (..., H, L, S)
    kept = allowed & (mask.to(torch.float64) > torch.finfo(dtype).min)
    rows = literal.any(-1) & ~kept.any(-1)  # (..., L)
    sinks = kwargs.get("sinks")
    if sinks is not None:  # a finite sink takes the whole row: output 0 in every convention
        rows = rows & _no_sink(sinks, output.dim() - 1)
    rows = rows.expand(*batch, L) if len(batch) else rows.expand(L)
    return rows if bool(rows.any()) else None


# ---- judging -----------------------------------------------------------------------------


@dataclass
class _Quantity:
    """One judged tensor: ``rows`` says what a row is ("query"/"key": the last dim's entries;
    "scalar": each element; "head": each element, one per head (dsinks); "one": the whole tensor)."""

    name: str
    actual: torch.Tensor
    reference: torch.Tensor
    low: torch.Tensor
    dtype: torch.dtype
    rows: str
    swap: bool = False  # report positions in the "blhd" layout
    not_judged: torch.Tensor | None = None  # bool, the rows' shape
    overflowed: torch.Tensor | None = None  # bool, the rows' shape
    rounding: torch.Tensor | None = None  # float64, the rows' shape: what any summation order may round away
    baseline: str = "no upcasting"  # how the low-precision baseline computes, for the messages
    # the rounding's words in the messages
    rounding_why: str = ("the rounding a right kernel may make on this row: its sums in any order and its result "
                         "and stored P, dS in the inputs' dtype, from the exact weights")


@dataclass
class _Verdict:
    quantity: _Quantity
    failed: bool
    allowance: torch.Tensor  # per row (a 0-dim tensor under bound="global")
    judged: torch.Tensor  # bool per row
    degenerate: int
    lines: list[str]


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in float64; 0 where both are the same infinity, ``inf`` where either is NaN."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    diff = (a - b).abs()
    diff = torch.where(a == b, torch.zeros_like(diff), diff)  # -inf == -inf: an empty row's lse
    return diff.nan_to_num(nan=math.inf, posinf=math.inf)


def _per_row(x: torch.Tensor, rows: str) -> torch.Tensor:
    """The largest entry of each row: ``(..., R, C) -> (..., R)``, or as ``rows`` says."""
    if rows in ("scalar", "head"):
        return x
    if rows == "one":
        return (x.amax() if x.numel() else x.new_zeros(())).reshape(1)
    return x.amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])


def _judge(q: _Quantity, factor: float, atol: float, bound: str) -> _Verdict:
    """Apply the rule to one quantity; the message lines when it fails."""
    if q.actual.shape != q.reference.shape:
        raise ValueError(
            f"actual_grads' {q.name} must have shape {_shape(q.reference.shape, q.swap)}, "
            f"got {_shape(q.actual.shape, q.swap)}"
        )
    diff = _abs_diff(q.actual, q.reference)
    low_diff = _abs_diff(q.low, q.reference)
    if bound == "global":
        return _judge_global(q, diff, low_diff, factor, atol)
    error, low_error = _per_row(diff, q.rows), _per_row(low_diff, q.rows)
    reference = q.reference.detach().abs()
    magnitude = _per_row(torch.where(torch.isfinite(reference), reference, torch.zeros_like(reference)), q.rows)
    not_judged = q.not_judged if q.not_judged is not None else torch.zeros_like(error, dtype=torch.bool)
    overflowed = q.overflowed if q.overflowed is not None else torch.zeros_like(not_judged)
    not_finite = ~torch.isfinite(low_error)
    # off by a quarter of its own magnitude or more, and by more than the typical row: a row whose reference
    # is merely small (a gradient that cancels, exactly 0) is off by what every row is off by, and is healthy
    usual = _percentile(low_error[~not_finite & ~not_judged])
    too_far = (low_error >= _DEGENERATE_SHARE * magnitude) & (low_error > usual) & ~not_finite
    degenerate = (not_finite | too_far | overflowed) & ~not_judged
    healthy = ~degenerate & ~not_judged
    # A row's baseline error is the largest of a few entries, a noisy estimate: a baseline that rounds
    # luckily on one row must not demand better there. So it counts as at least the typical error of the
    # healthy rows (their 90th percentile), absolute and relative to the row's magnitude; a percentile
    # moves little for a minority of bad rows, so no row's error widens the others' allowance.
    typical = _percentile(low_error[healthy])  # () float64
    sized = healthy & (magnitude > 0)
    typical_relative = _percentile(low_error[sized] / magnitude[sized])
    largest = low_error[healthy].max() if bool(healthy.any()) else torch.zeros((), dtype=torch.float64)
    floor = torch.maximum(typical, typical_relative * magnitude)  # (rows)
    floor = torch.minimum(floor, largest)  # (rows), <= the global
    if q.rounding is not None:
        # A row whose exact value cancels may be off by the rounding of its sums in a right kernel, whatever
        # the baseline's own order gave: an a priori bound, not capped by what one order happened to round.
        floor = torch.maximum(floor, q.rounding)
    # a degenerate row has no estimate of its own: it is held to the floor alone, the typical error at its scale
    judgeable = bool(healthy.any())
    allowance = factor * torch.where(degenerate, floor, torch.maximum(low_error, floor)) + atol
    if not judgeable:
        allowance = torch.where(degenerate, torch.full_like(allowance, math.nan), allowance)
    ok = error <= allowance  # False for NaN: a NaN fails
    if bool(not_judged.any()):  # judged only for being finite (lse: not NaN)
        values = q.actual.detach().to(torch.float64)
        finite = (~torch.isnan(values)) if q.rows in ("scalar", "head") else torch.isfinite(values).all(dim=-1)
        ok = torch.where(not_judged, finite, ok)
    judged = ~not_judged
    failing = ~ok
    n_degenerate = int(degenerate.sum())
    if not bool(failing.any()):
        return _Verdict(q, False, allowance, judged, n_degenerate, [])

    # the failing row with the largest error, and its worst position
    order = torch.where(failing, error.nan_to_num(nan=math.inf), torch.full_like(error, -1.0))
    row = tuple(int(i) for i in torch.unravel_index(order.argmax(), order.shape)) if order.dim() else ()
    if q.rows == "one":
        position = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    elif q.rows in ("scalar", "head"):
        position = row
    else:
        position = row + (int(diff[row].argmax()),) if diff.shape[-1] else row
    dtype = _name(q.dtype)
    lines = [f"  {q.name}:"]
    if bool(not_judged[row]):
        lines.append(f"    this row is not judged but must be finite: actual {_value(q.actual, position)}")
    else:
        lines += [
            f"    max|actual - reference|        = {error[row].item():.3e}",
            f"    max|low_precision - reference| = {low_error[row].item():.3e} ({dtype}, {q.baseline})",
        ]
        if not bool(degenerate[row]):
            if low_error[row] >= floor[row]:
                lines.append(f"    allowed: {factor:g} * {low_error[row].item():.3e} + {atol:g} = "
                             f"{allowance[row].item():.3e}")
            else:
                relative = typical_relative * magnitude[row]
                rounding = q.rounding[row] if q.rounding is not None else torch.zeros(())
                if floor[row] < torch.maximum(torch.maximum(typical, relative), rounding):
                    why = "the largest baseline error among the healthy rows, the floor's cap"
                elif rounding > torch.maximum(typical, relative):
                    why = q.rounding_why
                elif typical >= relative:
                    why = "the 90th percentile of the rows' baseline errors"
                else:
                    why = (f"{typical_relative.item():.3e} x {magnitude[row].item():.4g}, the 90th percentile of the "
                           "rows' baseline errors relative to their largest |reference|, times this row's")
                lines.append(f"    allowed: {factor:g} * {floor[row].item():.3e} + {atol:g} = "
                             f"{allowance[row].item():.3e} ({floor[row].item():.3e}: {why}; more than this row's own)")
        elif not judgeable:
            lines.append(f"    allowed: none: the {dtype} baseline is degenerate on every row of {q.name} "
                         f"({_reasons(not_finite, too_far, overflowed, degenerate)}), so the rule cannot judge "
                         "it; check in float32, or with smaller inputs")
        else:
            lines.append(f"    allowed: {factor:g} * {floor[row].item():.3e} + {atol:g} = {allowance[row].item():.3e}, "
                         "the typical error of the healthy rows at this row's magnitude (this row's baseline is "
                         f"degenerate: {_reasons(not_finite[row], too_far[row], overflowed[row], degenerate[row])})")
    lines.append(f"    worst position {_position(position, q.swap)}: actual {_value(q.actual, position)}, "
                 f"reference {_value(q.reference, position)}")
    if q.rows == "one":
        lines.append("    judged as one row (the whole tensor)")
    else:
        kind = {"query": "query rows", "key": "key rows", "scalar": "query rows", "head": "sinks", "token": "token rows",
                "state": "state rows"}[q.rows]
        lines.append(f"    {int(failing.sum())} of {failing.numel()} {kind} out of bounds; the numbers above are those "
                     f"of row {_swap_row(row) if q.swap else row}, the failing row with the largest error")
    if bool(overflowed.any()):
        lines.append(f"    the {dtype} baseline overflowed (a score beyond +-{torch.finfo(q.dtype).max:g} even with "
                     f"query * scale first) on {_count(int(overflowed.sum()), 'row')}: "
                     f"{_fmt_rows(_row_indices(overflowed, q.swap))}")
    if n_degenerate and judgeable:
        lines.append(f"    {_count(n_degenerate, 'row')} with a degenerate baseline "
                     f"({_reasons(not_finite, too_far, overflowed, degenerate)}) held to the healthy rows' typical "
                     f"error at their magnitude: {_fmt_rows(_row_indices(degenerate, q.swap))}")
    if bool(not_judged.any()):
        lines.append(f"    {_count(int(not_judged.sum()), 'query row')} not judged (every key masked only by float "
                     f"values <= finfo({dtype}).min; only checked to be finite): "
                     f"{_fmt_rows(_row_indices(not_judged, q.swap))}")
    return _Verdict(q, True, allowance, judged, n_degenerate, lines)


def _judge_global(q: _Quantity, diff: torch.Tensor, low_diff: torch.Tensor, factor: float, atol: float) -> _Verdict:
    """FlashAttention's exact rule: one maximum over the whole quantity."""
    error = diff.max().item() if diff.numel() else 0.0
    # a NaN in the baseline makes the bound NaN, as in FlashAttention's tests
    low = low_diff.masked_fill(torch.isinf(low_diff) & torch.isnan(q.low.detach().to(torch.float64)), math.nan)
    low_error = low.max().item() if low.numel() else 0.0
    allowed = factor * low_error + atol
    allowance = torch.tensor(allowed, dtype=torch.float64)
    judged = torch.ones((), dtype=torch.bool)
    if error <= allowed:  # False for NaN: a NaN fails
        return _Verdict(q, False, allowance, judged, 0, [])
    position = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    dtype = _name(q.dtype)
    lines = [
        f"  {q.name}:",
        f"    max|actual - reference|        = {error:.3e}",
        f"    max|low_precision - reference| = {low_error:.3e} ({dtype}, {q.baseline})",
        f"    allowed: {factor:g} * {low_error:.3e} + {atol:g} = {allowed:.3e}",
        f"    worst position {_position(position, q.swap)}: actual {_value(q.actual, position)}, "
        f"reference {_value(q.reference, position)}",
    ]
    if q.overflowed is not None and bool(q.overflowed.any()):
        lines.append(f"    the {dtype} baseline overflowed (a score beyond +-{torch.finfo(q.dtype).max:g} even with "
                     f"query * scale first) on {_count(int(q.overflowed.sum()), 'row')}: "
                     f"{_fmt_rows(_row_indices(q.overflowed, q.swap))}; bound='row' holds them to the other rows' "
                     "allowance")
    return _Verdict(q, True, allowance, judged, 0, lines)


def _accumulation_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the sums a kernel accumulates: float32's for float16, bfloat16 and float32."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps / 2


def _percentile(values: torch.Tensor) -> torch.Tensor:
    """The `_TYPICAL` percentile of ``values`` (nearest rank), 0 when there are none."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    ordered = values.flatten().sort().values
    return ordered[math.ceil(_TYPICAL * (ordered.numel() - 1))]


def _reasons(not_finite: torch.Tensor, too_far: torch.Tensor, overflowed: torch.Tensor, among: torch.Tensor) -> str:
    """Why the rows ``among`` are degenerate, in words."""
    reasons = ((overflowed, "overflowed"), (not_finite, "not finite"),
               (too_far, "off by a quarter of the row's magnitude or more"))
    return ", ".join(text for flags, text in reasons if bool((flags & among).any()))


def _rule_text(bound: str) -> str:
    if bound == "row":
        return ("for each row r, max_r|actual - ref| <= factor * max(e_r, F_r) + atol, "
                "e_r = max_r|low_precision - ref|, F_r the rows' typical e or the row's rounding (bound='row')")
    return "max|actual - ref| <= factor * max|low_precision - ref| + atol, over the whole tensor (bound='global')"


def _report(bound: str, verdicts: list[_Verdict], not_judged: torch.Tensor | None, swap: bool) -> CheckReport:
    rows = tuple(_row_indices(not_judged, swap)) if not_judged is not None else ()
    return CheckReport(bound, tuple(v.quantity.name for v in verdicts), rows,
                       {v.quantity.name: v.degenerate for v in verdicts})


# ---- probes: which planted bug would the output match? -----------------------------------


def _empty_row_lines(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, actual: torch.Tensor,
                     kwargs64: dict[str, Any], verdict: _Verdict, swap: bool) -> list[str]:
    """A line when every failing output row is a row no key takes part in (and no sink): conventions differ there."""
    q, k, v = (t.detach().to(torch.float64) for t in (query, key, value))
    weights_kwargs = {n: kwargs64[n] for n in _ATTENTION_KWARGS if n in kwargs64 and n != "sinks"}
    P = attention_weights(q, k, **weights_kwargs)  # (..., H, L, S)
    empty = P.sum(-1) == 0  # (..., H, L)
    sinks = kwargs64.get("sinks")
    if sinks is not None:  # a finite sink takes the whole row: output 0 in every convention
        empty = empty & _no_sink(sinks.detach(), empty.dim())
    error = _per_row(_abs_diff(actual, verdict.quantity.reference), "query")
    failing = ~(error <= verdict.allowance) & verdict.judged
    empty = empty.expand(failing.shape)
    if not bool(empty.any()) or bool((failing & ~empty).any()):
        return []
    v_all = expand_kv_heads(q, v, "value") if kwargs64.get("enable_gqa") else v  # (..., H, S, Ev)
    mean = v_all.mean(-2, keepdim=True).expand(actual.shape) if v.shape[-2] else None  # (..., H, L, Ev)
    got = actual.detach().to(torch.float64)
    if not bool(torch.isfinite(got[failing]).all()):
        gives = "NaN or inf there"
    elif mean is not None and bool(torch.allclose(got[failing], mean[failing], rtol=1e-2, atol=1e-2)):
        gives = "the mean of the values there (the softmax of equal scores, as a -1e9 or finfo.min mask gives)"
    else:
        gives = "something else there"
    every = "all " if bool((failing == empty).all()) else ""
    return [f"  the failing rows are {every}query rows no key takes part in ({_count(int(empty.sum()), 'such row')}: "
            f"{_fmt_rows(_row_indices(empty, swap))}): the reference gives 0 there, as FlashAttention and "
            f"torch's SDPA do; this kernel gives {gives}. Check the mask or causal alignment that empties them, "
            "or mask them out of the comparison"]


def _probe_lines(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, actual: torch.Tensor,
                 kwargs: dict[str, Any], verdict: _Verdict) -> list[str]:
    """``likely cause: ...`` for each planted bug under which the output passes its row allowances."""
    tried, matched = [], []
    for name, description, make in _probes(query, key, value, kwargs):
        tried.append(name)
        probe = make()
        error = _per_row(_abs_diff(actual, probe), "query")
        if bool(((error <= verdict.allowance) | ~verdict.judged).all()):
            matched.append(description)
    if matched:
        return [f"  likely cause: {description}" for description in matched]
    if tried:
        return [f"  probes tried, none matched: {', '.join(tried)}"]
    return []


def _probes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            kwargs: dict[str, Any]) -> list[tuple[str, str, Callable[[], torch.Tensor]]]:
    """``(short name, description, float64 output with the bug planted)`` for the probes that apply."""
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    mods_or_sinks = any(kwargs.get(n) is not None for n in ("score_mod", "mask_mod", "sinks"))

    def forward(q: torch.Tensor = query, k: torch.Tensor = key, v: torch.Tensor = value,
                **changes: Any) -> torch.Tensor:
        with torch.no_grad():
            return scaled_dot_product_attention(*(t.detach().to(torch.float64) for t in (q, k, v)),
                                                **_float64_kwargs({**kwargs, **changes}, False))

    probes: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        probes.append(("inverted mask", "the boolean attn_mask is inverted: here True = takes part "
                       "(F.scaled_dot_product_attention's convention); torch.nn.MultiheadAttention's masks "
                       "mean True = masked out", lambda: forward(attn_mask=~mask)))
    if kwargs.get("is_causal") and L != S:
        bottom_right = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)  # j <= i + S - L

        def aligned() -> torch.Tensor:
            return forward(attn_mask=combine_masks(mask, bottom_right), is_causal=False)

        probes.append(("causal alignment", "the causal mask is aligned bottom-right (query i keeps key j when "
                       f"j <= i + S - L = i + {S - L}, FlashAttention's convention) instead of top-left "
                       "(torch's is_causal: j <= i)", aligned))
    default = 1.0 / math.sqrt(E)
    if scale is None or math.isclose(scale, default, rel_tol=1e-6):
        probes.append(("scale = 1", f"scale = 1: the scores are not scaled (expected 1/sqrt(E) = {default:.4g})",
                       lambda: forward(scale=1.0)))
        if E > 1:
            probes.append(("scale = 1/E", f"scale = 1/E = {1 / E:.4g} instead of 1/sqrt(E) = {default:.4g}",
                           lambda: forward(scale=1.0 / E)))
    else:
        probes.append(("scale ignored", f"the scale argument is ignored: the default 1/sqrt(E) = {default:.4g} "
                       f"was used instead of scale={scale:g}", lambda: forward(scale=None)))
        probes.append(("scale = 1", "scale = 1: the scores are not scaled", lambda: forward(scale=1.0)))
    if (mask is None and not mods_or_sinks and query.dim() >= 3 and L == S
            and query.shape[-3] == key.shape[-3] and query.shape[-3] > 1):
        def transposed() -> torch.Tensor:
            swapped = forward(*(t.transpose(-3, -2) for t in (query, key, value)))  # (..., L, H, Ev) read as bhld
            return swapped.transpose(-3, -2)

        probes.append(("transposed layout", "the layout is transposed: the kernel read (B, L, H, E) tensors "
                       "as (B, H, L, E), or the reverse (its heads and positions swapped)", transposed))
    if kwargs.get("enable_gqa") and query.dim() >= 3 and 1 < key.shape[-3] < query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]

        def repeated(t: torch.Tensor) -> torch.Tensor:  # (..., Hkv, S, _) -> (..., H, S, _): head h gets h % Hkv
            return t.repeat(*(1,) * (t.dim() - 3), group, 1, 1)

        def interleaved(t: torch.Tensor) -> torch.Tensor:  # head h gets h // group, as enable_gqa does
            return expand_kv_heads(query, t, "key")

        order = ("query head h read key/value head h % Hkv (repeat) instead of h // (H / Hkv) "
                 "(repeat_interleave, as enable_gqa and this reference group them)")
        for name, k_of, v_of in (("GQA order", repeated, repeated),
                                 ("GQA order of values", interleaved, repeated),
                                 ("GQA order of keys", repeated, interleaved)):
            which = {"GQA order": "the key and value heads", "GQA order of values": "the value heads only",
                     "GQA order of keys": "the key heads only"}[name]
            probes.append((name, f"{which} in the wrong GQA order: {order}",
                           lambda k_of=k_of, v_of=v_of: forward(query, k_of(key), v_of(value), enable_gqa=False)))
    return probes


# ---- modules -----------------------------------------------------------------------------

_Parameters = dict[str, tuple[torch.Tensor, "slice | None"]]  # canonical name -> (parameter, its part)
_ORDER = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
          "out_proj.weight", "out_proj.bias")


@dataclass
class _ModuleSpec:
    """A multi-head module's sizes, and its parameters under the canonical names of `_ORDER`."""

    module: nn.Module
    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    bias: bool
    dtype: torch.dtype

    def parameters(self) -> _Parameters:
        m = self.module
        if isinstance(m, nn.MultiheadAttention):
            return _torch_parameters(m)
        found = {f"{proj}.{kind}": (getattr(getattr(m, proj), kind), None)
                 for proj in ("q_proj", "k_proj", "v_proj", "out_proj") for kind in ("weight", "bias")}
        return {n: found[n] for n in _ORDER if found[n][0] is not None}

    def weights(self) -> dict[str, torch.Tensor]:
        """Canonical name -> the detached weight (a fused in-projection split into its parts)."""
        return {n: (p if part is None else p[part]).detach() for n, (p, part) in self.parameters().items()}

    def call(self, inputs: list[torch.Tensor], attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        m = self.module
        if isinstance(m, nn.MultiheadAttention):
            return _call_torch(m, inputs, attn_mask, is_causal, batch_first=m.batch_first)
        key, value = (None, None) if len(inputs) == 1 else inputs[1:]
        return m(inputs[0], key, value, attn_mask, is_causal=is_causal)


def _module_spec(module: object) -> _ModuleSpec:
    if isinstance(module, MultiHeadAttention):
        if module.num_kv_heads != module.num_heads:
            raise ValueError(f"reference='torch' needs num_kv_heads == num_heads (torch.nn.MultiheadAttention has "
                             f"no grouped heads), got num_heads={module.num_heads}, "
                             f"num_kv_heads={module.num_kv_heads}")
        if getattr(module, "sinks", None) is not None:
            raise ValueError("reference='torch' cannot check a module with learned sinks (sinks=True): "
                             "torch.nn.MultiheadAttention has none")
        bias = module.q_proj.bias is not None
    elif isinstance(module, nn.MultiheadAttention):
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("assert_module_close does not support add_bias_kv=True or add_zero_attn=True")
        bias = module.in_proj_bias is not None
    else:
        raise TypeError("actual_module must be an attention_ref.MultiHeadAttention or a torch.nn.MultiheadAttention, "
                        f"got {type(module).__name__}")
    if module.training and module.dropout > 0:
        raise ValueError(f"the module is in training mode with dropout={module.dropout}: its output is random. "
                         "Build it with dropout=0, or call .eval() first")
    return _ModuleSpec(module, module.embed_dim, module.num_heads, module.kdim, module.vdim, bias,
                       module.out_proj.weight.dtype)


def _torch_parameters(m: nn.MultiheadAttention) -> _Parameters:
    """A torch module's parameters under the canonical names; the fused in-projection's parts as slices."""
    E = m.embed_dim
    part = {"q": slice(0, E), "k": slice(E, 2 * E), "v": slice(2 * E, 3 * E)}
    found: _Parameters = {"out_proj.weight": (m.out_proj.weight, None)}
    for p in "qkv":
        if m._qkv_same_embed_dim:  # in_proj_weight (3E, E) = [W_q; W_k; W_v]
            found[f"{p}_proj.weight"] = (m.in_proj_weight, part[p])
        else:
            found[f"{p}_proj.weight"] = (getattr(m, f"{p}_proj_weight"), None)
        if m.in_proj_bias is not None:  # in_proj_bias (3E,) = [b_q; b_k; b_v]
            found[f"{p}_proj.bias"] = (m.in_proj_bias, part[p])
    if m.out_proj.bias is not None:
        found["out_proj.bias"] = (m.out_proj.bias, None)
    return {n: found[n] for n in _ORDER if n in found}


def _torch_module(spec: _ModuleSpec, weights: dict[str, torch.Tensor]) -> nn.MultiheadAttention:
    """A float64 ``torch.nn.MultiheadAttention`` (batch first, dropout 0, training mode) holding ``weights``."""
    device = next(iter(weights.values())).device
    m = nn.MultiheadAttention(spec.embed_dim, spec.num_heads, dropout=0.0, bias=spec.bias, kdim=spec.kdim,
                              vdim=spec.vdim, batch_first=True, device=device, dtype=torch.float64)
    with torch.no_grad():
        w = {n: t.to(torch.float64) for n, t in weights.items()}
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]]))
        else:
            m.q_proj_weight.copy_(w["q_proj.weight"])
            m.k_proj_weight.copy_(w["k_proj.weight"])
            m.v_proj_weight.copy_(w["v_proj.weight"])
        m.out_proj.weight.copy_(w["out_proj.weight"])
        if spec.bias:
            m.in_proj_bias.copy_(torch.cat([w["q_proj.bias"], w["k_proj.bias"], w["v_proj.bias"]]))
            m.out_proj.bias.copy_(w["out_proj.bias"])
    return m.train()  # the general path; dropout is 0


def _call_torch(m: nn.Module, inputs: list[torch.Tensor], attn_mask: torch.Tensor | None, is_causal: bool,
                *, batch_first: bool) -> torch.Tensor:
    """Call a torch module with this package's mask convention converted to its own (True = masked out)."""
    q, k, v = (inputs * 3)[:3] if len(inputs) == 1 else inputs
    L, S = q.shape[1], k.shape[1]
    mask = attn_mask
    if is_causal:
        mask = combine_masks(mask, causal_mask(L, S, device=q.device))
    if mask is not None and mask.dtype == torch.bool:
        mask = ~mask  # torch.nn.MultiheadAttention: True = masked out
    elif mask is not None:
        mask = mask.to(q.dtype)
    if not batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = m(q, k, v, attn_mask=mask, need_weights=False)[0]
    return out if batch_first else out.transpose(0, 1)


def _low_precision_module(spec: _ModuleSpec, w: dict[str, torch.Tensor], inputs: list[torch.Tensor],
                          kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain multi-head attention in the module's dtype: projections, the baseline attention, out projection."""
    q, k, v = (inputs * 3)[:3] if len(inputs) == 1 else inputs
    H, D = spec.num_heads, spec.embed_dim // spec.num_heads

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        y = F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))  # (B, T, in) -> (B, T, H * D)
        return y.view(*y.shape[:2], H, D).transpose(1, 2)  # (B, T, H * D) -> (B, H, T, D)

    out, _, overflowed = _low_precision_attention(project(q, "q_proj"), project(k, "k_proj"), project(v, "v_proj"),
                                                  **kwargs)  # (B, H, L, D)
    B, _, L, _ = out.shape
    out = out.transpose(1, 2).reshape(B, L, H * D)  # (B, H, L, D) -> (B, L, H * D)
    return F.linear(out, w["out_proj.weight"], w.get("out_proj.bias")), overflowed.any(dim=1)  # (B, L, d), (B, L)


# ---- helpers -----------------------------------------------------------------------------


def _grad(output: torch.Tensor, wrt: Sequence[torch.Tensor], grad_output: torch.Tensor,
          parts: Sequence[slice | None] = ()) -> list[torch.Tensor]:
    """Gradients of ``output`` (fed ``grad_output``) to each of ``wrt``: 0 for an unused one; a tensor
    listed twice gets its gradient twice; ``parts`` slices the last ``len(parts)`` gradients."""
    unique = list({id(t): t for t in wrt}.values())
    grads = torch.autograd.grad(output, unique, grad_output, allow_unused=True)
    by_id = {id(t): (torch.zeros_like(t) if g is None else g) for t, g in zip(unique, grads)}
    result = [by_id[id(t)] for t in wrt]
    offset = len(wrt) - len(parts)
    for i, part in enumerate(parts):
        if part is not None:
            result[offset + i] = result[offset + i][part]
    return result


def _float64_kwargs(kwargs: dict[str, Any], with_grads: bool) -> dict[str, Any]:
    """The attention kwargs for the float64 reference: float mask and sinks in float64."""
    out = dict(kwargs)
    mask = out.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        out["attn_mask"] = mask.detach().to(torch.float64)
    sinks = out.get("sinks")
    if isinstance(sinks, torch.Tensor):
        out["sinks"] = sinks.detach().to(torch.float64).requires_grad_(with_grads)
    return out


def _bhld(t: torch.Tensor, swap: bool) -> torch.Tensor:
    return t.transpose(-3, -2) if swap else t


def _position(position: tuple[int, ...], swap: bool) -> tuple[int, ...]:
    """A position ``(..., h, i, c)`` in the caller's layout: "blhd" swaps the head and sequence entries."""
    return position[:-3] + (position[-2], position[-3], position[-1]) if swap and len(position) >= 3 else position


def _row_indices(rows: torch.Tensor, swap: bool) -> list[tuple[int, ...]]:
    """The indices of the True rows, in the caller's layout."""
    found = [tuple(int(i) for i in idx) for idx in rows.nonzero().tolist()]
    return [_swap_row(r) if swap else r for r in found]


def _swap_row(row: tuple[int, ...]) -> tuple[int, ...]:
    return row[:-2] + (row[-1], row[-2]) if len(row) >= 2 else row


def _shape(shape: Sequence[int], swap: bool) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    return shape[:-3] + (shape[-2], shape[-3], shape[-1]) if swap and len(shape) >= 3 else shape


def _value(t: torch.Tensor, position: tuple[int, ...]) -> str:
    return f"{t.detach()[position].item():.6g}" if t.dim() else f"{t.item():.6g}"


def _fmt_rows(rows: list[tuple[int, ...]]) -> str:
    shown = ", ".join(str(r) for r in rows[:_SHOWN])
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > _SHOWN else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {_name(value.dtype)}"
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


def _describe_config(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_kwargs: dict[str, Any],
                     factor: float, atol: float, bound: str, layout: str, swap: bool, lse_base: float | None) -> str:
    kwargs = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(attention_kwargs.items()))
    lse = "" if lse_base is None else f", lse_base={'e' if lse_base == math.e else f'{lse_base:g}'}"
    return (
        f"query {_shape(query.shape, swap)}, key {_shape(key.shape, swap)}, value {_shape(value.shape, swap)}\n"
        f"    dtype {_name(query.dtype)}, factor={factor:g}, atol={atol:g}, bound={bound!r}, layout={layout!r}{lse}\n"
        f"    kwargs {{{kwargs}}}"
    )


def _check_number(name: str, number: Any) -> None:
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(number).__name__}")
    bad = number <= 0 if name == "factor" else number < 0
    if not math.isfinite(number) or bad:
        raise ValueError(f"{name} must be finite and {'> 0' if name == 'factor' else '>= 0'}, got {number}")


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
    _check_number("factor", factor)
    _check_number("atol", atol)


def _check_options(bound: Any, layout: Any, lse_base: Any, actual_lse: Any) -> None:
    if bound not in _BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(map(repr, _BOUNDS))}, got {bound!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, _LAYOUTS))}, got {layout!r}")
    if isinstance(lse_base, bool) or not isinstance(lse_base, (int, float)):
        raise TypeError(f"lse_base must be a real number, got {type(lse_base).__name__}")
    if not math.isfinite(lse_base) or lse_base <= 1:
        raise ValueError(f"lse_base must be finite and > 1 (math.e or 2), got {lse_base}")
    if actual_lse is not None and (not isinstance(actual_lse, torch.Tensor) or not actual_lse.is_floating_point()):
        raise TypeError(f"actual_lse must be a floating-point torch.Tensor, got {type(actual_lse).__name__}")


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
    sinks = attention_kwargs.get("sinks")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point()):
        raise TypeError(f"sinks must be a floating-point torch.Tensor (H,) or None, got {type(sinks).__name__}")


def _length(value: Any) -> int | str:
    try:
        return len(value)
    except TypeError:
        return "none"
