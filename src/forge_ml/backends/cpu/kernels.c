/* kernels.c: fused float32 loops behind backends/cpu/__init__.py (built and loaded by native.py).

   NumPy runs one C loop per ufunc, so a GELU or a layernorm is 7-16 passes over memory; these
   functions do each op in one or two passes. They compute exactly what the NumPy kernels in
   reference.py compute (those stay the readable reference and the fallback); __init__.py
   calls them only for C-contiguous float32 arrays. The larger kernels share their work
   (heads, blocks of rows, chunks of elements) among a small pool of threads (below) whose
   size follows NumPy's OpenBLAS; an item's arithmetic never depends on which thread takes it,
   so every result is the same bits for every thread count. Nothing is allocated but small
   per-call scratch.

   Built with -O3 -ffp-contract=fast (FMA) -fno-math-errno -fno-trapping-math -fopenmp-simd
   and -march=native where the compiler takes it (native.py), never -ffast-math: loops
   vectorise through `#pragma omp simd` on the reductions and through exp_f32 below, which
   is written to vectorise without changing IEEE semantics (-fno-trapping-math lets its
   clamps become blends). */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RESTRICT __restrict__

/* ----------------------------------------------------------------------------------------
   The thread pool. A job is `count` items (heads, blocks of rows, chunks of elements) taken
   `grain` at a time from a shared counter by the caller and the workers alike, so a worker
   that wakes late only takes fewer. Every kernel below makes an item's result independent of
   the thread that computes it (per-item scratch, per-block partial sums added up in order by
   the caller afterwards), so the thread count never changes a bit.
   Where the pool runs the matrix products too (gemm_f32; OpenBLAS keeps one thread), a worker
   spins for POOL_SPIN_NS between jobs, then sleeps on a condition variable; beside
   OpenBLAS's own threads it sleeps at once (two pools, each spinning while the other works,
   fought over a small machine's cores). The caller, once the counter is
   spent, waits only for the workers that joined (they are busy with their last items). A job
   that finds the pool in use (two Python threads at once) runs on its caller alone; a child
   of fork() starts with no workers. forge_set_threads sets the size (the caller included).
   ---------------------------------------------------------------------------------------- */
#define POOL_MAX 16

static void* sgemm_ptr;             /* the BLAS's cblas_sgemm when the pool runs the products */
static int sgemm_ilp64;

typedef struct {
    long count, grain;
    long next;                      /* the next item (atomic) */
} work_t;

typedef void (*task_fn)(void* ctx, work_t* work);

/* The next `grain` items [*begin, *end), or 0 when none are left. */
static int work_take(work_t* w, long* begin, long* end) {
    const long b = __atomic_fetch_add(&w->next, w->grain, __ATOMIC_RELAXED);
    if (b >= w->count) return 0;
    *begin = b;
    *end = b + w->grain < w->count ? b + w->grain : w->count;
    return 1;
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int threads;                    /* the size asked for, the caller included */
    int started;                    /* workers running */
    int forked_hook;                /* pthread_atfork registered */
    unsigned long job;              /* bumped once per job */
    task_fn fn;                     /* the open job (NULL once its caller has finished) */
    void* ctx;
    work_t* work;
    int helpers;                    /* workers asked to join the open job */
    int joined;                     /* workers that joined it */
    int left;                       /* atomic: joined workers still working */
    int busy;                       /* atomic: a caller owns the pool */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 0, 0, NULL, NULL, NULL,
          0, 0, 0, 0};

/* How long a worker spins for the next job before it sleeps: a training step's kernels come
   tens to hundreds of microseconds apart, and a wake from sleep costs 10 us or more a job.
   GPT-2's CPU decoding step (a product every ~400 us) gave 39.8 tok/s with 200 us, 47.3
   with 1 ms, where OpenBLAS's own threads gave 49.9-50.7 (the same within its runs). */
#define POOL_SPIN_NS 1000000L

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void* pool_worker(void* arg) {
    const int id = (int)(intptr_t)arg;                     /* 1, 2, ... */
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = pool.job;
    for (;;) {
        pthread_mutex_unlock(&pool.mu);
        const long until = now_ns() + POOL_SPIN_NS;
        for (int i = 1; sgemm_ptr && __atomic_load_n(&pool.job, __ATOMIC_ACQUIRE) == seen; ++i) {
            cpu_relax();
            if (i % 256 == 0 && now_ns() > until) break;
        }
        pthread_mutex_lock(&pool.mu);
        while (pool.job == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.job;
        if (pool.fn == NULL || id > pool.helpers) continue;
        const task_fn fn = pool.fn;
        void* ctx = pool.ctx;
        work_t* work = pool.work;
        pool.joined++;
        pthread_mutex_unlock(&pool.mu);
        fn(ctx, work);
        __atomic_fetch_sub(&pool.left, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&pool.mu);
    }
    return NULL;
}

/* In a fork()ed child: the workers are the parent's; start again with none. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    pool.fn = NULL;
    pool.busy = 0;
}

/* The pool's size, the caller included (1: every job runs on its caller). */
void forge_set_threads(int n) {
    pool.threads = n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : n;
}

int forge_get_threads(void) { return pool.threads; }

/* Run `fn` on the caller and up to threads - 1 workers over count items, grain at a time. */
static void pool_run(task_fn fn, void* ctx, long count, long grain) {
    work_t work = {count, grain < 1 ? 1 : grain, 0};
    const long chunks = (count + work.grain - 1) / work.grain;
    int helpers = pool.threads - 1;
    if (helpers > chunks - 1) helpers = (int)(chunks - 1);
    if (helpers <= 0 || __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) {
        fn(ctx, &work);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    if (!pool.forked_hook) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        pool.forked_hook = 1;
    }
    while (pool.started < helpers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, pool_worker, (void*)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    if (helpers > pool.started) helpers = pool.started;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.work = &work;
    pool.helpers = helpers;
    pool.joined = 0;
    __atomic_store_n(&pool.left, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pool.job, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, &work);                                         /* the caller's share */
    pthread_mutex_lock(&pool.mu);
    pool.fn = NULL;                                         /* closed to late workers */
    const int joined = pool.joined;
    pthread_mutex_unlock(&pool.mu);
    /* the joined workers decrement `left` from 0: wait until it reaches -joined */
    while (__atomic_load_n(&pool.left, __ATOMIC_ACQUIRE) != -joined) sched_yield();
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
}

/* A task's failure (its scratch could not be allocated): the kernel returns -1 and the
   reference runs instead. */
static void task_failed(int* flag) { __atomic_store_n(flag, 1, __ATOMIC_RELAXED); }

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
   The pool's items are chunks of ELEMS_GRAIN elements (a multiple of 64: every chunk but the
   last starts and ends on the vector loop's own boundaries).
   ---------------------------------------------------------------------------------------- */
#define GELU_K 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_C 0.044715f
#define ELEMS_GRAIN 16384

static void gelu_span(const float* RESTRICT x, float* RESTRICT y, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i];
        const float m2u = v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v * v);   /* -2u */
        y[i] = v / (1.0f + exp_f32(m2u));
    }
}

static void gelu_bwd_span(const float* RESTRICT x, const float* RESTRICT dy, float* RESTRICT dx,
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
   Matrix products on the pool's threads: C = alpha op(A) op(B) (+ P), row-major, by one
   single-threaded BLAS call per block of C (forge_set_blas gives the BLAS, and native.py
   keeps that BLAS at one thread of its own). Blocks: one per core the process may use (at
   most 16; forge_set_gemm_blocks, set once at load), never per thread: BLAS may take another
   code path, and another rounding, for another block shape, so blocks sized by the thread
   count changed bits (a 100-row product on 1 and 2 threads), and the ThreadTuner's choice of
   count must change none. Blocks of rows where m >= GEMM_ROWS_MIN; else blocks of columns
   (a decoding step's single row): sgemv for one row (sgemm would pack all of op(B) for it),
   sgemm for a few. More blocks than cores cost: each block repacks op(B), and the nanoGPT
   CPU step took 4% longer with 4 blocks than with 2 on a 2-core VM, 6% with 8. Per block:
     P, the prologue: with `bias` and/or `res` (not NULL) C's block is first set to
        res + bias (either alone) and the product is added to it (beta 1), as torch's addmm
        adds its bias: no extra pass over C;
     the epilogue, on the block while it is in cache: EPI_GELU writes gelu(C) to `aux`
        (C keeps GELU's input); EPI_DGELU turns C into gelu_bwd(aux, C) (aux is GELU's
        input; C was the gradient at GELU's output).
   ---------------------------------------------------------------------------------------- */
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                           const float*, int64_t, float, float*, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float*, int, const float*,
                           int, float, float*, int);
typedef void (*sgemv64_fn)(int, int, int64_t, int64_t, float, const float*, int64_t, const float*,
                           int64_t, float, float*, int64_t);
typedef void (*sgemv32_fn)(int, int, int, int, float, const float*, int, const float*, int, float,
                           float*, int);
static void* sgemv_ptr;

/* The BLAS's cblas_sgemm and cblas_sgemv (ilp64: 64-bit integer arguments), or NULLs. */
void forge_set_blas(void* sgemm, void* sgemv, int ilp64) {
    sgemm_ptr = sgemv ? sgemm : NULL;
    sgemv_ptr = sgemm ? sgemv : NULL;
    sgemm_ilp64 = ilp64;
}

static long gemm_blocks = 1;

void forge_set_gemm_blocks(long blocks) { gemm_blocks = blocks < 1 ? 1 : blocks; }

#define GEMM_ROWS_MIN 64
enum { EPI_NONE = 0, EPI_GELU = 1, EPI_DGELU = 2 };
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef struct {
    int ta, tb, epi, by_rows;
    long m, n, k, lda, ldb, ldc, block;   /* block: rows or columns per item */
    float alpha;
    const float *a, *b, *bias, *res;
    float *c, *aux;
} gemm_ctx;

/* g = gelu_bwd(x, g) in place (gelu_bwd_span's arithmetic). */
static void dgelu_inplace(const float* RESTRICT x, float* g, long n) {
#pragma omp simd
    for (long i = 0; i < n; ++i) {
        float v = x[i], v2 = v * v;
        const float e = exp_f32(v * (-2.0f * GELU_K - 2.0f * GELU_K * GELU_C * v2));
        float s = 1.0f / (1.0f + e);
        float w = v * (2.0f * GELU_K + 6.0f * GELU_K * GELU_C * v2);
        g[i] = g[i] * s * (1.0f + e * s * w);
    }
}

/* C[r0:r1, c0:c1] (+ its prologue and epilogue). */
static void gemm_block(const gemm_ctx* g, long r0, long r1, long c0, long c1) {
    const long n = g->n, ldc = g->ldc, rows = r1 - r0, cols = c1 - c0;
    const float* a = g->ta ? g->a + r0 : g->a + r0 * g->lda;          /* op(A)'s rows r0.. */
    const float* b = g->tb ? g->b + c0 * g->ldb : g->b + c0;          /* op(B)'s columns c0.. */
    float* c = g->c + r0 * ldc + c0;
    float beta = 0.0f;
    if (g->bias || g->res) {
        for (long r = 0; r < rows; ++r) {
            float* RESTRICT cr = c + r * ldc;
            const float* RESTRICT bias = g->bias ? g->bias + c0 : NULL;
            const float* RESTRICT rr = g->res ? g->res + (r0 + r) * n + c0 : NULL;
            if (rr && bias) {
#pragma omp simd
                for (long j = 0; j < cols; ++j) cr[j] = rr[j] + bias[j];
            } else {
                memcpy(cr, rr ? rr : bias, sizeof(float) * (size_t)cols);
            }
        }
        beta = 1.0f;
    }
    const int ta = g->ta ? CBLAS_TRANS : CBLAS_NO_TRANS, tb = g->tb ? CBLAS_TRANS : CBLAS_NO_TRANS;
    if (rows == 1) {
        /* one row: c = op(B)^T a, a gemv on B as stored (a's elements at stride lda if ta) */
        const int t = g->tb ? CBLAS_NO_TRANS : CBLAS_TRANS;
        const long bm = g->tb ? cols : g->k, bn = g->tb ? g->k : cols, inc = g->ta ? g->lda : 1;
        if (sgemm_ilp64)
            ((sgemv64_fn)sgemv_ptr)(CBLAS_ROW_MAJOR, t, bm, bn, g->alpha, b, g->ldb, a, inc, beta, c, 1);
        else
            ((sgemv32_fn)sgemv_ptr)(CBLAS_ROW_MAJOR, t, (int)bm, (int)bn, g->alpha, b, (int)g->ldb, a,
                                    (int)inc, beta, c, 1);
    } else if (sgemm_ilp64) {
        ((sgemm64_fn)sgemm_ptr)(CBLAS_ROW_MAJOR, ta, tb, rows, cols, g->k, g->alpha, a, g->lda, b,
                                g->ldb, beta, c, ldc);
    } else {
        ((sgemm32_fn)sgemm_ptr)(CBLAS_ROW_MAJOR, ta, tb, (int)rows, (int)cols, (int)g->k, g->alpha,
                                a, (int)g->lda, b, (int)g->ldb, beta, c, (int)ldc);
    }
    if (g->epi == EPI_GELU)
        for (long r = 0; r < rows; ++r) gelu_span(c + r * ldc, g->aux + (r0 + r) * n + c0, cols);
    else if (g->epi == EPI_DGELU)
        for (long r = 0; r < rows; ++r) dgelu_inplace(g->aux + (r0 + r) * n + c0, c + r * ldc, cols);
}

static void gemm_task(void* vctx, work_t* w) {
    const gemm_ctx* g = vctx;
    long i0, i1;
    while (work_take(w, &i0, &i1)) {
        const long lo = i0 * g->block, hi = i1 * g->block, end = g->by_rows ? g->m : g->n;
        if (g->by_rows)
            gemm_block(g, lo, hi < end ? hi : end, 0, g->n);
        else
            gemm_block(g, 0, g->m, lo, hi < end ? hi : end);
    }
}

/* C (m x n, row stride ldc) = alpha op(A) op(B) [+ res + bias], then the epilogue (above);
   op(A) is m x k, op(B) k x n; res and aux are (m x n) contiguous. Returns -1 when no BLAS
   was given. */
int gemm_f32(int ta, int tb, long m, long n, long k, float alpha, const float* a, long lda,
             const float* b, long ldb, const float* bias, const float* res, int epi, float* aux,
             float* c, long ldc) {
    if (!sgemm_ptr) return -1;
    const int by_rows = m >= GEMM_ROWS_MIN;
    const long extent = by_rows ? m : n;
    long block = ((extent + gemm_blocks - 1) / gemm_blocks + 15) / 16 * 16;
    if (block < 16) block = 16;
    gemm_ctx g = {ta, tb, epi, by_rows, m, n, k, lda, ldb, ldc, block, alpha, a, b, bias, res, c,
                  aux};
    pool_run(gemm_task, &g, (extent + block - 1) / block, 1);
    return 0;
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

typedef struct {
    const float *x, *gamma, *beta, *dy, *add;
    float *y, *partial;             /* forward: y; backward: dx, and per-block dgamma, dbeta */
    long rows, c;
    float eps;
} ln_ctx;

/* Rows per pool item: about ELEMS_GRAIN elements. */
static long rows_grain(long c) { return c >= ELEMS_GRAIN ? 1 : ELEMS_GRAIN / c; }

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
    ln_ctx a = {x, gamma, beta, NULL, NULL, y, NULL, rows, c, eps};
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
            float* RESTRICT fg = a->partial + blk * 2 * c;      /* this block's dgamma */
            float* RESTRICT fb = fg + c;                        /* and dbeta */
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
            }
        }
}

/* Returns 0, or -1 when the block sums cannot be allocated. */
int layernorm_bwd_f32(const float* RESTRICT x, const float* RESTRICT gamma,
                      const float* RESTRICT dy, const float* RESTRICT add, float* RESTRICT dx,
                      float* RESTRICT dgamma, float* RESTRICT dbeta, long rows, long c,
                      float eps) {
    const long blocks = (rows + LN_BLOCK - 1) / LN_BLOCK;
    double* acc = calloc((size_t)(2 * c), sizeof(double));             /* dgamma, then dbeta */
    float* partial = calloc((size_t)(blocks * 2 * c), sizeof(float));  /* per block, the same */
    if (!acc || !partial) {
        free(acc);
        free(partial);
        return -1;
    }
    ln_ctx a = {x, gamma, NULL, dy, add, dx, partial, rows, c, eps};
    const long grain = rows_grain(c) / LN_BLOCK > 1 ? rows_grain(c) / LN_BLOCK : 1;
    pool_run(layernorm_bwd_task, &a, blocks, grain);
    for (long blk = 0; blk < blocks; ++blk) {
        const float* RESTRICT fg = partial + blk * 2 * c;
#pragma omp simd
        for (long j = 0; j < 2 * c; ++j) acc[j] += fg[j];
    }
    for (long j = 0; j < c; ++j) {
        dgamma[j] = (float)acc[j];
        dbeta[j] = (float)acc[c + j];
    }
    free(acc);
    free(partial);
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

/* The pool's attention jobs: one item per head. Head-major (BH, T, hs) arrays (fused == 0:
   q, k, v, out, dout; lse (BH, T)) or GPT-2's fused rows (fused == 1: qkv (B, T, 3C), head h
   of q, k, v at channels h*hs, C + h*hs, 2C + h*hs; y, dy (B, T, C); lse (B, H, T)). Each
   thread allocates its own scratch. */
typedef struct {
    const float *q, *k, *v, *out, *lse, *dout;     /* fused: q is qkv, out is y, dout is dy */
    float *o, *lse_out, *dq, *dk, *dv;            /* fused: dq is dqkv */
    long nh, t, hs;                                /* nh: heads per batch row (fused) */
    int fused;
    float scale;
    const drop_t* drop;
    int failed;
} attn_ctx;

/* Head `bh`'s dropout stream: element (i, j) of its P is index ((b H + h) t + i) t + j. */
static const drop_t* head_drop(const attn_ctx* a, long bh, drop_t* d) {
    if (!a->drop) return NULL;
    *d = *a->drop;
    d->base = (uint64_t)(bh * a->t) * (uint64_t)a->t;
    return d;
}

static void attention_task(void* vctx, work_t* w) {
    attn_ctx* a = vctx;
    const long t = a->t, hs = a->hs, c = a->nh * hs;
    float* scratch = calloc((size_t)fwd_scratch(t, hs), sizeof(float));
    if (!scratch) {
        task_failed(&a->failed);
        return;
    }
    long h0, h1;
    while (work_take(w, &h0, &h1))
        for (long bh = h0; bh < h1; ++bh) {
            drop_t d;
            const drop_t* dp = head_drop(a, bh, &d);
            if (a->fused) {
                const long b = bh / a->nh, h = bh % a->nh;
                const float* q = a->q + b * t * 3 * c + h * hs;
                attention_head(q, 3 * c, q + c, 3 * c, q + 2 * c, 3 * c, a->o + b * t * c + h * hs,
                               c, a->lse_out + bh * t, t, hs, a->scale, scratch, dp);
            } else {
                const long off = bh * t * hs;
                attention_head(a->q + off, hs, a->k + off, hs, a->v + off, hs, a->o + off, hs,
                               a->lse_out + bh * t, t, hs, a->scale, scratch, dp);
            }
        }
    free(scratch);
}

static void attention_bwd_task(void* vctx, work_t* w) {
    attn_ctx* a = vctx;
    const long t = a->t, hs = a->hs, c = a->nh * hs;
    float* scratch = calloc((size_t)bwd_scratch(t, hs), sizeof(float));
    if (!scratch) {
        task_failed(&a->failed);
        return;
    }
    long h0, h1;
    while (work_take(w, &h0, &h1))
        for (long bh = h0; bh < h1; ++bh) {
            drop_t d;
            const drop_t* dp = head_drop(a, bh, &d);
            if (a->fused) {
                const long b = bh / a->nh, h = bh % a->nh;
                const long iq = b * t * 3 * c + h * hs, io = b * t * c + h * hs;
                attention_bwd_head(a->q + iq, 3 * c, a->q + iq + c, a->q + iq + 2 * c, 3 * c,
                                   a->out + io, a->dout + io, c, a->lse + bh * t, a->dq + iq,
                                   a->dq + iq + c, a->dq + iq + 2 * c, t, hs, a->scale, scratch,
                                   dp);
            } else {
                const long off = bh * t * hs;
                attention_bwd_head(a->q + off, hs, a->k + off, a->v + off, hs, a->out + off,
                                   a->dout + off, hs, a->lse + bh * t, a->dq + off, a->dk + off,
                                   a->dv + off, t, hs, a->scale, scratch, dp);
            }
        }
    free(scratch);
}

/* Head-major (BH, T, hs) q, k, v, out; lse (BH, T). */
int attention_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                  float* RESTRICT out, float* RESTRICT lse, long nbh, long t, long hs,
                  float scale) {
    attn_ctx a = {q, k, v, NULL, NULL, NULL, out, lse, NULL, NULL, NULL, 1, t, hs, 0, scale,
                  NULL, 0};
    pool_run(attention_task, &a, nbh, 1);
    return a.failed ? -1 : 0;
}

int attention_bwd_f32(const float* RESTRICT q, const float* RESTRICT k, const float* RESTRICT v,
                      const float* RESTRICT out, const float* RESTRICT lse,
                      const float* RESTRICT dout, float* RESTRICT dq, float* RESTRICT dk,
                      float* RESTRICT dv, long nbh, long t, long hs, float scale) {
    attn_ctx a = {q, k, v, out, lse, dout, NULL, NULL, dq, dk, dv, 1, t, hs, 0, scale, NULL, 0};
    pool_run(attention_bwd_task, &a, nbh, 1);
    return a.failed ? -1 : 0;
}

/* GPT-2's fused rows (above). The _dropout_ forms apply dropout at rate p (scale 1/(1-p),
   Philox key (k0, k1)) to the probabilities, the mask of forge_ml.rng over (B, H, T, T). */
static int attention_qkv_run(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse,
                             long nb, long t, long nh, long hs, float scale, const drop_t* drop) {
    attn_ctx a = {qkv, NULL, NULL, NULL, NULL, NULL, y, lse, NULL, NULL, NULL, nh, t, hs, 1,
                  scale, drop, 0};
    pool_run(attention_task, &a, nb * nh, 1);
    return a.failed ? -1 : 0;
}

static int attention_qkv_bwd_run(const float* RESTRICT qkv, const float* RESTRICT y,
                                 const float* RESTRICT lse, const float* RESTRICT dy,
                                 float* RESTRICT dqkv, long nb, long t, long nh, long hs,
                                 float scale, const drop_t* drop) {
    attn_ctx a = {qkv, NULL, NULL, y, lse, dy, NULL, NULL, dqkv, NULL, NULL, nh, t, hs, 1, scale,
                  drop, 0};
    pool_run(attention_bwd_task, &a, nb * nh, 1);
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
void dropout_f32(const float* RESTRICT x, float* RESTRICT y, long n, uint32_t k0, uint32_t k1,
                 float p, float scale) {
    const drop_t d = {0, k0, k1, p, scale};
    if (n > 0) dropout_span(x, y, n, 0, &d);
}
