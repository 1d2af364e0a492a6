/* kernels.c: fused float32 loops behind backends/cpu/__init__.py (built and loaded by native.py).

   NumPy runs one C loop per ufunc, so a GELU or a layernorm is 7-16 passes over memory; these
   functions do each op in one or two passes. They compute exactly what the NumPy kernels in
   reference.py compute (those stay the readable reference and the fallback); __init__.py
   calls them only for C-contiguous float32 arrays. No threads, no global state; every
   function owns a flat range of elements or whole rows (one head, one layernorm row) and
   allocates nothing but small per-call scratch.

   Built with -O3 -ffp-contract=fast (FMA) -fno-math-errno -fno-trapping-math -fopenmp-simd
   and -march=native where the compiler takes it (native.py), never -ffast-math: loops
   vectorise through `#pragma omp simd` on the reductions and through exp_f32 below, which
   is written to vectorise without changing IEEE semantics (-fno-trapping-math lets its
   clamps become blends). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RESTRICT __restrict__

/* 8-float vectors (GCC/Clang vector extension; two SSE registers where AVX is absent) */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f bcast8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* exp(x) in float32 without a libm call, so that loops around it vectorise: Cephes' expf
   (S. Moshier): x = n ln2 + r with ln2 split in two (n ln2_hi exact), |r| <= ln2/2, e^r by
   a degree-6 polynomial, 2^n built in the exponent bits. About 1 ulp (max 1.4e-7 relative)
   on [-87.3, 88.3]; x is clamped to that range first, so far left it gives e^-87.3 =
   1.2e-38 instead of 0 and far right 2.4e38 instead of inf; NaN stays NaN (the clamps are
   max/min that pass a NaN x). n = round(x / ln2) by the 1.5 * 2^23 trick (round to
   nearest, the FPU's default mode), which needs no SSE4.1 round instruction. */
static inline float exp_f32(float x) {
    const float magic = 12582912.0f;                 /* 1.5 * 2^23, bits 0x4B400000 */
    x = x < -87.3365447504f ? -87.3365447504f : x;
    x = 88.3762626647949f < x ? 88.3762626647949f : x;
    const float t = x * 1.44269504088896341f + magic;   /* magic + round(x / ln2) */
    const float n = t - magic;
    int32_t ni;
    memcpy(&ni, &t, sizeof ni);
    ni -= 0x4B400000;                                /* round(x / ln2) as an int */
    float r = x - n * 0.693359375f;                  /* ln2_hi: n * ln2_hi is exact */
    r = r - n * -2.12194440e-4f;                     /* ln2_lo */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (ni + 127) << 23;           /* 2^n, n in -126..127 */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Exposed for the tests: y[i] = exp_f32(x[i]). */
void exp_f32_array(const float* RESTRICT x, float* RESTRICT y, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) y[i] = exp_f32(x[i]);
}

/* ----------------------------------------------------------------------------------------
   gelu: GPT-2's tanh approximation in the sigmoid form of reference.py's _gelu_block /
   _gelu_bwd_block: with u = k (x + c x^3), E = exp(-2u), s = 1 / (1 + E) = sigmoid(2u):
     gelu(x) = x s,   gelu'(x) = s (1 + (1 - s) w),  1 - s = E s,  w = x (2k + 6kc x^2).
   exp_f32 clamps -2u at 88.4, so E stays finite and dx finite far left (the NumPy kernels
   clamp at 80 to the same effect).
   Each call owns the flat range [0, n).
   ---------------------------------------------------------------------------------------- */
#define GELU_K 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_C 0.044715f

void gelu_f32(const float* RESTRICT x, float* RESTRICT y, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i];
        const float m2u = v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v * v);   /* -2u */
        y[i] = v / (1.0f + exp_f32(m2u));
    }
}

void gelu_bwd_f32(const float* RESTRICT x, const float* RESTRICT dy, float* RESTRICT dx,
                  long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i], v2 = v * v;
        const float e = exp_f32(v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v2));  /* E */
        float s = 1.0f / (1.0f + e);
        float w = v * (2.0f * GELU_K + 6.0f * GELU_K * GELU_C * v2);
        dx[i] = dy[i] * s * (1.0f + e * s * w);
    }
}

/* ----------------------------------------------------------------------------------------
   layernorm over rows of c, biased variance, two passes for the statistics (mean, then
   sum of (x - mean)^2), as reference.py's _layernorm_stats. Each loop iteration owns one row.
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
    const float mean = s / (float)c;
    const v8f m = bcast8(mean);
    a0 = a1 = a2 = a3 = bcast8(0.0f);
    for (long j = 0; j < c32; j += 32) {
        const v8f d0 = load8(xr + j) - m, d1 = load8(xr + j + 8) - m;
        const v8f d2 = load8(xr + j + 16) - m, d3 = load8(xr + j + 24) - m;
        a0 += d0 * d0;
        a1 += d1 * d1;
        a2 += d2 * d2;
        a3 += d3 * d3;
    }
    float ss = hsum8((a0 + a1) + (a2 + a3));
    for (long j = c32; j < c; ++j) ss += (xr[j] - mean) * (xr[j] - mean);
    *mean_out = mean;
    *rstd_out = 1.0f / sqrtf(ss / (float)c + eps);
}

void layernorm_f32(const float* RESTRICT x, const float* RESTRICT gamma,
                   const float* RESTRICT beta, float* RESTRICT y, long rows, long c,
                   float eps) {
    for (long r = 0; r < rows; ++r) {
        const float* xr = x + r * c;
        float* yr = y + r * c;
        float mean, rstd;
        row_stats(xr, c, eps, &mean, &rstd);
#pragma omp simd
        for (long j = 0; j < c; ++j) yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
    }
}

/* dgamma, dbeta: float partial sums over blocks of LN_BLOCK rows, added into double sums
   (per-element double accumulation cost 4 read-modify-writes per 8 elements). */
#define LN_BLOCK 16

/* Returns 0, or -1 when the accumulators cannot be allocated. */
int layernorm_bwd_f32(const float* RESTRICT x, const float* RESTRICT gamma,
                      const float* RESTRICT dy, const float* RESTRICT add, float* RESTRICT dx,
                      float* RESTRICT dgamma, float* RESTRICT dbeta, long rows, long c,
                      float eps) {
    double* acc = calloc((size_t)(2 * c), sizeof(double));   /* dgamma, then dbeta */
    float* blk = calloc((size_t)(2 * c), sizeof(float));     /* the same, this block */
    if (!acc || !blk) {
        free(acc);
        free(blk);
        return -1;
    }
    double* RESTRICT ag = acc;
    double* RESTRICT ab = acc + c;
    float* RESTRICT fg = blk;
    float* RESTRICT fb = blk + c;
    for (long r = 0; r < rows; ++r) {
        const float* xr = x + r * c;
        const float* dyr = dy + r * c;
        float* dxr = dx + r * c;
        float mean, rstd;
        row_stats(xr, c, eps, &mean, &rstd);
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
        if (add) {   /* dx + the gradient x already has (layernorm_bwd_add): one pass */
            const float* ar = add + r * c;
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
        if (r % LN_BLOCK == LN_BLOCK - 1 || r == rows - 1) {
#pragma omp simd
            for (long j = 0; j < c; ++j) {
                ag[j] += fg[j];
                ab[j] += fb[j];
                fg[j] = fb[j] = 0.0f;
            }
        }
    }
    for (long j = 0; j < c; ++j) {
        dgamma[j] = (float)ag[j];
        dbeta[j] = (float)ab[j];
    }
    free(acc);
    free(blk);
    return 0;
}

/* ----------------------------------------------------------------------------------------
   causal attention, one head at a time: q, k, v, out, dout (nbh, t, hs), lse (nbh, t).
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
   Row i of P and dS is valid on columns [0, round_up(i + 1, 8)), zero right of i; every
   product reads only there. Each call owns its heads; scratch is per call.
   ---------------------------------------------------------------------------------------- */
/* Pins a vector in a register. Left alone, GCC folds each use of a loaded row of B into the
   FMA as a memory operand, so tile_4x16 issued 12 loads per 8 FMAs and was load-bound
   (attention_bwd 1100 -> 660 us on the nanoGPT shapes with the pin). */
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* C[0..4, 0..16) = sum over k in [k0, k1) of A[r, k] B[k, 0..16), A[r, k] = a[r * ars + k * aks]. */
static inline void tile_4x16(const float* RESTRICT a, long ars, long aks, const float* RESTRICT b,
                             long ldb, float* RESTRICT c, long ldc, long k0, long k1) {
    v8f c00 = bcast8(0.0f), c01 = c00, c10 = c00, c11 = c00;
    v8f c20 = c00, c21 = c00, c30 = c00, c31 = c00;
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
    store8(c, c00); store8(c + 8, c01);
    store8(c + ldc, c10); store8(c + ldc + 8, c11);
    store8(c + 2 * ldc, c20); store8(c + 2 * ldc + 8, c21);
    store8(c + 3 * ldc, c30); store8(c + 3 * ldc + 8, c31);
}

/* Which k (and, for scores, which output columns) a row block [r, r + 4) needs. */
enum { K_ALL, K_UPTO_ROW, K_FROM_ROW };

/* C (m4 x n16) = A (m4 x K) B (K x n16) in 4 x 16 tiles; A[r, k] = a[r * ars + k * aks].
   K_ALL: k in [0, kn), and only the column tiles at or left of the block's last row (the
   causal S and dP). K_UPTO_ROW: k in [0, r + 4) (A is P or dS, zero right of the diagonal).
   K_FROM_ROW: k in [r, kn) (A is P^T or dS^T, zero left of it). */
static inline void gemm_tiles(const float* a, long ars, long aks, const float* b, long ldb,
                              float* c, long ldc, long m4, long n16, long kn, int kind) {
    for (long r = 0; r < m4; r += 4) {
        long k0 = 0, k1 = kn, ncols = n16;
        if (kind == K_ALL) ncols = round_up(r + 4, 16) < n16 ? round_up(r + 4, 16) : n16;
        if (kind == K_UPTO_ROW) k1 = r + 4;
        if (kind == K_FROM_ROW) k0 = r;
        for (long j = 0; j < ncols; j += 16)
            tile_4x16(a + r * ars, ars, aks, b + j, ldb, c + r * ldc + j, ldc, k0, k1);
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

/* Attention dropout (forge_ml.rng's stream over the (B, H, T, T) probabilities): head (b, h)'s
   element (i, j) is stream index base + i t + j, base = ((b H + h) t) t. */
typedef struct {
    uint64_t base;          /* the head's first element index */
    uint32_t k0, k1;        /* the Philox key (seed lo, hi) */
    float p, scale;         /* the rate, and 1/(1-p) rounded to float */
} drop_t;

/* y[j] = keep(first + j) ? x[j] scale : 0 for j in [0, n): the mask of stream indices first..
   (x == y is allowed: the attention applies it to a row of P in place). */
static void dropout_span(const float* x, float* y, long n, uint64_t first, const drop_t* d) {
    uint32_t c0[PHILOX_LANES], c1[PHILOX_LANES], c2[PHILOX_LANES], c3[PHILOX_LANES];
    const uint64_t g_first = first / 4, g_last = (first + (uint64_t)n - 1) / 4;
    for (uint64_t g0 = g_first; g0 <= g_last; g0 += PHILOX_LANES) {
        for (int l = 0; l < PHILOX_LANES; ++l) {       /* counter of group g0 + l */
            const uint64_t g = g0 + (uint64_t)l;
            c0[l] = (uint32_t)(g & 0xffffffffu);
            c1[l] = (uint32_t)(g >> 32);
            c2[l] = 0u;
            c3[l] = 0u;
        }
        philox_lanes(c0, c1, c2, c3, d->k0, d->k1);
        for (int l = 0; l < PHILOX_LANES && g0 + (uint64_t)l <= g_last; ++l) {
            const uint32_t w[4] = {c0[l], c1[l], c2[l], c3[l]};
            for (int q = 0; q < 4; ++q) {
                const uint64_t e = 4 * (g0 + (uint64_t)l) + (uint64_t)q;
                if (e < first || e >= first + (uint64_t)n) continue;
                const float u = (float)(w[q] >> 8) * 5.9604644775390625e-08f;   /* 2^-24 */
                const long j = (long)(e - first);
                y[j] = u >= d->p ? x[j] * d->scale : 0.0f;
            }
        }
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

/* Head-major (BH, T, hs) q, k, v, out; lse (BH, T). */
int attention_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                  float* RESTRICT out, float* RESTRICT lse, long nbh, long t, long hs,
                  float scale) {
    float* scratch = calloc((size_t)fwd_scratch(t, hs), sizeof(float));
    if (!scratch) return -1;
    for (long b = 0; b < nbh; ++b) {
        const long off = b * t * hs;
        attention_head(q + off, hs, k + off, hs, v + off, hs, out + off, hs, lse + b * t, t, hs,
                       scale, scratch, NULL);
    }
    free(scratch);
    return 0;
}

int attention_bwd_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                      const float* RESTRICT out, const float* RESTRICT lse,
                      const float* RESTRICT dout, float* RESTRICT dq, float* RESTRICT dk,
                      float* RESTRICT dv, long nbh, long t, long hs, float scale) {
    float* scratch = calloc((size_t)bwd_scratch(t, hs), sizeof(float));
    if (!scratch) return -1;
    for (long b = 0; b < nbh; ++b) {
        const long off = b * t * hs;
        attention_bwd_head(q + off, hs, k + off, v + off, hs, out + off, dout + off, hs,
                           lse + b * t, dq + off, dk + off, dv + off, t, hs, scale, scratch,
                           NULL);
    }
    free(scratch);
    return 0;
}

/* GPT-2's fused rows: qkv (B, T, 3C), head h of q, k, v at channels h*hs, C + h*hs,
   2C + h*hs; y (B, T, C); lse (B, H, T). The _dropout_ forms apply dropout at rate p (scale
   1/(1-p), Philox key (k0, k1)) to the probabilities, the mask of forge_ml.rng over (B, H, T, T). */
static int attention_qkv_run(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse,
                             long nb, long t, long nh, long hs, float scale, const drop_t* drop) {
    const long c = nh * hs;
    float* scratch = calloc((size_t)fwd_scratch(t, hs), sizeof(float));
    if (!scratch) return -1;
    for (long b = 0; b < nb; ++b)
        for (long h = 0; h < nh; ++h) {
            const float* q = qkv + b * t * 3 * c + h * hs;
            drop_t d;
            if (drop) {
                d = *drop;
                d.base = (uint64_t)((b * nh + h) * t) * (uint64_t)t;
            }
            attention_head(q, 3 * c, q + c, 3 * c, q + 2 * c, 3 * c, y + b * t * c + h * hs, c,
                           lse + (b * nh + h) * t, t, hs, scale, scratch, drop ? &d : NULL);
        }
    free(scratch);
    return 0;
}

static int attention_qkv_bwd_run(const float* RESTRICT qkv, const float* RESTRICT y,
                                 const float* RESTRICT lse, const float* RESTRICT dy,
                                 float* RESTRICT dqkv, long nb, long t, long nh, long hs,
                                 float scale, const drop_t* drop) {
    const long c = nh * hs;
    float* scratch = calloc((size_t)bwd_scratch(t, hs), sizeof(float));
    if (!scratch) return -1;
    for (long b = 0; b < nb; ++b)
        for (long h = 0; h < nh; ++h) {
            const long iq = b * t * 3 * c + h * hs, io = b * t * c + h * hs;
            drop_t d;
            if (drop) {
                d = *drop;
                d.base = (uint64_t)((b * nh + h) * t) * (uint64_t)t;
            }
            attention_bwd_head(qkv + iq, 3 * c, qkv + iq + c, qkv + iq + 2 * c, 3 * c, y + io,
                               dy + io, c, lse + (b * nh + h) * t, dqkv + iq, dqkv + iq + c,
                               dqkv + iq + 2 * c, t, hs, scale, scratch, drop ? &d : NULL);
        }
    free(scratch);
    return 0;
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
void adamw_many_f32(long count, const int64_t* p, const int64_t* g, const int64_t* m,
                    const int64_t* v, const int64_t* n, float b1, float c1, float b2, float c2,
                    const float* a, const float* c, const float* decay, int update) {
    for (long k = 0; k < count; ++k)
        adamw_f32((float*)(intptr_t)p[k], (const float*)(intptr_t)g[k], (float*)(intptr_t)m[k],
                  (float*)(intptr_t)v[k], (long)n[k], b1, c1, b2, c2, a[k], c[k], decay[k],
                  update);
}

void sumsq_many_f32(long count, const int64_t* x, const int64_t* n, float* out) {
    for (long k = 0; k < count; ++k) out[k] = (float)sumsq_f32((const float*)(intptr_t)x[k], (long)n[k]);
}

/* ----------------------------------------------------------------------------------------
   dropout with forge_ml.rng's Philox4x32-10 stream, bit for bit (rng.py, dropout.cu):
     key = (k0, k1), counter of element i = (i/4 lo, i/4 hi, 0, 0), word = philox[i % 4],
     keep = (word >> 8) 2^-24 >= p (exact in float), y = keep ? x scale : 0.
   One Philox call per group of 4 elements; the backward is the same call on dy. Each call
   owns the flat range [0, n).
   ---------------------------------------------------------------------------------------- */
void dropout_f32(const float* RESTRICT x, float* RESTRICT y, long n, uint32_t k0, uint32_t k1,
                 float p, float scale) {
    const drop_t d = {0, k0, k1, p, scale};
    if (n > 0) dropout_span(x, y, n, 0, &d);
}
