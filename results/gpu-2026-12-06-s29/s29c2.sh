#!/usr/bin/env bash
# session 29, call 2: the engine's prefill replayed from graphs per padded length (working tree)
# against main's HEAD (.scratch/s29head): GPU tests of the engine, then first-token time alone
# and serve_load with 512-token prompts, each tree in turn
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD; BASE=$ROOT/.scratch/s29head
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $O/gpu.txt
pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl 2>&1 | tail -1
PYTHONPATH=$ROOT/src timeout 150 python3 -m pytest tests -m cuda --ignore-glob='tests/test_cuda*' --ignore=tests/backends --ignore=tests/cuda_probes --ignore=tests/test_serve.py -q -p no:cacheprovider -rfEs -n 4 2>&1 | tail -4 | tee $O/tests_twins.txt
for t in base new; do
  if [ $t = new ]; then d=$ROOT; else d=$BASE; fi
  echo "== prefill alone, tree $t" | tee -a $O/prefill_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 90 python3 $ROOT/.scratch/prefill_time.py 2>&1 | tail -6) | tee -a $O/prefill_ab.txt
done
for t in base new base new; do
  if [ $t = new ]; then d=$ROOT; else d=$BASE; fi
  echo "== serve_load 512-token prompts, tree $t" | tee -a $O/serve_long.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 90 python3 benchmarks/serve_load.py --prompt-tokens 512 --max-tokens 64 --clients 32 --rounds 1 2>&1 | grep -v "^{" | tail -14) | tee -a $O/serve_long.txt
done
