// gemv.cu: the linear layer of a decoding step, for a few rows (M <= GEMV_M, the batch):
//   y (M, N) = act(alpha * LN(x) (M, K) @ W (K, N) + bias) + residual
// W row-major (in, out); LN optional (x's layernorm with gamma, beta, computed here); act none
// (0) or GPT-2's GELU (1); bias and residual optional. All of a layer in one kernel: reading W
// once is the whole cost, and in a CUDA graph every extra kernel is a few microseconds more.
//
// Block (column tile, K slice). Lane l of a warp owns VEC consecutive columns (one 16-byte
// load per row: 4 float32 or 8 bf16), so a warp reads 512 contiguous bytes of a row; the
// block's 8 warps take rows k0 + w, k0 + w + 8, ... of its K slice; each lane keeps M x VEC
// float32 sums. With LN, each block first computes the rows' mean and rstd (two passes over
// x, float32, as layernorm.cu) and normalises x as it reads it. The warps' sums meet in shared
// memory and the block writes part[slice, m, n] (float32). The last block of a column tile to
// finish (a counter per tile, atomically incremented after a fence) adds the tile's partial
// sums in slice order (the same bits on every run), applies the epilogue, rounds once to T,
// and sets the counter back to 0 for the next launch (counters are the backend's, one array
// per device, zeroed once). The grid is (N / (32 VEC), slices): about two blocks per SM.
#include "common.cuh"

#define GEMV_M 4  // at most this many rows
#define GEMV_WARPS 8

template <typename T, int VEC>
__device__ void gemv_impl(const T* x, const T* W, float* part, unsigned* counters,
                          const T* gamma, const T* beta, int has_ln, float eps, const T* bias,
                          int has_bias, const T* residual, int has_res, int act, T* y, int M,
                          int K, int N, int kchunk, float alpha) {
    __shared__ float red[GEMV_WARPS][GEMV_M * VEC][32];
    __shared__ float stat[2][GEMV_M];
    __shared__ float sh[32];
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (has_ln) {
        for (int m = 0; m < M; ++m) {
            const T* xr = x + (long long)m * K;
            float s = 0.f;
            for (int k = tid; k < K; k += blockDim.x) s += ldf(xr[k]);
            const float mean = block_sum(s, sh) / float(K);
            float v = 0.f;
            for (int k = tid; k < K; k += blockDim.x) {
                const float d = ldf(xr[k]) - mean;
                v += d * d;
            }
            const float var = block_sum(v, sh) / float(K);
            if (tid == 0) {
                stat[0][m] = mean;
                stat[1][m] = 1.f / sqrtf(var + eps);
            }
        }
        __syncthreads();
    }
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
            Vec16<T>::load(W + (long long)k * N + n0, w);
            const float g = has_ln ? ldf(gamma[k]) : 1.f, b = has_ln ? ldf(beta[k]) : 0.f;
#pragma unroll
            for (int m = 0; m < GEMV_M; ++m) {
                if (m < M) {
                    float xv = ldf(x[(long long)m * K + k]);
                    if (has_ln) xv = (xv - stat[0][m]) * stat[1][m] * g + b;
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
    for (int i = warp; i < GEMV_M * VEC; i += GEMV_WARPS) {
        const int m = i / VEC, j = i - m * VEC;
        const int n = (blockIdx.x * 32 + lane) * VEC + j;
        if (m >= M || n >= N) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += red[w][i][lane];
        part[((long long)blockIdx.y * M + m) * N + n] = s;
    }
    // the last block of this column tile finishes it
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int width = 32 * VEC, c0 = blockIdx.x * width;
    for (int i = tid; i < M * width; i += blockDim.x) {
        const int m = i / width, n = c0 + (i - m * width);
        if (n >= N) continue;
        float s = 0.f;
        for (int k = 0; k < (int)gridDim.y; ++k) s += __ldcg(part + ((long long)k * M + m) * N + n);
        s *= alpha;
        if (has_bias) s += ldf(bias[n]);
        if (act == 1) s = gelu_f(s);
        if (has_res) s += ldf(residual[(long long)m * N + n]);
        y[(long long)m * N + n] = To<T>::from(s);
    }
    if (tid == 0) counters[blockIdx.x] = 0u;
}

#define FORGE_GEMV(T, S, VEC)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                           \
        gemv_##S(const T* x, const T* W, float* part, unsigned* counters, const T* gamma,    \
                 const T* beta, int has_ln, float eps, const T* bias, int has_bias,          \
                 const T* res, int has_res, int act, T* y, int M, int K, int N, int kc,      \
                 float alpha) {                                                              \
        gemv_impl<T, VEC>(x, W, part, counters, gamma, beta, has_ln, eps, bias, has_bias,    \
                          res, has_res, act, y, M, K, N, kc, alpha);                         \
    }
FORGE_GEMV(float, f32, 4)
FORGE_GEMV(bf16, bf16, 8)
