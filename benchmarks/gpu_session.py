"""The steps of a GPU session (issue 12), one device call each: probe, tests, forward sweep.

A lent GPU comes rarely, for 30 minutes of device time at most, 10 minutes per command, on a
machine that keeps nothing between calls and sends back the last 12,000 characters of output
plus the files written under ``$OUT``. So each step below is one short command that writes its
full record under ``--out`` (default ``$OUT``, else ``/tmp/gpu-session``) and prints a short
summary LAST. The runbook (which calls, in which order, what each costs) is in
``notes/triton.md``; the benchmark grid itself is ``benchmarks/attention_bench.py --preset gpu``.

Steps (run from the repository root, the package as source: ``PYTHONPATH=.``):

``probe``
    What the machine is: Python, torch, triton, CUDA and driver versions, the GPU's name,
    multiprocessors and L2, and the two ceilings of ../shared METHOD.md measured once: a
    device-to-device copy (bytes read + written per second) and a bf16 8192^3 matrix
    product on random data (TFLOP/s). Then one small call of the Triton kernel against
    the float64 reference, so a kernel that does not compile shows up in the first minute.
``tests``
    The kernel's tests compiled on CUDA (``tests/test_triton_flash.py``: bfloat16, the large
    and odd shapes, windows, softcap) and the backend, tiled, log-sum-exp and checker tests
    with ``--device cuda``; a log and a JUnit XML file per command.
``sweep``
    The kernel's launch configurations at one shape (default bf16, D = 128, L = S = 8192,
    hidden 2048, causal and not). ``--pass fwd`` (default): the forward's block_n x stages x
    warps x ``--tma`` (K and V read through tensor descriptors, Hopper's TMA, or not) with
    block_m = 128. ``--pass bwd``: forward + backward, the backward's keys per
    dK/dV program (block_n1, also the dQ kernel's queries per program) x queries per step
    (block_m1) x warps x stages, the forward at the table's. Each configuration's output
    (and gradients, for bwd) is checked against a float32 (or, up to L = 1024, float64)
    reference and timed by the median of ``triton.testing.do_bench`` (CUDA), next to
    torch SDPA's flash and cuDNN kernels on the same inputs; the record goes to
    ``sweep-fwd.json`` or ``sweep-bwd.json``. Write the prediction in
    notes/triton.md before running it.

On a machine without CUDA, ``sweep --device cpu`` runs the same code under Triton's
interpreter at toy sizes (timed with ``time.perf_counter``; its figures mean nothing): that is
how the script is tested here (tests/test_gpu_session.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The interpreter must be chosen before triton is first imported (attention_ref.triton_flash).
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention_ref import scaled_dot_product_attention  # noqa: E402
from attention_bench import _commit, _version, write_json_atomic  # noqa: E402  (benchmarks/, beside this file)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: The test commands of the ``tests`` step: (name, pytest arguments).
TEST_COMMANDS = [
    ("triton-kernel", ["tests/test_triton_flash.py"]),
    ("backends-on-cuda", ["--device", "cuda", "tests/test_backends.py", "tests/test_tiled.py",
                          "tests/test_tiled_mods.py", "tests/test_lse.py"]),
    ("checker", ["tests/test_testing.py"]),  # FlashAttention's rule itself, on the device's torch
]


def _out_dir(args: argparse.Namespace) -> Path:
    out = Path(args.out or os.environ.get("OUT") or "/tmp/gpu-session")
    out.mkdir(parents=True, exist_ok=True)
    return out


def provenance(argv: list[str]) -> dict:
    """Versions, device and command: what a result file must carry."""
    cuda = torch.cuda.is_available()
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/gpu_session.py", *argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        **_commit(),
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} logical cores)",
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        record.update(
            multiprocessors=props.multi_processor_count,
            memory_GiB=round(props.total_memory / 2**30, 1),
            l2_MB=round(getattr(props, "L2_cache_size", 0) / 1e6, 1),
            capability=f"{props.major}.{props.minor}",
        )
    if shutil.which("nvidia-smi"):
        query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True)
        record["nvidia_smi"] = {"query": query, "answer": smi.stdout.strip() or smi.stderr.strip()}
    return record


def _timer(device: torch.device):
    """``time(fn) -> seconds``: the median of triton's do_bench on CUDA; on the CPU one perf_counter run
    (there the kernel runs in Triton's interpreter, Python step by step: the CPU run of a session's
    steps checks that they run and what they record, and its times measure nothing worth repeating)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3

    def cpu_time(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_time


def _rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf when x holds NaN."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# --- probe ------------------------------------------------------------------------------------


def probe(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    record: dict = {"provenance": provenance(args.argv)}
    time_of = _timer(device)
    if device.type == "cuda":
        n = 2**28  # 256 Mi bf16 = 512 MiB read and 512 MiB written per copy
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        seconds = time_of(lambda: dst.copy_(src))
        record["copy"] = {"bytes_moved": 2 * n * 2, "seconds": seconds, "TB_per_s": 2 * n * 2 / seconds / 1e12}
        del src, dst
        a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
        seconds = time_of(lambda: a @ b)
        record["matmul_bf16_8192"] = {"seconds": seconds, "TFLOP_per_s": 2 * 8192**3 / seconds / 1e12}
        del a, b
    # One small call of the kernel (compiled on CUDA, interpreted on CPU) against float64.
    from attention_ref.triton_flash import flash_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # L not a multiple of any block size: the edge tiles run. Triton's interpreter runs each program in
    # Python, about 9 s for the CUDA shape on one core: on the CPU the smoke is smaller
    shape = [2, 4, 300, 64] if device.type == "cuda" else [1, 2, 100, 32]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    start = time.perf_counter()
    out = flash_attention(q, k, v, is_causal=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    ref = scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    record["kernel_smoke"] = {"shape": shape, "dtype": str(dtype), "first_call_s": first_call,
                              "rel_error_vs_float64": _rel_error(out, ref)}
    _write(args, "probe.json", record)
    prov = record["provenance"]
    lines = [(f"device: {prov['device']}; torch {prov['torch']} (CUDA {prov['torch_cuda']}), "
              f"triton {prov['triton']}, python {prov['python']}")]
    if "copy" in record:
        lines.append(f"copy: {record['copy']['TB_per_s']:.2f} TB/s (read + write); "
                     f"bf16 matmul 8192^3: {record['matmul_bf16_8192']['TFLOP_per_s']:.0f} TFLOP/s")
    smoke = record["kernel_smoke"]
    lines.append(f"kernel smoke ({smoke['dtype']}, causal, L={smoke['shape'][2]}, D={smoke['shape'][3]}): rel error "
                 f"{smoke['rel_error_vs_float64']:.2e}, first call {smoke['first_call_s']:.1f} s")
    print("\n".join(lines))
    return record


# --- tests ------------------------------------------------------------------------------------


def run_tests(args: argparse.Namespace) -> dict:
    out = _out_dir(args)
    record: dict = {"provenance": provenance(args.argv), "commands": []}
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, pytest_args in TEST_COMMANDS:
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
               f"--junitxml={out / f'tests-{name}.xml'}", *pytest_args, *args.pytest_args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        (out / f"tests-{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        record["commands"].append({"name": name, "command": " ".join(cmd[1:]), "returncode": proc.returncode,
                                   "seconds": seconds, "summary": summary, "failed": failed})
        _write(args, "tests.json", record)
        print(f"[{name}] rc={proc.returncode} {seconds:.0f}s: {summary}", flush=True)
        for line in failed[:15]:
            print("   ", line[:200])
    return record


# --- sweep ------------------------------------------------------------------------------------


def sweep_configs(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The configurations to try, as ``_Config`` fields; the pass not swept keeps the table's."""
    from attention_ref.triton_flash import _gpu_config, _head_dim_block

    base = _gpu_config(_head_dim_block(args.head_dim), DTYPES[args.dtype])
    configs = []
    if args.pass_ == "fwd":
        for block_n, stages, warps, tma in itertools.product(args.block_n, args.stages, args.warps, args.tma):
            configs.append((args.block_m, block_n, warps, stages, base.block_m1, base.block_n1, base.block_m2,
                            base.block_n2, base.bwd_num_warps, base.bwd_num_stages, bool(tma)))
    else:  # the dQ kernel mirrors dK/dV: block_m2 = block_n1 queries per program, block_n2 = block_m1 keys per step
        for block_n1, block_m1, warps, stages, tma in itertools.product(args.block_n1, args.block_m1, args.warps,
                                                                        args.stages, args.tma):
            configs.append((base.block_m, base.block_n, base.num_warps, base.num_stages, block_m1, block_n1,
                            block_n1, block_m1, warps, stages, bool(tma)))
    return configs


def sweep(args: argparse.Namespace) -> dict:
    from attention_ref.triton_flash import _apply, _Config, _gpu_config, _head_dim_block

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    D, L = args.head_dim, args.length
    H = args.heads or max(1, 2048 // D)
    B = max(1, args.tokens // L)
    time_of = _timer(device)
    record: dict = {"provenance": provenance(args.argv), "shape": dict(B=B, H=H, L=L, S=L, D=D, dtype=args.dtype),
                    "default_config": list(vars(_gpu_config(_head_dim_block(D), dtype)).values()), "rows": []}
    bwd = args.pass_ == "bwd"
    record["pass"] = args.pass_
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(device, dtype).requires_grad_(bwd) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, generator=gen).to(device, dtype)

    def step(attention):
        """One forward (and, for bwd, backward) call: the output and the gradients."""
        out = attention(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out) if bwd else ()
        return out, grads

    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        flops = 4 * B * H * L * L * D / (2 if causal else 1) * (3.5 if bwd else 1.0)
        # The anchor: float64 at toy sizes, torch's own kernel on float32 copies beyond.
        wide = torch.float64 if L <= 1024 else torch.float32
        leaves = [t.detach().to(wide).requires_grad_(bwd) for t in (q, k, v)]
        ref_out = (scaled_dot_product_attention if wide == torch.float64 else F.scaled_dot_product_attention)(
            *leaves, is_causal=causal)
        ref = (ref_out, torch.autograd.grad(ref_out, leaves, grad_out.to(wide)) if bwd else ())
        anchors = {}
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for name, kernel in (("torch-sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                 ("torch-sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                def torch_kernel(q, k, v, kernel=kernel, causal=causal):
                    with sdpa_kernel(kernel):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                try:
                    seconds = time_of(lambda f=torch_kernel: step(f))
                    anchors[name] = {"ms": seconds * 1e3, "TFLOP_per_s": flops / seconds / 1e12}
                except RuntimeError as exc:  # a kernel torch cannot run here is recorded, not fatal
                    anchors[name] = {"error": str(exc)[:300]}
        for fields in sweep_configs(args):
            row = {"causal": causal, "config": list(fields)}
            try:
                config = _Config(*fields)

                def ours(q, k, v, config=config, causal=causal):
                    return _apply(q, k, v, causal, None, None, config)

                out, grads = step(ours)
                row["rel_error"] = max(_rel_error(x, r) for x, r in zip((out, *grads), (ref[0], *ref[1])))
                seconds = time_of(lambda: step(ours))
                row.update(ms=seconds * 1e3, TFLOP_per_s=flops / seconds / 1e12)
                flash = anchors.get("torch-sdpa-flash", {}).get("ms")
                if flash:
                    row["speed_vs_flash"] = flash / row["ms"]
            except Exception as exc:  # noqa: BLE001 - a config that fails (e.g. out of resources) is recorded
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            record["rows"].append(row)
            _write(args, f"sweep-{args.pass_}.json", record)
            print(_sweep_line(row), flush=True)
        record.setdefault("anchors", {})["causal" if causal else "full"] = anchors
        _write(args, f"sweep-{args.pass_}.json", record)
    print(f"shape B={B} H={H} L=S={L} D={D} {args.dtype}; anchors: {json.dumps(record['anchors'])}")
    best = [r for r in record["rows"] if "ms" in r]
    for causal in sorted({r["causal"] for r in best}):
        row = min((r for r in best if r["causal"] == causal), key=lambda r: r["ms"])
        print("best " + ("causal: " if causal else "full:   ") + _sweep_line(row))
    return record


def _sweep_line(row: dict) -> str:
    cfg = row["config"]
    head = (f"{'causal' if row['causal'] else 'full':<6} fwd {cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}"
            f"{' tma' if cfg[10] else '    '} bwd {cfg[5]}x{cfg[4]} w{cfg[8]} s{cfg[9]}")
    if "error" in row:
        return f"{head}  {row['error'][:120]}"
    ratio = f"  {row['speed_vs_flash']:.2f}x flash" if "speed_vs_flash" in row else ""
    return f"{head}  {row['ms']:8.3f} ms {row['TFLOP_per_s']:7.1f} TFLOP/s  rel err {row['rel_error']:.1e}{ratio}"


# --- main -------------------------------------------------------------------------------------


def _write(args: argparse.Namespace, name: str, record: dict) -> None:
    """Write ``record`` as JSON under the output folder, atomically (a killed run leaves a whole file)."""
    write_json_atomic(_out_dir(args) / name, record)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default=None, help="folder for the records (default $OUT, else /tmp/gpu-session)")
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("probe", help="versions, ceilings, one kernel call")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    t = sub.add_parser("tests", help="the kernel's and the backends' tests on CUDA")
    t.add_argument("--only", nargs="+", choices=[name for name, _ in TEST_COMMANDS])
    t.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    s = sub.add_parser("sweep", help="forward launch configurations at one shape")
    s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    s.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--length", type=int, default=8192)
    s.add_argument("--heads", type=int, default=None, help="default 2048 / D")
    s.add_argument("--tokens", type=int, default=16384, help="batch * L")
    s.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    s.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"],
                   help="sweep the forward's configurations, or the backward's (timing forward + backward)")
    s.add_argument("--block-m", type=int, default=128, help="fwd: queries per program")
    s.add_argument("--block-n", type=int, nargs="+", default=[64, 128], help="fwd: keys per step")
    s.add_argument("--block-n1", type=int, nargs="+", default=[64, 128], help="bwd: keys per dK/dV program")
    s.add_argument("--block-m1", type=int, nargs="+", default=[16, 32], help="bwd: queries per dK/dV step")
    s.add_argument("--tma", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                   help="tiles of the inner loops through tensor descriptors (1), masked loads (0), or both "
                        "(it applies to the forward and backward kernels alike)")
    s.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="of the swept pass")
    s.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="of the swept pass")
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error(f"step {args.step!r} needs CUDA (torch.cuda.is_available() is False); "
                     "--device cpu runs it under Triton's interpreter at toy sizes")
    if args.step == "tests" and not torch.cuda.is_available():
        parser.error("step 'tests' needs CUDA (torch.cuda.is_available() is False)")
    {"probe": probe, "tests": run_tests, "sweep": sweep}[args.step](args)
    print(f"records in {_out_dir(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
