#!/usr/bin/env bash
# Session 39, call 1 (carry .whl and .data; about 480 s): the pipelined wgmma forward's A/B on
# main (../gpu-2026-12-07-s38/next_call.sh: tests, bits, kernel times, trainer), then the whole
# GPU suite: on the patched tree where the A/B's tests passed and its bits matched main's (so
# the suite verifies QWalk, 7577aa3, and the pipelined forward together), else on main.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
timeout 260 bash results/gpu-2026-12-07-s38/next_call.sh > $O/ab.txt 2>&1
cat $O/ab.txt | tail -30
if grep -q "tests rc=0" $O/ab.txt && grep -q "^32 of 32 arrays the same bytes" $O/ab.txt; then
  echo "== suite on the pipelined forward"
else
  echo "== suite on main (the pipelined forward did not hold)"
  rm -rf src && cp -r .scratch/base/src src
fi
grep -c "wg_wait1" src/forge_ml/backends/cuda/flash_hopper.cu
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=300 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
# then, where the call's 600 s leave room: every sampling mode against greedy (call2.sh's
# benchmark; the suite above ran the OpenAI adjustments' GPU tests)
left=$((570 - SECONDS))
if [ $left -gt 60 ]; then
  PYTHONPATH=$PWD/src timeout $left python3 benchmarks/generate_gpu.py --dtype bf16 \
      --paths forge --sampling --modes greedy,top-p,penalty,openai --repeats 3 \
      > $O/sampling.txt 2>&1
  tail -16 $O/sampling.txt
fi
echo "(all $((SECONDS - t0)) s)"
