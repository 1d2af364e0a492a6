/* cpu_kernels.h: what the CPU backend's C files share. native.py builds pool.c, gemm.c,
   attention.c and kernels.c together into one library (behind backends/cpu/__init__.py):

     pool.c       the thread pool every larger kernel shares its items among
     gemm.c       float32 matrix products on the pool (own AVX-512 tiles or OpenBLAS)
     attention.c  causal attention, one head at a time, forward and backward
     kernels.c    gelu, layernorm, cross-entropy, scatter_add_rows, AdamW, sumsq, dropout

   Built with -O3 -ffp-contract=fast (FMA) -fno-math-errno -fno-trapping-math -fopenmp-simd
   -pthread and -march=native where the compiler takes it (native.py), never -ffast-math:
   loops vectorise through `#pragma omp simd` on the reductions and through exp_f32 below,
   which is written to vectorise without changing IEEE semantics (-fno-trapping-math lets its
   clamps become blends). INTERNAL functions are shared between the files, not exported. */
#ifndef FORGE_CPU_KERNELS_H
#define FORGE_CPU_KERNELS_H

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RESTRICT __restrict__
#define INTERNAL __attribute__((visibility("hidden")))

/* ---- the thread pool (pool.c) ------------------------------------------------------------ */
#define POOL_MAX 16

typedef struct {
    long count, grain;
    long next;                      /* the next item (atomic) */
} work_t;

typedef void (*task_fn)(void* ctx, work_t* work);

/* The next `grain` items [*begin, *end), or 0 when none are left. */
static inline int work_take(work_t* w, long* begin, long* end) {
    const long b = __atomic_fetch_add(&w->next, w->grain, __ATOMIC_RELAXED);
    if (b >= w->count) return 0;
    *begin = b;
    *end = b + w->grain < w->count ? b + w->grain : w->count;
    return 1;
}

/* Run `fn` on the caller and up to threads - 1 workers over count items, grain at a time. */
INTERNAL void pool_run(task_fn fn, void* ctx, long count, long grain);

/* Whether workers spin between jobs (gemm.c turns it on when the pool runs the products). */
INTERNAL void pool_spin_between_jobs(int on);

/* The pool's thread count (the caller included; exported for native.py too). */
int forge_get_threads(void);

/* A task's failure (its scratch could not be allocated): the kernel returns -1 and the
   reference runs instead. */
static inline void task_failed(int* flag) { __atomic_store_n(flag, 1, __ATOMIC_RELAXED); }

/* out[j] = the sum over i < rows of part[i * n + j], in order of i, in double: the column sums
   a kernel's items kept one row of `part` each (gemm.c's blocks, attention.c's batch rows),
   added so that no bit depends on which thread filled which row. */
static inline void sum_parts(const double* RESTRICT part, long rows, long n, float* RESTRICT out) {
    for (long j = 0; j < n; ++j) {
        double s = 0.0;
        for (long i = 0; i < rows; ++i) s += part[i * n + j];
        out[j] = (float)s;
    }
}

/* ---- 8-float vectors and exp ------------------------------------------------------------- */
/* 8-float vectors (GCC/Clang vector extension; two SSE registers where AVX is absent) */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f bcast8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* exp_f32's constants, which attention.c's vector exp_v shares: the clamps, 1.5 * 2^23 (bits
   0x4B400000, for round(x / ln2)), 1 / ln2, ln2 in two parts, the polynomial's coefficients */
#define EXP_LO -87.3365447504f
#define EXP_HI 88.3762626647949f
#define EXP_MAGIC 12582912.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* exp(x) in float32 without a libm call, so that loops around it vectorise: Cephes' expf
   (S. Moshier): x = n ln2 + r with ln2 split in two (n ln2_hi exact), |r| <= ln2/2, e^r by
   a degree-6 polynomial, 2^n built in the exponent bits. About 1 ulp (max 1.4e-7 relative)
   on [-87.3, 88.3]; x is clamped to that range first, so far left it gives e^-87.3 =
   1.2e-38 instead of 0 and far right 2.4e38 instead of inf; NaN stays NaN (the clamps are
   max/min that pass a NaN x). n = round(x / ln2) by the 1.5 * 2^23 trick (round to
   nearest, the FPU's default mode), which needs no SSE4.1 round instruction. exp_f32 (below)
   clamps at EXP_LO; exp_f32_from at a `lo` of the caller's (>= EXP_LO: gelu_bwd_span's E). */
static inline float exp_f32_from(float x, float lo) {
    const float magic = EXP_MAGIC;
    x = x < lo ? lo : x;
    x = EXP_HI < x ? EXP_HI : x;
    const float t = x * EXP_LOG2E + magic;           /* magic + round(x / ln2) */
    const float n = t - magic;
    uint32_t ni;                                     /* unsigned: a NaN's bits wrap, not overflow */
    memcpy(&ni, &t, sizeof ni);
    ni -= 0x4B400000u;                               /* round(x / ln2) as an int */
    float r = x - n * EXP_LN2_HI;                    /* ln2_hi: n * ln2_hi is exact */
    r = r - n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (ni + 127u) << 23;         /* 2^n, n in -126..127 */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float exp_f32(float x) { return exp_f32_from(x, EXP_LO); }

/* ---- GELU's loops (kernels.c's gelu ops, gemm.c's epilogues) ------------------------------ */
/* gelu: GPT-2's tanh approximation in the sigmoid form of reference.py's _gelu_block /
   _gelu_bwd_block: with u = k (x + c x^3), E = exp(-2u), s = 1 / (1 + E) = sigmoid(2u):
     gelu(x) = x s,   gelu'(x) = s (1 + (1 - s) w),  1 - s = E s,  w = x (2k + 6kc x^2).
   Past exp_f32's clamps (-2u outside [-87.3, 88.4]: x below -10.05 or above 10.0) the limits
   are taken: far left gelu = -0 and gelu' = 0, far right gelu' = 1. The clamped E, times x or
   w, gave gelu(-3e38) = -1.2, gelu'(-1e13) = -0.9 and gelu'(1e13) = 3.5 (the NumPy kernels
   take the same limits). */
#define GELU_K 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_C 0.044715f
#define ELEMS_GRAIN 16384            /* elements per pool item in elementwise kernels */

static inline void gelu_span(const float* RESTRICT x, float* RESTRICT y, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i];
        const float m2u = v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v * v);   /* -2u */
        const float g = v / (1.0f + exp_f32(m2u));
        y[i] = m2u >= EXP_HI ? v * 0.0f : g;            /* far left: -0 (NaN at -inf) */
    }
}

/* dx = gelu'(x) dy; dx may be dy itself (gemm.c's epilogue works in place). E's exponent is
   held at -80 or above (x above about 9.6): below, exp_f32 gives subnormal E down to its
   clamp (0.996 * 2^-126 there), and x86 takes a slow microcode path for each operation on
   one: the dgelu epilogue of a block whose GELU inputs were all 12 took 3.1 ms instead of 0.4.
   No bit changes: with E at 2^-115 or less and |w| under 2^12 until gelu' is set to its limit
   1, s = 1 / (1 + E) and 1 + E s w are 1 either way. (Far left, s = 1 / (1 + 2.4e38) is
   subnormal too, but measured no slower.) */
#define GELU_BWD_E_LO -80.0f
static inline void gelu_bwd_span(const float* RESTRICT x, const float* dy, float* dx, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i], v2 = v * v;
        const float m2u = v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v2);      /* -2u */
        const float e = exp_f32_from(m2u, GELU_BWD_E_LO);                           /* E */
        float s = 1.0f / (1.0f + e);
        float w = v * (2.0f * GELU_K + 6.0f * GELU_K * GELU_C * v2);
        float g = s * (1.0f + e * s * w);
        g = m2u >= EXP_HI ? 0.0f : g;                   /* the limits past the clamps; */
        g = m2u <= EXP_LO ? 1.0f : g;                   /* NaN x: neither, g is NaN */
        dx[i] = dy[i] * g;
    }
}

/* Rows per pool item: about ELEMS_GRAIN elements. */
static inline long rows_grain(long c) { return c >= ELEMS_GRAIN ? 1 : ELEMS_GRAIN / c; }

/* ---- dropout's Philox stream (kernels.c; the attention applies it to P) ------------------ */
/* Attention dropout (forge_ml.rng's stream over the (B, H, T, T) probabilities): head (b, h)'s
   element (i, j) is stream index base + i t + j, base = ((b H + h) t) t. */
typedef struct {
    uint64_t base;          /* the head's first element index */
    uint32_t k0, k1;        /* the Philox key (seed lo, hi) */
    float p, scale;         /* the rate, and 1/(1-p) rounded to float */
} drop_t;

/* y[j] = keep(first + j) ? x[j] scale : 0 for j in [0, n) (x == y allowed). */
INTERNAL void dropout_span(const float* x, float* y, long n, uint64_t first, const drop_t* d);

#endif
