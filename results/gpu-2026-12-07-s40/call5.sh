#!/usr/bin/env bash
# Session 40, call 5 (about 90 s; the session's device time nearly spent): after the review's
# mends (gemv.cu's layernorm statistics take the NaN rule; a contract test of linear with ln):
# the tests that run gemv.cu's layernorm (the contract suite's layernorm and linear cases on
# every backend, test_cuda.py's fused linear and gemv tests) and the decoding model's tests,
# the whole suite having run at call 3 before this one-line change.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
grep -c "quiet_nan<float>()" src/forge_ml/backends/cuda/gemv.cu
PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/backends/test_contract_ops.py tests/test_cuda.py tests/test_cuda_decode_model.py \
    -k "layernorm or linear or gemv or decode or variance" 2>&1 | tail -4
echo "(all $((SECONDS - t0)) s)"
