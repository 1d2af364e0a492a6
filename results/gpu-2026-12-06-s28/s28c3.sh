#!/usr/bin/env bash
# session 28, call 3 (minimal): the lost-row sign's GPU tests on main; the overlap tree's engine tests and A/B
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD; V=$ROOT/.scratch/s28ov
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $O/gpu.txt
PYTHONPATH=$ROOT/src timeout 75 python3 -m pytest tests/test_cuda_sampling.py tests/backends -k "cuda and (sample or greedy or no_finite)" -q -p no:cacheprovider -rfEs -n 4 2>&1 | tail -3 | tee $O/tests_main.txt
PYTHONPATH=$ROOT/src timeout 60 python3 -m pytest tests/test_generate.py tests/test_batch_engine.py -m cuda -q -p no:cacheprovider -rfEs -n 2 2>&1 | tail -3 | tee -a $O/tests_main.txt
(cd $V && PYTHONPATH=$V/src timeout 40 python3 -m pytest tests/test_batch_engine.py -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tail -2) | tee $O/tests_overlap.txt
for t in main overlap; do
  if [ $t = main ]; then d=$ROOT; else d=$V; fi
  echo "== engine alone, tree $t" | tee -a $O/engine_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 30 python3 $ROOT/.scratch/engine_prof.py cuda --no-profile 2>&1 | tail -2) | tee -a $O/engine_ab.txt
done
