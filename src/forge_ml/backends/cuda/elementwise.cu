// launched from backends/cuda/pointwise.py (add, scale_*), memory.py (cast_*) and linear.py
// (bias_fill_*)
// elementwise.cu: the plain per-element kernels: add, scale by a value in device memory, dtype
// casts, and the bias broadcast that seeds a matmul output (cuBLAS then accumulates with beta = 1).
#include "common.cuh"

// add: each thread owns groups of 4 consecutive elements g, g + stride, ... (one vector load
// per operand when aligned), then the tail n % 4 one element per thread.
template <typename T>
__device__ void add_impl(const T* a, const T* b, T* out, long long n) {
    long long done = 0;
    if (aligned4(a, sizeof(T)) && aligned4(b, sizeof(T)) && aligned4(out, sizeof(T))) {
        const long long nv = n >> 2;
        FORGE_FOR(g, nv) {
            const V4<T> x = reinterpret_cast<const V4<T>*>(a)[g];
            const V4<T> y = reinterpret_cast<const V4<T>*>(b)[g];
            V4<T> r;
#pragma unroll
            for (int k = 0; k < 4; ++k) r.v[k] = To<T>::from(ldf(x.v[k]) + ldf(y.v[k]));
            reinterpret_cast<V4<T>*>(out)[g] = r;
        }
        done = nv << 2;
    }
    FORGE_FOR(i, n - done) out[done + i] = To<T>::from(ldf(a[done + i]) + ldf(b[done + i]));
}

#define FORGE_ADD(T, S)                                                                  \
    extern "C" __global__ void add_##S(const T* a, const T* b, T* out, long long n) { \
        add_impl<T>(a, b, out, n);                                                       \
    }
FORGE_ADD(float, f32)
FORGE_ADD(double, f64)
FORGE_ADD(bf16, bf16)

// cast: each thread owns elements i, i + stride, ...: widen to the accumulation type, then
// round once to the output type.
template <typename TI, typename TO>
__device__ void cast_impl(const TI* x, TO* y, long long n) {
    FORGE_FOR(i, n) y[i] = To<TO>::from(ldf(x[i]));
}

#define FORGE_CAST(TI, SI, TO, SO)                                                         \
    extern "C" __global__ void cast_##SI##_##SO(const TI* x, TO* y, long long n) {         \
        cast_impl<TI, TO>(x, y, n);                                                        \
    }
FORGE_CAST(float, f32, bf16, bf16)
FORGE_CAST(bf16, bf16, float, f32)
FORGE_CAST(double, f64, bf16, bf16)
FORGE_CAST(bf16, bf16, double, f64)
FORGE_CAST(float, f32, double, f64)
FORGE_CAST(double, f64, float, f32)

// bias_fill: each thread owns elements i, i + stride, ... of the (rows, n) output: out = bias[i % n].
template <typename T>
__device__ void bias_fill_impl(const T* bias, T* out, long long total, int n) {
    FORGE_FOR(i, total) out[i] = bias[i % n];
}

#define FORGE_BIAS_FILL(T, S)                                                                  \
    extern "C" __global__ void bias_fill_##S(const T* bias, T* out, long long total, int n) { \
        bias_fill_impl<T>(bias, out, total, n);                                                \
    }
FORGE_BIAS_FILL(float, f32)
FORGE_BIAS_FILL(double, f64)
FORGE_BIAS_FILL(bf16, bf16)

// scale: y = s[0] * x, s one value of the accumulation type read on the device (a loss's
// cotangent: no wait for the host); each thread owns elements i, i + stride, ...
template <typename T, typename A>
__device__ void scale_impl(const T* x, const A* s, T* y, long long n) {
    const A g = s[0];
    FORGE_FOR(i, n) y[i] = To<T>::from(g * A(ldf(x[i])));
}

#define FORGE_SCALE(T, S, A)                                                              \
    extern "C" __global__ void scale_##S(const T* x, const A* s, T* y, long long n) {     \
        scale_impl<T, A>(x, s, y, n);                                                     \
    }
FORGE_SCALE(float, f32, float)
FORGE_SCALE(double, f64, double)
FORGE_SCALE(bf16, bf16, float)
