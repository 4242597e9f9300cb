"""Plots of attention weights: heatmaps, per-head grids, inline SVG, and the interactive explorer.

The figures need the optional ``matplotlib`` extra (``pip install
"attention-ref[plot]"``); it is imported on first use, so importing this module
(and [`explorer_html`][attention_ref.viz.explorer_html] and `map_slider_html`, which write plain
HTML) works without it.

Figures are `Figure` objects made without ``pyplot``:
making one changes no global state and leaves the backend you chose alone.
They have an opaque white background and dark text, so they read the same on
a light or a dark page, and the colour scale always runs from 0 to 1, so two
plots of weights can be compared by eye. Each colour bar says what it
measures: "attention weight", or "mask (1 = takes part)" for a boolean mask.

Every figure is at most 7 inches (672 CSS px) wide, the width of the
documentation's text column, and its text is at least 9 pt: embedded with
[`to_svg`][attention_ref.viz.to_svg], it is shown at its own size and its
labels render at 12 px or more. Cells too small for a label each get a label
every 2nd (3rd, ...) row or column; a grid of heads puts its labels on the
outer panels only.

Shapes use the package legend: ``H`` heads, ``L`` query length, ``S`` key length.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import io
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - only for the annotations
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["explorer_html", "head_grid", "head_grid_html", "heatmap", "heatmaps", "map_slider_html", "to_svg"]

_INSTALL_HINT = 'pip install "attention-ref[plot]" (or pip install matplotlib)'

# One look for every figure, whatever the user's matplotlib style: opaque white
# background and dark text (readable on Material's light and dark schemes), text
# kept as text in the SVG, and ids in the SVG derived from a fixed salt so that
# rebuilding the site gives byte-identical output.
_STYLE = {
    "figure.facecolor": "white",
    "figure.edgecolor": "white",
    "savefig.facecolor": "white",
    "savefig.edgecolor": "white",
    "savefig.transparent": False,
    "axes.facecolor": "white",
    "axes.edgecolor": "#333333",
    "axes.labelcolor": "#1a1a1a",
    "axes.titlecolor": "#1a1a1a",
    "text.color": "#1a1a1a",
    "xtick.color": "#333333",
    "ytick.color": "#333333",
    "xtick.labelcolor": "#1a1a1a",
    "ytick.labelcolor": "#1a1a1a",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],  # the SVG names it, then falls back to sans-serif
    # No text under 9 pt (12 CSS px at the figure's own size; see _MAX_WIDTH).
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "figure.titlesize": 12,
    "svg.fonttype": "none",
    "svg.hashsalt": "attention_ref",
    "image.interpolation": "none",  # vector backends embed the raw L x S pixels
}

# Figure geometry, in inches. matplotlib's SVG maps 1 in to 72 pt = 96 CSS px, and the site
# shows an SVG at its own size unless it is wider than the content column (690-750 px at a
# 1280 px viewport), where `max-width: 100%` scales it down, text included. A figure at most
# _MAX_WIDTH wide is never scaled there, so its 9 pt tick labels render at 12 px.
_MAX_WIDTH = 7.0  # 672 px
_MAX_HEIGHT = 10.0
_CHAR = 0.075  # the width of one character of a 9 pt tick label
_MIN_CELL = 0.15  # closer than this, 9 pt tick labels touch: label every 2nd, 3rd, ... cell
_CELL = 0.36  # a cell's side when there is room
_ANNOTATED_CELL = 0.42  # room for "0.25" in 9 pt
_COLORBAR = 0.85  # a colorbar with its tick labels and its label
_BAR = 0.14  # the colour bar itself
_GAP = 0.2  # between panels
_MASK_LABEL = "mask (1 = takes part)"
_WEIGHT_LABEL = "attention weight"


def _matplotlib() -> Any:
    """Import matplotlib, or raise an ImportError that says how to install it."""
    try:
        import matplotlib
        import matplotlib.figure
    except ImportError as error:
        raise ImportError(f"attention_ref.viz needs matplotlib for figures: {_INSTALL_HINT}") from error
    return matplotlib


@contextlib.contextmanager
def _style() -> Iterator[Any]:
    mpl = _matplotlib()
    with mpl.rc_context(_STYLE):
        yield mpl


def _as_array(name: str, weights: object, ndim: int, layout: str) -> np.ndarray:
    """``weights`` (torch tensor, NumPy array or nested lists) as a float64 array of ``ndim`` dims in [0, 1]."""
    if hasattr(weights, "detach"):  # a torch.Tensor, without importing torch here
        weights = weights.detach().cpu().float().numpy()
    try:
        array = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a tensor or array of numbers, got {type(weights).__name__}") from error
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got {array.ndim} dims with shape {array.shape}")
    if array.size and not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, got NaN or inf values")
    if array.size and (array.min() < -1e-6 or array.max() > 1 + 1e-6):
        raise ValueError(
            f"{name} must be attention weights in [0, 1], got values in [{array.min():.4g}, {array.max():.4g}]"
        )
    return np.clip(array, 0.0, 1.0)


def _labels(name: str, labels: Sequence[object] | None, expected: int, axis: str) -> list[str] | None:
    if labels is None:
        return None
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(f"{name} must be a sequence of labels (e.g. a list of tokens), got {type(labels).__name__}")
    if len(labels) != expected:
        raise ValueError(f"{name} must have one label per {axis} ({expected}), got {len(labels)}")
    return [str(label) for label in labels]


def _resolve_labels(
    shape: tuple[int, ...], query_labels: Sequence[object] | None, key_labels: Sequence[object] | None
) -> tuple[list[str] | None, list[str] | None]:
    L, S = shape[-2], shape[-1]
    queries = _labels("query_labels", query_labels, L, "query row L")
    if key_labels is None and queries is not None and L == S:
        return queries, queries  # self-attention: the same tokens on both axes
    return queries, _labels("key_labels", key_labels, S, "key column S")


def _is_mask(values: object) -> bool:
    """Whether ``values`` holds booleans (a mask), looked at before it becomes floats."""
    dtype = getattr(values, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(values).dtype
        except (TypeError, ValueError):  # not numbers: _as_array says so
            return False
    return str(dtype) in ("bool", "torch.bool")


def _colorbar_label(name: str, label: object, mask: bool) -> str:
    """The colorbar's label: ``label``, or what the values are when it is None."""
    if label is None:
        return _MASK_LABEL if mask else _WEIGHT_LABEL
    if not isinstance(label, str):
        raise TypeError(f"{name} must be a str or None, got {type(label).__name__}")
    return label


def _rotated(keys: list[str] | None) -> bool:
    """Key labels longer than 2 characters are written vertically."""
    return keys is not None and max(map(len, keys), default=0) > 2


def _margins(queries: list[str] | None, keys: list[str] | None, L: int, S: int) -> tuple[float, float]:
    """The inches the query labels take on the left and the key labels below."""
    longest_query = max(map(len, queries), default=1) if queries is not None else len(str(L - 1))
    longest_key = max(map(len, keys), default=1) if keys is not None else len(str(S - 1))
    left = 0.45 + _CHAR * longest_query
    bottom = 0.4 + (_CHAR * longest_key if _rotated(keys) else 0.17)
    return left, bottom


def _steps(cell_h: float, cell_w: float, keys: list[str] | None, S: int) -> tuple[int, int]:
    """Label every ``step``-th row and column, so that labels of cells this small do not touch."""
    longest_key = max(map(len, keys), default=1) if keys is not None else len(str(S - 1))
    need_w = _MIN_CELL if _rotated(keys) else max(_MIN_CELL, _CHAR * longest_key + 0.06)  # side by side

    def step(need: float, cell: float) -> int:
        return max(1, math.ceil(need / max(cell, 1e-3) - 1e-9))

    return step(_MIN_CELL, cell_h), step(need_w, cell_w)


def _labelled(n: int, step: int) -> list[int]:
    """Every ``step``-th of ``n`` indices from 0, the last index in place of the last of them: still at least
    ``step`` apart, and the first and the last (a sentence's ``[CLS]`` and ``[SEP]``) labelled."""
    ticks = list(range(0, n, step))
    if len(ticks) > 1:
        ticks[-1] = n - 1  # more than step after the one before it
    return ticks


def _draw(
    ax: Axes,
    weights: np.ndarray,
    queries: list[str] | None,
    keys: list[str] | None,
    cmap: str,
    annotate: bool,
    *,
    mask: bool = False,
    step: tuple[int, int] = (1, 1),
) -> Any:
    """Draw one ``(L, S)`` heatmap on ``ax``; return the image (for a colorbar).

    ``step`` labels every ``step[0]``-th row and ``step[1]``-th column (the
    cells are too small for every label), the last one always (a sentence's
    ``[SEP]``); ``mask`` writes annotations as 0/1.
    """
    L, S = weights.shape
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    rows, cols = _labelled(L, step[0]), _labelled(S, step[1])
    ax.set_xticks(cols, [keys[j] if keys is not None else str(j) for j in cols])
    ax.set_yticks(rows, [queries[i] if queries is not None else str(i) for i in rows])
    ax.tick_params(axis="x", labelrotation=90 if _rotated(keys) else 0)
    if annotate:
        for i in range(L):
            for j in range(S):
                r, g, b, _ = image.cmap(image.norm(weights[i, j]))
                dark = 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
                text = str(round(weights[i, j])) if mask else f"{weights[i, j]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    return image


def _colorbar(
    fig: Figure, image: Any, ax: Any, label: str, mask: bool, size: tuple[float, float] | None, **kwargs: Any
) -> None:
    """Add a colorbar that says what it measures; a mask's has the ticks 0 and 1 only.

    ``size`` is (width, height) in inches of the axes it stands beside, to make
    the bar ``_BAR`` thick, or None for matplotlib's default (the caller's axes).
    """
    if size is not None:
        width, height = size
        kwargs.update(fraction=_BAR / max(width, _BAR), aspect=max(height * kwargs.get("shrink", 1.0) / _BAR, 1.0))
    bar = fig.colorbar(image, ax=ax, label=label, **kwargs)
    if mask:
        bar.set_ticks([0.0, 1.0], labels=["0", "1"])


def _min_plot_height(label: str) -> float:
    """Inches a colorbar needs to hold its label (10 pt, written along it)."""
    return 0.085 * len(label) + 0.1


def heatmap(
    weights: object,
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    cmap: str = "viridis",
    annotate: bool = False,
    colorbar_label: str | None = None,
) -> Figure:
    """A heatmap of one attention matrix: queries down, keys across, a 0-1 colorbar.

    The figure is at most 7 inches wide (672 px, the documentation's text
    column), with tick labels in 9 pt: a web page shows it at its own size,
    and the text stays readable. When the cells get too small for a label
    each, every 2nd (3rd, ...) row and column is labelled.

    Args:
        weights: ``(L, S)`` values in ``[0, 1]`` (torch tensor, NumPy array or
            nested lists): attention weights, row ``i`` is where query ``i``
            attends; or a boolean mask (``True`` = the pair takes part).
        query_labels: ``L`` labels for the rows (e.g. the query tokens).
        key_labels: ``S`` labels for the columns. Defaults to ``query_labels``
            when ``L == S`` (self-attention), else to the column indices.
        ax: draw into this axes (its figure is returned) instead of a new figure.
        title: the axes title.
        cmap: a matplotlib colormap name.
        annotate: write each value in its cell (weights with 2 decimals, a
            boolean mask as 0 or 1); for small matrices.
        colorbar_label: what the colours measure. Defaults to
            ``"attention weight"``, or ``"mask (1 = takes part)"`` when
            ``weights`` is boolean.

    Returns:
        The `Figure`; pass it to [`to_svg`][attention_ref.viz.to_svg] to embed it.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``weights`` is not 2-D or not in ``[0, 1]``; a label list of
            the wrong length.
        TypeError: labels that are not a sequence; a ``colorbar_label`` that is
            not a str.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights, causal_mask
        >>> from attention_ref.viz import heatmap, to_svg
        >>> w = attention_weights(torch.randn(3, 4), torch.randn(3, 4))  # (L, S) = (3, 3)
        >>> fig = heatmap(w, ["the", "cat", "sat"], title="one head")
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['the', 'cat', 'sat']
        >>> fig.axes[1].get_ylabel()  # the colorbar
        'attention weight'
        >>> heatmap(causal_mask(3), annotate=True).axes[1].get_ylabel()  # a bool mask
        'mask (1 = takes part)'
        >>> to_svg(fig).startswith("<svg")
        True
    """
    mask = _is_mask(weights)
    array = _as_array("weights", weights, 2, "(L, S)")
    label = _colorbar_label("colorbar_label", colorbar_label, mask)
    queries, keys = _resolve_labels(array.shape, query_labels, key_labels)
    L, S = array.shape
    with _style() as mpl:
        step, size = (1, 1), None
        if ax is None:
            left, bottom = _margins(queries, keys, L, S)
            top = 0.45 if title else 0.15
            cell = _ANNOTATED_CELL if annotate else _CELL
            cell_w = min(cell, (_MAX_WIDTH - left - _COLORBAR) / max(S, 1))
            cell_h = min(cell, (_MAX_HEIGHT - bottom - top) / max(L, 1))
            width = left + S * cell_w + _COLORBAR
            if title:  # room for the title (11 pt)
                width = max(width, min(_MAX_WIDTH, 0.095 * len(title) + 0.3))
            plot_h = max(L * cell_h, _min_plot_height(label))
            height = bottom + plot_h + top
            fig = mpl.figure.Figure(figsize=(width, height), layout="constrained")
            ax = fig.add_subplot()
            step, size = _steps(cell_h, cell_w, keys, S), (S * cell_w, plot_h)
        else:
            fig = ax.figure
        image = _draw(ax, array, queries, keys, cmap, annotate, mask=mask, step=step)
        if title is not None:
            ax.set_title(title)
        _colorbar(fig, image, ax, label, mask, size)
    return fig


def heatmaps(
    matrices: Sequence[object],
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    titles: Sequence[str] | None = None,
    colorbar_labels: str | Sequence[str | None] | None = None,
    annotate: bool = False,
    cmap: str = "viridis",
) -> Figure:
    """Several ``(L, S)`` matrices side by side, each with a colorbar that says what it measures.

    Made to compare a mask with the weights it produces, or the weights of two
    variants, cell by cell: the panels share their labels (shown on the first
    panel), and each has its own colorbar, labelled like
    [`heatmap`][attention_ref.viz.heatmap]'s. The figure is at most 7 inches
    wide; put two or three small matrices in one.

    Args:
        matrices: a list of ``(L, S)`` matrices of the same shape, each weights
            in ``[0, 1]`` or a boolean mask.
        query_labels: ``L`` row labels.
        key_labels: ``S`` column labels; defaults to ``query_labels`` when ``L == S``.
        titles: one title per matrix.
        colorbar_labels: one label for all colorbars, or one per matrix (``None``
            items take the default: ``"attention weight"``, or
            ``"mask (1 = takes part)"`` for a boolean matrix).
        annotate: write each value in its cell (2 decimals, a mask as 0 or 1).
        cmap: a matplotlib colormap name.

    Returns:
        The `Figure`: one panel and one colorbar per matrix.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``matrices`` is not a list (or tuple); a colorbar label that
            is not a str.
        ValueError: no matrix, a matrix that is not 2-D or not in ``[0, 1]``,
            matrices of different shapes, ``titles`` or ``colorbar_labels`` of
            the wrong length, label lists of the wrong length.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights, causal_mask
        >>> from attention_ref.viz import heatmaps
        >>> keep = causal_mask(3)  # (L, S) bool, True = takes part
        >>> w = attention_weights(torch.randn(3, 4), torch.randn(3, 4), keep)
        >>> fig = heatmaps([keep, w], ["a", "b", "c"], titles=["mask", "weights"], annotate=True)
        >>> [ax.get_title() for ax in fig.axes if ax.get_label() != "<colorbar>"]
        ['mask', 'weights']
        >>> [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]
        ['mask (1 = takes part)', 'attention weight']
    """
    if isinstance(matrices, str) or not isinstance(matrices, Sequence):
        raise TypeError(f"matrices must be a list of (L, S) matrices, got {type(matrices).__name__}")
    n = len(matrices)
    if n == 0:
        raise ValueError("matrices must hold at least one matrix, got none")
    masks = [_is_mask(m) for m in matrices]
    arrays = [_as_array(f"matrices[{i}]", m, 2, "(L, S)") for i, m in enumerate(matrices)]
    shapes = [a.shape for a in arrays]
    if len(set(shapes)) != 1:
        raise ValueError(f"matrices must all have the same shape (L, S), got {shapes}")
    if titles is not None and (isinstance(titles, str) or len(titles) != n):
        got = "a str" if isinstance(titles, str) else len(titles)
        raise ValueError(f"titles must have one title per matrix ({n}), got {got}")
    if colorbar_labels is None or isinstance(colorbar_labels, str):
        given: Sequence[object] = [colorbar_labels] * n
    elif isinstance(colorbar_labels, Sequence) and len(colorbar_labels) == n:
        given = colorbar_labels
    else:
        got = len(colorbar_labels) if isinstance(colorbar_labels, Sequence) else type(colorbar_labels).__name__
        raise ValueError(f"colorbar_labels must be a str or one label per matrix ({n}), got {got}")
    labels = [_colorbar_label(f"colorbar_labels[{i}]", g, m) for i, (g, m) in enumerate(zip(given, masks))]
    queries, keys = _resolve_labels(shapes[0], query_labels, key_labels)
    L, S = shapes[0]
    with _style() as mpl:
        left, bottom = _margins(queries, keys, L, S)
        top = 0.45 if titles is not None else 0.15
        cell = _ANNOTATED_CELL if annotate else _CELL
        cell_w = min(cell, (_MAX_WIDTH - left - n * _COLORBAR - _GAP * (n - 1)) / (n * max(S, 1)))
        cell_h = min(cell, (_MAX_HEIGHT - bottom - top) / max(L, 1))
        width = left + n * (S * cell_w + _COLORBAR) + _GAP * (n - 1)
        plot_h = max(L * cell_h, *map(_min_plot_height, labels))
        height = bottom + plot_h + top
        fig = mpl.figure.Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(1, n, squeeze=False)[0]
        step = _steps(cell_h, cell_w, keys, S)
        for k, ax in enumerate(axes):
            image = _draw(ax, arrays[k], queries, keys, cmap, annotate, mask=masks[k], step=step)
            if titles is not None:
                ax.set_title(str(titles[k]))
            if k:  # the query labels on the first panel only
                ax.set_ylabel("")
                ax.tick_params(axis="y", labelleft=False)
            _colorbar(fig, image, ax, labels[k], masks[k], (S * cell_w, plot_h))
    return fig


def _head_grid_inputs(weights: object, query_labels: Sequence[object] | None, key_labels: Sequence[object] | None,
                      ncols: int | None, head_names: Sequence[str] | None, colorbar_label: str | None
                      ) -> tuple[bool, np.ndarray, str, list[str], list[str] | None, list[str] | None]:
    """The checked arguments `head_grid` and `head_grid_html` share: whether ``weights`` is a
    mask, the ``(H, L, S)`` array, the colour bar's label, the head names, the query and key labels."""
    mask = _is_mask(weights)
    array = _as_array("weights", weights, 3, "(H, L, S)")
    H = array.shape[0]
    if H == 0:
        raise ValueError(f"weights must hold at least one head, got shape {array.shape}")
    if ncols is not None and (isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1):
        raise ValueError(f"ncols must be a positive int or None, got {ncols!r}")
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"head_names must have one name per head ({H}), got {len(head_names)}")
    label = _colorbar_label("colorbar_label", colorbar_label, mask)
    names = [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)]
    queries, keys = _resolve_labels(array.shape, query_labels, key_labels)
    return mask, array, label, names, queries, keys


def head_grid(
    weights: object,
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    ncols: int | None = None,
    title: str | None = None,
    head_names: Sequence[str] | None = None,
    cmap: str = "viridis",
    colorbar_label: str | None = None,
) -> Figure:
    """One heatmap per head, in a grid, on one shared 0-1 colour scale.

    The figure is at most 7 inches wide (672 px, the documentation's text
    column), with 9 pt tick labels, so a web page shows it at its own size.
    The labels sit on the outer panels only: tokens down the left column and
    across the bottom panel of each column. By default a row holds as many
    heads (at most 4) as fit with a readable label per row and column.

    Args:
        weights: ``(H, L, S)`` weights in ``[0, 1]``, e.g. one batch element of
            ``MultiHeadAttention(..., return_weights=True, average_weights=False)``.
        query_labels: ``L`` row labels.
        key_labels: ``S`` column labels; defaults to ``query_labels`` when ``L == S``.
        ncols: heads per row. Defaults to the most (up to ``min(H, 4)``) whose
            cells leave room for a label each: 4 for 5 tokens, 3 for 10, 1 for 30.
        title: a title over the whole grid.
        head_names: ``H`` panel titles; defaults to ``head 0``, ``head 1``, ...
        cmap: a matplotlib colormap name.
        colorbar_label: what the colours measure; defaults to
            ``"attention weight"`` (``"mask (1 = takes part)"`` for booleans).

    Returns:
        The `Figure`, with one colorbar for all panels.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``weights`` not 3-D or not in ``[0, 1]``, ``H == 0``, a bad
            ``ncols``, label lists of the wrong length.
        TypeError: a ``colorbar_label`` that is not a str.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import head_grid
        >>> w = attention_weights(torch.randn(4, 5, 8), torch.randn(4, 5, 8))  # (H, L, S) = (4, 5, 5)
        >>> fig = head_grid(w, list("abcde"), ncols=2)
        >>> len(fig.axes)  # 4 heatmaps and 1 shared colorbar
        5
        >>> print(fig.get_size_inches()[0] <= 7.0)  # inches: fits the documentation's column
        True
    """
    mask, array, label, names, queries, keys = _head_grid_inputs(
        weights, query_labels, key_labels, ncols, head_names, colorbar_label)
    H, L, S = array.shape
    left, bottom = _margins(queries, keys, L, S)

    def cell_for(columns: int) -> float:  # the widest cell that fits `columns` panels
        return min(_CELL, (_MAX_WIDTH - left - _COLORBAR - _GAP * (columns - 1)) / (columns * max(S, 1)))

    if ncols is None:
        fits = [c for c in range(1, min(H, 4) + 1) if cell_for(c) >= _MIN_CELL]
        ncols = max(fits, default=1)
    ncols = min(ncols, H)
    nrows = -(-H // ncols)
    title_row, top = 0.3, (0.45 if title is not None else 0.1)
    cell_w = cell_for(ncols)
    room_h = _MAX_HEIGHT - bottom - top - nrows * title_row - _GAP * (nrows - 1)
    cell_h = max(min(cell_w, room_h / (nrows * max(L, 1))), 0.02)
    width = left + ncols * S * cell_w + _GAP * (ncols - 1) + _COLORBAR
    plots = max(nrows * L * cell_h + (nrows - 1) * (_GAP + title_row), _min_plot_height(label))
    height = top + title_row + plots + bottom
    with _style() as mpl:
        fig = mpl.figure.Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
        step = _steps(cell_h, cell_w, keys, S)
        image = None
        for h, ax in enumerate(axes.flat):
            if h >= H:
                ax.set_axis_off()
                continue
            image = _draw(ax, array[h], queries, keys, cmap, False, mask=mask, step=step)
            ax.set_title(names[h])
            if h % ncols:  # the query labels on the first column only
                ax.set_ylabel("")
                ax.tick_params(axis="y", labelleft=False)
            if h + ncols < H:  # the key labels on the lowest panel of each column only
                ax.set_xlabel("")
                ax.tick_params(axis="x", labelbottom=False)
        panels = (width - left - _COLORBAR, plots)
        _colorbar(fig, image, axes.ravel().tolist(), label, mask, panels, shrink=0.9)
        if title is not None:
            fig.suptitle(title)
    return fig


_SVG_START = re.compile(r"<svg\b")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


# The figure's own colours ("chrome": background, text, axes lines), each drawn through a CSS variable with
# the light colour as its fallback: the site's dark scheme sets the variables (docs/stylesheets/extra.css),
# anywhere else (a notebook, a file) the figure stays as it is. Data colours (cells, lines, annotations
# on cells in black or white) are other colours and stay.
_CHROME_TEXT, _CHROME_LINE, _CHROME_BACKGROUND = "#1a1a1a", "#333333", "#ffffff"
_THEMED = (
    # text, and mathtext drawn as glyph paths: only the chrome is in this colour
    (re.compile(r"(fill: )#1a1a1a"), r"\1var(--ar-figure-text, #1a1a1a)"),
    (re.compile(r"((?:stroke|fill): )#333333"), r"\1var(--ar-figure-line, #333333)"),
    # only the background patches of the figure, its axes and legends, never a data cell
    (re.compile(r'(<g id="(?:patch|legend)_\d+">\s*<path\b[^>]*?style="fill: )#ffffff'),
     r"\1var(--ar-figure-background, #ffffff)"),
)


def _themed(svg: str) -> str:
    """The chrome colours of matplotlib's SVG drawn through the site's CSS variables (see `_THEMED`)."""
    for pattern, replacement in _THEMED:
        svg = pattern.sub(replacement, svg)
    return svg


def _chrome(figure: Figure) -> None:
    """Give a figure made outside this module's style the chrome colours, where it has matplotlib's defaults.

    Titles, axis labels, tick labels, spines, ticks, legend text and colourbar text in pure black
    become `_CHROME_TEXT` / `_CHROME_LINE`; white figure, axes and legend backgrounds `_CHROME_BACKGROUND`.
    Text placed with ``ax.text`` becomes chrome too on a chart without cells (a bar's value); on a
    heatmap (an image or a mesh) it keeps its colour, chosen against the cell it sits on.
    """
    mpl = _matplotlib()
    to_rgba = mpl.colors.to_rgba
    black, white = to_rgba("black"), to_rgba("white")

    def text(t: Any) -> None:
        if to_rgba(t.get_color()) == black:
            t.set_color(_CHROME_TEXT)

    if to_rgba(figure.get_facecolor()) == white:
        figure.set_facecolor(_CHROME_BACKGROUND)
    for t in figure.texts + ([figure._suptitle] if getattr(figure, "_suptitle", None) else []):
        text(t)
    for ax in figure.axes:
        for t in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label,
                  *ax.get_xticklabels(), *ax.get_yticklabels()):
            text(t)
        for spine in ax.spines.values():
            if to_rgba(spine.get_edgecolor()) == black:
                spine.set_edgecolor(_CHROME_LINE)
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            ticks = axis.get_major_ticks()
            if ticks and to_rgba(ticks[0].tick1line.get_markeredgecolor()) == black:
                ax.tick_params(axis=name, which="both", color=_CHROME_LINE)
        legend = ax.get_legend()
        if legend is not None:
            for t in legend.get_texts() + [legend.get_title()]:
                text(t)
        # text on a chart without cells (a bar's value, a curve's label) sits on the background: chrome;
        # on a heatmap it may sit on a cell, whose colour its own was chosen against: kept
        has_cells = bool(ax.images) or any(isinstance(c, mpl.collections.QuadMesh) for c in ax.collections)
        if not has_cells:
            for t in ax.texts:
                text(t)


def _label(figure: Figure) -> str:
    """A name for screen readers: the figure's title, else its axes' titles, else "figure"."""
    suptitle = getattr(figure, "_suptitle", None)
    titles = [suptitle.get_text()] if suptitle is not None and suptitle.get_text() else [
        ax.get_title() for ax in figure.axes if ax.get_title()]
    return "; ".join(titles) or "figure"


def _caption(caption: object) -> str | None:
    """``caption`` checked: a str (escaped later) or None."""
    if caption is not None and not isinstance(caption, str):
        raise TypeError(f"caption must be a str or None, got {type(caption).__name__}")
    return caption or None


def _svg(figure: Figure, label: str | None = None) -> str:
    """The figure as themed inline ``<svg>`` markup named ``label`` (default: its titles); closes it."""
    mpl = _matplotlib()
    if not isinstance(figure, mpl.figure.Figure):
        raise TypeError(f"figure must be a matplotlib.figure.Figure, got {type(figure).__name__}")
    _chrome(figure)
    label = _label(figure) if label is None else label
    buffer = io.StringIO()
    with _style():
        figure.savefig(buffer, format="svg", metadata={"Date": None}, facecolor="white")
    if "matplotlib.pyplot" in sys.modules:  # a pyplot figure stays open until closed
        sys.modules["matplotlib.pyplot"].close(figure)
    text = buffer.getvalue()
    start = _SVG_START.search(text)
    if start is None:  # pragma: no cover - matplotlib always writes an <svg> element
        raise RuntimeError("matplotlib wrote no <svg> element")
    svg = text[start.start():]
    svg = _COMMENT.sub("", svg)  # matplotlib's <!-- text --> notes: only bytes in a page
    svg = _themed(svg)
    # Scale with the page: keep the viewBox, let CSS size it, but never below the width at which its
    # smallest text renders at _READABLE_PX (a wider figure scrolls in its box on a phone, see
    # extra.css). Named for screen readers by its titles.
    readable = _readable_width(svg)
    svg = _SVG_START.sub(f'<svg class="ar-figure" role="img" aria-label="{html.escape(label)}" '
                         f'style="max-width: 100%; height: auto; --ar-readable-width: {readable}px"', svg, count=1)
    # No indentation and no blank lines: smaller, and safe inside Markdown.
    return "\n".join(line.strip() for line in svg.splitlines() if line.strip()) + "\n"


#: The smallest text a figure may show on screen, in CSS px: a figure is never drawn narrower than the
#: width at which its smallest text renders this big.
_READABLE_PX = 9.0
_FONT_SIZE = re.compile(r"font-size:\s*([0-9.]+)px")
_VIEWBOX = re.compile(r'viewBox="[-0-9.]+ [-0-9.]+ ([0-9.]+) [0-9.]+"')


def _readable_width(svg: str) -> int:
    """The width in CSS px below which ``svg``'s smallest text would render under `_READABLE_PX`.

    matplotlib writes sizes in the viewBox's units (points): text of ``f`` units in a viewBox
    ``w`` units wide renders at ``f * shown / w`` px when the figure is ``shown`` px wide, so
    ``shown >= _READABLE_PX * w / f``. At its own size (``w`` pt = ``4 w / 3`` px) a figure's
    text of 6.75 pt or more is readable already; 0 for a figure without text.

    Examples:
        >>> _readable_width('<svg viewBox="0 0 300 150"><text style="font-size: 9px">a</text></svg>')
        300
        >>> _readable_width('<svg viewBox="0 0 600 150"><text style="font-size: 6px">a</text></svg>')
        900
        >>> _readable_width('<svg viewBox="0 0 600 150"></svg>')
        0
    """
    sizes = [float(size) for size in _FONT_SIZE.findall(svg)]
    box = _VIEWBOX.search(svg)
    if not sizes or box is None:
        return 0
    width = float(box.group(1))
    return math.ceil(_READABLE_PX * width / min(sizes))


def _figure_box(body: str, caption: str | None) -> str:
    """``body`` in a ``<figure class="ar-figure-box">`` with ``caption`` (escaped) as its ``<figcaption>``."""
    figcaption = f"<figcaption>{html.escape(caption)}</figcaption>\n" if caption else ""
    return f'<figure class="ar-figure-box">\n{body}{figcaption}</figure>\n'


def to_svg(figure: Figure, *, caption: str | None = None) -> str:
    """Render a figure as an inline ``<svg>`` element and close the figure.

    The string has no XML prolog or doctype, so it can be printed straight into
    an HTML page (markdown-exec ``html="1"``). It scales down to the width of
    the page. The output is deterministic: ids come from a fixed salt and no
    date is written, so rebuilding a page does not change it. The ``<svg>`` is
    named for screen readers (``role="img"``, ``aria-label``) by the figure's
    title, else its panels' titles.

    Args:
        figure: a matplotlib figure (from [`heatmap`][attention_ref.viz.heatmap],
            [`head_grid`][attention_ref.viz.head_grid] or your own).
        caption: a sentence shown under the figure: the ``<svg>`` then comes
            inside ``<figure class="ar-figure-box">`` with the caption, escaped,
            as its ``<figcaption>``. Without one, the ``<svg>`` alone.

    Returns:
        The ``<svg ...>...</svg>`` markup, or ``<figure ...>...</figure>`` with a caption.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``figure`` is not a matplotlib Figure; ``caption`` is not a str.

    Examples:
        >>> from attention_ref.viz import heatmap, to_svg
        >>> svg = to_svg(heatmap([[0.25, 0.75], [1.0, 0.0]], ["a", "b"]))
        >>> svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        True
        >>> boxed = to_svg(heatmap([[1.0]]), caption="One query, one key: weight 1.")
        >>> boxed.startswith('<figure class="ar-figure-box">')
        True
        >>> boxed.splitlines()[-2:]
        ['<figcaption>One query, one key: weight 1.</figcaption>', '</figure>']
    """
    caption = _caption(caption)
    svg = _svg(figure)
    return _figure_box(svg, caption) if caption else svg


# A head of head_grid_html is drawn at most this wide (216 px): two side by side fill a phone's column
# (358 px at a 390 px viewport) at 0.81 of their size, so 9 pt labels render at 9.7 px there and at
# 12 px where they are shown at their own size.
_PANEL_WIDTH = 2.25
_PANEL_GAP = 0.08  # inches between heads (0.4rem of the site, about 8 px)
_BAR_STRIP = (3.5, 0.8)  # the colour bar under the heads, in inches (336 px: a phone's column holds it)


def _head_panel(mpl: Any, weights: np.ndarray, queries: list[str] | None, keys: list[str] | None,
                name: str, cmap: str, mask: bool) -> Figure:
    """One head's ``(L, S)`` heatmap, titled ``name``, with its own labels and no colour bar."""
    L, S = weights.shape
    left, bottom = _margins(queries, keys, L, S)
    top, right = 0.35, 0.12
    cell_w = min(_CELL, (_PANEL_WIDTH - left - right) / max(S, 1))
    # rows a label each where the height allows: a little taller than wide is still a map
    cell_h = min(_CELL, max(cell_w, _MIN_CELL), (_MAX_HEIGHT - bottom - top) / max(L, 1))
    width = max(left + S * cell_w + right, min(_PANEL_WIDTH, 0.095 * len(name) + 0.3))
    fig = mpl.figure.Figure(figsize=(width, bottom + L * cell_h + top), layout="constrained")
    ax = fig.add_subplot()
    _draw(ax, weights, queries, keys, cmap, False, mask=mask, step=_steps(cell_h, cell_w, keys, S))
    ax.set_title(name)
    return fig


def _colorbar_strip(mpl: Any, label: str, cmap: str, mask: bool) -> Figure:
    """A horizontal 0-1 colour bar on its own, labelled ``label``: the scale every head shares."""
    fig = mpl.figure.Figure(figsize=_BAR_STRIP, layout="constrained")
    ax = fig.add_subplot()
    mappable = mpl.cm.ScalarMappable(norm=mpl.colors.Normalize(0.0, 1.0), cmap=cmap)
    bar = fig.colorbar(mappable, cax=ax, orientation="horizontal", label=label)
    if mask:
        bar.set_ticks([0.0, 1.0], labels=["0", "1"])
    return fig


def head_grid_html(
    weights: object,
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    ncols: int | None = None,
    title: str | None = None,
    head_names: Sequence[str] | None = None,
    cmap: str = "viridis",
    colorbar_label: str | None = None,
    caption: str | None = None,
) -> str:
    """One small inline SVG per head, laid out by the page: ``ncols`` per row, 2 per row on a phone.

    [`head_grid`][attention_ref.viz.head_grid] draws every head in one wide
    figure, which a phone shrinks until its labels cannot be read. Here each head
    is its own figure (at most 2.25 inches, 216 px wide, labelled on both axes,
    named ``head 3`` for screen readers), and the heads sit in a CSS grid,
    ``<div class="ar-head-grid">``: ``ncols`` per row where the screen is wide,
    2 per row below 720 px (the site's ``extra.css``), where their 9 pt labels
    still render at 9.7 px or more. One colour bar under the heads gives the
    shared 0-1 scale.

    Args:
        weights: ``(H, L, S)`` weights in ``[0, 1]``, or a boolean mask.
        query_labels: ``L`` row labels.
        key_labels: ``S`` column labels; defaults to ``query_labels`` when ``L == S``.
        ncols: heads per row on a wide screen. Defaults to as many as fit 7
            inches (the text column) at their own size, at most ``H``.
        title: a line over the heads (HTML text, so it follows the page's colours).
        head_names: ``H`` panel titles; defaults to ``head 0``, ``head 1``, ...
        cmap: a matplotlib colormap name.
        colorbar_label: what the colours measure; defaults to
            ``"attention weight"`` (``"mask (1 = takes part)"`` for booleans).
        caption: a sentence under the heads, as the ``<figcaption>``.

    Returns:
        ``<figure class="ar-figure-box">`` holding the title, the grid of heads,
        the colour bar and the caption; print it into a page (markdown-exec ``html="1"``).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``weights`` not 3-D or not in ``[0, 1]``, ``H == 0``, a bad
            ``ncols``, label lists of the wrong length.
        TypeError: a ``colorbar_label``, ``title`` or ``caption`` that is not a str.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import head_grid_html
        >>> w = attention_weights(torch.randn(4, 5, 8), torch.randn(4, 5, 8))  # (H, L, S) = (4, 5, 5)
        >>> page = head_grid_html(w, list("abcde"), ncols=4, caption="Four heads.")
        >>> '<div class="ar-head-grid" style="--ar-head-columns: 4; --ar-head-columns-phone: 2">' in page
        True
        >>> [page.count(f'aria-label="head {h}"') for h in range(4)]
        [1, 1, 1, 1]
    """
    mask, array, label, names, queries, keys = _head_grid_inputs(
        weights, query_labels, key_labels, ncols, head_names, colorbar_label)
    H = array.shape[0]
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    caption = _caption(caption)
    with _style() as mpl:
        panels = [_head_panel(mpl, array[h], queries, keys, names[h], cmap, mask) for h in range(H)]
        width = panels[0].get_size_inches()[0]
        if ncols is None:  # as many as the text column holds at their own size
            ncols = max(1, int((_MAX_WIDTH + _PANEL_GAP) // (width + _PANEL_GAP)))
        ncols = min(ncols, H)
        svgs = [_svg(fig, name) for fig, name in zip(panels, names)]
        bar = _svg(_colorbar_strip(mpl, label, cmap, mask), f"colour scale: {label}, from 0 to 1")
    bar = bar.replace('class="ar-figure"', 'class="ar-figure ar-head-grid-colorbar"', 1)
    heading = f'<p class="ar-head-grid-title">{html.escape(title)}</p>\n' if title else ""
    grid = (f'<div class="ar-head-grid" style="--ar-head-columns: {ncols}; '
            f'--ar-head-columns-phone: {min(ncols, 2)}">\n' + "".join(svgs) + "</div>\n")
    return _figure_box(heading + grid + bar, caption)


_EXPLORER_MODEL_KEYS = frozenset({"sentences", "scores", "scale", "causal", "head_names", "layer_names", "caption"})
_WEIGHT_UNIT = 1e-4  # weights travel as uint16 counts of 1e-4: 4 decimals, 0 to 10000
_SCORE_UNITS = (0.01, 0.1, 1.0)  # scores travel as int16 counts of the first unit that holds them


def _explorer_index(name: str, value: object, size: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        also = "None or " if allow_none else ""
        raise ValueError(f"{name} must be {also}an int in [0, {size - 1}], got {value!r}")
    return value


def _explorer_sentence(label: str, toks: object, w: object) -> tuple[list[str], np.ndarray]:
    """Tokens as a list of str and weights as ``(layers, H, L, L)`` float64, checked."""
    if isinstance(toks, str) or not isinstance(toks, Sequence):
        raise TypeError(f"{label}tokens must be a sequence of str, got {type(toks).__name__}")
    bad = [type(t).__name__ for t in toks if not isinstance(t, str)]
    if bad:
        raise TypeError(f"{label}tokens must be a sequence of str, got a {bad[0]} item")
    if hasattr(w, "detach"):  # a torch.Tensor, without importing torch here
        w = w.detach().cpu().float().numpy()
    ndim = np.ndim(w)
    if ndim not in (3, 4):
        raise ValueError(
            f"{label}weights must have 3 dims (H, L, L) or 4 dims (layers, H, L, L), "
            f"got {ndim} dims with shape {np.shape(w)}"
        )
    layout = "(H, L, L)" if ndim == 3 else "(layers, H, L, L)"
    array = _as_array(f"{label}weights", w, ndim, layout)
    if ndim == 3:
        array = array[None]  # one layer
    *_, L, S = array.shape
    if L != S or L != len(toks):
        raise ValueError(
            f"{label}weights must have shape {layout} with L = len(tokens) = {len(toks)}, got {tuple(np.shape(w))}"
        )
    if 0 in array.shape:
        raise ValueError(f"{label}weights must hold at least one layer, head and token, got shape {tuple(np.shape(w))}")
    return [str(t) for t in toks], array


def _explorer_scores(label: str, scores: object, weights: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    """``scores`` (q.k before the scale) as ``weights``' shape, checked to give ``weights`` through softmax."""
    if hasattr(scores, "detach"):
        scores = scores.detach().cpu().double().numpy()
    try:
        array = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{label}scores must be a tensor or array of numbers, got {type(scores).__name__}") from error
    if array.ndim == weights.ndim - 1:
        array = array[None]  # one layer, as the weights
    if array.shape != weights.shape:
        raise ValueError(
            f"{label}scores must have the weights' shape (layers, H, L, L) = {weights.shape}, got {np.shape(scores)}"
        )
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{label}scores must be finite (q.k before any mask), got NaN or inf values")
    # The steps the explorer shows: scale, mask, softmax. They must give the weights shown.
    scaled = array * scale  # (layers, H, L, L)
    if causal:
        L = array.shape[-1]
        scaled = np.where(np.tril(np.ones((L, L), dtype=bool)), scaled, -np.inf)  # True = takes part
    shifted = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    softmax = shifted / shifted.sum(axis=-1, keepdims=True)
    worst = float(np.abs(softmax - weights).max())
    if worst > 1e-3:
        raise ValueError(
            f"{label}scores must give the weights: softmax(scores * scale{', causal mask' if causal else ''}) "
            f"differs from the weights by up to {worst:.3g} (allowed 1e-3)"
        )
    return array


def _explorer_caption(name: str, caption: object) -> str | None:
    """A model's caption: a str, or None (and "") for none."""
    if caption is not None and not isinstance(caption, str):
        raise TypeError(f"{name} must be a str or None, got {type(caption).__name__}")
    return caption or None


def _explorer_pack(array: np.ndarray, unit: float, signed: bool) -> str:
    """``array`` in counts of ``unit``, as little-endian (u)int16 in base64: 2 bytes a number."""
    counts = np.rint(array / unit)
    dtype = "<i2" if signed else "<u2"
    return base64.b64encode(counts.astype(dtype).tobytes()).decode("ascii")


def _explorer_model(
    name: str,
    sentences: Mapping[str, object] | None,
    single: tuple[object, object] | None,
    scores: object,
    scale: object,
    causal: object,
    head_names: Sequence[str] | None,
    layer_names: Sequence[str] | None,
) -> dict[str, Any]:
    """One model of the explorer, checked: its names, its sentences ``(text, tokens, weights, scores)``."""
    where = f"model {name!r}: " if name else ""
    if sentences is not None:
        if not isinstance(sentences, Mapping):
            raise TypeError(
                f"{where}sentences must be a mapping from str to (tokens, weights), got {type(sentences).__name__}"
            )
        if not sentences:
            raise ValueError(f"{where}sentences must hold at least one sentence, got an empty mapping")
        items = []
        for text, pair in sentences.items():
            if not isinstance(text, str):
                raise TypeError(f"{where}sentences must have str keys, got {type(text).__name__}")
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"{where}sentences[{text!r}] must be a pair (tokens, weights), got {type(pair).__name__}")
            items.append([text, *_explorer_sentence(f"{where}sentences[{text!r}] ", pair[0], pair[1]), None])
    else:
        if single is None:
            raise TypeError(f"{where}needs tokens and weights, or sentences")
        toks, array = _explorer_sentence(where, *single)
        items = [[" ".join(toks), toks, array, None]]
    if not isinstance(causal, bool):
        raise TypeError(f"{where}causal must be a bool, got {type(causal).__name__}")
    if causal:
        for text, _, array, _ in items:
            if np.abs(np.triu(array, k=1)).max(initial=0.0) > 1e-6:
                raise ValueError(f"{where}causal=True, but sentence {text!r} has weight on keys after their query")
    if scores is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{where}scale must be a positive number (usually 1/sqrt(E)) with scores, got {scale!r}")
        if sentences is not None:
            if not isinstance(scores, Mapping) or set(scores) != set(sentences):
                raise ValueError(
                    f"{where}scores must be a mapping with the same sentences as keys as sentences, "
                    f"got {sorted(scores) if isinstance(scores, Mapping) else type(scores).__name__}"
                )
            for item in items:
                item[3] = _explorer_scores(f"{where}scores[{item[0]!r}] ", scores[item[0]], item[2], scale, causal)
        else:
            items[0][3] = _explorer_scores(where, scores, items[0][2], scale, causal)
    elif scale is not None:
        raise ValueError(f"{where}scale is only used with scores, got scale={scale!r} and no scores")
    n_layers, H = items[0][2].shape[:2]
    for text, _, array, _ in items[1:]:
        if array.shape[:2] != (n_layers, H):
            raise ValueError(
                f"{where}every sentence must have the same number of layers and heads: "
                f"{items[0][0]!r} has (layers, H) = {(n_layers, H)}, {text!r} has {array.shape[:2]}"
            )
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"{where}head_names must have one name per head ({H}), got {len(head_names)}")
    if layer_names is not None and len(layer_names) != n_layers:
        raise ValueError(f"{where}layer_names must have one name per layer ({n_layers}), got {len(layer_names)}")
    return {
        "name": name,
        "items": items,
        "layers": [str(n) for n in layer_names] if layer_names is not None else [f"layer {i}" for i in range(n_layers)],
        "heads": [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)],
        "scale": None if scores is None else float(scale),
        "causal": causal,
    }


def _explorer_json(model: dict[str, Any], initial: list[int | None]) -> dict[str, Any]:
    """The JSON of one model: names, and per sentence the packed weights and scores."""
    data: dict[str, Any] = {"name": model["name"], "layers": model["layers"], "heads": model["heads"],
                            "causal": model["causal"], "weightUnit": _WEIGHT_UNIT}
    if model.get("caption"):
        data["caption"] = model["caption"]  # the script shows the caption of the model chosen
    biggest = max((float(np.abs(s).max()) for *_, s in model["items"] if s is not None), default=None)
    if biggest is not None:
        unit = next((u for u in _SCORE_UNITS if biggest / u < 32767), None)
        if unit is None:
            raise ValueError(f"scores must be below {32767 * _SCORE_UNITS[-1]:.0f} in size, got {biggest:.4g}")
        d = 1.0 / model["scale"] ** 2  # scale = 1/sqrt(d)
        data.update(scale=model["scale"], scoreUnit=unit,
                    sqrtD=f"\u221a{round(d)}" if abs(d - round(d)) < 1e-6 else f"{1 / model['scale']:.4g}")
    data["sentences"] = [
        {"text": text, "tokens": toks, "weights": _explorer_pack(array, _WEIGHT_UNIT, signed=False),
         "initial": first, **({"scores": _explorer_pack(scores, data["scoreUnit"], signed=True)}
                             if scores is not None else {})}
        for (text, toks, array, scores), first in zip(model["items"], initial)
    ]
    return data


def _explorer_other_model(name: object, spec: object) -> dict[str, Any]:
    """One entry of ``other_models``, checked: its model, with its ``initial_token`` and caption."""
    if not isinstance(name, str) or not isinstance(spec, Mapping):
        raise TypeError(f"other_models must map a str name to a mapping, got {name!r}: {type(spec).__name__}")
    unknown = sorted(set(spec) - _EXPLORER_MODEL_KEYS - {"initial_token"})
    if unknown or "sentences" not in spec:
        raise TypeError(
            f"other_models[{name!r}] takes the keys {sorted(_EXPLORER_MODEL_KEYS | {'initial_token'})} "
            f"with 'sentences' required, got unknown keys {unknown}" if unknown else
            f"other_models[{name!r}] needs the key 'sentences'"
        )
    model = _explorer_model(name, spec["sentences"], None, spec.get("scores"), spec.get("scale"),
                            spec.get("causal", False), spec.get("head_names"), spec.get("layer_names"))
    model["initial_token"] = spec.get("initial_token")
    model["caption"] = _explorer_caption(f"other_models[{name!r}] caption", spec.get("caption"))
    return model


def _explorer_initial_tokens(model: dict[str, Any], value: object, opened: int, several: bool,
                             where: str) -> list[int | None]:
    """The token selected first in each of ``model``'s sentences, checked (``None``: none).

    An int (or ``None``) is the token of the sentence ``opened``, the others get ``None``; with
    ``several`` sentences to choose from, a sequence gives one entry per sentence. ``where``
    prefixes the argument's name in the messages (``""`` for the first model).
    """
    items = model["items"]
    if value is None or isinstance(value, (int, bool)):
        initial = [None] * len(items)
        initial[opened] = value
    elif several and isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != len(items):
            raise ValueError(f"initial_token must have one entry per sentence ({len(items)}), got {len(value)}")
        initial = list(value)
    else:
        raise ValueError(f"initial_token must be None or an int, got {value!r}")
    for s, ((_, toks, _, _), first) in enumerate(zip(items, initial)):
        name = "initial_token" if len(items) == 1 else f"initial_token for sentence {s}"
        _explorer_index(where + name, first, len(toks), allow_none=True)
    return initial


def _explorer_element_id(element_id: object, payload: str) -> str:
    """The container's id, checked: the one given, or ``attention-explorer-`` and a hash of ``payload``."""
    if element_id is None:
        element_id = "attention-explorer-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:10]
    if not isinstance(element_id, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", element_id):
        raise ValueError(
            f"element_id must start with a letter and hold only letters, digits, '-' and '_', got {element_id!r}"
        )
    return element_id


def _explorer_menu(element_id: str, kind: str, label: str, names: list[str], selected: int) -> str:
    """A labelled ``<select>`` of ``names`` (``kind``: model, sentence, layer or head), ``selected`` chosen."""
    esc = html.escape
    options = "".join(
        f'<option value="{i}"{" selected" if i == selected else ""}>{esc(name)}</option>'
        for i, name in enumerate(names)
    )
    return (
        f'<span class="attention-explorer-menu attention-explorer-menu-{kind}">'
        f'<label for="{element_id}-{kind}">{label}</label>'
        f'<select id="{element_id}-{kind}" class="attention-explorer-{kind}">{options}</select></span>'
    )


def _explorer_markup(element_id: str, payload: str, models: list[dict[str, Any]], initial_sentence: int,
                     initial_layer: int, initial_head: int) -> str:
    """The explorer's HTML: the container holding ``payload``, the caption, menus, tokens and empty panels.

    The menus, the tokens and the caption are those of the first model, as the page loads: the
    sentence menu shows when there are several sentences or models, the layer menu when there are
    several layers or models, the model menu with several models.
    """
    esc = html.escape
    main = models[0]
    items, layers, heads = main["items"], main["layers"], main["heads"]
    several = len(models) > 1
    shown = items[initial_sentence][1]
    buttons = "".join(
        f'<button type="button" class="attention-explorer-token" data-index="{i}" aria-pressed="false">'
        f"{esc(token)}</button>"
        for i, token in enumerate(shown)
    )
    direction = "".join(
        f'<button type="button" class="attention-explorer-direction-button" data-direction="{key}" '
        f'aria-pressed="{"true" if key == "to" else "false"}">{text}</button>'
        for key, text in (("to", "attends to"), ("by", "is attended by"))
    )
    parts = [
        f'<div class="attention-explorer" id="{element_id}" data-attention="{esc(payload, quote=True)}">',
        # the first model's caption; the script swaps in the chosen model's (hidden: none)
        f'<p class="attention-explorer-caption">{esc(main["caption"])}</p>' if main["caption"] else
        '<p class="attention-explorer-caption" hidden></p>' if any(m["caption"] for m in models) else "",
        '<div class="attention-explorer-controls">',
        _explorer_menu(element_id, "model", "Model", [m["name"] for m in models], 0) if several else "",
        _explorer_menu(element_id, "sentence", "Sentence", [text for text, *_ in items], initial_sentence)
        if several or len(items) > 1 else "",
        _explorer_menu(element_id, "layer", "Layer", layers, initial_layer) if several or len(layers) > 1 else "",
        _explorer_menu(element_id, "head", "Head", heads, initial_head),
        "</div>",
        (
            '<div class="attention-explorer-tokens" role="group" aria-label="Tokens: pick one to see its attention">'
            f"{buttons}</div>"
        ),
        (
            '<div class="attention-explorer-direction" role="group" aria-label="Direction">'
            f'<span class="attention-explorer-direction-label">The chosen token</span>{direction}</div>'
        ),
        (
            f'<p class="attention-explorer-status" id="{element_id}-status" aria-live="polite">'
            "Click a token, or move to it with Tab, to see its attention weights over all tokens.</p>"
        ),
        f'<div class="attention-explorer-steps" aria-labelledby="{element_id}-status"></div>',
        (
            '<div class="attention-explorer-overview">'
            '<p class="attention-explorer-legend">All heads: a row per layer, a column per head; in each map '
            "a row per query token and a column per key token. Each map is shaded to its own largest weight "
            "(darkest = that head's maximum), so faint heads stay visible: compare heads by the numbers above, "
            "not by shade. The chosen token's row (or column) is outlined; click a map to open that head.</p>"
            '<div class="attention-explorer-thumbs" role="group" aria-label="Every layer and head: '
            'pick one to open it"></div></div>'
        ),
        "</div>",
    ]
    return "".join(parts) + "\n"


def explorer_html(
    tokens: Sequence[str] | None = None,
    weights: object = None,
    *,
    sentences: dict[str, tuple[Sequence[str], object]] | None = None,
    scores: object = None,
    scale: float | None = None,
    causal: bool = False,
    model_name: str | None = None,
    other_models: Mapping[str, Mapping[str, object]] | None = None,
    head_names: Sequence[str] | None = None,
    layer_names: Sequence[str] | None = None,
    element_id: str | None = None,
    initial_sentence: int = 0,
    initial_layer: int = 0,
    initial_head: int = 0,
    initial_token: int | Sequence[int | None] | None = None,
    caption: str | None = None,
) -> str:
    r"""An HTML fragment that ``docs/javascripts/explorer.js`` turns into an attention explorer.

    The reader clicks (or focuses with the keyboard) a token, and a toggle
    picks the direction: where the token **attends to** (its row of weights),
    or by which tokens it is **attended by** (its column). The tokens are shaded
    by weight and a table gives, for each other token, the steps of
    $\mathrm{softmax}(q \cdot k \times \text{scale})$ when ``scores`` are given:
    the dot product $q \cdot k$, the scaled score, the causal mask ($-\infty$
    for a key after its query) and the weight; without ``scores``, the weight
    only. Menus pick the model (with ``other_models``), the sentence, the layer
    and the head. An overview of every layer x head, one small heatmap per head
    shaded to that head's own largest weight, opens a head when clicked. With
    ``scores``, the table also gives each key's $\exp(s - \max)$ and the sum
    they are divided by, so each weight can be checked by hand.

    Every number shown is computed here, at build time, and embedded in the
    page; the script only displays. Weights travel in units of 1e-4, scores in
    units of 0.01 (or 0.1, 1 for large ones), as base64 little-endian 16-bit
    integers, ``(layers, H, L, L)`` flattened: the page needs no server, and a
    6-layer, 12-head model on a 16-token sentence costs 74 KB. When
    ``scores`` are given, the softmax of the scaled (and masked) scores must
    equal the weights (to 1e-3), or this raises. Without JavaScript the tokens
    and the menus show but do nothing. Needs no matplotlib.

    Give either ``tokens`` and ``weights`` (one sentence), or ``sentences``.

    Markup: a ``div.attention-explorer`` whose ``data-attention`` attribute
    holds the JSON ``{"model": 0, "models": [{"name", "layers", "heads",
    "causal", "weightUnit", "scale", "scoreUnit", "sqrtD", "caption",
    "sentences": [{"text", "tokens", "weights", "scores", "initial"}]}]}``
    (``scale``, ``scoreUnit``, ``sqrtD`` and ``scores`` only with scores;
    ``caption`` only for a model that has one; ``initial`` the token selected
    first or ``null``), a caption paragraph when a model has a caption (the
    script shows the chosen model's, or hides it), a ``<select>`` per menu, a direction
    toggle, one ``<button>`` per token of the first sentence shown, and empty
    containers that the script fills (the steps table and the overview). The
    JSON sits in an attribute, not in a ``<script type="application/json">``:
    Material's instant navigation re-runs every ``<script>`` of a new page as
    JavaScript (dropping its ``type``), which would fail on JSON and stop the
    navigation.

    Args:
        tokens: the ``L`` tokens of the sentence.
        weights: its self-attention weights in ``[0, 1]`` (torch tensor or
            NumPy array), ``(H, L, L)`` for one layer or ``(layers, H, L, L)``;
            ``weights[..., h, i, :]`` is the row of query token ``i`` in head ``h``.
        sentences: instead of ``tokens`` and ``weights``, several sentences:
            a mapping from the sentence as the menu shows it to its
            ``(tokens, weights)``. Every sentence must have the same number of
            layers and heads (the lengths ``L`` may differ).
        scores: the dot products $q \cdot k$ before ``scale`` and any mask, the
            shape of ``weights``; with ``sentences``, a mapping from the same
            sentences to their scores. Optional: without them the explorer
            shows the weights only.
        scale: the factor applied to the scores before the softmax, usually
            $1/\sqrt{E}$ for query/key size ``E``. Required with ``scores``.
        causal: the weights come from a causal mask (query ``i`` sees keys
            ``j <= i``); the steps show $-\infty$ for the masked keys.
        model_name: the name of this model in the model menu (shown when
            ``other_models`` is given); defaults to ``model 0``.
        other_models: more models for the model menu, after this one: a
            mapping from a name to a mapping with the keys ``sentences``
            (required, as above), and optionally ``scores``, ``scale``,
            ``causal``, ``head_names``, ``layer_names``, ``initial_token`` and
            ``caption`` (as above; they open on their first sentence, layer
            and head). A model without a caption shows none.
        head_names: ``H`` names for the head menu; defaults to ``head 0``, ...
        layer_names: one name per layer for the layer menu; defaults to
            ``layer 0``, ... (the menu is left out when there is one layer and
            one model).
        element_id: the container's HTML id (letters, digits, ``-``, ``_``);
            defaults to one derived from the data, stable across builds.
        initial_sentence: the index of the sentence shown when the page loads.
        initial_layer: the layer selected when the page loads.
        initial_head: the head selected when the page loads.
        initial_token: the token selected when the page loads (in the initial
            sentence); ``None`` shows a hint until the reader picks one. With
            ``sentences``, also a sequence of one index or ``None`` per sentence:
            the token selected when the reader first switches to it.
        caption: a sentence shown above the menus while this (the first)
            model is chosen; give the other models theirs in ``other_models``.

    Returns:
        The HTML fragment (one block, no blank lines).

    Raises:
        ValueError: ``weights`` not ``(H, L, L)`` or ``(layers, H, L, L)`` with
            ``L == len(tokens)``, values outside ``[0, 1]``, ``scores`` of
            another shape or whose softmax is not the weights, ``scale`` missing
            or not positive, weight after the query with ``causal``, sentences
            with different numbers of layers or heads, names of the wrong
            length, a bad id, or a sentence, layer, head or token index out of
            range.
        TypeError: ``tokens`` is not a sequence of str, ``sentences`` not a
            mapping from str to ``(tokens, weights)``, both or neither of
            ``tokens``/``weights`` and ``sentences`` given, an unknown key
            in ``other_models``, or a caption that is not a str.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import explorer_html
        >>> w = attention_weights(torch.randn(2, 3, 4), torch.randn(2, 3, 4))  # (H, L, L) = (2, 3, 3)
        >>> fragment = explorer_html(["the", "cat", "sat"], w, element_id="demo")
        >>> fragment.startswith('<div class="attention-explorer" id="demo"')
        True
        >>> q, k = torch.randn(2, 3, 4), torch.randn(2, 3, 4)  # (H, L, E)
        >>> w = attention_weights(q, k)  # softmax(q k^T / sqrt(4))
        >>> fragment = explorer_html(["the", "cat", "sat"], w, scores=q @ k.transpose(-2, -1), scale=0.5)
        >>> two = torch.stack([w, w.flip(-1)])  # (layers, H, L, L) = (2, 2, 3, 3)
        >>> other = attention_weights(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))
        >>> fragment = explorer_html(sentences={"the cat sat": (["the", "cat", "sat"], two),
        ...                                     "it sat": (["it", "sat"], other)})
        >>> 'class="attention-explorer-layer"' in fragment and 'class="attention-explorer-sentence"' in fragment
        True
    """
    if sentences is not None:
        if tokens is not None or weights is not None:
            raise TypeError("give either tokens and weights, or sentences, not both")
        main = _explorer_model(model_name or "", sentences, None, scores, scale, causal, head_names, layer_names)
    else:
        if tokens is None or weights is None:
            raise TypeError("explorer_html needs tokens and weights, or sentences")
        main = _explorer_model(model_name or "", None, (tokens, weights), scores, scale, causal, head_names,
                               layer_names)
    models = [main]
    if other_models is not None:
        if not isinstance(other_models, Mapping):
            raise TypeError(f"other_models must be a mapping from a name to a mapping, got {type(other_models).__name__}")
        models += [_explorer_other_model(name, spec) for name, spec in other_models.items()]
        main["name"] = model_name or "model 0"
    main["caption"] = _explorer_caption("caption", caption)
    _explorer_index("initial_sentence", initial_sentence, len(main["items"]))
    _explorer_index("initial_layer", initial_layer, len(main["layers"]))
    _explorer_index("initial_head", initial_head, len(main["heads"]))
    # each model's first tokens, then its JSON, model by model
    packed = [_explorer_json(main, _explorer_initial_tokens(main, initial_token, initial_sentence,
                                                            sentences is not None, ""))]
    for model in models[1:]:
        where = f"other_models[{model['name']!r}] "
        packed.append(_explorer_json(model, _explorer_initial_tokens(model, model["initial_token"], 0, True, where)))
    data = {
        "model": 0,
        "start": {"sentence": initial_sentence, "layer": initial_layer, "head": initial_head},
        "models": packed,
    }
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    element_id = _explorer_element_id(element_id, payload)
    return _explorer_markup(element_id, payload, models, initial_sentence, initial_layer, initial_head)


# map_slider_html: one (L, S) map per frame (a training step, a layer, ...), drawn as an inline SVG whose
# cells docs/javascripts/map-slider.js recolours. The colours are viridis, the heatmaps' colormap, as 17
# stops interpolated linearly in RGB, the same arithmetic here and in the script: the static frame this
# writes and the frame the script draws are the same colours. Sizes in CSS px at the map's own size.
_RAMP = ("#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e", "#21918c",
         "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219", "#fde725")
_RAMP_RGB = tuple(tuple(int(c[k:k + 2], 16) for k in (1, 3, 5)) for c in _RAMP)
_SLIDER_FONT = 12.0  # labels; shown in a phone's 358 px column a 400 px map keeps them at 10.7 px
_SLIDER_CHAR = 0.62 * _SLIDER_FONT  # the width of one character of a label, estimated
_SLIDER_WIDTH = 400.0  # the widest map
_SLIDER_CELL = 40.0  # a cell's side when there is room
_SLIDER_NUMBERS = 1_000_000  # at most F * L * S weights in one page (2.7 MB of base64)


def _ramp_colour(weight: float) -> str:
    """The colour of ``weight`` in [0, 1] on `_RAMP`, as ``#rrggbb`` (map-slider.js's ``colour``)."""
    t = min(max(weight, 0.0), 1.0) * (len(_RAMP_RGB) - 1)
    i = min(math.floor(t), len(_RAMP_RGB) - 2)
    f = t - i
    return "#" + "".join(f"{math.floor(a + (b - a) * f + 0.5):02x}" for a, b in zip(_RAMP_RGB[i], _RAMP_RGB[i + 1]))


def _slider_svg(element_id: str, last: np.ndarray, rows: list[str], cols: list[str], tokens: list[str] | None,
                name: str) -> str:
    """The map as SVG: the ``(L, S)`` weights ``last`` as cells, the ``rows`` down the left, the ``cols``
    (position ``j=...`` over the key's token, or one rotated line when the tokens are too wide) below,
    and a 0-1 colour bar. Each cell is ``rect.ar-map-slider-cell`` with ``data-i``, ``data-j``,
    ``data-weight`` and a ``<title>``, in row-major order."""
    L, S = last.shape
    font, char = _SLIDER_FONT, _SLIDER_CHAR
    left = max(max(map(len, rows)) * char, len("query") * char) + 12
    right, top = 8.0, font + 10
    cell = max(min(_SLIDER_CELL, (_SLIDER_WIDTH - left - right) / S), 4.0)  # long labels widen the map instead
    positions = [f"j={j}" for j in range(S)]
    two_lines = max(map(len, positions)) * char <= cell - 2 and (
        tokens is None or max(map(len, tokens)) * char <= cell - 2)
    if two_lines:  # "j=7" over its token
        label_h = (2 if tokens is not None else 1) * (font + 3) + 4
        col_step = 1
    else:  # "j=7 · token", written upwards
        label_h = max(map(len, cols)) * char + 8
        col_step = math.ceil((font + 2) / cell - 1e-9)
    row_step = math.ceil((font + 2) / cell - 1e-9)
    grid_w, grid_h = S * cell, L * cell
    bar_w = max(grid_w, 160.0)
    bottom = top + grid_h
    key_y = bottom + label_h + font
    bar_y = key_y + 8
    width = left + bar_w + right
    height = bar_y + 10 + font + 8
    esc = html.escape

    def n(x: float) -> str:
        return f"{x:.2f}".rstrip("0").rstrip(".")

    out = [
        (f'<svg class="ar-map-slider-map" role="img" aria-label="{esc(name)}" xmlns="http://www.w3.org/2000/svg" '
         f'width="{n(width)}" height="{n(height)}" viewBox="0 0 {n(width)} {n(height)}" '
         f'style="max-width: 100%; height: auto" font-family="sans-serif" font-size="{n(font)}" fill="currentColor">'),
        f'<defs><linearGradient id="{element_id}-ramp">'
        + "".join(f'<stop offset="{n(k / (len(_RAMP) - 1))}" stop-color="{c}"/>' for k, c in enumerate(_RAMP))
        + "</linearGradient></defs>",
        f'<text class="ar-map-slider-axis" x="{n(left - 6)}" y="{n(top - 6)}" text-anchor="end">query</text>',
    ]
    for i in range(0, L, row_step):
        out.append(f'<text class="ar-map-slider-row" x="{n(left - 6)}" y="{n(top + (i + 0.5) * cell + 0.35 * font)}" '
                   f'text-anchor="end">{esc(rows[i])}</text>')
    out.append('<g class="ar-map-slider-cells">')
    for i in range(L):
        for j in range(S):
            w = float(last[i, j])
            out.append(f'<rect class="ar-map-slider-cell" data-i="{i}" data-j="{j}" data-weight="{w:.4f}" '
                       f'x="{n(left + j * cell)}" y="{n(top + i * cell)}" width="{n(cell)}" height="{n(cell)}" '
                       f'fill="{_ramp_colour(w)}"><title>{esc(rows[i])} \u2192 {esc(cols[j])}: {w:.3f}</title></rect>')
    out.append("</g>")
    for j in range(0, S, col_step):
        x = left + (j + 0.5) * cell
        if two_lines:
            out.append(f'<text class="ar-map-slider-col" x="{n(x)}" y="{n(bottom + font + 3)}" '
                       f'text-anchor="middle">{positions[j]}</text>')
            if tokens is not None:
                out.append(f'<text class="ar-map-slider-col" x="{n(x)}" y="{n(bottom + 2 * font + 6)}" '
                           f'text-anchor="middle">{esc(tokens[j])}</text>')
        else:
            out.append(f'<text class="ar-map-slider-col" x="{n(x + 0.35 * font)}" y="{n(bottom + 4)}" '
                       f'text-anchor="end" transform="rotate(-90 {n(x + 0.35 * font)} {n(bottom + 4)})">'
                       f"{esc(cols[j])}</text>")
    out += [
        f'<text class="ar-map-slider-axis" x="{n(left + grid_w / 2)}" y="{n(key_y)}" text-anchor="middle">key</text>',
        (f'<rect class="ar-map-slider-bar" x="{n(left)}" y="{n(bar_y)}" width="{n(bar_w)}" height="10" '
         f'fill="url(#{element_id}-ramp)"/>'),
        f'<text x="{n(left)}" y="{n(bar_y + 10 + font + 2)}">0</text>',
        f'<text x="{n(left + bar_w / 2)}" y="{n(bar_y + 10 + font + 2)}" text-anchor="middle">{_WEIGHT_LABEL}</text>',
        f'<text x="{n(left + bar_w)}" y="{n(bar_y + 10 + font + 2)}" text-anchor="end">1</text>',
        "</svg>",
    ]
    return "\n".join(out)


def map_slider_html(
    maps: object,
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    frame_names: Sequence[object] | None = None,
    values: object = None,
    value_name: str | None = None,
    value_format: str = ".2f",
    caption: str | None = None,
    element_id: str | None = None,
) -> str:
    """An attention map that changes over frames (training steps, layers, ...), with a slider and Play.

    ``docs/javascripts/map-slider.js`` turns the fragment into a widget: the
    reader drags the slider (or focuses it and presses the arrow keys) to move
    through the frames, or presses Play to run through them at 15 frames a
    second; the map, the frame's name and its value redraw. Rows are the
    queries, labelled ``i=0 · token``; columns the keys, labelled ``j=0`` over
    their token. A cell's colour is its weight on the heatmaps' 0-1 viridis
    scale, and hovering it shows the weight.

    The map is an inline SVG drawn here, showing the **last** frame: without
    JavaScript (a Jupyter notebook, a feed reader) the fragment is a still
    heatmap of the last frame, its name and its value, and the controls stay
    hidden. Every frame is embedded in the fragment, so the page needs no
    server: the weights travel as ``explorer_html``'s do, base64
    little-endian uint16 counts of 1e-4, ``(F, L, S)`` flattened, in the
    JSON of the figure's ``data-map-slider`` attribute: ``{"frames", "L",
    "S", "unit", "weights", "names", "values", "valueName", "rows", "cols",
    "ramp"}`` (``values`` the formatted values or ``null``; ``rows`` and
    ``cols`` the axis labels; ``ramp`` the colour stops). 151 frames of 8 x 8
    make a fragment of about 48 KB. Needs no matplotlib.

    Args:
        maps: ``(F, L, S)`` weights in ``[0, 1]``, one ``(L, S)`` map per frame
            (a torch tensor, NumPy array or nested lists), e.g.
            ``torch.stack(list_of_maps)``.
        query_labels: the ``L`` query tokens; ``None`` labels the rows by
            position only.
        key_labels: the ``S`` key tokens; defaults to ``query_labels`` when
            ``L == S`` (self-attention).
        frame_names: ``F`` names shown above the map, e.g. ``step 42``;
            defaults to ``frame 0``, ``frame 1``, ...
        values: ``F`` numbers, one per frame, shown under its name (e.g. a
            loss, or the weight on the right keys).
        value_name: what ``values`` are, shown before them; defaults to
            ``value``. Only with ``values``.
        value_format: the format spec of the values (``format(v,
            value_format)``).
        caption: a sentence under the map, as the ``<figcaption>``.
        element_id: the figure's HTML id (a letter, then letters, digits,
            ``-`` and ``_``); defaults to one derived from the data, stable
            across builds.

    Returns:
        ``<figure class="ar-figure-box ar-map-slider">``: the controls (hidden
        until the script runs), the frame's name and value, the map, the
        caption; print it into a page (markdown-exec ``html="1"``).

    Raises:
        ValueError: ``maps`` not 3-D, empty, or not in ``[0, 1]``; more than
            1,000,000 weights; labels, ``frame_names`` or ``values`` of the
            wrong length; ``values`` not finite; ``value_name`` without
            ``values``; a bad ``value_format`` or ``element_id``.
        TypeError: ``maps`` or ``values`` not numbers; labels or
            ``frame_names`` not a sequence; ``value_name``, ``value_format``
            or ``caption`` not a str.

    Examples:
        >>> import torch
        >>> from attention_ref.viz import map_slider_html
        >>> first = torch.full((3, 3), 1 / 3)  # (L, S): uniform
        >>> last = torch.eye(3).flip(-1)  # the anti-diagonal
        >>> maps = torch.stack([first, last])  # (F, L, S)
        >>> page = map_slider_html(maps, ["a", "b", "c"], values=[0.33, 1.0],
        ...                        value_name="on the anti-diagonal", element_id="demo")
        >>> page.startswith('<figure class="ar-figure-box ar-map-slider" id="demo"')
        True
        >>> [line for line in page.splitlines() if "value" in line and "div" in line]
        ['<div class="ar-map-slider-value">on the anti-diagonal: 1.00</div>']
        >>> page.count('class="ar-map-slider-cell"')
        9
    """
    array = _as_array("maps", maps, 3, "(F, L, S)")
    F, L, S = array.shape
    if 0 in array.shape:
        raise ValueError(f"maps must hold at least one frame, query and key, got shape (F, L, S) = {array.shape}")
    if array.size > _SLIDER_NUMBERS:
        raise ValueError(f"maps must hold at most {_SLIDER_NUMBERS:,} weights (F * L * S) for one page, "
                         f"got {array.size:,} with shape {array.shape}")
    tokens, key_tokens = _resolve_labels(array.shape, query_labels, key_labels)
    rows = [f"i={i}" + (f" \u00b7 {tokens[i]}" if tokens is not None else "") for i in range(L)]
    cols = [f"j={j}" + (f" \u00b7 {key_tokens[j]}" if key_tokens is not None else "") for j in range(S)]
    if frame_names is None:
        names = [f"frame {f}" for f in range(F)]
    else:
        if isinstance(frame_names, str) or not isinstance(frame_names, Sequence):
            raise TypeError(f"frame_names must be a sequence of names, got {type(frame_names).__name__}")
        if len(frame_names) != F:
            raise ValueError(f"frame_names must have one name per frame (F = {F}), got {len(frame_names)}")
        names = [str(name) for name in frame_names]
    if not isinstance(value_format, str):
        raise TypeError(f"value_format must be a format spec str such as '.2f', got {type(value_format).__name__}")
    if value_name is not None and not isinstance(value_name, str):
        raise TypeError(f"value_name must be a str or None, got {type(value_name).__name__}")
    shown_values = None
    if values is not None:
        if hasattr(values, "detach"):  # a torch.Tensor, without importing torch here
            values = values.detach().cpu().double().numpy()
        try:
            numbers = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise TypeError(f"values must be a sequence of numbers, got {type(values).__name__}") from error
        if numbers.shape != (F,):
            raise ValueError(f"values must have one number per frame, shape (F,) = ({F},), got shape {numbers.shape}")
        if not np.all(np.isfinite(numbers)):
            raise ValueError("values must be finite, got NaN or inf values")
        try:
            shown_values = [format(float(v), value_format) for v in numbers]
        except ValueError as error:
            raise ValueError(f"value_format must format a float, such as '.2f', got {value_format!r}") from error
        value_name = value_name or "value"
    elif value_name is not None:
        raise ValueError(f"value_name is only used with values, got value_name={value_name!r} and no values")
    caption = _caption(caption)
    counts = np.rint(array / _WEIGHT_UNIT).astype("<u2")  # (F, L, S) counts of 1e-4
    data = {
        "frames": F, "L": L, "S": S, "unit": _WEIGHT_UNIT,
        "weights": base64.b64encode(counts.tobytes()).decode("ascii"),
        "names": names, "values": shown_values, "valueName": value_name,
        "rows": rows, "cols": cols, "ramp": list(_RAMP),
    }
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if element_id is None:
        element_id = "map-slider-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:10]
    if not isinstance(element_id, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", element_id):
        raise ValueError(
            f"element_id must start with a letter and hold only letters, digits, '-' and '_', got {element_id!r}"
        )
    esc = html.escape
    last = counts[-1].astype(np.float64) * _WEIGHT_UNIT  # (L, S): the weights as the script decodes them
    value_text = f"{value_name}: {shown_values[-1]}" if shown_values is not None else ""
    spoken = names[-1] + (f", {value_text}" if value_text else "")
    parts = [
        f'<figure class="ar-figure-box ar-map-slider" id="{element_id}" data-map-slider="{esc(payload, quote=True)}">',
        '<div class="ar-map-slider-controls" hidden>',
        '<button type="button" class="ar-map-slider-play" aria-label="Play the frames">Play</button>',
        (f'<input type="range" class="ar-map-slider-range" min="0" max="{F - 1}" step="1" value="{F - 1}" '
         f'aria-label="Frame" aria-valuetext="{esc(spoken)}">'),
        "</div>",
        '<div class="ar-map-slider-status">',
        f'<div class="ar-map-slider-frame">{esc(names[-1])}</div>',
        f'<div class="ar-map-slider-value">{esc(value_text)}</div>' if value_text else "",
        "</div>",
        _slider_svg(element_id, last, rows, cols, key_tokens, f"attention map, {names[-1]}"),
        f"<figcaption>{esc(caption)}</figcaption>" if caption else "",
        "</figure>",
    ]
    return "\n".join(part for part in parts if part) + "\n"
