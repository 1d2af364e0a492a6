#!/usr/bin/env bash
# session 26, call 2: layer_mlp_rows (rows in each block) and its tests; small batches; the LM head kept in L2 (experiment); beam twins
set -u
O=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1; export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
timeout 240 python3 -m pytest tests/test_cuda_decode_model.py -q -p no:cacheprovider -rfEs -n 4 2>&1 | tail -15 | tee $O/decode_tests.txt
for dt in bf16 float32; do
  timeout 150 python3 benchmarks/generate_gpu.py --dtype $dt --rows 1,2,3,4 --repeats 2 2>&1 | tee $O/rows_$dt.txt
done
timeout 100 python3 benchmarks/generate_gpu.py --model gpt2-medium --dtype bf16 --rows 1,2,4 --rows-modes greedy --repeats 2 2>&1 | tee $O/rows_medium_bf16.txt
for r in 1 2; do for mb in 0 32 20; do
  timeout 60 python3 benchmarks/generate_gpu.py --dtype bf16 --paths forge --head-l2 $mb 2>&1 | grep -E "forge-ml:|L2" | sed "s/^/head-l2 $mb MB round $r: /" | tee -a $O/head_l2.txt
done; done
for mb in 0 32; do
  timeout 60 python3 benchmarks/generate_gpu.py --dtype float32 --paths forge --head-l2 $mb 2>&1 | grep -E "forge-ml:|L2" | sed "s/^/f32 head-l2 $mb MB: /" | tee -a $O/head_l2.txt
done
python3 -c "import cupy; p=cupy.cuda.runtime.getDeviceProperties(0); print('l2', p['l2CacheSize'], 'persist max', p['persistingL2CacheMaxSize'], 'window max', p['accessPolicyMaxWindowSize'])" | tee -a $O/head_l2.txt
timeout 200 python3 -m pytest tests -m cuda --ignore-glob='tests/test_cuda*' --ignore=tests/backends --ignore=tests/cuda_probes --ignore=tests/test_serve.py -q -rfEs -p no:cacheprovider -n 4 2>&1 | tail -5 | tee $O/twins.txt
