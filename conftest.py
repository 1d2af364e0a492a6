# Doctests run over src/forge_ml; the CUDA backend imports CuPy at module load, so its
# modules are left to tests/test_cuda.py (marked cuda), which skips without a GPU.
collect_ignore_glob = ["src/forge_ml/backends/cuda/*"]
