// launched from backends/cuda/attention.py
// attention.cu: the pieces of causal self-attention that are not matrix products (those go
// through cuBLAS): the probabilities rebuilt from the saved log-sum-exp in the backward, the
// in-place KV-cache append of inference, and the fused one-token decoding step.
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

// decode_attention: one decoding step, one new token per row. The keys 0..pos of head h of
// row b are split among P blocks (grid (H * P, B); on Hopper a cluster of P blocks, P > 1 for
// long caches), block p taking keys [p * ch, (p + 1) * ch), ch = ceil((pos + 1) / P). Every
// block writes the token's key and value (from the fused qkv row, GPT-2's c_attn output
// (B, 3C)) into the caches (B, H, Tmax, hs) at row pos (the same values; each block reads back
// only its own writes), then computes, in float32 (double for double), over its keys
//   m_p = max_j s_j,  l_p = sum_j exp(s_j - m_p),  o_p[d] = sum_j exp(s_j - m_p) v_j[d],
// with s_j = scale * q . k_j, in one pass: the R = hs / V lanes of a key group (V channels
// each, a 16-byte load) read key row j and value row j together, so a warp's load covers
// 32 / R whole rows, four rows a group in flight; the partial dot products are summed by a
// butterfly over the R lanes (the same order every run), and each group keeps its own running
// max, sum and outputs (online softmax: rescaled when its max grows). Groups take keys
// g, g + G, ...; then they meet in shared memory, added in group order. (Before, 2026-12-04:
// the scores, then the values, in two passes: at batch 64, position 1,000, 80.5 -> 57.9 us.)
// Heads of more than 32 16-byte chunks take two passes with a thread per key row; heads whose
// rows are not 16-byte multiples (or unaligned caches) go one element at a time. Then the
// blocks of the cluster meet (distributed shared memory): block p writes channels
// [p * hs / P, (p + 1) * hs / P) of
//   y[b, h*hs + d] = sum_p exp(m_p - M) o_p[d] / sum_p exp(m_p - M) l_p,  M = max_p m_p,
// adding the blocks' terms in block order (the same bits on every run).
// Launched with programmatic dependent launch where the GPU has it: the next kernel (a gemv)
// loads its weights while this one runs.
// pos is read from device memory, so a CUDA graph captured once replays at every position:
// one element for every row, or one per row (npos = B: rows at their own positions); a pos
// outside 0..Tmax-1 writes nothing and makes that row's outputs NaN.
#define DECODE_MAX_GROUPS 256  // key groups a block of the one-pass path may have
#define DECODE_PREFETCH_ROWS 64  // key and value rows of a block asked of L2 before pdl_wait
#ifndef DECODE_ROWS_IN_FLIGHT
#define DECODE_ROWS_IN_FLIGHT 4  // key and value rows a group of the one-pass path loads at once
#endif

template <typename T>
__device__ void decode_attention_impl(const T* qkv, T* kc, T* vc, const int* pos_p, T* y,
                                      int H, int Tmax, int hs, typename Acc<T>::type scale,
                                      int P, int npos) {
    typedef typename Acc<T>::type A;
    extern __shared__ unsigned char smem_raw[];
    const int ch_max = (Tmax + P - 1) / P;
    A* q = reinterpret_cast<A*>(smem_raw);  // hs
    A* o = q + hs;                           // hs: this block's o_p
    A* s = o + hs;                           // ch_max scores, then exp(s - m_p)
    A* part = s + ch_max;                    // blockDim.x * Vec16<T>::N partial outputs
    __shared__ A red[32];
    __shared__ A ml[2];                      // m_p, l_p
    const int h = blockIdx.x / P, p = blockIdx.x % P, b = blockIdx.y, C = H * hs, t = threadIdx.x;
    {   // Before waiting for the previous kernel: ask L2 for the first DECODE_PREFETCH_ROWS
        // key and value rows of this block's split, so that DRAM works under that kernel's
        // tail. Only a hint: pos is read without waiting (a stale value prefetches other
        // lines), nothing read here is used, and L2 is where every SM's writes meet.
        const int hint = min(max(pos_p[npos == 1 ? 0 : b], 0), Tmax - 1) + 1;
        const int hch = (hint + P - 1) / P, hj0 = p * hch;
        const int hcnt = max(0, min(hint, hj0 + hch) - hj0);
        const long long hbase = ((long long)b * H + h) * Tmax * hs + (long long)hj0 * hs;
        const int lines = (hs * (int)sizeof(T) + 127) / 128;   // 128-byte lines a row
        const int n = min(hcnt, DECODE_PREFETCH_ROWS) * lines;
        for (int i = t; i < n; i += blockDim.x) {
            const long long at = hbase + (long long)(i / lines) * hs;
            const int ln = (i % lines) * (128 / (int)sizeof(T));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + at + ln));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + at + ln));
        }
    }
    pdl_wait();  // everything below comes from earlier kernels (common.cuh)
    pdl_launch_dependents();
    const int pos = pos_p[npos == 1 ? 0 : b];  // one position, or one per row
    T* yr = y + (long long)b * C + (long long)h * hs;
    if (pos < 0 || pos >= Tmax) {  // the same for every block of the cluster: all leave
        if (p == 0)
            for (int d = t; d < hs; d += blockDim.x) yr[d] = To<T>::from(quiet_nan<A>());
        return;
    }
    const T* row = qkv + (long long)b * 3 * C + (long long)h * hs;
    const long long base = ((long long)b * H + h) * Tmax * hs;
    for (int d = t; d < hs; d += blockDim.x) {
        q[d] = ldf(row[d]) * scale;
        kc[base + (long long)pos * hs + d] = row[C + d];
        vc[base + (long long)pos * hs + d] = row[2 * C + d];
    }
    __syncthreads();  // the new key row is read back below (global writes, same block)
    const int lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5, n = pos + 1;
    const int ch = (n + P - 1) / P, j0 = p * ch, cnt = max(0, min(n, j0 + ch) - j0);
    constexpr int V = Vec16<T>::N;
    const bool vec = hs % V == 0 && hs / V <= (int)blockDim.x &&
                     (((unsigned long long)kc | (unsigned long long)vc) & 15ull) == 0;
    const T* kb = kc + base + (long long)j0 * hs;
    const T* vb = vc + base + (long long)j0 * hs;
    const int RK = hs / V;  // lanes reading one key row together (16-byte loads each)
    A m, l;                 // this block's m_p and l_p; o[d] its o_p
    if (vec && RK <= 32 && (RK & (RK - 1)) == 0 && nw * (32 / RK) <= DECODE_MAX_GROUPS) {
        // One pass: group g (RK lanes) reads key row j and value row j together, U rows in
        // flight, scores summed by a butterfly over the RK lanes, and keeps its own running
        // max mg, sum lg and outputs acc (its V channels), rescaled when mg grows (online
        // softmax). Then the groups meet in group order.
        constexpr int U = DECODE_ROWS_IN_FLIGHT;
        __shared__ A gml[2][DECODE_MAX_GROUPS];
        const int gpw = 32 / RK, G1 = nw * gpw, g = warp * gpw + lane / RK, r = lane % RK;
        A qr[V], acc[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            qr[i] = q[r * V + i];
            acc[i] = A(0);
        }
        A mg = neg_inf<A>(), lg = A(0);
        for (int jb = 0; jb < cnt; jb += U * G1) {  // uniform over the warp: shuffles are safe
            uint4 kr[U], vr[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = jb + u * G1 + g;
                kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
                if (j < cnt) {
                    kr[u] = Vec16<T>::raw(kb + (long long)j * hs + r * V);
                    vr[u] = Vec16<T>::raw(vb + (long long)j * hs + r * V);
                }
            }
            decode_keys_round<T, A, U, false>(kr, vr, jb + g, G1, cnt, RK, qr, mg, lg, acc);
        }
        if (r == 0) {
            gml[0][g] = mg;
            gml[1][g] = lg;
        }
        __syncthreads();
        m = neg_inf<A>();
        for (int k = 0; k < G1; ++k) m = fm_max(m, gml[0][k]);
        const A f = (mg == neg_inf<A>()) ? A(0) : fm_exp(mg - m);
#pragma unroll
        for (int i = 0; i < V; ++i) part[g * hs + r * V + i] = acc[i] * f;
        l = A(0);
        for (int k = 0; k < G1; ++k) {
            const A mk = gml[0][k];
            l += (mk == neg_inf<A>()) ? A(0) : gml[1][k] * fm_exp(mk - m);
        }
        __syncthreads();
        for (int d = t; d < hs; d += blockDim.x) {
            A a = A(0);
            for (int k = 0; k < G1; ++k) a += part[k * hs + d];
            o[d] = a;
        }
    } else {  // two passes: the scores (a thread per key row), then the values
        for (int j = t; j < cnt; j += blockDim.x) {  // a thread per key row
            const T* kr = kb + (long long)j * hs;
            A acc = A(0);
            if (vec) {
#pragma unroll 16
                for (int d0 = 0; d0 < hs; d0 += V) {
                    A w[V];
                    Vec16<T>::load(kr + d0, w);
#pragma unroll
                    for (int i = 0; i < V; ++i) acc += q[d0 + i] * w[i];
                }
            } else {
                for (int d = 0; d < hs; ++d) acc += q[d] * ldf(kr[d]);
            }
            s[j] = acc;
        }
        __syncthreads();
        m = neg_inf<A>();
        for (int j = t; j < cnt; j += blockDim.x) m = fm_max(m, s[j]);
        m = warp_max(m);
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = red[0];
        for (int w = 1; w < nw; ++w) m = fm_max(m, red[w]);
        l = A(0);
        for (int j = t; j < cnt; j += blockDim.x) {
            const A e = fm_exp(s[j] - m);
            s[j] = e;
            l += e;
        }
        l = block_sum(l, red);  // its barriers also publish the s[j] writes
        int G;  // key groups; part[g * hs + d] is group g's sum for channel d
        if (vec) {
            const int R = hs / V;
            G = blockDim.x / R;
            const int r = t % R, g = t / R;
            if (g < G) {
                A acc[V];
#pragma unroll
                for (int i = 0; i < V; ++i) acc[i] = A(0);
#pragma unroll 8
                for (int j = g; j < cnt; j += G) {
                    A w[V];
                    Vec16<T>::load(vb + (long long)j * hs + r * V, w);
                    const A pj = s[j];
#pragma unroll
                    for (int i = 0; i < V; ++i) acc[i] += pj * w[i];
                }
#pragma unroll
                for (int i = 0; i < V; ++i) part[g * hs + r * V + i] = acc[i];
            }
        } else {
            G = blockDim.x / hs;  // hs <= blockDim.x
            const int d = t % hs, g = t / hs;
            if (g < G) {
                A acc = A(0);
                for (int j = g; j < cnt; j += G) acc += s[j] * ldf(vb[(long long)j * hs + d]);
                part[g * hs + d] = acc;
            }
        }
        __syncthreads();
        for (int d = t; d < hs; d += blockDim.x) {
            A a = A(0);
            for (int k = 0; k < G; ++k) a += part[k * hs + d];
            o[d] = a;
        }
    }
    if (P == 1) {
        __syncthreads();
        for (int d = t; d < hs; d += blockDim.x) yr[d] = To<T>::from(o[d] / l);
        return;
    }
    if (t == 0) {
        ml[0] = m;
        ml[1] = l;
    }
    cluster_sync();
    A M = neg_inf<A>();
    for (int r = 0; r < P; ++r) M = fm_max(M, ld_cluster(&ml[0], (unsigned)r));
    const int share = (hs + P - 1) / P, d0 = p * share, d1 = min(hs, d0 + share);
    for (int d = d0 + t; d < d1; d += blockDim.x) {
        A num = A(0), den = A(0);
        for (int r = 0; r < P; ++r) {
            const A mr = ld_cluster(&ml[0], (unsigned)r);
            const A f = mr == neg_inf<A>() ? A(0) : fm_exp(mr - M);  // a block with no keys
            num += f * ld_cluster(&o[d], (unsigned)r);
            den += f * ld_cluster(&ml[1], (unsigned)r);
        }
        yr[d] = To<T>::from(num / den);
    }
    cluster_sync();  // no block leaves while another may still read its shared memory
}

#define FORGE_DECODE_ATTENTION(T, S, A)                                                       \
    extern "C" __global__ void decode_attention_##S(const T* qkv, T* kc, T* vc,              \
                                                    const int* pos, T* y, int H, int Tmax,    \
                                                    int hs, A scale, int P, int npos) {       \
        decode_attention_impl<T>(qkv, kc, vc, pos, y, H, Tmax, hs, scale, P, npos);           \
    }
FORGE_DECODE_ATTENTION(float, f32, float)
FORGE_DECODE_ATTENTION(double, f64, double)
FORGE_DECODE_ATTENTION(bf16, bf16, float)
