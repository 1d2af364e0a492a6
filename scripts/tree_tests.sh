#!/usr/bin/env bash
# Each tree's own tests, from that tree, on the GPU machine: the first step of an A/B, so that a
# branch's kernels are checked by its own tests before its timings count.
#
#   bash scripts/tree_tests.sh TREE "PYTEST ARGS" [TREE "PYTEST ARGS" ...]
#   bash scripts/tree_tests.sh .scratch/s18-layers "tests/test_cuda_decode_model.py" \
#                              .scratch/s18-skinny "tests/test_cuda.py -k 'skinny or tensor_cores'"
#
# The trees are scripts/ab_trees.sh's (git archive of a revision, with its tests and conftest).
# For each pair: pytest with the tree's src first on PYTHONPATH, 4 workers, a timeout
# (TREE_TIMEOUT, default 150 s), the whole log in $OUT/tests_<tree>.log (OUT default
# /tmp/forge_tree_tests), and one line printed: the tree, then pytest's counts and any FAILED
# or ERROR line. Exit status: the number of trees whose tests did not all pass.
set -u
cd "$(dirname "$0")/.."
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: tree_tests.sh TREE \"PYTEST ARGS\" [...]"; exit 2; }
log="${OUT:-/tmp/forge_tree_tests}"
mkdir -p "$log"
bad=0
while [ $# -ge 2 ]; do
  tree="$1"; args="$2"; shift 2
  name=$(basename "$tree")
  if [ ! -d "$tree/src/forge_ml" ]; then
    echo "$name: no src/forge_ml in $tree (make it with scripts/ab_trees.sh)"; bad=$((bad + 1)); continue
  fi
  f="$log/tests_$name.log"
  eval "pyargs=($args)"   # the shell's quoting inside ARGS: -k 'a or b' stays one argument
  # -o addopts= : the tree's pyproject asks for -q, which with ours would hide the counts
  (cd "$tree" && PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout "${TREE_TIMEOUT:-150}" \
      python3 -m pytest "${pyargs[@]}" -o addopts= -q -n "${TREE_WORKERS:-4}" -p no:cacheprovider \
      -rfE) > "$f" 2>&1
  rc=$?
  [ $rc -eq 0 ] || bad=$((bad + 1))
  counts=$(tail -n 1 "$f")   # pytest's summary line (passed, failed, deselected, no tests ran)
  echo "$name (exit $rc): ${counts:-nothing printed: see $f}"
  grep -E "^(FAILED|ERROR) " "$f" | head -10 | sed 's/^/  /'
done
exit $bad
