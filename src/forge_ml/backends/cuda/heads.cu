// launched from backends/cuda/layout.py
// heads.cu: the head permutations of multi-head attention, as bit copies (W is a word of the
// element's size, so one kernel serves every dtype). Shapes, with B = product of leading dims:
//   split_heads:   qkv (B, T, 3C) -> q, k, v (B, H, T, hs)      C = H * hs
//   unsplit_head:  dy (B, H, T, hs) -> (B, T, 3C), zeros outside third `which`
//   merge_heads:   x (B, H, T, hs) -> (B, T, C)
//   unmerge_heads: dy (B, T, C) -> (B, H, T, hs)
#include "common.cuh"

// split_heads: each thread owns one element of qkv (read coalesced) and writes it to q, k or v.
template <typename W>
__device__ void split_heads_impl(const W* qkv, W* q, W* k, W* v, long long total, int T, int H,
                                 int hs) {
    const int C = H * hs;
    FORGE_FOR(e, total) {
        const int c3 = (int)(e % (3 * C));
        const long long bt = e / (3 * C);
        const int t = (int)(bt % T);
        const long long b = bt / T;
        const int which = c3 / C, c = c3 - which * C;
        const int h = c / hs, d = c - h * hs;
        W* dst = which == 0 ? q : (which == 1 ? k : v);
        dst[((b * H + h) * T + t) * hs + d] = qkv[e];
    }
}

// unsplit_head: each thread owns one element of the (B, T, 3C) output.
template <typename W>
__device__ void unsplit_head_impl(const W* dy, W* out, long long total, int T, int H, int hs,
                                  int which) {
    const int C = H * hs;
    FORGE_FOR(e, total) {
        const int c3 = (int)(e % (3 * C));
        const long long bt = e / (3 * C);
        W val = W(0);
        if (c3 / C == which) {
            const int t = (int)(bt % T);
            const long long b = bt / T;
            const int c = c3 - which * C;
            const int h = c / hs, d = c - h * hs;
            val = dy[((b * H + h) * T + t) * hs + d];
        }
        out[e] = val;
    }
}

// merge_heads: each thread owns one element of the (B, T, C) output.
template <typename W>
__device__ void merge_heads_impl(const W* x, W* out, long long total, int T, int H, int hs) {
    const int C = H * hs;
    FORGE_FOR(e, total) {
        const int c = (int)(e % C);
        const long long bt = e / C;
        const int t = (int)(bt % T);
        const long long b = bt / T;
        const int h = c / hs, d = c - h * hs;
        out[e] = x[((b * H + h) * T + t) * hs + d];
    }
}

// unmerge_heads: each thread owns one element of the (B, H, T, hs) output.
template <typename W>
__device__ void unmerge_heads_impl(const W* dy, W* out, long long total, int T, int H, int hs) {
    const int C = H * hs;
    FORGE_FOR(e, total) {
        const int d = (int)(e % hs);
        const long long r = e / hs;
        const int t = (int)(r % T);
        const long long bh = r / T;
        const int h = (int)(bh % H);
        const long long b = bh / H;
        out[e] = dy[(b * T + t) * C + h * hs + d];
    }
}

#define FORGE_HEADS(W, S)                                                                      \
    extern "C" __global__ void split_heads_##S(const W* qkv, W* q, W* k, W* v, long long total, \
                                               int T, int H, int hs) {                         \
        split_heads_impl<W>(qkv, q, k, v, total, T, H, hs);                                    \
    }                                                                                          \
    extern "C" __global__ void unsplit_head_##S(const W* dy, W* out, long long total, int T,   \
                                                int H, int hs, int which) {                    \
        unsplit_head_impl<W>(dy, out, total, T, H, hs, which);                                 \
    }                                                                                          \
    extern "C" __global__ void merge_heads_##S(const W* x, W* out, long long total, int T,     \
                                               int H, int hs) {                                \
        merge_heads_impl<W>(x, out, total, T, H, hs);                                          \
    }                                                                                          \
    extern "C" __global__ void unmerge_heads_##S(const W* dy, W* out, long long total, int T,  \
                                                 int H, int hs) {                              \
        unmerge_heads_impl<W>(dy, out, total, T, H, hs);                                       \
    }
FORGE_HEADS(unsigned short, b16)
FORGE_HEADS(unsigned int, b32)
FORGE_HEADS(unsigned long long, b64)
