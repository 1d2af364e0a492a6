#!/usr/bin/env bash
# session 28, call 1: the GPU suite and CLI on main; generation and long-prompt serving before/after
# (.scratch/s28base = 9b209f7, the session's start); then branch s28-overlap (.scratch/s28ov) against main
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD; V=$ROOT/.scratch/s28ov; BASE=$ROOT/.scratch/s28base
OUT=$O/check SECTIONS="tests" bash scripts/gpu_check.sh > $O/gpu_check.txt 2>&1
echo "gpu_check rc $?" >> $O/gpu_check.txt
tail -45 $O/gpu_check.txt
for t in base main; do
  if [ $t = main ]; then d=$ROOT; else d=$BASE; fi
  echo "== generate tree $t" | tee -a $O/gen_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 100 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge --sampling --modes greedy,top-p --repeats 2 2>&1 | grep -E "^forge|greedy|top-p|batch") | tee -a $O/gen_ab.txt
done
for t in base main; do
  if [ $t = main ]; then d=$ROOT; else d=$BASE; fi
  echo "== serve_load 512-token prompts, tree $t" | tee -a $O/serve_long.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 80 python3 benchmarks/serve_load.py --prompt-tokens 512 --max-tokens 64 --clients 32 --rounds 1 2>&1 | grep "tokens/s\|steps/s\|first token\|lost") | tee -a $O/serve_long.txt
done
(cd $V && PYTHONPATH=$V/src:/tmp/forge_site timeout 90 python3 -m pytest tests/test_batch_engine.py tests/test_serve.py -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tail -3) | tee $O/tests_engine_overlap.txt
for t in main overlap; do
  if [ $t = main ]; then d=$ROOT; else d=$V; fi
  echo "== engine alone, tree $t" | tee -a $O/engine_ab.txt
  (cd $d && PYTHONPATH=$d/src timeout 45 python3 $ROOT/.scratch/engine_prof.py cuda --no-profile 2>&1 | tail -3) | tee -a $O/engine_ab.txt
done
for t in main overlap; do
  if [ $t = main ]; then d=$ROOT; else d=$V; fi
  echo "== serve_load tree $t" | tee -a $O/serve_ab.txt
  (cd $d && PYTHONPATH=$d/src:/tmp/forge_site timeout 45 python3 benchmarks/serve_load.py 2>&1 | grep "tokens/s\|steps/s\|first token\|lost") | tee -a $O/serve_ab.txt
done
