#!/usr/bin/env bash
# For the next session's first device call (carry .whl and .data; about 330 s; an H200 is the
# targets' machine: kind nvidia-h200):
#   bash results/gpu-2026-12-07-s33/next_call.sh
# The two targets' rows on the H200 (issue 10's B=32 against torch.compile; issue 11's batch-1
# bf16 and float32 with transformers), then the GPU suite on main. Few files under $OUT (the
# device tool returns a limited count): logs only, the suite's own folder left out.
set -u
OUT=${OUT:-/tmp/next_call}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
t0=$SECONDS
timeout 100 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 \
    --peers forge,compile --steps 20 --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
tail -3 "$OUT/e2e.log"; echo "($((SECONDS - t0)) s)"
for dt in bf16 float32; do
  timeout 90 python3 benchmarks/generate_gpu.py --dtype $dt --paths forge,hf --repeats 2 2>&1 \
      | tr '\r' '\n' | grep -v "Loading weights" > "$OUT/generate_$dt.log"; tail -4 "$OUT/generate_$dt.log"
done; echo "($((SECONDS - t0)) s)"
SECTIONS=tests TEST_WORKERS=8 TEST_TIMEOUT=200 OUT=/tmp/next_call_suite bash scripts/gpu_check.sh \
    > "$OUT/suite.log" 2>&1
grep -E "passed|failed|error" "$OUT/suite.log" | tail -3; echo "($((SECONDS - t0)) s)"
