// launched from backends/cuda/rows.py
// softmax.cu: softmax over the last axis with the optional causal mask, forward and backward.
//   causal: column j of row i (i = index along the second-to-last axis) is masked when
//   j > i + off; masked outputs are exact zeros.
//   backward: dx = y * (dy - sum_j y_j dy_j)
// The forward also serves attention: scores in float32 in, probabilities in the model dtype
// out, and the row's log-sum-exp kept for the backward.
#include "common.cuh"

// softmax_fwd: each warp owns one row of L columns (blockDim.x / 32 rows per block): one
// online (max, sum) pass over the unmasked columns, then one write pass.
template <typename TI, typename TO>
__device__ void softmax_fwd_impl(const TI* x, TO* y, typename Acc<TI>::type* lse, int want_lse,
                                 long long rows, int L, int R, int causal, int off) {
    typedef typename Acc<TI>::type A;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const TI* xr = x + row * L;
    TO* yr = y + row * L;
    int lim = L;
    if (causal) {
        const long long i = row % R;
        const long long last = i + off + 1;  // columns [0, last) are visible
        lim = last < 0 ? 0 : (last < L ? (int)last : L);
    }
    A m = neg_inf<A>(), s = A(0);
    for (int j = lane; j < lim; j += 32) ms_add(m, s, ldf(xr[j]));
    warp_ms(m, s);
    const A inv = (s > A(0)) ? A(1) / s : A(0);
    for (int j = lane; j < L; j += 32)
        yr[j] = To<TO>::from(j < lim ? fm_exp(ldf(xr[j]) - m) * inv : A(0));
    if (want_lse && lane == 0) lse[row] = (s > A(0)) ? m + fm_log(s) : neg_inf<A>();
}

// softmax_fwd_r: each warp owns one row of L <= 32 * NPL columns, held in registers (NPL per
// lane, lane + 32 k): one read of the row, exact max then sum, one write.
template <typename TI, typename TO, int NPL>
__device__ void softmax_fwd_reg_impl(const TI* x, TO* y, typename Acc<TI>::type* lse,
                                     int want_lse, long long rows, int L, int R, int causal,
                                     int off) {
    typedef typename Acc<TI>::type A;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const TI* xr = x + row * L;
    TO* yr = y + row * L;
    int lim = L;
    if (causal) {
        const long long i = row % R;
        const long long last = i + off + 1;
        lim = last < 0 ? 0 : (last < L ? (int)last : L);
    }
    A v[NPL];
    A m = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
        const int j = lane + 32 * k;
        v[k] = (j < lim) ? A(ldf(xr[j])) : neg_inf<A>();
        m = fm_max(m, v[k]);
    }
    m = warp_max(m);
    A s = A(0);
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
        const int j = lane + 32 * k;
        const A e = (j < lim && !(m == neg_inf<A>())) ? fm_exp(v[k] - m) : A(0);
        v[k] = e;
        s += e;
    }
    s = warp_sum(s);
    const A inv = (s > A(0)) ? A(1) / s : A(0);
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
        const int j = lane + 32 * k;
        if (j < L) yr[j] = To<TO>::from(v[k] * inv);
    }
    if (want_lse && lane == 0) lse[row] = (s > A(0)) ? m + fm_log(s) : neg_inf<A>();
}

// softmax_bwd: each warp owns one row: dx = y * (dy - sum(y * dy)).
template <typename TY, typename TD, typename TO>
__device__ void softmax_bwd_impl(const TY* y, const TD* dy, TO* dx, long long rows, int L) {
    typedef typename Acc<TD>::type A;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const TY* yr = y + row * L;
    const TD* dyr = dy + row * L;
    TO* dxr = dx + row * L;
    A dot = A(0);
    for (int j = lane; j < L; j += 32) dot += A(ldf(yr[j])) * A(ldf(dyr[j]));
    dot = warp_sum(dot);
    for (int j = lane; j < L; j += 32) {
        const A yj = A(ldf(yr[j]));
        dxr[j] = To<TO>::from(yj * (A(ldf(dyr[j])) - dot));
    }
}

#define FORGE_SOFTMAX_FWD(TI, SI, TO, SO, A)                                                 \
    extern "C" __global__ void softmax_fwd_##SI##_##SO(const TI* x, TO* y, A* lse,           \
                                                       int want_lse, long long rows, int L,   \
                                                       int R, int causal, int off) {          \
        softmax_fwd_impl<TI, TO>(x, y, lse, want_lse, rows, L, R, causal, off);               \
    }
#define FORGE_SOFTMAX_FWD_REG(TI, SI, TO, SO, A, NPL)                                         \
    extern "C" __global__ void softmax_fwd_r##NPL##_##SI##_##SO(                               \
        const TI* x, TO* y, A* lse, int want_lse, long long rows, int L, int R, int causal,    \
        int off) {                                                                             \
        softmax_fwd_reg_impl<TI, TO, NPL>(x, y, lse, want_lse, rows, L, R, causal, off);       \
    }
#define FORGE_SOFTMAX_FWD_ALL(TI, SI, TO, SO, A)   \
    FORGE_SOFTMAX_FWD(TI, SI, TO, SO, A)           \
    FORGE_SOFTMAX_FWD_REG(TI, SI, TO, SO, A, 8)    \
    FORGE_SOFTMAX_FWD_REG(TI, SI, TO, SO, A, 32)
FORGE_SOFTMAX_FWD_ALL(float, f32, float, f32, float)
FORGE_SOFTMAX_FWD_ALL(double, f64, double, f64, double)
FORGE_SOFTMAX_FWD_ALL(bf16, bf16, bf16, bf16, float)
FORGE_SOFTMAX_FWD_ALL(float, f32, bf16, bf16, float)

#define FORGE_SOFTMAX_BWD(TY, SY, TD, SD)                                                      \
    extern "C" __global__ void softmax_bwd_##SY##_##SD(const TY* y, const TD* dy, TY* dx,      \
                                                       long long rows, int L) {                 \
        softmax_bwd_impl<TY, TD, TY>(y, dy, dx, rows, L);                                       \
    }
FORGE_SOFTMAX_BWD(float, f32, float, f32)
FORGE_SOFTMAX_BWD(double, f64, double, f64)
FORGE_SOFTMAX_BWD(bf16, bf16, bf16, bf16)
FORGE_SOFTMAX_BWD(bf16, bf16, float, f32)
