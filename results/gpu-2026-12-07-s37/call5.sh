#!/usr/bin/env bash
# Session 37, call 5 (carry nothing; about 200 s): decode_head with 8 warps a block (128
# registers a thread) as landed: the decoding tests, then issue 11's batch-1 rows
# (generate_gpu.py, forge-ml's default path) in bf16 and float32.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 300 python3 -m pytest -q -x -n 4 tests/test_cuda_decode_model.py tests/test_cuda_sampling.py \
    tests/test_cuda_model.py 2>&1 | tail -3
echo "($((SECONDS - t0)) s)"
for d in bf16 float32; do
  timeout 60 python3 benchmarks/generate_gpu.py --dtype $d --paths forge --repeats 3 2>&1 \
      | grep -E "^forge-ml:|bandwidth"
done
echo "($((SECONDS - t0)) s)"
