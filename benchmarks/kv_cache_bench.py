"""The KV cache on CPU: one decoding step with a cache against recomputing the prefix, paged against contiguous.

A benchmark, not a test: every figure is measured side by side in one run and written as JSON
with its provenance. Run from the repository root:

    .venv/bin/python benchmarks/kv_cache_bench.py [--reps 7] [--threads 2] [--out DIR_OR_FILE]

For each prefix length P (128 ... 4096 tokens by default; B = 1, H = 8 query heads, Hkv = 8
key/value heads, E = 64, float32), the cache holds the prefix and the new token, P + 1 tokens,
and three ways to compute the new token's attention output are timed:

- ``cached``: one decoding step, `attention_with_kv_cache` with one query against a contiguous
  `KVCache` (``cache_seqlens = P + 1``, ``is_causal=True``): the new row of the weight matrix.
- ``paged``: the same step against a `PagedKVCache` with blocks of 16 tokens, its blocks taken
  from the pool in a shuffled order; the block table and seqlens are built before the timing.
- ``recompute``: what the step costs without a cache: the causal attention of all P + 1 tokens,
  every row (`attention_with_kv_cache` with ``Lq = P + 1``, the same function and core, so the
  only difference is the number of query rows), of which the last row is the new token's output.

Left out of all three, so that they differ only in the attention they compute: the Q/K/V
projections (without a cache a model would also recompute the keys and values of all P earlier
tokens in every layer, O(P d^2) more per step, so the real gap is larger) and the append of the
new key and value (one copy of Hkv * E numbers). All three run the math path of the functional
core (`backend="math"`), as `attention_with_kv_cache` does.

Expected: ``cached`` costs O(P) per step, ``recompute`` O(P^2), so their ratio grows linearly
with P; the goal is a log-log slope of the ratio against P between 0.8 and 1.2, fitted over the
prefixes >= 512 (the smallest are dominated by fixed per-call overheads). ``paged`` gathers the
blocks into one copy before the same computation; the goal is at most 1.5x the contiguous time
at every prefix.

Timing: torch's intra-op threads are fixed (``--threads``, recorded; 1 by default, so that the
small operations of a decoding step pay no thread start-up and both sides of the ratio run on
the same single core; with more threads ``recompute`` gains more than ``cached``). Each case is warmed up and
its number of calls per measurement chosen so that one measurement lasts at least
``--min-time`` seconds; then the cases of a prefix run in turns (round-robin), ``--reps`` rounds,
and the median time per call is reported, every raw measurement kept in the JSON. Progress goes
to stderr. ``--quick`` runs toy sizes in seconds (the smoke test; its figures mean nothing).
The result goes to benchmarks/results/kv-cache/kv-cache-<date>.json unless ``--out`` says
otherwise (a directory, or a path ending in .json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_bench import _load, provenance  # noqa: E402

from attention_ref.kv_cache import KVCache, PagedKVCache, attention_with_kv_cache  # noqa: E402

PREFIXES = [128, 256, 512, 1024, 2048, 4096]
QUICK = dict(prefixes=[16, 32, 64], heads=2, kv_heads=2, head_dim=16, reps=3, min_time=0.002, slope_from=16)
SLOPE_GOAL = (0.8, 1.2)
PAGED_GOAL = 1.5


def _say(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def _calibrate(fn: Callable[[], object], min_time: float) -> int:
    """Warm ``fn`` up, then the number of calls that makes one measurement last at least ``min_time``."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, math.ceil(min_time / once))


def time_cases(cases: dict[str, Callable[[], object]], reps: int, min_time: float) -> dict[str, dict]:
    """Median seconds per call of each case; the cases take turns, ``reps`` rounds."""
    numbers = {name: _calibrate(fn, min_time) for name, fn in cases.items()}
    per_call: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            per_call[name].append((time.perf_counter() - start) / numbers[name])
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "calls_per_measurement":
                   numbers[name], "per_call_s": t} for name, t in per_call.items()}


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def measure_prefix(P: int, H: int, Hkv: int, E: int, block_size: int, reps: int, min_time: float,
                   seed: int) -> dict:
    """Time the three cases at one prefix length (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    n = P + 1  # the prefix and the new token
    q_all = torch.randn(1, H, n, E, generator=gen)  # (B, H, P + 1, E): every token's query
    k_all, v_all = (torch.randn(1, Hkv, n, E, generator=gen) for _ in range(2))  # (B, Hkv, P + 1, E)
    cache = KVCache(1, Hkv, n, E)
    cache.append(k_all, v_all)
    blocks = -(-n // block_size)
    paged = PagedKVCache(2 * blocks, block_size, Hkv, E)
    # Shuffle the free list the way a server does: sequences of one block each, freed in a random order.
    one = torch.zeros(1, Hkv, 1, E)
    for sid in range(2 * blocks):
        paged.allocate(sid)
        paged.append([sid], one, one)
    for sid in torch.randperm(2 * blocks, generator=gen).tolist():
        paged.free(sid)
    paged.allocate("timed")
    paged.append(["timed"], k_all, v_all)
    table, seqlens = paged.block_table(["timed"]), paged.seqlens(["timed"])
    q_new = q_all[:, :, -1:]  # (B, H, 1, E): the new token's query

    def cached() -> torch.Tensor:
        return attention_with_kv_cache(q_new, cache.key_cache, cache.value_cache, cache.lengths, is_causal=True)

    def paged_step() -> torch.Tensor:
        return attention_with_kv_cache(q_new, paged.key_blocks, paged.value_blocks, seqlens, block_table=table,
                                       is_causal=True)

    def recompute() -> torch.Tensor:  # every row of a causal pass over P + 1 tokens; the last one is kept
        return attention_with_kv_cache(q_all, cache.key_cache, cache.value_cache, cache.lengths,
                                       is_causal=True)[:, :, -1:]

    with torch.no_grad():
        reference = cached()
        errors = {"paged_vs_cached": float((paged_step() - reference).abs().max()),
                  "recompute_vs_cached": float((recompute() - reference).abs().max())}
        times = time_cases({"cached": cached, "paged": paged_step, "recompute": recompute}, reps, min_time)
    med = {name: t["median_s"] for name, t in times.items()}
    return {"prefix": P, "tokens_in_cache": n, "times": times, "max_abs_diff": errors,
            "ratio_recompute_over_cached": med["recompute"] / med["cached"],
            "ratio_paged_over_cached": med["paged"] / med["cached"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, nargs="+", default=PREFIXES, help="prefix lengths P")
    parser.add_argument("--heads", type=int, default=8, help="H, query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="Hkv, key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="E")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of the paged cache")
    parser.add_argument("--reps", type=int, default=7, help="rounds per case (the median is reported)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per measurement, at least")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, see above)")
    parser.add_argument("--slope-from", type=int, default=512, help="fit the slope over prefixes >= this")
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds: the smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kv-cache",
                        help="a directory (kv-cache-<date>.json is written there) or a .json path")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:  # toy sizes by default; options given on the command line still win
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    record: dict = {"provenance": provenance(torch.device("cpu"), argv), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/kv_cache_bench.py", *argv])
    record["config"] = {"B": 1, "H": args.heads, "Hkv": args.kv_heads, "E": args.head_dim, "Ev": args.head_dim,
                        "dtype": "float32", "block_size": args.block_size, "prefixes": args.prefixes,
                        "reps": args.reps, "min_time_s": args.min_time, "threads": torch.get_num_threads(),
                        "quick": args.quick, "backend": "math",
                        "recompute": "attention_with_kv_cache with Lq = P + 1 (every row of a causal pass over "
                                     "the prefix and the new token), last row kept; no projections"}
    rows = []
    for i, P in enumerate(args.prefixes):
        _say(f"[{i + 1}/{len(args.prefixes)}] prefix {P}: cached, paged, recompute x {args.reps} rounds")
        row = measure_prefix(P, args.heads, args.kv_heads, args.head_dim, args.block_size, args.reps,
                             args.min_time, seed=i)
        med = {name: 1e3 * t["median_s"] for name, t in row["times"].items()}
        _say(f"    cached {med['cached']:.3f} ms  paged {med['paged']:.3f} ms  recompute {med['recompute']:.2f} ms"
             f"  -> recompute/cached {row['ratio_recompute_over_cached']:.1f}x,"
             f" paged/cached {row['ratio_paged_over_cached']:.2f}x")
        rows.append(row)
    record["results"] = rows
    fit = [r for r in rows if r["prefix"] >= args.slope_from]
    slope = loglog_slope([r["prefix"] for r in fit], [r["ratio_recompute_over_cached"] for r in fit]) \
        if len(fit) >= 2 else None
    worst_paged = max(r["ratio_paged_over_cached"] for r in rows)
    record["slope"] = {"value": slope, "fit_prefixes": [r["prefix"] for r in fit], "goal": list(SLOPE_GOAL),
                       "met": slope is not None and SLOPE_GOAL[0] <= slope <= SLOPE_GOAL[1],
                       "what": "least-squares slope of log(recompute / cached) against log(prefix)"}
    record["paged"] = {"max_ratio_over_cached": worst_paged, "goal": PAGED_GOAL, "met": worst_paged <= PAGED_GOAL}
    record["load_after"] = _load()
    slope_text = "n/a" if slope is None else f"{slope:.2f}"
    _say(f"slope of recompute/cached vs prefix over {record['slope']['fit_prefixes']}: {slope_text} "
         f"(goal {SLOPE_GOAL[0]}-{SLOPE_GOAL[1]}: {'met' if record['slope']['met'] else 'NOT met'})")
    _say(f"paged/contiguous, worst prefix: {worst_paged:.2f}x (goal <= {PAGED_GOAL}: "
         f"{'met' if record['paged']['met'] else 'NOT met'})")
    out = args.out
    if out.suffix != ".json":
        out = out / f"kv-cache-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    _say(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
