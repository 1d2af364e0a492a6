#!/usr/bin/env bash
# Session 43, call 1c (the least that verifies this session's GPU-side changes; about 90 s):
# the sampling tests with sample.cu's early stop (and its new test), the host copies' test on
# this tree and on the code before it (must fail there).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
PYTHONPATH=$PWD/src timeout 100 python3 -m pytest -p no:cacheprovider -n 4 tests/test_cuda_sampling.py \
    tests/test_cuda.py -k "sampl or keep_their_host or sample" 2>&1 | grep -E "passed|failed|Error" | tail -4
echo "(all $((SECONDS - t0)) s)"
rm -rf /tmp/old && cp -r src /tmp/old && sed -i '/^        _keep_until_done(stream, src)$/d; /^    _keep_until_done(stream, out, event)$/d' /tmp/old/forge_ml/backends/cuda/memory.py
echo "keep calls left in the old copy: $(grep -c '_keep_until_done(stream' /tmp/old/forge_ml/backends/cuda/memory.py)"
PYTHONPATH=/tmp/old timeout 40 python3 -m pytest tests/test_cuda.py -k keep_their_host -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | tail -3
echo "(all $((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 40 python3 benchmarks/sampling_cuda.py --reps 10 2>&1 | tail -12
echo "(all $((SECONDS - t0)) s)"
