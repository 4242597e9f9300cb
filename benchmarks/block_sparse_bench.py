"""Block-sparse attention on CPU: the tiled path with a mask_mod against FlexAttention and SDPA.

A benchmark, not a test: every figure is measured side by side in one run, printed with its
ratio, and written as JSON with its provenance. Run from the repository root:

    .venv/bin/python benchmarks/block_sparse_bench.py [--reps 7] [--out DIR]

Two parts:

1. The headline (issue 9): B=1, H=8, L=S=8192, D=64, float32, a causal sliding window of 256
   keys (`mods.sliding_window(255)`: the query's own key and the 255 before it), forward. Each
   path gets its block mask built outside the timing: `torch.compile(flex_attention)` with
   FlexAttention's `create_block_mask` (its default 128 x 128 blocks), the tiled path with
   `tiled.create_block_mask` (its own blocks, `backends.TILED_MODS_BLOCK_Q/K`), and
   `torch.nn.functional.scaled_dot_product_attention` with the dense boolean mask. Also the
   forward and backward pass of the tiled path against the math path (the reference), and
   the fraction of blocks each block mask skips.
2. The `"auto"` rule: for a few lengths, the forward time of the tiled path, the math path and
   SDPA with the materialised mask (not for a score_mod, which it cannot take), for a sparse
   mask (the same window), causal (about half the blocks empty), a mask with no empty block,
   and soft-capping with and without the window. The thresholds of rule 3 in
   `attention_ref.backends` are read off these figures.

Timing: each case is warmed up, then the cases of a group run in turns (round-robin), `--reps`
times; the median of each is reported (these machines are shared: see the load in the JSON).
The result goes to benchmarks/results/block-sparse/ (the GPU-path page reads only the JSON
files directly in benchmarks/results/, the results of attention_bench.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_bench import _load, provenance  # noqa: E402

from attention_ref import backends, mods, scaled_dot_product_attention, tiled  # noqa: E402

WINDOW_KEYS = 256


def _time(cases: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, dict]:
    """Median and spread of each case's wall time (seconds), the cases run in turns."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "reps": len(t)}
            for name, t in times.items()}


def _write_dated(out: Path, stem: str, record: dict) -> Path:
    """Write ``record`` as ``<out>/<stem>-<date of its provenance>.json`` and say where."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{record['provenance']['date'][:10]}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    _say(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


def _say(*args: object) -> None:
    print(*args, flush=True)


def headline(reps: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    B, H, L, D = 1, 8, 8192, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    mask_mod = mods.sliding_window(WINDOW_KEYS - 1)
    bq, bk = backends.TILED_MODS_BLOCK_Q, backends.TILED_MODS_BLOCK_K

    _say(f"[1/4] block masks (L=S={L}, window of {WINDOW_KEYS} keys)")
    start = time.perf_counter()
    ours = tiled.create_block_mask(mask_mod, None, None, L, L, block_q=bq, block_k=bk)
    ours_build = time.perf_counter() - start
    start = time.perf_counter()
    flex_bm = flex_block_mask(mask_mod, None, None, L, L, device="cpu")
    flex_build = time.perf_counter() - start
    dense = mods.create_mask(mask_mod, None, None, L, L)  # (1, 1, L, S) bool for SDPA
    flex_blocks = (L // 128) ** 2
    flex_sparsity = flex_bm.sparsity() / 100.0  # FlexAttention reports the percentage of blocks skipped

    _say("[2/4] compiling flex_attention (7-25 s here)")
    compiled = torch.compile(flex_attention)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(q, k, v, block_mask=flex_bm)
    compile_s = time.perf_counter() - start

    _say(f"[3/4] forward, {reps} rounds")
    with torch.no_grad():
        fwd = _time({
            "tiled": lambda: tiled.tiled_attention(q, k, v, block_mask=ours, block_q=bq, block_k=bk),
            "flex_compiled": lambda: compiled(q, k, v, block_mask=flex_bm),
            "sdpa_dense_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
            "math": lambda: scaled_dot_product_attention(q, k, v, mask_mod=mask_mod),
        }, reps)
    ref = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask_mod=mask_mod)
    with torch.no_grad():
        err_tiled = (tiled.tiled_attention(q, k, v, block_mask=ours, block_q=bq, block_k=bk).double() - ref).abs().max()
        err_flex = (compiled(q, k, v, block_mask=flex_bm).double() - ref).abs().max()

    _say(f"[4/4] forward + backward, {max(3, reps // 2)} rounds")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn(B, H, L, D)

    def fwd_bwd(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.grad(run(), (qg, kg, vg), grad)
        return step

    both = _time({
        "tiled": fwd_bwd(lambda: tiled.tiled_attention(qg, kg, vg, block_mask=ours, block_q=bq, block_k=bk)),
        "math": fwd_bwd(lambda: scaled_dot_product_attention(qg, kg, vg, mask_mod=mask_mod)),
        "sdpa_dense_mask": fwd_bwd(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense)),
    }, max(3, reps // 2))
    t = {name: r["median_s"] for name, r in fwd.items()}
    tb = {name: r["median_s"] for name, r in both.items()}
    return {
        "config": {"B": B, "H": H, "L": L, "S": L, "D": D, "dtype": "float32", "window_keys": WINDOW_KEYS,
                   "mask_mod": f"mods.sliding_window({WINDOW_KEYS - 1})", "tiled_blocks": [bq, bk],
                   "flex_blocks": [128, 128]},
        "block_masks": {
            "tiled": {"build_s": ours_build, "fraction_skipped": ours.fraction_skipped, **ours.counts()},
            "flex": {"build_s": flex_build, "fraction_skipped": flex_sparsity, "blocks": flex_blocks},
        },
        "flex_compile_s": compile_s,
        "forward": fwd,
        "forward_backward": both,
        "max_abs_error_vs_float64": {"tiled": float(err_tiled), "flex_compiled": float(err_flex)},
        "ratios": {
            "tiled_speed_vs_flex_compiled": t["flex_compiled"] / t["tiled"],
            "tiled_speedup_vs_sdpa_dense_mask": t["sdpa_dense_mask"] / t["tiled"],
            "tiled_speedup_vs_math": t["math"] / t["tiled"],
            "fwd_bwd_tiled_speedup_vs_math": tb["math"] / tb["tiled"],
            "fwd_bwd_tiled_speedup_vs_sdpa_dense_mask": tb["sdpa_dense_mask"] / tb["tiled"],
        },
        "targets": {"tiled_speed_vs_flex_compiled": 0.5, "tiled_speedup_vs_sdpa_dense_mask": 5.0},
    }


def _no_empty_block(b, h, q_idx, kv_idx):
    """A dense mask_mod: no block is empty, every block partial (the tiled path's worst case)."""
    return (q_idx + kv_idx) % 7 != 0


AUTO_CASES = {  # name: (mask_mod, score_mod)
    "window": (mods.sliding_window(WINDOW_KEYS - 1), None),
    "causal": (mods.causal(), None),
    "no empty block": (_no_empty_block, None),
    "window + softcap": (mods.sliding_window(WINDOW_KEYS - 1), mods.softcap(30.0)),
    "softcap": (None, mods.softcap(30.0)),
}


def auto_rule(reps: int, lengths: list[int]) -> list[dict]:
    rows = []
    for L in lengths:
        for name, (mask_mod, score_mod) in AUTO_CASES.items():
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))
            skipped = 0.0
            if mask_mod is not None:
                skipped = tiled.create_block_mask(mask_mod, None, None, L, L, block_q=backends.TILED_MODS_BLOCK_Q,
                                                  block_k=backends.TILED_MODS_BLOCK_K).fraction_skipped
            kw = {"mask_mod": mask_mod, "score_mod": score_mod}
            cases = {backend: (lambda backend=backend: scaled_dot_product_attention(q, k, v, backend=backend, **kw))
                     for backend in ("tiled", "math", "sdpa") if backend != "sdpa" or score_mod is None}
            with torch.no_grad():
                r = _time(cases, reps)
            med = {n: x["median_s"] for n, x in r.items()}
            chosen = backends.select_backend(q, k, v, backend="auto", **kw)
            fastest = min(med, key=med.get)
            rows.append({"L": L, "case": name, "fraction_skipped": skipped, "forward": r,
                         "auto_picks": chosen, "fastest": fastest})
            _say(f"  L={L:>5} {name:<16} skipped {skipped:5.1%}  "
                 + "  ".join(f"{n} {1e3 * m:7.1f} ms" for n, m in med.items())
                 + f"  auto -> {chosen}, fastest {fastest}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per case (median reported)")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="lengths of the auto-rule table")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/block-sparse"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    record = {"provenance": provenance(torch.device("cpu"), sys.argv[1:]), "load_before": _load()}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/block_sparse_bench.py", *sys.argv[1:]])
    record["headline"] = h = headline(args.reps)
    r = h["ratios"]
    f = {n: 1e3 * x["median_s"] for n, x in h["forward"].items()}
    fb = {n: 1e3 * x["median_s"] for n, x in h["forward_backward"].items()}
    _say("\nforward (median ms): " + ", ".join(f"{n} {m:.1f}" for n, m in f.items()))
    _say(f"tiled vs compiled flex: {r['tiled_speed_vs_flex_compiled']:.2f}x the speed (target >= 0.5x)")
    _say(f"tiled vs SDPA with the dense mask: {r['tiled_speedup_vs_sdpa_dense_mask']:.1f}x faster (target >= 5x)")
    _say("forward + backward (median ms): " + ", ".join(f"{n} {m:.1f}" for n, m in fb.items()))
    _say(f"tiled vs math, forward + backward: {r['fwd_bwd_tiled_speedup_vs_math']:.1f}x faster")
    bms = h["block_masks"]
    _say(f"blocks skipped: tiled {bms['tiled']['fraction_skipped']:.1%}, flex {bms['flex']['fraction_skipped']:.1%}")
    _say("\nauto rule (forward, median):")
    record["auto_rule"] = auto_rule(args.reps, [int(x) for x in args.lengths.split(",")])
    record["load_after"] = _load()
    _say("")
    _write_dated(Path(args.out), "block-sparse", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
