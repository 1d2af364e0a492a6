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
        const G gv = g[i];
        P mi = m[i], vi = v[i], pi = p[i];
        adamw_step<P, G>(pi, mi, vi, gv, lr, b1, b2, eps, wd, bc1, bc2, gscale);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (has_lowp) p_lowp[i] = To<bf16>::from(pi);
    }
}

// adamw_update_at: the same step with lr, the bias corrections and grad_scale read from device
// memory, forge_ml.ops.STEP_SCALARS' layout (double s[6]: lr, bc1, bc2, grad_scale, norm, step),
// each rounded to P as the host rounds the scalars it passes to adamw_update; a non-finite
// grad_scale (clip_scale's verdict on a NaN norm or loss) skips the update entirely.
template <typename P, typename G>
__device__ void adamw_at_impl(P* p, const G* g, P* m, P* v, bf16* p_lowp, int has_lowp,
                              long long n, const double* s, P b1, P b2, P eps, P wd) {
    if (!isfinite(s[3])) return;
    adamw_impl<P, G>(p, g, m, v, p_lowp, has_lowp, n, P(s[0]), b1, b2, eps, wd, P(s[1]), P(s[2]),
                     P(s[3]));
}

#define FORGE_ADAMW(P, SP, G, SG)                                                              \
    extern "C" __global__ void adamw_update_##SP##_##SG(                                       \
        P* p, const G* g, P* m, P* v, bf16* p_lowp, int has_lowp, long long n, P lr, P b1,     \
        P b2, P eps, P wd, P bc1, P bc2, P gscale) {                                           \
        adamw_impl<P, G>(p, g, m, v, p_lowp, has_lowp, n, lr, b1, b2, eps, wd, bc1, bc2,       \
                         gscale);                                                              \
    }                                                                                          \
    extern "C" __global__ void adamw_update_at_##SP##_##SG(                                    \
        P* p, const G* g, P* m, P* v, bf16* p_lowp, int has_lowp, long long n, const double* s, \
        P b1, P b2, P eps, P wd) {                                                             \
        adamw_at_impl<P, G>(p, g, m, v, p_lowp, has_lowp, n, s, b1, b2, eps, wd);             \
    }
FORGE_ADAMW(float, f32, float, f32)
FORGE_ADAMW(float, f32, bf16, bf16)
FORGE_ADAMW(double, f64, double, f64)

// clip_scale: one thread turns the sum of the gradients' squares into the step's norm and
// factor, in double as forge_ml.optim.clip_grad_norm computes them on the host:
//   norm = |gs| sqrt(sumsq);  factor = gs min(1, max_norm / (norm + 1e-6))  (gs if max_norm <= 0)
// and NaN as the factor when the norm or the check value (the step's loss) is not finite.
template <typename T>
__device__ void clip_scale_impl(const T* sumsq, const T* check, int has_check, double* s,
                                double max_norm, double gs) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const double sq = (double)sumsq[0];
    const double norm = (isfinite(sq) && sq >= 0.0) ? fabs(gs) * sqrt(sq) : quiet_nan<double>();
    const bool ok = isfinite(norm) && (!has_check || isfinite((double)check[0]));
    double factor = gs;
    if (max_norm > 0.0) {
        const double r = max_norm / (norm + 1e-6);
        factor = gs * (r < 1.0 ? r : 1.0);
    }
    s[3] = ok ? factor : quiet_nan<double>();
    s[4] = norm;
}

#define FORGE_CLIP(T, S)                                                                       \
    extern "C" __global__ void clip_scale_##S(const T* sumsq, const T* check, int has_check,   \
                                              double* s, double max_norm, double gs) {         \
        clip_scale_impl<T>(sumsq, check, has_check, s, max_norm, gs);                          \
    }
FORGE_CLIP(float, f32)
FORGE_CLIP(double, f64)
