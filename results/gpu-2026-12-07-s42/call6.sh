#!/usr/bin/env bash
# Session 42, call 6 (asked of an H200; carry .whl for transformers' tokenizer-free peer):
# issue 11's batch-1 figures on today's main: float32 (forge-ml and transformers' generate)
# and bf16, greedy, a 16-token prompt to position 1,024.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
PYTHONPATH=$PWD/src timeout 120 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf \
    --repeats 2 2>&1 | grep -E "^forge-ml|^transformers|bandwidth|x HF|ratio" | head -8
PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
echo "(all $((SECONDS - t0)) s)"
