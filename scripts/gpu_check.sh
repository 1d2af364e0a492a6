#!/usr/bin/env bash
# One command for the GPU machine: the whole GPU test suite, then the GPU benchmarks.
# Logs go to $OUT (or /tmp/forge_gpu_check when OUT is unset); a summary is printed last.
#   bash scripts/gpu_check.sh            (from anywhere; the package need not be installed)
# Environment: TEST_TIMEOUT / BENCH_TIMEOUT (seconds, defaults 240 / 150), TEST_WORKERS (pytest-xdist
# processes sharing the GPU, default 4), BENCH_ARGS (e.g. "--only gelu --reps 50").
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp/forge_gpu_check}"
mkdir -p "$LOG"
PY="${PYTHON:-python3}"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$LOG/gpu.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$LOG/gpu.txt"
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount(),
          "nvrtc", cupy.cuda.nvrtc.getVersion())
    try:
        print("bfloat16 dtype:", cupy.dtype("bfloat16"))
    except Exception as e:
        import ml_dtypes
        print("bfloat16 via ml_dtypes", ml_dtypes.__version__, cupy.dtype(ml_dtypes.bfloat16), f"({e})")
except Exception as e:
    print("cupy not usable:", e)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda)
except Exception as e:
    print("torch not usable:", e)
PYEOF

echo "== tests (the GPU tests, and the contract suite on every backend; addopts give -q)"
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda*.py tests/backends ${EXTRA_TESTS:-} -rfEs -p no:cacheprovider -n "${TEST_WORKERS:-4}" \
    --durations=8 --junitxml="$LOG/tests.xml" 2>&1 | tee "$LOG/tests.log"
test_rc=${PIPESTATUS[0]}

echo "== benchmarks (benchmarks/ops_cuda.py)"
if [ -z "${SKIP_OPS_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/ops_cuda.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench_ops.log"
  bench_rc=${PIPESTATUS[0]}
else
  echo "(skipped: SKIP_OPS_BENCH is set)" | tee "$LOG/bench_ops.log"; bench_rc=0
fi
timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/attention_cuda.py 2>&1 | tee "$LOG/bench_attention.log"  # flash vs v1 vs torch SDPA

echo "== model benchmarks (training throughput, generation)"
timeout "${TRAIN_TIMEOUT:-200}" "$PY" benchmarks/train_gpu.py --batch "${TRAIN_BATCH:-32}" --steps "${TRAIN_STEPS:-10}" ${TRAIN_ARGS:-} 2>&1 | tee "$LOG/bench_train.log"
timeout "${GEN_TIMEOUT:-120}" "$PY" benchmarks/generate_gpu.py --new-tokens 200 2>&1 | tee "$LOG/bench_generate.log"
timeout "${GEN_TIMEOUT:-120}" "$PY" benchmarks/generate_gpu.py --new-tokens 200 --dtype bf16 2>&1 | tee -a "$LOG/bench_generate.log"
timeout "${GEN_TIMEOUT:-120}" "$PY" benchmarks/decode_gpu.py 2>&1 | tee "$LOG/bench_decode.log"  # where a decoding step's time goes
timeout "${GEN_TIMEOUT:-120}" "$PY" benchmarks/decode_gpu.py --dtype bf16 2>&1 | tee -a "$LOG/bench_decode.log"

echo "== end to end: forge-ml check, and the CLI trainer in bf16 on the GPU"
timeout 120 "$PY" -m forge_ml check 2>&1 | tee "$LOG/check.log"
timeout "${CLI_TIMEOUT:-120}" "$PY" -m forge_ml train --device cuda --dtype bf16 --max-steps 300 \
    --eval-interval 150 --sample-interval 300 --sample-tokens 80 --no-progress --out /tmp/forge_cli_run \
    2>&1 | tail -n 25 | tee "$LOG/cli_train.log"

echo
echo "================ gpu_check summary ================"
echo "gpu:        $(sed -n 2p "$LOG/gpu.txt")"
echo "tests:      exit $test_rc ($( [ "$test_rc" = 0 ] && echo PASS || { [ "$test_rc" = 124 ] && echo TIMEOUT || echo FAIL; } )): $(grep -E '(passed|failed|error|skipped)' "$LOG/tests.log" | tail -n 1)"
grep -E '^(FAILED|ERROR) ' "$LOG/tests.log" | head -n 40
echo "benchmarks: exit $bench_rc ($( [ "$bench_rc" = 0 ] && echo OK || { [ "$bench_rc" = 124 ] && echo TIMEOUT || echo 'SOME OPS FAILED'; } )): $(grep -E '^geometric mean' "$LOG/bench_ops.log" | tail -n 1)"
echo "attention:  $(grep -iE 'ratio|flash' "$LOG/bench_attention.log" | tail -n 4 | tr '\n' ' ')"
echo "training:"; grep -E '^(forge|torch)' "$LOG/bench_train.log"
echo "generation:"; grep -E '^(forge|transformers|ratio)' "$LOG/bench_generate.log"
echo "decoding step:"; grep -E '^GPT-2|graph replay|DecodeStep call|greedy chain' "$LOG/bench_decode.log"
echo "check:"; cat "$LOG/check.log"
echo "logs in $LOG"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
