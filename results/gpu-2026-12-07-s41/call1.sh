#!/usr/bin/env bash
# Session 41, call 1 (carry .whl and .data; about 200 s on an H100, 500 s on an H200): the
# GPU suite on main at the fortieth session's last commit (fee9816; gemv.cu's layernorm
# statistics take the NaN rule, not run on a GPU then); on an H200 first the issues' H200
# targets (../gpu-2026-12-07-s37/next_call.sh: the B=32 trainer, batch-1 greedy bf16 and
# float32, the sampling modes at batch 1).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
grep -c "quiet_nan<float>()" src/forge_ml/backends/cuda/gemv.cu
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 300 bash results/gpu-2026-12-07-s37/next_call.sh > $O/h200.txt 2>&1
  cat $O/h200.txt
fi
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=280 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
