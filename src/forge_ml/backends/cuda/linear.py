"""Matrix products and the linear layer: ``matmul`` (cuBLAS through cublas.py; with a bias,
one cuBLASLt product with the bias in its epilogue, cublaslt.py, else the bias broadcast first
by elementwise.cu's ``bias_fill_*``), ``linear`` (a layernorm kernel, then one cuBLASLt product
with the bias, GELU and the residual in its epilogue), and for training ``matmul_gelu`` (GELU's
input written beside its output) and ``weight_grads`` (the bias gradient summed by the weight
gradient's product). For a few rows (a decoding step) on Hopper ``matmul`` and ``linear`` go to
gemv.cu instead: one kernel per layer, a thread-block cluster of K slices per column tile,
with the layernorm prologue and the bias, GELU and residual epilogue fused (``_gemv``).
Kernels: gemv.cu.
"""
from __future__ import annotations

import numpy as np

from ... import flags
from ...errors import DTypeError, ShapeError
from .. import compose as _compose
from .cublas import _matmul_into
from .cublaslt import lt_matmul
from .memory import _c, _like
from .rows import gelu_bwd_colsum, sum_rows
from .runtime import (BF16, F32, _THREADS, _empty, _float_sfx, _grid, _guarded, _i32, _i64,
                      _launch, _launcher_ex, _package, _pdl_wrote)


_GEMV_M = 4          # gemv.cu: GEMV_M
_GEMV_THREADS = 256  # GEMV_WARPS * 32
_GEMV_VEC = {F32: 4}
if BF16 is not None:
    _GEMV_VEC[BF16] = 8
_GEMV_KC = 1024        # gemv.cu: GEMV_KC, rows of a block's K slice at most
_GEMV_CLUSTER = 8      # blocks of a cluster at most (K slices of one column tile)
_GEMV_LPR = {F32: (32, 16, 8, 4, 2, 1), BF16: (16, 8, 4, 2, 1)}  # lanes per row compiled
_GEMV_TILES = 16       # column tiles wanted at least (with 8 slices: about one block per SM)


def _gemv_ok(a, b, M, K, N) -> bool:
    """Whether x (M, K) @ W (K, N) goes to gemv.cu: a few rows (decoding), float32 or
    bf16, N a multiple of the 16-byte vector, W 16-byte aligned, K within the kernel's
    slices, on a Hopper GPU (thread-block clusters) (the FORGE_GEMV switch off turns it
    off)."""
    vec = _GEMV_VEC.get(a.dtype)
    return (vec is not None and 0 < M <= _GEMV_M and 0 < K <= _GEMV_CLUSTER * _GEMV_KC
            and N % vec == 0 and b.data.ptr % 16 == 0
            and flags.on("FORGE_GEMV") and _launcher_ex())


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
    # W (or the bias, gamma, beta: every weight the kernel loads before its pdl_wait) written
    # by the kernel before: a plain launch (on the H200 a programmatic launch read such a W
    # stale through the read-only cache, even with its pdl_wait() before the loads)
    early = not any(_pdl_wrote(t) for t in (b, bias) + (() if ln is None else ln[:2])
                    if t is not None)
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
    (gemv.cu); otherwise the layernorm kernel, then one cuBLASLt product with the bias, GELU
    and the residual in its epilogue (where cuBLASLt cannot: matmul, gelu and add one after
    the other). ``ln``: None or (gamma, beta, eps)."""
    x, w = _c(x), _like(_c(w), x.dtype)
    M, K = x.shape
    N = w.shape[1]
    if _gemv_ok(x, w, M, K, N):
        bias = None if bias is None else _like(_c(bias), x.dtype)
        residual = None if residual is None else _like(_c(residual), x.dtype)
        if ln is not None:
            ln = (_like(_c(ln[0]), x.dtype), _like(_c(ln[1]), x.dtype), float(ln[2]))
        return _gemv(x, w, bias, 1.0, M, K, N, _ACTS[act], residual, ln)
    if act is None or (bias is not None and residual is None):
        # cuBLASLt: D = act(x @ w + bias) [+ residual as C]; GELU applies after C is added,
        # so GELU with a residual stays composed
        bias = None if bias is None else _like(_c(bias), x.dtype)
        res = None if residual is None else _like(_c(residual), x.dtype)
        if (bias is not None and bias.size != N) or (res is not None and res.shape != (M, N)):
            raise ShapeError(f"linear: bias {None if bias is None else bias.shape} and residual "
                             f"{None if res is None else res.shape} do not fit an output "
                             f"of {(M, N)}")
        h = x if ln is None else _package().layernorm(x, _like(_c(ln[0]), x.dtype),
                                                      _like(_c(ln[1]), x.dtype), float(ln[2]))
        out = _empty((M, N), x.dtype)
        epi = ("gelu_bias" if act else "bias") if bias is not None else "default"
        if lt_matmul(h, w, out, bias=bias, epilogue=epi, c=res):
            return out
        return _compose.linear(_package(), h, w, bias, act, res, None)
    return _compose.linear(_package(), x, w, bias, act, residual, ln)


@_guarded
def matmul_gelu(x, w, bias):
    """``(gelu(x @ w + bias), x @ w + bias)``: one cuBLASLt product (GELU_AUX_BIAS writes
    GELU's input as its auxiliary output), else matmul then gelu."""
    x, w, bias = _c(x), _like(_c(w), x.dtype), _like(_c(bias), x.dtype)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or bias.size != w.shape[1]:
        raise ShapeError(f"matmul_gelu: x {x.shape}, w {w.shape} and bias {bias.shape} do not "
                         "fit (M, K) @ (K, N) + (N,)")
    out, pre = _empty((x.shape[0], w.shape[1]), x.dtype), _empty((x.shape[0], w.shape[1]), x.dtype)
    if out.size and lt_matmul(x, w, out, bias=bias, epilogue="gelu_aux_bias", aux=pre):
        return out, pre
    return _compose.matmul_gelu(_package(), x, w, bias)


@_guarded
def matmul_dgelu(dy, w, pre):
    """``(gelu_bwd(pre, dy @ w^T), its row sums)``: one cuBLASLt product whose DGELU epilogue
    applies GELU's derivative at ``pre`` to the product as it writes it, then ``sum_rows`` of
    the result (16-byte rows); where cuBLASLt cannot, cuBLAS for the product, then one kernel
    for GELU's derivative that sums the bias gradient as it writes (gelu.cu's
    gelu_bwd_colsum). (cuBLASLt's DGELU_BGRAD epilogue, the sums too, ran as a separate
    kernel, 0.65 ms a GPT-2 124M layer at B=32: slower than the two passes.)"""
    dy, w, pre = _c(dy), _like(_c(w), dy.dtype), _like(_c(pre), dy.dtype)
    if dy.ndim != 2 or w.ndim != 2 or pre.ndim != 2 or dy.shape[1] != w.shape[1] \
            or pre.shape != (dy.shape[0], w.shape[0]):
        raise ShapeError(f"matmul_dgelu: dy {dy.shape}, w {w.shape} and pre {pre.shape} do not "
                         "fit (M, N) @ (K, N)^T = (M, K)")
    if pre.size:
        dpre = _empty(pre.shape, dy.dtype)
        if lt_matmul(dy, w, dpre, trans_b=True, epilogue="dgelu", aux=pre):
            return dpre, sum_rows(dpre)
        dh = dpre
        _matmul_into(dy, w, dh, False, True, 1.0, None)
        got = gelu_bwd_colsum(pre, dh)
        if got is not None:
            return got
    return _compose.matmul_dgelu(_package(), dy, w, pre)


@_guarded
def weight_grads(x, dy, alpha):
    """``(alpha x^T dy, sum_rows(dy))``: one cuBLASLt product whose epilogue sums dy's rows
    (BGRADA), else matmul and sum_rows."""
    x, dy = _c(x), _like(_c(dy), x.dtype)
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ShapeError(f"weight_grads: x {x.shape} and dy {dy.shape} must be (M, K) and (M, N)")
    dw, db = _empty((x.shape[1], dy.shape[1]), x.dtype), _empty((dy.shape[1],), x.dtype)
    if dw.size and lt_matmul(x, dy, dw, trans_a=True, bias=db, epilogue="bgrada", alpha=alpha):
        return dw, db
    return _compose.weight_grads(_package(), x, dy, alpha)


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
    # every 2-D product without a bias through cuBLASLt's heuristic (as the products with a
    # bias or an epilogue go) rather than cublasGemmEx's choice
    if (bias is None and a.ndim == 2 and br == br_stored and out.size
            and lt_matmul(a, b, out, trans_a, trans_b, alpha=alpha)):
        return out
    if bias is not None:
        bias = _like(_c(bias), a.dtype)
        if bias.size != N:
            raise ShapeError(f"matmul: bias has {bias.size} elements but the output has {N} "
                             "columns")
        if (a.ndim == 2 and br == br_stored and out.size
                and lt_matmul(a, b, out, trans_a, trans_b, bias=bias, epilogue="bias",
                              alpha=alpha)):
            return out
        if out.size:
            _launch("elementwise", f"bias_fill_{_float_sfx(out)}", _grid(out.size), _THREADS,
                    (bias, out, _i64(out.size), _i32(N)))
        beta = 1.0
    return _matmul_into(a, b, out, trans_a, trans_b, alpha, b_rows, beta)
