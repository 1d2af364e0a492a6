#!/usr/bin/env bash
# Session 43, call 1 (carry .whl, .data and .scratch/base43 = main before sample.cu's early
# stop; under 590 s): the GPU suite on this tree (the forty-second session's CPU-side mends,
# the host copies keeping their arrays, the QA mends, sample.cu's radix descent stopping at a
# bin whose lower edge keeps the cut's weights, with its test); the host copies' test on the
# code before it (must fail); sampling_cuda.py and generate() with top-k and top-p on both
# trees; batch-1 greedy in float32 (transformers in the same run) and bf16; the B=32 trainer
# beside torch.compile with what time is left.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=250 OUT=$O/gc PYTHONPATH=/tmp/forge_site \
  bash scripts/gpu_check.sh 2>&1 | grep -E "passed|failed|error|FAIL" | tail -8
echo "(all $((SECONDS - t0)) s)"
rm -rf /tmp/old && cp -r src /tmp/old && sed -i '/^        _keep_until_done(stream, src)$/d; /^    _keep_until_done(stream, out, event)$/d' /tmp/old/forge_ml/backends/cuda/memory.py
echo "keep calls left in the old copy: $(grep -c '_keep_until_done(stream' /tmp/old/forge_ml/backends/cuda/memory.py)"
PYTHONPATH=/tmp/old timeout 40 python3 -m pytest tests/test_cuda.py -k keep_their_host -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | tail -3
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 60 python3 benchmarks/sampling_cuda.py --reps 20 2>&1 | tail -12 | tee $O/sampling_cuda_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== generate_gpu.py --sampling, $t"
  PYTHONPATH=$src timeout 100 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
      --sampling --batch 64 --repeats 3 --modes top-k,top-p 2>&1 | tail -11 | tee -a $O/generate_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 60 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf \
    --repeats 3 2>&1 | tee $O/generate_float32.log | grep -E "^forge-ml:|^hf|bandwidth|ratio"
PYTHONPATH=$PWD/src timeout 45 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | tee $O/generate_bf16.log | grep -E "^forge-ml:|bandwidth"
echo "(all $((SECONDS - t0)) s)"
left=$((${DEADLINE:-585} - SECONDS + t0))
[ $left -gt 60 ] && PYTHONPATH=$PWD/src:/tmp/forge_site timeout $left python3 benchmarks/train_e2e.py \
    --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge,compile --steps 20 \
    --json $O/e2e.json 2>&1 | tee $O/e2e.log | tail -8
echo "(all $((SECONDS - t0)) s)"
