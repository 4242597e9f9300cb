"""Checks of the built files that need no browser: the site references nothing outside itself,
and the KaTeX assets it references were copied into it."""

from __future__ import annotations

import re
from pathlib import Path

# src="..." / href="..." of things a browser loads by itself (not <a href>, not rel=canonical)
LOADED = re.compile(
    r"""<(?:script|img|iframe|source|video|audio)\b[^>]*\bsrc=["']([^"']+)["']"""
    r"""|<link\b(?=[^>]*\brel=["']?(?:stylesheet|preload|icon|modulepreload|manifest))[^>]*\bhref=["']([^"']+)["']""",
    re.IGNORECASE,
)
CSS_URL = re.compile(r"""url\(\s*["']?([^"')]+)["']?\s*\)|@import\s+["']([^"']+)["']""")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)


def test_pages_load_nothing_from_other_hosts(built_site: Path):
    pages = sorted(built_site.rglob("*.html"))
    assert pages
    external = [f"{page.relative_to(built_site)}: {url}"
                for page in pages
                for match in LOADED.finditer(page.read_text(encoding="utf-8"))
                for url in match.groups() if url and EXTERNAL.match(url)]
    assert not external, "resources from other hosts:\n" + "\n".join(external)


def test_stylesheets_load_nothing_from_other_hosts(built_site: Path):
    sheets = sorted(built_site.rglob("*.css"))
    assert sheets
    external = [f"{css.relative_to(built_site)}: {url}"
                for css in sheets
                for match in CSS_URL.finditer(css.read_text(encoding="utf-8"))
                for url in match.groups() if url and EXTERNAL.match(url)]
    assert not external, "stylesheet URLs on other hosts:\n" + "\n".join(external)


def test_katex_fonts_referenced_by_its_stylesheet_are_shipped(built_site: Path):
    katex = built_site / "assets" / "vendor" / "katex"
    css = (katex / "katex.min.css").read_text(encoding="utf-8")
    woff2 = sorted({m[0] for m in CSS_URL.findall(css) if m[0].endswith(".woff2")})
    assert len(woff2) >= 10, woff2
    missing = [f for f in woff2 if not (katex / f).is_file()]
    assert not missing, f"KaTeX fonts missing from the site: {missing} (run `python3 dev.py setup`)"


def test_extra_assets_exist(built_site: Path):
    """Every script and stylesheet a page links with a relative URL is in the site."""
    page = built_site / "index.html"
    missing = []
    for match in LOADED.finditer(page.read_text(encoding="utf-8")):
        url = next(u for u in match.groups() if u)
        if not EXTERNAL.match(url) and not url.startswith("data:"):
            path = (page.parent / url.split("?")[0].split("#")[0]).resolve()
            if not path.is_file():
                missing.append(url)
    assert not missing, f"index.html links files the build does not contain: {missing}"
