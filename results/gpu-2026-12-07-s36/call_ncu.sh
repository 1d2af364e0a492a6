#!/usr/bin/env bash
# Session 36, call 3 (about 200 s; carry nothing): where batch-64 decoding's time goes, for
# issue 11's batch-64 row. Nsight Compute on the kernel-per-op step at batch 64, bf16,
# position 512: decode_attention (38.6 us a layer on an H100, ~78% of its bandwidth by our
# count) and the cuBLASLt products (6.6-7.0 us against torch addmm's 3.7-6.8); then
# decode_attention alone with its keys split among 1-8 blocks a head.
set -u
OUT=${OUT:-/tmp/ncu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,lts__t_sector_hit_rate.pct
summarize() {   # $1 a csv of ncu --csv --metrics: a line of metrics for each kernel launch
  python3 - "$1" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no rows"); sys.exit()
h = rows[0]; ki, mi, vi, ui = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value"), h.index("Metric Unit")
ii = h.index("ID")
by = collections.OrderedDict()
for r in rows[1:]:
    by.setdefault((r[ii], r[ki][:60]), []).append(f"{r[mi].split('__')[-1][:28]}={r[vi]}{r[ui]}")
for (i, k), ms in by.items():
    print(i, k); print("   ", "; ".join(ms))
PY
}
run() {   # $1 label, $2 kernel regex, $3 count: the kernel-per-op step at batch 64 under ncu
  timeout 100 ncu --clock-control none -k "regex:$2" -c "$3" --metrics "$M" --csv \
      python3 benchmarks/decode_gpu.py --dtype bf16 --batch 64 --pos 512 --reps 3 \
      > "$OUT/$1.csv" 2> "$OUT/$1.err"
  echo "== $1 rc=$? ($((SECONDS - t0)) s)"
  summarize "$OUT/$1.csv"
}
run attention decode_attention 2
echo "== the step's own products (step_products.py: ln + c_attn, c_proj + res, ln + c_fc + gelu, c_proj + res)"
timeout 100 ncu --clock-control none -k "regex:nvjet|gemm|layernorm|xmma|sm90" -c 8 --metrics "$M" --csv \
    python3 results/gpu-2026-12-07-s36/step_products.py --reps 1 > "$OUT/step.csv" 2> "$OUT/step.err"
echo "rc=$? ($((SECONDS - t0)) s)"; summarize "$OUT/step.csv"
timeout 60 python3 benchmarks/decode_gpu.py --dtype bf16 --batch 64 --pos 512 --splits --reps 50 2>&1 | grep -v "^ *$" | tail -12
echo "($((SECONDS - t0)) s)"
