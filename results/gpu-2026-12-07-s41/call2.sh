#!/usr/bin/env bash
# Session 41, call 2 (carry .scratch/base41; about 400 s on an H100): the LM head of the layers
# decoding step streamed through shared memory (each warp's rows through 3 slots, the first
# asked for before the wait) against main before it (.scratch/base41): the decode tests, the
# step's phases at position 1,000 (DL_TRACE, bf16, this tree), then batch-1
# greedy generate() A/B (bf16 two rounds, float32 one).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_cuda_decode_model.py tests/test_cuda_sampling.py 2>&1 | tail -4
echo "(all $((SECONDS - t0)) s)"
for dt in bf16; do
  for tree in .; do
    PYTHONPATH=$tree/src timeout 90 python3 $tree/benchmarks/decode_gpu.py --fused layers \
      --trace --dtype $dt --pos 1000 --reps 50 > $O/trace_${dt}_$(basename $tree).txt 2>&1
    echo "== $dt $tree"; grep -E "decode_head|logit rows|wait \(PDL\)|gather x''|the step," \
      $O/trace_${dt}_$(basename $tree).txt | tail -6
  done
done
echo "(all $((SECONDS - t0)) s)"
OUT=$O/ab timeout 260 bash scripts/ab_generate.sh .scratch/base41 2 1 2>&1 | tail -4
echo "(all $((SECONDS - t0)) s)"
OUT=$O/ab32 GEN_ARGS="--dtype float32" timeout 150 bash scripts/ab_generate.sh .scratch/base41 1 1 2>&1 | tail -2
echo "(all $((SECONDS - t0)) s)"
