#!/usr/bin/env bash
# session 24, call 3: A/B of 6135fcf (attention in flight), 150e633 (cluster push), this (push + late trigger)
set -u
O=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
for t in .scratch/150e633 .; do n=$([ $t = . ] && echo late || echo push)
  timeout 150 python3 $t/benchmarks/decode_gpu.py --dtype bf16 --fused layers --pos 1000 --trace > $O/trace_$n.txt 2>&1
  echo "== trace $n"; tail -38 $O/trace_$n.txt
done
PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py > $O/tests.txt 2>&1
echo "== tests this"; tail -3 $O/tests.txt
for r in 1 2; do for t in .scratch/6135fcf .scratch/150e633 .; do for dt in bf16 float32; do n=$(basename $t)
  timeout 120 python3 $t/benchmarks/generate_gpu.py --dtype $dt --paths forge > $O/gen_${n}_${dt}_$r.txt 2>&1
  echo "round $r $n $dt: $(grep -m1 '^forge-ml' $O/gen_${n}_${dt}_$r.txt | cut -c1-40)"
done; done; done
