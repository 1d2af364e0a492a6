#!/usr/bin/env bash
# The device call sessions 30 and 31 prepared and could not run (every start refused), for the
# next session's first call: from the repository root on the GPU machine (carry .whl and .data):
#   bash results/gpu-2026-12-06-s30/next_call.sh        (about 450 s; logs under $OUT)
# Applies s30-prefetch.diff to the machine's copy (the local tree needs `git apply` too, to land
# it), then: the L2 hints' A/B (float32 and bf16, generate() batch 1), the float32 step's phase
# trace with and without them and bf16's (H200 phase figures: the last trace is an H100's),
# the decoding tests, issue 11's float32 figure with transformers, issue 10's B=32 row.
set -u
R=results/gpu-2026-12-06-s30
OUT=${OUT:-/tmp/next_call}; mkdir -p "$OUT"
git apply "$R/s30-prefetch.diff" 2>/dev/null || patch -p1 -N < "$R/s30-prefetch.diff"
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl
export PYTHONPATH=$PWD/src:/tmp/forge_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 90 python3 "$R/prefetch_ab.py" 3 gpt2 float32,bfloat16 2>&1 | tee "$OUT/prefetch_ab.log"
for m in off auto; do
  timeout 35 python3 "$R/trace_pf.py" $m --fused layers --trace --dtype float32 --pos 1000 2>&1 | tee "$OUT/trace_f32_$m.log" | tail -32
done
timeout 110 python3 -m pytest tests/test_cuda_decode_model.py -q -x -p no:cacheprovider -n 4 2>&1 | tee "$OUT/decode_model_tests.log" | tail -5
timeout 50 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf --repeats 2 2>&1 | tee "$OUT/generate_float32.log" | tail -12
timeout 30 python3 "$R/trace_pf.py" off --fused layers --trace --dtype bf16 --pos 1000 2>&1 | tee "$OUT/trace_bf16.log" | tail -32
timeout 150 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge,compile \
    --steps 20 --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | tail -25
