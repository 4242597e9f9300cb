"""Scaled dot-product attention in pure NumPy: the whole algorithm, nothing hidden.

This module imports only NumPy. It has the semantics of
`attention_ref.scaled_dot_product_attention`: a bool mask is ``True``
where a pair takes part, a float mask is added to the scores, and a query row
with no key taking part gives 0. Shapes: ``q (..., L, E)``, ``k (..., S, E)``,
``v (..., S, Ev)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["scaled_dot_product_attention", "softmax"]


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; rows where every score is ``-inf`` give 0.

    Examples:
        >>> softmax(np.array([[0.0, np.log(3.0)], [-np.inf, -np.inf]])).tolist()
        [[0.25, 0.75], [0.0, 0.0]]
    """
    if scores.shape[-1] == 0:
        return scores
    row_max = scores.max(axis=-1, keepdims=True)  # (..., L, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # fully masked row: shift by 0
    exp = np.exp(scores - row_max)  # every entry in [0, 1]: no overflow
    denom = exp.sum(axis=-1, keepdims=True)  # (..., L, 1)
    return exp / np.where(denom > 0, denom, 1.0)


def scaled_dot_product_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> np.ndarray:
    """``softmax(q @ k^T * scale + mask) @ v``.

    Args:
        q: ``(..., L, E)``.
        k: ``(..., S, E)``.
        v: ``(..., S, Ev)``.
        mask: bool (``True`` = takes part) or float (added), broadcastable to ``(..., L, S)``.
        is_causal: keep key ``j`` for query ``i`` only when ``j <= i``.
        scale: defaults to ``1 / sqrt(E)``.

    Returns:
        ``(..., L, Ev)``.

    Raises:
        ValueError: ``q`` and ``k`` with different ``E``, ``k`` and ``v`` with different ``S``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share E (last axis), got q {q.shape} and k {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share S (axis -2), got k {k.shape} and v {v.shape}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., L, E) @ (..., E, S) -> (..., L, S)
    L, S = scores.shape[-2:]
    if is_causal:
        keep = np.arange(S)[None, :] <= np.arange(L)[:, None]  # (L, S)
        scores = np.where(keep, scores, -np.inf)
    if mask is not None:
        mask = np.asarray(mask)
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    return softmax(scores) @ v  # (..., L, S) @ (..., S, Ev) -> (..., L, Ev)
