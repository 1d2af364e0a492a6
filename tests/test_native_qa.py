"""The C kernels' loader (backends/cpu/native.py) on users' machines as they are: a compiler
that speaks another encoding, a cache on a full disk, a folder where the cached library
should be, many processes building into one empty cache at once. Each case runs in a fresh
interpreter (the loader tries once a process) with its own cache under ``tmp_path``; the
standard is the C kernels (or NumPy) with at most one warning that says why, never a
traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_ml.backends.cpu import native

from test_cpu_kernels import _GELU_CHECK   # gelu through the loader; prints lib or numpy, why

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env(**env):
    """The environment of a fresh interpreter: this checkout's sources, none of the loader's
    variables of the calling process, ``env`` added (UTF-8 mode: the same on every locale)."""
    full = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUTF8="1")
    for name in ("FORGE_CPU_KERNELS", "FORGE_CACHE_DIR", "CC"):
        full.pop(name, None)
    full.update(env)
    return full


def _fresh(code, **env):
    """Run ``code`` in a new interpreter with ``env`` added; returns the completed process."""
    return subprocess.run([sys.executable, "-c", code], env=_env(**env), capture_output=True,
                          text=True, timeout=120)


def _needs_cc():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_a_compiler_speaking_another_encoding_falls_back_with_one_warning(tmp_path):
    """A compiler whose messages are not UTF-8 (a Latin-1 locale's, a file name's bytes) was
    a UnicodeDecodeError traceback from the first kernel (and from forge-ml check)."""
    cc = _script(tmp_path / "latin1-cc", r'''printf 'caf\351: fatal error\n' >&2; exit 1''')
    r = _fresh(_GELU_CHECK, CC=str(cc), FORGE_CACHE_DIR=str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith("numpy") and "fatal error" in r.stdout
    assert r.stderr.count("C CPU kernels are unavailable") == 1


# A disk with no room left: files can still be made (mkstemp), but no byte written to them
# under FULL_DISK, by Python or by the linker (the compiler wrapper below).
_FULL_DISK = """
import builtins, errno, os
_full, _open = os.environ["FULL_DISK"], builtins.open
class _NoRoom:
    def __init__(self, f): self._f = f
    def write(self, data): raise OSError(errno.ENOSPC, "No space left on device")
    def __getattr__(self, name): return getattr(self._f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self._f.close()
def _full_open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    full = isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(_full)
    return _NoRoom(f) if full and any(c in mode for c in "wax+") else f
builtins.open = _full_open
"""


def test_a_cache_on_a_full_disk_builds_for_the_process(tmp_path):
    """The linker's 'No space left on device' in the cache was taken for a compile error at
    every flag set: NumPy ran, behind a page of compiler output. Now the library is built in
    a temporary folder for this process, with one warning that names the full disk and the
    line that asked for the kernels (it named 'sys:1')."""
    _needs_cc()
    full = tmp_path / "full"
    real = native.compiler()
    cc = _script(tmp_path / "cc", f'case "$*" in *"-o {full}"*)\n'
                 f'  echo "/usr/bin/ld: final link failed: No space left on device" >&2; '
                 f'exit 1;;\nesac\nexec {real} "$@"')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = _fresh(_FULL_DISK + _GELU_CHECK, CC=str(cc), FORGE_CACHE_DIR=str(full),
               FULL_DISK=str(full), TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lib None"), r.stdout + r.stderr
    assert "unavailable" not in r.stderr
    (warning,) = [line for line in r.stderr.splitlines() if "RuntimeWarning" in line]
    assert "cannot be written" in warning and "No space left on device" in warning
    assert warning.startswith("<string>:"), warning      # the caller's line, not sys:1
    assert list((full / "cpu").iterdir()) == []           # no temporary left in the cache
    assert list(tmp.iterdir()) == []                      # the process's build removed at exit


def test_a_folder_where_the_cached_library_should_be(tmp_path):
    """A folder at the library's name in the cache ('Is a directory') fell back to NumPy;
    the kernels are built for this process instead, with one warning."""
    _needs_cc()
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib"), r.stderr
    (so,) = (tmp_path / "cpu").iterdir()
    so.unlink()
    so.mkdir()
    (so / "keep").write_text("")
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lib None"), r.stdout
    assert r.stderr.count("RuntimeWarning") == 1 and "cannot be written" in r.stderr
    assert (so / "keep").exists()                         # someone's folder, left alone


# A read-only cache (an image's, a read-only mount): nothing in it can be removed or replaced.
_READ_ONLY = """
import errno, pathlib
def _unlink(self, missing_ok=False):
    raise OSError(errno.EROFS, "Read-only file system", str(self))
pathlib.Path.unlink = _unlink
"""


def test_a_damaged_library_in_a_read_only_cache_is_built_for_the_process(tmp_path):
    """A truncated library in a read-only cache could not be deleted ('Read-only file
    system'): NumPy ran. Now this process builds its own, with one warning."""
    _needs_cc()
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib"), r.stderr
    (so,) = (tmp_path / "cpu").iterdir()
    so.write_bytes(so.read_bytes()[:4096])
    r = _fresh(_READ_ONLY + _GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lib None"), r.stdout
    assert r.stderr.count("RuntimeWarning") == 1 and "cannot be written" in r.stderr
    assert so.stat().st_size == 4096                      # the read-only cache as it was


def test_a_compiler_that_writes_nothing_caches_nothing(tmp_path):
    """A "compiler" that exits 0 and writes no library (CC=true) left an empty kernels-*.so in
    the cache, and every later start fell back to NumPy with a "file too short" warning. Now
    it is a failed build: NumPy with one warning that says so, and nothing cached."""
    cache = tmp_path / "c"
    r = _fresh(_GELU_CHECK, CC=_script(tmp_path / "silent-cc", "exit 0").as_posix(),
               FORGE_CACHE_DIR=str(cache))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("numpy") and "wrote no library" in r.stdout, r.stdout
    assert not [p for p in cache.rglob("*.so")], sorted(cache.rglob("*"))
