#!/usr/bin/env bash
# Session 38, call 1 (carry .whl and .data; about 520 s): the GPU suite on main as session 37
# left it (the flash helpers db1614c/7cc64c8 had run only the flash, wgmma, attention and step
# tests), then the issues' H200 targets (results/gpu-2026-12-07-s37/next_call.sh).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=300 OUT=${OUT:-/tmp/gc} \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(suite $((SECONDS - t0)) s)"
timeout 330 bash results/gpu-2026-12-07-s37/next_call.sh 2>&1 | tail -25
echo "($((SECONDS - t0)) s)"
