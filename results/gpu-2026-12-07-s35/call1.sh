#!/usr/bin/env bash
# Session 35, call 1 (carry .whl and .data; about 560 s): the thirty-fourth session's call 1
# cut to 370 s (the dk/dv kernel of 128 keys a block: its tests, the backward's timings, the
# trainer at B=32 with r64 / r128h alternated, issue 10's row against torch.compile if time
# allows), then the head prefetch's tests, A/B and traces on main (call_head.sh, ~150 s).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
LIMIT=${LIMIT:-300} bash results/gpu-2026-12-07-s34/call1.sh 2>&1 | grep -v "^NVIDIA\|^ *$"
bash results/gpu-2026-12-07-s35/call_rows.sh
bash results/gpu-2026-12-07-s35/call_head.sh
