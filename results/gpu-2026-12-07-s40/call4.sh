#!/usr/bin/env bash
# Session 40, call 4 (carry .data; about 90 s): the B=32 trainer after the layernorm rule
# (call 3's ran for 1 s and printed no figure; its output was cut to the table's last line).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
PYTHONPATH=$PWD/src timeout 150 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt \
    --rows gpt2-b32 --peers forge --steps 20 2>&1 | tail -40
echo "(all $((SECONDS - t0)) s)"
