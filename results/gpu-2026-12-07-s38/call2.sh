#!/usr/bin/env bash
# Session 38, call 2 (carry .whl and .data; about 250 s): where the B=32 step goes today,
# kernel by kernel beside torch.compile's (benchmarks/train_profile.py; the last such table is
# the tenth session's, before the wgmma attention's later kernels, the epilogues' changes and
# the dk/dv kernel of 128 keys). Issue 10's 600K needs about -3.6 ms a step on an H100.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
mkdir -p ${OUT:-/tmp/o2}
timeout 400 python3 benchmarks/train_profile.py --data .data/tinyshakespeare.txt \
    --who forge,compile --top 45 > ${OUT:-/tmp/o2}/train_profile.txt 2>&1
echo "rc=$? ($((SECONDS - t0)) s)"
grep -E "^==|ms a step" ${OUT:-/tmp/o2}/train_profile.txt | head -20
