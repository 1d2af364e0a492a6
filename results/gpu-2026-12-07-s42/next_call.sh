#!/usr/bin/env bash
# For the next session's first call (carry .whl; about 200 s on an H100): the GPU suite on main
# after the forty-second session's CPU-side mends that GPU paths also run (Tensor.__bool__,
# AdamW's gradient checks before a step, ops' bool switches, generate's text_after,
# DecodeStep.choose's shape check, load_model's config check,
# DataParallel's check that every rank was built alike: its NCCL form needs two GPUs,
# tests/test_cuda_distributed.py on nvidia-h100-x2), then batch-1 greedy in float32 and bf16.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=280 OUT=$O/gc PYTHONPATH=/tmp/forge_site \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
for d in float32 bf16; do
  PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/generate_gpu.py --dtype $d --paths forge \
      --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
done
echo "(all $((SECONDS - t0)) s)"
