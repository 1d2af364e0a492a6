/* kernels.c: fused float32 loops behind backends/cpu/__init__.py (built with pool.c, gemm.c
   and attention.c by native.py; what they share is in cpu_kernels.h).

   NumPy runs one C loop per ufunc, so a GELU or a layernorm is 7-16 passes over memory; these
   functions do each op in one or two passes. They compute what the NumPy kernels in
   reference.py compute (those stay the readable reference and the fallback); __init__.py
   calls them only for C-contiguous float32 arrays. The larger kernels share their work
   (blocks of rows, chunks of elements) among the thread pool (pool.c); an item's arithmetic
   never depends on which thread takes it, so every result is the same bits for every thread
   count. Nothing is allocated but small per-call scratch. */
#include "cpu_kernels.h"

/* Exposed for the tests: y[i] = exp_f32(x[i]). */
void exp_f32_array(const float* RESTRICT x, float* RESTRICT y, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) y[i] = exp_f32(x[i]);
}

/* ----------------------------------------------------------------------------------------
   gelu and its backward (the loops, gelu_span and gelu_bwd_span, are in cpu_kernels.h). The
   pool's items are chunks of ELEMS_GRAIN elements (a multiple of 64: every chunk but the last
   starts and ends on the vector loop's own boundaries).
   ---------------------------------------------------------------------------------------- */
typedef struct { const float *x, *dy; float* out; } gelu_ctx;

static void gelu_task(void* vctx, work_t* w) {
    const gelu_ctx* g = vctx;
    long b, e;
    while (work_take(w, &b, &e)) gelu_span(g->x + b, g->out + b, e - b);
}

static void gelu_bwd_task(void* vctx, work_t* w) {
    const gelu_ctx* g = vctx;
    long b, e;
    while (work_take(w, &b, &e)) gelu_bwd_span(g->x + b, g->dy + b, g->out + b, e - b);
}

void gelu_f32(const float* RESTRICT x, float* RESTRICT y, long n) {
    gelu_ctx g = {x, NULL, y};
    pool_run(gelu_task, &g, n, ELEMS_GRAIN);
}

void gelu_bwd_f32(const float* RESTRICT x, const float* RESTRICT dy, float* RESTRICT dx,
                  long n) {
    gelu_ctx g = {x, dy, dx};
    pool_run(gelu_bwd_task, &g, n, ELEMS_GRAIN);
}

/* ----------------------------------------------------------------------------------------
   layernorm over rows of c, biased variance, two passes for the statistics (mean, then the
   corrected sums of x - mean), as reference.py's _layernorm_stats. Each loop iteration owns one row.
   The backward is the textbook form, per row:
     dx = rstd (g - mean(g) - xhat mean(g xhat)),  g = dy gamma,
   and dgamma = sum over rows of dy xhat, dbeta = sum of dy (float sums over blocks of 16
   rows, added up in double). With `add` (not NULL: layernorm_bwd_add) dx + add is written,
   in the same pass.
   ---------------------------------------------------------------------------------------- */
static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* mean and 1/sqrt(var + eps) of one row. The sums run in four 8-float partial sums (then
   the scalar tail): a single `omp simd` accumulator made each sum one latency-bound chain
   of c/8 adds, and the statistics were most of the layernorm's time. */
static inline void row_stats(const float* RESTRICT xr, long c, float eps, float* mean_out,
                             float* rstd_out) {
    const long c32 = c / 32 * 32;
    v8f a0 = bcast8(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (long j = 0; j < c32; j += 32) {
        a0 += load8(xr + j);
        a1 += load8(xr + j + 8);
        a2 += load8(xr + j + 16);
        a3 += load8(xr + j + 24);
    }
    float s = hsum8((a0 + a1) + (a2 + a3));
    for (long j = c32; j < c; ++j) s += xr[j];
    const float m0 = s / (float)c;
    /* the second pass sums d = x - m0 and d^2; the corrected two-pass form (Chan, Golub and
       LeVeque) takes the rounding error of m0 out of both the mean and the variance: a
       constant row gets mean = its value and var = 0 exactly (its y is beta), where m0 alone
       left a residue that 1/sqrt(eps) made 0.2 at values near 1000 */
    const v8f m = bcast8(m0);
    v8f b0 = bcast8(0.0f), b1 = b0, b2 = b0, b3 = b0;
    a0 = a1 = a2 = a3 = bcast8(0.0f);
    for (long j = 0; j < c32; j += 32) {
        const v8f d0 = load8(xr + j) - m, d1 = load8(xr + j + 8) - m;
        const v8f d2 = load8(xr + j + 16) - m, d3 = load8(xr + j + 24) - m;
        a0 += d0 * d0;
        a1 += d1 * d1;
        a2 += d2 * d2;
        a3 += d3 * d3;
        b0 += d0;
        b1 += d1;
        b2 += d2;
        b3 += d3;
    }
    float ss = hsum8((a0 + a1) + (a2 + a3)), sd = hsum8((b0 + b1) + (b2 + b3));
    for (long j = c32; j < c; ++j) {
        const float d = xr[j] - m0;
        ss += d * d;
        sd += d;
    }
    const float cd = sd / (float)c;
    const float var = ss / (float)c - cd * cd;
    *mean_out = m0 + cd;
    /* a variance past float's range (inf, or inf - inf) is none: NaN, so the row's output is
       NaN rather than beta (1 / sqrt(inf) is 0); common.cuh's ln_correct, the reference */
    *rstd_out = var < INFINITY ? 1.0f / sqrtf((var > 0.0f ? var : 0.0f) + eps) : NAN;
}

typedef struct {
    const float *x, *gamma, *beta, *dy, *add;
    float *y, *partial;             /* forward: y; backward: dx, and per-block dgamma, dbeta */
    long rows, c;
    float eps;
    long nsum;                      /* backward: the sums a block keeps, 2 (dgamma, dbeta) or 3
                                       (and dx's column sums) */
} ln_ctx;

static void layernorm_task(void* vctx, work_t* w) {
    const ln_ctx* a = vctx;
    const long c = a->c;
    long r0, r1;
    while (work_take(w, &r0, &r1))
        for (long r = r0; r < r1; ++r) {
            const float* xr = a->x + r * c;
            float* yr = a->y + r * c;
            float mean, rstd;
            row_stats(xr, c, a->eps, &mean, &rstd);
#pragma omp simd
            for (long j = 0; j < c; ++j) yr[j] = (xr[j] - mean) * rstd * a->gamma[j] + a->beta[j];
        }
}

void layernorm_f32(const float* RESTRICT x, const float* RESTRICT gamma,
                   const float* RESTRICT beta, float* RESTRICT y, long rows, long c,
                   float eps) {
    ln_ctx a = {x, gamma, beta, NULL, NULL, y, NULL, rows, c, eps, 0};
    pool_run(layernorm_task, &a, rows, rows_grain(c));
}

/* dgamma, dbeta: float partial sums over blocks of LN_BLOCK rows (the pool's items), added
   into double sums in block order by the caller (per-element double accumulation cost 4
   read-modify-writes per 8 elements). */
#define LN_BLOCK 16

static void layernorm_bwd_task(void* vctx, work_t* w) {
    const ln_ctx* a = vctx;
    const long c = a->c;
    long b0, b1;
    while (work_take(w, &b0, &b1))
        for (long blk = b0; blk < b1; ++blk) {
            float* RESTRICT fg = a->partial + blk * a->nsum * c;  /* this block's dgamma */
            float* RESTRICT fb = fg + c;                          /* and dbeta */
            float* RESTRICT fs = a->nsum == 3 ? fb + c : NULL;    /* and dx's sums */
            const long r_end = (blk + 1) * LN_BLOCK < a->rows ? (blk + 1) * LN_BLOCK : a->rows;
            for (long r = blk * LN_BLOCK; r < r_end; ++r) {
                const float* xr = a->x + r * c;
                const float* dyr = a->dy + r * c;
                const float* RESTRICT gamma = a->gamma;
                float* dxr = a->y + r * c;
                float mean, rstd;
                row_stats(xr, c, a->eps, &mean, &rstd);
                float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+:sg, sgx)
                for (long j = 0; j < c; ++j) {
                    const float xhat = (xr[j] - mean) * rstd;
                    const float g = dyr[j] * gamma[j];
                    sg += g;
                    sgx += g * xhat;
                    fg[j] += dyr[j] * xhat;
                    fb[j] += dyr[j];
                }
                const float mg = sg / (float)c, mgx = sgx / (float)c;
                if (a->add) {   /* dx + the gradient x already has (layernorm_bwd_add): one pass */
                    const float* ar = a->add + r * c;
#pragma omp simd
                    for (long j = 0; j < c; ++j) {
                        const float xhat = (xr[j] - mean) * rstd;
                        const float d = rstd * (dyr[j] * gamma[j] - mg - xhat * mgx);
                        dxr[j] = ar[j] + d;
                    }
                } else {
#pragma omp simd
                    for (long j = 0; j < c; ++j) {
                        const float xhat = (xr[j] - mean) * rstd;
                        dxr[j] = rstd * (dyr[j] * gamma[j] - mg - xhat * mgx);
                    }
                }
                if (fs) {       /* the row just written, while it is in L1 */
#pragma omp simd
                    for (long j = 0; j < c; ++j) fs[j] += dxr[j];
                }
            }
        }
}

/* sums, where not NULL, gets dx's column sums (sum_rows(dx), the bias gradient of the linear
   layer whose output x is), summed as dgamma and dbeta are. Returns 0, or -1 when the block
   sums cannot be allocated. */
int layernorm_bwd_f32(const float* RESTRICT x, const float* RESTRICT gamma,
                      const float* RESTRICT dy, const float* RESTRICT add, float* RESTRICT dx,
                      float* RESTRICT dgamma, float* RESTRICT dbeta, float* RESTRICT sums,
                      long rows, long c, float eps) {
    const long blocks = (rows + LN_BLOCK - 1) / LN_BLOCK, nsum = sums ? 3 : 2;
    double* acc = calloc((size_t)(nsum * c), sizeof(double));     /* dgamma, dbeta[, sums] */
    float* partial = calloc((size_t)(blocks * nsum * c), sizeof(float));   /* per block */
    if (!acc || !partial) {
        free(acc);
        free(partial);
        return -1;
    }
    ln_ctx a = {x, gamma, NULL, dy, add, dx, partial, rows, c, eps, nsum};
    const long grain = rows_grain(c) / LN_BLOCK > 1 ? rows_grain(c) / LN_BLOCK : 1;
    pool_run(layernorm_bwd_task, &a, blocks, grain);
    for (long blk = 0; blk < blocks; ++blk) {
        const float* RESTRICT fg = partial + blk * nsum * c;
#pragma omp simd
        for (long j = 0; j < nsum * c; ++j) acc[j] += fg[j];
    }
    for (long j = 0; j < c; ++j) {
        dgamma[j] = (float)acc[j];
        dbeta[j] = (float)acc[c + j];
        if (sums) sums[j] = (float)acc[2 * c + j];
    }
    free(acc);
    free(partial);
    return 0;
}

/* ----------------------------------------------------------------------------------------
   cross-entropy over rows of vp logits whose first v columns are the vocabulary, as
   reference.py's cross_entropy and cross_entropy_bwd, per row with m its max over [0, v):
     row_loss = log(sum_j exp(l_j - m)) - (l_t - m)                       (row_loss not NULL)
     dl_j = exp(l_j - m) (scale / sum) for j < v, 0 beyond; dl_t -= scale   (dl not NULL)
   dl may be the logits themselves (each row is read whole before it is written). Items:
   rows. Returns -1 (nothing to trust) when a target is outside [0, v).
   ---------------------------------------------------------------------------------------- */
typedef struct {
    const float* logits;
    const int64_t* targets;
    long vp, v;
    float scale;
    float *row_loss, *dl;
    int failed;
} xent_ctx;

static void xent_task(void* vctx, work_t* w) {
    xent_ctx* x = vctx;
    const long vp = x->vp, v = x->v;
    long r0, r1;
    while (work_take(w, &r0, &r1))
        for (long r = r0; r < r1; ++r) {
            const float* l = x->logits + r * vp;
            const int64_t t = x->targets[r];
            if (t < 0 || t >= v) {
                task_failed(&x->failed);
                continue;
            }
            float m = -INFINITY;
#pragma omp simd reduction(max:m)
            for (long j = 0; j < v; ++j) m = l[j] > m ? l[j] : m;
            const float lt = l[t];
            float s = 0.0f;
            if (x->dl) {
                float* d = x->dl + r * vp;
#pragma omp simd reduction(+:s)
                for (long j = 0; j < v; ++j) {
                    const float e = exp_f32(l[j] - m);
                    d[j] = e;
                    s += e;
                }
                const float k = x->scale / s;
#pragma omp simd
                for (long j = 0; j < v; ++j) d[j] *= k;
                for (long j = v; j < vp; ++j) d[j] = 0.0f;
                d[t] -= x->scale;
            } else {
#pragma omp simd reduction(+:s)
                for (long j = 0; j < v; ++j) s += exp_f32(l[j] - m);
            }
            if (x->row_loss) x->row_loss[r] = logf(s) - (lt - m);
        }
}

int xent_f32(const float* logits, const int64_t* targets, long n, long vp, long v, float scale,
             float* row_loss, float* dl) {
    xent_ctx x = {logits, targets, vp, v, scale, row_loss, dl, 0};
    pool_run(xent_task, &x, n, rows_grain(v));
    return x.failed ? -1 : 0;
}

/* ----------------------------------------------------------------------------------------
   dst[ids[i]] += src[i] for rows of c, as reference.py's scatter_add_rows: the rows of a
   repeated id are summed first (here in order of i; NumPy's reduceat sums them pairwise),
   then added, so each row of dst is written once. ids are grouped by a stable counting sort; items: the distinct ids. Returns -1, with
   dst untouched, when an id is outside [0, rows) or the scratch cannot be allocated (every
   allocation comes before the first write: a fallback after a partial add would add twice).
   ---------------------------------------------------------------------------------------- */
typedef struct {
    float* dst;
    const float* src;
    const int64_t* ids;
    const long *order, *start;      /* rows of src grouped by id; group g is order[start[g]..start[g+1]) */
    long c;
    float* sums;                    /* POOL_MAX rows of c: one per task, for a group's sum */
    int next_sum;                   /* atomic: the next free row of sums */
} scatter_ctx;

static void scatter_task(void* vctx, work_t* w) {
    scatter_ctx* s = vctx;
    const long c = s->c;
    float* tmp = s->sums + __atomic_fetch_add(&s->next_sum, 1, __ATOMIC_RELAXED) * c;
    long g0, g1;
    while (work_take(w, &g0, &g1))
        for (long g = g0; g < g1; ++g) {
            const long* o = s->order + s->start[g];
            const long count = s->start[g + 1] - s->start[g];
            float* RESTRICT d = s->dst + s->ids[o[0]] * c;
            const float* RESTRICT first = s->src + o[0] * c;
            if (count == 1) {
#pragma omp simd
                for (long j = 0; j < c; ++j) d[j] += first[j];
                continue;
            }
            memcpy(tmp, first, sizeof(float) * (size_t)c);
            for (long i = 1; i < count; ++i) {
                const float* RESTRICT row = s->src + o[i] * c;
#pragma omp simd
                for (long j = 0; j < c; ++j) tmp[j] += row[j];
            }
#pragma omp simd
            for (long j = 0; j < c; ++j) d[j] += tmp[j];
        }
}

int scatter_add_rows_f32(float* dst, long rows, const int64_t* ids, const float* src, long n, long c) {
    for (long i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
    long* count = calloc((size_t)rows + 1, sizeof(long));
    long* order = malloc(sizeof(long) * (size_t)(n > 0 ? n : 1));
    long* start = malloc(sizeof(long) * (size_t)(n + 1));
    float* sums = malloc(sizeof(float) * (size_t)(POOL_MAX * c));   /* before any write to dst */
    if (!count || !order || !start || !sums) {
        free(count);
        free(order);
        free(start);
        free(sums);
        return -1;
    }
    for (long i = 0; i < n; ++i) count[ids[i] + 1]++;
    long groups = 0;
    for (long r = 0; r < rows; ++r) {            /* count[r] becomes id r's first slot */
        if (count[r + 1]) start[groups++] = count[r];
        count[r + 1] += count[r];
    }
    start[groups] = n;
    for (long i = 0; i < n; ++i) order[count[ids[i]]++] = i;   /* stable */
    scatter_ctx s = {dst, src, ids, order, start, c, sums, 0};
    pool_run(scatter_task, &s, groups, groups / 64 > 1 ? groups / 64 : 1);
    free(count);
    free(order);
    free(start);
    free(sums);
    return 0;
}

/* ----------------------------------------------------------------------------------------
   sum of squares for global-norm clipping: each square of a float32 is exact in double, and
   the sum runs in double over 8 lanes. One call owns the flat range [0, n).
   ---------------------------------------------------------------------------------------- */
double sumsq_f32(const float* RESTRICT x, long n) {
    double s = 0.0;
#pragma omp simd reduction(+:s)
    for (long i = 0; i < n; ++i) s += (double)x[i] * (double)x[i];
    return s;
}

/* ----------------------------------------------------------------------------------------
   AdamW, one parameter tensor in place, in reference.py's adamw_update's folded form:
     g' = grad_scale g;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2;
     p = decay p - m / (sqrt(v) a + c),  a = bc1 / (lr sqrt(bc2)),  c = eps bc1 / lr.
   The caller folds the scalars: c1 = (1 - b1) grad_scale, c2 = (1 - b2) grad_scale^2.
   update = 0 (lr == 0) moves the moments only. Each call owns the flat range [0, n).
   ---------------------------------------------------------------------------------------- */
void adamw_f32(float* RESTRICT p, const float* RESTRICT g, float* RESTRICT m,
               float* RESTRICT v, long n, float b1, float c1, float b2, float c2, float a,
               float c, float decay, int update) {
    if (!update) {
#pragma omp simd
        for (long i = 0; i < n; ++i) {
            m[i] = b1 * m[i] + c1 * g[i];
            v[i] = b2 * v[i] + c2 * (g[i] * g[i]);
        }
        return;
    }
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        const float mi = b1 * m[i] + c1 * g[i];
        const float vi = b2 * v[i] + c2 * (g[i] * g[i]);
        m[i] = mi;
        v[i] = vi;
        p[i] = decay * p[i] - mi / (sqrtf(vi) * a + c);
    }
}

/* ----------------------------------------------------------------------------------------
   The optimizer's step over every parameter in one call (a model's 50-odd tensors cost one
   call instead of one each): adamw_f32 on tensor k with its own a[k], c[k] and decay[k] (its
   step's bias corrections, its weight decay); sumsq_many_f32 writes sumsq_f32 of each tensor,
   rounded to float, into out[k]. Pointers come as 64-bit integers. The same arithmetic as the
   one-tensor calls, so the same bits.
   ---------------------------------------------------------------------------------------- */
typedef struct {
    const int64_t *p, *g, *m, *v, *n;
    long count;
    long* first;                    /* the first chunk of tensor k; first[count] = all chunks */
    float b1, c1, b2, c2;
    const float *a, *c, *decay;
    int update;
    float* out;                     /* sumsq_many */
} many_ctx;

/* The pool's items for AdamW: chunks of ELEMS_GRAIN elements, each inside one tensor. */
static void adamw_many_task(void* vctx, work_t* w) {
    const many_ctx* x = vctx;
    long i0, i1;
    while (work_take(w, &i0, &i1))
        for (long i = i0; i < i1; ++i) {
            long lo = 0, hi = x->count - 1;         /* the tensor k with first[k] <= i < first[k+1] */
            while (lo < hi) {
                const long mid = (lo + hi + 1) / 2;
                if (x->first[mid] <= i) lo = mid; else hi = mid - 1;
            }
            const long k = lo, off = (i - x->first[k]) * ELEMS_GRAIN;
            const long n = (long)x->n[k] - off < ELEMS_GRAIN ? (long)x->n[k] - off : ELEMS_GRAIN;
            adamw_f32((float*)(intptr_t)x->p[k] + off, (const float*)(intptr_t)x->g[k] + off,
                      (float*)(intptr_t)x->m[k] + off, (float*)(intptr_t)x->v[k] + off, n,
                      x->b1, x->c1, x->b2, x->c2, x->a[k], x->c[k], x->decay[k], x->update);
        }
}

void adamw_many_f32(long count, const int64_t* p, const int64_t* g, const int64_t* m,
                    const int64_t* v, const int64_t* n, float b1, float c1, float b2, float c2,
                    const float* a, const float* c, const float* decay, int update) {
    long* first = malloc(sizeof(long) * (size_t)(count + 1));
    if (!first) {              /* one tensor after another on this thread */
        for (long k = 0; k < count; ++k)
            adamw_f32((float*)(intptr_t)p[k], (const float*)(intptr_t)g[k], (float*)(intptr_t)m[k],
                      (float*)(intptr_t)v[k], (long)n[k], b1, c1, b2, c2, a[k], c[k], decay[k],
                      update);
        return;
    }
    first[0] = 0;
    for (long k = 0; k < count; ++k) first[k + 1] = first[k] + ((long)n[k] + ELEMS_GRAIN - 1) / ELEMS_GRAIN;
    many_ctx x = {p, g, m, v, n, count, first, b1, c1, b2, c2, a, c, decay, update, NULL};
    pool_run(adamw_many_task, &x, first[count], 1);
    free(first);
}

/* sumsq_many's items: whole tensors (a split would change the order of the sum). */
static void sumsq_many_task(void* vctx, work_t* w) {
    const many_ctx* x = vctx;
    long k0, k1;
    while (work_take(w, &k0, &k1))
        for (long k = k0; k < k1; ++k)
            x->out[k] = (float)sumsq_f32((const float*)(intptr_t)x->p[k], (long)x->n[k]);
}

void sumsq_many_f32(long count, const int64_t* x, const int64_t* n, float* out) {
    many_ctx c = {x, NULL, NULL, NULL, n, count, NULL, 0, 0, 0, 0, NULL, NULL, NULL, 0, out};
    pool_run(sumsq_many_task, &c, count, 1);
}

/* ----------------------------------------------------------------------------------------
   dropout with forge_ml.rng's Philox4x32-10 stream, bit for bit (rng.py, dropout.cu):
     key = (k0, k1), counter of element i = (i/4 lo, i/4 hi, 0, 0), word = philox[i % 4],
     keep = (word >> 8) 2^-24 >= p (exact in float), y = keep ? x scale : 0.
   One Philox call per group of 4 elements; the backward is the same call on dy. Each call
   owns the flat range [0, n).
   ---------------------------------------------------------------------------------------- */
#define PHILOX_LANES 16

/* Philox4x32-10 on PHILOX_LANES counters at once (lane l: words c0[l]..c3[l]), written so the
   compiler vectorizes across lanes (32x32->64 multiplies: vpmuludq on AVX2). */
static inline void philox_lanes(uint32_t* RESTRICT c0, uint32_t* RESTRICT c1,
                                uint32_t* RESTRICT c2, uint32_t* RESTRICT c3,
                                uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
#pragma omp simd
        for (int l = 0; l < PHILOX_LANES; ++l) {
            const uint64_t p0 = (uint64_t)0xD2511F53u * c0[l];
            const uint64_t p1 = (uint64_t)0xCD9E8D57u * c2[l];
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[l] ^ k0;
            const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[l] ^ k1;
            c1[l] = (uint32_t)p1;
            c3[l] = (uint32_t)p0;
            c0[l] = n0;
            c2[l] = n2;
        }
    }
}

/* y[j] = keep(first + j) ? x[j] scale : 0 for j in [0, n): the mask of stream indices first..
   (x == y is allowed: the attention applies it to a row of P in place). */
void dropout_span(const float* x, float* y, long n, uint64_t first, const drop_t* d) {
    uint32_t c0[PHILOX_LANES], c1[PHILOX_LANES], c2[PHILOX_LANES], c3[PHILOX_LANES];
    uint32_t words[4 * PHILOX_LANES];                 /* the block's words in element order */
    const uint64_t end = first + (uint64_t)n;
    for (uint64_t g0 = first / 4; 4 * g0 < end; g0 += PHILOX_LANES) {
        for (int l = 0; l < PHILOX_LANES; ++l) {       /* counter of group g0 + l */
            const uint64_t g = g0 + (uint64_t)l;
            c0[l] = (uint32_t)(g & 0xffffffffu);
            c1[l] = (uint32_t)(g >> 32);
            c2[l] = 0u;
            c3[l] = 0u;
        }
        philox_lanes(c0, c1, c2, c3, d->k0, d->k1);
        for (int l = 0; l < PHILOX_LANES; ++l) {
            words[4 * l] = c0[l];
            words[4 * l + 1] = c1[l];
            words[4 * l + 2] = c2[l];
            words[4 * l + 3] = c3[l];
        }
        /* the span's elements among the block's 4 * PHILOX_LANES, [e0 + lo, e0 + hi) */
        const uint64_t e0 = 4 * g0;
        const long lo = first > e0 ? (long)(first - e0) : 0;
        const long hi = end < e0 + 4 * PHILOX_LANES ? (long)(end - e0) : 4 * PHILOX_LANES;
        const long shift = (long)e0 - (long)first;    /* element e0 + i is x[i + shift] */
        const float p = d->p, scale = d->scale;
#pragma omp simd
        for (long i = lo; i < hi; ++i) {
            const float u = (float)(words[i] >> 8) * 5.9604644775390625e-08f;   /* 2^-24 */
            y[i + shift] = u >= p ? x[i + shift] * scale : 0.0f;
        }
    }
}

typedef struct { const float* x; float* y; drop_t d; } dropout_ctx;

static void dropout_task(void* vctx, work_t* w) {
    const dropout_ctx* c = vctx;
    long b, e;
    while (work_take(w, &b, &e)) dropout_span(c->x + b, c->y + b, e - b, (uint64_t)b, &c->d);
}

/* Items: chunks of ELEMS_GRAIN elements; an element's keep bit depends on its index alone. */
void dropout_f32(const float* RESTRICT x, float* RESTRICT y, long n, uint32_t k0, uint32_t k1,
                 float p, float scale) {
    const dropout_ctx c = {x, y, {0, k0, k1, p, scale}};
    if (n > 0) pool_run(dropout_task, (void*)&c, n, ELEMS_GRAIN);
}
