#!/usr/bin/env bash
# Session 35: gemm_rows.cu (decoding products of 5-64 rows on the tensor cores, behind
# FORGE_GEMM_ROWS, default off until measured): its tests, then batch-64 greedy generate()
# with the switch off / on alternated, then batch 64's step profile with it on. ~150 s.
set -u
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -n 4 tests/test_cuda_gemm_rows.py > /tmp/rows_tests.log 2>&1
rc=$?; echo "gemm_rows tests rc=$rc"; tail -3 /tmp/rows_tests.log; [ $rc = 0 ] || grep -E "Error|error|assert" /tmp/rows_tests.log | head -20
echo "($((SECONDS - t0)) s)"
if [ $rc = 0 ]; then
  for r in $(seq 1 ${ROUNDS:-2}); do for f in off on; do
    echo "FORGE_GEMM_ROWS=$f round $r"
    FORGE_GEMM_ROWS=$f timeout 80 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge --sampling \
        --modes greedy --batch 64 --repeats ${REPEATS:-2} 2>&1 | grep -v "^ *$" | tail -4
  done; done
  echo "($((SECONDS - t0)) s)"
  FORGE_GEMM_ROWS=on timeout 60 python3 benchmarks/decode_gpu.py --dtype bf16 --batch 64 --pos 512 2>&1 | grep -v "^ *$" | tail -30
fi
echo "($((SECONDS - t0)) s)"
