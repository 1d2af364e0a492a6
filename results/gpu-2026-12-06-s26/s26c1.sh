#!/usr/bin/env bash
# session 26, call 1: the layers step at 2-4 rows: its tests, the small-batch table, the GPU suite
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1; export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
timeout 200 python3 -m pytest tests/test_cuda_decode_model.py -x -q -p no:cacheprovider -rfEs 2>&1 | tail -25 | tee $O/decode_tests.txt
for dt in bf16 float32; do
  timeout 170 python3 benchmarks/generate_gpu.py --dtype $dt --rows 1,2,3,4,5,6,8 --repeats 2 2>&1 | tee $O/rows_$dt.txt
done
TEST_TIMEOUT=280 SECTIONS="tests" OUT=$O/check timeout 420 bash scripts/gpu_check.sh > $O/check.log 2>&1
tail -5 $O/check/tests.log; tail -3 $O/check/tests_twins.log
