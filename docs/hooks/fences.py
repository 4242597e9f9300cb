"""The executed code fences of a Markdown page, and the prose between them.

One parser for everything that reads the pages' ```python exec="on"``` blocks the way
markdown-exec does: the pytest collector of tests/docs, the notebook hook (notebooks.py) and
the site tests. Standard library only; loaded by file path (hooks are not a package).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

EXECUTED_LANGUAGES = {"python", "py"}
HIDE_MARKER = re.compile(r"\s*#\s*markdown-exec:\s*hide\s*$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_OPTION = re.compile(r"""([\w-]+)=(?:"([^"]*)"|'([^']*)'|(\S+))""")


@dataclass(frozen=True)
class Block:
    """One executed fence: where it is, how markdown-exec runs it, and its code."""

    path: Path
    line: int  # 1-based line of the opening fence
    session: str | None
    workdir: str | None
    code: str  # dedented, hidden lines included (they run)
    options: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def shown_code(self) -> str:
        """The code a reader sees on the page: the lines marked hidden left out."""
        return "".join(line for line in self.code.splitlines(keepends=True)
                       if not HIDE_MARKER.search(line))


def is_on(value: str | None) -> bool:
    """markdown-exec's reading of exec="..." (any value other than these is on)."""
    return value is not None and value.lower() not in {"", "no", "off", "false", "0"}


def parse_info(info: str) -> tuple[str, dict[str, str]]:
    """The language and the options of a fence's info string."""
    info = info.strip().removeprefix("{").removesuffix("}").strip()
    language = info.split(None, 1)[0].lstrip(".").lower() if info else ""
    options = {m[1]: next(g for g in m.groups()[1:] if g is not None)
               for m in _OPTION.finditer(info)}
    return language, options


def split_page(text: str, path: Path = Path("<page>")) -> list[str | Block]:
    """The page as a list of prose chunks (str, lines joined) and executed blocks, in order.

    Fences that do not execute (plain code examples) stay in the prose.
    """
    lines = text.splitlines()
    parts: list[str | Block] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        language, options = parse_info(opening["info"])
        if language in EXECUTED_LANGUAGES and is_on(options.get("exec")):
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                    for line in lines[i + 1:end]]
            if prose:
                parts.append("\n".join(prose))
                prose = []
            parts.append(Block(path, i + 1, options.get("session") or None,
                               options.get("workdir"), "\n".join(body) + "\n", options))
        else:
            prose.extend(lines[i:end + 1])
        i = end + 1
    if prose:
        parts.append("\n".join(prose))
    return parts


def find_blocks(path: Path) -> list[Block]:
    """The executed Python blocks of one Markdown file, in order."""
    parts = split_page(path.read_text(encoding="utf-8"), path)
    return [part for part in parts if isinstance(part, Block)]
