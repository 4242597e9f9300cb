"""What the whole check costs, phase by phase, test file by test file, page by page.

Runs what CI runs (``.ci/run``: ``python3 dev.py check --newest``) in a fresh clone of the
commit checked out here, with ``ATTENTION_REF_CHECK_REPORT`` set so that ``dev.py`` writes
its figures (each phase's seconds, each test file's and each page's), and writes them as JSON
with their provenance; or, with ``--report``, takes a report a check already wrote. With
``--baseline`` it prints each phase beside a baseline's and their ratio, and stores the ratios.
Run from the repository root (any Python >= 3.10; the check sets up its own environments):

    python3 benchmarks/check_budget.py [--out benchmarks/results/check-budget/DATE-COMMIT.json]
        [--report REPORT.json] [--baseline OLDER.json] [--note TEXT]

A check takes 10-30 minutes on a 2-core machine. The same kind of machine differs about 2.4x in
speed from one to the next (../shared/TOOLCHAIN.md): compare only figures measured on one
machine, which the ``machine`` field helps tell apart. The point of the file is to see the next
feature's cost before it lands: the slowest files and pages are listed in every result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "check-budget"


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def run_check(commit: str) -> tuple[dict, float, int]:
    """``.ci/run`` in a fresh clone of ``commit``: its report, the wall seconds and the exit status."""
    with tempfile.TemporaryDirectory(prefix="attention-ref-budget-") as tmp:
        clone = Path(tmp) / "project"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        shared = ROOT.parent / "shared"
        if shared.is_dir():  # where the team's files are, as ../shared/tools/fresh-clone-check puts them
            (Path(tmp) / "shared").symlink_to(shared)
        report = Path(tmp) / "report.json"
        env = dict(os.environ, CI="true", ATTENTION_REF_CHECK_REPORT=str(report))
        start = time.perf_counter()
        lines = []
        with subprocess.Popen(["bash", ".ci/run"], cwd=clone, env=env, stdin=subprocess.DEVNULL, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as check:
            for line in check.stdout:  # shown as it comes, and kept for a commit that writes no report
                print(line, end="", flush=True)
                lines.append(line)
        code = check.returncode
        seconds = time.perf_counter() - start
        output = "".join(lines)
        if report.is_file():
            parsed = json.loads(report.read_text())
        else:
            parsed = parse_summary(output)
        if parsed is not None:
            # mkdocs' own figure for the build: the one both an older commit and this one print (an older
            # dev.py's build row ran on until the tests beside the build ended)
            built = re.findall(r"Documentation built in ([\d.]+) seconds", output)
            parsed["mkdocs_build_seconds"] = float(built[-1]) if built else None
            return parsed, seconds, code
        raise SystemExit(f"the check wrote no report and printed no summary (exit {code}): see its output above")


def parse_summary(output: str) -> dict | None:
    """The report of a check that predates ATTENTION_REF_CHECK_REPORT, read from the summary table
    ``dev.py check`` prints last (``  name  ok|FAILED|skipped  seconds s   detail``); no per-file timings."""
    row = re.compile(r"^  (\S.{0,12}?)\s+(ok|FAILED|skipped)\s+([\d.]+) s(?:   (.*))?$")
    table = output[output.rfind("[dev] summary"):] if "[dev] summary" in output else ""
    phases, total = [], None
    for line in table.splitlines():
        match = row.match(line)
        if match is None:
            continue
        name, status, seconds, detail = match.group(1).strip(), match.group(2), float(match.group(3)), match.group(4)
        if name == "total":
            total = (status == "ok", seconds)
        else:
            phases.append({"name": name, "ok": None if status == "skipped" else status == "ok", "seconds": seconds,
                           "detail": detail or ""})
    if total is None:
        return None
    return {"ok": total[0], "total_seconds": total[1], "phases": phases, "timings": {},
            "read_from": "the summary table of the check's output (this commit writes no report)"}


def phases(report: dict) -> dict[str, float]:
    """Phase name -> seconds, the total and mkdocs' own build figure included."""
    named = {**{p["name"]: p["seconds"] for p in report["phases"]}, "total": report["total_seconds"]}
    if report.get("mkdocs_build_seconds") is not None:
        named["mkdocs build (its own figure)"] = report["mkdocs_build_seconds"]
    return named


def compare(result: dict, baseline: dict) -> dict[str, float | None]:
    """Each phase's seconds over the baseline's (None where either lacks it or the baseline's is 0)."""
    ours, theirs = phases(result["report"]), phases(baseline["report"])
    return {name: (round(ours[name] / theirs[name], 3) if theirs.get(name) else None) for name in ours}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", help="a report dev.py check already wrote (ATTENTION_REF_CHECK_REPORT)")
    parser.add_argument("--commit", default="HEAD", help="the commit to check in a fresh clone (default HEAD)")
    parser.add_argument("--baseline", help="an earlier result of this script, measured on the same machine")
    parser.add_argument("--out", help="where to write the result (default: results/check-budget/DATE-COMMIT.json)")
    parser.add_argument("--note", default="", help="a sentence stored with the figures (what else ran, ...)")
    args = parser.parse_args()

    commit = git("rev-parse", args.commit)
    if args.report:
        report, wall, code = json.loads(Path(args.report).read_text()), None, None
    else:
        report, wall, code = run_check(commit)
    result = {
        "benchmark": "check_budget",
        "provenance": {
            "git_commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
                        if hasattr(os, "sysconf") else None},
            "python": sys.version.split()[0], "command": "bash .ci/run (python3 dev.py check --newest), fresh clone"
            if not args.report else f"report {args.report}",
            "note": args.note,
        },
        "wall_seconds": None if wall is None else round(wall, 1),
        "exit_status": code,
        "report": report,
    }
    print(f"check of {commit[:10]}: {'ok' if report['ok'] else 'FAILED'}, {report['total_seconds']:.0f} s")
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    if baseline is not None:
        result["baseline"] = {"git_commit": baseline["provenance"]["git_commit"], "file": args.baseline,
                              "ratios": compare(result, baseline)}
    theirs = phases(baseline["report"]) if baseline else {}
    for name, seconds in phases(report).items():
        ratio = result.get("baseline", {}).get("ratios", {}).get(name)
        beside = f"   baseline {theirs[name]:7.1f} s   ratio {ratio:.2f}" if ratio is not None else ""
        print(f"  {name:<30} {seconds:7.1f} s{beside}")
    for name, seconds in report.get("timings", {}).items():
        print(f"  slowest in {name}: " + ", ".join(f"{k} {v:.0f} s" for k, v in list(seconds.items())[:5]))
    out = Path(args.out) if args.out else RESULTS / f"{datetime.date.today()}-{commit[:10]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"written to {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
