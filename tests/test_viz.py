"""Tests of attention_ref.viz: real matplotlib figures, SVG output, the explorer fragment."""

from __future__ import annotations

import html.parser
import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason="attention_ref.viz figures need matplotlib (the plot extra)")

from matplotlib.figure import Figure  # noqa: E402

from attention_ref import attention_weights  # noqa: E402
from attention_ref.viz import explorer_html, head_grid, heatmap, to_svg  # noqa: E402

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
    colorbars = [a for a in fig.axes if a.get_label() == "<colorbar>"]
    assert len(colorbars) == 1
    assert image.colorbar is not None


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
        assert tick_texts(ax, "x") == keys
    assert tick_texts(panels[0], "y") == TOKENS
    assert [a.get_label() for a in fig.axes].count("<colorbar>") == 1
    assert fig.get_suptitle() == "all heads"
    # a 2 x 2 grid for 3 heads: the fourth axes is switched off
    assert sum(1 for a in fig.axes if not a.axison) == 1


def test_head_grid_names_and_errors():
    w = weights(2, 3, 3)
    fig = head_grid(w, ["a", "b", "c"], head_names=["syntax", "position"])
    assert [ax.get_title() for ax in image_axes(fig)] == ["syntax", "position"]
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, S\), got 2 dims with shape \(3, 3\)"):
        head_grid(w[0])
    with pytest.raises(ValueError, match=r"ncols must be a positive int or None, got 0"):
        head_grid(w, ncols=0)
    with pytest.raises(ValueError, match=r"head_names must have one name per head \(2\), got 1"):
        head_grid(w, head_names=["x"])
    with pytest.raises(ValueError, match=r"weights must hold at least one head, got shape \(0, 3, 3\)"):
        head_grid(torch.zeros(0, 3, 3))


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
    assert set(TOKENS) | {"key", "query", "one head", "weight"} <= texts
    assert "Date" not in svg and "<dc:date>" not in svg


def test_to_svg_is_deterministic_and_differs_between_figures():
    w = weights(5, 5)
    first = to_svg(heatmap(w, TOKENS))
    second = to_svg(heatmap(w, TOKENS))
    assert first == second
    assert to_svg(heatmap(weights(5, 5, seed=1), TOKENS)) != first


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
    assert attrs["data-initial-token"] == "2"
    assert not any(t == "script" for t, _ in parsed.tags)  # Material's instant navigation would run it
    data = json.loads(attrs["data-attention"])  # unescaped by the HTML parser, as by the browser
    assert data["tokens"] == tokens
    assert data["heads"] == ["x", "y", "z"]
    np.testing.assert_allclose(np.array(data["weights"]), w.numpy(), atol=5e-5)
    assert parsed.buttons == tokens  # escaped in HTML, exact after parsing
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
    assert parsed.buttons == [token] and parsed.options == ["</option><b>"]
    assert json.loads(parsed.tags[0][1]["data-attention"])["tokens"] == [token]


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
    with pytest.raises(ValueError, match=r"weights must have 3 dims \(H, L, L\), got 2 dims"):
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
