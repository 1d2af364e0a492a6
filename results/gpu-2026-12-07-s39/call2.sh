#!/usr/bin/env bash
# Session 39, call 2 (carry .whl and .data; about 150 s): after call 1 (the whole suite: 2
# failures, both test_penalize_logits on cuda, a NaN's payload compared byte for byte): the
# OpenAI adjustments' GPU tests again with the NaN compared as NaN, then every sampling mode
# against greedy once more (bf16, batch 1 and 64), for a second round of call 1's figures.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_generate.py tests/test_batch_engine.py tests/backends/test_contract_ops.py \
    -k "gpu or penalize or sample_next or openai" > $O/tests.log 2>&1
echo "tests rc=$?"
grep -E "[0-9]+ passed|failed|FAILED|rror" $O/tests.log | tail -6
echo "($((SECONDS - t0)) s)"
PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
    --sampling --modes greedy,penalty,openai --repeats 3 > $O/sampling.txt 2>&1
tail -14 $O/sampling.txt
echo "($((SECONDS - t0)) s)"
