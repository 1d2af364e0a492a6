#!/usr/bin/env bash
# Session 37, call 3 (carry .whl and .data; about 400 s): the shakespeare_char recipe, 5,000
# steps, forge-ml's trainer against torch eager (issue 10: <= 0.5x eager's time, best val
# <= 1.48, the same final val within 0.02), then issue 11's batch-1 rows with transformers.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
SECTIONS="recipe" E2E_DATA=.data/tinyshakespeare.txt RECIPE_TIMEOUT=330 OUT=${OUT:-/tmp/gc} \
  bash scripts/gpu_check.sh 2>&1 | grep -A8 "char recipe:"
echo "($((SECONDS - t0)) s)"
export PYTHONPATH=$PWD/src
for d in bf16 float32; do
  timeout 100 python3 benchmarks/generate_gpu.py --dtype $d 2>&1 | grep -v "^ *$" | tail -6
done
echo "($((SECONDS - t0)) s)"
