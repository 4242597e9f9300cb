"""MkDocs hook: write the language model of page 11 where the page's JavaScript fetches it.

After the build, ``assets/char-lm/char-lm.json`` (the manifest: sizes, vocabulary, where each
tensor lies) and ``assets/char-lm/char-lm.bin`` (every weight in float16) are written into the
site from the weights that ship with the package (`attention_ref.lm.load_char_lm`,
`attention_ref.lm.browser_export`), so the browser runs the very model the page's Python runs.
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = "assets/char-lm"
MANIFEST = "char-lm.json"
WEIGHTS = "char-lm.bin"


def write(site_dir: str | Path) -> Path:
    from attention_ref import lm

    model, tokenizer, _ = lm.load_char_lm()
    manifest, weights = lm.browser_export(model, tokenizer)
    manifest["weights"] = WEIGHTS
    folder = Path(site_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WEIGHTS).write_bytes(weights)
    (folder / MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")), encoding="utf-8")
    return folder


def on_post_build(config, **kwargs) -> None:
    write(config["site_dir"])
