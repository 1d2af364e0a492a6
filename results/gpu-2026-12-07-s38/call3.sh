#!/usr/bin/env bash
# Session 38, call 3 (carry .whl and .data; about 170 s, 500 on an H200): flash_hopper.cu's
# dk/dv kernels reading their query side through one QWalk (q, dout, lse and D of the block's
# head and their shared buffers; the default r128h kernel's PTX has the same instructions, ten
# lines in another order): the flash, attention and training-step tests on Hopper, then the
# kernels' times at B=32, T=1024 (the backward was 0.679-0.698 ms on H100s). On an H200, then
# the issues' H200 targets (results/gpu-2026-12-07-s37/next_call.sh).
set -u
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_flash_hopper.py \
    tests/test_cuda_flash.py tests/test_attention_qkv.py tests/test_cuda_train_step.py \
    > /tmp/t3.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|error" /tmp/t3.log | tail -3
echo "($((SECONDS - t0)) s)"
timeout 100 python3 benchmarks/attention_cuda.py --batch 32 --no-v1 2>&1 | grep -v "^ *$" | tail -8
echo "($((SECONDS - t0)) s)"
case "$name" in *H200*) timeout 330 bash results/gpu-2026-12-07-s37/next_call.sh 2>&1 | tail -22 ;; esac
echo "($((SECONDS - t0)) s)"
