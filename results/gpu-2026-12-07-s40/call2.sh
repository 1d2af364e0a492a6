#!/usr/bin/env bash
# Session 40, call 2 (carry .whl and .data; about 160 s on an H100, 500 s on an H200): the GPU
# suite on main after the session's QA fixes (the CPU backend's out-of-memory guard, the
# sampling knobs' one number check, logit_bias keys, beam search's length penalty, the
# server's empty prompt on a char model, the swept tape, the trainer's CPU memory check:
# none changes a kernel, all run on the GPU's Python paths); on an H200 first the issues'
# H200 targets (../gpu-2026-12-07-s37/next_call.sh).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
git log --oneline -1 2>/dev/null || true
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 320 bash results/gpu-2026-12-07-s37/next_call.sh > $O/h200.txt 2>&1
  cat $O/h200.txt
fi
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=260 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
