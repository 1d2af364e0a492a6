#!/usr/bin/env bash
# Session 35, call 2 (on the warm machine after call 1; carry .whl and .data): the GPU suite's
# tests section with call 1's winners made the defaults on this machine's copy of the tree
# (nothing of it comes back): GEMM_ROWS=on|off, HEAD_BF16=0-8, HEAD_F32=0-8 (rows of
# decoder.HEAD_PREFETCH), then the server under load. ~400 s.
#   GEMM_ROWS=on HEAD_BF16=8 HEAD_F32=4 bash results/gpu-2026-12-07-s35/call2.sh
set -u
t0=$SECONDS
sed -i "s/Switch(\"FORGE_GEMM_ROWS\", \"off\"/Switch(\"FORGE_GEMM_ROWS\", \"${GEMM_ROWS:-off}\"/" src/forge_ml/flags.py
sed -i "s/^HEAD_PREFETCH = {\"f32\": 0, \"bf16\": 0}/HEAD_PREFETCH = {\"f32\": ${HEAD_F32:-0}, \"bf16\": ${HEAD_BF16:-0}}/" \
    src/forge_ml/backends/cuda/decoder.py
grep -n "FORGE_GEMM_ROWS\", \"" src/forge_ml/flags.py; grep -n "^HEAD_PREFETCH" src/forge_ml/backends/cuda/decoder.py
SECTIONS="tests" TEST_WORKERS=8 TEST_TIMEOUT=330 OUT=/tmp/gc2 bash scripts/gpu_check.sh 2>&1 | tail -25
echo "($((SECONDS - t0)) s)"
[ $((SECONDS - t0)) -lt 430 ] && SECTIONS="serve" OUT=/tmp/gc2s timeout $((560 - (SECONDS - t0))) bash scripts/gpu_check.sh 2>&1 | grep -E "tok/s|tokens/s|first token|lost|serve" | tail -8
echo "($((SECONDS - t0)) s)"
