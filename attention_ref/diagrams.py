"""Concept diagrams of attention as inline SVG, drawn from the sizes of real tensors.

Each function returns one ``<svg>`` element as a string, ready to print into an
HTML page (markdown-exec's ``html="1"``) or to show in a notebook
(``IPython.display.SVG``). A diagram that shows sizes reads them from the
tensors (or the module) it is given, so the figure cannot drift from the run
next to it. The markup is written here by hand: no matplotlib, no scripts, no
external references, and the same input always gives the same bytes.

Styling. Every element carries a class (``ar-diagram``, ``ar-bg``, ``ar-box``,
``ar-label``, ``ar-muted``, ``ar-arrow``, ``ar-q``, ``ar-k``, ``ar-v``,
``ar-w``, ``ar-o``, ...) that the site's ``docs/stylesheets/diagrams.css``
colours with Material's variables, so a diagram follows the light and the dark
scheme; inline presentation attributes (a white background, dark text) keep it
readable without that stylesheet. The ``viewBox`` is at most 640 units wide and
``width``/``height`` equal it, so on a wide page one unit is one CSS pixel, and
``max-width: 100%`` shrinks it on a phone. No text is smaller than 12 units.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``Hkv`` key/value
heads, ``L`` query length, ``S`` key length, ``E`` query/key size, ``Ev`` value
size, ``D`` head size, ``d`` model width.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

import numpy as np
import torch

from attention_ref._validation import fmt_shape
from attention_ref.multihead import MultiHeadAttention

__all__ = ["flash_tiling", "kv_head_groups", "multihead_flow", "path_length", "qkv_shapes", "sdpa_flow", "self_vs_cross",
           "transformer_block"]

#: The smallest size, in CSS pixels, at which a diagram's text may render (the site's figures keep the same).
READABLE_PX = 9
_FONT_SIZE = re.compile(r'font-size="([\d.]+)"')
_WIDTH = 640  # the widest viewBox of any diagram, in CSS pixels at scale 1
_FONT = 14  # body text; titles are 16, nothing is below _MIN_FONT
_MIN_FONT = 12

# Fallback colours (presentation attributes): what a diagram looks like without the
# site's stylesheet. The stylesheet replaces them with Material's colours per scheme.
_FG = "#1f1f1f"
_MUTED = "#555555"
_BG = "#ffffff"
_BOX = "#f1f1f1"
_LINE = "#666666"
_GRID = "#9e9e9e"
_ACCENT = "#3f51b5"
# One hue per tensor (Okabe-Ito, distinguishable with the common colour-vision deficiencies).
_HUES = {
    "q": "#0072b2",  # queries
    "k": "#e69f00",  # keys
    "v": "#009e73",  # values
    "w": "#cc79a7",  # scores and weights
    "o": "#d55e00",  # outputs
}


# --- markup -------------------------------------------------------------------------------


def _num(value: float) -> str:
    """A coordinate with at most two decimals and no trailing zeros (deterministic text)."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _text_width(text: str, size: float = _FONT) -> float:
    """A generous estimate of the rendered width of ``text`` (sans-serif, ~0.6 em a character)."""
    plain = text.replace("_{", "").replace("}", "")
    return len(plain) * size * 0.6


def _rich(text: str, size: float) -> str:
    """Escape ``text``; ``X_{i}`` becomes X with a subscript i (a tspan of at least 13 units)."""
    sub_size = max(_MIN_FONT + 1, size - 2)  # 13 units: still ~7 px on a 390 px phone
    shift = round(size * 0.3)
    parts, rest, lowered = [], text, False
    while "_{" in rest:
        head, tail = rest.split("_{", 1)
        sub, rest = tail.split("}", 1)
        if head:
            parts.append(f'<tspan dy="-{shift}">{escape(head)}</tspan>' if lowered else escape(head))
            lowered = False
        parts.append(f'<tspan dy="{shift}" font-size="{_num(sub_size)}">{escape(sub)}</tspan>')
        lowered = True
    if rest:
        parts.append(f'<tspan dy="-{shift}">{escape(rest)}</tspan>' if lowered else escape(rest))
    return "".join(parts)


class _Canvas:
    """Collects SVG elements; ``render`` wraps them in the ``<svg>`` root."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, cls: str, *, hue: str | None = None,
             opacity: float | None = None, rx: float = 0, stroke_width: float = 1.5,
             dashed: bool = False, fill: str | None = None, stroke: str | None = None) -> None:
        colour = _HUES[hue] if hue else None
        if fill is None:
            fill = colour or _BOX
        if stroke is None:
            stroke = colour or _LINE
        if stroke_width == 0:
            stroke = "none"
        attrs = [f'class="{cls}"', f'x="{_num(x)}"', f'y="{_num(y)}"', f'width="{_num(w)}"',
                 f'height="{_num(h)}"', f'fill="{fill}"']
        if opacity is not None:
            attrs.append(f'fill-opacity="{_num(opacity)}"')
        attrs.append(f'stroke="{stroke}"')
        if stroke_width:
            attrs.append(f'stroke-width="{_num(stroke_width)}"')
        if rx:
            attrs.append(f'rx="{_num(rx)}"')
        if dashed:
            attrs.append('stroke-dasharray="5 4"')
        self.parts.append(f"<rect {' '.join(attrs)}/>")

    def text(self, x: float, y: float, content: str, *, size: float = _FONT, anchor: str = "middle",
             bold: bool = False, muted: bool = False) -> None:
        cls = "ar-label ar-muted" if muted else "ar-label"
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text class="{cls}" x="{_num(x)}" y="{_num(y)}" font-size="{_num(size)}" '
            f'text-anchor="{anchor}" fill="{_MUTED if muted else _FG}"{weight}>{_rich(content, size)}</text>'
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, cls: str = "ar-arrow", *,
             colour: str = _LINE, width: float = 1.5, dashed: bool = False) -> None:
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        self.parts.append(
            f'<line class="{cls}" x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" '
            f'stroke="{colour}" stroke-width="{_num(width)}"{dash}/>'
        )

    def arrow(self, x1: float, y1: float, x2: float, y2: float, *, head: float = 8) -> None:
        """A line from (x1, y1) to (x2, y2) with a filled head at the end (no marker ids)."""
        length = math.hypot(x2 - x1, y2 - y1)
        ux, uy = (x2 - x1) / length, (y2 - y1) / length
        bx, by = x2 - ux * head, y2 - uy * head  # base of the head
        self.line(x1, y1, bx, by)
        px, py = -uy * head * 0.5, ux * head * 0.5
        points = f"{_num(x2)},{_num(y2)} {_num(bx + px)},{_num(by + py)} {_num(bx - px)},{_num(by - py)}"
        self.parts.append(f'<polygon class="ar-arrowhead" points="{points}" fill="{_LINE}"/>')

    def path(self, d: str, cls: str, *, fill: str = "none", stroke: str = _LINE, width: float = 1.5,
             opacity: float | None = None) -> None:
        extra = f' fill-opacity="{_num(opacity)}"' if opacity is not None else ""
        self.parts.append(
            f'<path class="{cls}" d="{d}" fill="{fill}"{extra} stroke="{stroke}" stroke-width="{_num(width)}"/>'
        )

    def circle(self, cx: float, cy: float, r: float, cls: str = "ar-node") -> None:
        self.parts.append(
            f'<circle class="{cls}" cx="{_num(cx)}" cy="{_num(cy)}" r="{_num(r)}" fill="{_BG}" '
            f'stroke="{_LINE}" stroke-width="1.5"/>'
        )

    def box(self, x: float, y: float, w: float, h: float, lines: Sequence[str], *, hue: str | None = None,
            bold_first: bool = True) -> None:
        """A rounded box with one or two centred lines of text (the first bold)."""
        cls = f"ar-box ar-{hue}" if hue else "ar-box"
        self.rect(x, y, w, h, cls, hue=hue, opacity=0.16 if hue else None, rx=6)
        gap = 20
        top = y + h / 2 - gap * (len(lines) - 1) / 2 + 5
        for i, content in enumerate(lines):
            self.text(x + w / 2, top + i * gap, content, size=15 if i == 0 and bold_first else _FONT,
                      bold=i == 0 and bold_first)

    def render(self, height: float, width: float = _WIDTH) -> str:
        """The diagram as an ``<svg>``. It scales with its column, and says the width below which
        its smallest text would render under `READABLE_PX` (``--ar-readable-width``): the site
        (docs/stylesheets/diagrams.css, docs/hooks/diagram_boxes.py) keeps it that wide in a box
        that scrolls sideways on a phone and says so, rather than shrinking its labels."""
        w, h = _num(width), _num(math.ceil(height))
        sizes = [float(x) for part in self.parts for x in _FONT_SIZE.findall(part)] or [_FONT]
        readable = math.ceil(width * READABLE_PX / min(sizes))
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" class="ar-diagram" viewBox="0 0 {w} {h}" '
            f'width="{w}" height="{h}" role="img" aria-label={quoteattr(self.title)} '
            f'style="max-width:100%;height:auto;--ar-readable-width:{readable}px" font-family="sans-serif" '
            f'font-size="{_FONT}">'
        )
        background = f'<rect class="ar-bg" x="0" y="0" width="{w}" height="{h}" fill="{_BG}"/>'
        return "\n".join([head, f"<title>{escape(self.title)}</title>", background, *self.parts, "</svg>"])


# --- input checks ---------------------------------------------------------------------------


def _shape(name: str, value: object, min_dims: int, layout: str) -> tuple[int, ...]:
    """The shape of a torch tensor or NumPy array of at least ``min_dims`` dims."""
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    shape = tuple(int(d) for d in value.shape)
    if len(shape) < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dims {layout}, got shape {fmt_shape(shape)}")
    if any(d == 0 for d in shape[-2:]):
        raise ValueError(f"{name} must have non-empty last two dims {layout}, got shape {fmt_shape(shape)}")
    return shape


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value}")
    return value


def _batch_dims(name_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast shape of the leading (batch) dims of several ``(..., X, Y)`` shapes."""
    try:
        return tuple(torch.broadcast_shapes(*(shape[:-2] for shape in name_shapes.values())))
    except RuntimeError:
        listed = ", ".join(f"{name} {fmt_shape(shape)}" for name, shape in name_shapes.items())
        raise ValueError(f"the leading (batch) dims must broadcast together, got {listed}") from None


def _describe_batch(batch: tuple[int, ...]) -> str:
    """``(2, 1)`` -> ``"B=2, H=1"``; the one place a diagram shows the batch dims."""
    if not batch:
        return "no batch dims"
    if len(batch) == 1:
        return f"B={batch[0]}"
    if len(batch) == 2:
        return f"B={batch[0]}, H={batch[1]}"
    return f"batch dims {fmt_shape(batch)}"


def _dims(*sizes: int) -> str:
    return " × ".join(str(s) for s in sizes)


# --- 1. the data flow of scaled dot-product attention ----------------------------------------


def _qkv_shapes(query: object, key: object, value: object) -> dict[str, tuple[int, ...]]:
    """The shapes of query ``(..., L, E)``, key ``(..., S, E)`` and value ``(..., S, Ev)``,
    checked to chain (the sizes E and S agree)."""
    q = _shape("query", query, 2, "(..., L, E)")
    k = _shape("key", key, 2, "(..., S, E)")
    v = _shape("value", value, 2, "(..., S, Ev)")
    E, (S, Ek), Sv = q[-1], k[-2:], v[-2]
    if Ek != E:
        raise ValueError(f"key must have size E={E} in its last dim (that of query), got shape {fmt_shape(k)}")
    if Sv != S:
        raise ValueError(f"value must have S={S} rows in dim -2 (those of key), got shape {fmt_shape(v)}")
    return {"query": q, "key": k, "value": v}


def sdpa_flow(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None = None) -> str:
    r"""The data flow of scaled dot-product attention, with the shapes of the tensors given.

    Q, K and V go to the scores \(QK^\top/\sqrt{E}\), the mask (when given), a
    softmax over each row, and the weighted sum of the values. Every box prints
    its shape, read from the arguments; leading batch dims are shown once
    (``B=2, H=1``) and every box is one slice of them.

    Args:
        query: ``(..., L, E)``, a torch tensor or NumPy array (only its shape is read).
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        mask: optional, broadcastable to ``(..., L, S)``; bool (``True`` = takes
            part, the opposite of ``torch.nn.MultiheadAttention``) or float
            (added to the scores).

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: an argument that is not a tensor or array, or a mask that is
            neither bool nor floating point.
        ValueError: fewer than 2 dims, ``E`` or ``S`` that differ between the
            arguments, batch dims that do not broadcast, or a mask whose last two
            dims do not broadcast to ``(L, S)``.

    Examples:
        >>> import torch
        >>> from attention_ref import diagrams
        >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
        >>> svg = diagrams.sdpa_flow(q, k, v)
        >>> svg.startswith("<svg") and "L × S = 3 × 5" in svg and "B=2" in svg
        True
    """
    shapes = _qkv_shapes(query, key, value)
    (L, E), (S, Ev) = shapes["query"][-2:], shapes["value"][-2:]
    mask_line = None
    if mask is not None:
        m = _shape("mask", mask, 1, "(..., L, S)")
        m = (1,) * (2 - len(m)) + m  # a 1-D mask (S,) broadcasts over the queries
        if isinstance(mask, torch.Tensor):
            is_bool, is_float = mask.dtype == torch.bool, mask.is_floating_point()
        else:
            is_bool, is_float = mask.dtype.kind == "b", mask.dtype.kind == "f"
        if not (is_bool or is_float):
            raise TypeError(f"mask must be bool (True = takes part) or floating point, got {mask.dtype}")
        if m[-2] not in (1, L) or m[-1] not in (1, S):
            raise ValueError(
                f"mask must broadcast to (..., L, S) = (..., {L}, {S}), got shape {fmt_shape(m)}")
        shapes["mask"] = m
        rule = "−∞ where the mask is False" if is_bool else "scores + mask"
        given = "mask L × S" if m[-2:] == (L, S) else f"mask {fmt_shape(m[-2:])} broadcast to L × S"
        mask_line = (f"masked scores: {rule}", f"{given} = {_dims(L, S)}")
    batch_dims = _batch_dims(shapes)
    batch = _describe_batch(batch_dims)

    canvas = _Canvas(
        f"Scaled dot-product attention ({batch}): Q {_dims(L, E)} and K {_dims(S, E)} give scores "
        f"{_dims(L, S)}{', masked' if mask_line else ''}, softmax gives weights {_dims(L, S)}, "
        f"weights times V {_dims(S, Ev)} give the output {_dims(L, Ev)}"
    )
    canvas.text(_WIDTH / 2, 24, f"scaled dot-product attention{f', {batch}' if batch_dims else ''}", size=16,
                bold=True)
    sizes = f"L = {L} queries, S = {S} keys, E = {E}, Ev = {Ev}"
    canvas.text(_WIDTH / 2, 46, f"{sizes}; each box: one batch slice" if batch_dims else sizes, muted=True)
    box_h, step = 56, 96
    y = 64
    canvas.box(20, y, 180, box_h, ["Q  queries", f"L × E = {_dims(L, E)}"], hue="q")
    canvas.box(230, y, 180, box_h, ["K  keys", f"S × E = {_dims(S, E)}"], hue="k")
    canvas.box(440, y, 180, box_h, ["V  values", f"S × Ev = {_dims(S, Ev)}"], hue="v")
    canvas.arrow(110, y + box_h, 110, y + step)
    canvas.arrow(320, y + box_h, 320, y + step)
    y += step
    canvas.box(20, y, 390, box_h, ["scores = Q Kᵀ / √E", f"L × S = {_dims(L, S)}"], hue="w")
    if mask_line:
        canvas.arrow(215, y + box_h, 215, y + step)
        y += step
        canvas.box(20, y, 390, box_h, mask_line, hue="w")
    canvas.arrow(215, y + box_h, 215, y + step)
    y += step
    canvas.box(20, y, 390, box_h, ["weights = softmax of each row", f"L × S = {_dims(L, S)}, rows sum to 1"],
               hue="w")
    canvas.arrow(215, y + box_h, 215, y + step)
    canvas.arrow(530, 64 + box_h, 530, y + step)
    y += step
    canvas.box(20, y, 600, box_h, ["output = weights V", f"L × Ev = {_dims(L, Ev)}"], hue="o")
    return canvas.render(y + box_h + 12)


# --- 2. the shapes of Q, K, V and the weights, to scale --------------------------------------


def qkv_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               weights: torch.Tensor | None = None) -> str:
    """Q, Kᵀ, the weights and V of one batch element as rectangles drawn to scale.

    Two matrix products, each drawn as ``left × right = result`` with widths and
    heights proportional to the sizes: ``(L × E)(E × S) = L × S`` (the scores) and
    ``(L × S)(S × Ev) = L × Ev`` (the output). With ``weights``, the weights
    rectangle is shaded cell by cell with the values of the first batch element
    (the opacity grows with the square root of the weight, so small weights show).

    Args:
        query: ``(..., L, E)``, a torch tensor or NumPy array.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        weights: optional ``(..., L, S)`` attention weights in ``[0, 1]``.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: an argument that is not a tensor or array.
        ValueError: fewer than 2 dims, ``E`` or ``S`` that differ between the
            arguments, batch dims that do not broadcast, weights whose last two
            dims are not ``(L, S)`` or whose values are outside ``[0, 1]``.

    Examples:
        >>> import torch
        >>> from attention_ref import diagrams
        >>> svg = diagrams.qkv_shapes(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2))
        >>> "L × E = 3 × 4" in svg and "S × Ev = 5 × 2" in svg
        True
    """
    shapes = _qkv_shapes(query, key, value)
    (L, E), (S, Ev) = shapes["query"][-2:], shapes["value"][-2:]
    cells = None
    if weights is not None:
        w = _shape("weights", weights, 2, "(..., L, S)")
        if w[-2:] != (L, S):
            raise ValueError(f"weights must have shape (..., L, S) = (..., {L}, {S}), got {fmt_shape(w)}")
        shapes["weights"] = w
        array = weights.detach().cpu().double().numpy() if isinstance(weights, torch.Tensor) else weights
        cells = np.asarray(array, dtype=np.float64).reshape(-1, L, S)[0]
        if not np.all(np.isfinite(cells)) or cells.min() < -1e-6 or cells.max() > 1 + 1e-6:
            raise ValueError(
                f"weights must be attention weights in [0, 1], got values in [{cells.min():.4g}, {cells.max():.4g}]")
    batch = _describe_batch(_batch_dims(shapes))

    rows = [
        [("Q", "L × E", (L, E), "q", None), ("Kᵀ", "E × S", (E, S), "k", None),
         ("scores", "L × S", (L, S), "w", None)],
        [("weights", "L × S", (L, S), "w", cells), ("V", "S × Ev", (S, Ev), "v", None),
         ("output", "L × Ev", (L, Ev), "o", None)],
    ]
    notes = [f"inner size E = {E} matches: (L × E)(E × S) = L × S = {_dims(L, S)}",
             f"inner size S = {S} matches: (L × S)(S × Ev) = L × Ev = {_dims(L, Ev)}"]
    symbol_w, margin, max_row_h = 36, 20, 170

    def slots(unit: float) -> list[list[float]]:
        return [[max(unit * size[1], _text_width(f"{dims} = {_dims(*size)}") + 8) for _, dims, size, _, _ in row]
                for row in rows]

    unit = min(28.0, max_row_h / max(L, E, S))
    while unit > 0.05 and max(sum(row) for row in slots(unit)) + 2 * symbol_w + 2 * margin > _WIDTH:
        unit /= 1.1

    canvas = _Canvas(
        f"Shapes of one batch element ({batch}) drawn to scale: Q {_dims(L, E)} times K transposed "
        f"{_dims(E, S)} gives scores {_dims(L, S)}; weights {_dims(L, S)} times V {_dims(S, Ev)} "
        f"gives the output {_dims(L, Ev)}"
    )
    canvas.text(_WIDTH / 2, 24, "Q, K, V and the weights, drawn to scale", size=16, bold=True)
    notes_top = [] if batch == "no batch dims" else [f"batch element 0 of {batch}"]
    notes_top.append("1 square = 1 number" if unit >= 6 else "sides proportional to the sizes")
    if cells is not None:
        notes_top.append("weights shaded by value")
    canvas.text(_WIDTH / 2, 46, "; ".join(notes_top), muted=True)
    y = 60
    for row, widths, note in zip(rows, slots(unit), notes):
        row_h = unit * max(size[0] for _, _, size, _, _ in row)
        x = (_WIDTH - sum(widths) - 2 * symbol_w) / 2
        top = y + 26
        for i, ((name, dims, (h, w), hue, values), slot) in enumerate(zip(row, widths)):
            cx = x + slot / 2
            canvas.text(cx, top - 8, name, size=15, bold=True)
            rx, rw, rh = cx - unit * w / 2, max(unit * w, 1.5), max(unit * h, 1.5)
            if values is not None:
                # opacity grows with the square root of the weight, so that small weights still show
                shade = 0.05 + 0.9 * np.sqrt(np.clip(values, 0.0, 1.0))
                canvas.rect(rx, top, rw, rh, "ar-bg", fill=_BG, stroke_width=0)
                for r in range(h):
                    for c in range(w):
                        canvas.rect(rx + c * unit, top + r * unit, unit, unit, f"ar-cell ar-{hue}", hue=hue,
                                    opacity=float(shade[r, c]), stroke_width=0)
                canvas.rect(rx, top, rw, rh, f"ar-outline ar-{hue}", hue=hue, fill="none")
            else:
                canvas.rect(rx, top, rw, rh, f"ar-box ar-{hue}", hue=hue, opacity=0.2)
            if unit >= 6:
                for r in range(1, h):
                    canvas.line(rx, top + r * unit, rx + rw, top + r * unit, "ar-grid", colour=_GRID, width=0.6)
                for c in range(1, w):
                    canvas.line(rx + c * unit, top, rx + c * unit, top + rh, "ar-grid", colour=_GRID, width=0.6)
            canvas.text(cx, top + row_h + 20, f"{dims} = {_dims(h, w)}")
            x += slot
            if i < 2:
                canvas.text(x + symbol_w / 2, top + min(row_h, 60) / 2 + 6, "×" if i == 0 else "=", size=20,
                            bold=True)
                x += symbol_w
        canvas.text(_WIDTH / 2, top + row_h + 44, note, muted=True)
        y = top + row_h + 64
    return canvas.render(y - 6)


# --- 3. multi-head attention ------------------------------------------------------------------


def _self_attention_input(name: str, module: object, x: object) -> tuple[int, ...]:
    """Check a self-attention `MultiHeadAttention` and its input ``x`` ``(B, L, d)`` or ``(L, d)``; x's shape."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"{name} must be an attention_ref.MultiHeadAttention, got {type(module).__name__}")
    d = module.embed_dim
    if module.kdim != d or module.vdim != d:
        raise ValueError(
            f"{name} must be a self-attention module (kdim == vdim == embed_dim={d}), "
            f"got kdim={module.kdim}, vdim={module.vdim}")
    shape = _shape("x", x, 2, "(B, L, d)")
    if len(shape) > 3 or shape[-1] != d:
        raise ValueError(f"x must have shape (B, L, d) or (L, d) with d = embed_dim = {d}, got {fmt_shape(shape)}")
    return shape


def multihead_flow(module: MultiHeadAttention, x: torch.Tensor) -> str:
    """Split heads, attend per head, concatenate, project: multi-head self-attention of ``x``.

    ``x`` (L × d) goes through ``W_Q``, ``W_K``, ``W_V``; the last axis is split
    into ``H`` heads of ``D = d / H``; each head attends on its own; the heads are
    concatenated back to ``L × H·D`` and ``W_O`` gives the output ``L × d``. The
    sizes come from ``module`` and ``x``. With fewer key/value heads
    (``num_kv_heads``) the K and V widths show it.

    Args:
        module: an `attention_ref.MultiHeadAttention` with ``kdim == vdim == embed_dim``.
        x: ``(B, L, d)`` or ``(L, d)`` with ``d = module.embed_dim``.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: ``module`` not a ``MultiHeadAttention``, ``x`` not a tensor or array.
        ValueError: ``x`` not 2 or 3 dims, its last dim not ``embed_dim``, or a
            module whose ``kdim``/``vdim`` differ from ``embed_dim`` (not self-attention).

    Examples:
        >>> import torch
        >>> from attention_ref import MultiHeadAttention, diagrams
        >>> svg = diagrams.multihead_flow(MultiHeadAttention(16, 4), torch.randn(2, 5, 16))
        >>> "H = 4" in svg and "L × d = 5 × 16" in svg
        True
    """
    shape = _self_attention_input("module", module, x)
    d, H, Hkv, D = module.embed_dim, module.num_heads, module.num_kv_heads, module.head_dim
    L = shape[-2]
    batch = f", batch B = {shape[0]} not drawn" if len(shape) == 3 else ""

    canvas = _Canvas(
        f"Multi-head attention: x {_dims(L, d)} is projected to Q, K, V, split into {H} heads of size {D}, "
        f"each head attends, the heads are concatenated to {_dims(L, H * D)} and W_O gives {_dims(L, d)}"
    )
    canvas.text(_WIDTH / 2, 24, f"multi-head attention: d = {d}, H = {H} heads of D = d / H = {D}", size=16,
                bold=True)
    canvas.text(_WIDTH / 2, 46, f"one sequence of L = {L} tokens{batch}", muted=True)
    y = 62
    canvas.box(220, y, 200, 52, ["x", f"L × d = {_dims(L, d)}"])
    y_proj = y + 96
    kv = "L × d" if Hkv == H else "L × Hkv·D"  # K and V are narrower with fewer key/value heads
    for cx, name, hue, dims, width in ((110, "Q", "q", "L × d", H * D), (320, "K", "k", kv, Hkv * D),
                                       (530, "V", "v", kv, Hkv * D)):
        canvas.arrow(320 + (cx - 320) * 0.3, y + 52, cx, y_proj)
        canvas.box(cx - 95, y_proj, 190, 52, [f"{name} = x W_{{{name}}}", f"{dims} = {_dims(L, width)}"], hue=hue)
    y = y_proj + 52
    canvas.text(_WIDTH / 2, y + 26, f"split the last axis into heads of D = {D}, then each head attends:",
                muted=True)
    canvas.text(_WIDTH / 2, y + 48, f"q, k, v L × D = {_dims(L, D)} → weights L × L = {_dims(L, L)} "
                                   f"→ L × D = {_dims(L, D)}", muted=True)
    if Hkv != H:
        canvas.text(_WIDTH / 2, y + 70, f"K and V have Hkv = {Hkv} heads, each shared by {H // Hkv} query heads",
                    muted=True)
        y += 22
    heads_y = y + 64
    shown = list(range(1, H + 1)) if H <= 8 else [1, 2, 3, 4, 5, None, H]
    gap = 10
    head_w = (_WIDTH - 40 - gap * (len(shown) - 1)) / len(shown)
    head_h = 64
    for i, h in enumerate(shown):
        hx = 20 + i * (head_w + gap)
        if h is None:
            canvas.text(hx + head_w / 2, heads_y + head_h / 2 + 6, "…", size=20, bold=True)
            continue
        canvas.rect(hx, heads_y, head_w, head_h, "ar-box", rx=6)
        canvas.text(hx + head_w / 2, heads_y + 22, f"head {h}", bold=True)
        bar_w = min(14.0, (head_w - 16) / 3 - 4)
        for j, hue in enumerate("qkv"):
            bx = hx + head_w / 2 + (j - 1) * (bar_w + 6) - bar_w / 2
            canvas.rect(bx, heads_y + 32, bar_w, 22, f"ar-box ar-{hue}", hue=hue, opacity=0.35, stroke_width=1)
        canvas.arrow(hx + head_w / 2, heads_y + head_h, hx + head_w / 2, heads_y + head_h + 36)
    concat_y = heads_y + head_h + 36
    # the concatenation: one segment per head, in head order
    for i, h in enumerate(shown):
        sx = 20 + i * (head_w + gap) - (gap / 2 if i else 0)
        sw = head_w + (gap if 0 < i < len(shown) - 1 else gap / 2)
        canvas.rect(sx, concat_y, sw, 30, "ar-box ar-o", hue="o", opacity=0.3 if i % 2 == 0 else 0.12,
                    stroke_width=1)
        canvas.text(sx + sw / 2, concat_y + 21, "…" if h is None else str(h))
    canvas.text(_WIDTH / 2, concat_y + 54, f"concat: L × H·D = {_dims(L, H * D)}", bold=True)
    canvas.arrow(_WIDTH / 2, concat_y + 62, _WIDTH / 2, concat_y + 96)
    out_y = concat_y + 96
    canvas.box(170, out_y, 300, 52, ["output = concat W_{O}", f"L × d = {_dims(L, d)}"], hue="o")
    return canvas.render(out_y + 64)


_MAX_GROUPED_HEADS = 12  # more query heads than this leave no room for their labels


def kv_head_groups(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """Which query heads share which key/value head: multi-head, grouped-query or multi-query.

    Top row: the ``H`` query heads of ``query``; bottom row: the ``Hkv`` key/value
    heads of ``key`` and ``value``. A line joins query head ``h`` to the key/value
    head it reads, ``h // G`` with groups of ``G = H / Hkv`` consecutive query heads
    (the order of ``repeat_interleave``, of PyTorch's ``enable_gqa=True`` and of
    `attention_ref.scaled_dot_product_attention`); a dashed outline marks each
    group. ``Hkv = H`` is multi-head attention, ``1 < Hkv < H`` grouped-query
    attention, ``Hkv = 1`` multi-query attention. The last line counts the numbers
    a KV cache keeps per token and layer, ``Hkv (E + Ev)``, against multi-head's
    ``H (E + Ev)``. Every size is read from the tensors.

    Args:
        query: ``(..., H, L, E)``, a torch tensor or NumPy array, ``H <= 12``.
        key: ``(..., Hkv, S, E)`` with ``H`` a multiple of ``Hkv``.
        value: ``(..., Hkv, S, Ev)``.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: an argument that is not a tensor or array.
        ValueError: fewer than 3 dims, ``E`` or ``S`` that differ between the
            arguments, ``key`` and ``value`` with different head counts, ``H`` not a
            multiple of ``Hkv``, or more than 12 query heads.

    Examples:
        >>> import torch
        >>> from attention_ref import diagrams
        >>> q, kv = torch.randn(1, 6, 5, 4), torch.randn(1, 2, 7, 4)
        >>> svg = diagrams.kv_head_groups(q, kv, kv)
        >>> "grouped-query attention: H = 6, Hkv = 2, G = H / Hkv = 3" in svg
        True
    """
    _qkv_shapes(query, key, value)
    q = _shape("query", query, 3, "(..., H, L, E)")
    k = _shape("key", key, 3, "(..., Hkv, S, E)")
    v = _shape("value", value, 3, "(..., Hkv, S, Ev)")
    (H, L, E), (Hkv, S, _), Ev = q[-3:], k[-3:], v[-1]
    if v[-3] != Hkv:
        raise ValueError(f"value must have as many heads (dim -3) as key, Hkv={Hkv}, got shape {fmt_shape(v)}")
    if H % Hkv:
        raise ValueError(f"the query heads H={H} (dim -3 of query) must be a multiple of the key/value heads "
                         f"Hkv={Hkv} (dim -3 of key)")
    G = H // Hkv
    if H > _MAX_GROUPED_HEADS:
        raise ValueError(f"kv_head_groups draws at most {_MAX_GROUPED_HEADS} query heads, got H={H}; draw whole "
                         f"groups, e.g. the first one: query[..., :{G}, :, :] with key[..., :1, :, :]")
    if Hkv == H:
        name, rule = "multi-head attention", "every query head has its own key/value head"
    elif Hkv == 1:
        name, rule = "multi-query attention", f"all {H} query heads read the one key/value head"
    else:
        name, rule = "grouped-query attention", "query head h reads key/value head h // G"
    canvas = _Canvas(
        f"{name.capitalize()}: {H} query heads share {Hkv} key/value heads in groups of {G}; "
        f"query head h reads key/value head h // {G}"
    )
    canvas.text(_WIDTH / 2, 24, f"{name}: H = {H}, Hkv = {Hkv}, G = H / Hkv = {G}", size=16, bold=True)
    canvas.text(_WIDTH / 2, 46, rule, muted=True)

    gap, group_gap, margin = 6.0, 12.0, 20.0
    box_w = min(64.0, (_WIDTH - 2 * margin - (H - Hkv) * gap - (Hkv - 1) * group_gap) / H)
    group_w = G * box_w + (G - 1) * gap
    left = (_WIDTH - Hkv * group_w - (Hkv - 1) * group_gap) / 2
    group_x = [left + g * (group_w + group_gap) for g in range(Hkv)]
    canvas.text(margin, 76, f"query heads: q, L × E = {_dims(L, E)} each", anchor="start")
    q_top, q_h = 96, 34
    kv_top, kv_h = q_top + q_h + 74, 34
    kv_w = min(group_w, 128.0)
    for g, gx in enumerate(group_x):
        if G > 1:  # the group's outline
            canvas.rect(gx - 4, q_top - 6, group_w + 8, q_h + 12, "ar-grid", fill="none", stroke=_GRID,
                        stroke_width=1, rx=6, dashed=True)
        kx = gx + group_w / 2 - kv_w / 2
        for i in range(G):
            h = g * G + i
            hx = gx + i * (box_w + gap)
            canvas.rect(hx, q_top, box_w, q_h, "ar-box ar-q", hue="q", opacity=0.16, rx=4)
            canvas.text(hx + box_w / 2, q_top + q_h / 2 + 5, f"q{h}")
            # from the bottom of query head h to the top of its key/value head
            canvas.line(hx + box_w / 2, q_top + q_h + (6 if G > 1 else 0), kx + kv_w / 2, kv_top, "ar-edge",
                        colour=_HUES["w"], width=2)
        # the key/value head: a K half and a V half, named k0 and v0 where they fit, else 0
        named = kv_w / 2 >= _text_width(f"k{Hkv - 1}") + 6
        for j, hue in enumerate("kv"):
            canvas.rect(kx + j * kv_w / 2, kv_top, kv_w / 2, kv_h, f"ar-box ar-{hue}", hue=hue, opacity=0.16,
                        rx=4)
            if named:
                canvas.text(kx + (2 * j + 1) * kv_w / 4, kv_top + kv_h / 2 + 5, f"{hue}{g}")
        if not named:
            canvas.text(kx + kv_w / 2, kv_top + kv_h / 2 + 5, str(g))
    below = kv_top + kv_h
    canvas.text(margin, below + 26, f"key/value heads: k, S × E = {_dims(S, E)}; v, S × Ev = {_dims(S, Ev)}",
                anchor="start")
    cached, full = Hkv * (E + Ev), H * (E + Ev)
    summary = f"KV cache per token, per layer: Hkv (E + Ev) = {cached} numbers"
    summary += " (multi-head)" if Hkv == H else f" (multi-head: {full})"
    canvas.text(_WIDTH / 2, below + 56, summary, bold=True)
    return canvas.render(below + 70)


# --- 4. self- and cross-attention ---------------------------------------------------------


def _length(name: str, value: object) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _shape(name, value, 2, "(..., length, features)")[-2]
    return _int(name, value, 1)


def self_vs_cross(query: int | torch.Tensor, key: int | torch.Tensor) -> str:
    """Self-attention (one sequence, ``L × L`` weights) beside cross-attention (``L × S``).

    Left: queries, keys and values come from one sequence of length ``L``, so
    the weights are ``L × L``. Right: the queries come from the decoder (length
    ``L``), the keys and values from the encoder (length ``S``), so the weights
    are ``L × S``. Both grids use the same cell size.

    Args:
        query: the query (decoder) length ``L``, or a tensor ``(..., L, d)`` whose dim -2 is it.
        key: the key/value (encoder) length ``S``, or a tensor ``(..., S, d)``.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: an argument that is neither an int nor a tensor or array.
        ValueError: a length below 1, or a tensor with fewer than 2 dims.

    Examples:
        >>> import torch
        >>> from attention_ref import diagrams
        >>> svg = diagrams.self_vs_cross(torch.randn(1, 4, 8), torch.randn(1, 6, 8))
        >>> "L × L = 4 × 4" in svg and "L × S = 4 × 6" in svg
        True
    """
    L, S = _length("query", query), _length("key", key)
    canvas = _Canvas(
        f"Self-attention: one sequence of length {L}, weights {_dims(L, L)}. Cross-attention: queries from "
        f"the decoder (length {L}), keys and values from the encoder (length {S}), weights {_dims(L, S)}"
    )
    panel_w, grid_left = 300, 40
    cell = min(26.0, (panel_w - grid_left - 10) / max(L, S), 220 / L)
    for px, title, sub, cols, key_name in (
        (10, "self-attention", "Q, K, V: one sequence x", L, "x"),
        (330, "cross-attention", "Q: decoder; K, V: encoder", S, "encoder"),
    ):
        cx = px + panel_w / 2
        canvas.text(cx, 26, title, size=16, bold=True)
        canvas.text(cx, 48, sub, muted=True)
        gx = px + grid_left
        canvas.text(gx, 76, f"keys (columns): {key_name}, S = {cols}" if key_name != "x"
                    else f"keys (columns): x, S = L = {cols}", anchor="start")
        top = 88
        key_row = min(cell, 18.0)
        canvas.rect(gx, top, cols * cell, key_row, "ar-box ar-k", hue="k", opacity=0.35, stroke_width=1)
        grid_top = top + key_row + 8
        canvas.rect(px + grid_left - 8 - key_row, grid_top, key_row, L * cell, "ar-box ar-q", hue="q",
                    opacity=0.35, stroke_width=1)
        canvas.rect(gx, grid_top, cols * cell, L * cell, "ar-box ar-w", hue="w", opacity=0.2)
        if cell >= 6:
            for r in range(1, L):
                canvas.line(gx, grid_top + r * cell, gx + cols * cell, grid_top + r * cell, "ar-grid",
                            colour=_GRID, width=0.6)
            for c in range(1, cols):
                canvas.line(gx + c * cell, top, gx + c * cell, top + key_row, "ar-grid", colour=_GRID, width=0.6)
                canvas.line(gx + c * cell, grid_top, gx + c * cell, grid_top + L * cell, "ar-grid",
                            colour=_GRID, width=0.6)
            for r in range(1, L):
                canvas.line(px + grid_left - 8 - key_row, grid_top + r * cell, px + grid_left - 8,
                            grid_top + r * cell, "ar-grid", colour=_GRID, width=0.6)
        below = grid_top + L * cell
        query_name = "x" if key_name == "x" else "decoder"
        canvas.text(gx, below + 24, f"queries (rows): {query_name}, L = {L}", anchor="start")
        dims = f"L × L = {_dims(L, L)}" if key_name == "x" else f"L × S = {_dims(L, S)}"
        canvas.text(gx, below + 46, f"weights: {dims}", anchor="start", bold=True)
    height = 88 + min(cell, 18.0) + 8 + L * cell + 60
    canvas.line(320, 12, 320, height - 12, "ar-grid", colour=_GRID, width=1, dashed=True)
    return canvas.render(height)


# --- 5. path length -----------------------------------------------------------------------


def path_length(n: int) -> str:
    """Steps from token 1 to the last token ``n`` (L = n tokens): a recurrent network vs attention.

    Top: a recurrent network passes information along a chain, so token 1
    reaches token ``n`` after ``n - 1`` sequential steps. Bottom: in
    self-attention the last token attends to every token directly (the edges
    drawn), and every pair of tokens is one step apart.

    Args:
        n: the number of tokens, ``2 <= n <= 12``.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: ``n`` not an int.
        ValueError: ``n`` outside ``[2, 12]``.

    Examples:
        >>> from attention_ref import diagrams
        >>> svg = diagrams.path_length(6)
        >>> "L − 1 = 5 sequential steps" in svg
        True
    """
    n = _int("n", n, 2, 12)
    spacing = min(64.0, (_WIDTH - 80) / (n - 1))
    left = (_WIDTH - spacing * (n - 1)) / 2
    xs = [left + i * spacing for i in range(n)]
    r = 15
    canvas = _Canvas(
        f"Path length between token 1 and token {n}: {n - 1} sequential steps in a recurrent network, "
        f"1 step in self-attention"
    )
    canvas.text(20, 28, "recurrent network", size=16, bold=True, anchor="start")
    y1 = 72
    for i, x in enumerate(xs):
        canvas.circle(x, y1, r)
        canvas.text(x, y1 + 5, str(i + 1))
        if i:
            canvas.arrow(xs[i - 1] + r, y1, x - r, y1, head=7)
    canvas.text(_WIDTH / 2, y1 + 42, f"token 1 reaches token {n} only after L − 1 = {n - 1} sequential steps",
                muted=True)

    top = 170
    canvas.text(20, top, "self-attention", size=16, bold=True, anchor="start")
    y2 = top + 30 + 110
    last = xs[-1]
    for x in xs[:-1]:
        rise = 20 + 90 * (last - x) / (last - xs[0])
        cx, cy = (x + last) / 2, y2 - 2 * rise  # control point of a quadratic curve
        # leave and reach the circles in the direction of the control point
        d0, d1 = math.hypot(cx - x, cy - y2), math.hypot(cx - last, cy - y2)
        sx, sy = x + r * (cx - x) / d0, y2 + r * (cy - y2) / d0
        ex, ey = last + (r + 1) * (cx - last) / d1, y2 + (r + 1) * (cy - y2) / d1
        canvas.path(f"M {_num(sx)} {_num(sy)} Q {_num(cx)} {_num(cy)} {_num(ex)} {_num(ey)}", "ar-edge ar-w",
                    stroke=_HUES["w"], width=2)
    for i, x in enumerate(xs):
        canvas.circle(x, y2, r)
        canvas.text(x, y2 + 5, str(i + 1))
    canvas.text(_WIDTH / 2, y2 + 42, f"token {n} attends to every token directly: 1 step, whatever the distance",
                muted=True)
    canvas.text(_WIDTH / 2, y2 + 64, f"every pair is one step apart: L × L = {n * n} scores in one layer",
                muted=True)
    return canvas.render(y2 + 80)


# --- 6. the tiles of flash attention ------------------------------------------------------


def _tile_kinds(L: int, S: int, block_q: int, block_k: int, causal: bool) -> list[list[str]]:
    """Per (query block, key block): "full", "diagonal" (computed, partly masked) or "skipped".

    Causal is top-left aligned (key ``j`` allowed for query ``i`` when ``j <= i``), as in
    `attention_ref.tiled`: a block whose first key comes after its last query is skipped.
    """
    kinds = []
    for i0 in range(0, L, block_q):
        i1 = min(i0 + block_q, L)
        row = []
        for j0 in range(0, S, block_k):
            j1 = min(j0 + block_k, S)
            if not causal:
                row.append("full")
            elif j0 > i1 - 1:
                row.append("skipped")
            elif j1 - 1 > i0:
                row.append("diagonal")
            else:
                row.append("full")
        kinds.append(row)
    return kinds


def flash_tiling(L: int, S: int, block_q: int, block_k: int, causal: bool = False) -> str:
    """The score matrix of flash attention cut into query blocks × key blocks.

    Each query block walks over the key blocks from left to right (numbered
    for the last query block) and keeps, per query row, the running max
    ``m_i``, the running sum ``l_i`` and the accumulator ``acc``. Under a causal
    mask (top-left aligned, as in `attention_ref.tiled`) the blocks right of the
    diagonal are skipped, and blocks on the diagonal are computed with the mask
    (the masked part shaded). The caption counts computed and skipped blocks.

    Args:
        L: query length.
        S: key length.
        block_q: queries per block.
        block_k: keys per block.
        causal: draw the causal mask and the skipped blocks.

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: a size that is not an int, or ``causal`` not a bool.
        ValueError: a size below 1, or more than 24 blocks along an axis.

    Examples:
        >>> from attention_ref import diagrams
        >>> svg = diagrams.flash_tiling(8, 8, 4, 2, causal=True)
        >>> "computed 6" in svg and "skipped 2" in svg
        True
    """
    L, S = _int("L", L, 1), _int("S", S, 1)
    block_q, block_k = _int("block_q", block_q, 1), _int("block_k", block_k, 1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    Tq, Tk = math.ceil(L / block_q), math.ceil(S / block_k)
    for name, count, length, block in (("block_q", Tq, "L", block_q), ("block_k", Tk, "S", block_k)):
        if count > 24:
            raise ValueError(f"{name} must leave at most 24 blocks along {length}, got {count} blocks "
                             f"({length} = {L if length == 'L' else S}, {name} = {block})")
    kinds = _tile_kinds(L, S, block_q, block_k, causal)
    computed = sum(kind != "skipped" for row in kinds for kind in row)
    skipped = Tq * Tk - computed
    diagonal = sum(kind == "diagonal" for row in kinds for kind in row)

    canvas = _Canvas(
        f"Flash attention tiles: the {_dims(L, S)} score matrix in {Tq} query blocks of {block_q} and "
        f"{Tk} key blocks of {block_k}; {computed} blocks computed, {skipped} skipped"
    )
    canvas.text(_WIDTH / 2, 24, f"scores L × S = {_dims(L, S)} in blocks of {block_q} queries × {block_k} keys",
                size=16, bold=True)
    area_w, area_h, left, top = 330.0, 300.0, 56.0, 78.0
    unit = min(area_w / S, area_h / L, 40.0)
    mw, mh = unit * S, unit * L
    canvas.text(left + mw / 2, top - 26, f"keys: {Tk} blocks", anchor="middle")
    for qi, row in enumerate(kinds):
        y0, y1 = qi * block_q * unit, min((qi + 1) * block_q, L) * unit
        for kj, kind in enumerate(row):
            x0, x1 = kj * block_k * unit, min((kj + 1) * block_k, S) * unit
            x, y, w, h = left + x0, top + y0, x1 - x0, y1 - y0
            if kind == "skipped":
                canvas.rect(x, y, w, h, "ar-tile ar-skip", fill=_BG, dashed=True, stroke_width=1)
                continue
            canvas.rect(x, y, w, h, "ar-tile ar-w", hue="w", opacity=0.28, stroke_width=1.5)
            if kind == "diagonal":
                canvas.path(_masked_region(qi * block_q, min((qi + 1) * block_q, L), kj * block_k,
                                           min((kj + 1) * block_k, S), unit, left, top),
                            "ar-masked", fill=_GRID, stroke="none", width=0, opacity=0.55)
    # query block labels on the left, one per block when there is room
    block_h = block_q * unit
    for qi in range(Tq):
        if block_h >= 18:
            y_mid = top + (qi * block_q + min((qi + 1) * block_q, L)) * unit / 2
            canvas.text(left - 8, y_mid + 5, f"Q{qi + 1}", anchor="end")
    block_w = block_k * unit
    for kj in range(Tk):
        if block_w >= 26:
            x_mid = left + (kj * block_k + min((kj + 1) * block_k, S)) * unit / 2
            canvas.text(x_mid, top - 6, f"K{kj + 1}")
    # the order in which the last query block visits the key blocks
    last_row = kinds[-1]
    visited = [kj for kj, kind in enumerate(last_row) if kind != "skipped"]
    y_last0 = (Tq - 1) * block_q * unit
    canvas.rect(left - 3, top + y_last0 - 3, mw + 6, mh - y_last0 + 6, "ar-focus", fill="none",
                stroke=_ACCENT, stroke_width=2.5)
    h_last = mh - y_last0
    if min(block_w, h_last) >= 18:
        for order, kj in enumerate(visited, start=1):
            x_mid = left + (kj * block_k + min((kj + 1) * block_k, S)) * unit / 2
            canvas.text(x_mid, top + y_last0 + h_last / 2 + 6, str(order), bold=True, size=15)

    # the state of one query block, beside the matrix
    px = left + mw + 40
    pw = _WIDTH - 16 - px
    rows_last = L - (Tq - 1) * block_q
    state = [
        (f"query block Q{Tq}", True),
        (f"rows {(Tq - 1) * block_q}–{L - 1}, {rows_last} queries", False),
        (f"visits K{visited[0] + 1} → K{visited[-1] + 1} in order" if len(visited) > 1
         else f"visits K{visited[0] + 1} only", False),
        ("keeps per row:", True),
        ("m_{i}: running max", False),
        ("l_{i}: running sum", False),
        (f"acc: {rows_last} × Ev", False),
        ("then out = acc / l_{i}", False),
    ]
    # shrink to fit the panel: the widest line decides the font size (never below 13)
    size = float(_FONT)
    while size > _MIN_FONT + 1 and max(_text_width(t, size) for t, _ in state) > pw:
        size -= 1
    sy = top + 14
    for content, bold in state:
        canvas.text(px, sy, content, anchor="start", bold=bold, size=size)
        sy += size + 9
    # legend and counts
    ly = top + max(mh, sy - top) + 28
    canvas.rect(left, ly - 13, 18, 16, "ar-tile ar-w", hue="w", opacity=0.28, stroke_width=1.5)
    canvas.text(left + 26, ly, "computed", anchor="start")
    lx = left + 26 + _text_width("computed") + 16
    if causal:
        canvas.rect(lx, ly - 13, 18, 16, "ar-masked", fill=_GRID, opacity=0.55, stroke_width=0)
        canvas.text(lx + 26, ly, "masked (j > i)", anchor="start")
        lx += 26 + _text_width("masked (j > i)") + 16
        canvas.rect(lx, ly - 13, 18, 16, "ar-tile ar-skip", fill=_BG, dashed=True, stroke_width=1)
        canvas.text(lx + 26, ly, "skipped", anchor="start")
    caption = f"{Tq} × {Tk} = {Tq * Tk} blocks: computed {computed}, skipped {skipped}"
    if causal:
        caption += f" ({diagonal} cut by the diagonal)"
    canvas.text(_WIDTH / 2, ly + 30, caption, bold=True)
    return canvas.render(ly + 42)


def _masked_region(i0: int, i1: int, j0: int, j1: int, unit: float, left: float, top: float) -> str:
    """The outline of the cells with ``j > i`` among rows ``i0:i1`` and columns ``j0:j1``.

    Row ``i`` is masked from column ``max(i + 1, j0)`` to ``j1``. With cells of at least 4
    units the outline follows the cell edges (a staircase); smaller cells get the straight
    diagonal, so a large matrix does not cost one path point per row.
    """
    last = min(i1, j1 - 1)  # rows from `last` on have nothing masked in this block
    if unit >= 4:
        edge = []
        for i in range(i0, last):
            start = max(i + 1, j0)
            edge += [(start, i), (start, i + 1)]
    else:
        rows = sorted({i0, last, *(r for r in (j0 - 1,) if i0 < r < last)})
        edge = [(min(max(y + 1, j0), j1), y) for y in rows]
    outline = [(j1, i0), *edge, (j1, last)]
    return " ".join(
        f"{'M' if n == 0 else 'L'} {_num(left + x * unit)} {_num(top + y * unit)}" for n, (x, y) in enumerate(outline)
    ) + " Z"


# ---- the Transformer block around attention (6b) ------------------------------------------------
# Narrow enough to be drawn at its own size in a phone's text column (about 350 CSS px at
# 390 px): a vertical diagram does not need the 640 units of the wide ones.
_NARROW = 340
_MAIN_X = 30  # left edge of the main column's boxes
_MAIN_W = 220  # their width
_RESIDUAL_X = 300  # the bypass lines of the residual connections


def transformer_block(attention: MultiHeadAttention, x: torch.Tensor, *, mlp_width: int) -> str:
    """A pre-norm Transformer block: norm, attention, residual add; norm, MLP, residual add.

    Top to bottom: the input ``x`` (L × d); LayerNorm; multi-head self-attention
    (the only step where tokens exchange information); the residual connection
    adds the input back; LayerNorm; an MLP applied to each token alone
    (d → ``mlp_width`` → d); a second residual add; the output, L × d again.
    This is the arrangement of GPT-2 and most models since (the norm inside each
    residual branch); Vaswani et al. (2017) put the norm after each add instead.
    The sizes come from ``attention`` and ``x``.

    The SVG is 340 units wide (one unit is one CSS pixel, so a phone shows it at
    its own size) and uses the classes of the other diagrams here.

    Args:
        attention: the block's `attention_ref.MultiHeadAttention` (self-attention:
            ``kdim == vdim == embed_dim``).
        x: the block's input, ``(B, L, d)`` or ``(L, d)`` with ``d = attention.embed_dim``.
        mlp_width: the width of the MLP's hidden layer (often ``4 * d``).

    Returns:
        An ``<svg>`` element as a string.

    Raises:
        TypeError: ``attention`` not a ``MultiHeadAttention``, ``x`` not a tensor
            or array, ``mlp_width`` not an int.
        ValueError: ``x`` not 2 or 3 dims or its last dim not ``embed_dim``, a
            cross-attention module (``kdim`` or ``vdim`` not ``embed_dim``),
            ``mlp_width`` below 1.

    Examples:
        >>> import torch
        >>> from attention_ref import MultiHeadAttention
        >>> from attention_ref.diagrams import transformer_block
        >>> attention = MultiHeadAttention(16, 2)
        >>> svg = transformer_block(attention, torch.zeros(5, 16), mlp_width=64)
        >>> "L × d = 5 × 16" in svg and "16 → 64 → 16" in svg
        True
    """
    shape = _self_attention_input("attention", attention, x)
    d, H = attention.embed_dim, attention.num_heads
    width = _int("mlp_width", mlp_width, 1)
    L = shape[-2]
    heads = "1 head" if H == 1 else f"{H} heads"

    canvas = _Canvas(
        f"A pre-norm Transformer block: x ({_dims(L, d)}) goes through LayerNorm and multi-head "
        f"attention ({heads}), which is added back to x; then through LayerNorm and an MLP "
        f"({d} to {width} to {d}, each token alone), which is added back; the output is {_dims(L, d)}"
    )
    mid, right = _MAIN_X + _MAIN_W / 2, _MAIN_X + _MAIN_W
    canvas.text(_NARROW / 2, 24, "a Transformer block (pre-norm)", size=16, bold=True)
    canvas.text(_NARROW / 2, 46, f"d = {d}, H = {H}, MLP width {width}", muted=True)

    y = 62
    canvas.box(_MAIN_X, y, _MAIN_W, 48, ["x", f"L × d = {_dims(L, d)}"])
    y += 48

    def sublayer(y: float, lines: list[str], hue: str) -> float:
        """LayerNorm, the sublayer, and the add of the residual that bypasses both."""
        branch = y + 16
        canvas.arrow(mid, y, mid, y + 36)
        canvas.box(_MAIN_X, y + 36, _MAIN_W, 36, ["LayerNorm"])
        canvas.arrow(mid, y + 72, mid, y + 98)
        canvas.box(_MAIN_X, y + 98, _MAIN_W, 56, lines, hue=hue)
        add = y + 154 + 26 + 14  # the centre of the ⊕ node
        canvas.arrow(mid, y + 154, mid, add - 14)
        canvas.circle(mid, add, 14)
        canvas.text(mid, add + 6, "+", size=18, bold=True)
        # the residual: around the sublayer, into the side of the ⊕ node
        canvas.line(mid, branch, _RESIDUAL_X, branch)
        canvas.line(_RESIDUAL_X, branch, _RESIDUAL_X, add)
        canvas.arrow(_RESIDUAL_X, add, mid + 14, add)
        canvas.text(right + 6, branch - 6, "residual", anchor="start", muted=True)
        return add + 14

    y = sublayer(y, ["attention, " + heads, "tokens look at each other"], "w")
    y = sublayer(y, ["MLP, each token alone", f"{d} → {width} → {d}"], "v")
    canvas.arrow(mid, y, mid, y + 28)
    y += 28
    canvas.box(_MAIN_X, y, _MAIN_W, 48, ["output", f"L × d = {_dims(L, d)}"], hue="o")
    return canvas.render(y + 60, width=_NARROW)
