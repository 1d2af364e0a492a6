// launched from backends/cuda/rows.py and classifier.py (cross_entropy_fused_*)
// cross_entropy.cu: softmax + negative log-likelihood, fused (no probabilities kept).
//   loss_r = logsumexp(l_r[:V]) - l_r[target_r]            (mean over rows taken in reduce.cu)
//   dl_r   = dloss / N * (softmax(l_r[:V]) - onehot(target_r)),  0 in columns >= V
// cross_entropy_fused_* does both in one pass over a row and writes dl_r (for dloss = 1) over
// the row's logits: the LM head's loss over a chunk of rows (classifier.py); the _rows_ kernels
// hold a bf16 row in registers.
// Rows have Vp >= V columns (a padded vocabulary); columns >= V are ignored.
#include "common.cuh"

// The row's (max, sum of exp) over its first V columns, by the whole block.
template <typename T, typename A>
__device__ __forceinline__ void row_ms(const T* lr, int V, A& m, A& s, A* shm, A* shs) {
    m = neg_inf<A>();
    s = A(0);
    for (int j = threadIdx.x; j < V; j += blockDim.x) ms_add(m, s, A(ldf(lr[j])));
    block_ms(m, s, shm, shs);
}

// cross_entropy_fwd: each block owns one row of logits and writes that row's loss (float32,
// float64 for float64 logits). A target outside [0, V) gives NaN.
template <typename T, typename I>
__device__ void cross_entropy_fwd_impl(const T* logits, const I* targets,
                                       typename Acc<T>::type* loss, int Vp, int V) {
    typedef typename Acc<T>::type A;
    __shared__ A shm[32], shs[32];
    const long long row = blockIdx.x;
    const T* lr = logits + row * Vp;
    A m, s;
    row_ms(lr, V, m, s, shm, shs);
    if (threadIdx.x == 0) {
        const long long t = (long long)targets[row];
        loss[row] = (t >= 0 && t < V) ? m + fm_log(s) - A(ldf(lr[t])) : quiet_nan<A>();
    }
}

// A row's gradient: dr[j] = scale * (softmax(lr)[j] - [j == t]) for j < V, 0 in the padding,
// from the row's max m and 1 / sum inv_s (the backward's, and the fused kernel's over the
// logits themselves: dr may be lr, each element read before its thread writes it).
template <typename T>
__device__ void ce_grad_row(const T* lr, T* dr, int Vp, int V, typename Acc<T>::type m,
                            typename Acc<T>::type inv_s, long long t,
                            typename Acc<T>::type scale) {
    typedef typename Acc<T>::type A;
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
        A d = A(0);
        if (j < V) {
            const A p = fm_exp(A(ldf(lr[j])) - m) * inv_s;
            d = scale * (p - (j == t ? A(1) : A(0)));
        }
        dr[j] = To<T>::from(d);
    }
}

// cross_entropy_bwd: each block owns one row: recomputes (max, sum), then writes the row of
// dlogits. `dloss` points to the upstream gradient of the mean loss (one element).
template <typename T, typename I>
__device__ void cross_entropy_bwd_impl(const T* logits, const I* targets, T* dlogits,
                                       const typename Acc<T>::type* dloss, int Vp, int V,
                                       typename Acc<T>::type inv_n) {
    typedef typename Acc<T>::type A;
    __shared__ A shm[32], shs[32];
    const long long row = blockIdx.x;
    const T* lr = logits + row * Vp;
    T* dr = dlogits + row * Vp;
    A m, s;
    row_ms(lr, V, m, s, shm, shs);
    ce_grad_row(lr, dr, Vp, V, m, A(1) / s, (long long)targets[row], dloss[0] * inv_n);
}

// cross_entropy_fused: each block owns one row: (max, sum) once, the row's loss, then the row
// overwritten with inv_n * (softmax - onehot). Thread 0 reads l[target] before the barrier
// that comes ahead of any write to the row.
template <typename T, typename I>
__device__ void cross_entropy_fused_impl(T* logits, const I* targets, typename Acc<T>::type* loss,
                                         int Vp, int V, typename Acc<T>::type inv_n) {
    typedef typename Acc<T>::type A;
    __shared__ A shm[32], shs[32];
    const long long row = blockIdx.x;
    T* lr = logits + row * Vp;
    A m, s;
    row_ms(lr, V, m, s, shm, shs);
    const long long t = (long long)targets[row];
    if (threadIdx.x == 0)
        loss[row] = (t >= 0 && t < V) ? m + fm_log(s) - A(ldf(lr[t])) : quiet_nan<A>();
    __syncthreads();
    ce_grad_row(lr, lr, Vp, V, m, A(1) / s, t, inv_n);
}

// cross_entropy_fused_rows (bf16, Vp a multiple of 8 and at most CE_ROW_VECS * 8 * 1024): the
// same result with the row held in registers, 16-byte vectors of 8 logits, so the row is read
// from memory once and written once (the kernel above reads it twice). 1024 threads per row:
// the row's max, then the sum of exp(l - max) over its first V columns, each a block reduction.
#define CE_ROW_THREADS 1024
#define CE_ROW_VECS 8

template <typename I>
__device__ void cross_entropy_fused_rows_impl(bf16* logits, const I* targets, float* loss, int Vp,
                                              int V, float inv_n) {
    __shared__ float sh[32];
    const long long row = blockIdx.x;
    bf16* lr = logits + row * Vp;
    uint4* lv = reinterpret_cast<uint4*>(lr);
    const int nv = Vp >> 3;
    uint4 r[CE_ROW_VECS];
    float m = neg_inf<float>();
#pragma unroll
    for (int k = 0; k < CE_ROW_VECS; ++k) {
        const int v = threadIdx.x + k * CE_ROW_THREADS;
        if (v < nv) {
            r[k] = lv[v];
            float w[8];
            Vec16<bf16>::widen(r[k], w);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (v * 8 + j < V) m = fmaxf(m, w[j]);
        }
    }
    m = block_max(m, sh);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < CE_ROW_VECS; ++k) {
        const int v = threadIdx.x + k * CE_ROW_THREADS;
        if (v < nv) {
            float w[8];
            Vec16<bf16>::widen(r[k], w);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (v * 8 + j < V) s += fm_exp(w[j] - m);
        }
    }
    s = block_sum(s, sh);
    const long long t = (long long)targets[row];
    if (threadIdx.x == 0)
        loss[row] = (t >= 0 && t < V) ? m + fm_log(s) - ldf(lr[t]) : quiet_nan<float>();
    __syncthreads();   // l[target] is read before any thread writes the row
    const float inv_s = 1.f / s;
#pragma unroll
    for (int k = 0; k < CE_ROW_VECS; ++k) {
        const int v = threadIdx.x + k * CE_ROW_THREADS;
        if (v < nv) {
            float w[8];
            Vec16<bf16>::widen(r[k], w);
            unsigned u[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float d[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = v * 8 + 2 * i + h;
                    d[h] = col < V ? inv_n * (fm_exp(w[2 * i + h] - m) * inv_s - (col == t ? 1.f : 0.f))
                                   : 0.f;
                }
                u[i] = (unsigned)f32_to_bf16(d[0]).bits | ((unsigned)f32_to_bf16(d[1]).bits << 16);
            }
            lv[v] = make_uint4(u[0], u[1], u[2], u[3]);
        }
    }
}

#define FORGE_CE_ROWS(I, SI)                                                                   \
    extern "C" __global__ void __launch_bounds__(CE_ROW_THREADS)                               \
        cross_entropy_fused_rows_bf16_##SI(bf16* logits, const I* targets, float* loss, int Vp, \
                                           int V, float inv_n) {                               \
        cross_entropy_fused_rows_impl<I>(logits, targets, loss, Vp, V, inv_n);                 \
    }
FORGE_CE_ROWS(int, i32)
FORGE_CE_ROWS(long long, i64)

// cross_entropy_fused_stream (bf16, sm_80+, Vp a multiple of 8; 2 * Vp * 2 bytes of dynamic
// shared memory: two rows): the same result as the _rows_ kernel, from persistent blocks of
// CE_STREAM_THREADS threads that own rows blockIdx.x, blockIdx.x + gridDim.x, ... While a block
// works on one row in shared memory, the next row's logits are on their way in (cp.async into
// the other buffer). The work a logit costs is kept small, since at GPT-2's vocabulary the
// instructions, not the bytes, bound the _rows_ kernel: exponentials as ex2.approx of a scaled
// argument (one FFMA and one MUFU op), the 1 / sum and 1 / N folded into that argument, the
// target column and the padding (columns >= V) handled in their own vectors only, two values
// rounded to bf16 by one cvt. Each thread takes its max over its logits, then its sum; the
// block merges the (max, sum) pairs once. A NaN logit among the first V makes the loss NaN.
#define CE_STREAM_THREADS 1024

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
FORGE_D float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The gradient of 8 logits from column 8v: ex2(w log2e - k), less inv_n at column t, 0 at
// columns >= V; `edge`: the vector holds the target or padding.
FORGE_D uint4 ce_grad8(uint4 raw, int v, int V, long long t, float k, float inv_n, bool edge) {
    float w[8];
    Vec16<bf16>::widen(raw, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = ex2(fmaf(w[j], FORGE_LOG2E, -k));
    if (edge) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = v * 8 + j;
            w[j] = col >= V ? 0.f : (col == t ? w[j] - inv_n : w[j]);
        }
    }
    return pack8_bf16(w);
}

template <typename I>
__device__ void cross_entropy_fused_stream_impl(bf16* logits, const I* targets, float* loss,
                                                long long n_rows, int Vp, int V, float inv_n) {
    extern __shared__ uint4 ce_rows[];   // [2][Vp / 8]
    __shared__ float shm[32], shs[32];
    const int nv = Vp >> 3, full = V >> 3;   // vectors; vectors with no padding column
    long long row = blockIdx.x;
    auto load = [&](long long r, int buf) {
        const uint4* src = reinterpret_cast<const uint4*>(logits + r * Vp);
        uint4* dst = ce_rows + buf * nv;
        for (int v = threadIdx.x; v < nv; v += blockDim.x) cp_async16(smem_u32(dst + v), src + v, true);
        cp_async_commit();
    };
    if (row < n_rows) load(row, 0);
    for (int it = 0; row < n_rows; row += gridDim.x, ++it) {
        const int buf = it & 1;
        if (row + gridDim.x < n_rows) {   // the buffer it fills was last read before the
            load(row + gridDim.x, buf ^ 1);   // barrier that ended the previous row
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint4* rv = ce_rows + buf * nv;
        float m = neg_inf<float>(), w[8];
        for (int v = threadIdx.x; v < nv; v += blockDim.x) {
            Vec16<bf16>::widen(rv[v], w);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (v < full || v * 8 + j < V) m = fmaxf(m, w[j]);
        }
        const float mk = m == neg_inf<float>() ? 0.f : m * FORGE_LOG2E;   // -inf logits give 0
        float s = 0.f;
        for (int v = threadIdx.x; v < nv; v += blockDim.x) {
            Vec16<bf16>::widen(rv[v], w);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (v < full || v * 8 + j < V) s += ex2(fmaf(w[j], FORGE_LOG2E, -mk));   // NaN stays
        }
        if (s != s) m = 0.f;   // a thread whose logits are all NaN: merging keeps its NaN sum
        block_ms(m, s, shm, shs);
        const long long t = (long long)targets[row];
        const bool t_ok = t >= 0 && t < V;
        if (threadIdx.x == 0)
            loss[row] = t_ok ? m + fm_log(s) - bf16_to_f32(reinterpret_cast<const bf16*>(rv)[t])
                             : quiet_nan<float>();
        // inv_n exp(l - m) / s = ex2(l log2e - k)
        const float k = m * FORGE_LOG2E + __log2f(s) - __log2f(inv_n);
        const long long tv = t_ok ? t >> 3 : -1;
        uint4* out = reinterpret_cast<uint4*>(logits + row * Vp);
        for (int v = threadIdx.x; v < nv; v += blockDim.x)
            out[v] = ce_grad8(rv[v], v, V, t, k, inv_n, v >= full || v == tv);
        __syncthreads();   // every thread is done with this buffer before it is refilled
    }
}

#define FORGE_CE_STREAM(I, SI)                                                                 \
    extern "C" __global__ void __launch_bounds__(CE_STREAM_THREADS)                            \
        cross_entropy_fused_stream_bf16_##SI(bf16* logits, const I* targets, float* loss,      \
                                             long long n_rows, int Vp, int V, float inv_n) {   \
        cross_entropy_fused_stream_impl<I>(logits, targets, loss, n_rows, Vp, V, inv_n);       \
    }
FORGE_CE_STREAM(int, i32)
FORGE_CE_STREAM(long long, i64)
#endif

#define FORGE_CE(T, S, I, SI, A)                                                              \
    extern "C" __global__ void cross_entropy_fwd_##S##_##SI(const T* logits, const I* targets, \
                                                            A* loss, int Vp, int V) {          \
        cross_entropy_fwd_impl<T, I>(logits, targets, loss, Vp, V);                            \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_bwd_##S##_##SI(const T* logits, const I* targets, \
                                                            T* dlogits, const A* dloss,        \
                                                            int Vp, int V, A inv_n) {          \
        cross_entropy_bwd_impl<T, I>(logits, targets, dlogits, dloss, Vp, V, inv_n);           \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_fused_##S##_##SI(T* logits, const I* targets,     \
                                                              A* loss, int Vp, int V, A inv_n) { \
        cross_entropy_fused_impl<T, I>(logits, targets, loss, Vp, V, inv_n);                   \
    }
FORGE_CE(float, f32, int, i32, float)
FORGE_CE(float, f32, long long, i64, float)
FORGE_CE(double, f64, int, i32, double)
FORGE_CE(double, f64, long long, i64, double)
FORGE_CE(bf16, bf16, int, i32, float)
FORGE_CE(bf16, bf16, long long, i64, float)
