#!/usr/bin/env bash
# session 24, call 1: the layers step's phases (trace) before/after the vectors' prefetch, tests, A/B
set -u
O=${OUT:-/tmp/out}; B=.scratch/c1ec631
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $O/gpu.txt
for t in $B .; do n=$([ $t = . ] && echo new || echo base)
  timeout 150 python3 $t/benchmarks/decode_gpu.py --dtype bf16 --fused layers --pos 1000 --trace > $O/trace_$n.txt 2>&1
  echo "== trace $n"; cat $O/trace_$n.txt | tail -45
done
PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py > $O/tests.txt 2>&1
echo "== tests"; tail -3 $O/tests.txt
for r in 1 2; do for t in $B .; do for dt in bf16 float32; do n=$([ $t = . ] && echo new || echo base)
  timeout 120 python3 $t/benchmarks/generate_gpu.py --dtype $dt --paths forge > $O/gen_${n}_${dt}_$r.txt 2>&1
  echo "round $r $n $dt: $(grep -m1 '^forge-ml' $O/gen_${n}_${dt}_$r.txt)"
done; done; done
