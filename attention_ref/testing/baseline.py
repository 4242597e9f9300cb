"""What a kernel is compared with: the float64 reference's arguments, the low-precision baseline, float masks.

- `float64_kwargs`: the attention keywords for the float64 reference
  (`attention_ref.functional.scaled_dot_product_attention`);
- `low_precision_attention`: plain attention in the inputs' dtype, nothing upcast (FlashAttention's
  ``upcast=False``), whose error sets each row's allowance;
- `masked_below_min`, `rows_without_agreed_output`, `sinkless`: float-mask values at or below
  ``finfo(dtype).min`` count as masked, and the rows they alone empty have no agreed output;
- `gradients`: the backward of any side, for the gradients judged.

Shared by `assert_attention_close` and `assert_module_close` (whose baseline runs
`low_precision_attention` on the projected heads); the probes use `float64_kwargs` and `sinkless`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_ref import mods
from attention_ref._inputs import expand_kv_heads
from attention_ref.masks import causal_mask


def low_precision_attention(
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


def sinkless(sinks: torch.Tensor, rows_dim: int) -> torch.Tensor:
    """Bool, broadcastable to rows of ``rows_dim`` dims ``(..., H, L)``: True where no finite sink joins the row."""
    no_sink = ~torch.isfinite(sinks)
    return no_sink.reshape(-1, 1) if sinks.dim() == 1 and rows_dim >= 2 else no_sink  # (H,) -> (H, 1)


def masked_below_min(kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``kwargs`` with a float ``attn_mask``'s values ``<= finfo(dtype).min`` set to ``-inf``."""
    mask = kwargs.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return dict(kwargs)
    lowest = torch.finfo(dtype).min
    return dict(kwargs, attn_mask=mask.masked_fill(mask.to(torch.float64) <= lowest, float("-inf")))


def rows_without_agreed_output(
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
        rows = rows & sinkless(sinks, output.dim() - 1)
    rows = rows.expand(*batch, L) if len(batch) else rows.expand(L)
    return rows if bool(rows.any()) else None


def gradients(output: torch.Tensor, wrt: Sequence[torch.Tensor], grad_output: torch.Tensor,
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


def float64_kwargs(kwargs: dict[str, Any], with_grads: bool) -> dict[str, Any]:
    """The attention kwargs for the float64 reference: float mask and sinks in float64."""
    out = dict(kwargs)
    mask = out.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        out["attn_mask"] = mask.detach().to(torch.float64)
    sinks = out.get("sinks")
    if isinstance(sinks, torch.Tensor):
        out["sinks"] = sinks.detach().to(torch.float64).requires_grad_(with_grads)
    return out
