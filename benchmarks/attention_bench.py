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
    kernels, this package's ``triton``, ``sdpa``, ``tiled`` and ``math``, and
    ``flex``). ``--impls``, ``--head-dims``, ``--lengths``, ``--causal`` and
    ``--modes`` select a part of it, so that the grid can be split into calls
    that each end within a time limit. It refuses to run without CUDA (``--plan``
    works anywhere).
``--preset cpu``
    The CPU targets (float32, H = 8, D = 64, batch 1): the tiled path and torch's
    CPU SDPA side by side at L = 4096 (throughput ratio), a sweep over L for the
    ``auto`` threshold, and at L = 32768 the tiled path's extra peak memory next
    to what the math path needs (computed from the formula: it cannot be
    allocated on a machine with less memory than that).
``--preset tune-cpu``
    A block-size sweep of the tiled path at L = 4096 against torch's CPU SDPA.
``--preset custom`` (the default)
    The configurations and backends named by the options (``--impls``,
    ``--lengths``, ``--head-dims``, ``--heads``, ``--tokens``, ``--causal``,
    ``--modes``, ``--dtype``), on any device.

Backends (``--impls``): ``torch-sdpa`` (torch's SDPA with its own kernel choice, the
baseline of every ratio), ``torch-sdpa-flash``, ``-efficient``, ``-cudnn`` and
``-math`` (one kernel each, through ``sdpa_kernel``), this package's ``triton``,
``sdpa``, ``tiled`` and ``math`` backends, ``matmul-floor`` (see below) and ``flex``:
``torch.compile(flex_attention)`` (``torch.nn.attention.flex_attention``), compiled
once per process with ``dynamic=False`` (so it recompiles for every new shape, as
FlexAttention's own benchmarks do); causal attention goes through a
``create_block_mask`` block mask built once per (causal, L, S, device), before the
timing. In the gpu preset ``flex`` runs only for D = 128 and L >= 4096 (its compiles
are slow); its backward runs only on CUDA (torch has none on the CPU).

Measurements:

- time: the median of ``--repeats`` calls after ``--warmup`` calls. Backends
  take turns call by call (round-robin), so a change in machine load hits all
  of them alike. CUDA: ``torch.cuda.Event`` pairs; CPU: ``time.perf_counter``.
  The first call of each backend (a compile for ``flex``, a JIT for ``triton``)
  is also recorded alone, in wall-clock seconds, as ``extra.first_call_s``; it is
  a warmup call, so it stays out of the median (with ``--warmup 0`` it is the
  first timed call).
- TFLOP/s: forward ``4 B H L S D`` FLOPs, halved for causal; backward 2.5 x the
  forward (so forward + backward is 3.5 x).
- peak memory: the extra bytes live at once during one call (output, saved
  tensors and gradients included, inputs excluded). CUDA:
  ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
  CPU: torch's (Kineto) profiler with ``profile_memory=True`` records every CPU tensor
  allocation with the allocator's running total; the peak of that total minus
  its value before the call. That counts torch tensors (what attention
  allocates), not Python objects or the allocator's own caching.
- output check (forward configs): every backend's output against the first of
  torch-sdpa, its flash, cuDNN or efficient kernel, or math that ran, as
  ``extra["output_check"]``; a relative difference above ``OUTPUT_CHECK_REL`` prints
  "WRONG OUTPUT" in the progress line.
- ratio: this backend's TFLOP/s over torch SDPA's (``torch-sdpa``, its default
  kernel choice) in the same run and configuration. Because the calls take turns,
  each round also gives a ratio of its own; their quartiles (``rounds q1-q3`` in
  the table, ``extra.ratio_per_round`` in the JSON) show how far the machine's
  load moved it during the run.
- ``matmul-floor`` (CPU preset): not attention, only the tiled forward pass's two
  matrix products per block; its ratio is the most the tiled path could reach
  with everything else free.

Output, built for a run that may be killed at a time limit and whose printed
output may be cut to its last lines:

- the JSON file is rewritten after every configuration (a temporary file in the
  same folder, then ``os.replace``, so it is never half-written), with
  ``"complete": false`` until the last configuration is done; a killed run leaves
  every finished configuration in it. Ctrl-C or SIGTERM (what ``timeout`` sends
  first) stop the run at once, drop the configuration under way, save, print the
  summary of what finished and exit with status 130. ``--max-wall-s`` (gpu and
  custom presets) ends a run cleanly instead: it stops before a configuration that
  the ``--plan`` model, scaled by the run's own speed so far, says would end past
  that many seconds after the start of ``main``.
- one line per finished configuration
  (``[12/48] D=128 L=8192 causal fwd: triton 1.23 ms, flash 1.30 ms, ...``); the
  progress bar (tqdm) only on a terminal.
- the full table, then, printed last and stored under ``"targets"`` in the JSON,
  the summary against the targets of the GPU kernel (`target_summary`): for every
  (D, L, causal, mode) with a ``triton`` result, its speed over
  ``torch-sdpa-flash`` and over the fastest of torch's built-ins
  (``torch-sdpa-flash``, ``-efficient``, ``-cudnn`` and ``torch-sdpa``), and for the
  target rows (bfloat16, D = 128, L >= 4096) whether ``TARGETS`` are met: forward
  >= 1.0 x flash and >= 0.8 x the fastest, forward + backward >= 0.8 x flash. The
  ratios compare backends of the same run: keep ``triton`` and the built-ins in one
  call. ``--summarize FILE ...`` prints the summary of result files (the calls of a
  split grid together) and exits.

Planning a GPU session (no CUDA needed): ``--plan`` prints the configurations the
gpu (or custom) preset would run with the other options given, the backends each
one skips, and an estimate of the wall time, then exits without running anything
or writing a file. The estimate is rough (expect it off by up to 2x) and its model
is simple: for each backend and call, FLOPs over an assumed sustained TFLOP/s of an
H100-class GPU (``PLAN_TFLOPS``; the memory-bound math paths scaled by D / 128) plus
a fixed cost per call (``PLAN_CALL_S``; the tiled path pays ``PLAN_TILED_PAIR_S`` per
pair of blocks, its Python loop), times ``warmup + repeats`` (+1 for the memory
pass); plus a first-call cost per configuration (``PLAN_FIRST_CALL_S``: ``flex``
compiles for every new shape, ``triton``'s JIT), ``PLAN_CONFIG_S`` per
configuration (random inputs) and ``PLAN_STARTUP_S`` per process. A run stores the
estimate (``plan_estimate_s``) next to its ``wall_s``, to correct the next plan.
A split of the gpu grid, each call writing under ``$OUT``::

    python benchmarks/attention_bench.py --preset gpu --plan --head-dims 128 --lengths 4096 8192
    python benchmarks/attention_bench.py --preset gpu --head-dims 128 --lengths 4096 8192 \\
        --impls torch-sdpa torch-sdpa-flash torch-sdpa-efficient torch-sdpa-cudnn triton \\
        --max-wall-s 500 --out $OUT/h100-gpu-d128-a.json

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
import signal
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


#: The compiled ``flex_attention`` of this process (`_compiled_flex` makes it once).
_FLEX: list[Callable[..., torch.Tensor]] = []
#: Causal block masks for ``flex``, by (causal, L, S, device): built once, outside the timing.
_FLEX_BLOCK_MASKS: dict[tuple, object] = {}


def _compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention, dynamic=False)``, made on the first call of the process."""
    if not _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled function recompiles for every new shape and for forward + backward: the
        # gpu grid asks for more than dynamo's default of 8 before it falls back to eager code.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx  # top-left aligned, as is_causal: query i sees key j <= i


def _flex_block_mask(causal: bool, L: int, S: int, device: torch.device):
    """The block mask of ``flex`` for this shape (None without causal), cached per (causal, L, S, device)."""
    if not causal:
        return None
    key = (causal, L, S, str(device))
    if key not in _FLEX_BLOCK_MASKS:
        from torch.nn.attention import flex_attention as flex_module

        # B = H = None: one mask broadcast over batch and heads; device= because its default is cuda.
        _FLEX_BLOCK_MASKS[key] = flex_module.create_block_mask(_causal_mask_mod, None, None, L, S, device=device)
    return _FLEX_BLOCK_MASKS[key]


def _flex(q, k, v, causal, mask):
    if mask is not None:
        raise ValueError("the flex benchmark takes is_causal only, not a dense mask")
    block_mask = _flex_block_mask(causal, q.shape[-2], k.shape[-2], q.device)
    return _compiled_flex()(q, k, v, block_mask=block_mask)


def _flex_prepare(cfg: Config, device: torch.device) -> None:
    _compiled_flex()
    _flex_block_mask(cfg.causal, cfg.L, cfg.S, device)


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
    "flex": _flex,  # torch.compile(flex_attention)
}
GPU_ONLY = {"torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "triton"}
#: Work done once per configuration before its timing starts, by impl.
PREPARE: dict[str, Callable[[Config, torch.device], None]] = {"flex": _flex_prepare}
#: What the gpu preset runs unless ``--impls`` says otherwise.
GPU_IMPLS = ["torch-sdpa", "torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "triton", "sdpa",
             "tiled", "math", "flex"]
#: Short names for the one-line progress report.
SHORT = {"torch-sdpa": "torch", "torch-sdpa-flash": "flash", "torch-sdpa-efficient": "efficient",
         "torch-sdpa-cudnn": "cudnn", "torch-sdpa-math": "torch-math"}


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


def _static_skip(impl: str, cfg: Config, device_type: str, free_bytes: float) -> str | None:
    """Why ``impl`` does not run ``cfg``, from the configuration and the device's kind and free memory alone."""
    if impl in GPU_ONLY and device_type != "cuda":
        return "skipped: CUDA only"
    if impl == "matmul-floor" and (cfg.mode != "fwd" or cfg.mask != "none"):
        return "skipped: forward without a mask only"
    if impl == "flex":
        if cfg.mask != "none":
            return "skipped: flex runs without a dense mask only"
        if cfg.group == "grid" and not (cfg.D == 128 and cfg.L >= 4096):
            return "skipped: flex only for D=128, L>=4096 in the gpu preset"
        if cfg.mode == "fwd+bwd" and device_type != "cuda":
            return "skipped: flex backward needs CUDA"
    if impl in ("math", "torch-sdpa-math"):
        need = _math_bytes(cfg)
        if need > 0.6 * free_bytes:
            return f"skipped: needs about {need / GIB:.1f} GiB (computed), more than this device has free"
    return None


def _skip_reason(impl: str, cfg: Config, device: torch.device) -> str | None:
    free = _available_bytes(device) if impl in ("math", "torch-sdpa-math") else math.inf
    reason = _static_skip(impl, cfg, device.type, free)
    if reason is None and impl == "triton":
        from attention_ref.triton_flash import is_available

        if not is_available(device):
            return "skipped: triton kernel not available on this device"
    return reason


#: Whether run_configs shows its progress bar unless told otherwise (``--no-progress`` clears it).
_SHOW_PROGRESS = True


def _describe(cfg: Config) -> str:
    group = "" if cfg.group in ("grid", "custom") else f"{cfg.group} "
    mask = "" if cfg.mask == "none" else f" {cfg.mask}-mask"
    return f"{group}D={cfg.D} L={cfg.L}{'' if cfg.S == cfg.L else f' S={cfg.S}'} " \
           f"{'causal' if cfg.causal else 'noncausal'}{mask} {cfg.mode}"


#: Relative difference ``||out - ref|| / ||ref||`` between a backend's forward output and the
#: anchor's above which the run flags it ("WRONG OUTPUT"); bf16 kernels differ by ~3e-3.
OUTPUT_CHECK_REL = 2e-2
#: The backends whose output anchors the check, in order of preference.
OUTPUT_ANCHORS = ("torch-sdpa", "torch-sdpa-flash", "torch-sdpa-cudnn", "torch-sdpa-efficient", "math")


def _check_outputs(by_impl: dict[str, Result], live: list[str], q, k, v, mask, cfg: Config) -> None:
    """Forward configs: each live backend's output against the first anchor that ran, in ``extra``.

    A fast kernel that computes something else would otherwise win the table: at the
    benchmark's sizes (larger than the tests') this is the check that it still computes
    attention. ``extra["output_check"] = {"against": name, "rel_error": ||out - ref|| / ||ref||}``.
    """
    if cfg.mode != "fwd":
        return
    anchor = next((name for name in OUTPUT_ANCHORS if name in live), None)
    if anchor is None:
        return
    with torch.no_grad():
        ref = IMPLS[anchor](q, k, v, cfg.causal, mask).float()
        for name in live:
            if name == "matmul-floor":  # not attention by design
                continue
            try:
                out = IMPLS[name](q, k, v, cfg.causal, mask).float()
            except Exception as exc:  # noqa: BLE001 - timed fine, fails now: record it
                by_impl[name].extra["output_check"] = {"against": anchor, "error": str(exc)[:200]}
                continue
            rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item() if torch.isfinite(out).all() else math.inf
            by_impl[name].extra["output_check"] = {"against": anchor, "rel_error": rel}
            del out


def _config_line(index: int, total: int, cfg: Config, rows: list[Result]) -> str:
    """``[12/48] D=128 L=8192 causal fwd: triton 1.23 ms, flash 1.30 ms, ...`` (skipped backends left out)."""
    parts = []
    for r in rows:
        name = SHORT.get(r.impl, r.impl)
        if r.time_s is not None:
            wrong = r.extra.get("output_check", {}).get("rel_error", 0.0) > OUTPUT_CHECK_REL
            parts.append(f"{name} {r.time_s * 1e3:.3g} ms" + (" WRONG OUTPUT" if wrong else ""))
        elif r.status == "skipped: out of memory":
            parts.append(f"{name} OOM")
        elif r.status.startswith("error"):
            parts.append(f"{name} ERROR")
    return f"[{index}/{total}] {_describe(cfg)}: {', '.join(parts) or 'nothing ran'}"


def run_configs(
    configs: list[Config],
    impls: list[str],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    memory: bool,
    progress: bool | None = None,
    results: list[Result] | None = None,
    on_config: Callable[[], None] | None = None,
    deadline: float | None = None,
) -> list[Result]:
    """Time every impl on every config (round-robin per config); optionally measure peak memory.

    The rows of each finished configuration are appended to ``results`` (a new list if None,
    returned), one line is printed, then ``on_config()`` is called (it saves the JSON file).
    With a ``deadline`` (a ``time.perf_counter()`` value) it stops before a configuration that
    would end after it by the `plan_config_s` estimate, scaled by the run's speed so far.
    """
    results = [] if results is None else results
    total = sum(len(impls) * (repeats + warmup + int(memory)) for _ in configs)
    progress = _SHOW_PROGRESS if progress is None else progress
    bar = None
    if tqdm and progress and sys.stderr.isatty():  # a bar in a log file is thousands of lines of noise
        bar = tqdm(total=total, desc="attention bench", unit="call")
    spent_s = planned_s = 0.0
    for index, cfg in enumerate(configs, 1):
        planned = 0.0
        if deadline is not None:
            planned = plan_config_s(cfg, impls, device.type, _available_bytes(device), repeats=repeats,
                                    warmup=warmup, memory=memory)
            scale = spent_s / planned_s if planned_s else 1.0  # the model, corrected by this run's speed so far
            if time.perf_counter() + planned * scale > deadline:
                print(f"stopped before [{index}/{len(configs)}] {_describe(cfg)}: it would end past --max-wall-s "
                      f"(about {planned * scale:.0f} s)", flush=True)
                break
        started = time.perf_counter()
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
        for name in list(live):
            if name in PREPARE:  # built before the timing starts (flex's block mask)
                try:
                    PREPARE[name](cfg, device)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run is recorded
                    by_impl[name].status = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                    live.remove(name)
        d_out: list = []

        def call(name: str) -> None:
            _step(IMPLS[name], q, k, v, mask, cfg, d_out)

        for phase, count in (("warmup", warmup), ("timed", repeats)):
            for _ in range(count):
                for name in list(live):
                    if bar:
                        bar.set_postfix_str(f"{name} L={cfg.L} D={cfg.D} {cfg.mode}{' causal' if cfg.causal else ''}")
                    try:
                        wall0 = time.perf_counter()
                        elapsed = _time_once(lambda n=name: call(n), device)
                        if "first_call_s" not in by_impl[name].extra:  # compile / JIT included
                            by_impl[name].extra["first_call_s"] = time.perf_counter() - wall0
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
        _check_outputs(by_impl, live, q, k, v, mask, cfg)
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
        del q, k, v, mask, d_out
        results.extend(by_impl.values())
        spent_s += time.perf_counter() - started
        planned_s += planned
        line = _config_line(index, len(configs), cfg, list(by_impl.values()))
        if bar:
            bar.write(line)
        else:
            print(line, flush=True)  # flushed: a killed run's output must show where it was
        if on_config:
            on_config()
    if bar:
        bar.close()
    return results


# --- presets -------------------------------------------------------------------------------------


_CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}


def gpu_configs(args: argparse.Namespace) -> list[Config]:
    """The gpu preset's grid, cut down by ``--head-dims``, ``--lengths``, ``--causal`` and ``--modes``."""
    configs = []
    for D in args.head_dims or (64, 128):
        H = 2048 // D
        for L in args.lengths or (512, 1024, 2048, 4096, 8192, 16384):
            B = max(1, args.tokens // L)
            for causal in _CAUSAL[getattr(args, "causal", "both")]:
                for mode in args.modes:
                    configs.append(Config(B, H, L, L, D, causal, mode, args.dtype or "bfloat16"))
    return configs


def custom_configs(args: argparse.Namespace, gpu: bool) -> list[Config]:
    """The custom preset's configurations: every combination of the options given."""
    configs = []
    for D in args.head_dims or (64,):
        H = args.heads or 2048 // D
        for L in args.lengths or (1024,):
            for causal in _CAUSAL[args.causal]:
                for mode in args.modes:
                    configs.append(Config(max(1, args.tokens // L), H, L, L, D, causal, mode,
                                          args.dtype or ("bfloat16" if gpu else "float32"), "custom"))
    return configs


def run_cpu_preset(args: argparse.Namespace, device: torch.device, out: dict | None = None,
                   save: Callable[[], None] | None = None) -> dict:
    """The CPU targets: throughput at L=4096, a sweep for the auto threshold, memory at L=32768.

    The rows go into ``out`` (a new dict if None, returned) as they finish; ``save()`` runs after each
    configuration.
    """
    dtype, H, D = "float32", 8, 64
    out = {} if out is None else out
    # 1. Throughput side by side at L = 4096.
    throughput = [Config(1, H, 4096, 4096, D, causal, mode, dtype, "throughput")
                  for mode in args.modes for causal in (False, True)]
    out["throughput"] = []
    run_configs(throughput, ["torch-sdpa", "tiled", "sdpa", "matmul-floor"], device,
                repeats=args.repeats, warmup=args.warmup, memory=True, results=out["throughput"], on_config=save)
    # 2. Sweep over L (forward), without a mask and with a dense boolean (L, S) mask: time and
    #    extra memory of tiled vs torch SDPA vs math; the basis of the auto rule's threshold.
    sweep = [Config(1, H, L, L, D, False, "fwd", dtype, "sweep", mask)
             for mask in ("none", "dense") for L in args.sweep_lengths]
    out["sweep"] = []
    run_configs(sweep, ["torch-sdpa", "tiled", "math"], device, repeats=max(1, args.repeats // 2), warmup=1,
                memory=True, results=out["sweep"], on_config=save)
    # 3. Memory at L = 32768: one forward call of the tiled path (and torch SDPA) under the
    #    profiler; the math path's requirement comes from the formula.
    big = Config(1, H, args.long_length, args.long_length, D, False, "fwd", dtype, "memory")
    out["memory"] = []
    run_configs([big], ["tiled", "torch-sdpa", "math"], device, repeats=1, warmup=0, memory=True,
                results=out["memory"], on_config=save)
    need = attention_memory_bytes(1, H, big.L, big.S, D, D)["weights"]
    out["math_requirement"] = {
        "L": big.L, "H": H, "bytes": need, "GiB": need / GIB, "how": "computed: B*H*L*S*4 bytes for the float32 "
        "(L, S) weights alone (attention_ref.complexity.attention_memory_bytes); the math path also holds the "
        "scores, so its real peak is about twice that. Not allocated: more than this machine's memory.",
    }
    return out


def run_tune_cpu(args: argparse.Namespace, device: torch.device, results: list[Result] | None = None,
                 save: Callable[[], None] | None = None) -> list[Result]:
    """Block-size sweep of the tiled path at L = 4096 (forward, not causal), next to torch SDPA."""
    names = ["torch-sdpa"]
    for bq in args.tune_block_q:
        for bk in args.tune_block_k:
            name = f"tiled-{bq}x{bk}"
            IMPLS[name] = _ours("tiled", block_q=bq, block_k=bk)
            names.append(name)
    cfgs = [Config(1, 8, args.tune_length, args.tune_length, 64, causal, "fwd", "float32", "tune")
            for causal in (False, True)]
    return run_configs(cfgs, names, device, repeats=args.repeats, warmup=1, memory=False, results=results,
                       on_config=save)


# --- planning: a rough model of the wall time ---------------------------------------------------

#: ``--plan``'s assumed sustained TFLOP/s per backend on an H100-class GPU in bfloat16, as
#: (forward, forward + backward): round guesses from public FlashAttention-2/3, cuDNN and
#: FlexAttention figures, not measurements of this code. The math paths are memory-bound on the
#: ``(L, S)`` scores: theirs are for D = 128 and scale with D (`PLAN_MEMORY_BOUND`).
PLAN_TFLOPS: dict[str, tuple[float, float]] = {
    "torch-sdpa": (400, 280), "torch-sdpa-flash": (350, 250), "torch-sdpa-cudnn": (450, 300),
    "torch-sdpa-efficient": (180, 120), "torch-sdpa-math": (25, 15), "math": (25, 15), "triton": (250, 150),
    "flex": (300, 200), "sdpa": (400, 280), "tiled": (100, 60), "matmul-floor": (150, 150),
}
PLAN_MEMORY_BOUND = {"math", "torch-sdpa-math"}
#: Fixed cost of one call: launches, Python, the synchronize after every timed call.
PLAN_CALL_S = 2e-4
#: The tiled path, per (query block, key block) pair it visits: its Python loop and a sync per block
#: (forward, forward + backward).
PLAN_TILED_PAIR_S = (1e-4, 3e-4)
#: One-time cost of a backend's first call in a configuration (forward, forward + backward): flex
#: compiles for every new shape; triton's JIT is charged per configuration too (an overestimate:
#: its kernels compile once per process for most shapes).
PLAN_FIRST_CALL_S: dict[str, tuple[float, float]] = {"flex": (20.0, 60.0), "triton": (1.0, 2.0),
                                                     "torch-sdpa-cudnn": (0.5, 1.0)}
#: Per configuration: the inputs drawn on the CPU and copied, the skip checks, the progress line.
PLAN_CONFIG_S = 2.0
#: Per process: import torch, the CUDA context, the first cuBLAS and cuDNN handles.
PLAN_STARTUP_S = 20.0
#: Free device memory assumed by ``--plan`` (an 80 GB H100) for the math paths' skip rule.
PLAN_FREE_BYTES = 79 * GIB


def plan_impl_s(impl: str, cfg: Config, *, repeats: int, warmup: int, memory: bool) -> float:
    """Estimated seconds for ``impl`` on ``cfg``: its calls (FLOPs / assumed rate + fixed cost) and first-call cost."""
    bwd = cfg.mode == "fwd+bwd"
    rate = PLAN_TFLOPS.get(impl, (50.0, 30.0))[bwd] * 1e12
    if impl in PLAN_MEMORY_BOUND:
        rate *= cfg.D / 128
    per_call = cfg.flops() / rate + PLAN_CALL_S
    if impl == "tiled":
        rows, cols = math.ceil(cfg.L / tiled.DEFAULT_BLOCK_Q), math.ceil(cfg.S / tiled.DEFAULT_BLOCK_K)
        pairs = (rows * cols + rows) / 2 if cfg.causal else rows * cols  # about half the pairs under causal
        per_call += pairs * PLAN_TILED_PAIR_S[bwd]
    return (warmup + repeats + int(memory)) * per_call + PLAN_FIRST_CALL_S.get(impl, (0.0, 0.0))[bwd]


def plan_config_s(cfg: Config, impls: list[str], device_type: str = "cuda", free_bytes: float = PLAN_FREE_BYTES,
                  *, repeats: int, warmup: int, memory: bool) -> float:
    """Estimated seconds for one configuration: `PLAN_CONFIG_S` plus `plan_impl_s` of each backend that runs."""
    return PLAN_CONFIG_S + sum(plan_impl_s(name, cfg, repeats=repeats, warmup=warmup, memory=memory)
                               for name in impls if _static_skip(name, cfg, device_type, free_bytes) is None)


def plan(configs: list[Config], impls: list[str], *, repeats: int, warmup: int, memory: bool,
         free_bytes: float = PLAN_FREE_BYTES) -> dict:
    """What a CUDA run of ``configs`` would do and how long it would take (the rough model above).

    Returns:
        ``{"rows": [{"config", "runs", "skips", "estimate_s"}], "by_impl_s": {impl: s},
        "startup_s", "total_s"}``; nothing runs and nothing needs CUDA.
    """
    rows, by_impl = [], dict.fromkeys(impls, 0.0)
    for cfg in configs:
        skips = {name: reason for name in impls if (reason := _static_skip(name, cfg, "cuda", free_bytes))}
        runs = [name for name in impls if name not in skips]
        for name in runs:
            by_impl[name] += plan_impl_s(name, cfg, repeats=repeats, warmup=warmup, memory=memory)
        estimate = plan_config_s(cfg, impls, "cuda", free_bytes, repeats=repeats, warmup=warmup, memory=memory)
        rows.append({"config": cfg, "runs": runs, "skips": skips, "estimate_s": estimate})
    total = PLAN_STARTUP_S + sum(r["estimate_s"] for r in rows)
    return {"rows": rows, "by_impl_s": by_impl, "startup_s": PLAN_STARTUP_S, "total_s": total}


def format_plan(p: dict, *, repeats: int, warmup: int, memory: bool) -> str:
    n = len(p["rows"])
    lines = [(f"plan: {n} configurations, {warmup} warmup + {repeats} timed{' + 1 memory' if memory else ''} "
              "calls per backend (ROUGH estimate: FLOPs / assumed H100 TFLOP/s + per-call and compile costs)")]
    cumulative = p["startup_s"]
    for i, row in enumerate(p["rows"], 1):
        cfg = row["config"]
        cumulative += row["estimate_s"]
        skipped = f"; skips {' '.join(SHORT.get(s, s) for s in row['skips'])}" if row["skips"] else ""
        runs = f"{len(row['runs'])} backend{'' if len(row['runs']) == 1 else 's'}"
        lines.append(f"[{i}/{n}] {_describe(cfg)} B={cfg.B} H={cfg.H}: {runs}{skipped}; "
                     f"~{row['estimate_s']:.0f} s, ~{cumulative:.0f} s so far")
    slowest_first = sorted(p["by_impl_s"].items(), key=lambda kv: -kv[1])
    by_impl = ", ".join(f"{SHORT.get(k, k)} {v:.0f} s" for k, v in slowest_first)
    lines.append(f"by backend: {by_impl}; start-up {p['startup_s']:.0f} s")
    lines.append(f"estimate: ~{p['total_s']:.0f} s (~{p['total_s'] / 60:.1f} min) in all, rough (up to 2x off)")
    return "\n".join(lines)


# --- the targets of the GPU kernel ---------------------------------------------------------------

#: The goals for ``triton`` (speed ratios: the other backend's time over triton's), by mode.
TARGETS: dict[str, dict[str, float]] = {"fwd": {"vs_flash": 1.0, "vs_fastest": 0.8}, "fwd+bwd": {"vs_flash": 0.8}}
TARGET_RULE = "bfloat16, D=128, L>=4096"
#: torch's built-in kernels; "fastest" is the fastest of these in a configuration.
BUILTINS = ("torch-sdpa-flash", "torch-sdpa-efficient", "torch-sdpa-cudnn", "torch-sdpa")


def is_target(cfg: Config) -> bool:
    """Whether the targets apply to ``cfg`` (`TARGET_RULE`)."""
    return cfg.dtype == "bfloat16" and cfg.D == 128 and cfg.L >= 4096


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def target_summary(results: list[Result]) -> dict:
    """``triton`` against torch's flash kernel and the fastest built-in, per configuration.

    A pure function of the rows: for every configuration with a ``triton`` row, the speed
    ratios ``time(flash) / time(triton)`` and ``time(fastest built-in) / time(triton)``
    (above 1: triton is faster), and on the target rows (`is_target`) whether each goal of
    `TARGETS` is met (None where a time is missing: not measured).

    Args:
        results: result rows of one run (or several: a later row of the same configuration
            and backend replaces an earlier one).

    Returns:
        ``{"rule", "targets", "builtins", "rows": [...], "target_rows", "met", "not_met",
        "not_measured"}``; each row holds D, L, S, B, H, causal, mode, dtype, the times in ms,
        ``fastest`` (its name), ``vs_flash``, ``vs_fastest``, ``target``, ``goals`` (goal name ->
        True / False / None) and ``verdict`` ("met", "not met", "not measured" or "-").
    """
    groups: dict[tuple, dict[str, Result]] = {}
    for r in results:
        c = r.config
        key = (c.group, c.dtype, c.mask, c.B, c.H, c.D, c.L, c.S, c.causal, c.mode)
        groups.setdefault(key, {})[r.impl] = r
    rows = []
    for by_impl in groups.values():
        if "triton" not in by_impl:
            continue
        tri = by_impl["triton"]
        c = tri.config
        flash = by_impl.get("torch-sdpa-flash")
        flash_s = flash.time_s if flash else None
        builtins = sorted((by_impl[n].time_s, n) for n in BUILTINS if n in by_impl and by_impl[n].time_s)
        fastest_s, fastest = builtins[0] if builtins else (None, None)
        ratios = {"vs_flash": flash_s / tri.time_s if flash_s and tri.time_s else None,
                  "vs_fastest": fastest_s / tri.time_s if fastest_s and tri.time_s else None}
        target = is_target(c)
        goals = {name: None if ratios[name] is None else ratios[name] >= goal
                 for name, goal in TARGETS.get(c.mode, {}).items()} if target else {}
        if not target:
            verdict = "-"
        elif any(v is False for v in goals.values()):
            verdict = "not met"
        elif any(v is None for v in goals.values()):
            verdict = "not measured"
        else:
            verdict = "met"
        rows.append({"D": c.D, "L": c.L, "S": c.S, "B": c.B, "H": c.H, "causal": c.causal, "mode": c.mode,
                     "dtype": c.dtype, "triton_ms": _ms(tri.time_s), "triton_status": tri.status,
                     "flash_ms": _ms(flash_s), "fastest": fastest, "fastest_ms": _ms(fastest_s), **ratios,
                     "target": target, "goals": goals, "verdict": verdict})
    rows.sort(key=lambda r: (r["D"], r["L"], r["causal"], r["mode"]))
    verdicts = [r["verdict"] for r in rows if r["target"]]
    return {"rule": TARGET_RULE, "targets": TARGETS, "builtins": list(BUILTINS), "rows": rows,
            "target_rows": len(verdicts), "met": verdicts.count("met"), "not_met": verdicts.count("not met"),
            "not_measured": verdicts.count("not measured")}


def format_targets(summary: dict) -> str:
    """The short table of `target_summary`, ending with the count of target rows met."""
    goals = "; ".join(f"{mode}: triton " + ", ".join(f">= {g:.1f}x {name[3:]}" for name, g in t.items())
                      for mode, t in summary["targets"].items())
    lines = [f"targets ({summary['rule']}): {goals} (x = their time / triton's)",
             (f"{'D':>4} {'L':>6} {'causal':<6} {'mode':<8} {'triton ms':>10} {'flash ms':>9} {'x flash':>7} "
              f"{'fastest':>18} {'x fastest':>9}  target")]
    for r in summary["rows"]:
        fastest = f"{SHORT.get(r['fastest'], r['fastest'])} {r['fastest_ms']:.3f}" if r["fastest"] else "-"
        verdict = r["verdict"]
        if verdict == "not met":
            verdict += " (" + ", ".join(name[3:] for name, ok in r["goals"].items() if ok is False) + ")"
        lines.append(f"{r['D']:>4} {r['L']:>6} {'yes' if r['causal'] else 'no':<6} {r['mode']:<8} "
                     f"{_fmt(r['triton_ms'], '.3f'):>10} {_fmt(r['flash_ms'], '.3f'):>9} "
                     f"{_fmt(r['vs_flash'], '.2f'):>7} {fastest:>18} {_fmt(r['vs_fastest'], '.2f'):>9}  {verdict}")
    if summary["target_rows"]:
        lines.append(f"targets: {summary['met']} of {summary['target_rows']} target rows met "
                     f"({summary['not_met']} not met, {summary['not_measured']} not measured)")
    else:
        lines.append("targets: no target rows in these results")
    return "\n".join(lines)


def _result_from_json(row: dict) -> Result:
    config = Config(**{k: v for k, v in row["config"].items() if k in Config.__dataclass_fields__})
    return Result(config, **{k: v for k, v in row.items() if k in Result.__dataclass_fields__ and k != "config"})


def load_results(path: Path) -> list[Result]:
    """The rows of the gpu or custom preset in a result file, as `Result` objects."""
    record = json.loads(Path(path).read_text())
    return [_result_from_json(row) for key in ("grid", "custom") for row in record.get(key, [])]


# --- provenance and output -----------------------------------------------------------------------


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _commit() -> dict:
    """The git commit measured: from git, or where the tree was copied without ``.git`` (the device
    machine gets a copy of the working tree, whose .git may be stale), from ``ATTENTION_REF_GIT_COMMIT`` set by
    the caller, which wins when set."""
    given = os.environ.get("ATTENTION_REF_GIT_COMMIT")
    commit = _git("rev-parse", "HEAD")
    if given:  # the caller's word wins: the device's copy may carry a stale .git (seen 2026-11-26)
        return {"git_commit": given, "git_dirty": None, "git_commit_from": "ATTENTION_REF_GIT_COMMIT",
                "git_head_in_copy": commit}
    if commit is not None:
        return {"git_commit": commit, "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
                "git_commit_from": "git"}
    return {"git_commit": None, "git_dirty": None, "git_commit_from": "unknown (no git, variable unset)"}


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
        **_commit(),
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


def write_json_atomic(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    A reader (or a run killed during the write) sees the old file or the new one, never half of one.
    """
    text = json.dumps(_jsonable(record), indent=1) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _default_out(device: torch.device, preset: str) -> Path:
    kind = "cpu" if device.type != "cuda" else torch.cuda.get_device_name(device).lower().replace(" ", "-")
    stem = f"{kind}-{preset}-{dt.date.today().isoformat()}"
    out, n = REPO / "benchmarks" / "results" / f"{stem}.json", 1
    while out.exists():  # a split grid runs several calls a day: never overwrite one by default
        n += 1
        out = out.with_name(f"{stem}-{n}.json")
    return out


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["gpu", "cpu", "tune-cpu", "custom"], default="custom")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--impls", nargs="+", choices=sorted(IMPLS),
                        help=f"gpu/custom: backends to run (gpu default: {' '.join(GPU_IMPLS)})")
    parser.add_argument("--lengths", nargs="+", type=int, help="L = S values (gpu/custom)")
    parser.add_argument("--head-dims", nargs="+", type=int, help="D values (gpu/custom)")
    parser.add_argument("--heads", type=int, default=None, help="custom: H (default 2048 / D)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * L (gpu/custom)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="gpu/custom")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per backend (median)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--sweep-lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--long-length", type=int, default=32768, help="cpu: L for the memory target")
    parser.add_argument("--tune-length", type=int, default=4096)
    parser.add_argument("--tune-block-q", nargs="+", type=int, default=[64, 128, 256, 512])
    parser.add_argument("--tune-block-k", nargs="+", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/<device>-<preset>-<date>[-n].json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    parser.add_argument("--plan", action="store_true",
                        help="gpu/custom: print the configurations and a rough wall-time estimate, run nothing")
    parser.add_argument("--max-wall-s", type=float, default=None,
                        help="gpu/custom: stop before a configuration estimated to end past this many seconds")
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="FILE",
                        help="print the targets summary of these result files and exit")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    global _SHOW_PROGRESS
    _SHOW_PROGRESS = not args.no_progress

    if args.summarize:
        print(format_targets(target_summary([r for path in args.summarize for r in load_results(path)])))
        return 0
    if args.plan:
        if args.preset not in ("gpu", "custom"):
            parser.error(f"--plan is for --preset gpu or custom, got --preset {args.preset}")
        repeats = args.repeats or 20
        warmup = args.warmup if args.warmup is not None else 5
        configs = gpu_configs(args) if args.preset == "gpu" else custom_configs(args, gpu=True)
        impls = args.impls or (GPU_IMPLS if args.preset == "gpu" else ["torch-sdpa", "tiled", "sdpa"])
        print(format_plan(plan(configs, impls, repeats=repeats, warmup=warmup, memory=not args.no_memory),
                          repeats=repeats, warmup=warmup, memory=not args.no_memory))
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if args.preset == "gpu" and not gpu:
        parser.error("--preset gpu needs a CUDA device (--plan works without one)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (20 if gpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    out = args.out if args.out is not None else _default_out(device, args.preset)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict = {"provenance": provenance(device, argv), "load_before": _load(), "preset": args.preset,
                    "complete": False}
    t0 = time.perf_counter()
    deadline = None if args.max_wall_s is None else t0 + args.max_wall_s
    summary_rows: list[Result] | None = None  # the rows the targets summary reads (gpu, custom)

    def save(complete: bool = False) -> None:
        record["load_after"] = _load()
        record["wall_s"] = time.perf_counter() - t0
        record["complete"] = complete
        if summary_rows is not None:
            record["targets"] = target_summary(summary_rows)
        write_json_atomic(out, record)

    interrupted = False
    printable: list[Result] = []
    configs: list[Config] = []
    impls: list[str] = []
    previous = None
    with contextlib.suppress(ValueError):  # the main thread only: SIGTERM then stops like Ctrl-C
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.preset in ("gpu", "custom"):
            configs = gpu_configs(args) if args.preset == "gpu" else custom_configs(args, gpu)
            impls = args.impls or (GPU_IMPLS if args.preset == "gpu" else ["torch-sdpa", "tiled", "sdpa"])
            key = "grid" if args.preset == "gpu" else "custom"
            record[key] = summary_rows = printable = []
            record["configs_total"] = len(configs)
            if gpu:  # the model assumes an H100-class GPU
                record["plan_estimate_s"] = plan(configs, impls, repeats=args.repeats, warmup=args.warmup,
                                                 memory=not args.no_memory)["total_s"]
            save()  # a run killed in its first configuration still leaves its provenance
            run_configs(configs, impls, device, repeats=args.repeats, warmup=args.warmup,
                        memory=not args.no_memory, progress=not args.no_progress, results=printable,
                        on_config=save, deadline=deadline)
        elif args.preset == "cpu":
            record["cpu"] = {}
            save()
            run_cpu_preset(args, device, record["cpu"], save)
        else:
            record["tune"] = []
            save()
            run_tune_cpu(args, device, record["tune"], save)
    except KeyboardInterrupt as exc:
        interrupted = True
        print(f"interrupted ({exc or 'Ctrl-C'}): the file keeps the finished configurations", flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if args.preset == "cpu":
        printable = [r for key in ("throughput", "sweep", "memory") for r in record["cpu"].get(key, [])]
    elif args.preset == "tune-cpu":
        printable = record["tune"]
    # A gpu/custom run stopped by --max-wall-s is not interrupted but not complete either.
    all_done = len(printable) == len(configs) * len(impls) if impls else True
    save(complete=not interrupted and all_done)
    print(_table(printable))
    if args.preset == "cpu" and "math_requirement" in record["cpu"]:
        req = record["cpu"]["math_requirement"]
        print(f"math path at L={req['L']}: {req['GiB']:.0f} GiB for the weights alone ({req['how'].split(':')[0]})")
    print(f"wrote {out} ({'complete' if record['complete'] else 'INCOMPLETE'}), wall {record['wall_s']:.0f} s"
          + (f", plan estimate {record['plan_estimate_s']:.0f} s" if "plan_estimate_s" in record else ""))
    if summary_rows is not None and any(r.impl == "triton" for r in summary_rows):
        print(format_targets(record["targets"]))  # last: the end of the output is what a cut log keeps
    return 130 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
