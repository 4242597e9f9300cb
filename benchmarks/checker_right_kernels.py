"""Does the checker ever fail a right kernel, and does it still catch a wrong one? Counted over many seeds.

`attention_ref.testing.assert_attention_close` must pass every right kernel on
every input, whatever order it sums in and whatever it rounds to the inputs'
dtype, and still fail a kernel further off than FlashAttention's rule allows.
This script draws random attention problems (float16 and bfloat16, with
gradients) and counts, for each kernel, the seeds on which the checker fails it:

* right: torch's CPU flash kernel (``sdpa_kernel(FLASH_ATTENTION)``); float16
  or bfloat16 scores with a float32 softmax and the weights cast back before
  ``P @ V`` (as x-transformers writes it); everything in float32, cast back;
* wrong: the float64 truth plus 3x the naive formula's error (the naive
  formula: every step in the inputs' dtype), which must fail on every seed.

Usage::

    .venv/bin/python benchmarks/checker_right_kernels.py [--seeds N] [--out FILE]

It writes benchmarks/results/checker/right-kernels-<date>.json unless ``--out``
says otherwise. The exit status is 1 when a right kernel failed or a wrong one
passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from attention_bench import provenance  # noqa: E402

from attention_ref.functional import scaled_dot_product_attention  # noqa: E402
from attention_ref.testing import assert_attention_close  # noqa: E402


def torch_flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def low_scores(q, k, v):  # scores in the inputs' dtype, softmax in float32, weights cast back before P @ V
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    return scores.float().softmax(-1).to(q.dtype) @ v


def float32(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)


RIGHT = {"torch flash (CPU)": torch_flash, "low-precision scores": low_scores, "float32, cast back": float32}


def problem(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(B, H, L, E) queries over (B, H, S, E) keys and values, and a grad_output."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g).to(dtype) for n in (13, 19, 19))
    grad_output = torch.randn(2, 4, 13, 16, generator=g).to(dtype)
    return q, k, v, grad_output


def fails(check) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


def run(seeds: int) -> dict:
    counts: dict = {}
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        failed = {kernel: [] for kernel in RIGHT} | {"3x the naive error": []}
        start = time.perf_counter()
        for seed in range(seeds):
            q, k, v, grad_output = problem(seed, dtype)
            for kernel, attention in RIGHT.items():
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = attention(*leaves)
                grads = torch.autograd.grad(out, leaves, grad_output)
                if fails(lambda: assert_attention_close(out.detach(), q, k, v, grad_output=grad_output,
                                                        actual_grads=grads)):
                    failed[kernel].append(seed)
            truth = scaled_dot_product_attention(q.double(), k.double(), v.double())
            naive = (((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v).double()
            wrong = truth + 3 * (naive - truth)
            if not fails(lambda: assert_attention_close(wrong, q, k, v)):
                failed["3x the naive error"].append(seed)
        counts[name] = {"seeds": seeds, "seconds": round(time.perf_counter() - start, 1),
                        "right kernels failed on seeds": {kernel: failed[kernel] for kernel in RIGHT},
                        "wrong kernel passed on seeds": failed["3x the naive error"]}
        print(f"{name}: {seeds} seeds", file=sys.stderr)
        for kernel in RIGHT:
            print(f"  {kernel:22} failed on {len(failed[kernel])}", file=sys.stderr)
        print(f"  {'3x the naive error':22} passed on {len(failed['3x the naive error'])} (must be 0)", file=sys.stderr)
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=250, help="seeds per dtype (default 250)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    record = {"provenance": provenance(torch.device("cpu"), argv), "results": run(args.seeds)}
    record["provenance"]["command"] = " ".join(["python", "benchmarks/checker_right_kernels.py", *argv])
    out = args.out or ROOT / "benchmarks" / "results" / "checker" / f"right-kernels-{dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    bad = any(seeds for r in record["results"].values()
              for seeds in (*r["right kernels failed on seeds"].values(), r["wrong kernel passed on seeds"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
