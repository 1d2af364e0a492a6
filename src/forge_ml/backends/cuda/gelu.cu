// launched from backends/cuda/pointwise.py (gelu_fwd/bwd) and rows.py (gelu_bwd_colsum*)
// gelu.cu: GPT-2's GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. in section 2):
//   y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
#include "common.cuh"

// gelu_f(v), the forward, is in common.cuh (gemv.cu's fused epilogue uses it too).
// Past |u| = 40 the limits, 0 far left and 1 far right (the CPU kernels' too): the formula's
// 0 * inf was NaN once x^2 overflowed (|x| > 1.8e19 in float32). A NaN x stays NaN.
template <typename A> FORGE_D A gelu_d(A v) {
    const A k0 = A(0.7978845608028654), k1 = A(0.044715);
    const A u = k0 * (v + k1 * v * v * v);
    const A t = fm_tanh(u);
    const A du = k0 * (A(1) + A(3) * k1 * v * v);
    const A g = A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * du;
    return u >= A(40) ? A(1) : (u <= A(-40) ? A(0) : g);
}

// gelu_fwd: each thread owns groups of 4 consecutive elements (one vector load when aligned),
// grid-stride, then the tail one element per thread.
template <typename T>
__device__ void gelu_fwd_impl(const T* x, T* y, long long n) {
    long long done = 0;
    if (aligned4(x, sizeof(T)) && aligned4(y, sizeof(T))) {
        const long long nv = n >> 2;
        FORGE_FOR(g, nv) {
            const V4<T> a = reinterpret_cast<const V4<T>*>(x)[g];
            V4<T> r;
#pragma unroll
            for (int k = 0; k < 4; ++k) r.v[k] = To<T>::from(gelu_f(ldf(a.v[k])));
            reinterpret_cast<V4<T>*>(y)[g] = r;
        }
        done = nv << 2;
    }
    FORGE_FOR(i, n - done) y[done + i] = To<T>::from(gelu_f(ldf(x[done + i])));
}

// gelu_bwd: each thread owns groups of 4 consecutive elements, as gelu_fwd: dx = dy * gelu'(x).
template <typename T>
__device__ void gelu_bwd_impl(const T* x, const T* dy, T* dx, long long n) {
    long long done = 0;
    if (aligned4(x, sizeof(T)) && aligned4(dy, sizeof(T)) && aligned4(dx, sizeof(T))) {
        const long long nv = n >> 2;
        FORGE_FOR(g, nv) {
            const V4<T> a = reinterpret_cast<const V4<T>*>(x)[g];
            const V4<T> d = reinterpret_cast<const V4<T>*>(dy)[g];
            V4<T> r;
#pragma unroll
            for (int k = 0; k < 4; ++k) r.v[k] = To<T>::from(ldf(d.v[k]) * gelu_d(ldf(a.v[k])));
            reinterpret_cast<V4<T>*>(dx)[g] = r;
        }
        done = nv << 2;
    }
    FORGE_FOR(i, n - done) dx[done + i] = To<T>::from(ldf(dy[done + i]) * gelu_d(ldf(x[done + i])));
}

// gelu_bwd_colsum: gelu_bwd of an (R, K) matrix (K a multiple of 4, rows 4-aligned) and the
// column sums of its (rounded) result, for the bias gradient of the layer before GELU: each
// (32 x 8) block owns 128 columns (4 a thread) over one chunk of rows, and writes that chunk's
// sums to part[chunk, col] (reduce.cu's colsum_finish adds the chunks in order). The gradient
// is summed as it is written, not read again.
template <typename T>
__device__ void gelu_bwd_colsum_impl(const T* x, const T* dy, T* dx, typename Acc<T>::type* part,
                                     long long R, int K, long long chunk) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[8][129];
    const int tx = threadIdx.x, ty = threadIdx.y, c0 = (blockIdx.x * 32 + tx) * 4;
    const long long r0 = (long long)blockIdx.y * chunk, r1 = min(R, r0 + chunk);
    A s[4] = {A(0), A(0), A(0), A(0)};
    if (c0 < K) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            const long long o = r * K + c0;
            const V4<T> a = *reinterpret_cast<const V4<T>*>(x + o);
            const V4<T> d = *reinterpret_cast<const V4<T>*>(dy + o);
            V4<T> g;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                g.v[k] = To<T>::from(ldf(d.v[k]) * gelu_d(ldf(a.v[k])));
                s[k] += ldf(g.v[k]);
            }
            *reinterpret_cast<V4<T>*>(dx + o) = g;
        }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) sh[ty][4 * tx + k] = s[k];
    __syncthreads();
    if (ty == 0 && c0 < K) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            A t = A(0);
#pragma unroll
            for (int j = 0; j < 8; ++j) t += sh[j][4 * tx + k];
            part[(long long)blockIdx.y * K + c0 + k] = t;
        }
    }
}

// gelu_bwd_colsum8_bf16: gelu_bwd_colsum for bf16 rows whose K is a multiple of 8 and whose
// operands are 16-byte aligned (GPT-2's MLP: K = 3072), written for the bandwidth the 4-wide
// kernel above did not reach (59% of the H200's on GPT-2 124M's (32768, 3072)):
// - 16-byte loads: each lane owns 8 columns, a (32 x 8) block 256 columns;
// - two rows in flight a lane (r and r + 8; the pointers are __restrict__, so the next row's
//   loads need not wait for this row's store);
// - GELU's derivative from e^(2u) (the hardware exponential) and one fast division, about
//   half of tanhf's instructions (the 4-wide kernel was as much bound by its arithmetic as by
//   memory): gelu_d_fast below;
// - chunks of rows sized by the caller so that the grid is about one wave.
// A lane adds its rows in order (r0 + ty, r0 + ty + 8, ...) and the 8 row groups in order, as
// the 4-wide kernel does; colsum_finish adds the chunks.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// 1 + tanh(u) = 2e / (1 + e) and 1 - tanh(u) = 2 / (1 + e), e = exp(2u), each without the
// cancellation of 1 +- t where tanh(u) is near -1 or 1 (u clamped to +-40: e stays finite).
// Past |u| = 40 the limits, 0 far left and 1 far right, as gelu_d: the clamped e, times x du,
// gave gelu'(1e13) = 3600 and gelu'(-1e13) = -360. fmaxf drops a NaN, so the test is on the
// unclamped u: a NaN x stays NaN.
FORGE_D float gelu_d_fast(float v) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    const float v2 = v * v;
    const float u0 = k0 * fmaf(k1 * v2, v, v);                           // k0 (v + k1 v^3)
    const float u = fminf(fmaxf(u0, -40.f), 40.f);
    const float e = __expf(2.f * u), r = __fdividef(2.f, 1.f + e);
    const float up = e * r, dn = r;                                      // 1 + t, 1 - t
    const float du = k0 * fmaf(3.f * k1, v2, 1.f);
    const float g = 0.5f * fmaf(v * dn * du, up, up);
    return u0 >= 40.f ? 1.f : (u0 <= -40.f ? 0.f : g);
}

// one row's 8 columns: dx = dy * gelu'(x) rounded to bf16, its rounded values added to s
FORGE_D void gelu_bwd_row8(uint4 a16, uint4 d16, bf16* __restrict__ dx, float (&s)[8]) {
    float a[8], d[8], g[8];
    Vec16<bf16>::widen(a16, a);
    Vec16<bf16>::widen(d16, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = d[k] * gelu_d_fast(a[k]);
    const uint4 out = pack8_bf16(g);
    *reinterpret_cast<uint4*>(dx) = out;
    Vec16<bf16>::widen(out, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] += g[k];
}

extern "C" __global__ void __launch_bounds__(256)
    gelu_bwd_colsum8_bf16(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                          bf16* __restrict__ dx, float* __restrict__ part, long long R, int K,
                          long long chunk) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    colsum8_rows(
        R, K, chunk,
        [&](long long o0, long long o1) {
            const uint4 a0 = *reinterpret_cast<const uint4*>(x + o0);
            const uint4 d0 = *reinterpret_cast<const uint4*>(dy + o0);
            const uint4 a1 = *reinterpret_cast<const uint4*>(x + o1);
            const uint4 d1 = *reinterpret_cast<const uint4*>(dy + o1);
            gelu_bwd_row8(a0, d0, dx + o0, s);
            gelu_bwd_row8(a1, d1, dx + o1, s);
        },
        [&](long long o) {
            gelu_bwd_row8(*reinterpret_cast<const uint4*>(x + o),
                          *reinterpret_cast<const uint4*>(dy + o), dx + o, s);
        });
    colsum8_block_finish(s, part, K);
}
#endif

#define FORGE_GELU(T, S)                                                                      \
    extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, long long n) {                \
        gelu_fwd_impl<T>(x, y, n);                                                            \
    }                                                                                         \
    extern "C" __global__ void gelu_bwd_##S(const T* x, const T* dy, T* dx, long long n) { \
        gelu_bwd_impl<T>(x, dy, dx, n);                                                       \
    }                                                                                         \
    extern "C" __global__ void gelu_bwd_colsum_##S(const T* x, const T* dy, T* dx,           \
                                                   Acc<T>::type* part, long long R, int K,   \
                                                   long long chunk) {                        \
        gelu_bwd_colsum_impl<T>(x, dy, dx, part, R, K, chunk);                                \
    }
FORGE_GELU(float, f32)
FORGE_GELU(double, f64)
FORGE_GELU(bf16, bf16)
