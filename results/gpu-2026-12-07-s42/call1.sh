#!/usr/bin/env bash
# Session 42, call 1 (carry .whl): the forty-first session's next_call.sh (the GPU suite on the
# final form of the float32 LM head streamed; batch-1 greedy in float32 and bf16), then every
# sampling mode against greedy at batch 1 and 64 in bf16 (where issue 11's 10% stands).
set -u
t0=$SECONDS
bash results/gpu-2026-12-07-s41/next_call.sh
PYTHONPATH=$PWD/src timeout 240 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --sampling --batch 64 --repeats 3 2>&1 | tail -14
echo "(all $((SECONDS - t0)) s)"
