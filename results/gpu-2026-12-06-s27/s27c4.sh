#!/usr/bin/env bash
# session 27, call 4: main after the review's mends (562f536) + the server's wake-ups batched and one-choice
# streams without a queue (working tree): the engine's GPU tests, the engine alone profiled (engine_prof.py),
# serve_load in three trees (base bf30bfb, pre 562f536, now), then the GPU suite (tests section)
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=$ROOT/src:/tmp/forge_site
timeout 90 python3 -m pytest tests/test_batch_engine.py tests/test_generate.py -m cuda -q -n 4 -p no:cacheprovider -rfEs 2>&1 | tail -6 | tee $O/tests_engine.txt
timeout 100 python3 .scratch/engine_prof.py cuda 2>&1 | tail -40 | tee $O/engine_prof.txt
for r in 1 2; do for t in s27pre now; do
  if [ $t = now ]; then d=$ROOT; else d=$ROOT/.scratch/$t; fi
  echo "== serve_load round $r tree $t" | tee -a $O/serve_ab.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 60 python3 benchmarks/serve_load.py 2>&1 | tail -13) | tee -a $O/serve_ab.txt
done; done
TEST_TIMEOUT=200 SECTIONS="tests" OUT=$O/check timeout 260 bash scripts/gpu_check.sh > $O/check.log 2>&1
tail -2 $O/check/tests.log; tail -2 $O/check/tests_twins.log
