#!/usr/bin/env bash
# Session 43, call 2 (about 150 s on a warm machine): issue 11's sampling rows, every mode
# against greedy at batch 1 and 64 in bf16 (16-token prompt to position 1,024, best of 3),
# then batch-1 greedy in bf16 once more (the call's spread).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
PYTHONPATH=$PWD/src timeout 300 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --sampling --batch 64 --repeats 3 2>&1 | tee $O/sampling.log | tail -14
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
echo "(all $((SECONDS - t0)) s)"
