"""The conformance suite's full matrix on the shipped adapters, written as JSON with its provenance.

Not a test: the package's tests and the "Conformance" page run the quick matrix; this runs
the full one (every scenario in float32, float16 and bfloat16, fwd and bwd, on the small and
the medium shapes; see `attention_ref.conformance.cases.matrix`) on each adapter of
`attention_ref.conformance.shipped` and records every case's status and message. Run from
the repository root:

    .venv/bin/python benchmarks/conformance_full.py [--adapters NAME ...] [--size full|quick]
                                                    [--device cpu|cuda] [--threads N] [--out DIR_OR_FILE]

By default every shipped adapter but the compiled FlexAttention ones (``torch.compile`` on a
CPU takes minutes per shape: name them with ``--adapters`` to include them). Without CUDA,
``TRITON_INTERPRET=1`` is set before anything imports triton, so this package's Triton kernel
runs under Triton's interpreter (float32 and float16; its medium cases take a while). Progress
and one summary line per adapter go to stderr. The record goes to
benchmarks/results/conformance/conformance-<device>-<date>.json unless ``--out`` says otherwise
(a directory, or a path ending in .json). The exit status is 1 when a case failed, raised or
passed against a known bug (``report.ok`` false), so a CI job can run it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything (transformers, for one) imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from attention_bench import _load, provenance  # noqa: E402

from attention_ref import conformance  # noqa: E402
from attention_ref.conformance import shipped  # noqa: E402

DEFAULT_ADAPTERS = [name for name in shipped.SHIPPED if not name.endswith("-compiled")]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", nargs="+", default=DEFAULT_ADAPTERS, choices=sorted(shipped.SHIPPED),
                        metavar="NAME", help=f"shipped adapters to run (default: {' '.join(DEFAULT_ADAPTERS)})")
    parser.add_argument("--size", choices=("quick", "full"), default="full", help="the matrix (default full)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/conformance",
                        help="a directory (conformance-<device>-<date>.json is written there) or a .json path")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    record: dict = {"provenance": provenance(device, argv), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/conformance_full.py", *argv])
    record["provenance"]["versions"] = conformance.runner.versions()
    record["config"] = {"size": args.size, "device": str(device), "cases": len(conformance.matrix(args.size)),
                        "adapters": args.adapters, "threads": torch.get_num_threads(),
                        "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    reports = {}
    start = time.perf_counter()
    for name in args.adapters:
        try:
            adapter = shipped.SHIPPED[name]()
        except (ImportError, RuntimeError) as error:  # a library that is not installed, or no way to run
            _say(f"{name}: not run: {type(error).__name__}: {error}")
            reports[name] = {"adapter": name, "not_run": f"{type(error).__name__}: {error}"}
            continue
        report = conformance.run(adapter, args.size, progress=not args.no_progress, device=device)
        _say(report.summary())
        for problem in report.problems():
            _say(f"    {problem.id}: {problem.status}: {problem.detail.strip().splitlines()[0]}")
        reports[name] = report.to_dict()
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["load_after"] = _load()
    record["reports"] = reports
    record["summary"] = {name: r.get("counts", r.get("not_run")) for name, r in reports.items()}

    out = args.out
    if out.suffix != ".json":
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        out = out / f"conformance-{device.type}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    _say(f"wrote {out}")
    ok = all(r.get("counts") is None or not any(r["counts"][s] for s in ("failed", "error", "xpassed"))
             for r in reports.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
