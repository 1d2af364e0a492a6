#!/usr/bin/env bash
# session 25, call 3: the GPU suite with the GPU twins of the CPU tests; float32 GPT-2 large
# on its new default (the kernel-per-op step) against the layers step; 124M unchanged
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
SECTIONS="tests" OUT=$O/check timeout 420 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "== suite"; sed -n '/gpu_check summary/,$p' $O/check.txt | head -30
timeout 100 python3 benchmarks/generate_gpu.py --model gpt2-large --dtype float32 --paths forge,layers --repeats 2 > $O/large_f32.txt 2>&1
echo "== large float32"; grep -E "^forge|^bandwidth" $O/large_f32.txt | cut -c1-150
for dt in bf16 float32; do
  timeout 60 python3 benchmarks/generate_gpu.py --dtype $dt --paths forge --repeats 3 > $O/small_$dt.txt 2>&1
  echo "== 124M $dt"; grep -E "^forge" $O/small_$dt.txt | cut -c1-120
done
