"""Judging: the rule applied to each quantity, its verdict, the numbers of a failure's message, the report.

A checker wraps each tensor it judges in a `Quantity` (the actual values, the float64 reference, the
low-precision baseline, what a row is, its rounding term) and calls `judge_all`, which applies
``bound="row"`` (`_judge`: each row's allowance from its own baseline error, the healthy rows'
typical error and its rounding) or ``bound="global"`` (`_judge_global`: FlashAttention's exact rule)
and gives a `Verdict` per quantity with the lines of the message. A passing check returns a
`CheckReport`, made by `report`. `Quantity`, `Verdict`, `judge_all`, `report`, `abs_diff` and
`per_row` are shared by the three checkers and the probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attention_ref.testing.messages import (
    caller_position,
    caller_shape,
    counted,
    dtype_name,
    fmt_rows,
    row_indices,
    swap_row,
    value_at,
)

_DEGENERATE_SHARE = 0.25  # a baseline off by a quarter of the row's magnitude or more cannot judge that row
_TYPICAL = 0.9  # the percentile of the healthy rows' baseline errors that floors every row's own


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
            text += (f"; {counted(len(self.rows_not_judged), 'query row')} not judged (every key masked "
                     f"only by float values <= finfo(dtype).min): {fmt_rows(list(self.rows_not_judged))}")
        degenerate = {name: n for name, n in self.degenerate_rows.items() if n}
        if degenerate:
            text += "; rows with a degenerate baseline, held to the typical error: " + ", ".join(
                f"{name} {n}" for name, n in degenerate.items())
        return text


def judge_all(
    check: str, quantities: list[Quantity], factor: float, atol: float, bound: str
) -> tuple[list[Verdict], list[str]]:
    """Every quantity's verdict, and the failure message's lines so far (none when all pass)."""
    verdicts = [_judge(q, factor, atol, bound) for q in quantities]
    failures = [v for v in verdicts if v.failed]
    if not failures:
        return verdicts, []
    lines = [f"{check}: {len(failures)} of {len(verdicts)} quantities out of bounds", "  rule: " + _rule_text(bound)]
    for verdict in failures:
        lines += verdict.lines
    return verdicts, lines


@dataclass
class Quantity:
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
class Verdict:
    quantity: Quantity
    failed: bool
    allowance: torch.Tensor  # per row (a 0-dim tensor under bound="global")
    judged: torch.Tensor  # bool per row
    degenerate: int
    lines: list[str]


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in float64; 0 where both are the same infinity, ``inf`` where either is NaN."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    diff = (a - b).abs()
    diff = torch.where(a == b, torch.zeros_like(diff), diff)  # -inf == -inf: an empty row's lse
    return diff.nan_to_num(nan=math.inf, posinf=math.inf)


def per_row(x: torch.Tensor, rows: str) -> torch.Tensor:
    """The largest entry of each row: ``(..., R, C) -> (..., R)``, or as ``rows`` says."""
    if rows in ("scalar", "head"):
        return x
    if rows == "one":
        return (x.amax() if x.numel() else x.new_zeros(())).reshape(1)
    return x.amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])


def _judge(q: Quantity, factor: float, atol: float, bound: str) -> Verdict:
    """Apply the rule to one quantity; the message lines when it fails.

    Under ``bound="row"`` each row ``r`` passes when ``max_r|actual - ref| <= a_r``, the allowance
    of `_row_allowance` from the row's baseline error ``e_r`` (`_degenerate_rows` says which rows'
    ``e_r`` cannot be trusted, `_error_floor` gives the floor ``F_r``); a row not judged passes when
    it is finite. ``bound="global"`` is `_judge_global`.
    """
    if q.actual.shape != q.reference.shape:
        raise ValueError(
            f"actual_grads' {q.name} must have shape {caller_shape(q.reference.shape, q.swap)}, "
            f"got {caller_shape(q.actual.shape, q.swap)}"
        )
    diff = abs_diff(q.actual, q.reference)
    low_diff = abs_diff(q.low, q.reference)
    if bound == "global":
        return _judge_global(q, diff, low_diff, factor, atol)
    error, low_error = per_row(diff, q.rows), per_row(low_diff, q.rows)
    reference = q.reference.detach().abs()
    magnitude = per_row(torch.where(torch.isfinite(reference), reference, torch.zeros_like(reference)), q.rows)
    not_judged = q.not_judged if q.not_judged is not None else torch.zeros_like(error, dtype=torch.bool)
    overflowed = q.overflowed if q.overflowed is not None else torch.zeros_like(not_judged)
    not_finite, too_far, degenerate = _degenerate_rows(low_error, magnitude, not_judged, overflowed)
    healthy = ~degenerate & ~not_judged
    floor, typical, typical_relative = _error_floor(low_error, magnitude, healthy, q.rounding)
    judgeable = bool(healthy.any())
    allowance = _row_allowance(low_error, floor, degenerate, judgeable, factor, atol)
    ok = _rows_pass(q, error, allowance, not_judged)
    judged = ~not_judged
    failing = ~ok
    n_degenerate = int(degenerate.sum())
    if not bool(failing.any()):
        return Verdict(q, False, allowance, judged, n_degenerate, [])
    terms = _RowTerms(error, low_error, magnitude, not_judged, overflowed, not_finite, too_far, degenerate, floor,
                      typical, typical_relative, allowance, judgeable)
    return Verdict(q, True, allowance, judged, n_degenerate, _row_failure_lines(q, diff, terms, failing, factor, atol))


def _degenerate_rows(
    low_error: torch.Tensor, magnitude: torch.Tensor, not_judged: torch.Tensor, overflowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows whose baseline error ``e_r`` cannot judge them: ``(not_finite, too_far, degenerate)``, bool per row.

    With ``m_r`` the row's largest finite ``|reference|`` and ``U`` the `_TYPICAL` percentile of the
    finite ``e`` of the judged rows: ``not_finite_r`` when ``e_r`` is NaN or inf; ``too_far_r`` when
    ``e_r >= 0.25 * m_r and e_r > U`` (finite ``e_r`` only); ``degenerate_r = (not_finite_r or too_far_r
    or overflowed_r) and r is judged``. A row whose reference is merely small (a gradient that cancels,
    exactly 0) is off by what every row is off by (``e_r <= U``), and is healthy.
    """
    not_finite = ~torch.isfinite(low_error)
    usual = _percentile(low_error[~not_finite & ~not_judged])
    too_far = (low_error >= _DEGENERATE_SHARE * magnitude) & (low_error > usual) & ~not_finite
    degenerate = (not_finite | too_far | overflowed) & ~not_judged
    return not_finite, too_far, degenerate


def _error_floor(
    low_error: torch.Tensor, magnitude: torch.Tensor, healthy: torch.Tensor, rounding: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The floor of each row's baseline error, and its two percentiles: ``(F, T, T_rel)``.

    ``F_r = max(min(max(T, T_rel * m_r), e_max), rounding_r)``, where ``T`` is the `_TYPICAL` (90th)
    percentile of the healthy rows' ``e``, ``T_rel`` that of ``e / m`` over the healthy rows with
    ``m > 0``, ``e_max`` the largest healthy ``e`` (0 if none) and ``rounding_r`` the quantity's
    rounding term (left out when it has none). A row's baseline error is the largest of a few entries,
    a noisy estimate: a baseline that rounds luckily on one row must not demand better there, and a
    percentile moves little for a minority of bad rows, so no row's error widens the others'
    allowance. The rounding is an a priori bound on what a right kernel's sums may round away on a
    row whose exact value cancels, not capped by what one order happened to round.
    """
    typical = _percentile(low_error[healthy])  # () float64
    sized = healthy & (magnitude > 0)
    typical_relative = _percentile(low_error[sized] / magnitude[sized])
    largest = low_error[healthy].max() if bool(healthy.any()) else torch.zeros((), dtype=torch.float64)
    floor = torch.maximum(typical, typical_relative * magnitude)  # (rows)
    floor = torch.minimum(floor, largest)  # (rows), <= the global
    if rounding is not None:
        floor = torch.maximum(floor, rounding)
    return floor, typical, typical_relative


def _row_allowance(low_error: torch.Tensor, floor: torch.Tensor, degenerate: torch.Tensor, judgeable: bool,
                   factor: float, atol: float) -> torch.Tensor:
    """Each row's allowance: ``a_r = factor * max(e_r, F_r) + atol``, or ``factor * F_r + atol`` on a degenerate row.

    A degenerate row has no estimate of its own: it is held to the floor alone, the typical error
    at its scale. When no row is healthy (not ``judgeable``) there is no floor to trust either, and
    the degenerate rows' allowance is NaN, which fails every comparison.
    """
    allowance = factor * torch.where(degenerate, floor, torch.maximum(low_error, floor)) + atol
    if not judgeable:
        allowance = torch.where(degenerate, torch.full_like(allowance, math.nan), allowance)
    return allowance


def _rows_pass(q: Quantity, error: torch.Tensor, allowance: torch.Tensor, not_judged: torch.Tensor) -> torch.Tensor:
    """Bool per row: ``max_r|actual - ref| <= a_r`` on a judged row (False for NaN), finiteness on the others.

    A row not judged passes when its actual values are all finite (for ``"scalar"`` and ``"head"``
    rows, the lse, when its value is not NaN).
    """
    ok = error <= allowance  # False for NaN: a NaN fails
    if bool(not_judged.any()):  # judged only for being finite (lse: not NaN)
        values = q.actual.detach().to(torch.float64)
        finite = (~torch.isnan(values)) if q.rows in ("scalar", "head") else torch.isfinite(values).all(dim=-1)
        ok = torch.where(not_judged, finite, ok)
    return ok


@dataclass(frozen=True)
class _RowTerms:
    """The per-row terms of ``bound="row"`` for one quantity, for its failure message (`_judge` computes them)."""

    error: torch.Tensor  # max_r|actual - ref|
    low_error: torch.Tensor  # e_r = max_r|low_precision - ref|
    magnitude: torch.Tensor  # m_r, the row's largest finite |ref|
    not_judged: torch.Tensor
    overflowed: torch.Tensor
    not_finite: torch.Tensor
    too_far: torch.Tensor
    degenerate: torch.Tensor
    floor: torch.Tensor  # F_r
    typical: torch.Tensor  # T
    typical_relative: torch.Tensor  # T_rel
    allowance: torch.Tensor  # a_r
    judgeable: bool


def _worst_failing_row(q: Quantity, diff: torch.Tensor, error: torch.Tensor,
                       failing: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(row, position)``: the failing row with the largest error (NaN counts as inf), and its worst entry."""
    order = torch.where(failing, error.nan_to_num(nan=math.inf), torch.full_like(error, -1.0))
    row = tuple(int(i) for i in torch.unravel_index(order.argmax(), order.shape)) if order.dim() else ()
    if q.rows == "one":
        position = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    elif q.rows in ("scalar", "head"):
        position = row
    else:
        position = row + (int(diff[row].argmax()),) if diff.shape[-1] else row
    return row, position


def _allowed_line(q: Quantity, t: _RowTerms, row: tuple[int, ...], factor: float, atol: float) -> str:
    """The message's ``allowed:`` line for a judged ``row``: ``a_r`` and which term of ``max(e_r, F_r)`` set it."""
    dtype = dtype_name(q.dtype)
    if not bool(t.degenerate[row]):
        if t.low_error[row] >= t.floor[row]:
            return f"    allowed: {factor:g} * {t.low_error[row].item():.3e} + {atol:g} = {t.allowance[row].item():.3e}"
        relative = t.typical_relative * t.magnitude[row]
        rounding = q.rounding[row] if q.rounding is not None else torch.zeros(())
        if t.floor[row] < torch.maximum(torch.maximum(t.typical, relative), rounding):
            why = "the largest baseline error among the healthy rows, the floor's cap"
        elif rounding > torch.maximum(t.typical, relative):
            why = q.rounding_why
        elif t.typical >= relative:
            why = "the 90th percentile of the rows' baseline errors"
        else:
            why = (f"{t.typical_relative.item():.3e} x {t.magnitude[row].item():.4g}, the 90th percentile of the "
                   "rows' baseline errors relative to their largest |reference|, times this row's")
        return (f"    allowed: {factor:g} * {t.floor[row].item():.3e} + {atol:g} = "
                f"{t.allowance[row].item():.3e} ({t.floor[row].item():.3e}: {why}; more than this row's own)")
    if not t.judgeable:
        return (f"    allowed: none: the {dtype} baseline is degenerate on every row of {q.name} "
                f"({_reasons(t.not_finite, t.too_far, t.overflowed, t.degenerate)}), so the rule cannot judge "
                "it; check in float32, or with smaller inputs")
    return (f"    allowed: {factor:g} * {t.floor[row].item():.3e} + {atol:g} = {t.allowance[row].item():.3e}, "
            "the typical error of the healthy rows at this row's magnitude (this row's baseline is "
            f"degenerate: {_reasons(t.not_finite[row], t.too_far[row], t.overflowed[row], t.degenerate[row])})")


def _row_failure_lines(q: Quantity, diff: torch.Tensor, t: _RowTerms, failing: torch.Tensor, factor: float,
                       atol: float) -> list[str]:
    """The message lines of a quantity that fails ``bound="row"``: the worst failing row's numbers, then counts."""
    row, position = _worst_failing_row(q, diff, t.error, failing)
    dtype = dtype_name(q.dtype)
    lines = [f"  {q.name}:"]
    if bool(t.not_judged[row]):
        lines.append(f"    this row is not judged but must be finite: actual {value_at(q.actual, position)}")
    else:
        lines += [
            f"    max|actual - reference|        = {t.error[row].item():.3e}",
            f"    max|low_precision - reference| = {t.low_error[row].item():.3e} ({dtype}, {q.baseline})",
            _allowed_line(q, t, row, factor, atol),
        ]
    lines.append(f"    worst position {caller_position(position, q.swap)}: actual {value_at(q.actual, position)}, "
                 f"reference {value_at(q.reference, position)}")
    if q.rows == "one":
        lines.append("    judged as one row (the whole tensor)")
    else:
        kind = {"query": "query rows", "key": "key rows", "scalar": "query rows", "head": "sinks", "token": "token rows",
                "state": "state rows"}[q.rows]
        lines.append(f"    {int(failing.sum())} of {failing.numel()} {kind} out of bounds; the numbers above are those "
                     f"of row {swap_row(row) if q.swap else row}, the failing row with the largest error")
    if bool(t.overflowed.any()):
        lines.append(f"    the {dtype} baseline overflowed (a score beyond +-{torch.finfo(q.dtype).max:g} even with "
                     f"query * scale first) on {counted(int(t.overflowed.sum()), 'row')}: "
                     f"{fmt_rows(row_indices(t.overflowed, q.swap))}")
    n_degenerate = int(t.degenerate.sum())
    if n_degenerate and t.judgeable:
        lines.append(f"    {counted(n_degenerate, 'row')} with a degenerate baseline "
                     f"({_reasons(t.not_finite, t.too_far, t.overflowed, t.degenerate)}) held to the healthy rows' "
                     f"typical error at their magnitude: {fmt_rows(row_indices(t.degenerate, q.swap))}")
    if bool(t.not_judged.any()):
        lines.append(f"    {counted(int(t.not_judged.sum()), 'query row')} not judged (every key masked only by float "
                     f"values <= finfo({dtype}).min; only checked to be finite): "
                     f"{fmt_rows(row_indices(t.not_judged, q.swap))}")
    return lines


def _judge_global(q: Quantity, diff: torch.Tensor, low_diff: torch.Tensor, factor: float, atol: float) -> Verdict:
    """FlashAttention's exact rule: one maximum over the whole quantity."""
    error = diff.max().item() if diff.numel() else 0.0
    # a NaN in the baseline makes the bound NaN, as in FlashAttention's tests
    low = low_diff.masked_fill(torch.isinf(low_diff) & torch.isnan(q.low.detach().to(torch.float64)), math.nan)
    low_error = low.max().item() if low.numel() else 0.0
    allowed = factor * low_error + atol
    allowance = torch.tensor(allowed, dtype=torch.float64)
    judged = torch.ones((), dtype=torch.bool)
    if error <= allowed:  # False for NaN: a NaN fails
        return Verdict(q, False, allowance, judged, 0, [])
    position = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    dtype = dtype_name(q.dtype)
    lines = [
        f"  {q.name}:",
        f"    max|actual - reference|        = {error:.3e}",
        f"    max|low_precision - reference| = {low_error:.3e} ({dtype}, {q.baseline})",
        f"    allowed: {factor:g} * {low_error:.3e} + {atol:g} = {allowed:.3e}",
        f"    worst position {caller_position(position, q.swap)}: actual {value_at(q.actual, position)}, "
        f"reference {value_at(q.reference, position)}",
    ]
    if q.overflowed is not None and bool(q.overflowed.any()):
        lines.append(f"    the {dtype} baseline overflowed (a score beyond +-{torch.finfo(q.dtype).max:g} even with "
                     f"query * scale first) on {counted(int(q.overflowed.sum()), 'row')}: "
                     f"{fmt_rows(row_indices(q.overflowed, q.swap))}; bound='row' holds them to the other rows' "
                     "allowance")
    return Verdict(q, True, allowance, judged, 0, lines)


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


def report(bound: str, verdicts: list[Verdict], not_judged: torch.Tensor | None, swap: bool) -> CheckReport:
    rows = tuple(row_indices(not_judged, swap)) if not_judged is not None else ()
    return CheckReport(bound, tuple(v.quantity.name for v in verdicts), rows,
                       {v.quantity.name: v.degenerate for v in verdicts})
