"""Fused float32 CPU kernels in C (``cpu_kernels.c``), compiled on first use, loaded by ctypes.

``cpu.py`` asks ``lib()`` for the loaded library and calls it for C-contiguous float32 arrays;
everything else (float64 gradient checks, a machine without a C compiler, a failed compile)
runs the NumPy kernels, which stay the reference. ``FORGE_CPU_KERNELS`` picks:

    auto   (default) the C kernels if they compile, else NumPy with one warning saying why
    numpy  NumPy only; the C source is never compiled
    c      the C kernels or an error (for tests and benchmarks that must not fall back)

The shared library is built with ``$CC`` (else ``cc``, else ``gcc``) at -O3, never
-ffast-math, with -march=native where the compiler takes it, into
``$FORGE_CACHE_DIR/cpu`` (default ``$XDG_CACHE_HOME/forge-ml/cpu``, ``~/.cache/forge-ml/cpu``),
named by a hash of the source, the compiler's version, the flags and the CPU's feature
flags. It is written to a private temporary name and renamed into place, so concurrent
processes (``pytest -n 2``) never load a half-written file.

>>> import numpy as np
>>> from forge_ml.backends import cpu_native
>>> cpu_native.mode() in ("auto", "numpy", "c")
True
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from ..errors import ForgeError

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_MODES = ("auto", "numpy", "c")
_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu99", "-ffp-contract=fast", "-fno-math-errno",
               "-fno-trapping-math", "-fopenmp-simd")
# Tried in order until one compiles. -march=native: AVX2/FMA where the CPU has them.
# -fno-thread-jumps: GCC otherwise clones gelu's loop body for exp_f32's clamped inputs,
# which costs a second division per element (gelu 0.76 -> 0.24 ms on (768, 512)).
_FLAG_CHOICES = (_BASE_FLAGS + ("-march=native", "-fno-thread-jumps"),
                 _BASE_FLAGS + ("-march=native",),
                 _BASE_FLAGS)

_c_long, _c_float, _c_int, _p = ctypes.c_long, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# name -> (restype, argtypes); pointers are passed as ints (array.ctypes.data)
_SIGNATURES = {
    "exp_f32_array": (None, [_p, _p, _c_long]),
    "gelu_f32": (None, [_p, _p, _c_long]),
    "gelu_bwd_f32": (None, [_p, _p, _p, _c_long]),
    "layernorm_f32": (None, [_p, _p, _p, _p, _c_long, _c_long, _c_float]),
    "layernorm_bwd_f32": (_c_int, [_p, _p, _p, _p, _p, _p, _c_long, _c_long, _c_float]),
    "attention_f32": (_c_int, [_p, _p, _p, _p, _p, _c_long, _c_long, _c_long, _c_float]),
    "attention_bwd_f32": (_c_int, [_p] * 9 + [_c_long, _c_long, _c_long, _c_float]),
    "attention_qkv_f32": (_c_int, [_p] * 3 + [_c_long] * 4 + [_c_float]),
    "attention_qkv_bwd_f32": (_c_int, [_p] * 5 + [_c_long] * 4 + [_c_float]),
    "adamw_f32": (None, [_p, _p, _p, _p, _c_long] + [_c_float] * 7 + [_c_int]),
    "sumsq_f32": (ctypes.c_double, [_p, _c_long]),
}


class NativeKernelError(ForgeError):
    """The C kernels were required (FORGE_CPU_KERNELS=c) but could not be built or loaded."""


_lock = threading.Lock()
_state = {"mode": None, "lib": None, "tried": False, "why": None}


def mode() -> str:
    """The kernel choice in force: ``auto``, ``numpy`` or ``c`` (``FORGE_CPU_KERNELS``)."""
    if _state["mode"] is None:
        m = os.environ.get("FORGE_CPU_KERNELS", "auto").strip().lower() or "auto"
        if m not in _MODES:
            raise NativeKernelError(f"FORGE_CPU_KERNELS must be one of {', '.join(_MODES)}, "
                                    f"got {m!r}")
        _state["mode"] = m
    return _state["mode"]


def set_mode(m: str) -> str:
    """Switch the kernel choice at run time (tests, benchmarks); returns the previous one."""
    if m not in _MODES:
        raise NativeKernelError(f"set_mode: expected one of {', '.join(_MODES)}, got {m!r}")
    old = mode()
    _state["mode"] = m
    if m == "c":
        _require()
    return old


def why_not() -> str | None:
    """Why the C kernels are not in use (None when they are, or were never asked for)."""
    return _state["why"]


def lib():
    """The loaded C library, or None when NumPy is to run (mode ``numpy``, or no build)."""
    m = _state["mode"] or mode()
    if m == "numpy":
        return None
    if not _state["tried"]:
        _load()
    if _state["lib"] is None and m == "c":
        _require()
    return _state["lib"]


def _require():
    if not _state["tried"]:
        _load()
    if _state["lib"] is None:
        raise NativeKernelError(f"FORGE_CPU_KERNELS=c but the C kernels are unavailable: "
                                f"{_state['why']}")


def _load():
    with _lock:
        if _state["tried"]:
            return
        try:
            path = build()
            _state["lib"] = _bind(ctypes.CDLL(str(path)))
        except (OSError, AttributeError, NativeKernelError, subprocess.SubprocessError) as e:
            # AttributeError: a kernel missing from the library
            _state["why"] = str(e)
            if _state["mode"] != "c":
                warnings.warn(f"forge-ml: the C CPU kernels are unavailable, NumPy runs "
                              f"instead (FORGE_CPU_KERNELS=numpy silences this): {e}",
                              RuntimeWarning, stacklevel=4)
        _state["tried"] = True


def _bind(cdll):
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
    return cdll


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, else ``gcc`` on PATH; None if none."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    root = os.environ.get("FORGE_CACHE_DIR")
    if root:
        return Path(root) / "cpu"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "forge-ml" / "cpu"


def _cpu_flags() -> str:
    """The CPU's feature flags (part of the cache key: -march=native code is per CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.machine() + platform.processor()


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def build() -> Path:
    """Compile ``cpu_kernels.c`` (or find it already built) and return the library's path."""
    cc = compiler()
    if cc is None:
        raise NativeKernelError("no C compiler found (set CC, or install cc/gcc)")
    try:
        version = _run([cc, "--version"]).stdout
    except OSError as e:
        raise NativeKernelError(f"the C compiler {cc} cannot run: {e}") from None
    source = SOURCE.read_bytes()
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    last_err = ""
    for flags in _FLAG_CHOICES:
        key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(),
                                         " ".join(flags).encode(), _cpu_flags().encode(),
                                         sys.platform.encode()])).hexdigest()[:20]
        path = out_dir / f"cpu_kernels-{key}.so"
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".cpu_kernels-{key}.", suffix=".so.tmp", dir=out_dir)
        os.close(fd)
        try:
            res = _run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"])
            if res.returncode == 0:
                os.replace(tmp, path)
                return path
            last_err = (res.stderr or res.stdout).strip()[-2000:]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise NativeKernelError(f"{cc} could not compile {SOURCE.name}:\n{last_err}")


def f32(*arrays) -> bool:
    """True when every array is float32 and C-contiguous (what the C kernels take)."""
    for a in arrays:
        if a.dtype.char != "f" or not a.flags.c_contiguous:
            return False
    return True


def ptr(a: np.ndarray) -> int:
    """The address of an array's first element."""
    return a.ctypes.data
