#!/usr/bin/env bash
# Session 40, call 5 (carry .whl; about 170 s): the GPU suite after the review's mends
# (gemv.cu's layernorm statistics take the NaN rule; a contract test of linear with ln).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
grep -c "quiet_nan<float>()" src/forge_ml/backends/cuda/gemv.cu
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=260 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
grep -E "FAILED" $O/gc/tests.log | head -10
echo "(all $((SECONDS - t0)) s)"
