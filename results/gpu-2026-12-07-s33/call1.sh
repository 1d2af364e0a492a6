#!/usr/bin/env bash
# Session 33, call 1 (carry .whl and .data; about 450 s): the one-kernel attention backward
# (FORGE_WGMMA_BWD=fused) tested, timed at the trainer's shape and in the trainer against the
# split kernels (alternated), the model and step tests with it on, then the GPU suite on main.
set -u
OUT=${OUT:-/tmp/s33c1}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
t0=$SECONDS
timeout 180 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_wgmma_probe.py \
    tests/test_cuda_flash_hopper.py -k "fused or tt" > "$OUT/fused_tests.log" 2>&1
echo "fused tests rc=$? ($((SECONDS - t0)) s)"; tail -3 "$OUT/fused_tests.log"
timeout 100 python3 benchmarks/attention_cuda.py --batch 32 --no-v1 --reps 20 > "$OUT/attention_b32.log" 2>&1
grep -E "bwd |ERROR" "$OUT/attention_b32.log"; echo "($((SECONDS - t0)) s)"
for r in 1 2; do for m in split fused; do
  FORGE_WGMMA_BWD=$m timeout 90 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt \
      --rows gpt2-b32 --peers forge --steps 30 --json "$OUT/e2e_${m}_$r.json" > "$OUT/e2e_${m}_$r.log" 2>&1
  echo "$m round $r: $(grep -E '^gpt2-b32 +forge' "$OUT/e2e_${m}_$r.log" | tail -1)"
done; done; echo "($((SECONDS - t0)) s)"
FORGE_WGMMA_BWD=fused timeout 150 python3 -m pytest -q -x -n 4 -p no:cacheprovider \
    tests/test_cuda_train_step.py tests/test_cuda_model.py > "$OUT/fused_step_model_tests.log" 2>&1
echo "step/model tests with fused rc=$? ($((SECONDS - t0)) s)"; tail -2 "$OUT/fused_step_model_tests.log"
SECTIONS=tests TEST_WORKERS=8 TEST_TIMEOUT=200 OUT="$OUT/suite" bash scripts/gpu_check.sh > "$OUT/suite.log" 2>&1
grep -E "passed|failed|error" "$OUT/suite.log" | tail -3; echo "($((SECONDS - t0)) s)"
# with the time left: issue 10's B=32 row against torch.compile (fused as the A/B chose it is
# not assumed: the default), issue 11's batch-1 bf16 row with transformers
if [ $((SECONDS - t0)) -lt 430 ]; then
  timeout 100 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 \
      --peers forge,compile --steps 20 --json "$OUT/e2e_compile.json" > "$OUT/e2e_compile.log" 2>&1
  tail -3 "$OUT/e2e_compile.log"; echo "($((SECONDS - t0)) s)"
fi
if [ $((SECONDS - t0)) -lt 520 ]; then
  timeout 70 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge,hf --repeats 2 2>&1 \
      | tr '\r' '\n' | grep -v "Loading weights" > "$OUT/generate_bf16.log"; tail -4 "$OUT/generate_bf16.log"
fi
