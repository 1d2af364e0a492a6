#!/usr/bin/env bash
# session 28, call 2: the lost-row sign (review mends) on the GPU; the engine with the overlap (.scratch/s28ov) A/B
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD; V=$ROOT/.scratch/s28ov
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
PYTHONPATH=$ROOT/src timeout 150 python3 -m pytest tests/test_cuda_sampling.py tests/test_cuda_decode_model.py tests/backends -k "cuda and (sample or greedy or no_finite or decode)" -q -p no:cacheprovider -rfEs -n 4 2>&1 | tail -4 | tee $O/tests_main.txt
PYTHONPATH=$ROOT/src timeout 100 python3 -m pytest tests/test_generate.py tests/test_batch_engine.py tests/test_beam.py -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tail -3 | tee -a $O/tests_main.txt
(cd $V && PYTHONPATH=$V/src timeout 60 python3 -m pytest tests/test_batch_engine.py -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tail -2) | tee $O/tests_overlap.txt
pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
for t in main overlap; do
  if [ $t = main ]; then d=$ROOT; else d=$V; fi
  echo "== engine alone, tree $t" | tee -a $O/engine_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 40 python3 $ROOT/.scratch/engine_prof.py cuda --no-profile 2>&1 | tail -2) | tee -a $O/engine_ab.txt
done
for t in main overlap; do
  if [ $t = main ]; then d=$ROOT; else d=$V; fi
  echo "== serve_load tree $t" | tee -a $O/serve_ab.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 45 python3 benchmarks/serve_load.py 2>&1 | grep "tokens/s\|steps/s\|first token\|lost") | tee -a $O/serve_ab.txt
done
for t in main; do
  if [ $t = main ]; then d=$ROOT; else d=$ROOT/.scratch/s28base; fi
  echo "== serve_load 512-token prompts, tree $t" | tee -a $O/serve_long.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 60 python3 benchmarks/serve_load.py --prompt-tokens 512 --max-tokens 64 --clients 32 --rounds 1 2>&1 | grep "tokens/s\|steps/s\|first token\|lost") | tee -a $O/serve_long.txt
done
