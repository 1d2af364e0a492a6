"""The CPU backend's NumPy kernels: every op of the contract (``backends/contract.py``) in
plain NumPy. The specification they meet is ``tests/reference.py``; this module is the fast
reference: what runs for float64 (gradient checks), for arrays the C kernels do not take, on
a machine without a C compiler, and under ``FORGE_CPU_KERNELS=numpy``. It never calls C:
``backends/cpu/__init__.py`` decides, op by op, whether the fused C kernel of ``native``
runs instead. Loaded alone (``contract.missing(reference) == []``) it is a complete backend
whose ``linear`` and ``attention_qkv`` are ``compose``'s defaults.

Arrays in, arrays out. Each op computes in its input's dtype (float32, or float64 for
gradient checks); reductions that feed a loss or a norm (cross-entropy, sum of squares,
layernorm statistics) are written to stay accurate in float32. bfloat16 is a GPU storage
type only: asking this backend for it is a DTypeError.

Speed notes. NumPy runs one C loop per ufunc call, so the kernels below chain in-place
ufuncs (``out=``) instead of building expression temporaries, hand every product to BLAS
through ``np.matmul``, and take row and column sums as products with a ones vector (BLAS
gemv beats NumPy's reductions on short rows). Long chains of elementwise passes (gelu,
cross-entropy) walk big arrays in ~1 MB blocks that stay in cache. Causal attention walks
the queries in a few row chunks, so that it skips most of the masked upper triangle.

>>> import numpy as np
>>> from forge_ml.backends import contract
>>> from forge_ml.backends.cpu import reference
>>> contract.missing(reference)
[]
>>> reference.logsumexp(np.zeros((2, 2)), True, 0).round(4).tolist()
[0.0, 0.6931]
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ... import dtype as _dtype
from ... import rng
from ...errors import DTypeError, ShapeError

BF16_MESSAGE = ("bfloat16 is a GPU storage type; the cpu backend computes in float32/float64 (use a "
                "GPU, --device cuda, or leave bf16 out)")

# Multi-pass elementwise kernels (gelu, cross-entropy) walk big arrays in blocks of this many
# elements (1 MB of float32), so that pass after pass reads from cache, not memory.
_BLOCK_ELEMS = 1 << 18


def _np_dtype(dtype_name) -> np.dtype:
    """The NumPy dtype for a forge-ml dtype name; bfloat16 is refused."""
    name = _dtype.get(dtype_name).name
    if name == "bfloat16":
        raise DTypeError(BF16_MESSAGE)
    return np.dtype(name)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

def zeros(shape, dtype_name):
    """A new zero-filled array."""
    return np.zeros(shape, dtype=_np_dtype(dtype_name))


def from_host(np_array, dtype_name):
    """A C-contiguous copy of a NumPy array, cast to ``dtype_name``."""
    return np.array(np_array, dtype=_np_dtype(dtype_name), order="C", copy=True)


def to_host(array) -> np.ndarray:
    """A host copy (on the CPU, just a copy)."""
    return np.array(array, order="C", copy=True)


def cast(array, dtype_name):
    """A new array of ``dtype_name``."""
    return array.astype(_np_dtype(dtype_name), order="C", copy=True)


def copy(array):
    """A new C-contiguous array with the same contents."""
    return np.array(array, order="C", copy=True)


def assign(dst, values):
    """dst[...] = values (a NumPy array), in place."""
    dst[...] = values


def synchronize():
    """Nothing to wait for: every CPU kernel has finished when it returns."""


def pinned_empty(shape, dtype):
    """A host array (the GPU backend's is page-locked)."""
    return np.empty(shape, dtype)


def to_host_async(array, out):
    """Copy ``array`` into ``out`` now; returns None (nothing is in flight on the CPU)."""
    np.copyto(out, array.reshape(out.shape))


def from_host_async(dst, src):
    """Copy ``src`` into ``dst`` now (every earlier kernel has finished on the CPU)."""
    np.copyto(dst, src.reshape(dst.shape))


# ---------------------------------------------------------------------------------------------
# matmul (its backward is matmul again, with trans_a / trans_b)
# ---------------------------------------------------------------------------------------------

def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as its 2-D rows ``(R, x.shape[-1])``; ``reshape(-1, 0)`` cannot infer R for a
    zero-width ``x`` (an op on an (M, 0) gradient raised NumPy's ValueError).

    >>> _rows(np.zeros((2, 3, 0))).shape
    (6, 0)
    """
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def matmul(a, b, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    """``alpha * op(a) @ op(b) + bias``; 2-D x 2-D or batched (equal leading dims).

    ``b_rows`` keeps the first rows of ``b`` as stored (a KV cache filled that far);
    ``bias`` (N,) is added after scaling. Transposes are views: BLAS reads them as they lie.
    """
    if b_rows is not None:
        b = b[..., :b_rows, :]  # (..., b_rows, cols)
    if trans_b:
        b = b.swapaxes(-1, -2)
    if b.ndim == 2 and a.ndim > 2 and not trans_a:
        # (..., M, K) @ (K, N): one GEMM over all rows rather than one per leading index.
        out = np.matmul(_rows(a), b).reshape(*a.shape[:-1], b.shape[-1])
    else:
        out = np.matmul(a.swapaxes(-1, -2) if trans_a else a, b)  # (..., M, N)
    if alpha != 1.0:
        out *= out.dtype.type(alpha)
    if bias is not None:
        out += bias
    return out


# ---------------------------------------------------------------------------------------------
# Sums along an axis. NumPy's own reductions pay a per-row price on short rows (C = 64..768);
# a product with a ones vector is one BLAS gemv, two to four times faster at these shapes.
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype_str: str) -> np.ndarray:
    ones = np.ones(n, dtype=np.dtype(dtype_str))
    ones.flags.writeable = False
    return ones


def _row_sums(x):
    """Sums over the last axis: (..., n) -> (...)."""
    rows = _rows(x)                                           # (R, n)
    return np.matmul(rows, _ones(x.shape[-1], x.dtype.str)).reshape(x.shape[:-1])


def add(a, b):
    """Elementwise sum of two arrays of the same shape."""
    return np.add(a, b)


def sum_rows(x):
    """Sum over every axis but the last: (..., C) -> (C,), the bias gradient."""
    rows = _rows(x)                                           # (R, C)
    return np.matmul(_ones(rows.shape[0], x.dtype.str), rows)


_SUMSQ_ROW = 512


def sumsq(x):
    """Sum of squares as a 0-d array of x's dtype (for global-norm clipping).

    Rows of 512 elements are summed in x's dtype (np.vecdot), the row sums in float64: for
    GPT-2's 38M-element wte this stays within ~1e-10 relative, where one float32 dot product
    over the whole array is off by ~1e-4.
    """
    flat = x.reshape(-1)
    whole = flat.size - flat.size % _SUMSQ_ROW
    rows = flat[:whole].reshape(-1, _SUMSQ_ROW)               # (n // 512, 512)
    tail = flat[whole:].astype(np.float64)
    total = np.vecdot(rows, rows).sum(dtype=np.float64) + np.dot(tail, tail)
    return np.asarray(total, dtype=x.dtype)


# ---------------------------------------------------------------------------------------------
# gelu: GPT-2's tanh approximation (Hendrycks & Gimpel 2016, section 2)
#   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
# Both kernels chain 7-16 ufunc passes; on blocks of a few hundred KB those passes hit
# cache instead of memory (1.6x faster on GPT-2's (1024, 3072) MLP activations).
# ---------------------------------------------------------------------------------------------

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
# exp's argument is clamped here (below log(max float): 88.7 for float32, 709.8 for float64)
_EXP_MAX = {"f": 80.0, "d": 700.0}
# gelu_bwd keeps five arrays live per block: 64 K elements (256 KB each in float32) ran ~1.25x
# faster than 256 K blocks on the nanoGPT MLP's (768, 512) activations.
_GELU_BWD_BLOCK = 1 << 16


def _gelu_block(x, y):
    """y = gelu(x) as x * sigmoid(2u) = x / (1 + exp(-2u)): the same function, since
    0.5 (1 + tanh u) = sigmoid(2u), one pass shorter, and no 1 + tanh cancellation for x < 0."""
    f = x.dtype.type
    with np.errstate(over="ignore", invalid="ignore"):   # x^3 past float's range is inf
        np.multiply(x, x, out=y)       # x^2
        y *= f(-2.0 * _GELU_K * _GELU_C)
        y -= f(2.0 * _GELU_K)
        y *= x                         # -2u
        np.exp(y, out=y)   # exp -> inf far left, where y = x / inf = -0.0 is right (-inf: NaN)
        y += f(1.0)
        np.divide(x, y, out=y)


def _gelu_bwd_block(x, dy, dx, s, e):
    """dx = dy * gelu'(x) in the sigmoid form: with s = sigmoid(2u), E = exp(-2u) and
    1 - s = E s (no cancellation),
        gelu'(x) = s + 2 x s (1 - s) du/dx = s (1 + (1 - s) w),  w = x (2k + 6kc x^2).
    One exp and no tanh (NumPy's float32 tanh costs 1.6x its exp); ``s``, ``e`` are scratch.
    -2u is clamped below exp's overflow; past +-the clamp the limits are taken: gelu' = 0 far
    left, 1 far right (the clamped E times w gave -3863 at x = -1e13, and 0 * inf NaN past
    x = 1.2e13), as the C kernel's."""
    f = x.dtype.type
    lim = f(_EXP_MAX[x.dtype.char])
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(x, x, out=dx)                   # x^2
        np.multiply(dx, f(-2.0 * _GELU_K * _GELU_C), out=e)
        e -= f(2.0 * _GELU_K)
        e *= x                                      # -2u
    far = np.flatnonzero(np.abs(e) >= lim)          # (NaN: not far)
    far_right = e[far] < 0
    np.minimum(e, lim, out=e)
    np.exp(e, out=e)                                # E
    np.add(e, f(1.0), out=s)
    np.reciprocal(s, out=s)                         # s = 1 / (1 + E)
    e *= s                                          # 1 - s
    with np.errstate(over="ignore", invalid="ignore"):   # w past float's range: far right
        dx *= f(6.0 * _GELU_K * _GELU_C)
        dx += f(2.0 * _GELU_K)
        dx *= x                                     # w = 2 x du/dx
        dx *= e
        dx += f(1.0)
        dx *= s
    if far.size:
        dx[far] = far_right
    dx *= dy


def gelu(x):
    """GPT-2 gelu, elementwise."""
    y = np.empty_like(x)
    xs, ys = x.reshape(-1), y.reshape(-1)
    for i in range(0, xs.size, _BLOCK_ELEMS):
        _gelu_block(xs[i:i + _BLOCK_ELEMS], ys[i:i + _BLOCK_ELEMS])
    return y


def gelu_bwd(x, dy):
    """dx = dy * gelu'(x)."""
    dx = np.empty_like(x)
    xs, dys, dxs = x.reshape(-1), dy.reshape(-1), dx.reshape(-1)
    n = xs.size
    s = np.empty(min(n, _GELU_BWD_BLOCK), dtype=x.dtype)
    e = np.empty_like(s)
    for i in range(0, n, _GELU_BWD_BLOCK):
        j = min(i + _GELU_BWD_BLOCK, n)
        _gelu_bwd_block(xs[i:j], dys[i:j], dxs[i:j], s[:j - i], e[:j - i])
    return dx


# ---------------------------------------------------------------------------------------------
# layernorm over the last axis, biased variance (as torch.nn.LayerNorm)
# ---------------------------------------------------------------------------------------------

def _centred(x):
    """``(x - mean, sum of its squares)`` over the last axis, ``(..., C)`` and ``(..., 1)``: the
    corrected two-pass form (Chan, Golub and LeVeque): ``m0`` the plain mean, then the mean of
    ``d = x - m0`` added back, so that m0's rounding error leaves neither the mean nor the
    variance (a constant row is centred to exact zeros: its layernorm is beta). A sum of
    squares that overflows is NaN.

    >>> _centred(np.array([[1.0, 3.0], [3e20, -3e20]], np.float32))[1].ravel().tolist()
    [2.0, nan]
    """
    c = x.shape[-1]
    f = x.dtype.type
    m0 = _row_sums(x)[..., None]                              # (..., 1)
    m0 /= f(c)
    d = np.subtract(x, m0)                                    # (..., C)
    cd = _row_sums(d)[..., None]
    cd /= f(c)
    ss = np.vecdot(d, d)[..., None]                           # (..., 1)
    ss -= f(c) * cd * cd                                      # sum (d - cd)^2
    np.maximum(ss, f(0), out=ss)
    # a sum of squares past the float type's range (rows of |x - mean| past ~1e19 / sqrt(C)
    # in float32) is no variance: NaN, so the row's output is NaN, not beta (1 / sqrt(inf)
    # is 0: every output was beta, in silence), as the C and CUDA kernels' ln rule
    ss[np.isinf(ss)] = np.nan
    m0 += cd                                                  # the mean, rounded once
    np.subtract(x, m0, out=d)                                 # x - mean, rounded once (as the C kernel)
    return d, ss


def _layernorm_stats(x, eps):
    """xhat = (x - mean) * rstd (a new array) and rstd (..., 1); two passes, for accuracy."""
    c = x.shape[-1]
    xhat, var = _centred(x)
    var /= x.dtype.type(c)
    var += x.dtype.type(eps)
    rstd = np.sqrt(var, out=var)
    np.reciprocal(rstd, out=rstd)
    xhat *= rstd
    return xhat, rstd


def layernorm(x, gamma, beta, eps):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta."""
    y, _ = _layernorm_stats(x, eps)
    y *= gamma
    y += beta
    return y


def layernorm_bwd(x, gamma, dy, eps):
    """(dx, dgamma, dbeta); with g = dy * gamma the textbook form is
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).

    Written on xc = x - mean so that every row reduction is a BLAS gemv against gamma, rstd
    or ones, and g and xhat are never formed: with p = dy * xc,
        mean(g) = (dy @ gamma) / C,  mean(g * xhat) = rstd (p @ gamma) / C,
        dgamma = rstd @ p,  dx = rstd (dy * gamma) + xc * a + b  (a, b per row).
    """
    f = x.dtype.type
    c = x.shape[-1]
    xs, dys = _rows(x), _rows(dy)                                # (R, C)
    xc, rstd = _centred(xs)                                      # (R, C) x - mean; (R, 1)
    rstd /= f(c)
    rstd += f(eps)
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    p = np.multiply(dys, xc)                                     # (R, C)
    # the sum over rows of dy * xhat, in float64 as the C kernel's (a float32 sum over
    # thousands of rows drifts past 1e-5)
    dgamma = np.matmul(rstd[:, 0], p, dtype=np.float64).astype(f)
    dbeta = sum_rows(dys)
    a = np.matmul(p, gamma)[:, None]                             # (R, 1) C mean(g xhat) / rstd
    a *= rstd * rstd * rstd
    a /= f(-c)                                                   # a = -rstd^2 mean(g xhat)
    b = np.matmul(dys, gamma)[:, None]                           # (R, 1) C mean(g)
    b *= rstd
    b /= f(-c)                                                   # b = -rstd mean(g)
    xc *= a
    xc += b
    dx = np.multiply(dys, gamma)
    dx *= rstd
    dx += xc
    return dx.reshape(x.shape), dgamma, dbeta


def layernorm_bwd_add(x, gamma, dy, eps, add):
    """``layernorm_bwd`` with ``add`` added to dx (``add + dx``, as the tape's accumulation)."""
    dx, dgamma, dbeta = layernorm_bwd(x, gamma, dy, eps)
    return np.add(add, dx), dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# softmax over the last axis, optionally causal
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _causal_mask(rows: int, cols: int, off: int) -> np.ndarray:
    """(rows, cols) bool, True where column j is masked for row i: j > i + off. Read-only."""
    mask = np.triu(np.ones((rows, cols), dtype=bool), k=off + 1)
    mask.flags.writeable = False
    return mask


def softmax(x, causal, off):
    """Softmax over the last axis; causal masks column j of row i when j > i + off."""
    if causal:
        mask = _causal_mask(x.shape[-2], x.shape[-1], int(off))
        y = np.where(mask, x.dtype.type(-np.inf), x)  # exp(-inf) gives exact zeros
        y -= y.max(axis=-1, keepdims=True)
    else:
        y = np.subtract(x, x.max(axis=-1, keepdims=True))
    np.exp(y, out=y)
    s = _row_sums(y)[..., None]                        # (..., 1)
    y *= np.reciprocal(s, out=s)
    return y


def softmax_bwd(y, dy):
    """dx = y * (dy - sum(y * dy)) along the last axis."""
    s = np.vecdot(y, dy)[..., None]                    # (..., 1)
    dx = np.subtract(dy, s)
    dx *= y
    return dx


def logsumexp(x, causal, off):
    """log(sum(exp(x))) over the last axis, masked as ``softmax``: (..., n) -> (...), in x's
    dtype.

    The row max m is taken out first, log(sum(exp(x - m))) + m, so that scores in the
    hundreds neither overflow nor lose the small terms. A row whose max is not finite (all
    masked, or holding an inf or a NaN) shifts by 0 instead: the sum then gives the exact
    answer, -inf, inf or NaN.
    """
    f = x.dtype.type
    if x.shape[-1] == 0:
        return np.full(x.shape[:-1], f(-np.inf))
    if causal:
        z = np.where(_causal_mask(x.shape[-2], x.shape[-1], int(off)), f(-np.inf), x)
    else:
        z = x
    m = z.max(axis=-1, keepdims=True)                  # (..., 1)
    m[~np.isfinite(m)] = f(0.0)
    e = np.subtract(z, m, out=z if causal else None)   # z is a copy when causal: reuse it
    np.exp(e, out=e)                                   # masked entries: exp(-inf) = 0
    out = _row_sums(e)                                 # (...)
    with np.errstate(divide="ignore"):                 # log(0) = -inf for an all-masked row
        np.log(out, out=out)
    out += m[..., 0]
    return out


# ---------------------------------------------------------------------------------------------
# heads: (..., T, 3C) <-> 3 x (..., H, T, hs), and (..., H, T, hs) <-> (..., T, C)
# ---------------------------------------------------------------------------------------------

# The three permutations below copy with np.array (always a copy), not np.ascontiguousarray:
# with one head or one position the permuted view is contiguous already, and the output would
# be the input's memory, which a write into it (kv_append, assign) changed unseen.

def split_heads(qkv, n_head):
    """(..., T, 3C) -> q, k, v, each a contiguous (..., H, T, hs) of its own."""
    *lead, t, c3 = qkv.shape
    hs = c3 // (3 * n_head)
    x = qkv.reshape(*lead, t, 3, n_head, hs)  # (..., T, 3, H, hs)
    return tuple(np.array(x[..., which, :, :].swapaxes(-3, -2), order="C")  # (..., H, T, hs)
                 for which in range(3))


def unsplit_head(dy, which):
    """(..., H, T, hs) -> (..., T, 3C), zero outside the ``which`` third (0=q, 1=k, 2=v)."""
    *lead, h, t, hs = dy.shape
    out = np.zeros((*lead, t, 3 * h * hs), dtype=dy.dtype)
    out.reshape(*lead, t, 3, h, hs)[..., which, :, :] = dy.swapaxes(-3, -2)  # (..., T, H, hs)
    return out


def merge_heads(x):
    """(..., H, T, hs) -> (..., T, H*hs)."""
    *lead, h, t, hs = x.shape
    return np.array(x.swapaxes(-3, -2), order="C").reshape(*lead, t, h * hs)


def unmerge_heads(dy, h):
    """(..., T, C) -> (..., H, T, hs)."""
    *lead, t, c = dy.shape
    return np.array(dy.reshape(*lead, t, h, c // h).swapaxes(-3, -2), order="C")


# ---------------------------------------------------------------------------------------------
# attention: causal softmax(q k^T * scale) v, keeping only the log-sum-exp per query row.
# Queries are taken in row chunks; chunk [r0, r1) sees keys [0, r1) only (the rest is masked),
# which skips most of the masked triangle. The backward is FlashAttention's (Dao et al. 2022,
# alg. 4): P = exp(S - lse), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D).
# The chunk's products multiply the masked entries by their zero, exact only while what they
# read is finite (0 * inf or NaN is NaN): the rows that come out non-finite are computed again
# from their unmasked entries alone, so a non-finite value at a masked position reaches no row.
# ---------------------------------------------------------------------------------------------

_ATTN_CHUNK_ROWS = 256  # short sequences run as one chunk


def _attention_chunks(t):
    """Row ranges [r0, r1) covering 0..t: one when t is short, else at most 8."""
    if t <= _ATTN_CHUNK_ROWS:
        return [(0, t)]
    step = max(_ATTN_CHUNK_ROWS // 2, -(-t // 8))
    return [(r0, min(r0 + step, t)) for r0 in range(0, t, step)]


@functools.lru_cache(maxsize=32)
def _causal_bias(rows: int, cols: int, off: int, dtype_str: str) -> np.ndarray:
    """(rows, cols): -inf where _causal_mask is True, else 0. Read-only. Adding it masks the
    scores in one plain pass (a masked np.copyto costs 1.3x that)."""
    f = np.dtype(dtype_str).type
    bias = np.where(_causal_mask(rows, cols, off), f(-np.inf), f(0.0))
    bias.flags.writeable = False
    return bias


def _attention_scores(q, k, scale, r0, r1):
    """Scaled causal scores of query rows [r0, r1) against keys [0, r1): (..., r1-r0, r1)."""
    s = np.matmul(q[..., r0:r1, :] * q.dtype.type(scale), k[..., :r1, :].swapaxes(-1, -2))
    s += _causal_bias(r1 - r0, r1, r0, q.dtype.str)
    return s


def _attention_rows(q, k, v, scale, r0, r1, out, lse):
    """Writes out[..., r0:r1, :] and lse[..., r0:r1]: query rows [r0, r1) over keys [0, r1)."""
    s = _attention_scores(q, k, scale, r0, r1)   # (..., H, r, r1)
    m = s.max(axis=-1, keepdims=True)            # (..., H, r, 1)
    s -= m
    np.exp(s, out=s)
    l = _row_sums(s)[..., None]                  # (..., H, r, 1)
    o = np.matmul(s, v[..., :r1, :])             # (..., H, r, hs), not yet normalized
    np.multiply(o, np.reciprocal(l), out=out[..., r0:r1, :])
    np.log(l, out=l)
    l += m
    lse[..., r0:r1] = l[..., 0]


def attention(q, k, v, scale):
    """Causal self-attention of (..., H, T, hs): (out (..., H, T, hs), lse (..., H, T))."""
    t = q.shape[-2]
    out = np.empty_like(q)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)  # (..., H, T)
    for r0, r1 in _attention_chunks(t):
        _attention_rows(q, k, v, scale, r0, r1, out, lse)
    for i in _nonfinite_rows(out):               # row i alone: keys [0, i], none masked
        _attention_rows(q, k, v, scale, i, i + 1, out, lse)
    return out, lse


def _nonfinite_rows(x):
    """The rows i of x (..., T, hs) that are not finite in some head (intp)."""
    return np.flatnonzero(~np.isfinite(x).all(axis=tuple(range(x.ndim - 2)) + (-1,)))


def _attention_bwd_rows(q, k, v, lse, dout, d, scale, r0, r1, dq):
    """P and dS = P (dP - D), unscaled, of query rows [r0, r1) over keys [0, r1), each
    (..., H, r, r1); writes dq[..., r0:r1, :] = scale dS k."""
    p = _attention_scores(q, k, scale, r0, r1)         # (..., H, r, r1)
    p -= lse[..., r0:r1, None]
    np.exp(p, out=p)                                   # P; masked entries exp(-inf) = 0
    ds = np.matmul(dout[..., r0:r1, :], v[..., :r1, :].swapaxes(-1, -2))  # dP (..., H, r, r1)
    ds -= d[..., r0:r1, :]
    ds *= p                                            # dS = P (dP - D), unscaled
    dq_rows = dq[..., r0:r1, :]
    np.matmul(ds, k[..., :r1, :], out=dq_rows)
    dq_rows *= q.dtype.type(scale)                     # scale the (r, hs) side, not (r, r1)
    return p, ds


def attention_bwd(q, k, v, out, lse, dout, scale):
    """(dq, dk, dv) of causal attention, recomputing the probabilities from ``lse``."""
    t = q.shape[-2]
    f = q.dtype.type
    chunks = _attention_chunks(t)
    one = len(chunks) == 1                                 # then dk, dv are written, not summed
    dq = np.empty_like(q)
    dk = np.empty_like(k) if one else np.zeros_like(k)
    dv = np.empty_like(v) if one else np.zeros_like(v)
    d = np.vecdot(dout, out)[..., None]                    # (..., H, T, 1) = rowsum(dO * O)
    for r0, r1 in chunks:
        p, ds = _attention_bwd_rows(q, k, v, lse, dout, d, scale, r0, r1, dq)
        do = dout[..., r0:r1, :]                           # (..., H, r, hs)
        q_scaled = q[..., r0:r1, :] * f(scale)
        if one:
            np.matmul(p.swapaxes(-1, -2), do, out=dv)
            np.matmul(ds.swapaxes(-1, -2), q_scaled, out=dk)
        else:
            dv[..., :r1, :] += np.matmul(p.swapaxes(-1, -2), do)
            dk[..., :r1, :] += np.matmul(ds.swapaxes(-1, -2), q_scaled)
    for i in _nonfinite_rows(dq):        # row i of P and dS over keys [0, i], none masked
        _attention_bwd_rows(q, k, v, lse, dout, d, scale, i, i + 1, dq)
    for j in np.union1d(_nonfinite_rows(dk), _nonfinite_rows(dv)):
        q_scaled = q[..., j:, :] * f(scale)                              # column j: queries [j, T)
        p = np.matmul(q_scaled, k[..., j:j + 1, :].swapaxes(-1, -2))
        np.exp(p - lse[..., j:, None], out=p)                            # (..., H, T-j, 1)
        np.matmul(p.swapaxes(-1, -2), dout[..., j:, :], out=dv[..., j:j + 1, :])
        ds = (np.matmul(dout[..., j:, :], v[..., j:j + 1, :].swapaxes(-1, -2)) - d[..., j:, :]) * p
        np.matmul(ds.swapaxes(-1, -2), q_scaled, out=dk[..., j:j + 1, :])
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# embedding and its backward (scatter_add_rows), kv_append
# ---------------------------------------------------------------------------------------------

def embedding(ids, wte, wpe, pos):
    """wte[ids] + wpe[pos + t]: (..., T) ids -> (..., T, C).

    ``pos`` is an int, or an int32 array (a decoding step's device-side position) of one
    element, shared by every row of ids, or of one element per row (rows decoding at
    different positions: continuous batching), row b taking wpe[pos[b] + t]. A row whose
    positions run past the table is NaN, as on the GPU; the other rows are unaffected.
    """
    t, c = ids.shape[-1], wte.shape[-1]
    out = np.take(wte, ids, axis=0)                                 # (..., T, C)
    if not isinstance(pos, np.ndarray):
        out += wpe[pos:pos + t]
        return out
    starts = pos.reshape(-1).astype(np.intp)                        # (1,) or (R,)
    ok = (starts >= 0) & (starts + t <= wpe.shape[0])
    if starts.size == 1:
        if ok[0]:
            out += wpe[starts[0]:starts[0] + t]
        else:
            out[...] = np.nan
        return out
    n_rows = out.size // max(t * c, 1)
    if starts.size != n_rows:
        raise ShapeError(f"embedding: pos has {starts.size} positions but ids {ids.shape} has "
                         f"{n_rows} rows; give one position, or one per row")
    rows = out.reshape(n_rows, t, c)                                # (R, T, C) view
    rows += wpe[np.where(ok, starts, 0)[:, None] + np.arange(t)]    # wpe rows (R, T) -> (R, T, C)
    rows[~ok] = np.nan
    return out


def scatter_add_rows(dst, ids, src):
    """dst[ids[i]] += src[i] in place, repeated ids adding up (np.add.at semantics).

    Sorting groups equal ids. Ids seen once take one fancy-index add (their rows are
    distinct); the rows of each repeated id are summed first with np.add.reduceat, so every
    row of ``dst`` is written once. (np.add.at does the same job one row at a time.)
    """
    flat_ids = ids.reshape(-1)                                      # (N,)
    if flat_ids.size == 0:
        return
    rows = _rows(src)                                               # (N, C)
    order = np.argsort(flat_ids, kind="stable")
    sorted_ids = flat_ids[order]
    bounds = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1], True])  # (U+1,)
    starts, lengths = bounds[:-1], np.diff(bounds)                  # (U,) each
    once = lengths == 1
    dst[sorted_ids[starts[once]]] += rows[order[starts[once]]]
    if once.all():
        return
    many = ~once
    group_rows = order[np.repeat(many, lengths)]                    # rows of repeated ids, grouped
    group_starts = np.cumsum(lengths[many]) - lengths[many]
    dst[sorted_ids[starts[many]]] += np.add.reduceat(rows[group_rows], group_starts, axis=0)


def kv_append(cache, new, pos):
    """cache[..., pos:pos+Tn, :] = new, in place."""
    cache[..., pos:pos + new.shape[-2], :] = new


# ---------------------------------------------------------------------------------------------
# dropout: the mask is regenerated from (seed, element index), so backward is dropout again
# ---------------------------------------------------------------------------------------------

def dropout(x, p, seed):
    """Inverted dropout with the Philox keep-mask of ``forge_ml.rng``; p == 0 copies."""
    if p == 0:
        return np.array(x, copy=True)
    keep = rng.dropout_keep(seed, x.size, p).reshape(x.shape)
    y = np.zeros_like(x)
    np.multiply(x, x.dtype.type(rng.dropout_scale(p)), out=y, where=keep)
    return y


# ---------------------------------------------------------------------------------------------
# cross-entropy over the first V columns (the padded vocab columns are ignored).
# GPT-2's (N, V) logits are 200 MB: rows go in blocks of about _BLOCK_ELEMS elements, so that
# the exp pass reads what the max/subtract pass left in cache (2-3x faster at V = 50257 than
# whole-array passes). A short vocabulary's rows fit in one block.
# ---------------------------------------------------------------------------------------------

def _row_blocks(n_rows, row_len):
    """[r0, r1) row ranges of about _BLOCK_ELEMS elements each (at least one row)."""
    step = max(1, _BLOCK_ELEMS // max(row_len, 1))
    return [(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]


def _shifted_exp(logits, vocab_size, out):
    """exp(l - rowmax) over l = logits[:, :V], written into ``out``, and the row max (n, 1)."""
    l = logits[:, :vocab_size]            # (n, V)
    m = l.max(axis=1, keepdims=True)      # (n, 1)
    e = np.subtract(l, m, out=out)
    np.exp(e, out=e)
    return e, m


def cross_entropy(logits, targets, vocab_size):
    """Mean over rows of logsumexp(l[:V]) - l[target], a 0-d array of the logits' dtype."""
    n, vp = logits.shape
    v = vp if vocab_size is None else vocab_size
    log_sums = np.empty(n, dtype=logits.dtype)     # log sum exp(l - m), per row
    row_max = np.empty(n, dtype=logits.dtype)
    blocks = _row_blocks(n, v)
    scratch = np.empty((blocks[0][1] - blocks[0][0], v), dtype=logits.dtype)
    for r0, r1 in blocks:
        e, m = _shifted_exp(logits[r0:r1], v, out=scratch[:r1 - r0])
        np.log(_row_sums(e), out=log_sums[r0:r1])
        row_max[r0:r1] = m[:, 0]
    # log(sum exp(l - m)) - (l[t] - m): the max cancels before it can cost precision
    log_sums -= logits[np.arange(n), targets] - row_max
    loss = np.sum(log_sums, dtype=np.float64) / n
    return np.asarray(loss, dtype=logits.dtype)


def cross_entropy_bwd(logits, targets, dloss, vocab_size):
    """dlogits = dloss * (softmax(l[:V]) - onehot(target)) / N, zero in columns >= V."""
    n, vp = logits.shape
    v = vp if vocab_size is None else vocab_size
    scale = logits.dtype.type(float(dloss) / n)
    dl = np.empty_like(logits)
    for r0, r1 in _row_blocks(n, v):
        e, _ = _shifted_exp(logits[r0:r1], v, out=dl[r0:r1, :v])  # (rows, V) view of dl
        row_scale = _row_sums(e)[:, None]                            # (rows, 1)
        np.divide(scale, row_scale, out=row_scale)
        e *= row_scale
    dl[:, v:] = 0
    dl[np.arange(n), targets] -= scale
    return dl


# ---------------------------------------------------------------------------------------------
# AdamW (Loshchilov & Hutter 2019, algorithm 2), with torch.optim.AdamW's conventions:
#   p *= 1 - lr wd;  m, v updated;  p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
# ---------------------------------------------------------------------------------------------

def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                 p_lowp=None):
    """One AdamW step on p, m, v in place; g is multiplied by grad_scale first."""
    if p_lowp is not None:
        raise DTypeError(f"adamw_update: p_lowp is a bfloat16 copy for the GPU; "
                         f"the cpu backend has none (got {p_lowp.dtype})")
    f = p.dtype.type
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    scratch = np.empty_like(p)                     # (np.multiply of a 0-d array is a scalar)
    np.multiply(g, f((1.0 - beta1) * grad_scale), out=scratch, dtype=p.dtype)
    m *= f(beta1)
    m += scratch                                   # m = b1 m + (1 - b1) g'
    np.multiply(g, g, out=scratch, dtype=p.dtype)
    scratch *= f((1.0 - beta2) * grad_scale * grad_scale)
    v *= f(beta2)
    v += scratch                                   # v = b2 v + (1 - b2) g'^2
    if lr == 0.0:                                  # e.g. step 0 of a warmup: p stays put
        return
    # lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) = m / (sqrt(v) * a + b), folding lr/bc1 in
    np.sqrt(v, out=scratch)
    scratch *= f(bc1 / (lr * math.sqrt(bc2)))
    scratch += f(eps * bc1 / lr)
    np.divide(m, scratch, out=scratch)
    if weight_decay != 0.0:
        p *= f(1.0 - lr * weight_decay)
    p -= scratch


# ---------------------------------------------------------------------------------------------
# decode_attention: one decoding step over a KV cache (inference only)
# ---------------------------------------------------------------------------------------------

def decode_attention(qkv, k_cache, v_cache, pos, n_head, scale):
    """Write the new keys and values at row ``pos`` of the caches ``(B, H, Tmax, hs)``, then
    return ``y (B, C)``: each head's ``softmax(scale * q k^T) v`` over rows ``0..pos``.

    ``pos``: an int, or an int32 array of one element (shared by every row) or of B elements
    (row b at its own position pos[b]: continuous batching). A row whose position is outside
    ``0..Tmax-1`` writes nothing and its y is NaN (as on the GPU, where the kernel reads the
    position); the other rows are unaffected.
    """
    B, H, tmax, hs = k_cache.shape
    if isinstance(pos, np.ndarray):
        if pos.size != 1:
            return _decode_attention_rows(qkv, k_cache, v_cache, pos, scale)
        pos = int(pos.reshape(-1)[0])
    if not 0 <= pos < tmax:
        return np.full((B, H * hs), np.nan, qkv.dtype)
    q, k, v = (qkv.reshape(B, 3, H, hs)[:, i] for i in range(3))   # (B, H, hs) each
    k_cache[:, :, pos] = k
    v_cache[:, :, pos] = v
    keys, values = k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1]  # (B, H, n, hs)
    s = np.matmul(keys, q[..., None])[..., 0]                        # (B, H, n)
    s *= s.dtype.type(scale)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    y = np.matmul(s[:, :, None, :], values)[:, :, 0]                 # (B, H, hs)
    return y.reshape(B, H * hs)


def _decode_attention_rows(qkv, k_cache, v_cache, pos, scale):
    """decode_attention with row b at position pos[b]: keys past a row's own position are
    masked out of its scores (exp(-inf) = 0), so every row runs in one batched product over
    the longest row's keys; a row that comes out non-finite is computed again over its own
    keys alone (0 * a stale NaN or inf value past its position is NaN)."""
    B, H, tmax, hs = k_cache.shape
    if pos.size != B:
        raise ShapeError(f"decode_attention: pos has {pos.size} positions but qkv has {B} rows; "
                         "give one position, or one per row")
    at = pos.reshape(-1).astype(np.intp)                             # (B,)
    ok = (at >= 0) & (at < tmax)
    y = np.full((B, H * hs), np.nan, qkv.dtype)
    if not ok.any():
        return y
    rows = np.flatnonzero(ok)                                        # (R,)
    at = at[rows]
    q, k, v = (qkv.reshape(B, 3, H, hs)[rows, i] for i in range(3))  # (R, H, hs) each
    k_cache[rows, :, at] = k
    v_cache[rows, :, at] = v
    n = int(at.max()) + 1
    sel = slice(None) if rows.size == B else rows                    # views when every row is in
    keys, values = k_cache[sel, :, :n], v_cache[sel, :, :n]          # (R, H, n, hs)
    s = np.matmul(keys, q[..., None])[..., 0]                        # (R, H, n)
    s *= s.dtype.type(scale)
    np.copyto(s, s.dtype.type(-np.inf), where=np.arange(n) > at[:, None, None])
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    yr = np.matmul(s[:, :, None, :], values)[:, :, 0]               # (R, H, hs)
    for r in np.flatnonzero(~np.isfinite(yr).all(axis=(1, 2)) & (at < n - 1)):
        yr[r] = np.matmul(s[r, :, None, :at[r] + 1], values[r, :, :at[r] + 1])[:, 0]
    y[rows] = yr.reshape(-1, H * hs)
    return y


# ---------------------------------------------------------------------------------------------
# attention on GPT-2's fused qkv rows (attention_qkv itself is compose's: split, attend, merge)
# ---------------------------------------------------------------------------------------------

def attention_qkv_bwd(qkv, y, lse, dy, n_head, scale):
    """``dqkv (B, T, 3C)`` of attention from fused rows: attention_bwd on the split heads,
    the three gradients merged straight into their thirds of dqkv."""
    q, k, v = split_heads(qkv, n_head)
    grads = attention_bwd(q, k, v, unmerge_heads(y, n_head), lse, unmerge_heads(dy, n_head), scale)
    C = qkv.shape[-1] // 3
    dqkv = np.empty_like(qkv)
    for i, g in enumerate(grads):
        dqkv[..., i * C:(i + 1) * C] = merge_heads(g)
    return dqkv


def greedy_next(logits, vocab_size, ids, pos, out=None):
    """In place: ``ids[b] = argmax(logits[b, :vocab_size])`` (and ``out[b]`` too, when
    given: -1 there for a row whose largest logit, a NaN first, is not finite), then ``pos +=
    1``: the shared position, or each row's (pos of B elements)."""
    rows = logits[:, :vocab_size]
    choice = np.argmax(rows, axis=1)
    if out is not None:
        lost = ~np.isfinite(rows[np.arange(rows.shape[0]), choice])
        out.reshape(-1)[...] = np.where(lost, -1, choice)
    ids.reshape(-1)[...] = choice
    pos += 1

