"""MkDocs hook: every tutorial page is also a Jupyter notebook, linked at the top of the page.

The notebook is built from the page as it is executed: its prose becomes Markdown cells and
every executed block (```python exec="on"```) a code cell, hidden lines included (they are
the checks that keep the page honest, so the notebook checks the same claims). The cells run
top to bottom in one namespace, as the page's session does. A first code cell makes the
figures the page prints as SVG show as pictures in Jupyter; run as a plain script the
notebook prints them as text.

The file is written next to the page's HTML (``tutorial/01-intuition/01-intuition.ipynb``),
so the link at the top of the page is relative and works wherever the site is served.
tests/site/test_notebooks.py runs every notebook's code cells.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import sys
from pathlib import Path, PurePosixPath

SECTIONS = ("tutorial/",)  # the pages that get a notebook (source paths relative to docs/)
_pending: dict[str, object] = {}  # site-relative path of the notebook -> its notebook node

# Material admonitions (!!! note "Title", ??? question "Title", ???+ ...) do not render in
# Jupyter: their title becomes a bold line and their body is dedented.
_ADMONITION = re.compile(r'^(?P<indent>[ \t]*)(?:!!!|\?\?\?\+?)\s+[\w-]+(?:\s+"(?P<title>[^"]*)")?\s*$')
_ATTR_LIST = re.compile(r"\{\s*[.#:][^}\n]*\}")  # attr_list { .class } left on links and images

SETUP_CELL = '''\
# Set-up for Jupyter (not on the page): the page prints its figures as SVG text;
# here they are shown as pictures. Run as a plain script, they print as text.
import builtins

try:
    from IPython.display import HTML, display
except ImportError:
    pass
else:
    def print(*args, **kwargs):
        text = " ".join(str(arg) for arg in args)
        if text.lstrip().startswith(("<svg", "<div", "<figure")):
            display(HTML(text))
        else:
            builtins.print(*args, **kwargs)
'''


def _fences():
    name = "attention_ref_docs_fences"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fences.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def notebook_name(src_uri: str) -> str:
    """The notebook's file name for a page: ``tutorial/01-intuition.md`` -> ``01-intuition.ipynb``."""
    return PurePosixPath(src_uri).stem + ".ipynb"


def prose_to_notebook_markdown(text: str, stack: list[int] | None = None, link=None) -> str:
    """Material-only Markdown made plain: admonitions become a bold title and a dedented body.

    ``stack`` holds the body indentation of the admonitions still open; pass the same list for
    every prose chunk of a page, so that text after a code block inside an admonition (a
    solution's last sentence) is dedented too. ``link`` maps a relative link target (a page's
    ``.md`` path) to the address it should have in the notebook.
    """
    out: list[str] = []
    stack = [] if stack is None else stack
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if line.strip():
            while stack and indent < stack[-1]:
                stack.pop()
        shift = 4 * len(stack)
        match = _ADMONITION.match(line)
        if match:
            title = match["title"] or ""
            out.append(" " * max(len(match["indent"]) - shift, 0) + (f"**{title}**" if title else ""))
            stack.append(len(match["indent"]) + 4)
            continue
        out.append(line[shift:] if line[:shift].strip() == "" else line.lstrip())
    plain = _ATTR_LIST.sub("", "\n".join(out)).strip()
    if link is not None:
        plain = _MD_LINK.sub(lambda m: f"]({link(m['target'])}{m['anchor'] or ''})", plain)
    return plain


_MD_LINK = re.compile(r"\]\((?P<target>(?![a-z]+:)[^)#\s]+\.md)(?P<anchor>#[^)\s]*)?\)")


def _site_link(site_url: str, src_uri: str):
    """A function from a relative ``.md`` link of page ``src_uri`` to the page's address."""

    def link(target: str) -> str:
        path = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target))
        stem = path.removesuffix(".md")
        url = "" if stem == "index" else (stem.removesuffix("/index") if stem.endswith("/index") else stem) + "/"
        return site_url.rstrip("/") + "/" + url

    return link


def page_notebook(markdown: str, *, title: str, url: str, src_uri: str = "", site_url: str = ""):
    """The notebook (an nbformat v4 node) of one page's Markdown source."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    fences = _fences()
    cells = [
        new_markdown_cell(
            f"# {title}\n\nThis notebook is a page of the attention_ref tutorial: {url}\n\n"
            "It needs the `attention_ref` package with its plot extra (from the project's "
            "repository: `pip install -e \".[plot]\"`). Run the cells in order; the lines "
            "that check the page's claims (marked `# markdown-exec: hide` on the page, where "
            "they are hidden) run here too."),
        new_code_cell(SETUP_CELL.rstrip()),
    ]
    stack: list[int] = []  # admonitions open across the page's prose and code
    link = _site_link(site_url, src_uri) if site_url else None
    for part in fences.split_page(markdown):
        if isinstance(part, str):
            text = prose_to_notebook_markdown(part, stack, link)
            heading = re.match(r"^# [^\n]*\n*", text)  # the page title is the first cell's
            if heading and len(cells) == 2:
                text = text[heading.end():]
            if text:
                cells.append(new_markdown_cell(text))
        else:
            cells.append(new_code_cell(part.code.rstrip("\n")))
    notebook = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    nbformat.validate(notebook)
    return notebook


def _wants_notebook(page) -> bool:
    return page.file.src_uri.startswith(SECTIONS)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if not _wants_notebook(page):
        return markdown
    name = notebook_name(page.file.src_uri)
    dest = PurePosixPath(page.file.dest_uri).parent / name
    title = page.title or PurePosixPath(page.file.src_uri).stem
    site_url = config.get("site_url") or ""
    _pending[str(dest)] = page_notebook(markdown, title=str(title), url=site_url + page.url,
                                        src_uri=page.file.src_uri, site_url=site_url)
    link = (f'<p class="ar-notebook"><a href="{name}" download>Download this page as a '
            f"Jupyter notebook</a> ({name}): its code, checks included, to run yourself.</p>")
    lines = markdown.splitlines()
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    return "\n".join(lines[:at] + ["", link, ""] + lines[at:])


def on_post_build(config, **kwargs) -> None:
    import nbformat

    site = Path(config["site_dir"])
    for dest, notebook in _pending.items():
        target = site / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, str(target))
    _pending.clear()
