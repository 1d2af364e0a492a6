"""Element-by-element error bounds for the contract suite, from the float64 reference.

Each function returns, for one op and its inputs, an array of the op's output shape: how far a
correct kernel's result may lie from the exact one, in units of the unit roundoff u of the
arithmetic (2^-24 in float32, 2^-53 in float64; ``test_contract_ops.close`` multiplies). The
bound is the standard forward error analysis of the op's arithmetic (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2002: chapters 3 and 4): each rounding step commits a
relative error of at most u, so a result is bounded by the number of rounding steps along its
longest chain times the magnitude of the terms rounded there, which is the float64 reference
evaluated on absolute values (``|a| @ |b|`` for a product whose exact value may cancel to 0).
Non-linear steps carry their input's error through their derivative (an exp turns an absolute
error d of its argument into a relative error d of its value).

These are worst-case bounds, independent of the order a kernel adds in, with one deliberate
exception, ``acc_k``: the sums that forge-ml's kernels document as accumulated past float32 or
in blocks (sumsq for clipping over millions of gradient elements, layernorm's dgamma over every
row of a batch) are held to what that accumulation gives, whatever their length.
"""
from __future__ import annotations

import numpy as np

import reference as ref

ACC_K = 64
"""float32 sums documented as accumulated past float32 (``acc_k``) may err by this many u of
the magnitude of their terms, whatever their length: float32 partial sums over blocks of at
most a few dozen terms (the CPU's 16 rows, the GPU's per-thread runs), added in double or in a
tree, stay near the blocks' own rounding; a float32 running sum over thousands of terms does
not (its error grows with its length: ~1000u over 4096 equal blocks)."""


f64 = ref.f64


def sum_k(n: int) -> int:
    """Rounding steps of a sum of n terms in any order: each term passes through at most n - 1
    additions, plus the rounding of the terms themselves (Higham, section 4.2)."""
    return n + 1


def acc_k(n: int, dt: str) -> int:
    """``sum_k`` for a sum documented as accumulated past float32 (``ACC_K``); float64 has no
    wider type, so there it is the any-order bound."""
    return sum_k(n) if dt == "float64" else min(sum_k(n), ACC_K)


# -- products ----------------------------------------------------------------------------------

def matmul(a, b, bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None):
    """``alpha op(a) op(b) + bias``: a dot product of K terms (K products, K - 1 additions),
    then alpha and the bias, each one rounding: (K + 2) |alpha| |op(a)| |op(b)| + 2 |bias|."""
    k = (a.shape[-2] if trans_a else a.shape[-1])
    mag = ref.matmul(np.abs(f64(a)), np.abs(f64(b)), None, trans_a, trans_b, abs(alpha), b_rows)
    out = (k + 2) * mag
    return out if bias is None else out + 2 * np.abs(f64(bias))


# -- elementwise -------------------------------------------------------------------------------

GELU_K = 16
"""gelu and gelu_bwd: a float32 evaluation (the cubic, one exp or tanh, a division, the
product) commits about 6 roundings of the sizes below, and the exp or tanh turns the relative
error of its argument 2k(x + c x^3) into an error of the same size in its value; 16 allows
that with margin (the kernels stay within 4). The GPT-2 constant c off in its fourth digit
moves gelu by up to 85u |x| (at |x| near 1.5), 50u |x| and more for |x| in 1..2.5."""


EPILOGUE_GELU_K = 256
"""cuBLASLt's GELU and DGELU epilogues (the CUDA backend's matmul_gelu and matmul_dgelu in
float32) evaluate GELU their own way, which NVIDIA does not document: measured up to 37 u |x|
(GELU) and 84 u (its derivative) past the result on an H200 (2026-12-06; 1.3-3.2 times the
GELU_K bound). 256 keeps a margin; a wrong formula or constant of ours is still caught by the
composed path and by the gelu and gelu_bwd tests, which keep GELU_K."""


def gelu_k(bk, how: str) -> int:
    """GELU's rounding units for an op run ``how`` ("backend" or "composed") on ``bk``:
    EPILOGUE_GELU_K where the CUDA backend's own fused op runs cuBLASLt's epilogue."""
    return EPILOGUE_GELU_K if bk.name == "cuda" and how == "backend" else GELU_K


def gelu(x, k=GELU_K):
    """gelu(x) = x s(x) with s in [0, 1]: every term is at most |x|."""
    return k * np.abs(f64(x))


def gelu_bwd(x, dy, k=GELU_K):
    """dy (0.5 (1 + tanh u) + 0.5 x sech^2(u) u'): the two terms of the product rule, times
    |dy|; sech^2 taken as 1 - tanh^2, as kernels often form it, which errs by u tanh^2: its
    term's magnitude is 0.5 |x u'| (sech^2 + tanh^2 = 1)."""
    x = f64(x)
    u = ref.GELU_K * (x + ref.GELU_C * x ** 3)
    du = ref.GELU_K * (1.0 + 3.0 * ref.GELU_C * x * x)
    terms = 0.5 * (1.0 + np.abs(np.tanh(u))) + 0.5 * np.abs(x) * du
    return k * np.abs(f64(dy)) * terms


def gelu_slope(x):
    """|gelu'(x)|: how gelu carries an error of its input."""
    return np.abs(ref.gelu_bwd(x, np.ones_like(f64(x))))


# -- layernorm ---------------------------------------------------------------------------------

def _ln_stats(x, eps):
    """Per row of the last axis: xhat, rstd, mean |x| (float64), and the rounding units of
    rstd's relative error and of xhat's absolute error.

    The mean is a sum of C terms (error (C + 1) u mean|x|, times rstd in xhat); the variance a
    sum of C positive terms (relative (C + 2) u), halved by the square root, plus the root and
    the reciprocal: rstd's relative error e_r = C/2 + 4; xhat = (x - mean) rstd adds two."""
    x = f64(x)
    c = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    mabs = np.abs(x).mean(-1, keepdims=True)
    e_r = c / 2 + 4
    e_xhat = np.abs(xhat) * (e_r + 2) + rstd * mabs * (c + 1)
    return xhat, rstd, mabs, e_r, e_xhat


def layernorm(x, gamma, beta, eps):
    """xhat gamma + beta: xhat's error times |gamma|, and the product and the sum."""
    xhat, _, _, _, e_xhat = _ln_stats(x, eps)
    g, b = np.abs(f64(gamma)), np.abs(f64(beta))
    return g * e_xhat + 3 * (np.abs(xhat) * g + b)


def layernorm_bwd(x, gamma, dy, eps, dt):
    """(dx, dgamma, dbeta). With g = dy gamma, dx = rstd (g - mean(g) - xhat mean(g xhat)):
    rstd's relative error on every term; mean(g) a sum of C terms; mean(g xhat) a sum of C
    terms with xhat's error in each; xhat's error times mean(g xhat); three roundings to
    combine. dgamma = sum over R rows of dy xhat: ``acc_k`` (documented: the CPU adds float
    blocks of 16 rows in double, the GPU chunks of rows), plus xhat's error in each term. dbeta
    = sum over rows of dy: ``sum_k`` (CPU's NumPy path sums it in float32 BLAS)."""
    x, dy = f64(x), f64(dy)
    c = x.shape[-1]
    xhat, rstd, _, e_r, e_xhat = _ln_stats(x, eps)
    g = np.abs(dy * f64(gamma))
    mg = g.mean(-1, keepdims=True)
    mgx = (g * np.abs(xhat)).mean(-1, keepdims=True)
    terms = g + mg + np.abs(xhat) * mgx
    dx = rstd * (terms * (e_r + 3) + (c + 1) * mg
                 + np.abs(xhat) * ((c + 2) * mgx + (g * e_xhat).mean(-1, keepdims=True))
                 + e_xhat * mgx)
    rows = x.reshape(-1, c).shape[0]
    dys = np.abs(dy).reshape(-1, c)
    dgamma = (acc_k(rows, dt) * (dys * np.abs(xhat).reshape(-1, c)).sum(0)
              + (dys * e_xhat.reshape(-1, c)).sum(0))
    dbeta = sum_k(rows) * dys.sum(0)
    return dx, dgamma, dbeta


def sum_rows(x, bound=None):
    """The sum over rows of x (its magnitude |x|), each term carrying ``bound`` if given."""
    x = np.abs(f64(x)).reshape(-1, np.shape(x)[-1])
    out = sum_k(x.shape[0]) * x.sum(0)
    return out if bound is None else out + f64(bound).reshape(x.shape).sum(0)


# -- softmax -----------------------------------------------------------------------------------

def _softmax_parts(x, keep):
    """(p, m, span, n, lse) of rows of x where ``keep``: the probabilities, the row maximum,
    the largest |x - max| kept, the kept count, and the log of the sum of the exps."""
    x = f64(x)
    z = np.where(keep, x, -np.inf)
    m = z.max(-1, keepdims=True)
    e = np.where(keep, np.exp(z - m), 0.0)
    total = e.sum(-1, keepdims=True)
    span = np.where(keep, m - x, 0.0).max(-1, keepdims=True)
    n = np.broadcast_to(keep, x.shape).sum(-1, keepdims=True)
    return e / total, m, span, n, m + np.log(total)


def _softmax_rel(span, n):
    """Relative error of a softmax row's entries: each exp's argument x - max rounds (an
    absolute error u |x - max|, a relative one in the exp) and the exp itself errs by 2u; the
    normalising sum of n such terms adds n and its own terms' errors, the division one."""
    return 2 * (span + 3) + n + 2


def softmax(x, causal, off):
    keep = ref.causal_mask(x.shape[-2], x.shape[-1], off) if causal else np.ones(x.shape[-2:], bool)
    p, _, span, n, _ = _softmax_parts(x, keep)
    return p * _softmax_rel(span, n)            # 0 where masked: exactly 0 there


def logsumexp(x, causal, off):
    """max + log(sum): the sum's relative error becomes an absolute one in the log; then the
    addition rounds at |lse| and the max carries its own."""
    keep = ref.causal_mask(x.shape[-2], x.shape[-1], off) if causal else np.ones(x.shape[-2:], bool)
    _, m, span, n, lse = _softmax_parts(x, keep)
    return (_softmax_rel(span, n) + np.abs(m) + 2 * np.abs(lse))[..., 0]


def softmax_bwd(y, dy):
    """y (dy - sum(y dy)): the sum of n terms, the difference and the product."""
    y, dy = np.abs(f64(y)), np.abs(f64(dy))
    n = y.shape[-1]
    return y * (dy + (y * dy).sum(-1, keepdims=True)) * (n + 3)


# -- attention ---------------------------------------------------------------------------------

def attention(q, k, v, scale, keep, dout=None, drop=None):
    """Causal (or ``keep``-masked) attention of heads (..., T, hs) over keys (..., n, hs):
    ``(out, lse)`` bounds, and with ``dout`` also ``(dq, dk, dv)``'s. ``drop``: dropout's
    multipliers (mask times 1/(1-p)) over the probabilities, or None.

    Scores s = scale q.k: hs products and sums and the scale (hs + 1 roundings of the
    magnitude a = |scale| |q|.|k|), which the softmax turns into the relative error e of every
    probability of the row (``_softmax_rel`` plus twice the largest score error); out = P v a
    sum of n terms. The backward recomputes P from the forward's lse (its error too) and forms
    dS = P (dP - D), dP = dout v^T and D = dout.out sums of hs terms; dq = scale dS k and
    dk = scale dS^T q sums of n and T terms, dv = P^T dout of T terms."""
    q, k, v = f64(q), f64(k), f64(v)
    hs, n, t = q.shape[-1], k.shape[-2], q.shape[-2]
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    a = abs(scale) * np.einsum("...id,...jd->...ij", np.abs(q), np.abs(k))
    p, m, span, cnt, lse = _softmax_parts(s, keep)
    amax = np.where(keep, a, 0.0).max(-1, keepdims=True)
    e = _softmax_rel(span, cnt) + 2 * (hs + 1) * amax                 # (..., T, 1)
    pd = p if drop is None else p * drop
    b_out = (pd * (e + n + 3)) @ np.abs(v)
    b_lse = (e + np.abs(m) + 2 * np.abs(lse))[..., 0]
    if dout is None:
        return b_out, b_lse
    dout = f64(dout)
    out = pd @ v
    md = 1.0 if drop is None else drop
    mag = p * (md * (np.abs(dout) @ np.abs(np.swapaxes(v, -1, -2)))
               + (np.abs(dout) * np.abs(out)).sum(-1, keepdims=True))   # |terms of dS| / scale
    e_s = 2 * e + b_lse[..., None] + hs + n + 8                          # dS's relative error
    b_dq = abs(scale) * ((mag * (e_s + n + 1)) @ np.abs(k))
    b_dk = abs(scale) * (np.swapaxes(mag * (e_s + t + 1), -1, -2) @ np.abs(q))
    b_dv = np.swapaxes(pd * (e_s + t + 2), -1, -2) @ np.abs(dout)
    return b_out, b_lse, b_dq, b_dk, b_dv


def causal(t):
    return ref.causal_mask(t, t, 0)


def unsplit(dq, dk, dv):
    """dq, dk, dv bounds (..., H, T, hs) placed as the (..., T, 3C) gradient of fused rows."""
    return ref.unsplit_head(dq, 0) + ref.unsplit_head(dk, 1) + ref.unsplit_head(dv, 2)


# -- cross-entropy -----------------------------------------------------------------------------

def _xent_rows(logits, v, logit_err=None):
    """Per row: probabilities over the first v columns, their relative error (the softmax's,
    and twice the largest error of a logit), lse, and the terms of the row's loss."""
    z = f64(logits)[:, :v]
    p, _, span, cnt, lse = _softmax_parts(z, np.ones(z.shape, bool))
    e = _softmax_rel(span, cnt)
    if logit_err is not None:
        e = e + 2 * f64(logit_err)[:, :v].max(-1, keepdims=True)
    return p, e, lse


def cross_entropy(logits, targets, v, logit_err=None):
    """mean over N rows of lse - l[t]: each row's error (the sum's relative error, the max, the
    two roundings at |lse| and |l[t]|), then a sum of N terms and the division."""
    _, e, lse = _xent_rows(logits, v, logit_err)
    z = f64(logits)
    rows = np.arange(len(z))
    lt = np.abs(z[rows, targets])
    row = e[:, 0] + 2 * np.abs(lse[:, 0]) + 2 * lt
    if logit_err is not None:
        row = row + f64(logit_err)[rows, targets]
    n = len(z)
    return np.float64(row.mean() + sum_k(n) * np.abs(lse[:, 0] - z[rows, targets]).mean())


def cross_entropy_bwd(logits, targets, dloss, v, logit_err=None):
    """|dloss / N| (p (e + 3) + 2 onehot): the probabilities' error, the subtraction at the
    target and the scale (itself rounded once); exactly 0 past v."""
    p, e, _ = _xent_rows(logits, v, logit_err)
    n, vp = np.shape(logits)
    out = np.zeros((n, vp))
    out[:, :v] = p * (e + 3)
    out[np.arange(n), targets] += 2
    return abs(float(dloss) / n) * out


def linear_cross_entropy(x, w, targets, v):
    """(loss, dx, dw) of logits = x w^T, a logit a dot product of C terms, its error at most
    (C + 2) |x| |w|; the loss and dl as above with those errors (the largest of a row bounded
    by |x_r| . max_j |w_j|); dx = dl w a sum of Vp terms, dw = dl^T x of N terms: (Vp + 1) and
    (N + 1) times |dl|, plus dl's own error carried. Written over whole rows at once, with the
    probabilities formed once: the LM head's logits are large."""
    x, w = f64(x), f64(w)
    n, c = x.shape
    ax, aw = np.abs(x), np.abs(w[:v])
    rows, targets = np.arange(n), np.asarray(targets)
    z = x @ w[:v].T                                                  # (N, V) logits
    m = z.max(-1, keepdims=True)
    span = m - z.min(-1, keepdims=True)
    z -= m
    np.exp(z, out=z)
    l = z.sum(-1, keepdims=True)
    z /= l                                                           # p
    lse = m + np.log(l)
    err_max = (c + 2) * (ax @ aw.max(0))[:, None]                    # >= every logit's error
    e = _softmax_rel(span, v) + 2 * err_max                          # p's relative error
    lt = (x * w[targets]).sum(-1)
    loss_r = lse[:, 0] - lt
    row = e[:, 0] + 2 * np.abs(lse[:, 0]) + 2 * np.abs(lt) + (c + 2) * (ax * aw[targets]).sum(-1)
    b_loss = np.float64(row.mean() + sum_k(n) * np.abs(loss_r).mean())
    # dl = (p - onehot) / N: off the target |dl| = p / N with the error p (e + 3) / N, at it
    # |p - 1| / N with (p (e + 3) + 2) / N. The products take p weighted as off the target,
    # then each row's target term is corrected by the difference.
    pt = z[rows, targets]
    kx, kw = w.shape[0] + 1, n + 1
    b_dx = (e + kx + 3) * (z @ aw) + (2 + kx * (np.abs(1 - pt) - pt))[:, None] * aw[targets]
    b_dw = np.zeros(w.shape)
    b_dw[:v] = (z * (e + kw + 3)).T @ ax
    np.add.at(b_dw, targets, (2 + kw * (np.abs(1 - pt) - pt))[:, None] * ax)
    return b_loss, b_dx / n, b_dw / n


# -- AdamW -------------------------------------------------------------------------------------

def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    """(p, m, v) bounds of one AdamW step, g' = s g. m' = b1 m + (1 - b1) g': the factors
    rounded, the products and the sum, at most five roundings of its terms' magnitude (6
    allowed), and where 1 - b1 is formed from b1 rounded to the dtype (the GPU's), b1's
    rounding error u b1 in that factor: u b1 |g'| more (2 allowed). v' = b2 v + (1 - b2) g'^2
    likewise, one rounding more (8). p' = p - lr wd p - d, d = lr m_hat / (sqrt(v_hat) + eps):
    the decay and two subtractions, three roundings of |p| and one of |p'|; d carries m''s
    error, half of v''s relative error (the root), and the roundings of lr, the bias
    corrections, the quotients, the root and eps, at most eight (12 allowed)."""
    p, g, m, v = f64(p), f64(g) * grad_scale, f64(m), f64(v)
    b_m = 6 * (abs(beta1) * np.abs(m) + (1 - beta1) * np.abs(g)) + 2 * beta1 * np.abs(g)
    b_v = 8 * (beta2 * np.abs(v) + (1 - beta2) * g * g) + 2 * beta2 * g * g
    m1 = beta1 * m + (1 - beta1) * g
    v1 = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    den = np.sqrt(v1 / bc2) + eps
    d = lr * np.abs(m1) / bc1 / den
    p1 = p - lr * (m1 / bc1 / den + weight_decay * p)
    with np.errstate(divide="ignore", invalid="ignore"):
        v_rel = np.where(v1 > 0, b_v / v1, 0.0)
    b_p = 3 * np.abs(p) + np.abs(p1) + d * (12 + v_rel / 2) + lr * b_m / bc1 / den
    return b_p, b_m, b_v


# -- the rest ----------------------------------------------------------------------------------

def sumsq(x, dt):
    """A sum of squares (its terms rounded too): ``acc_k`` of the sum of the squares."""
    x = f64(x)
    return np.float64(acc_k(x.size, dt) * np.sum(x * x))


def scatter_add_rows(dst, ids, src):
    """dst[id] plus the rows with that id: a sum of (count + 1) terms for every row."""
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=np.shape(dst)[0])
    mag = ref.scatter_add_rows(np.abs(f64(dst)), ids, np.abs(f64(src)))
    return mag * sum_k(int(counts.max()) + 1)
