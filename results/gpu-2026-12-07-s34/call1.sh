#!/usr/bin/env bash
# Session 34, call 1 (carry .whl and .data; at most ~560 s): the dk/dv kernel of 128 keys a block
# (its diff, applied by branch.sh; compile-checked) on a copy of the tree:
# 1. its 26 tests; the backward's timings at B=32;
# 2. the trainer at B=32 with r64 (main's kernel) / r128h / r128 alternated (forge-ml only);
#    expected: r128h takes the dk/dv kernel ~0.46 -> ~0.38 ms a layer, ~+1.5% tok/s; r128 slower;
# 3. issue 10's B=32 row against torch.compile with r128h (the candidate default);
# 4. with the time left: flash_hopper.cu's whole test file and the step/model tests with
#    FORGE_WGMMA_DKDV=r128h; issue 11's batch-1 bf16 row with transformers (main's decode).
# Few files under $OUT (the device tool returns a limited count): figures are printed.
set -u
OUT=${OUT:-/tmp/s34c1}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
L=${LIMIT:-540}   # the call's own budget in seconds (a shorter call: LIMIT=400; about 150: the tests and one trainer run)
B=/tmp/dk; . results/gpu-2026-12-07-s34/branch.sh
export PYTHONPATH=$B/src:/tmp/forge_site
(cd $B && timeout $((L < 300 ? L / 2 : 150)) python3 -m pytest -q -x -p no:cacheprovider -n 4 tests/test_cuda_flash_hopper.py \
    -k "dkdv_128" > /tmp/dkdv_tests.log 2>&1; echo "dkdv tests rc=$?"; tail -2 /tmp/dkdv_tests.log)
[ $L -ge 250 ] && timeout 45 python3 $B/benchmarks/attention_cuda.py --batch 32 --no-v1 --reps 20 2>&1 | grep -E "bwd |ERROR"
echo "($((SECONDS - t0)) s)"
for r in 1 2; do for m in r64 r128h r128; do
  [ $r = 2 ] && [ $m = r128 ] && continue
  [ $m = r128 ] && [ $L -lt 500 ] && continue
  [ $((SECONDS - t0)) -gt $((L - 45)) ] && continue
  FORGE_WGMMA_DKDV=$m timeout 60 python3 $B/benchmarks/train_e2e.py --data .data/tinyshakespeare.txt \
      --rows gpt2-b32 --peers forge --steps 30 > /tmp/e2e_$m.log 2>&1
  echo "$m round $r: $(grep -E '^gpt2-b32 +forge' /tmp/e2e_$m.log | tail -1)"
done; done; echo "($((SECONDS - t0)) s)"
[ $((SECONDS - t0)) -lt $((L - 100)) ] && FORGE_WGMMA_DKDV=r128h timeout $((L - (SECONDS - t0))) python3 $B/benchmarks/train_e2e.py --data .data/tinyshakespeare.txt \
    --rows gpt2-b32 --peers forge,compile --steps 20 --json "$OUT/e2e_compile_r128h.json" > "$OUT/e2e_compile_r128h.log" 2>&1
tail -3 "$OUT/e2e_compile_r128h.log" 2>/dev/null; echo "($((SECONDS - t0)) s)"
if [ $((SECONDS - t0)) -lt $((L - 140)) ]; then
  (cd $B && FORGE_WGMMA_DKDV=r128h timeout $((L - (SECONDS - t0) - 70)) python3 -m pytest -q -p no:cacheprovider -n 8 \
      tests/test_cuda_flash_hopper.py tests/test_cuda_train_step.py tests/test_cuda_model.py tests/test_cuda_flash.py \
      > /tmp/r128h_tests.log 2>&1; echo "hopper/step/model/flash tests with r128h rc=$?"; tail -2 /tmp/r128h_tests.log)
  echo "($((SECONDS - t0)) s)"
fi
if [ $((SECONDS - t0)) -lt $((L - 100)) ]; then
  # where the bf16 batch-1 token's time goes on this machine (the last trace is an H100's)
  PYTHONPATH=$PWD/src timeout 40 python3 benchmarks/decode_gpu.py --dtype bf16 --pos 1000 --fused layers --trace --roof 2>&1 | tail -23
  echo "($((SECONDS - t0)) s)"
fi
if [ $((SECONDS - t0)) -lt $((L - 60)) ]; then
  PYTHONPATH=$PWD/src:/tmp/forge_site timeout $((L + 10 - (SECONDS - t0))) python3 benchmarks/generate_gpu.py \
      --dtype bf16 --paths forge,hf --repeats 2 2>&1 | tr '\r' '\n' | grep -v "Loading weights" | tail -4
fi
echo "($((SECONDS - t0)) s)"
