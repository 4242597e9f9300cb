"""What one more character costs page 11's widget, below and past the model's 128 characters.

Serves a built site, opens page 11 in headless Chromium and times the widget's forward pass
(docs/javascripts/char-lm.js, `CharModel.run`) for one character more:

- below 128: the run reuses the keys and values of the text before it (one position computed);
- past 128, a window sliding by one character: every position computed again (the first
  character of the window changed, and a deeper layer's key depends on it);
- past 128, the widget's window, which jumps ahead 64 characters at a time
  (`attention_ref.lm.widget_window_start`): one run from scratch per jump, then one position
  per character; the figure is the mean over the 64 characters of one jump.

Prints the figures and their ratios, and writes them as JSON with their provenance. Run from
the repository root with the project's environment, after a build:

    .venv/bin/mkdocs build -d /tmp/site
    .venv/bin/python benchmarks/char_lm_widget.py --site /tmp/site \
        [--out benchmarks/results/char-lm-widget/char-lm-widget.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import http.server
import json
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = "tutorial/11-language-model/"
MANIFEST = "assets/char-lm/char-lm.json"
TEXT = ("O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name; "
        "Or, if thou wilt not, be but sworn my love, And I'll no longer be a Capulet. ") * 4

# One character more, three ways; each figure is milliseconds per character, the median of `repeats`.
TIMING = """async ([url, text, repeats]) => {
  const lm = window.attentionRefCharLM;
  const m = await lm.load(url);
  const ids = m.encode(text).ids;
  const median = (xs) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  const time = (f) => { const t = performance.now(); f(); return performance.now() - t; };
  const cached = [], sliding = [], jumping = [];
  for (let r = 0; r < repeats; r++) {
    // below 128: 100 characters computed, then the 101st with their keys and values
    const before = m.run(ids.slice(0, 100));
    cached.push(time(() => m.run(ids.slice(0, 101), before)));
    // past 128, sliding by one: the window of characters 72 .. 199 from scratch
    sliding.push(time(() => m.run(ids.slice(200 - m.context, 200))));
    // past 128, the widget's window: from 193 to 256 characters it starts at 128
    let previous = null;
    jumping.push(time(() => {
      for (let n = 193; n <= 256; n++) {
        const start = lm.windowStart(n, m.context);
        previous = m.run(ids.slice(start, n), previous);
      }
    }) / 64);
  }
  return { cached: median(cached), sliding: median(sliding), jumping: median(jumping), context: m.context };
}"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", required=True, help="a folder of the built site")
    parser.add_argument("--out", default="benchmarks/results/char-lm-widget/char-lm-widget.json")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    site = Path(args.site).resolve()
    if not (site / PAGE / "index.html").is_file():
        parser.error(f"--site {args.site}: no {PAGE}index.html there; build the site first")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    from playwright.sync_api import sync_playwright

    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url + PAGE)
            figures = page.evaluate(TIMING, [url + MANIFEST, TEXT, args.repeats])
            version = browser.version
            browser.close()
    finally:
        server.shutdown()
    ms = {k: round(v, 2) for k, v in figures.items() if k != "context"}
    print(f"one character more, in ms (median of {args.repeats}, Chromium {version}):")
    print(f"  below {figures['context']}, with the cache:        {ms['cached']:8.2f}")
    print(f"  past it, a window sliding by one:       {ms['sliding']:8.2f}  ({ms['sliding'] / ms['cached']:.1f}x)")
    print(f"  past it, the widget's jumping window:   {ms['jumping']:8.2f}  ({ms['jumping'] / ms['cached']:.1f}x)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    record = {
        "what": "milliseconds of page 11's widget forward pass for one character more, in headless Chromium",
        "ms_per_character": ms,
        "ratios_to_cached": {k: round(ms[k] / ms["cached"], 2) for k in ("sliding", "jumping")},
        "provenance": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "chromium": version,
            "repeats": args.repeats, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
