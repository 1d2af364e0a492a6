// launched from backends/cuda/pointwise.py
// dropout.cu: inverted dropout whose mask is forge_ml.rng's Philox stream, bit for bit:
//   key = (seed lo, seed hi), counter = (i/4 lo, i/4 hi, 0, 0), word = philox(counter)[i % 4],
//   u = (word >> 8) * 2^-24 (exact in float32), keep = u >= float32(p),
//   y = keep ? x * scale : 0, scale = float32(1 / (1 - p)) computed once on the host.
// The backward is the same kernel applied to dy with the same seed.
#include "common.cuh"

// dropout: each thread owns one group of 4 consecutive elements (one Philox4x32-10 call, one
// vector load when aligned), grid-stride over the groups.
template <typename T>
__device__ void dropout_impl(const T* x, T* y, long long n, unsigned int k0, unsigned int k1,
                             float p, typename Acc<T>::type scale) {
    typedef typename Acc<T>::type A;
    const long long groups = (n + 3) >> 2;
    const bool vec = aligned4(x, sizeof(T)) && aligned4(y, sizeof(T));
    FORGE_FOR(g, groups) {
        u32x4 c;
        c.x = (unsigned int)(g & 0xffffffffLL);
        c.y = (unsigned int)(g >> 32);
        c.z = 0u;
        c.w = 0u;
        const u32x4 r = philox4x32_10(c, k0, k1);
        const unsigned int words[4] = {r.x, r.y, r.z, r.w};
        if (vec && 4 * g + 3 < n) {
            const V4<T> a = reinterpret_cast<const V4<T>*>(x)[g];
            V4<T> o;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float u = (float)(words[j] >> 8) * 5.9604644775390625e-08f;  // 2^-24
                o.v[j] = To<T>::from(u >= p ? ldf(a.v[j]) * scale : A(0));
            }
            reinterpret_cast<V4<T>*>(y)[g] = o;
            continue;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long i = 4 * g + j;
            if (i < n) {
                const float u = (float)(words[j] >> 8) * 5.9604644775390625e-08f;  // 2^-24
                y[i] = To<T>::from(u >= p ? ldf(x[i]) * scale : A(0));
            }
        }
    }
}

// dropout_at: the same with the stream's seed read from device memory (a captured training
// step's, rewritten before each replay): seed = mix_seed(base, site) (common.cuh: forge_ml.rng.mix
// bit for bit). Every thread derives the key itself (a few integer ops).
#define FORGE_DROPOUT(T, S, A)                                                                \
    extern "C" __global__ void dropout_##S(const T* x, T* y, long long n, unsigned int k0,    \
                                           unsigned int k1, float p, A scale) {               \
        dropout_impl<T>(x, y, n, k0, k1, p, scale);                                           \
    }                                                                                         \
    extern "C" __global__ void dropout_at_##S(const T* x, T* y, long long n,                  \
                                              const unsigned long long* base,                 \
                                              unsigned long long site, float p, A scale) {    \
        const unsigned long long seed = mix_seed(*base, site);                                \
        dropout_impl<T>(x, y, n, (unsigned int)(seed & 0xffffffffULL),                        \
                        (unsigned int)(seed >> 32), p, scale);                                \
    }
FORGE_DROPOUT(float, f32, float)
FORGE_DROPOUT(double, f64, double)
FORGE_DROPOUT(bf16, bf16, float)
