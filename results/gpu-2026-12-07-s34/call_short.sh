#!/usr/bin/env bash
# A short call (about 150 s, carry .whl and .data) when little device time is left: the dk/dv
# kernel of 128 keys a block (s33-dkdv128.diff on a copy of the tree): its tests, the
# backward's per-layer timings at B=32, then one trainer run each of r64 and r128h if time is left.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
B=/tmp/dk; rm -rf $B; mkdir -p $B; cp -r src tests benchmarks scripts README.md pyproject.toml conftest.py $B/
(cd $B && git apply "$OLDPWD/results/gpu-2026-12-07-s33/s33-dkdv128.diff") && echo "branch applied"
export PYTHONPATH=$B/src
(cd $B && timeout 70 python3 -m pytest -q -x -p no:cacheprovider -n 4 tests/test_cuda_flash_hopper.py \
    -k "dkdv_128" 2>&1 | tail -2; echo "dkdv tests rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)")
timeout 40 python3 $B/benchmarks/attention_cuda.py --batch 32 --no-v1 --reps 20 2>&1 | grep -E "bwd |ERROR"
echo "($((SECONDS - t0)) s)"
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
for m in r64 r128h; do
  [ $((SECONDS - t0)) -gt 110 ] && break
  FORGE_WGMMA_DKDV=$m PYTHONPATH=$B/src:/tmp/forge_site timeout 45 python3 $B/benchmarks/train_e2e.py \
      --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge --steps 30 > /tmp/e2e_$m.log 2>&1
  echo "$m: $(grep -E '^gpt2-b32 +forge' /tmp/e2e_$m.log | tail -1) ($((SECONDS - t0)) s)"
done
