#!/usr/bin/env bash
# Session 36, call 2 (carry .whl and .data; about 400 s): main as it ends the session (the
# dk/dv kernel of 128 keys the default; the head prefetch and gemm_rows.cu taken out; the CPU
# attention and gemm changes): the GPU suite, issue 10's B=32 row against torch.compile,
# issue 11's batch-1 and batch-64 greedy rows (forge-ml only).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS=tests TEST_WORKERS=8 TEST_TIMEOUT=300 OUT=/tmp/gc bash scripts/gpu_check.sh 2>&1 | tail -4
echo "($((SECONDS - t0)) s)"
export PYTHONPATH=$PWD/src:/tmp/forge_site
timeout 170 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 \
    --peers forge,compile --steps 20 2>&1 | tail -3
echo "($((SECONDS - t0)) s)"
for d in bf16 float32; do
  timeout 70 python3 benchmarks/generate_gpu.py --dtype $d --paths forge --sampling --modes greedy \
      --batch 64 --repeats 2 2>&1 | grep -v "^ *$" | tail -4
done
echo "($((SECONDS - t0)) s)"
