# Sourced by scripts/ab_train.sh and scripts/ab_generate.sh: what every A/B between trees of the
# code does the same way (the trees are scripts/ab_trees.sh's folders, comma-separated).

# ab_check TREES WHAT TEST: every tree passes `TEST TREE`, else the script says that the tree
# must hold WHAT and exits 2.
ab_check() {
  local trees="$1" what="$2" test="$3" tree
  for tree in ${trees//,/ }; do
    "$test" "$tree" || { echo "$(basename "$0"): $tree must hold $what"; exit 2; }
  done
}

# ab_rounds TREES ROUNDS RUN: `RUN TREE NAME ROUND` for each round, each tree in turn and then
# the working tree ("." named "this"), so that every tree sees the same machine state.
ab_rounds() {
  local trees="$1" rounds="$2" run="$3" r tree
  for r in $(seq 1 "$rounds"); do
    for tree in ${trees//,/ } .; do
      "$run" "$tree" "$([ "$tree" = . ] && echo this || basename "$tree")" "$r"
    done
  done
}
