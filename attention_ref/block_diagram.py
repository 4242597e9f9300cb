"""The Transformer block around attention, drawn as an inline SVG from a module's sizes.

A diagram in the style of [`attention_ref.diagrams`][attention_ref.diagrams] (the same
markup, classes and colours, so it follows the site's light and dark schemes), kept in its
own module for now; it belongs beside the other diagrams and can move there unchanged.

Shapes use the package legend: ``B`` batch, ``H`` heads, ``L`` query length, ``S`` key
length, ``d`` model width.
"""

from __future__ import annotations

import torch

from attention_ref.diagrams import _Canvas, _dims, _int, _self_attention_input
from attention_ref.multihead import MultiHeadAttention

__all__ = ["transformer_block"]

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
    its own size) and uses the classes of `attention_ref.diagrams`.

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
        >>> from attention_ref.block_diagram import transformer_block
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
