// launched from backends/cuda/attention.py
// flash_hopper.cu: flash_attention.cu's causal attention, forward and backward without dropout
// (bf16, head size 64, the same layouts, outputs and lse), on Hopper's warpgroup products,
// after FlashAttention-3 (Shah et al., 2024) without its producer warps: one warpgroup (4
// warps) a block of 64 rows. The forward:
//   S = q k^T   wgmma m64n64k16, q and k both read from shared memory (K-major tiles)
//   O += P v    wgmma m64n64k16, P from registers (the softmax's own), v from shared memory
//               (an MN-major tile, read transposed)
// Why: in flash_attention.cu each warp reads every B fragment through ldmatrix itself, so the
// four warps of a block read each k and v tile four times and the kernel waits on shared
// memory (H200: forward 3.3 ms a 124M B=32 step against cuDNN's 2.0). A wgmma reads its B
// operand once for the warpgroup, at the tensor cores' own rate.
// The masks and the epilogue are flash_fwd_bf16_h64's, on the same per-thread elements: the
// accumulator of an m64nNk16 wgmma gives warp w rows 16w..16w+15 and lane (g, t) the elements
// mma.sync's C fragments give it, one 8-wide column tile after another. The softmax has fewer
// instructions than flash_fwd_bf16_h64's (the forward issues an instruction on most cycles):
// the tile's max is scaled instead of each score, each exponent is one fma, and 2^x is the
// bare MUFU instruction (wg_exp2). So the outputs are within rounding of the mma.sync kernels',
// no longer their bits.
// The backward keeps flash_attention.cu's two kernels (dq; then dk and dv), each product a
// wgmma with the kernel's row operands in registers (see "backward" below). No dropout here
// (dropout runs flash_attention.cu's kernels).
//
// Written without a GPU (2026-12-04), verified on the H200 on 2026-12-04 (eighth session):
// tests/test_cuda_wgmma_probe.py checks the descriptor strides below on one tile against
// NumPy, tests/test_cuda_flash_hopper.py these kernels against float64 and against
// flash_attention.cu's (the same bits there). The backend's flash path on compute capability
// 9.0 unless FORGE_WGMMA_ATTENTION=off.
//
// Shared tiles: 64 rows of 128 bytes (64 bf16) with the 128-byte swizzle: the 16-byte chunk c
// of row r is stored at chunk c ^ (r % 8); each tile starts on a 1024-byte boundary.
// Matrix descriptor (PTX ISA): bits 0-13 start address >> 4, 16-29 leading-dimension byte
// offset >> 4, 32-45 stride-dimension byte offset >> 4, 62-63 swizzle (1: 128-byte).
#include "common.cuh"

// wgmma exists for sm_90a only: compiled for anything else (NVRTC's plain sm_90, the test that
// compiles every kernel file) the file defines no kernel, so asking for it is a clean error
// rather than a launch. runtime.py compiles this file for sm_90a (_ARCH_STEMS) with
// FORGE_ARCH_FEATURES defined, in case NVRTC does not define nvcc's feature macro.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(FORGE_ARCH_FEATURES)

// K-major tile (rows of q or k, 64 k-values each): 8-row groups 1024 bytes apart; a 16-wide
// k step moves the start 32 bytes (the hardware swizzles the moved address as the store did)
#define WG_K_LBO 16
#define WG_K_SBO 1024
#define WG_K_STEP 32
// MN-major tile (rows of v: row k holds the 64 n-values): 8-row groups along k 1024 bytes
// apart; a 16-row k step moves the start 16 x 128 bytes
#define WG_MN_LBO 16
#define WG_MN_SBO 1024
#define WG_MN_STEP 2048

FORGE_D unsigned long long wg_desc(const void* smem, unsigned lbo_bytes, unsigned sbo_bytes) {
    const unsigned long long a = smem_u32(smem);
    return ((a & 0x3FFFFull) >> 4) | ((unsigned long long)((lbo_bytes >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

FORGE_D void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FORGE_D void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
FORGE_D void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// what the generic proxy wrote to shared memory (cp.async, plain stores) made visible to the
// async proxy that wgmma reads through
FORGE_D void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WG_D32(d)                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),          \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),          \
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_REGS32                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64, f32) += A B^T, A and B K-major shared tiles given by their descriptors.
FORGE_D void wg_mma_ss(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : WG_D32(d)
                 : "l"(da), "l"(db));
}

// d (64 x 64, f32) += A B, A from registers (this warp's 16 rows in mma.sync's A-fragment
// layout), B an MN-major shared tile read transposed.
FORGE_D void wg_mma_rs_t(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (64 x 64, f32) += A B^T, A from registers as above, B a K-major shared tile (the k of
// q k^T in the backward, whose A operands stay in registers for the whole kernel).
FORGE_D void wg_mma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Rows r0..r0+63 of an (n, 64) bf16 matrix with row stride ld into a swizzled shared tile;
// rows >= n become zeros. 512 chunks of 16 bytes, 512 / NT a thread of the NT (thread tid).
template <int NT = 128>
FORGE_D void wg_load_tile(bf16* tile, const bf16* src, int r0, int n, int tid, int ld) {
#pragma unroll
    for (int i = 0; i < 512 / NT; ++i) {
        const int c = tid + NT * i, row = c >> 3, ch = c & 7;
        const bool valid = r0 + row < n;
        const bf16* p = valid ? src + (long long)(r0 + row) * ld + ch * 8 : src;
        cp_async16(smem_u32(reinterpret_cast<char*>(tile) + row * 128 + ((ch ^ (row & 7)) << 4)),
                   p, valid);
    }
}
// ---- end of the wgmma helpers (tests/test_cuda_wgmma_probe.py pastes the lines above) ----

// Rows r_lo (elements 4nt, 4nt+1) and r_lo + 8 (4nt+2, 4nt+3) of a 16 x 64 float32
// accumulator in wgmma's layout, times `mul`, to an (n, 64) bf16 matrix with row stride ld;
// rows >= n are skipped (flash_attention.cu's store_rows on the flat layout).
FORGE_D void wg_store_rows(bf16* dst, const float (&acc)[32], int r_lo, int n, float mul_lo,
                           float mul_hi, int t, int ld) {
    unsigned* lo = reinterpret_cast<unsigned*>(dst + (long long)r_lo * ld);
    unsigned* hi = lo + 8 * (long long)ld / 2;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (r_lo < n) lo[4 * nt + t] = pack_bf16x2(acc[4 * nt] * mul_lo, acc[4 * nt + 1] * mul_lo);
        if (r_lo + 8 < n)
            hi[4 * nt + t] = pack_bf16x2(acc[4 * nt + 2] * mul_hi, acc[4 * nt + 3] * mul_hi);
    }
}

// The column sums of what wg_store_rows writes from acc (each value as rounded to bf16, rows
// >= n left out), over the warpgroup's 64 rows: the lanes of a column meet by shuffles, then
// the four warps add in warp order through red (256 floats of shared memory that this
// warpgroup may use), and part[c], c < 64, is written when `write`. One row of the partial
// sums that reduce.cu's colsum_finish adds (the bias gradient of the layer whose output the
// rows are: attention.py's backward with sums). Every thread of the block calls it (it
// holds a __syncthreads()).
FORGE_D void wg_colsum_rows(float* part, bool write, float* red, const float (&acc)[32], int r_lo,
                            int n, float mul, int t, int warp, int lane, int wtid) {
    float s[16];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const unsigned lo = pack_bf16x2(acc[4 * nt] * mul, acc[4 * nt + 1] * mul);
        const unsigned hi = pack_bf16x2(acc[4 * nt + 2] * mul, acc[4 * nt + 3] * mul);
        s[2 * nt] = (r_lo < n ? bf16_lo(lo) : 0.f) + (r_lo + 8 < n ? bf16_lo(hi) : 0.f);
        s[2 * nt + 1] = (r_lo < n ? bf16_hi(lo) : 0.f) + (r_lo + 8 < n ? bf16_hi(hi) : 0.f);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // over g = lane >> 2: the warp's 16 rows
        s[i] += __shfl_xor_sync(0xffffffffu, s[i], 4);
        s[i] += __shfl_xor_sync(0xffffffffu, s[i], 8);
        s[i] += __shfl_xor_sync(0xffffffffu, s[i], 16);
    }
    if (lane < 4) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            red[64 * warp + 8 * nt + 2 * t] = s[2 * nt];
            red[64 * warp + 8 * nt + 2 * t + 1] = s[2 * nt + 1];
        }
    }
    __syncthreads();
    if (write && wtid < 64) part[wtid] = ((red[wtid] + red[64 + wtid]) + red[128 + wtid]) + red[192 + wtid];
}

// A 16 x 64 float32 tile in wgmma's accumulator layout rounded to bf16 as the A operand of the
// next product, one 16-wide k step per row of a (mma_cb's packing)
FORGE_D void wg_pack_a(unsigned (&a)[4][4], const float (&p)[32]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = pack_bf16x2(p[8 * kk], p[8 * kk + 1]);
        a[kk][1] = pack_bf16x2(p[8 * kk + 2], p[8 * kk + 3]);
        a[kk][2] = pack_bf16x2(p[8 * kk + 4], p[8 * kk + 5]);
        a[kk][3] = pack_bf16x2(p[8 * kk + 6], p[8 * kk + 7]);
    }
}

// 2^x by the MUFU unit alone, subnormal results flushed to zero (PTX ex2.approx.ftz): exp2f
// adds a range test and two predicated multiplies around it for subnormal results, which for
// probabilities below 2^-126 change nothing a bf16 output or a gradient can hold. A quarter of
// the forward's instructions were those (Nsight Compute, ninth session).
FORGE_D float wg_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

FORGE_D void wg_zero(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
}

// The four 16-wide k steps of a 64-wide product, issued (the caller fences before and commits
// and waits after, around as many products as it batches): A and B shared (both K-major); A
// from registers and B K-major; A from registers and B MN-major, read transposed.
FORGE_D void wg_ss4(float (&d)[32], unsigned long long da, unsigned long long db) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wg_mma_ss(d, da + (kk * WG_K_STEP >> 4), db + (kk * WG_K_STEP >> 4));
}

FORGE_D void wg_rs4(float (&d)[32], const unsigned (&a)[4][4], unsigned long long db) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg_mma_rs(d, a[kk], db + (kk * WG_K_STEP >> 4));
}

FORGE_D void wg_rs4_t(float (&d)[32], const unsigned (&a)[4][4], unsigned long long db) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg_mma_rs_t(d, a[kk], db + (kk * WG_MN_STEP >> 4));
}

// Iteration kb of a walk over 64-row k and v tiles (double-buffered), by the block's NT
// threads: the next pair starts loading while this one is used; then this pair is waited for,
// made visible to wgmma and to every thread.
template <int NT = 128>
FORGE_D void wg_next_kv(bf16 (&sK)[2][64 * 64], bf16 (&sV)[2][64 * 64], const bf16* K,
                        const bf16* V, int kb, int nkb, int Tk, int tid, int kv_ld) {
    if (kb + 1 < nkb) {
        const int buf = (kb + 1) & 1;
        wg_load_tile<NT>(sK[buf], K, (kb + 1) * 64, Tk, tid, kv_ld);
        wg_load_tile<NT>(sV[buf], V, (kb + 1) * 64, Tk, tid, kv_ld);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    fence_async_smem();
    __syncthreads();
}

// Every kernel's lengths, scale and layout (attention.py's _head_major / _fused_layout): the
// (batch, head) strides and row stride of q, of k and v, and of out and dout.
#define WG_SHAPE_PARAMS                                                                          \
    int Tq, int Tk, float scale, int H, long long q_sb, long long q_sh, int q_ld,                \
        long long kv_sb, long long kv_sh, int kv_ld, long long o_sb, long long o_sh, int o_ld
#define WG_SHAPE_ARGS Tq, Tk, scale, H, q_sb, q_sh, q_ld, kv_sb, kv_sh, kv_ld, o_sb, o_sh, o_ld

// Block (blockIdx.x = bh, query rows q0..q0+64 NW-1), the latest rows first, as
// flash_fwd_bf16_h64; NW warpgroups, warpgroup wg owning rows qw = q0+64wg..+63 and its own q
// tile, the k and v tiles loaded once for all of them (NW = 2 halves the k and v bytes each
// query row costs: the NW = 1 kernel at T=4096 streams about 4 TB/s of them from L2). Warp w of
// a warpgroup owns rows qw+16w..+15 (this thread r_lo = qw+16w+g and r_hi = r_lo+8), element
// 4 nt + e of s and o being (row r_lo or r_hi for e < 2 or not, column 8 nt + 2t + (e & 1)).
// A warpgroup skips the products of a key tile wholly after its rows (its last one, NW = 2).
#define FWD_PARAMS                                                                               \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,          \
        bf16 *__restrict__ out, float *__restrict__ lse, WG_SHAPE_PARAMS
#define FWD_ARGS q, k, v, out, lse, WG_SHAPE_ARGS

template <int NW>
FORGE_D void fwd_block(FWD_PARAMS, bf16* sQ, bf16 (&sK)[2][64 * 64], bf16 (&sV)[2][64 * 64]) {
    constexpr int NT = 128 * NW;
    const int tid = threadIdx.x, wg = NW == 1 ? 0 : tid >> 7, wtid = tid & 127;
    const int warp = wtid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int q0 = (int)(gridDim.y - 1 - blockIdx.y) * 64 * NW;
    const int qw = q0 + 64 * wg;
    const int off = Tk - Tq;
    const bf16* Q = q + head_base(bh, H, q_sb, q_sh);
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const bf16* K = k + kvb;
    const bf16* V = v + kvb;
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = qw + 16 * warp;
    const int r_lo = w0 + g, r_hi = r_lo + 8;
    const int kv_end = min(Tk, q0 + 64 * NW + off);
    const int nkb = (kv_end + 63) / 64;
    bf16* myQ = sQ + 64 * 64 * wg;

    wg_load_tile(myQ, Q, qw, Tq, wtid, q_ld);
    wg_load_tile<NT>(sK[0], K, 0, Tk, tid, kv_ld);
    wg_load_tile<NT>(sV[0], V, 0, Tk, tid, kv_ld);
    cp_async_commit();

    float o[32];
    wg_zero(o);
    const float NEG_INF = neg_inf<float>();
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    const unsigned long long dq = wg_desc(myQ, WG_K_LBO, WG_K_SBO);

    for (int kb = 0; kb < nkb; ++kb) {
        const int buf = kb & 1;
        wg_next_kv<NT>(sK, sV, K, V, kb, nkb, Tk, tid, kv_ld);
        const int k0 = kb * 64;
        if (NW == 1 || k0 <= qw + 63 + off) {
            float s[32];
            wg_zero(s);
            wg_fence();
            wg_ss4(s, dq, wg_desc(sK[buf], WG_K_LBO, WG_K_SBO));  // q k^T
            wg_commit();
            wg_wait0();

            // the scores stay unscaled: the tile's max is scaled once (scale > 0, which
            // attention.py's _fa_fwd checks) and each exponent is one fma
            if (k0 + 63 > w0 + off || k0 + 64 > Tk) {
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int j = k0 + 8 * nt + 2 * t + (e & 1);
                        const int i = (e < 2) ? r_lo : r_hi;
                        if (j > i + off || j >= Tk) s[4 * nt + e] = NEG_INF;
                    }
            }
            float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                mx_lo = fmaxf(mx_lo, fmaxf(s[4 * nt], s[4 * nt + 1]));
                mx_hi = fmaxf(mx_hi, fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
            }
            mx_lo = fmaxf(m_lo, quad_max(mx_lo) * sl2);  // the running max, in log2 units
            mx_hi = fmaxf(m_hi, quad_max(mx_hi) * sl2);
            const float b_lo = (mx_lo == NEG_INF) ? 0.f : mx_lo;
            const float b_hi = (mx_hi == NEG_INF) ? 0.f : mx_hi;
            const float al_lo = wg_exp2(m_lo - b_lo), al_hi = wg_exp2(m_hi - b_hi);
            m_lo = mx_lo;
            m_hi = mx_hi;
            float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                s[4 * nt] = wg_exp2(fmaf(s[4 * nt], sl2, -b_lo));
                s[4 * nt + 1] = wg_exp2(fmaf(s[4 * nt + 1], sl2, -b_lo));
                s[4 * nt + 2] = wg_exp2(fmaf(s[4 * nt + 2], sl2, -b_hi));
                s[4 * nt + 3] = wg_exp2(fmaf(s[4 * nt + 3], sl2, -b_hi));
                sum_lo += s[4 * nt] + s[4 * nt + 1];
                sum_hi += s[4 * nt + 2] + s[4 * nt + 3];
                o[4 * nt] *= al_lo;
                o[4 * nt + 1] *= al_lo;
                o[4 * nt + 2] *= al_hi;
                o[4 * nt + 3] *= al_hi;
            }
            l_lo = l_lo * al_lo + sum_lo;
            l_hi = l_hi * al_hi + sum_hi;

            // P as the A operand, 16 keys a k step: (row g, keys 2t..), (g+8, 2t..), (g, 2t+8..),
            // (g+8, 2t+8..) of key block kk, as mma_cb packs it
            unsigned a[4][4];
            wg_pack_a(a, s);
            wg_fence();
            wg_rs4_t(o, a, wg_desc(sV[buf], WG_MN_LBO, WG_MN_SBO));  // p v
            wg_commit();
            wg_wait0();
        }
        __syncthreads();  // every warp is done with buf before it is refilled
    }

    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
    wg_store_rows(out + head_base(bh, H, o_sb, o_sh), o, r_lo, Tq, 1.f / l_lo, 1.f / l_hi, t,
                  o_ld);
    if (t == 0) {
        float* L = lse + bh * Tq;
        if (r_lo < Tq) L[r_lo] = (m_lo + log2f(l_lo)) * 0.6931471805599453f;
        if (r_hi < Tq) L[r_hi] = (m_hi + log2f(l_hi)) * 0.6931471805599453f;
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_fwd_wgmma_bf16_h64(FWD_PARAMS) {
    __shared__ __align__(1024) bf16 sQ[64 * 64];
    __shared__ __align__(1024) bf16 sK[2][64 * 64];
    __shared__ __align__(1024) bf16 sV[2][64 * 64];
    fwd_block<1>(FWD_ARGS, sQ, sK, sV);
}

// 128 query rows a block, two warpgroups (attention.py's _fwd_rows): 48 KiB of tiles, at most
// 128 registers a thread, so two blocks (four warpgroups) an SM as the kernel above has.
extern "C" __global__ void __launch_bounds__(256, 2) flash_fwd_wgmma_r128_bf16_h64(FWD_PARAMS) {
    __shared__ __align__(1024) bf16 sQ[2][64 * 64];
    __shared__ __align__(1024) bf16 sK[2][64 * 64];
    __shared__ __align__(1024) bf16 sV[2][64 * 64];
    fwd_block<2>(FWD_ARGS, sQ[0], sK, sV);
}


// ---- backward (flash_attention.cu's two kernels, DROP = false, on wgmma) -------------------
// The same split and the same per-thread work as flash_bwd_dq_bf16_h64 and
// flash_bwd_dkdv_bf16_h64: P is recomputed from the saved lse in both, so dq needs no atomics
// and the bits are the same on every run. Each kernel keeps its row operands (q and dout, or
// k and v) in registers as A fragments, and its products read the other side's shared tiles
// twice over: K-major for q k^T and dout v^T, MN-major (transposed) for dS k, P^T dout and
// dS^T q.

// Block (bh, query rows q0..q0+63), latest rows first; warp w owns rows q0+16w..+15. Writes
// D = rowsum(dout * out) for its rows (the dk/dv kernel, launched next, reads it) and dq.
// QD_SHARED = false: q and dout are A fragments in registers; true: shared tiles sQ, sO (the
// scores' products read both operands from shared memory), freeing 32 registers a thread.
// part_ld > 0: dq's column sums too (wg_colsum_rows), a row of `part` (row stride part_ld) for
// each 64 rows of each batch, head h's at columns 64h..: row b * ceil(Tq / 64) + (rows' first)
// / 64 (GPT-2's c_attn bias gradient, finished by colsum_finish); part_ld = 0: none.
#define DQ_PARAMS                                                                                \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,          \
        const bf16 *__restrict__ out, const bf16 *__restrict__ dout,                             \
        const float *__restrict__ lse, float *__restrict__ Dsum, bf16 *__restrict__ dq,          \
        float *__restrict__ part, int part_ld, WG_SHAPE_PARAMS
#define DQ_ARGS q, k, v, out, dout, lse, Dsum, dq, part, part_ld, WG_SHAPE_ARGS

// NW warpgroups a block as fwd_block: warpgroup wg owns rows q0+64wg..+63 (its own q and dout
// tiles, sQ + 4096 wg and sO + 4096 wg, with QD_SHARED), the k and v tiles loaded once for all.
template <bool QD_SHARED, int NW = 1>
FORGE_D void dq_block(DQ_PARAMS, bf16 (&sK)[2][64 * 64], bf16 (&sV)[2][64 * 64], bf16* sQ,
                      bf16* sO) {
    constexpr int NT = 128 * NW;
    const int tid = threadIdx.x, wg = NW == 1 ? 0 : tid >> 7, wtid = tid & 127;
    const int warp = wtid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int q0 = (int)(gridDim.y - 1 - blockIdx.y) * 64 * NW + 64 * wg;  // this warpgroup's
    const int off = Tk - Tq;
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const long long qb_ = head_base(bh, H, q_sb, q_sh), ob = head_base(bh, H, o_sb, o_sh);
    const bf16* K = k + kvb;
    const bf16* V = v + kvb;
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = q0 + 16 * warp;
    const int r_lo = w0 + g, r_hi = r_lo + 8;
    // the block's last key tile: that of its last warpgroup
    const int kv_end = min(Tk, q0 + 64 * (NW - wg) + off);
    const int nkb = (kv_end + 63) / 64;
    if constexpr (QD_SHARED) {
        sQ += 64 * 64 * wg;
        sO += 64 * 64 * wg;
    }

    wg_load_tile<NT>(sK[0], K, 0, Tk, tid, kv_ld);
    wg_load_tile<NT>(sV[0], V, 0, Tk, tid, kv_ld);
    cp_async_commit();
    if constexpr (QD_SHARED) {  // this warpgroup's q and dout rows, waited for with the first k, v
        wg_load_tile(sQ, q + qb_, q0, Tq, wtid, q_ld);
        wg_load_tile(sO, dout + ob, q0, Tq, wtid, o_ld);
        cp_async_commit();
    }

    unsigned qf[4][4], df[4][4];
    if constexpr (!QD_SHARED) load_a_frags(qf, q + qb_, w0, Tq, g, t, q_ld);
    load_a_frags(df, dout + ob, w0, Tq, g, t, o_ld);  // for D; with QD_SHARED not kept
    float d_lo, d_hi, l2_lo, l2_hi;  // D and lse (log2 units) of rows r_lo, r_hi
    dq_rows_d_lse(df, out + ob, lse, Dsum, bh, w0, Tq, g, t, o_ld, d_lo, d_hi, l2_lo, l2_hi);

    float acc[32];
    wg_zero(acc);
    for (int kb = 0; kb < nkb; ++kb) {
        const int buf = kb & 1;
        wg_next_kv<NT>(sK, sV, K, V, kb, nkb, Tk, tid, kv_ld);
        const int k0 = kb * 64;
        if (NW == 1 || k0 <= q0 + 63 + off) {  // a key tile wholly after the rows: nothing
            float p[32], dp[32];
            wg_zero(p);
            wg_zero(dp);
            wg_fence();
            if constexpr (QD_SHARED) {
                wg_ss4(p, wg_desc(sQ, WG_K_LBO, WG_K_SBO), wg_desc(sK[buf], WG_K_LBO, WG_K_SBO));
                wg_ss4(dp, wg_desc(sO, WG_K_LBO, WG_K_SBO), wg_desc(sV[buf], WG_K_LBO, WG_K_SBO));
            } else {
                wg_rs4(p, qf, wg_desc(sK[buf], WG_K_LBO, WG_K_SBO));   // q k^T
                wg_rs4(dp, df, wg_desc(sV[buf], WG_K_LBO, WG_K_SBO));  // dout v^T
            }
            wg_commit();
            wg_wait0();

            const bool edge = k0 + 63 > w0 + off || k0 + 64 > Tk;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = k0 + 8 * nt + 2 * t + (e & 1);
                    const int i = (e < 2) ? r_lo : r_hi;
                    const bool masked = edge && (j > i + off || j >= Tk);
                    const int x = 4 * nt + e;
                    const float pe = masked ? 0.f : wg_exp2(fmaf(p[x], sl2, -((e < 2) ? l2_lo : l2_hi)));
                    p[x] = pe * (dp[x] - ((e < 2) ? d_lo : d_hi));  // dS
                }
            unsigned a[4][4];
            wg_pack_a(a, p);
            wg_fence();
            wg_rs4_t(acc, a, wg_desc(sK[buf], WG_MN_LBO, WG_MN_SBO));  // dq += dS k
            wg_commit();
            wg_wait0();
        }
        __syncthreads();
    }
    wg_store_rows(dq + qb_, acc, r_lo, Tq, scale, scale, t, q_ld);
    if (part_ld > 0) {  // the k and v tiles are no longer read (the loop's last __syncthreads)
        const int b = (int)bh / H, h = (int)bh - b * H;
        float* row = part + ((long long)b * ((Tq + 63) / 64) + q0 / 64) * part_ld + 64 * h;
        wg_colsum_rows(row, q0 < Tq, reinterpret_cast<float*>(sK[0]) + 256 * wg, acc, r_lo, Tq,
                       scale, t, warp, lane, wtid);
    }
}


extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_wgmma_bf16_h64(DQ_PARAMS) {
    __shared__ __align__(1024) bf16 sK[2][64 * 64];
    __shared__ __align__(1024) bf16 sV[2][64 * 64];
    dq_block<false>(DQ_ARGS, sK, sV, nullptr, nullptr);
}

// The same with q and dout in shared memory: four blocks an SM (48 KiB of tiles each) instead
// of three. The backend's default (FORGE_WGMMA_BWD_SHARED=both; verified and timed on the H200
// in the ninth session: the same bits as the kernel above).
extern "C" __global__ void __launch_bounds__(128, 4) flash_bwd_dq_wgmma_qds_bf16_h64(DQ_PARAMS) {
    __shared__ __align__(1024) bf16 sK[2][64 * 64];
    __shared__ __align__(1024) bf16 sV[2][64 * 64];
    __shared__ __align__(1024) bf16 sQ[64 * 64];
    __shared__ __align__(1024) bf16 sO[64 * 64];
    dq_block<true>(DQ_ARGS, sK, sV, sQ, sO);
}

// The same for 128 query rows, two warpgroups (attention.py's _bwd_dq_rows): its 64 KiB of
// tiles are dynamic shared memory (_DQ_R128_SMEM: 1 KiB more, the tiles starting at the first
// 1024-byte boundary); at most 128 registers a thread, two blocks an SM.
extern "C" __global__ void __launch_bounds__(256, 2)
    flash_bwd_dq_wgmma_qds_r128_bf16_h64(DQ_PARAMS) {
    extern __shared__ unsigned char dq_smem_raw[];
    unsigned char* dq_smem = dq_smem_raw + ((1024 - (smem_u32(dq_smem_raw) & 1023)) & 1023);
    typedef bf16 Tiles[2][64 * 64];
    Tiles& sK = *reinterpret_cast<Tiles*>(dq_smem);
    Tiles& sV = *reinterpret_cast<Tiles*>(dq_smem + sizeof(Tiles));
    bf16* sQ = reinterpret_cast<bf16*>(dq_smem + 2 * sizeof(Tiles));
    bf16* sO = reinterpret_cast<bf16*>(dq_smem + 3 * sizeof(Tiles));
    dq_block<true, 2>(DQ_ARGS, sK, sV, sQ, sO);
}

// Block (bh, keys k0..k0+63), the earliest keys (the most queries) first; warp w owns keys
// k0+16w..+15 and works on the transposed scores S^T = k q^T, so dv and dk accumulate in
// registers. KV_SHARED = false: k and v are A fragments in registers (as
// flash_bwd_dkdv_bf16_h64 holds them); true: k and v are shared tiles sK, sV (both products
// of the scores read A and B from shared memory), which frees 32 registers a thread.
// part_ld > 0: dk's and dv's column sums too, rows of part_k and part_v as dq's of part
// (row b * ceil(Tk / 64) + k0 / 64, head h's at columns 64h..).
#define DKDV_PARAMS                                                                              \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,          \
        const bf16 *__restrict__ dout, const float *__restrict__ lse,                            \
        const float *__restrict__ Dsum, bf16 *__restrict__ dk, bf16 *__restrict__ dv,            \
        float *__restrict__ part_k, float *__restrict__ part_v, int part_ld, WG_SHAPE_PARAMS
#define DKDV_ARGS q, k, v, dout, lse, Dsum, dk, dv, part_k, part_v, part_ld, WG_SHAPE_ARGS

// P and dS of a warpgroup's 64 keys (rows j_lo, j_hi of this thread) against the queries
// q0 + c0 + (8 nt + 2t + e & 1) of one score tile of NTILE columns, in place; masked where
// some (key, query) of the warp has j > i + off, or the queries run past Tq
template <int NTILE>
FORGE_D void dkdv_p_ds(float* p, float* ds, int q0, int c0, int j_lo, int j_hi, int w0, int off,
                       int Tq, int t, float sl2, const float* sLb, const float* sDb) {
    const bool edge = w0 + 15 > q0 + c0 + off || q0 + c0 + NTILE > Tq;
#pragma unroll
    for (int nt = 0; nt < NTILE / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = c0 + 8 * nt + 2 * t + (e & 1);
            const int i = q0 + c;
            const int j = (e < 2) ? j_lo : j_hi;
            const bool masked = edge && (j > i + off || i >= Tq);
            const int x = 4 * nt + e;
            const float pe = masked ? 0.f : wg_exp2(fmaf(p[x], sl2, -sLb[c]));
            p[x] = pe;
            ds[x] = pe * (ds[x] - sDb[c]);
        }
}

// What the dk/dv kernels walk over: one (batch, head)'s q, dout, lse and D rows, and the
// shared buffers they are staged into (two of each, for the query tile in use and the next).
struct QWalk {
    bf16 (*sQ)[64 * 64];
    bf16 (*sO)[64 * 64];   // dout
    float (*sL)[64];       // lse * log2(e), 0 past Tq
    float (*sD)[64];       // D, 0 past Tq
    const bf16 *Q, *dO;
    const float *L, *D;
    int Tq, q_ld, o_ld;
};

FORGE_D QWalk q_walk(DKDV_PARAMS, long long bh, bf16 (&sQ)[2][64 * 64], bf16 (&sO)[2][64 * 64],
                     float (&sL)[2][64], float (&sD)[2][64]) {
    return QWalk{sQ, sO, sL, sD, q + head_base(bh, H, q_sb, q_sh),
                 dout + head_base(bh, H, o_sb, o_sh), lse + bh * Tq, Dsum + bh * Tq, Tq, q_ld,
                 o_ld};
}

// Query tile qb (64 rows from 64 qb) of q and dout into buffer buf of the walk's tiles
// (cp.async, a group of its own), with its rows' lse (log2 units) and D, 0 past Tq: the dk/dv
// kernels' double buffer, NT threads sharing the loads.
template <int NT = 128>
FORGE_D void dkdv_stage(const QWalk& w, int qb, int buf, int tid) {
    const int r0 = qb * 64;
    wg_load_tile<NT>(w.sQ[buf], w.Q, r0, w.Tq, tid, w.q_ld);
    wg_load_tile<NT>(w.sO[buf], w.dO, r0, w.Tq, tid, w.o_ld);
    cp_async_commit();
    if (tid < 64) {
        const int i = r0 + tid;
        w.sL[buf][tid] = (i < w.Tq) ? w.L[i] * FORGE_LOG2E : 0.f;
        w.sD[buf][tid] = (i < w.Tq) ? w.D[i] : 0.f;
    }
}

// Iteration qb of the dk/dv kernels' walk over the query tiles from qb0 (double-buffered, as
// wg_next_kv's over k and v): tile qb + 1 staged into the other buffer while this one is
// used, then this one waited for and made visible to wgmma and to every thread. Returns the
// buffer tile qb is in.
template <int NT = 128>
FORGE_D int dkdv_next_q(const QWalk& w, int qb, int qb0, int nqb, int tid) {
    const int buf = (qb - qb0) & 1;
    if (qb + 1 < nqb) {
        dkdv_stage<NT>(w, qb + 1, buf ^ 1, tid);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    fence_async_smem();
    __syncthreads();
    return buf;
}

// The end of a warpgroup's 64 keys from k0 (a lane's rows j_lo, j_lo + 8 of its warp): dk
// (times scale) and dv stored, and with part_ld > 0 their column sums into part_k and part_v
// (red: 512 floats of shared memory no longer read; valid: the keys start before Tk; wtid:
// the thread's index in its warpgroup).
FORGE_D void dkdv_finish(DKDV_PARAMS, const float (&dka)[32], const float (&dva)[32],
                         long long bh, long long kvb, int k0, int j_lo, int t, int warp,
                         int lane, int wtid, float* red, bool valid) {
    wg_store_rows(dk + kvb, dka, j_lo, Tk, scale, scale, t, kv_ld);
    wg_store_rows(dv + kvb, dva, j_lo, Tk, 1.f, 1.f, t, kv_ld);
    if (part_ld > 0) {  // the q and dout tiles are no longer read (the loop's last __syncthreads)
        const int b = (int)bh / H, h = (int)bh - b * H;
        const long long at = ((long long)b * ((Tk + 63) / 64) + k0 / 64) * part_ld + 64 * h;
        wg_colsum_rows(part_k + at, valid, red, dka, j_lo, Tk, scale, t, warp, lane, wtid);
        wg_colsum_rows(part_v + at, valid, red + 256, dva, j_lo, Tk, 1.f, t, warp, lane, wtid);
    }
}

template <bool KV_SHARED>
FORGE_D void dkdv_block(DKDV_PARAMS, bf16 (&sQ)[2][64 * 64], bf16 (&sO)[2][64 * 64],
                        float (&sL)[2][64], float (&sD)[2][64], bf16* sK, bf16* sV) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int k0 = (int)blockIdx.y * 64;
    const int off = Tk - Tq;
    const QWalk qw = q_walk(DKDV_ARGS, bh, sQ, sO, sL, sD);
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = k0 + 16 * warp;
    const int j_lo = w0 + g, j_hi = j_lo + 8;
    const int qb0 = max(0, k0 - off) / 64;  // the first query that sees key k0
    const int nqb = (Tq + 63) / 64;

    dkdv_stage(qw, qb0, 0, tid);

    unsigned kf[4][4], vf[4][4];
    if constexpr (KV_SHARED) {  // waited for with the first q / dout tiles
        wg_load_tile(sK, k + kvb, k0, Tk, tid, kv_ld);
        wg_load_tile(sV, v + kvb, k0, Tk, tid, kv_ld);
        cp_async_commit();
    } else {
        load_a_frags(kf, k + kvb, w0, Tk, g, t, kv_ld);
        load_a_frags(vf, v + kvb, w0, Tk, g, t, kv_ld);
    }
    float dka[32], dva[32];
    wg_zero(dka);
    wg_zero(dva);

    for (int qb = qb0; qb < nqb; ++qb) {
        const int buf = dkdv_next_q(qw, qb, qb0, nqb, tid);

        float p[32], ds[32];
        wg_zero(p);
        wg_zero(ds);
        wg_fence();
        if constexpr (KV_SHARED) {
            wg_ss4(p, wg_desc(sK, WG_K_LBO, WG_K_SBO), wg_desc(sQ[buf], WG_K_LBO, WG_K_SBO));
            wg_ss4(ds, wg_desc(sV, WG_K_LBO, WG_K_SBO), wg_desc(sO[buf], WG_K_LBO, WG_K_SBO));
        } else {
            wg_rs4(p, kf, wg_desc(sQ[buf], WG_K_LBO, WG_K_SBO));   // S^T = k q^T
            wg_rs4(ds, vf, wg_desc(sO[buf], WG_K_LBO, WG_K_SBO));  // dP^T = v dout^T
        }
        wg_commit();
        wg_wait0();

        dkdv_p_ds<64>(p, ds, qb * 64, 0, j_lo, j_hi, w0, off, Tq, t, sl2, sL[buf], sD[buf]);
        unsigned pa[4][4], da[4][4];
        wg_pack_a(pa, p);
        wg_pack_a(da, ds);
        wg_fence();
        wg_rs4_t(dva, pa, wg_desc(sO[buf], WG_MN_LBO, WG_MN_SBO));  // dv += P^T dout
        wg_rs4_t(dka, da, wg_desc(sQ[buf], WG_MN_LBO, WG_MN_SBO));  // dk += dS^T q
        wg_commit();
        wg_wait0();
        __syncthreads();
    }
    dkdv_finish(DKDV_ARGS, dka, dva, bh, kvb, k0, j_lo, t, warp, lane, tid,
                reinterpret_cast<float*>(sQ[0]), true);
}

extern "C" __global__ void __launch_bounds__(128) flash_bwd_dkdv_wgmma_bf16_h64(DKDV_PARAMS) {
    __shared__ __align__(1024) bf16 sQ[2][64 * 64];
    __shared__ __align__(1024) bf16 sO[2][64 * 64];  // dout
    __shared__ float sL[2][64];                       // lse * log2(e), 0 past Tq
    __shared__ float sD[2][64];                       // D, 0 past Tq
    dkdv_block<false>(DKDV_ARGS, sQ, sO, sL, sD, nullptr, nullptr);
}

// The same with k and v in shared memory: 162 registers instead of 226, so three blocks an SM
// instead of two. Its tiles are 49 KiB, over the 48 KiB of static shared memory, so they are
// dynamic: launched with 1 KiB more than they take (attention.py's _DKDV_KVS_SMEM), the
// tiles starting at the first 1024-byte boundary (the swizzle's alignment). The backend's
// default, as the dq one above (T=4096, B=8: the backward 2.93 -> 2.33 ms with both).
extern "C" __global__ void __launch_bounds__(128, 3) flash_bwd_dkdv_wgmma_kvs_bf16_h64(DKDV_PARAMS) {
    extern __shared__ unsigned char dkdv_smem_raw[];
    unsigned char* dkdv_smem = dkdv_smem_raw + ((1024 - (smem_u32(dkdv_smem_raw) & 1023)) & 1023);
    typedef bf16 Tiles[2][64 * 64];
    typedef float Rows[2][64];
    Tiles& sQ = *reinterpret_cast<Tiles*>(dkdv_smem);
    Tiles& sO = *reinterpret_cast<Tiles*>(dkdv_smem + sizeof(Tiles));
    bf16* sK = reinterpret_cast<bf16*>(dkdv_smem + 2 * sizeof(Tiles));
    bf16* sV = sK + 64 * 64;
    Rows& sL = *reinterpret_cast<Rows*>(dkdv_smem + 3 * sizeof(Tiles));
    Rows& sD = *reinterpret_cast<Rows*>(dkdv_smem + 3 * sizeof(Tiles) + sizeof(Rows));
    dkdv_block<true>(DKDV_ARGS, sQ, sO, sL, sD, sK, sV);
}

// ---- dk/dv with two warpgroups a block of 128 keys (attention.py: FORGE_WGMMA_DKDV) ---------
// dkdv_block's kernel with k and v shared, for keys k0..k0+127: warpgroup wg owns keys
// k0 + 64 wg..+63 (its own k and v tiles) and both read each q and dout tile, loaded once for
// the two (half the tile loads a key row costs, as the dq kernel's 128 rows do for k and v).
// Each 64-query tile's scores in two halves of 32 queries (m64n32 products), so the scores
// and dP take 32 registers instead of 64 and the kernel fits 128 a thread: two blocks an SM
// (four warpgroups, against the one-warpgroup kernel's three). The same products in the same
// order of k steps per output element, so dk and dv keep its bits. (With the whole 64-query
// score tile, 195 registers and one block an SM, it was slower than the 64-key kernel: the
// backward at B=32 T=1024 0.836 ms against 0.731, and 0.698 in halves; H100, session 36.)

#define WG_D16(d)                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
        "+f"(d[14]), "+f"(d[15])
#define WG_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// d (64 x 32, f32) += A B^T, A and B K-major shared tiles (B's 32 rows from its descriptor)
FORGE_D void wg_mma_ss_n32(float (&d)[16], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_REGS16
                 ", %16, %17, 1, 1, 1, 0, 0;\n"
                 : WG_D16(d)
                 : "l"(da), "l"(db));
}

FORGE_D void wg_ss4_n32(float (&d)[16], unsigned long long da, unsigned long long db) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wg_mma_ss_n32(d, da + (kk * WG_K_STEP >> 4), db + (kk * WG_K_STEP >> 4));
}

// a 64 x 32 accumulator as the A operand of two 16-wide k steps (wg_pack_a's packing)
FORGE_D void wg_pack_a2(unsigned (&a)[2][4], const float (&p)[16]) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
        a[kk][0] = pack_bf16x2(p[8 * kk], p[8 * kk + 1]);
        a[kk][1] = pack_bf16x2(p[8 * kk + 2], p[8 * kk + 3]);
        a[kk][2] = pack_bf16x2(p[8 * kk + 4], p[8 * kk + 5]);
        a[kk][3] = pack_bf16x2(p[8 * kk + 6], p[8 * kk + 7]);
    }
}

FORGE_D void dkdv2_block(DKDV_PARAMS, bf16 (&sQ)[2][64 * 64], bf16 (&sO)[2][64 * 64],
                         float (&sL)[2][64], float (&sD)[2][64], bf16* sK, bf16* sV) {
    constexpr int NT = 256;
    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
    const int warp = wtid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const int kblk = (int)blockIdx.y * 128;
    const int k0 = kblk + 64 * wg;  // this warpgroup's keys
    const int off = Tk - Tq;
    const QWalk qw = q_walk(DKDV_ARGS, bh, sQ, sO, sL, sD);
    const long long kvb = head_base(bh, H, kv_sb, kv_sh);
    const float sl2 = scale * FORGE_LOG2E;
    const int w0 = k0 + 16 * warp;
    const int j_lo = w0 + g, j_hi = j_lo + 8;
    const int qb0 = max(0, kblk - off) / 64;  // the block's first query block (warpgroup 0's)
    const int qbw = max(0, k0 - off) / 64;    // this warpgroup's
    const int nqb = (Tq + 63) / 64;
    sK += 64 * 64 * wg;
    sV += 64 * 64 * wg;

    dkdv_stage<NT>(qw, qb0, 0, tid);
    wg_load_tile(sK, k + kvb, k0, Tk, wtid, kv_ld);  // rows past Tk: zeros
    wg_load_tile(sV, v + kvb, k0, Tk, wtid, kv_ld);
    cp_async_commit();

    float dka[32], dva[32];
    wg_zero(dka);
    wg_zero(dva);
    const unsigned long long dK = wg_desc(sK, WG_K_LBO, WG_K_SBO);
    const unsigned long long dV = wg_desc(sV, WG_K_LBO, WG_K_SBO);

    for (int qb = qb0; qb < nqb; ++qb) {
        const int buf = dkdv_next_q<NT>(qw, qb, qb0, nqb, tid);
        const int q0 = qb * 64;
        if (qb >= qbw) {  // (warpgroup-uniform) a tile wholly before this warpgroup's keys: none
            const unsigned long long dQk = wg_desc(sQ[buf], WG_K_LBO, WG_K_SBO);
            const unsigned long long dOk = wg_desc(sO[buf], WG_K_LBO, WG_K_SBO);
            const unsigned long long dQm = wg_desc(sQ[buf], WG_MN_LBO, WG_MN_SBO);
            const unsigned long long dOm = wg_desc(sO[buf], WG_MN_LBO, WG_MN_SBO);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float p[16], ds[16];
#pragma unroll
                for (int i = 0; i < 16; ++i) p[i] = ds[i] = 0.f;
                wg_fence();  // the queries 32h..: B's rows start 32 h rows (4 KiB h) on
                wg_ss4_n32(p, dK, dQk + (h * 4096 >> 4));   // S^T = k q^T
                wg_ss4_n32(ds, dV, dOk + (h * 4096 >> 4));  // dP^T = v dout^T
                wg_commit();
                wg_wait0();
                dkdv_p_ds<32>(p, ds, q0, 32 * h, j_lo, j_hi, w0, off, Tq, t, sl2, sL[buf],
                              sD[buf]);
                unsigned pa[2][4], da[2][4];
                wg_pack_a2(pa, p);
                wg_pack_a2(da, ds);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)  // k steps 2h, 2h + 1 of the 64 queries
                    wg_mma_rs_t(dva, pa[kk], dOm + ((2 * h + kk) * WG_MN_STEP >> 4));
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    wg_mma_rs_t(dka, da[kk], dQm + ((2 * h + kk) * WG_MN_STEP >> 4));
                wg_commit();
                wg_wait0();
            }
        }
        __syncthreads();
    }
    dkdv_finish(DKDV_ARGS, dka, dva, bh, kvb, k0, j_lo, t, warp, lane, wtid,
                reinterpret_cast<float*>(sQ[0]) + 512 * wg, k0 < Tk);
}

// dynamic shared memory (attention.py's _DKDV_R128_SMEM): sQ[2], sO[2], sK[2], sV[2] (8 KiB
// tiles; the k and v tiles one a warpgroup), sL[2][64], sD[2][64], and 1 KiB to align
extern "C" __global__ void __launch_bounds__(256, 2)
    flash_bwd_dkdv_wgmma_kvs_r128h_bf16_h64(DKDV_PARAMS) {
    extern __shared__ unsigned char d2_smem_raw[];
    unsigned char* d2 = d2_smem_raw + ((1024 - (smem_u32(d2_smem_raw) & 1023)) & 1023);
    typedef bf16 Tiles[2][64 * 64];
    typedef float Rows[2][64];
    Tiles& sQ = *reinterpret_cast<Tiles*>(d2);
    Tiles& sO = *reinterpret_cast<Tiles*>(d2 + sizeof(Tiles));
    bf16* sK = reinterpret_cast<bf16*>(d2 + 2 * sizeof(Tiles));
    bf16* sV = reinterpret_cast<bf16*>(d2 + 3 * sizeof(Tiles));
    Rows& sL = *reinterpret_cast<Rows*>(d2 + 4 * sizeof(Tiles));
    Rows& sD = *reinterpret_cast<Rows*>(d2 + 4 * sizeof(Tiles) + sizeof(Rows));
    dkdv2_block(DKDV_ARGS, sQ, sO, sL, sD, sK, sV);
}

#endif  // sm_90a
