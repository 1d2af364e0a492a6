"""Every fused op of the contract, written with memory and core ops only: the default a
backend gets where it has no fused kernel (candle's ``*_slow`` twins play the same part).

``bk`` is a loaded backend (``backends.Backend``). These functions define what each fused
op means in terms of the op set, so a backend's fused kernel and its composed default agree
by construction; ``tests/backends`` checks both against the float64 specification. A real
backend also calls them for the cases its kernels do not take (the CPU for every
``linear``, the GPU for attention in a dtype or head size its flash kernels do not take).

>>> import numpy as np
>>> from forge_ml.backends import get
>>> from forge_ml.device import CPU
>>> bk = get(CPU)
>>> x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
>>> linear(bk, x, w, None, None, None).tolist()[0]
[3.0, 3.0, 3.0, 3.0]
"""
from __future__ import annotations

import numpy as np

from .. import rng
from ..dtype import of_array


def linear(bk, x, w, bias, act, residual, ln=None):
    """``act(LN(x) @ w + bias) + residual``: layernorm (``ln`` = (gamma, beta, eps) or None),
    matmul, gelu (``act`` "gelu" or None) and add, one after the other."""
    if ln is not None:
        x = bk.layernorm(x, ln[0], ln[1], ln[2])
    y = bk.matmul(x, w, bias, False, False, 1.0, None)
    if act == "gelu":
        y = bk.gelu(y)
    return y if residual is None else bk.add(residual, y)


def matmul_gelu(bk, x, w, bias):
    """``(gelu(x @ w + bias), x @ w + bias)``: the product and GELU one after the other, GELU's
    input kept (its backward needs it)."""
    pre = bk.matmul(x, w, bias, False, False, 1.0, None)
    return bk.gelu(pre), pre


def layernorm_bwd_add(bk, x, gamma, dy, eps, add):
    """``layernorm_bwd`` with ``add`` added to dx: the backward, then ``add(add, dx)``."""
    dx, dgamma, dbeta = bk.layernorm_bwd(x, gamma, dy, eps)
    return bk.add(add, dx), dgamma, dbeta


def layernorm_bwd_sums(bk, x, gamma, dy, eps, add):
    """``(dx, dgamma, dbeta, sum_rows(dx))``: ``layernorm_bwd`` (``layernorm_bwd_add`` where
    ``add`` is not None), then ``sum_rows`` of the dx it gave."""
    if add is None:
        dx, dgamma, dbeta = bk.layernorm_bwd(x, gamma, dy, eps)
    else:
        dx, dgamma, dbeta = bk.layernorm_bwd_add(x, gamma, dy, eps, add)
    return dx, dgamma, dbeta, bk.sum_rows(dx)


def matmul_dgelu(bk, dy, w, pre):
    """The gradient at GELU's input of ``gelu(pre) @ w`` and its sum over rows: ``dpre =
    gelu_bwd(pre, dy @ w^T)``, ``(dpre, sum_rows(dpre))``."""
    dpre = bk.gelu_bwd(pre, bk.matmul(dy, w, None, False, True, 1.0, None))
    return dpre, bk.sum_rows(dpre)


def sumsq_total(bk, xs):
    """The sum of squares of every element of every array in ``xs`` (0-d): ``sumsq`` each,
    added with ``add`` in order, in float64 when any array is float64 (else float32)."""
    acc_dt = "float64" if any(of_array(x.dtype).name == "float64" for x in xs) else "float32"
    acc = bk.zeros((), acc_dt)
    for x in xs:
        s = bk.sumsq(x)
        acc = bk.add(acc, s if of_array(s.dtype).name == acc_dt else bk.cast(s, acc_dt))
    return acc


def weight_grads(bk, x, dy, alpha):
    """A linear layer's weight and bias gradients: ``(alpha x^T dy, sum_rows(dy))``."""
    return bk.matmul(x, dy, None, True, False, float(alpha), None), bk.sum_rows(dy)


def linear_cross_entropy(bk, x, w, targets, vocab_size, grad, dloss=1.0):
    """The LM head and its loss, the logits kept whole: ``logits = x @ w^T``, ``loss =
    cross_entropy(logits)``; with ``grad`` also ``dl = cross_entropy_bwd(logits, dloss)``,
    ``dx = dl @ w``, ``dw = dl^T @ x``. Returns ``(loss, dx, dw)`` (None, None without grad).
    ``dloss`` (1 for the contract's op) lets a backend run it over chunks of rows."""
    logits = bk.matmul(x, w, None, False, True, 1.0, None)             # (N, Vp)
    loss = bk.cross_entropy(logits, targets, vocab_size)
    if not grad:
        return loss, None, None
    dl = bk.cross_entropy_bwd(logits, targets, dloss, vocab_size)
    return (loss, bk.matmul(dl, w, None, False, False, 1.0, None),
            bk.matmul(dl, x, None, True, False, 1.0, None))


def scale(bk, x, s):
    """``s * x`` in x's dtype, as a ``(numel, 1) @ (1, 1)`` product with s in that dtype (a
    float, or a one-element array of the backend: no trip through the host)."""
    name = of_array(x.dtype).name
    if isinstance(s, (int, float, np.integer, np.floating)):
        sv = bk.from_host(np.full((1, 1), float(s)), name)
    else:
        sv = s.reshape(1, 1)
        if of_array(sv.dtype).name != name:
            sv = bk.cast(sv, name)
    return bk.matmul(x.reshape(-1, 1), sv, None, False, False, 1.0, None).reshape(x.shape)


def attention(bk, q, k, v, scale):
    """Causal attention over ``(..., H, T, hs)``: the scores ``S = scale q k^T`` (T x T per
    head, kept in memory), ``P = softmax(S, causal)``, ``out = P v``; ``lse`` is the
    log-sum-exp of each row of masked S.

    Known limit: a masked probability is a zero that the products still multiply, so a NaN or
    inf at a future position (in k, v, or in the backward q or the cotangent) reaches earlier
    rows (0 * NaN is NaN); the backends' own attention kernels and the float64 reference skip
    masked entries. No op of the set can skip them here (that needs a causal product)."""
    s = bk.matmul(q, k, None, False, True, float(scale), None)     # (..., H, T, T)
    p = bk.softmax(s, True, 0)
    out = bk.matmul(p, v, None, False, False, 1.0, None)            # (..., H, T, hs)
    return out, bk.logsumexp(s, True, 0)


def attention_bwd(bk, q, k, v, out, lse, dout, scale):
    """``(dq, dk, dv)`` of causal attention, the probabilities recomputed from q and k:
    ``dV = P^T dO``, ``dS = softmax_bwd(P, dO V^T)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q`` (``out`` and ``lse`` are not needed on this path)."""
    s = bk.matmul(q, k, None, False, True, float(scale), None)     # (..., H, T, T)
    p = bk.softmax(s, True, 0)
    dv = bk.matmul(p, dout, None, True, False, 1.0, None)
    dp = bk.matmul(dout, v, None, False, True, 1.0, None)
    ds = bk.softmax_bwd(p, dp)
    dq = bk.matmul(ds, k, None, False, False, float(scale), None)
    dk = bk.matmul(ds, q, None, True, False, float(scale), None)
    return dq, dk, dv


def attention_qkv(bk, qkv, n_head, scale):
    """Causal self-attention from fused rows ``qkv (B, T, 3C)``: split_heads, attention,
    merge_heads; returns ``(y (B, T, C), lse (B, H, T))``."""
    q, k, v = bk.split_heads(qkv, n_head)
    out, lse = bk.attention(q, k, v, scale)
    return bk.merge_heads(out), lse


def attention_qkv_bwd(bk, qkv, y, lse, dy, n_head, scale):
    """``dqkv (B, T, 3C)``: attention_bwd on the split heads, each gradient put back in its
    third of the rows (unsplit_head) and the three added."""
    q, k, v = bk.split_heads(qkv, n_head)
    dq, dk, dv = bk.attention_bwd(q, k, v, bk.unmerge_heads(y, n_head), lse,
                                  bk.unmerge_heads(dy, n_head), scale)
    dqkv = bk.add(bk.unsplit_head(dq, 0), bk.unsplit_head(dk, 1))
    return bk.add(dqkv, bk.unsplit_head(dv, 2))


def attention_qkv_bwd_sums(bk, qkv, y, lse, dy, n_head, scale):
    """``(dqkv, sum_rows(dqkv))``: ``attention_qkv_bwd``, then ``sum_rows`` of the dqkv it
    gave."""
    dqkv = bk.attention_qkv_bwd(qkv, y, lse, dy, n_head, scale)
    return dqkv, bk.sum_rows(dqkv)


def _dropout(bk, x, p, seed):
    """``dropout(x, p, seed)`` for a seed of either form: an int, or ``(base, site)`` (the stream
    ``rng.mix(base[0], site)``): ``dropout_at`` where the backend has it (``contract.GRAPH``),
    else the base read back to the host (a wait on a device)."""
    if not isinstance(seed, tuple):
        return bk.dropout(x, p, seed)
    base, site = seed
    if callable(getattr(bk, "dropout_at", None)):
        return bk.dropout_at(x, p, base, site)
    at = int(np.asarray(bk.to_host(base)).reshape(-1)[0]) & 0xFFFFFFFFFFFFFFFF
    return bk.dropout(x, p, rng.mix(at, site))


def attention_qkv_dropout(bk, qkv, n_head, scale, p, seed):
    """``attention_qkv`` with dropout on the probabilities, as a model without the fused op
    writes it: split_heads, ``S = scale q k^T``, ``P = softmax(S, causal)``, ``y =
    merge_heads(dropout(P, p, seed) v)`` (the mask over the (B, H, T, T) probabilities);
    ``(y, lse)``, lse of S (before dropout)."""
    q, k, v = bk.split_heads(qkv, n_head)
    s = bk.matmul(q, k, None, False, True, float(scale), None)     # (B, H, T, T)
    pd = _dropout(bk, bk.softmax(s, True, 0), p, seed)
    out = bk.matmul(pd, v, None, False, False, 1.0, None)           # (B, H, T, hs)
    return bk.merge_heads(out), bk.logsumexp(s, True, 0)


def attention_qkv_dropout_bwd(bk, qkv, y, lse, dy, n_head, scale, p, seed):
    """``dqkv (B, T, 3C)`` of ``attention_qkv_dropout``, P and its mask M (times 1/(1-p))
    recomputed: ``dV = (P M)^T dO``, ``dS = softmax_bwd(P, M (dO V^T))``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``, each put back in its third of the rows (``y`` and ``lse`` are not
    needed on this path)."""
    q, k, v = bk.split_heads(qkv, n_head)
    s = bk.matmul(q, k, None, False, True, float(scale), None)     # (B, H, T, T)
    pr = bk.softmax(s, True, 0)
    dout = bk.unmerge_heads(dy, n_head)                             # (B, H, T, hs)
    dv = bk.matmul(_dropout(bk, pr, p, seed), dout, None, True, False, 1.0, None)
    dpd = bk.matmul(dout, v, None, False, True, 1.0, None)          # d(dropped P)
    ds = bk.softmax_bwd(pr, _dropout(bk, dpd, p, seed))             # dropout's backward: its mask
    dq = bk.matmul(ds, k, None, False, False, float(scale), None)
    dk = bk.matmul(ds, q, None, True, False, float(scale), None)
    dqkv = bk.add(bk.unsplit_head(dq, 0), bk.unsplit_head(dk, 1))
    return bk.add(dqkv, bk.unsplit_head(dv, 2))


def _host_positions(bk, pos, rows) -> np.ndarray:
    """Positions as a host int array of ``rows`` elements, from an int or a device array of
    one element (shared) or one per row (read back: a device wait, which is why backends with
    graphs have their own kernel)."""
    if isinstance(pos, (int, np.integer)):
        return np.full(rows, int(pos), np.int64)
    host = np.asarray(bk.to_host(pos)).reshape(-1).astype(np.int64)
    return np.broadcast_to(host, (rows,)) if host.size == 1 else host


def decode_attention(bk, qkv, k_cache, v_cache, pos, n_head, scale):
    """One decoding step from ``qkv (B, 3C)``: the new key and value written at row ``pos``
    of the caches ``(B, H, Tmax, hs)`` (kv_append), then per head ``softmax(scale q k^T) v``
    over rows ``0..pos`` (matmul with ``b_rows``); ``y (B, C)``. A position outside the cache
    writes nothing and gives NaN. With one position per row, each row is one such step on
    its own rows of the caches (views of the leading axis)."""
    B, H, tmax, hs = k_cache.shape
    at = _host_positions(bk, pos, B)
    if B > 1 and not (at == at[0]).all():
        ys = [decode_attention(bk, qkv[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1],
                               int(at[b]), n_head, scale) for b in range(B)]
        y = ys[0]
        for b in range(1, B):   # stack the rows: (b, C) + (1, C) through a (b+1, C) buffer
            y = _stack_rows(bk, y, ys[b])
        return y
    at = int(at[0])
    if not 0 <= at < tmax:
        return bk.from_host(np.full((B, H * hs), np.nan, np.float32), of_array(qkv.dtype).name)
    q, k, v = bk.split_heads(qkv.reshape(B, 1, 3 * H * hs), n_head)    # (B, H, 1, hs) each
    bk.kv_append(k_cache, k, at)
    bk.kv_append(v_cache, v, at)
    s = bk.matmul(q, k_cache, None, False, True, float(scale), at + 1)  # (B, H, 1, at+1)
    p = bk.softmax(s, False, 0)
    y = bk.matmul(p, v_cache, None, False, False, 1.0, at + 1)          # (B, H, 1, hs)
    return bk.merge_heads(y).reshape(B, H * hs)


def _stack_rows(bk, top, row):
    """``top (n, C)`` with ``row (1, C)`` below it: kv_append into a zero (n+1, C) buffer."""
    n, c = top.shape
    out = bk.zeros((1, n + 1, c), of_array(top.dtype).name)
    bk.kv_append(out, top.reshape(1, n, c), 0)
    bk.kv_append(out, row.reshape(1, 1, c), n)
    return out.reshape(n + 1, c)


def greedy_next(bk, logits, vocab_size, ids, pos, out=None):
    """``ids = argmax(logits[:, :vocab_size])`` (NumPy's ties: the lowest id), also into
    ``out`` (-1 there for a row whose largest logit is not finite), then ``pos += 1``:
    through the host (to_host, assign)."""
    host = np.asarray(bk.to_host(logits))[:, :vocab_size]
    choice = np.argmax(host, axis=1).astype(np.int32)
    if out is not None:   # -1: a row with no finite largest logit (a NaN comes first)
        lost = ~np.isfinite(host[np.arange(host.shape[0]), choice])
        bk.assign(out, np.where(lost, -1, choice).astype(np.int32).reshape(out.shape))
    bk.assign(ids, choice.reshape(ids.shape))
    bk.assign(pos, (np.asarray(bk.to_host(pos)) + 1).astype(np.int32).reshape(pos.shape))



# -- sampling: forge_ml.sampling's rule through the host (the GPU runs cuda/sample.cu) -----------

def penalize_logits(bk, logits, vocab_size, seen, penalties, bias=None):
    """OpenAI's logit adjustments in place (``forge_ml.sampling.adjusted`` per row), through
    the host: the first ``vocab_size`` logits of each row of float32 ``logits (B, Vp)`` get
    ``bias`` (float32 ``(B, Vp)`` or None) added, then ``frequency * (seen >> 1)`` and, where
    that count is above 0, ``presence`` taken away (``penalties (B, 2)``: presence,
    frequency)."""
    from ..sampling import adjusted
    host = np.array(bk.to_host(logits), np.float32)
    B = host.shape[0]
    sn = np.asarray(bk.to_host(seen)).reshape(B, -1)
    pen = np.asarray(bk.to_host(penalties), np.float32).reshape(B, 2)
    bs = None if bias is None else np.asarray(bk.to_host(bias), np.float32).reshape(B, -1)
    for b in range(B):
        host[b, :vocab_size] = adjusted(host[b, :vocab_size], sn[b], pen[b, 0], pen[b, 1],
                                        None if bs is None else bs[b])
    bk.assign(logits, host)


def sample_next(bk, logits, vocab_size, ids, pos, knobs, keys, seen=None, out=None):
    """A decoding step's sampled choice (``forge_ml.sampling.sample_row`` per row), through the host: ``ids``
    (and ``out``, -1 there for a row whose logit at its argmax is not finite) get the tokens, ``seen[b, token] = 1`` where given, every element of ``pos``
    goes up by one. ``knobs`` (B, 5) float32 (``SAMPLE_KNOBS``), ``keys`` (B, 2) int32 Philox
    keys (uint32 bits), ``pos`` one int32 element or one per row: the position fed, so the
    Philox counter, the position of the token chosen, is ``pos + 1``."""
    from ..sampling import penalised, sample_row
    host = np.asarray(bk.to_host(logits), np.float32)
    B = host.shape[0]
    kn = np.asarray(bk.to_host(knobs), np.float32).reshape(B, 5)
    ky = np.asarray(bk.to_host(keys)).astype(np.int64).reshape(B, 2) & 0xFFFFFFFF
    p = np.asarray(bk.to_host(pos)).reshape(-1).astype(np.int64)
    sn = None if seen is None else np.asarray(bk.to_host(seen)).reshape(B, -1)
    # each row penalised once: sample_row on those logits (no marks: no second penalty)
    pz = [penalised(host[b, :vocab_size], kn[b], None if sn is None else sn[b]) for b in range(B)]
    toks = np.array([sample_row(pz[b], kn[b], (int(ky[b, 0]), int(ky[b, 1])),
                                int(p[0] if p.size == 1 else p[b]) + 1)  # the token's position
                     for b in range(B)], np.int32)
    if out is not None:   # -1: a row whose logit at its (penalised) argmax is not finite
        lost = [not np.isfinite(host[b, int(np.argmax(pz[b]))]) for b in range(B)]
        bk.assign(out, np.where(lost, -1, toks).astype(np.int32).reshape(out.shape))
    bk.assign(ids, toks.reshape(ids.shape))
    if sn is not None:
        sn = sn.copy()
        sn[np.arange(B), toks] += 2   # (a row's token once: B distinct (row, id) pairs)
        bk.assign(seen, sn.astype(np.int32).reshape(seen.shape))
    bk.assign(pos, (p + 1).astype(np.int32).reshape(pos.shape))
