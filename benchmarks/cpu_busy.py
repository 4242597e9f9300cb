"""How many of the machine's cores are busy, sampled from Linux's /proc/stat, while something else runs.

    python3 benchmarks/cpu_busy.py --out FILE.json [--every 2] [--window 30] -- COMMAND ...

Runs ``COMMAND``, reads /proc/stat every ``--every`` seconds meanwhile (the whole machine, not only
the command), and writes to FILE.json each sample (seconds since the start, busy cores: the
non-idle share of the interval times the cores) and their means over windows of ``--window``
seconds. Used with benchmarks/check_budget.py to tell whether a check waits (idle cores: running
things side by side would help) or works (busy cores: only less work helps). Exits with the
command's status. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _jiffies() -> tuple[int, int]:
    """(idle, total) jiffies of all cores since boot: the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait count as idle


def windows(samples: list[tuple[float, float]], window: float) -> list[dict]:
    """The mean busy cores per window of ``window`` seconds, from ``(seconds, busy cores)`` samples. Each sample
    is the mean over the interval since the one before it (since 0 for the first), so it counts in the window
    that holds the interval's middle (counted by its end, a first sample that came late on a busy machine left
    the first window out)."""
    if not window > 0:
        raise ValueError(f"window must be > 0 seconds, got {window!r}")
    found: dict[int, list[float]] = {}
    for (seconds, busy), (earlier, _) in zip(samples, [(0.0, 0.0), *samples]):
        found.setdefault(int((earlier + seconds) / 2 // window), []).append(busy)
    return [{"from_s": k * window, "to_s": (k + 1) * window, "busy_cores": round(sum(v) / len(v), 2)}
            for k, v in sorted(found.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds per mean in the summary (default 30)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.every <= 0 or args.window < args.every:
        parser.error(f"--every must be > 0 and --window at least --every, got {args.every} and {args.window}")
    cores = os.cpu_count() or 1
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    before = _jiffies()
    process = subprocess.Popen(command)
    while process.poll() is None:
        time.sleep(args.every)
        now = _jiffies()
        idle, total = now[0] - before[0], now[1] - before[1]
        samples.append((round(time.monotonic() - start, 1), round(cores * (1 - idle / total), 2) if total else 0.0))
        before = now
    summary = windows(samples, args.window)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"command": command, "cores": cores, "every_s": args.every, "exit_status": process.returncode,
                   "seconds": round(time.monotonic() - start, 1), "windows": summary, "samples": samples}, f, indent=1)
    for row in summary:
        print(f"{row['from_s']:6.0f}-{row['to_s']:<6.0f} s  {row['busy_cores']:.2f} of {cores} cores busy", file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
