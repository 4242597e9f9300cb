"""MkDocs hook: every tutorial page is also a Jupyter notebook, linked at the top of the page.

The notebook is built from the page as it is executed, so that a reader can take the page
home and run it:

- its first code cell installs the package with the one install line of the site
  (``INSTALL_LINE``, commented out so that running all cells again does not reinstall), the
  second makes the figures the page prints as SVG show as pictures in Jupyter;
- its prose becomes Markdown cells: Material admonitions become a bold title and a dedented
  body, inline math ``\\( \\)`` becomes ``$ $`` (what JupyterLab, VS Code and GitHub render),
  and links to other pages point to the published site;
- every executed block (```python exec="on"```) becomes a code cell holding the code the page
  shows, with the output the page printed while the site was built (recorded from
  markdown-exec as it ran the block, not run a second time). The hidden lines (marked
  ``# markdown-exec: hide``) that are whole statements of the block, the asserts that keep the
  page honest, follow in one cell labelled "Checks"; hidden lines inside a shown statement
  stay on the site only (the page runs them; tests/docs/test_shown_code.py shows that the
  shown code prints the same without them);
- before each solution of an exercise comes an empty "Your turn" cell;
- the interactive explorer (``viz.explorer_html``), which needs the site's JavaScript, is
  replaced by a static heatmap of the view it opens on and a link to the page.

Links point to the published site: ``ATTENTION_REF_PUBLISHED_URL`` if set, else ``site_url``
when it is not a local address, else the GitHub Pages address of ``repo_url`` (a github.com
repository). A local build with none of these (``python3 dev.py check`` builds for
127.0.0.1) writes the links relative to the notebook's place on the site instead of to
127.0.0.1.

The file is written next to the page's HTML (``tutorial/01-intuition/01-intuition.ipynb``),
so the link at the top of the page is relative and works wherever the site is served.
tests/site/test_notebooks.py checks every notebook's cells and runs them; the fresh
environment test (tests/site/test_fresh_notebooks.py) installs the package with
``INSTALL_LINE`` into a new virtual environment and runs every notebook there.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import posixpath
import re
import sys
import urllib.parse
from pathlib import Path, PurePosixPath

SECTIONS = ("tutorial/",)  # the pages that get a notebook (source paths relative to docs/)

# The one install line of the site: the home page, the how-tos, the README and the notebooks
# use it word for word (tests/site/test_fresh_notebooks.py checks that, and runs it). Run at
# the root of a clone of the repository: constraints.txt pins torch==2.13.0 (the CPU build;
# an unpinned torch pulls the multi-GB CUDA build) and the versions tested together; the
# `learn` extra adds matplotlib and the pretrained model of pages 1 and 6.
INSTALL_LINE = 'pip install -c constraints.txt ".[learn]"'

_pending: dict[str, object] = {}  # site-relative path of the notebook -> its notebook node
_runs: list[tuple[str | None, str, str, dict]] = []  # the current page's (session, code, output, extra)
_state: dict[str, object] = {"recording": False}
log = logging.getLogger(f"mkdocs.hooks.{__name__}")

# Material admonitions (!!! note "Title", ??? question "Title", ???+ ...) do not render in
# Jupyter: their title becomes a bold line and their body is dedented.
_ADMONITION = re.compile(r'^(?P<indent>[ \t]*)(?:!!!|\?\?\?\+?)\s+[\w-]+(?:\s+"(?P<title>[^"]*)")?\s*$')
_SOLUTION = re.compile(r'^[ \t]*(?:!!!|\?\?\?\+?)\s+success\b')  # the solution of an exercise
_ATTR_LIST = re.compile(r"\{\s*[.#:][^}\n]*\}")  # attr_list { .class } left on links and images
# Text that math conversion must leave alone: fenced code, inline code.
_CODE = re.compile(r"(^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\2[ \t]*$|`[^`\n]+`)", re.M | re.S)
_INLINE_MATH = re.compile(r"\\\((.+?)\\\)", re.S)
_DISPLAY_MATH = re.compile(r"\\\[(.+?)\\\]", re.S)
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1", ""}

INSTALL_CELL = f'''\
# Install (once per environment), in a terminal at the root of a clone of the repository:
#     python3 -m venv .venv && . .venv/bin/activate
#     {INSTALL_LINE}
# constraints.txt pins torch 2.13.0 (the CPU build) and the versions the site was built with.
# Or uncomment the next line, run this cell from the clone's root, then restart the kernel.
# It is commented out so that running all cells again does not reinstall.
# %{INSTALL_LINE}'''

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

CHECKS_HEADER = ("# Checks (hidden on the page): the asserts that keep the page's claims true.\n"
                 "# They print nothing; an AssertionError means a claim no longer holds.\n")
YOUR_TURN = "# Your turn: write and run your answer here, then open the solution below."


# docs/hooks/fences.py, loaded once by path: serve_workers.fences, shared with reload.py's workers
if str(Path(__file__).parent) not in sys.path:
    sys.path.append(str(Path(__file__).parent))
from serve_workers import fences as _fences


def notebook_name(src_uri: str) -> str:
    """The notebook's file name for a page: ``tutorial/01-intuition.md`` -> ``01-intuition.ipynb``."""
    return PurePosixPath(src_uri).stem + ".ipynb"


def dollar_math(text: str) -> str:
    r"""``\( x \)`` -> ``$x$`` and ``\[ x \]`` -> ``$$x$$``, outside code spans and fences."""

    def convert(chunk: str) -> str:
        chunk = _DISPLAY_MATH.sub(lambda m: f"$${m[1].strip()}$$", chunk)
        return _INLINE_MATH.sub(lambda m: f"${m[1].strip()}$", chunk)

    out, at = [], 0
    for match in _CODE.finditer(text):
        out += [convert(text[at:match.start()]), match[0]]
        at = match.end()
    return "".join(out + [convert(text[at:])])


def prose_to_notebook_markdown(text: str, stack: list[int] | None = None, link=None) -> str:
    """Material-only Markdown made plain: admonitions become a bold title and a dedented body.

    ``stack`` holds the body indentation of the admonitions still open; pass the same list for
    every prose chunk of a page, so that text after a code block inside an admonition (a
    solution's last sentence) is dedented too. ``link`` maps a relative link target (a page's
    ``.md`` path) to the address it should have in the notebook. Inline math becomes ``$``-math.
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
    plain = dollar_math(_ATTR_LIST.sub("", "\n".join(out)).strip())
    if link is not None:
        plain = _MD_LINK.sub(lambda m: f"]({link(m['target'])}{m['anchor'] or ''})", plain)
    return plain


_MD_LINK = re.compile(r"\]\((?P<target>(?![a-z]+:)[^)#\s]+\.md)(?P<anchor>#[^)\s]*)?\)")


def _page_path(src_uri: str, target: str = "") -> str:
    """The site path (``tutorial/04-shapes/``) of a page's relative ``.md`` link, or of the page."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target or
                                             posixpath.basename(src_uri)))
    stem = path.removesuffix(".md")
    return "" if stem == "index" else (stem.removesuffix("/index") if stem.endswith("/index") else stem) + "/"


def _site_link(site_url: str, src_uri: str):
    """A function from a relative ``.md`` link of page ``src_uri`` to the page's address:
    absolute under ``site_url``, or (no ``site_url``) relative to the notebook's place on the
    site, which is next to the page's HTML."""
    here = _page_path(src_uri)

    def link(target: str) -> str:
        path = _page_path(src_uri, target)
        if site_url:
            return site_url.rstrip("/") + "/" + path
        return posixpath.relpath(path or ".", here or ".") + "/"

    return link


def published_url(config) -> str:
    """The address the notebooks link to (trailing slash), or "" when no published one is known."""
    given = os.environ.get("ATTENTION_REF_PUBLISHED_URL")
    if given:
        return given.rstrip("/") + "/"
    site_url = config.get("site_url") or ""
    if site_url and urllib.parse.urlsplit(site_url).hostname not in _LOCAL_HOSTS:
        return site_url.rstrip("/") + "/"
    repo = urllib.parse.urlsplit(config.get("repo_url") or "")
    parts = [p for p in repo.path.split("/") if p]
    if repo.hostname == "github.com" and len(parts) == 2:
        owner, name = parts[0], parts[1].removesuffix(".git")
        if name.lower() == f"{owner.lower()}.github.io":
            return f"https://{owner.lower()}.github.io/"
        return f"https://{owner.lower()}.github.io/{name}/"
    return ""


def split_hidden(code: str) -> tuple[str, str]:
    """A block's code as (the code the page shows, its hidden whole statements).

    A top-level statement whose lines are all marked ``# markdown-exec: hide`` is a check: it
    goes to the second string, unmarked, to run after the shown code; unless a later shown
    statement rebinds a name it reads (it would then see another value). Those, and hidden
    lines inside a shown statement, are left out of both (they run on the site only).
    """
    fences = _fences()
    lines = code.splitlines()
    hidden = [bool(fences.HIDE_MARKER.search(line)) for line in lines]
    checks: list[str] = []
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = None
    body = tree.body if tree else []
    is_hidden = [all(hidden[i] or not lines[i].strip() for i in range(s.lineno - 1, s.end_lineno))
                 and any(hidden[i] for i in range(s.lineno - 1, s.end_lineno)) for s in body]
    dropped: set[str] = set()  # names bound by hidden statements that stay on the page
    for n, stmt in enumerate(body):
        if not is_hidden[n]:
            continue
        reads = {x.id for x in ast.walk(stmt) if isinstance(x, ast.Name)}
        rebound = {x.id for later, h in zip(body[n + 1:], is_hidden[n + 1:]) if not h
                   for x in ast.walk(later) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
        if reads & (rebound | dropped):  # run after the block, it would see other values
            dropped |= {x.id for x in ast.walk(stmt) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
            continue
        checks += [fences.HIDE_MARKER.sub("", lines[i]) for i in range(stmt.lineno - 1, stmt.end_lineno)]
    shown = "\n".join(line for line, h in zip(lines, hidden) if not h)
    return shown.strip("\n"), "\n".join(checks).strip("\n")


def _explorer_call(code: str):
    """The top-level ``print(explorer_html(...))`` statement of a block and its keywords, if any."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for stmt in tree.body:
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and getattr(stmt.value.func, "id", "") == "print" and stmt.value.args
                and isinstance(stmt.value.args[0], ast.Call)):
            inner = stmt.value.args[0]
            name = getattr(inner.func, "id", None) or getattr(inner.func, "attr", "")
            if name == "explorer_html":
                keywords = {k.arg: ast.get_source_segment(code, k.value) for k in inner.keywords if k.arg}
                positional = [ast.get_source_segment(code, a) for a in inner.args]
                return stmt, keywords, positional
    return None


def static_explorer(code: str, page_url: str) -> str | None:
    """The block with its explorer replaced by a heatmap of the view the explorer opens on."""
    found = _explorer_call(code)
    if found is None:
        return None
    stmt, kw, positional = found
    if "sentences" in kw:
        pick = f"list(({kw['sentences']}).values())[{kw.get('initial_sentence', '0')}]"
    elif len(positional) == 2:
        pick = f"({positional[0]}, {positional[1]})"
    elif "tokens" in kw and "weights" in kw:
        pick = f"({kw['tokens']}, {kw['weights']})"
    else:
        return None
    layer, head = kw.get("initial_layer", "0"), kw.get("initial_head", "0")
    lines = code.splitlines()
    before, after = lines[:stmt.lineno - 1], lines[stmt.end_lineno:]
    static = [
        f"# On the site this is an interactive explorer (click a token, pick the sentence,",
        f"# layer and head): {page_url}",
        "# Here, a picture of the view it opens on: one head's weights, a row per query token.",
        "from attention_ref.viz import heatmap, to_svg",
        "",
        f"ex_tokens, ex_weights = {pick}  # tokens, weights ((layers,) H, L, L)",
        f"ex_layer, ex_head = {layer}, {head}",
        "ex_w = ex_weights[ex_layer, ex_head] if ex_weights.dim() == 4 else ex_weights[ex_head]",
        "print(to_svg(heatmap(ex_w, ex_tokens,",
        '                     title=f"layer {ex_layer}, head {ex_head}" if ex_weights.dim() == 4',
        '                     else f"head {ex_head}")))',
    ]
    return "\n".join(before + static + after).strip("\n"), "\n".join(static)


def _outputs(text: str, html: bool) -> list:
    from nbformat.v4 import new_output

    if not text.strip():
        return []
    if html:
        data = {"text/html": text, "text/plain": "<figure: see the page>"}
        if text.lstrip().startswith("<svg") and text.rstrip().endswith("</svg>"):
            data["image/svg+xml"] = text
        return [new_output("display_data", data=data)]
    return [new_output("stream", name="stdout", text=text)]


def page_notebook(markdown: str, *, title: str, url: str, src_uri: str = "", site_url: str = "",
                  runs: list | None = None):
    """The notebook (an nbformat v4 node) of one page's Markdown source.

    ``url`` is the page's address, ``site_url`` the published site's ("" for links relative
    to the notebook's place on the site). ``runs`` are the page's executed blocks as
    markdown-exec ran them, ``(session, code, output, extra)``: each code cell then stores the
    output of its block (blocks are matched by their code, in order).
    """
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    fences = _fences()
    where = f"[{url}]({url})" if "://" in url else f"`{url}` on the site"
    cells = [
        new_markdown_cell(
            f"# {title}\n\nThis notebook is a page of the attention_ref tutorial, {where}, with "
            "the output the page printed when the site was built. Install the package with the "
            "first code cell, then run the cells in order. After each block of the page, a cell "
            "labelled *Checks* holds the asserts that keep the page's claims true (hidden on "
            "the page); before each solution, an empty *Your turn* cell is yours."),
        new_code_cell(INSTALL_CELL),
        new_code_cell(SETUP_CELL.rstrip()),
    ]
    stack: list[int] = []  # admonitions open across the page's prose and code
    link = _site_link(site_url, src_uri) if src_uri else None
    pending = list(runs or [])

    def run_of(block) -> tuple[str, dict]:
        for i, (session, code, output, extra) in enumerate(pending):
            if session == block.session and code.strip() == block.code.strip():
                del pending[:i + 1]
                return output, extra
        return "", {}

    def add_prose(text: str) -> None:
        text = prose_to_notebook_markdown(text, stack, link)
        heading = re.match(r"^# [^\n]*\n*", text)  # the page title is the first cell's
        if heading and len(cells) == 3:
            text = text[heading.end():]
        if text:
            cells.append(new_markdown_cell(text))

    for part in fences.split_page(markdown):
        if isinstance(part, str):
            chunk: list[str] = []
            for line in part.splitlines():
                if _SOLUTION.match(line):  # an empty cell to try the exercise first
                    add_prose("\n".join(chunk))
                    chunk = []
                    cells.append(new_code_cell(YOUR_TURN))
                chunk.append(line)
            add_prose("\n".join(chunk))
            continue
        output, extra = run_of(part)
        outputs = _outputs(output, fences.is_on(extra.get("html", part.options.get("html"))))
        shown, checks = split_hidden(part.code)
        static = static_explorer(shown, url)
        if static is not None:
            page_link = url if "://" in url else "./"
            cells.append(new_markdown_cell(
                "On the page, the next cell draws an interactive explorer, which needs the "
                f"site: [open it there]({page_link}). Here it draws a static picture instead."))
            shown = static[0]
            outputs = _outputs(extra.get("static", ""), True)
        cells.append(new_code_cell(shown, outputs=outputs))
        if checks:
            cells.append(new_code_cell(CHECKS_HEADER + checks))
    notebook = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    nbformat.validate(notebook)
    return notebook


def _wants_notebook(page) -> bool:
    return page.file.src_uri.startswith(SECTIONS)


def _record() -> None:
    """Wrap markdown-exec's Python runner (once) to record each block's output for the notebook.

    Wraps whatever runner is in place (under ``mkdocs serve`` the reload hook's cache), so the
    output recorded is the one the page shows. For an explorer block, it also draws the static
    picture the notebook shows instead, in a copy of the session's namespace right after the
    block ran (later blocks may rebind the names it uses).
    """
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_notebooks", False):
        return

    def recording_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        output = run(code, returncode, session, id, **extra)
        if _state["recording"]:
            extra = dict(extra)
            found = static_explorer(split_hidden(code)[0], "")
            if found is not None and session:
                extra["static"] = _draw(found[1], formatter._sessions_globals.get(session, {}))
            _runs.append((session, code, output, extra))
        return output

    recording_run._attention_ref_notebooks = True
    formatter._run_python = recording_run


def _draw(code: str, namespace: dict) -> str:
    printed = io.StringIO()
    scope = dict(namespace)
    scope["print"] = lambda *args, **kwargs: print(*args, **{**kwargs, "file": printed})
    try:
        exec(compile(code, "<notebook static explorer>", "exec"), scope)
    except Exception as error:  # noqa: BLE001 - the notebook then has no stored output here
        log.info("notebooks hook: the explorer's static picture failed: %s", error)
        return ""
    return printed.getvalue()


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    _state["recording"] = False
    if not _wants_notebook(page):
        return markdown
    _record()
    _runs.clear()
    _state["recording"] = True
    name = notebook_name(page.file.src_uri)
    _state["page"] = (page, markdown)
    link = (f'<p class="ar-notebook"><a href="{name}" download>Download this page as a '
            f"Jupyter notebook</a> ({name}): its code and outputs, checks included, to run "
            "yourself.</p>")
    lines = markdown.splitlines()
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    return "\n".join(lines[:at] + ["", link, ""] + lines[at:])


def on_page_content(html: str, page, config, files, **kwargs) -> str:
    """The page's blocks have run: its notebook, with their outputs."""
    if not _state.get("recording"):
        return html
    _state["recording"] = False
    page_, markdown = _state.pop("page")
    if page_ is not page:
        return html
    dest = PurePosixPath(page.file.dest_uri).parent / notebook_name(page.file.src_uri)
    title = page.title or PurePosixPath(page.file.src_uri).stem
    base = published_url(config)
    url = base + _page_path(page.file.src_uri) if base else _page_path(page.file.src_uri)
    _pending[str(dest)] = page_notebook(markdown, title=str(title), url=url,
                                        src_uri=page.file.src_uri, site_url=base, runs=list(_runs))
    _runs.clear()
    return html


def on_post_build(config, **kwargs) -> None:
    import nbformat

    site = Path(config["site_dir"])
    for dest, notebook in _pending.items():
        target = site / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, str(target))
    _pending.clear()
