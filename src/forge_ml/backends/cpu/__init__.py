"""The CPU backend: the module the registry (``backends/__init__.py``) loads for ``cpu``.

The rooms: ``reference.py`` holds NumPy kernels for the core ops and some fused ones (the
reference, and the fallback; the product ops are defined here over ``gemm.c`` and fall back
to ``compose.py``'s composed forms, as the ops with no kernel of their own do); the C files hold fused float32 loops, 1.3x to 4x faster than
chains of ufuncs on the nanoGPT CPU model's shapes, sharing one thread pool (``pool.c``):
the matrix products with their bias, residual and GELU (``gemm.c``), attention forward and
backward, also on GPT-2's fused qkv rows (``attention.c``), and gelu, layernorm,
cross-entropy, scatter_add_rows, AdamW, sumsq and dropout (``kernels.c``); ``native.py``
builds, caches and loads them as one library. This module decides, op by op, which one
runs: the C kernel when the library is loaded (``FORGE_CPU_KERNELS``: auto, numpy, c) and
every array it reads is a non-empty C-contiguous float32 array; otherwise, or when the kernel
declines (its scratch allocation failed, an argument it does not take), the reference. That
decision is ``_fused``, written once; every other core op is the reference's own function.

Capabilities: no bfloat16, no graphs, arrays in host memory. ``start()`` is the start-up step
the registry runs once at load (glibc malloc tuning, ``FORGE_CPU_MALLOC``).

>>> import numpy as np
>>> from forge_ml.backends import cpu
>>> cpu.softmax(np.zeros((2, 2), np.float32), True, 0).tolist()
[[1.0, 0.0], [0.5, 0.5]]
>>> cpu.gelu.reference is cpu.reference.gelu
True
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import math
import sys
import weakref

import numpy as np

from ... import flags
from ... import rng as _rng
from .. import compose as _compose
from . import native as _native
from . import reference
from .native import optr as _optr
from .native import ptr as _ptr
from .reference import (add, assign, cast, copy, decode_attention, embedding, from_host,
                        from_host_async, greedy_next, kv_append, logsumexp, merge_heads,
                        pinned_empty, softmax, softmax_bwd, split_heads, sum_rows, synchronize,
                        to_host, to_host_async, unmerge_heads, unsplit_head, zeros)

NAME = "cpu"
BF16 = False        # bfloat16 is a GPU storage type; here float32 and float64
GRAPHS = False      # nothing to capture: every kernel runs when it is called
HOST_MEMORY = True  # arrays are NumPy arrays: reading one costs no device wait

__all__ = ["NAME", "BF16", "GRAPHS", "HOST_MEMORY", "start", "reference",
           # memory
           "zeros", "from_host", "to_host", "cast", "copy", "assign", "synchronize",
           "pinned_empty", "to_host_async", "from_host_async",
           # core kernels
           "matmul", "add", "sum_rows", "sumsq", "gelu", "gelu_bwd", "layernorm",
           "layernorm_bwd", "softmax", "softmax_bwd", "logsumexp", "split_heads",
           "unsplit_head", "merge_heads", "unmerge_heads", "embedding", "scatter_add_rows",
           "kv_append", "dropout", "cross_entropy", "cross_entropy_bwd", "adamw_update",
           # fused kernels
           "attention", "attention_bwd", "attention_qkv", "attention_qkv_bwd",
           "attention_qkv_bwd_sums", "attention_qkv_dropout", "attention_qkv_dropout_bwd",
           "linear", "matmul_gelu", "matmul_dgelu", "weight_grads", "layernorm_bwd_add",
           "layernorm_bwd_sums", "decode_attention", "greedy_next",
           "linear_cross_entropy", "scale",
           # optional: the optimizer's step in one call; what decides the arithmetic
           "adamw_update_many", "sumsq_many", "numerics"]


# ---------------------------------------------------------------------------------------------
# start-up: glibc malloc tuning
# ---------------------------------------------------------------------------------------------

# glibc's malloc serves blocks above its mmap threshold (128 KB to start) with fresh mmaps and
# returns a freed heap top to the OS, so every new activation array (0.4-1.5 MB at nanoGPT
# sizes) came back as zero-filled pages: ~11,000 page faults and ~45 ms of system time per
# training step of the nanoGPT CPU model. Keeping blocks up to 32 MB (glibc's cap) on the heap
# and trimming only past 256 MB of free top lets freed activations be reused without a fault.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def start() -> None:
    """The backend's start-up step, run once by the registry when it loads ``cpu``: with
    ``FORGE_CPU_MALLOC=tuned`` (the default), raise glibc's malloc thresholds (above) so that
    freed activation arrays are reused instead of returned to the OS and faulted in again.
    Process-wide, Linux and glibc only (elsewhere, and with ``=default``, nothing happens);
    running it twice is harmless."""
    if flags.get("FORGE_CPU_MALLOC") != "tuned" or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def numerics() -> dict:
    """What decides this backend's arithmetic besides an op's inputs: the kernels that run (the
    C kernels, or NumPy's where they do not build or FORGE_CPU_KERNELS=numpy), how float32
    products are shared out (FORGE_CPU_GEMM) and by which kernel (``gemm``: gemm.c's own
    AVX-512 tiles, which the library has where the CPU has AVX-512, or OpenBLAS's), and who
    sums the bias gradients (FORGE_BIAS_SUMS). Training checkpoints record it.

    >>> sorted(numerics())
    ['FORGE_BIAS_SUMS', 'FORGE_CPU_GEMM', 'cpu_kernels', 'gemm', 'numpy']
    """
    return {"cpu_kernels": "c" if _native.lib() is not None else "numpy",
            "numpy": np.__version__,   # its OpenBLAS runs the float32 products
            "FORGE_CPU_GEMM": flags.get("FORGE_CPU_GEMM"),
            "gemm": "forge-avx512" if _native.own_product() else "openblas",
            "FORGE_BIAS_SUMS": flags.get("FORGE_BIAS_SUMS")}   # C kernels sum in double


# ---------------------------------------------------------------------------------------------
# native or reference: the one place that decides
# ---------------------------------------------------------------------------------------------

_DECLINED = object()
"""What a C call returns when its kernel reports a failure (scratch allocation): the reference
runs instead."""


def _fused(reference_fn, *arrays):
    """Decorator: the op runs the decorated C call ``c_call(lib, *args)`` when the C library is
    loaded and each argument named in ``arrays`` is a non-empty C-contiguous float32 array;
    otherwise, or when the call returns ``_DECLINED``, ``reference_fn(*args)``. The op takes
    ``reference_fn``'s arguments and documentation (and keeps it as ``op.reference``)."""
    params = list(inspect.signature(reference_fn).parameters)
    where = [(params.index(name), name) for name in arrays]   # positional index, keyword

    def decorate(c_call):
        @functools.wraps(reference_fn)
        def op(*args, **kwargs):
            lib = _native.lib()
            if lib is not None:
                given = [args[i] if i < len(args) else kwargs[name] for i, name in where]
                if _native.f32(*given) and all(a.size for a in given):
                    out = c_call(lib, *args, **kwargs)
                    if out is not _DECLINED:
                        return out
            return reference_fn(*args, **kwargs)

        op.__name__ = op.__qualname__ = c_call.__name__
        op.__module__ = __name__
        op.reference = reference_fn
        return op

    return decorate


def _ok(status, result):
    """A C kernel's status: 0, its result; else _DECLINED."""
    return result if status == 0 else _DECLINED


# ---------------------------------------------------------------------------------------------
# ops with a C kernel (kernels.c; each computes what the reference of the same name does)
# ---------------------------------------------------------------------------------------------

@_fused(reference.sumsq, "x")
def sumsq(lib, x):
    return np.asarray(lib.sumsq_f32(_ptr(x), x.size), dtype=x.dtype)


@_fused(reference.dropout, "x")
def dropout(lib, x, p, seed):
    if p == 0:
        return reference.dropout(x, p, seed)           # a copy
    y = np.empty_like(x)
    pf, scale, k0, k1 = _drop_args(p, seed)
    lib.dropout_f32(_ptr(x), _ptr(y), x.size, k0, k1, pf, scale)
    return y


@_fused(reference.gelu, "x")
def gelu(lib, x):
    y = np.empty_like(x)
    lib.gelu_f32(_ptr(x), _ptr(y), x.size)
    return y


@_fused(reference.gelu_bwd, "x", "dy")
def gelu_bwd(lib, x, dy):
    dx = np.empty_like(x)
    lib.gelu_bwd_f32(_ptr(x), _ptr(dy), _ptr(dx), x.size)
    return dx


@_fused(reference.layernorm, "x", "gamma", "beta")
def layernorm(lib, x, gamma, beta, eps):
    y, c = np.empty_like(x), x.shape[-1]
    lib.layernorm_f32(_ptr(x), _ptr(gamma), _ptr(beta), _ptr(y),
                      x.size // c, c, eps)
    return y


@_fused(reference.layernorm_bwd, "x", "gamma", "dy")
def layernorm_bwd(lib, x, gamma, dy, eps):
    return _layernorm_bwd(lib, x, gamma, dy, eps, None)


@_fused(reference.layernorm_bwd_add, "x", "gamma", "dy", "add")
def layernorm_bwd_add(lib, x, gamma, dy, eps, add):
    return _layernorm_bwd(lib, x, gamma, dy, eps, add)


def _layernorm_bwd(lib, x, gamma, dy, eps, add, sums=False):
    """The C kernel, ``add`` (or None) added to dx in its last pass over each row; with
    ``sums``, dx's column sums too (summed as dgamma and dbeta are, in the same pass)."""
    c = x.shape[-1]
    dx, dgamma, dbeta = np.empty_like(x), np.empty(c, np.float32), np.empty(c, np.float32)
    s = np.empty(c, np.float32) if sums else None
    return _ok(lib.layernorm_bwd_f32(_ptr(x), _ptr(gamma), _ptr(dy),
                                     _optr(add), _ptr(dx),
                                     _ptr(dgamma), _ptr(dbeta), _optr(s),
                                     x.size // c, c, eps),
               (dx, dgamma, dbeta) + ((s,) if sums else ()))


def _layernorm_bwd_sums_composed(x, gamma, dy, eps, add=None):
    """``(dx, dgamma, dbeta, sum_rows(dx))``, dx with ``add`` added where it is not None:
    ``layernorm_bwd(_add)``, then ``sum_rows`` (``compose.layernorm_bwd_sums``)."""
    return _compose.layernorm_bwd_sums(sys.modules[__name__], x, gamma, dy, eps, add)


@_fused(_layernorm_bwd_sums_composed, "x", "gamma", "dy")
def layernorm_bwd_sums(lib, x, gamma, dy, eps, add=None):
    # the C kernel adds each dx row into its block's column sums while the row is in cache (a
    # separate sum_rows read dx again: ~40 us a call at nanoGPT's CPU size, 8 a step)
    if add is not None and not (_native.f32(add) and add.size):
        return _DECLINED
    return _layernorm_bwd(lib, x, gamma, dy, eps, add, sums=True)


@_fused(reference.attention, "q", "k", "v")
def attention(lib, q, k, v, scale):
    t, hs = q.shape[-2:]
    out, lse = np.empty_like(q), np.empty(q.shape[:-1], np.float32)  # (..., H, T, hs), (..., H, T)
    return _ok(lib.attention_f32(_ptr(q), _ptr(k), _ptr(v), _ptr(out),
                                 _ptr(lse), q.size // (t * hs), t, hs, scale), (out, lse))


@_fused(reference.attention_bwd, "q", "k", "v", "out", "lse", "dout")
def attention_bwd(lib, q, k, v, out, lse, dout, scale):
    t, hs = q.shape[-2:]
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    return _ok(lib.attention_bwd_f32(_ptr(q), _ptr(k), _ptr(v),
                                     _ptr(out), _ptr(lse), _ptr(dout),
                                     _ptr(dq), _ptr(dk), _ptr(dv),
                                     q.size // (t * hs), t, hs, scale), (dq, dk, dv))


def _attention_qkv_composed(qkv, n_head, scale):
    """Causal self-attention from fused rows ``qkv (B, T, 3C) -> (y (B, T, C), lse (B, H,
    T))``: split_heads, attention, merge_heads (``compose.attention_qkv``)."""
    return _compose.attention_qkv(sys.modules[__name__], qkv, n_head, scale)


@_fused(_attention_qkv_composed, "qkv")
def attention_qkv(lib, qkv, n_head, scale):
    B, T, C3 = qkv.shape
    y = np.empty((B, T, C3 // 3), np.float32)       # heads read in place, y written merged
    lse = np.empty((B, n_head, T), np.float32)
    return _ok(lib.attention_qkv_f32(_ptr(qkv), _ptr(y), _ptr(lse), B, T,
                                     n_head, C3 // (3 * n_head), scale), (y, lse))


@_fused(reference.attention_qkv_bwd, "qkv", "y", "lse", "dy")
def attention_qkv_bwd(lib, qkv, y, lse, dy, n_head, scale):
    B, T, C3 = qkv.shape
    dqkv = np.empty_like(qkv)                       # dq, dk, dv written into their thirds
    return _ok(lib.attention_qkv_bwd_f32(_ptr(qkv), _ptr(y), _ptr(lse),
                                         _ptr(dy), _ptr(dqkv), B, T, n_head,
                                         C3 // (3 * n_head), scale), dqkv)


def _attention_qkv_bwd_sums_composed(qkv, y, lse, dy, n_head, scale):
    """``(dqkv, sum_rows(dqkv))``: ``attention_qkv_bwd``, then ``sum_rows``
    (``compose.attention_qkv_bwd_sums``)."""
    return _compose.attention_qkv_bwd_sums(sys.modules[__name__], qkv, y, lse, dy, n_head,
                                           scale)


@_fused(_attention_qkv_bwd_sums_composed, "qkv", "y", "lse", "dy")
def attention_qkv_bwd_sums(lib, qkv, y, lse, dy, n_head, scale):
    # each head adds its columns of dqkv over its rows as it finishes them (a separate
    # sum_rows read dqkv again: ~50 us a layer at nanoGPT's CPU size)
    B, T, C3 = qkv.shape
    dqkv, sums = np.empty_like(qkv), np.empty(C3, np.float32)
    return _ok(lib.attention_qkv_bwd_sums_f32(_ptr(qkv), _ptr(y), _ptr(lse), _ptr(dy),
                                              _ptr(dqkv), _ptr(sums), B, T, n_head,
                                              C3 // (3 * n_head), scale), (dqkv, sums))


def _attention_qkv_dropout_composed(qkv, n_head, scale, p, seed):
    """``attention_qkv`` with dropout on the probabilities through the op set
    (``compose.attention_qkv_dropout``)."""
    return _compose.attention_qkv_dropout(sys.modules[__name__], qkv, n_head, scale, p, seed)


def _attention_qkv_dropout_bwd_composed(qkv, y, lse, dy, n_head, scale, p, seed):
    """Its backward through the op set (``compose.attention_qkv_dropout_bwd``)."""
    return _compose.attention_qkv_dropout_bwd(sys.modules[__name__], qkv, y, lse, dy, n_head,
                                              scale, p, seed)


def _drop_args(p, seed):
    """The C kernels' dropout arguments: p and 1/(1-p) as float32, the Philox key of ``seed``
    (an int, or the contract's ``(base array, site)``: ``rng.mix(base[0], site)``)."""
    if isinstance(seed, tuple):
        base, site = seed
        seed = _rng.mix(int(base.reshape(-1)[0]) & 0xFFFFFFFFFFFFFFFF, site)
    k0, k1 = _rng.seed_key(seed)
    return np.float32(p), _rng.dropout_scale(p), k0, k1


@_fused(_attention_qkv_dropout_composed, "qkv")
def attention_qkv_dropout(lib, qkv, n_head, scale, p, seed):
    B, T, C3 = qkv.shape
    y = np.empty((B, T, C3 // 3), np.float32)
    lse = np.empty((B, n_head, T), np.float32)
    return _ok(lib.attention_qkv_dropout_f32(_ptr(qkv), _ptr(y), _ptr(lse), B,
                                             T, n_head, C3 // (3 * n_head), scale,
                                             *_drop_args(p, seed)), (y, lse))


@_fused(_attention_qkv_dropout_bwd_composed, "qkv", "y", "lse", "dy")
def attention_qkv_dropout_bwd(lib, qkv, y, lse, dy, n_head, scale, p, seed):
    B, T, C3 = qkv.shape
    dqkv = np.empty_like(qkv)
    return _ok(lib.attention_qkv_dropout_bwd_f32(_ptr(qkv), _ptr(y), _ptr(lse),
                                                 _ptr(dy), _ptr(dqkv), B, T, n_head,
                                                 C3 // (3 * n_head), scale, *_drop_args(p, seed)),
                 dqkv)


def _targets(targets, n):
    """The targets as the C kernels' int64 vector of n, or None where they are not n ints."""
    t = np.asarray(targets)
    if t.dtype.kind not in "iu" or t.size != n:
        return None
    return np.ascontiguousarray(t.reshape(-1), np.int64)


def _xent(lib, logits, targets, vocab_size, scale, row_loss, dl):
    """``xent_f32`` on 2-D logits: its status, or -1 where the arguments do not suit."""
    n, vp = logits.shape
    v = vp if vocab_size is None else int(vocab_size)
    t = _targets(targets, n)
    if t is None or not 0 < v <= vp:
        return -1
    return lib.xent_f32(_ptr(logits), _ptr(t), n, vp, v, scale, _optr(row_loss), _optr(dl))


@_fused(reference.cross_entropy, "logits")
def cross_entropy(lib, logits, targets, vocab_size):
    if logits.ndim != 2:
        return _DECLINED
    rows = np.empty(logits.shape[0], np.float32)
    if _xent(lib, logits, targets, vocab_size, 0.0, rows, None) != 0:
        return _DECLINED                   # e.g. a target out of range: the reference says so
    return np.asarray(np.sum(rows, dtype=np.float64) / len(rows), np.float32)


@_fused(reference.cross_entropy_bwd, "logits")
def cross_entropy_bwd(lib, logits, targets, dloss, vocab_size):
    if logits.ndim != 2:
        return _DECLINED
    dl = np.empty_like(logits)
    scale = float(np.float32(float(dloss) / logits.shape[0]))
    return _ok(_xent(lib, logits, targets, vocab_size, scale, None, dl), dl)


@_fused(reference.scatter_add_rows, "dst", "src")
def scatter_add_rows(lib, dst, ids, src):
    c = dst.shape[-1]
    t = _targets(ids, np.asarray(ids).size)
    if dst.ndim != 2 or t is None or src.size != t.size * c:
        return _DECLINED
    status = lib.scatter_add_rows_f32(_ptr(dst), dst.shape[0], _ptr(t), _ptr(src),
                                      t.size, c)
    return None if status == 0 else _DECLINED


@_fused(reference.adamw_update, "p", "g", "m", "v")
def adamw_update(lib, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                 p_lowp=None):
    if p_lowp is not None:
        return _DECLINED                             # the reference says why it is refused
    lib.adamw_f32(_ptr(p), _ptr(g), _ptr(m), _ptr(v), p.size,
                  *_adamw_moments(beta1, beta2, grad_scale), *_adamw_folded(lr, beta1, beta2, eps, step),
                  1.0 - lr * weight_decay, lr != 0.0)
    return None


def _adamw_moments(beta1, beta2, grad_scale):
    """``adamw_f32``'s (b1, c1, b2, c2): the moments' factors with ``grad_scale`` folded in."""
    return beta1, (1.0 - beta1) * grad_scale, beta2, (1.0 - beta2) * grad_scale * grad_scale


def _adamw_folded(lr, beta1, beta2, eps, step):
    """``adamw_f32``'s (a, c) of a 1-based ``step``: the bias corrections and lr folded into
    the denominator; (0, 0) at lr 0, where only the moments move."""
    if lr == 0.0:
        return 0.0, 0.0
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    return bc1 / (lr * math.sqrt(bc2)), eps * bc1 / lr


# ---------------------------------------------------------------------------------------------
# the optimizer's step over every parameter in one C call (contract.OPTIONAL)
# ---------------------------------------------------------------------------------------------

_PTRS: dict = {}   # "pmv": (weak references to the arrays, their pointer and size arrays)


def _pointers(arrays):
    """int64 arrays of the arrays' addresses and sizes."""
    return (np.fromiter((_ptr(a) for a in arrays), np.int64, len(arrays)),
            np.fromiter((a.size for a in arrays), np.int64, len(arrays)))


def _kept_pointers(ps, ms, vs):
    """The addresses of p, m and v, kept between steps (an optimizer updates the same arrays
    in place every step): weak references say whether they are still the same arrays."""
    arrays = list(ps) + list(ms) + list(vs)
    hit = _PTRS.get("pmv")
    if hit is not None and len(hit[0]) == len(arrays) and all(
            r() is a for r, a in zip(hit[0], arrays)):
        return hit[1]
    k = len(ps)
    ptrs, sizes = _pointers(arrays)
    out = (ptrs[:k], ptrs[k:2 * k], ptrs[2 * k:], sizes[:k])
    _PTRS["pmv"] = ([weakref.ref(a) for a in arrays], out)
    return out


def adamw_update_many(ps, gs, ms, vs, lr, beta1, beta2, eps, weight_decays, steps, grad_scale):
    """``adamw_update`` on each parameter (its own weight decay and 1-based step), float32 in
    one C call; other dtypes, or no C kernels, one ``adamw_update`` each."""
    lib = _native.lib()
    arrays = list(ps) + list(gs) + list(ms) + list(vs)
    if lib is None or not _native.f32(*arrays) or not all(a.size for a in arrays):
        for p, g, m, v, wd, st in zip(ps, gs, ms, vs, weight_decays, steps):
            adamw_update(p, g, m, v, lr, beta1, beta2, eps, wd, st, grad_scale)
        return
    P, M, V, N = _kept_pointers(ps, ms, vs)
    G, _ = _pointers(gs)
    folded = {st: _adamw_folded(lr, beta1, beta2, eps, st) for st in set(steps)}
    a = np.array([folded[st][0] for st in steps], np.float32)
    c = np.array([folded[st][1] for st in steps], np.float32)
    decay = np.array([1.0 - lr * wd for wd in weight_decays], np.float32)
    lib.adamw_many_f32(len(ps), _ptr(P), _ptr(G), _ptr(M), _ptr(V),
                       _ptr(N), *_adamw_moments(beta1, beta2, grad_scale), _ptr(a),
                       _ptr(c), _ptr(decay), lr != 0.0)


def sumsq_many(xs):
    """``[sumsq(x) for x in xs]`` as one float32 (float64 for float64 input) array; float32
    arrays in one C call."""
    lib = _native.lib()
    if lib is None or not xs or not _native.f32(*xs) or not all(x.size for x in xs):
        return np.array([float(sumsq(x)) for x in xs],
                        np.float64 if any(x.dtype == np.float64 for x in xs) else np.float32)
    ptrs, sizes = _pointers(xs)
    out = np.empty(len(xs), np.float32)
    lib.sumsq_many_f32(len(xs), _ptr(ptrs), _ptr(sizes), _ptr(out))
    return out


# ---------------------------------------------------------------------------------------------
# composed on this backend's own ops (so that its layernorm and gelu run in C)
# ---------------------------------------------------------------------------------------------

def _gemm_lib():
    """The C library when its pool runs the float32 products (``native.owns_products``)."""
    lib = _native.lib()
    return lib if lib is not None and _native.owns_products() else None


_EPI = {None: 0, "gelu": 1, "dgelu": 2}


def _gemm(lib, a, b, trans_a=False, trans_b=False, alpha=1.0, bias=None, res=None, epi=None,
          aux=None, sums=None):
    """``alpha op(a) op(b) (+ res + bias)`` on the kernels' pool (``gemm_f32``), with its
    epilogue (``epi`` "gelu": gelu of the result into ``aux``; "dgelu": the result becomes
    ``gelu_bwd(aux, result)``) and, into ``sums`` (N,) where given, the result's column sums:
    the (M, N) result, or _DECLINED where the arrays do not suit (not 2-D float32
    C-contiguous, an empty dimension, a bias or residual of another shape)."""
    if a.ndim != 2 or b.ndim != 2:
        return _DECLINED
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    extra = [x for x in (bias, res, aux) if x is not None]
    if (k != kb or not (m and n and k) or not _native.f32(a, b, *extra)
            or (bias is not None and bias.shape != (n,))
            or any(x.shape != (m, n) for x in (res, aux) if x is not None)):
        return _DECLINED
    out = np.empty((m, n), np.float32)
    status = lib.gemm_f32(int(trans_a), int(trans_b), m, n, k, alpha, _ptr(a), a.shape[1],
                          _ptr(b), b.shape[1], _optr(bias), _optr(res), _EPI[epi], _optr(aux),
                          _ptr(out), n, _optr(sums))
    return _ok(status, out)


@_fused(reference.matmul, "a", "b")
def matmul(lib, a, b, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    if not _native.owns_products() or b_rows is not None or b.ndim != 2 or (a.ndim > 2 and trans_a):
        return _DECLINED
    if a.ndim == 2:
        return _gemm(lib, a, b, trans_a, trans_b, alpha, bias)
    out = _gemm(lib, reference._rows(a), b, False, trans_b, alpha, bias)
    return out if out is _DECLINED else out.reshape(*a.shape[:-1], out.shape[-1])


def _rows(x):
    """x as 2-D rows (a view of a C-contiguous array), or x itself when it is not one."""
    return reference._rows(x) if x.ndim > 2 and x.flags.c_contiguous else x


def linear(x, w, bias, act, residual, ln=None):
    """``act(LN(x) @ w + bias) + residual`` (act None or "gelu", ln None or (gamma, beta,
    eps)): layernorm, then one product on the kernels' pool with the residual and bias added
    in it (``gemm_f32``) or GELU applied to each block of rows as it is written; else
    ``compose.linear`` (layernorm, matmul, gelu and add)."""
    lib = _gemm_lib()
    if lib is not None and not (act is not None and residual is not None):
        xn = layernorm(x, ln[0], ln[1], ln[2]) if ln is not None else x
        x2 = _rows(xn)
        shape = (*xn.shape[:-1], w.shape[-1])
        if act is None:
            out = _gemm(lib, x2, w, bias=bias, res=None if residual is None else _rows(residual))
            if out is not _DECLINED:
                return out.reshape(shape)
        else:
            y = np.empty((x2.shape[0], w.shape[-1]), np.float32)
            out = _gemm(lib, x2, w, bias=bias, epi="gelu", aux=y)
            if out is not _DECLINED:
                return y.reshape(shape)
        return _compose.linear(sys.modules[__name__], xn, w, bias, act, residual, None)
    return _compose.linear(sys.modules[__name__], x, w, bias, act, residual, ln)


def matmul_gelu(x, w, bias):
    """``(gelu(x @ w + bias), x @ w + bias)``: one product on the kernels' pool, the bias added
    in it and GELU applied to each block of rows as it is written (``gemm_f32``); else BLAS,
    then the GELU kernel (``compose``)."""
    lib = _gemm_lib()
    if lib is not None:
        x2 = _rows(x)
        y = np.empty((x2.shape[0], w.shape[-1]), np.float32)
        pre = _gemm(lib, x2, w, bias=bias, epi="gelu", aux=y)
        if pre is not _DECLINED:
            shape = (*x.shape[:-1], w.shape[-1])
            return y.reshape(shape), pre.reshape(shape)
    return _compose.matmul_gelu(sys.modules[__name__], x, w, bias)


def matmul_dgelu(dy, w, pre):
    """``(gelu_bwd(pre, dy @ w^T), its row sums)``: one product on the kernels' pool with GELU's
    backward applied to each block of rows as it is written and the block's column sums taken
    while it is in cache (``gemm_f32``); else BLAS, the GELU kernel, the column sums
    (``compose``)."""
    lib = _gemm_lib()
    if lib is not None and pre.flags.c_contiguous:
        sums = np.empty(w.shape[0], np.float32)
        dpre = _gemm(lib, _rows(dy), w, trans_b=True, epi="dgelu", aux=_rows(pre), sums=sums)
        if dpre is not _DECLINED:
            return dpre.reshape(pre.shape), sums
    return _compose.matmul_dgelu(sys.modules[__name__], dy, w, pre)


def weight_grads(x, dy, alpha):
    """``(alpha x^T dy, sum_rows(dy))``: BLAS and the column sums (``compose``)."""
    return _compose.weight_grads(sys.modules[__name__], x, dy, alpha)


LCE_CHUNK_BYTES = 1 << 26
"""``linear_cross_entropy``'s logits of one chunk of rows at most (64 MiB)."""


def linear_cross_entropy(x, w, targets, vocab_size, grad):
    """The LM head and its loss over chunks of rows, as the GPU's classifier does, so a large
    vocabulary's ``(N, Vp)`` logits are never kept whole: per chunk, the logits, the chunk's
    share of the mean loss and of the logits' gradient, its rows of dx and its share of dw:
    on the kernels' pool (the loss and gradient in one C pass over the logits), else
    ``compose``'s op per chunk, with dloss = rows / N."""
    n, vp = x.shape[0], w.shape[0]
    rows = max(1, min(n, LCE_CHUNK_BYTES // max(1, vp * x.itemsize)))
    lib = _gemm_lib()
    if lib is not None and x.ndim == 2 and _native.f32(x, w) and x.size and w.size:
        out = _linear_cross_entropy_pool(lib, x, w, targets, vocab_size, grad, rows)
        if out is not _DECLINED:
            return out
    me = sys.modules[__name__]
    if rows >= n:
        return _compose.linear_cross_entropy(me, x, w, targets, vocab_size, grad)
    total = 0.0
    dx = np.empty_like(x) if grad else None
    dw = np.zeros_like(w) if grad else None
    for r0 in range(0, n, rows):
        ts = targets[r0:r0 + rows]
        loss, dx_c, dw_c = _compose.linear_cross_entropy(me, x[r0:r0 + rows], w, ts, vocab_size,
                                                         grad, dloss=len(ts) / n)
        total += float(loss) * len(ts)
        if grad:
            dx[r0:r0 + rows] = dx_c
            dw += dw_c
    return np.asarray(total / n, x.dtype), dx, dw


def _linear_cross_entropy_pool(lib, x, w, targets, vocab_size, grad, rows):
    """``linear_cross_entropy`` by chunks of ``rows`` on the kernels' pool: the logits (one
    product), the loss and the logits' gradient in one pass written over them (``xent_f32``),
    dx and dw (two products); or _DECLINED."""
    n = x.shape[0]
    t = _targets(targets, n)
    if t is None:
        return _DECLINED
    scale = float(np.float32(1.0 / n))            # dloss = 1, the mean over all n rows
    total = 0.0
    dx = np.empty_like(x) if grad and rows < n else None
    dw = np.zeros_like(w) if grad and rows < n else None
    for r0 in range(0, n, rows):
        xc = x[r0:r0 + rows]
        logits = _gemm(lib, xc, w, trans_b=True)                        # (rows, Vp)
        losses = np.empty(len(xc), np.float32)
        if logits is _DECLINED or _xent(lib, logits, t[r0:r0 + rows], vocab_size, scale, losses,
                                        logits if grad else None) != 0:
            return _DECLINED
        total += float(np.sum(losses, dtype=np.float64))
        if grad:                                                        # logits now hold dl
            dx_c, dw_c = _gemm(lib, logits, w), _gemm(lib, logits, xc, trans_a=True)
            if dx_c is _DECLINED or dw_c is _DECLINED:
                return _DECLINED
            if rows >= n:                   # one chunk: its products are the whole gradients
                dx, dw = dx_c, dw_c
            else:
                dx[r0:r0 + rows] = dx_c
                dw += dw_c
    return np.asarray(total / n, x.dtype), dx, dw


def scale(x, s):
    """``s * x`` in x's dtype (``s`` a float or a one-element array)."""
    x = np.asarray(x)
    return np.multiply(x, np.asarray(s, x.dtype).reshape(-1)[0], dtype=x.dtype)
