#!/usr/bin/env bash
# Session 35: the head's L2 prefetch before its wait (decoder.HEAD_PREFETCH) on main's tree:
# its bit-equality tests, the A/B through generate() (batch 1, bf16 and float32, rounds
# alternated), and the phase trace at position 1,000 with it off and on (bf16). ~200 s.
set -u
t0=$SECONDS
export PYTHONPATH=$PWD/src
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_decode_model.py -k "prefetch or head_gives" 2>&1 | tail -2
echo "($((SECONDS - t0)) s)"
timeout 200 python3 results/gpu-2026-12-07-s35/head_pf_ab.py 3 bfloat16=0,4,8 float32=0,2,4 2>&1 | tail -8
echo "($((SECONDS - t0)) s)"
for r in 0 8; do
  timeout 40 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from forge_ml.backends.cuda import decoder
decoder.HEAD_PREFETCH['bf16'] = $r; print('HEAD_PREFETCH bf16 =', $r); import decode_gpu
decode_gpu.main(['--dtype', 'bf16', '--pos', '1000', '--fused', 'layers', '--trace'] + (['--roof'] if $r else []))" 2>&1 | grep -v "^ *$" | tail -24
done
echo "($((SECONDS - t0)) s)"
# batch 64's step on this machine: where its time goes (the op-by-op step's kernels)
timeout 60 python3 benchmarks/decode_gpu.py --dtype bf16 --batch 64 --pos 512 2>&1 | grep -v "^ *$" | tail -30
echo "($((SECONDS - t0)) s)"
