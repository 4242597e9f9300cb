"""The gated delta rule on CPU: chunked against the recurrence and transformers, and its crossover with softmax.

A benchmark, not a test: every figure is measured side by side in one run and written as JSON
with its provenance (device, versions, command, git commit, load average). Run from the
repository root:

    .venv/bin/python benchmarks/linear_bench.py [--reps 5] [--threads 1] [--out DIR_OR_FILE]

Two parts, forward only, float32, batch 1, under ``torch.no_grad()``:

``headline``
    ``T = 8192`` tokens, ``H = 8`` heads (``Hv = H``), ``E = Ev = 128`` (fla's ``K = V``),
    three implementations of the same layer (Gated DeltaNet, q and k L2-normalised in the
    kernel, ``scale = E ** -0.5``, random log gates ``g`` in ``[-0.1, 0]`` and ``beta`` in
    ``[0, 1)``), once for each number of torch threads in ``--threads`` (1 and 2 by default):

    - ``chunked_<C>``: `attention_ref.linear.gated_delta_rule` with ``mode="chunked"``, for
      each ``chunk_size`` ``C`` in ``--chunk-sizes`` (32 and 64 by default);
    - ``recurrent``: the same function with ``mode="recurrent"`` (the token loop);
    - ``transformers``: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's PyTorch
      fallback, its ``chunk_size=64``, ``use_qk_l2norm_in_kernel=True``).

    Goals (issue 22): ``recurrent / chunked >= 5`` and ``chunked / transformers <= 2``, judged
    for every thread count and chunk size. The outputs are compared too (largest absolute
    difference from the recurrence). Beside the times: the arithmetic of each form (`flops`),
    the float32 matmul rate torch reaches on this CPU with the same threads (a 1024^3
    product), and from them the ``ceiling``: the ratio the chunked form would reach if all its
    arithmetic ran at that rate and nothing else cost time.

``crossover``
    For each ``L`` (256 ... 4096 by default, same ``H``, ``E``), the chunked gated delta
    rule against causal softmax attention, `attention_ref.scaled_dot_product_attention`
    (``backend="math"``, ``is_causal=True``, the ``(B, H, L, L)`` weights materialised):
    time per call and the extra peak of torch CPU allocations during one call (torch's
    profiler with ``profile_memory=True``, `attention_bench.cpu_peak_bytes`; inputs
    excluded). The crossover length, where the two times (or peaks) are equal, is
    interpolated on the log-log scale between the two measured lengths around it.

Timing: torch's intra-op threads are fixed for each part (``--threads``, recorded; the crossover
runs with the first of them. On a shared two-core machine a second thread that waits for a busy
core can make the recurrence's thousands of small operations pathologically slow, about 40x in
one trial, which would flatter the ratio: the CPU-time ratios are recorded beside the wall-clock ones).
Each case is called once to warm it up (that call's output is the one compared) and its number
of calls per measurement chosen so that one measurement lasts at least ``--min-time`` seconds;
then the cases take turns (round-robin), ``--reps`` rounds, and the
median time per call is reported, every raw measurement kept in the JSON. The process's CPU
time (``time.process_time``) is recorded beside the wall-clock time: with one thread it leaves
out the time the process waited for a core, so on a busy machine it is the steadier of the two
(the goals are judged on wall-clock medians; the ratios in CPU time are reported too).
Progress goes to stderr. ``--quick`` runs toy sizes in seconds (the smoke test; its figures
mean nothing). The result goes to benchmarks/results/linear/linear-<date>.json unless ``--out``
says otherwise (a directory, or a path ending in .json).
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

from attention_bench import _load, cpu_peak_bytes, provenance  # noqa: E402

from attention_ref import scaled_dot_product_attention  # noqa: E402
from attention_ref.linear import gated_delta_rule, kimi_delta_attention  # noqa: E402

CROSSOVER_LENGTHS = [256, 512, 1024, 2048, 4096]
QUICK = dict(tokens=256, heads=2, head_dim=16, lengths=[32, 64, 128], reps=2, min_time=0.002, threads=[1],
             chunk_sizes=[8, 16], kda_tokens=128, kda_heads=2)
RECURRENT_GOAL = 5.0
"""``recurrent / chunked`` must be at least this."""
TRANSFORMERS_GOAL = 2.0
"""``chunked / transformers`` must be at most this."""
KDA_GOAL = 2.0
"""Kimi delta attention's chunked form over the gated delta rule's (issue 34) must be at most this."""


def _say(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def _warm_up(fn: Callable[[], object], min_time: float) -> tuple[object, int]:
    """Call ``fn`` once; its result, and the number of calls that makes one measurement last ``min_time``."""
    start = time.perf_counter()
    result = fn()
    once = time.perf_counter() - start
    if once < min_time:  # a fast case: time a second, warm call to size the measurement
        start = time.perf_counter()
        fn()
        once = time.perf_counter() - start
    return result, max(1, math.ceil(min_time / max(once, 1e-7)))


def time_cases(cases: dict[str, Callable[[], object]], reps: int, min_time: float
               ) -> tuple[dict[str, object], dict[str, dict]]:
    """Warm-up results, and the median seconds per call of each case; the cases take turns, ``reps`` rounds."""
    results, numbers = {}, {}
    for name, fn in cases.items():
        results[name], numbers[name] = _warm_up(fn, min_time)
    per_call: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(numbers[name]):
                fn()
            per_call[name].append((time.perf_counter() - start) / numbers[name])
            cpu[name].append((time.process_time() - start_cpu) / numbers[name])
    times = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                    "calls_per_measurement": numbers[name], "per_call_s": t,
                    "median_cpu_s": statistics.median(cpu[name]), "per_call_cpu_s": cpu[name]}
             for name, t in per_call.items()}
    return results, times


def crossover(xs: list[float], a: list[float], b: list[float]) -> float | None:
    """The first ``x`` where ``a`` stops exceeding ``b``, interpolated on the log-log scale; None if never.

    ``a`` is expected to grow faster with ``x`` than ``b`` (softmax attention against the
    linear form): the answer lies between the last ``x`` with ``a < b`` and the first with
    ``a >= b``. The first ``x`` if ``a >= b`` already there.
    """
    for i, (x, ai, bi) in enumerate(zip(xs, a, b)):
        if ai >= bi:
            if i == 0:
                return float(x)
            # log(a / b) is linear in log(x) between the two points: find its zero
            r0, r1 = math.log(a[i - 1] / b[i - 1]), math.log(ai / bi)
            lx0, lx1 = math.log(xs[i - 1]), math.log(x)
            return math.exp(lx0 + (lx1 - lx0) * (0 - r0) / (r1 - r0))
    return None


def _inputs(T: int, H: int, E: int, seed: int) -> dict[str, torch.Tensor]:
    """Gated DeltaNet inputs in the ``(B, L, H, .)`` layout, float32, B = 1."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, E, generator=gen) for _ in range(3))  # (B, L, H, E), Ev = E
    g = -0.1 * torch.rand(1, T, H, generator=gen)  # (B, L, H): log decay in [-0.1, 0]
    beta = torch.rand(1, T, H, generator=gen)  # (B, L, H)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def flops(T: int, H: int, E: int, Ev: int, chunk_size: int | None = None) -> float:
    """Multiplications and additions of one forward call (batch 1), recurrent or chunked.

    Counted: the matrix products and the state's decay; ignored: elementwise work on ``C x C``
    or ``T x E`` tensors (gates, norms). Per token and head, the recurrence decays the
    ``E x Ev`` state, predicts ``k^T S``, adds ``k u^T`` and reads ``q^T S``: ``7 E Ev``. Per
    chunk of ``C`` and head, the chunked form builds ``Q K^T`` and ``K K^T`` (``2 C^2 E``
    each), solves the unit triangular system against ``I`` (``2 C^3 / 3``), forms
    ``U = A^-1 V`` (``2 C^2 Ev``) and ``W = A^-1 K`` (``2 C^2 E``), then passes the state:
    ``W S``, ``Q S`` and ``K^T V_new`` (``2 C E Ev`` each), ``scores V_new`` (``2 C^2 Ev``)
    and the decay (``E Ev``).
    """
    if chunk_size is None:
        return 7.0 * E * Ev * T * H
    C = chunk_size
    per_chunk = 6 * C * C * E + 4 * C * C * Ev + 2 * C**3 / 3 + 6 * C * E * Ev + E * Ev
    return per_chunk * (T / C) * H


def peak_matmul_gflops(min_time: float) -> float:
    """The float32 rate of a 1024 x 1024 x 1024 product with the current threads, GFLOP/s (best of 3)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    _, calls = _warm_up(lambda: a @ b, min_time / 3)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * 1024**3 / best / 1e9


def measure_headline(T: int, H: int, E: int, chunk_sizes: list[int], reps: int, min_time: float, seed: int) -> dict:
    """The chunked forms, the recurrence and transformers' chunked form at one size, the current threads."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    x = _inputs(T, H, E, seed)
    cases = {f"chunked_{C}": (lambda C=C: gated_delta_rule(**x, mode="chunked", chunk_size=C)[0])
             for C in chunk_sizes}
    cases["transformers"] = lambda: torch_chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, use_qk_l2norm_in_kernel=True)[0]
    cases["recurrent"] = lambda: gated_delta_rule(**x, mode="recurrent")[0]
    with torch.no_grad():
        outs, times = time_cases(cases, reps, min_time)
    peak = peak_matmul_gflops(min_time)
    errors = {f"{name}_vs_recurrent": float((outs[name] - outs["recurrent"]).abs().max())
              for name in cases if name != "recurrent"}
    med = {name: t["median_s"] for name, t in times.items()}
    cpu = {name: max(t["median_cpu_s"], 1e-12) for name, t in times.items()}
    ratios, cpu_ratios, goals, ceiling = {}, {}, {}, {}
    for C in chunk_sizes:
        name = f"chunked_{C}"
        ratios[name] = {"recurrent_over_chunked": med["recurrent"] / med[name],
                        "chunked_over_transformers": med[name] / med["transformers"]}
        cpu_ratios[name] = {"recurrent_over_chunked": cpu["recurrent"] / cpu[name],
                            "chunked_over_transformers": cpu[name] / cpu["transformers"]}
        goals[name] = {"recurrent_over_chunked": {"goal": f">= {RECURRENT_GOAL}",
                                                  "met": ratios[name]["recurrent_over_chunked"] >= RECURRENT_GOAL},
                       "chunked_over_transformers": {"goal": f"<= {TRANSFORMERS_GOAL}",
                                                     "met": ratios[name]["chunked_over_transformers"]
                                                     <= TRANSFORMERS_GOAL}}
        ceiling[name] = med["recurrent"] / (flops(T, H, E, E, C) / (peak * 1e9))
    return {"threads": torch.get_num_threads(), "times": times, "max_abs_diff": errors, "ratios": ratios,
            "cpu_time_ratios": cpu_ratios, "goals": goals, "peak_matmul_gflops": peak, "ceiling": ceiling,
            "gflops_achieved": {name: flops(T, H, E, E, None if name == "recurrent" else int(name.split("_")[1]))
                                / med[name] / 1e9 for name in cases if name != "transformers"}}


def measure_kda(T: int, H: int, E: int, chunk_size: int, reps: int, min_time: float, seed: int) -> dict:
    """Kimi delta attention's chunked form against the gated delta rule's at the same size, the current threads.

    The same inputs, except the gate: one log decay per key channel, ``(B, L, H, E)``, drawn like
    the scalar one. Both also against their own recurrence run once on the first 512 tokens
    (their largest absolute difference), so a fast wrong form would show.
    """
    x = _inputs(T, H, E, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    g_channels = -0.1 * torch.rand(1, T, H, E, generator=gen)  # (B, L, H, E): a log decay per key channel
    kda = dict(x, g=g_channels)
    cases = {"gated_delta_rule_chunked": lambda: gated_delta_rule(**x, mode="chunked", chunk_size=chunk_size)[0],
             "kimi_delta_attention_chunked": lambda: kimi_delta_attention(**kda, mode="chunked",
                                                                         chunk_size=chunk_size)[0]}
    with torch.no_grad():
        _, times = time_cases(cases, reps, min_time)
        head = {n: t[:, :512] for n, t in kda.items()}
        errors = {"kimi_delta_attention_chunked_vs_recurrent": float(
            (kimi_delta_attention(**head, mode="chunked", chunk_size=chunk_size)[0]
             - kimi_delta_attention(**head, mode="recurrent")[0]).abs().max())}
    med = {name: t["median_s"] for name, t in times.items()}
    cpu = {name: max(t["median_cpu_s"], 1e-12) for name, t in times.items()}
    ratio = med["kimi_delta_attention_chunked"] / med["gated_delta_rule_chunked"]
    return {"threads": torch.get_num_threads(), "times": times, "max_abs_diff": errors,
            "ratio_kda_over_gated_delta_rule": ratio,
            "cpu_time_ratio": cpu["kimi_delta_attention_chunked"] / cpu["gated_delta_rule_chunked"],
            "goal": {"goal": f"<= {KDA_GOAL}", "met": ratio <= KDA_GOAL}}


def measure_crossover_length(L: int, H: int, E: int, chunk_size: int, reps: int, min_time: float, seed: int) -> dict:
    """The chunked gated delta rule and causal softmax attention at one length: time and peak memory."""
    x = _inputs(L, H, E, seed)
    q, k, v = (x[n].transpose(1, 2).contiguous() for n in "qkv")  # (B, L, H, E) -> (B, H, L, E)
    cases = {
        "gated_delta_rule_chunked": lambda: gated_delta_rule(**x, mode="chunked", chunk_size=chunk_size)[0],
        "softmax_sdpa_math": lambda: scaled_dot_product_attention(q, k, v, is_causal=True, backend="math"),
    }
    with torch.no_grad():
        _, times = time_cases(cases, reps, min_time)
        peaks = {name: cpu_peak_bytes(fn) for name, fn in cases.items()}
    return {"L": L, "times": times, "peak_bytes": peaks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["headline", "crossover", "kda"],
                        default=["headline", "crossover", "kda"])
    parser.add_argument("--kda-tokens", type=int, default=2048, help="T of the kda part")
    parser.add_argument("--kda-heads", type=int, default=4, help="H (= Hv) of the kda part")
    parser.add_argument("--tokens", type=int, default=8192, help="T of the headline part")
    parser.add_argument("--heads", type=int, default=8, help="H (= Hv)")
    parser.add_argument("--head-dim", type=int, default=128, help="E = Ev (fla's K = V)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64],
                        help="tokens per chunk of attention_ref's chunked form in the headline")
    parser.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk in the crossover")
    parser.add_argument("--lengths", type=int, nargs="+", default=CROSSOVER_LENGTHS, help="L of the crossover")
    parser.add_argument("--reps", type=int, default=5, help="rounds per case (the median is reported)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement, at least")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch.set_num_threads for each headline run; the crossover uses the first")
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds: the smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/linear",
                        help="a directory (linear-<date>.json is written there) or a .json path")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:  # toy sizes by default; options given on the command line still win
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for n in args.threads + args.chunk_sizes + [args.chunk_size]:
        if n < 1:
            parser.error(f"--threads and chunk sizes must be >= 1, got {n}")
    torch.set_num_threads(args.threads[0])
    import transformers

    record: dict = {"provenance": provenance(torch.device("cpu"), argv), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/linear_bench.py", *argv])
    record["provenance"]["transformers"] = transformers.__version__
    record["config"] = {"B": 1, "H": args.heads, "Hv": args.heads, "E": args.head_dim, "Ev": args.head_dim,
                        "dtype": "float32", "direction": "forward, torch.no_grad()", "chunk_size": args.chunk_size,
                        "chunk_sizes": args.chunk_sizes, "transformers_chunk_size": 64,
                        "T": args.tokens, "lengths": args.lengths, "reps": args.reps, "min_time_s": args.min_time,
                        "threads": args.threads, "crossover_threads": args.threads[0], "quick": args.quick,
                        "parts": args.parts,
                        "gates": "g = -0.1 * U[0, 1), beta = U[0, 1), q and k L2-normalised, scale E ** -0.5",
                        "softmax": "attention_ref.scaled_dot_product_attention, backend='math', is_causal=True"}
    if "headline" in args.parts:
        runs = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            _say(f"headline, {threads} thread(s): T = {args.tokens}, H = {args.heads}, E = Ev = {args.head_dim}: "
                 f"chunked (C = {', '.join(map(str, args.chunk_sizes))}), transformers, recurrent x {args.reps} "
                 f"rounds (the recurrence is slow)")
            head = measure_headline(args.tokens, args.heads, args.head_dim, args.chunk_sizes, args.reps,
                                    args.min_time, seed=0)
            med = {name: t["median_s"] for name, t in head["times"].items()}
            _say("    " + "  ".join(f"{name} {t:.3f} s" for name, t in med.items())
                 + f"; matmul peak {head['peak_matmul_gflops']:.0f} GFLOP/s")
            for name, ratios in head["ratios"].items():
                for what, ratio in ratios.items():
                    goal = head["goals"][name][what]
                    _say(f"    {name} {what}: {ratio:.2f}x (goal {goal['goal']}: "
                         f"{'met' if goal['met'] else 'NOT met'}); in CPU time "
                         f"{head['cpu_time_ratios'][name][what]:.2f}x")
                _say(f"    {name}: ceiling at the matmul peak {head['ceiling'][name]:.2f}x")
            _say(f"    largest |difference| from the recurrence: {head['max_abs_diff']}")
            runs.append(head)
        torch.set_num_threads(args.threads[0])
        record["headline"] = {"T": args.tokens, "runs": runs,
                              "flops": {"recurrent": flops(args.tokens, args.heads, args.head_dim, args.head_dim),
                                        **{f"chunked_{C}": flops(args.tokens, args.heads, args.head_dim,
                                                                 args.head_dim, C) for C in args.chunk_sizes}}}
    if "kda" in args.parts:
        runs = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            _say(f"kda, {threads} thread(s): T = {args.kda_tokens}, H = {args.kda_heads}, E = Ev = {args.head_dim}: "
                 f"chunked Kimi delta attention against the chunked gated delta rule, C = {args.chunk_size}")
            run = measure_kda(args.kda_tokens, args.kda_heads, args.head_dim, args.chunk_size, args.reps,
                              args.min_time, seed=7)
            _say("    " + "  ".join(f"{name} {t['median_s'] * 1e3:.1f} ms" for name, t in run["times"].items())
                 + f": {run['ratio_kda_over_gated_delta_rule']:.2f}x (goal {run['goal']['goal']}: "
                 f"{'met' if run['goal']['met'] else 'NOT met'}); in CPU time {run['cpu_time_ratio']:.2f}x; "
                 f"{run['max_abs_diff']}")
            runs.append(run)
        torch.set_num_threads(args.threads[0])
        record["kda"] = {"T": args.kda_tokens, "H": args.kda_heads, "E": args.head_dim, "chunk_size": args.chunk_size,
                         "gates": "scalar: g = -0.1 * U[0, 1) per head; per channel: the same per key channel",
                         "runs": runs}
    if "crossover" in args.parts:
        rows = []
        for i, L in enumerate(args.lengths):
            _say(f"[{i + 1}/{len(args.lengths)}] crossover L = {L}: chunked gated delta rule, softmax")
            row = measure_crossover_length(L, args.heads, args.head_dim, args.chunk_size, args.reps, args.min_time,
                                           seed=1 + i)
            t, m = row["times"], row["peak_bytes"]
            _say(f"    {1e3 * t['gated_delta_rule_chunked']['median_s']:.1f} ms vs "
                 f"{1e3 * t['softmax_sdpa_math']['median_s']:.1f} ms, peak {m['gated_delta_rule_chunked'] / 2**20:.1f}"
                 f" MiB vs {m['softmax_sdpa_math'] / 2**20:.1f} MiB")
            rows.append(row)
        Ls = [r["L"] for r in rows]
        soft_t = [r["times"]["softmax_sdpa_math"]["median_s"] for r in rows]
        lin_t = [r["times"]["gated_delta_rule_chunked"]["median_s"] for r in rows]
        soft_m = [r["peak_bytes"]["softmax_sdpa_math"] for r in rows]
        lin_m = [r["peak_bytes"]["gated_delta_rule_chunked"] for r in rows]
        record["crossover"] = {"rows": rows, "time_L": crossover(Ls, soft_t, lin_t),
                               "memory_L": crossover(Ls, soft_m, lin_m),
                               "what": "L where softmax attention's median time (peak bytes) first reaches the "
                                       "chunked gated delta rule's, log-log interpolation; None: not in range"}
        _say(f"crossover: time at L ~ {record['crossover']['time_L']}, memory at L ~ "
             f"{record['crossover']['memory_L']}")
    record["load_after"] = _load()
    _say(f"load average before {record['load_before']['loadavg_1_5_15']}, after "
         f"{record['load_after']['loadavg_1_5_15']}")
    out = args.out
    if out.suffix != ".json":
        out = out / f"linear-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    _say(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
