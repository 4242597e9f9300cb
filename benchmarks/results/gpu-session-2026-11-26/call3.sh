export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=7face5c17c2dccbc6a141689125b350c0469655a
R=/tmp/gs3; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
timeout 215 python3 benchmarks/gpu_session.py --out $R tests --only triton-kernel -- -p no:benchmark 2>&1 | tail -12
echo "== at $((SECONDS-T0)) s"
timeout $(left 275) python3 benchmarks/gpu_session.py --out $R tests --only backends-on-cuda -- -n 8 -p no:benchmark 2>&1 | tail -12
echo "== sweep at $((SECONDS-T0)) s"
timeout $(left 365) python3 benchmarks/gpu_session.py --out $R sweep --pass bwd --block-n1 64 --block-m1 16 32 --warps 8 --stages 2 3 --tma 0 1 2>&1 | tail -22
tar czf $OUT/gs3.tgz -C $R . ; cp $R/*.json $OUT/ 2>/dev/null; echo "done at $((SECONDS-T0))"
