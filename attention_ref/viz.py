"""Plots of attention weights: heatmaps, per-head grids, inline SVG, and the interactive explorer.

The figures need the optional ``matplotlib`` extra (``pip install
"attention-ref[plot]"``); it is imported on first use, so importing this module
(and [`explorer_html`][attention_ref.viz.explorer_html], which writes plain HTML) works without it.

Figures are `Figure` objects made without ``pyplot``:
making one changes no global state and leaves the backend you chose alone.
They have an opaque white background and dark text, so they read the same on
a light or a dark page, and the colour scale always runs from 0 to 1, so two
plots of weights can be compared by eye.

Shapes use the package legend: ``H`` heads, ``L`` query length, ``S`` key length.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import io
import json
import re
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - only for the annotations
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["explorer_html", "head_grid", "heatmap", "to_svg"]

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
    "font.size": 10,
    "axes.titlesize": 11,
    "svg.fonttype": "none",
    "svg.hashsalt": "attention_ref",
    "image.interpolation": "none",  # vector backends embed the raw L x S pixels
}


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


def _draw(
    ax: Axes, weights: np.ndarray, queries: list[str] | None, keys: list[str] | None, cmap: str, annotate: bool
) -> Any:
    """Draw one ``(L, S)`` heatmap on ``ax``; return the image (for a colorbar)."""
    L, S = weights.shape
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_xticks(range(S), keys if keys is not None else [str(j) for j in range(S)])
    ax.set_yticks(range(L), queries if queries is not None else [str(i) for i in range(L)])
    if keys is not None:
        ax.tick_params(axis="x", labelrotation=90 if max(map(len, keys), default=0) > 2 else 0)
    if annotate:
        for i in range(L):
            for j in range(S):
                r, g, b, _ = image.cmap(image.norm(weights[i, j]))
                dark = 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
                ax.text(j, i, f"{weights[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
    return image


def heatmap(
    weights: object,
    query_labels: Sequence[object] | None = None,
    key_labels: Sequence[object] | None = None,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    cmap: str = "viridis",
    annotate: bool = False,
) -> Figure:
    """A heatmap of one attention matrix: queries down, keys across, a 0-1 colorbar.

    Args:
        weights: ``(L, S)`` weights in ``[0, 1]`` (torch tensor, NumPy array or
            nested lists); row ``i`` is where query ``i`` attends.
        query_labels: ``L`` labels for the rows (e.g. the query tokens).
        key_labels: ``S`` labels for the columns. Defaults to ``query_labels``
            when ``L == S`` (self-attention), else to the column indices.
        ax: draw into this axes (its figure is returned) instead of a new figure.
        title: the axes title.
        cmap: a matplotlib colormap name.
        annotate: write each weight (2 decimals) in its cell; for small matrices.

    Returns:
        The `Figure`; pass it to [`to_svg`][attention_ref.viz.to_svg] to embed it.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``weights`` is not 2-D or not in ``[0, 1]``; a label list of
            the wrong length.
        TypeError: labels that are not a sequence.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import heatmap, to_svg
        >>> w = attention_weights(torch.randn(3, 4), torch.randn(3, 4))  # (L, S) = (3, 3)
        >>> fig = heatmap(w, ["the", "cat", "sat"], title="one head")
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['the', 'cat', 'sat']
        >>> to_svg(fig).startswith("<svg")
        True
    """
    array = _as_array("weights", weights, 2, "(L, S)")
    queries, keys = _resolve_labels(array.shape, query_labels, key_labels)
    with _style() as mpl:
        if ax is None:
            L, S = array.shape
            size = (min(2.0 + 0.45 * S, 12.0), min(1.6 + 0.4 * L, 10.0))  # inches, grows with the tokens
            fig = mpl.figure.Figure(figsize=size, layout="constrained")
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        image = _draw(ax, array, queries, keys, cmap, annotate)
        if title is not None:
            ax.set_title(title)
        fig.colorbar(image, ax=ax, label="weight")
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
) -> Figure:
    """One heatmap per head, side by side, on one shared 0-1 colour scale.

    Args:
        weights: ``(H, L, S)`` weights in ``[0, 1]``, e.g. one batch element of
            ``MultiHeadAttention(..., return_weights=True, average_weights=False)``.
        query_labels: ``L`` row labels.
        key_labels: ``S`` column labels; defaults to ``query_labels`` when ``L == S``.
        ncols: heads per row; defaults to ``min(H, 4)``.
        title: a title over the whole grid.
        head_names: ``H`` panel titles; defaults to ``head 0``, ``head 1``, ...
        cmap: a matplotlib colormap name.

    Returns:
        The `Figure`, with one colorbar for all panels.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``weights`` not 3-D or not in ``[0, 1]``, ``H == 0``, a bad
            ``ncols``, label lists of the wrong length.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import head_grid
        >>> w = attention_weights(torch.randn(4, 5, 8), torch.randn(4, 5, 8))  # (H, L, S) = (4, 5, 5)
        >>> fig = head_grid(w, list("abcde"), ncols=2)
        >>> len(fig.axes)  # 4 heatmaps and 1 shared colorbar
        5
    """
    array = _as_array("weights", weights, 3, "(H, L, S)")
    H = array.shape[0]
    if H == 0:
        raise ValueError(f"weights must hold at least one head, got shape {array.shape}")
    if ncols is None:
        ncols = min(H, 4)
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be a positive int or None, got {ncols!r}")
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"head_names must have one name per head ({H}), got {len(head_names)}")
    names = [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)]
    queries, keys = _resolve_labels(array.shape, query_labels, key_labels)
    ncols = min(ncols, H)
    nrows = -(-H // ncols)
    L, S = array.shape[1:]
    with _style() as mpl:
        panel_w, panel_h = min(1.2 + 0.32 * S, 6.0), min(1.0 + 0.3 * L, 5.0)
        fig = mpl.figure.Figure(figsize=(panel_w * ncols + 1.0, panel_h * nrows + 0.4), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
        image = None
        for h, ax in enumerate(axes.flat):
            if h >= H:
                ax.set_axis_off()
                continue
            image = _draw(ax, array[h], queries, keys, cmap, False)
            ax.set_title(names[h])
            if h % ncols:  # the query labels on the first column only
                ax.set_ylabel("")
                ax.tick_params(axis="y", labelleft=False)
            if h + ncols < H:  # the "key" axis label on the lowest panel of each column only
                ax.set_xlabel("")
        fig.colorbar(image, ax=axes.ravel().tolist(), label="weight", shrink=0.9)
        if title is not None:
            fig.suptitle(title)
    return fig


_SVG_START = re.compile(r"<svg\b")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


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
    # Scale with the page: keep the viewBox, let CSS size it.
    svg = _SVG_START.sub('<svg style="max-width: 100%; height: auto"', svg, count=1)
    # No indentation and no blank lines: smaller, and safe inside Markdown.
    return "\n".join(line.strip() for line in svg.splitlines() if line.strip()) + "\n"


def explorer_html(
    tokens: Sequence[str],
    weights: object,
    *,
    head_names: Sequence[str] | None = None,
    element_id: str | None = None,
    initial_head: int = 0,
    initial_token: int | None = None,
    caption: str | None = None,
) -> str:
    """An HTML fragment that ``docs/javascripts/explorer.js`` turns into an attention explorer.

    The reader clicks (or focuses with the keyboard) a token and sees how much
    it attends to every token, as shaded tokens and bars with the values; a
    menu switches heads. The weights are embedded in the page as JSON (4
    decimals), so the page needs no server. Without JavaScript the tokens and
    the menu show but do nothing. Needs no matplotlib.

    Markup: a ``div.attention-explorer`` whose ``data-attention`` attribute
    holds the JSON ``{"tokens", "heads", "weights"}``, with a ``<select>`` of
    heads and one ``<button>`` per token. The JSON sits in an attribute, not in
    a ``<script type="application/json">``: Material's instant navigation
    re-runs every ``<script>`` of a new page as JavaScript (dropping its
    ``type``), which would fail on JSON and stop the navigation.

    Args:
        tokens: the ``L`` tokens of the sentence.
        weights: ``(H, L, L)`` self-attention weights in ``[0, 1]`` (torch tensor
            or NumPy array); ``weights[h, i]`` is the row of query token ``i``.
        head_names: ``H`` names for the menu; defaults to ``head 0``, ...
        element_id: the container's HTML id (letters, digits, ``-``, ``_``);
            defaults to one derived from the data, stable across builds.
        initial_head: the head selected when the page loads.
        initial_token: the token selected when the page loads; ``None`` shows
            a hint until the reader picks one.
        caption: a sentence shown above the tokens.

    Returns:
        The HTML fragment (one block, no blank lines).

    Raises:
        ValueError: ``weights`` not ``(H, L, L)`` with ``L == len(tokens)``,
            values outside ``[0, 1]``, a bad id, head or token index.
        TypeError: ``tokens`` is not a sequence of str.

    Examples:
        >>> import torch
        >>> from attention_ref import attention_weights
        >>> from attention_ref.viz import explorer_html
        >>> w = attention_weights(torch.randn(2, 3, 4), torch.randn(2, 3, 4))  # (H, L, L) = (2, 3, 3)
        >>> fragment = explorer_html(["the", "cat", "sat"], w, element_id="demo")
        >>> fragment.startswith('<div class="attention-explorer" id="demo"')
        True
    """
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of str, got {type(tokens).__name__}")
    if not all(isinstance(t, str) for t in tokens):
        raise TypeError("tokens must be a sequence of str, got a non-str item")
    array = _as_array("weights", weights, 3, "(H, L, L)")
    H, L, S = array.shape
    if L != S or L != len(tokens):
        raise ValueError(
            f"weights must have shape (H, L, L) with L = len(tokens) = {len(tokens)}, got {array.shape}"
        )
    if H == 0 or L == 0:
        raise ValueError(f"weights must hold at least one head and one token, got shape {array.shape}")
    if head_names is not None and len(head_names) != H:
        raise ValueError(f"head_names must have one name per head ({H}), got {len(head_names)}")
    names = [str(n) for n in head_names] if head_names is not None else [f"head {h}" for h in range(H)]
    if isinstance(initial_head, bool) or not isinstance(initial_head, int) or not 0 <= initial_head < H:
        raise ValueError(f"initial_head must be an int in [0, {H - 1}], got {initial_head!r}")
    if initial_token is not None and (
        isinstance(initial_token, bool) or not isinstance(initial_token, int) or not 0 <= initial_token < L
    ):
        raise ValueError(f"initial_token must be None or an int in [0, {L - 1}], got {initial_token!r}")
    data = {"tokens": list(tokens), "heads": names, "weights": np.round(array, 4).tolist()}
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if element_id is None:
        element_id = "attention-explorer-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:10]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", element_id):
        raise ValueError(
            f"element_id must start with a letter and hold only letters, digits, '-' and '_', got {element_id!r}"
        )
    esc = html.escape
    options = "".join(
        f'<option value="{h}"{" selected" if h == initial_head else ""}>{esc(name)}</option>'
        for h, name in enumerate(names)
    )
    buttons = "".join(
        f'<button type="button" class="attention-explorer-token" data-index="{i}" aria-pressed="false">'
        f"{esc(token)}</button>"
        for i, token in enumerate(tokens)
    )
    initial = "" if initial_token is None else f' data-initial-token="{initial_token}"'
    parts = [
        f'<div class="attention-explorer" id="{element_id}"{initial} data-attention="{esc(payload, quote=True)}">',
        f'<p class="attention-explorer-caption">{esc(caption)}</p>' if caption else "",
        '<div class="attention-explorer-controls">',
        f'<label for="{element_id}-head">Head</label>',
        f'<select id="{element_id}-head" class="attention-explorer-head">{options}</select>',
        "</div>",
        f'<div class="attention-explorer-tokens" role="group" aria-label="Tokens: pick one to see where it attends">'
        f"{buttons}</div>",
        f'<p class="attention-explorer-status" id="{element_id}-status" aria-live="polite">'
        "Click a token, or move to it with Tab, to see its attention weights over all tokens.</p>",
        f'<ol class="attention-explorer-bars" aria-labelledby="{element_id}-status"></ol>',
        "</div>",
    ]
    return "".join(parts) + "\n"
