"""The conformance suite's full matrix on the shipped adapters, written as JSON with its provenance.

Not a test: the package's tests and the "Conformance" page run the quick matrix; this runs
the full one (every scenario in float32, float16 and bfloat16, fwd and bwd, on the small and
the medium shapes; see `attention_ref.conformance.cases.matrix`) on each adapter of
`attention_ref.conformance.shipped` and records every case's status and message. Run from
the repository root:

    .venv/bin/python benchmarks/conformance_full.py [--adapters NAME ...] [--size full|quick] [--jobs N]
                                                    [--device cpu|cuda] [--threads N] [--out DIR_OR_FILE]

By default every shipped adapter but the compiled FlexAttention ones (``torch.compile`` on a
CPU takes minutes per shape: name them with ``--adapters`` to include them). Without CUDA,
``TRITON_INTERPRET=1`` is set before anything imports triton, so this package's Triton kernel
runs under Triton's interpreter (float32 and float16; its medium cases take a while). Progress
and one summary line per adapter go to stderr. The record goes to
benchmarks/results/conformance/conformance-<device>-<date>.json unless ``--out`` says otherwise
(a directory, or a path ending in .json). ``--jobs N`` runs N adapters at a time, each in a
process of its own (what a lent GPU machine with 16 cores wants; the record is the same, each
report's ``seconds`` then counts its process's time beside the others). The exit status is 1 when a case failed, raised or
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
from attention_ref.conformance.runner import _progress, run_case, versions  # noqa: E402

DEFAULT_ADAPTERS = [name for name in shipped.SHIPPED
                    if not name.endswith("-compiled") and (torch.cuda.is_available() or name not in shipped.CUDA_ONLY)]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: A CUDA error after which the process's CUDA context is lost: every later call would fail too.
_CONTEXT_LOST = ("device-side assert", "illegal memory access", "unspecified launch failure")


def _run_adapter(name: str, size: str, device: torch.device, progress: bool, deadline: float | None,
                 shard: tuple[int, int] = (0, 1), after: str | None = None) -> dict:
    """One adapter's report as a dict: the cases of ``shard`` ``(k, n)`` (every n-th from the k-th), after the
    case ``after`` when given, one by one until ``deadline`` (a ``time.time()``) or until the CUDA context is lost.

    ``not_run``: the adapter cannot be built here. ``not_reached``: cases not started (the deadline had passed,
    or the context was lost). ``context_lost_at``: the case whose error lost the CUDA context (a device-side
    assert, say); `_run_in_processes` goes on in a new process from the case after it.
    """
    try:
        adapter = shipped.SHIPPED[name]()
    except (ImportError, RuntimeError) as error:  # a library that is not installed, or no way to run
        _say(f"{name}: not run: {type(error).__name__}: {error}")
        return {"adapter": name, "not_run": f"{type(error).__name__}: {error}"}
    if name.endswith("-compiled"):
        # Every case is a new graph. Past dynamo's recompile limit (8) it would run flex_attention
        # eagerly and the report would say "compiled": raise the limit, and fail rather than fall back.
        from torch import _dynamo

        _dynamo.config.recompile_limit = _dynamo.config.accumulated_recompile_limit = 4096
        _dynamo.config.fail_on_recompile_limit_hit = True
    k, n = shard
    cases = conformance.matrix(size)[k::n]
    if after is not None:
        cases = cases[[case.id for case in cases].index(after) + 1:]
    results, lost, start = [], None, time.perf_counter()
    for case in _progress(cases, name, progress):
        if deadline is not None and time.time() >= deadline:
            break
        result = run_case(adapter, case, device)
        results.append(result)
        if result.status == "error" and any(words in result.detail for words in _CONTEXT_LOST):
            lost = case.id
            break
    report = conformance.Report(adapter.name, adapter.description, size, str(torch.device(device)), results,
                                versions(), time.perf_counter() - start)
    not_reached = len(cases) - len(results)
    _say(report.summary() + (f" (shard {k + 1}/{n})" if n > 1 else "")
         + (f"; the CUDA context was lost at {lost}" if lost else "")
         + (f"; {not_reached} cases not reached" if not_reached else ""))
    for problem in report.problems():
        _say(f"    {problem.id}: {problem.status}: {problem.detail.strip().splitlines()[0]}")
    return dict(report.to_dict(), not_reached=not_reached, context_lost_at=[lost] if lost else [])


def _merge(parts: list[dict], size: str) -> dict:
    """One adapter's report from the reports of its shards and resumed processes, its cases in matrix order."""
    done = [part for part in parts if "results" in part]
    if not done:
        return parts[0]
    order = {case.id: i for i, case in enumerate(conformance.matrix(size))}
    results = sorted((r for part in done for r in part["results"]), key=lambda r: order[r["id"]])
    merged = dict(done[0], results=results, seconds=round(sum(part["seconds"] for part in done), 3),
                  counts={status: sum(r["status"] == status for r in results) for status in done[0]["counts"]},
                  context_lost_at=[i for part in done for i in part["context_lost_at"]], processes=len(parts))
    # a resumed process's cases were counted as not reached by the one before it
    merged["not_reached"] = len(order) - len(results)
    crashed = [part["not_run"] for part in parts if "not_run" in part]
    if crashed:
        merged["processes_lost"] = crashed
    return merged


def _run_in_processes(args: argparse.Namespace) -> dict:
    """Each adapter in ``args.shards`` processes, ``args.jobs`` at a time; a process whose CUDA context was lost
    is followed by one that goes on from the next case. The reports in ``args.adapters``' order."""
    import subprocess
    import tempfile

    own = ["--size", args.size, "--device", args.device, "--no-progress"]
    if args.deadline is not None:
        own += ["--deadline", repr(args.deadline)]
    if args.threads is not None:
        own += ["--threads", str(args.threads)]
    parts: dict[str, list[dict]] = {name: [] for name in args.adapters}
    with tempfile.TemporaryDirectory() as tmp:
        waiting = [(name, k, None) for name in args.adapters for k in range(args.shards)]
        running: dict = {}
        while waiting or running:
            while waiting and len(running) < args.jobs:
                name, k, after = task = waiting.pop(0)
                out = Path(tmp) / f"{name}-{k}-{len(parts[name])}-{len(running)}.json"
                cmd = [sys.executable, __file__, *own, "--adapters", name, "--shard", f"{k}/{args.shards}",
                       "--out", str(out)] + (["--resume-after", after] if after else [])
                running[task] = (subprocess.Popen(cmd), out)
            for task, (proc, out) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[task]
                name, k, _ = task
                if out.exists():
                    part = json.loads(out.read_text())["reports"][name]
                    lost = part.get("context_lost_at")
                    if lost and part.get("not_reached"):
                        waiting.insert(0, (name, k, lost[-1]))
                else:  # the process died before writing (a crash of the kernel, say): recorded, not lost
                    part = {"adapter": name, "not_run": f"shard {k}: its process exited with {proc.returncode}"}
                parts[name].append(part)
            time.sleep(0.2)
    return {name: _merge(parts[name], args.size) for name in args.adapters}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", nargs="+", default=DEFAULT_ADAPTERS, choices=sorted(shipped.SHIPPED),
                        metavar="NAME", help=f"shipped adapters to run (default: {' '.join(DEFAULT_ADAPTERS)})")
    parser.add_argument("--size", choices=("quick", "full"), default="full", help="the matrix (default full)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--jobs", type=int, default=1, help="adapters run at a time, one process each (default 1)")
    parser.add_argument("--max-wall-s", type=float, default=None,
                        help="start no case after this many seconds (the record counts the cases not reached)")
    parser.add_argument("--shards", type=int, default=1,
                        help="split each adapter's cases over this many processes (with --jobs; default 1)")
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # --max-wall-s, for children
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # k/n: a child's share of the cases
    parser.add_argument("--resume-after", default=None, help=argparse.SUPPRESS)  # a child's first case follows this
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
    if args.max_wall_s is not None and args.deadline is None:
        args.deadline = time.time() + args.max_wall_s
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    record["config"].update(jobs=args.jobs, shards=args.shards)
    start = time.perf_counter()
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    if args.max_wall_s is not None and args.max_wall_s <= 0:
        parser.error(f"--max-wall-s must be positive, got {args.max_wall_s}")
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        parser.error(f"--shard must be k/n with 0 <= k < n, got {args.shard!r}")
    ids = [case.id for case in conformance.matrix(args.size)]
    if args.resume_after is not None and args.resume_after not in ids:
        parser.error(f"--resume-after {args.resume_after!r} is no case of the {args.size} matrix")
    if (args.jobs == 1 and args.shards == 1) or shard != (0, 1) or args.resume_after:
        reports = {name: _run_adapter(name, args.size, device, not args.no_progress, args.deadline, shard,
                                      args.resume_after)
                   for name in args.adapters}
    else:
        reports = _run_in_processes(args)
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
