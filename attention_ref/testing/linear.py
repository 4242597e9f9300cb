"""`assert_linear_attention_close`: a delta-rule kernel against the float64 recurrence, by the same rule.

Gated DeltaNet and Kimi Delta Attention (`attention_ref.linear`), judged like attention
(`attention_ref.testing.verdict`) with a rounding term of their own; on a failure,
`_linear_probe_lines` names a likely cause (the decay or beta left out, the initial state
ignored, packed sequences run as one, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from attention_ref import linear
from attention_ref.testing.arguments import BOUNDS, check_number
from attention_ref.testing.messages import describe, dtype_name
from attention_ref.testing.rounding import accumulation_roundoff
from attention_ref.testing.verdict import (
    CheckReport,
    Quantity,
    Verdict,
    abs_diff,
    judge_all,
    per_row,
    report,
)

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
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(map(repr, BOUNDS))}, got {bound!r}")
    check_number("factor", factor)
    check_number("atol", atol)
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
    baseline = f"the recurrence, its state in {dtype_name(torch.promote_types(dtype, torch.float32))}"
    # what any order of accumulating L tokens may round away on a row: sqrt(L) u max_r|ref|, u the unit
    # roundoff of the state's dtype (the row's largest entry stands for the sizes of its terms)
    roundoff = math.sqrt(max(q.shape[1], 1)) * accumulation_roundoff(dtype)
    why = "the rounding any order of accumulating the L tokens may make, sqrt(L) * u * max|reference| of the row"
    quantities = [Quantity("output", actual, reference, low, dtype, "token", baseline=baseline,
                            rounding=roundoff * per_row(reference.abs(), "token"), rounding_why=why)]
    if actual_state is not None:
        quantities.append(Quantity("final_state", actual_state, reference_state, low_state, dtype, "state",
                                    baseline=baseline, rounding=roundoff * per_row(reference_state.abs(), "state"),
                                    rounding_why=why))
    verdicts, lines = judge_all("assert_linear_attention_close", quantities, factor, atol, bound)
    if lines:
        if verdicts[0].failed:
            lines += _linear_probe_lines(actual, recurrence, g, beta, settings, verdicts[0])
        lines.append(f"  config: {form.__name__}, q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                     f"g {tuple(g.shape)}, beta {tuple(beta.shape)}\n    dtype {dtype_name(dtype)}, factor={factor:g}, "
                     f"atol={atol:g}, bound={bound!r}, initial_state={describe(initial_state)}, "
                     f"cu_seqlens={describe(cu_seqlens)}, scale={scale}, use_qk_l2norm={use_qk_l2norm}")
        raise AssertionError("\n".join(lines))
    return report(bound, verdicts, None, False)


def _linear_probe_lines(actual: torch.Tensor, recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                        g: torch.Tensor, beta: torch.Tensor, settings: dict[str, Any], verdict: Verdict
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
        if bool((per_row(abs_diff(actual, planted), "token") <= verdict.allowance).all()):
            matched.append(description)
    if matched:
        return [f"  likely cause: {description}" for description in matched]
    return [f"  probes tried, none matched: {', '.join(name for name, _, _ in probes)}"]
