#!/usr/bin/env bash
# Call 3: the kernel's CUDA tests with 4 backward warps at D = 64, then the D = 64 grid.
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=96eafa8781fa40fad4101ab1bd4aeac5a3190226
R=/tmp/gs; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
echo "== triton tests"
timeout 100 python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- -p no:benchmark 2>&1 | tail -12
cp $R/tests.json $R/tests-e.json
echo "== grid at $((SECONDS-T0)) s"
timeout $(left 190) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 182) --head-dims 64 \
  --impls torch-sdpa-flash torch-sdpa-cudnn torch-sdpa-efficient triton --out $R/gpu-grid-d64.json 2>&1 | tail -26
echo "== done at $((SECONDS-T0)) s"
tar czf $OUT/gs3.tgz -C $R . ; cp $R/tests-e.json $R/gpu-grid-d64.json $OUT/ 2>/dev/null; ls $OUT
