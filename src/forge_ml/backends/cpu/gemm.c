/* gemm.c: matrix products on the pool's threads: C = alpha op(A) op(B) (+ P), row-major, by one
   single-threaded BLAS call per block of C (forge_set_blas gives the BLAS, and native.py
   keeps that BLAS at one thread of its own). Blocks: one per core the process may use (at
   most 16; forge_set_gemm_blocks, set once at load), never per thread: BLAS may take another
   code path, and another rounding, for another block shape, so blocks sized by the thread
   count changed bits (a 100-row product on 1 and 2 threads), and the ThreadTuner's choice of
   count must change none. Blocks of rows where m >= GEMM_ROWS_MIN and m >= n; else blocks of
   columns (a decoding step's single row; a weight gradient's C x N with N > C): sgemv for
   one row (sgemm would pack all of op(B) for it), sgemm for a few. Each block of rows packs
   all of op(B) (k x n) and each block of columns all of op(A) (m x k): the split is along the
   longer side of C, so the operand every block repacks is the smaller one (the nanoGPT CPU
   step's dW = x^T dy of 128 x 512 and 128 x 384, k 768: 10-11% faster by columns, the step
   ~0.9 ms of 24). More blocks than cores cost: the nanoGPT CPU step took 4% longer with 4
   blocks than with 2 on a 2-core VM, 6% with 8. Per block:
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
*/
#include "cpu_kernels.h"

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
    for (long j = 0; part && j < n; ++j) {
        double s = 0.0;
        for (long i = 0; i < rows_of_part; ++i) s += part[i * n + j];
        sums[j] = (float)s;
    }
    free(part);
    return 0;
}

