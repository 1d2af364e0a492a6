#!/usr/bin/env bash
# Session 37, call 4 (carry nothing; about 150 s): the layers step's LM head with more
# registers a thread (8 warps a block, 128 registers) and its column loop unrolled, against
# main: generate() batch 1 greedy, bf16 and float32 (head_ab.py; issue 11's batch-1 rows).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD/src
timeout 400 python3 results/gpu-2026-12-07-s37/head_ab.py 3 ${VARIANTS:-main w8r8u2 w8r4u6 w8r8} 2>&1 | grep -v "^ *$" | tail -12
