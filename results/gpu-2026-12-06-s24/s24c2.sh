#!/usr/bin/env bash
# session 24, call 2: trace of the new step (bf16, f32), decode tests, A/B against f580121
set -u
O=${OUT:-/tmp/out}; B=.scratch/f580121
export PYTHONUNBUFFERED=1
for dt in bf16 float32; do
  timeout 150 python3 benchmarks/decode_gpu.py --dtype $dt --fused layers --pos 1000 --trace > $O/trace_$dt.txt 2>&1
  echo "== trace $dt"; tail -42 $O/trace_$dt.txt
done
PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py > $O/tests.txt 2>&1
echo "== tests"; tail -3 $O/tests.txt
for r in 1 2; do for t in $B .; do for dt in bf16 float32; do n=$([ $t = . ] && echo new || echo prev)
  timeout 120 python3 $t/benchmarks/generate_gpu.py --dtype $dt --paths forge > $O/gen_${n}_${dt}_$r.txt 2>&1
  echo "round $r $n $dt: $(grep -m1 '^forge-ml' $O/gen_${n}_${dt}_$r.txt)"
done; done; done
