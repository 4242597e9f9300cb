"""docs/hooks/diagram_boxes.py puts each concept diagram in a box of its own, and nothing else."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from attention_ref import diagrams, viz

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("diagram_boxes_hook", ROOT / "docs" / "hooks" / "diagram_boxes.py")
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)


def test_each_diagram_gets_a_box_and_a_figure_does_not():
    from matplotlib.figure import Figure

    q = torch.randn(3, 4)
    one, two = diagrams.sdpa_flow(q, q, q), diagrams.path_length(6)
    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1])
    figure = viz.to_svg(fig)
    html = f"<p>a</p>\n{one}\n<p>b</p>\n{figure}\n{two}"
    boxed = hook.boxed(html)
    assert boxed == (f'<p>a</p>\n<div class="ar-diagram-box">{one}</div>\n<p>b</p>\n{figure}\n'
                     f'<div class="ar-diagram-box">{two}</div>')
