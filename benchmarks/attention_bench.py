"""Benchmark the attention backends: time, TFLOP/s, peak memory, and the ratio to torch's SDPA.

A benchmark, not a test: it measures and writes a JSON file with its provenance
(device, versions, date, command, git commit, machine load). The docs plot the
committed files in ``benchmarks/results/``.

Presets:

``--preset gpu``
    The FlashAttention grid on a CUDA device: head size D in {64, 128}, hidden
    2048 (H = 2048 / D), L = S in {512 ... 16384}, batch * L = 16384 tokens,
    causal and not, forward and forward + backward, bfloat16, every backend
    that runs there (torch SDPA with its default choice and each of its
    kernels, this package's ``triton``, ``sdpa``, ``tiled`` and ``math``).
``--preset cpu``
    The CPU targets (float32, H = 8, D = 64, batch 1): the tiled path and torch's
    CPU SDPA side by side at L = 4096 (throughput ratio), a sweep over L for the
    ``auto`` threshold, and at L = 32768 the tiled path's extra peak memory next
    to what the math path needs (computed from the formula: it cannot be
    allocated on a machine with less memory than that).
``--preset tune-cpu``
    A block-size sweep of the tiled path at L = 4096 against torch's CPU SDPA.

Measurements:

- time: the median of ``--repeats`` calls after ``--warmup`` calls. Backends
  take turns call by call (round-robin), so a change in machine load hits all
  of them alike. CUDA: ``torch.cuda.Event`` pairs; CPU: ``time.perf_counter``.
- TFLOP/s: forward ``4 B H L S D`` FLOPs, halved for causal; backward 2.5 x the
  forward (so forward + backward is 3.5 x).
- peak memory: the extra bytes live at once during one call (output, saved
  tensors and gradients included, inputs excluded). CUDA:
  ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
  CPU: torch's (Kineto) profiler with ``profile_memory=True`` records every CPU tensor
  allocation with the allocator's running total; the peak of that total minus
  its value before the call. That counts torch tensors (what attention
  allocates), not Python objects or the allocator's own caching.
- ratio: this backend's TFLOP/s over torch SDPA's (``torch-sdpa``, its default
  kernel choice) in the same run and configuration. Because the calls take turns,
  each round also gives a ratio of its own; their quartiles (``rounds q1-q3`` in
  the table, ``extra.ratio_per_round`` in the JSON) show how far the machine's
  load moved it during the run.
- ``matmul-floor`` (CPU preset): not attention, only the tiled forward pass's two
  matrix products per block; its ratio is the most the tiled path could reach
  with everything else free.

Run ``python benchmarks/attention_bench.py --help`` for every option.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the test extra
    tqdm = None

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import attention_ref  # noqa: E402
from attention_ref import tiled  # noqa: E402
from attention_ref.complexity import attention_memory_bytes  # noqa: E402

GIB = 2**30
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- backends under test -------------------------------------------------------------------------


def _torch_sdpa(kernel: str | None) -> Callable[..., torch.Tensor]:
    def run(q, k, v, causal, mask):
        if mask is not None and causal:
            raise ValueError("torch SDPA takes attn_mask or is_causal, not both")
        if kernel is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, kernel)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    return run


def _ours(backend: str, **tiled_blocks: int) -> Callable[..., torch.Tensor]:
    def run(q, k, v, causal, mask):
        if tiled_blocks:
            return tiled.tiled_attention(q, k, v, mask, is_causal=causal, **tiled_blocks)
        return attention_ref.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, backend=backend)

    return run


def _matmul_floor(q, k, v, causal, mask):
    """Only the two matrix products per block of the tiled forward pass, no softmax: a floor for its time.

    Not attention (the output is meaningless): it measures what the tiled path
    would cost if everything but its ``bmm``/``baddbmm`` calls were free.
    """
    bq, bk = tiled.DEFAULT_BLOCK_Q, tiled.DEFAULT_BLOCK_K
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))  # (..., n, D) -> (N, n, D)
    L, S = q3.shape[1], k3.shape[1]
    out = torch.empty(q3.shape[0], L, v3.shape[-1], dtype=q.dtype, device=q.device)
    for i0 in range(0, L, bq):
        acc = out[:, i0:i0 + bq].zero_()
        for j0 in range(0, min(S, i0 + bq) if causal else S, bk):
            s = torch.bmm(q3[:, i0:i0 + bq], k3[:, j0:j0 + bk].transpose(1, 2))
            acc.baddbmm_(s, v3[:, j0:j0 + bk])
    return out


IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "torch-sdpa": _torch_sdpa(None),  # the baseline of every ratio
    "torch-sdpa-flash": _torch_sdpa("FLASH_ATTENTION"),
    "torch-sdpa-efficient": _torch_sdpa("EFFICIENT_ATTENTION"),
    "torch-sdpa-cudnn": _torch_sdpa("CUDNN_ATTENTION"),
    "torch-sdpa-math": _torch_sdpa("MATH"),
    "triton": _ours("triton"),
    "sdpa": _ours("sdpa"),
    "tiled": _ours("tiled"),
    "math": _ours("math"),
    "matmul-floor": _matmul_floor,  # not attention: the tiled path's matrix products alone
}
GPU_ONLY = {"torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "triton"}


@dataclass
class Config:
    B: int
    H: int
    L: int
    S: int
    D: int
    causal: bool
    mode: str  # "fwd" or "fwd+bwd"
    dtype: str
    group: str = "grid"
    mask: str = "none"  # "none" or "dense": a boolean (L, S) mask shared by all heads

    def flops(self) -> float:
        forward = 4 * self.B * self.H * self.L * self.S * self.D / (2 if self.causal else 1)
        return forward * (3.5 if self.mode == "fwd+bwd" else 1.0)


@dataclass
class Result:
    config: Config
    impl: str
    status: str = "ok"  # ok | skipped: ... | error: ...
    times_s: list[float] = field(default_factory=list)
    time_s: float | None = None
    tflops: float | None = None
    peak_bytes: int | None = None
    ratio_to_torch_sdpa: float | None = None
    ratio_to_torch_sdpa_flash: float | None = None
    extra: dict = field(default_factory=dict)


# --- measuring -----------------------------------------------------------------------------------


def _inputs(cfg: Config, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = DTYPES[cfg.dtype]
    grad = cfg.mode == "fwd+bwd"
    shapes = ((cfg.B, cfg.H, cfg.L, cfg.D), (cfg.B, cfg.H, cfg.S, cfg.D), (cfg.B, cfg.H, cfg.S, cfg.D))
    q, k, v = (torch.randn(*s, generator=gen).to(device, dtype).requires_grad_(grad) for s in shapes)
    mask = None
    if cfg.mask == "dense":  # 90% of the pairs take part, a fresh pattern per row
        mask = (torch.rand(cfg.L, cfg.S, generator=gen) > 0.1).to(device)
    return q, k, v, mask


def _step(impl: Callable, q, k, v, mask, cfg: Config, d_out: list) -> None:
    """One forward (and backward) call; the output is dropped before returning."""
    out = impl(q, k, v, cfg.causal, mask)
    if cfg.mode == "fwd+bwd":
        if not d_out:
            d_out.append(torch.randn_like(out))
        out.backward(d_out[0])
        q.grad = k.grad = v.grad = None


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Extra peak of torch CPU tensor allocations during ``fn()`` (torch's profiler records)."""
    from torch._C._profiler import _EventType
    from torch.autograd.profiler import profile

    # The autograd profiler front end of the same Kineto profiler: it records the same
    # allocation events without the start-up cost of torch.profiler.profile.
    with profile(use_kineto=True, profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size, f.total_allocated))
    if not events:
        return 0
    events.sort(key=lambda e: e[0])
    # total_allocated is the allocator's running total after each event; before the first
    # event it was (total - size of that event).
    base = events[0][2] - events[0][1]
    return max(0, max(total for _, _, total in events) - base)


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(fn)


def _math_bytes(cfg: Config) -> int:
    """What the math path must hold at once: the (L, S) scores and weights, in float32 at least."""
    per = max(torch.finfo(DTYPES[cfg.dtype]).bits // 8, 4)
    weights = attention_memory_bytes(cfg.B, cfg.H, cfg.L, cfg.S, cfg.D, cfg.D, bytes_per_element=per)["weights"]
    return 2 * weights * (2 if cfg.mode == "fwd+bwd" else 1)


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # pragma: no cover - non-Linux
        return 8 * GIB


def _skip_reason(impl: str, cfg: Config, device: torch.device) -> str | None:
    if impl in GPU_ONLY and device.type != "cuda":
        return "skipped: CUDA only"
    if impl == "matmul-floor" and (cfg.mode != "fwd" or cfg.mask != "none"):
        return "skipped: forward without a mask only"
    if impl == "triton":
        from attention_ref.triton_flash import is_available

        if not is_available(device):
            return "skipped: triton kernel not available on this device"
    if impl in ("math", "torch-sdpa-math"):
        need = _math_bytes(cfg)
        if need > 0.6 * _available_bytes(device):
            return f"skipped: needs about {need / GIB:.1f} GiB (computed), more than this device has free"
    return None


#: Whether run_configs shows its progress bar unless told otherwise (``--no-progress`` clears it).
_SHOW_PROGRESS = True


def run_configs(
    configs: list[Config],
    impls: list[str],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    memory: bool,
    progress: bool | None = None,
) -> list[Result]:
    """Time every impl on every config (round-robin per config); optionally measure peak memory."""
    results: list[Result] = []
    total = sum(len(impls) * (repeats + warmup + int(memory)) for _ in configs)
    progress = _SHOW_PROGRESS if progress is None else progress
    bar = tqdm(total=total, desc="attention bench", unit="call", disable=not progress) if tqdm else None
    for cfg in configs:
        q, k, v, mask = _inputs(cfg, device)
        by_impl = {name: Result(cfg, name) for name in impls}
        live = []
        for name in impls:
            reason = _skip_reason(name, cfg, device)
            if reason:
                by_impl[name].status = reason
                if bar:
                    bar.update(repeats + warmup + int(memory))
            else:
                live.append(name)
        d_out: list = []

        def call(name: str) -> None:
            _step(IMPLS[name], q, k, v, mask, cfg, d_out)

        for phase, count in (("warmup", warmup), ("timed", repeats)):
            for _ in range(count):
                for name in list(live):
                    if bar:
                        bar.set_postfix_str(f"{name} L={cfg.L} D={cfg.D} {cfg.mode}{' causal' if cfg.causal else ''}")
                    try:
                        elapsed = _time_once(lambda n=name: call(n), device)
                    except torch.cuda.OutOfMemoryError:
                        by_impl[name].status = "skipped: out of memory"
                        live.remove(name)
                        torch.cuda.empty_cache()
                        continue
                    except Exception as exc:  # noqa: BLE001 - a backend that cannot run is recorded
                        by_impl[name].status = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                        live.remove(name)
                        continue
                    finally:
                        if bar:
                            bar.update(1)
                    if phase == "timed":
                        by_impl[name].times_s.append(elapsed)
        for name in impls:
            if memory and name in live:
                try:
                    by_impl[name].peak_bytes = int(_peak_bytes(lambda n=name: call(n), device))
                except Exception as exc:  # noqa: BLE001
                    by_impl[name].extra["memory_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if bar:
                    bar.update(1)
            elif memory and bar and by_impl[name].status == "ok":
                bar.update(1)
        for r in by_impl.values():
            if r.times_s:
                r.time_s = statistics.median(r.times_s)
                r.tflops = cfg.flops() / r.time_s / 1e12
        for r in by_impl.values():
            for base, attr in (("torch-sdpa", "ratio_to_torch_sdpa"), ("torch-sdpa-flash", "ratio_to_torch_sdpa_flash")):
                ref = by_impl.get(base)
                if r.tflops and ref is not None and ref.tflops:
                    setattr(r, attr, r.tflops / ref.tflops)
            base = by_impl.get("torch-sdpa")
            if base is not None and len(r.times_s) >= 4 and len(base.times_s) == len(r.times_s):
                # Round-robin pairs: torch's time over this one's in the same round, so the spread
                # shows how much the machine's load moved the ratio during the run.
                per_round = [b / t for b, t in zip(base.times_s, r.times_s)]
                q1, med, q3 = statistics.quantiles(per_round, n=4)
                r.extra["ratio_per_round"] = {"q1": q1, "median": med, "q3": q3, "min": min(per_round),
                                              "max": max(per_round)}
        results.extend(by_impl.values())
        del q, k, v, mask, d_out
    if bar:
        bar.close()
    return results


# --- presets -------------------------------------------------------------------------------------


def gpu_configs(args: argparse.Namespace) -> list[Config]:
    configs = []
    for D in args.head_dims or (64, 128):
        H = 2048 // D
        for L in args.lengths or (512, 1024, 2048, 4096, 8192, 16384):
            B = max(1, args.tokens // L)
            for causal in (False, True):
                for mode in args.modes:
                    configs.append(Config(B, H, L, L, D, causal, mode, args.dtype or "bfloat16"))
    return configs


def run_cpu_preset(args: argparse.Namespace, device: torch.device) -> dict:
    """The CPU targets: throughput at L=4096, a sweep for the auto threshold, memory at L=32768."""
    dtype, H, D = "float32", 8, 64
    out: dict = {}
    # 1. Throughput side by side at L = 4096.
    throughput = [Config(1, H, 4096, 4096, D, causal, mode, dtype, "throughput")
                  for mode in args.modes for causal in (False, True)]
    out["throughput"] = run_configs(throughput, ["torch-sdpa", "tiled", "sdpa", "matmul-floor"], device,
                                    repeats=args.repeats, warmup=args.warmup, memory=True)
    # 2. Sweep over L (forward), without a mask and with a dense boolean (L, S) mask: time and
    #    extra memory of tiled vs torch SDPA vs math; the basis of the auto rule's threshold.
    sweep = [Config(1, H, L, L, D, False, "fwd", dtype, "sweep", mask)
             for mask in ("none", "dense") for L in args.sweep_lengths]
    out["sweep"] = run_configs(sweep, ["torch-sdpa", "tiled", "math"], device,
                               repeats=max(1, args.repeats // 2), warmup=1, memory=True)
    # 3. Memory at L = 32768: one forward call of the tiled path (and torch SDPA) under the
    #    profiler; the math path's requirement comes from the formula.
    big = Config(1, H, args.long_length, args.long_length, D, False, "fwd", dtype, "memory")
    out["memory"] = run_configs([big], ["tiled", "torch-sdpa", "math"], device, repeats=1, warmup=0, memory=True)
    need = attention_memory_bytes(1, H, big.L, big.S, D, D)["weights"]
    out["math_requirement"] = {
        "L": big.L, "H": H, "bytes": need, "GiB": need / GIB, "how": "computed: B*H*L*S*4 bytes for the float32 "
        "(L, S) weights alone (attention_ref.complexity.attention_memory_bytes); the math path also holds the "
        "scores, so its real peak is about twice that. Not allocated: more than this machine's memory.",
    }
    return out


def run_tune_cpu(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Block-size sweep of the tiled path at L = 4096 (forward, not causal), next to torch SDPA."""
    names = ["torch-sdpa"]
    for bq in args.tune_block_q:
        for bk in args.tune_block_k:
            name = f"tiled-{bq}x{bk}"
            IMPLS[name] = _ours("tiled", block_q=bq, block_k=bk)
            names.append(name)
    cfgs = [Config(1, 8, args.tune_length, args.tune_length, 64, causal, "fwd", "float32", "tune")
            for causal in (False, True)]
    return run_configs(cfgs, names, device, repeats=args.repeats, warmup=1, memory=False)


# --- provenance and output -----------------------------------------------------------------------


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def provenance(device: torch.device, argv: list[str]) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_name()} ({os.cpu_count()} logical cores)"
    return {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/attention_bench.py", *argv]),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "tiled_blocks": {"block_q": tiled.DEFAULT_BLOCK_Q, "block_k": tiled.DEFAULT_BLOCK_K},
    }


def _load() -> dict:
    one, five, fifteen = os.getloadavg()
    uptime = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    return {"loadavg_1_5_15": [one, five, fifteen], "uptime": uptime}


def _jsonable(obj):
    if isinstance(obj, Result):
        d = asdict(obj)
        d["config"]["flops"] = obj.config.flops()
        return d
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj


def _table(results: list[Result]) -> str:
    lines = [f"{'group':<10} {'impl':<22} {'L':>6} {'D':>4} {'causal':>6} {'mask':>5} {'mode':>8} {'ms':>10} "
             f"{'TFLOP/s':>8} {'peak MiB':>9} {'vs torch':>8} {'rounds q1-q3':>12}  status"]
    for r in results:
        c = r.config
        fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
        rounds = r.extra.get("ratio_per_round")
        spread = f"{rounds['q1']:.2f}-{rounds['q3']:.2f}" if rounds else "-"
        lines.append(
            f"{c.group:<10} {r.impl:<22} {c.L:>6} {c.D:>4} {str(c.causal):>6} {c.mask:>5} {c.mode:>8} "
            f"{fmt(r.time_s and r.time_s * 1e3, '%.1f'):>10} {fmt(r.tflops, '%.3f'):>8} "
            f"{fmt(r.peak_bytes and r.peak_bytes / 2**20, '%.1f'):>9} {fmt(r.ratio_to_torch_sdpa, '%.2f'):>8} "
            f"{spread:>12}  {r.status}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["gpu", "cpu", "tune-cpu", "custom"], default="custom")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--impls", nargs="+", choices=sorted(IMPLS), help="custom: backends to run")
    parser.add_argument("--lengths", nargs="+", type=int, help="L = S values (gpu/custom)")
    parser.add_argument("--head-dims", nargs="+", type=int, help="D values (gpu/custom)")
    parser.add_argument("--heads", type=int, default=None, help="custom: H (default 2048 / D)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * L (gpu/custom)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="custom only")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per backend (median)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--sweep-lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--long-length", type=int, default=32768, help="cpu: L for the memory target")
    parser.add_argument("--tune-length", type=int, default=4096)
    parser.add_argument("--tune-block-q", nargs="+", type=int, default=[64, 128, 256, 512])
    parser.add_argument("--tune-block-k", nargs="+", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    parser.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    global _SHOW_PROGRESS
    _SHOW_PROGRESS = not args.no_progress

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device.type == "cuda"
    args.repeats = args.repeats or (20 if gpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    record: dict = {"provenance": provenance(device, argv), "load_before": _load(), "preset": args.preset}
    t0 = time.perf_counter()
    if args.preset == "gpu":
        if not gpu:
            parser.error("--preset gpu needs a CUDA device")
        impls = ["torch-sdpa", "torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "triton", "sdpa",
                 "tiled", "math"]
        results = run_configs(gpu_configs(args), impls, device, repeats=args.repeats, warmup=args.warmup,
                              memory=not args.no_memory, progress=not args.no_progress)
        record["grid"] = results
        printable = results
    elif args.preset == "cpu":
        record["cpu"] = run_cpu_preset(args, device)
        printable = [r for key in ("throughput", "sweep", "memory") for r in record["cpu"][key]]
    elif args.preset == "tune-cpu":
        record["tune"] = run_tune_cpu(args, device)
        printable = record["tune"]
    else:
        impls = args.impls or ["torch-sdpa", "tiled", "sdpa"]
        configs = []
        for D in args.head_dims or (64,):
            H = args.heads or 2048 // D
            for L in args.lengths or (1024,):
                for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
                    for mode in args.modes:
                        configs.append(Config(max(1, args.tokens // L), H, L, L, D, causal, mode,
                                              args.dtype or ("bfloat16" if gpu else "float32"), "custom"))
        record["custom"] = results = run_configs(configs, impls, device, repeats=args.repeats, warmup=args.warmup,
                                                 memory=not args.no_memory, progress=not args.no_progress)
        printable = results
    record["load_after"] = _load()
    record["wall_s"] = time.perf_counter() - t0
    print(_table(printable))
    if args.preset == "cpu":
        req = record["cpu"]["math_requirement"]
        print(f"math path at L={req['L']}: {req['GiB']:.0f} GiB for the weights alone ({req['how'].split(':')[0]})")
    out = args.out
    if out is None:
        kind = "cpu" if not gpu else torch.cuda.get_device_name(device).lower().replace(" ", "-")
        stamp = dt.date.today().isoformat()
        out = REPO / "benchmarks" / "results" / f"{kind}-{args.preset}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(record), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
