"""Gated DeltaNet and Kimi Delta Attention on a GPU: attention_ref's chunked forms against fla's Triton kernels.

For one short call on a lent GPU with ``fla-core`` (flash-linear-attention's kernels, module
``fla``) installed. Run from the repository root:

    python benchmarks/linear_gpu.py [--lengths 8192 32768] [--out DIR_OR_FILE]

``correctness``: at ``T = --check-length``, fla's ``chunk_gated_delta_rule`` and ``chunk_kda``,
and as a control `attention_ref.linear.gated_delta_rule` and `~.kimi_delta_attention` with
``mode="chunked"``, each from an initial state, output and final state judged by
`attention_ref.testing.assert_linear_attention_close` (the float64 recurrence).
``timing``: forward, ``torch.no_grad()``, for each ``T`` in ``--lengths``, the same four calls:
a first call (Triton compiles and autotunes; its time is kept), a timed warm one, then the
median of ``triton.testing.do_bench`` if that was short (CUDA), else of a few warm calls
(``time.perf_counter``). Recorded: ms, tokens/s, ours/fla per ``T``.

Inputs (batch 1, ``Hv = H``, ``Ev = E``): q, k, v in ``--dtype``; log decay
``g = logsigmoid(N(0, 1) + 2)`` in float32, ``(B, T, H)`` for Gated DeltaNet, ``(B, T, H, E)``
for KDA; ``beta = sigmoid(N(0, 1))`` in ``--dtype``; initial state ``0.1 N(0, 1)`` in float32;
q and k L2-normalised in the kernel; ``scale = E ** -0.5``. fla-core 0.6.0's conventions
matched: ``g`` is the plain log decay in both (``use_gate_in_kernel=False``: no ``A_log`` or
softplus inside; KDA's ``safe_gate=False``), as this package's ``g``; ``beta`` already in
``(0, 1)`` (``use_beta_sigmoid_in_kernel=False``); the state ``[N, HV, K, V]``
(``state_v_first=False``), this package's ``(B, Hv, E, Ev)`` (``state_layout="kv"``).

Each case runs in its own ``try`` (an error is recorded and the run goes on) and the JSON is
rewritten atomically after each, so a run cut off keeps what it measured. Cases starting after
``--budget`` seconds are skipped, except the timings of fla kernels already compiled (well under
a second each). Without fla (or CUDA) fla's rows say so. Progress goes to stderr, a summary to
stdout. ``--quick``: toy sizes on the CPU in seconds (the smoke test; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_bench import _version, provenance, write_json_atomic  # noqa: E402

from attention_ref.linear import gated_delta_rule, kimi_delta_attention  # noqa: E402
from attention_ref.testing import assert_linear_attention_close  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUICK = {"lengths": [64], "heads": 2, "dim": 16, "dtype": "float32", "check_length": 64, "device": "cpu"}
FLA = ("fla.chunk_gated_delta_rule", "fla.chunk_kda")
OURS = ("attention_ref.gated_delta_rule", "attention_ref.kimi_delta_attention")
GATE = {FLA[0]: "g", OURS[0]: "g", FLA[1]: "gk", OURS[1]: "gk"}
"""Which log decay each call takes: per head (Gated DeltaNet) or per key channel (KDA)."""
SLOW_S = 0.1
"""A warm call longer than this is timed by a few plain calls instead of ``do_bench``."""


def _say(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def make_inputs(T: int, H: int, E: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """The inputs of one call, batch 1, ``Hv = H``, ``Ev = E``; ``g`` (per head) and ``gk`` (per key channel)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = (randn(1, T, H, E).to(dtype) for _ in range(3))  # (B, T, H, E)
    return {"q": q, "k": k, "v": v,
            "g": F.logsigmoid(randn(1, T, H) + 2),  # (B, T, Hv) log decay < 0, float32 as fla prefers
            "gk": F.logsigmoid(randn(1, T, H, E) + 2),  # (B, T, Hv, E): KDA's, per key channel
            "beta": torch.sigmoid(randn(1, T, H)).to(dtype),  # (B, T, Hv), in (0, 1)
            "h0": 0.1 * randn(1, H, E, E),  # (B, Hv, E, Ev) float32 (fla's chunk_kda requires it)
            "scale": E**-0.5}


def load_fla(device: torch.device) -> tuple[dict, str]:
    """fla's two kernels as ``name -> fn(inputs) -> (out, final_state)``, and a status."""
    if importlib.util.find_spec("fla") is None:
        return {}, "not installed"
    if device.type != "cuda":
        return {}, "skipped: fla's kernels are Triton, CUDA only"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on without fla
        return {}, f"import failed: {error!r}"
    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": False,
          "use_gate_in_kernel": False, "state_v_first": False}
    return {FLA[0]: lambda x: chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")), scale=x["scale"],
                                                     initial_state=x["h0"], **kw),
            FLA[1]: lambda x: chunk_kda(*(x[n] for n in ("q", "k", "v", "gk", "beta")), scale=x["scale"],
                                        initial_state=x["h0"], safe_gate=False, **kw)}, "ok"


def _ours(form, gate: str):
    return lambda x: form(x["q"], x["k"], x["v"], x[gate], x["beta"], initial_state=x["h0"], output_final_state=True,
                          mode="chunked", scale=x["scale"], use_qk_l2norm=True)


OURS_FNS = {OURS[0]: _ours(gated_delta_rule, GATE[OURS[0]]), OURS[1]: _ours(kimi_delta_attention, GATE[OURS[1]])}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worst_ratios(message: str) -> dict[str, float]:
    """Per failing quantity, its worst row's ``max|actual - reference|`` over the allowed, read off the message."""
    ratios, name, error = {}, None, None
    for line in message.splitlines():
        if m := re.fullmatch(r"  (\w+):", line):
            name = m.group(1)
        elif m := re.search(r"max\|actual - reference\|\s*= ([-+.\deinf]+)", line):
            error = float(m.group(1))
        elif (m := re.search(r"allowed: .*? = ([-+.\deinf]+)", line)) and name and error is not None:
            ratios[name] = error / float(m.group(1))
    return ratios


def check(name: str, fn, x: dict, device: torch.device, outputs: dict) -> dict:
    """One call judged by `assert_linear_attention_close` (verdict, message, seconds with compilation);
    its ``(out, state)`` goes to ``outputs``, and an fla row gets its largest distance from ours there."""
    start = time.perf_counter()
    with torch.no_grad():
        out, state = outputs[name] = fn(x)
    _sync(device)
    row = {"call_s": time.perf_counter() - start}
    ours = outputs.get(OURS[FLA.index(name)]) if name in FLA else None
    if ours is not None:
        row["max_abs_diff_vs_attention_ref"] = {"output": float((out.float() - ours[0].float()).abs().max()),
                                                "final_state": float((state.float() - ours[1].float()).abs().max())}
    try:
        report = assert_linear_attention_close(out, x["q"], x["k"], x["v"], x[GATE[name]], x["beta"],
                                               actual_state=state, initial_state=x["h0"], scale=x["scale"],
                                               use_qk_l2norm=True, state_layout="kv")
        row.update(status="passed", message=str(report), degenerate_rows=report.degenerate_rows,
                   rows_not_judged=len(report.rows_not_judged))
    except AssertionError as failure:
        row.update(status="failed", message=str(failure), worst_error_over_allowed=worst_ratios(str(failure)))
    return row


def measure(fn, x: dict, device: torch.device, reps: int, budget_s: float) -> dict:
    """Median ms and tokens/s of ``fn(x)`` after a first call (compile, autotune) and a timed warm one.

    A warm call under `SLOW_S` on CUDA: ``triton.testing.do_bench``; else up to ``reps`` warm calls,
    fewer when they would take more than ``budget_s`` (one at least).
    """
    fast = False
    with torch.no_grad():
        start = time.perf_counter()
        fn(x)
        _sync(device)
        first, warm = time.perf_counter() - start, []
        while not fast and (not warm or (len(warm) < reps and sum(warm) + warm[0] <= budget_s)):
            start = time.perf_counter()
            fn(x)
            _sync(device)
            warm.append(time.perf_counter() - start)
            fast = device.type == "cuda" and warm[0] < SLOW_S
        if fast:
            from triton.testing import do_bench

            ms = do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")
            how = "triton.testing.do_bench(warmup=25, rep=100, return_mode='median')"
        else:
            ms, how = 1e3 * statistics.median(warm), f"time.perf_counter, median of {len(warm)} warm call(s)"
    return {"ms": ms, "tokens_per_s": x["q"].shape[1] / (ms / 1e3), "first_call_s": first,
            "warm_calls_ms": [1e3 * t for t in warm], "method": how}


def summary(record: dict) -> str:
    lines = [f"correctness at T = {record['config']['check_length']} ({record['config']['dtype']}):"]
    for name, row in record["correctness"].items():
        ratios = row.get("worst_error_over_allowed")
        lines.append(f"  {name:<36} {row['status']}" + (f"  worst error / allowed {ratios}" if ratios else ""))
    lines.append(f"{'T':>7}  {'implementation (forward)':<36} {'ms':>10} {'Mtok/s':>9} {'ours/fla':>9}")
    for T, rows in record["timing"].items():
        for name in (*FLA, *OURS):
            row = rows.get(name, {})
            if "ms" not in row:
                lines.append(f"{T:>7}  {name:<36} {row.get('status', '-')} {row.get('error', '')[:80]}")
                continue
            ratio = rows["ours_over_fla"].get(name)
            lines.append(f"{T:>7}  {name:<36} {row['ms']:>10.3f} {row['tokens_per_s'] / 1e6:>9.3f} "
                         + (f"{ratio:>8.2f}x" if ratio is not None else f"{'':>9}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="T of the timing part")
    parser.add_argument("--heads", type=int, default=8, help="H = Hv")
    parser.add_argument("--dim", type=int, default=128, help="E = Ev (fla's K = V)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="of q, k, v and beta")
    parser.add_argument("--check-length", type=int, default=2048, help="T of the correctness part")
    parser.add_argument("--reps", type=int, default=3, help="warm calls of a slow case (median reported)")
    parser.add_argument("--budget", type=float, default=90.0,
                        help="seconds from the start; cases after this are skipped (see above)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness part (timings only)")
    parser.add_argument("--quick", action="store_true", help="toy sizes on the CPU, seconds: the smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/linear-gpu",
                        help="a directory (fla-<date>.json is written there) or a .json path")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:  # toy sizes by default; options given on the command line still win
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for name in ("heads", "dim", "check_length", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.lengths) < 1 or args.budget <= 0:
        parser.error(f"--lengths must be at least 1 and --budget positive, got {args.lengths} and {args.budget}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    out = args.out if args.out.suffix == ".json" else args.out / f"fla-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    fla_fns, fla_status = load_fla(device)
    record: dict = {"provenance": provenance(device, argv)}
    record["provenance"].update(command=" ".join(["python", "benchmarks/linear_gpu.py", *argv]),
                                fla_core=_version("fla-core"), fla_status=fla_status)
    record["config"] = {"B": 1, "H": args.heads, "Hv": args.heads, "E": args.dim, "Ev": args.dim,
                        "dtype": args.dtype, "check_length": args.check_length, "lengths": args.lengths,
                        "reps": args.reps, "budget_s": args.budget, "quick": args.quick, "chunk_size": 64,
                        "direction": "forward, torch.no_grad()", "inputs": "see the script's docstring"}
    record["correctness"], record["timing"] = {}, {}
    fns = {**fla_fns, **OURS_FNS}

    def run(part: dict, name: str, what, *what_args, cheap: bool = False) -> None:
        """``part[name] = what(*what_args)``, or the error or the skip; then the JSON is written."""
        if name not in fns:
            part[name] = {"status": fla_status}
        elif time.perf_counter() - started > args.budget and not cheap:
            part[name] = {"status": f"skipped: past --budget {args.budget:g} s"}
        else:
            try:
                part[name] = what(*what_args)
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                part[name] = {"status": "error", "error": repr(error), "traceback": traceback.format_exc()[-3000:]}
        record["elapsed_s"] = time.perf_counter() - started
        write_json_atomic(out, record)
        _say(f"    {name}: {part[name].get('status', 'measured')} ({record['elapsed_s']:.1f} s so far)")

    _say(f"correctness, T = {args.check_length}, H = {args.heads}, E = Ev = {args.dim}, {args.dtype}, "
         f"{device}; fla: {fla_status}")
    x, outputs = make_inputs(args.check_length, args.heads, args.dim, dtype, device, seed=0), {}
    for name in (*OURS, *FLA):  # ours first: fla's rows also give their distance from ours
        if args.no_check:
            record["correctness"][name] = {"status": "skipped: --no-check"}
            continue
        run(record["correctness"], name, check, name, fns.get(name), x, device, outputs)
    outputs.clear()
    for T in args.lengths:
        _say(f"timing, T = {T}")
        rows = record["timing"][str(T)] = {"ours_over_fla": {}}
        try:
            x = make_inputs(T, args.heads, args.dim, dtype, device, seed=T)
        except Exception as error:  # noqa: BLE001 - recorded, the next length may still fit
            rows["error"] = repr(error)
            continue
        for name in (*OURS, *FLA):  # ours first: fla's first call at a new T may autotune for a minute
            compiled = name in FLA and record["correctness"][name].get("status") in ("passed", "failed")
            run(rows, name, measure, fns.get(name), x, device, args.reps, min(20.0, args.budget / 4), cheap=compiled)
        for ours, fla in zip(OURS, FLA):
            if "ms" in rows[ours] and "ms" in rows[fla]:
                rows["ours_over_fla"][ours] = rows[ours]["ms"] / rows[fla]["ms"]
    record["elapsed_s"] = time.perf_counter() - started
    write_json_atomic(out, record)
    _say(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} in {record['elapsed_s']:.1f} s")
    print(summary(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
