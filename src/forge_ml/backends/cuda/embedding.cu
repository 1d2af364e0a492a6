// launched from backends/cuda/layout.py
// embedding.cu: token + position embedding forward, and its backward for the token table,
// scatter_add_rows (dst[ids[i]] += src[i], repeats add).
#include "common.cuh"

// embedding_fwd: each thread owns one output element (token n, channel c):
// out[n, c] = wte[ids[n], c] + wpe[pos + n % T, c].
template <typename T, typename I>
__device__ void embedding_fwd_impl(const I* ids, const T* wte, const T* wpe, T* out,
                                   long long total, int T_, int C, int pos) {
    typedef typename Acc<T>::type A;
    FORGE_FOR(e, total) {
        const long long n = e / C;
        const int c = (int)(e - n * C);
        const long long id = (long long)ids[n];
        const long long t = pos + n % T_;
        out[e] = To<T>::from(ldf(wte[id * C + c]) + ldf(wpe[t * C + c]));
    }
}

#define FORGE_EMBEDDING(T, S, I, SI)                                                          \
    extern "C" __global__ void embedding_fwd_##S##_##SI(const I* ids, const T* wte,           \
                                                        const T* wpe, T* out, long long total, \
                                                        int T_, int C, int pos) {              \
        embedding_fwd_impl<T, I>(ids, wte, wpe, out, total, T_, C, pos);                       \
    }
FORGE_EMBEDDING(float, f32, int, i32)
FORGE_EMBEDDING(float, f32, long long, i64)
FORGE_EMBEDDING(double, f64, int, i32)
FORGE_EMBEDDING(double, f64, long long, i64)
FORGE_EMBEDDING(bf16, bf16, int, i32)
FORGE_EMBEDDING(bf16, bf16, long long, i64)

// embedding_at_fwd: embedding_fwd with the position read from device memory (*pos_p), so a
// captured CUDA graph replays at every position; if any of the positions pos..pos+T-1 is
// outside the wpe table (n_pos rows), every output is NaN.
// npos: 1 (one position for every row) or the number of rows (row r = token n / T_ at
// pos_p[r]: continuous batching); a row whose positions leave the table is NaN alone.
template <typename T, typename I>
__device__ void embedding_at_fwd_impl(const I* ids, const T* wte, const T* wpe, T* out,
                                      long long total, int T_, int C, const int* pos_p,
                                      int n_pos, int npos) {
    typedef typename Acc<T>::type A;
    FORGE_FOR(e, total) {
        const long long n = e / C;
        const int c = (int)(e - n * C);
        const int pos = pos_p[npos == 1 ? 0 : n / T_];
        const bool bad = pos < 0 || (long long)pos + T_ > n_pos;
        const long long id = (long long)ids[n];
        const long long t = pos + n % T_;
        out[e] = bad ? To<T>::from(quiet_nan<A>())
                     : To<T>::from(ldf(wte[id * C + c]) + ldf(wpe[t * C + c]));
    }
}

#define FORGE_EMBEDDING_AT(T, S, I, SI)                                                        \
    extern "C" __global__ void embedding_at_fwd_##S##_##SI(const I* ids, const T* wte,         \
                                                           const T* wpe, T* out,               \
                                                           long long total, int T_, int C,     \
                                                           const int* pos, int n_pos,          \
                                                           int npos) {                         \
        embedding_at_fwd_impl<T, I>(ids, wte, wpe, out, total, T_, C, pos, n_pos, npos);       \
    }
FORGE_EMBEDDING_AT(float, f32, int, i32)
FORGE_EMBEDDING_AT(float, f32, long long, i64)
FORGE_EMBEDDING_AT(double, f64, int, i32)
FORGE_EMBEDDING_AT(double, f64, long long, i64)
FORGE_EMBEDDING_AT(bf16, bf16, int, i32)
FORGE_EMBEDDING_AT(bf16, bf16, long long, i64)

// scatter_add_sorted: the ids arrive sorted (with `order`, the source row of each sorted
// position). Each block owns one run of equal ids, the block whose index is the run's first
// position (the others return at once); its threads own channels c, c + blockDim.x, ... and
// add the run's src rows in sorted order in float32, then update the dst row once. No atomics:
// the result does not depend on scheduling.
template <typename T>
__device__ void scatter_add_sorted_impl(T* dst, const T* src, const long long* sorted_ids,
                                        const long long* order, long long N, int C) {
    typedef typename Acc<T>::type A;
    const long long start = blockIdx.x;
    if (start >= N) return;
    const long long id = sorted_ids[start];
    if (start > 0 && sorted_ids[start - 1] == id) return;
    long long end = start + 1;
    while (end < N && sorted_ids[end] == id) ++end;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        A acc = A(0);
        for (long long k = start; k < end; ++k) acc += ldf(src[order[k] * C + c]);
        dst[id * C + c] = To<T>::from(ldf(dst[id * C + c]) + acc);
    }
}

#define FORGE_SCATTER(T, S)                                                                  \
    extern "C" __global__ void scatter_add_sorted_##S(T* dst, const T* src,                  \
                                                      const long long* sorted_ids,           \
                                                      const long long* order, long long N,   \
                                                      int C) {                               \
        scatter_add_sorted_impl<T>(dst, src, sorted_ids, order, N, C);                       \
    }
FORGE_SCATTER(float, f32)
FORGE_SCATTER(double, f64)
FORGE_SCATTER(bf16, bf16)
