"""A block mask built once (issue 23): the public call against the tiled path, build times, contention.

A benchmark, not a test: every figure is measured side by side in one run, printed with its
ratio, and written as JSON with its provenance. Run from the repository root:

    .venv/bin/python benchmarks/block_mask_bench.py [--reps 11] [--flex] [--out DIR]

Three parts:

1. Forward, B=1, H=8, L=S=8192, D=64, float32, a causal sliding window of 256 keys
   (`mods.sliding_window(255)`), in turns: the public
   `scaled_dot_product_attention(..., backend="tiled", block_mask=bm)` with ``bm`` built once
   outside the timing; `tiled.tiled_attention(..., block_mask=bm)`; the public call with
   ``mask_mod=`` only, which builds the block mask on every call (the described window, now
   classified from its block corners, and the same window hidden in a hand-written function,
   which is evaluated); with ``--flex`` also ``torch.compile(flex_attention)`` with
   FlexAttention's block mask (the first compile takes minutes on CPU).
2. Block-mask build time, same sizes, 128 x 128 blocks, in turns: ``create_block_mask`` as it
   was at commit ``BEFORE_COMMIT`` (loaded from git with ``git show``, so the "before" is the
   code itself, not a remembered figure) and as it is now, for the described window and for
   the hand-written one.
3. Contention: L=S=4096, H=8, D=64, float32, causal, forward; the tiled path against torch's
   CPU SDPA, in turns, first on a quiet machine, then with one core kept busy by another
   process (a Python busy loop started by this script). The tiled path runs as a user gets it
   (``tiled``: on `attention_ref.threads.fitting_threads`, fewer threads while cores are busy), on every thread
   as before that choice (``tiled_all_threads``, ``attention_ref.threads.ADAPT_THREADS = False``), and under
   load on one thread set by hand. The ratio is the tiled path's throughput over SDPA's.

Each case is warmed up, then the cases of a group run in turns, ``--reps`` times; the median
and the minimum are reported, and the ratios of both (other processes only ever add time, so
on these shared machines the minimum is the steadier one; the load average before and after
is in the JSON).
The result goes to benchmarks/results/block-mask/.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_bench import _load, provenance  # noqa: E402
from block_sparse_bench import _say, _time, _write_dated  # noqa: E402  (cases timed in turns, as there)

from attention_ref import mods, scaled_dot_product_attention, tiled  # noqa: E402
from attention_ref import threads as budget  # noqa: E402
from attention_ref.backends import TILED_MODS_BLOCK_K, TILED_MODS_BLOCK_Q  # noqa: E402

#: The commit whose ``create_block_mask`` is the "before" (the last one before issue 23's change).
BEFORE_COMMIT = "30f7565"
WINDOW_KEYS = 256

def _before_module(commit: str):
    """``attention_ref/tiled.py`` as it was at ``commit``, imported as a module of its own (or None)."""
    try:
        source = subprocess.run(["git", "show", f"{commit}:attention_ref/tiled.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "tiled_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("tiled_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _hidden(mask_mod):
    """The same mask in a hand-written function: `mods.describe` cannot see through it."""
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)


def forward_part(size: dict, reps: int, flex: bool) -> dict:
    B, H, L, D = size["B"], size["H"], size["L"], size["D"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    window = mods.sliding_window(WINDOW_KEYS - 1)
    hidden = _hidden(window)
    blocks = {"block_q": TILED_MODS_BLOCK_Q, "block_k": TILED_MODS_BLOCK_K}
    bm = tiled.create_block_mask(window, None, None, L, L, **blocks)
    cases = {
        "public_block_mask": lambda: scaled_dot_product_attention(q, k, v, backend="tiled", block_mask=bm),
        "tiled_attention": lambda: tiled.tiled_attention(q, k, v, block_mask=bm),
        "public_per_call_described": lambda: scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=window),
        "public_per_call_hand_written": lambda: scaled_dot_product_attention(q, k, v, backend="tiled",
                                                                             mask_mod=hidden),
    }
    record: dict = {"size": size, "blocks": blocks, "block_mask": repr(bm)}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fbm = create_block_mask(lambda b, h, qi, kv: (kv <= qi) & (qi - kv < WINDOW_KEYS), None, None, L, L,
                                device="cpu")
        compiled = torch.compile(flex_attention)
        start = time.perf_counter()
        compiled(q, k, v, block_mask=fbm)
        record["flex_compile_s"] = time.perf_counter() - start
        cases["flex_compiled"] = lambda: compiled(q, k, v, block_mask=fbm)
    with torch.no_grad():
        out = scaled_dot_product_attention(q, k, v, backend="tiled", block_mask=bm)
        record["max_abs_diff_vs_tiled"] = float((out - tiled.tiled_attention(q, k, v, block_mask=bm)).abs().max())
        record["forward"] = t = _time(cases, reps)
    for key, stat in (("ratios", "median_s"), ("ratios_of_min", "min_s")):
        m = {n: x[stat] for n, x in t.items()}
        others = ["tiled_attention", "per_call_hand_written", "per_call_described"] + (
            ["flex_compiled"] if flex else [])
        record[key] = {f"public_block_mask_speed_vs_{name}": m.get(name, m.get(f"public_{name}"))
                       / m["public_block_mask"] for name in others}
    return record


def build_part(size: dict, reps: int) -> dict:
    L = size["L"]
    window = mods.sliding_window(WINDOW_KEYS - 1)
    hidden = _hidden(window)
    blocks = {"block_q": TILED_MODS_BLOCK_Q, "block_k": TILED_MODS_BLOCK_K}
    # the sizes the public call used to build with: the call's (B, H), so (1, 8)
    sizes = (size["B"], size["H"], L, L)
    cases = {"after_described": lambda: tiled.create_block_mask(window, *sizes, **blocks),
             "after_hand_written": lambda: tiled.create_block_mask(hidden, *sizes, **blocks)}
    before = _before_module(BEFORE_COMMIT)
    if before is not None:
        cases["before_described"] = lambda: before.create_block_mask(window, *sizes, **blocks)
        cases["before_hand_written"] = lambda: before.create_block_mask(hidden, *sizes, **blocks)
        same = all(torch.equal(before.create_block_mask(m, *sizes, **blocks).kinds,
                               tiled.create_block_mask(m, *sizes, **blocks).kinds) for m in (window, hidden))
    record = {"before": f"create_block_mask at commit {BEFORE_COMMIT} (git show), "
                        + ("loaded" if before is not None else "not found: no git"),
              "blocks": blocks, "sizes_B_H_L_S": list(sizes), "build": _time(cases, reps)}
    if before is not None:
        record["same_kinds_before_after"] = same
        m = {n: x["median_s"] for n, x in record["build"].items()}
        record["speedup"] = {"described": m["before_described"] / m["after_described"],
                             "hand_written": m["before_hand_written"] / m["after_hand_written"]}
    return record


def contention_part(reps: int, length: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64, generator=g) for _ in range(3))
    threads = torch.get_num_threads()

    def tiled_one_thread():
        torch.set_num_threads(1)
        try:
            tiled.tiled_attention(q, k, v, is_causal=True)
        finally:
            torch.set_num_threads(threads)

    def tiled_all_threads():  # as before the per-call choice: every thread, busy cores or not
        budget.ADAPT_THREADS = False
        try:
            tiled.tiled_attention(q, k, v, is_causal=True)
        finally:
            budget.ADAPT_THREADS = True

    cases = {"tiled": lambda: tiled.tiled_attention(q, k, v, is_causal=True),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "tiled_all_threads": tiled_all_threads}
    rows = {}
    fitting = {}
    with torch.no_grad():
        fitting["quiet"] = budget.fitting_threads()
        rows["quiet"] = _time(cases, reps)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core kept busy
        try:
            time.sleep(0.5)
            fitting["one_core_busy"] = budget.fitting_threads()
            rows["one_core_busy"] = _time({**cases, "tiled_1_thread": tiled_one_thread}, reps)
        finally:
            busy.kill()
            busy.wait()
    ratio = {name: r["sdpa"]["median_s"] / r["tiled"]["median_s"] for name, r in rows.items()}
    ratio_of_min = {name: r["sdpa"]["min_s"] / r["tiled"]["min_s"] for name, r in rows.items()}
    slow = {name: rows["one_core_busy"][name]["median_s"] / rows["quiet"][name]["median_s"]
            for name in ("tiled", "sdpa")}
    return {"size": {"B": 1, "H": 8, "L": length, "S": length, "D": 64, "dtype": "float32", "is_causal": True},
            "torch_threads": threads, "fitting_threads_before_timing": fitting,
            "times": rows, "tiled_throughput_vs_sdpa": ratio,
            "tiled_throughput_vs_sdpa_of_min": ratio_of_min,
            "slowdown_under_load": slow,
            "tiled_1_thread_vs_2_threads_under_load": rows["one_core_busy"]["tiled_all_threads"]["median_s"]
            / rows["one_core_busy"]["tiled_1_thread"]["median_s"],
            "tiled_speedup_from_fitting_threads_under_load": rows["one_core_busy"]["tiled_all_threads"]["median_s"]
            / rows["one_core_busy"]["tiled"]["median_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=11, help="timed rounds per case (median reported)")
    parser.add_argument("--length", type=int, default=8192, help="L = S of parts 1 and 2")
    parser.add_argument("--contention-length", type=int, default=4096, help="L = S of part 3")
    parser.add_argument("--flex", action="store_true", help="also time torch.compile(flex_attention) (minutes)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/block-mask"))
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    record = {"provenance": provenance(torch.device("cpu"), argv), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/block_mask_bench.py", *argv])
    size = {"B": 1, "H": 8, "L": args.length, "S": args.length, "D": 64, "dtype": "float32",
            "window_keys": WINDOW_KEYS}
    record["forward"] = fw = forward_part(size, args.reps, args.flex)
    f = {n: 1e3 * x["median_s"] for n, x in fw["forward"].items()}
    _say("forward (median ms): " + ", ".join(f"{n} {m:.1f}" for n, m in f.items()))
    _say("ratios of medians: " + ", ".join(f"{n} {r:.2f}" for n, r in fw["ratios"].items()))
    _say("ratios of minima: " + ", ".join(f"{n} {r:.2f}" for n, r in fw["ratios_of_min"].items()))
    record["build"] = bd = build_part(size, args.reps)
    _say("build (median ms): " + ", ".join(f"{n} {1e3 * x['median_s']:.2f}" for n, x in bd["build"].items()))
    if "speedup" in bd:
        _say("build speed-up: " + ", ".join(f"{n} {r:.1f}x" for n, r in bd["speedup"].items()))
    record["contention"] = ct = contention_part(args.reps, args.contention_length)
    _say("contention, tiled throughput / SDPA's (medians): " + ", ".join(
        f"{n} {r:.2f}" for n, r in ct["tiled_throughput_vs_sdpa"].items()))
    _say("contention, tiled throughput / SDPA's (minima): " + ", ".join(
        f"{n} {r:.2f}" for n, r in ct["tiled_throughput_vs_sdpa_of_min"].items()))
    _say("slowdown with one core busy: " + ", ".join(f"{n} {r:.2f}x" for n, r in ct["slowdown_under_load"].items()))
    _say(f"tiled with 1 thread vs 2 threads under load: {ct['tiled_1_thread_vs_2_threads_under_load']:.2f}x")
    _say(f"fitting threads (before timing): {ct['fitting_threads_before_timing']}; tiled with them vs all threads "
         f"under load: {ct['tiled_speedup_from_fitting_threads_under_load']:.2f}x")
    record["load_after"] = _load()
    _write_dated(Path(args.out), "block-mask", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
