#!/usr/bin/env bash
# One command for the GPU machine: the GPU test suite (and the contract suite on every
# backend), then the GPU benchmarks, the server under load and the CLI end to end.
# Logs go to $OUT (or /tmp/forge_gpu_check when OUT is unset); a summary is printed last.
#   bash scripts/gpu_check.sh                       (from anywhere; no install needed)
#   SECTIONS="tests generate serve" bash scripts/gpu_check.sh      (a subset)
# Sections: tests wgmma ops train e2e memory recipe generate decode serve cli (default: all;
# e2e, memory and recipe need E2E_DATA), and profile and curve (asked for by name only; need
# E2E_DATA): the trainer's step kernel by kernel beside torch.compile's
# (benchmarks/train_profile.py); the 200-step loss curve of the fast path against the op-by-op
# path and against the sixth session's committed run (benchmarks/loss_curve.py --against).
# Also by name only: algos (benchmarks/gemm_algos_cuda.py, cuBLASLt's candidates for every
# product of a step, timed in graphs; needs E2E_DATA; ALGOS_ARGS) and ab (scripts/ab_train.sh
# with AB_TREES, comma-separated folders of other versions, against this tree; AB_ROWS,
# AB_ROUNDS): SECTIONS="ab" AB_TREES=.scratch/base,.scratch/x E2E_DATA=... bash ...
# wgmma: flash_hopper.cu's probe and kernel tests (each in its own process), the flash, model
# and step tests with FORGE_WGMMA_ATTENTION=off (the mma.sync kernels other GPUs run; the
# tests section runs the default, wgmma on Hopper), the model and step tests with
# FORGE_WGMMA_BWD_SHARED=none and FORGE_WGMMA_ROWS=64 (the register backward kernels and one
# warpgroup a block; the defaults are both and 128), and the wgmma kernels' timings.
# Environment: E2E_DATA (a text file for e2e), E2E_ROWS (default gpt2-b32,char),
# TEST_TIMEOUT (default 300 s), TEST_WORKERS (pytest-xdist processes sharing the
# GPU, default 4), BENCH_TIMEOUT (150), BENCH_ARGS (e.g. "--only gelu --reps 50"), SERVE_ARGS.
# The serve section needs starlette and uvicorn; where pip cannot reach an index, put their
# wheels in .whl/serve (scripts: README of the device tool) and they are installed first.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp/forge_gpu_check}"
mkdir -p "$LOG"
PY="${PYTHON:-python3}"
SECTIONS="${SECTIONS:-tests wgmma ops train e2e memory recipe generate decode serve cli}"
want() { case " $SECTIONS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/forge_site"
fi

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$LOG/gpu.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$LOG/gpu.txt"
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount(),
          "nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as e:
    print("cupy not usable:", e)
for name in ("torch", "cuda.bindings", "starlette", "uvicorn"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(name, "not usable:", e)
PYEOF

test_rc=skipped; bench_rc=0; serve_rc=skipped; wgmma_rc=skipped; wgmma_off_rc=skipped
if want tests; then
  echo "== tests (the GPU tests, and the contract suite on every backend; addopts give -q)"
  # flash_hopper.cu's tests run in the wgmma section: an experimental kernel that faults would
  # take the CUDA context of a worker, and the tests after it, down with it
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda*.py tests/backends ${EXTRA_TESTS:-} -rfEs \
      --deselect tests/test_cuda_wgmma_probe.py --deselect tests/test_cuda_flash_hopper.py \
      -p no:cacheprovider -n "${TEST_WORKERS:-4}" --durations=8 --junitxml="$LOG/tests.xml" 2>&1 | tee "$LOG/tests.log"
  test_rc=${PIPESTATUS[0]}
  # the GPU twins of CPU tests (marked cuda) in the other test files: generation, beam search,
  # the batch engine on the device (test_serve.py needs the openai client: the serve section)
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests -m cuda --ignore-glob='tests/test_cuda*' \
      --ignore=tests/backends --ignore=tests/cuda_probes --ignore=tests/test_serve.py -rfEs -p no:cacheprovider \
      -n "${TEST_WORKERS:-4}" 2>&1 | tee "$LOG/tests_twins.log"
  twins_rc=${PIPESTATUS[0]}
  [ "$test_rc" = 0 ] && test_rc=$twins_rc
fi
if want ops; then
  echo "== op benchmarks (benchmarks/ops_cuda.py, attention_cuda.py, epilogues_cuda.py)"
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/ops_cuda.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench_ops.log"
  bench_rc=${PIPESTATUS[0]}
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/attention_cuda.py 2>&1 | tee "$LOG/bench_attention.log"
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/epilogues_cuda.py 2>&1 | tee "$LOG/bench_epilogues.log"
fi
if want train; then
  echo "== training step (benchmarks/train_gpu.py)"
  timeout "${TRAIN_TIMEOUT:-200}" "$PY" benchmarks/train_gpu.py --batch "${TRAIN_BATCH:-32}" --steps "${TRAIN_STEPS:-10}" ${TRAIN_ARGS:-} 2>&1 | tee "$LOG/bench_train.log"
fi
if want e2e; then
  echo "== the trainer as forge-ml train drives it, against torch eager and torch.compile (benchmarks/train_e2e.py)"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${E2E_TIMEOUT:-500}" "$PY" benchmarks/train_e2e.py --data "$E2E_DATA" --rows "${E2E_ROWS:-gpt2-b32,char}" \
        --steps "${E2E_STEPS:-20}" --json "$LOG/e2e.json" 2>&1 | tee "$LOG/bench_e2e.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_e2e.log"
  fi
fi
if want memory; then
  echo "== where the trainer's device memory goes, op by op and as one graph (benchmarks/train_memory.py)"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${MEMORY_TIMEOUT:-240}" "$PY" benchmarks/train_memory.py --data "$E2E_DATA" ${MEMORY_ARGS:---workspace-mib 32} 2>&1 | tee "$LOG/bench_memory.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_memory.log"
  fi
fi
if want profile; then
  echo "== the trainer's step kernel by kernel, beside torch.compile's (benchmarks/train_profile.py)"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${PROFILE_TIMEOUT:-300}" "$PY" benchmarks/train_profile.py --data "$E2E_DATA" ${PROFILE_ARGS:-} 2>&1 \
        | grep -v -E "UserWarning|_warn_once" | tee "$LOG/bench_profile.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_profile.log"
  fi
fi
if want algos; then
  echo "== cuBLASLt's candidate algorithms for every product of a step, timed in CUDA graphs (benchmarks/gemm_algos_cuda.py)"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${ALGOS_TIMEOUT:-300}" "$PY" benchmarks/gemm_algos_cuda.py --data "$E2E_DATA" ${ALGOS_ARGS:---algos 8 --reps 5} \
        2>&1 | tee "$LOG/bench_algos.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_algos.log"
  fi
fi
if want ab; then
  echo "== the trainer from other trees of the code against this one (scripts/ab_train.sh)"
  if [ -n "${AB_TREES:-}" ]; then
    OUT="$LOG/ab" DATA="${E2E_DATA:-.data/tinyshakespeare.txt}" timeout "${AB_TIMEOUT:-500}" \
        bash scripts/ab_train.sh "$AB_TREES" "${AB_ROWS:-gpt2-b32}" "${AB_ROUNDS:-2}" 2>&1 | tee "$LOG/bench_ab.log"
  else
    echo "skipped: set AB_TREES to the trees (git archive REV src benchmarks | tar -x -C DIR)" | tee "$LOG/bench_ab.log"
  fi
fi
if want curve; then
  echo "== the 200-step loss curve (benchmarks/loss_curve.py, 124M, B=16): fast against op by op, and against results/gpu-2026-12-04-s6/curve.json"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${CURVE_TIMEOUT:-500}" "$PY" benchmarks/loss_curve.py --data "$E2E_DATA" --batch 16 --steps 200 \
        --json "$LOG/curve.json" --against results/gpu-2026-12-04-s6/curve.json 2>&1 | tee "$LOG/bench_curve.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_curve.log"
  fi
fi
if want wgmma; then
  echo "== Hopper's wgmma attention (flash_hopper.cu): the probe, its kernel tests, the flash, model and step tests with FORGE_WGMMA_ATTENTION=off (mma.sync), then the kernels' timings"
  # one process each: a probe that faults takes its CUDA context down, not the kernel tests
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda_wgmma_probe.py -rfEs \
      -p no:cacheprovider 2>&1 | tee "$LOG/wgmma_tests.log"
  wgmma_rc=${PIPESTATUS[0]}
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda_flash_hopper.py -rfEs \
      -p no:cacheprovider 2>&1 | tee -a "$LOG/wgmma_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || wgmma_rc=1
  FORGE_WGMMA_ATTENTION=off timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda_flash.py \
      tests/test_cuda_model.py tests/test_cuda_train_step.py tests/test_attention_qkv.py -rfEs \
      -p no:cacheprovider -n "${TEST_WORKERS:-4}" 2>&1 | tee "$LOG/wgmma_off_tests.log"
  wgmma_off_rc=${PIPESTATUS[0]}
  # the register backward kernels (the default reads the block's operands from shared memory)
  # through the model and the trainer's graph
  FORGE_WGMMA_BWD_SHARED=none FORGE_WGMMA_ROWS=64 timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/test_cuda_model.py \
      tests/test_cuda_train_step.py tests/test_attention_qkv.py -rfEs -p no:cacheprovider \
      -n "${TEST_WORKERS:-4}" 2>&1 | tee "$LOG/wgmma_bwd_regs_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || wgmma_off_rc=1
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/attention_cuda.py --batch "${WGMMA_BATCH:-8,32}" 2>&1 \
      | tee "$LOG/bench_wgmma.log"
fi
if want recipe; then
  echo "== nanoGPT's shakespeare_char recipe, forge-ml's trainer against PyTorch eager (benchmarks/char_recipe.py)"
  if [ -n "${E2E_DATA:-}" ]; then
    timeout "${RECIPE_TIMEOUT:-500}" "$PY" benchmarks/char_recipe.py --data "$E2E_DATA" --device cuda \
        --json "$LOG/recipe.json" 2>&1 | tee "$LOG/bench_recipe.log"
  else
    echo "skipped: set E2E_DATA to a text file (tinyshakespeare)" | tee "$LOG/bench_recipe.log"
  fi
fi
if want generate; then
  echo "== generation (benchmarks/generate_gpu.py: greedy vs HF, then every sampling mode)"
  timeout "${GEN_TIMEOUT:-200}" "$PY" benchmarks/generate_gpu.py 2>&1 | tee "$LOG/bench_generate.log"
  timeout "${GEN_TIMEOUT:-300}" "$PY" benchmarks/generate_gpu.py --dtype bf16 --sampling 2>&1 | tee -a "$LOG/bench_generate.log"
  # small batches: the layers step at 1-4 rows against the kernel-per-op step (and 5 forced)
  timeout "${GEN_TIMEOUT:-200}" "$PY" benchmarks/generate_gpu.py --dtype bf16 --rows 1,2,3,4,5 \
      --rows-modes greedy --repeats 2 2>&1 | tee -a "$LOG/bench_generate.log"
  timeout 60 "$PY" benchmarks/sampling_cuda.py 2>&1 | tee -a "$LOG/bench_generate.log"
fi
if want decode; then
  echo "== decoding step (benchmarks/decode_gpu.py)"
  timeout "${GEN_TIMEOUT:-150}" "$PY" benchmarks/decode_gpu.py 2>&1 | tee "$LOG/bench_decode.log"
  timeout "${GEN_TIMEOUT:-150}" "$PY" benchmarks/decode_gpu.py --dtype bf16 2>&1 | tee -a "$LOG/bench_decode.log"
fi
if want serve; then
  echo "== forge-ml serve under load (benchmarks/serve_load.py)"
  timeout "${SERVE_TIMEOUT:-200}" "$PY" benchmarks/serve_load.py ${SERVE_ARGS:-} 2>&1 | tee "$LOG/bench_serve.log"
  serve_rc=${PIPESTATUS[0]}
fi
if want cli; then
  echo "== end to end: forge-ml check, and the CLI trainer in bf16 on the GPU"
  timeout 120 "$PY" -m forge_ml check 2>&1 | tee "$LOG/check.log"
  timeout "${CLI_TIMEOUT:-150}" "$PY" -m forge_ml train --device cuda --dtype bf16 --max-steps 300 \
      --eval-interval 150 --sample-interval 300 --sample-tokens 80 --no-progress --out /tmp/forge_cli_run \
      ${CLI_ARGS:-} 2>&1 | tail -n 25 | tee "$LOG/cli_train.log"
fi

echo
echo "================ gpu_check summary ================"
echo "gpu:        $(sed -n 2p "$LOG/gpu.txt")"
if want tests; then
  echo "tests:      exit $test_rc ($( [ "$test_rc" = 0 ] && echo PASS || { [ "$test_rc" = 124 ] && echo TIMEOUT || echo FAIL; } )): $(grep -E '(passed|failed|error|skipped)' "$LOG/tests.log" | tail -n 1)"
  [ -f "$LOG/tests_twins.log" ] && echo "  their GPU twins in the other files: $(grep -E '(passed|failed|error|skipped)' "$LOG/tests_twins.log" | tail -n 1)"
  grep -hE '^(FAILED|ERROR) ' "$LOG/tests.log" "$LOG/tests_twins.log" 2>/dev/null | head -n 40
fi
want ops && echo "op benchmarks: exit $bench_rc: $(grep -E '^geometric mean' "$LOG/bench_ops.log" | tail -n 1)"
want train && { echo "training:"; grep -E '^(forge|torch)' "$LOG/bench_train.log"; }
want e2e && { echo "trainer end to end:"; tail -n 8 "$LOG/bench_e2e.log"; }
want memory && { echo "trainer memory:"; grep -E '^\[graph' "$LOG/bench_memory.log"; }
want recipe && { echo "char recipe:"; tail -n 5 "$LOG/bench_recipe.log"; }
want algos && { echo "gemm algorithms:"; tail -n 1 "$LOG/bench_algos.log"; }
want ab && { echo "A/B:"; cat "$LOG/bench_ab.log"; }
want profile && { echo "profile:"; grep -E "^(forge-ml|torch.compile|== )" "$LOG/bench_profile.log"; }
want wgmma && { echo "wgmma: kernel tests exit $wgmma_rc, the flash suites with the switch off and with FORGE_WGMMA_BWD_SHARED=none FORGE_WGMMA_ROWS=64 exit $wgmma_off_rc"; \
  tail -n 1 "$LOG/wgmma_tests.log" "$LOG/wgmma_off_tests.log" "$LOG/wgmma_bwd_regs_tests.log"; grep -E "wgmma|^ *B=" "$LOG/bench_wgmma.log"; }
want generate && { echo "generation:"; grep -E '^(forge|transformers|ratio|bandwidth|batch|  |flat|peaked| +[0-9]+ +greedy)' "$LOG/bench_generate.log"; }
want decode && { echo "decoding step:"; grep -E '^GPT-2|graph replay|DecodeStep call|greedy chain' "$LOG/bench_decode.log"; }
want serve && { echo "serve: exit $serve_rc"; grep -vE '^\{' "$LOG/bench_serve.log" | tail -n 14; }
want cli && { echo "check:"; cat "$LOG/check.log"; }
echo "logs in $LOG"
[ "$test_rc" = 0 -o "$test_rc" = skipped ] && [ "$bench_rc" = 0 ] && [ "$serve_rc" = 0 -o "$serve_rc" = skipped ] \
  && [ "$wgmma_rc" = 0 -o "$wgmma_rc" = skipped ] && [ "$wgmma_off_rc" = 0 -o "$wgmma_off_rc" = skipped ]
