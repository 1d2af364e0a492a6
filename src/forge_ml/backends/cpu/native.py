"""Fused float32 CPU kernels in C (``pool.c``, ``gemm.c``, ``attention.c``, ``kernels.c``; what
they share in ``cpu_kernels.h``), compiled on first use into one library, loaded by ctypes.

The backend (``backends/cpu/__init__.py``) asks ``lib()`` for the loaded library and calls it
for C-contiguous float32 arrays; everything else (float64 gradient checks, a machine without
a C compiler, a failed compile) runs ``reference.py``'s NumPy kernels. The switch
``FORGE_CPU_KERNELS`` (read through ``forge_ml.flags``; tests use ``flags.override``) picks:

    auto   (default) the C kernels if they compile, else NumPy with one warning saying why
    numpy  NumPy only; the C source is never compiled
    c      the C kernels or an error (for tests and benchmarks that must not fall back)

The shared library is built with ``$CC`` (a command line: ``ccache gcc`` or ``gcc -m64`` are
split into words, as make does; else ``cc``, else ``gcc``) at -O3, never
-ffast-math, with -march=native where the compiler takes it, into
``$FORGE_CACHE_DIR/cpu`` (default ``$XDG_CACHE_HOME/forge-ml/cpu``, ``~/.cache/forge-ml/cpu``),
named by a hash of the sources, the compiler's version, the flags and the CPU's feature
flags; a library cached under any of the flag sets is looked for before anything is compiled.
It is written to a private temporary name and renamed into place (mode 0755, so that a cache
shared by several users serves them all), so concurrent processes (``pytest -n 2``) never load
a half-written file; that library is the only file a build leaves. Where the cache cannot be
written (a read-only home, a full disk), or holds a library this user can neither read nor
replace (another user's, a damaged one in a read-only cache), the library is built in a
temporary folder for this process alone, removed at exit, with one warning. A cached library
that does not load (truncated, overwritten) is deleted and built again, once; only if that
fails too does NumPy run, with one warning.

>>> from forge_ml.backends.cpu import native
>>> native.mode() in ("auto", "numpy", "c")
True
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from ... import flags
from ...errors import ForgeError

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("pool.c", "gemm.c", "attention.c", "kernels.c"))
"""The C files built together into one library; ``HEADERS`` are part of its cache key."""
HEADERS = (HERE / "cpu_kernels.h",)
_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu99", "-ffp-contract=fast", "-fno-math-errno",
               "-fno-trapping-math", "-fopenmp-simd", "-pthread")
# Tried in order until one compiles. -march=native: AVX2/FMA where the CPU has them.
# -fno-thread-jumps: GCC otherwise clones gelu's loop body for exp_f32's clamped inputs,
# which costs a second division per element (gelu 0.76 -> 0.24 ms on (768, 512)).
_FLAG_CHOICES = (_BASE_FLAGS + ("-march=native", "-fno-thread-jumps"),
                 _BASE_FLAGS + ("-march=native",),
                 _BASE_FLAGS)

_c_long, _c_float, _c_int, _p = ctypes.c_long, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# name -> (restype, argtypes); pointers are passed as ints (ptr(array), below)
_SIGNATURES = {
    "exp_f32_array": (None, [_p, _p, _c_long]),
    "gelu_f32": (None, [_p, _p, _c_long]),
    "gelu_bwd_f32": (None, [_p, _p, _p, _c_long]),
    "layernorm_f32": (None, [_p, _p, _p, _p, _c_long, _c_long, _c_float]),
    "layernorm_bwd_f32": (_c_int, [_p] * 8 + [_c_long, _c_long, _c_float]),
    "attention_f32": (_c_int, [_p, _p, _p, _p, _p, _c_long, _c_long, _c_long, _c_float]),
    "attention_bwd_f32": (_c_int, [_p] * 9 + [_c_long, _c_long, _c_long, _c_float]),
    "attention_qkv_f32": (_c_int, [_p] * 3 + [_c_long] * 4 + [_c_float]),
    "attention_qkv_bwd_f32": (_c_int, [_p] * 5 + [_c_long] * 4 + [_c_float]),
    "attention_qkv_bwd_sums_f32": (_c_int, [_p] * 6 + [_c_long] * 4 + [_c_float]),
    "attention_qkv_dropout_f32": (_c_int, [_p] * 3 + [_c_long] * 4 + [_c_float] * 3
                                  + [ctypes.c_uint32] * 2),
    "attention_qkv_dropout_bwd_f32": (_c_int, [_p] * 5 + [_c_long] * 4 + [_c_float] * 3
                                      + [ctypes.c_uint32] * 2),
    "adamw_f32": (None, [_p, _p, _p, _p, _c_long] + [_c_float] * 7 + [_c_int]),
    "sumsq_f32": (ctypes.c_double, [_p, _c_long]),
    "adamw_many_f32": (None, [_c_long] + [_p] * 5 + [_c_float] * 4 + [_p] * 3 + [_c_int]),
    "sumsq_many_f32": (None, [_c_long, _p, _p, _p]),
    "dropout_f32": (None, [_p, _p, _c_long, ctypes.c_uint32, ctypes.c_uint32, _c_float, _c_float]),
    "forge_set_threads": (None, [_c_int]),
    "xent_f32": (_c_int, [_p, _p, _c_long, _c_long, _c_long, _c_float, _p, _p]),
    "scatter_add_rows_f32": (_c_int, [_p, _c_long, _p, _p, _c_long, _c_long]),
    "forge_set_blas": (None, [_p, _p, _c_int]),
    "forge_set_gemm_blocks": (None, [_c_long]),
    "forge_gemm_own": (_c_int, [_c_int]),
    "gemm_f32": (_c_int, [_c_int, _c_int, _c_long, _c_long, _c_long, _c_float, _p, _c_long, _p,
                          _c_long, _p, _p, _c_int, _p, _p, _c_long, _p]),
    "forge_get_threads": (_c_int, []),
}


class NativeKernelError(ForgeError):
    """The C kernels were required (FORGE_CPU_KERNELS=c) but could not be built or loaded."""


_lock = threading.Lock()
_state = {"lib": None, "tried": False, "why": None,   # one load attempt per process
          "threads": None,                               # set_threads before the load
          "products": False}                             # gemm_f32 has an sgemm


def mode() -> str:
    """The kernel choice in force: ``auto``, ``numpy`` or ``c`` (``FORGE_CPU_KERNELS``)."""
    return flags.get("FORGE_CPU_KERNELS")


def why_not() -> str | None:
    """Why the C kernels are not in use (None when they are, or were never asked for)."""
    return _state["why"]


def lib():
    """The loaded C library, or None when NumPy is to run (mode ``numpy``, or no build).
    In mode ``c`` a library that cannot be had is a NativeKernelError."""
    m = mode()
    if m == "numpy":
        return None
    if not _state["tried"]:
        _load(m)
    if _state["lib"] is None and m == "c":
        raise NativeKernelError(f"FORGE_CPU_KERNELS=c but the C kernels are unavailable: "
                                f"{_state['why']}")
    return _state["lib"]


def _load(m):
    with _lock:
        if _state["tried"]:
            return
        try:
            cdll = _open()
            _take_products(cdll)
            _state["lib"] = cdll
            set_threads(_state["threads"] or _blas_threads())
        except (OSError, AttributeError, NativeKernelError, subprocess.SubprocessError) as e:
            _state["why"] = str(e)
            if m != "c":  # stacklevel 4: the caller of the backend op that asked for lib()
                warnings.warn(f"forge-ml: the C CPU kernels are unavailable, NumPy runs "
                              f"instead (FORGE_CPU_KERNELS=numpy silences this): {e}",
                              RuntimeWarning, stacklevel=4)
        _state["tried"] = True


def _blas_threads() -> int:
    """The thread count of NumPy's OpenBLAS (1 where none is found): the kernels' pool starts
    with it."""
    from ... import blas
    return blas.openblas_threads() or 1


GEMM_BLOCKS_MAX = 16
"""A product is split into this many blocks of rows at most: one per core the process may use
when the library loads (``gemm_f32``; the thread count never changes the split, so never a
bit)."""


def _take_products(cdll) -> None:
    """Give the library OpenBLAS's ``cblas_sgemm`` and ``cblas_sgemv`` (``gemm_f32`` calls them
    on the pool's threads, one block of C each), unless ``FORGE_CPU_GEMM=openblas``; with
    ``pool`` (the default) blocks of 64 rows or more take gemm.c's own AVX-512 product where
    the library has it, with ``pool-openblas`` always the sgemm. Two pools of
    threads on one small machine fight: OpenBLAS's idle threads spin for a while after each
    product and, on a 2-core VM, took the core the kernels' second thread was woken on (the
    attention's backward gained nothing from a second thread until OpenBLAS's had none)."""
    from ... import blas
    choice = flags.get("FORGE_CPU_GEMM")
    found = blas.sgemm() if choice in ("pool", "pool-openblas") else None
    if found is not None:
        cdll.forge_set_blas(*found)
        cdll.forge_set_gemm_blocks(min(GEMM_BLOCKS_MAX, blas.cores()))
        _state["products"] = True
        cdll.forge_gemm_own(int(choice == "pool"))


def own_product() -> bool:
    """Whether ``gemm_f32``'s blocks of 64 rows or more take gemm.c's own AVX-512 product
    rather than OpenBLAS's sgemm (``FORGE_CPU_GEMM=pool`` on a library built for AVX-512).

    >>> own_product() in (True, False)
    True
    """
    return owns_products() and bool(_state["lib"].forge_gemm_own(-1))   # -1: asks, sets nothing


def owns_products() -> bool:
    """Whether the kernels' pool runs the float32 matrix products (``gemm_f32``): the library
    is loaded and found OpenBLAS's sgemm. OpenBLAS then keeps one thread of its own."""
    return _state["lib"] is not None and _state["products"]


def set_threads(n: int) -> None:
    """The size of the kernels' thread pool, the calling thread included (``blas.set_threads``
    sets it, so the ThreadTuner's choice holds for every kernel). Results do not depend on it.
    Before the library is loaded, the count is kept for the load; where the pool runs the
    products, OpenBLAS is kept at one thread.

    >>> before = threads(); set_threads(1); threads()
    1
    >>> set_threads(before)
    """
    _state["threads"] = max(1, int(n))
    if _state["lib"] is not None:
        _state["lib"].forge_set_threads(_state["threads"])
        if _state["products"]:
            from ... import blas
            blas.openblas_set_threads(1)


def threads() -> int:
    """The kernels' pool size (the count the library will start with, before it is loaded)."""
    if _state["lib"] is not None:
        return int(_state["lib"].forge_get_threads())
    return _state["threads"] or _blas_threads()


def _open():
    """Build (or find) the library and load it. A cached library that is cut short or does
    not load (OSError; AttributeError for a kernel it lacks) is deleted and built again,
    once; a second failure propagates. One this user may not read, or not replace (another
    user's in a shared cache, one in a read-only cache, a folder at its name), is built again
    for this process alone."""
    path, cached = build()
    if cached:
        loaded = False
        try:
            if _whole(path):
                cdll = ctypes.CDLL(str(path))
                loaded = True
                return _bind(cdll)
        except PermissionError:       # _whole's read: a library this user may not read
            return _bind(ctypes.CDLL(str(build(private=True)[0])))
        except (OSError, AttributeError):
            pass
        try:
            path.unlink(missing_ok=True)  # another process may have removed it first
        except OSError:   # not ours to remove: another user's, a read-only cache, a folder
            return _bind(ctypes.CDLL(str(build(private=True)[0])))
        path, _ = build()
        if loaded:
            # the loader hands back the library it already loaded from a path, not the file
            # built there again: this process loads a copy of the new one under another name
            path = _process_copy(path)
    return _bind(ctypes.CDLL(str(path)))


def _process_copy(path: Path) -> Path:
    """A copy of the library ``path`` in a temporary folder of this process, removed at exit."""
    tmp_dir = tempfile.mkdtemp(prefix="forge-ml-cpu-")
    atexit.register(shutil.rmtree, tmp_dir, ignore_errors=True)
    return Path(shutil.copy(path, tmp_dir))


def _whole(path: Path) -> bool:
    """Whether a cached library is all there. dlopen of a truncated ELF file can die of
    SIGBUS instead of failing, so the file is checked first: the section header table, which
    the linker writes last, must lie inside it. Garbage that is not ELF fails on Linux
    (other platforms' formats are left to the loader)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] != b"\x7fELF":
        return not sys.platform.startswith("linux")
    if len(head) < 64:
        return False
    end = "<" if head[5] == 1 else ">"           # EI_DATA: 1 little-endian, 2 big-endian
    if head[4] == 2:                             # EI_CLASS 2: ELF64
        shoff = struct.unpack_from(end + "Q", head, 0x28)[0]
        shentsize, shnum = struct.unpack_from(end + "HH", head, 0x3A)
    else:                                        # ELF32
        shoff = struct.unpack_from(end + "I", head, 0x20)[0]
        shentsize, shnum = struct.unpack_from(end + "HH", head, 0x2E)
    return shoff + shentsize * shnum <= path.stat().st_size


def _bind(cdll):
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
    return cdll


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, else ``gcc`` on PATH; None if none.
    ``$CC`` may be a command line (``ccache gcc``, ``gcc -m64``): its program is looked up.

    >>> import os
    >>> old = os.environ.get("CC"); os.environ["CC"] = "no-such-wrapper gcc -m64"
    >>> compiler()
    'no-such-wrapper gcc -m64'
    >>> _ = os.environ.pop("CC") if old is None else os.environ.update(CC=old)
    """
    cc = os.environ.get("CC")
    if cc:
        words = _argv(cc)
        if not words:
            return None
        prog = shutil.which(words[0]) or words[0]
        return prog if len(words) == 1 else shlex.join([prog, *words[1:]])
    return shutil.which("cc") or shutil.which("gcc")


def _argv(cc: str) -> list:
    """A compiler command (``$CC``, or what ``compiler()`` gave) as the words to run: one
    program whose path holds a space, else the words a shell would split it into (an unclosed
    quote: one name, which then 'cannot run', not a traceback)."""
    if os.path.exists(cc):
        return [cc]
    try:
        return shlex.split(cc)
    except ValueError:
        return [cc]


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    return flags.cache_root("cpu")


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
    # errors="replace": a compiler's messages in another encoding than Python's (a Latin-1
    # locale, a file name's bytes) were a UnicodeDecodeError from the first kernel call
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)


def build(private: bool = False) -> tuple:
    """Compile the C files into one library, or find it already built: ``(path of the library, whether it
    was found in the cache)``. Where the cache cannot be written, or ``private`` (its library
    cannot be used: see ``_open``), the library is built in a temporary folder, removed at
    exit, with one warning."""
    cc = compiler()
    if cc is None:
        raise NativeKernelError("no C compiler found (set CC, or install cc/gcc)")
    argv = _argv(cc)
    try:
        version = _run([*argv, "--version"]).stdout
    except OSError as e:
        raise NativeKernelError(f"the C compiler {cc} cannot run: {e}") from None
    source = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES + HEADERS)
    out_dir = cache_dir()
    if private:
        why = "it holds a library this user can neither load nor replace"
    else:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            return _build_in(out_dir, argv, version, source)
        except OSError as e:     # the cache cannot be written (read-only home, a file in the way)
            why = f"{type(e).__name__}: {e}"
    try:
        tmp_dir = tempfile.mkdtemp(prefix="forge-ml-cpu-")
    except OSError as e:
        raise NativeKernelError(f"the kernel cache {out_dir} cannot be written ({why}), nor a "
                                f"temporary folder ({e}); set FORGE_CACHE_DIR to a writable "
                                f"folder") from None
    atexit.register(shutil.rmtree, tmp_dir, ignore_errors=True)
    # stacklevel 6 (build < _open < _load < lib < op): the line that called the op (7 was
    # the line above it: 'sys:1' from a script)
    warnings.warn(f"forge-ml: the kernel cache {out_dir} cannot be written ({why}); the C CPU "
                  f"kernels are built for this process only (set FORGE_CACHE_DIR to a writable "
                  f"folder to keep them)", RuntimeWarning, stacklevel=6)
    return _build_in(Path(tmp_dir), argv, version, source)


def _build_in(out_dir: Path, argv: list, version: str, source: bytes) -> tuple:
    """``build`` in the folder ``out_dir``: the cached library if it is there (under any flag
    set: a compiler that refuses the first set is not asked again at every start), else a new
    one (an OSError where the folder cannot be written)."""
    cpu = _cpu_flags().encode()
    paths = []
    for cflags in _FLAG_CHOICES:
        key = hashlib.sha256(b"\0".join([source, shlex.join(argv).encode(), version.encode(),
                                         " ".join(cflags).encode(), cpu,
                                         sys.platform.encode()])).hexdigest()[:20]
        paths.append((cflags, key, out_dir / f"kernels-{key}.so"))
    for _, _, path in paths:
        if path.exists():
            return path, True
    last_err = ""
    for cflags, key, path in paths:
        fd, tmp = tempfile.mkstemp(prefix=f".kernels-{key}.", suffix=".so.tmp", dir=out_dir)
        os.close(fd)
        try:
            res = _run([*argv, *cflags, "-o", tmp, *map(str, SOURCES), "-lm"])
            # a "compiler" that exits 0 and writes nothing (CC=true) is a failure: its empty
            # file, cached, made every later start fall back to NumPy ("file too short")
            if res.returncode == 0 and os.path.getsize(tmp) > 0:
                os.chmod(tmp, 0o755)     # mkstemp's 0600: other users of a shared cache
                os.replace(tmp, path)
                return path, False
            last_err = ((res.stderr or res.stdout).strip()[-2000:] if res.returncode else
                        f"it exited 0 but wrote no library to {tmp}")
            _room_for_a_library(tmp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise NativeKernelError(f"{shlex.join(argv)} could not compile {', '.join(p.name for p in SOURCES)}:\n{last_err}")


def _room_for_a_library(tmp: str) -> None:
    """After a failed compile into the cache, whether the cache's disk took the output: an
    OSError (ENOSPC, EDQUOT) where 1 MiB (the library is ~90 KB) cannot be written into the
    temporary file ``tmp``, so that ``build`` builds for this process alone. A full disk made
    the linker fail at every flag set, and NumPy ran behind a compiler error."""
    with open(tmp, "wb") as f:
        f.write(bytes(1 << 20))
        f.flush()
        os.fsync(f.fileno())


def f32(*arrays) -> bool:
    """True when every array is float32 and C-contiguous (what the C kernels take)."""
    for a in arrays:
        if a.dtype.char != "f" or not a.flags.c_contiguous:
            return False
    return True


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def ptr(a) -> int:
    """The address of array ``a``'s first element, as the kernels' pointer arguments take it:
    through ctypes' buffer view where ``a`` is writable and contiguous (200 ns; ``a.ctypes.data``
    builds a ctypes helper object, 850 ns, and a training step passes ~440 pointers), else
    ``a.ctypes.data``.

    >>> import numpy as np
    >>> a = np.zeros(3, np.float32); b = np.zeros(3); b.flags.writeable = False
    >>> ptr(a) == a.ctypes.data, ptr(b) == b.ctypes.data
    (True, True)
    """
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def optr(a):
    """``ptr(a)``, or None (a NULL pointer) for an optional array that is not given.

    >>> optr(None) is None
    True
    """
    return None if a is None else ptr(a)
