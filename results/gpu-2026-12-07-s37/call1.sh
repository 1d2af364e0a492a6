#!/usr/bin/env bash
# Session 37, call 1 (carry .whl and .data; about 550 s): issue 10's other rows on main as
# session 36 left it (the dk/dv kernel of 128 keys now the default), each against
# torch.compile in the same run: B=16, T=4096 B=8, medium B=16, then the char recipe.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
for row in gpt2-b16 gpt2-t4096 medium char; do
  timeout 170 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows $row \
      --peers forge,compile --steps 20 --json $OUT/e2e_$row.json 2>&1 | tail -3
  echo "($((SECONDS - t0)) s)"
done
