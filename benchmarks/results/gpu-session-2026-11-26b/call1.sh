#!/usr/bin/env bash
# One device call (session 3 of 2026-11-26): the kernel's CUDA tests after the allocator fix,
# the backend tests on cuda, then wider backward sweeps at L = 8192, D = 128 bf16, then the
# D = 128 forward + backward grid with whatever time is left.
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=5fa8990b87283e6f8a931533ab6cec3c2a6ea922
R=/tmp/gs; mkdir -p $R/a $R/b; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee $R/smi.txt
python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|pytest-xdist) " | tee $R/pip.txt
echo "== probe"; timeout 60 python3 benchmarks/gpu_session.py --out $R probe 2>&1 | tail -4
echo "== triton tests at $((SECONDS-T0)) s"
timeout $(left 260) python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- -p no:benchmark 2>&1 | tail -24
cp $R/tests.json $R/tests-a.json 2>/dev/null
echo "== backend tests at $((SECONDS-T0)) s"
timeout $(left 330) python3 benchmarks/gpu_session.py --out $R tests --only backends-on-cuda checker -- -n 8 -p no:benchmark 2>&1 | tail -12
cp $R/tests.json $R/tests-b.json 2>/dev/null
echo "== sweep A at $((SECONDS-T0)) s"
timeout $(left 420) python3 benchmarks/gpu_session.py --out $R/a sweep --pass bwd --block-n1 64 128 --block-m1 32 64 --warps 4 8 --stages 3 --tma 0 2>&1 | tail -20
echo "== sweep B at $((SECONDS-T0)) s"
timeout $(left 500) python3 benchmarks/gpu_session.py --out $R/b sweep --pass bwd --block-n1 64 128 --block-m1 32 64 --warps 8 --stages 4 --tma 0 1 2>&1 | tail -20
echo "== grid at $((SECONDS-T0)) s"
timeout $(left 555) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 545) --head-dims 128 \
  --lengths 4096 8192 16384 --modes fwd+bwd --impls torch-sdpa-flash torch-sdpa-cudnn triton --out $R/gpu-grid-d128-fwdbwd.json 2>&1 | tail -16
echo "== done at $((SECONDS-T0)) s"
cp $R/a/sweep-bwd.json $OUT/sweep-bwd-a.json; cp $R/b/sweep-bwd.json $OUT/sweep-bwd-b.json
tar czf $OUT/gs.tgz -C $R . ; cp $R/probe.json $R/tests-a.json $R/tests-b.json $R/gpu-grid-d128-fwdbwd.json $OUT/ 2>/dev/null; ls $OUT
