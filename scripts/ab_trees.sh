#!/usr/bin/env bash
# Trees of other versions of the code for scripts/ab_train.sh (and gpu_check.sh's ab section):
# `git archive` of each revision's src/, benchmarks/, tests/ and scripts/ (with conftest.py and
# pyproject.toml: the branch's own GPU tests run from its tree) into .scratch/<name>
# (.scratch is gitignored, and the device tool carries it when asked: carry [".scratch", ...]).
# Prints the AB_TREES value, the first revision first (about 2.5 MB a tree).
#
#   bash scripts/ab_trees.sh main s15-lt-dw s15-dkdv-ovl
#   -> AB_TREES=.scratch/main,.scratch/s15-lt-dw,.scratch/s15-dkdv-ovl
set -eu
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: ab_trees.sh REV [REV ...]"; exit 2; }
trees=""
for rev in "$@"; do
  git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "ab_trees.sh: no revision $rev"; exit 2; }
  name=$(printf '%s' "$rev" | tr '/~^:' '____')
  dir=".scratch/$name"
  rm -rf "$dir"
  mkdir -p "$dir"
  git archive "$rev" src benchmarks tests scripts conftest.py pyproject.toml | tar -x -C "$dir"
  trees="${trees:+$trees,}$dir"
done
echo "AB_TREES=$trees"
