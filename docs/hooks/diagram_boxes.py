"""MkDocs hook: each concept diagram of `attention_ref.diagrams` sits in a box of its own that scrolls.

A diagram's SVG scales with the column but says the width below which its smallest label would
render under 9 px (``--ar-readable-width``); docs/stylesheets/diagrams.css keeps it at least that
wide. On a phone that is wider than the column, so the diagram needs a box that scrolls sideways
(the page itself never does), marked by docs/javascripts/wide.js so that the page says so under it.
The package returns the bare SVG (a notebook or another site has no use for this box); this hook
puts each one in ``<div class="ar-diagram-box">`` when the page is rendered.
"""

from __future__ import annotations

import re

_DIAGRAM = re.compile(r'<svg xmlns="http://www.w3.org/2000/svg" class="ar-diagram".*?</svg>', re.DOTALL)


def boxed(html: str) -> str:
    """``html`` with every diagram's ``<svg>`` inside a ``<div class="ar-diagram-box">``."""
    return _DIAGRAM.sub(lambda m: f'<div class="ar-diagram-box">{m.group()}</div>', html)


def on_page_content(html: str, page, config, files, **kwargs) -> str:
    return boxed(html)
