"""Argument checks and preparation shared by every attention path (the bottom floor).

`attention_ref.functional` (the math and the dispatch), `attention_ref.backends`
and `attention_ref.tiled` all validate their arguments here, so each error
message is written once and the imports flow one way: this module imports
nothing of the package but `attention_ref._validation` and `attention_ref.mods`.
Shapes use the package legend (``B``, ``H``, ``Hkv``, ``L``, ``S``, ``E``, ``Ev``).
"""

from __future__ import annotations

import math

import torch

from attention_ref import mods
from attention_ref._validation import check_dense  # noqa: F401 - the paths call _inputs.check_dense
from attention_ref._validation import (
    check_scale,
    fmt_shape,
    require_float_tensor,
    require_same_dtype_and_device,
    require_tensor,
)


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        kind = type(value)
        # numpy.bool_ is named "bool" too: name its module, so the message is not "must be a bool, got bool"
        shown = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        hint = f" (pass bool({name}))" if kind.__name__ in ("bool", "bool_") else ""
        raise TypeError(f"{name} must be a bool, got {shown}{hint}")


def check_merge(out_a: object, lse_a: object, out_b: object, lse_b: object) -> None:
    """The arguments of `attention_ref.merge_attention`: two (output, lse) pairs of one shape."""
    named = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if out_a.dim() < 1 or out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape (..., L, Ev), got out_a {fmt_shape(out_a.shape)} "
                         f"and out_b {fmt_shape(out_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:-1]:
            raise ValueError(f"{name} must have shape {fmt_shape(out_a.shape[:-1])} (the outputs' (..., L)), "
                             f"got {fmt_shape(lse.shape)}")
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise ValueError(f"out_a, lse_a, out_b and lse_b must be on one device, got {sorted(map(str, devices))}")


def kv_group(query: torch.Tensor, kv: torch.Tensor, name: str) -> int:
    """Check the heads of grouped-query attention; return how many query heads share a kv head."""
    if query.dim() < 3 or kv.dim() < 3:
        raise ValueError(
            f"enable_gqa=True needs query and {name} with a heads dim (..., H, L|S, E), "
            f"got query {fmt_shape(query.shape)} and {name} {fmt_shape(kv.shape)}"
        )
    q_heads, kv_heads = query.shape[-3], kv.shape[-3]
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"enable_gqa=True needs the query heads ({q_heads}) to be a multiple of the "
            f"{name} heads, got {name} heads = {kv_heads}"
        )
    return q_heads // kv_heads


def expand_kv_heads(query: torch.Tensor, kv: torch.Tensor, name: str) -> torch.Tensor:
    """Repeat the key/value heads of grouped-query attention to match the query heads."""
    # (..., Hkv, S, E) -> (..., H, S, E): each key/value head serves H // Hkv query heads.
    group = kv_group(query, kv, name)
    return kv if group == 1 else kv.repeat_interleave(group, dim=-3)  # H == Hkv: no copy


def check_qk(
    query: object, key: object, value: object | None, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """Validate query/key(/value); return them and the batch shape.

    With ``enable_gqa`` the grouped key/value heads are returned as they are (the
    fused backends take them so; the math path expands them with
    ``expand_kv_heads``), and the batch shape counts them as the query heads.
    """
    query = require_float_tensor("query", query, 2, "(..., L, E)")
    key = require_float_tensor("key", key, 2, "(..., S, E)")
    tensors = {"query": query, "key": key}
    if value is not None:
        value = require_float_tensor("value", value, 2, "(..., S, Ev)")
        tensors["value"] = value
    require_same_dtype_and_device(**tensors)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dim E: query {fmt_shape(query.shape)} "
            f"has E={query.shape[-1]}, key {fmt_shape(key.shape)} has E={key.shape[-1]}"
        )
    if value is not None and value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S (dim -2): key {fmt_shape(key.shape)} "
            f"has S={key.shape[-2]}, value {fmt_shape(value.shape)} has S={value.shape[-2]}"
        )
    check_bool("enable_gqa", enable_gqa)
    if enable_gqa:
        if value is not None and (value.dim() < 3 or value.shape[-3] != key.shape[-3]):
            raise ValueError(
                f"enable_gqa=True needs key and value with the same number of heads (dim -3), "
                f"got key {fmt_shape(key.shape)} and value {fmt_shape(value.shape)}"
            )
        kv_group(query, key, "key")
    leading = [("query", query), ("key", key)] + ([("value", value)] if value is not None else [])
    # Leading dims as the math sees them: grouped key/value heads count as the query heads.
    lead_shapes = [query.shape[:-2]] + [
        t.shape[:-3] + query.shape[-3:-2] if enable_gqa else t.shape[:-2] for _, t in leading[1:]
    ]
    try:
        batch = torch.broadcast_shapes(*lead_shapes)
    except RuntimeError:
        described = ", ".join(f"{n} {fmt_shape(t.shape[:-2])}" for n, t in leading)
        hint = ""
        if not enable_gqa and query.dim() >= 3 and key.dim() >= 3 and key.shape[-3] and query.shape[-3] % key.shape[-3] == 0:
            hint = " (for grouped-query attention with fewer key/value heads, pass enable_gqa=True)"
        raise ValueError(f"the leading (batch) dims must broadcast together, got {described}{hint}") from None
    return query, key, value, tuple(batch)


def check_mask(attn_mask: object, query: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor | None:
    """``attn_mask`` is None, or a bool/float tensor broadcastable to ``target = (..., L, S)``."""
    if attn_mask is None:
        return None
    mask = require_tensor("attn_mask", attn_mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be bool (True = takes part) or floating point (added to the "
            f"scores), got {mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(f"attn_mask must be on the same device as query ({query.device}), got {mask.device}")
    try:
        broadcast = tuple(torch.broadcast_shapes(mask.shape, target))
    except RuntimeError:
        broadcast = None
    if broadcast != target:
        raise ValueError(
            f"attn_mask must be broadcastable to (..., L, S) = {fmt_shape(target)}, "
            f"got shape {fmt_shape(mask.shape)}"
        )
    return mask


def check_mods(score_mod: object, mask_mod: object) -> bool:
    """Check that the mods are None or callables of FlexAttention's signatures; return whether any is given."""
    if score_mod is not None:
        mods.check_mod("score_mod", score_mod, "score")
    if mask_mod is not None:
        mods.check_mod("mask_mod", mask_mod, "mask")
    return score_mod is not None or mask_mod is not None


def prepare(
    query: object,
    key: object,
    value: object | None,
    attn_mask: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
    """Validate every argument; return (query, key, value, mask, scale) ready for the math."""
    check_bool("is_causal", is_causal)
    check_scale(scale)  # type: ignore[arg-type]
    query, key, value, batch = check_qk(query, key, value, enable_gqa)  # type: ignore[arg-type]
    L, S = query.shape[-2], key.shape[-2]
    mask = check_mask(attn_mask, query, (*batch, L, S))
    E = query.shape[-1]
    # E = 0: every score is an empty sum, 0 whatever the scale; 1.0 instead of 1 / sqrt(0) (torch's answer)
    resolved = (1.0 / math.sqrt(E) if E else 1.0) if scale is None else float(scale)  # type: ignore[arg-type]
    compute = torch.promote_types(query.dtype, torch.float32)
    if abs(resolved) > torch.finfo(compute).max:
        raise ValueError(f"scale: {resolved:g} is infinite in {compute}, the dtype the scores are computed in "
                         f"(at most {torch.finfo(compute).max:.4g})")
    return query, key, value, mask, resolved


def check_scores_finite(scores: torch.Tensor, query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
    """Refuse scores ``q . k * scale`` that overflowed the compute dtype from finite inputs (they would
    make NaN weights). Inputs holding inf or NaN are left to propagate them, as torch does.

    Where ``|q . k * scale| <= |scale| * E * max|q| * max|k|`` is far below the dtype's largest value (the usual case),
    no score can have overflowed and the ``(..., L, S)`` scores are not read again: a pass over the
    queries and keys, ``S / E`` times smaller, decides. (The bound leaves half the range for rounding:
    a sum of ``E`` products rounds up by far less than a factor of 2.)"""
    if scores.device.type == "meta" or not scores.numel():
        return
    if query.numel() and key.numel() and query.shape[-1]:
        largest = abs(scale) * query.shape[-1] * float(query.detach().abs().amax()) * float(key.detach().abs().amax())
        if largest <= torch.finfo(scores.dtype).max / 2:  # False when an input holds NaN or inf
            return
    if bool(torch.isfinite(scores).all()):
        return
    if bool(torch.isfinite(query).all()) and bool(torch.isfinite(key).all()):
        raise ValueError(
            f"query, key: the scores q . k * scale overflow {scores.dtype} (finite inputs, infinite scores: "
            f"largest |query| {float(query.detach().abs().max()):.3g}, |key| {float(key.detach().abs().max()):.3g}); "
            f"scale them "
            f"down, or pass float64 inputs"
        )


def check_scores_bounded(query: torch.Tensor, key: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
    """For a path that never holds the scores: refuse inputs whose scores could overflow ``dtype``, by the
    bound ``|scale| * E * max|q| * max|k|`` on every ``|q . k * scale|``."""
    if query.device.type == "meta" or not query.numel() or not key.numel():
        return
    bound = abs(scale) * query.shape[-1] * float(query.detach().abs().max()) * float(key.detach().abs().max())
    if bound > torch.finfo(dtype).max and bool(torch.isfinite(query).all()) and bool(torch.isfinite(key).all()):
        raise ValueError(
            f"query, key: scores q . k * scale could overflow {dtype} (|scale| * E * max|q| * max|k| = "
            f"{bound:.3g} > {torch.finfo(dtype).max:.3g}); scale them down, or pass float64 inputs"
        )


def batch_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> tuple[int, ...]:
    """The broadcast leading dims ``(...)`` of the output, grouped key/value heads counted as ``H``."""
    if enable_gqa:
        H = query.shape[-3]
        return tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-3] + (H,), value.shape[:-3] + (H,)))
    return tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))


def check_self_attention(query: torch.Tensor, key: torch.Tensor, family: str) -> None:
    """``family`` (MoBA, NSA) is causal self-attention: as many keys as queries, or a ValueError."""
    L, S = query.shape[-2], key.shape[-2]
    if L != S:
        raise ValueError(
            f"key must have S = L = {L} keys ({family} is causal self-attention: query t and key t are one "
            f"position), got key {fmt_shape(key.shape)} with S = {S}"
        )
