"""The rounding model: per row, what a right kernel may round away, whatever the order of its sums.

`row_rounding` gives `assert_attention_close` each row's ``U_r`` (the rule in `attention_ref.testing`;
its docstring derives it): accumulation in float32 and storage in the inputs' dtype, computed in
float64 from the exact weights. `accumulation_roundoff`, the unit roundoff of the sums a kernel
accumulates, is shared with `assert_linear_attention_close`'s rounding term.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attention_ref._inputs import expand_kv_heads
from attention_ref.functional import attention_weights
from attention_ref.testing.arguments import ATTENTION_KWARGS


def row_rounding(
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
    weights_kwargs = {n: kwargs64[n] for n in ATTENTION_KWARGS if n in kwargs64}
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
    unit = accumulation_roundoff(query.dtype)
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


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the sums a kernel accumulates: float32's for float16, bfloat16 and float32."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps / 2
