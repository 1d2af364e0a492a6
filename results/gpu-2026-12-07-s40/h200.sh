#!/usr/bin/env bash
# Session 40: the issues' H200 targets where an H200 comes (../gpu-2026-12-07-s37/next_call.sh:
# the B=32 trainer beside torch.compile, batch-1 greedy bf16 and float32, the sampling modes at
# batch 1); on any other card it only names the card and stops (no device time spent on
# figures that exist for the H100).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash results/gpu-2026-12-07-s37/next_call.sh
fi
