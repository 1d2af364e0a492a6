// gemv.cu: products of a few rows by a weight matrix, y (M, N) = alpha x (M, K) W (K, N)
// [+ bias], M <= GEMV_M, W row-major (in, out): the linear layers of a decoding step, where
// the whole cost is reading W once. cuBLAS's gemm tiles leave most of the GPU idle at M = 1, so:
//   gemv_partial: block (column tile, K slice). Lane l of a warp owns VEC consecutive columns
//                 (one 16-byte load per row: 4 float32 or 8 bf16), so a warp reads 512
//                 contiguous bytes of a row; the block's 8 warps take rows k0 + w, k0 + w + 8,
//                 ... of its K slice; each lane keeps M x VEC float32 sums. The warps' sums
//                 meet in shared memory and the block writes part[slice, m, n] (float32).
//   gemv_finish:  each thread owns one y[m, n] = act(alpha * sum over slices of part (in slice
//                 order: the same bits on every run) + bias[n]) + residual[m, n], rounded once
//                 to T; act is none (0) or GPT-2's GELU (1). The epilogue is the decoding
//                 step's linear layer: bias, then GELU (c_fc) or the residual add (c_proj).
// The grid is (N / (32 VEC), slices), with enough slices to give every SM about two blocks.
#include "common.cuh"

#define GEMV_M 4         // at most this many rows
#define GEMV_WARPS 8

// VEC columns of row k as float32, from one 16-byte load.
template <typename T, int VEC> struct RowVec;
template <> struct RowVec<float, 4> {
    static FORGE_D void load(const float* p, float (&w)[4]) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    }
};
template <> struct RowVec<bf16, 8> {
    static FORGE_D void load(const bf16* p, float (&w)[8]) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = bits_f32(u[i] << 16);
            w[2 * i + 1] = bits_f32(u[i] & 0xffff0000u);
        }
    }
};

template <typename T, int VEC>
__device__ void gemv_partial_impl(const T* x, const T* W, float* part, int M, int K, int N,
                                  int kchunk) {
    __shared__ float red[GEMV_WARPS][GEMV_M * VEC][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * 32 + lane) * VEC;
    const int k0 = blockIdx.y * kchunk, k1 = min(K, k0 + kchunk);
    float acc[GEMV_M][VEC];
#pragma unroll
    for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[m][j] = 0.f;
    if (n0 < N) {
#pragma unroll 4
        for (int k = k0 + warp; k < k1; k += GEMV_WARPS) {
            float w[VEC];
            RowVec<T, VEC>::load(W + (long long)k * N + n0, w);
#pragma unroll
            for (int m = 0; m < GEMV_M; ++m) {
                if (m < M) {
                    const float xv = ldf(x[(long long)m * K + k]);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[m][j] += xv * w[j];
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) red[warp][m * VEC + j][lane] = acc[m][j];
    __syncthreads();
    // thread t sums entry (i, l) = (t / 32 + 8 r, t % 32) over the warps, in warp order
    const int l = threadIdx.x & 31;
    for (int i = threadIdx.x >> 5; i < GEMV_M * VEC; i += GEMV_WARPS) {
        const int m = i / VEC, j = i - m * VEC;
        const int n = (blockIdx.x * 32 + l) * VEC + j;
        if (m >= M || n >= N) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += red[w][i][l];
        part[((long long)blockIdx.y * M + m) * N + n] = s;
    }
}

template <typename T>
__device__ void gemv_finish_impl(const float* part, const T* bias, int has_bias,
                                 const T* residual, int has_residual, int act, T* y, int M,
                                 int N, int slices, float alpha) {
    FORGE_FOR(e, (long long)M * N) {
        float s = 0.f;
        for (int k = 0; k < slices; ++k) s += part[(long long)k * M * N + e];
        s *= alpha;
        if (has_bias) s += ldf(bias[e % N]);
        if (act == 1) s = gelu_f(s);
        if (has_residual) s += ldf(residual[e]);
        y[e] = To<T>::from(s);
    }
}

#define FORGE_GEMV(T, S, VEC)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                             \
        gemv_partial_##S(const T* x, const T* W, float* part, int M, int K, int N, int kc) {  \
        gemv_partial_impl<T, VEC>(x, W, part, M, K, N, kc);                                   \
    }                                                                                          \
    extern "C" __global__ void gemv_finish_##S(const float* part, const T* bias, int has_bias, \
                                               const T* res, int has_res, int act, T* y, int M, \
                                               int N, int slices, float alpha) {               \
        gemv_finish_impl<T>(part, bias, has_bias, res, has_res, act, y, M, N, slices, alpha);  \
    }
FORGE_GEMV(float, f32, 4)
FORGE_GEMV(bf16, bf16, 8)
