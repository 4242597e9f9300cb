export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=a059b11968feb094dcfb82a45c6eb64bda99915f
R=/tmp/gs2; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
X="-n 8 -p no:benchmark"
timeout 200 python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- $X 2>&1 | tail -20
echo "== at $((SECONDS-T0)) s"
timeout $(left 330) python3 benchmarks/gpu_session.py --out $R tests --only backends-on-cuda checker -- $X 2>&1 | tail -20
echo "== grid64 at $((SECONDS-T0)) s"
timeout $(left 420) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 410) --head-dims 64 --impls torch-sdpa-flash torch-sdpa-cudnn torch-sdpa-efficient triton --out $R/gpu-grid-d64.json 2>&1 | tail -28
echo "== flex at $((SECONDS-T0)) s"
timeout $(left 520) python3 benchmarks/attention_bench.py --preset gpu --no-progress --max-wall-s $(left 510) --head-dims 128 --lengths 4096 8192 16384 --impls torch-sdpa-flash flex triton --modes fwd --out $R/gpu-flex-fwd.json 2>&1 | tail -12
tar czf $OUT/gs2.tgz -C $R . ; cp $R/*.json $OUT/ 2>/dev/null; echo "done at $((SECONDS-T0))"
