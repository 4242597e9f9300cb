"""Threads of the tiled path: adapting to busy cores must never slow a quiet call (issue 30).

A benchmark, not a test: every figure is measured side by side in one run and written as JSON
with its provenance. Run from the repository root, on a machine nothing else is using:

    .venv/bin/python benchmarks/threads_bench.py [--pairs 40] [--length 4096] [--out DIR]

The call: `tiled.tiled_attention`, B=1, H=8, L=S=4096, D=64, float32, causal, forward, under
``torch.no_grad()``. Three ways to choose its threads, each timed call by call:

- ``all_threads``: ``attention_ref.threads.ADAPT_THREADS = False``, every thread whatever the load;
- ``adapted``: `attention_ref.threads.fitting_threads` as shipped (paired readings of the machine's runnable
  tasks and this process's own, the least of three taken 4 ms apart);
- ``adapted_before``: the reading before issue 30 (the machine's least of three readings minus
  one later reading of this process's own threads), put back for this run only.

``quiet``: in a fresh process (the first calls after import included), the three take turns
call by call, ``--pairs`` rounds; each round gives the ratio ``all_threads / adapted`` (above 1:
adapting was faster) and the same for ``adapted_before``. The goal: median at least 0.95 and
worst at least 0.7. The threads each choice used are counted (a quiet machine should get every
thread), and the worst ratio is also given over the rounds where the call kept every thread
(where a low ratio is the machine's noise, not the choice). ``one_core_busy``: another process keeps one core busy (a Python loop); the same
three and torch's SDPA take turns; the gain kept is the adapted call's throughput against
SDPA's, and against all threads. Progress goes to stdout. The result goes to
benchmarks/results/threads/threads-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_bench import _load, provenance  # noqa: E402
from block_sparse_bench import _say, _write_dated  # noqa: E402

from attention_ref import threads as budget  # noqa: E402
from attention_ref import tiled  # noqa: E402


def _others_running_before() -> int:
    """The reading before issue 30: the machine's least of three readings minus one later reading of our own."""
    return max(min(budget._runnable() for _ in range(3)) - budget._own_running(), 0)


def _choices(q, k, v) -> tuple[dict, dict, dict]:
    """The calls; the threads each call's own choice gave (counted, and per call in order)."""
    used: dict[str, Counter] = {"all_threads": Counter(), "adapted": Counter(), "adapted_before": Counter()}
    per_call: dict[str, list[int]] = {name: [] for name in used}
    shipped, choose = budget._others_running, budget.fitting_threads

    def call(name: str) -> None:
        chosen = []

        def recorded() -> int | None:  # the choice the call itself makes, recorded
            threads = choose()
            chosen.append(threads or torch.get_num_threads())
            return threads

        budget.ADAPT_THREADS = name != "all_threads"
        budget._others_running = _others_running_before if name == "adapted_before" else shipped
        budget.fitting_threads = recorded
        try:
            tiled.tiled_attention(q, k, v, is_causal=True)
        finally:
            budget.ADAPT_THREADS = True
            budget._others_running, budget.fitting_threads = shipped, choose
        threads = chosen[0] if chosen else torch.get_num_threads()
        used[name][threads] += 1
        per_call[name].append(threads)

    return {name: (lambda name=name: call(name)) for name in used}, used, per_call


def _turns(cases: dict, rounds: int) -> dict[str, list[float]]:
    """Each case once per round, in turns (the order rotates), wall seconds per call."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _ratios(times: dict[str, list[float]], name: str, threads: list[int]) -> dict:
    """``all_threads / name`` per round; the worst also over the rounds where ``name`` kept every thread
    (there a low ratio is the machine's noise, not the choice)."""
    per_round = [a / b for a, b in zip(times["all_threads"], times[name])]
    every = max(threads)
    kept = [r for r, t in zip(per_round, threads) if t == every]
    return {"median": statistics.median(per_round), "worst": min(per_round), "first_3": per_round[:3],
            "rounds_with_fewer_threads": sum(t < every for t in threads),
            "worst_where_every_thread_kept": min(kept) if kept else None, "per_round": per_round}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=40, help="rounds of turns in the quiet part")
    parser.add_argument("--busy-rounds", type=int, default=11, help="rounds of turns with one core busy")
    parser.add_argument("--length", type=int, default=4096, help="L = S")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/threads"))
    args = parser.parse_args(argv)
    for name in ("pairs", "busy_rounds", "length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    argv = sys.argv[1:] if argv is None else argv
    record = {"provenance": provenance(torch.device("cpu"), argv), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/threads_bench.py", *argv])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.length, 64, generator=g) for _ in range(3))
    record["size"] = {"B": 1, "H": 8, "L": args.length, "S": args.length, "D": 64, "dtype": "float32",
                      "is_causal": True, "torch_threads": torch.get_num_threads()}
    with torch.no_grad():
        cases, used, per_call = _choices(q, k, v)
        quiet = _turns(cases, args.pairs)  # no warm-up: the first calls after import count
        record["quiet"] = {"median_s": {n: statistics.median(t) for n, t in quiet.items()},
                           "threads_used": {n: dict(c) for n, c in used.items()}, "threads_per_call": per_call,
                           "all_over_adapted": _ratios(quiet, "adapted", per_call["adapted"]),
                           "all_over_adapted_before": _ratios(quiet, "adapted_before", per_call["adapted_before"]),
                           "times_s": quiet}
        for name in ("adapted", "adapted_before"):
            r = record["quiet"][f"all_over_{name}"]
            _say(f"quiet, all threads / {name}: median {r['median']:.2f}, worst {r['worst']:.2f} "
                 f"({r['worst_where_every_thread_kept']:.2f} where it kept every thread); "
                 f"threads its calls chose {dict(used[name])}")
        r = record["quiet"]["all_over_adapted"]
        record["quiet"]["goal"] = {"median_at_least": 0.95, "worst_at_least": 0.7,
                                   "met": r["median"] >= 0.95 and r["worst"] >= 0.7}
        cases, used, _ = _choices(q, k, v)
        cases["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core kept busy
        try:
            time.sleep(0.5)
            for fn in cases.values():  # warm-up, under the load
                fn()
            loaded = _turns(cases, args.busy_rounds)
        finally:
            busy.kill()
            busy.wait()
        med = {n: statistics.median(t) for n, t in loaded.items()}
        record["one_core_busy"] = {
            "median_s": med, "threads_used": {n: dict(c) for n, c in used.items()}, "times_s": loaded,
            "tiled_throughput_vs_sdpa": {n: med["sdpa"] / med[n] for n in used},
            "adapted_speedup_over_all_threads": med["all_threads"] / med["adapted"]}
        b = record["one_core_busy"]
        _say("one core busy, tiled throughput / SDPA's: " + ", ".join(
            f"{n} {x:.2f}" for n, x in b["tiled_throughput_vs_sdpa"].items())
            + f"; adapted {b['adapted_speedup_over_all_threads']:.2f}x all threads; threads used "
            + str(b["threads_used"]))
    record["load_after"] = _load()
    _write_dated(Path(args.out), "threads", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
