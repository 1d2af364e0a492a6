#!/usr/bin/env bash
# Session 43, call 1b (call 1 cut to the device time left; carry .whl and .scratch/base43 = main
# before sample.cu's early stop; about 420 s): the GPU suite on this tree; the host copies'
# test on the code before it (must fail); sampling_cuda.py and generate() with top-k and
# top-p at batch 1 and 64 on both trees.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=240 OUT=$O/gc PYTHONPATH=/tmp/forge_site \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
rm -rf /tmp/old && cp -r src /tmp/old && sed -i '/^        _keep_until_done(stream, src)$/d; /^    _keep_until_done(stream, out, event)$/d' /tmp/old/forge_ml/backends/cuda/memory.py
echo "keep calls left in the old copy: $(grep -c '_keep_until_done(stream' /tmp/old/forge_ml/backends/cuda/memory.py)"
PYTHONPATH=/tmp/old timeout 40 python3 -m pytest tests/test_cuda.py -k keep_their_host -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | tail -3
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 50 python3 benchmarks/sampling_cuda.py --reps 15 2>&1 | tail -12 | tee $O/sampling_cuda_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  left=$((${DEADLINE:-560} - SECONDS + t0)); [ $left -lt 40 ] && break
  [ $left -gt 90 ] && left=90
  echo "== generate_gpu.py --sampling, $t"
  PYTHONPATH=$src timeout $left python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
      --sampling --batch 64 --repeats 2 --modes top-k,top-p 2>&1 | tail -11 | tee -a $O/generate_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
