"""cuBLASLt: matrix products with their epilogue fused (``lt_matmul``). A product with a bias
(``BIAS``), a bias and GELU (``GELU_BIAS``; ``GELU_AUX_BIAS`` also writes GELU's input, which
the backward needs), a residual added through C (``D = A B + bias + C``, C apart from D), and
the weight gradient with the bias gradient of the same pass (``BGRADA``: the sum over the rows
of dY, read once), and GELU's backward applied to a product (``DGELU``: the derivative at the
input ``GELU_AUX_BIAS`` kept). Today's path without it: ``bias_fill`` then cuBLAS with
beta = 1, ``gelu`` after, ``sum_rows`` beside the weight gradient; each of those reads or
writes the whole output once more.

Called through ctypes like ``cublas.py`` (``libcublasLt``, which libcublas loads, found in this
process's memory map), and for the same reason: calls are recorded into CUDA graphs. A plan
(descriptors, layouts and the algorithm cuBLASLt's heuristic picked) is made once per shape,
dtype and epilogue and kept; a call only sets the pointers. Where the
library, the epilogue or the shape is not available (no algorithm from the heuristic, or a
launch the library declines), ``lt_matmul`` returns False and the caller takes today's path
(the ``FORGE_CUBLASLT`` switch off does the same).

GELU here is cuBLASLt's tanh form, GPT-2's; float32 products are true float32 (compute type
32F, no TF32), as in cublas.py.
"""
from __future__ import annotations

import ctypes as C
import json
import threading

import numpy as np

from ... import flags
from ...errors import DeviceError
from .cublas import _CUBLAS_STATUS, _cublas_direct, _cuda_type, _open_loaded
from .runtime import BF16, F32, _dev, _oom_error, cupy

# cublasLt.h
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD, _DESC_BIAS_DATA_TYPE = 11, 12, 26
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
_COMPUTE_32F = 68
_EPILOGUES = {"default": 1, "bias": 4, "gelu_bias": 36, "gelu_aux_bias": 164, "dgelu": 192,
              "bgrada": 256}
_WORKSPACE = 32 << 20
_ALIGN = 16
_CANDIDATES = 8     # heuristic results a plan keeps (FORGE_GEMM_TUNE times them)
_TUNE_CALLS = 5     # back-to-back calls between a candidate's two events
_TUNE_MARGIN = 0.03  # another candidate replaces the heuristic's first only if this much faster
# Products FORGE_GEMM_TUNE times: training's, at least this many rows and M * N * K. Timed back to
# back, a product of a few microseconds ranks the candidates by what a warm L2 favours: at M = 64
# (batch-64 decoding) the picks cost generation 7.8% (the seventeenth session, an H100).
_TUNE_MIN_ROWS = 4096
_TUNE_MIN_WORK = 1 << 33
_DECLINED = (7, 8, 15)   # INVALID_VALUE, ARCH_MISMATCH, NOT_SUPPORTED: nothing was launched


class _LtC:
    """libcublasLt's entry points, through ctypes (None where the library is not found)."""

    def __init__(self, lib):
        vp, i32, u64, i64, sz = C.c_void_p, C.c_int, C.c_uint64, C.c_int64, C.c_size_t
        sigs = {
            "cublasLtCreate": [C.POINTER(vp)],
            "cublasLtMatmulDescCreate": [C.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [C.POINTER(vp), i32, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [C.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, C.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, i32
            setattr(self, name[len("cublasLt"):].lower(), f)

    @staticmethod
    def load():
        if _cublas_direct() is None:   # libcublas (and with it libcublasLt) not loaded
            return None
        return _open_loaded("libcublasLt", _LtC)


_lib: list = []      # [the _LtC or None]
_devices: dict = {}  # device -> (handle, workspace)
_plans: dict = {}    # key -> _Plan, or None where cuBLASLt has no algorithm for it
_lock = threading.Lock()   # a plan's descriptor takes each call's pointers: one call at a time


def _lt():
    if not _lib:
        _lib.append(_LtC.load())
    return _lib[0]


def _ok(st, what):
    if st == 3:
        raise _oom_error(MemoryError(f"cuBLASLt could not allocate ({what})"))
    if st != 0:
        raise DeviceError(f"cuBLASLt {what} failed: CUBLAS_STATUS_{_CUBLAS_STATUS.get(st, st)}")


def _device_state(lt):
    dev = _dev()
    st = _devices.get(dev)
    if st is None:
        h = C.c_void_p()
        _ok(lt.create(C.byref(h)), "create")
        st = _devices[dev] = (h, cupy.empty(_WORKSPACE, np.uint8))
    return st


def _set(lt, desc, attr, value, ctype):
    v = ctype(value)
    _ok(lt.matmuldescsetattribute(desc, attr, C.byref(v), C.sizeof(v)), f"attribute {attr}")


class _Plan:
    """Descriptors and the chosen algorithm of one product: row-major ``out (M, N) = op(a)
    (M, K) @ op(b) (K, N)``, asked of cuBLASLt (column-major) as ``out^T = op(b)^T op(a)^T``:
    its A is our b, its B our a."""

    def __init__(self, lt, handle, dt, M, N, K, a_shape, b_shape, trans_a, trans_b, epi,
                 bias_dt):
        vp = C.c_void_p
        t = _cuda_type(dt)
        self.desc = vp()
        _ok(lt.matmuldesccreate(C.byref(self.desc), _COMPUTE_32F, _cuda_type(F32)), "desc")
        _set(lt, self.desc, _DESC_TRANSA, int(trans_b), C.c_int)
        _set(lt, self.desc, _DESC_TRANSB, int(trans_a), C.c_int)
        _set(lt, self.desc, _DESC_EPILOGUE, _EPILOGUES[epi], C.c_int)
        if bias_dt is not None:
            _set(lt, self.desc, _DESC_BIAS_DATA_TYPE, _cuda_type(bias_dt), C.c_int)
        if epi in ("gelu_aux_bias", "dgelu"):   # GELU's input: written, or read
            _set(lt, self.desc, _DESC_AUX_LD, N, C.c_int64)

        def layout(stored):   # a row-major (r, c) matrix is column-major (c, r), ld c
            lay = vp()
            _ok(lt.matrixlayoutcreate(C.byref(lay), t, stored[1], stored[0], stored[1]), "layout")
            return lay
        self.a, self.b, self.d = layout(b_shape), layout(a_shape), layout((M, N))
        self.pref = pref = vp()   # kept: benchmarks/gemm_algos_cuda.py asks it for more candidates
        _ok(lt.matmulpreferencecreate(C.byref(pref)), "preference")
        ws = C.c_size_t(_WORKSPACE)
        _ok(lt.matmulpreferencesetattribute(pref, _PREF_MAX_WORKSPACE_BYTES, C.byref(ws),
                                            C.sizeof(ws)), "preference")
        for attr in _PREF_MIN_ALIGNMENT:
            al = C.c_uint32(_ALIGN)
            _ok(lt.matmulpreferencesetattribute(pref, attr, C.byref(al), C.sizeof(al)),
                "preference")
        # cublasLtMatmulHeuristicResult_t (96 bytes): the 64-byte algorithm is its head
        res = (C.c_ubyte * (96 * _CANDIDATES))()
        n = C.c_int(0)
        st = lt.matmulalgogetheuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref,
                                       _CANDIDATES, res, C.byref(n))
        self.ok = st == 0 and n.value > 0
        self.candidates = [(C.c_ubyte * 96).from_buffer_copy(res, 96 * i)
                           for i in range(n.value if self.ok else 0)]
        self.algo = self.candidates[0] if self.ok else (C.c_ubyte * 96)()
        self.tuned = False   # FORGE_GEMM_TUNE: the algorithm chosen (from the cache or timed)


def _tune_key(dt, M, N, K, trans_a, trans_b, epi, bias_dt, beta) -> str:
    """The tuning cache's key of a product: the GPU's name and cuBLASLt's version (another
    library or card ranks the candidates anew), then what the plan depends on.

    >>> _tune_key("bfloat16", 8, 16, 32, True, False, "bgrada", "bfloat16", 0.0).split("|", 2)[2]
    'bfloat16|8,16,32|TN|bgrada|bias bfloat16|beta 0'
    """
    try:
        dev = cupy.cuda.runtime.getDeviceProperties(_dev())["name"]
        dev = dev.decode() if isinstance(dev, bytes) else str(dev)
        ver = str(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:   # no GPU (the doctest): the key's other fields still apply
        dev, ver = "?", "?"
    return (f"{dev}|cuda {ver}|{dt}|{M},{N},{K}|{'T' if trans_a else 'N'}"
            f"{'T' if trans_b else 'N'}|{epi}|bias {bias_dt}|beta {float(beta):g}")


def _tune_file():
    return flags.cache_root("gemm") / "lt_algos.json"


def _tune_load() -> dict:
    """The cache of chosen algorithms (key -> the 64 bytes as hex); an unreadable or
    malformed file is an empty cache (it is rewritten on the next choice)."""
    try:
        data = json.loads(_tune_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(data, dict) else {}


def _tune_store(key: str, algo_hex: str) -> None:
    """Add one choice to the cache file: read, update, written whole (``runs.replace_file``: a
    reader never sees half a file; two processes racing keep one whole file, each choice still
    in use in its own process). A folder that cannot be written is skipped: the choice holds
    for this process."""
    from ...runs import replace_file
    path = _tune_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _tune_load()
        data[key] = algo_hex
        replace_file(path, json.dumps(data, indent=0, sort_keys=True))
    except OSError:
        pass


def _tune_pick(times) -> int:
    """The candidate to keep: the fastest, unless the heuristic's first (index 0) is within
    _TUNE_MARGIN of it (timing noise should not move a product off the library's choice).

    >>> _tune_pick([1.0, 0.99, 1.2]), _tune_pick([1.0, 0.9, 0.95]), _tune_pick([float("inf"), 2.0])
    (0, 1, 1)
    """
    best = min(range(len(times)), key=lambda i: (times[i], i))
    return 0 if times[0] <= times[best] * (1.0 + _TUNE_MARGIN) else best


def _tunable(M: int, N: int, K: int) -> bool:
    """Whether FORGE_GEMM_TUNE times a product of (M, K) @ (K, N): training's sizes only.

    >>> _tunable(32768, 768, 768), _tunable(64, 50304, 768), _tunable(16384, 384, 384)
    (True, False, False)
    """
    return M >= _TUNE_MIN_ROWS and M * N * K >= _TUNE_MIN_WORK


def _tune(plan, key: str, run) -> None:
    """FORGE_GEMM_TUNE: set ``plan.algo`` to the cached choice for ``key`` if it is still one
    of the heuristic's candidates, else time each candidate (``run(algo)`` launches the
    product; _TUNE_CALLS calls back to back between two events, best of two, on the call's own
    operands: every candidate writes the same outputs) and keep ``_tune_pick``'s. Not while the
    stream is being captured into a graph (the plan keeps the heuristic's first until a call
    outside a capture)."""
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return
    plan.tuned = True
    if len(plan.candidates) < 2:
        return
    heads = [bytes(c)[:64].hex() for c in plan.candidates]
    cached = _tune_load().get(key)
    if cached in heads:
        plan.algo = plan.candidates[heads.index(cached)]
        return
    times = []
    for algo in plan.candidates:
        try:
            run(algo)   # the first call of a kernel loads it
            best = float("inf")
            for _ in range(2):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                for _ in range(_TUNE_CALLS):
                    run(algo)
                end.record(stream)
                end.synchronize()
                best = min(best, cupy.cuda.get_elapsed_time(start, end) / _TUNE_CALLS)
        except DeviceError:
            best = float("inf")
        times.append(best)
    pick = _tune_pick(times)
    plan.algo = plan.candidates[pick]
    _tune_store(key, heads[pick])


def _aligned(*arrays) -> bool:
    """Every pointer on a 16-byte boundary: what the plans are made for. One alignment for all
    (not the 256 bytes most allocations have) keeps the algorithm, and so the bits, the same
    wherever an operand lives (a view into a flat buffer of parameters included)."""
    return all(x.data.ptr % _ALIGN == 0 for x in arrays if x is not None)


def lt_matmul(a, b, out, trans_a=False, trans_b=False, *, bias=None, epilogue="default",
              aux=None, c=None, alpha=1.0) -> bool:
    """``out = epilogue(alpha op(a) @ op(b) + bias + c)`` for 2-D bfloat16 or float32 operands,
    row-major: ``epilogue`` "default", "bias", "gelu_bias", "gelu_aux_bias" (``aux`` gets
    GELU's input, out's shape), "dgelu" (``out`` = GELU's derivative at ``aux``, GELU's input
    as "gelu_aux_bias" wrote it, times the product) or "bgrada": the weight gradient
    ``X^T dY`` (``a`` = X with ``trans_a``, ``b`` = dY) that also writes ``bias`` = the sums
    of dY's rows. ``c``: None, or
    an array of out's shape added (beta = 1, C apart from D). Returns False, having done
    nothing, where cuBLASLt cannot do it here."""
    if not flags.on("FORGE_CUBLASLT") or a.dtype not in (BF16, F32) or a.dtype != b.dtype \
            or out.dtype != a.dtype or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    if epilogue == "bgrada" and (not trans_a or trans_b):
        return False
    lt = _lt()
    if lt is None:
        return False
    M, N = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    if min(M, N, K) == 0:
        return False
    if not _aligned(a, b, out, c, aux, bias):
        return False
    bias_dt = None if bias is None else bias.dtype
    key = (_dev(), a.dtype, a.shape, b.shape, trans_a, trans_b, epilogue, bias_dt)  # M, N, K follow
    al, be = C.c_float(alpha), C.c_float(0.0 if c is None else 1.0)
    cp = out if c is None else c
    with _lock:
        handle, ws = _device_state(lt)
        plan = _plans.get(key, False)
        if plan is False:
            plan = _Plan(lt, handle, a.dtype, M, N, K, a.shape, b.shape, trans_a, trans_b,
                         epilogue, bias_dt)
            plan = _plans[key] = plan if plan.ok else None
        if plan is None:
            return False
        if bias is not None:
            _set(lt, plan.desc, _DESC_BIAS_POINTER, bias.data.ptr, C.c_void_p)
        if aux is not None:
            _set(lt, plan.desc, _DESC_AUX_POINTER, aux.data.ptr, C.c_void_p)

        def run(algo):
            st = lt.matmul(handle, plan.desc, C.byref(al), b.data.ptr, plan.a, a.data.ptr,
                           plan.b, C.byref(be), cp.data.ptr, plan.d, out.data.ptr, plan.d, algo,
                           ws.data.ptr, _WORKSPACE, cupy.cuda.get_current_stream().ptr)
            if st != 0:
                raise DeviceError(f"cuBLASLt candidate: status {st}")

        if not plan.tuned and flags.on("FORGE_GEMM_TUNE") and _tunable(M, N, K):
            _tune(plan, _tune_key(a.dtype, M, N, K, trans_a, trans_b, epilogue, bias_dt,
                                  0.0 if c is None else 1.0), run)
        st = lt.matmul(handle, plan.desc, C.byref(al), b.data.ptr, plan.a, a.data.ptr, plan.b,
                       C.byref(be), cp.data.ptr, plan.d, out.data.ptr, plan.d, plan.algo,
                       ws.data.ptr, _WORKSPACE, cupy.cuda.get_current_stream().ptr)
        if st in _DECLINED:   # this GPU or library will not run the plan: cuBLAS from now on
            _plans[key] = None
            return False
        _ok(st, f"matmul ({M} x {K}) @ ({K} x {N}), {epilogue}")
    return True
