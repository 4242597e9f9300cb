"""Every formula of the built site parses with the KaTeX the site ships.

A strict build does not catch bad TeX (KaTeX would show it in red in the reader's browser), so
this extracts the contents of every .arithmatex element from the built HTML and parses each
with katex.renderToString(..., {throwOnError: true}) in Node, using the site's own
assets/vendor/katex/katex.min.js.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

NODE_SCRIPT = r"""
const katex = require(process.argv[1]);
const formulas = JSON.parse(require("fs").readFileSync(0, "utf8"));
const failures = [];
for (const f of formulas) {
  try {
    katex.renderToString(f.tex, { displayMode: f.display, throwOnError: true });
  } catch (error) {
    failures.push({ ...f, error: String(error.message || error) });
  }
}
process.stdout.write(JSON.stringify(failures));
"""

DELIMITERS = {False: ("\\(", "\\)"), True: ("\\[", "\\]")}


class _ArithmatexParser(HTMLParser):
    """Collects the text of each element with class "arithmatex"."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, bool]] = []  # (text, display)
        self._depth = 0
        self._display = False
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if self._depth:
            self._depth += 1
        elif "arithmatex" in (dict(attrs).get("class") or "").split():
            self._depth, self._display, self._text = 1, tag == "div", []

    def handle_endtag(self, tag):
        if self._depth:
            self._depth -= 1
            if not self._depth:
                self.found.append(("".join(self._text), self._display))

    def handle_data(self, data):
        if self._depth:
            self._text.append(data)


def formulas_of(html: str) -> list[tuple[str, bool]]:
    """(TeX without its delimiters, display mode) of each .arithmatex element."""
    parser = _ArithmatexParser()
    parser.feed(html)
    result = []
    for text, display in parser.found:
        text = text.strip()
        left, right = DELIMITERS[display]
        if text.startswith(left) and text.endswith(right):
            text = text[len(left):-len(right)].strip()
        result.append((text, display))
    return result


def site_formulas(site: Path) -> list[dict]:
    formulas = []
    for page in sorted(site.rglob("*.html")):
        for tex, display in formulas_of(page.read_text(encoding="utf-8")):
            formulas.append({"page": str(page.relative_to(site)), "tex": tex, "display": display})
    return formulas


def katex_errors(katex_js: Path, formulas: list[dict]) -> list[dict]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js (`node`) is needed to parse the site's formulas with KaTeX")
    run = subprocess.run([node, "-e", NODE_SCRIPT, str(katex_js)], input=json.dumps(formulas),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_formula_extraction():
    html = ('<p>a <span class="arithmatex">\\(x &lt; y\\)</span> b</p>'
            '<div class="arithmatex">\\[\n\\frac{1}{2}\n\\]</div><span class="other">\\(z\\)</span>')
    assert formulas_of(html) == [("x < y", False), ("\\frac{1}{2}", True)]


def test_katex_rejects_bad_tex(built_site: Path):
    """The check below can fail: KaTeX in Node rejects malformed TeX."""
    bad = [{"page": "p", "tex": "\\frac{1}{", "display": False},
           {"page": "p", "tex": "\\notacommand x", "display": True},
           {"page": "p", "tex": "x^2", "display": False}]
    errors = katex_errors(built_site / "assets/vendor/katex/katex.min.js", bad)
    assert [e["tex"] for e in errors] == ["\\frac{1}{", "\\notacommand x"]


def test_every_formula_parses_with_katex(built_site: Path):
    formulas = site_formulas(built_site)
    assert formulas, "the site has no .arithmatex formulas: is pymdownx.arithmatex configured?"
    errors = katex_errors(built_site / "assets/vendor/katex/katex.min.js", formulas)
    report = "\n".join(f"{e['page']}: {e['tex']!r}\n    {e['error']}" for e in errors)
    assert not errors, f"{len(errors)} of {len(formulas)} formulas do not parse:\n{report}"
