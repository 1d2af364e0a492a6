// launched from backends/cuda/rows.py
// layernorm.cu: LayerNorm over the last axis (Ba, Kiros & Hinton 2016), forward and backward.
//   y = (x - mean) * rstd * gamma + beta,  rstd = 1 / sqrt(var + eps)   (biased variance)
//   dx = rstd * (g dy - mean(g dy) - xhat * mean(g dy xhat)),  xhat = (x - mean) * rstd
//   dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy
// Statistics are accumulated in float32 (float64 for float64 data), two-pass for the variance.
#include "common.cuh"

// Mean and rstd of one row, computed by the 32 lanes of a warp (all lanes get both).
template <typename T, typename A>
__device__ __forceinline__ void row_stats(const T* xr, int C, A eps, A& mean, A& rstd) {
    const int lane = threadIdx.x & 31;
    A s = A(0);
    for (int c = lane; c < C; c += 32) s += ldf(xr[c]);
    mean = warp_sum(s) / A(C);
    A v = A(0);
    for (int c = lane; c < C; c += 32) {
        const A d = ldf(xr[c]) - mean;
        v += d * d;
    }
    rstd = A(1) / fm_sqrt(warp_sum(v) / A(C) + eps);
}

// layernorm_fwd: each warp owns one row of C elements (blockDim.x / 32 rows per block).
template <typename T>
__device__ void layernorm_fwd_impl(const T* x, const T* gamma, const T* beta, T* y, long long R,
                                   int C, typename Acc<T>::type eps) {
    typedef typename Acc<T>::type A;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= R) return;
    const T* xr = x + row * C;
    T* yr = y + row * C;
    A mean, rstd;
    row_stats(xr, C, eps, mean, rstd);
    for (int c = threadIdx.x & 31; c < C; c += 32)
        yr[c] = To<T>::from((ldf(xr[c]) - mean) * rstd * ldf(gamma[c]) + ldf(beta[c]));
}

// layernorm_fwd_block: one block per row, for a few rows (a decoding step: one row per
// sequence), where a warp per row would leave the GPU idle and walk C / 32 elements serially.
template <typename T>
__device__ void layernorm_fwd_block_impl(const T* x, const T* gamma, const T* beta, T* y, int C,
                                         typename Acc<T>::type eps) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    const T* xr = x + (long long)blockIdx.x * C;
    T* yr = y + (long long)blockIdx.x * C;
    A s = A(0);
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += ldf(xr[c]);
    const A mean = block_sum(s, sh) / A(C);
    A v = A(0);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const A d = ldf(xr[c]) - mean;
        v += d * d;
    }
    const A rstd = A(1) / fm_sqrt(block_sum(v, sh) / A(C) + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = To<T>::from((ldf(xr[c]) - mean) * rstd * ldf(gamma[c]) + ldf(beta[c]));
}

// layernorm_bwd: each warp owns one row: recomputes mean and rstd, writes dx, and leaves the
// row's (mean, rstd) for layernorm_bwd_params.
template <typename T>
__device__ void layernorm_bwd_impl(const T* x, const T* gamma, const T* dy, T* dx,
                                   typename Acc<T>::type* mean_out,
                                   typename Acc<T>::type* rstd_out, long long R, int C,
                                   typename Acc<T>::type eps) {
    typedef typename Acc<T>::type A;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= R) return;
    const int lane = threadIdx.x & 31;
    const T* xr = x + row * C;
    const T* dyr = dy + row * C;
    T* dxr = dx + row * C;
    A mean, rstd;
    row_stats(xr, C, eps, mean, rstd);
    A s1 = A(0), s2 = A(0);
    for (int c = lane; c < C; c += 32) {
        const A gdy = ldf(gamma[c]) * ldf(dyr[c]);
        s1 += gdy;
        s2 += gdy * (ldf(xr[c]) - mean) * rstd;
    }
    const A m1 = warp_sum(s1) / A(C), m2 = warp_sum(s2) / A(C);
    for (int c = lane; c < C; c += 32) {
        const A xhat = (ldf(xr[c]) - mean) * rstd;
        const A gdy = ldf(gamma[c]) * ldf(dyr[c]);
        dxr[c] = To<T>::from(rstd * (gdy - m1 - xhat * m2));
    }
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

// layernorm_bwd_params: each (32 x 8) block owns 32 columns over one chunk of rows and writes
// that chunk's partial sums of dy * xhat and dy (reduce.cu's colsum_finish adds the chunks).
template <typename T>
__device__ void layernorm_bwd_params_impl(const T* x, const T* dy,
                                          const typename Acc<T>::type* mean,
                                          const typename Acc<T>::type* rstd,
                                          typename Acc<T>::type* part_g,
                                          typename Acc<T>::type* part_b, long long R, int C,
                                          long long chunk) {
    typedef typename Acc<T>::type A;
    __shared__ A sg[8][33];
    __shared__ A sb[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;
    const long long r0 = (long long)blockIdx.y * chunk;
    long long r1 = r0 + chunk;
    if (r1 > R) r1 = R;
    A g = A(0), b = A(0);
    if (col < C) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            const A d = ldf(dy[r * C + col]);
            g += d * (ldf(x[r * C + col]) - mean[r]) * rstd[r];
            b += d;
        }
    }
    sg[ty][tx] = g;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && col < C) {
        A tg = A(0), tb = A(0);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            tg += sg[k][tx];
            tb += sb[k][tx];
        }
        part_g[(long long)blockIdx.y * C + col] = tg;
        part_b[(long long)blockIdx.y * C + col] = tb;
    }
}

#define FORGE_LAYERNORM(T, S, A)                                                              \
    extern "C" __global__ void layernorm_fwd_##S(const T* x, const T* gamma, const T* beta,   \
                                                 T* y, long long R, int C, A eps) {            \
        layernorm_fwd_impl<T>(x, gamma, beta, y, R, C, eps);                                   \
    }                                                                                          \
    extern "C" __global__ void layernorm_fwd_block_##S(const T* x, const T* gamma,            \
                                                       const T* beta, T* y, int C, A eps) {    \
        layernorm_fwd_block_impl<T>(x, gamma, beta, y, C, eps);                                \
    }                                                                                          \
    extern "C" __global__ void layernorm_bwd_##S(const T* x, const T* gamma, const T* dy,     \
                                                 T* dx, A* mean, A* rstd, long long R, int C,  \
                                                 A eps) {                                      \
        layernorm_bwd_impl<T>(x, gamma, dy, dx, mean, rstd, R, C, eps);                        \
    }                                                                                          \
    extern "C" __global__ void layernorm_bwd_params_##S(const T* x, const T* dy,              \
                                                        const A* mean, const A* rstd,         \
                                                        A* part_g, A* part_b, long long R,    \
                                                        int C, long long chunk) {             \
        layernorm_bwd_params_impl<T>(x, dy, mean, rstd, part_g, part_b, R, C, chunk);          \
    }
FORGE_LAYERNORM(float, f32, float)
FORGE_LAYERNORM(double, f64, double)
FORGE_LAYERNORM(bf16, bf16, float)
