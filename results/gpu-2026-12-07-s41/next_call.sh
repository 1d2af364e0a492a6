#!/usr/bin/env bash
# For the next session's first call (carry .whl; about 200 s on an H100): the GPU suite on main
# after the float32 LM head streamed through shared memory (decode_layers.cu's
# DL_HEAD_STREAM; its final form, bf16 keeping lm_head_rows, has not run as a whole), then
# batch-1 greedy generate() in float32 and bf16.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=280 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
for d in float32 bf16; do
  PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/generate_gpu.py --dtype $d --paths forge \
      --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
done
echo "(all $((SECONDS - t0)) s)"
