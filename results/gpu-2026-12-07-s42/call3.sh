#!/usr/bin/env bash
# Session 42, call 3 (carry .scratch/base42 = main before the change): sample.cu's passes by
# mass adding their low bits with one-instruction atomics. The sampling tests; the new carry
# test against a copy with the carry taken out (it must fail there); sampling_cuda.py on both
# trees; generate() with every sampling mode at batch 1 and 64, both trees in turn.
set -u
t0=$SECONDS
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 \
    tests/test_cuda_sampling.py tests/test_sampling.py tests/test_cuda_model.py tests/test_batch_engine.py \
    tests/test_generate.py 2>&1 | tail -3
rm -rf /tmp/broken && mkdir -p /tmp/broken && cp -r src tests conftest.py pyproject.toml /tmp/broken/
sed -i 's/if (carry) mass_add(h, d, low);/if (false) mass_add(h, d, low);/' /tmp/broken/src/forge_ml/backends/cuda/sample.cu
grep -c "if (false) mass_add" /tmp/broken/src/forge_ml/backends/cuda/sample.cu
(cd /tmp/broken && PYTHONPATH=/tmp/broken/src timeout 100 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_sampling.py -k past_32_bits 2>&1 | tail -2)
echo "(all $((SECONDS - t0)) s)"
for t in base42 this; do
  src=$PWD/src; [ $t = base42 ] && src=$PWD/.scratch/base42/src
  echo "== sampling_cuda.py, $t"
  PYTHONPATH=$src timeout 120 python3 benchmarks/sampling_cuda.py --reps 30 2>&1 | tail -12 | tee $O/sampling_cuda_$t.txt
done
echo "(all $((SECONDS - t0)) s)"
for r in 1 2; do for t in base42 this; do
  src=$PWD/src; [ $t = base42 ] && src=$PWD/.scratch/base42/src
  echo "== generate_gpu.py --sampling, $t, round $r"
  PYTHONPATH=$src timeout 150 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge \
      --sampling --batch 64 --repeats 3 --modes top-k,top-p 2>&1 | tail -11 | tee -a $O/generate_$t.txt
done; done
echo "(all $((SECONDS - t0)) s)"
