#!/usr/bin/env bash
# Session 44, the one call after loans resumed (carry .whl and .scratch/base43 = main before the
# session, whose sample.cu has no early stop; the tree has sample-early-stop.diff applied):
# the whole GPU suite, forge-ml check on cuda, sampling_cuda.py on both sample.cu's, batch-1
# greedy generate() in float32 and bf16 (forge-ml; transformers in float32 while time allows).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=230 OUT=$O/gc PYTHONPATH=/tmp/forge_site \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
grep -hE "^(FAILED|ERROR)" $O/gc/*.log 2>/dev/null | head -10
PYTHONPATH=$PWD/src timeout 60 python3 -m forge_ml check 2>&1 | tail -3
echo "(all $((SECONDS - t0)) s)"
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 40 python3 benchmarks/sampling_cuda.py --reps 10 2>&1 | tail -12
done
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 40 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
left=$((${DEADLINE:-400} - SECONDS + t0)); [ $left -gt 70 ] && paths=forge,hf || paths=forge
PYTHONPATH=$PWD/src timeout 70 python3 benchmarks/generate_gpu.py --dtype float32 --paths $paths \
    --repeats 3 2>&1 | grep -E "^forge-ml:|^hf|bandwidth|ratio"
echo "(all $((SECONDS - t0)) s)"
