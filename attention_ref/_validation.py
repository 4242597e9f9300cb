"""Checks of user input at the public boundary.

Every message names the argument and gives the expected and the actual value,
so a user sees what to change without reading a traceback from inside torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch


def fmt_shape(shape: Sequence[int]) -> str:
    """Format a shape as ``(2, 3, 5)`` (a 1-tuple as ``(5,)``)."""
    return str(tuple(int(d) for d in shape))


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_float_tensor(name: str, value: object, min_dims: int, layout: str) -> torch.Tensor:
    """A floating-point tensor of at least ``min_dims`` dimensions shaped like ``layout``."""
    tensor = require_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    if tensor.dim() < min_dims:
        raise ValueError(
            f"{name} must have at least {min_dims} dims {layout}, "
            f"got {tensor.dim()} dims with shape {fmt_shape(tensor.shape)}"
        )
    return tensor


def require_int_tensor(name: str, value: object, layout: str, dims: Sequence[int] = (1,), *,
                       shape: Sequence[int] | None = None, device: torch.device | None = None,
                       device_of: str = "query", lists: bool = False) -> torch.Tensor:
    """The one check of an integer tensor argument (ids, lengths, offsets, tables).

    Args:
        name: the argument's name, for the messages.
        value: what was given.
        layout: its shape in the docs' legend, e.g. ``"(B,)"``, for the messages.
        dims: the numbers of dimensions it may have.
        shape: when given, the exact shape it must have (``layout`` names its axes).
        device: when given, the device it must be on: that of the tensor named ``device_of``.
        lists: accept a list of ints as well, made an int64 tensor (on ``device`` when given).

    Raises:
        TypeError: not a tensor (or a list of ints, with ``lists``), or bool, float or complex.
        ValueError: another number of dims, another shape or another device.
    """
    if lists and isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise TypeError(f"{name} must be an integer tensor {layout} or a list of ints, got {value!r}")
        value = torch.tensor(list(value), dtype=torch.long, device=device)
    tensor = require_tensor(name, value)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor {layout}, got {tensor.dtype}")
    if tensor.dim() not in dims or (shape is not None and tuple(tensor.shape) != tuple(shape)):
        expected = f"{layout} = {fmt_shape(shape)}" if shape is not None else layout
        raise ValueError(f"{name} must have shape {expected}, got shape {fmt_shape(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on the same device as {device_of} ({device}), got {tensor.device}")
    return tensor


def short_list(values: list[int]) -> str:
    """Integers for a message: all of them, or the first and last few."""
    if len(values) <= 12:
        return str(values)
    return f"[{', '.join(map(str, values[:5]))}, ..., {', '.join(map(str, values[-5:]))}]"


def check_cu_seqlens(name: str, cu_seqlens: object, total: int | None = None, total_name: str = "",
                     device: torch.device | None = None) -> torch.Tensor:
    """The one check of cumulative sequence lengths (``cu_seqlens``, ``cu_seqlens_q``, ...): ``(n + 1,)``
    integers (a list of ints too) from 0 (to ``total``, named ``total_name``, when given),
    non-decreasing, on ``device`` when given; returned as int64."""
    cu = require_int_tensor(name, cu_seqlens, "(n + 1,)", lists=True, device=device)
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold n + 1 >= 1 offsets starting at 0, got an empty tensor")
    if cu.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values: the sequences' lengths are read "
                         "from it (the mask depends on them); give it on the CPU or the query's device")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {values[0]} ({short_list(values)})")
    drops = [s for s in range(len(values) - 1) if values[s + 1] < values[s]]
    if drops:
        s = drops[0]
        raise ValueError(
            f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{s}] = {values[s]} "
            f"> {name}[{s + 1}] = {values[s + 1]} ({short_list(values)})"
        )
    if total is not None and values[-1] != total:
        raise ValueError(
            f"{name} must end at the packed length {total_name} = {total}, got {name}[-1] = {values[-1]} "
            f"({short_list(values)})"
        )
    return cu.long()


def require_same_dtype_and_device(**tensors: torch.Tensor) -> None:
    """All tensors share the first one's dtype and device."""
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.device != first.device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first.device}), "
                f"got {tensor.device}"
            )
        if tensor.dtype != first.dtype:
            raise TypeError(
                f"{name} must have the same dtype as {first_name} ({first.dtype}), got {tensor.dtype}"
            )


def require_module_input(name: str, x: object, width: int, dtype: torch.dtype,
                         device: torch.device | None = None) -> torch.Tensor:
    """A module's input (``MultiHeadAttention``'s query, key and value, MLA's hidden states, what
    ``assert_module_close`` feeds a module): a tensor of shape (B, seq, width), batch first, in the
    module's ``dtype`` and, where given, on its ``device``. One message per mistake for every module."""
    x = require_tensor(name, x)
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{name} must have shape (B, seq, {width}), batch first, got {fmt_shape(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on the module's device ({device}), got {x.device}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have the module's dtype ({dtype}), got {x.dtype}")
    return x


def check_scale(scale: float | None) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive finite float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float or None, got {scale}")


def check_probability(name: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__}")
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {p}")


def check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    lowest = 0 if allow_zero else 1
    if value < lowest:
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be a {kind} int, got {value}")
    return value


# --- dense (L, S) allocations: estimated before they are made -------------------------------------

#: Environment variable: the most bytes a dense ``(..., L, S)`` computation may take (an int).
DENSE_LIMIT_ENV = "ATTENTION_REF_MAX_DENSE_BYTES"
#: Copies of the ``(..., L, S)`` scores the math path holds at its peak (scores, masked, weights).
DENSE_COPIES = 3


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` (``None``: the CPU); a ValueError naming ``name`` if torch cannot read it."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                        f"got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} must be a device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from None


def dense_limit(device: torch.device) -> int:
    """The most bytes a dense ``(..., L, S)`` computation may take on ``device``: the value of
    ``ATTENTION_REF_MAX_DENSE_BYTES`` if set, else half the device's memory (the machine's
    physical memory for the CPU)."""
    given = os.environ.get(DENSE_LIMIT_ENV)
    if given:
        try:
            return int(float(given))
        except ValueError:
            raise ValueError(f"{DENSE_LIMIT_ENV} must be a number of bytes, got {given!r}") from None
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): no limit known
        return 2**62


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def check_dense(what: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                copies: int = DENSE_COPIES, *, noun: str = "the (..., L, S) scores",
                instead: str = "backend='tiled' computes attention without forming (L, S)") -> None:
    """Refuse, before allocating, a dense ``shape`` (ending in ``(L, S)``) of ``copies`` tensors
    larger than `dense_limit`, naming the sizes and the path that needs none."""
    if device.type == "meta":
        return
    need = math.prod(shape) * torch.empty((), dtype=dtype).element_size() * copies
    limit = dense_limit(device)
    if need > limit:
        copies_text = f" ({copies} copies at the peak)" if copies > 1 else ""
        raise ValueError(
            f"{what}: {noun} {tuple(shape)} in {dtype} would take {_size(need)}"
            f"{copies_text}, above the limit of {_size(limit)} (half this device's memory, or "
            f"${DENSE_LIMIT_ENV}); {instead}"
        )
