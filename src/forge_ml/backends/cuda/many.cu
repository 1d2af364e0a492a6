// launched from backends/cuda/many.py
// many.cu: an optimizer step's per-tensor work over a whole model in a few launches instead of
// a few per tensor (GPT-2 124M has 148 parameters: clipping and AdamW were 590 launches a
// step). Every kernel reads a table of the tensors (many.py builds it once per set of
// addresses) and cuts each tensor into chunks of MANY_CHUNK elements; block b owns one chunk
// of one tensor: the tensor t whose first chunk is the last one <= b (a binary search over
// the table's `chunk0` column).
//
//   sumsq_many_partial  part[b] = the sum of squares of chunk b (float32, a fixed tree)
//   sumsq_many_finish   one block: out = the sum of every part in double, rounded once
//   adamw_many_at       adamw.cu's adamw_update_at on every chunk (the same per-element
//                       arithmetic: adamw_step, so the bits are the one-tensor kernel's)
// No atomics: the sum has the same bits on every run.
#include "common.cuh"

#define MANY_CHUNK 16384  // elements a block owns (many.py: _CHUNK)

// The tensor that chunk b belongs to: the last t with chunk0(t) <= b, chunk0(0) = 0.
FORGE_D int many_find(const long long* tab, int nt, int width, int col, long long b) {
    int lo = 0, hi = nt - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tab[(long long)mid * width + col] <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// sumsq table rows: (address, elements, chunk0). A chunk whose start is 16-byte aligned and
// whose length is a whole number of 16-byte vectors is read in vectors, four in flight per
// thread (one element at a time, a chunk of 64 dependent loads a thread ran at a third of the
// one-tensor kernel's bandwidth); others element by element.
#define SQ_W 3
template <typename T>
__device__ void sumsq_many_partial_impl(const long long* tab, int nt, float* part) {
    __shared__ float sh[32];
    const long long b = blockIdx.x;
    const int t = many_find(tab, nt, SQ_W, 2, b);
    const T* x = reinterpret_cast<const T*>(tab[t * SQ_W]);
    const long long n = tab[t * SQ_W + 1];
    const long long start = (b - tab[t * SQ_W + 2]) * MANY_CHUNK;
    const int cnt = (int)min((long long)MANY_CHUNK, n - start);
    x += start;
    const int bd = blockDim.x;
    enum { N = Vec16<T>::N };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (cnt % N == 0 && (reinterpret_cast<size_t>(x) & 15) == 0) {
        const int nv = cnt / N;
        int j = threadIdx.x;
        for (; j + 3 * bd < nv; j += 4 * bd) {
            float w[4][N];
#pragma unroll
            for (int u = 0; u < 4; ++u) Vec16<T>::load(x + (long long)(j + u * bd) * N, w[u]);
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int e = 0; e < N; ++e) acc[u] += w[u][e] * w[u][e];
        }
        for (; j < nv; j += bd) {
            float w[N];
            Vec16<T>::load(x + (long long)j * N, w);
#pragma unroll
            for (int e = 0; e < N; ++e) acc[0] += w[e] * w[e];
        }
    } else {
        for (int i = threadIdx.x; i < cnt; i += bd) {
            const float v = ldf(x[i]);
            acc[0] += v * v;
        }
    }
    float total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    total = block_sum(total, sh);
    if (threadIdx.x == 0) part[b] = total;
}

extern "C" __global__ void sumsq_many_partial_bf16(const long long* tab, int nt, float* part) {
    sumsq_many_partial_impl<bf16>(tab, nt, part);
}
extern "C" __global__ void sumsq_many_partial_f32(const long long* tab, int nt, float* part) {
    sumsq_many_partial_impl<float>(tab, nt, part);
}

// One block of 1024 threads: thread i adds parts i, i + 1024, ... in double, then a fixed
// tree; out[0] is the total rounded once to float32.
extern "C" __global__ void sumsq_many_finish(const float* part, long long n, float* out) {
    __shared__ double sh[32];
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += (double)part[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = (float)acc;
}

// Four gradients widened to float (exactly: a bf16 is a float's upper half), from an address
// aligned to four of them.
template <typename G> struct Grad4;
template <> struct Grad4<float> {
    enum { ALIGN = 16 };
    static FORGE_D void load(const float* g, float (&w)[4]) { Vec16<float>::load(g, w); }
};
template <> struct Grad4<bf16> {
    enum { ALIGN = 8 };
    static FORGE_D void load(const bf16* g, float (&w)[4]) {
        const uint2 v = *reinterpret_cast<const uint2*>(g);
        w[0] = bits_f32(v.x << 16);
        w[1] = bits_f32(v.x & 0xffff0000u);
        w[2] = bits_f32(v.y << 16);
        w[3] = bits_f32(v.y & 0xffff0000u);
    }
};

// adamw table rows: (p, g, m, v, p_lowp or 0, elements, weight decay as a double's bits,
// chunk0); scalars s as adamw_update_at's (ops.STEP_SCALARS). Chunks of whole aligned groups
// of four run in groups (p, m, v as float4; two groups in flight a thread); others element by
// element. Either way each element is adamw_step, as in adamw_update_at.
#define AW_W 8
template <typename G>
__device__ void adamw_many_at_impl(const long long* tab, int nt, const double* s, float b1,
                                   float b2, float eps) {
    if (!isfinite(s[3])) return;  // clip_scale's verdict: skip the whole update
    const long long b = blockIdx.x;
    const int t = many_find(tab, nt, AW_W, 7, b);
    const long long* r = tab + (long long)t * AW_W;
    const long long n = r[5];
    const long long start = (b - r[7]) * MANY_CHUNK;
    const int cnt = (int)min((long long)MANY_CHUNK, n - start);
    float* __restrict__ p = reinterpret_cast<float*>(r[0]) + start;
    const G* __restrict__ g = reinterpret_cast<const G*>(r[1]) + start;
    float* __restrict__ m = reinterpret_cast<float*>(r[2]) + start;
    float* __restrict__ v = reinterpret_cast<float*>(r[3]) + start;
    bf16* __restrict__ lowp = r[4] ? reinterpret_cast<bf16*>(r[4]) + start : nullptr;
    const float wd = (float)__longlong_as_double(r[6]);
    const float lr = (float)s[0], bc1 = (float)s[1], bc2 = (float)s[2], gs = (float)s[3];
    const int bd = blockDim.x;
    const bool vec = cnt % 4 == 0 && ((reinterpret_cast<size_t>(p) | reinterpret_cast<size_t>(m) |
                                       reinterpret_cast<size_t>(v)) & 15) == 0 &&
                     (reinterpret_cast<size_t>(g) & (Grad4<G>::ALIGN - 1)) == 0 &&
                     (reinterpret_cast<size_t>(lowp) & 7) == 0;
    if (vec) {
        const int nq = cnt / 4;
        for (int j0 = threadIdx.x; j0 < nq; j0 += 2 * bd) {
            float pw[2][4], mw[2][4], vw[2][4], gw[2][4];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = j0 + u * bd;
                if (j < nq) {
                    Grad4<G>::load(g + 4 * j, gw[u]);
                    const float4 mq = reinterpret_cast<const float4*>(m)[j];
                    const float4 vq = reinterpret_cast<const float4*>(v)[j];
                    const float4 pq = reinterpret_cast<const float4*>(p)[j];
                    mw[u][0] = mq.x; mw[u][1] = mq.y; mw[u][2] = mq.z; mw[u][3] = mq.w;
                    vw[u][0] = vq.x; vw[u][1] = vq.y; vw[u][2] = vq.z; vw[u][3] = vq.w;
                    pw[u][0] = pq.x; pw[u][1] = pq.y; pw[u][2] = pq.z; pw[u][3] = pq.w;
                }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = j0 + u * bd;
                if (j >= nq) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    adamw_step<float, float>(pw[u][e], mw[u][e], vw[u][e], gw[u][e], lr, b1, b2,
                                             eps, wd, bc1, bc2, gs);
                reinterpret_cast<float4*>(m)[j] = make_float4(mw[u][0], mw[u][1], mw[u][2], mw[u][3]);
                reinterpret_cast<float4*>(v)[j] = make_float4(vw[u][0], vw[u][1], vw[u][2], vw[u][3]);
                reinterpret_cast<float4*>(p)[j] = make_float4(pw[u][0], pw[u][1], pw[u][2], pw[u][3]);
                if (lowp != nullptr) {
                    unsigned short h[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) h[e] = To<bf16>::from(pw[u][e]).bits;
                    reinterpret_cast<uint2*>(lowp)[j] =
                        make_uint2(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16));
                }
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < cnt; i += bd) {
        const G gv = g[i];  // adamw.cu's order of loads
        float mi = m[i], vi = v[i], pi = p[i];
        adamw_step<float, G>(pi, mi, vi, gv, lr, b1, b2, eps, wd, bc1, bc2, gs);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (lowp != nullptr) lowp[i] = To<bf16>::from(pi);
    }
}

extern "C" __global__ void adamw_many_at_bf16(const long long* tab, int nt, const double* s,
                                              float b1, float b2, float eps) {
    adamw_many_at_impl<bf16>(tab, nt, s, b1, b2, eps);
}
extern "C" __global__ void adamw_many_at_f32(const long long* tab, int nt, const double* s,
                                             float b1, float b2, float eps) {
    adamw_many_at_impl<float>(tab, nt, s, b1, b2, eps);
}
