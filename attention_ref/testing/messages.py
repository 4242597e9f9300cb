"""How the checkers' messages write what they report: positions and rows, shapes, values, counts, dtypes.

A checker works in ``(..., H, L, E)`` (``layout="bhld"``); with ``layout="blhd"`` its messages swap
the head and sequence entries back, so that a position reads in the caller's layout
(`caller_position`, `caller_shape`, `row_indices`, `swap_row`). Every name here but `_SHOWN` is
shared: by the verdict (`attention_ref.testing.verdict`), the probes and the three checkers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_SHOWN = 4  # row indices printed in a message before "..."


def caller_position(position: tuple[int, ...], swap: bool) -> tuple[int, ...]:
    """A position ``(..., h, i, c)`` in the caller's layout: "blhd" swaps the head and sequence entries."""
    return position[:-3] + (position[-2], position[-3], position[-1]) if swap and len(position) >= 3 else position


def row_indices(rows: torch.Tensor, swap: bool) -> list[tuple[int, ...]]:
    """The indices of the True rows, in the caller's layout."""
    found = [tuple(int(i) for i in idx) for idx in rows.nonzero().tolist()]
    return [swap_row(r) if swap else r for r in found]


def swap_row(row: tuple[int, ...]) -> tuple[int, ...]:
    return row[:-2] + (row[-1], row[-2]) if len(row) >= 2 else row


def caller_shape(shape: Sequence[int], swap: bool) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    return shape[:-3] + (shape[-2], shape[-3], shape[-1]) if swap and len(shape) >= 3 else shape


def value_at(t: torch.Tensor, position: tuple[int, ...]) -> str:
    return f"{t.detach()[position].item():.6g}" if t.dim() else f"{t.item():.6g}"


def fmt_rows(rows: list[tuple[int, ...]]) -> str:
    shown = ", ".join(str(r) for r in rows[:_SHOWN])
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > _SHOWN else "")


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {dtype_name(value.dtype)}"
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)
