"""Compile attention_ref's Triton kernels for a GPU target WITHOUT a GPU and report resources.

Triton's wheel ships ptxas, so the kernels compile to cubin for sm_90 on any x86-64 machine.
For each kernel this prints the registers per thread, the bytes spilled to local memory, the
shared memory, and how many Hopper tensor-core instructions (wgmma) / older mma.sync the PTX
holds. Spills and a missing wgmma are the first things to fix before timing on a GPU.

    python notes/triton_compile_report.py                      # the table's D=128 bf16 entry
    python notes/triton_compile_report.py 64,float16,causal,kpm 128,bfloat16
    python notes/triton_compile_report.py 128,bfloat16,causal --config 128,64,8,3,32,64,64,32,8,2

A case is ``D,dtype[,causal][,kpm][,left][,right][,cap][,gqaG]`` (a sliding window
bounded on that side, soft-capping, G query heads per key/value head); ``--config`` overrides the launch table with the ten
fields of ``triton_flash._Config`` (block_m, block_n, num_warps, num_stages, block_m1,
block_n1, block_m2, block_n2, bwd_num_warps, bwd_num_stages), and an optional 11th, ``1`` to
load the inner loops' tiles through tensor descriptors (``tma``; the ``tma=`` column counts
the PTX's ``cp.async.bulk.tensor`` instructions). The first compile of a
variant takes 5-60 s on 2 CPU cores; Triton caches it afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attention_ref import triton_flash as tf  # noqa: E402

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def resources(kernel) -> str:
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = triton.knobs.nvidia.ptxas_blackwell.path  # the ptxas Triton itself uses for sm_90+
    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    log = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return (f"regs={','.join(regs) or '?'} spill_bytes={','.join(spills) or '?'} "
            f"smem={kernel.metadata.shared} wgmma={ptx.count('wgmma.mma_async')} "
            f"mma.sync={len(re.findall(r'mma[.]sync', ptx))} tma={ptx.count('cp.async.bulk.tensor')}")


def report(D: int, dtype: torch.dtype, causal: bool, kpm: bool, cfg: tf._Config | None,
           left: bool = False, right: bool = False, cap: bool = False, group: int = 1) -> None:
    kernels = tf._load_kernels(False)
    block_d = tf._head_dim_block(D)
    cfg = cfg or tf._gpu_config(block_d, dtype)
    target = GPUTarget("cuda", 90, 32)
    P = f"*{TYPES[dtype]}"
    common = dict(IS_CAUSAL=causal, WINDOW_LEFT=left, WINDOW_RIGHT=right, HAS_SOFTCAP=cap, HAS_KPM=kpm,
                  BLOCK_D=block_d, EVEN_D=block_d == D, DOT_PRECISION=tf._dot_precision(dtype),
                  GROUP=group)  # query heads per key/value head
    strides = {n: "i32" for n in ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn")}
    tail = dict(stride_mb="i32", stride_lb="i32", stride_lh="i32", L="i32", S="i32", D="i32")
    options = dict(qk_scale="fp32", tanh_scale="fp32", win_lo="i32", win_hi="i32")  # window and softcap
    fwd_sig = dict(Q=P, K=P, V=P, KPM="*u8", O=P, LSE="*fp32", **strides,
                   stride_vb="i32", stride_vh="i32", stride_vn="i32", **tail, **options)
    bwd_ptrs = dict(Q=P, K=P, V=P, KPM="*u8", DO=P, LSE="*fp32", DELTA="*fp32")
    bwd_tail = dict(**strides, **tail, sm_scale="fp32", **options)
    jobs = [
        ("forward", kernels._attn_fwd, fwd_sig, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=cfg.tma),
         cfg.num_warps, cfg.num_stages),
        ("bwd dK/dV", kernels._attn_bwd_dkdv, dict(**bwd_ptrs, DK=P, DV=P, **bwd_tail),
         dict(BLOCK_M1=cfg.block_m1, BLOCK_N1=cfg.block_n1, USE_TMA=cfg.tma), cfg.bwd_num_warps,
         cfg.bwd_num_stages),
        ("bwd dQ", kernels._attn_bwd_dq, dict(**bwd_ptrs, DQ=P, **bwd_tail),
         dict(BLOCK_M2=cfg.block_m2, BLOCK_N2=cfg.block_n2, USE_TMA=cfg.tma), cfg.bwd_num_warps,
         cfg.bwd_num_stages),
    ]
    print(f"D={D} {TYPES[dtype]} causal={causal} kpm={kpm} window_left={left} window_right={right} "
          f"softcap={cap} group={group} {cfg}")
    for name, fn, sig, blocks, warps, stages in jobs:
        constexprs = dict(common, **blocks)
        start = time.time()
        compiled = triton.compile(
            ASTSource(fn, dict(sig, **{k: "constexpr" for k in constexprs}), constexprs),
            target=target, options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True),
        )
        print(f"  {name:10s} {resources(compiled)}  ({time.time() - start:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["128,bfloat16,causal"])
    parser.add_argument("--config", help="ten comma-separated _Config fields, and an 11th, 1 for tma")
    args = parser.parse_args()
    cfg = tf._Config(*map(int, args.config.split(","))) if args.config else None
    for case in args.cases:
        D, dtype, *flags = case.split(",")
        group = next((int(f[3:]) for f in flags if f.startswith("gqa")), 1)  # gqa4: 4 query heads per kv head
        report(int(D), getattr(torch, dtype), "causal" in flags, "kpm" in flags, cfg,
               "left" in flags, "right" in flags, "cap" in flags, group)


if __name__ == "__main__":
    main()
