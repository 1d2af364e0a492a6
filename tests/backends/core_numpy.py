"""A minimal backend for the contract suite: NumPy arrays, the memory and core ops of
``forge_ml.backends.contract`` and nothing else. Every fused op (attention, attention_qkv,
attention_qkv_dropout, linear, decode_attention, greedy_next, ...) comes from
``backends/compose.py``.

It follows docs/architecture.md's "Add a backend" list: a module with the contract's
functions, capability constants, one ``register`` line (``register_backend`` below), and this
suite. Its kernels are written here from the formulas, plainly, not borrowed from the CPU
backend, so that the suite checks two independent implementations.
"""
from __future__ import annotations

import numpy as np

from forge_ml import rng

NAME = "corenp"
BF16 = False
GRAPHS = False
HOST_MEMORY = True


def register_backend():
    """Register this module as device type ``corenp`` (idempotent)."""
    import sys

    from forge_ml.backends import names, register
    if NAME not in names():
        register(NAME, lambda: sys.modules[__name__])


def _np(dtype_name):
    if dtype_name == "bfloat16":
        from forge_ml.errors import DTypeError
        raise DTypeError("corenp: no bfloat16")
    return np.dtype(dtype_name)


# -- memory ----------------------------------------------------------------------------------
def zeros(shape, dtype_name):
    return np.zeros(shape, _np(dtype_name))


def from_host(a, dtype_name):
    return np.array(a, dtype=_np(dtype_name), order="C", copy=True)


def to_host(a):
    return np.array(a, copy=True)


def cast(a, dtype_name):
    return a.astype(_np(dtype_name))


def copy(a):
    return np.array(a, order="C", copy=True)


def assign(dst, values):
    dst[...] = values


def synchronize():
    pass


def pinned_empty(shape, dtype):
    return np.empty(shape, dtype)


def to_host_async(a, out):
    np.copyto(out, np.asarray(a).reshape(out.shape))


def from_host_async(dst, src):
    np.copyto(dst, np.asarray(src).reshape(dst.shape))


# -- core kernels ----------------------------------------------------------------------------
def matmul(a, b, bias, trans_a, trans_b, alpha, b_rows):
    if b_rows is not None:
        b = b[..., :b_rows, :]
    a = np.swapaxes(a, -1, -2) if trans_a else a
    b = np.swapaxes(b, -1, -2) if trans_b else b
    out = np.matmul(a, b) * a.dtype.type(alpha)
    return out if bias is None else out + bias


def add(a, b):
    return a + b


def sum_rows(x):
    return x.reshape(-1, x.shape[-1]).sum(axis=0)


def sumsq(x):
    return np.asarray(np.sum(x.astype(np.float64) ** 2), dtype=x.dtype)


_K, _C = np.sqrt(2.0 / np.pi), 0.044715


def gelu(x):
    return (0.5 * x * (1.0 + np.tanh(_K * (x + _C * x ** 3)))).astype(x.dtype)


def gelu_bwd(x, dy):
    t = np.tanh(_K * (x + _C * x ** 3))
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K * (1 + 3 * _C * x * x)
    return (dy * d).astype(x.dtype)


def _var(x, mu):
    """The rows' variance; one past the type's range is NaN (the contract's layernorm rule)."""
    with np.errstate(over="ignore"):
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return np.where(np.isinf(var), np.nan, var)


def layernorm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = _var(x, mu)
    return ((x - mu) / np.sqrt(var + eps) * gamma + beta).astype(x.dtype)


def layernorm_bwd(x, gamma, dy, eps):
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(_var(x, mu) + eps)
    xhat = (x - mu) * rstd
    g = gamma * dy
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    c = x.shape[-1]
    # the sums over rows in float64: a float32 running sum over thousands of rows drifts
    # (the contract suite holds dgamma to what blocked or double accumulation gives)
    dgamma = (dy * xhat).reshape(-1, c).sum(0, dtype=np.float64)
    dbeta = dy.reshape(-1, c).sum(0, dtype=np.float64)
    return dx.astype(x.dtype), dgamma.astype(x.dtype), dbeta.astype(x.dtype)


def _masked(x, causal, off):
    if not causal:
        return x
    i = np.arange(x.shape[-2])[:, None]
    j = np.arange(x.shape[-1])[None, :]
    return np.where(j > i + off, -np.inf, x)


def softmax(x, causal, off):
    z = _masked(x, causal, off)
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(x.dtype)


def softmax_bwd(y, dy):
    return (y * (dy - (y * dy).sum(-1, keepdims=True))).astype(y.dtype)


def logsumexp(x, causal, off):
    z = _masked(x, causal, off)
    m = z.max(-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0].astype(x.dtype)


def split_heads(qkv, n_head):
    *lead, t, c3 = qkv.shape
    x = qkv.reshape(*lead, t, 3, n_head, c3 // (3 * n_head))
    return tuple(np.swapaxes(x[..., w, :, :], -3, -2).copy() for w in range(3))


def unsplit_head(dy, which):
    *lead, h, t, hs = dy.shape
    out = np.zeros((*lead, t, 3, h, hs), dy.dtype)
    out[..., which, :, :] = np.swapaxes(dy, -3, -2)
    return out.reshape(*lead, t, 3 * h * hs)


def merge_heads(x):
    *lead, h, t, hs = x.shape
    return np.swapaxes(x, -3, -2).copy().reshape(*lead, t, h * hs)


def unmerge_heads(dy, h):
    *lead, t, c = dy.shape
    return np.swapaxes(dy.reshape(*lead, t, h, c // h), -3, -2).copy()


def embedding(ids, wte, wpe, pos):
    t = ids.shape[-1]
    out = wte[ids].copy()
    if isinstance(pos, np.ndarray) and pos.size > 1:            # one position per row
        for b, p in enumerate(pos.reshape(-1)):
            if 0 <= p and p + t <= wpe.shape[0]:
                out[b] += wpe[p:p + t]
            else:
                out[b] = np.nan
        return out
    p = int(np.asarray(pos).reshape(-1)[0])
    if p < 0 or p + t > wpe.shape[0]:
        out[...] = np.nan
        return out
    return out + wpe[p:p + t]


def scatter_add_rows(dst, ids, src):
    np.add.at(dst, ids.reshape(-1), src.reshape(-1, dst.shape[-1]))


def kv_append(cache, new, pos):
    cache[..., pos:pos + new.shape[-2], :] = new


def dropout(x, p, seed):
    if p == 0:
        return x.copy()
    keep = rng.dropout_keep(seed, x.size, p).reshape(x.shape)
    return np.where(keep, x * x.dtype.type(rng.dropout_scale(p)), 0).astype(x.dtype)


def cross_entropy(logits, targets, vocab_size):
    z = logits[:, :vocab_size].astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
    return np.asarray(np.mean(lse - z[np.arange(len(z)), targets.reshape(-1)]), logits.dtype)


def cross_entropy_bwd(logits, targets, dloss, vocab_size):
    n = logits.shape[0]
    out = np.zeros_like(logits)
    out[:, :vocab_size] = softmax(logits[:, :vocab_size], False, 0)
    out[np.arange(n), targets.reshape(-1)] -= 1
    return (out * logits.dtype.type(float(dloss) / n)).astype(logits.dtype)


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                 p_lowp=None):
    g = g * grad_scale
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * g * g
    p -= lr * weight_decay * p
    p -= lr * (m / (1 - beta1 ** step)) / (np.sqrt(v / (1 - beta2 ** step)) + eps)
