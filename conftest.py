# Doctests run over src/forge_ml; the CUDA backend imports CuPy at module load, so its
# modules are left to tests/test_cuda.py (marked cuda), which skips without a GPU.
collect_ignore_glob = ["src/forge_ml/backends/cuda/*"]
# The moved module's shim warns at import (its test is tests/test_moved_names.py), and has no
# examples of its own: collecting it printed its DeprecationWarning after every run.
collect_ignore = ["src/forge_ml/generate.py"]

# The trainer's BLAS thread tuner (forge_ml.blas) stays off in the suite: two
# pytest workers on a small machine, each taking every core, would slow each other down. The
# tests that exercise it turn it on themselves.
import os  # noqa: E402

os.environ.setdefault("FORGE_BLAS_TUNE", "off")
