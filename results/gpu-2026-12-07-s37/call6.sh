#!/usr/bin/env bash
# Session 37, call 6 (carry nothing; about 150 s): flash_hopper.cu's dk/dv kernels sharing
# their tile staging and their end (dkdv_stage, dkdv_finish; the PTX differs from before only
# in register names and where two index sums are computed) and the dq kernels' D and lse rows
# (common.cuh's dq_rows_d_lse; PTX byte-identical): the flash, attention and training-step
# tests on Hopper, then the kernels' times at B=32, T=1024 (the backward was 0.698 ms).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_flash_hopper.py \
    tests/test_cuda_flash.py tests/test_attention_qkv.py tests/test_cuda_train_step.py \
    > /tmp/t6.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|error" /tmp/t6.log | tail -3
echo "($((SECONDS - t0)) s)"
timeout 100 python3 benchmarks/attention_cuda.py --batch 32 --no-v1 2>&1 | grep -v "^ *$" | tail -8
echo "($((SECONDS - t0)) s)"
