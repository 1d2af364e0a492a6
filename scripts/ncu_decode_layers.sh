#!/usr/bin/env bash
# Nsight Compute's full profile of one layer of the batch-1 layers decoding step
# (FORGE_FUSED_DECODE=layers: layer_attn and layer_mlp, decode_layers.cu), with the kernels
# compiled with -lineinfo (FORGE_CUDA_LINEINFO=on), so that the source page gives each .cu
# line's warp-stall samples: where a layer's latency goes, stage by stage.
#
#   bash scripts/ncu_decode_layers.sh [POS]          (on the GPU machine; POS default 1000)
#
# Writes to $OUT (default /tmp/forge_ncu_layers): layers.ncu-rep, details.csv (every section
# of both kernels), sass.csv (per instruction), cuda.csv (per source line of the file as NVRTC
# compiled it: common.cuh pasted in, kept beside as sv/backends/cuda/decode_layers.cu) and
# lines.txt (the 40 source lines with the most stall samples per kernel).
# Caches are not flushed between kernels (--cache-control none), as in the decoding loop.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/forge_ncu_layers}"
mkdir -p "$out/sv/backends/cuda"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" FORGE_CUDA_LINEINFO=on FORGE_FUSED_DECODE=layers
python3 -c "from forge_ml.backends.cuda import kernel_source as k; open('$out/sv/backends/cuda/decode_layers.cu', 'w').write(k('decode_layers'))"
ncu --clock-control none --cache-control none --graph-profiling node -k 'regex:layer_(attn|mlp)' \
    --launch-skip 240 --launch-count 2 --set full --import-source yes -f -o "$out/layers" \
    python3 benchmarks/decode_gpu.py --dtype bf16 --pos "${1:-1000}" --fused layers --reps 20 \
    > "$out/ncu_run.log" 2>&1
echo "ncu exit $? (log $out/ncu_run.log)"
ncu -i "$out/layers.ncu-rep" --page details --csv > "$out/details.csv" 2>&1
ncu -i "$out/layers.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
ncu -i "$out/layers.ncu-rep" --page source --csv --print-source cuda --source-folders "$out/sv" \
    > "$out/cuda.csv" 2>&1
grep -E '"(Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Block Limit Shared Mem)"' \
    "$out/details.csv" | cut -d, -f5,13-16 | head -20
python3 - "$out" <<'PYEOF'
import csv, sys
out = sys.argv[1]
rows = list(csv.reader(open(f"{out}/cuda.csv", errors="replace")))
tables, col = [], None   # one table a kernel: a header row, then a row a source line
for r in rows:
    hit = next((i for i, c in enumerate(r) if "Warp Stall Sampling (All" in c), None)
    if hit is not None:
        col = hit
        tables.append([])
    elif col is not None and len(r) > col:
        try:
            tables[-1].append((float(r[col] or 0), r))
        except ValueError:
            pass
if not tables:
    print("cuda.csv has no stall-sampling column:", rows[:3])
with open(f"{out}/lines.txt", "w") as f:
    for k, t in enumerate(tables):
        total = sum(n for n, _ in t) or 1
        f.write(f"== table {k}: {total:.0f} samples\n")
        for n, r in sorted(t, key=lambda x: -x[0])[:40]:
            f.write(f"{n:8.0f} {100 * n / total:5.1f}%  {r[0]:>5}  {r[1].strip()[:100]}\n")
print(open(f"{out}/lines.txt").read()[:8000] if tables else "")
PYEOF
