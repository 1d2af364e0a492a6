# Sourced from the repository root by call1.sh and call2.sh, with B set: the serve wheels into
# /tmp/forge_site, and $B a fresh copy of the tree with the dk/dv kernel for 128 keys a block
# (FORGE_WGMMA_DKDV) applied: s35-dkdv128.diff (the thirty-third session's kernel, rebased
# onto main in the thirty-fifth).
python3 -m pip install -q --no-index --no-deps --target /tmp/forge_site .whl/serve/*.whl >/dev/null 2>&1
rm -rf "$B"; mkdir -p "$B"
cp -r src tests benchmarks scripts README.md pyproject.toml conftest.py "$B"/
(root=$PWD; cd "$B" && git apply "$root/results/gpu-2026-12-07-s35/s35-dkdv128.diff") && echo "branch applied"
