#!/usr/bin/env bash
# For the next session (carry .whl and .data; about 200 s): the pipelined wgmma forward's A/B
# on main as it is, with no local change: main's src and benchmarks are copied to .scratch/base
# on the device, fwd-pipelined.diff is applied to the device's copy, and call4.sh runs (tests,
# the bits against main's forward, both kernels' times, both trainers). If it holds (the same
# bits, the tests pass, faster), apply the diff locally and commit it with these figures.
set -u
R=results/gpu-2026-12-07-s38
rm -rf .scratch/base && mkdir -p .scratch/base && cp -r src benchmarks .scratch/base/
if command -v patch >/dev/null; then patch -p1 --quiet < $R/fwd-pipelined.diff
else git apply $R/fwd-pipelined.diff; fi || { echo "the diff does not apply"; exit 1; }
grep -c "wg_wait1" src/forge_ml/backends/cuda/flash_hopper.cu
bash $R/call4.sh
