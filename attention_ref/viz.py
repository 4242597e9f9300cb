"""Plots of attention weights: heatmaps, per-head grids, inline SVG, and the interactive explorer.

The figures need the optional ``matplotlib`` extra (``pip install
"attention-ref[plot]"``); it is imported on first use, so importing this module
(and [`explorer_html`][attention_ref.viz.explorer_html], which writes plain HTML) works without it.

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

import contextlib
import hashlib
import html
import io
import json
import math
import re
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - only for the annotations
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["explorer_html", "head_grid", "heatmap", "heatmaps", "to_svg"]

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
    cells are too small for every label); ``mask`` writes annotations as 0/1.
    """
    L, S = weights.shape
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    rows, cols = range(0, L, step[0]), range(0, S, step[1])
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
    mask = _is_mask(weights)
    array = _as_array("weights", weights, 3, "(H, L, S)")
    H, L, S = array.shape
    if H == 0:
        raise ValueError(f"weights must hold at least one head, got shape {array.shape}")
    if ncols is not None and (isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1):
        raise ValueError(f"ncols must be a positive int or None, got {ncols!r}")
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"head_names must have one name per head ({H}), got {len(head_names)}")
    label = _colorbar_label("colorbar_label", colorbar_label, mask)
    names = [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)]
    queries, keys = _resolve_labels(array.shape, query_labels, key_labels)
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
    Text placed on the data (``ax.text``, e.g. a cell's value) keeps its colour.
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


def _label(figure: Figure) -> str:
    """A name for screen readers: the figure's title, else its axes' titles, else "figure"."""
    suptitle = getattr(figure, "_suptitle", None)
    titles = [suptitle.get_text()] if suptitle is not None and suptitle.get_text() else [
        ax.get_title() for ax in figure.axes if ax.get_title()]
    return "; ".join(titles) or "figure"


def to_svg(figure: Figure) -> str:
    """Render a figure as an inline ``<svg>`` element and close the figure.

    The string has no XML prolog or doctype, so it can be printed straight into
    an HTML page (markdown-exec ``html="1"``). It scales down to the width of
    the page. The output is deterministic: ids come from a fixed salt and no
    date is written, so rebuilding a page does not change it.

    Args:
        figure: a matplotlib figure (from [`heatmap`][attention_ref.viz.heatmap],
            [`head_grid`][attention_ref.viz.head_grid] or your own).

    Returns:
        The ``<svg ...>...</svg>`` markup.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``figure`` is not a matplotlib Figure.

    Examples:
        >>> from attention_ref.viz import heatmap, to_svg
        >>> svg = to_svg(heatmap([[0.25, 0.75], [1.0, 0.0]], ["a", "b"]))
        >>> svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        True
    """
    mpl = _matplotlib()
    if not isinstance(figure, mpl.figure.Figure):
        raise TypeError(f"figure must be a matplotlib.figure.Figure, got {type(figure).__name__}")
    _chrome(figure)
    label = _label(figure)
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
    # Scale with the page: keep the viewBox, let CSS size it. Named for screen readers by its titles.
    svg = _SVG_START.sub(f'<svg class="ar-figure" role="img" aria-label="{html.escape(label)}" '
                         'style="max-width: 100%; height: auto"', svg, count=1)
    # No indentation and no blank lines: smaller, and safe inside Markdown.
    return "\n".join(line.strip() for line in svg.splitlines() if line.strip()) + "\n"


def explorer_html(
    tokens: Sequence[str] | None = None,
    weights: object = None,
    *,
    sentences: dict[str, tuple[Sequence[str], object]] | None = None,
    head_names: Sequence[str] | None = None,
    layer_names: Sequence[str] | None = None,
    element_id: str | None = None,
    initial_sentence: int = 0,
    initial_layer: int = 0,
    initial_head: int = 0,
    initial_token: int | Sequence[int | None] | None = None,
    caption: str | None = None,
) -> str:
    """An HTML fragment that ``docs/javascripts/explorer.js`` turns into an attention explorer.

    The reader clicks (or focuses with the keyboard) a token and sees how much
    it attends to every token, as shaded tokens and bars with the values.
    Menus pick the sentence (when there are several), the layer (when the
    weights have several) and the head; a row of thumbnails, one small heatmap
    per head of the chosen layer, opens a head when clicked. The weights are
    embedded in the page as JSON (4 decimals), so the page needs no server.
    Without JavaScript the tokens and the menus show but do nothing. Needs no
    matplotlib.

    Give either ``tokens`` and ``weights`` (one sentence), or ``sentences``.

    Markup: a ``div.attention-explorer`` whose ``data-attention`` attribute
    holds the JSON ``{"layers", "heads", "sentences": [{"text", "tokens",
    "weights", "initial"}]}`` (``weights`` always ``(layers, H, L, L)``,
    ``initial`` the token selected first or ``null``), with a ``<select>`` per
    menu, an empty ``div.attention-explorer-thumbs`` that the script fills, and
    one ``<button>`` per token of the first sentence shown. The JSON sits in an
    attribute, not in a ``<script type="application/json">``: Material's
    instant navigation re-runs every ``<script>`` of a new page as JavaScript
    (dropping its ``type``), which would fail on JSON and stop the navigation.

    Args:
        tokens: the ``L`` tokens of the sentence.
        weights: its self-attention weights in ``[0, 1]`` (torch tensor or
            NumPy array), ``(H, L, L)`` for one layer or ``(layers, H, L, L)``;
            ``weights[..., h, i, :]`` is the row of query token ``i`` in head ``h``.
        sentences: instead of ``tokens`` and ``weights``, several sentences:
            a mapping from the sentence as the menu shows it to its
            ``(tokens, weights)``. Every sentence must have the same number of
            layers and heads (the lengths ``L`` may differ).
        head_names: ``H`` names for the head menu; defaults to ``head 0``, ...
        layer_names: one name per layer for the layer menu; defaults to
            ``layer 0``, ... (the menu is left out when there is one layer).
        element_id: the container's HTML id (letters, digits, ``-``, ``_``);
            defaults to one derived from the data, stable across builds.
        initial_sentence: the index of the sentence shown when the page loads.
        initial_layer: the layer selected when the page loads.
        initial_head: the head selected when the page loads.
        initial_token: the token selected when the page loads (in the initial
            sentence); ``None`` shows a hint until the reader picks one. With
            ``sentences``, also a sequence of one index or ``None`` per sentence:
            the token selected when the reader first switches to it.
        caption: a sentence shown above the menus.

    Returns:
        The HTML fragment (one block, no blank lines).

    Raises:
        ValueError: ``weights`` not ``(H, L, L)`` or ``(layers, H, L, L)`` with
            ``L == len(tokens)``, values outside ``[0, 1]``, sentences with
            different numbers of layers or heads, names of the wrong length, a
            bad id, or a sentence, layer, head or token index out of range.
        TypeError: ``tokens`` is not a sequence of str, ``sentences`` not a
            mapping from str to ``(tokens, weights)``, or both or neither of
            ``tokens``/``weights`` and ``sentences`` given.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import explorer_html
        >>> w = attention_weights(torch.randn(2, 3, 4), torch.randn(2, 3, 4))  # (H, L, L) = (2, 3, 3)
        >>> fragment = explorer_html(["the", "cat", "sat"], w, element_id="demo")
        >>> fragment.startswith('<div class="attention-explorer" id="demo"')
        True
        >>> two = torch.stack([w, w.flip(-1)])  # (layers, H, L, L) = (2, 2, 3, 3)
        >>> other = attention_weights(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))
        >>> fragment = explorer_html(sentences={"the cat sat": (["the", "cat", "sat"], two),
        ...                                     "it sat": (["it", "sat"], other)})
        >>> 'class="attention-explorer-layer"' in fragment and 'class="attention-explorer-sentence"' in fragment
        True
    """
    from collections.abc import Mapping

    def index(name: str, value: object, size: int, allow_none: bool = False) -> int | None:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            also = "None or " if allow_none else ""
            raise ValueError(f"{name} must be {also}an int in [0, {size - 1}], got {value!r}")
        return value

    def one_sentence(label: str, toks: object, w: object) -> tuple[list[str], np.ndarray]:
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
        array = _as_array(f"{label}weights", w, ndim, "(H, L, L)" if ndim == 3 else "(layers, H, L, L)")
        if ndim == 3:
            array = array[None]  # one layer
        *_, L, S = array.shape
        if L != S or L != len(toks):
            layout = "(H, L, L)" if ndim == 3 else "(layers, H, L, L)"
            raise ValueError(
                f"{label}weights must have shape {layout} with L = len(tokens) = {len(toks)}, "
                f"got {tuple(np.shape(w))}"
            )
        if 0 in array.shape:
            raise ValueError(
                f"{label}weights must hold at least one layer, head and token, got shape {tuple(np.shape(w))}"
            )
        return [str(t) for t in toks], array

    if sentences is not None:
        if tokens is not None or weights is not None:
            raise TypeError("give either tokens and weights, or sentences, not both")
        if not isinstance(sentences, Mapping):
            raise TypeError(
                f"sentences must be a mapping from str to (tokens, weights), got {type(sentences).__name__}"
            )
        if not sentences:
            raise ValueError("sentences must hold at least one sentence, got an empty mapping")
        items = []
        for text, pair in sentences.items():
            if not isinstance(text, str):
                raise TypeError(f"sentences must have str keys, got {type(text).__name__}")
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(
                    f"sentences[{text!r}] must be a pair (tokens, weights), got {type(pair).__name__}"
                )
            items.append((text, *one_sentence(f"sentences[{text!r}] ", pair[0], pair[1])))
    else:
        if tokens is None or weights is None:
            raise TypeError("explorer_html needs tokens and weights, or sentences")
        toks, array = one_sentence("", tokens, weights)
        items = [(" ".join(toks), toks, array)]

    n_layers, H = items[0][2].shape[:2]
    for text, _, array in items[1:]:
        if array.shape[:2] != (n_layers, H):
            raise ValueError(
                "every sentence must have the same number of layers and heads: "
                f"{items[0][0]!r} has (layers, H) = {(n_layers, H)}, {text!r} has {array.shape[:2]}"
            )
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"head_names must have one name per head ({H}), got {len(head_names)}")
    if layer_names is not None and len(layer_names) != n_layers:
        raise ValueError(f"layer_names must have one name per layer ({n_layers}), got {len(layer_names)}")
    heads = [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)]
    layers = [str(n) for n in layer_names] if layer_names is not None else [f"layer {i}" for i in range(n_layers)]
    index("initial_sentence", initial_sentence, len(items))
    index("initial_layer", initial_layer, n_layers)
    index("initial_head", initial_head, H)
    if initial_token is None or isinstance(initial_token, (int, bool)):
        initial = [None] * len(items)
        initial[initial_sentence] = initial_token
    elif sentences is not None and isinstance(initial_token, Sequence) and not isinstance(initial_token, str):
        if len(initial_token) != len(items):
            raise ValueError(
                f"initial_token must have one entry per sentence ({len(items)}), got {len(initial_token)}"
            )
        initial = list(initial_token)
    else:
        raise ValueError(f"initial_token must be None or an int, got {initial_token!r}")
    for s, ((_, toks, _), value) in enumerate(zip(items, initial)):
        name = "initial_token" if len(items) == 1 else f"initial_token for sentence {s}"
        index(name, value, len(toks), allow_none=True)

    data = {
        "layers": layers,
        "heads": heads,
        "sentences": [
            {"text": text, "tokens": toks, "weights": np.round(array, 4).tolist(), "initial": first}
            for (text, toks, array), first in zip(items, initial)
        ],
    }
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if element_id is None:
        element_id = "attention-explorer-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:10]
    if not isinstance(element_id, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", element_id):
        raise ValueError(
            f"element_id must start with a letter and hold only letters, digits, '-' and '_', got {element_id!r}"
        )
    esc = html.escape

    def menu(kind: str, label: str, names: list[str], selected: int) -> str:
        options = "".join(
            f'<option value="{i}"{" selected" if i == selected else ""}>{esc(name)}</option>'
            for i, name in enumerate(names)
        )
        return (
            f'<span class="attention-explorer-menu attention-explorer-menu-{kind}">'
            f'<label for="{element_id}-{kind}">{label}</label>'
            f'<select id="{element_id}-{kind}" class="attention-explorer-{kind}">{options}</select></span>'
        )

    shown = items[initial_sentence][1]
    buttons = "".join(
        f'<button type="button" class="attention-explorer-token" data-index="{i}" aria-pressed="false">'
        f"{esc(token)}</button>"
        for i, token in enumerate(shown)
    )
    parts = [
        f'<div class="attention-explorer" id="{element_id}" data-attention="{esc(payload, quote=True)}">',
        f'<p class="attention-explorer-caption">{esc(caption)}</p>' if caption else "",
        '<div class="attention-explorer-controls">',
        menu("sentence", "Sentence", [text for text, _, _ in items], initial_sentence) if len(items) > 1 else "",
        menu("layer", "Layer", layers, initial_layer) if n_layers > 1 else "",
        menu("head", "Head", heads, initial_head),
        "</div>",
        f'<div class="attention-explorer-thumbs" role="group" aria-label="The heads of this layer: '
        'pick one to open it"></div>',
        '<div class="attention-explorer-tokens" role="group" aria-label="Tokens: pick one to see where it attends">'
        f"{buttons}</div>",
        f'<p class="attention-explorer-status" id="{element_id}-status" aria-live="polite">'
        "Click a token, or move to it with Tab, to see its attention weights over all tokens.</p>",
        f'<ol class="attention-explorer-bars" aria-labelledby="{element_id}-status"></ol>',
        "</div>",
    ]
    return "".join(parts) + "\n"
