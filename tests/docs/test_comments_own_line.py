"""Comments in the executed code of the tutorial pages stand on their own lines.

On a phone (390 px) a code line wraps, and a comment trailing the code breaks across lines;
a comment above the line it describes does not. So in every ```python exec="on"``` block of
docs/tutorial/*.md, a comment may follow code on the same line only when it is a directive:
``# markdown-exec: hide`` (the line runs but is not shown, so a note before the marker is
not shown either) or a pragma (``# noqa``, ``# type: ...``, ``# pragma: ...``). Comments are
found with ``tokenize``, so a ``#`` inside a string is not one.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
from test_shown_code import (
    fences,  # the one fence parser (docs/hooks/fences.py), loaded there
)

ROOT = Path(__file__).resolve().parents[2]
PRAGMA = re.compile(r"#\s*(noqa\b|type:|pragma:)")


PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "tutorial").glob("*.md"))


def trailing_comments(code: str) -> list[tuple[int, str]]:
    """(1-based line in ``code``, comment) for every comment that follows code on its line,
    directives and pragmas left out."""
    found = []
    code_on_line: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            allowed = PRAGMA.match(token.string) or fences.HIDE_MARKER.search(token.string)
            if row in code_on_line and not allowed:
                found.append((row, token.string))
        elif token.type not in skip:
            # a token spanning lines (a triple-quoted string) puts code on its last line
            code_on_line.update(range(token.start[0], token.end[0] + 1))
    return found


def test_trailing_comments_are_found():
    code = ('x = 1  # one\n'
            '# own line\n'
            's = "# not a comment"\n'
            'y = 2  # markdown-exec: hide\n'
            'y = 3  # a hidden note  # markdown-exec: hide\n'
            'z = {\n'
            '    "a": 1,  # in a dict\n'
            '}\n'
            'import os  # noqa: F401\n'
            'w = """\n'
            'text"""  # after a string\n')
    assert trailing_comments(code) == [(1, "# one"), (7, "# in a dict"),
                                       (11, "# after a string")]


def test_tutorial_pages_are_found():
    assert len(PAGES) >= 5


@pytest.mark.parametrize("page", PAGES)
def test_comments_stand_on_their_own_lines(page: str):
    problems = []
    for block in fences.find_blocks(ROOT / page):
        for row, comment in trailing_comments(block.code):
            # the block's code starts on the line after its opening fence
            problems.append(f"{page}:{block.line + row}: trailing comment {comment!r}")
    assert not problems, ("put these comments on their own line, above the code they "
                          "describe:\n" + "\n".join(problems))
