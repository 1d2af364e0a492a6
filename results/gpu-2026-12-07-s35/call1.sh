#!/usr/bin/env bash
# Session 35, call 1 (carry .whl and .data; about 570 s): the head prefetch's tests, A/B and
# traces (call_head.sh), gemm_rows.cu's tests and batch-64 A/B (call_rows.sh), then the
# thirty-fourth session's call 1 in the time left (LIMIT: the dk/dv kernel of 128 keys a
# block: its tests, the backward's timings, the trainer at B=32 with r64 / r128h alternated).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bash results/gpu-2026-12-07-s35/call_head.sh
bash results/gpu-2026-12-07-s35/call_rows.sh
TOTAL=${TOTAL:-565}
echo "== s34 call1 with LIMIT=$((TOTAL - SECONDS))"
[ $((TOTAL - SECONDS)) -gt 100 ] && LIMIT=$((TOTAL - SECONDS)) bash results/gpu-2026-12-07-s34/call1.sh 2>&1 | grep -v "^NVIDIA\|^ *$"
