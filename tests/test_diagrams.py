"""Tests of attention_ref.diagrams: valid SVG, sizes read from the tensors, readable text, errors."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from attention_ref import MultiHeadAttention, attention_weights, diagrams

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def text_of(svg: str) -> str:
    """All the text a reader sees (tspans joined, as a browser lays them out), one line per <text>."""
    return "\n".join("".join(t.itertext()) for t in parse(svg).iter(f"{SVG}text"))


def qkv(L: int = 3, S: int = 5, E: int = 7, Ev: int = 11, lead: tuple[int, ...] = (2, 1)):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*lead, L, E, generator=g), torch.randn(*lead, S, E, generator=g),
            torch.randn(*lead, S, Ev, generator=g))


def one_of_each() -> dict[str, str]:
    """Every diagram once, with distinct prime sizes."""
    q, k, v = qkv()
    return {
        "sdpa_flow": diagrams.sdpa_flow(q, k, v),
        "sdpa_flow_mask": diagrams.sdpa_flow(q, k, v, torch.ones(3, 5, dtype=torch.bool)),
        "qkv_shapes": diagrams.qkv_shapes(q, k, v, attention_weights(q, k)),
        "multihead_flow": diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(2, 5, 12)),
        "multihead_flow_gqa": diagrams.multihead_flow(MultiHeadAttention(48, 12, num_kv_heads=4),
                                                      torch.randn(7, 48)),
        "kv_head_groups": diagrams.kv_head_groups(torch.randn(2, 6, 3, 5), torch.randn(2, 2, 7, 5),
                                                  torch.randn(2, 2, 7, 11)),
        "kv_head_groups_mqa": diagrams.kv_head_groups(torch.randn(6, 3, 5), torch.randn(1, 7, 5),
                                                      torch.randn(1, 7, 11)),
        "kv_head_groups_mha": diagrams.kv_head_groups(torch.randn(12, 3, 5), torch.randn(12, 7, 5),
                                                      torch.randn(12, 7, 11)),
        "self_vs_cross": diagrams.self_vs_cross(3, 7),
        "path_length": diagrams.path_length(7),
        "flash_tiling": diagrams.flash_tiling(11, 13, 3, 5, causal=True),
        "flash_tiling_large": diagrams.flash_tiling(4096, 8192, 256, 512, causal=True),
    }


ALL = one_of_each()


# --- every diagram ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_svg_root_is_accessible_and_sized_for_a_page(name: str):
    svg = ALL[name]
    root = parse(svg)
    assert root.get("role") == "img" and root.get("aria-label")
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == root.get("aria-label")
    assert "ar-diagram" in root.get("class").split()
    x0, y0, width, height = (float(t) for t in root.get("viewBox").split())
    assert (x0, y0) == (0, 0) and width <= 640
    # width/height equal the viewBox: one unit is one CSS pixel on a wide page, shrunk on a phone
    assert (float(root.get("width")), float(root.get("height"))) == (width, height)
    assert "max-width:100%" in root.get("style")
    # no external references, no scripts, no ids that could clash between diagrams on one page
    assert not re.search(r"href|<script|url\(|\bid=", svg)


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_text_below_12_units(name: str):
    root = parse(ALL[name])
    default = float(root.get("font-size"))
    assert default >= 14
    sizes = [float(t.get("font-size", default)) for t in root.iter() if t.tag in (f"{SVG}text", f"{SVG}tspan")]
    assert sizes and min(sizes) >= 12


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_element_has_a_class_for_the_stylesheet(name: str):
    root = parse(ALL[name])
    drawn = [el for el in root.iter() if el.tag.removeprefix(SVG) in {"rect", "text", "line", "path", "polygon",
                                                                      "circle"}]
    assert drawn and all(el.get("class", "").startswith("ar-") for el in drawn)


@pytest.mark.parametrize("name", sorted(ALL))
def test_elements_stay_inside_the_view_box(name: str):
    root = parse(ALL[name])
    _, _, width, height = (float(t) for t in root.get("viewBox").split())
    for el in root.iter():
        for attr in ("x", "x1", "x2", "cx"):
            if el.get(attr) is not None:
                assert -0.5 <= float(el.get(attr)) <= width + 0.5, (el.tag, attr, el.get(attr))
        for attr in ("y", "y1", "y2", "cy"):
            if el.get(attr) is not None:
                assert -0.5 <= float(el.get(attr)) <= height + 0.5, (el.tag, attr, el.get(attr))
        if el.tag == f"{SVG}text":  # estimated extent of centred text (0.6 em a character)
            half = len("".join(el.itertext())) * float(el.get("font-size")) * 0.3
            x = float(el.get("x"))
            if el.get("text-anchor") == "middle":
                assert x - half >= -2 and x + half <= width + 2, "".join(el.itertext())
            elif el.get("text-anchor") == "start":
                assert x + 2 * half <= width + 2, "".join(el.itertext())


def test_output_is_deterministic():
    again = one_of_each()
    assert again == ALL


def test_stylesheet_names_every_class_the_diagrams_use():
    from pathlib import Path

    css = (Path(__file__).resolve().parents[1] / "docs" / "stylesheets" / "diagrams.css").read_text()
    used = {cls for svg in ALL.values() for cls in re.findall(r'class="([^"]+)"', svg) for cls in cls.split()}
    styled = set(re.findall(r"\.(ar-[\w-]+)", css))
    # the classes only used as hooks, with no colour of their own
    hooks = {"ar-tile", "ar-cell"}
    assert used - hooks <= styled, used - hooks - styled


# --- 1. sdpa_flow ---------------------------------------------------------------------------


def boxes(svg: str) -> dict[str, str]:
    """Each box's first line (its name) mapped to its second line (its shape)."""
    lines = text_of(svg).splitlines()
    return dict(itertools.pairwise(lines))


def test_sdpa_flow_prints_the_shapes_of_the_tensors():
    q, k, v = qkv(L=3, S=5, E=7, Ev=11, lead=(2, 1))
    svg = diagrams.sdpa_flow(q, k, v)
    assert boxes(svg) | {
        "Q  queries": "L × E = 3 × 7",
        "K  keys": "S × E = 5 × 7",
        "V  values": "S × Ev = 5 × 11",
        "scores = Q Kᵀ / √E": "L × S = 3 × 5",
        "weights = softmax of each row": "L × S = 3 × 5, rows sum to 1",
        "output = weights V": "L × Ev = 3 × 11",
    } == boxes(svg)
    text = text_of(svg)
    assert "B=2, H=1" in text and text.count("B=2") == 1  # the batch dims, once
    assert "mask" not in text


def test_sdpa_flow_follows_a_change_of_size():
    q, k, v = qkv(L=3, S=5)
    q2, k2, v2 = qkv(L=3, S=13)
    before, after = diagrams.sdpa_flow(q, k, v), diagrams.sdpa_flow(q2, k2, v2)
    assert before != after
    assert "L × S = 3 × 13" in text_of(after) and "3 × 5" not in text_of(after)


def test_sdpa_flow_draws_the_mask_only_when_given():
    q, k, v = qkv(lead=())
    plain = text_of(diagrams.sdpa_flow(q, k, v))
    assert "batch" not in plain and "B=" not in plain
    bool_mask = text_of(diagrams.sdpa_flow(q, k, v, torch.ones(1, 5, dtype=torch.bool)))
    assert "−∞ where the mask is False" in bool_mask and "mask (1, 5) broadcast to L × S = 3 × 5" in bool_mask
    float_mask = text_of(diagrams.sdpa_flow(q, k, v, torch.zeros(3, 5)))
    assert "scores + mask" in float_mask and "mask L × S = 3 × 5" in float_mask
    numpy_mask = text_of(diagrams.sdpa_flow(q.numpy(), k.numpy(), v.numpy(), np.ones(5, dtype=bool)))
    assert "−∞ where the mask is False" in numpy_mask


def test_sdpa_flow_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="query must be a torch.Tensor or numpy.ndarray, got list"):
        diagrams.sdpa_flow([[1.0]], k, v)
    with pytest.raises(ValueError, match=r"key must have at least 2 dims \(\.\.\., S, E\), got shape \(7,\)"):
        diagrams.sdpa_flow(q, torch.randn(7), v)
    with pytest.raises(ValueError, match=r"key must have size E=7 .* got shape \(2, 1, 5, 4\)"):
        diagrams.sdpa_flow(q, torch.randn(2, 1, 5, 4), v)
    with pytest.raises(ValueError, match=r"value must have S=5 rows .* got shape \(2, 1, 6, 11\)"):
        diagrams.sdpa_flow(q, k, torch.randn(2, 1, 6, 11))
    with pytest.raises(ValueError, match=r"leading \(batch\) dims must broadcast .* key \(3, 1, 5, 7\)"):
        diagrams.sdpa_flow(q, torch.randn(3, 1, 5, 7), v)
    with pytest.raises(TypeError, match="mask must be bool .* or floating point, got torch.int64"):
        diagrams.sdpa_flow(q, k, v, torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask must broadcast to \(\.\.\., L, S\) = \(\.\.\., 3, 5\), "
                                         r"got shape \(3, 4\)"):
        diagrams.sdpa_flow(q, k, v, torch.ones(3, 4, dtype=torch.bool))


# --- 2. qkv_shapes --------------------------------------------------------------------------


def rect_sizes(svg: str, cls: str) -> list[tuple[float, float]]:
    return [(float(r.get("width")), float(r.get("height"))) for r in parse(svg).iter(f"{SVG}rect")
            if r.get("class") == cls]


def test_qkv_shapes_draws_to_scale():
    q, k, v = qkv(L=3, S=5, E=7, Ev=11)
    svg = diagrams.qkv_shapes(q, k, v)
    text = text_of(svg)
    for shape in ("L × E = 3 × 7", "E × S = 7 × 5", "L × S = 3 × 5", "S × Ev = 5 × 11", "L × Ev = 3 × 11"):
        assert shape in text
    (qw, qh), = rect_sizes(svg, "ar-box ar-q")
    (kw, kh), = rect_sizes(svg, "ar-box ar-k")
    (vw, vh), = rect_sizes(svg, "ar-box ar-v")
    unit = qh / 3
    assert unit > 0
    # width = columns, height = rows, one unit each: Q is 3 x 7, K^T is 7 x 5, V is 5 x 11
    assert (qw, kw, kh, vw, vh) == pytest.approx((7 * unit, 5 * unit, 7 * unit, 11 * unit, 5 * unit), abs=0.02)


def test_qkv_shapes_follows_a_change_of_size_and_shades_the_weights():
    q, k, v = qkv(L=3, S=5)
    q2, k2, v2 = qkv(L=3, S=13)
    assert diagrams.qkv_shapes(q, k, v) != diagrams.qkv_shapes(q2, k2, v2)
    assert "E × S = 7 × 13" in text_of(diagrams.qkv_shapes(q2, k2, v2))
    w = attention_weights(q, k)  # (2, 1, 3, 5)
    svg = diagrams.qkv_shapes(q, k, v, w)
    cells = [r for r in parse(svg).iter(f"{SVG}rect") if r.get("class") == "ar-cell ar-w"]
    assert len(cells) == 3 * 5
    opacities = np.array([float(c.get("fill-opacity")) for c in cells]).reshape(3, 5)
    np.testing.assert_allclose(opacities, 0.05 + 0.9 * w[0, 0].sqrt().numpy(), atol=0.01)  # first batch element
    assert "weights shaded by value" in text_of(svg)


def test_qkv_shapes_large_sizes_stay_in_the_width():
    svg = diagrams.qkv_shapes(torch.randn(512, 64), torch.randn(1024, 64), torch.randn(1024, 64))
    root = parse(svg)
    assert float(root.get("viewBox").split()[2]) == 640
    assert "sides proportional to the sizes" in text_of(svg)


def test_qkv_shapes_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="value must be a torch.Tensor or numpy.ndarray, got int"):
        diagrams.qkv_shapes(q, k, 3)
    with pytest.raises(ValueError, match=r"key must have size E=7"):
        diagrams.qkv_shapes(q, torch.randn(5, 3), v)
    with pytest.raises(ValueError, match=r"weights must have shape \(\.\.\., L, S\) = \(\.\.\., 3, 5\), got \(5, 3\)"):
        diagrams.qkv_shapes(q, k, v, torch.rand(5, 3))
    with pytest.raises(ValueError, match=r"weights must be attention weights in \[0, 1\], got values in \[-1, 2\]"):
        diagrams.qkv_shapes(q, k, v, torch.tensor([[-1.0, 2.0, 0, 0, 0]] * 3))


# --- 3. multihead_flow ----------------------------------------------------------------------


def test_multihead_flow_reads_the_module_and_the_input():
    text = text_of(diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(2, 5, 12)))
    assert "d = 12, H = 3 heads of D = d / H = 4" in text
    assert "L = 5 tokens" in text and "B = 2" in text
    assert "L × d = 5 × 12" in text and "L × H·D = 5 × 12" in text
    assert "L × D = 5 × 4" in text and "L × L = 5 × 5" in text
    assert [f"head {h}" for h in (1, 2, 3)] == [line for line in text.splitlines() if line.startswith("head")]
    # x W_Q with Q as a subscript
    assert "Q = x WQ" in text


def test_multihead_flow_follows_a_change_of_size():
    before = diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(5, 12))
    after = diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(7, 12))
    assert before != after and "L × d = 7 × 12" in text_of(after)
    gqa = diagrams.multihead_flow(MultiHeadAttention(48, 12, num_kv_heads=4), torch.randn(7, 48))
    many = text_of(gqa)
    heads = [line for line in many.splitlines() if line.startswith("head")]
    assert heads == ["head 1", "head 2", "head 3", "head 4", "head 5", "head 12"] and "…" in many
    assert boxes(gqa) | {"Q = x WQ": "L × d = 7 × 48", "K = x WK": "L × Hkv·D = 7 × 16",
                         "V = x WV": "L × Hkv·D = 7 × 16"} == boxes(gqa)
    assert "Hkv = 4 heads, each shared by 3 query heads" in many


def test_multihead_flow_errors():
    with pytest.raises(TypeError, match="module must be an attention_ref.MultiHeadAttention, got MultiheadAttention"):
        diagrams.multihead_flow(torch.nn.MultiheadAttention(12, 3), torch.randn(5, 12))
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, d\) or \(L, d\) with d = embed_dim = 12, "
                                         r"got \(5, 11\)"):
        diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(5, 11))
    with pytest.raises(ValueError, match=r"x must have shape .* got \(1, 2, 5, 12\)"):
        diagrams.multihead_flow(MultiHeadAttention(12, 3), torch.randn(1, 2, 5, 12))
    with pytest.raises(ValueError, match="kdim == vdim == embed_dim=12.*got kdim=7, vdim=12"):
        diagrams.multihead_flow(MultiHeadAttention(12, 3, kdim=7), torch.randn(5, 12))


# --- kv_head_groups -------------------------------------------------------------------------


def edges(svg: str) -> list[tuple[float, float]]:
    """(x at the query heads, x at the key/value heads) of every line joining the two rows."""
    return [(float(el.get("x1")), float(el.get("x2"))) for el in parse(svg).iter(f"{SVG}line")
            if el.get("class") == "ar-edge"]


def centres(svg: str, hue: str) -> list[float]:
    """The x centres of the boxes of one hue (``q``, ``k`` or ``v``), left to right."""
    return [float(el.get("x")) + float(el.get("width")) / 2 for el in parse(svg).iter(f"{SVG}rect")
            if el.get("class") == f"ar-box ar-{hue}"]


@pytest.mark.parametrize(("H", "Hkv"), [(6, 2), (6, 1), (12, 12), (12, 4), (3, 1)])
def test_kv_head_groups_joins_query_head_h_to_key_value_head_h_over_g(H: int, Hkv: int):
    svg = diagrams.kv_head_groups(torch.randn(1, H, 3, 5), torch.randn(1, Hkv, 7, 5), torch.randn(1, Hkv, 7, 11))
    queries, keys, values = centres(svg, "q"), centres(svg, "k"), centres(svg, "v")
    assert len(queries) == H and len(keys) == len(values) == Hkv
    kv_centres = [(k + v) / 2 for k, v in zip(keys, values)]
    G = H // Hkv
    # one line per query head, from its box to the key/value head h // G: repeat_interleave's order
    expected = [(queries[h], kv_centres[h // G]) for h in range(H)]
    assert np.allclose(edges(svg), expected)
    text = text_of(svg)
    name = {1: "multi-query", H: "multi-head"}.get(Hkv, "grouped-query")
    assert text.startswith(f"{name} attention: H = {H}, Hkv = {Hkv}, G = H / Hkv = {G}")
    assert f"Hkv (E + Ev) = {Hkv * 16} numbers" in text
    assert "L × E = 3 × 5" in text and "S × E = 7 × 5" in text and "S × Ev = 7 × 11" in text


def test_kv_head_groups_the_order_is_that_of_enable_gqa():
    H, Hkv = 6, 2
    q, k, v = torch.randn(1, H, 3, 5), torch.randn(1, Hkv, 7, 5), torch.randn(1, Hkv, 7, 11)
    grouped = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    queries, keys = centres(diagrams.kv_head_groups(q, k, v), "q"), centres(diagrams.kv_head_groups(q, k, v), "k")
    drawn = [min(range(Hkv), key=lambda j: abs(keys[j] - x2)) for _, x2 in edges(diagrams.kv_head_groups(q, k, v))]
    assert len(drawn) == len(queries) == H
    for h, j in enumerate(drawn):
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, h], k[:, j], v[:, j])
        assert torch.allclose(grouped[:, h], alone, atol=1e-6)


def test_kv_head_groups_errors():
    q, kv = torch.randn(6, 3, 5), torch.randn(2, 7, 5)
    with pytest.raises(TypeError, match="key must be a torch.Tensor or numpy.ndarray, got list"):
        diagrams.kv_head_groups(q, [[1.0]], kv)
    with pytest.raises(ValueError, match=r"query must have at least 3 dims \(\.\.\., H, L, E\), got shape \(3, 5\)"):
        diagrams.kv_head_groups(q[0], kv, kv)
    with pytest.raises(ValueError, match="value must have as many heads .* Hkv=2, got shape"):
        diagrams.kv_head_groups(q, kv, torch.randn(3, 7, 5))
    with pytest.raises(ValueError, match="query heads H=6 .* must be a multiple of the key/value heads Hkv=4"):
        diagrams.kv_head_groups(q, torch.randn(4, 7, 5), torch.randn(4, 7, 5))
    with pytest.raises(ValueError, match="key must have size E=5"):
        diagrams.kv_head_groups(q, torch.randn(2, 7, 4), kv)
    with pytest.raises(ValueError, match=r"at most 12 query heads, got H=32; .* query\[\.\.\., :4, :, :\]"):
        diagrams.kv_head_groups(torch.randn(32, 3, 5), torch.randn(8, 7, 5), torch.randn(8, 7, 5))


# --- 4. self_vs_cross -----------------------------------------------------------------------


def test_self_vs_cross_sizes_from_ints_or_tensors():
    from_ints = diagrams.self_vs_cross(3, 7)
    from_tensors = diagrams.self_vs_cross(torch.randn(2, 3, 16), torch.randn(2, 7, 16))
    assert from_ints == from_tensors
    text = text_of(from_ints)
    assert "weights: L × L = 3 × 3" in text and "weights: L × S = 3 × 7" in text
    assert "S = 7" in text and "L = 3" in text
    # both grids share one cell size: the cross grid is 7/3 as wide as the self grid
    (self_w, self_h), (cross_w, cross_h) = rect_sizes(from_ints, "ar-box ar-w")
    assert self_h == cross_h and cross_w == pytest.approx(self_w * 7 / 3)
    assert diagrams.self_vs_cross(3, 11) != from_ints


def test_self_vs_cross_errors():
    with pytest.raises(TypeError, match="key must be an int, got str"):
        diagrams.self_vs_cross(3, "7")
    with pytest.raises(ValueError, match=r"query must be an int >= 1, got 0"):
        diagrams.self_vs_cross(0, 7)
    with pytest.raises(ValueError, match=r"key must have at least 2 dims .* got shape \(7,\)"):
        diagrams.self_vs_cross(3, torch.randn(7))


# --- 5. path_length -------------------------------------------------------------------------


def test_path_length_counts():
    svg = diagrams.path_length(7)
    text = text_of(svg)
    assert "L − 1 = 6 sequential steps" in text and "L × L = 49 scores" in text
    root = parse(svg)
    arcs = [p for p in root.iter(f"{SVG}path") if p.get("class") == "ar-edge ar-w"]
    arrows = [p for p in root.iter(f"{SVG}line") if p.get("class") == "ar-arrow"]
    assert len(arcs) == 6 and len(arrows) == 6  # the last token's edges; the chain's steps
    assert len(list(root.iter(f"{SVG}circle"))) == 2 * 7
    assert diagrams.path_length(8) != svg


def test_path_length_errors():
    with pytest.raises(TypeError, match="n must be an int, got float"):
        diagrams.path_length(7.0)
    with pytest.raises(ValueError, match=r"n must be an int in \[2, 12\], got 13"):
        diagrams.path_length(13)
    with pytest.raises(ValueError, match=r"n must be an int in \[2, 12\], got 1"):
        diagrams.path_length(1)


# --- 6. flash_tiling ------------------------------------------------------------------------


def brute_force_counts(L: int, S: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(computed, skipped, cut by the diagonal) from the causal mask itself, cell by cell."""
    allowed = torch.ones(L, S, dtype=torch.bool).tril()  # top-left aligned: j <= i
    computed = skipped = cut = 0
    for i0 in range(0, L, block_q):
        for j0 in range(0, S, block_k):
            block = allowed[i0:i0 + block_q, j0:j0 + block_k]
            if not block.any():
                skipped += 1
            else:
                computed += 1
                cut += int(not block.all())
    return computed, skipped, cut


@pytest.mark.parametrize(("L", "S", "block_q", "block_k"),
                         [(11, 13, 3, 5), (13, 11, 5, 3), (8, 8, 4, 2), (7, 3, 7, 1), (1, 5, 2, 2), (30, 30, 7, 7)])
def test_flash_tiling_counts_match_the_causal_mask(L, S, block_q, block_k):
    computed, skipped, cut = brute_force_counts(L, S, block_q, block_k)
    text = text_of(diagrams.flash_tiling(L, S, block_q, block_k, causal=True))
    Tq, Tk = -(-L // block_q), -(-S // block_k)
    assert f"{Tq} × {Tk} = {Tq * Tk} blocks: computed {computed}, skipped {skipped} ({cut} cut by the diagonal)" \
        in text
    assert f"L × S = {L} × {S}" in text


def test_flash_tiling_without_causal_computes_every_block_in_order():
    svg = diagrams.flash_tiling(12, 10, 4, 5)
    text = text_of(svg)
    assert "3 × 2 = 6 blocks: computed 6, skipped 0" in text and "masked" not in text
    assert "visits K1 → K2 in order" in text and "acc: 4 × Ev" in text
    assert "m" in text and "running max" in text and "running sum" in text
    # the visiting order of the last query block, numbered in its blocks
    numbers = [t for t in parse(svg).iter(f"{SVG}text") if t.get("font-weight") == "bold" and t.text in ("1", "2")]
    assert len(numbers) == 2
    assert diagrams.flash_tiling(12, 10, 4, 2) != svg


def test_flash_tiling_large_matrix_stays_small():
    svg = diagrams.flash_tiling(8192, 8192, 512, 512, causal=True)
    assert len(svg) < 60_000  # the masked triangles are straight lines, not one step per row
    assert "computed 136, skipped 120" in text_of(svg)


def test_flash_tiling_errors():
    with pytest.raises(TypeError, match="block_k must be an int, got float"):
        diagrams.flash_tiling(8, 8, 4, 2.0)
    with pytest.raises(ValueError, match=r"L must be an int >= 1, got 0"):
        diagrams.flash_tiling(0, 8, 4, 2)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        diagrams.flash_tiling(8, 8, 4, 2, causal=1)
    with pytest.raises(ValueError, match=r"block_q must leave at most 24 blocks along L, got 25 blocks "
                                         r"\(L = 100, block_q = 4\)"):
        diagrams.flash_tiling(100, 8, 4, 2)


def test_a_diagram_says_the_width_at_which_its_smallest_text_reads_at_9_px():
    import math
    import re

    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    for svg in (diagrams.sdpa_flow(q, k, v), diagrams.path_length(8), diagrams.flash_tiling(9, 10, block_q=4, block_k=5)):
        root = parse(svg)
        width = float(root.get("viewBox").split()[2])
        smallest = min(float(size) for size in re.findall(r'font-size="([\d.]+)"', svg))
        readable = re.search(r"--ar-readable-width:(\d+)px", root.get("style"))
        assert readable, root.get("style")
        assert int(readable.group(1)) == math.ceil(width * 9 / smallest)
        assert smallest * int(readable.group(1)) / width >= 9  # at that width, the smallest text is 9 px
