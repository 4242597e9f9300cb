"""The options the checkers share, and their checks.

`ATTENTION_KWARGS`, the attention keywords a kernel may have used, is shared by
`assert_attention_close` (which refuses any other), the rounding model, the probes and the
conformance runner (which asks whether the checker takes ``sinks=``); `BOUNDS`,
`check_number` (``factor``, ``atol``) and `check_options` (``bound``, ``layout``, ``lse_base``) by
the checkers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ATTENTION_KWARGS = ("attn_mask", "is_causal", "scale", "enable_gqa", "score_mod", "mask_mod", "sinks")
BOUNDS = ("row", "global")
_LAYOUTS = ("bhld", "blhd")


def check_number(name: str, number: Any) -> None:
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(number).__name__}")
    bad = number <= 0 if name == "factor" else number < 0
    if not math.isfinite(number) or bad:
        raise ValueError(f"{name} must be finite and {'> 0' if name == 'factor' else '>= 0'}, got {number}")


def check_options(bound: Any, layout: Any, lse_base: Any, actual_lse: Any) -> None:
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(map(repr, BOUNDS))}, got {bound!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, _LAYOUTS))}, got {layout!r}")
    if isinstance(lse_base, bool) or not isinstance(lse_base, (int, float)):
        raise TypeError(f"lse_base must be a real number, got {type(lse_base).__name__}")
    if not math.isfinite(lse_base) or lse_base <= 1:
        raise ValueError(f"lse_base must be finite and > 1 (math.e or 2), got {lse_base}")
    if actual_lse is not None and (not isinstance(actual_lse, torch.Tensor) or not actual_lse.is_floating_point()):
        raise TypeError(f"actual_lse must be a floating-point torch.Tensor, got {type(actual_lse).__name__}")
