// launched from backends/cuda/rows.py
// reduce.cu: deterministic reductions (fixed grid, fixed order, no atomics): column sums for
// sum_rows and the LayerNorm parameter gradients, and whole-array sums (sum of squares for
// gradient clipping, plain sums for the cross-entropy mean). float32 accumulation (float64
// for float64 data).
#include "common.cuh"

// sum_rows_partial: each (32 x 8) block owns 32 columns over one chunk of rows and writes that
// chunk's column sums to part[chunk, col].
template <typename T>
__device__ void sum_rows_partial_impl(const T* x, typename Acc<T>::type* part, long long R,
                                      int C, long long chunk) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;
    const long long r0 = (long long)blockIdx.y * chunk;
    long long r1 = r0 + chunk;
    if (r1 > R) r1 = R;
    A acc = A(0);
    if (col < C)
        for (long long r = r0 + ty; r < r1; r += 8) acc += ldf(x[r * C + col]);
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && col < C) {
        A t = A(0);
#pragma unroll
        for (int k = 0; k < 8; ++k) t += sh[k][tx];
        part[(long long)blockIdx.y * C + col] = t;
    }
}

// colsum_finish: each (32 x 32) block owns 32 columns: thread (tx, ty) adds chunk partials ty,
// ty + 32, ... of column tx in order, then row ty = 0 adds the 32 sums in order and rounds once.
// (One thread a column walking every partial left most of the GPU idle: 17 us for 768 columns
// of 512 partials.) blockIdx.y picks one of a stack of jobs, partials (S, C) and output (C,)
// each, one after the other in part and out (layernorm's parameter gradients in one launch).
template <typename A, typename T>
__device__ void colsum_finish_impl(const A* part, T* out, int S, int C) {
    __shared__ A sh[32][33];
    part += (long long)blockIdx.y * S * C;
    out += (long long)blockIdx.y * C;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;
    A t = A(0);
    if (col < C)
        for (int s = ty; s < S; s += 32) t += part[(long long)s * C + col];
    sh[ty][tx] = t;
    __syncthreads();
    if (ty == 0 && col < C) {
        A u = A(0);
#pragma unroll
        for (int k = 0; k < 32; ++k) u += sh[k][tx];
        out[col] = To<T>::from(u);
    }
}

// sum_partial: each block owns a grid-stride share of the n elements and writes its sum (of
// squares when SQUARE) to part[blockIdx.x].
template <typename T, bool SQUARE>
__device__ void sum_partial_impl(const T* x, typename Acc<T>::type* part, long long n) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[32];
    A acc = A(0);
    FORGE_FOR(i, n) {
        const A v = ldf(x[i]);
        acc += SQUARE ? v * v : v;
    }
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// sum_finish: one block owns the whole job: adds the n partials (thread t takes t, t + 1024, ...,
// then a fixed tree) and writes scale * total to out[0].
template <typename A>
__device__ void sum_finish_impl(const A* part, A* out, long long n, A scale) {
    __shared__ A sh[32];
    A acc = A(0);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += part[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = acc * scale;
}

#define FORGE_REDUCE(T, S, A)                                                                   \
    extern "C" __global__ void sum_rows_partial_##S(const T* x, A* part, long long R, int C,   \
                                                    long long chunk) {                          \
        sum_rows_partial_impl<T>(x, part, R, C, chunk);                                         \
    }                                                                                           \
    extern "C" __global__ void colsum_finish_##S(const A* part, T* out, int S_, int C) {       \
        colsum_finish_impl<A, T>(part, out, S_, C);                                             \
    }                                                                                           \
    extern "C" __global__ void sumsq_partial_##S(const T* x, A* part, long long n) {          \
        sum_partial_impl<T, true>(x, part, n);                                                  \
    }                                                                                           \
    extern "C" __global__ void sum_partial_##S(const T* x, A* part, long long n) {            \
        sum_partial_impl<T, false>(x, part, n);                                                 \
    }
FORGE_REDUCE(float, f32, float)
FORGE_REDUCE(double, f64, double)
FORGE_REDUCE(bf16, bf16, float)

extern "C" __global__ void sum_finish_f32(const float* part, float* out, long long n,
                                          float scale) {
    sum_finish_impl<float>(part, out, n, scale);
}
extern "C" __global__ void sum_finish_f64(const double* part, double* out, long long n,
                                          double scale) {
    sum_finish_impl<double>(part, out, n, scale);
}

// sum_rows8_partial_bf16: sum_rows_partial for bf16 rows whose C is a multiple of 8 and whose
// start is 16-byte aligned (the MLP's (B*T, 4C) gradient after cuBLASLt's DGELU epilogue):
// gelu.cu's gelu_bwd_colsum8_bf16 without GELU and without the write. 16-byte loads, a lane
// owning 8 columns and two rows in flight (r, r + 8); a (32 x 8) block owns 256 columns over
// one chunk of rows (sized by the caller for about one wave). A lane adds its rows in order
// and the 8 row groups are added in order; colsum_finish adds the chunks.
extern "C" __global__ void __launch_bounds__(256)
    sum_rows8_partial_bf16(const bf16* __restrict__ x, float* __restrict__ part, long long R,
                           int C, long long chunk) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    colsum8_rows(
        R, C, chunk,
        [&](long long o0, long long o1) {
            const uint4 a = *reinterpret_cast<const uint4*>(x + o0);
            const uint4 b = *reinterpret_cast<const uint4*>(x + o1);
            float va[8], vb[8];
            Vec16<bf16>::widen(a, va);
            Vec16<bf16>::widen(b, vb);
#pragma unroll
            for (int k = 0; k < 8; ++k) s[k] = (s[k] + va[k]) + vb[k];
        },
        [&](long long o) {
            float v[8];
            Vec16<bf16>::widen(*reinterpret_cast<const uint4*>(x + o), v);
#pragma unroll
            for (int k = 0; k < 8; ++k) s[k] += v[k];
        });
    colsum8_block_finish(s, part, C);
}
