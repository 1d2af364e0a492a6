#!/usr/bin/env bash
# session 25, call 1: the GPU suite on main + the float32 XL layout fix; XL decoding by path;
# the generation table (bf16 with sampling and transformers, float32)
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
SECTIONS="tests" OUT=$O/check timeout 300 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "== suite"; grep -E "^tests:|^(FAILED|ERROR) | passed| failed" $O/check.txt | head -20
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_decode_model.py -k "every_gpt2_width" -rA 2>&1 | grep -E "PASS|FAIL|SKIP|passed|failed" | head -20
for dt in float32 bf16; do
  timeout 150 python3 benchmarks/generate_gpu.py --model gpt2-xl --dtype $dt --paths forge,perop --new-tokens 300 --repeats 2 > $O/xl_$dt.txt 2>&1
  echo "== XL $dt"; grep -v "^\s*$" $O/xl_$dt.txt | tail -5
done
timeout 200 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge,perop,hf --sampling --repeats 3 > $O/gen_bf16.txt 2>&1
echo "== generate bf16"; grep -v "^\s*$" $O/gen_bf16.txt | grep -v Loading | tail -30
timeout 60 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf --repeats 2 > $O/gen_f32.txt 2>&1
echo "== generate float32"; grep -v "^\s*$" $O/gen_f32.txt | grep -v Loading | tail -6
