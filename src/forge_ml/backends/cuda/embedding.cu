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

// scatter_add_rows over ids that arrive sorted (with `order`, the source row of each sorted
// position), in two kernels and without atomics, so the sums do not depend on scheduling:
// - scatter_add_pieces: block p owns the sorted positions [p R, p R + R) (a piece, R =
//   SCATTER_PIECE) and adds their src rows run by run (a run: equal ids), in sorted order, in
//   float32 (float64 for float64), its threads owning channels c, c + blockDim.x, ... A run
//   wholly inside the piece updates its dst row at once. A run that crosses an edge of the
//   piece leaves its part: the part at the piece's start in part[p][0], the part at its end
//   in part[p][1] (one run over the whole piece: part[p][0]).
// - scatter_add_spans: block p takes the run that crosses the end of piece p and starts in it,
//   adds its parts in piece order and updates its dst row once.
// A frequent token (a newline in a text batch: thousands of rows) spreads over many blocks
// instead of one block adding its rows one after another.
#define SCATTER_PIECE 32

template <typename T>
__device__ void scatter_add_pieces_impl(T* dst, const T* src, const long long* ids,
                                        const long long* order, typename Acc<T>::type* part,
                                        long long N, int C) {
    typedef typename Acc<T>::type A;
    __shared__ long long sid[SCATTER_PIECE + 2], sorder[SCATTER_PIECE];
    const long long p0 = (long long)blockIdx.x * SCATTER_PIECE;
    const int n = (int)min((long long)SCATTER_PIECE, N - p0);
    for (int k = threadIdx.x; k < n + 2; k += blockDim.x) {   // sid[k] = ids[p0 + k - 1]
        const long long q = p0 + k - 1;
        sid[k] = (q >= 0 && q < N) ? ids[q] : -1;
    }
    for (int k = threadIdx.x; k < n; k += blockDim.x) sorder[k] = order[p0 + k];
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        A acc = A(0);
        int first = 0;   // the current segment's first position in the piece
        for (int k0 = 0; k0 < n; k0 += 8) {
            A val[8];   // eight rows' loads in flight at once
#pragma unroll
            for (int j = 0; j < 8; ++j) val[j] = k0 + j < n ? A(ldf(src[sorder[k0 + j] * C + c])) : A(0);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int k = k0 + j;
                if (k >= n) break;
                acc += val[j];
                const long long id = sid[k + 1];
                if (k + 1 < n && sid[k + 2] == id) continue;
                const bool starts = sid[first] != id, ends = sid[k + 2] != id;   // in this piece
                if (starts && ends)
                    dst[id * C + c] = To<T>::from(ldf(dst[id * C + c]) + acc);
                else
                    part[((long long)blockIdx.x * 2 + (first == 0 ? 0 : 1)) * C + c] = acc;
                acc = A(0);
                first = k + 1;
            }
        }
    }
}

template <typename T>
__device__ void scatter_add_spans_impl(T* dst, const long long* ids,
                                       const typename Acc<T>::type* part, long long N, int C) {
    typedef typename Acc<T>::type A;
    const long long p = blockIdx.x, p0 = p * SCATTER_PIECE, p1 = p0 + SCATTER_PIECE;
    if (p1 >= N) return;
    const long long id = ids[p1 - 1];
    if (ids[p1] != id) return;                                  // no run crosses the end
    const bool whole = ids[p0] == id;                           // one run over the piece
    if (whole && p0 > 0 && ids[p0 - 1] == id) return;           // it started in an earlier piece
    long long lo = p1, hi = N;   // the run ends at hi: the first sorted position past it
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (ids[mid] == id) lo = mid + 1; else hi = mid;
    }
    const long long q_end = (hi + SCATTER_PIECE - 1) / SCATTER_PIECE;   // pieces it reaches
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        A acc = part[(p * 2 + (whole ? 0 : 1)) * C + c];
        for (long long q = p + 1; q < q_end; ++q) acc += part[q * 2 * C + c];
        dst[id * C + c] = To<T>::from(ldf(dst[id * C + c]) + acc);
    }
}

#define FORGE_SCATTER(T, S)                                                                  \
    extern "C" __global__ void scatter_add_pieces_##S(T* dst, const T* src,                  \
                                                      const long long* ids,                  \
                                                      const long long* order,                \
                                                      Acc<T>::type* part, long long N, int C) { \
        scatter_add_pieces_impl<T>(dst, src, ids, order, part, N, C);                        \
    }                                                                                        \
    extern "C" __global__ void scatter_add_spans_##S(T* dst, const long long* ids,           \
                                                     const Acc<T>::type* part, long long N,  \
                                                     int C) {                                \
        scatter_add_spans_impl<T>(dst, ids, part, N, C);                                     \
    }
FORGE_SCATTER(float, f32)
FORGE_SCATTER(double, f64)
FORGE_SCATTER(bf16, bf16)
