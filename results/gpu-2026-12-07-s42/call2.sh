#!/usr/bin/env bash
# Session 42, call 2: the race behind call 1's cudaErrorIllegalAddress shown on the device
# (table_race.py), test_cuda_many.py alone five times, then the whole GPU suite with the tests'
# tables emptied through many._clear_tables.
set -u
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
PYTHONPATH=$PWD/src timeout 60 python3 results/gpu-2026-12-07-s42/table_race.py 2>&1 | tail -4
for i in 1 2 3 4 5; do
  PYTHONPATH=$PWD/src timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_many.py \
      2>&1 | tail -1
done
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=280 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
