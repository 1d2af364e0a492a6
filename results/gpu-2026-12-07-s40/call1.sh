#!/usr/bin/env bash
# Session 40, call 1 (carry .whl and .data; about 300 s on an H100, 520 s on an H200): the
# GPU suite on main at the thirty-ninth session's last commit (28bc39f: the engine's bias row
# and DecodeStep's penalty copies, not run on a GPU), then every sampling mode against greedy
# (bf16, batch 1 and 64); on an H200 first the issues' H200 targets
# (../gpu-2026-12-07-s37/next_call.sh: the B=32 trainer, batch-1 greedy bf16 and float32).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 300 bash results/gpu-2026-12-07-s37/next_call.sh > $O/h200.txt 2>&1
  cat $O/h200.txt
fi
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=300 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
left=$((580 - SECONDS))
if [ $left -gt 60 ]; then
  PYTHONPATH=$PWD/src timeout $left python3 benchmarks/generate_gpu.py --dtype bf16 \
      --paths forge --sampling --modes greedy,top-p,penalty,openai --repeats 3 \
      > $O/sampling.txt 2>&1
  tail -16 $O/sampling.txt
fi
echo "(all $((SECONDS - t0)) s)"
