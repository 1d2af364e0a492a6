#!/usr/bin/env bash
# A/B of generation between trees of forge-ml, on the GPU machine: benchmarks/generate_gpu.py
# (forge-ml's default path only, greedy bf16 from a 16-token prompt to position 1,024, at batch
# 1 and at BATCH) from each tree in turn, alternated ROUNDS times, so that all see the same
# machine state. Prints the tree and the tokens/s lines of each run.
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
for tree in ${trees//,/ }; do
  if ! grep -q -- "--modes" "$tree/benchmarks/generate_gpu.py" 2>/dev/null; then
    echo "ab_generate.sh: $tree must hold benchmarks/generate_gpu.py with --paths and --modes"
    exit 2
  fi
done
for r in $(seq 1 "$rounds"); do
  for tree in ${trees//,/ } .; do
    name=$([ "$tree" = . ] && echo this || basename "$tree")
    f="$log/${name}_$r.log"
    # generate_gpu.py puts its own tree's src first on sys.path
    timeout 300 python3 "$tree/benchmarks/generate_gpu.py" --dtype bf16 --paths forge --sampling \
      --modes greedy --batch "$batch" --repeats 2 ${GEN_ARGS:-} > "$f" 2>&1
    lines=$(grep -E "^forge-ml: |^batch |^  greedy " "$f" | tr -s ' ' | tr '\n' ';')
    echo "$name round $r: ${lines:-FAILED (see $f)}"
  done
done
