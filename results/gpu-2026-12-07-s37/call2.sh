#!/usr/bin/env bash
# Session 37, call 2 (carry .whl and .data; about 450 s): main with the CPU gemm kernel (no
# GPU change since session 36): the GPU suite and the 200-step loss curve against the sixth
# session's committed run (issue 10: "the loss curve of 200 steps matches today's eager path").
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
SECTIONS="tests curve" E2E_DATA=.data/tinyshakespeare.txt TEST_WORKERS=8 TEST_TIMEOUT=300 \
  OUT=${OUT:-/tmp/gc} bash scripts/gpu_check.sh 2>&1 | tail -30
echo "($((SECONDS - t0)) s)"
