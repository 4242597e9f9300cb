"""Tests of attention_ref.viz: real matplotlib figures, SVG output, the explorer fragment."""

from __future__ import annotations

import base64
import html.parser
import json
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason="attention_ref.viz figures need matplotlib (the plot extra)")

from matplotlib.figure import Figure  # noqa: E402

from attention_ref import attention_weights, causal_mask, viz  # noqa: E402
from attention_ref.viz import (  # noqa: E402
    explorer_html,
    head_grid,
    head_grid_html,
    heatmap,
    heatmaps,
    map_slider_html,
    to_svg,
)

SVG = "{http://www.w3.org/2000/svg}"
TOKENS = ["the", "bank", "of", "the", "river"]


def weights(*shape: int, seed: int = 0) -> torch.Tensor:
    """Real attention weights of shape ``(..., L, S)`` from the functional core."""
    g = torch.Generator().manual_seed(seed)
    *lead, L, S = shape
    return attention_weights(torch.randn(*lead, L, 4, generator=g), torch.randn(*lead, S, 4, generator=g))


def tick_texts(ax, axis: str) -> list[str]:
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in labels]


def image_axes(fig: Figure) -> list:
    return [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]


def colorbar_labels(fig: Figure) -> list[str]:
    return [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]


def shown_tick_texts(ax, axis: str) -> list[str]:
    """The tick labels a reader sees (empty when the axis hides them)."""
    axis_ = ax.xaxis if axis == "x" else ax.yaxis
    return [t.get_text() for t in axis_.get_ticklabels() if t.get_visible() and t.get_text()]


# The site's text column is 690-750 px wide at a 1280 px viewport; matplotlib's SVG maps
# 1 in to 96 px: a figure at most 7 in wide is shown unscaled, so 9 pt text renders at 12 px.
MAX_WIDTH_IN, MIN_FONT_PT = 7.0, 9.0


def assert_readable(fig: Figure) -> None:
    """The figure fits the column, its text is >= 9 pt, and no two tick labels of an axis overlap."""
    from matplotlib.text import Text

    width, height = fig.get_size_inches()
    assert width <= MAX_WIDTH_IN + 1e-9, f"figure {width:.2f} in wide: scaled down in the column"
    assert height <= 10.0 + 1e-9
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lay the figure out (constrained layout) and measure its text
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < MIN_FONT_PT]
    assert not small, f"text under {MIN_FONT_PT} pt: {small[:5]}"
    figure_box = fig.bbox
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), f"tick labels overlap on {ax.get_title() or ax.get_label()!r}"
    for t in texts:  # nothing drawn outside the figure
        box = t.get_window_extent(renderer)
        assert box.x0 >= figure_box.x0 - 1 and box.x1 <= figure_box.x1 + 1, t.get_text()
        assert box.y0 >= figure_box.y0 - 1 and box.y1 <= figure_box.y1 + 1, t.get_text()


# --- heatmap -----------------------------------------------------------------


def test_heatmap_labels_ticks_and_colorbar():
    w = weights(5, 7)  # (L, S) distinct sizes: a swapped axis fails
    keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6"]
    fig = heatmap(w, TOKENS, keys, title="one head")
    assert isinstance(fig, Figure)
    (ax,) = image_axes(fig)
    assert ax.get_xlabel() == "key"
    assert ax.get_ylabel() == "query"
    assert ax.get_title() == "one head"
    assert tick_texts(ax, "x") == keys
    assert tick_texts(ax, "y") == TOKENS
    image = ax.images[0]
    assert image.get_array().shape == (5, 7)
    np.testing.assert_allclose(image.get_array(), w.numpy(), atol=1e-7)
    assert image.get_clim() == (0.0, 1.0)
    assert colorbar_labels(fig) == ["attention weight"]  # one colorbar, saying what it measures
    assert image.colorbar is not None
    assert_readable(fig)


def test_heatmap_self_attention_uses_query_labels_for_keys():
    fig = heatmap(weights(5, 5), TOKENS)
    (ax,) = image_axes(fig)
    assert tick_texts(ax, "x") == TOKENS
    assert tick_texts(ax, "y") == TOKENS


def test_heatmap_without_labels_uses_indices_and_accepts_numpy_and_lists():
    fig = heatmap(weights(3, 2).numpy())
    (ax,) = image_axes(fig)
    assert tick_texts(ax, "x") == ["0", "1"]
    assert tick_texts(ax, "y") == ["0", "1", "2"]
    assert isinstance(heatmap([[0.5, 0.5]]), Figure)


def test_heatmap_draws_into_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert heatmap(weights(5, 5), TOKENS, ax=ax) is fig
    assert ax.images and tick_texts(ax, "y") == TOKENS


def test_heatmap_annotate_writes_each_value():
    w = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    fig = heatmap(w, ["a", "b"], annotate=True)
    (ax,) = image_axes(fig)
    assert sorted(t.get_text() for t in ax.texts) == sorted(["0.25", "0.75", "1.00", "0.00"])
    assert all(t.get_fontsize() >= MIN_FONT_PT for t in ax.texts)
    assert_readable(fig)


@pytest.mark.parametrize("as_type", [lambda m: m, lambda m: m.numpy(), lambda m: m.tolist()])
def test_heatmap_of_a_boolean_mask_says_so(as_type):
    keep = causal_mask(3)  # bool, True = the pair takes part
    fig = heatmap(as_type(keep), ["a", "b", "c"], annotate=True)
    (ax,) = image_axes(fig)
    assert colorbar_labels(fig) == ["mask (1 = takes part)"]
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == ["0", "1"]
    assert [t.get_text() for t in ax.texts] == ["1", "0", "0", "1", "1", "0", "1", "1", "1"]  # row by row
    # the same mask as floats is drawn the same, but as numbers: nothing says it is a mask
    floats = heatmap(keep.float(), annotate=True)
    assert colorbar_labels(floats) == ["attention weight"]
    assert image_axes(floats)[0].texts[0].get_text() == "1.00"


def test_heatmap_colorbar_label():
    assert colorbar_labels(heatmap(weights(3, 3), colorbar_label="p(key | query)")) == ["p(key | query)"]
    assert colorbar_labels(heatmap(causal_mask(3), colorbar_label="allowed")) == ["allowed"]
    with pytest.raises(TypeError, match=r"colorbar_label must be a str or None, got int"):
        heatmap(weights(3, 3), colorbar_label=1)


@pytest.mark.parametrize(("L", "S"), [(1, 1), (5, 7), (12, 12), (40, 60), (3, 200)])
def test_heatmap_fits_the_column_with_readable_labels(L, S):
    labels = [f"tok{i}" for i in range(S)]
    fig = heatmap(weights(L, S), key_labels=labels, title="a title of some length")
    assert_readable(fig)
    (ax,) = image_axes(fig)
    shown = tick_texts(ax, "x")
    step = 1 if len(shown) == S else int(shown[1][3:])
    # every step-th key labelled from the first, the last one in place of the last of them
    expected = labels[::step]
    if len(expected) > 1:
        expected[-1] = labels[-1]
    assert shown == expected
    assert_readable(heatmap(weights(L, S)))  # index labels, written horizontally


def test_heatmap_into_given_axes_keeps_every_label():
    fig = Figure(figsize=(3, 3))
    heatmap(weights(30, 30), ax=fig.add_subplot())
    assert tick_texts(image_axes(fig)[0], "x") == [str(j) for j in range(30)]  # the caller sized it


def test_figures_have_an_opaque_light_background_and_dark_text():
    import matplotlib
    from matplotlib.colors import to_rgba

    with matplotlib.rc_context({"figure.facecolor": "black", "text.color": "white"}):  # a user's dark style
        fig = heatmap(weights(5, 5), TOKENS, title="t")
    (ax,) = image_axes(fig)
    assert to_rgba(fig.get_facecolor()) == (1.0, 1.0, 1.0, 1.0)
    assert sum(to_rgba(ax.title.get_color())[:3]) < 0.5
    assert sum(to_rgba(ax.xaxis.label.get_color())[:3]) < 0.5


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.rand(2, 3, 4), ValueError, r"weights must have 2 dims \(L, S\), got 3 dims with shape \(2, 3, 4\)"),
        (torch.rand(4), ValueError, r"weights must have 2 dims \(L, S\), got 1 dims"),
        (torch.full((2, 2), 1.5), ValueError, r"weights must be attention weights in \[0, 1\], got .* \[1.5, 1.5\]"),
        (torch.full((2, 2), float("nan")), ValueError, r"weights must be finite"),
        ("abc", TypeError, r"weights must be a tensor or array of numbers, got str"),
    ],
)
def test_heatmap_rejects_bad_weights(bad, error, match):
    with pytest.raises(error, match=match):
        heatmap(bad)


def test_heatmap_rejects_bad_labels():
    w = weights(5, 7)
    with pytest.raises(ValueError, match=r"query_labels must have one label per query row L \(5\), got 4"):
        heatmap(w, TOKENS[:4])
    with pytest.raises(ValueError, match=r"key_labels must have one label per key column S \(7\), got 5"):
        heatmap(w, TOKENS, TOKENS)
    with pytest.raises(TypeError, match=r"query_labels must be a sequence of labels .* got str"):
        heatmap(weights(5, 5), "abcde")


# --- head_grid ---------------------------------------------------------------


def test_head_grid_one_panel_per_head_shared_scale_one_colorbar():
    w = weights(3, 5, 7)  # (H, L, S)
    keys = [f"k{j}" for j in range(7)]
    fig = head_grid(w, TOKENS, keys, ncols=2, title="all heads")
    panels = image_axes(fig)
    assert len(panels) == 3
    for h, ax in enumerate(panels):
        assert ax.get_title() == f"head {h}"
        assert ax.images[0].get_clim() == (0.0, 1.0)
        np.testing.assert_allclose(ax.images[0].get_array(), w[h].numpy(), atol=1e-7)
    # labels on the outer panels: the left column's rows, the lowest panel of each column
    # (heads 1 and 2: head 1 has no panel below it)
    assert [shown_tick_texts(ax, "y") for ax in panels] == [TOKENS, [], TOKENS]
    assert [shown_tick_texts(ax, "x") for ax in panels] == [[], keys, keys]
    assert [ax.get_xlabel() for ax in panels] == ["", "key", "key"]
    assert [ax.get_ylabel() for ax in panels] == ["query", "", "query"]
    assert colorbar_labels(fig) == ["attention weight"]
    assert fig.get_suptitle() == "all heads"
    # a 2 x 2 grid for 3 heads: the fourth axes is switched off
    assert sum(1 for a in fig.axes if not a.axison) == 1
    assert_readable(fig)


@pytest.mark.parametrize(("H", "L", "ncols"), [(12, 10, 3), (4, 5, 4), (12, 5, 4), (2, 10, 2), (8, 30, 1)])
def test_head_grid_default_columns_fit_readable_panels(H, L, ncols):
    tokens = ["[CLS]", "the", "bank", "of", "the", "river", "was", "flooded", ".", "[SEP]"] * 3
    fig = head_grid(weights(H, L, L), tokens[:L])
    panels = image_axes(fig)
    assert len(panels) == H
    assert fig.axes[0].get_gridspec().ncols == ncols
    assert_readable(fig)


def test_head_grid_with_too_many_columns_thins_labels_but_stays_readable():
    fig = head_grid(weights(12, 10, 10), ncols=12)  # one row of 12 panels of 10 keys
    assert fig.get_size_inches()[0] <= MAX_WIDTH_IN
    bottom = image_axes(fig)[0]
    assert 1 < len(shown_tick_texts(bottom, "x")) < 10
    assert_readable(fig)


def test_head_grid_colorbar_label():
    assert colorbar_labels(head_grid(weights(2, 3, 3), colorbar_label="p")) == ["p"]
    assert colorbar_labels(head_grid(causal_mask(3).expand(2, 3, 3))) == ["mask (1 = takes part)"]
    with pytest.raises(TypeError, match=r"colorbar_label must be a str or None, got list"):
        head_grid(weights(2, 3, 3), colorbar_label=["p"])


def test_head_grid_names_and_errors():
    w = weights(2, 3, 3)
    fig = head_grid(w, ["a", "b", "c"], head_names=["syntax", "position"])
    assert [ax.get_title() for ax in image_axes(fig)] == ["syntax", "position"]
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, S\), got 2 dims with shape \(3, 3\)"):
        head_grid(w[0])
    with pytest.raises(ValueError, match=r"ncols must be a positive int or None, got 0"):
        head_grid(w, ncols=0)
    with pytest.raises(ValueError, match=r"ncols must be a positive int or None, got True"):
        head_grid(w, ncols=True)
    with pytest.raises(ValueError, match=r"head_names must have one name per head \(2\), got 1"):
        head_grid(w, head_names=["x"])
    with pytest.raises(ValueError, match=r"weights must hold at least one head, got shape \(0, 3, 3\)"):
        head_grid(torch.zeros(0, 3, 3))


# --- heatmaps ----------------------------------------------------------------


def test_heatmaps_mask_and_weights_side_by_side():
    keep = causal_mask(5)
    w = attention_weights(torch.randn(5, 4), torch.randn(5, 4), keep)
    fig = heatmaps([keep, w], TOKENS, titles=["mask", "weights"], annotate=True)
    mask_ax, weight_ax = image_axes(fig)
    assert [mask_ax.get_title(), weight_ax.get_title()] == ["mask", "weights"]
    assert colorbar_labels(fig) == ["mask (1 = takes part)", "attention weight"]
    np.testing.assert_array_equal(mask_ax.images[0].get_array(), keep.float().numpy())
    np.testing.assert_allclose(weight_ax.images[0].get_array(), w.numpy(), atol=1e-7)
    assert mask_ax.texts[1].get_text() == "0" and weight_ax.texts[0].get_text() == "1.00"
    assert len(mask_ax.texts) == len(weight_ax.texts) == 25
    # one row; the query labels on the first panel, the key labels on both
    assert mask_ax.get_subplotspec().colspan.start == 0 and weight_ax.get_subplotspec().colspan.start == 1
    assert shown_tick_texts(mask_ax, "y") == TOKENS and shown_tick_texts(weight_ax, "y") == []
    assert shown_tick_texts(mask_ax, "x") == shown_tick_texts(weight_ax, "x") == TOKENS
    assert_readable(fig)


def test_heatmaps_colorbar_labels_one_for_all_or_one_each():
    w = weights(3, 3)
    assert colorbar_labels(heatmaps([w, w], colorbar_labels="p")) == ["p", "p"]
    assert colorbar_labels(heatmaps([w, causal_mask(3)], colorbar_labels=["p", None])) == [
        "p", "mask (1 = takes part)"]
    assert colorbar_labels(heatmaps((w,))) == ["attention weight"]  # a tuple is fine


@pytest.mark.parametrize(("n", "L", "annotate"), [(2, 8, True), (3, 5, True), (3, 24, False)])
def test_heatmaps_fit_the_column(n, L, annotate):
    tokens = [f"token{i}" for i in range(L)]
    assert_readable(heatmaps([weights(L, L, seed=k) for k in range(n)], tokens, annotate=annotate))


def test_heatmaps_rejects_bad_input():
    w = weights(3, 3)
    with pytest.raises(TypeError, match=r"matrices must be a list of \(L, S\) matrices, got Tensor"):
        heatmaps(torch.stack([w, w]))
    with pytest.raises(ValueError, match=r"matrices must hold at least one matrix, got none"):
        heatmaps([])
    with pytest.raises(ValueError, match=r"matrices\[1\] must have 2 dims \(L, S\), got 3 dims"):
        heatmaps([w, w[None]])
    with pytest.raises(ValueError, match=r"matrices\[0\] must be attention weights in \[0, 1\]"):
        heatmaps([w * 3, w])
    with pytest.raises(ValueError, match=r"matrices must all have the same shape \(L, S\), got \[\(3, 3\), \(3, 4\)\]"):
        heatmaps([w, weights(3, 4)])
    with pytest.raises(ValueError, match=r"titles must have one title per matrix \(2\), got 1"):
        heatmaps([w, w], titles=["one"])
    with pytest.raises(ValueError, match=r"titles must have one title per matrix \(2\), got a str"):
        heatmaps([w, w], titles="ab")
    with pytest.raises(ValueError, match=r"colorbar_labels must be a str or one label per matrix \(2\), got 3"):
        heatmaps([w, w], colorbar_labels=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"colorbar_labels must be a str or one label per matrix \(2\), got int"):
        heatmaps([w, w], colorbar_labels=5)
    with pytest.raises(TypeError, match=r"colorbar_labels\[1\] must be a str or None, got int"):
        heatmaps([w, w], colorbar_labels=["a", 2])
    with pytest.raises(ValueError, match=r"query_labels must have one label per query row L \(3\), got 2"):
        heatmaps([w, w], ["a", "b"])


# --- to_svg ------------------------------------------------------------------


def test_to_svg_is_parseable_inline_svg_with_the_tokens():
    svg = to_svg(heatmap(weights(5, 5), TOKENS, title="one head"))
    assert svg.startswith("<svg")
    assert "<?xml" not in svg and "<!DOCTYPE" not in svg
    assert "\n\n" not in svg  # no blank line that could end an HTML block in Markdown
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    assert "viewBox" in root.attrib
    texts = {"".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")}
    assert set(TOKENS) | {"key", "query", "one head", "attention weight"} <= texts
    assert "Date" not in svg and "<dc:date>" not in svg


def test_to_svg_is_deterministic_and_differs_between_figures():
    w = weights(5, 5)
    first = to_svg(heatmap(w, TOKENS))
    second = to_svg(heatmap(w, TOKENS))
    assert first == second
    assert to_svg(heatmap(weights(5, 5, seed=1), TOKENS)) != first
    grid = head_grid(weights(3, 5, 5), TOKENS)
    assert to_svg(grid) == to_svg(head_grid(weights(3, 5, 5), TOKENS))
    pair = [causal_mask(5), weights(5, 5)]
    assert to_svg(heatmaps(pair, annotate=True)) == to_svg(heatmaps(pair, annotate=True))


def test_to_svg_keeps_the_text_size_for_the_page():
    """The SVG says its size in pt and its text in user units: 9 pt labels stay 9 pt."""
    svg = to_svg(head_grid(weights(12, 10, 10), TOKENS * 2))
    root = ET.fromstring(svg)
    width_pt = float(root.attrib["width"].removesuffix("pt"))
    assert width_pt <= MAX_WIDTH_IN * 72
    assert root.attrib["viewBox"].split()[2] == root.attrib["width"].removesuffix("pt")
    import re

    sizes = [float(s) for s in re.findall(r"font[^;\"]*?(\d+(?:\.\d+)?)px", svg)]
    assert sizes and min(sizes) >= MIN_FONT_PT


def test_to_svg_closes_pyplot_figures():
    import matplotlib.pyplot as plt  # headless here: pyplot picks Agg

    fig, ax = plt.subplots()
    heatmap(weights(5, 5), TOKENS, ax=ax)
    assert plt.fignum_exists(fig.number)
    svg = to_svg(fig)
    assert svg.startswith("<svg")
    assert not plt.fignum_exists(fig.number)


def test_to_svg_rejects_non_figures():
    with pytest.raises(TypeError, match=r"figure must be a matplotlib.figure.Figure, got str"):
        to_svg("not a figure")


def test_to_svg_with_a_caption_wraps_the_same_svg_in_a_figure():
    def fig():
        return heatmap(weights(5, 5), TOKENS, title="one head")

    bare = to_svg(fig())
    assert bare.startswith("<svg") and "<figure" not in bare and "figcaption" not in bare
    assert to_svg(fig(), caption=None) == bare == to_svg(fig(), caption="")  # no caption: as before
    boxed = to_svg(fig(), caption="Each row sums to 1.")
    assert boxed == ('<figure class="ar-figure-box">\n' + bare
                     + "<figcaption>Each row sums to 1.</figcaption>\n</figure>\n")
    assert "\n\n" not in boxed
    root = ET.fromstring(boxed)  # one well-formed element: figure > svg, figcaption
    assert root.tag == "figure" and root.attrib == {"class": "ar-figure-box"}
    svg, caption = list(root)
    assert svg.tag == f"{SVG}svg" and svg.attrib["aria-label"] == "one head" and svg.attrib["role"] == "img"
    assert caption.tag == "figcaption" and caption.text == "Each row sums to 1."


def test_to_svg_escapes_the_caption():
    text = 'The <pad> key & "the" get <b>0</b>'
    boxed = to_svg(heatmap(weights(2, 2)), caption=text)
    assert "<pad>" not in boxed and "<b>" not in boxed
    assert ET.fromstring(boxed).find("figcaption").text == text  # exact after unescaping
    with pytest.raises(TypeError, match=r"caption must be a str or None, got int"):
        to_svg(heatmap(weights(2, 2)), caption=3)


def _head_grid_parts(fragment: str):
    root = ET.fromstring(fragment)
    assert root.tag == "figure" and root.attrib["class"] == "ar-figure-box"
    grid = root.find("div")
    assert grid is not None and grid.attrib["class"] == "ar-head-grid"
    return root, grid, list(grid)


def test_head_grid_html_one_labelled_svg_per_head_in_a_css_grid():
    w = weights(5, 5, 7)  # (H, L, S): distinct sizes
    keys = list("abcdefg")
    fragment = head_grid_html(w, TOKENS, keys, title="all <heads>", caption="Look at head 3.")
    assert "\n\n" not in fragment and "<heads>" not in fragment
    root, grid, heads = _head_grid_parts(fragment)
    title, *_ = list(root)
    assert title.tag == "p" and title.attrib["class"] == "ar-head-grid-title" and title.text == "all <heads>"
    # 216 px panels: 3 fit the 672 px column at their own size; 2 per row on a phone
    assert grid.attrib["style"] == "--ar-head-columns: 3; --ar-head-columns-phone: 2"
    assert len(heads) == 5
    for h, svg in enumerate(heads):
        assert svg.tag == f"{SVG}svg" and svg.attrib["role"] == "img"
        assert svg.attrib["aria-label"] == f"head {h}"
        assert float(svg.attrib["width"].removesuffix("pt")) <= 2.25 * 72  # 216 px
        texts = {"".join(t.itertext()).strip() for t in svg.iter(f"{SVG}text")}
        # each head stands alone wherever the row breaks: labelled on both axes, titled
        assert set(TOKENS) | set(keys) | {"key", "query", f"head {h}"} <= texts
        sizes = [float(x) for x in re.findall(r"font[^;\"]*?(\d+(?:\.\d+)?)px", ET.tostring(svg, "unicode"))]
        assert sizes and min(sizes) >= MIN_FONT_PT
    # the shared scale: one colour bar after the grid, then the caption
    bar, caption = list(root)[2:]
    assert bar.tag == f"{SVG}svg" and "ar-head-grid-colorbar" in bar.attrib["class"]
    assert bar.attrib["aria-label"] == "colour scale: attention weight, from 0 to 1"
    assert "attention weight" in {"".join(t.itertext()).strip() for t in bar.iter(f"{SVG}text")}
    assert caption.tag == "figcaption" and caption.text == "Look at head 3."


def test_head_grid_html_heads_are_readable_figures(monkeypatch):
    """Each head's figure, before it becomes SVG, fits its panel with no text under 9 pt and no overlap."""
    checked = []
    original = viz._svg

    def check(figure, label=None):
        if label and label.startswith("head"):
            assert_readable(figure)
            checked.append(label)
        return original(figure, label)

    monkeypatch.setattr(viz, "_svg", check)
    tokens = ["[CLS]", "the", "bank", "of", "the", "river", "was", "flooded", ".", "[SEP]"]
    head_grid_html(weights(12, 10, 10), tokens)
    assert checked == [f"head {h}" for h in range(12)]


def test_head_grid_html_columns_names_mask_and_errors():
    _, grid, heads = _head_grid_parts(head_grid_html(weights(1, 3, 3)))
    assert grid.attrib["style"] == "--ar-head-columns: 1; --ar-head-columns-phone: 1"  # one head: one column
    _, grid, heads = _head_grid_parts(head_grid_html(weights(4, 3, 3), ncols=4, head_names=list("abcd")))
    assert grid.attrib["style"] == "--ar-head-columns: 4; --ar-head-columns-phone: 2"
    assert [svg.attrib["aria-label"] for svg in heads] == list("abcd")
    root, _, _ = _head_grid_parts(head_grid_html(causal_mask(3)[None].expand(2, 3, 3)))
    assert root.find("figcaption") is None and root.find("p") is None  # no caption, no title: none drawn
    assert list(root)[-1].attrib["aria-label"] == "colour scale: mask (1 = takes part), from 0 to 1"
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, S\), got 2 dims"):
        head_grid_html(weights(3, 3))
    with pytest.raises(ValueError, match=r"ncols must be a positive int or None, got 0"):
        head_grid_html(weights(2, 3, 3), ncols=0)
    with pytest.raises(ValueError, match=r"head_names must have one name per head \(2\), got 1"):
        head_grid_html(weights(2, 3, 3), head_names=["a"])
    with pytest.raises(TypeError, match=r"caption must be a str or None, got int"):
        head_grid_html(weights(2, 3, 3), caption=1)


# --- optional dependency -------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_attention_ref_does_not_import_matplotlib():
    result = run_python(
        """
        import sys
        import attention_ref, attention_ref.viz
        assert "matplotlib" not in sys.modules, sorted(m for m in sys.modules if m.startswith("matplotlib"))
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_viz_without_matplotlib_raises_a_clear_import_error():
    result = run_python(
        """
        import sys
        sys.modules["matplotlib"] = None  # as if it were not installed
        import torch
        from attention_ref.viz import explorer_html, heatmap
        explorer_html(["a"], torch.ones(1, 1, 1))  # plain HTML: no matplotlib needed
        try:
            heatmap(torch.ones(1, 1))
        except ImportError as error:
            print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "attention_ref.viz needs matplotlib" in result.stdout
    assert 'pip install "attention-ref[plot]"' in result.stdout


def test_figures_leave_the_pyplot_backend_alone():
    result = run_python(
        """
        import matplotlib
        matplotlib.use("svg")
        from attention_ref.viz import heatmap, to_svg
        to_svg(heatmap([[1.0]]))
        print(matplotlib.get_backend(), "matplotlib.pyplot" in __import__("sys").modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "False"]


# --- explorer_html -------------------------------------------------------------


class _Collect(html.parser.HTMLParser):
    """Collect the tags and the JSON of an explorer fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.buttons: list[str] = []
        self.options: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("button", "option"):
            self._in = tag
            if tag == "button":
                self.buttons.append("")
            if tag == "option":
                self.options.append("")

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "button":
            self.buttons[-1] += data
        elif self._in == "option":
            self.options[-1] += data


def test_explorer_html_embeds_the_data_and_accessible_controls():
    tokens = ["[CLS]", "a", "<b>", "&", '"q"']
    w = weights(3, 5, 5)
    fragment = explorer_html(tokens, w, head_names=["x", "y", "z"], element_id="ex1", initial_head=1, initial_token=2)
    assert "\n\n" not in fragment
    parsed = _Collect()
    parsed.feed(fragment)
    tag, attrs = parsed.tags[0]
    assert tag == "div" and attrs["class"] == "attention-explorer" and attrs["id"] == "ex1"
    assert not any(t == "script" for t, _ in parsed.tags)  # Material's instant navigation would run it
    data = json.loads(attrs["data-attention"])  # unescaped by the HTML parser, as by the browser
    [model] = data["models"]
    assert model["heads"] == ["x", "y", "z"] and model["layers"] == ["layer 0"]
    [sentence] = model["sentences"]
    assert sentence["tokens"] == tokens and sentence["initial"] == 2
    np.testing.assert_allclose(_unpack(model, sentence)[0], w.numpy()[None], atol=5e-5)  # (1, H, L, L)
    assert not any(t == "select" and "layer" in a["class"] for t, a in parsed.tags)  # one layer: no menu
    assert parsed.buttons == [*tokens, "attends to", "is attended by"]  # escaped in HTML, exact after parsing
    assert parsed.options == ["x", "y", "z"]
    selected = [a for t, a in parsed.tags if t == "option" and "selected" in a]
    assert [a["value"] for a in selected] == ["1"]
    labels = [a for t, a in parsed.tags if t == "label"]
    assert labels == [{"for": "ex1-head"}]
    assert any(t == "select" and a.get("id") == "ex1-head" for t, a in parsed.tags)
    assert all(a.get("type") == "button" for t, a in parsed.tags if t == "button")


def test_explorer_html_tokens_cannot_break_out_of_the_markup():
    token = '"><script>alert(1)</script>'
    fragment = explorer_html([token], torch.ones(1, 1, 1), head_names=["</option><b>"])
    assert "<script" not in fragment and "<b>" not in fragment
    parsed = _Collect()
    parsed.feed(fragment)
    assert parsed.buttons[0] == token and parsed.options == ["</option><b>"]
    assert json.loads(parsed.tags[0][1]["data-attention"])["models"][0]["sentences"][0]["tokens"] == [token]


def test_explorer_html_default_id_is_stable_and_data_dependent():
    w = weights(2, 5, 5)
    first = explorer_html(TOKENS, w)
    assert first == explorer_html(TOKENS, w.numpy())
    assert first != explorer_html(TOKENS, weights(2, 5, 5, seed=3))
    assert 'id="attention-explorer-' in first


def test_explorer_html_rejects_bad_input():
    w = weights(2, 5, 5)
    with pytest.raises(ValueError, match=r"shape \(H, L, L\) with L = len\(tokens\) = 4, got \(2, 5, 5\)"):
        explorer_html(TOKENS[:4], w)
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, L\) or 4 dims .* got 2 dims"):
        explorer_html(TOKENS, w[0])
    with pytest.raises(ValueError, match=r"weights must have shape \(H, L, L\) .* got \(2, 5, 4\)"):
        explorer_html(TOKENS, weights(2, 5, 4))
    with pytest.raises(ValueError, match=r"head_names must have one name per head \(2\), got 3"):
        explorer_html(TOKENS, w, head_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"element_id must start with a letter"):
        explorer_html(TOKENS, w, element_id="1 bad")
    with pytest.raises(ValueError, match=r"initial_head must be an int in \[0, 1\], got 2"):
        explorer_html(TOKENS, w, initial_head=2)
    with pytest.raises(ValueError, match=r"initial_token must be None or an int in \[0, 4\], got 5"):
        explorer_html(TOKENS, w, initial_token=5)
    with pytest.raises(TypeError, match=r"tokens must be a sequence of str, got str"):
        explorer_html("the bank", w)


def _explorer_data(fragment: str) -> tuple[_Collect, dict]:
    """The parsed fragment and the JSON of its first model."""
    parsed = _Collect()
    parsed.feed(fragment)
    return parsed, json.loads(parsed.tags[0][1]["data-attention"])["models"][0]


def _unpack(model: dict, sentence: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """A sentence's weights and q.k scores (layers, H, L, L), decoded as explorer.js decodes them."""
    L = len(sentence["tokens"])
    shape = (len(model["layers"]), len(model["heads"]), L, L)
    w = np.frombuffer(base64.b64decode(sentence["weights"]), "<u2").reshape(shape) * model["weightUnit"]
    if "scores" not in sentence:
        return w, None
    return w, np.frombuffer(base64.b64decode(sentence["scores"]), "<i2").reshape(shape) * model["scoreUnit"]


def test_explorer_html_all_layers_and_sentences():
    first = weights(3, 2, 5, 5)  # (layers, H, L, L)
    second = weights(3, 2, 3, 3, seed=1)
    fragment = explorer_html(
        sentences={"the bank of the river": (TOKENS, first), "it was tired": (["it", "was", "tired"], second)},
        layer_names=["low", "mid", "top"], element_id="ex2",
        initial_sentence=1, initial_layer=2, initial_head=1, initial_token=[None, 0],
    )
    parsed, data = _explorer_data(fragment)
    assert data["layers"] == ["low", "mid", "top"] and data["heads"] == ["head 0", "head 1"]
    assert [s["text"] for s in data["sentences"]] == ["the bank of the river", "it was tired"]
    assert [s["initial"] for s in data["sentences"]] == [None, 0]
    for sentence, w in zip(data["sentences"], (first, second)):
        np.testing.assert_allclose(_unpack(data, sentence)[0], w.numpy(), atol=5e-5)  # 4 decimals
    selects = {a["id"]: a["class"] for t, a in parsed.tags if t == "select"}
    assert selects == {
        "ex2-sentence": "attention-explorer-sentence", "ex2-layer": "attention-explorer-layer",
        "ex2-head": "attention-explorer-head",
    }
    assert [a["for"] for t, a in parsed.tags if t == "label"] == ["ex2-sentence", "ex2-layer", "ex2-head"]
    assert parsed.options == ["the bank of the river", "it was tired", "low", "mid", "top", "head 0", "head 1"]
    selected = [a["value"] for t, a in parsed.tags if t == "option" and "selected" in a]
    assert selected == ["1", "2", "1"]  # sentence 1, layer 2, head 1
    assert parsed.buttons[:3] == ["it", "was", "tired"]  # the tokens of the sentence shown first
    assert any(t == "div" and a.get("class") == "attention-explorer-thumbs" for t, a in parsed.tags)


def test_explorer_html_int_initial_token_picks_in_the_initial_sentence():
    one = weights(2, 5, 5)
    two = weights(2, 3, 3, seed=2)
    _, data = _explorer_data(
        explorer_html(sentences={"a": (TOKENS, one), "b": (["x", "y", "z"], two)}, initial_sentence=1, initial_token=2)
    )
    assert [s["initial"] for s in data["sentences"]] == [None, 2]
    _, data = _explorer_data(explorer_html(TOKENS, one[None]))  # (1, H, L, L): one layer, 4 dims
    assert data["layers"] == ["layer 0"] and data["sentences"][0]["text"] == "the bank of the river"


def test_explorer_html_rejects_bad_layers_and_sentences():
    w = weights(3, 2, 5, 5)
    three = (["a", "b", "c"], weights(3, 2, 3, 3))
    with pytest.raises(TypeError, match=r"either tokens and weights, or sentences, not both"):
        explorer_html(TOKENS, w, sentences={"s": (TOKENS, w)})
    with pytest.raises(TypeError, match=r"needs tokens and weights, or sentences"):
        explorer_html(TOKENS)
    with pytest.raises(TypeError, match=r"sentences must be a mapping from str to \(tokens, weights\), got list"):
        explorer_html(sentences=[(TOKENS, w)])
    with pytest.raises(ValueError, match=r"sentences must hold at least one sentence"):
        explorer_html(sentences={})
    with pytest.raises(TypeError, match=r"sentences\['s'\] must be a pair \(tokens, weights\), got tuple"):
        explorer_html(sentences={"s": (TOKENS, w, 0)})
    with pytest.raises(ValueError, match=r"sentences\['s'\] weights must have shape \(layers, H, L, L\) "
                       r"with L = len\(tokens\) = 3, got \(3, 2, 5, 5\)"):
        explorer_html(sentences={"s": (["a", "b", "c"], w)})
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, L\) or 4 dims \(layers, H, L, L\), "
                       r"got 5 dims with shape \(1, 3, 2, 5, 5\)"):
        explorer_html(TOKENS, w[None])
    with pytest.raises(ValueError, match=r"same number of layers and heads: 's' has \(layers, H\) = \(3, 2\), "
                       r"'t' has \(2, 2\)"):
        explorer_html(sentences={"s": (TOKENS, w), "t": (["a", "b", "c"], weights(2, 2, 3, 3))})
    with pytest.raises(ValueError, match=r"layer_names must have one name per layer \(3\), got 2"):
        explorer_html(TOKENS, w, layer_names=["a", "b"])
    with pytest.raises(ValueError, match=r"initial_layer must be an int in \[0, 2\], got 3"):
        explorer_html(TOKENS, w, initial_layer=3)
    with pytest.raises(ValueError, match=r"initial_sentence must be an int in \[0, 1\], got 2"):
        explorer_html(sentences={"s": (TOKENS, w), "t": three}, initial_sentence=2)
    with pytest.raises(ValueError, match=r"initial_token must have one entry per sentence \(2\), got 1"):
        explorer_html(sentences={"s": (TOKENS, w), "t": three}, initial_token=[0])
    with pytest.raises(ValueError, match=r"initial_token for sentence 1 must be None or an int in \[0, 2\], got 3"):
        explorer_html(sentences={"s": (TOKENS, w), "t": three}, initial_token=[0, 3])
    with pytest.raises(ValueError, match=r"initial_token must be None or an int, got \[0\]"):
        explorer_html(TOKENS, w, initial_token=[0])  # a list needs sentences
    with pytest.raises(ValueError, match=r"weights must be attention weights in \[0, 1\]"):
        explorer_html(TOKENS, w * 2)


# --- the site's dark scheme ----------------------------------------------------


def _colours(svg):
    return set(re.findall(r"(?:fill|stroke): (var\([^)]*\)|#[0-9a-f]{6})", svg))


def test_to_svg_draws_the_chrome_through_css_variables_and_keeps_the_data_colours():
    svg = to_svg(heatmap([[0.25, 0.75], [1.0, 0.0]], ["a", "b"], annotate=True, title="one head"))
    colours = _colours(svg)
    assert {"var(--ar-figure-text, #1a1a1a)", "var(--ar-figure-line, #333333)",
            "var(--ar-figure-background, #ffffff)"} <= colours
    assert not colours & {"#1a1a1a", "#333333"}  # no chrome left out of the theme
    # the cell annotations keep their colours (white on dark cells), outside any variable
    values = re.findall(r'<text style="[^"]*fill: (#[0-9a-f]{6}|var\([^)]*\))"[^>]*>(0\.25|0\.75|1\.00|0\.00)<', svg)
    assert values and all(fill in ("#ffffff", "#000000") for fill, _ in values), values
    assert 'class="ar-figure" role="img" aria-label="one head"' in svg


def test_to_svg_themes_a_pyplot_figure_made_with_the_default_colours():
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], label="cost")
    ax.text(1, 2, "a label", color="black")
    ax.bar_label(ax.bar([0], [1]))
    ax.set_title("a line")
    ax.legend()
    svg = to_svg(fig)
    assert "#000000" not in svg  # matplotlib's black chrome is gone
    # on a chart without cells, text placed with ax.text (a label, a bar's value) is chrome too
    assert re.search(r'fill: var\(--ar-figure-text, #1a1a1a\)"[^>]*>a label<', svg)
    assert re.search(r'fill: var\(--ar-figure-text, #1a1a1a\)"[^>]*>1<', svg)
    assert re.search(r'fill: var\(--ar-figure-text, #1a1a1a\)"[^>]*>a line<', svg)
    assert "#1f77b4" in _colours(svg)  # the data line keeps matplotlib's blue
    # on a heatmap, ax.text keeps its colour: it was chosen against the cell under it
    fig, ax = plt.subplots()
    ax.imshow([[0.0, 1.0]])
    ax.text(0, 0, "on a cell", color="black")
    assert re.search(r'<text style="[^"]*"[^>]*>on a cell<', (cell := to_svg(fig))) and not re.search(
        r'<text style="[^"]*fill: [^"]*"[^>]*>on a cell<', cell)
    assert 'aria-label="a line"' in svg


def test_explorer_html_steps_are_the_packages_attention():
    """The scores embedded are q.k; softmax(q.k * scale) is the weights shown, also under a causal mask."""
    from attention_ref import attention_weights, causal_mask

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 5, 7, generator=g), torch.randn(2, 3, 5, 7, generator=g)  # (layers, H, L, E)
    qk = q @ k.transpose(-2, -1)  # (2, 3, 5, 7) x (2, 3, 7, 5) -> (2, 3, 5, 5)
    for causal in (False, True):
        mask = causal_mask(5) if causal else None
        w = attention_weights(q, k, attn_mask=mask)  # the package's path, scale 1/sqrt(7)
        _, data = _explorer_data(explorer_html(TOKENS, w, scores=qk, scale=7**-0.5, causal=causal))
        assert data["causal"] is causal and data["scale"] == pytest.approx(7**-0.5) and data["sqrtD"] == "\u221a7"
        shown_w, shown_s = _unpack(data, data["sentences"][0])
        np.testing.assert_allclose(shown_w, w.numpy(), atol=5e-5)
        np.testing.assert_allclose(shown_s, qk.numpy(), atol=5e-3)
        scaled = torch.from_numpy(shown_s) * data["scale"]
        if causal:
            scaled = scaled.masked_fill(~causal_mask(5), float("-inf"))
        np.testing.assert_allclose(torch.softmax(scaled, -1).numpy(), shown_w, atol=3e-3)
    with pytest.raises(ValueError, match=r"softmax\(scores \* scale\) differs from the weights by up to"):
        explorer_html(TOKENS, attention_weights(q, k), scores=qk, scale=1.0)  # the wrong scale
    with pytest.raises(ValueError, match=r"causal=True, but sentence .* has weight on keys after their query"):
        explorer_html(TOKENS, attention_weights(q, k), causal=True)
    with pytest.raises(ValueError, match=r"scale must be a positive number"):
        explorer_html(TOKENS, attention_weights(q, k), scores=qk)
    with pytest.raises(ValueError, match=r"scores must have the weights' shape"):
        explorer_html(TOKENS, attention_weights(q, k), scores=qk[0], scale=7**-0.5)


def test_explorer_html_other_models():
    w = weights(2, 3, 5, 5)
    digits = {"1 2 3": (["1", "2", "3"], torch.eye(3)[None, None])}  # (1, 1, 3, 3): each token on itself
    fragment = explorer_html(TOKENS, w, model_name="encoder",
                             other_models={"decoder": {"sentences": digits, "causal": True, "initial_token": 1}})
    parsed = _Collect()
    parsed.feed(fragment)
    data = json.loads(parsed.tags[0][1]["data-attention"])
    assert [m["name"] for m in data["models"]] == ["encoder", "decoder"]
    assert data["models"][1]["causal"] and data["models"][1]["sentences"][0]["initial"] == 1
    assert parsed.options[:2] == ["encoder", "decoder"]  # the model menu comes first
    assert {a["class"] for t, a in parsed.tags if t == "select"} >= {
        "attention-explorer-model", "attention-explorer-sentence", "attention-explorer-layer"}
    with pytest.raises(TypeError, match=r"other_models\['d'\] takes the keys .* got unknown keys \['mask'\]"):
        explorer_html(TOKENS, w, other_models={"d": {"sentences": digits, "mask": 1}})
    with pytest.raises(ValueError, match=r"other_models\['d'\] initial_token must be None or an int in \[0, 2\]"):
        explorer_html(TOKENS, w, other_models={"d": {"sentences": digits, "initial_token": 3}})



# --- map_slider_html -----------------------------------------------------------------------------

KEYS = ["x", "y", "z"]


def _slider(fragment: str) -> tuple[dict, dict, ET.Element]:
    """The figure's attributes, its JSON (unescaped as by a browser) and its SVG, parsed."""
    parsed = _Collect()
    parsed.feed(fragment)
    tag, attrs = parsed.tags[0]
    assert tag == "figure"
    data = json.loads(attrs["data-map-slider"])
    svg = ET.fromstring(fragment[fragment.index("<svg"):fragment.index("</svg>") + len("</svg>")])
    return attrs, data, svg


def _slider_weights(data: dict) -> np.ndarray:
    """The ``(F, L, S)`` weights as the page's script decodes them."""
    counts = np.frombuffer(base64.b64decode(data["weights"]), "<u2")
    return counts.reshape(data["frames"], data["L"], data["S"]) * data["unit"]


def _cells(svg: ET.Element) -> list[ET.Element]:
    return [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "ar-map-slider-cell"]


def test_map_slider_html_embeds_every_frame_within_the_encodings_precision():
    maps = weights(7, 5, 3)  # (F, L, S): distinct primes, so a swapped axis fails
    fragment = map_slider_html(maps, TOKENS, KEYS, frame_names=[f"step {s}" for s in range(7)],
                               values=maps[:, 0, 0], value_name="w[0, 0]", element_id="s1")
    assert "\n\n" not in fragment and "<script" not in fragment
    attrs, data, _ = _slider(fragment)
    assert attrs["id"] == "s1" and "ar-map-slider" in attrs["class"].split()
    assert (data["frames"], data["L"], data["S"], data["unit"]) == (7, 5, 3, 1e-4)
    decoded = _slider_weights(data)
    np.testing.assert_allclose(decoded, maps.numpy(), atol=5e-5)  # counts of 1e-4, rounded
    assert data["names"] == [f"step {s}" for s in range(7)]
    assert data["values"] == [f"{v:.2f}" for v in maps[:, 0, 0].tolist()] and data["valueName"] == "w[0, 0]"
    assert data["rows"] == [f"i={i} \u00b7 {t}" for i, t in enumerate(TOKENS)]
    assert data["cols"] == ["j=0 \u00b7 x", "j=1 \u00b7 y", "j=2 \u00b7 z"]
    # a weight of exactly 0 or 1 travels exactly
    ends = _slider_weights(_slider(map_slider_html(torch.eye(3).flip(-1)[None]))[1])
    assert np.array_equal(ends, torch.eye(3).flip(-1)[None].numpy())


def test_map_slider_html_without_javascript_shows_the_last_frame():
    first = torch.full((5, 3), 1 / 3)  # (L, S): uniform
    last = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0.5, 0.5, 0], [0.25, 0.25, 0.5]])
    maps = torch.stack([first, (first + last) / 2, last])  # (F, L, S) = (3, 5, 3)
    fragment = map_slider_html(maps, TOKENS, KEYS, frame_names=["start", "middle", "end"],
                               values=[0.1, 0.5, 0.9], value_name="score")
    _, data, svg = _slider(fragment)
    parsed = _Collect()
    parsed.feed(fragment)
    controls = [a for t, a in parsed.tags if a.get("class") == "ar-map-slider-controls"]
    assert len(controls) == 1 and "hidden" in controls[0]  # shown by the script only
    [range_] = [a for t, a in parsed.tags if t == "input"]
    assert (range_["type"], range_["min"], range_["max"], range_["value"]) == ("range", "0", "2", "2")
    assert range_["aria-label"] and range_["aria-valuetext"] == "end, score: 0.90"
    [play] = [a for t, a in parsed.tags if t == "button"]
    assert play["type"] == "button" and play["aria-label"]
    assert '<div class="ar-map-slider-frame">end</div>' in fragment
    assert '<div class="ar-map-slider-value">score: 0.90</div>' in fragment
    cells = _cells(svg)
    assert [(int(c.get("data-i")), int(c.get("data-j"))) for c in cells] == [(i, j) for i in range(5) for j in range(3)]
    shown = np.array([float(c.get("data-weight")) for c in cells]).reshape(5, 3)
    np.testing.assert_allclose(shown, last.numpy(), atol=1e-4)
    assert [c.get("fill") for c in cells] == [viz._ramp_colour(w) for w in _slider_weights(data)[-1].ravel()]
    assert cells[0].get("fill") == "#fde725" and cells[1].get("fill") == "#440154"  # 1 and 0: viridis' ends
    assert cells[0].find(f"{SVG}title").text == "i=0 \u00b7 the \u2192 j=0 \u00b7 x: 1.000"
    assert svg.get("aria-label") == "attention map, end"
    assert svg.get("style") == "max-width: 100%; height: auto"  # a notebook shows it at its own size, or less


def _texts(svg: ET.Element) -> list[str]:
    return [t.text for t in svg.iter(f"{SVG}text")]


def test_map_slider_html_labels_each_axis_by_position_and_token():
    *_, svg = _slider(map_slider_html(weights(2, 5, 3), TOKENS, KEYS))
    shown = _texts(svg)
    assert [f"i={i} \u00b7 {t}" for i, t in enumerate(TOKENS)] == [t for t in shown if t.startswith("i=")]
    assert [t for t in shown if t.startswith("j=")] == ["j=0", "j=1", "j=2"]  # over their tokens
    assert set(KEYS) <= set(shown) and {"query", "key", "attention weight"} <= set(shown)
    *_, svg = _slider(map_slider_html(weights(2, 3, 3)))  # no tokens: positions only
    assert [t for t in _texts(svg) if "=" in t] == ["i=0", "i=1", "i=2", "j=0", "j=1", "j=2"]
    # keys too wide for their column: one line each, written upwards
    keys = [f"token{j}" for j in range(11)]
    *_, svg = _slider(map_slider_html(weights(2, 3, 11), ["a", "b", "c"], keys))
    cols = [t for t in svg.iter(f"{SVG}text") if t.get("class") == "ar-map-slider-col"]
    assert [t.text for t in cols] == [f"j={j} \u00b7 token{j}" for j in range(11)]
    assert all(t.get("transform", "").startswith("rotate(-90") for t in cols)
    # a query label wider than the map: the map widens (and a page scales it down), its cells keep a size
    *_, svg = _slider(map_slider_html(weights(1, 2, 2), ["a" * 80, "b"]))
    assert min(float(c.get("width")) for c in _cells(svg)) >= 4


def test_map_slider_html_colours_are_viridis():
    """17 stops interpolated linearly stay within 6/255 a channel of matplotlib's viridis (the heatmaps')."""
    mpl = pytest.importorskip("matplotlib")
    viridis = mpl.colormaps["viridis"]
    for w in np.linspace(0, 1, 41):
        ours = np.array([int(viz._ramp_colour(w)[k:k + 2], 16) for k in (1, 3, 5)])
        theirs = np.round(np.array(viridis(w)[:3]) * 255)
        assert np.abs(ours - theirs).max() <= 6, (w, ours, theirs)


def test_map_slider_html_escapes_labels_and_has_a_stable_default_id():
    token = '"><script>alert(1)</script>'
    fragment = map_slider_html(torch.ones(1, 1, 1), [token], frame_names=["</div><b>"], caption="a <b>bold</b> map")
    assert "<script" not in fragment and "<b>" not in fragment
    assert "<figcaption>a &lt;b&gt;bold&lt;/b&gt; map</figcaption>" in fragment
    _, data, svg = _slider(fragment)
    assert data["rows"] == [f"i=0 \u00b7 {token}"] and data["names"] == ["</div><b>"]
    assert f"i=0 \u00b7 {token}" in [t.text for t in svg.iter(f"{SVG}text")]
    maps = weights(3, 5, 5)
    first = map_slider_html(maps, TOKENS)
    assert first == map_slider_html(maps.numpy(), TOKENS)
    assert first != map_slider_html(weights(3, 5, 5, seed=3), TOKENS)
    assert re.search(r'id="map-slider-[0-9a-f]{10}"', first)
    assert f'fill="url(#{_slider(first)[0]["id"]}-ramp)"' in first  # the colour bar's gradient is this figure's


@pytest.mark.parametrize("kwargs, error, match", [
    ({"maps": torch.rand(5, 3)}, ValueError, r"maps must have 3 dims \(F, L, S\), got 2 dims with shape \(5, 3\)"),
    ({"maps": torch.full((2, 5, 3), 1.5)}, ValueError,
     r"maps must be attention weights in \[0, 1\], got values in \[1\.5, 1\.5\]"),
    ({"maps": "abc"}, TypeError, r"maps must be a tensor or array of numbers, got str"),
    ({"maps": np.zeros((0, 5, 3))}, ValueError,
     r"maps must hold at least one frame, query and key, got shape \(F, L, S\) = \(0, 5, 3\)"),
    ({"maps": np.zeros((1001, 1000, 1))}, ValueError, r"maps must hold at most 1,000,000 weights .* got 1,001,000"),
    ({"query_labels": TOKENS[:4]}, ValueError, r"query_labels must have one label per query row L \(5\), got 4"),
    ({"key_labels": "xyz"}, TypeError, r"key_labels must be a sequence of labels .* got str"),
    ({"frame_names": ["a"] * 6}, ValueError, r"frame_names must have one name per frame \(F = 7\), got 6"),
    ({"frame_names": "abcdefg"}, TypeError, r"frame_names must be a sequence of names, got str"),
    ({"values": [0.5] * 6}, ValueError,
     r"values must have one number per frame, shape \(F,\) = \(7,\), got shape \(6,\)"),
    ({"values": [float("nan")] * 7}, ValueError, r"values must be finite"),
    ({"values": ["a"] * 7}, TypeError, r"values must be a sequence of numbers, got list"),
    ({"value_name": "loss"}, ValueError, r"value_name is only used with values, got value_name='loss' and no values"),
    ({"values": [0.5] * 7, "value_name": 3}, TypeError, r"value_name must be a str or None, got int"),
    ({"values": [0.5] * 7, "value_format": "d"}, ValueError,
     r"value_format must format a float, such as '\.2f', got 'd'"),
    ({"value_format": 2}, TypeError, r"value_format must be a format spec str such as '\.2f', got int"),
    ({"caption": 3}, TypeError, r"caption must be a str or None, got int"),
    ({"element_id": "1x"}, ValueError, r"element_id must start with a letter .* got '1x'"),
])
def test_map_slider_html_rejects_bad_input(kwargs, error, match):
    arguments = {"maps": weights(7, 5, 3), "query_labels": TOKENS, "key_labels": KEYS, **kwargs}
    with pytest.raises(error, match=match):
        map_slider_html(**arguments)


def test_head_grid_labels_the_last_token_however_it_thins_the_labels():
    """Issue 33: page 6's grids labelled every other key, so the [SEP] column its caption asks about had none."""
    from attention_ref.viz import _labelled

    assert _labelled(10, 2) == [0, 2, 4, 6, 9] and _labelled(11, 3) == [0, 3, 6, 10] and _labelled(2, 2) == [0]
    for n in (20, 31):
        tokens = ["[CLS]"] + [f"w{i}" for i in range(n - 2)] + ["[SEP]"]
        weights = torch.softmax(torch.randn(4, n, n, generator=torch.Generator().manual_seed(n)), -1)
        page = viz.head_grid_html(weights, tokens)
        assert page.count(">[SEP]<") == page.count(">[CLS]<") == 8  # 4 heads, both axes
        assert page.count(">w1<") < 8  # the labels are thinned: the test is about the thinned case
