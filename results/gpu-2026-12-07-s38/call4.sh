#!/usr/bin/env bash
# Session 38, call 4 (NOT RUN: the device refused every start after call 3 and the session's
# device time ran out). For the next session, on a tree with fwd-pipelined.diff applied:
#   git archive HEAD src benchmarks | tar -x -C .scratch/base      (main without the diff)
#   git apply results/gpu-2026-12-07-s38/fwd-pipelined.diff
#   run: bash results/gpu-2026-12-07-s38/call4.sh   (carry .whl, .data, .scratch/base; ~180 s)
# The change: the wgmma forward pipelined (tile kb + 1's scores and softmax while tile kb's
# p v runs; one block barrier a tile instead of two; ptxas: 118 registers for the r128 kernel
# (109 before), 107 for the 64-row one (120), no spill, no wgmma serialization). Expected: the
# forward 0.335 -> about 0.29-0.30 ms a layer at B=32 (torch's cuDNN 0.284), the B=32 trainer
# +0.6-1.0%.
# 1. the flash, attention and training-step tests on Hopper;
# 2. the bits: fwd_bits.py saves out and lse for 8 shapes x 64/128 rows from both trees and
#    compares them byte for byte (the same operations per element in the same order);
# 3. the kernels' times at B=32, T=1024, old tree then this one;
# 4. the trainer, old tree and this one (scripts/ab_train.sh, B=32, one round of 12 steps;
#    more rounds where device time allows).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
R=results/gpu-2026-12-07-s38
PYTHONPATH=$PWD/src timeout 100 python3 -m pytest -q -x -n 8 -p no:cacheprovider \
    tests/test_cuda_flash_hopper.py tests/test_cuda_flash.py tests/test_attention_qkv.py \
    tests/test_cuda_train_step.py > /tmp/t4.log 2>&1; echo "tests rc=$?"
grep -E "[0-9]+ passed|failed|rror" /tmp/t4.log | tail -3
echo "($((SECONDS - t0)) s)"
PYTHONPATH=.scratch/base/src python3 $R/fwd_bits.py save /tmp/bits_old 2>&1 | tail -2
PYTHONPATH=src python3 $R/fwd_bits.py save /tmp/bits_new 2>&1 | tail -2
python3 $R/fwd_bits.py cmp /tmp/bits_old /tmp/bits_new 2>&1 | tail -4
for tree in .scratch/base .; do
  echo "== $tree"
  PYTHONPATH=$PWD/$tree/src timeout 40 python3 $tree/benchmarks/attention_cuda.py --batch 32 \
      --no-v1 2>&1 | grep -E "^ *32 fwd|dkdv r128h"
done
echo "($((SECONDS - t0)) s)"
timeout 90 bash scripts/ab_train.sh .scratch/base gpt2-b32 1 12 2>&1 | tail -3
echo "($((SECONDS - t0)) s)"
