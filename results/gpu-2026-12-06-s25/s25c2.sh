#!/usr/bin/env bash
# session 25, call 2: the GPU suite (NaN refusals, the width test on main's kernels); batch-1
# greedy generation by path at every GPT-2 size, 16 -> 1,024
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
SECTIONS="tests" OUT=$O/check timeout 300 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "== suite"; grep -E "^tests:|^(FAILED|ERROR) " $O/check.txt | head -20
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_decode_model.py tests/test_generate.py tests/test_batch_engine.py -k "every_gpt2_width or nan or refuses_a_model" -rA 2>&1 | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" | head -30
for m in gpt2-medium gpt2-large gpt2-xl; do for dt in bf16 float32; do
  timeout 150 python3 benchmarks/generate_gpu.py --model $m --dtype $dt --paths forge,perop --repeats 2 > $O/size_${m}_$dt.txt 2>&1
  echo "== $m $dt"; grep -E "^forge|^bandwidth" $O/size_${m}_$dt.txt | cut -c1-120
done; done
