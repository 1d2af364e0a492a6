#!/usr/bin/env bash
# A/B of generation between trees of forge-ml, on the GPU machine: benchmarks/generate_gpu.py
# (forge-ml's default path only, greedy bf16 from a 16-token prompt to position 1,024, at batch
# 1 and at BATCH) from each tree in turn, alternated ROUNDS times, so that all see the same
# machine state. Prints one line a run: the tree, the default path's tokens/s, and greedy's at
# batch 1 and at BATCH (the logs keep the whole output).
#
#   bash scripts/ab_generate.sh BASE_TREE[,TREE...] [ROUNDS] [BATCH]
#
# The trees are scripts/ab_trees.sh's (git archive of each revision), as for ab_train.sh; the
# working tree runs last, named "this". ROUNDS default 2, BATCH default 64.
# Environment: OUT (the logs; default /tmp/forge_ab_generate), GEN_ARGS (more arguments for
# generate_gpu.py, e.g. "--dtype float32"). Needs generate_gpu.py's --paths and --modes (trees
# from 2026-12-05 on).
set -u
cd "$(dirname "$0")/.."
trees="${1:?usage: ab_generate.sh BASE_TREE[,TREE...] [ROUNDS] [BATCH]}"
rounds="${2:-2}"
batch="${3:-64}"
log="${OUT:-/tmp/forge_ab_generate}"
mkdir -p "$log"
. scripts/ab_common.sh
has_modes() { grep -q -- "--modes" "$1/benchmarks/generate_gpu.py" 2>/dev/null; }
ab_check "$trees" "benchmarks/generate_gpu.py with --paths and --modes" has_modes
run() {   # tree, name, round
  local f="$log/${2}_$3.log" line
  # generate_gpu.py puts its own tree's src first on sys.path
  timeout 300 python3 "$1/benchmarks/generate_gpu.py" --dtype bf16 --paths forge --sampling \
    --modes greedy --batch "$batch" --repeats 2 ${GEN_ARGS:-} > "$f" 2>&1
  # one line a run: the default path's figure, then greedy's at batch 1 and at BATCH
  line=$(awk '/^forge-ml: / {d = $2}
              /^batch / {b = $2; sub(",", "", b)}
              /^  greedy / {g = g sprintf(" | batch %s greedy %s tok/s", b, $2)}
              END {if (d != "") printf "default %s tok/s%s", d, g}' "$f")
  echo "$2 round $3: ${line:-FAILED (see $f)}"
}
ab_rounds "$trees" "$rounds" run
