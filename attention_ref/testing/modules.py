"""`assert_module_close`: a multi-head module against ``torch.nn.MultiheadAttention`` with its weights.

`_ModuleSpec` reads either kind of module's sizes and parameters under one set of names (`_ORDER`),
`_torch_module` builds the float64 reference holding those weights, `_call_torch` gives a torch
module this package's mask convention in its own, and `_low_precision_module` is the baseline: the
projections and `attention_ref.testing.baseline.low_precision_attention` in the module's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention_ref._validation import require_module_input
from attention_ref.masks import causal_mask, combine_masks
from attention_ref.multihead import MultiHeadAttention
from attention_ref.testing.arguments import check_number, check_options
from attention_ref.testing.baseline import (
    gradients,
    low_precision_attention,
    masked_below_min,
    rows_without_agreed_output,
)
from attention_ref.testing.messages import describe, dtype_name, fmt_rows, row_indices
from attention_ref.testing.verdict import CheckReport, Quantity, judge_all, report


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
    check_options(bound, "bhld", math.e, None)
    for name, number in (("factor", factor), ("atol", atol)):
        check_number(name, number)
    spec = _module_spec(actual_module)
    self_attention = key is None
    key = query if key is None else key
    value = key if value is None else value
    for name, x, width in (("query", query, spec.embed_dim), ("key", key, spec.kdim), ("value", value, spec.vdim)):
        require_module_input(name, x, width, spec.dtype)
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
    kwargs = masked_below_min(mask_kwargs, dtype) if bound == "row" else dict(mask_kwargs)

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

    rows = rows_without_agreed_output(mask_kwargs, reference_out[:, None], dtype) if bound == "row" else None
    not_judged = None if rows is None else rows[:, 0]  # (B, 1, L) -> (B, L)
    quantities = [Quantity("output", actual, reference_out, low, dtype, "query", False, not_judged, overflowed)]
    if with_grads:
        assert grad_output is not None
        if not_judged is not None and bool((grad_output.detach() != 0).any(-1)[not_judged].any()):
            raise ValueError(
                "grad_output must be 0 on the query rows where every key is masked only by float-mask values "
                f"<= finfo({dtype_name(dtype)}).min: {fmt_rows(row_indices(not_judged, False))} (libraries disagree "
                "on those rows' output, so on their gradients); zero it there or pass bound='global'"
            )
        # k_proj's bias adds q_i . b_k to every score of row i: softmax ignores it, so its gradient is 0 up
        # to rounding, pure noise on both sides, and is not judged
        names = [n for n in weights if n != "k_proj.bias"]
        mine, theirs = spec.parameters(), _torch_parameters(torch64)
        got = gradients(actual, leaves + [mine[n][0] for n in names], grad_output.detach(), [mine[n][1] for n in names])
        ref = gradients(reference_out, leaves64 + [theirs[n][0] for n in names], grad_output.detach().to(torch.float64),
                    [theirs[n][1] for n in names])
        base = gradients(low, leaves_low + [params_low[n] for n in names], grad_output.detach().to(dtype))
        input_names = ["dquery"] if self_attention else ["dquery", "dkey", "dvalue"]
        for i, name in enumerate(input_names + ["d" + n for n in names]):
            kind = "query" if i < len(input_names) or name.endswith("weight") else "one"
            quantities.append(Quantity(name, got[i], ref[i], base[i], dtype, kind))
    verdicts, lines = judge_all("assert_module_close", quantities, factor, atol, bound)
    if lines:
        lines.append(
            f"  config: {type(actual_module).__name__}(embed_dim={spec.embed_dim}, num_heads={spec.num_heads}, "
            f"kdim={spec.kdim}, vdim={spec.vdim}, bias={spec.bias}) in "
            f"{'training' if actual_module.training else 'eval'} mode, query {tuple(query.shape)}, "
            + ("self-attention" if self_attention else f"key {tuple(key.shape)}, value {tuple(value.shape)}")
            + f"\n    dtype {dtype_name(dtype)}, factor={factor:g}, atol={atol:g}, bound={bound!r}, "
            f"attn_mask={describe(attn_mask)}, is_causal={is_causal}"
        )
        raise AssertionError("\n".join(lines))
    return report(bound, verdicts, not_judged, False)


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

    out, _, overflowed = low_precision_attention(project(q, "q_proj"), project(k, "k_proj"), project(v, "v_proj"),
                                                  **kwargs)  # (B, H, L, D)
    B, _, L, _ = out.shape
    out = out.transpose(1, 2).reshape(B, L, H * D)  # (B, H, L, D) -> (B, L, H * D)
    return F.linear(out, w["out_proj.weight"], w.get("out_proj.bias")), overflowed.any(dim=1)  # (B, L, d), (B, L)
