#!/usr/bin/env bash
# The second call on the same warm machine (after call1.sh; carry .whl and .data):
#   bash results/gpu-2026-12-07-s34/call2.sh
# The dk/dv kernel of 128 keys a block (applied by branch.sh) as the default would run it:
# FORGE_WGMMA_DKDV=r128h exported on a copy of the tree with the diff applied,
# 1. flash_hopper.cu's whole test file and the probe (each as gpu_check's wgmma section runs them),
#    and the flash / model / step tests;
# 2. the trainer's other rows (B=16, T=4096 B=8, medium B=16) with r64 and r128h alternated.
set -u
OUT=${OUT:-/tmp/call2}; mkdir -p "$OUT"
B=/tmp/dk2; . results/gpu-2026-12-07-s34/branch.sh
t0=$SECONDS
export FORGE_WGMMA_DKDV=r128h
(cd $B && PYTHONPATH=$B/src:/tmp/forge_site timeout 200 python3 -m pytest -q -p no:cacheprovider \
    -n 4 tests/test_cuda_flash_hopper.py > "$OUT/hopper_tests.log" 2>&1; echo "flash_hopper tests rc=$?"; tail -2 "$OUT/hopper_tests.log")
(cd $B && PYTHONPATH=$B/src:/tmp/forge_site timeout 100 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_wgmma_probe.py > /tmp/probe.log 2>&1; echo "probe rc=$?"; tail -1 /tmp/probe.log)
(cd $B && PYTHONPATH=$B/src:/tmp/forge_site timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 \
    tests/test_cuda_flash.py tests/test_cuda_flash_dropout.py tests/test_cuda_model.py tests/test_cuda_train_step.py \
    > "$OUT/flash_step_tests.log" 2>&1; echo "flash/step/model tests rc=$?"; tail -2 "$OUT/flash_step_tests.log")
echo "($((SECONDS - t0)) s)"
unset FORGE_WGMMA_DKDV
for row in gpt2-b16 gpt2-t4096 medium; do for m in r64 r128h r64 r128h; do
  [ $row = medium ] && [ $((SECONDS - t0)) -gt 420 ] && break
  FORGE_WGMMA_DKDV=$m PYTHONPATH=$B/src:/tmp/forge_site timeout 70 python3 $B/benchmarks/train_e2e.py \
      --data .data/tinyshakespeare.txt --rows $row --peers forge --steps 20 > /tmp/e2e_$m.log 2>&1
  echo "$row $m: $(grep -E "^$row +forge" /tmp/e2e_$m.log | tail -1)" | tee -a "$OUT/dkdv_rows.txt"
done; done; echo "($((SECONDS - t0)) s)"
