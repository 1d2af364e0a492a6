"""What a user gets from ``pip install`` or an sdist: the wheel carries every file of
``src/forge_ml`` (the C and CUDA sources native.py and runtime.py compile at run time), and
the sdist carries the test suite whole (its helpers and fixtures too), the docs, the
benchmarks and the scripts, so that the README's ``pytest`` runs from it. Both are built by
the project's own backend (setuptools.build_meta) from a copy of the tracked files."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement


def _tracked() -> list:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the tracked files are the source of truth)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(tracked files, sdist member names, wheel member names, the wheel's METADATA), built
    from a clean copy."""
    files = _tracked()
    src = tmp_path_factory.mktemp("src")
    for p in files:
        (src / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / p, src / p)
    out = tmp_path_factory.mktemp("dist")
    code = ("import sys, setuptools.build_meta as b; out = sys.argv[1]; "  # b rewrites sys.argv
            "names = b.build_sdist(out), b.build_wheel(out); print('BUILT', *names)")
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sdist_name, wheel_name = r.stdout.split("BUILT ")[-1].split()
    with tarfile.open(out / sdist_name) as t:
        top = sdist_name[: -len(".tar.gz")] + "/"
        sdist = {m.name[len(top):] for m in t.getmembers() if m.isfile()}
    with zipfile.ZipFile(out / wheel_name) as z:
        wheel = set(z.namelist())
        meta = [z.read(n).decode() for n in wheel if n.endswith(".dist-info/METADATA")]
    return files, sdist, wheel, meta[0] if meta else ""


def test_the_wheel_carries_every_package_file(built):
    files, _, wheel, _ = built
    package = {p[len("src/"):] for p in files if p.startswith("src/forge_ml/")}
    assert {"forge_ml/backends/cpu/gemm.c", "forge_ml/backends/cpu/cpu_kernels.h",
            "forge_ml/backends/cuda/common.cuh", "forge_ml/backends/cuda/sample.cu"} <= package
    assert sorted(package - wheel) == []
    tops = {n.split("/")[0] for n in wheel} - {"forge_ml"}
    assert len(tops) == 1 and tops.pop().endswith(".dist-info")


def test_the_sdist_carries_the_tests_docs_benchmarks_and_scripts(built):
    files, sdist, _, _ = built
    wanted = {p for p in files if p.split("/")[0] in ("src", "tests", "docs", "benchmarks",
                                                       "scripts")}
    wanted |= {"README.md", "pyproject.toml", "conftest.py"}
    assert {"tests/reference.py", "tests/backends/core_numpy.py"} <= wanted
    assert sorted(wanted - sdist) == []
    assert not [n for n in sdist if "__pycache__" in n or n.endswith(".pyc")]


def test_the_wheel_carries_the_license_and_the_one_version(built):
    """The licence text pyproject names ships in the wheel and the sdist, and the version is
    written once (forge_ml.__version__, read by setuptools)."""
    import forge_ml
    files, sdist, wheel, metadata = built
    assert "LICENSE" in sdist and any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel), wheel
    assert f"\nVersion: {forge_ml.__version__}\n" in metadata
