#!/usr/bin/env bash
# Session 44, the short call (carry .whl and .scratch/base43 = main before sample.cu's early
# stop; about 420 s): the GPU suite on this tree; the host copies' test on the code before it
# (must fail); forge-ml check (its biases and gains now away from init); sampling_cuda.py on both trees; batch-1 greedy float32 and bf16 (forge-ml only);
# generate() with top-k / top-p on both trees while DEADLINE (s) allows.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=230 OUT=$O/gc PYTHONPATH=/tmp/forge_site \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
PYTHONPATH=$PWD/src timeout 60 python3 -m forge_ml check 2>&1 | tail -3
echo "(all $((SECONDS - t0)) s)"
rm -rf /tmp/old && cp -r src /tmp/old && sed -i '/^        _keep_until_done(stream, src)$/d; /^    _keep_until_done(stream, out, event)$/d' /tmp/old/forge_ml/backends/cuda/memory.py
echo "keep calls left in the old copy: $(grep -c '_keep_until_done(stream' /tmp/old/forge_ml/backends/cuda/memory.py)"
PYTHONPATH=/tmp/old timeout 40 python3 -m pytest tests/test_cuda.py -k keep_their_host -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | tail -3
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 45 python3 benchmarks/sampling_cuda.py --reps 12 2>&1 | tail -12 | tee $O/sampling_cuda_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 45 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge \
    --repeats 3 2>&1 | tee $O/generate_float32.log | grep -E "^forge-ml:|bandwidth"
PYTHONPATH=$PWD/src timeout 40 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | tee $O/generate_bf16.log | grep -E "^forge-ml:|bandwidth"
echo "(all $((SECONDS - t0)) s)"
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  left=$((${DEADLINE:-420} - SECONDS + t0)); [ $left -lt 40 ] && break
  [ $left -gt 80 ] && left=80
  echo "== generate_gpu.py --sampling --batch 1 rows, $t"
  PYTHONPATH=$src timeout $left python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
      --sampling --batch 64 --repeats 2 --modes top-k,top-p 2>&1 | tail -11 | tee -a $O/generate_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
