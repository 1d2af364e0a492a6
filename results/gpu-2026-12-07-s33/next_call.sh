#!/usr/bin/env bash
# For the next session's first device call (carry .whl and .data; about 500 s; an H200 is the
# targets' machine: kind nvidia-h200):
#   bash results/gpu-2026-12-07-s33/next_call.sh
# 1. The two targets' rows on main (issue 10's B=32 against torch.compile; issue 11's batch-1
#    bf16 and float32 with transformers).
# 2. s33-dkdv128.diff (the dk/dv kernel for 128 keys a block, FORGE_WGMMA_DKDV r128 / r128h;
#    compile-checked only) on a copy of the tree: its tests, the backward's timings at B=32,
#    and the trainer with r64 (main's kernel), r128h and r128 alternated.
#    Expected: r128h (two warpgroups on each q and dout tile, 127 registers, two blocks an
#    SM) takes the dk/dv kernel from ~0.46 toward ~0.38 ms a layer at B=32 (the dq kernel's
#    r64 -> r128 moved it 22%): about -1 ms a step, +1.5% in the trainer; r128 (195
#    registers, one block an SM) likely slower.
# 3. The GPU suite on main.
# Few files under $OUT (the device tool returns a limited count).
set -u
OUT=${OUT:-/tmp/next_call}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
t0=$SECONDS
timeout 100 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 \
    --peers forge,compile --steps 20 --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
tail -3 "$OUT/e2e.log"; echo "($((SECONDS - t0)) s)"
for dt in bf16 float32; do
  timeout 90 python3 benchmarks/generate_gpu.py --dtype $dt --paths forge,hf --repeats 2 2>&1 \
      | tr '\r' '\n' | grep -v "Loading weights" > "$OUT/generate_$dt.log"; tail -4 "$OUT/generate_$dt.log"
done; echo "($((SECONDS - t0)) s)"
# 2. the dk/dv branch on a copy
B=/tmp/dk; rm -rf $B; mkdir -p $B; cp -r src tests benchmarks scripts README.md pyproject.toml conftest.py $B/
(cd $B && git apply "$OLDPWD/results/gpu-2026-12-07-s33/s33-dkdv128.diff") && echo "branch applied"
(cd $B && PYTHONPATH=$B/src:/tmp/forge_site timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_flash_hopper.py -k "dkdv_128" > "$OUT/dkdv_tests.log" 2>&1; echo "dkdv tests rc=$?"; tail -3 "$OUT/dkdv_tests.log")
PYTHONPATH=$B/src timeout 100 python3 $B/benchmarks/attention_cuda.py --batch 32 --no-v1 --reps 20 2>&1 \
    | grep -E "bwd |ERROR" | tee "$OUT/dkdv_attention_b32.txt"; echo "($((SECONDS - t0)) s)"
for r in 1 2; do for m in r64 r128h r128; do
  FORGE_WGMMA_DKDV=$m PYTHONPATH=$B/src:/tmp/forge_site timeout 60 python3 $B/benchmarks/train_e2e.py \
      --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge --steps 30 > /tmp/e2e_$m.log 2>&1
  echo "$m round $r: $(grep -E '^gpt2-b32 +forge' /tmp/e2e_$m.log | tail -1)" | tee -a "$OUT/dkdv_ab.txt"
done; done; echo "($((SECONDS - t0)) s)"
# 3. the GPU suite on main
SECTIONS=tests TEST_WORKERS=8 TEST_TIMEOUT=200 OUT=/tmp/next_call_suite bash scripts/gpu_check.sh \
    > "$OUT/suite.log" 2>&1
grep -E "passed|failed|error" "$OUT/suite.log" | tail -3; echo "($((SECONDS - t0)) s)"
