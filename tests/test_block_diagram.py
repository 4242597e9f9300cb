"""Tests of attention_ref.diagrams.transformer_block, the Transformer block diagram: valid SVG, sizes read from the module and input, errors."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from attention_ref import MultiHeadAttention
from attention_ref.diagrams import transformer_block

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def lines_of(svg: str) -> list[str]:
    """The text a reader sees, one entry per <text> element (tspans joined)."""
    return ["".join(t.itertext()) for t in parse(svg).iter(f"{SVG}text")]


def block(d: int = 12, H: int = 3, L: int = 7, width: int = 13) -> str:
    return transformer_block(MultiHeadAttention(d, H), torch.zeros(L, d), mlp_width=width)


def test_the_block_reads_its_sizes_from_the_module_and_the_input():
    lines = lines_of(block(12, 3, 7, 13))
    assert lines[0] == "a Transformer block (pre-norm)"
    assert lines[1] == "d = 12, H = 3, MLP width 13"
    assert lines.count("L × d = 7 × 12") == 2  # the input and the output
    assert "attention, 3 heads" in lines and "12 → 13 → 12" in lines
    assert lines.count("LayerNorm") == 2 and lines.count("residual") == 2 and lines.count("+") == 2
    one_head = lines_of(block(12, 1, 7, 13))
    assert "attention, 1 head" in one_head


def test_the_steps_come_in_the_order_of_a_pre_norm_block():
    lines = lines_of(block())
    order = [line for line in lines if line in {"x", "LayerNorm", "attention, 3 heads", "+",
                                               "MLP, each token alone", "output"}]
    assert order == ["x", "LayerNorm", "attention, 3 heads", "+", "LayerNorm", "MLP, each token alone", "+",
                     "output"]


def test_a_batch_of_inputs_and_a_numpy_input_give_the_same_diagram():
    attention = MultiHeadAttention(12, 3)
    single = transformer_block(attention, torch.zeros(7, 12), mlp_width=13)
    assert transformer_block(attention, torch.zeros(5, 7, 12), mlp_width=13) == single
    assert transformer_block(attention, np.zeros((7, 12)), mlp_width=13) == single


def test_the_diagram_follows_a_change_of_size():
    assert block(L=7) != block(L=11)
    assert "L × d = 11 × 12" in lines_of(block(L=11))


def test_output_is_deterministic():
    assert block() == block()


def test_svg_root_is_accessible_and_fits_a_phone():
    root = parse(block())
    assert root.get("role") == "img" and root.get("aria-label")
    assert root.find(f"{SVG}title").text == root.get("aria-label")
    assert "ar-diagram" in root.get("class").split()
    x0, y0, width, height = (float(t) for t in root.get("viewBox").split())
    assert (x0, y0) == (0, 0) and width <= 350  # drawn at its own size in a 390 px phone's column
    assert (float(root.get("width")), float(root.get("height"))) == (width, height)
    assert "max-width:100%" in root.get("style")
    assert not re.search(r"href|<script|url\(|\bid=", block())


def test_no_text_below_12_units_and_everything_inside_the_view_box():
    root = parse(block())
    _, _, width, height = (float(t) for t in root.get("viewBox").split())
    sizes = [float(t.get("font-size", root.get("font-size"))) for t in root.iter()
             if t.tag in (f"{SVG}text", f"{SVG}tspan")]
    assert sizes and min(sizes) >= 12
    for el in root.iter():
        for attr in ("x", "x1", "x2", "cx"):
            if el.get(attr) is not None:
                assert -0.5 <= float(el.get(attr)) <= width + 0.5, (el.tag, attr, el.get(attr))
        for attr in ("y", "y1", "y2", "cy"):
            if el.get(attr) is not None:
                assert -0.5 <= float(el.get(attr)) <= height + 0.5, (el.tag, attr, el.get(attr))
        if el.tag == f"{SVG}text":  # estimated extent (0.6 em a character)
            extent = len("".join(el.itertext())) * float(el.get("font-size")) * 0.6
            x = float(el.get("x"))
            left = x - extent / 2 if el.get("text-anchor") == "middle" else x
            assert left >= -2 and left + extent <= width + 2, "".join(el.itertext())


def test_every_element_has_a_class_the_stylesheet_styles():
    svg = block()
    drawn = [el for el in parse(svg).iter()
             if el.tag.removeprefix(SVG) in {"rect", "text", "line", "path", "polygon", "circle"}]
    assert drawn and all(el.get("class", "").startswith("ar-") for el in drawn)
    css = (Path(__file__).resolve().parents[1] / "docs" / "stylesheets" / "diagrams.css").read_text()
    used = {c for cls in re.findall(r'class="([^"]+)"', svg) for c in cls.split()}
    assert used <= set(re.findall(r"\.(ar-[\w-]+)", css)), used - set(re.findall(r"\.(ar-[\w-]+)", css))


def test_errors():
    x = torch.zeros(7, 12)
    with pytest.raises(TypeError, match="attention must be an attention_ref.MultiHeadAttention, "
                                        "got MultiheadAttention"):
        transformer_block(torch.nn.MultiheadAttention(12, 3), x, mlp_width=13)
    with pytest.raises(ValueError, match="kdim == vdim == embed_dim=12.*got kdim=5, vdim=12"):
        transformer_block(MultiHeadAttention(12, 3, kdim=5), x, mlp_width=13)
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, d\) or \(L, d\) with d = embed_dim = 12, "
                                         r"got \(7, 11\)"):
        transformer_block(MultiHeadAttention(12, 3), torch.zeros(7, 11), mlp_width=13)
    with pytest.raises(ValueError, match=r"got \(1, 2, 7, 12\)"):
        transformer_block(MultiHeadAttention(12, 3), torch.zeros(1, 2, 7, 12), mlp_width=13)
    with pytest.raises(TypeError, match="x must be a torch.Tensor or numpy.ndarray, got list"):
        transformer_block(MultiHeadAttention(12, 3), [[0.0] * 12], mlp_width=13)
    with pytest.raises(TypeError, match="mlp_width must be an int, got float"):
        transformer_block(MultiHeadAttention(12, 3), x, mlp_width=13.0)
    with pytest.raises(ValueError, match="mlp_width must be an int >= 1, got 0"):
        transformer_block(MultiHeadAttention(12, 3), x, mlp_width=0)
