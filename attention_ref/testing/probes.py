"""Probes: which planted bug would the output match?

When `assert_attention_close` fails an output, `probe_lines` recomputes the reference in float64 with
one planted bug at a time (the boolean mask inverted, the other causal alignment, ``scale = 1`` or
``1/E`` or the default instead of a given one, a transposed layout, GQA heads in ``repeat`` order)
and names each one the output passes under the same row allowances; `empty_row_lines` says when every
failing row is one no key takes part in. The linear check's probes live beside it
(`attention_ref.testing.linear`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from attention_ref._inputs import expand_kv_heads
from attention_ref.functional import attention_weights, scaled_dot_product_attention
from attention_ref.masks import combine_masks
from attention_ref.testing.arguments import ATTENTION_KWARGS
from attention_ref.testing.baseline import float64_kwargs, sinkless
from attention_ref.testing.messages import counted, fmt_rows, row_indices
from attention_ref.testing.verdict import Verdict, abs_diff, per_row


def empty_row_lines(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, actual: torch.Tensor,
                     kwargs64: dict[str, Any], verdict: Verdict, swap: bool) -> list[str]:
    """A line when every failing output row is a row no key takes part in (and no sink): conventions differ there."""
    q, k, v = (t.detach().to(torch.float64) for t in (query, key, value))
    weights_kwargs = {n: kwargs64[n] for n in ATTENTION_KWARGS if n in kwargs64 and n != "sinks"}
    P = attention_weights(q, k, **weights_kwargs)  # (..., H, L, S)
    empty = P.sum(-1) == 0  # (..., H, L)
    sinks = kwargs64.get("sinks")
    if sinks is not None:  # a finite sink takes the whole row: output 0 in every convention
        empty = empty & sinkless(sinks.detach(), empty.dim())
    error = per_row(abs_diff(actual, verdict.quantity.reference), "query")
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
    return [f"  the failing rows are {every}query rows no key takes part in ({counted(int(empty.sum()), 'such row')}: "
            f"{fmt_rows(row_indices(empty, swap))}): the reference gives 0 there, as FlashAttention and "
            f"torch's SDPA do; this kernel gives {gives}. Check the mask or causal alignment that empties them, "
            "or mask them out of the comparison"]


def probe_lines(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, actual: torch.Tensor,
                 kwargs: dict[str, Any], verdict: Verdict) -> list[str]:
    """``likely cause: ...`` for each planted bug under which the output passes its row allowances."""
    tried, matched = [], []
    for name, description, make in _probes(query, key, value, kwargs):
        tried.append(name)
        probe = make()
        error = per_row(abs_diff(actual, probe), "query")
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
                                                **float64_kwargs({**kwargs, **changes}, False))

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
