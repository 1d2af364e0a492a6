// attention.cu: the pieces of causal self-attention that are not matrix products (those go
// through cuBLAS): the probabilities rebuilt from the saved log-sum-exp in the backward, and
// the in-place KV-cache append of inference.
//   P_ij = exp(S_ij - lse_i) where j <= i + off, else 0   (S already scaled)
#include "common.cuh"

// attn_probs: each thread owns elements e, e + stride, ... of the (rows, Tk) score matrix.
template <typename TS, typename TO>
__device__ void attn_probs_impl(const TS* S, const typename Acc<TS>::type* lse, TO* P,
                                long long total, int Tq, int Tk, int off) {
    typedef typename Acc<TS>::type A;
    FORGE_FOR(e, total) {
        const long long row = e / Tk;
        const int j = (int)(e - row * Tk);
        const int i = (int)(row % Tq);
        const A p = (j <= i + off) ? fm_exp(ldf(S[e]) - lse[row]) : A(0);
        P[e] = To<TO>::from(p);
    }
}

#define FORGE_ATTN_PROBS(TS, SS, TO, SO, A)                                                   \
    extern "C" __global__ void attn_probs_##SS##_##SO(const TS* S, const A* lse, TO* P,      \
                                                      long long total, int Tq, int Tk,        \
                                                      int off) {                              \
        attn_probs_impl<TS, TO>(S, lse, P, total, Tq, Tk, off);                               \
    }
FORGE_ATTN_PROBS(float, f32, float, f32, float)
FORGE_ATTN_PROBS(double, f64, double, f64, double)
FORGE_ATTN_PROBS(float, f32, bf16, bf16, float)

// kv_append: each thread owns one element of `src` (lead, Tn, hs) and copies its bits to
// cache (lead, Tmax, hs) at row pos + t. W is a word of the element's size.
template <typename W>
__device__ void kv_append_impl(W* cache, const W* src, long long total, int Tn, int Tmax,
                               int hs, int pos) {
    FORGE_FOR(e, total) {
        const long long d = e % hs;
        const long long rt = e / hs;
        const long long t = rt % Tn;
        const long long b = rt / Tn;
        cache[(b * Tmax + pos + t) * hs + d] = src[e];
    }
}

#define FORGE_KV_APPEND(W, S)                                                                 \
    extern "C" __global__ void kv_append_##S(W* cache, const W* src, long long total, int Tn, \
                                             int Tmax, int hs, int pos) {                     \
        kv_append_impl<W>(cache, src, total, Tn, Tmax, hs, pos);                              \
    }
FORGE_KV_APPEND(unsigned short, b16)
FORGE_KV_APPEND(unsigned int, b32)
FORGE_KV_APPEND(unsigned long long, b64)
