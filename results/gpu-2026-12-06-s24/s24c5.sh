#!/usr/bin/env bash
# session 24, call 5: A/B main vs s24-sum (the mean from the gather's sums), its decode tests and trace
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
T=.scratch/s24-sum
(cd $T && PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py tests/test_cuda_sampling.py -n 4 > $O/tests.txt 2>&1)
echo "== tests s24-sum"; tail -2 $O/tests.txt
timeout 100 python3 $T/benchmarks/decode_gpu.py --dtype bf16 --fused layers --pos 1000 --trace > $O/trace.txt 2>&1
echo "== trace s24-sum"; tail -34 $O/trace.txt
for r in 1 2; do for t in . $T; do for dt in bf16 float32; do n=$(basename $t)
  timeout 120 python3 $t/benchmarks/generate_gpu.py --dtype $dt --paths forge > $O/ab_${n}_${dt}_$r.txt 2>&1
  echo "round $r $n $dt: $(grep -m1 '^forge-ml' $O/ab_${n}_${dt}_$r.txt | cut -c1-40)"
done; done; done
