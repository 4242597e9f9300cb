#!/usr/bin/env bash
# Device call 1 of 2026-11-27 (issue 35): correctness in parallel (the conformance suite on CUDA,
# full size, every shipped adapter; the Triton kernel's tests; the checker and thread tests; the
# backends on cuda), then timings alone: linear attention against fla's Triton kernels, and the
# forward grid (bf16, D = 128) before and after the FMA change, beside torch's flash and cuDNN.
# Run from the repository root with `.gpu` carried (the fla-core and transformers wheels, and
# `.gpu/before`: attention_ref and attention_bench.py as committed before the kernel change).
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=${COMMIT:?}
R=/tmp/gs; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/smi.txt 2>&1
python3 -m pip install -q --no-deps --no-index .gpu/transformers-5.23.0-py3-none-any.whl > $R/pip-install.txt 2>&1
python3 -m pip install -q --no-deps --no-index --target /tmp/fla .gpu/fla_core-0.6.0-py3-none-any.whl >> $R/pip-install.txt 2>&1
python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|pytest-xdist|einops|huggingface.hub|tokenizers) " > $R/pip.txt
cat $R/smi.txt $R/pip.txt
echo "== phase 1 (parallel) at $((SECONDS-T0)) s"
ALL="attention_ref-triton torch-flex hf-flex torch-sdpa-math torch-sdpa-flash torch-sdpa-efficient torch-sdpa-cudnn torch-multihead hf-sdpa hf-eager attention_ref-math attention_ref-tiled"
( timeout 240 python3 benchmarks/conformance_full.py --size full --jobs 4 --device cuda --no-progress --max-wall-s 180 \
    --adapters $ALL --out $R/conformance-cuda.json > $R/conformance.log 2>&1; echo "conformance rc=$?" >> $R/conformance.log ) &
( timeout 240 python3 benchmarks/conformance_full.py --size full --jobs 2 --device cuda --no-progress --max-wall-s 180 \
    --adapters torch-flex-compiled hf-flex-compiled --out $R/conformance-cuda-compiled.json > $R/conformance-compiled.log 2>&1
  echo "compiled rc=$?" >> $R/conformance-compiled.log ) &
( timeout 200 python3 benchmarks/gpu_session.py --out $R/t1 tests --only triton-kernel -- -p no:benchmark > $R/t1.log 2>&1 ) &
( timeout 200 python3 benchmarks/gpu_session.py --out $R/t2 tests --only checker -- -n 3 -p no:benchmark > $R/t2.log 2>&1
  timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:benchmark tests/test_tiled.py -k thread > $R/t-threads.log 2>&1 ) &
( timeout 220 python3 benchmarks/gpu_session.py --out $R/t3 tests --only backends-on-cuda -- -n 3 -p no:benchmark > $R/t3.log 2>&1 ) &
wait
echo "== phase 1 done at $((SECONDS-T0)) s"
tail -3 $R/t1.log $R/t2.log $R/t3.log $R/t-threads.log
grep -E "\((full|quick), cuda|not run|rc=|: (failed|error|xpassed): " $R/conformance.log $R/conformance-compiled.log | cut -c1-220 | head -60
echo "== linear vs fla at $((SECONDS-T0)) s"
PYTHONPATH=.:/tmp/fla timeout $(left 360) python3 benchmarks/linear_gpu.py --budget 80 --out $R/linear-gpu.json 2>$R/linear.err | tail -20
tail -3 $R/linear.err
echo "== forward grid before at $((SECONDS-T0)) s"
G="--preset gpu --no-progress --head-dims 128 --lengths 1024 2048 4096 8192 16384 --modes fwd --impls torch-sdpa-flash torch-sdpa-cudnn triton"
(cd .gpu/before && ATTENTION_REF_GIT_COMMIT=${BEFORE:?} timeout $(left 470) python3 benchmarks/attention_bench.py $G --max-wall-s $(left 465) --out $R/fwd-before.json 2>&1 | tail -16)
echo "== forward grid after at $((SECONDS-T0)) s"
timeout $(left 560) python3 benchmarks/attention_bench.py $G --max-wall-s $(left 555) --out $R/fwd-after.json 2>&1 | tail -16
echo "== done at $((SECONDS-T0)) s"
tar czf $OUT/gs1.tgz -C $R . ; ls -la $OUT
