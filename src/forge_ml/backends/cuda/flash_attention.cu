// launched from backends/cuda/attention.py
// flash_attention.cu: fused causal self-attention for bfloat16 at head size 64, forward and
// backward, after FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023). Scores and probabilities live in registers one
// 64 x 64 tile at a time, normalised by the online softmax (Milakov & Gimelshein, 2018); no
// T x T matrix touches memory. Products run on the tensor cores (mma.sync m16n8k16, bf16 in,
// float32 accumulate); the softmax, the log-sum-exp and every accumulator are float32.
//
// Layout: bf16 rows of 64 (one head's channels). Row i of head bh = (b, h) of an operand starts
// at element (bh / H) * sb + (bh % H) * sh + i * ld, with (sb, sh, ld) given per group: one
// for q and dq, one for k, v, dk and dv, one for out and dout. Head-major (BH, T, 64) tensors
// pass H = 1, sb = T * 64, ld = 64; GPT-2's fused layout passes the (B, T, 3C) qkv rows (ld =
// 3C, sh = 64, k and v pointers offset by C and 2C) and the (B, T, C) output (ld = C), so no
// head split or merge copies are needed. lse, D are (BH, Tq) float32.
// Causal with a KV-cache offset: query row i sees key j when j <= i + off, off = Tk - Tq >= 0.
// lse_i = log sum_j exp(scale * q_i . k_j) over the keys row i sees (natural log, as v1).
//
//   flash_fwd_bf16_h64       block (bh, 64 query rows), warp w owns 16 of those rows; walks the
//                            64-key blocks up to the diagonal; writes out and lse.
//   flash_bwd_dq_bf16_h64    block (bh, 64 query rows), warp w owns 16 rows; writes
//                            D = rowsum(dout * out) and dq, walking the key blocks as above.
//   flash_bwd_dkdv_bf16_h64  block (bh, 64 keys), warp w owns 16 keys; walks the 64-query
//                            blocks from the diagonal to the end; reads D; writes dk and dv.
// The backward recomputes P = exp(scale * q k^T - lse) from the saved lse in both kernels
// rather than adding dq up with atomics: two more tile products, but no float32 dq buffer and
// the same bits on every run.
//
// Dropout on the probabilities (FlashAttention's): each kernel is a template over DROP, and its
// last four arguments (ignored when DROP is false) are the seed (an int, or a device address
// and a site: ops.SeedAt), the least Philox word kept and 1/(1-p). The mask is ops.dropout's
// over the (B, H, Tq, Tk) probabilities, bit for bit (see "dropout" below), drawn again in each
// kernel rather than stored. With M = keep / (1-p): out = (P * M) v with P normalised over every
// key (lse unchanged), dv = (P * M)^T dout, dS = P * (M * dout v^T - D) with D = rowsum(dout *
// out) as before (out holds the mask). The DROP = false instances compile to the same code as
// kernels written without dropout: the flag is a template parameter of the kernel itself (an
// inlined device function would change its code: NVVM optimises an inlined body's loops
// before it inlines it).
//
// Fragments are those of PTX ISA "Matrix Fragments for mma.m16n8k16" (g = lane / 4,
// t = lane % 4; each 32-bit register holds two bf16, the lower column in the low half):
//   A (16 x 16):  a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16 x 8):   b0 = rows 2t..2t+1 of column g,  b1 = rows 2t+8..2t+9 of column g
//   C (16 x 8):   c0, c1 = (g, 2t..2t+1)           c2, c3 = (g+8, 2t..2t+1)
// So two C tiles side by side (16 x 16) are, rounded to bf16, the A operand of the next
// product without leaving registers. B tiles come from shared memory through ldmatrix: plain
// when the operand is stored n-major (k^T in q k^T: rows of k are columns of B), .trans when
// it is stored k-major (v in p v: rows of v are rows of B).
#include "common.cuh"

#define FA_D 64         // head size
#define FA_BLK 64       // query rows, or keys, per block (and per tile)
#define FA_LD 72        // shared tile row stride in bf16: 144 bytes, so the 8 rows one
                        // ldmatrix phase reads start in 8 distinct 16-byte bank groups
#define FA_THREADS 128  // 4 warps, 16 rows each
#define FA_LN2 0.6931471805599453f

// ---- PTX wrappers (sm_80+: ldmatrix, mma.sync bf16; cp.async, cvt.rn.bf16x2 in common.cuh)

// Four 8 x 8 bf16 matrices from shared memory: lane 8m + r gives the address of row r of
// matrix m; register m of lane l receives matrix m's (row l/4, columns 2(l%4)..+1), or with
// .trans its (rows 2(l%4)..+1, column l/4).
FORGE_D void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

FORGE_D void ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a (16 x 16) b (16 x 8), bf16 products summed in float32.
FORGE_D void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// ---- tiles and fragments ------------------------------------------------------------------


// Rows r0..r0+63 of an (n, 64) bf16 matrix with row stride ld into a shared tile of row
// stride FA_LD; rows >= n become zeros. Each of the 128 threads moves four 16-byte chunks; a
// warp covers four whole rows (4 x 128 bytes) per step.
FORGE_D void load_tile(bf16* tile, const bf16* src, int r0, int n, int tid, int ld) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = tid + FA_THREADS * i, row = c >> 3, col = (c & 7) * 8;
        const bool valid = r0 + row < n;
        const bf16* p = valid ? src + (long long)(r0 + row) * ld + col : src;
        cp_async16(smem_u32(tile + row * FA_LD + col), p, valid);
    }
}


// Byte offset of this lane's ldmatrix row address within a tile, for the two B patterns.
//   plain: 16 x 8 B tiles whose columns are tile rows (k^T): matrix m = (tile rows 0..7,
//          columns 8m..8m+7); one call yields b0, b1 of two k-steps (k = 32 kp + 0..31).
//   trans: B tiles whose rows are tile rows (v): matrix m = (tile rows 8(m&1)..+7, columns
//          8(m>>1)..+7); one call yields b0, b1 of two adjacent 8-column n-tiles.
FORGE_D unsigned lane_off_plain(int lane) { return ((lane & 7) * FA_LD + 8 * (lane >> 3)) * 2; }
FORGE_D unsigned lane_off_trans(int lane) {
    return (((lane & 7) + 8 * ((lane >> 3) & 1)) * FA_LD + 8 * (lane >> 4)) * 2;
}

// acc (16 x 64) += a (16 x 64, from registers) b^T, where b is a shared 64 x 64 tile read
// with the plain pattern (tile row = output column): the q k^T and dout v^T shapes.
FORGE_D void mma_abt(float (&acc)[8][4], const unsigned (&a)[4][4], unsigned tile_lane) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int kp = 0; kp < 2; ++kp) {
            unsigned b[4];
            ldsm_x4(b, tile_lane + (8 * nt * FA_LD + 32 * kp) * 2);
            mma_bf16(acc[nt], a[2 * kp], b[0], b[1]);
            mma_bf16(acc[nt], a[2 * kp + 1], b[2], b[3]);
        }
    }
}

// acc (16 x 64) += p (16 x 64, float32 C tiles, rounded to bf16 here) b, where b is a shared
// 64 x 64 tile read with the trans pattern (tile row = k): the p v and ds k shapes.
FORGE_D void mma_cb(float (&acc)[8][4], const float (&p)[8][4], unsigned tile_lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned a[4];
        a[0] = pack_bf16x2(p[2 * kk][0], p[2 * kk][1]);
        a[1] = pack_bf16x2(p[2 * kk][2], p[2 * kk][3]);
        a[2] = pack_bf16x2(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = pack_bf16x2(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < 4; ++dp) {
            unsigned b[4];
            ldsm_x4_t(b, tile_lane + (16 * kk * FA_LD + 16 * dp) * 2);
            mma_bf16(acc[2 * dp], a, b[0], b[1]);
            mma_bf16(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

FORGE_D void zero_acc(float (&acc)[8][4]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
}

// Rows r_lo (c0, c1) and r_lo + 8 (c2, c3) of a 16 x 64 float32 accumulator, times `mul`,
// to an (n, 64) bf16 matrix with row stride ld; rows >= n are skipped.
FORGE_D void store_rows(bf16* dst, const float (&acc)[8][4], int r_lo, int n, float mul_lo,
                        float mul_hi, int t, int ld) {
    unsigned* lo = reinterpret_cast<unsigned*>(dst + (long long)r_lo * ld);
    unsigned* hi = lo + 8 * (long long)ld / 2;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (r_lo < n) lo[4 * nt + t] = pack_bf16x2(acc[nt][0] * mul_lo, acc[nt][1] * mul_lo);
        if (r_lo + 8 < n) hi[4 * nt + t] = pack_bf16x2(acc[nt][2] * mul_hi, acc[nt][3] * mul_hi);
    }
}


// ---- dropout ------------------------------------------------------------------------------
// forge_ml.rng's dropout stream over the (B, H, Tq, Tk) probabilities in row-major order, the
// mask ops.dropout draws on the composed path: element (bh, i, j) is n = (bh Tq + i) Tk + j,
// its draw is word n % 4 of philox4x32_10((n/4 lo, n/4 hi, 0, 0), (seed lo, seed hi)), and it
// is kept when (word >> 8) 2^-24 >= p, that is when word >= keep_min = ceil(p 2^24) 2^8.
// A thread turns its 16 x 64 tile's draws into 32 keep bits, bit 4 nt + e for element [nt][e]
// of its accumulators. One Philox call gives 4 consecutive elements: when Tk % 4 == 0 (`quads`)
// each call's 4 words serve 2 or 4 lanes, passed on by shuffles (8 calls a thread and tile);
// otherwise each element takes a call of its own (32).

struct FaDrop {
    unsigned k0, k1;    // the stream's Philox key: the seed's low and high words
    unsigned keep_min;  // a draw is kept when its word >= keep_min
    float scale;        // 1/(1-p) rounded once to float32 (rng.dropout_scale)
};

// The stream of the kernels' dropout arguments: the seed itself when seed_at is null, else
// mix_seed(*seed_at, seed) (ops.SeedAt: a captured step's seed, read when the kernel runs).
FORGE_D FaDrop fa_drop(const unsigned long long* seed_at, unsigned long long seed,
                       unsigned keep_min, float scale) {
    if (seed_at != nullptr) seed = mix_seed(*seed_at, seed);
    FaDrop d;
    d.k0 = (unsigned)(seed & 0xffffffffULL);
    d.k1 = (unsigned)(seed >> 32);
    d.keep_min = keep_min;
    d.scale = scale;
    return d;
}

// Keep bits of elements 4 blk .. 4 blk + 3 (bit j: element 4 blk + j): one Philox call.
FORGE_D unsigned fa_keep4(const FaDrop& d, unsigned long long blk) {
    u32x4 c;
    c.x = (unsigned)(blk & 0xffffffffULL);
    c.y = (unsigned)(blk >> 32);
    c.z = 0u;
    c.w = 0u;
    const u32x4 r = philox4x32_10(c, d.k0, d.k1);
    return (unsigned)(r.x >= d.keep_min) | ((unsigned)(r.y >= d.keep_min) << 1) |
           ((unsigned)(r.z >= d.keep_min) << 2) | ((unsigned)(r.w >= d.keep_min) << 3);
}

// The keep bit of element n.
FORGE_D unsigned fa_keep1(const FaDrop& d, unsigned long long n) {
    return (fa_keep4(d, n >> 2) >> (unsigned)(n & 3ULL)) & 1u;
}

// Keep bits of a tile in the query-row layout (forward, dq): element [nt][e] is row r_lo
// (e < 2) or r_hi, key k0 + 8 nt + 2t + (e & 1); n_lo, n_hi are the indices of (r_lo, k0) and
// (r_hi, k0). With quads every row starts a Philox block, and the block of keys
// k0 + 8 nt + 4(t/2) .. +3 holds the pairs of lanes t and t^1: the even lane draws row r_lo's
// blocks, the odd lane row r_hi's, and each lane takes its pair of every block from the two.
FORGE_D unsigned fa_keep_rows(const FaDrop& d, unsigned long long n_lo, unsigned long long n_hi,
                              int t, int lane, bool quads) {
    if (quads) {
        const unsigned long long n0 = ((t & 1) ? n_hi : n_lo) + 4 * (t >> 1);
        unsigned mine = 0;  // nibble nt: the block of keys k0 + 8 nt + 4(t/2) ..
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mine |= fa_keep4(d, (n0 >> 2) + 2 * nt) << (4 * nt);
        const int sh = 2 * (t & 1);  // an odd lane's pair is words 2, 3 of each block
        const unsigned lo = __shfl_sync(0xffffffffu, mine, lane & ~1) >> sh;
        const unsigned hi = __shfl_sync(0xffffffffu, mine, lane | 1) >> sh;
        return (lo & 0x33333333u) | ((hi & 0x33333333u) << 2);
    }
    unsigned bits = 0;
#pragma unroll 1
    for (int b = 0; b < 32; ++b) {
        const int nt = b >> 2, e = b & 3;
        bits |= fa_keep1(d, ((e < 2) ? n_lo : n_hi) + 8 * nt + 2 * t + (e & 1)) << b;
    }
    return bits;
}

// Keep bits of a tile in the key-row layout (dk/dv): element [nt][e] is key j_lo = w0 + g
// (e < 2) or j_hi = j_lo + 8, query q0 + 8 nt + 2t + (e & 1); n_q0 is the index of (q0, w0),
// and consecutive keys are consecutive elements. With quads the keys w0 + 8(e/2) + 4(g/4) ..
// +3 of one query are a Philox block that lanes g = 4(g/4) .. +3 (same t) share: lane g % 4 = r
// draws the blocks of its slot e = r, and each lane takes word r of every slot's block from the
// lane that drew it.
FORGE_D unsigned fa_keep_keys(const FaDrop& d, unsigned long long n_q0, int Tk, int g, int t,
                              int lane, bool quads) {
    const unsigned long long tk = (unsigned long long)Tk;
    if (quads) {
        const int r = g & 3;
        const unsigned long long n0 = n_q0 + (2 * t + (r & 1)) * tk + 8 * (r >> 1) + 4 * (g >> 2);
        unsigned mine = 0;  // nibble nt: the block of slot r for queries q0 + 8 nt + ..
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mine |= fa_keep4(d, (n0 + 8 * nt * tk) >> 2) << (4 * nt);
        unsigned bits = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // lane 16(g/4) + 4e + t drew slot e
            const unsigned w = __shfl_sync(0xffffffffu, mine, (lane & ~12) | (e << 2));
            bits |= ((w >> r) & 0x11111111u) << e;
        }
        return bits;
    }
    unsigned bits = 0;
#pragma unroll 1
    for (int b = 0; b < 32; ++b) {
        const int nt = b >> 2, e = b & 3;
        const unsigned long long i = 8 * nt + 2 * t + (e & 1), j = g + 8 * (e >> 1);
        bits |= fa_keep1(d, n_q0 + i * tk + j) << b;
    }
    return bits;
}

// The layout arguments every kernel takes (see the top of the file), and the dropout ones.
#define FA_LAYOUT_PARAMS                                                                      \
    int H, long long q_sb, long long q_sh, int q_ld, long long kv_sb, long long kv_sh,        \
        int kv_ld, long long o_sb, long long o_sh, int o_ld
#define FA_DROP_PARAMS                                                                        \
    const unsigned long long* __restrict__ seed_at, unsigned long long seed,                  \
        unsigned keep_min, float keep_scale

// ---- forward ------------------------------------------------------------------------------

// Block (blockIdx.x = bh, query rows q0..q0+63), the latest rows (the most keys) first.
// Warp w owns rows q0+16w..+15: this thread rows r_lo = q0+16w+g and r_hi = r_lo+8, columns
// 8nt+2t, +1 of every 8-wide n-tile. Scores are kept in log2 units, x = scale*log2(e) q.k, so
// the softmax is exp2(x - m). DROP: the dropped probabilities count in l but do not reach o,
// and 1/(1-p) joins the final 1/l.
template <bool DROP>
__global__ void __launch_bounds__(FA_THREADS)
    flash_fwd_bf16_h64(const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, bf16* __restrict__ out,
                       float* __restrict__ lse, int Tq, int Tk, float scale, FA_LAYOUT_PARAMS,
                       FA_DROP_PARAMS) {
    const FaDrop drop = DROP ? fa_drop(seed_at, seed, keep_min, keep_scale) : FaDrop();
    __shared__ __align__(16) bf16 sK[2][FA_BLK * FA_LD];
    __shared__ __align__(16) bf16 sV[2][FA_BLK * FA_LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int q0 = (int)(gridDim.y - 1 - blockIdx.y) * FA_BLK;
    const int off = Tk - Tq;
    const bf16* Q = q + head_base(bh, H, q_sb, q_sh);
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const bf16* K = k + kvb;
    const bf16* V = v + kvb;
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = q0 + 16 * warp;  // the warp's first row
    const int r_lo = w0 + g, r_hi = r_lo + 8;
    // the block's last row, q0 + 63, sees keys up to q0 + 63 + off
    const int kv_end = min(Tk, q0 + FA_BLK + off);
    const int nkb = (kv_end + FA_BLK - 1) / FA_BLK;
    // dropout: the mask indices of (r_lo, 0) and (r_hi, 0)
    const unsigned long long n_lo = ((unsigned long long)bh * Tq + r_lo) * (unsigned long long)Tk;
    const unsigned long long n_hi = n_lo + 8ULL * (unsigned long long)Tk;
    const bool quads = (Tk & 3) == 0;

    load_tile(sK[0], K, 0, Tk, tid, kv_ld);
    load_tile(sV[0], V, 0, Tk, tid, kv_ld);
    cp_async_commit();
    unsigned qf[4][4];
    load_a_frags(qf, Q, w0, Tq, g, t, q_ld);

    float o[8][4];
    zero_acc(o);
    const float NEG_INF = neg_inf<float>();
    float m_lo = NEG_INF, m_hi = NEG_INF;  // running max of x per row (whole quad agrees)
    float l_lo = 0.f, l_hi = 0.f;          // this thread's share of the running sum
    const unsigned plain = lane_off_plain(lane), trans = lane_off_trans(lane);

    for (int kb = 0; kb < nkb; ++kb) {
        const int buf = kb & 1;
        // the tile's keep bits, drawn while the tiles load
        const unsigned keep =
            DROP ? fa_keep_rows(drop, n_lo + kb * FA_BLK, n_hi + kb * FA_BLK, t, lane, quads) : 0u;
        if (kb + 1 < nkb) {  // prefetch the next K, V tiles while this one is used
            load_tile(sK[buf ^ 1], K, (kb + 1) * FA_BLK, Tk, tid, kv_ld);
            load_tile(sV[buf ^ 1], V, (kb + 1) * FA_BLK, Tk, tid, kv_ld);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        float s[8][4];
        zero_acc(s);
        mma_abt(s, qf, smem_u32(sK[buf]) + plain);  // q k^T: (16 rows, 64 keys)

        const int k0 = kb * FA_BLK;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= sl2;
        // mask where the tile crosses the diagonal (for this warp's rows) or the end of k
        if (k0 + FA_BLK - 1 > w0 + off || k0 + FA_BLK > Tk) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = k0 + 8 * nt + 2 * t + (e & 1);
                    const int i = (e < 2) ? r_lo : r_hi;
                    if (j > i + off || j >= Tk) s[nt][e] = NEG_INF;
                }
        }

        float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
        }
        mx_lo = quad_max(mx_lo);
        mx_hi = quad_max(mx_hi);
        // a row with nothing seen yet keeps m = -inf; subtract 0 then so no -inf - -inf
        const float b_lo = (mx_lo == NEG_INF) ? 0.f : mx_lo;
        const float b_hi = (mx_hi == NEG_INF) ? 0.f : mx_hi;
        const float al_lo = exp2f(m_lo - b_lo), al_hi = exp2f(m_hi - b_hi);
        m_lo = mx_lo;
        m_hi = mx_hi;
        float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - b_lo);
            s[nt][1] = exp2f(s[nt][1] - b_lo);
            s[nt][2] = exp2f(s[nt][2] - b_hi);
            s[nt][3] = exp2f(s[nt][3] - b_hi);
            sum_lo += s[nt][0] + s[nt][1];
            sum_hi += s[nt][2] + s[nt][3];
            o[nt][0] *= al_lo;
            o[nt][1] *= al_lo;
            o[nt][2] *= al_hi;
            o[nt][3] *= al_hi;
        }
        l_lo = l_lo * al_lo + sum_lo;
        l_hi = l_hi * al_hi + sum_hi;
        if (DROP) {  // o takes the kept probabilities only (l has them all)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!((keep >> (4 * nt + e)) & 1u)) s[nt][e] = 0.f;
        }

        mma_cb(o, s, smem_u32(sV[buf]) + trans);  // o += p v
        __syncthreads();  // every warp is done with buf before it is refilled
    }

    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
    // every row sees key 0, so l >= 1 for the rows that are stored
    const float mul = DROP ? drop.scale : 1.f;
    store_rows(out + head_base(bh, H, o_sb, o_sh), o, r_lo, Tq, mul / l_lo, mul / l_hi, t, o_ld);
    if (t == 0) {
        float* L = lse + bh * Tq;
        if (r_lo < Tq) L[r_lo] = (m_lo + log2f(l_lo)) * FA_LN2;
        if (r_hi < Tq) L[r_hi] = (m_hi + log2f(l_hi)) * FA_LN2;
    }
}

// ---- backward -----------------------------------------------------------------------------
// With P = softmax(S), S = scale q k^T masked (Dao 2023, Algorithm 2):
//   dv = P^T dout,  dP = dout v^T,  dS = P * (dP - D),  D_i = sum_d dout_id out_id,
//   dq = scale dS k,  dk = scale dS^T q.

// Block (blockIdx.x = bh, query rows q0..q0+63), latest rows first; thread ownership as in
// the forward. Writes D for its rows (the dk/dv kernel, launched next, reads it) and dq.
// DROP: dP = (dout v^T) * M.
template <bool DROP>
__global__ void __launch_bounds__(FA_THREADS)
    flash_bwd_dq_bf16_h64(const bf16* __restrict__ q, const bf16* __restrict__ k,
                          const bf16* __restrict__ v, const bf16* __restrict__ out,
                          const bf16* __restrict__ dout, const float* __restrict__ lse,
                          float* __restrict__ Dsum, bf16* __restrict__ dq, int Tq, int Tk,
                          float scale, FA_LAYOUT_PARAMS, FA_DROP_PARAMS) {
    const FaDrop drop = DROP ? fa_drop(seed_at, seed, keep_min, keep_scale) : FaDrop();
    __shared__ __align__(16) bf16 sK[2][FA_BLK * FA_LD];
    __shared__ __align__(16) bf16 sV[2][FA_BLK * FA_LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int q0 = (int)(gridDim.y - 1 - blockIdx.y) * FA_BLK;
    const int off = Tk - Tq;
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const long long qb_ = head_base(bh, H, q_sb, q_sh), ob = head_base(bh, H, o_sb, o_sh);
    const bf16* K = k + kvb;
    const bf16* V = v + kvb;
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = q0 + 16 * warp;
    const int r_lo = w0 + g, r_hi = r_lo + 8;
    const int kv_end = min(Tk, q0 + FA_BLK + off);
    const int nkb = (kv_end + FA_BLK - 1) / FA_BLK;
    // dropout: the mask indices of (r_lo, 0) and (r_hi, 0)
    const unsigned long long n_lo = ((unsigned long long)bh * Tq + r_lo) * (unsigned long long)Tk;
    const unsigned long long n_hi = n_lo + 8ULL * (unsigned long long)Tk;
    const bool quads = (Tk & 3) == 0;

    load_tile(sK[0], K, 0, Tk, tid, kv_ld);
    load_tile(sV[0], V, 0, Tk, tid, kv_ld);
    cp_async_commit();

    unsigned qf[4][4], df[4][4];
    load_a_frags(qf, q + qb_, w0, Tq, g, t, q_ld);
    load_a_frags(df, dout + ob, w0, Tq, g, t, o_ld);
    float d_lo, d_hi, l2_lo, l2_hi;  // D and lse (log2 units) of rows r_lo, r_hi
    dq_rows_d_lse(df, out + ob, lse, Dsum, bh, w0, Tq, g, t, o_ld, d_lo, d_hi, l2_lo, l2_hi);

    float acc[8][4];
    zero_acc(acc);
    const unsigned plain = lane_off_plain(lane), trans = lane_off_trans(lane);

    for (int kb = 0; kb < nkb; ++kb) {
        const int buf = kb & 1;
        const unsigned keep =
            DROP ? fa_keep_rows(drop, n_lo + kb * FA_BLK, n_hi + kb * FA_BLK, t, lane, quads) : 0u;
        if (kb + 1 < nkb) {
            load_tile(sK[buf ^ 1], K, (kb + 1) * FA_BLK, Tk, tid, kv_ld);
            load_tile(sV[buf ^ 1], V, (kb + 1) * FA_BLK, Tk, tid, kv_ld);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        float p[8][4], dp[8][4];
        zero_acc(p);
        zero_acc(dp);
        mma_abt(p, qf, smem_u32(sK[buf]) + plain);   // q k^T
        mma_abt(dp, df, smem_u32(sV[buf]) + plain);  // dout v^T
        const int k0 = kb * FA_BLK;
        const bool edge = k0 + FA_BLK - 1 > w0 + off || k0 + FA_BLK > Tk;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = k0 + 8 * nt + 2 * t + (e & 1);
                const int i = (e < 2) ? r_lo : r_hi;
                const bool masked = edge && (j > i + off || j >= Tk);
                const float pe = masked ? 0.f : exp2f(p[nt][e] * sl2 - ((e < 2) ? l2_lo : l2_hi));
                float dpe = dp[nt][e];
                if (DROP) dpe = ((keep >> (4 * nt + e)) & 1u) ? dpe * drop.scale : 0.f;
                p[nt][e] = pe * (dpe - ((e < 2) ? d_lo : d_hi));  // dS
            }
        mma_cb(acc, p, smem_u32(sK[buf]) + trans);  // dq += dS k
        __syncthreads();
    }
    store_rows(dq + qb_, acc, r_lo, Tq, scale, scale, t, q_ld);
}

// Block (blockIdx.x = bh, keys k0..k0+63), the earliest keys (the most queries) first. Warp w
// owns keys k0+16w..+15: this thread keys j_lo = k0+16w+g and j_hi = j_lo+8, and query
// columns 8nt+2t, +1 of each 8-wide n-tile of the current query block. It works on the
// transposed scores S^T = k q^T, so the keys are the rows and dv, dk accumulate in registers.
// DROP: dv takes (P * keep)^T dout, times 1/(1-p) when stored; dP^T = (v dout^T) * M^T.
template <bool DROP>
__global__ void __launch_bounds__(FA_THREADS)
    flash_bwd_dkdv_bf16_h64(const bf16* __restrict__ q, const bf16* __restrict__ k,
                            const bf16* __restrict__ v, const bf16* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ Dsum,
                            bf16* __restrict__ dk, bf16* __restrict__ dv, int Tq, int Tk,
                            float scale, FA_LAYOUT_PARAMS, FA_DROP_PARAMS) {
    const FaDrop drop = DROP ? fa_drop(seed_at, seed, keep_min, keep_scale) : FaDrop();
    __shared__ __align__(16) bf16 sQ[2][FA_BLK * FA_LD];
    __shared__ __align__(16) bf16 sO[2][FA_BLK * FA_LD];  // dout
    __shared__ float sL[2][FA_BLK];                       // lse * log2(e), 0 past Tq
    __shared__ float sD[2][FA_BLK];                       // D, 0 past Tq
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int k0 = (int)blockIdx.y * FA_BLK;
    const int off = Tk - Tq;
    const bf16* Q = q + head_base(bh, H, q_sb, q_sh);
    const bf16* dO = dout + head_base(bh, H, o_sb, o_sh);
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const float* L = lse + bh * Tq;
    const float* D = Dsum + bh * Tq;
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = k0 + 16 * warp;  // the warp's first key
    const int j_lo = w0 + g, j_hi = j_lo + 8;
    // the first query that sees key k0 is i = k0 - off (k0 < Tk, so it is < Tq)
    const int qb0 = max(0, k0 - off) / FA_BLK;
    const int nqb = (Tq + FA_BLK - 1) / FA_BLK;
    // dropout: the mask index of (query 0, key w0)
    const unsigned long long n_w0 = (unsigned long long)bh * Tq * (unsigned long long)Tk + w0;
    const bool quads = (Tk & 3) == 0;

    auto stage = [&](int qb, int buf) {
        const int r0 = qb * FA_BLK;
        load_tile(sQ[buf], Q, r0, Tq, tid, q_ld);
        load_tile(sO[buf], dO, r0, Tq, tid, o_ld);
        cp_async_commit();
        if (tid < FA_BLK) {
            const int i = r0 + tid;
            sL[buf][tid] = (i < Tq) ? L[i] * FORGE_LOG2E : 0.f;
            sD[buf][tid] = (i < Tq) ? D[i] : 0.f;
        }
    };
    stage(qb0, 0);

    unsigned kf[4][4], vf[4][4];
    load_a_frags(kf, k + kvb, w0, Tk, g, t, kv_ld);
    load_a_frags(vf, v + kvb, w0, Tk, g, t, kv_ld);
    float dka[8][4], dva[8][4];
    zero_acc(dka);
    zero_acc(dva);
    const unsigned plain = lane_off_plain(lane), trans = lane_off_trans(lane);

    for (int qb = qb0; qb < nqb; ++qb) {
        const int buf = (qb - qb0) & 1;
        const unsigned keep =
            DROP ? fa_keep_keys(drop, n_w0 + (unsigned long long)qb * FA_BLK * Tk, Tk, g, t, lane,
                                quads)
                 : 0u;
        if (qb + 1 < nqb) {
            stage(qb + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        float p[8][4], ds[8][4];
        zero_acc(p);
        zero_acc(ds);
        mma_abt(p, kf, smem_u32(sQ[buf]) + plain);   // S^T = k q^T: (16 keys, 64 queries)
        mma_abt(ds, vf, smem_u32(sO[buf]) + plain);  // dP^T = v dout^T
        const int q0 = qb * FA_BLK;
        // mask where some (key, query) of this warp has j > i + off, or queries run past Tq
        const bool edge = w0 + 15 > q0 + off || q0 + FA_BLK > Tq;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * nt + 2 * t + (e & 1);  // query column in the block
                const int i = q0 + c;
                const int j = (e < 2) ? j_lo : j_hi;
                const bool masked = edge && (j > i + off || i >= Tq);
                const float pe = masked ? 0.f : exp2f(p[nt][e] * sl2 - sL[buf][c]);
                float dpe = ds[nt][e];
                p[nt][e] = pe;
                if (DROP) {
                    const bool kept = (keep >> (4 * nt + e)) & 1u;
                    p[nt][e] = kept ? pe : 0.f;
                    dpe = kept ? dpe * drop.scale : 0.f;
                }
                ds[nt][e] = pe * (dpe - sD[buf][c]);
            }
        mma_cb(dva, p, smem_u32(sO[buf]) + trans);   // dv += P^T dout
        mma_cb(dka, ds, smem_u32(sQ[buf]) + trans);  // dk += dS^T q
        __syncthreads();
    }
    store_rows(dk + kvb, dka, j_lo, Tk, scale, scale, t, kv_ld);
    const float mul = DROP ? drop.scale : 1.f;
    store_rows(dv + kvb, dva, j_lo, Tk, mul, mul, t, kv_ld);
}

// ---- the instances the backend launches --------------------------------------------------
// Without dropout and with it. Template instances have C++ names, so attention.py asks for each
// by its mangled one (_flash_kernel): a change to a kernel's parameter types must change
// _FLASH_SIGS there too.
#define FA_LAYOUT_TYPES int, long long, long long, int, long long, long long, int, long long, \
                        long long, int
#define FA_DROP_TYPES const unsigned long long*, unsigned long long, unsigned, float
#define FA_INSTANCES(DROP)                                                                    \
    template __global__ void flash_fwd_bf16_h64<DROP>(const bf16*, const bf16*, const bf16*, \
                                                      bf16*, float*, int, int, float,         \
                                                      FA_LAYOUT_TYPES, FA_DROP_TYPES);        \
    template __global__ void flash_bwd_dq_bf16_h64<DROP>(                                     \
        const bf16*, const bf16*, const bf16*, const bf16*, const bf16*, const float*, float*, \
        bf16*, int, int, float, FA_LAYOUT_TYPES, FA_DROP_TYPES);                              \
    template __global__ void flash_bwd_dkdv_bf16_h64<DROP>(                                   \
        const bf16*, const bf16*, const bf16*, const bf16*, const float*, const float*, bf16*, \
        bf16*, int, int, float, FA_LAYOUT_TYPES, FA_DROP_TYPES);
FA_INSTANCES(false)
FA_INSTANCES(true)
