"""The CUDA backend's runtime: CuPy and the device, NVRTC, the kernel launchers, dtypes.

- CuPy is imported here; no CuPy, or CuPy without a usable GPU, is a DeviceError at import.
- Devices: ``select(index)`` (``use_device``, its older name) makes a GPU current for the
  thread; ``_dev()`` is the current ordinal; ``device_name``, ``synchronize``.
- Errors: ``_guarded`` turns CuPy's and cuBLAS's out-of-memory failures into forge_ml's
  OutOfMemoryError (``_oom_error`` says how much was asked for and how much is free), and
  other CUDA runtime failures into DeviceError.
- Compilation: ``kernel_source(stem)`` is ``backends/cuda/<stem>.cu`` with ``common.cuh``
  pasted in; ``compile_source`` runs NVRTC through CuPy (CompileError with the log),
  ``compile_for_arch`` NVRTC itself for an arch-specific target (sm_90a's wgmma);
  ``_function`` caches the loaded kernels per device; ``_set_max_shared`` opts a kernel in
  to more than 48 KB of dynamic shared memory where the device allows it.
- Launch: ``_launch`` queues a kernel on the current stream, through CuPy, or through
  ``_LauncherEx`` (``cuLaunchKernelEx`` from NVIDIA's ``cuda.bindings``) when it needs a
  thread-block cluster or programmatic dependent launch (Hopper); ``_grid`` sizes
  grid-stride loops.
- Dtypes: float32, float64 and bfloat16 (``BF16``: ml_dtypes' type, or None where CuPy
  cannot hold it), kernel-name suffixes (``_sfx``, ``_float_sfx``, ``_word``), kernel
  scalars (``_i32``, ``_i64``, ``_acc``) and ``_empty``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import threading
from pathlib import Path

import numpy as np

from ... import flags
from ...errors import CompileError, DeviceError, DTypeError, OutOfMemoryError

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

_KERNEL_DIR = Path(__file__).resolve().parent
_INCLUDE = '#include "common.cuh"'
_THREADS = 256


# ----------------------------------------------------------------------------------------------
# Device, errors
# ----------------------------------------------------------------------------------------------

_N_DEVICES = _device_count()
_current = threading.local()  # the device forge-ml last made current in this thread


def select(index: int) -> None:
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


use_device = select  # the older name, kept for callers that use it


def _dev() -> int:
    """The current device ordinal (forge-ml's record of it; the driver's when none yet)."""
    idx = getattr(_current, "index", None)
    if idx is None:
        idx = _current.index = cupy.cuda.Device().id
    return idx


def _package():
    """The backend package (forge_ml.backends.cuda), whose public functions the composed
    fallbacks of backends/compose.py call (``_compose.linear(_package(), ...)``); looked up at
    call time, so the rooms never import the package's __init__."""
    return sys.modules[__name__.rpartition(".")[0]]


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


# ----------------------------------------------------------------------------------------------
# Compilation
# ----------------------------------------------------------------------------------------------

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
    """backends/cuda/<stem>.cu with common.cuh pasted in place of its include line."""
    path = _KERNEL_DIR / f"{stem}.cu"
    try:
        text = path.read_text()
    except OSError as e:
        raise CompileError(f"kernel source {path} cannot be read: {e}") from e
    return text.replace(_INCLUDE, (_KERNEL_DIR / "common.cuh").read_text(), 1)


# Kernel files written for one architecture's own features, compiled for it (not through
# CuPy, which appends its own -arch=sm_XY): flash_hopper.cu's wgmma needs sm_90a.
_ARCH_STEMS = {"flash_hopper": ("90", "sm_90a")}


def compile_for_arch(source: str, label: str, arch: str, options=("--std=c++17",)):
    """Compile ``source`` with NVRTC for ``arch`` (e.g. ``"sm_90a"``, whose arch-specific
    instructions a plain sm_90 build lacks) into a loaded module: NVRTC's own calls and the
    driver's module loader, as CuPy's compiler would do but for CuPy's choice of -arch.
    FORGE_ARCH_FEATURES is defined, for code that a plain build must leave out. The cubin is
    kept in ``flags.cache_root("cuda")`` under a hash of the source, the options and NVRTC's
    version, so a later process loads it instead of compiling (an unwritable cache only costs
    the compile). A compile failure raises CompileError carrying NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc
    opts = tuple(options) + (f"-arch={arch}", "-DFORGE_ARCH_FEATURES=1")
    key = hashlib.sha256(repr((source, opts, nvrtc.getVersion())).encode()).hexdigest()[:24]
    cached = flags.cache_root("cuda") / f"{Path(label).stem}-{arch}-{key}.cubin"
    module = cupy.cuda.function.Module()
    try:
        module.load(cached.read_bytes())
        return module
    except Exception:   # none kept yet, or unreadable: compile
        pass
    prog = nvrtc.createProgram(source, label, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            raise CompileError(f"NVRTC could not compile {label} for {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    try:   # whole or not at all: another process may be reading the same name
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, cached)
    except OSError:
        pass
    module = cupy.cuda.function.Module()
    module.load(cubin)
    return module


def _compile_options() -> tuple:
    """NVRTC's options for forge-ml's kernel files: C++17, and ``-lineinfo`` under
    FORGE_CUDA_LINEINFO=on (a profiler's source page then names .cu lines)."""
    return ("--std=c++17",) + (("-lineinfo",) if flags.on("FORGE_CUDA_LINEINFO") else ())


def _function(stem: str, name: str):
    """Kernel ``name`` of backends/cuda/<stem>.cu on the current device, the file compiled on
    first use. A file that NVRTC does not compile (or one written for another architecture)
    raises CompileError, and a new CompileError with the same message at once when asked again
    (the failure's message is kept: no second compile). A source file that cannot be read is
    not kept: the next call tries again."""
    key = (_dev(), stem, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            mkey = key[:2]
            module = _modules.get(mkey)
            if isinstance(module, str):   # a failed compile's message: a fresh error each time
                raise CompileError(module)
            if module is None:
                label = f"backends/cuda/{stem}.cu"
                opts = _compile_options()
                source = kernel_source(stem)   # unreadable: CompileError, not kept
                try:
                    if stem in _ARCH_STEMS:
                        cc, arch = _ARCH_STEMS[stem]
                        have = _cc(key[0])
                        if have != cc:
                            raise CompileError(f"{label} is written for {arch}; this GPU is "
                                               f"compute capability {have}")
                        module = compile_for_arch(source, label, arch, opts)
                    else:
                        module = compile_source(source, label, opts)
                except CompileError as e:
                    _modules[mkey] = str(e)
                    raise
                _modules[mkey] = module
            fn = module.get_function(name)
            _functions[key] = fn
    return fn


_shared_room: dict = {}  # (device, stem, name) -> [dynamic shared bytes it may take, opted in to]


def _set_max_shared(stem: str, name: str, nbytes: int) -> bool:
    """Whether kernel ``name`` of <stem>.cu may be launched with ``nbytes`` of dynamic shared
    memory per block on the current device, opting it in (``max_dynamic_shared_size_bytes``,
    CUDA's ``cudaFuncAttributeMaxDynamicSharedMemorySize``) when it may: up to the device's
    ``sharedMemPerBlockOptin`` (227 KB on Hopper, 163 KB on an A100, 99 KB on most consumer
    GPUs) less the kernel's static shared memory. False, changing nothing, where ``nbytes``
    does not fit. Once a size is set, a dict lookup, so it may be asked before every launch
    (the first call compiles the kernel, like its first launch; setting the attribute is no
    stream operation, so a relaxed-mode graph capture allows it too)."""
    key = (_dev(), stem, name)
    room = _shared_room.get(key)
    if room is None:
        fn = _function(stem, name)
        props = cupy.cuda.runtime.getDeviceProperties(key[0])
        limit = int(props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]))
        static = (fn.shared_size_bytes if hasattr(fn, "shared_size_bytes") else   # a RawKernel
                  cupy.cuda.driver.funcGetAttribute(1, fn.ptr))  # compile_for_arch's Function
        room = _shared_room.setdefault(key, [limit - int(static), 0])
    if nbytes > room[0]:
        return False
    if nbytes > room[1]:
        fn = _function(stem, name)
        with _lock:
            if nbytes > room[1]:
                try:
                    if hasattr(fn, "max_dynamic_shared_size_bytes"):
                        fn.max_dynamic_shared_size_bytes = int(nbytes)
                    else:   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                        cupy.cuda.driver.funcSetAttribute(fn.ptr, 8, int(nbytes))
                except cupy.cuda.driver.CUDADriverError:  # refused: take what it had
                    room[0] = room[1]
                    return False
                room[1] = int(nbytes)
    return True


def _takes(stem: str, name: str, nbytes: int) -> bool:
    """Whether kernel ``name`` of <stem>.cu compiles here and may be launched with ``nbytes``
    of dynamic shared memory (``_set_max_shared``); a file that does not compile is a no, and
    after the first try a dict lookup (its room is kept as none: no error raised and caught on
    every step). For a fast path's own kernel, where a slower path that works elsewhere must
    run instead of failing."""
    try:
        return _set_max_shared(stem, name, nbytes)
    except CompileError:
        _shared_room[(_dev(), stem, name)] = [-1, 0]   # fits nothing (_function keeps the error)
        return False


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

def _launch(stem: str, name: str, grid, block, args, shared: int = 0, pdl: bool = False,
            writes=(), cluster=None) -> None:
    """Launch kernel ``name`` of backends/cuda/<stem>.cu on the current stream. ``pdl``: the
    kernel calls ``pdl_wait()`` (common.cuh) before it reads anything the previous kernel
    writes, so on Hopper it may be launched with programmatic dependent launch
    (``_LauncherEx``); ``writes``: the arrays it writes (``_pdl_wrote`` asks about them).
    ``cluster``: blocks per thread-block cluster (x, y, z), Hopper only (the caller checks
    ``_launcher_ex()``)."""
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
    """``cuLaunchKernelEx`` through ``cuda.bindings.driver`` (NVIDIA's maintained binding of
    the driver API), for launch attributes CuPy's launcher lacks: thread-block cluster
    dimensions, and programmatic stream serialization (programmatic dependent launch): the
    kernel may start while the previous kernel on the stream still runs, once every block of
    that one has called ``pdl_launch_dependents()`` (or ended). Its blocks load what does not
    depend on the previous kernel (the weights of a decoding step), then ``pdl_wait()`` until
    the previous kernel has finished and its writes are visible. Inside a CUDA graph capture
    this becomes a programmatic edge.

    The attribute lists are built once per (pdl, cluster) and reused, so a launch costs one
    ``CUlaunchConfig`` and the argument tuple."""

    def __init__(self, driver):
        import ctypes as C
        self._driver = driver
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._attrs: dict = {}   # (pdl, cluster) -> [CUlaunchAttribute, ...]
        # kernel scalars by NumPy dtype -> the ctypes type cuda.bindings packs them as
        self._types = {np.dtype(np.int32): C.c_int32, np.dtype(np.int64): C.c_int64,
                       np.dtype(np.uint32): C.c_uint32, np.dtype(np.float32): C.c_float,
                       np.dtype(np.float64): C.c_double}
        self._void_p = C.c_void_p

    def _attributes(self, pdl: bool, cluster) -> list:
        key = (bool(pdl), None if cluster is None else tuple(int(v) for v in cluster))
        attrs = self._attrs.get(key)
        if attrs is None:
            d = self._driver
            attrs = []
            if key[0]:
                a = d.CUlaunchAttribute()
                a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                a.value.programmaticStreamSerializationAllowed = 1
                attrs.append(a)
            if key[1] is not None:
                a = d.CUlaunchAttribute()
                a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                dim = a.value.clusterDim
                dim.x, dim.y, dim.z = key[1]
                attrs.append(a)
            self._attrs[key] = attrs
        return attrs

    def _params(self, args):
        """``((values), (ctypes types))``: cuda.bindings' form of the kernel arguments. A CuPy
        array is its device address (c_void_p); a NumPy scalar its value in the matching
        ctypes type."""
        values, types = [], []
        for a in args:
            if isinstance(a, cupy.ndarray):
                values.append(a.data.ptr)
                types.append(self._void_p)
                continue
            t = self._types.get(getattr(a, "dtype", None))
            if t is None:
                raise DTypeError(f"pdl launch: kernel argument of type {type(a).__name__} "
                                 "(expected a CuPy array or a NumPy int32/int64/uint32/float scalar)")
            values.append(t(a.item()))
            types.append(t)
        return tuple(values), tuple(types)

    def launch(self, func: int, grid, block, args, shared: int, stream: int, pdl: bool = True,
               cluster=None) -> None:
        """Launch CUfunction ``func`` (an address); ``pdl``: with programmatic dependent
        launch; ``cluster``: (x, y, z) blocks per thread-block cluster, or None."""
        d = self._driver
        cfg = d.CUlaunchConfig()
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in g)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in b)
        cfg.sharedMemBytes = int(shared)
        cfg.hStream = int(stream)
        attrs = self._attributes(pdl, cluster)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        (err,) = d.cuLaunchKernelEx(cfg, d.CUfunction(int(func)), self._params(args), 0)
        if err != self._ok:
            _, msg = d.cuGetErrorString(err)
            raise DeviceError(f"cuLaunchKernelEx failed: error {int(err)} "
                              f"({(msg or b'?').decode()})")

    @staticmethod
    def load():
        """The launcher, or None where ``cuda.bindings`` does not import or cannot reach the
        driver (then the gemv goes to cuBLAS and decode attention runs a block per head)."""
        try:
            from cuda.bindings import driver
        except ImportError:
            return None
        try:
            (err, _version) = driver.cuDriverGetVersion()
        except Exception:  # the driver library cannot be loaded
            return None
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return _LauncherEx(driver)


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
    capability 9.0 or later (Hopper) and ``cuda.bindings`` usable."""
    return _cc_major(_dev()) >= 9 and _launcher() is not None


def _pdl_on() -> bool:
    """Programmatic dependent launch: ``_launcher_ex()`` and the FORGE_PDL switch on."""
    return flags.on("FORGE_PDL") and _launcher_ex()


@functools.lru_cache(maxsize=None)
def _cc(dev: int) -> str:
    """Device ``dev``'s compute capability as CuPy writes it (``"90"`` on Hopper)."""
    return cupy.cuda.Device(dev).compute_capability


@functools.lru_cache(maxsize=None)
def _cc_major(dev: int) -> int:
    return int(_cc(dev)) // 10


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])


def _grid(n: int, threads: int = _THREADS, per_sm: int = 32) -> int:
    """Blocks for a grid-stride loop over n items: enough to fill the GPU, at least one."""
    cap = _sm_count(_dev()) * per_sm
    return max(1, min(cap, -(-n // threads)))


# ----------------------------------------------------------------------------------------------
# Dtypes and kernel scalars
# ----------------------------------------------------------------------------------------------

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


def _word(x) -> str:
    """The bit-copy kernel suffix of ``x``'s element size."""
    return _WORD[x.dtype.itemsize]


def _dtype(name):
    name = getattr(name, "name", name)  # a forge_ml DType or a NumPy dtype works too
    try:
        return _DTYPES[name]
    except KeyError:
        if name == "bfloat16":
            raise DTypeError("bfloat16 on the GPU needs CuPy with ml_dtypes installed "
                             "(pip install ml_dtypes)") from None
        raise DTypeError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _empty(shape, dt):
    return cupy.empty(tuple(int(s) for s in shape), dtype=dt)
