"""scripts/tree_tests.sh, the first step of an A/B on the GPU machine (each branch's own tests
from its own tree): run here on stub trees, one whose test passes and one whose test fails."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_tests.sh"


def _tree(root: Path, name: str, body: str) -> Path:
    t = root / name
    (t / "src" / "forge_ml").mkdir(parents=True)
    (t / "src" / "forge_ml" / "__init__.py").write_text("WHERE = __file__\n")
    (t / "tests").mkdir()
    (t / "tests" / "test_one.py").write_text(body)
    return t


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and timeout")
def test_each_tree_runs_its_own_tests_and_the_exit_counts_the_failures(tmp_path):
    ok = _tree(tmp_path, "good", "import forge_ml\n\ndef test_from_here():\n"
                                 "    assert 'good' in forge_ml.WHERE\n")
    bad = _tree(tmp_path, "bad", "def test_fails():\n    assert 1 == 2\n\n"
                                 "def test_left_out():\n    pass\n")
    env = dict(os.environ, OUT=str(tmp_path / "logs"), TREE_WORKERS="1")
    bindir = tmp_path / "bin"                # python3 here is the interpreter running the tests
    bindir.mkdir()
    shim = bindir / "python3"                # a script, not a link: a venv's python finds its
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # packages by its own path
    shim.chmod(0o755)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    r = subprocess.run(["bash", str(SCRIPT), str(ok), "tests/test_one.py", str(bad),
                        "tests -k 'fails or nothing_else'"],       # a quoted -k stays one argument
                       capture_output=True, text=True, env=env, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert lines[0].startswith("good (exit 0): 1 passed"), lines
    assert lines[1].startswith("bad (exit 1): 1 failed") and "passed" not in lines[1], lines
    assert "FAILED tests/test_one.py::test_fails" in lines[2], lines
    assert (tmp_path / "logs" / "tests_bad.log").is_file()
    r = subprocess.run(["bash", str(SCRIPT), str(ok)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "usage" in r.stdout
