#!/usr/bin/env bash
# Device call 2 of 2026-11-27 (issue 35), after call 1 showed three harness faults: the varlen
# and paged cases' mask mods indexed CPU tensors (fixed: made on the case's device), a
# device-side assert in hf-flex turned 222 later cases into errors (fixed: a new process goes on
# from the next case), and the slow adapters did not finish (now split over processes).
# Phase A, in parallel: the conformance suite again (full size; the compiled FlexAttention
# adapters at quick size, compiling each case takes seconds), the routing tests. Phase B alone:
# the linear-attention timings, this package's chunked forms and fla's kernels side by side
# (correctness was judged in call 1).
export PYTHONPATH=. PYTHONUNBUFFERED=1 ATTENTION_REF_GIT_COMMIT=${COMMIT:?}
R=/tmp/gs; mkdir -p $R; T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
python3 -m pip install -q --no-deps --no-index .gpu/transformers-5.23.0-py3-none-any.whl > $R/pip-install.txt 2>&1
python3 -m pip install -q --no-deps --no-index --target /tmp/fla .gpu/fla_core-0.6.0-py3-none-any.whl >> $R/pip-install.txt 2>&1
echo "== phase A at $((SECONDS-T0)) s"
ALL="attention_ref-triton hf-flex torch-flex hf-sdpa hf-eager torch-sdpa-cudnn torch-sdpa-efficient torch-multihead torch-sdpa-math torch-sdpa-flash attention_ref-math attention_ref-tiled"
( timeout 230 python3 benchmarks/conformance_full.py --size full --jobs 9 --shards 3 --device cuda --max-wall-s 185 \
    --adapters $ALL --out $R/conformance-cuda.json > $R/conformance.log 2>&1; echo "conformance rc=$?" >> $R/conformance.log ) &
( timeout 230 python3 benchmarks/conformance_full.py --size quick --jobs 6 --shards 3 --device cuda --max-wall-s 185 \
    --adapters torch-flex-compiled hf-flex-compiled --out $R/conformance-cuda-compiled-quick.json > $R/conformance-compiled.log 2>&1
  echo "compiled rc=$?" >> $R/conformance-compiled.log ) &
( timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --device cuda tests/test_backends.py -k routing > $R/t-routing.log 2>&1 ) &
wait
echo "== phase A done at $((SECONDS-T0)) s"
tail -n 3 $R/t-routing.log
grep -E "\((full|quick), cuda|not run|rc=|lost" $R/conformance.log $R/conformance-compiled.log | cut -c1-200 | head -70
echo "== linear timings at $((SECONDS-T0)) s"
PYTHONPATH=.:/tmp/fla timeout $(left 372) python3 benchmarks/linear_gpu.py --no-check --budget 150 --out $R/linear-gpu-timing.json 2>$R/linear.err | tail -12
tail -n 4 $R/linear.err
echo "== done at $((SECONDS-T0)) s"
tar czf $OUT/gs2.tgz -C $R . ; ls -la $OUT
