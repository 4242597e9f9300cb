#!/usr/bin/env bash
# Call 2: the kernel's CUDA tests with the new D = 128 backward tiles and auto routing to
# Triton, a D = 64 backward sweep, then the D = 128 grid (every length, fwd and fwd+bwd).
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=3fdef69bdd5bf55cda7cce518ff33506dc3177b3
R=/tmp/gs; mkdir -p $R/c; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
echo "== triton tests"
timeout 110 python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- -p no:benchmark 2>&1 | tail -12
cp $R/tests.json $R/tests-c.json
echo "== backend tests at $((SECONDS-T0)) s"
timeout $(left 180) python3 benchmarks/gpu_session.py --out $R tests --only backends-on-cuda -- -n 8 -p no:benchmark 2>&1 | tail -12
cp $R/tests.json $R/tests-d.json
echo "== D=64 sweep at $((SECONDS-T0)) s"
timeout $(left 250) python3 benchmarks/gpu_session.py --out $R/c sweep --pass bwd --head-dim 64 --block-n1 64 128 --block-m1 32 64 --warps 4 8 --stages 3 --tma 0 2>&1 | tail -20
echo "== grid at $((SECONDS-T0)) s"
timeout $(left 300) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 292) --head-dims 128 \
  --impls torch-sdpa-flash torch-sdpa-cudnn torch-sdpa-efficient triton --out $R/gpu-grid-d128.json 2>&1 | tail -16
echo "== done at $((SECONDS-T0)) s"
cp $R/c/sweep-bwd.json $OUT/sweep-bwd-d64.json
tar czf $OUT/gs2.tgz -C $R . ; cp $R/tests-c.json $R/tests-d.json $R/gpu-grid-d128.json $OUT/ 2>/dev/null; ls $OUT
