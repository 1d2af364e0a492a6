"""The op spec: naive float64 NumPy formulas for every op, forward and backward.

Written for clarity, not speed: explicit masks, explicit loops over rows and heads, textbook
derivative formulas. Every backend kernel is tested against these. Inputs of any float dtype
are promoted to float64; outputs are float64 (ids and masks are left alone).

Backward functions take the forward's inputs and the cotangent ``dy`` of the forward's output
and return the gradient of ``sum(forward(...) * dy)`` with respect to each input.
"""
from __future__ import annotations

import math

import numpy as np

from forge_ml import rng


def f64(x):
    return np.asarray(x, dtype=np.float64)


# --- matmul ----------------------------------------------------------------------------------

def _transpose_last2(x):
    return np.swapaxes(x, -1, -2)


def _product(a, b):
    """a @ b as an explicit sum of products over the inner index (no BLAS)."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(axis=-2)


def matmul(a, b, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    a, b = f64(a), f64(b)
    if b_rows is not None:
        b = b[..., :b_rows, :]
    if trans_a:
        a = _transpose_last2(a)
    if trans_b:
        b = _transpose_last2(b)
    out = alpha * _product(a, b)
    if bias is not None:
        out = out + f64(bias)
    return out


def matmul_bwd(a, b, dy, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    """(da, db, dbias) of matmul; db has b's full stored shape (rows past b_rows get 0)."""
    a, b, dy = f64(a), f64(b), f64(dy)
    bb = b[..., :b_rows, :] if b_rows is not None else b
    opa = _transpose_last2(a) if trans_a else a
    opb = _transpose_last2(bb) if trans_b else bb
    d_opa = alpha * _product(dy, _transpose_last2(opb))   # d/d op(a)
    d_opb = alpha * _product(_transpose_last2(opa), dy)   # d/d op(b)
    da = _transpose_last2(d_opa) if trans_a else d_opa
    dbb = _transpose_last2(d_opb) if trans_b else d_opb
    db = np.zeros_like(b)
    db[..., :bb.shape[-2], :] = dbb
    dbias = dy.reshape(-1, dy.shape[-1]).sum(axis=0) if bias is not None else None
    return da, db, dbias


# --- add, sum_rows, sumsq --------------------------------------------------------------------

def add(a, b):
    return f64(a) + f64(b)


def sum_rows(x):
    x = f64(x)
    out = np.zeros(x.shape[-1])
    for row in x.reshape(-1, x.shape[-1]):
        out += row
    return out


def sumsq(x):
    x = f64(x).ravel()
    return np.float64(np.sum(x * x))


# --- gelu ------------------------------------------------------------------------------------

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def gelu(x):
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(GELU_K * (x + GELU_C * x ** 3)))


def gelu_bwd(x, dy):
    """d/dx of 0.5 x (1 + tanh u(x)) with u = k (x + c x^3): product rule, sech^2 = 1/cosh^2."""
    x = f64(x)
    u = GELU_K * (x + GELU_C * x ** 3)
    du = GELU_K * (1.0 + 3.0 * GELU_C * x ** 2)
    with np.errstate(over="ignore"):  # cosh overflows to inf far out, where sech^2 is 0
        sech2 = 1.0 / np.cosh(u) ** 2
    return f64(dy) * (0.5 * (1.0 + np.tanh(u)) + 0.5 * x * sech2 * du)


# --- layernorm -------------------------------------------------------------------------------

def layernorm(x, gamma, beta, eps):
    x, gamma, beta = f64(x), f64(gamma), f64(beta)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    for r in range(rows.shape[0]):
        mu = rows[r].mean()
        var = ((rows[r] - mu) ** 2).mean()
        out[r] = (rows[r] - mu) / math.sqrt(var + eps) * gamma + beta
    return out.reshape(x.shape)


def layernorm_bwd(x, gamma, dy, eps):
    """The step-by-step chain rule through mu and var (Ioffe & Szegedy 2015, section 3)."""
    x, gamma, dy = f64(x), f64(gamma), f64(dy)
    n = x.shape[-1]
    xs = x.reshape(-1, n)
    dys = dy.reshape(-1, n)
    dx = np.empty_like(xs)
    dgamma = np.zeros(n)
    dbeta = np.zeros(n)
    for r in range(xs.shape[0]):
        mu = xs[r].mean()
        var = ((xs[r] - mu) ** 2).mean()
        sigma = math.sqrt(var + eps)
        xhat = (xs[r] - mu) / sigma
        dgamma += dys[r] * xhat
        dbeta += dys[r]
        dxhat = dys[r] * gamma
        dvar = np.sum(dxhat * (xs[r] - mu)) * -0.5 * (var + eps) ** -1.5
        dmu = np.sum(-dxhat / sigma) + dvar * np.mean(-2.0 * (xs[r] - mu))
        dx[r] = dxhat / sigma + dvar * 2.0 * (xs[r] - mu) / n + dmu / n
    return dx.reshape(x.shape), dgamma, dbeta


# --- softmax ---------------------------------------------------------------------------------

def causal_mask(rows, cols, off):
    """True where allowed: column j of row i is kept when j <= i + off."""
    keep = np.zeros((rows, cols), dtype=bool)
    for i in range(rows):
        for j in range(cols):
            keep[i, j] = j <= i + off
    return keep


def softmax(x, causal=False, off=0):
    x = f64(x)
    keep = causal_mask(x.shape[-2], x.shape[-1], off) if causal else np.ones(x.shape[-2:], bool)
    keep = np.broadcast_to(keep, x.shape)
    z = np.where(keep, x, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.where(keep, np.exp(z), 0.0)
    return e / e.sum(axis=-1, keepdims=True)


def logsumexp(x, causal=False, off=0):
    """log(sum_j exp(x_ij)) over the unmasked columns of each row (masked as softmax)."""
    x = f64(x)
    keep = causal_mask(x.shape[-2], x.shape[-1], off) if causal else np.ones(x.shape[-2:], bool)
    keep = np.broadcast_to(keep, x.shape)
    out = np.empty(x.shape[:-1])
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx][keep[idx]]
        m = row.max()
        out[idx] = m + np.log(np.sum(np.exp(row - m)))
    return out


def softmax_bwd(y, dy):
    """dx = J^T dy with the softmax Jacobian J = diag(y) - y y^T, row by row."""
    y, dy = f64(y), f64(dy)
    ys = y.reshape(-1, y.shape[-1])
    dys = dy.reshape(-1, y.shape[-1])
    dx = np.empty_like(ys)
    for r in range(ys.shape[0]):
        jac = np.diag(ys[r]) - np.outer(ys[r], ys[r])
        dx[r] = jac.T @ dys[r]
    return dx.reshape(y.shape)


# --- heads -----------------------------------------------------------------------------------

def split_heads(qkv, n_head):
    qkv = f64(qkv)
    *lead, t, c3 = qkv.shape
    c = c3 // 3
    hs = c // n_head
    outs = []
    for which in range(3):
        part = np.empty((*lead, n_head, t, hs))
        for h in range(n_head):
            part[..., h, :, :] = qkv[..., :, which * c + h * hs: which * c + (h + 1) * hs]
        outs.append(part)
    return tuple(outs)


def unsplit_head(dy, which):
    dy = f64(dy)
    *lead, n_head, t, hs = dy.shape
    c = n_head * hs
    out = np.zeros((*lead, t, 3 * c))
    for h in range(n_head):
        out[..., :, which * c + h * hs: which * c + (h + 1) * hs] = dy[..., h, :, :]
    return out


def merge_heads(x):
    x = f64(x)
    *lead, n_head, t, hs = x.shape
    out = np.empty((*lead, t, n_head * hs))
    for h in range(n_head):
        out[..., :, h * hs:(h + 1) * hs] = x[..., h, :, :]
    return out


def unmerge_heads(dy, n_head):
    dy = f64(dy)
    *lead, t, c = dy.shape
    hs = c // n_head
    out = np.empty((*lead, n_head, t, hs))
    for h in range(n_head):
        out[..., h, :, :] = dy[..., :, h * hs:(h + 1) * hs]
    return out


# --- attention -------------------------------------------------------------------------------

def attention(q, k, v, scale):
    """Causal attention through the explicit scores matrix: (out, lse)."""
    q, k, v = f64(q), f64(k), f64(v)
    t = q.shape[-2]
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    keep = np.broadcast_to(causal_mask(t, t, 0), s.shape)
    masked = np.where(keep, s, -np.inf)
    mx = masked.max(axis=-1, keepdims=True)
    lse = (mx + np.log(np.where(keep, np.exp(masked - mx), 0.0).sum(axis=-1, keepdims=True)))
    p = softmax(s, causal=True, off=0)
    return np.einsum("...ij,...jd->...id", p, v), lse[..., 0]


def attention_bwd(q, k, v, dout, scale):
    """(dq, dk, dv) by composing the reference matmul and softmax backward rules."""
    q, k, v, dout = f64(q), f64(k), f64(v), f64(dout)
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    p = softmax(s, causal=True, off=0)
    dv = np.einsum("...ij,...id->...jd", p, dout)
    dp = np.einsum("...id,...jd->...ij", dout, v)
    ds = softmax_bwd(p, dp)
    dq = scale * np.einsum("...ij,...jd->...id", ds, k)
    dk = scale * np.einsum("...ij,...id->...jd", ds, q)
    return dq, dk, dv


def attention_dropout(q, k, v, scale, p, seed):
    """Causal attention with inverted dropout on the probabilities: (out, lse).

    P is the causal softmax of ``scale q k^T`` (normalised over every key it sees), M the
    dropout mask of ``dropout_mask`` over P's shape (element ``((b H + h) T + t) T + s`` of a
    (B, H, T, T) P in row-major order) times ``float32(1 / (1 - p))``; ``out = (P * M) v``;
    lse is ``attention``'s: dropout comes after the normalisation.
    """
    q, k, v = f64(q), f64(k), f64(v)
    _, lse = attention(q, k, v, scale)
    p_ = softmax(scale * np.einsum("...id,...jd->...ij", q, k), causal=True, off=0)
    return np.einsum("...ij,...jd->...id", dropout(p_, p, seed), v), lse


def attention_dropout_bwd(q, k, v, dout, scale, p, seed):
    """(dq, dk, dv) of ``attention_dropout``, the chain rule step by step: out = Pd v with
    Pd = dropout(P), so dv = Pd^T dout and dPd = dout v^T; dP = dropout_bwd(dPd) (the same
    mask and scale); dS = softmax_bwd(P, dP); dq = scale dS k, dk = scale dS^T q."""
    q, k, v, dout = f64(q), f64(k), f64(v), f64(dout)
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    p_ = softmax(s, causal=True, off=0)
    dv = np.einsum("...ij,...id->...jd", dropout(p_, p, seed), dout)
    dpd = np.einsum("...id,...jd->...ij", dout, v)
    ds = softmax_bwd(p_, dropout_bwd(p_.shape, dpd, p, seed))
    dq = scale * np.einsum("...ij,...jd->...id", ds, k)
    dk = scale * np.einsum("...ij,...id->...jd", ds, q)
    return dq, dk, dv


# --- embedding, scatter_add_rows, kv_append --------------------------------------------------

def embedding(ids, wte, wpe, pos):
    ids = np.asarray(ids)
    wte, wpe = f64(wte), f64(wpe)
    t = ids.shape[-1]
    flat = ids.reshape(-1, t)
    out = np.empty((flat.shape[0], t, wte.shape[1]))
    for b in range(flat.shape[0]):
        for i in range(t):
            out[b, i] = wte[flat[b, i]] + wpe[pos + i]
    return out.reshape(*ids.shape, wte.shape[1])


def embedding_bwd(ids, n_vocab, n_pos, dy, pos):
    """(dwte, dwpe) of embedding."""
    ids = np.asarray(ids)
    dy = f64(dy)
    t = ids.shape[-1]
    c = dy.shape[-1]
    dwte = np.zeros((n_vocab, c))
    dwpe = np.zeros((n_pos, c))
    flat_ids = ids.reshape(-1, t)
    flat_dy = dy.reshape(-1, t, c)
    for b in range(flat_ids.shape[0]):
        for i in range(t):
            dwte[flat_ids[b, i]] += flat_dy[b, i]
            dwpe[pos + i] += flat_dy[b, i]
    return dwte, dwpe


def scatter_add_rows(dst, ids, src):
    """A new array: dst with src[i] added to row ids[i], one row at a time."""
    out = f64(dst).copy()
    ids = np.asarray(ids).reshape(-1)
    src = f64(src).reshape(-1, out.shape[-1])
    for i in range(ids.shape[0]):
        out[ids[i]] += src[i]
    return out


def kv_append(cache, new, pos):
    """A new array: cache with rows pos.. of the second-to-last axis replaced by new."""
    out = f64(cache).copy()
    new = f64(new)
    for i in range(new.shape[-2]):
        out[..., pos + i, :] = new[..., i, :]
    return out


def decode_attention(qkv, k_cache, v_cache, pos, n_head, scale):
    """(y, k_cache', v_cache'): one decoding step, written out with loops over rows and heads.

    qkv (B, 3C) holds each row's new query, key and value; the key and value go to row pos of
    the caches (B, H, Tmax, hs); head h of row b attends over cache rows 0..pos. ``pos`` may
    also be a sequence of B positions, one per row (continuous batching).
    """
    qkv = f64(qkv)
    kc, vc = f64(k_cache).copy(), f64(v_cache).copy()
    B, H, _, hs = kc.shape
    C = H * hs
    y = np.zeros((B, C))
    rows_pos = np.broadcast_to(np.asarray(pos).reshape(-1), (B,))
    for b in range(B):
        pos = int(rows_pos[b])
        for h in range(H):
            q = qkv[b, h * hs:(h + 1) * hs]
            kc[b, h, pos] = qkv[b, C + h * hs:C + (h + 1) * hs]
            vc[b, h, pos] = qkv[b, 2 * C + h * hs:2 * C + (h + 1) * hs]
            s = np.array([scale * q @ kc[b, h, j] for j in range(pos + 1)])
            p = np.exp(s - s.max())
            p /= p.sum()
            y[b, h * hs:(h + 1) * hs] = sum(p[j] * vc[b, h, j] for j in range(pos + 1))
    return y, kc, vc


# --- dropout ---------------------------------------------------------------------------------

def dropout_mask(shape, p, seed):
    """The keep mask as the Philox stream spec of forge_ml.rng defines it, element by element."""
    n = int(np.prod(shape))
    key = rng.seed_key(seed)
    keep = np.empty(n, dtype=bool)
    blocks = rng.philox4x32_10([np.arange((n + 3) // 4), 0, 0, 0], key)  # (4, n/4)
    for i in range(n):
        word = int(blocks[i % 4, i // 4])
        keep[i] = (word >> 8) * 2.0 ** -24 >= np.float32(p)
    return keep.reshape(shape)


def dropout(x, p, seed):
    x = f64(x)
    if p == 0:
        return x.copy()
    scale = float(np.float32(1.0 / (1.0 - p)))
    return x * dropout_mask(x.shape, p, seed) * scale


def dropout_bwd(x_shape, dy, p, seed):
    if p == 0:
        return f64(dy).copy()
    scale = float(np.float32(1.0 / (1.0 - p)))
    return f64(dy) * dropout_mask(x_shape, p, seed) * scale


# --- cross-entropy ---------------------------------------------------------------------------

def cross_entropy(logits, targets, vocab_size=None):
    """-mean over rows of log_softmax(l[:V])[target], log-softmax written out."""
    logits = f64(logits)
    v = logits.shape[1] if vocab_size is None else vocab_size
    total = 0.0
    for n in range(logits.shape[0]):
        row = logits[n, :v]
        shifted = row - row.max()
        log_probs = shifted - math.log(np.exp(shifted).sum())
        total -= log_probs[targets[n]]
    return np.float64(total / logits.shape[0])


def cross_entropy_bwd(logits, targets, dloss=1.0, vocab_size=None):
    logits = f64(logits)
    n_rows, vp = logits.shape
    v = vp if vocab_size is None else vocab_size
    out = np.zeros((n_rows, vp))
    for n in range(n_rows):
        row = logits[n, :v]
        e = np.exp(row - row.max())
        probs = e / e.sum()
        onehot = np.zeros(v)
        onehot[targets[n]] = 1.0
        out[n, :v] = float(dloss) * (probs - onehot) / n_rows
    return out



def linear_cross_entropy(x, w, targets, vocab_size=None):
    """``(loss, dx, dw)`` of the LM head and its loss for dloss = 1: logits = x w^T, the loss
    and dlogits as above, dx = dlogits w, dw = dlogits^T x."""
    x, w = f64(x), f64(w)
    logits = x @ w.T
    dl = cross_entropy_bwd(logits, targets, 1.0, vocab_size)
    return cross_entropy(logits, targets, vocab_size), dl @ w, dl.T @ x

# --- AdamW -----------------------------------------------------------------------------------

def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    """One AdamW step, returning new (p, m, v) (Loshchilov & Hutter 2019, algorithm 2)."""
    p, g, m, v = f64(p), f64(g) * grad_scale, f64(m), f64(v)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    m_hat = m / (1.0 - beta1 ** step)
    v_hat = v / (1.0 - beta2 ** step)
    p = p - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p)
    return p, m, v
