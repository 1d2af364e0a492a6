#!/usr/bin/env bash
# session 27, call 6: branch s27-overlap (root) against main (.scratch/s27main): engine GPU tests, engine alone, serve_load
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD; M=$ROOT/.scratch/s27main
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
PYTHONPATH=$ROOT/src:/tmp/forge_site timeout 60 python3 -m pytest tests/test_batch_engine.py -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tail -3 | tee $O/tests_engine.txt
for t in main overlap; do
  if [ $t = main ]; then d=$M; else d=$ROOT; fi
  echo "== engine alone, tree $t" | tee -a $O/engine_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 45 python3 $ROOT/.scratch/engine_prof.py cuda --no-profile 2>&1 | tail -3) | tee -a $O/engine_ab.txt
done
for t in main overlap; do
  if [ $t = main ]; then d=$M; else d=$ROOT; fi
  echo "== serve_load tree $t" | tee -a $O/serve_ab.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 45 python3 benchmarks/serve_load.py 2>&1 | grep "tokens/s\|steps/s\|first token\|lost") | tee -a $O/serve_ab.txt
done
