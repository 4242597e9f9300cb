"""Each page's code starts from the same global state, whatever page ran before it.

markdown-exec runs every page's blocks in one Python process, so a global setting a page
changes would reach the pages built after it: `torch.set_printoptions` (pages 9 and Position
set it) would change how later pages print tensors, depending on the build order. Before a page's
blocks run, torch's print options go back to their defaults. tests/docs/conftest.py does the
same before the first block of each page, so the tests see what the site shows.
"""

from __future__ import annotations


def reset_global_state() -> None:
    """torch's print options back to their defaults (if torch is imported at all)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_printoptions(profile="default")


def on_page_markdown(markdown: str, **kwargs) -> str:
    reset_global_state()
    return markdown
