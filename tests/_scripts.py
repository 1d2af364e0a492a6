"""A benchmark's or a script's module loaded from its file (benchmarks/ and scripts/ are no
package), for the tests of their arithmetic that run without a GPU."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(relpath: str):
    """The module of ``ROOT / relpath`` (e.g. "scripts/ptx_same.py"), run once per call."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"{path.stem}_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
