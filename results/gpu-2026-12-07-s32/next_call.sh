#!/usr/bin/env bash
# For the next session's first device call (carry .whl and .data; about 400 s on an H200):
#   bash results/gpu-2026-12-07-s32/next_call.sh
# The GPU suite on main after session 32's later commits (data, tokenizer, HF and convert checks:
# CPU-side paths, run here on the GPU machine too), then the two targets' rows on the machine
# they were set on: issue 11's batch-1 bf16 figure with transformers, issue 10's B=32 row.
set -u
OUT=${OUT:-/tmp/next_call}; mkdir -p "$OUT"
SECTIONS=tests TEST_WORKERS=8 TEST_TIMEOUT=240 OUT="$OUT/suite" bash scripts/gpu_check.sh > "$OUT/suite.log" 2>&1
grep -E "passed|failed|error" "$OUT/suite.log" | tail -4
export PYTHONPATH=$PWD/src:/tmp/forge_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 80 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge,hf --repeats 2 2>&1 | tr '\r' '\n' \
    | grep -v "Loading weights" | tee "$OUT/generate_bf16.log" | tail -6
timeout 140 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge,compile \
    --steps 20 --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | tail -4
