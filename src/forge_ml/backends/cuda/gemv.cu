// launched from backends/cuda/linear.py
// gemv.cu: the linear layer of a decoding step, for a few rows (M <= GEMV_M, the batch):
//   y (M, N) = act(alpha * LN(x) (M, K) @ W (K, N) + bias) + residual
// W row-major (in, out); LN optional (x's layernorm with gamma, beta, computed here); act none
// (0) or GPT-2's GELU (1); bias and residual optional. All of a layer in one kernel: reading W
// once is the whole cost, and in a CUDA graph every extra kernel is a few microseconds more.
// Hopper (sm_90) and later: it uses a thread-block cluster and programmatic dependent launch.
//
// Grid (column tiles, S), launched as clusters of (1, S, 1) blocks (S <= 8): the S blocks of a
// cluster share a column tile and split K into S slices, block s taking rows
// [s * kchunk, (s + 1) * kchunk) (at most GEMV_KC of them). A tile is LPR * VEC columns: LPR
// lanes read one row's tile, each one 16-byte load of VEC columns (4 float32 or 8 bf16), so a
// warp reads 32 / LPR rows at a time and the block's 8 warps 8 * 32 / LPR rows. Each lane keeps
// M x VEC float32 sums.
//   1. Every lane loads its first GEMV_PF rows of W into registers, and its first gamma and
//      beta of x's slice (GEMV_XPF) and bias of the columns it finishes (GEMV_EPF), then waits
//      for the previous kernel (pdl_wait, common.cuh): on Hopper these weight loads overlap
//      the previous kernel's tail, and none of them stands between the wait and the output.
//      `early` = 0 (W, the bias or the layernorm's parameters may be what the previous kernel
//      wrote) waits first; the backend then also launches it without programmatic dependent
//      launch. Right after the wait the lane loads its residual values, which the previous
//      kernels wrote, so their latency passes under steps 2 and 3.
//   2. With LN, the block computes the rows' mean and rstd (two passes over x, float32, as
//      layernorm.cu); x's slice, normalised, goes to shared memory.
//   3. Multiply-add over the slice; the lanes of a row group meet by shuffles (in a fixed
//      order), the warps in shared memory: the block's partial tile, bpart[M][tile].
//   4. Cluster barrier; block s finishes columns [s * tile / S, (s + 1) * tile / S) of the
//      tile: it reads the S partial tiles from the cluster's shared memory (distributed shared
//      memory, in block order: the same bits on every run), applies the epilogue and rounds
//      once to T. A second barrier keeps every block's shared memory alive until read.
#include "common.cuh"

#define GEMV_M 4      // at most this many rows
#define GEMV_WARPS 8
#define GEMV_PF 8     // row groups per lane loaded before waiting for the previous kernel
#define GEMV_KC 1024  // rows of a block's K slice at most (x's slice is staged in shared memory)
#define GEMV_TILE 128 // columns of a tile at most (LPR * VEC)
#define GEMV_XPF 2    // passes of the x-slice fill whose gamma and beta are loaded before the
                      // wait: every pass where M * kchunk <= 2 * 256 (GPT-2 124M: 384)
#define GEMV_EPF 1    // passes of the epilogue whose bias and residual are loaded early:
                      // every pass where M * (the block's columns) <= 256 (at most 4 * 16)


// acc[m][:] += xs[m][kk] * (the VEC weights in w), for the M rows.
template <typename T, int VEC>
FORGE_D void gemv_row(float (&acc)[GEMV_M][VEC], uint4 w16, const float (&xs)[GEMV_M][GEMV_KC],
                      int kk, int M) {
    float w[VEC];
    Vec16<T>::widen(w16, w);
#pragma unroll
    for (int m = 0; m < GEMV_M; ++m) {
        if (m < M) {
            const float xv = xs[m][kk];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[m][j] += xv * w[j];
        }
    }
}

template <typename T, int VEC, int LPR>
__device__ void gemv_impl(const T* x, const T* W, const T* gamma, const T* beta, int has_ln,
                          float eps, const T* bias, int has_bias, const T* residual,
                          int has_res, int act, T* y, int M, int K, int N, int kchunk,
                          float alpha, int early) {
    constexpr int TILE = LPR * VEC, RW = 32 / LPR, BR = GEMV_WARPS * RW;
    __shared__ float xs[GEMV_M][GEMV_KC];
    __shared__ float red[GEMV_WARPS][GEMV_M][TILE];
    __shared__ float bpart[GEMV_M][TILE];
    __shared__ float stat[2][GEMV_M];
    __shared__ float sh[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = lane / LPR, cl = lane % LPR;
    const int n0 = blockIdx.x * TILE + cl * VEC;
    const int S = gridDim.y, s = blockIdx.y;
    const int k0 = s * kchunk, kn = max(0, min(K, k0 + kchunk) - k0);
    const int r0 = warp * RW + rg;  // this lane's first row of the slice; then r0 + BR, ...
    const bool col = n0 < N;
    // the columns this block finishes in step 4: [c0, c1) of the tile
    const int share = (TILE + S - 1) / S, c0 = s * share, c1 = min(TILE, c0 + share);
    const int cw = max(0, c1 - c0);
    // 1. the first rows of W, gamma and beta of the slice, the bias of the finished columns
    if (!early) pdl_wait();
    uint4 wp[GEMV_PF];
#pragma unroll
    for (int i = 0; i < GEMV_PF; ++i) {
        const int kk = r0 + i * BR;
        wp[i] = (col && kk < kn) ? Vec16<T>::raw(W + (long long)(k0 + kk) * N + n0)
                                 : make_uint4(0u, 0u, 0u, 0u);
    }
    float gpf[GEMV_XPF], bpf[GEMV_XPF], biaspf[GEMV_EPF];
#pragma unroll
    for (int j = 0; j < GEMV_XPF; ++j) {
        const int i = tid + j * GEMV_WARPS * 32;
        gpf[j] = bpf[j] = 0.f;
        if (has_ln && i < M * kn) {
            const int k = k0 + i % kn;
            gpf[j] = ldcg_f(gamma + k);
            bpf[j] = ldcg_f(beta + k);
        }
    }
#pragma unroll
    for (int j = 0; j < GEMV_EPF; ++j) {
        const int i = tid + j * GEMV_WARPS * 32;
        biaspf[j] = 0.f;
        if (has_bias && cw > 0 && i < M * cw) {
            const int n = blockIdx.x * TILE + c0 + i % cw;
            if (n < N) biaspf[j] = ldcg_f(bias + n);
        }
    }
    pdl_wait();
    pdl_launch_dependents();
    float respf[GEMV_EPF];
#pragma unroll
    for (int j = 0; j < GEMV_EPF; ++j) {
        const int i = tid + j * GEMV_WARPS * 32;
        respf[j] = 0.f;
        if (has_res && cw > 0 && i < M * cw) {
            const int m = i / cw, n = blockIdx.x * TILE + c0 + i % cw;
            if (n < N) respf[j] = ldf(residual[(long long)m * N + n]);
        }
    }
    // 2. LN statistics, x's slice in shared memory
    if (has_ln) {
        for (int m = 0; m < M; ++m) {
            const T* xr = x + (long long)m * K;
            float a = 0.f;
            for (int k = tid; k < K; k += blockDim.x) a += ldf(xr[k]);
            const float mean = block_sum(a, sh) / float(K);
            float v = 0.f;
            for (int k = tid; k < K; k += blockDim.x) {
                const float d = ldf(xr[k]) - mean;
                v += d * d;
            }
            const float var = block_sum(v, sh) / float(K);
            if (tid == 0) {
                stat[0][m] = mean;
                // ln_correct's rule: a variance past float's range is NaN, not 1/sqrt(inf) = 0
                stat[1][m] = var < -neg_inf<float>() ? 1.f / sqrtf(var + eps) : quiet_nan<float>();
            }
        }
        __syncthreads();
    }
    // element i of the slice (row m, column kk) with gamma g and beta b
    auto fill = [&](int i, float g, float b) {
        const int m = i / kn, kk = i - m * kn;
        float v = ldf(x[(long long)m * K + k0 + kk]);
        if (has_ln) v = (v - stat[0][m]) * stat[1][m] * g + b;
        xs[m][kk] = v;
    };
#pragma unroll
    for (int j = 0; j < GEMV_XPF; ++j) {   // the passes whose gamma and beta came early
        const int i = tid + j * GEMV_WARPS * 32;
        if (i < M * kn) fill(i, gpf[j], bpf[j]);
    }
    for (int i = tid + GEMV_XPF * GEMV_WARPS * 32; i < M * kn; i += blockDim.x) {
        const int k = k0 + i % kn;
        fill(i, has_ln ? ldf(gamma[k]) : 0.f, has_ln ? ldf(beta[k]) : 0.f);
    }
    __syncthreads();
    // 3. multiply-add: the prefetched rows, then the rest of the slice
    float acc[GEMV_M][VEC];
#pragma unroll
    for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[m][j] = 0.f;
#pragma unroll
    for (int i = 0; i < GEMV_PF; ++i) {
        const int kk = r0 + i * BR;
        if (kk < kn) gemv_row<T, VEC>(acc, wp[i], xs, kk, M);
    }
    if (col) {
#pragma unroll 4
        for (int kk = r0 + GEMV_PF * BR; kk < kn; kk += BR)
            gemv_row<T, VEC>(acc, Vec16<T>::raw(W + (long long)(k0 + kk) * N + n0), xs, kk, M);
    }
    // the warp's row groups, then the warps, in a fixed order
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
        for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], o);
    if (rg == 0) {
#pragma unroll
        for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) red[warp][m][cl * VEC + j] = acc[m][j];
    }
    __syncthreads();
    for (int i = tid; i < M * TILE; i += blockDim.x) {
        const int m = i / TILE, c = i - m * TILE;
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) a += red[w][m][c];
        bpart[m][c] = a;
    }
    // 4. the cluster's S partial tiles; block s finishes its share of the columns
    if (S > 1) {
        cluster_sync();
    } else {
        __syncthreads();
    }
    // output i of the block's share (row m, tile column c) with its bias and residual value
    auto finish = [&](int i, float bias_v, float res_v) {
        const int m = i / cw, c = c0 + (i - m * cw), n = blockIdx.x * TILE + c;
        if (n >= N) return;
        float a = 0.f;
        if (S > 1) {
            for (int r = 0; r < S; ++r) a += ld_cluster(&bpart[m][c], (unsigned)r);
        } else {
            a = bpart[m][c];
        }
        a *= alpha;
        if (has_bias) a += bias_v;
        if (act == 1) a = gelu_f(a);
        if (has_res) a += res_v;
        y[(long long)m * N + n] = To<T>::from(a);
    };
#pragma unroll
    for (int j = 0; j < GEMV_EPF; ++j) {   // the passes whose bias and residual came early
        const int i = tid + j * GEMV_WARPS * 32;
        if (i < M * cw) finish(i, biaspf[j], respf[j]);
    }
    for (int i = tid + GEMV_EPF * GEMV_WARPS * 32; i < M * cw; i += blockDim.x) {
        const int m = i / cw, n = blockIdx.x * TILE + c0 + (i - m * cw);
        const bool in = n < N;
        finish(i, has_bias && in ? ldf(bias[n]) : 0.f,
               has_res && in ? ldf(residual[(long long)m * N + n]) : 0.f);
    }
    if (S > 1) cluster_sync();  // no block leaves while another may still read its bpart
}

#define FORGE_GEMV(T, S, VEC, LPR)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2)                        \
        gemv_##S##_##LPR(const T* x, const T* W, const T* gamma, const T* beta, int has_ln,  \
                         float eps, const T* bias, int has_bias, const T* res, int has_res,  \
                         int act, T* y, int M, int K, int N, int kc, float alpha,            \
                         int early) {                                                        \
        gemv_impl<T, VEC, LPR>(x, W, gamma, beta, has_ln, eps, bias, has_bias, res,          \
                               has_res, act, y, M, K, N, kc, alpha, early);                  \
    }
FORGE_GEMV(float, f32, 4, 32)
FORGE_GEMV(float, f32, 4, 16)
FORGE_GEMV(float, f32, 4, 8)
FORGE_GEMV(float, f32, 4, 4)
FORGE_GEMV(float, f32, 4, 2)
FORGE_GEMV(float, f32, 4, 1)
FORGE_GEMV(bf16, bf16, 8, 16)
FORGE_GEMV(bf16, bf16, 8, 8)
FORGE_GEMV(bf16, bf16, 8, 4)
FORGE_GEMV(bf16, bf16, 8, 2)
FORGE_GEMV(bf16, bf16, 8, 1)
