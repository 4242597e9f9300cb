"""The docs-block collector itself (conftest.py here), run on small pages in a temporary
project through a separate pytest process."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent

GOOD_PAGE = '''\
# A page

```python exec="on" session="s"
x = 41
print("x is", x)
```

A block that only shows code is not run:

```python
raise RuntimeError("must not run")
```

```python exec="on" session="s" result="text"
x += 1
assert x == 42
```

```python exec="on"
assert "x" not in globals(), "a block without a session must get a fresh namespace"
```

```python exec="on" session="other"
assert "x" not in globals(), "sessions must not share namespaces"
```

!!! note
    An indented block, as inside an admonition or a tab:

    ```python exec="on" session="s"
    from pathlib import Path
    assert x == 42
    assert Path("docs/good.md").is_file(), "blocks run from the repository root"
    ```
'''

# lines of the executed fences, counted from the text (1-based)
GOOD_LINES = [n for n, line in enumerate(GOOD_PAGE.splitlines(), 1) if 'exec="on"' in line]

BAD_PAGE = '''\
# A page that fails

Some text.

```python exec="on" session="bad"
import math
print("before the error")
value = math.sqrt(-1)
```

```python exec="on" session="bad"
print(value)
```
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "docs").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", tmp_path / "tests" / "docs" / "conftest.py")
    (tmp_path / "tests" / "docs" / "pages.txt").write_text("# pages\ndocs/**/*.md\n")
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "hooks").mkdir()  # the fence parser the collector loads
    shutil.copy(HERE.parents[1] / "docs" / "hooks" / "fences.py", tmp_path / "docs" / "hooks")
    (tmp_path / "docs" / "good.md").write_text(GOOD_PAGE)
    (tmp_path / "docs" / "sub" / "bad.md").write_text(BAD_PAGE)
    return tmp_path


def run_pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(project),
         "-o", "addopts=", "-o", "filterwarnings=", *args, "tests"],
        cwd=project, capture_output=True, text=True, timeout=120,
    )


def test_blocks_share_sessions_and_failures_name_file_and_line(project: Path):
    result = run_pytest(project, "-rA")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    # good.md: the 5 executed blocks pass, the plain ```python block is not collected
    assert len(GOOD_LINES) == 5
    for line in GOOD_LINES:
        assert f"PASSED docs/good.md::L{line}" in out, out
    assert "must not run" not in out
    # bad.md: the failing block is reported with the fence's file:line and the failing line
    assert "docs/sub/bad.md:5: block (session \"bad\") raised ValueError" in out, out
    assert 'File "docs/sub/bad.md", line 8, in <module>' in out, out
    assert "value = math.sqrt(-1)" in out, out
    assert "before the error" in out, out
    # the next block of the same session is skipped, naming the block that failed
    assert "SKIPPED [1] docs/sub/bad.md:11: an earlier block of session 'bad' failed: " \
        "docs/sub/bad.md:5" in out, out
    assert "1 failed, 5 passed, 1 skipped" in out, out


def test_one_block_alone_runs_the_earlier_blocks_of_its_session(project: Path):
    result = run_pytest(project, "-k", f"good and L{GOOD_LINES[-1]}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout


def test_fence_parsing(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("docs_collector", HERE / "conftest.py")
    collector = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = collector  # dataclasses look their module up
    spec.loader.exec_module(collector)

    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent('''\
        ````python exec="1" session='quad' workdir="docs"
        ```
        a = 1
        ````
        ~~~py exec="off"
        b = 2
        ~~~
        ```pycon
        >>> c = 3
        ```
        ```{.python exec="on"}
        d = 4
        ```
    '''))
    blocks = collector.find_blocks(page)
    assert [(b.line, b.session, b.workdir, b.code) for b in blocks] == [
        (1, "quad", "docs", "```\na = 1\n"),
        (11, None, None, "d = 4\n"),
    ]
