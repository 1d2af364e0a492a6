// wgmma_probe.cu: Hopper's warpgroup products (wgmma.mma_async, sm_90a) on one 64 x 64 x 64
// bf16 tile, the two operand forms a FlashAttention-3-style kernel needs, checked against
// NumPy by tests/test_cuda_wgmma_probe.py before any kernel of the package relies on them.
// Written without a GPU (2026-12-04); the descriptor's strides are kernel arguments so that
// a first run can try the candidates. The wgmma wrappers are flash_hopper.cu's own, pasted in
// by the test, so what passes here is what that kernel runs.
//
//   probe_ss  C = A B^T, A (64 x 64) and B (64 x 64) both K-major in shared memory with the
//             128-byte swizzle (the q k^T shape: rows of q and of k are K-major)
//   probe_rk  C = A B^T, A (64 x 64) from registers, B K-major in shared memory (the
//             backward's q k^T and dout v^T with q, dout or k, v held in registers)
//   probe_rs  C = A B, A (64 x 64) from registers in mma.sync's A-fragment layout, B (64 x 64,
//             row k holds the 64 n-values: the v of p v) MN-major in shared memory, swizzled,
//             read transposed (imm-trans-b = 1)
//
// Shared-memory layout (128-byte swizzle): a 64-row tile of 128-byte rows; the 16-byte chunk
// c of row r sits at chunk c ^ (r % 8) of that row; the tile starts on a 1024-byte boundary.
// Descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4, 16-29
// leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 62-63 the
// swizzle mode (1: 128-byte).
// Accumulator layout (m64nNk16, f32): warp w of the warpgroup holds rows 16w..16w+15; its
// register 4j + e is row 16w + g + 8 (e / 2), column 8j + 2t + (e % 2) (g = lane / 4,
// t = lane % 4), mma.sync's C fragments side by side.
#include "common.cuh"

// The test pastes flash_hopper.cu's helpers in place of the next line (wg_desc, wg_fence,
// wg_commit, wg_wait0, fence_async_smem, wg_mma_ss, wg_mma_rs_t, wg_load_tile).
// WGMMA_HELPERS

// rows of a (64 x 64) bf16 row-major matrix into a swizzled shared tile, plain stores
FORGE_D void wg_store_tile(bf16* tile, const bf16* src, int tid, int nthreads) {
    for (int i = tid; i < 64 * 8; i += nthreads) {
        const int r = i >> 3, c = i & 7;
        const uint4 v = *reinterpret_cast<const uint4*>(src + r * 64 + c * 8);
        *reinterpret_cast<uint4*>(reinterpret_cast<char*>(tile) + r * 128 + ((c ^ (r & 7)) << 4)) = v;
    }
}

// B into its swizzled tile, every store made visible to wgmma, d zeroed
FORGE_D void probe_start(bf16* sB, const bf16* B, float (&d)[32]) {
    wg_store_tile(sB, B, threadIdx.x, 128);
    fence_async_smem();
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
}

FORGE_D void wg_store_acc(float* C, const float (&d)[32], int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            C[(16 * warp + g + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}

// One warpgroup. k_step_bytes: how far the descriptors' start moves per 16-wide k step
// (32 for a K-major swizzled tile: the hardware swizzles the moved address).
extern "C" __global__ void __launch_bounds__(128)
    probe_ss(const bf16* A, const bf16* B, float* C, unsigned lbo, unsigned sbo,
             unsigned k_step_bytes) {
    __shared__ __align__(1024) bf16 sA[64 * 64];
    __shared__ __align__(1024) bf16 sB[64 * 64];
    const int tid = threadIdx.x;
    wg_store_tile(sA, A, tid, 128);
    float d[32];
    probe_start(sB, B, d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wg_mma_ss(d, wg_desc(reinterpret_cast<char*>(sA) + kk * k_step_bytes, lbo, sbo),
                  wg_desc(reinterpret_cast<char*>(sB) + kk * k_step_bytes, lbo, sbo));
    wg_commit();
    wg_wait0();
    wg_store_acc(C, d, tid >> 5, tid & 31);
}

// A's fragments for k step kk straight from global memory (row-major 64 x 64): a0 = (g,
// 2t..), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..) of the warp's 16 rows.
// A's fragments for every k step from global memory (row-major 64 x 64): a0 = (g, 2t..),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..) of the warp's 16 rows. All are loaded
// before the first wgmma: the registers a wgmma reads must stay as they are until it is done.
FORGE_D void probe_a_frags(const bf16* A, unsigned (&a)[4][4], int warp, int g, int t) {
    const unsigned* lo = reinterpret_cast<const unsigned*>(A + (16 * warp + g) * 64);
    const unsigned* hi = lo + 8 * 64 / 2;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = lo[8 * kk + t];
        a[kk][1] = hi[8 * kk + t];
        a[kk][2] = lo[8 * kk + 4 + t];
        a[kk][3] = hi[8 * kk + 4 + t];
    }
}

// A from registers, B in shared memory: K-major (wg_mma_rs) or, with TRANS_B, MN-major read
// transposed (wg_mma_rs_t).
template <bool TRANS_B>
__device__ void probe_reg_a(const bf16* A, const bf16* B, float* C, unsigned lbo, unsigned sbo,
                            unsigned k_step_bytes) {
    __shared__ __align__(1024) bf16 sB[64 * 64];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    float d[32];
    probe_start(sB, B, d);
    unsigned a[4][4];
    probe_a_frags(A, a, warp, g, t);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned long long db =
            wg_desc(reinterpret_cast<char*>(sB) + kk * k_step_bytes, lbo, sbo);
        if (TRANS_B)
            wg_mma_rs_t(d, a[kk], db);
        else
            wg_mma_rs(d, a[kk], db);
    }
    wg_commit();
    wg_wait0();
    wg_store_acc(C, d, warp, lane);
}

extern "C" __global__ void __launch_bounds__(128)
    probe_rk(const bf16* A, const bf16* B, float* C, unsigned lbo, unsigned sbo,
             unsigned k_step_bytes) {
    probe_reg_a<false>(A, B, C, lbo, sbo, k_step_bytes);
}

extern "C" __global__ void __launch_bounds__(128)
    probe_rs(const bf16* A, const bf16* B, float* C, unsigned lbo, unsigned sbo,
             unsigned k_step_bytes) {
    probe_reg_a<true>(A, B, C, lbo, sbo, k_step_bytes);
}
