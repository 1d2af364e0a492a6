#!/usr/bin/env bash
# Session 35, a short call (~280 s) for when little device time is left: the head prefetch's
# bit-equality tests and its generate() A/B (bf16 and float32, 3 rounds), then gemm_rows.cu's
# tests and one batch-64 A/B round if time allows.
set -u
t0=$SECONDS
T=${T:-270}   # the call's own budget in seconds
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD/src
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py -k prefetch 2>&1 | tail -2
echo "($((SECONDS - t0)) s)"
timeout $((T < 200 ? 70 : 100)) python3 results/gpu-2026-12-07-s35/head_pf_ab.py $((T < 200 ? 2 : 3)) bfloat16=0,4,8 float32=0,2,4 2>&1 | tail -8
echo "($((SECONDS - t0)) s)"
[ $((T - (SECONDS - t0))) -gt 40 ] && timeout $((T - (SECONDS - t0))) python3 -m pytest -q -x -p no:cacheprovider -n 4 tests/test_cuda_gemm_rows.py > /tmp/rows_tests.log 2>&1
rc=$?; echo "gemm_rows tests rc=$rc"; tail -3 /tmp/rows_tests.log; [ $rc = 0 ] || grep -E "Error|error|assert" /tmp/rows_tests.log | head -20
echo "($((SECONDS - t0)) s)"
