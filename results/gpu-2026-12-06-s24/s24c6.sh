#!/usr/bin/env bash
# session 24, call 6: the GPU suite on the final main, generation with its peers (bf16 table, float32)
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
SECTIONS="tests" OUT=$O/check timeout 300 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "== suite"; grep -E "^tests:|^(FAILED|ERROR) " $O/check.txt | head -20
timeout 200 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge,perop,hf --sampling --repeats 3 > $O/gen_bf16.txt 2>&1
echo "== generate bf16"; grep -v "^\s*$" $O/gen_bf16.txt | grep -v Loading | tail -30
timeout 60 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf --repeats 2 > $O/gen_f32.txt 2>&1
echo "== generate float32"; grep -v "^\s*$" $O/gen_f32.txt | grep -v Loading | tail -6
