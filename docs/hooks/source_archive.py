"""MkDocs hook: the site serves its own source, so a reader can take the package home.

The project records no public repository address yet (``repo_url`` is set only when the docs
workflow passes ``ATTENTION_REF_REPO_URL``), so "clone the repository" alone would leave a
reader of the published site with nothing to clone. After every build this hook writes
``downloads/attention_ref-<version>.tar.gz`` into the site: one folder
``attention_ref-<version>/`` holding what the install line needs (``pyproject.toml``,
``README.md``, ``constraints.txt``, the package) and the tutorial's notebooks as this build
wrote them (``notebooks/``). The home page links it, and the install line of the site
(docs/hooks/notebooks.py ``INSTALL_LINE``) runs at the root of the unpacked folder as it does
in a clone. tests/site/test_fresh_notebooks.py installs from this very archive in a fresh
virtual environment and runs its notebooks.

The archive's bytes depend only on the files in it (sorted names, a fixed modification time,
no owner names); a notebook whose outputs print a timing changes with each build.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What the install line needs, as a clone holds it.
SOURCE_FILES = ("pyproject.toml", "README.md", "constraints.txt", "attention_ref")
_FIXED_MTIME = 1_700_000_000  # a fixed date, so the same tree gives the same bytes


def version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is Python 3.11+)
    return re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)


def archive_name() -> str:
    return f"attention_ref-{version()}.tar.gz"


def _members(site: Path) -> list[tuple[str, Path]]:
    """(name in the archive, file on disk), sorted by name."""
    top = f"attention_ref-{version()}"
    members = []
    for name in SOURCE_FILES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
        members += [(f"{top}/{p.relative_to(ROOT).as_posix()}", p) for p in files]
    members += [(f"{top}/notebooks/{p.name}", p) for p in sorted((site / "tutorial").rglob("*.ipynb"))]
    return sorted(members)


def write_archive(site: Path) -> Path:
    target = site / "downloads" / archive_name()
    target.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in _members(site):
            info = tarfile.TarInfo(name)
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), _FIXED_MTIME, 0o644
            tar.addfile(info, io.BytesIO(data))
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=_FIXED_MTIME, filename="") as gz:
        gz.write(buffer.getvalue())
    return target


def on_files(files, config, **kwargs):
    """Announce the archive, so that the home page's link to it is checked like any other.

    Its bytes exist only after the pages have run (the notebooks hold their outputs):
    MkDocs copies this empty stand-in with the static files, and ``on_post_build``, which
    runs after that, writes the archive over it.
    """
    from mkdocs.structure.files import File

    files.append(File.generated(config, f"downloads/{archive_name()}", content=b""))
    return files


def on_post_build(config, **kwargs) -> None:
    write_archive(Path(config["site_dir"]))
