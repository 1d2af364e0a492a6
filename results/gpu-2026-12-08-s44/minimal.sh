#!/usr/bin/env bash
# Session 44, the least call (carry .scratch/base43; about 200 s): the sampling, host-copy and
# check tests of this tree; the host copies' test on the code before (must fail); forge-ml
# check; sampling_cuda.py on both trees; batch-1 greedy float32 and bf16 (forge-ml only).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
PYTHONPATH=$PWD/src timeout 120 python3 -m pytest -p no:cacheprovider -n 8 tests/test_cuda_sampling.py \
    tests/test_cuda.py tests/test_cli.py -k "sampl or keep_their_host or sample or check" 2>&1 | grep -E "passed|failed|Error" | tail -4
PYTHONPATH=$PWD/src timeout 60 python3 -m forge_ml check 2>&1 | tail -3
echo "(all $((SECONDS - t0)) s)"
rm -rf /tmp/old && cp -r src /tmp/old && sed -i '/^        _keep_until_done(stream, src)$/d; /^    _keep_until_done(stream, out, event)$/d' /tmp/old/forge_ml/backends/cuda/memory.py
echo "keep calls left in the old copy: $(grep -c '_keep_until_done(stream' /tmp/old/forge_ml/backends/cuda/memory.py)"
PYTHONPATH=/tmp/old timeout 40 python3 -m pytest tests/test_cuda.py -k keep_their_host -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | tail -3
for t in base43 this; do
  src=$PWD/src; [ $t = base43 ] && src=$PWD/.scratch/base43/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 40 python3 benchmarks/sampling_cuda.py --reps 10 2>&1 | tail -12
done
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 45 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge \
    --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
PYTHONPATH=$PWD/src timeout 40 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --repeats 3 2>&1 | grep -E "^forge-ml:|bandwidth"
echo "(all $((SECONDS - t0)) s)"
