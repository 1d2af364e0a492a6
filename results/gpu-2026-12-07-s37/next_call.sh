#!/usr/bin/env bash
# For the next session's first call on an H200 (carry .whl and .data; about 330 s): the
# issues' H200 targets on main as session 37 left it, none measured on an H200 since s30.
#   issue 10: B=32 >= 600K tok/s (H100 562.7K, 1.218x torch.compile; H200 best 572.4K, s15)
#   issue 11: batch-1 greedy bf16 >= 6,000, float32 >= 4,000 (H200 5,002 / 3,907 in s30;
#             the LM head of 8 warps since: +1.9-2.7% / +1.4-1.9% on an H100), every sampling
#             mode within 10% of greedy at batch 1 (top-p 0.897x on an H100 in s37).
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/forge_site
timeout 170 python3 benchmarks/train_e2e.py --data .data/tinyshakespeare.txt --rows gpt2-b32 \
    --peers forge,compile --steps 20 2>&1 | tail -3
echo "($((SECONDS - t0)) s)"
for d in bf16 float32; do
  timeout 60 python3 benchmarks/generate_gpu.py --dtype $d --paths forge --repeats 3 2>&1 \
      | grep -E "^forge-ml:|bandwidth"
done
timeout 90 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge --sampling --batch 1 \
    --repeats 2 2>&1 | grep -v "^ *$" | tail -6
echo "($((SECONDS - t0)) s)"
