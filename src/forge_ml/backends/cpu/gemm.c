/* gemm.c: matrix products on the pool's threads: C = alpha op(A) op(B) (+ P), row-major, a block of
   C each, by gemm.c's own AVX-512 product (below) or one single-threaded BLAS call (forge_set_blas
   gives the BLAS, and native.py keeps that BLAS at one thread of its own). Blocks: one per core the
   process may use (at most 16; forge_set_gemm_blocks, set once at load), never per thread: BLAS may
   take another code path, and another rounding, for another block shape, so blocks sized by the
   thread count changed bits (a 100-row product on 1 and 2 threads), and the ThreadTuner's choice of
   count must change none. Blocks of rows where m >= GEMM_ROWS_MIN and m >= n; else blocks of
   columns (a decoding step's single row; a weight gradient's C x N with N > C): sgemv for one row
   (sgemm would pack all of op(B) for it), sgemm for a few. Each block of rows packs all of op(B) (k
   x n) and each block of columns all of op(A) (m x k): the split is along the longer side of C, so
   the operand every block repacks is the smaller one (the nanoGPT CPU step's dW = x^T dy of 128 x
   512 and 128 x 384, k 768: 10-11% faster by columns, the step ~0.9 ms of 24). More blocks than
   cores cost: the nanoGPT CPU step took 4% longer with 4 blocks than with 2 on a 2-core VM, 6% with
   8. Per block:
     P, the prologue: with `bias` and/or `res` (not NULL) C's block is first set to
        res + bias (either alone) and the product is added to it (beta 1), as torch's addmm
        adds its bias: no extra pass over C;
     the epilogue, on the block while it is in cache: EPI_GELU writes gelu(C) to `aux`
        (C keeps GELU's input); EPI_DGELU turns C into gelu_bwd(aux, C) (aux is GELU's
        input; C was the gradient at GELU's output);
     with `sums` (not NULL), the block's column sums of the C it wrote, in double, into its
        own row of partial sums; gemm_f32 adds the rows in block order into sums[n] (the bias
        gradient beside matmul_dgelu's product, read while in cache: no bit depends on the
        thread count).
   Where the library is built for AVX-512 (-march=native on such a CPU), a block's product is
   forge's own where it is the faster (gk_gemm below, GK_ROWS_MIN; unless forge_gemm_own(0)):
   OpenBLAS's sgemm reached 137-151 GFLOP/s a core on the nanoGPT CPU step's blocks (384 x 512 x
   128, 128 x 256 x 768, ...) where MKL reaches 186-227. Tiles of 12 x 32 of C in 24 registers, A's
   12 values of a k broadcast straight from A as stored (packed only for a last tile of fewer rows),
   op(B) packed into panels of 32 columns, 256 values of k (GK_KC) and up to 1,024 columns (GK_NC)
   at a time in a buffer of the thread's own (1 MB, kept while the thread lives): 1.06-1.18x
   OpenBLAS on the step's products (benchmarks/gemm_cpu.py), 1.01-1.05x on GPT-2 124M's. Products
   with A transposed (the weight gradients x^T dy) stay with sgemm: strided reads of A's columns
   came out 0.94-1.03x OpenBLAS, packed or not. Each C value is summed over k in order, FMA by FMA,
   in a fixed order of k blocks: its bits depend on neither the thread count nor the block it is in.
   sgemv still takes a single row.
*/
#include "cpu_kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                           const float*, int64_t, float, float*, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float*, int, const float*,
                           int, float, float*, int);
typedef void (*sgemv64_fn)(int, int, int64_t, int64_t, float, const float*, int64_t, const float*,
                           int64_t, float, float*, int64_t);
typedef void (*sgemv32_fn)(int, int, int, int, float, const float*, int, const float*, int, float,
                           float*, int);
static void* sgemm_ptr;            /* the BLAS's cblas_sgemm and cblas_sgemv, or NULL */
static void* sgemv_ptr;
static int sgemm_ilp64;

/* The BLAS's cblas_sgemm and cblas_sgemv (ilp64: 64-bit integer arguments), or NULLs. */
void forge_set_blas(void* sgemm, void* sgemv, int ilp64) {
    sgemm_ptr = sgemv ? sgemm : NULL;
    sgemv_ptr = sgemm ? sgemv : NULL;
    sgemm_ilp64 = ilp64;
    pool_spin_between_jobs(sgemm_ptr != NULL);
}

static long gemm_blocks = 1;

void forge_set_gemm_blocks(long blocks) { gemm_blocks = blocks < 1 ? 1 : blocks; }

#if defined(__AVX512F__)
#define GK_MR 12        /* rows of a tile of C */
#define GK_NR 32        /* its columns: two 16-float registers */
#define GK_KC 256       /* values of k a panel of op(B) holds */
#define GK_NC 1024      /* columns of op(B) packed at a time */
/* Blocks it takes: at least GK_ROWS_MIN rows (each packed value of op(B) serves them all;
   with 2-63 rows, a decoding step's few rows, it ran 1.1-1.9x OpenBLAS's time), and op(B)
   transposed only in blocks of rows (there each thread packs its op(B) once for hundreds of
   rows; a block of columns of B^T, as an LM head's 50,304, packs a transpose per block and
   ran 1.02-1.26x OpenBLAS's time) */
#define GK_ROWS_MIN 64
static int gemm_own = 1;

/* C[0:rows, 0:cols] (+)= alpha * sum over k < kc of op(A)[r][k] * Bp[k][0:32], op(A)[r][k] at
   a[r * rs + k * cs], Bp packed (kc rows of 32 floats, zero past the block's last column);
   `add`: C's values are added to (else only written). Always inlined, so that each of the
   two callers below has its strides' constant part folded in. */
static inline __attribute__((always_inline)) void gk_tile(long kc, const float* RESTRICT a,
        long rs, long cs, const float* RESTRICT bp, float* c, long ldc, int rows, int cols,
        float alpha, int add) {
    __m512 acc[GK_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < GK_MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long k = 0; k < kc; ++k) {
        const __m512 b0 = _mm512_load_ps(bp + k * GK_NR), b1 = _mm512_load_ps(bp + k * GK_NR + 16);
#pragma GCC unroll 12
        for (int r = 0; r < GK_MR; ++r) {
            const __m512 v = _mm512_set1_ps(a[r * rs + k * cs]);
            acc[r][0] = _mm512_fmadd_ps(v, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(v, b1, acc[r][1]);
        }
    }
    const __m512 va = _mm512_set1_ps(alpha);
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1u);
    const __mmask16 m1 = cols >= 32   ? 0xffff
                         : cols <= 16 ? 0
                                      : (__mmask16)((1u << (cols - 16)) - 1u);
    for (int r = 0; r < rows; ++r) {
        float* cr = c + r * ldc;
        __m512 v0 = _mm512_mul_ps(va, acc[r][0]), v1 = _mm512_mul_ps(va, acc[r][1]);
        if (add) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
        }
        _mm512_mask_storeu_ps(cr, m0, v0);
        _mm512_mask_storeu_ps(cr + 16, m1, v1);
    }
}

/* op(A) packed (rows of GK_MR), or A's rows as stored */
static void gk_tile_packed(long kc, const float* a, const float* bp, float* c, long ldc, int rows,
                           int cols, float alpha, int add) {
    gk_tile(kc, a, 1, GK_MR, bp, c, ldc, rows, cols, alpha, add);
}
static void gk_tile_a(long kc, const float* a, long lda, const float* bp, float* c, long ldc,
                      int cols, float alpha, int add) {
    gk_tile(kc, a, lda, 1, bp, c, ldc, GK_MR, cols, alpha, add);
}

/* The thread's buffer for packed panels of op(B) (GK_KC x GK_NC floats), or NULL. */
static float* gk_buffer(void) {
    static __thread float* buf;
    void* p;
    if (!buf && posix_memalign(&p, 64, sizeof(float) * GK_KC * GK_NC) == 0) buf = p;
    return buf;
}

static long gk_min(long a, long b) { return a < b ? a : b; }

/* op(B)[p0:p0+kc, j0:j0+nc] into panels of GK_NR columns at bp (kc rows of GK_NR floats each,
   zero past column nc). */
static void gk_pack_b(int tb, const float* b, long ldb, long p0, long kc, long j0, long nc,
                      float* bp) {
    for (long jp = 0; jp * GK_NR < nc; ++jp) {
        float* RESTRICT d = bp + jp * GK_NR * kc;
        const long jj = j0 + jp * GK_NR, w = gk_min(nc - jp * GK_NR, GK_NR);
        if (tb) {
            for (long j = 0; j < w; ++j) {
                const float* RESTRICT src = b + (jj + j) * ldb + p0;
                for (long q = 0; q < kc; ++q) d[q * GK_NR + j] = src[q];
            }
        } else {
            for (long q = 0; q < kc; ++q)
                memcpy(d + q * GK_NR, b + (p0 + q) * ldb + jj, sizeof(float) * w);
        }
        for (long q = 0; w < GK_NR && q < kc; ++q)
            memset(d + q * GK_NR + w, 0, sizeof(float) * (GK_NR - w));
    }
}

/* h < GK_MR rows of A (from ai, row stride lda) for kc values of k into ap (kc rows of GK_MR
   floats, zero past row h). */
static void gk_pack_a(const float* ai, long lda, long h, long kc, float* ap) {
    for (long r = 0; r < h; ++r)
        for (long q = 0; q < kc; ++q) ap[q * GK_MR + r] = ai[r * lda + q];
    for (long q = 0; h < GK_MR && q < kc; ++q)
        memset(ap + q * GK_MR + h, 0, sizeof(float) * (GK_MR - h));
}

/* C (rows x cols at c, row stride ldc) = alpha A op(B) (+ C where beta is 1), A's rows from a
   (row r, value k at a[r * lda + k]), op(B)'s columns from b (value k of column j at
   b[j * ldb + k] if tb, else b[k * ldb + j]). 0, or -1 where the thread's buffer could not be
   allocated (nothing written). */
static int gk_gemm(int tb, long rows, long cols, long k, float alpha, const float* a,
                   long lda, const float* b, long ldb, float beta, float* c, long ldc) {
    float* bp = gk_buffer();
    if (!bp) return -1;
    float ap[GK_MR * GK_KC] __attribute__((aligned(64)));
    for (long j0 = 0; j0 < cols; j0 += GK_NC) {
        const long nc = gk_min(cols - j0, GK_NC);
        for (long p0 = 0; p0 < k; p0 += GK_KC) {
            const long kc = gk_min(k - p0, GK_KC);
            const int add = p0 > 0 || beta != 0.0f;
            gk_pack_b(tb, b, ldb, p0, kc, j0, nc, bp);
            for (long i0 = 0; i0 < rows; i0 += GK_MR) {
                const long h = gk_min(rows - i0, GK_MR);
                const float* ai = a + i0 * lda + p0;
                if (h < GK_MR) gk_pack_a(ai, lda, h, kc, ap);
                for (long jp = 0; jp * GK_NR < nc; ++jp) {
                    const int w = (int)gk_min(nc - jp * GK_NR, GK_NR);
                    float* ct = c + i0 * ldc + j0 + jp * GK_NR;
                    const float* bpj = bp + jp * GK_NR * kc;
                    if (h < GK_MR)
                        gk_tile_packed(kc, ap, bpj, ct, ldc, (int)h, w, alpha, add);
                    else
                        gk_tile_a(kc, ai, lda, bpj, ct, ldc, w, alpha, add);
                }
            }
        }
    }
    return 0;
}
#endif

/* Whether blocks of GK_ROWS_MIN rows or more take forge's own product (gk_gemm) rather than
   the BLAS's sgemm: `want` where the library is built with AVX-512, else 0 (want < 0: the
   choice as it stands, unchanged). Returns the choice. */
int forge_gemm_own(int want) {
#if defined(__AVX512F__)
    if (want >= 0) gemm_own = want != 0;
    return gemm_own;
#else
    (void)want;
    return 0;
#endif
}

#define GEMM_ROWS_MIN 64
enum { EPI_NONE = 0, EPI_GELU = 1, EPI_DGELU = 2 };
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef struct {
    int ta, tb, epi, by_rows;
    long m, n, k, lda, ldb, ldc, block;   /* block: rows or columns per item */
    float alpha;
    const float *a, *b, *bias, *res;
    float *c, *aux;
    double* part;                         /* with sums: a row of n per block of rows, or one */
} gemm_ctx;

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
    }
#if defined(__AVX512F__)
    else if (gemm_own && !g->ta && rows >= GK_ROWS_MIN && (g->by_rows || !g->tb) && g->k > 0 &&
             gk_gemm(g->tb, rows, cols, g->k, g->alpha, a, g->lda, b, g->ldb, beta, c, ldc) == 0) {
    }
#endif
    else if (sgemm_ilp64) {
        ((sgemm64_fn)sgemm_ptr)(CBLAS_ROW_MAJOR, ta, tb, rows, cols, g->k, g->alpha, a, g->lda, b,
                                g->ldb, beta, c, ldc);
    } else {
        ((sgemm32_fn)sgemm_ptr)(CBLAS_ROW_MAJOR, ta, tb, (int)rows, (int)cols, (int)g->k, g->alpha,
                                a, (int)g->lda, b, (int)g->ldb, beta, c, (int)ldc);
    }
    if (g->epi == EPI_GELU)
        for (long r = 0; r < rows; ++r) gelu_span(c + r * ldc, g->aux + (r0 + r) * n + c0, cols);
    else if (g->epi == EPI_DGELU)
        for (long r = 0; r < rows; ++r) {
            float* cr = c + r * ldc;
            gelu_bwd_span(g->aux + (r0 + r) * n + c0, cr, cr, cols);
        }
    if (g->part) {
        double* RESTRICT ps = g->part + (g->by_rows ? r0 / g->block * n : 0) + c0;
        for (long r = 0; r < rows; ++r) {
            const float* RESTRICT cr = c + r * ldc;
#pragma omp simd
            for (long j = 0; j < cols; ++j) ps[j] += (double)cr[j];
        }
    }
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
   op(A) is m x k, op(B) k x n; res and aux are (m x n) contiguous; sums (n, or NULL): C's
   column sums. Returns -1 when no BLAS was given, -2 when the partial sums cannot be
   allocated. */
int gemm_f32(int ta, int tb, long m, long n, long k, float alpha, const float* a, long lda,
             const float* b, long ldb, const float* bias, const float* res, int epi, float* aux,
             float* c, long ldc, float* sums) {
    if (!sgemm_ptr) return -1;
    const int by_rows = m >= GEMM_ROWS_MIN && m >= n;
    const long extent = by_rows ? m : n;
    long block = ((extent + gemm_blocks - 1) / gemm_blocks + 15) / 16 * 16;
    if (block < 16) block = 16;
    const long items = (extent + block - 1) / block, rows_of_part = by_rows ? items : 1;
    double* part = NULL;
    if (sums && !(part = calloc((size_t)(rows_of_part * n), sizeof(double)))) return -2;
    gemm_ctx g = {ta, tb, epi, by_rows, m, n, k, lda, ldb, ldc, block, alpha, a, b, bias, res, c,
                  aux, part};
    pool_run(gemm_task, &g, items, 1);
    if (part) sum_parts(part, rows_of_part, n, sums);
    free(part);
    return 0;
}

