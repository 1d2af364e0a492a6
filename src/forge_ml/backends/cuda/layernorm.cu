// launched from backends/cuda/rows.py
// layernorm.cu: LayerNorm over the last axis (Ba, Kiros & Hinton 2016), forward and backward.
//   y = (x - mean) * rstd * gamma + beta,  rstd = 1 / sqrt(var + eps)   (biased variance)
//   dx = rstd * (g dy - mean(g dy) - xhat * mean(g dy xhat)),  xhat = (x - mean) * rstd
//   dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy
// Statistics are accumulated in float32 (float64 for float64 data), two passes
// (the corrected form, common.cuh's ln_correct: a constant row's layernorm is beta exactly).
#include "common.cuh"

// Mean and rstd of one row, computed by the 32 lanes of a warp (all lanes get both).
template <typename T, typename A>
__device__ __forceinline__ void row_stats(const T* xr, int C, A eps, A& mean, A& rstd) {
    const int lane = threadIdx.x & 31;
    A s = A(0);
    for (int c = lane; c < C; c += 32) s += ldf(xr[c]);
    const A m0 = warp_sum(s) / A(C);
    A v = A(0), sd = A(0);
    for (int c = lane; c < C; c += 32) {
        const A d = ldf(xr[c]) - m0;
        v += d * d;
        sd += d;
    }
    ln_correct(m0, warp_sum(sd), warp_sum(v), C, eps, mean, rstd);
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
    const A m0 = block_sum(s, sh) / A(C);
    A v = A(0), sd = A(0);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const A d = ldf(xr[c]) - m0;
        v += d * d;
        sd += d;
    }
    const A ss = block_sum(v, sh);
    A mean, rstd;
    ln_correct(m0, block_sum(sd, sh), ss, C, eps, mean, rstd);
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

// ---- bf16 rows of C = 8k <= 2048: a warp per row, each lane holding NV 16-byte vectors ------
// Lane l owns vectors l, l + 32, ..., l + 32 (NV - 1) of the row (columns 8v..8v+7), so a warp
// reads and writes whole 512-byte spans; statistics as row_stats (two passes, over registers).
#define LN_WARPS 8

template <int NV>
FORGE_D void ln_load(const bf16* r, int nv, uint4 (&raw)[NV]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int v = lane + 32 * j;
        raw[j] = v < nv ? reinterpret_cast<const uint4*>(r)[v] : make_uint4(0, 0, 0, 0);
    }
}

// mean and rstd of the row in raw (columns past C are zeros and left out of the variance).
template <int NV>
FORGE_D void ln_stats(const uint4 (&raw)[NV], int nv, int C, float eps, float& mean, float& rstd) {
    const int lane = threadIdx.x & 31;
    float s = 0.f, w[8];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        Vec16<bf16>::widen(raw[j], w);
#pragma unroll
        for (int e = 0; e < 8; ++e) s += w[e];
    }
    const float m0 = warp_sum(s) / float(C);
    float v = 0.f, sd = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if (lane + 32 * j >= nv) continue;
        Vec16<bf16>::widen(raw[j], w);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float d = w[e] - m0;
            v += d * d;
            sd += d;
        }
    }
    ln_correct(m0, warp_sum(sd), warp_sum(v), C, eps, mean, rstd);
}

// layernorm_fwd_vec: y = (x - mean) rstd gamma + beta, each warp owning rows warp, warp + (all
// warps of the grid), ...
template <int NV>
__device__ void layernorm_fwd_vec_impl(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                                       long long R, int C, float eps) {
    const int lane = threadIdx.x & 31, nv = C >> 3;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < R;
         row += warps) {
        uint4 raw[NV];
        ln_load<NV>(x + row * C, nv, raw);
        float mean, rstd;
        ln_stats<NV>(raw, nv, C, eps, mean, rstd);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int v = lane + 32 * j;
            if (v >= nv) continue;
            float w[8], g[8], b[8];
            Vec16<bf16>::widen(raw[j], w);
            Vec16<bf16>::load(gamma + 8 * v, g);
            Vec16<bf16>::load(beta + 8 * v, b);
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = (w[e] - mean) * rstd * g[e] + b[e];
            reinterpret_cast<uint4*>(y + row * C)[v] = pack8_bf16(w);
        }
    }
}

// layernorm_bwd_fused: dx of each row (as layernorm_bwd), and in the same pass each lane's
// running sums of dy * xhat and dy over the rows its warp takes, in registers; at the end the
// block adds its warps' sums in warp order and writes them to part_g[blockIdx.x], part_b[...]
// (reduce.cu's colsum_finish adds the blocks). x and dy are read once, and no second kernel
// reads them again for the parameters' gradients. ADD (the _add_ kernels): dx + add is written
// (the gradient x already has from its other uses, rounded to bf16 once with dx:
// layernorm_bwd_add); without it the instance is the kernel as it was before ADD existed.
// SUMS (the _sums kernels): a third running sum, of the dx written (as rounded to bf16), to
// part_o: the bias gradient of the linear layer whose output x is, when this backward writes
// x's whole gradient (layernorm_bwd_sums: the tape hands it to that layer's backward, so no
// kernel reads the gradient again for it).
template <int NV, bool ADD, bool SUMS>
__device__ void layernorm_bwd_fused_impl(const bf16* x, const bf16* gamma, const bf16* dy,
                                         const bf16* add, bf16* dx, float* part_g,
                                         float* part_b, float* part_o, long long R, int C,
                                         float eps) {
    __shared__ float sh[LN_WARPS][256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nv = C >> 3;
    const long long warps = (long long)gridDim.x * LN_WARPS;
    float acc_g[NV][8], acc_b[NV][8], acc_o[SUMS ? NV : 1][8];
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc_g[j][e] = acc_b[j][e] = 0.f;
#pragma unroll
    for (int j = 0; j < (SUMS ? NV : 1); ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc_o[j][e] = 0.f;
    for (long long row = (long long)blockIdx.x * LN_WARPS + warp; row < R; row += warps) {
        uint4 rx[NV], rd[NV];
        ln_load<NV>(x + row * C, nv, rx);
        ln_load<NV>(dy + row * C, nv, rd);
        float mean, rstd;
        ln_stats<NV>(rx, nv, C, eps, mean, rstd);
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int v = lane + 32 * j;
            if (v >= nv) continue;
            float w[8], d[8], g[8];
            Vec16<bf16>::widen(rx[j], w);
            Vec16<bf16>::widen(rd[j], d);
            Vec16<bf16>::load(gamma + 8 * v, g);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float xhat = (w[e] - mean) * rstd, gdy = g[e] * d[e];
                s1 += gdy;
                s2 += gdy * xhat;
                acc_g[j][e] += d[e] * xhat;
                acc_b[j][e] += d[e];
            }
        }
        const float m1 = warp_sum(s1) / float(C), m2 = warp_sum(s2) / float(C);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int v = lane + 32 * j;
            if (v >= nv) continue;
            float w[8], d[8], g[8];
            Vec16<bf16>::widen(rx[j], w);
            Vec16<bf16>::widen(rd[j], d);
            Vec16<bf16>::load(gamma + 8 * v, g);
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = rstd * (g[e] * d[e] - m1 - (w[e] - mean) * rstd * m2);
            if (ADD) {
                float a[8];
                Vec16<bf16>::load(add + row * C + 8 * v, a);
#pragma unroll
                for (int e = 0; e < 8; ++e) w[e] = a[e] + w[e];
            }
            const uint4 packed = pack8_bf16(w);
            reinterpret_cast<uint4*>(dx + row * C)[v] = packed;
            if (SUMS) {
                Vec16<bf16>::widen(packed, w);   // the values written, as the layer reads them
#pragma unroll
                for (int e = 0; e < 8; ++e) acc_o[SUMS ? j : 0][e] += w[e];
            }
        }
    }
    // the block's sums, one vector column j at a time: sh[warp][8 lane + e]
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int which = 0; which < (SUMS ? 3 : 2); ++which) {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                sh[warp][8 * lane + e] = which == 2 ? acc_o[SUMS ? j : 0][e]
                                                    : (which ? acc_b[j][e] : acc_g[j][e]);
            __syncthreads();
            const int col = 256 * j + threadIdx.x;   // threadIdx.x < 256 = 8 lanes x 32
            if (col < C) {
                float t = 0.f;
#pragma unroll
                for (int k = 0; k < LN_WARPS; ++k) t += sh[k][threadIdx.x];
                (which == 2 ? part_o : (which ? part_b : part_g))[(long long)blockIdx.x * C + col] = t;
            }
            __syncthreads();
        }
    }
}

#define FORGE_LN_VEC(NV)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS) layernorm_fwd_vec_bf16_##NV(   \
        const bf16* x, const bf16* gamma, const bf16* beta, bf16* y, long long R, int C,       \
        float eps) {                                                                            \
        layernorm_fwd_vec_impl<NV>(x, gamma, beta, y, R, C, eps);                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS) layernorm_bwd_fused_bf16_##NV( \
        const bf16* x, const bf16* gamma, const bf16* dy, bf16* dx, float* part_g,             \
        float* part_b, long long R, int C, float eps) {                                         \
        layernorm_bwd_fused_impl<NV, false, false>(x, gamma, dy, dy, dx, part_g, part_b, part_b, \
                                                   R, C, eps);                                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS)                                 \
        layernorm_bwd_fused_add_bf16_##NV(const bf16* x, const bf16* gamma, const bf16* dy,    \
                                          const bf16* add, bf16* dx, float* part_g,            \
                                          float* part_b, long long R, int C, float eps) {      \
        layernorm_bwd_fused_impl<NV, true, false>(x, gamma, dy, add, dx, part_g, part_b, part_b, \
                                                  R, C, eps);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS)                                 \
        layernorm_bwd_fused_sums_bf16_##NV(const bf16* x, const bf16* gamma, const bf16* dy,   \
                                           bf16* dx, float* part_g, float* part_b,             \
                                           float* part_o, long long R, int C, float eps) {     \
        layernorm_bwd_fused_impl<NV, false, true>(x, gamma, dy, dy, dx, part_g, part_b, part_o, \
                                                  R, C, eps);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS)                                 \
        layernorm_bwd_fused_add_sums_bf16_##NV(const bf16* x, const bf16* gamma,               \
                                               const bf16* dy, const bf16* add, bf16* dx,      \
                                               float* part_g, float* part_b, float* part_o,    \
                                               long long R, int C, float eps) {                \
        layernorm_bwd_fused_impl<NV, true, true>(x, gamma, dy, add, dx, part_g, part_b, part_o, \
                                                 R, C, eps);                                    \
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
FORGE_LN_VEC(1)
FORGE_LN_VEC(2)
FORGE_LN_VEC(3)
FORGE_LN_VEC(4)
FORGE_LN_VEC(5)
FORGE_LN_VEC(6)
FORGE_LN_VEC(7)
FORGE_LN_VEC(8)
#endif

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
