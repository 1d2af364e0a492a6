#!/usr/bin/env bash
# Session 41, call 3 (carry .scratch/base41, .scratch/early0, .scratch/early1; about 200 s, on
# call 2's warm H100): the streamed head with 0, 1 or 3 (this tree) of a warp's slots asked
# for before the wait, against main (base41): the decode tests of the two variants, then
# batch-1 greedy generate(), bf16 and float32, one round each, the trees in turn.
set -u
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
for tree in .scratch/early0 .scratch/early1; do
  (cd $tree && PYTHONPATH=$PWD/src timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider \
      tests/test_cuda_decode_model.py 2>&1 | tail -1)
done
echo "(all $((SECONDS - t0)) s)"
OUT=$O/ab timeout 150 bash scripts/ab_generate.sh .scratch/base41,.scratch/early0,.scratch/early1 1 1 2>&1 | tail -4
OUT=$O/ab32 GEN_ARGS="--dtype float32" timeout 150 bash scripts/ab_generate.sh .scratch/base41,.scratch/early0,.scratch/early1 1 1 2>&1 | tail -4
echo "(all $((SECONDS - t0)) s)"
