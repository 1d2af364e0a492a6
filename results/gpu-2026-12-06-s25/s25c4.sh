#!/usr/bin/env bash
# session 25, call 4: the final main: the GPU suite with its twins, the server under load,
# the CLI end to end (forge-ml check, train bf16)
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
SECTIONS="tests serve cli" SERVE_TIMEOUT=120 CLI_TIMEOUT=150 OUT=$O/check timeout 480 bash scripts/gpu_check.sh > $O/check.txt 2>&1
echo "rc=$?"; sed -n '/gpu_check summary/,$p' $O/check.txt | head -40
echo "== cli train"; tail -n 6 $O/check/cli_train.log 2>/dev/null
