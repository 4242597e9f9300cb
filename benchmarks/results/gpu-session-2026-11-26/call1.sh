#!/usr/bin/env bash
# One device call: probe, the kernel's CUDA tests, the D=128 grid, the backend tests on cuda.
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=a059b11968feb094dcfb82a45c6eb64bda99915f
R=/tmp/gs; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee $R/smi.txt
python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|pytest-xdist|hypothesis) " | tee $R/pip.txt
echo "== probe"; timeout 90 python3 benchmarks/gpu_session.py --out $R probe 2>&1 | tail -5
echo "== triton tests at $((SECONDS-T0)) s"
timeout 200 python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- -n 8 2>&1 | tail -20
echo "== grid at $((SECONDS-T0)) s"
timeout $(left 470) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 460) --head-dims 128 \
  --impls torch-sdpa-flash torch-sdpa-cudnn torch-sdpa-efficient triton --out $R/gpu-grid-d128.json 2>&1 | tail -40
echo "== backend tests at $((SECONDS-T0)) s"
timeout $(left 555) python3 benchmarks/gpu_session.py --out $R tests --only backends-on-cuda -- -n 8 -x 2>&1 | tail -20
echo "== done at $((SECONDS-T0)) s"
tar czf $OUT/gs.tgz -C $R . ; cp $R/*.json $OUT/ 2>/dev/null; ls -la $OUT
