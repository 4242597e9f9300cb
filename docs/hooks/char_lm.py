"""MkDocs hook: write the language models of page 11 where the page's JavaScript fetches them.

After the build, for each model of `MODELS` a manifest (sizes, vocabulary, where each tensor
lies: ``assets/char-lm/char-lm.json``) and its weights (every weight in float16:
``char-lm.bin``) are written into the site from the weights that ship with the package
(`attention_ref.lm.load_char_lm`, `attention_ref.lm.browser_export`), so the browser runs the
very models the page's Python runs: the Shakespeare model (``char-lm``) and the copy-task model
(``copy-lm``, `attention_ref.lm.COPY_MODEL`).
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = "assets/char-lm"
#: the file stem in `FOLDER` -> the source `attention_ref.lm.load_char_lm` takes (None: the default model)
MODELS = {"char-lm": None, "copy-lm": "copy"}


def write(site_dir: str | Path) -> Path:
    from attention_ref import lm

    folder = Path(site_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for stem, source in MODELS.items():
        model, tokenizer, _ = lm.load_char_lm(source)
        manifest, weights = lm.browser_export(model, tokenizer)
        manifest["weights"] = f"{stem}.bin"
        (folder / f"{stem}.bin").write_bytes(weights)
        (folder / f"{stem}.json").write_text(json.dumps(manifest, separators=(",", ":")), encoding="utf-8")
    return folder


def on_post_build(config, **kwargs) -> None:
    write(config["site_dir"])
