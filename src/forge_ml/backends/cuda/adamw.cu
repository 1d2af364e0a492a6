// launched from backends/cuda/pointwise.py
// adamw.cu: one fused AdamW step (Loshchilov & Hutter, "Decoupled weight decay
// regularization", 2019; PyTorch's AdamW order of operations):
//   g = grad_scale * g
//   m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//   p = p - lr * wd * p                                   (decoupled weight decay)
//   p = p - lr * (m / bc1) / (sqrt(v / bc2) + eps)       bc1 = 1 - b1^step, bc2 = 1 - b2^step
// Master weights and moments are float32 (float64 in gradient checks); g may be bf16; the
// updated p may also be written, rounded to bf16, into the model's low-precision copy.
#include "common.cuh"

// adamw_update: each thread owns elements i, i + stride, ... of the parameter (grid-stride).
template <typename P, typename G>
__device__ void adamw_impl(P* p, const G* g, P* m, P* v, bf16* p_lowp, int has_lowp,
                           long long n, P lr, P b1, P b2, P eps, P wd, P bc1, P bc2, P gscale) {
    FORGE_FOR(i, n) {
        const P gi = P(ldf(g[i])) * gscale;
        const P mi = b1 * m[i] + (P(1) - b1) * gi;
        const P vi = b2 * v[i] + (P(1) - b2) * gi * gi;
        P pi = p[i];
        pi = pi - lr * wd * pi;
        pi = pi - lr * (mi / bc1) / (fm_sqrt(vi / bc2) + eps);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (has_lowp) p_lowp[i] = To<bf16>::from(pi);
    }
}

#define FORGE_ADAMW(P, SP, G, SG)                                                              \
    extern "C" __global__ void adamw_update_##SP##_##SG(                                       \
        P* p, const G* g, P* m, P* v, bf16* p_lowp, int has_lowp, long long n, P lr, P b1,     \
        P b2, P eps, P wd, P bc1, P bc2, P gscale) {                                           \
        adamw_impl<P, G>(p, g, m, v, p_lowp, has_lowp, n, lr, b1, b2, eps, wd, bc1, bc2,       \
                         gscale);                                                              \
    }
FORGE_ADAMW(float, f32, float, f32)
FORGE_ADAMW(float, f32, bf16, bf16)
FORGE_ADAMW(double, f64, double, f64)
