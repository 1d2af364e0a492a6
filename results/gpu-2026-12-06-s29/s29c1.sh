#!/usr/bin/env bash
# session 29, call 1: batch-1 generate A/B (base = main at the session's start; qkv = the qkv
# partials stored into every block; both = qkv + the head's L2 hint), then the GPU suite from
# the tree with both (.scratch/s29t = main's HEAD + the two CUDA files)
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
ROOT=$PWD
gen() {  # tree name dtype
  (cd $ROOT/.scratch/$1 && PYTHONPATH=$ROOT/.scratch/$1/src timeout 60 python3 benchmarks/generate_gpu.py --dtype $3 --paths forge --repeats 3 2>&1 | grep -E "^forge-ml:" | sed "s/^/$2 $3 /") | tee -a $O/gen_ab.txt
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $O/gpu.txt
for r in 1 2; do
  gen s29base base bf16; gen s29qkv qkv bf16; gen s29t both bf16
done
gen s29base base float32; gen s29qkv qkv float32; gen s29t both float32
(cd .scratch/s29t && PYTHONPATH=$PWD/src timeout 120 python3 benchmarks/decode_gpu.py --dtype bf16 --fused layers --trace > $O/trace_both.txt 2>&1; tail -30 $O/trace_both.txt)
(cd .scratch/s29t && OUT=$O/check SECTIONS="tests" TEST_TIMEOUT=200 bash scripts/gpu_check.sh > $O/gpu_check.txt 2>&1; echo "gpu_check rc $?" >> $O/gpu_check.txt; tail -25 $O/gpu_check.txt)
