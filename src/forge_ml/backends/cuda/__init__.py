"""The CUDA backend: CuPy arrays, forge-ml's own kernels (``kernels/*.cu``, compiled by NVRTC on
first use and cached by CuPy, in memory and on disk), and cuBLAS for the matrix products (called
through ctypes, so that they can be captured in a CUDA graph; on Hopper, products of at most
four rows go to ``kernels/gemv.cu`` instead, the layers of a decoding step). ``capture_graph``
records the device work of a function once for replays (``models.gpt2.DecodeStep`` uses it).
On Hopper the decoding kernels (gemv, decode attention) run as thread-block clusters and with
programmatic dependent launch (``_LauncherEx``: ``cuLaunchKernelEx`` through ctypes), so each
starts loading its weights while the previous kernel finishes.

Dtypes: float32, float64 and bfloat16 (stored as 2-byte words, ``ml_dtypes.bfloat16`` on the
CuPy side; every kernel accumulates bf16 in float32). Each kernel file holds one layer's
forward and backward side by side; ``kernels/common.cuh`` is pasted into each before NVRTC
sees it. Errors: no CuPy or no GPU -> DeviceError at import; an unknown device index ->
DeviceError from ``use_device``; NVRTC failures -> CompileError with the compiler's log; an
allocation the GPU cannot hold -> OutOfMemoryError (the process can go on).

The contract is in ``forge_ml/backends/__init__.py``; this module only computes (``ops`` has
checked shapes, dtypes and devices already), but it keeps a few cheap checks of its own so that
a direct call with bad shapes fails with a ShapeError rather than a wild kernel.
"""
from __future__ import annotations

import functools
import math
import re
import sys
import threading
from pathlib import Path

import numpy as np

from ...errors import CompileError, DeviceError, DTypeError, OutOfMemoryError, ShapeError
from ... import rng as _rng
from .. import compose as _compose

try:
    import cupy
except ImportError as e:  # forge_ml.backends.get turns this into a DeviceError too
    raise DeviceError(
        f"the CUDA backend needs CuPy, which does not import here ({e}); install it with "
        "pip install 'forge-ml[cuda]' (cupy-cuda13x) on a machine with an NVIDIA GPU") from e


def _device_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise DeviceError(
            f"CuPy {cupy.__version__} is installed but no CUDA device can be used: {e}") from e


if _device_count() == 0:
    raise DeviceError(f"CuPy {cupy.__version__} is installed but this machine has no CUDA device")


def _bf16_dtype():
    """bfloat16 as CuPy sees it: its own type when it has one, else ml_dtypes' (CuPy 14)."""
    own = getattr(cupy, "bfloat16", None)
    if own is not None:
        return np.dtype(own)
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
BF16 = _bf16_dtype()
_FLOATS = tuple(d for d in (F32, F64, BF16) if d is not None)
_DTYPES = {"float32": F32, "float64": F64, "int32": np.dtype(np.int32),
           "int64": np.dtype(np.int64)}
if BF16 is not None:
    _DTYPES["bfloat16"] = BF16

# kernel-name suffixes
_SFX = {F32: "f32", F64: "f64", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
if BF16 is not None:
    _SFX[BF16] = "bf16"
_WORD = {2: "b16", 4: "b32", 8: "b64"}  # bit-copy kernels by element size

_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_INCLUDE = '#include "common.cuh"'
_THREADS = 256


# ----------------------------------------------------------------------------------------------
# Device, errors, compilation
# ----------------------------------------------------------------------------------------------

_N_DEVICES = _device_count()
_current = threading.local()  # the device forge-ml last made current in this thread


def use_device(index: int) -> None:
    """Make GPU ``index`` current for this thread; DeviceError if the machine has no such GPU.

    Called before every op, so it is cheap when the device is already current: the ordinal
    forge-ml last set is remembered per thread and the driver is only called on a change
    (code that switches devices behind forge-ml's back should call this again).
    """
    if getattr(_current, "index", None) == index:
        return
    n = _N_DEVICES
    if not isinstance(index, (int, np.integer)) or not 0 <= int(index) < n:
        raise DeviceError(
            f"cuda:{index} was asked for but this machine has {n} CUDA device(s): "
            f"cuda:0 to cuda:{n - 1}")
    cupy.cuda.Device(int(index)).use()
    _current.index = int(index)


def _dev() -> int:
    """The current device ordinal (forge-ml's record of it; the driver's when none yet)."""
    idx = getattr(_current, "index", None)
    if idx is None:
        idx = _current.index = cupy.cuda.Device().id
    return idx


def device_name() -> str:
    """The current GPU's name, e.g. 'NVIDIA H200'."""
    dev = cupy.cuda.Device()
    return cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()


def synchronize() -> None:
    """Wait for all work queued on the current GPU."""
    cupy.cuda.Device().synchronize()


def _oom_error(e: BaseException) -> OutOfMemoryError:
    requested = getattr(e, "_size", None)
    if requested is None:
        found = re.search(r"allocating ([\d,]+) bytes", str(e))
        requested = int(found.group(1).replace(",", "")) if found else None
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
    except Exception:  # the context may be unusable; say what we know
        free = total = None
    pool = cupy.get_default_memory_pool()
    asked = f"{requested:,} bytes" if requested is not None else "an allocation"
    if free is None:
        room = "the free amount is unknown"
    else:
        room = (f"{free:,} bytes are free on the device out of {total:,} "
                f"(plus {pool.free_bytes():,} cached free in CuPy's pool)")
    return OutOfMemoryError(
        f"out of GPU memory on cuda:{cupy.cuda.Device().id}: asked for {asked} but {room}. "
        "Use a smaller batch or sequence length, or bfloat16")


def _guarded(fn):
    """Turn CuPy/cuBLAS out-of-memory failures into forge_ml's OutOfMemoryError."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise _oom_error(e) from e
        except cupy.cuda.runtime.CUDARuntimeError as e:
            if "memory" in str(e).lower() and "out of" in str(e).lower():
                raise _oom_error(e) from e
            raise DeviceError(f"{fn.__name__}: CUDA failed: {e}") from e
    return wrapper


_lock = threading.Lock()
_modules: dict = {}
_functions: dict = {}


def compile_source(source: str, label: str = "<source>", options=("--std=c++17",)):
    """Compile CUDA C++ ``source`` with NVRTC into a loaded ``cupy.RawModule``.

    CuPy adds ``-arch=sm_XY`` for the current GPU (so the module holds native code for it,
    sm_90 on Hopper) and caches the result on disk. A compile failure raises CompileError
    carrying NVRTC's log.
    """
    module = cupy.RawModule(code=source, options=tuple(options))
    try:
        module.compile()
    except cupy.cuda.compiler.CompileException as e:
        log = e.get_message() if hasattr(e, "get_message") else str(e)
        raise CompileError(f"NVRTC could not compile {label}:\n{log}") from None
    return module


def kernel_source(stem: str) -> str:
    """kernels/<stem>.cu with kernels/common.cuh pasted in place of its include line."""
    path = _KERNEL_DIR / f"{stem}.cu"
    try:
        text = path.read_text()
    except OSError as e:
        raise CompileError(f"kernel source {path} cannot be read: {e}") from e
    return text.replace(_INCLUDE, (_KERNEL_DIR / "common.cuh").read_text(), 1)


def _function(stem: str, name: str):
    key = (_dev(), stem, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            mkey = key[:2]
            module = _modules.get(mkey)
            if module is None:
                module = compile_source(kernel_source(stem), f"kernels/{stem}.cu")
                _modules[mkey] = module
            fn = module.get_function(name)
            _functions[key] = fn
    return fn


def _launch(stem: str, name: str, grid, block, args, shared: int = 0, pdl: bool = False,
            writes=(), cluster=None) -> None:
    """Launch kernel ``name`` of kernels/<stem>.cu on the current stream. ``pdl``: the kernel
    calls ``pdl_wait()`` (common.cuh) before it reads anything the previous kernel writes, so
    on Hopper it may be launched with programmatic dependent launch (``_LauncherEx``);
    ``writes``: the arrays it writes (``_pdl_wrote`` asks about them). ``cluster``: blocks per
    thread-block cluster (x, y, z), Hopper only (the caller checks ``_launcher_ex()``)."""
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    fn = _function(stem, name)
    # a kernel launched without pdl never lets the next one start early
    _pdl_writes[:] = [(a.data.ptr, a.data.ptr + a.nbytes) for a in writes] if pdl else []
    pdl = pdl and _pdl_on()
    if pdl or cluster is not None:
        _launcher().launch(fn.kernel.ptr, grid, block, args, shared,
                               cupy.cuda.get_current_stream().ptr, pdl, cluster)
    else:
        fn(grid, block, args, shared_mem=shared)


class _LauncherEx:
    """``cuLaunchKernelEx`` (libcuda, through ctypes), for launch attributes CuPy's launcher
    lacks: thread-block cluster dimensions, and programmatic stream serialization
    (programmatic dependent launch): the kernel may start while the previous kernel on the
    stream still runs, once every block of that one has called ``pdl_launch_dependents()``
    (or ended). Its blocks load
    what does not depend on the previous kernel (the weights of a decoding step), then
    ``pdl_wait()`` until the previous kernel has finished and its writes are visible. Inside a
    CUDA graph capture this becomes a programmatic edge."""

    _ATTR_CLUSTER_DIMENSION = 4                  # CU_LAUNCH_ATTRIBUTE_..., cuda.h
    _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    def __init__(self, lib):
        import ctypes as C

        class Attribute(C.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
            _fields_ = [("id", C.c_int), ("pad", C.c_char * 4), ("value", C.c_int * 16)]

        class Config(C.Structure):  # CUlaunchConfig
            _fields_ = [("grid", C.c_uint * 3), ("block", C.c_uint * 3), ("shared", C.c_uint),
                        ("stream", C.c_void_p), ("attrs", C.POINTER(Attribute)),
                        ("num_attrs", C.c_uint)]

        self._C, self._Config, self._Attribute = C, Config, Attribute
        self._fn = lib.cuLaunchKernelEx
        self._fn.argtypes = [C.POINTER(Config), C.c_void_p, C.c_void_p, C.c_void_p]
        self._fn.restype = C.c_int
        self._err = lib.cuGetErrorString
        self._err.argtypes = [C.c_int, C.POINTER(C.c_char_p)]
        self._types = {np.dtype(np.int32): C.c_int32, np.dtype(np.int64): C.c_int64,
                       np.dtype(np.uint32): C.c_uint32, np.dtype(np.float32): C.c_float,
                       np.dtype(np.float64): C.c_double}

    def _arg(self, a):
        if isinstance(a, cupy.ndarray):
            return self._C.c_void_p(a.data.ptr)
        t = self._types.get(getattr(a, "dtype", None))
        if t is None:
            raise DTypeError(f"pdl launch: kernel argument of type {type(a).__name__} "
                             "(expected a CuPy array or a NumPy int32/int64/uint32/float scalar)")
        return t(a.item())

    def launch(self, func: int, grid, block, args, shared: int, stream: int, pdl: bool = True,
               cluster=None) -> None:
        """Launch CUfunction ``func``; ``pdl``: with programmatic dependent launch;
        ``cluster``: (x, y, z) blocks per thread-block cluster, or None."""
        C = self._C
        cfg = self._Config()
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg.grid[:] = [int(v) for v in g]
        cfg.block[:] = [int(v) for v in b]
        cfg.shared, cfg.stream = int(shared), stream or None
        attrs = (self._Attribute * 2)()
        n = 0
        if pdl:
            attrs[n].id = self._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value[0] = 1
            n += 1
        if cluster is not None:
            attrs[n].id = self._ATTR_CLUSTER_DIMENSION
            attrs[n].value[:3] = [int(v) for v in cluster]
            n += 1
        cfg.attrs, cfg.num_attrs = C.cast(attrs, C.POINTER(self._Attribute)), n
        vals = [self._arg(a) for a in args]
        params = (C.c_void_p * max(1, len(vals)))(*[C.cast(C.pointer(v), C.c_void_p) for v in vals])
        rc = self._fn(C.byref(cfg), C.c_void_p(func), params, None)
        if rc != 0:
            msg = C.c_char_p()
            self._err(rc, C.byref(msg))
            raise DeviceError(f"cuLaunchKernelEx failed: error {rc} "
                              f"({(msg.value or b'?').decode()})")

    @staticmethod
    def load():
        import ctypes
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            return _LauncherEx(lib)
        except (OSError, AttributeError):
            return None


_launchers: list = []  # [the _LauncherEx or None], filled on first use
_pdl_writes: list = []  # (start, end) of what the last kernel launched with pdl=True writes


def _pdl_wrote(a) -> bool:
    """Whether ``a``'s memory meets what the last kernel launched with ``pdl=True`` writes:
    that kernel may still run when the next one starts, so the next one must not load ``a``
    before the previous one has ended. (A launch from outside ``_launch`` in between, a
    cuBLAS or CuPy kernel, would make the early load safe again; this answer is the cautious
    one.)"""
    lo, hi = a.data.ptr, a.data.ptr + a.nbytes
    return any(lo < e and s < hi for s, e in _pdl_writes)


def _launcher() -> "_LauncherEx":
    if not _launchers:
        _launchers.append(_LauncherEx.load())
    return _launchers[0]


def _launcher_ex() -> bool:
    """Launch attributes (clusters, programmatic dependent launch): a GPU of compute
    capability 9.0 or later (Hopper) and libcuda's cuLaunchKernelEx found."""
    return _cc_major(_dev()) >= 9 and _launcher() is not None


def _pdl_on() -> bool:
    """Programmatic dependent launch: ``_launcher_ex()`` and FORGE_PDL not 0."""
    import os
    return os.environ.get("FORGE_PDL", "1") != "0" and _launcher_ex()


@functools.lru_cache(maxsize=None)
def _cc_major(dev: int) -> int:
    return int(cupy.cuda.runtime.getDeviceProperties(dev)["major"])


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])


def _grid(n: int, threads: int = _THREADS, per_sm: int = 32) -> int:
    """Blocks for a grid-stride loop over n items: enough to fill the GPU, at least one."""
    cap = _sm_count(_dev()) * per_sm
    return max(1, min(cap, -(-n // threads)))


def _i32(v):
    return np.int32(v)


def _i64(v):
    return np.int64(v)


def _acc_dtype(dt):
    return F64 if dt == F64 else F32


def _acc(dt, v):
    """A kernel scalar of the accumulation type of dtype ``dt``."""
    return np.float64(v) if dt == F64 else np.float32(v)


def _sfx(dt) -> str:
    try:
        return _SFX[np.dtype(dt)]
    except KeyError:
        raise DTypeError(f"the CUDA backend has no kernels for dtype {dt}") from None


def _float_sfx(x) -> str:
    if x.dtype not in _FLOATS:
        raise DTypeError(f"expected a float32, float64 or bfloat16 array, got {x.dtype}")
    return _SFX[x.dtype]


def _dtype(name):
    name = getattr(name, "name", name)  # a forge_ml DType or a NumPy dtype works too
    try:
        return _DTYPES[name]
    except KeyError:
        if name == "bfloat16":
            raise DTypeError("bfloat16 on the GPU needs CuPy with ml_dtypes installed "
                             "(pip install ml_dtypes)") from None
        raise DTypeError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _c(x):
    """The contract promises C-contiguous arrays; copy if a caller broke that promise."""
    return x if x.flags.c_contiguous else copy(x)


def _empty(shape, dt):
    return cupy.empty(tuple(int(s) for s in shape), dtype=dt)


def _like(x, dt):
    """``x`` in dtype ``dt`` (itself when it already is)."""
    return x if x.dtype == dt else cast(x, dt.name)


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------

@_guarded
def zeros(shape, dtype_name):
    return cupy.zeros(tuple(int(s) for s in shape), dtype=_dtype(dtype_name))


@_guarded
def from_host(np_array, dtype_name):
    dt = _dtype(dtype_name)
    a = np.asarray(np_array)
    if dt == BF16:
        # round on the device (to nearest even), the same code path as every other cast
        return cast(cupy.asarray(np.asarray(a, dtype=np.float32, order="C")), "bfloat16")
    return cupy.asarray(np.asarray(a, dtype=dt, order="C"))  # keeps 0-d arrays 0-d


@_guarded
def to_host(array) -> np.ndarray:
    if array.dtype == BF16:
        array = cast(array, "float32")
    return cupy.asnumpy(array)


@_guarded
def cast(array, dtype_name):
    dt = _dtype(dtype_name)
    x = _c(array)
    if x.dtype == dt:
        return copy(x)
    if BF16 is not None and BF16 in (x.dtype, dt):
        if x.dtype in _FLOATS and dt in _FLOATS:
            out = _empty(x.shape, dt)
            if x.size:
                _launch("elementwise", f"cast_{_SFX[x.dtype]}_{_SFX[dt]}", _grid(x.size),
                        _THREADS, (x, out, _i64(x.size)))
            return out
        # integers <-> bf16 go through float32
        mid = x.astype(F32) if x.dtype != BF16 else cast(x, "float32")
        return cast(mid, dt.name) if dt == BF16 else mid.astype(dt)
    return x.astype(dt)


@_guarded
def copy(array):
    out = cupy.empty(array.shape, dtype=array.dtype)
    if array.size:
        if array.flags.c_contiguous:
            out.data.copy_from_device_async(array.data, array.nbytes)
        elif array.dtype != BF16:
            out[...] = array
        else:  # strided bf16: copy the raw 2-byte words
            out.view(np.uint16)[...] = array.view(np.uint16)
    return out


# ----------------------------------------------------------------------------------------------
# matmul: cuBLAS
# ----------------------------------------------------------------------------------------------

_CUDA_R_32F, _CUDA_R_64F, _CUDA_R_16BF = 0, 1, 14
_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_64F = 68, 70
_CUBLAS_DEFAULT_MATH = 0  # no TF32: float32 products are true float32
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST = 0
_handles: dict = {}


def _cublas():
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError as e:
        raise DeviceError(f"cuBLAS cannot be loaded through CuPy: {e}") from e
    return cublas


def _cublas_handle():
    """forge-ml's own cuBLAS handle for the current device (its math mode is ours to set)."""
    cublas = _cublas()
    dev = _dev()
    h = _handles.get(dev)
    if h is None:
        h = cublas.create()
        cublas.setMathMode(h, _CUBLAS_DEFAULT_MATH)
        cublas.setPointerMode(h, _CUBLAS_POINTER_MODE_HOST)
        _handles[dev] = h
    direct = _cublas_direct()
    if direct is not None:
        direct.set_stream(h, cupy.cuda.get_current_stream().ptr)
    else:
        cublas.setStream(h, cupy.cuda.get_current_stream().ptr)
    return h


class _CublasC:
    """libcublas called through ctypes: the library CuPy loaded, found in this process's memory
    map. CuPy's own cuBLAS wrappers refuse to run while a stream is being captured into a CUDA
    graph; cuBLAS itself records its kernels into the graph. None when it cannot be found
    (then CuPy's wrappers are used, and no matrix product can be captured)."""

    def __init__(self, lib):
        import ctypes as C
        vp, i, ll = C.c_void_p, C.c_int, C.c_longlong
        self.set_stream = lib.cublasSetStream_v2
        self.set_stream.argtypes, self.set_stream.restype = [vp, vp], i
        self.gemm = lib.cublasGemmEx
        self.gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self.gemm.restype = i
        self.gemm_batched = lib.cublasGemmStridedBatchedEx
        self.gemm_batched.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp,
                                      i, i, ll, i, i, i]
        self.gemm_batched.restype = i

    @staticmethod
    def load():
        import ctypes
        _cublas().getVersion  # make sure CuPy has loaded the library
        paths = []
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({ln.split()[-1] for ln in f
                                if "/libcublas.so" in ln and "libcublasLt" not in ln})
        except OSError:
            pass
        for name in paths + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
            try:
                return _CublasC(ctypes.CDLL(name))
            except (OSError, AttributeError):
                continue
        return None


_cublas_c: list = []  # [the _CublasC or None], filled on first use


def _cublas_direct():
    if not _cublas_c:
        _cublas_c.append(_CublasC.load())
    return _cublas_c[0]


_CUBLAS_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
                  8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
                  14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED"}


def _cuda_type(dt) -> int:
    if dt == F32:
        return _CUDA_R_32F
    if dt == F64:
        return _CUDA_R_64F
    if dt == BF16:
        return _CUDA_R_16BF
    raise DTypeError(f"matmul: no cuBLAS type for {dt}")


def _gemm(a, b, out, M, N, K, trans_a, trans_b, batch, stride_a, stride_b, alpha, beta):
    """out (row-major, batch x M x N) = alpha * op(a) @ op(b) + beta * out.

    cuBLAS is column-major, and a row-major matrix is its transpose seen column-major, so we
    ask for out^T = op(b)^T op(a)^T: cuBLAS's A is our b, its B is our a, m = N, n = M.
    The leading dimension of each operand is its stored row length (b_rows changes only N or
    K, never the storage).
    """
    cublas = _cublas()
    h = _cublas_handle()
    if a.dtype == F64:
        compute, scalar = _CUBLAS_COMPUTE_64F, np.float64
    else:
        compute, scalar = _CUBLAS_COMPUTE_32F, np.float32
    al = np.array(alpha, dtype=scalar)
    be = np.array(beta, dtype=scalar)
    op_b = 1 if trans_b else 0
    op_a = 1 if trans_a else 0
    ta, tb, tc = _cuda_type(a.dtype), _cuda_type(b.dtype), _cuda_type(out.dtype)
    lda, ldb = a.shape[-1], b.shape[-1]
    direct = _cublas_direct()
    if direct is not None:
        if batch == 1:
            st = direct.gemm(h, op_b, op_a, N, M, K, al.ctypes.data, b.data.ptr, tb, ldb,
                             a.data.ptr, ta, lda, be.ctypes.data, out.data.ptr, tc, N, compute,
                             _CUBLAS_GEMM_DEFAULT)
        else:
            st = direct.gemm_batched(
                h, op_b, op_a, N, M, K, al.ctypes.data, b.data.ptr, tb, ldb, stride_b,
                a.data.ptr, ta, lda, stride_a, be.ctypes.data, out.data.ptr, tc, N, M * N,
                batch, compute, _CUBLAS_GEMM_DEFAULT)
        if st == 3:
            raise _oom_error(MemoryError("cuBLAS could not allocate its workspace"))
        if st != 0:
            raise DeviceError(f"matmul: cuBLAS failed for ({M} x {K}) @ ({K} x {N}), batch "
                              f"{batch}, {a.dtype}: CUBLAS_STATUS_{_CUBLAS_STATUS.get(st, st)}")
        return
    try:
        if batch == 1:
            cublas.gemmEx(h, op_b, op_a, N, M, K, al.ctypes.data, b.data.ptr, tb, ldb,
                          a.data.ptr, ta, lda, be.ctypes.data, out.data.ptr, tc, N, compute,
                          _CUBLAS_GEMM_DEFAULT)
        else:
            cublas.gemmStridedBatchedEx(
                h, op_b, op_a, N, M, K, al.ctypes.data, b.data.ptr, tb, ldb, stride_b,
                a.data.ptr, ta, lda, stride_a, be.ctypes.data, out.data.ptr, tc, N, M * N,
                batch, compute, _CUBLAS_GEMM_DEFAULT)
    except cublas.CUBLASError as e:
        if "ALLOC_FAILED" in str(e):
            raise _oom_error(e) from e
        raise DeviceError(f"matmul: cuBLAS failed for ({M} x {K}) @ ({K} x {N}), batch {batch}, "
                          f"{a.dtype}: {e}") from e


def _matmul_into(a, b, out, trans_a, trans_b, alpha, b_rows, beta=0.0):
    """Shapes of op(a) @ op(b) into a preallocated ``out`` (which may differ in dtype)."""
    batched = a.ndim >= 3
    batch = math.prod(a.shape[:-2]) if batched else 1
    ar, ac = a.shape[-2:]
    br_stored, bc = b.shape[-2:]
    br = br_stored if b_rows is None else int(b_rows)
    M, K = (ac, ar) if trans_a else (ar, ac)
    Kb, N = (bc, br) if trans_b else (br, bc)
    if out.size == 0:
        return out
    if K == 0:
        if beta == 0.0:
            out.data.memset_async(0, out.nbytes)
        return out
    _gemm(a, b, out, M, N, K, trans_a, trans_b, batch, ar * ac, br_stored * bc, alpha, beta)
    return out


_GEMV_M = 4          # kernels/gemv.cu: GEMV_M
_GEMV_THREADS = 256  # GEMV_WARPS * 32
_GEMV_VEC = {F32: 4}
if BF16 is not None:
    _GEMV_VEC[BF16] = 8
_GEMV_KC = 1024        # kernels/gemv.cu: GEMV_KC, rows of a block's K slice at most
_GEMV_CLUSTER = 8      # blocks of a cluster at most (K slices of one column tile)
_GEMV_LPR = {F32: (32, 16, 8, 4, 2, 1), BF16: (16, 8, 4, 2, 1)}  # lanes per row compiled
_GEMV_TILES = 16       # column tiles wanted at least (with 8 slices: about one block per SM)


def _gemv_ok(a, b, M, K, N) -> bool:
    """Whether x (M, K) @ W (K, N) goes to kernels/gemv.cu: a few rows (decoding), float32 or
    bf16, N a multiple of the 16-byte vector, W 16-byte aligned, K within the kernel's
    slices, on a Hopper GPU (thread-block clusters) (FORGE_GEMV=0 turns it off)."""
    import os
    vec = _GEMV_VEC.get(a.dtype)
    return (vec is not None and 0 < M <= _GEMV_M and 0 < K <= _GEMV_CLUSTER * _GEMV_KC
            and N % vec == 0 and b.data.ptr % 16 == 0
            and os.environ.get("FORGE_GEMV", "1") != "0" and _launcher_ex())


def _gemv_shape(dt, K, N):
    """(lanes per row, column tiles, K slices = cluster size, rows per slice) of a gemv: the
    widest tile (up to 128 columns) that still gives _GEMV_TILES tiles, and 8 slices of at
    least 64 rows where K allows."""
    vec = _GEMV_VEC[dt]
    lprs = _GEMV_LPR[BF16 if dt == BF16 else F32]
    lpr = next((p for p in lprs if -(-N // (p * vec)) >= _GEMV_TILES), lprs[-1])
    tiles = -(-N // (lpr * vec))
    slices = max(1, min(_GEMV_CLUSTER, -(-K // 64)))
    kchunk = -(-K // slices)
    return lpr, tiles, slices, kchunk


def _gemv(a, b, bias, alpha, M, K, N, act=0, residual=None, ln=None):
    lpr, tiles, slices, kchunk = _gemv_shape(a.dtype, K, N)
    # W written by the kernel before: a plain launch (on the H200 a programmatic launch read
    # such a W stale through the read-only cache, even with its pdl_wait() before the loads)
    early = not _pdl_wrote(b)
    out = _empty((M, N), a.dtype)
    gamma, beta, eps = (out, out, 0.0) if ln is None else ln
    _launch("gemv", f"gemv_{_float_sfx(a)}_{lpr}", (tiles, slices), _GEMV_THREADS,
            (a, b, gamma, beta, _i32(ln is not None), np.float32(eps),
             out if bias is None else bias, _i32(bias is not None),
             out if residual is None else residual, _i32(residual is not None), _i32(act), out,
             _i32(M), _i32(K), _i32(N), _i32(kchunk), np.float32(alpha),
             _i32(early)), pdl=early, writes=(out,), cluster=(1, slices, 1))
    return out


_ACTS = {None: 0, "gelu": 1}


@_guarded
def linear(x, w, bias, act, residual, ln=None):
    """``act(LN(x) @ w + bias) + residual`` for a few rows of x: one kernel
    (kernels/gemv.cu); otherwise layernorm, matmul, gelu and add one after the other.
    ``ln``: None or (gamma, beta, eps)."""
    x, w = _c(x), _like(_c(w), x.dtype)
    M, K = x.shape
    N = w.shape[1]
    if _gemv_ok(x, w, M, K, N):
        bias = None if bias is None else _like(_c(bias), x.dtype)
        residual = None if residual is None else _like(_c(residual), x.dtype)
        if ln is not None:
            ln = (_like(_c(ln[0]), x.dtype), _like(_c(ln[1]), x.dtype), float(ln[2]))
        return _gemv(x, w, bias, 1.0, M, K, N, _ACTS[act], residual, ln)
    return _compose.linear(sys.modules[__name__], x, w, bias, act, residual, ln)


@_guarded
def matmul(a, b, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    a, b = _c(a), _c(b)
    if a.dtype != b.dtype:
        raise DTypeError(f"matmul: a is {a.dtype} but b is {b.dtype}")
    if a.ndim >= 3 and b.ndim == 2 and not trans_a:
        # (..., M, K) @ (K, N): one big 2-D product over all leading rows
        out = matmul(a.reshape(-1, a.shape[-1]), b, bias, False, trans_b, alpha, b_rows)
        return out.reshape(a.shape[:-1] + (out.shape[-1],))
    if not ((a.ndim == 2 and b.ndim == 2)
            or (a.ndim >= 3 and b.ndim == a.ndim and a.shape[:-2] == b.shape[:-2])):
        raise ShapeError(f"matmul: a is {a.shape} and b is {b.shape}; expected 2-D x 2-D or "
                         "batched with equal leading dims")
    lead = a.shape[:-2]
    ar, ac = a.shape[-2:]
    br_stored, bc = b.shape[-2:]
    br = br_stored if b_rows is None else int(b_rows)
    if not 0 <= br <= br_stored:
        raise ShapeError(f"matmul: b_rows={b_rows} but b has {br_stored} rows")
    M, K = (ac, ar) if trans_a else (ar, ac)
    Kb, N = (bc, br) if trans_b else (br, bc)
    if K != Kb:
        raise ShapeError(f"matmul: op(a) is ({M}, {K}) but op(b) is ({Kb}, {N}); "
                         "inner dims must agree")
    if (a.ndim == 2 and b.ndim == 2 and not trans_a and not trans_b and br == br_stored
            and _gemv_ok(a, b, M, K, N)):
        if bias is not None:
            bias = _like(_c(bias), a.dtype)
            if bias.size != N:
                raise ShapeError(f"matmul: bias has {bias.size} elements but the output has {N} "
                                 "columns")
        return _gemv(a, b, bias, alpha, M, K, N)
    out = _empty(lead + (M, N), a.dtype)
    beta = 0.0
    if bias is not None:
        bias = _like(_c(bias), a.dtype)
        if bias.size != N:
            raise ShapeError(f"matmul: bias has {bias.size} elements but the output has {N} "
                             "columns")
        if out.size:
            _launch("elementwise", f"bias_fill_{_float_sfx(out)}", _grid(out.size), _THREADS,
                    (bias, out, _i64(out.size), _i32(N)))
        beta = 1.0
    return _matmul_into(a, b, out, trans_a, trans_b, alpha, b_rows, beta)


# ----------------------------------------------------------------------------------------------
# Elementwise: add, gelu, dropout
# ----------------------------------------------------------------------------------------------

@_guarded
def add(a, b):
    a, b = _c(a), _like(_c(b), a.dtype)
    if a.shape != b.shape:
        raise ShapeError(f"add: a is {a.shape} but b is {b.shape}; shapes must agree")
    out = _empty(a.shape, a.dtype)
    if a.size:
        _launch("elementwise", f"add_{_float_sfx(a)}", _grid(a.size), _THREADS,
                (a, b, out, _i64(a.size)))
    return out


@_guarded
def gelu(x):
    x = _c(x)
    y = _empty(x.shape, x.dtype)
    if x.size:
        _launch("gelu", f"gelu_fwd_{_float_sfx(x)}", _grid(x.size), _THREADS,
                (x, y, _i64(x.size)))
    return y


@_guarded
def gelu_bwd(x, dy):
    x, dy = _c(x), _like(_c(dy), x.dtype)
    dx = _empty(x.shape, x.dtype)
    if x.size:
        _launch("gelu", f"gelu_bwd_{_float_sfx(x)}", _grid(x.size), _THREADS,
                (x, dy, dx, _i64(x.size)))
    return dx


@_guarded
def dropout(x, p, seed):
    x = _c(x)
    p = float(p)
    if p >= 1.0:
        return zeros(x.shape, x.dtype.name)
    y = _empty(x.shape, x.dtype)
    n = x.size
    if n:
        k0, k1 = _rng.seed_key(seed)
        scale = _rng.dropout_scale(p)  # rounded once to float32, as on the CPU
        _launch("dropout", f"dropout_{_float_sfx(x)}", _grid((n + 3) // 4), _THREADS,
                (x, y, _i64(n), np.uint32(k0), np.uint32(k1), np.float32(p),
                 _acc(x.dtype, float(scale))))
    return y


# ----------------------------------------------------------------------------------------------
# Reductions: sum_rows, sumsq
# ----------------------------------------------------------------------------------------------

def _chunks(R: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) for the column-sum kernels."""
    chunk = max(64, -(-R // 1024))
    return chunk, max(1, -(-R // chunk))


def _colsum_finish(part, out, S, C):
    _launch("reduce", f"colsum_finish_{_float_sfx(out)}", (-(-C // _THREADS),), _THREADS,
            (part, out, _i32(S), _i32(C)))


@_guarded
def sum_rows(x):
    x = _c(x)
    C = x.shape[-1] if x.ndim else 1
    R = x.size // C if C else 0
    out = _empty((C,), x.dtype)
    if C == 0:
        return out
    if R == 0:
        out.data.memset_async(0, out.nbytes)
        return out
    chunk, S = _chunks(R)
    part = _empty((S, C), _acc_dtype(x.dtype))
    _launch("reduce", f"sum_rows_partial_{_float_sfx(x)}", (-(-C // 32), S), (32, 8),
            (x, part, _i64(R), _i32(C), _i64(chunk)))
    _colsum_finish(part, out, S, C)
    return out


def _sum_finish(part, out, n, scale):
    _launch("reduce", f"sum_finish_{_SFX[out.dtype]}", (1,), (1024,),
            (part, out, _i64(n), _acc(out.dtype, scale)))


@_guarded
def sumsq(x):
    x = _c(x)
    acc = _acc_dtype(x.dtype)
    out = _empty((), acc)
    n = x.size
    if n == 0:
        out.data.memset_async(0, out.nbytes)
        return out
    blocks = max(1, min(1024, -(-n // (_THREADS * 8))))
    part = _empty((blocks,), acc)
    _launch("reduce", f"sumsq_partial_{_float_sfx(x)}", (blocks,), _THREADS,
            (x, part, _i64(n)))
    _sum_finish(part, out, blocks, 1.0)
    return out


# ----------------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------------

_ROWS_PER_BLOCK = 8  # warp-per-row kernels: 8 warps, 256 threads


@_guarded
def layernorm(x, gamma, beta, eps=1e-5):
    x = _c(x)
    gamma, beta = _like(_c(gamma), x.dtype), _like(_c(beta), x.dtype)
    C = x.shape[-1]
    R = x.size // C if C else 0
    y = _empty(x.shape, x.dtype)
    if R and R < _sm_count(_dev()):  # a few rows (decoding): a block per row
        _launch("layernorm", f"layernorm_fwd_block_{_float_sfx(x)}", (R,), _THREADS,
                (x, gamma, beta, y, _i32(C), _acc(x.dtype, eps)))
    elif R:
        _launch("layernorm", f"layernorm_fwd_{_float_sfx(x)}", (-(-R // _ROWS_PER_BLOCK),),
                32 * _ROWS_PER_BLOCK, (x, gamma, beta, y, _i64(R), _i32(C), _acc(x.dtype, eps)))
    return y


@_guarded
def layernorm_bwd(x, gamma, dy, eps=1e-5):
    x = _c(x)
    gamma, dy = _like(_c(gamma), x.dtype), _like(_c(dy), x.dtype)
    C = x.shape[-1]
    R = x.size // C if C else 0
    sfx = _float_sfx(x)
    acc = _acc_dtype(x.dtype)
    dx = _empty(x.shape, x.dtype)
    dgamma = _empty((C,), x.dtype)
    dbeta = _empty((C,), x.dtype)
    if C == 0:
        return dx, dgamma, dbeta
    if R == 0:
        dgamma.data.memset_async(0, dgamma.nbytes)
        dbeta.data.memset_async(0, dbeta.nbytes)
        return dx, dgamma, dbeta
    mean = _empty((R,), acc)
    rstd = _empty((R,), acc)
    _launch("layernorm", f"layernorm_bwd_{sfx}", (-(-R // _ROWS_PER_BLOCK),),
            32 * _ROWS_PER_BLOCK,
            (x, gamma, dy, dx, mean, rstd, _i64(R), _i32(C), _acc(x.dtype, eps)))
    chunk, S = _chunks(R)
    part_g = _empty((S, C), acc)
    part_b = _empty((S, C), acc)
    _launch("layernorm", f"layernorm_bwd_params_{sfx}", (-(-C // 32), S), (32, 8),
            (x, dy, mean, rstd, part_g, part_b, _i64(R), _i32(C), _i64(chunk)))
    _colsum_finish(part_g, dgamma, S, C)
    _colsum_finish(part_b, dbeta, S, C)
    return dx, dgamma, dbeta


# ----------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------

def _softmax_into(x, y, lse, causal, off):
    L = x.shape[-1]
    rows = x.size // L if L else 0
    if rows == 0:
        return
    R = x.shape[-2] if x.ndim >= 2 else 1
    want = lse is not None
    lse_arg = lse if want else y  # never written when want_lse is 0
    # rows up to 1024 long are held in registers (one read); longer rows take the online pass
    variant = "r8_" if L <= 256 else ("r32_" if L <= 1024 else "")
    _launch("softmax", f"softmax_fwd_{variant}{_float_sfx(x)}_{_float_sfx(y)}",
            (-(-rows // _ROWS_PER_BLOCK),), 32 * _ROWS_PER_BLOCK,
            (x, y, lse_arg, _i32(int(want)), _i64(rows), _i32(L), _i32(R), _i32(int(causal)),
             _i32(off)))


@_guarded
def softmax(x, causal=False, off=0):
    x = _c(x)
    y = _empty(x.shape, x.dtype)
    _softmax_into(x, y, None, bool(causal), int(off))
    return y


def _softmax_bwd_into(y, dy, dx):
    L = y.shape[-1]
    rows = y.size // L if L else 0
    if rows == 0:
        return
    _launch("softmax", f"softmax_bwd_{_float_sfx(y)}_{_float_sfx(dy)}",
            (-(-rows // _ROWS_PER_BLOCK),), 32 * _ROWS_PER_BLOCK,
            (y, dy, dx, _i64(rows), _i32(L)))


@_guarded
def softmax_bwd(y, dy):
    y, dy = _c(y), _like(_c(dy), y.dtype)
    dx = _empty(y.shape, y.dtype)
    _softmax_bwd_into(y, dy, dx)
    return dx


# ----------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------

def _word(x) -> str:
    return _WORD[x.dtype.itemsize]


@_guarded
def split_heads(qkv, n_head):
    qkv = _c(qkv)
    H = int(n_head)
    *lead, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % H:
        raise ShapeError(f"split_heads: last dim {C3} is not 3 * n_head ({H}) * head size")
    C = C3 // 3
    hs = C // H
    shape = tuple(lead) + (H, T, hs)
    q, k, v = (_empty(shape, qkv.dtype) for _ in range(3))
    if qkv.size:
        _launch("heads", f"split_heads_{_word(qkv)}", _grid(qkv.size), _THREADS,
                (qkv, q, k, v, _i64(qkv.size), _i32(T), _i32(H), _i32(hs)))
    return q, k, v


_WHICH = {"q": 0, "k": 1, "v": 2}


@_guarded
def unsplit_head(dy, which):
    dy = _c(dy)
    w = _WHICH.get(which, which) if isinstance(which, str) else int(which)
    if w not in (0, 1, 2):
        raise ShapeError(f"unsplit_head: which must be 0, 1, 2 (or 'q', 'k', 'v'), got {which!r}")
    *lead, H, T, hs = dy.shape
    out = _empty(tuple(lead) + (T, 3 * H * hs), dy.dtype)
    if out.size:
        _launch("heads", f"unsplit_head_{_word(dy)}", _grid(out.size), _THREADS,
                (dy, out, _i64(out.size), _i32(T), _i32(H), _i32(hs), _i32(w)))
    return out


@_guarded
def merge_heads(x):
    x = _c(x)
    *lead, H, T, hs = x.shape
    out = _empty(tuple(lead) + (T, H * hs), x.dtype)
    if out.size:
        _launch("heads", f"merge_heads_{_word(x)}", _grid(out.size), _THREADS,
                (x, out, _i64(out.size), _i32(T), _i32(H), _i32(hs)))
    return out


@_guarded
def unmerge_heads(dy, h):
    dy = _c(dy)
    H = int(h)
    *lead, T, C = dy.shape
    if C % H:
        raise ShapeError(f"unmerge_heads: {C} channels do not split into {H} heads")
    hs = C // H
    out = _empty(tuple(lead) + (H, T, hs), dy.dtype)
    if out.size:
        _launch("heads", f"unmerge_heads_{_word(dy)}", _grid(out.size), _THREADS,
                (dy, out, _i64(out.size), _i32(T), _i32(H), _i32(hs)))
    return out


# ----------------------------------------------------------------------------------------------
# Attention. flash (kernels/flash_attention.cu): fused, no T x T matrix in memory, bfloat16 at
# head size 64 on the tensor cores. v1: cuBLAS batched products around the softmax kernels, the
# T x T scores of each head materialized in float32; it serves every other dtype and head size,
# and everything when FORGE_ATTENTION=v1.
# ----------------------------------------------------------------------------------------------

def _attn_shapes(q, k, v):
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] \
            or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not agree")
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tq > Tk:
        raise ShapeError(f"attention: {Tq} queries but only {Tk} keys")
    return Tq, Tk


def _as_batched(x):
    """(..., T, hs) as a batch of matrices for cuBLAS: at least 3-D."""
    return x if x.ndim >= 3 else x.reshape((1,) + x.shape)


_FLASH_HS = 64       # the one head size flash_attention.cu is written for (FA_D)
_FLASH_BLOCK = 64    # query rows / keys per block (FA_BLK)
_FLASH_THREADS = 128


def _flash_wanted(q, k, *others) -> bool:
    """Whether the fused kernels take this call: bfloat16, head size 64, something to do, at
    most 65535 blocks of rows (grid y), every array 16-byte aligned (cp.async), and
    FORGE_ATTENTION is not 'v1' (read at every call, so a run can switch it)."""
    import os
    if os.environ.get("FORGE_ATTENTION", "").strip().lower() == "v1":
        return False
    if BF16 is None or q.dtype != BF16 or q.shape[-1] != _FLASH_HS or q.size == 0:
        return False
    if -(-k.shape[-2] // _FLASH_BLOCK) > 65535:
        return False
    return all(x.data.ptr % 16 == 0 for x in (q, k) + others)


def _flash_grid(bh: int, rows: int):
    """(bh, blocks of _FLASH_BLOCK rows): the kernels read blockIdx.x as bh."""
    return (bh, -(-rows // _FLASH_BLOCK))


@_guarded
def attention(q, k, v, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    if _flash_wanted(q, k, v):
        hs = q.shape[-1]
        scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
        return _attention_flash(q, k, v, scale, Tq, Tk)
    return _attention_v1(q, k, v, scale)


def _head_major(Tq, Tk):
    """The flash kernels' layout arguments for (BH, T, 64) q/out and (BH, Tk, 64) k/v:
    H, then (sb, sh, ld) for q and dq, for k, v, dk, dv, and for out and dout."""
    d = _FLASH_HS
    return (_i32(1), _i64(Tq * d), _i64(0), _i32(d), _i64(Tk * d), _i64(0), _i32(d),
            _i64(Tq * d), _i64(0), _i32(d))


def _fused_layout(T, C, n_head):
    """Layout arguments for GPT-2's fused rows: q, k, v (and dq, dk, dv) inside (B, T, 3C),
    out and dout (B, T, C), head h at channels h*64.."""
    d = _FLASH_HS
    return (_i32(n_head), _i64(T * 3 * C), _i64(d), _i32(3 * C), _i64(T * 3 * C), _i64(d),
            _i32(3 * C), _i64(T * C), _i64(d), _i32(C))


def _attention_flash(q, k, v, scale, Tq, Tk):
    bh = math.prod(q.shape[:-2])
    out = _empty(q.shape, q.dtype)  # (..., H, Tq, 64)
    lse = _empty(q.shape[:-1], F32)  # (..., H, Tq)
    _launch("flash_attention", "flash_fwd_bf16_h64", _flash_grid(bh, Tq), _FLASH_THREADS,
            (q, k, v, out, lse, _i32(Tq), _i32(Tk), np.float32(scale)) + _head_major(Tq, Tk))
    return out, lse


def _qkv_flash_ok(qkv, n_head, *others) -> bool:
    """_flash_wanted for the fused layout: bfloat16, heads of 64, every array 16-byte aligned
    (the k and v thirds then are too: C * 2 bytes is a multiple of 128)."""
    import os
    if os.environ.get("FORGE_ATTENTION", "").strip().lower() == "v1":
        return False
    B, T, C3 = qkv.shape
    return (BF16 is not None and qkv.dtype == BF16 and C3 == 3 * n_head * _FLASH_HS
            and B * T > 0 and -(-T // _FLASH_BLOCK) <= 65535
            and all(x.data.ptr % 16 == 0 for x in (qkv,) + others))


def _thirds(x, C):
    """Flat views of (B, T, 3C) starting at channel 0, C and 2C (the kernels stride over rows
    themselves)."""
    flat = x.reshape(-1)
    return flat, flat[C:], flat[2 * C:]


@_guarded
def attention_qkv(qkv, n_head, scale):
    """Causal self-attention on GPT-2's fused rows: ``qkv (B, T, 3C) -> (y (B, T, C), lse
    (B, H, T) float32)``. The flash kernels read each head in place and write y with the heads
    merged; other dtypes and head sizes run split_heads, attention, merge_heads."""
    qkv = _c(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if not _qkv_flash_ok(qkv, n_head):
        return _compose.attention_qkv(sys.modules[__name__], qkv, n_head, scale)
    y = _empty((B, T, C), qkv.dtype)
    lse = _empty((B, n_head, T), F32)
    q, k, v = _thirds(qkv, C)
    _launch("flash_attention", "flash_fwd_bf16_h64", _flash_grid(B * n_head, T), _FLASH_THREADS,
            (q, k, v, y, lse, _i32(T), _i32(T), np.float32(scale)) + _fused_layout(T, C, n_head))
    return y, lse


@_guarded
def attention_qkv_bwd(qkv, y, lse, dy, n_head, scale):
    """``dqkv (B, T, 3C)`` of ``attention_qkv`` given its output y, lse and ``dL/dy``; the
    flash kernels write dq, dk, dv straight into their thirds of dqkv."""
    qkv = _c(qkv)
    y, dy = _like(_c(y), qkv.dtype), _like(_c(dy), qkv.dtype)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if not _qkv_flash_ok(qkv, n_head, y, dy):
        q, k, v = split_heads(qkv, n_head)
        dq, dk, dv = attention_bwd(q, k, v, unmerge_heads(y, n_head), lse,
                                   unmerge_heads(dy, n_head), scale)
        dqkv = _empty(qkv.shape, qkv.dtype)
        w = dqkv.view(np.uint16) if dqkv.dtype == BF16 else dqkv
        for i, g in enumerate((dq, dk, dv)):
            m = merge_heads(g)
            w[..., i * C:(i + 1) * C] = m.view(np.uint16) if m.dtype == BF16 else m
        return dqkv
    lse = _like(_c(lse), F32)
    D = _empty(lse.shape, F32)  # rowsum(dy * y): written by the dq kernel, read by dk/dv
    dqkv = _empty(qkv.shape, qkv.dtype)
    q, k, v = _thirds(qkv, C)
    dq, dk, dv = _thirds(dqkv, C)
    lay = _fused_layout(T, C, n_head)
    grid = _flash_grid(B * n_head, T)
    _launch("flash_attention", "flash_bwd_dq_bf16_h64", grid, _FLASH_THREADS,
            (q, k, v, y, dy, lse, D, dq, _i32(T), _i32(T), np.float32(scale)) + lay)
    _launch("flash_attention", "flash_bwd_dkdv_bf16_h64", grid, _FLASH_THREADS,
            (q, k, v, dy, lse, D, dk, dv, _i32(T), _i32(T), np.float32(scale)) + lay)
    return dqkv


@_guarded
def _attention_v1(q, k, v, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    hs = q.shape[-1]
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    lead = q.shape[:-2]
    sdt = _acc_dtype(q.dtype)  # scores, lse: float32 (float64 for float64)
    qb, kb, vb = _as_batched(q), _as_batched(k), _as_batched(v)
    S = _empty(qb.shape[:-2] + (Tq, Tk), sdt)
    _matmul_into(qb, kb, S, False, True, scale, None)  # (BH, Tq, Tk) scaled scores
    P = _empty(S.shape, q.dtype)
    lse = _empty(S.shape[:-1], sdt)
    _softmax_into(S, P, lse, True, Tk - Tq)
    del S
    out = _empty(qb.shape, q.dtype)
    _matmul_into(P, vb, out, False, False, 1.0, None)  # (BH, Tq, hs)
    return out.reshape(q.shape), lse.reshape(lead + (Tq,))


@_guarded
def attention_bwd(q, k, v, out, lse, dout, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    out, dout = _like(_c(out), q.dtype), _like(_c(dout), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:-1]:
        raise ShapeError(f"attention_bwd: q {q.shape} needs out and dout of that shape and lse "
                         f"of {q.shape[:-1]}; got out {out.shape}, dout {dout.shape}, "
                         f"lse {lse.shape}")
    if _flash_wanted(q, k, v, out, dout):
        hs = q.shape[-1]
        scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
        return _attention_bwd_flash(q, k, v, out, _like(_c(lse), F32), dout, scale, Tq, Tk)
    return _attention_bwd_v1(q, k, v, out, lse, dout, scale)


def _attention_bwd_flash(q, k, v, out, lse, dout, scale, Tq, Tk):
    bh = math.prod(q.shape[:-2])
    D = _empty(lse.shape, F32)  # rowsum(dout * out): written by the dq kernel, read by dk/dv
    dq = _empty(q.shape, q.dtype)
    _launch("flash_attention", "flash_bwd_dq_bf16_h64", _flash_grid(bh, Tq), _FLASH_THREADS,
            (q, k, v, out, dout, lse, D, dq, _i32(Tq), _i32(Tk), np.float32(scale))
            + _head_major(Tq, Tk))
    dk = _empty(k.shape, q.dtype)
    dv = _empty(v.shape, q.dtype)
    _launch("flash_attention", "flash_bwd_dkdv_bf16_h64", _flash_grid(bh, Tk), _FLASH_THREADS,
            (q, k, v, dout, lse, D, dk, dv, _i32(Tq), _i32(Tk), np.float32(scale))
            + _head_major(Tq, Tk))
    return dq, dk, dv


@_guarded
def _attention_bwd_v1(q, k, v, out, lse, dout, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    dout = _like(_c(dout), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    hs = q.shape[-1]
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    sdt = _acc_dtype(q.dtype)
    lse = _like(_c(lse), sdt)
    qb, kb, vb, dob = _as_batched(q), _as_batched(k), _as_batched(v), _as_batched(dout)
    S = _empty(qb.shape[:-2] + (Tq, Tk), sdt)
    _matmul_into(qb, kb, S, False, True, scale, None)
    P = _empty(S.shape, q.dtype)
    _launch("attention", f"attn_probs_{_SFX[sdt]}_{_float_sfx(P)}", _grid(S.size), _THREADS,
            (S, lse, P, _i64(S.size), _i32(Tq), _i32(Tk), _i32(Tk - Tq)))
    dv = _empty(kb.shape, q.dtype)
    _matmul_into(P, dob, dv, True, False, 1.0, None)  # P^T dout: (BH, Tk, hs)
    dP = S  # reuse the scores' memory: (BH, Tq, Tk) in sdt
    _matmul_into(dob, vb, dP, False, True, 1.0, None)  # dout v^T
    dS = _empty(S.shape, q.dtype)
    _softmax_bwd_into(P, dP, dS)  # P * (dP - rowsum(P * dP)); masked entries stay 0
    del P, dP, S
    dq = _empty(qb.shape, q.dtype)
    _matmul_into(dS, kb, dq, False, False, scale, None)  # (BH, Tq, hs)
    dk = _empty(kb.shape, q.dtype)
    _matmul_into(dS, qb, dk, True, False, scale, None)  # (BH, Tk, hs)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


@_guarded
def assign(dst, values):
    """dst[...] = values (a NumPy array), in place, queued on the current stream."""
    if not dst.flags.c_contiguous:
        raise ShapeError("assign: dst must be C-contiguous (it is written in place)")
    if dst.dtype == BF16:  # rounded on the device, as from_host does
        src = from_host(values, "bfloat16")
        dst.data.copy_from_device_async(src.data, dst.nbytes)
    else:  # one host-to-device copy
        dst.set(np.ascontiguousarray(values, dtype=dst.dtype))


@_guarded
def kv_append(cache, new, pos):
    new = _like(_c(new), cache.dtype)
    if not cache.flags.c_contiguous:
        raise ShapeError("kv_append: the cache must be C-contiguous (it is written in place)")
    *lead_c, Tmax, hs = cache.shape
    *lead_n, Tn, hs_n = new.shape
    pos = int(pos)
    if math.prod(lead_c) != math.prod(lead_n) or hs != hs_n or not 0 <= pos <= Tmax - Tn:
        raise ShapeError(f"kv_append: cannot write new {new.shape} into cache {cache.shape} "
                         f"at position {pos}")
    if new.size:
        _launch("attention", f"kv_append_{_word(cache)}", _grid(new.size), _THREADS,
                (cache, new, _i64(new.size), _i32(Tn), _i32(Tmax), _i32(hs), _i32(pos)))


_DECODE_THREADS = 256
_DECODE_SPLIT = 8  # blocks per head at most (a thread-block cluster: 8 is the portable size)


@_guarded
def decode_attention(qkv, k_cache, v_cache, pos, n_head, scale):
    """One decoding step: write the new keys and values at row ``pos`` of the caches and
    return ``y (B, C)``; per (head, row) one block, or on Hopper a cluster of up to 8 blocks
    splitting the keys of a long cache (kernels/attention.cu)."""
    qkv = _like(_c(qkv), k_cache.dtype)
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ShapeError("decode_attention: the caches must be C-contiguous (written in place)")
    B, H, Tmax, hs = k_cache.shape
    if qkv.shape != (B, 3 * H * hs) or v_cache.shape != k_cache.shape or H != n_head:
        raise ShapeError(f"decode_attention: qkv {qkv.shape} and caches {k_cache.shape}, "
                         f"{v_cache.shape} do not fit {n_head} heads")
    if hs > _DECODE_THREADS:
        raise ShapeError(f"decode_attention: head size {hs} is over the kernel's "
                         f"{_DECODE_THREADS}")
    acc = _acc_dtype(qkv.dtype)
    # a cache of more than 128 rows: its keys split among a cluster of up to 8 blocks per head
    P = max(1, min(_DECODE_SPLIT, -(-Tmax // 128))) if _launcher_ex() else 1
    shared = (2 * hs + -(-Tmax // P) + _DECODE_THREADS * (16 // qkv.dtype.itemsize)) * acc.itemsize
    if shared > 48 * 1024:
        raise ShapeError(f"decode_attention: a cache of {Tmax} rows needs {shared} bytes of "
                         "shared memory, over the 48 KiB a block may take")
    if isinstance(pos, cupy.ndarray):
        pos = _pos_array(pos)
    else:
        pos = cupy.asarray(np.array([int(pos)], np.int32))
    y = _empty((B, H * hs), qkv.dtype)
    if y.size:
        _launch("attention", f"decode_attention_{_float_sfx(qkv)}", (H * P, B), _DECODE_THREADS,
                (qkv, k_cache, v_cache, pos, y, _i32(H), _i32(Tmax), _i32(hs),
                 _acc(qkv.dtype, scale), _i32(P)), shared=shared, pdl=True,
                writes=(y, k_cache, v_cache), cluster=(P, 1, 1) if P > 1 else None)
    return y


@_guarded
def greedy_next(logits, vocab_size, ids, pos, out=None):
    """In place: ``ids[b] = argmax(logits[b, :vocab_size])`` (numpy.argmax's ties and NaNs)
    for float32 logits (B, Vp), also written to ``out`` (B int32, e.g. a row of a chain's
    token buffer) when given, then ``pos += 1`` (kernels/greedy.cu)."""
    if logits.dtype != F32 or logits.ndim != 2 or ids.size != logits.shape[0]:
        raise ShapeError(f"greedy_next: float32 logits (B, Vp) and B ids expected, got "
                         f"{logits.dtype} {logits.shape} and {ids.size} ids")
    B, Vp = logits.shape
    if out is None:
        out = ids
    elif out.size != B or out.dtype != ids.dtype or not out.flags.c_contiguous:
        raise ShapeError(f"greedy_next: out must be {B} contiguous {ids.dtype} values, got "
                         f"{out.dtype} {out.shape}")
    _launch("greedy", "greedy_next_f32", (B,), 1024,
            (_c(logits), _i32(vocab_size), _i32(Vp), ids, out, _pos_array(pos)))


class _Copy:
    """A device-to-host copy in flight: ``synchronize()`` waits for it."""

    def __init__(self, event):
        self._event = event

    def synchronize(self):
        self._event.synchronize()


def pinned_empty(shape, dtype):
    """A NumPy array in page-locked host memory (device copies into it run asynchronously)."""
    dt = np.dtype(dtype)
    n = int(math.prod(shape))
    mem = cupy.cuda.alloc_pinned_memory(max(1, n * dt.itemsize))
    return np.frombuffer(mem, dt, n).reshape(shape)


@_guarded
def to_host_async(array, out):
    """Queue a copy of ``array`` into the host array ``out`` (pinned, same size and dtype) on
    the current stream; returns a handle whose ``synchronize()`` waits for it."""
    array = _c(array)
    if out.nbytes != array.nbytes or out.dtype != array.dtype:
        raise ShapeError(f"to_host_async: {array.dtype} {array.shape} into {out.dtype} {out.shape}")
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memcpyAsync(out.ctypes.data, array.data.ptr, array.nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    return _Copy(event)


# ----------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------

class CapturedGraph:
    """Work captured once from a Python function and replayed with one launch.

    ``outputs``: what the function returned during the capture (arrays the replays rewrite in
    place). Every array the captured work touches keeps its address: the inputs the function
    read (write new values into them before a replay) and its intermediates, which live in a
    memory pool of the graph's own, so no later allocation can land on them.
    """

    def __init__(self, graph, outputs, pool):
        self._graph, self.outputs, self._pool = graph, outputs, pool

    @_guarded
    def replay(self) -> None:
        """Run the captured work again, on the current stream (ordered with other ops)."""
        self._graph.launch(cupy.cuda.get_current_stream())


@_guarded
def capture_graph(fn) -> CapturedGraph:
    """Capture the GPU work of ``fn()`` into a CUDA graph (``CapturedGraph``).

    ``fn`` must queue device work only: nothing that waits for the GPU or reads a value back
    (that is an error during a capture). Run it once eagerly first, so every kernel it
    needs is compiled and loaded. The capture runs on a private stream in relaxed mode, its
    allocations from a private pool.
    """
    pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        try:
            outputs = fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # the capture may be invalid already; the first error is the one
                pass
            raise
        graph = stream.end_capture()
    return CapturedGraph(graph, outputs, pool)


# ----------------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------------

def _ids(ids):
    ids = _c(ids)
    if ids.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        ids = ids.astype(np.int64)
    return ids


def _pos_array(pos):
    """A position given as a device array: one int32 element (read by the kernel itself)."""
    if pos.size != 1 or pos.dtype != np.dtype(np.int32):
        raise ShapeError(f"a device position must be one int32 element, got {pos.dtype} "
                         f"of shape {pos.shape}")
    return _c(pos)


@_guarded
def embedding(ids, wte, wpe, pos=0):
    ids = _ids(ids)
    wte = _c(wte)
    wpe = _like(_c(wpe), wte.dtype)
    C = wte.shape[-1]
    T = ids.shape[-1] if ids.ndim else 1
    out = _empty(ids.shape + (C,), wte.dtype)
    if not out.size:
        return out
    sfx = f"{_float_sfx(wte)}_{_sfx(ids.dtype)}"
    if isinstance(pos, cupy.ndarray):  # read on the device (CUDA-graph replays)
        _launch("embedding", f"embedding_at_fwd_{sfx}", _grid(out.size), _THREADS,
                (ids, wte, wpe, out, _i64(out.size), _i32(T), _i32(C), _pos_array(pos),
                 _i32(wpe.shape[0])))
    else:
        _launch("embedding", f"embedding_fwd_{sfx}", _grid(out.size), _THREADS,
                (ids, wte, wpe, out, _i64(out.size), _i32(T), _i32(C), _i32(int(pos))))
    return out


@_guarded
def scatter_add_rows(dst, ids, src):
    if not dst.flags.c_contiguous:
        raise ShapeError("scatter_add_rows: dst must be C-contiguous (it is updated in place)")
    ids = _ids(ids).reshape(-1)
    C = dst.shape[-1]
    src = _like(_c(src), dst.dtype).reshape(-1, C) if C else _c(src)
    N = ids.size
    if src.shape[0] != N:
        raise ShapeError(f"scatter_add_rows: {N} ids but src has {src.shape[0]} rows")
    if N == 0 or C == 0:
        return None
    # Sort the ids so that each dst row is owned by one block: no atomics, deterministic.
    order = cupy.argsort(ids).astype(np.int64, copy=False)
    sorted_ids = ids[order].astype(np.int64, copy=False)
    threads = 256 if C >= 256 else 32 * max(1, -(-C // 32))
    _launch("embedding", f"scatter_add_sorted_{_float_sfx(dst)}", (N,), threads,
            (dst, src, sorted_ids, order, _i64(N), _i32(C)))
    return None


# ----------------------------------------------------------------------------------------------
# Cross entropy
# ----------------------------------------------------------------------------------------------

_CE_THREADS = 512


def _ce_args(logits, targets, vocab_size):
    logits = _c(logits)
    targets = _ids(targets).reshape(-1)
    Vp = logits.shape[-1]
    V = Vp if vocab_size is None else int(vocab_size)
    N = logits.size // Vp if Vp else 0
    if not 0 < V <= Vp:
        raise ShapeError(f"cross_entropy: vocab_size {vocab_size} but logits have {Vp} columns")
    if targets.size != N:
        raise ShapeError(f"cross_entropy: {N} rows of logits but {targets.size} targets")
    return logits, targets, N, Vp, V


@_guarded
def cross_entropy(logits, targets, vocab_size=None):
    logits, targets, N, Vp, V = _ce_args(logits, targets, vocab_size)
    acc = _acc_dtype(logits.dtype)
    out = _empty((), acc)
    if N == 0:
        out.fill(float("nan"))
        return out
    losses = _empty((N,), acc)
    _launch("cross_entropy", f"cross_entropy_fwd_{_float_sfx(logits)}_{_sfx(targets.dtype)}",
            (N,), _CE_THREADS, (logits, targets, losses, _i32(Vp), _i32(V)))
    _sum_finish(losses, out, N, 1.0 / N)
    return out


@_guarded
def cross_entropy_bwd(logits, targets, dloss=1.0, vocab_size=None):
    logits, targets, N, Vp, V = _ce_args(logits, targets, vocab_size)
    acc = _acc_dtype(logits.dtype)
    dl = _empty(logits.shape, logits.dtype)
    if N == 0:
        return dl
    if isinstance(dloss, cupy.ndarray):
        g = dloss.reshape(-1)[:1]
        g = g if g.dtype == acc else cast(g, acc.name)
    else:
        g = cupy.full((1,), float(np.asarray(dloss).reshape(-1)[0]), dtype=acc)
    _launch("cross_entropy", f"cross_entropy_bwd_{_float_sfx(logits)}_{_sfx(targets.dtype)}",
            (N,), _CE_THREADS, (logits, targets, dl, _c(g), _i32(Vp), _i32(V), _acc(acc, 1.0 / N)))
    return dl


# ----------------------------------------------------------------------------------------------
# AdamW
# ----------------------------------------------------------------------------------------------

@_guarded
def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0,
                 p_lowp=None):
    for name, arr in (("p", p), ("m", m), ("v", v)):
        if not arr.flags.c_contiguous:
            raise ShapeError(f"adamw_update: {name} must be C-contiguous (updated in place)")
        if arr.dtype != p.dtype or arr.shape != p.shape:
            raise ShapeError(f"adamw_update: {name} is {arr.shape} {arr.dtype} but p is "
                             f"{p.shape} {p.dtype}")
    if p.dtype not in (F32, F64):
        raise DTypeError(f"adamw_update: master weights must be float32 (or float64), got {p.dtype}")
    g = _c(g)
    if g.size != p.size:
        raise ShapeError(f"adamw_update: g has {g.size} elements but p has {p.size}")
    if p.dtype == F64:
        g = _like(g, F64)
    elif g.dtype not in (F32, BF16):
        g = _like(g, F32)
    step = int(step)
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step}")
    has_lowp = p_lowp is not None
    if has_lowp and (p_lowp.dtype != BF16 or p_lowp.size != p.size
                     or not p_lowp.flags.c_contiguous):
        raise ShapeError(f"adamw_update: p_lowp must be a contiguous bfloat16 array of "
                         f"{p.size} elements, got {p_lowp.shape} {p_lowp.dtype}")
    if p.size == 0:
        return None
    bc1 = 1.0 - float(beta1) ** step
    bc2 = 1.0 - float(beta2) ** step
    s = (lambda x: np.float64(x)) if p.dtype == F64 else (lambda x: np.float32(x))
    _launch("adamw", f"adamw_update_{_SFX[p.dtype]}_{_SFX[g.dtype]}", _grid(p.size), _THREADS,
            (p, g, m, v, p_lowp if has_lowp else p, _i32(int(has_lowp)), _i64(p.size),
             s(lr), s(beta1), s(beta2), s(eps), s(weight_decay), s(bc1), s(bc2),
             s(grad_scale)))
    return None
