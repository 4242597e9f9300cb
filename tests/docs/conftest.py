"""Run every executed code block of the docs pages as a pytest test.

markdown-exec runs each ```python exec="on" fence while MkDocs builds the site; this collector
runs the same blocks under pytest so a failure names the Markdown file and line:

    docs/tutorial/05-masks.md:42: block (session "tut05-masks") raised AssertionError

The pages come from the glob patterns in ``pages.txt`` (next to this file, relative to the
repository root). Each block is one test item, ``<page>::L<line of the fence>``. Blocks of a
page run in order; blocks with the same ``session="..."`` share one namespace per page, a
block without a session gets a fresh one (as markdown-exec does). Running one item alone
(``-k "05-masks and L42"``) first runs the earlier blocks of its session. Blocks run with the
repository root as working directory, as under ``mkdocs build``, and ``print`` is captured the
way markdown-exec captures it; the output is shown when a block fails.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")  # figures render off-screen, as in a build

PAGES_FILE = "pages.txt"
ROOT = Path(__file__).resolve().parents[2]


def _load_fences() -> ModuleType:
    # the one fence parser (docs/hooks/fences.py), shared with the notebook hook; hooks are
    # files, not a package, so it is loaded by path
    spec = importlib.util.spec_from_file_location("attention_ref_docs_fences",
                                                  ROOT / "docs" / "hooks" / "fences.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


fences = _load_fences()
Block = fences.Block
find_blocks = fences.find_blocks


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.name == PAGES_FILE and file_path.parent == Path(__file__).parent:
        return DocsPages.from_parent(parent, path=file_path)
    return None


class DocsPages(pytest.File):
    """The Markdown pages named by the glob patterns of pages.txt."""

    def collect(self):
        root = self.config.rootpath
        patterns = [line.strip() for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        pages = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
        for page in pages:
            yield MarkdownPage.from_parent(self, path=page)


class BlockFailed(Exception):
    """A block raised; carries the report that names the file and line."""


class MarkdownPage(pytest.File):
    """One Markdown page: its blocks, and the namespaces of its sessions."""

    def collect(self):
        self.blocks = find_blocks(self.path)
        self.namespaces: dict[str, dict] = {}
        self.outcomes: dict[int, str | None] = {}  # block index -> None (passed) or failure report
        for index, block in enumerate(self.blocks):
            yield BlockItem.from_parent(self, name=f"L{block.line}", index=index)

    def relpath(self) -> str:
        try:
            return str(self.path.relative_to(self.config.rootpath))
        except ValueError:
            return str(self.path)

    def namespace(self, block: Block) -> dict:
        if block.session is None:
            return {}
        if block.session not in self.namespaces:
            # a module object per (page, session), as markdown-exec registers one per block:
            # dataclasses, pickle and friends look functions' modules up in sys.modules
            name = "docs_block_" + re.sub(r"\W+", "_", f"{self.relpath()}_{block.session}")
            sys.modules[name] = ModuleType(name)
            self.namespaces[block.session] = {"__name__": name}
        return self.namespaces[block.session]

    def run_block(self, index: int) -> None:
        """Run block `index` once; raise BlockFailed with a file:line report if it fails."""
        if index in self.outcomes:
            if self.outcomes[index] is not None:
                raise BlockFailed(self.outcomes[index])
            return
        block = self.blocks[index]
        if not self.outcomes:  # the page's first block: the global state the build gives a page
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.set_printoptions(profile="default")  # as docs/hooks/isolation.py does
        namespace = self.namespace(block)
        output = io.StringIO()

        def captured_print(*texts, end="\n", **kwargs):  # what markdown-exec does with print
            output.write(" ".join(str(t) for t in texts) + end)

        namespace["print"] = captured_print
        # padding with newlines makes traceback line numbers those of the .md file
        code = compile("\n" * block.line + block.code, str(block.path), "exec", dont_inherit=True)
        cwd = os.getcwd()
        os.chdir(self.config.rootpath / (block.workdir or ""))
        try:
            exec(code, namespace)
        except Exception as error:
            self.outcomes[index] = self._report(block, error, output.getvalue())
            raise BlockFailed(self.outcomes[index]) from None
        finally:
            os.chdir(cwd)
        self.outcomes[index] = None

    def _report(self, block: Block, error: Exception, printed: str) -> str:
        where = f"{self.relpath()}:{block.line}"
        session = f'session "{block.session}"' if block.session else "no session"
        trace = traceback.TracebackException.from_exception(error)
        frames = list(trace.stack)
        first = next((i for i, f in enumerate(frames) if f.filename == str(block.path)), 0)
        trace.stack = traceback.StackSummary.from_list(frames[first:])
        text = "".join(trace.format()).replace(str(block.path), self.relpath())
        parts = [f"{where}: block ({session}) raised {type(error).__name__}", "", text.rstrip()]
        if printed:
            parts += ["", "printed before the error:", printed.rstrip()]
        return "\n".join(parts)


class BlockItem(pytest.Item):
    def __init__(self, *, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def runtest(self) -> None:
        page: MarkdownPage = self.parent
        block = page.blocks[self.index]
        if block.session is not None:
            for earlier in range(self.index):
                if page.blocks[earlier].session != block.session:
                    continue
                if page.outcomes.get(earlier, None) is not None:
                    raise pytest.skip.Exception(
                        f"an earlier block of session {block.session!r} failed: "
                        f"{page.relpath()}:{page.blocks[earlier].line}",
                        _use_item_location=True,  # report the skip at this block's file:line
                    )
                page.run_block(earlier)  # when this item runs alone (-k)
        page.run_block(self.index)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, BlockFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        block = self.parent.blocks[self.index]
        return self.path, block.line - 1, f"{self.parent.relpath()}:{block.line}"
