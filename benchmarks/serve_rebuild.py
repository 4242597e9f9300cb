"""How long `mkdocs serve` takes to show an edit: from saving a file to the rebuilt site.

Starts `mkdocs serve` on a free port, waits for its first build, then makes each edit below in
turn (one string replaced in a file of the package), times until the server logs the next
"Documentation built", and puts the file back. Prints the figures and writes them as JSON with
their provenance. Run from the repository root with the project's environment:

    .venv/bin/python benchmarks/serve_rebuild.py [--out benchmarks/results/serve/serve-rebuild.json]

The edits change code every page runs (`functional._compute_dtype`), code a few pages run
(`complexity._nonneg`) and only a docstring, the three cases docs/hooks/reload.py tells apart.
The result goes to its own folder: the GPU-path page reads every JSON file directly in
benchmarks/results/ as a result of attention_bench.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EDITS = [  # (what, file, old, new)
    ("code every page runs", "attention_ref/functional.py",
     "return torch.promote_types(dtype, torch.float32)", "return torch.promote_types(torch.float32, dtype)"),
    ("code a few pages run", "attention_ref/complexity.py",
     "def _nonneg(**sizes: int) -> None:", "def _nonneg(_probe: int = 0, **sizes: int) -> None:"),
    ("a docstring", "attention_ref/functional.py", "Attention weights", "Attention  weights"),
]
BUILT = re.compile(r"Documentation built in")
BLOCKS = re.compile(r"reload hook: (.*served from the serve cache)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(log: Path, count: int, timeout: float) -> float:
    start = time.perf_counter()
    while len(BUILT.findall(log.read_text())) < count:
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"no rebuild within {timeout} s; see {log}")
        time.sleep(0.05)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/serve/serve-rebuild.json")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-rebuild-{os.getpid()}.log"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = Path(sys.executable).with_name("mkdocs")
    with log.open("w") as out:
        server = subprocess.Popen([str(mkdocs), "serve", "-a", f"127.0.0.1:{free_port()}"],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    results = []
    try:
        first = wait_for(log, 1, args.timeout)
        print(f"first build (server start included): {first:.1f} s", flush=True)
        for what, name, old, new in EDITS:
            path = ROOT / name
            original = path.read_text()
            if old not in original:
                raise SystemExit(f"{name} no longer contains {old!r}: update EDITS")
            time.sleep(3)  # let the watcher settle
            count = len(BUILT.findall(log.read_text())) + 1
            path.write_text(original.replace(old, new, 1))
            try:
                seconds = wait_for(log, count, args.timeout)
            finally:
                path.write_text(original)
            blocks = BLOCKS.findall(log.read_text())
            results.append({"edit": what, "file": name, "seconds": round(seconds, 2),
                            "blocks": blocks[-1] if blocks else None})
            print(f"{what:22} {seconds:5.1f} s   {results[-1]['blocks']}", flush=True)
            wait_for(log, count + 1, args.timeout)  # the rebuild that puts the file back
    finally:
        server.terminate()
        server.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    record = {
        "what": "seconds from saving a file to the rebuilt site under mkdocs serve",
        "first_build_seconds": round(first, 2),
        "edits": results,
        "provenance": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "serve_workers": os.environ.get("ATTENTION_REF_SERVE_WORKERS", "1"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
