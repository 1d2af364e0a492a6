"""cuBLAS for the matrix products: forge-ml's own handle per device, ``_gemm`` (GemmEx and
GemmStridedBatchedEx on row-major operands) and ``_matmul_into`` (shapes, b_rows, beta).

cuBLAS is called through ctypes (``_CublasC``: the libcublas CuPy loaded, found in this
process's memory map), not through CuPy's wrappers: CuPy's cuBLAS wrappers refuse to run while
a stream is being captured into a CUDA graph, and the decoding step is replayed as one; cuBLAS
itself records its kernels into the graph. NVIDIA's maintained alternative, nvmath-python, is
not in the GPU image, so ctypes stays here (and in cublaslt.py, for the products with an
epilogue). Where libcublas cannot be found, CuPy's wrappers are used, and no matrix product can
be captured.

No TF32: the math mode is CUBLAS_DEFAULT_MATH, so float32 products are true float32.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import DTypeError, DeviceError
from .runtime import BF16, F32, F64, _dev, _oom_error, cupy

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
        self.lib = lib   # the loaded library, for other entry points (benchmarks/train_memory.py)
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
        _cublas().getVersion  # make sure CuPy has loaded the library
        return _open_loaded("libcublas", _CublasC)


def _open_loaded(stem: str, wrap):
    """``wrap(ctypes.CDLL(path))`` for the library ``stem`` (e.g. "libcublas"): the copy this
    process has loaded (CuPy's, found in /proc/self/maps) first, then the usual sonames; None
    where none opens or ``wrap`` finds an entry point missing (AttributeError)."""
    import ctypes
    paths = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if f"/{stem}.so" in ln})
    except OSError:
        pass
    for name in paths + [f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"]:
        try:
            return wrap(ctypes.CDLL(name))
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
