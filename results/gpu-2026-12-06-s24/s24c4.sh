#!/usr/bin/env bash
# session 24, call 4: the GPU suite on main, generation with its peers, the carveout A/B
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
git log --oneline -1 2>/dev/null
SECTIONS="tests" OUT=$O/check timeout 330 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "== suite"; grep -E "^tests:|^(FAILED|ERROR) " $O/check.txt | head -20
timeout 220 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge,perop,hf --sampling --repeats 3 > $O/gen_bf16.txt 2>&1
echo "== generate bf16"; cat $O/gen_bf16.txt | grep -v "^\s*$" | tail -40
timeout 100 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge,hf --repeats 2 > $O/gen_f32.txt 2>&1
echo "== generate float32"; grep -v "^\s*$" $O/gen_f32.txt | tail -8
for r in 1 2; do for t in . .scratch/s24-carveout; do for dt in bf16 float32; do n=$(basename $t)
  timeout 120 python3 $t/benchmarks/generate_gpu.py --dtype $dt --paths forge > $O/ab_${n}_${dt}_$r.txt 2>&1
  echo "round $r $n $dt: $(grep -m1 '^forge-ml' $O/ab_${n}_${dt}_$r.txt | cut -c1-40)"
done; done; done
