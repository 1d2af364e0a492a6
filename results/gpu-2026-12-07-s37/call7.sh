#!/usr/bin/env bash
# Session 37, call 7 (carry nothing; about 90 s): the cluster sampler's first pass with 16
# loads a thread in flight (one round over an eighth of GPT-2's row on 512 threads, where 8
# took two) at up to 128 registers (__launch_bounds__(512, 1): 79, no spill): the sampling
# and decoding tests, then every sampling mode at batch 1 (top-p was 0.897x greedy).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_sampling.py \
    tests/test_cuda_decode_model.py > /tmp/t7.log 2>&1; echo "tests rc=$?"; tail -2 /tmp/t7.log
echo "($((SECONDS - t0)) s)"
timeout 100 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge --sampling --batch 1 \
    --repeats 2 2>&1 | grep -v "^ *$" | tail -6
echo "($((SECONDS - t0)) s)"
