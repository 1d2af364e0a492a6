"""Kernels that reduce along rows or columns: ``sum_rows`` and ``sumsq`` (reduce.cu: fixed
grids and orders, no atomics, so every run gives the same bits), ``layernorm`` and
``layernorm_bwd`` (layernorm.cu), ``softmax``, ``softmax_bwd`` and ``logsumexp`` (softmax.cu,
with the causal mask), ``cross_entropy`` and ``cross_entropy_bwd`` (cross_entropy.cu: softmax
and NLL fused, no probabilities kept). Kernels: reduce.cu, layernorm.cu, softmax.cu,
cross_entropy.cu.
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from .. import compose as _compose
from .memory import _c, _ids, _like, cast
from .runtime import (_SFX, _THREADS, BF16, F32, _acc, _acc_dtype, _cc_major, _dev, _empty,
                      _float_sfx, _guarded, _i32, _i64, _launch, _package, _sfx, _sm_count, cupy)


# ----------------------------------------------------------------------------------------------
# Reductions: sum_rows, sumsq
# ----------------------------------------------------------------------------------------------

def _chunks(R: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) for the column-sum kernels."""
    chunk = max(64, -(-R // 1024))
    return chunk, max(1, -(-R // chunk))


def _colsum_finish(part, out, S, C, jobs=1):
    """out[j] = the column sums of part[j] (S, C), j < jobs (a stack of them in one launch)."""
    _launch("reduce", f"colsum_finish_{_float_sfx(out)}", (-(-C // 32), jobs), (32, 32),
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
    if x.dtype == BF16 and C % 8 == 0 and x.data.ptr % 16 == 0:
        _colsum8("reduce", "sum_rows8_partial_bf16", (x,), out, R, C)   # 16-byte rows
        return out
    chunk, S = _chunks(R)
    part = _empty((S, C), _acc_dtype(x.dtype))
    _launch("reduce", f"sum_rows_partial_{_float_sfx(x)}", (-(-C // 32), S), (32, 8),
            (x, part, _i64(R), _i32(C), _i64(chunk)))
    _colsum_finish(part, out, S, C)
    return out


def _colsum8(module: str, kernel: str, ins: tuple, out, R: int, C: int) -> None:
    """One of the 16-byte column-sum kernels (gelu.cu's gelu_bwd_colsum8_bf16, reduce.cu's
    sum_rows8_partial_bf16) over ``R`` bf16 rows of ``C`` columns, a multiple of 8: ``ins``,
    then its float32 partial sums, a (32 x 8) block 256 columns over a chunk of rows (about
    four blocks an SM, one wave, a chunk a multiple of 16 rows); then ``colsum_finish`` adds
    the chunks into ``out``."""
    want = max(1, min(-(-R // 16), 4 * _sm_count(_dev()) // -(-C // 256)))   # chunks wanted
    chunk = 16 * -(-R // (16 * want))
    S = -(-R // chunk)
    part = _empty((S, C), F32)
    _launch(module, kernel, (-(-C // 256), S), (32, 8),
            ins + (part, _i64(R), _i32(C), _i64(chunk)))
    _colsum_finish(part, out, S, C)


def gelu_bwd_colsum(x, dy):
    """``(gelu_bwd(x, dy), sum_rows of it)`` for 2-D ``x``, ``dy`` of one dtype, the sums taken
    as the gradient is written (gelu.cu's ``gelu_bwd_colsum``, and for bf16 rows of a multiple
    of 8 columns on 16-byte boundaries ``gelu_bwd_colsum8_bf16``); None where the 4-wide
    vectors do not fit (columns not a multiple of 4, or an operand off a 4-element boundary)."""
    R, K = x.shape
    if K % 4 or R == 0 or any(a.data.ptr % (4 * a.itemsize) for a in (x, dy)):
        return None
    dx, db = _empty((R, K), x.dtype), _empty((K,), x.dtype)
    if x.dtype == BF16 and K % 8 == 0 and not any(a.data.ptr % 16 for a in (x, dy, dx)):
        _colsum8("gelu", "gelu_bwd_colsum8_bf16", (x, dy, dx), db, R, K)   # the 16-byte kernel
        return dx, db
    chunk, S = _chunks(R)
    part = _empty((S, K), _acc_dtype(x.dtype))
    _launch("gelu", f"gelu_bwd_colsum_{_float_sfx(x)}", (-(-K // 128), S), (32, 8),
            (x, dy, dx, part, _i64(R), _i32(K), _i64(chunk)))
    _colsum_finish(part, db, S, K)
    return dx, db


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

_ROWS_PER_BLOCK = 8  # warp-per-row kernels: 8 warps, 256 threads (layernorm.cu: LN_WARPS)


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
    elif R and _vec_rows(C, x, gamma, beta):
        nv = -(-C // 256)
        grid = min(-(-R // _ROWS_PER_BLOCK), 16 * _sm_count(_dev()))
        _launch("layernorm", f"layernorm_fwd_vec_bf16_{nv}", (grid,), 32 * _ROWS_PER_BLOCK,
                (x, gamma, beta, y, _i64(R), _i32(C), _acc(x.dtype, eps)))
    elif R:
        _launch("layernorm", f"layernorm_fwd_{_float_sfx(x)}", (-(-R // _ROWS_PER_BLOCK),),
                32 * _ROWS_PER_BLOCK, (x, gamma, beta, y, _i64(R), _i32(C), _acc(x.dtype, eps)))
    return y


def _layernorm_bwd_vec(x, gamma, dy, add, eps, sums=False):
    """layernorm.cu's one-pass bf16 backward (``_vec_rows``), dx + ``add`` where it is given:
    ``(dx, dgamma, dbeta)``, and with ``sums`` also dx's column sums (the _sums kernels). The
    parameters' gradients (and the sums) are rows of one array, finished by one launch."""
    C = x.shape[-1]
    R = x.size // C
    nv = -(-C // 256)
    S = min(-(-R // _ROWS_PER_BLOCK), (2 if nv <= 4 else 1) * _sm_count(_dev()))
    dx = _empty(x.shape, x.dtype)
    jobs = 3 if sums else 2
    part = _empty((jobs, S, C), F32)
    outs = _empty((jobs, C), x.dtype)
    name = "layernorm_bwd_fused" + ("_add" if add is not None else "") + ("_sums" if sums else "")
    ins = (x, gamma, dy) if add is None else (x, gamma, dy, add)
    _launch("layernorm", f"{name}_bf16_{nv}", (S,), 32 * _ROWS_PER_BLOCK,
            ins + (dx, part[0], part[1]) + ((part[2],) if sums else ())
            + (_i64(R), _i32(C), _acc(x.dtype, eps)))
    _colsum_finish(part, outs, S, C, jobs)
    return (dx,) + tuple(outs[j] for j in range(jobs))


def _layernorm_bwd_fused(x, gamma, dy, eps, add, sums, composed):
    """The vector kernels for the bf16 rows they take (``add`` None or x's shape), else
    ``composed`` (compose's op of the same name), on the operands in x's dtype."""
    x = _c(x)
    gamma, dy = _like(_c(gamma), x.dtype), _like(_c(dy), x.dtype)
    add = None if add is None else _like(_c(add), x.dtype)
    if (x.size and (add is None or add.shape == x.shape)
            and _vec_rows(x.shape[-1], *(a for a in (x, gamma, dy, add) if a is not None))):
        return _layernorm_bwd_vec(x, gamma, dy, add, eps, sums=sums)
    return composed(_package(), x, gamma, dy, eps, add)


@_guarded
def layernorm_bwd_add(x, gamma, dy, eps, add):
    """``layernorm_bwd`` with ``add`` added to dx in the kernel's last pass, for the bf16 rows
    the vector kernels take (else ``compose``: the backward, then ``add``): the residual
    stream's gradient joins dx in the pass that writes it, instead of an ``add`` over the
    whole stream after it."""
    return _layernorm_bwd_fused(x, gamma, dy, eps, add, False, _compose.layernorm_bwd_add)


@_guarded
def layernorm_bwd_sums(x, gamma, dy, eps, add=None):
    """``(dx, dgamma, dbeta, sum_rows(dx))``, dx with ``add`` added where it is given: the
    vector kernels sum the dx they write (as rounded to x's dtype) in the same pass, for the
    bias gradient of the layer that made x (else ``compose``: the backward, then
    ``sum_rows``)."""
    return _layernorm_bwd_fused(x, gamma, dy, eps, add, True, _compose.layernorm_bwd_sums)


def _vec_rows(C: int, *arrays) -> bool:
    """bf16 rows of C = 8k <= 2048 on sm_80+, every array on a 16-byte boundary (a view into a
    larger buffer may not be): layernorm.cu's kernels that hold a row in 16-byte vectors (a warp
    a row, the lanes reading whole 512-byte spans)."""
    return (arrays[0].dtype == BF16 and C % 8 == 0 and 0 < C <= 2048 and _cc_major(_dev()) >= 8
            and all(a.data.ptr % 16 == 0 for a in arrays))


@_guarded
def layernorm_bwd(x, gamma, dy, eps=1e-5):
    x = _c(x)
    gamma, dy = _like(_c(gamma), x.dtype), _like(_c(dy), x.dtype)
    C = x.shape[-1]
    R = x.size // C if C else 0
    sfx = _float_sfx(x)
    acc = _acc_dtype(x.dtype)
    if R and _vec_rows(C, x, gamma, dy):   # dx and the parameters' partial sums in one pass
        return _layernorm_bwd_vec(x, gamma, dy, None, eps)
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


@_guarded
def logsumexp(x, causal=False, off=0):
    """``log(sum(exp(x)))`` over the last axis, masked as ``softmax`` is: ``x.shape[:-1]``,
    float32 (float64 for float64 input). The softmax kernel's per-row lse, the probabilities
    written to a scratch array."""
    x = _c(x)
    y = _empty(x.shape, x.dtype)                         # scratch: the probabilities
    lse = _empty(x.shape[:-1], _acc_dtype(x.dtype))
    if x.shape[-1] == 0 and lse.size:
        lse.fill(-np.inf)                                # a sum of no terms: log 0
    _softmax_into(x, y, lse, bool(causal), int(off))
    return lse


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
