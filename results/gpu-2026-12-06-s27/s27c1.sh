#!/usr/bin/env bash
# session 27, call 1. Root: main (the engine's device choice, e21da45) + s26-head-rows cherry-picked (s27-merge).
# Base (.scratch/s27base): main at bf30bfb (before both). (1) decode + engine + generate GPU tests on root;
# (2) serve_load base vs root; (3) generate_gpu --rows base vs root.
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD/.scratch/s27m; B=$PWD/.scratch/s27base; cd $ROOT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
pip install -q --no-index --no-deps --target /tmp/forge_site $ROOT/../../.whl/serve/*.whl 2>&1 | tail -2
PYTHONPATH=$ROOT/src:/tmp/forge_site timeout 120 python3 -m pytest tests/test_cuda_decode_model.py -q -n 4 -p no:cacheprovider -rfEs 2>&1 | tail -12 | tee $O/tests_decode.txt
PYTHONPATH=$ROOT/src:/tmp/forge_site timeout 90 python3 -m pytest tests/test_batch_engine.py tests/test_generate.py tests/test_beam.py tests/test_cuda_sampling.py -m cuda -q -n 4 -p no:cacheprovider -rfEs 2>&1 | tail -12 | tee $O/tests_engine.txt
for t in base root; do
  if [ $t = base ]; then d=$B; else d=$ROOT; fi
  echo "== serve_load tree $t" | tee -a $O/serve_ab.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 110 python3 benchmarks/serve_load.py 2>&1 | tail -14) | tee -a $O/serve_ab.txt
done
for t in base root; do
  if [ $t = base ]; then d=$B; else d=$ROOT; fi
  echo "== rows tree $t" | tee -a $O/rows_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 90 python3 benchmarks/generate_gpu.py --dtype bf16 --rows 1,2,3,4 --rows-modes greedy --repeats 2 2>&1) | tee -a $O/rows_ab.txt
done
