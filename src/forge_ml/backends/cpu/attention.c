/* attention.c: causal attention, one head at a time: q, k, v, out, dout (nbh, t, hs), lse (nbh, t).
   Every product is C = A B with B row-major, computed by tile_rxnv: an R x (nv VW) block of
   C in R nv vector registers, A's entries broadcast (A read as stored or transposed), B's
   rows loaded nv vectors at a time (the GEMM micro-kernel layout of BLIS, Van Zee & van de
   Geijn 2015). Vectors are VW = 16 floats (zmm) with AVX-512, with tiles of 8 x 32 and
   4 x 64 (16 accumulators of the 32 registers; S, dP, P v, dS k, dS^T q and P^T dO all
   1.1x-1.6x faster than the 8-float tiles); else VW = 8 (v8f) and 4 x 16 tiles (8 of the 16
   ymm registers). The causal structure skips every 16-column panel above the diagonal. When
   t % 4 == 0 and hs % 16 == 0 (GPT-2's heads) q, k, v, dout and the results are used in
   place; otherwise they go through zero-padded per-head copies (rows to a multiple of 4,
   columns of 16).
     forward:  S = q k^T;  P = exp(scale S - rowmax) / l, lse = rowmax + log l;  O = P v
     backward (FlashAttention, Dao et al. 2022, alg. 4): P = exp(scale S - lse),
       dP = dO v^T, D = rowsum(dO * O), dS = scale P (dP - D),
       dQ = dS k, dK = dS^T q, dV = P^T dO.
   The elementwise passes (softmax; P and dS) work on whole VW-float vectors (exp_v; the
   scalar exp_f32 in `omp simd` loops over each row's few elements was 2-3x slower).
   Row i of P and dS is written on columns [0, round_up(i + 1, VW)): P is zero right of i,
   dS there is scale 0 (dP - D), NaN where dP is. The products over positions (P v, dS k,
   P^T dO, dS^T q) skip the masked entries of the diagonal blocks rather than multiply them
   by that zero: 0 * inf or NaN is NaN, so a non-finite value at a masked position would
   reach rows that cannot see it.
   The pool's items are heads; each thread has its own scratch.
*/
#include "cpu_kernels.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* The vectors of the tiles and of the softmax passes: 16 floats (one zmm register) where
   AVX-512 is there, else 8 (v8f: one ymm, or two SSE registers). */
#if defined(__AVX512F__)
#define VW 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
#else
#define VW 8
typedef v8f vf;
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
#endif
typedef float v4f __attribute__((vector_size(16)));

/* Pins a vector in a register. Left alone, GCC folds each use of a loaded row of B into the
   FMA as a memory operand, so the 4 x 16 tile of 8-float vectors issued 12 loads per 8 FMAs
   and was load-bound (attention_bwd 1100 -> 660 us on the nanoGPT shapes with the pin). */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* An initializer, not a loop over the lanes: GCC built that one lane at a time. */
static inline vf vbcast(float x) {
#if VW == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return bcast8(x);
#endif
}

/* m ? a : b lane by lane, m a comparison's lanes (all ones or all zeros) */
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

static inline vi vsplat_i(int32_t x) {
#if VW == 16
    return (vi){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vi){x, x, x, x, x, x, x, x};
#endif
}

static inline vi viota(void) {
#if VW == 16
    return (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (vi){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}

/* The sum and the maximum of the lanes, halving the vector (a tree, not a chain of 16). The
   maximum takes a lane only where it is greater, as the rows' scalar max did: NaN lanes are
   passed over unless every lane is NaN (the row is NaN anyway through its exp). */
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline v8f max8(v8f a, v8f b) {
    const v8i m = b > a;
    return (v8f)(((v8i)b & m) | ((v8i)a & ~m));
}

static inline v4f max4(v4f a, v4f b) {
    const v4i m = b > a;
    return (v4f)(((v4i)b & m) | ((v4i)a & ~m));
}

/* v's two halves, of 8 (VW 16) or 4 floats */
#if VW == 16
static inline void halves(vf v, v8f* lo, v8f* hi) {
    memcpy(lo, &v, sizeof *lo);
    memcpy(hi, (char*)&v + sizeof *lo, sizeof *hi);
}
#endif

static inline void halves8(v8f v, v4f* lo, v4f* hi) {
    memcpy(lo, &v, sizeof *lo);
    memcpy(hi, (char*)&v + sizeof *lo, sizeof *hi);
}

static inline float hsum(vf v) {
#if VW == 16
    v8f lo, hi;
    halves(v, &lo, &hi);
    const v8f h = lo + hi;
#else
    const v8f h = v;
#endif
    v4f a, b;
    halves8(h, &a, &b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline float gt_max(float a, float b) { return b > a ? b : a; }

static inline float hmax(vf v) {
#if VW == 16
    v8f lo, hi;
    halves(v, &lo, &hi);
    const v8f h = max8(lo, hi);
#else
    const v8f h = v;
#endif
    v4f a, b;
    halves8(h, &a, &b);
    a = max4(a, b);
    return gt_max(gt_max(a[0], a[2]), gt_max(a[1], a[3]));
}

/* exp_f32 (cpu_kernels.h) on a vector, the same operations lane by lane: the clamps keep a
   NaN x, n = round(x / ln2) by the 1.5 * 2^23 trick, e^r by the same polynomial. With
   AVX-512 the clamps are max / min (they return their second operand, x, where one is NaN)
   and 2^n comes in by vscalefps, not by building the exponent bits: 15 instead of 25
   operations, the exp pass 1.5x faster; the same value for n in exp_f32's range. */
static inline vf exp_v(vf x) {
    const vf lo = vbcast(EXP_LO), hi = vbcast(EXP_HI);
    const vf magic = vbcast(EXP_MAGIC);
#if defined(__AVX512F__)
    x = _mm512_max_ps(lo, x);                        /* lo > x ? lo : x */
    x = _mm512_min_ps(hi, x);                        /* hi < x ? hi : x */
#else
    x = vsel(x < lo, lo, x);
    x = vsel(hi < x, hi, x);
#endif
    const vf t = x * vbcast(EXP_LOG2E) + magic;
    const vf n = t - magic;
    vf r = x - n * vbcast(EXP_LN2_HI);
    r = r - n * vbcast(EXP_LN2_LO);
    vf p = vbcast(EXP_P0);
    p = p * r + vbcast(EXP_P1);
    p = p * r + vbcast(EXP_P2);
    p = p * r + vbcast(EXP_P3);
    p = p * r + vbcast(EXP_P4);
    p = p * r + vbcast(EXP_P5);
    p = p * r * r + r + vbcast(1.0f);
#if defined(__AVX512F__)
    return _mm512_scalef_ps(p, n);
#else
    /* 2^n, n in -126..127: round(x / ln2) + 127 (t's low bits less 0x4B400000) at bit 23 */
    const vu bits = ((vu)t - (vu)vsplat_i(0x4B400000 - 127)) << (vu)vsplat_i(23);
    return p * (vf)bits;
#endif
}

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* Which k (and, for scores, which output columns) a row block [r, r + 4) needs. */
enum { K_ALL, K_UPTO_ROW, K_FROM_ROW };

/* C[0..R, 0..nv VW) = sum over k in [k0, k1) of A[r, k] B[k, 0..nv VW), A[r, k] =
   a[r * ars + k * aks], plus the causal triangle k in [kd, kd + nd): row r takes k only where
   k - kd <= r (K_UPTO_ROW) or k - kd >= r (K_FROM_ROW), skipping the others, not multiplying
   them by 0. R (4 or 8) and nv (R nv <= 16) are constants where this is inlined (tile_rxn):
   the accumulators are named variables, c<row>_<vector>, those past R or nv dropped as dead
   code; GCC kept an array of them in memory. */
#define ROWS(X, u) X(0, u) X(1, u) X(2, u) X(3, u) X(4, u) X(5, u) X(6, u) X(7, u)
#define VECTORS(X) X(0) X(1) X(2) X(3)
static inline __attribute__((always_inline)) void
tile_rxnv(const float* RESTRICT a, long ars, long aks, const float* RESTRICT b, long ldb,
          float* RESTRICT c, long ldc, long k0, long k1, int kind, long kd, long nd,
          const int R, const int nv) {
    const vf zero = vbcast(0.0f);
#define DECLARE(row, u_) vf c##row##_0 = zero, c##row##_1 = zero, c##row##_2 = zero, \
                            c##row##_3 = zero;
    ROWS(DECLARE, 0)
    for (long s = 0; kind == K_FROM_ROW && s < nd; ++s) {      /* the triangle before k0 */
        const float* bk = b + (kd + s) * ldb;
        const float* ak = a + (kd + s) * aks;
#define FROM_ROW(row, u) if (R > row && s >= row) c##row##_##u += vbcast(ak[row * ars]) * b##u;
#define FROM_ROW_V(u) if (nv > u) { const vf b##u = vload(bk + u * VW); ROWS(FROM_ROW, u) }
        VECTORS(FROM_ROW_V)
    }
    for (long k = k0; k < k1; ++k) {
        const float* bk = b + k * ldb;
        const float* ak = a + k * aks;
#define BCAST(row, u_) const vf a##row = R > row ? vbcast(ak[row * ars]) : zero;
        ROWS(BCAST, 0)
#define ALL_ROWS(row, u) if (R > row) c##row##_##u += a##row * b##u;
#define ALL_ROWS_V(u)                                                                         \
        if (nv > u) {                                                                         \
            vf b##u = vload(bk + u * VW);                                                     \
            IN_REGISTER(b##u);                                                                \
            ROWS(ALL_ROWS, u)                                                                 \
        }
        VECTORS(ALL_ROWS_V)
    }
    for (long s = 0; kind == K_UPTO_ROW && s < nd; ++s) {      /* the triangle after k1 */
        const float* bk = b + (kd + s) * ldb;
        const float* ak = a + (kd + s) * aks;
#define UPTO_ROW(row, u) if (R > row && s <= row) c##row##_##u += vbcast(ak[row * ars]) * b##u;
#define UPTO_ROW_V(u) if (nv > u) { const vf b##u = vload(bk + u * VW); ROWS(UPTO_ROW, u) }
        VECTORS(UPTO_ROW_V)
    }
#define STORE(row, u) if (R > row) vstore(c + row * ldc + u * VW, c##row##_##u);
#define STORE_V(u) if (nv > u) { ROWS(STORE, u) }
    VECTORS(STORE_V)
#undef DECLARE
#undef FROM_ROW
#undef FROM_ROW_V
#undef BCAST
#undef ALL_ROWS
#undef ALL_ROWS_V
#undef UPTO_ROW
#undef UPTO_ROW_V
#undef STORE
#undef STORE_V
}

/* An R x (16 np) tile: 16-column panels of 16 / VW vectors. */
static void tile_rxn(const float* RESTRICT a, long ars, long aks, const float* RESTRICT b,
                     long ldb, float* RESTRICT c, long ldc, long k0, long k1, int kind, long kd,
                     long nd, long rows, long np) {
#define TILE(R, nv) tile_rxnv(a, ars, aks, b, ldb, c, ldc, k0, k1, kind, kd, nd, R, nv)
#if VW == 16
    if (rows == 8) {
        if (np == 1) TILE(8, 1);
        else TILE(8, 2);
        return;
    }
    switch (np) {
    case 1: TILE(4, 1); break;
    case 2: TILE(4, 2); break;
    case 3: TILE(4, 3); break;
    default: TILE(4, 4); break;
    }
#else
    (void)rows;
    (void)np;
    TILE(4, 2);
#endif
#undef TILE
}

/* C (m4 x n16) = A (m4 x K) B (K x n16) in tiles of R rows (8, or 4 for the last block of
   rows where m4 % 8 == 4 and without AVX-512) and up to NP_MAX(R) 16-column panels; A[r, k] =
   a[r * ars + k * aks]. K_ALL: k in [0, kn), and only the 16-column panels at or left of the
   block's last row (the causal S and dP). K_UPTO_ROW: row i takes k in [0, i] (A is P or
   dS, zero right of the diagonal). K_FROM_ROW: row i takes k in [i, kn) (A is P^T or dS^T,
   zero left of it). */
#if VW == 16
#define R_MAX 8
#define NP_MAX(R) ((R) == 8 ? 2 : 4)
#else
#define R_MAX 4
#define NP_MAX(R) 1
#endif
static inline void gemm_tiles(const float* a, long ars, long aks, const float* b, long ldb,
                              float* c, long ldc, long m4, long n16, long kn, int kind) {
    for (long r = 0, rows; r < m4; r += rows) {
        rows = r + R_MAX <= m4 ? R_MAX : 4;
        long k0 = 0, k1 = kn, ncols = n16;
        const long nd = kind == K_ALL ? 0 : (kn - r < rows ? kn - r : rows);   /* triangle */
        if (kind == K_ALL) ncols = round_up(r + rows, 16) < n16 ? round_up(r + rows, 16) : n16;
        if (kind == K_UPTO_ROW) k1 = r;
        if (kind == K_FROM_ROW) k0 = r + rows < kn ? r + rows : kn;
        for (long j = 0, np; j < ncols; j += 16 * np) {
            np = (ncols - j) / 16 < NP_MAX(rows) ? (ncols - j) / 16 : NP_MAX(rows);
            tile_rxn(a + r * ars, ars, aks, b + j, ldb, c + r * ldc + j, ldc, k0, k1, kind, r,
                     nd, rows, np);
        }
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

/* dst (hs x tp, zero padding) <- src (t rows of hs, stride ld) transposed. With AVX, 8 x 8
   blocks through registers (Intel's unpack / shuffle / permute sequence): the element by
   element loop took as long as S = q k^T itself at hs = 32, t = 64. */
static void transpose_padded(const float* RESTRICT src, long ld, long t, long hs, long tp,
                             float* RESTRICT dst) {
    long d0 = 0, j0 = 0;
#if defined(__AVX__)
    d0 = hs / 8 * 8;
    j0 = t / 8 * 8;
    for (long j = 0; j < j0; j += 8)
        for (long d = 0; d < d0; d += 8) {
            const float* s = src + j * ld + d;
            const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ld);
            const __m256 r2 = _mm256_loadu_ps(s + 2 * ld), r3 = _mm256_loadu_ps(s + 3 * ld);
            const __m256 r4 = _mm256_loadu_ps(s + 4 * ld), r5 = _mm256_loadu_ps(s + 5 * ld);
            const __m256 r6 = _mm256_loadu_ps(s + 6 * ld), r7 = _mm256_loadu_ps(s + 7 * ld);
            const __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1);
            const __m256 u2 = _mm256_unpacklo_ps(r2, r3), u3 = _mm256_unpackhi_ps(r2, r3);
            const __m256 u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5);
            const __m256 u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
            const __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
            const __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
            const __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
            const __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
            float* o = dst + d * tp + j;
            _mm256_storeu_ps(o, _mm256_permute2f128_ps(s0, s4, 0x20));
            _mm256_storeu_ps(o + tp, _mm256_permute2f128_ps(s1, s5, 0x20));
            _mm256_storeu_ps(o + 2 * tp, _mm256_permute2f128_ps(s2, s6, 0x20));
            _mm256_storeu_ps(o + 3 * tp, _mm256_permute2f128_ps(s3, s7, 0x20));
            _mm256_storeu_ps(o + 4 * tp, _mm256_permute2f128_ps(s0, s4, 0x31));
            _mm256_storeu_ps(o + 5 * tp, _mm256_permute2f128_ps(s1, s5, 0x31));
            _mm256_storeu_ps(o + 6 * tp, _mm256_permute2f128_ps(s2, s6, 0x31));
            _mm256_storeu_ps(o + 7 * tp, _mm256_permute2f128_ps(s3, s7, 0x31));
        }
#endif
    for (long d = 0; d < hs; ++d) {                 /* what the blocks left, and the padding */
        float* RESTRICT row = dst + d * tp;
        for (long j = d < d0 ? j0 : 0; j < t; ++j) row[j] = src[j * ld + d];
        for (long j = t; j < tp; ++j) row[j] = 0.0f;
    }
}

/* Scratch floats of one head's forward and backward (see the layouts below). */
static long fwd_scratch(long t, long hs) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    return hs * tp + t4 * tp + 3 * t4 * hp + 2 * t;
}

static long bwd_scratch(long t, long hs) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    return 2 * hs * tp + 3 * t4 * tp + 6 * t4 * hp + t;
}

/* One head's causal attention: out (stride lo) and lse (t) from q, k, v (strides lq, lk, lv). */
static void attention_head(const float* q, long lq, const float* k, long lk, const float* v,
                           long lv, float* out, long lo, float* RESTRICT lse, long t, long hs,
                           float scale, float* scratch, const drop_t* drop) {
    const long t4 = round_up(t, 4), tp = round_up(t, 16), hp = round_up(hs, 16);
    const long n_a = t4 * hp;
    /* kt (hs, tp); p (t4, tp); q, v, o padded copies (t4, hp) when needed; row maxima and
       sums (t each) */
    float *kt = scratch, *p = kt + hs * tp, *qpad = p + t4 * tp, *vpad = qpad + n_a;
    float *opad = vpad + n_a, *rowmax = opad + n_a, *rowsum = rowmax + t;
    const int direct = t == t4 && hs == hp;
    long sq, sv;
    const float* qa = padded(q, lq, t, hs, t4, hp, qpad, &sq);
    const float* vb = padded(v, lv, t, hs, t4, hp, vpad, &sv);
    float* o = direct ? out : opad;
    transpose_padded(k, lk, t, hs, tp, kt);
    gemm_tiles(qa, sq, 1, kt, tp, p, tp, t4, tp, hs, K_ALL);              /* S */
    /* The softmax on the rows' VW-float vectors [0, round_up(i + 1, VW)), the last vector's
       lanes j > i passed over by selects (S is not finite there where q or k is not). In
       three passes over all rows (max; exp and sum; 1 / l, lse), each row's work short: a
       row's steps form one chain, and with all of them in one loop fewer rows fitted in the
       out-of-order window (1.5x slower). */
    const vi iota = viota();
    const vf vscale = vbcast(scale), ninf = vbcast(-INFINITY), zero = vbcast(0.0f);
    for (long i = 0; i < t; ++i) {
        const float* RESTRICT pi = p + i * tp;
        const long last = i / VW * VW;
        vf mv = vsel(iota <= vsplat_i((int32_t)(i - last)), vload(pi + last) * vscale, ninf);
        for (long j = 0; j < last; j += VW) {
            const vf sj = vload(pi + j) * vscale;
            mv = vsel(sj > mv, sj, mv);
        }
        rowmax[i] = hmax(mv);
    }
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        const long last = i / VW * VW;
        const vf vm = vbcast(rowmax[i]);
        const vf el = vsel(iota <= vsplat_i((int32_t)(i - last)),
                           exp_v(vload(pi + last) * vscale - vm), zero);
        vstore(pi + last, el);
        vf lv = el;
        for (long j = 0; j < last; j += VW) {
            const vf e = exp_v(vload(pi + j) * vscale - vm);
            vstore(pi + j, e);
            lv += e;
        }
        rowsum[i] = hsum(lv);
    }
    for (long i = 0; i < t; ++i) {
        float* RESTRICT pi = p + i * tp;
        const float l = rowsum[i];
        const vf inv = vbcast(1.0f / l);
        for (long j = 0; j <= i; j += VW) vstore(pi + j, vload(pi + j) * inv);
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
    /* kt, vt (hs, tp); p, ds (t4, tp); q, k, dout, dq, dk, dv padded copies (t4, hp);
       dropout's mask (t4, tp); D (t) */
    float *kt = scratch, *vt = kt + n_t, *p = vt + n_t, *ds = p + n_s;
    float *qpad = ds + n_s, *kpad = qpad + n_a, *dopad = kpad + n_a;
    float *dqpad = dopad + n_a, *dkpad = dqpad + n_a, *dvpad = dkpad + n_a;
    float *mask = dvpad + n_a, *dvec = mask + n_s;
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
    for (long i = 0; i < t; ++i) {                                       /* D_i = dO_i . O_i */
        const float* RESTRICT doi = dout + i * lo;
        const float* RESTRICT oi = out + i * lo;
        const long hv = hs / VW * VW;
        vf dv_i = vbcast(0.0f);
        for (long d = 0; d < hv; d += VW) dv_i += vload(doi + d) * vload(oi + d);
        float di = hsum(dv_i);
        for (long d = hv; d < hs; ++d) di += doi[d] * oi[d];
        dvec[i] = di;
    }
    /* with dropout M (keep / (1-p), else 0): dV = (P M)^T dO, dP = (dO V^T) M,
       dS = P (dP - D); D_i = dO_i . O_i still, O holding the mask. M's rows first, into
       scratch (t4, tp). */
    for (long i = 0; drop && i < t; ++i) {
        float* RESTRICT mi = mask + i * tp;
        for (long j = 0; j < round_up(i + 1, VW); ++j) mi[j] = 1.0f;
        dropout_span(mi, mi, i + 1, drop->base + (uint64_t)(i * t), drop);
    }
    /* P and dS by columns of vectors (all rows' vector c, then c + 1: a long loop of
       independent exps, about 3% faster than row by row), lanes j > i of the diagonal's
       vectors selected out: P 0 there, dS scale 0 (dP - D) */
    const vi iota = viota();
    const vf vscale = vbcast(scale), zero = vbcast(0.0f);
    for (long c = 0; c < t; c += VW)
        for (long i = c; i < t; ++i) {
            float* RESTRICT pij = p + i * tp + c;
            float* RESTRICT dsij = ds + i * tp + c;
            const vi keep = iota <= vsplat_i((int32_t)(i - c));
            const vf pj = vsel(keep, exp_v(vload(pij) * vscale - vbcast(lse[i])), zero);
            if (drop) {
                const vf mj = vsel(keep, vload(mask + i * tp + c), zero);
                vstore(pij, pj * mj);
                vstore(dsij, vscale * pj * (vload(dsij) * mj - vbcast(dvec[i])));
            } else {
                vstore(pij, pj);
                vstore(dsij, vscale * pj * (vload(dsij) - vbcast(dvec[i])));
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
   (B, H, T)). Each thread allocates its own scratch. part (fused backward, or NULL): (B, 3C)
   doubles, row b the column sums of batch row b's dqkv rows, each head adding its own
   columns after its backward (the rows still in cache). */
typedef struct {
    const float *q, *k, *v, *out, *lse, *dout;     /* fused: q is qkv, out is y, dout is dy */
    float *o, *lse_out, *dq, *dk, *dv;            /* fused: dq is dqkv */
    long nh, t, hs;                                /* nh: heads per batch row (fused) */
    int fused, bwd;
    float scale;
    const drop_t* drop;
    int failed;
    double* part;
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
                for (long third = 0; a->part && third < 3; ++third) {   /* dq, dk, dv */
                    double* RESTRICT ps = a->part + b * 3 * c + third * c + h * hs;
                    const float* g = dq + third * c;
                    for (long i = 0; i < t; ++i) {
                        const float* RESTRICT gi = g + i * lq;
#pragma omp simd
                        for (long e = 0; e < hs; ++e) ps[e] += (double)gi[e];
                    }
                }
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

/* Heads a thread takes at once in the fused layout: a batch row's nh heads together where
   there are batch rows enough for every thread (two each), else one. A row's heads interleave
   in memory (head h's q, k, v and their gradients are hs floats of every 3C-float row), and
   heads of one row taken by two cores ran a third slower (at nanoGPT's CPU size, 2 threads,
   forward + backward 415 -> 283-310 us with whole rows), likely as each core's prefetchers
   pull the lines beside its own, which the other core reads and writes. Each head's
   arithmetic is the same either way. */
static long fused_grain(long nb, long nh) { return nb >= 2L * forge_get_threads() ? nh : 1; }

/* GPT-2's fused rows (above). The _dropout_ forms apply dropout at rate p (scale 1/(1-p),
   Philox key (k0, k1)) to the probabilities, the mask of forge_ml.rng over (B, H, T, T). */
static int attention_qkv_run(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse,
                             long nb, long t, long nh, long hs, float scale, const drop_t* drop) {
    attn_ctx a = {qkv, NULL, NULL, NULL, NULL, NULL, y, lse, NULL, NULL, NULL, nh, t, hs, 1, 0,
                  scale, drop, 0};
    pool_run(attention_task, &a, nb * nh, fused_grain(nb, nh));
    return a.failed ? -1 : 0;
}

static int attention_qkv_bwd_run(const float* RESTRICT qkv, const float* RESTRICT y,
                                 const float* RESTRICT lse, const float* RESTRICT dy,
                                 float* RESTRICT dqkv, long nb, long t, long nh, long hs,
                                 float scale, const drop_t* drop, double* part) {
    attn_ctx a = {qkv, NULL, NULL, y, lse, dy, NULL, NULL, dqkv, NULL, NULL, nh, t, hs, 1, 1,
                  scale, drop, 0, part};
    pool_run(attention_task, &a, nb * nh, fused_grain(nb, nh));
    return a.failed ? -1 : 0;
}

int attention_qkv_f32(const float* RESTRICT qkv, float* RESTRICT y, float* RESTRICT lse, long nb,
                      long t, long nh, long hs, float scale) {
    return attention_qkv_run(qkv, y, lse, nb, t, nh, hs, scale, NULL);
}

int attention_qkv_bwd_f32(const float* RESTRICT qkv, const float* RESTRICT y,
                          const float* RESTRICT lse, const float* RESTRICT dy,
                          float* RESTRICT dqkv, long nb, long t, long nh, long hs, float scale) {
    return attention_qkv_bwd_run(qkv, y, lse, dy, dqkv, nb, t, nh, hs, scale, NULL, NULL);
}

/* attention_qkv_bwd_f32, and sums = sum_rows(dqkv) (3C): the bias gradient of the layer whose
   output qkv is. Each head adds its columns over its rows in double into its batch row's
   part; the batch rows are then added in order, so no bit depends on the thread count. */
int attention_qkv_bwd_sums_f32(const float* RESTRICT qkv, const float* RESTRICT y,
                               const float* RESTRICT lse, const float* RESTRICT dy,
                               float* RESTRICT dqkv, float* RESTRICT sums, long nb, long t,
                               long nh, long hs, float scale) {
    const long c3 = 3 * nh * hs;
    double* part = calloc((size_t)(nb * c3), sizeof(double));
    if (!part) return -1;
    const int status = attention_qkv_bwd_run(qkv, y, lse, dy, dqkv, nb, t, nh, hs, scale, NULL,
                                             part);
    if (status == 0) sum_parts(part, nb, c3, sums);
    free(part);
    return status;
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
    return attention_qkv_bwd_run(qkv, y, lse, dy, dqkv, nb, t, nh, hs, scale, &d, NULL);
}

