/* attention.c: causal attention, one head at a time: q, k, v, out, dout (nbh, t, hs), lse (nbh, t).
   Every product is C = A B with B row-major, computed by tile_4x16: a 4 x 16 block of C in
   eight 8-float registers, A's entries broadcast (A read as stored or transposed), B's rows
   loaded 16 at a time (the GEMM micro-kernel layout of BLIS, Van Zee & van de Geijn 2015).
   The causal structure skips every tile above the diagonal. When t % 4 == 0 and
   hs % 16 == 0 (GPT-2's heads) q, k, v, dout and the results are used in place; otherwise
   they go through zero-padded per-head copies (rows to a multiple of 4, columns of 16).
     forward:  S = q k^T;  P = exp(scale S - rowmax) / l, lse = rowmax + log l;  O = P v
     backward (FlashAttention, Dao et al. 2022, alg. 4): P = exp(scale S - lse),
       dP = dO v^T, D = rowsum(dO * O), dS = scale P (dP - D),
       dQ = dS k, dK = dS^T q, dV = P^T dO.
   Row i of P and dS is written on columns [0, round_up(i + 1, 8)): P is zero right of i,
   dS there is scale 0 (dP - D), NaN where dP is. The products over positions (P v, dS k,
   P^T dO, dS^T q) skip the masked entries of the diagonal blocks rather than multiply them
   by that zero: 0 * inf or NaN is NaN, so a non-finite value at a masked position would
   reach rows that cannot see it.
   The pool's items are heads; each thread has its own scratch.
*/
#include "cpu_kernels.h"

/* Pins a vector in a register. Left alone, GCC folds each use of a loaded row of B into the
   FMA as a memory operand, so tile_4x16 issued 12 loads per 8 FMAs and was load-bound
   (attention_bwd 1100 -> 660 us on the nanoGPT shapes with the pin). */
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* Which k (and, for scores, which output columns) a row block [r, r + 4) needs. */
enum { K_ALL, K_UPTO_ROW, K_FROM_ROW };

/* C[0..4, 0..16) = sum over k in [k0, k1) of A[r, k] B[k, 0..16), A[r, k] = a[r * ars + k * aks],
   plus the causal triangle k in [kd, kd + nd): row r takes k only where k - kd <= r
   (K_UPTO_ROW) or k - kd >= r (K_FROM_ROW), skipping the others, not multiplying them by 0. */
static inline void tile_4x16(const float* RESTRICT a, long ars, long aks, const float* RESTRICT b,
                             long ldb, float* RESTRICT c, long ldc, long k0, long k1, int kind,
                             long kd, long nd) {
    v8f c00 = bcast8(0.0f), c01 = c00, c10 = c00, c11 = c00;
    v8f c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    const int upto = kind == K_UPTO_ROW;
    for (long s = 0; kind == K_FROM_ROW && s < nd; ++s) {      /* the triangle before k0 */
        const long k = kd + s;
        const v8f b0 = load8(b + k * ldb), b1 = load8(b + k * ldb + 8);
        const float* ak = a + k * aks;
        const v8f a0 = bcast8(ak[0]);
        c00 += a0 * b0; c01 += a0 * b1;
        if (s >= 1) { const v8f a1 = bcast8(ak[ars]); c10 += a1 * b0; c11 += a1 * b1; }
        if (s >= 2) { const v8f a2 = bcast8(ak[2 * ars]); c20 += a2 * b0; c21 += a2 * b1; }
        if (s >= 3) { const v8f a3 = bcast8(ak[3 * ars]); c30 += a3 * b0; c31 += a3 * b1; }
    }
    for (long k = k0; k < k1; ++k) {
        v8f b0 = load8(b + k * ldb), b1 = load8(b + k * ldb + 8);
        IN_REGISTER(b0);
        IN_REGISTER(b1);
        const float* ak = a + k * aks;
        const v8f a0 = bcast8(ak[0]), a1 = bcast8(ak[ars]);
        const v8f a2 = bcast8(ak[2 * ars]), a3 = bcast8(ak[3 * ars]);
        c00 += a0 * b0; c01 += a0 * b1;
        c10 += a1 * b0; c11 += a1 * b1;
        c20 += a2 * b0; c21 += a2 * b1;
        c30 += a3 * b0; c31 += a3 * b1;
    }
    for (long s = 0; upto && s < nd; ++s) {                    /* the triangle after k1 */
        const long k = kd + s;
        const v8f b0 = load8(b + k * ldb), b1 = load8(b + k * ldb + 8);
        const float* ak = a + k * aks;
        const v8f a3 = bcast8(ak[3 * ars]);
        c30 += a3 * b0; c31 += a3 * b1;
        if (s <= 2) { const v8f a2 = bcast8(ak[2 * ars]); c20 += a2 * b0; c21 += a2 * b1; }
        if (s <= 1) { const v8f a1 = bcast8(ak[ars]); c10 += a1 * b0; c11 += a1 * b1; }
        if (s <= 0) { const v8f a0 = bcast8(ak[0]); c00 += a0 * b0; c01 += a0 * b1; }
    }
    store8(c, c00); store8(c + 8, c01);
    store8(c + ldc, c10); store8(c + ldc + 8, c11);
    store8(c + 2 * ldc, c20); store8(c + 2 * ldc + 8, c21);
    store8(c + 3 * ldc, c30); store8(c + 3 * ldc + 8, c31);
}

/* C (m4 x n16) = A (m4 x K) B (K x n16) in 4 x 16 tiles; A[r, k] = a[r * ars + k * aks].
   K_ALL: k in [0, kn), and only the column tiles at or left of the block's last row (the
   causal S and dP). K_UPTO_ROW: row i takes k in [0, i] (A is P or dS, zero right of the
   diagonal). K_FROM_ROW: row i takes k in [i, kn) (A is P^T or dS^T, zero left of it). */
static inline void gemm_tiles(const float* a, long ars, long aks, const float* b, long ldb,
                              float* c, long ldc, long m4, long n16, long kn, int kind) {
    for (long r = 0; r < m4; r += 4) {
        long k0 = 0, k1 = kn, ncols = n16;
        const long nd = kind == K_ALL ? 0 : (kn - r < 4 ? kn - r : 4);   /* the triangle */
        if (kind == K_ALL) ncols = round_up(r + 4, 16) < n16 ? round_up(r + 4, 16) : n16;
        if (kind == K_UPTO_ROW) k1 = r;
        if (kind == K_FROM_ROW) k0 = r + 4 < kn ? r + 4 : kn;
        for (long j = 0; j < ncols; j += 16)
            tile_4x16(a + r * ars, ars, aks, b + j, ldb, c + r * ldc + j, ldc, k0, k1, kind, r,
                      nd);
    }
}

/* The operands of one head: rows of hs floats, row i of x at x + i * ld. Head-major arrays
   (BH, T, hs) have ld = hs; GPT-2's fused rows have ld = 3C (q, k, v in place in the
   (B, T, 3C) qkv rows) and ld = C (the (B, T, C) output), so no head is copied out or in. */

/* The (t4 x hp) A operand for src (t rows of hs, stride ld): src itself, stride ld, when no
   padding is needed; else a zero-padded copy in dst, stride hp. */
static const float* padded(const float* RESTRICT src, long ld, long t, long hs, long t4, long hp,
                           float* RESTRICT dst, long* stride) {
    if (t == t4 && hs == hp) {
        *stride = ld;
        return src;
    }
    memset(dst, 0, sizeof(float) * (size_t)(t4 * hp));
    for (long i = 0; i < t; ++i) memcpy(dst + i * hp, src + i * ld, sizeof(float) * (size_t)hs);
    *stride = hp;
    return dst;
}

/* dst (rows of hs, stride ld) <- src (rows of hp), the first t rows. */
static void unpad(const float* RESTRICT src, long t, long hs, long hp, float* RESTRICT dst,
                  long ld) {
    for (long i = 0; i < t; ++i) memcpy(dst + i * ld, src + i * hp, sizeof(float) * (size_t)hs);
}

/* dst (hs x tp, zero padding) <- src (t rows of hs, stride ld) transposed. */
static void transpose_padded(const float* RESTRICT src, long ld, long t, long hs, long tp,
                             float* RESTRICT dst) {
    for (long d = 0; d < hs; ++d) {
        float* RESTRICT row = dst + d * tp;
        for (long j = 0; j < t; ++j) row[j] = src[j * ld + d];
        for (long j = t; j < tp; ++j) row[j] = 0.0f;
    }
}

/* Scratch floats of one head's forward and backward (see the layouts below). */
static long fwd_scratch(long t, long hs) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    return hs * tp + t4 * tp + 3 * t4 * hp + t;
}

static long bwd_scratch(long t, long hs) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    return 2 * hs * tp + 2 * t4 * tp + 6 * t4 * hp + tp;   /* + one row of dropout mask */
}

/* One head's causal attention: out (stride lo) and lse (t) from q, k, v (strides lq, lk, lv). */
static void attention_head(const float* q, long lq, const float* k, long lk, const float* v,
                           long lv, float* out, long lo, float* RESTRICT lse, long t, long hs,
                           float scale, float* scratch, const drop_t* drop) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    const long n_a = t4 * hp;
    /* kt (hs, tp); p (t4, tp); q, v, o padded copies (t4, hp) when needed; row maxima (t) */
    float *kt = scratch, *p = kt + hs * tp, *qpad = p + t4 * tp, *vpad = qpad + n_a;
    float *opad = vpad + n_a, *rowmax = opad + n_a;
    const int direct = t == t4 && hs == hp;
    long sq, sv;
    const float* qa = padded(q, lq, t, hs, t4, hp, qpad, &sq);
    const float* vb = padded(v, lv, t, hs, t4, hp, vpad, &sv);
    float* o = direct ? out : opad;
    transpose_padded(k, lk, t, hs, tp, kt);
    gemm_tiles(qa, sq, 1, kt, tp, p, tp, t4, tp, hs, K_ALL);              /* S */
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        const long n8 = round_up(i + 1, 8);
        float m = -INFINITY;
#pragma omp simd reduction(max:m)
        for (long j = 0; j < n8; ++j) {
            const float sj = j <= i ? pi[j] * scale : -INFINITY;
            m = sj > m ? sj : m;
        }
        rowmax[i] = m;
    }
    /* exp in its own loop over all rows: with the row sum in the same short loop, each row's
       polynomial chains ran one after another (1.25x slower in all) */
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        const float m = rowmax[i];
#pragma omp simd
        for (long j = 0; j < round_up(i + 1, 8); ++j)
            pi[j] = j <= i ? exp_f32(pi[j] * scale - m) : 0.0f;
    }
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        const long n8 = round_up(i + 1, 8);
        float l = 0.0f;
#pragma omp simd reduction(+:l)
        for (long j = 0; j < n8; ++j) l += pi[j];
        const float inv = 1.0f / l;
#pragma omp simd
        for (long j = 0; j < n8; ++j) pi[j] *= inv;
        lse[i] = rowmax[i] + logf(l);
        if (drop) dropout_span(pi, pi, i + 1, drop->base + (uint64_t)(i * t), drop);  /* P M */
    }
    gemm_tiles(p, tp, 1, vb, sv, o, direct ? lo : hp, t4, hp, t, K_UPTO_ROW);  /* P v */
    if (!direct) unpad(opad, t, hs, hp, out, lo);
}

/* One head's backward: dq (stride lq), dk, dv (stride lk) from q, k, v, out, dout (strides lq,
   lk, lk, lo, lo) and lse. */
static void attention_bwd_head(const float* q, long lq, const float* k, const float* v, long lk,
                               const float* out, const float* dout, long lo,
                               const float* RESTRICT lse, float* dq, float* dk, float* dv,
                               long t, long hs, float scale, float* scratch, const drop_t* drop) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    const long n_a = t4 * hp, n_t = hs * tp, n_s = t4 * tp;
    /* kt, vt (hs, tp); p, ds (t4, tp); q, k, dout, dq, dk, dv padded copies (t4, hp) */
    float *kt = scratch, *vt = kt + n_t, *p = vt + n_t, *ds = p + n_s;
    float *qpad = ds + n_s, *kpad = qpad + n_a, *dopad = kpad + n_a;
    float *dqpad = dopad + n_a, *dkpad = dqpad + n_a, *dvpad = dkpad + n_a;
    const int direct = t == t4 && hs == hp;
    long sq, sk, sdo;
    const float* qa = padded(q, lq, t, hs, t4, hp, qpad, &sq);
    const float* ka = padded(k, lk, t, hs, t4, hp, kpad, &sk);
    const float* doa = padded(dout, lo, t, hs, t4, hp, dopad, &sdo);
    float* dqc = direct ? dq : dqpad;
    float* dkc = direct ? dk : dkpad;
    float* dvc = direct ? dv : dvpad;
    const long lq_out = direct ? lq : hp, lk_out = direct ? lk : hp;
    transpose_padded(k, lk, t, hs, tp, kt);
    transpose_padded(v, lk, t, hs, tp, vt);
    gemm_tiles(qa, sq, 1, kt, tp, p, tp, t4, tp, hs, K_ALL);              /* S */
    gemm_tiles(doa, sdo, 1, vt, tp, ds, tp, t4, tp, hs, K_ALL);           /* dP */
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        float* RESTRICT dsi = ds + i * tp;
        const float* RESTRICT doi = dout + i * lo;
        const float* RESTRICT oi = out + i * lo;
        const long n8 = round_up(i + 1, 8);
        float di = 0.0f;                                                  /* D_i */
#pragma omp simd reduction(+:di)
        for (long d = 0; d < hs; ++d) di += doi[d] * oi[d];
        const float li = lse[i];
        if (drop) {
            /* with dropout M (keep / (1-p), else 0): dV = (P M)^T dO, dP = (dO V^T) M,
               dS = P (dP - D); D_i = dO_i . O_i still, O holding the mask */
            float* RESTRICT mi = dqpad + n_a * 3;          /* one row of the mask */
            for (long j = 0; j < n8; ++j) mi[j] = 1.0f;
            dropout_span(mi, mi, i + 1, drop->base + (uint64_t)(i * t), drop);
#pragma omp simd
            for (long j = 0; j < n8; ++j) {
                const float pj = j <= i ? exp_f32(pi[j] * scale - li) : 0.0f;
                const float mj = j <= i ? mi[j] : 0.0f;
                pi[j] = pj * mj;
                dsi[j] = scale * pj * (dsi[j] * mj - di);
            }
            continue;
        }
#pragma omp simd
        for (long j = 0; j < n8; ++j) {
            const float pj = j <= i ? exp_f32(pi[j] * scale - li) : 0.0f;
            pi[j] = pj;
            dsi[j] = scale * pj * (dsi[j] - di);
        }
    }
    gemm_tiles(ds, tp, 1, ka, sk, dqc, lq_out, t4, hp, t, K_UPTO_ROW);    /* dS k */
    gemm_tiles(ds, 1, tp, qa, sq, dkc, lk_out, t4, hp, t, K_FROM_ROW);    /* dS^T q */
    gemm_tiles(p, 1, tp, doa, sdo, dvc, lk_out, t4, hp, t, K_FROM_ROW);   /* P^T dO */
    if (!direct) {
        unpad(dqpad, t, hs, hp, dq, lq);
        unpad(dkpad, t, hs, hp, dk, lk);
        unpad(dvpad, t, hs, hp, dv, lk);
    }
}

/* The pool's attention jobs: one item per head, forward or backward (bwd). Head-major
   (BH, T, hs) arrays (fused == 0: q, k, v, out, dout and the gradients; lse (BH, T)) or
   GPT-2's fused rows (fused == 1: qkv (B, T, 3C) in q, head h of q, k, v at channels h*hs,
   C + h*hs, 2C + h*hs, dqkv likewise in dq; y, dy (B, T, C) in out / o and dout; lse
   (B, H, T)). Each thread allocates its own scratch. */
typedef struct {
    const float *q, *k, *v, *out, *lse, *dout;     /* fused: q is qkv, out is y, dout is dy */
    float *o, *lse_out, *dq, *dk, *dv;            /* fused: dq is dqkv */
    long nh, t, hs;                                /* nh: heads per batch row (fused) */
    int fused, bwd;
    float scale;
    const drop_t* drop;
    int failed;
} attn_ctx;

static void attention_task(void* vctx, work_t* w) {
    attn_ctx* a = vctx;
    const long t = a->t, hs = a->hs, c = a->nh * hs;
    float* scratch = calloc((size_t)(a->bwd ? bwd_scratch(t, hs) : fwd_scratch(t, hs)),
                            sizeof(float));
    if (!scratch) {
        task_failed(&a->failed);
        return;
    }
    long h0 = 0, h1 = 0;
    while (work_take(w, &h0, &h1))
        for (long bh = h0; bh < h1; ++bh) {
            /* head bh's first row: iq in q, k, v and their gradients (row stride lq), io in
               the output, dout and y (row stride lo) */
            const long b = bh / a->nh, h = bh % a->nh;
            const long iq = a->fused ? b * t * 3 * c + h * hs : bh * t * hs;
            const long io = a->fused ? b * t * c + h * hs : bh * t * hs;
            const long lq = a->fused ? 3 * c : hs, lo = a->fused ? c : hs;
            const float* q = a->q + iq;
            const float* k = a->fused ? q + c : a->k + iq;
            const float* v = a->fused ? q + 2 * c : a->v + iq;
            drop_t d;                 /* element (i, j) of the head's P: ((b H + h) t + i) t + j */
            if (a->drop) {
                d = *a->drop;
                d.base = (uint64_t)(bh * t) * (uint64_t)t;
            }
            const drop_t* dp = a->drop ? &d : NULL;
            if (a->bwd) {
                float* dq = a->dq + iq;
                float* dk = a->fused ? dq + c : a->dk + iq;
                float* dv = a->fused ? dq + 2 * c : a->dv + iq;
                attention_bwd_head(q, lq, k, v, lq, a->out + io, a->dout + io, lo, a->lse + bh * t,
                                   dq, dk, dv, t, hs, a->scale, scratch, dp);
            } else {
                attention_head(q, lq, k, lq, v, lq, a->o + io, lo, a->lse_out + bh * t, t, hs,
                               a->scale, scratch, dp);
            }
        }
    free(scratch);
}

/* Head-major (BH, T, hs) q, k, v, out; lse (BH, T). */
int attention_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                  float* RESTRICT out, float* RESTRICT lse, long nbh, long t, long hs,
                  float scale) {
    attn_ctx a = {q, k, v, NULL, NULL, NULL, out, lse, NULL, NULL, NULL, 1, t, hs, 0, 0, scale,
                  NULL, 0};
    pool_run(attention_task, &a, nbh, 1);
    return a.failed ? -1 : 0;
}

int attention_bwd_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                      const float* RESTRICT out, const float* RESTRICT lse,
                      const float* RESTRICT dout, float* RESTRICT dq, float* RESTRICT dk,
                      float* RESTRICT dv, long nbh, long t, long hs, float scale) {
    attn_ctx a = {q, k, v, out, lse, dout, NULL, NULL, dq, dk, dv, 1, t, hs, 0, 1, scale, NULL,
                  0};
    pool_run(attention_task, &a, nbh, 1);
    return a.failed ? -1 : 0;
}

/* GPT-2's fused rows (above). The _dropout_ forms apply dropout at rate p (scale 1/(1-p),
   Philox key (k0, k1)) to the probabilities, the mask of forge_ml.rng over (B, H, T, T). */
static int attention_qkv_run(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse,
                             long nb, long t, long nh, long hs, float scale, const drop_t* drop) {
    attn_ctx a = {qkv, NULL, NULL, NULL, NULL, NULL, y, lse, NULL, NULL, NULL, nh, t, hs, 1, 0,
                  scale, drop, 0};
    pool_run(attention_task, &a, nb * nh, 1);
    return a.failed ? -1 : 0;
}

static int attention_qkv_bwd_run(const float* RESTRICT qkv, const float* RESTRICT y,
                                 const float* RESTRICT lse, const float* RESTRICT dy,
                                 float* RESTRICT dqkv, long nb, long t, long nh, long hs,
                                 float scale, const drop_t* drop) {
    attn_ctx a = {qkv, NULL, NULL, y, lse, dy, NULL, NULL, dqkv, NULL, NULL, nh, t, hs, 1, 1,
                  scale, drop, 0};
    pool_run(attention_task, &a, nb * nh, 1);
    return a.failed ? -1 : 0;
}

int attention_qkv_f32(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse, long nb,
                      long t, long nh, long hs, float scale) {
    return attention_qkv_run(qkv, y, lse, nb, t, nh, hs, scale, NULL);
}

int attention_qkv_bwd_f32(const float* RESTRICT qkv, const float* RESTRICT y,
                          const float* RESTRICT lse, const float* RESTRICT dy,
                          float* RESTRICT dqkv, long nb, long t, long nh, long hs, float scale) {
    return attention_qkv_bwd_run(qkv, y, lse, dy, dqkv, nb, t, nh, hs, scale, NULL);
}

int attention_qkv_dropout_f32(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse,
                              long nb, long t, long nh, long hs, float scale, float p,
                              float p_scale, uint32_t k0, uint32_t k1) {
    const drop_t d = {0, k0, k1, p, p_scale};
    return attention_qkv_run(qkv, y, lse, nb, t, nh, hs, scale, &d);
}

int attention_qkv_dropout_bwd_f32(const float* RESTRICT qkv, const float* RESTRICT y,
                                  const float* RESTRICT lse, const float* RESTRICT dy,
                                  float* RESTRICT dqkv, long nb, long t, long nh, long hs,
                                  float scale, float p, float p_scale, uint32_t k0, uint32_t k1) {
    const drop_t d = {0, k0, k1, p, p_scale};
    return attention_qkv_bwd_run(qkv, y, lse, dy, dqkv, nb, t, nh, hs, scale, &d);
}

