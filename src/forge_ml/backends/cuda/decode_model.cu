// launched from backends/cuda/decoder.py
// decode_model.cu: a whole GPT-2 decoding step for one row (batch 1) as ONE kernel: the
// embedding, every layer (layernorm, qkv, attention over the KV cache, projection, MLP, the
// residual adds), the final layernorm, the LM head and, for a greedy chain, the argmax.
//
// Why one kernel: at batch 1 a step reads every weight once (248 MB in bf16 for GPT-2 124M,
// about 52 us at the H200's 4.8 TB/s), but as ~60 kernels each one pays its launch, its ramp
// and its tail (about 5 us each, ~400 us a token). Here the grid is one block per SM, kept
// resident for the whole step; the stages meet at a grid-wide barrier (an atomic counter in
// global memory), and before each barrier a block asks L2 for the weights its next stage reads
// (prefetch.global.L2), so DRAM works while the grid waits.
//
// Stages of a layer (every vector in float32; weights and the KV cache in T):
//   A  x = residual (or the embedding); LN1(x) in shared memory; qkv = LN1(x) @ Wqkv as S
//      partial sums over K slices (written to qkvp[s][3C], deterministic: no atomics)
//   B  attention, one item per (head, split of the keys 0..pos): q and, for the split holding
//      position pos, the new k and v (written to the cache) summed from qkvp; the split's
//      softmax pair (m, l) and its unnormalised output (attp[h][split])
//   C  y = the splits' outputs merged; partial sums of y @ Wproj (projp)
//   D  x' = x + bias + sum(projp) (kept in xm); LN2(x'); partial sums of LN2(x') @ Wfc (fcp)
//   E  h = GELU(sum(fcp) + bias); partial sums of h @ Wout (outp)
// then the next layer's A folds outp into the residual. Finally F: LN_f, the logits
// (float32, every padded column) and each block's argmax; with `greedy`, after one more
// barrier block 0 picks the argmax over the blocks (NumPy's ties), writes ids[0] and
// hist[0] (a chain's record of its tokens; ids itself when there is none), and advances
// pos[0] by one.
//
// A gemv stage's work items are (column tile, K slice): LPR lanes read one row's tile (16-byte
// loads of VEC columns), the block's 16 warps 16 * 32 / LPR rows at a time; the warps meet in
// shared memory in a fixed order. decoder.py chooses LPR and the slices per stage.
//
// Data written by other blocks during the kernel is read through L2 only (__ldcg): an SM's L1
// is not coherent with the other SMs' writes.
#include "common.cuh"

#define DM_WARPS 16
#define DM_THREADS (DM_WARPS * 32)
#define DM_KMAX 6400  // 4 * n_embd at most
#define DM_CMAX 1600  // n_embd at most
#define DM_TILE 128   // gemv tile columns at most (LPR * VEC)
#define DM_KEYS 1024  // keys of one attention split at most
#define DM_HS 64      // head size
#define DM_LAYER 14   // pointers per layer: the 12 Layer tensors, then the k and v caches
#define DM_ROWS 8     // LM head rows in flight per warp
#define DM_PF 4       // W rows per lane loaded into registers before the barrier of a stage
#define DM_SMAX 16    // K slices of a gemv, and attention splits, at most
#define DM_BARS 256   // barriers a step at most (5 a layer + 1), for the timing record

// geometry: int32 g[] (decoder.py: _GEO)
enum {
    G_C, G_H, G_L, G_V, G_VP, G_TMAX, G_SPLITS,
    G_QKV_LPR, G_QKV_S, G_QKV_KC,
    G_PROJ_LPR, G_PROJ_S, G_PROJ_KC,
    G_FC_LPR, G_FC_S, G_FC_KC,
    G_OUT_LPR, G_OUT_S, G_OUT_KC,
    G_X, G_XM, G_QKVP, G_ATTP, G_PROJP, G_FCP, G_OUTP, G_ARGP,
    G_N
};

struct DmShared {
    float xs[DM_KMAX];              // a gemv's input vector (full K); attention: scores, q
    float xv[DM_CMAX];              // the residual x
    float red[DM_WARPS][DM_TILE];   // the warps' partial tiles; attention: groups' outputs
    float sh[32];
    float shv[32];
    int shi[32];
    int pos;
};

// Every block arrives, then waits for all: a counter that only grows (each launch adds
// gridDim.x per barrier, so between launches it is a multiple of gridDim.x).
// `tim` (null: off): each block's arrival and departure time at barrier `nb`, in ns, for the
// stage profile of benchmarks/decode_gpu.py
FORGE_D void grid_barrier(unsigned long long* ctr, unsigned long long* tim, int& nb) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (tim != nullptr && nb < DM_BARS) tim[((long long)blockIdx.x * DM_BARS + nb) * 2] = global_ns();
        __threadfence();
        unsigned long long old;
        asm volatile("atom.release.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(ctr) : "memory");
        const unsigned long long G = gridDim.x, target = (old / G + 1) * G;
        unsigned long long v;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
        } while (v < target);
        __threadfence();
        if (tim != nullptr && nb < DM_BARS) tim[((long long)blockIdx.x * DM_BARS + nb) * 2 + 1] = global_ns();
    }
    ++nb;
    __syncthreads();
}

FORGE_D void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

FORGE_D int cdiv(int a, int b) { return (a + b - 1) / b; }


// ---- gemv stages: P[s][n] = sum over k in slice s of xs[k] * W[k][n] ----
struct Gemv {
    int K, N, lpr, S, kc;
};

FORGE_D Gemv gemv_of(const int* g, int K, int N, int at) { return Gemv{K, N, g[at], g[at + 1], g[at + 2]}; }

template <int VEC> FORGE_D int gemv_items(const Gemv& m) { return cdiv(m.N, m.lpr * VEC) * m.S; }

// ask L2 for the weights of this block's items of stage m (one 128-byte line per row)
template <typename T, int VEC> __device__ void gemv_prefetch(const T* W, const Gemv& m) {
    const int TILE = m.lpr * VEC, tiles = cdiv(m.N, TILE), items = tiles * m.S;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int tile = it % tiles, s = it / tiles, k0 = s * m.kc;
        const int kn = max(0, min(m.K, k0 + m.kc) - k0);
        for (int r = threadIdx.x; r < kn; r += DM_THREADS)
            prefetch_l2(W + (long long)(k0 + r) * m.N + tile * TILE);
    }
}

// this block's first item of stage m: the lane's first DM_PF rows of W, into registers (loaded
// before the stage's barrier, they arrive while the grid waits)
template <typename T, int VEC>
FORGE_D void gemv_preload(const T* __restrict__ W, const Gemv& m, uint4 (&pre)[DM_PF]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lpr = m.lpr, TILE = lpr * VEC, RW = 32 / lpr, BR = DM_WARPS * RW;
    const int tiles = cdiv(m.N, TILE), it = blockIdx.x;
    const int tile = it % tiles, s = it / tiles, k0 = s * m.kc;
    const int kn = max(0, min(m.K, k0 + m.kc) - k0), n0 = tile * TILE + (lane % lpr) * VEC;
    const bool ok = it < tiles * m.S && n0 < m.N;
#pragma unroll
    for (int i = 0; i < DM_PF; ++i) {
        const int kk = warp * RW + lane / lpr + i * BR;
        pre[i] = ok && kk < kn ? __ldg(reinterpret_cast<const uint4*>(W + (long long)(k0 + kk) * m.N + n0))
                               : make_uint4(0u, 0u, 0u, 0u);
    }
}

template <typename T, int VEC>
__device__ void gemv_tile(const T* __restrict__ W, const Gemv& m, int tile, int s, const float* xs,
                          float* P, DmShared& sm, const uint4 (&pre)[DM_PF], bool use_pre) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lpr = m.lpr, TILE = lpr * VEC, RW = 32 / lpr, BR = DM_WARPS * RW;
    const int rg = lane / lpr, cl = lane % lpr;
    const int n0 = tile * TILE + cl * VEC;
    const int k0 = s * m.kc, kn = max(0, min(m.K, k0 + m.kc) - k0);
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    int first = warp * RW + rg;
    if (use_pre) {  // rows first + i * BR, i < DM_PF, are in registers (zero past the slice)
#pragma unroll
        for (int i = 0; i < DM_PF; ++i) {
            const int kk = first + i * BR;
            if (kk < kn) {
                float w[VEC];
                Vec16<T>::widen(pre[i], w);
                const float xk = xs[k0 + kk];
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] += xk * w[j];
            }
        }
        first += DM_PF * BR;
    }
    if (n0 < m.N) {
        const T* wp = W + (long long)k0 * m.N + n0;
#pragma unroll 8
        for (int kk = first; kk < kn; kk += BR) {
            const uint4 w16 = __ldg(reinterpret_cast<const uint4*>(wp + (long long)kk * m.N));
            float w[VEC];
            Vec16<T>::widen(w16, w);
            const float xk = xs[k0 + kk];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] += xk * w[j];
        }
    }
    for (int o = lpr; o < 32; o <<= 1)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if (rg == 0) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sm.red[warp][cl * VEC + j] = acc[j];
    }
    __syncthreads();
    for (int c = tid; c < TILE; c += DM_THREADS) {
        const int n = tile * TILE + c;
        if (n < m.N) {
            float a = 0.f;
#pragma unroll
            for (int w = 0; w < DM_WARPS; ++w) a += sm.red[w][c];
            __stcg(P + (long long)s * m.N + n, a);
        }
    }
    __syncthreads();
}

// every item of a stage; fill(k0, kn) writes xs[k0 .. k0 + kn) first (and syncs) when the
// input is made per slice
template <typename T, int VEC, typename Fill>
__device__ void gemv_stage(const T* W, const Gemv& m, float* P, DmShared& sm,
                           const uint4 (&pre)[DM_PF], Fill fill) {
    const int TILE = m.lpr * VEC, tiles = cdiv(m.N, TILE), items = tiles * m.S;
    int filled = -1;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int tile = it % tiles, s = it / tiles;
        if (s != filled) {
            const int k0 = s * m.kc;
            fill(k0, max(0, min(m.K, k0 + m.kc) - k0));
            filled = s;
        }
        gemv_tile<T, VEC>(W, m, tile, s, sm.xs, P, sm, pre, it == (int)blockIdx.x);
    }
}

struct NoFill {
    FORGE_D void operator()(int, int) const {}
};

// ---- vectors every block makes for itself ----

// xv = base + bias + sum over S partial rows of P (C columns); block 0 also stores it in dst
template <typename T>
__device__ void gather(DmShared& sm, const float* base, const T* bias, const float* P, int S, int C,
                       float* dst) {
    for (int c = threadIdx.x; c < C; c += DM_THREADS) {
        float a = __ldcg(base + c) + ldf(bias[c]);
#pragma unroll
        for (int s = 0; s < DM_SMAX; ++s)  // unrolled: every slice's load in flight at once
            if (s < S) a += __ldcg(P + (long long)s * C + c);
        sm.xv[c] = a;
        if (blockIdx.x == 0) __stcg(dst + c, a);
    }
    __syncthreads();
}

// xs[0 .. C) = layernorm(xv) with gamma, beta (float32 statistics, two passes, as layernorm.cu)
template <typename T>
__device__ void layernorm_xs(DmShared& sm, const T* gamma, const T* beta, int C, float eps) {
    float a = 0.f;
    for (int c = threadIdx.x; c < C; c += DM_THREADS) a += sm.xv[c];
    const float mean = block_sum(a, sm.sh) / float(C);
    float v = 0.f;
    for (int c = threadIdx.x; c < C; c += DM_THREADS) {
        const float d = sm.xv[c] - mean;
        v += d * d;
    }
    const float var = block_sum(v, sm.sh) / float(C);
    const float rstd = var < -neg_inf<float>() ? 1.f / sqrtf(var + eps) : quiet_nan<float>();
    for (int c = threadIdx.x; c < C; c += DM_THREADS)
        sm.xs[c] = (sm.xv[c] - mean) * rstd * ldf(gamma[c]) + ldf(beta[c]);
    __syncthreads();
}

// ---- attention: one (head, split) item ----
template <typename T>
__device__ void attention_item(DmShared& sm, int h, int sp, int splits, int pos, int C, int Tmax,
                               const float* qkvp, int S, const T* qkv_b, T* kc, T* vc,
                               float* attp) {
    constexpr int VEC = Vec16<T>::N;
    const int tid = threadIdx.x, n = pos + 1, chunk = cdiv(n, splits);
    const int j0 = sp * chunk, j1 = min(n, j0 + chunk), nk = max(0, j1 - j0);
    float* sc = sm.xs;            // scores of the split's keys
    float* q = sm.xs + DM_KEYS;   // q / sqrt(hs)
    const long long head = (long long)h * Tmax * DM_HS;
    if (tid < DM_HS) {
        const int c = h * DM_HS + tid;
        float a = ldf(qkv_b[c]);
#pragma unroll
        for (int s = 0; s < DM_SMAX; ++s)
            if (s < S) a += __ldcg(qkvp + (long long)s * 3 * C + c);
        q[tid] = a * 0.125f;
    } else if (tid < 3 * DM_HS && j0 <= pos && pos < j1) {
        const int which = tid / DM_HS, d = tid % DM_HS, c = which * C + h * DM_HS + d;
        float a = ldf(qkv_b[c]);
#pragma unroll
        for (int s = 0; s < DM_SMAX; ++s)
            if (s < S) a += __ldcg(qkvp + (long long)s * 3 * C + c);
        T* dst = which == 1 ? kc : vc;
        dst[head + (long long)pos * DM_HS + d] = To<T>::from(a);
    }
    __syncthreads();
    for (int j = tid; j < nk; j += DM_THREADS) {
        const T* kr = kc + head + (long long)(j0 + j) * DM_HS;
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < DM_HS / VEC; ++i) {
            float w[VEC];
            Vec16<T>::widen(Vec16<T>::raw(kr + i * VEC), w);
#pragma unroll
            for (int e = 0; e < VEC; ++e) a += q[i * VEC + e] * w[e];
        }
        sc[j] = a;
    }
    __syncthreads();
    float mx = neg_inf<float>();
    for (int j = tid; j < nk; j += DM_THREADS) mx = fmaxf(mx, sc[j]);
    const float m = block_max(mx, sm.sh);
    float l = 0.f;
    for (int j = tid; j < nk; j += DM_THREADS) {
        const float p = __expf(sc[j] - m);
        sc[j] = p;
        l += p;
    }
    l = block_sum(l, sm.sh);  // syncs: every p is in sc
    // p . V: TPK threads a key row (16-byte loads), G rows at a time, two rows in flight;
    // the key groups of a warp meet by shuffles, the warps in shared memory
    constexpr int TPK = DM_HS / VEC, G = DM_THREADS / TPK;
    const int part = tid % TPK, kg = tid / TPK, lane = tid & 31, warp = tid >> 5;
    float a[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) a[e] = 0.f;
#pragma unroll 2
    for (int j = kg; j < nk; j += G) {
        float w[VEC];
        Vec16<T>::widen(Vec16<T>::raw(vc + head + (long long)(j0 + j) * DM_HS + part * VEC), w);
        const float p = sc[j];
#pragma unroll
        for (int e = 0; e < VEC; ++e) a[e] += p * w[e];
    }
#pragma unroll
    for (int o = TPK; o < 32; o <<= 1)
#pragma unroll
        for (int e = 0; e < VEC; ++e) a[e] += __shfl_xor_sync(0xffffffffu, a[e], o);
    float* wsum = &sm.red[0][0];  // DM_WARPS x 64
    if (lane < TPK) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wsum[warp * DM_HS + part * VEC + e] = a[e];
    }
    __syncthreads();
    float* out = attp + ((long long)h * splits + sp) * (DM_HS + 2);
    if (tid < DM_HS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < DM_WARPS; ++w) o += wsum[w * DM_HS + tid];
        __stcg(out + 2 + tid, o);
    }
    if (tid == 0) {
        __stcg(out, nk ? m : neg_inf<float>());
        __stcg(out + 1, l);
    }
    __syncthreads();
}


// the attention output y[k], k in [k0, k0 + kn): the splits of head k / 64 merged
__device__ void merge_heads(DmShared& sm, const float* attp, int splits, int k0, int kn) {
    for (int k = k0 + threadIdx.x; k < k0 + kn; k += DM_THREADS) {
        const int h = k / DM_HS, d = k % DM_HS;
        const float* A = attp + (long long)h * splits * (DM_HS + 2);
        float ms[DM_SMAX], ls[DM_SMAX], ys[DM_SMAX];
        float M = neg_inf<float>();
#pragma unroll
        for (int s = 0; s < DM_SMAX; ++s) {  // every split's three loads in flight at once
            ms[s] = s < splits ? __ldcg(A + s * (DM_HS + 2)) : neg_inf<float>();
            ls[s] = s < splits ? __ldcg(A + s * (DM_HS + 2) + 1) : 0.f;
            ys[s] = s < splits ? __ldcg(A + s * (DM_HS + 2) + 2 + d) : 0.f;
            M = fmaxf(M, ms[s]);
        }
        float L = 0.f, y = 0.f;
#pragma unroll
        for (int s = 0; s < DM_SMAX; ++s) {
            if (ms[s] == neg_inf<float>()) continue;  // an empty split
            const float w = __expf(ms[s] - M);
            L += w * ls[s];
            y += w * ys[s];
        }
        sm.xs[k] = y / L;
    }
    __syncthreads();
}

// ---- the LM head: logits[n] = xs . head[n], warp per row, DM_ROWS rows in flight ----
template <typename T>
__device__ void lm_head(DmShared& sm, const T* head, int C, int Vp, int V, float* logits,
                        float& best, int& bi) {
    lm_head_rows<T, DM_ROWS, DM_WARPS>(sm.xs, head, C, Vp, V, logits, best, bi);
}

template <typename T>
__device__ void head_prefetch(const T* head, int C, int Vp, int part, int parts) {
    // the rows of this block's warps, lines of 128 bytes; part `part` of `parts`
    const int lines = cdiv(C * (int)sizeof(T), 128);
    const int nw = gridDim.x * DM_WARPS;
    for (int w = 0; w < DM_WARPS; ++w) {
        const int gw = blockIdx.x * DM_WARPS + w;
        for (int n0 = gw * DM_ROWS; n0 < Vp; n0 += nw * DM_ROWS) {
            for (int i = threadIdx.x; i < DM_ROWS * lines; i += DM_THREADS) {
                const int r = i / lines, ln = i % lines, n = n0 + r;
                if (n < Vp && (n % parts) == part)
                    prefetch_l2(reinterpret_cast<const char*>(head + (long long)n * C) + ln * 128);
            }
        }
    }
}

template <typename T>
__device__ void decode_model_impl(const int* g, const unsigned long long* tab, const T* wte,
                                  const T* wpe, const T* lnf_w, const T* lnf_b, const T* head,
                                  float* ws, unsigned long long* bar, int* ids, int* posp,
                                  int* hist, int greedy, float eps, float* logits,
                                  unsigned long long* tim) {
    int nb = 0;  // barriers passed
    constexpr int VEC = Vec16<T>::N;
    __shared__ DmShared sm;
    const int C = g[G_C], H = g[G_H], L = g[G_L], V = g[G_V], Vp = g[G_VP], Tmax = g[G_TMAX];
    const int splits = g[G_SPLITS];
    const Gemv mq = gemv_of(g, C, 3 * C, G_QKV_LPR), mp = gemv_of(g, C, C, G_PROJ_LPR);
    const Gemv mf = gemv_of(g, C, 4 * C, G_FC_LPR), mo = gemv_of(g, 4 * C, C, G_OUT_LPR);
    float *x = ws + g[G_X], *xm = ws + g[G_XM], *qkvp = ws + g[G_QKVP], *attp = ws + g[G_ATTP];
    float *projp = ws + g[G_PROJP], *fcp = ws + g[G_FCP], *outp = ws + g[G_OUTP];
    float* argp = ws + g[G_ARGP];
    if (threadIdx.x == 0) sm.pos = __ldcg(posp);
    __syncthreads();
    const int pos = sm.pos;
    const int tid = threadIdx.x;
#define LP(l, i) (reinterpret_cast<T*>(tab[(long long)(l) * DM_LAYER + (i)]))
    // the embedding
    {
        const int id = __ldcg(ids);
        for (int c = tid; c < C; c += DM_THREADS) {
            const float a = ldf(wte[(long long)id * C + c]) + ldf(wpe[(long long)pos * C + c]);
            sm.xv[c] = a;
            if (blockIdx.x == 0) __stcg(x + c, a);
        }
        __syncthreads();
    }
    uint4 pre[DM_PF];  // the next gemv stage's first rows of W
    gemv_preload<T, VEC>(LP(0, 2), mq, pre);
    for (int l = 0; l < L; ++l) {
        // A: LN1, qkv
        if (l > 0) gather<T>(sm, xm, LP(l - 1, 11), outp, mo.S, C, x);
        layernorm_xs<T>(sm, LP(l, 0), LP(l, 1), C, eps);
        gemv_stage<T, VEC>(LP(l, 2), mq, qkvp, sm, pre, NoFill());
        // the K and V rows this block's attention items read
        for (int it = blockIdx.x; it < H * splits; it += gridDim.x) {
            const int h = it % H, sp = it / H, n = pos + 1, chunk = cdiv(n, splits);
            const int j0 = sp * chunk, j1 = min(n, j0 + chunk);
            const long long hd = (long long)h * Tmax * DM_HS;
            for (int j = j0 + tid; j < j1; j += DM_THREADS) {
                prefetch_l2(LP(l, 12) + hd + (long long)j * DM_HS);
                prefetch_l2(LP(l, 13) + hd + (long long)j * DM_HS);
            }
        }
        grid_barrier(bar, tim, nb);
        // B: attention
        for (int it = blockIdx.x; it < H * splits; it += gridDim.x)
            attention_item<T>(sm, it % H, it / H, splits, pos, C, Tmax, qkvp, mq.S, LP(l, 3),
                              LP(l, 12), LP(l, 13), attp);
        gemv_prefetch<T, VEC>(LP(l, 4), mp);
        gemv_preload<T, VEC>(LP(l, 4), mp, pre);
        grid_barrier(bar, tim, nb);
        // C: merge the heads, projection
        gemv_stage<T, VEC>(LP(l, 4), mp, projp, sm, pre,
                           [&](int k0, int kn) { merge_heads(sm, attp, splits, k0, kn); });
        gemv_prefetch<T, VEC>(LP(l, 8), mf);
        gemv_preload<T, VEC>(LP(l, 8), mf, pre);
        grid_barrier(bar, tim, nb);
        // D: residual, LN2, fc
        gather<T>(sm, x, LP(l, 5), projp, mp.S, C, xm);
        layernorm_xs<T>(sm, LP(l, 6), LP(l, 7), C, eps);
        gemv_stage<T, VEC>(LP(l, 8), mf, fcp, sm, pre, NoFill());
        gemv_prefetch<T, VEC>(LP(l, 10), mo);
        gemv_preload<T, VEC>(LP(l, 10), mo, pre);
        grid_barrier(bar, tim, nb);
        // E: GELU, the MLP's projection
        const T* fcb = LP(l, 9);
        gemv_stage<T, VEC>(LP(l, 10), mo, outp, sm, pre, [&](int k0, int kn) {
            for (int k = k0 + tid; k < k0 + kn; k += DM_THREADS) {
                float a = ldf(fcb[k]);
#pragma unroll
                for (int s = 0; s < DM_SMAX; ++s)
                    if (s < mf.S) a += __ldcg(fcp + (long long)s * 4 * C + k);
                sm.xs[k] = gelu_f(a);
            }
            __syncthreads();
        });
        if (l + 1 < L) {
            gemv_prefetch<T, VEC>(LP(l + 1, 2), mq);
            gemv_preload<T, VEC>(LP(l + 1, 2), mq, pre);
        } else {
            head_prefetch<T>(head, C, Vp, 0, 1);
        }
        grid_barrier(bar, tim, nb);
    }
    // F: LN_f, the LM head, the block's argmax
    gather<T>(sm, xm, LP(L - 1, 11), outp, mo.S, C, x);
    layernorm_xs<T>(sm, lnf_w, lnf_b, C, eps);
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    lm_head<T>(sm, head, C, Vp, V, logits, best, bi);
    if (!greedy) return;
    block_argmax(best, bi, sm.shv, sm.shi);
    if (tid == 0) {
        __stcg(argp + 2 * blockIdx.x, best);
        __stcg(reinterpret_cast<int*>(argp) + 2 * blockIdx.x + 1, bi);
    }
    grid_barrier(bar, tim, nb);
    if (blockIdx.x != 0) return;
    best = neg_inf<float>();
    bi = 0x7fffffff;
    for (int b = tid; b < (int)gridDim.x; b += DM_THREADS)
        argmax_take(__ldcg(argp + 2 * b), __ldcg(reinterpret_cast<const int*>(argp) + 2 * b + 1), best, bi);
    block_argmax(best, bi, sm.shv, sm.shi);
    if (tid == 0) {
        hist[0] = isfinite(best) ? bi : -1;   // -1: no finite largest logit (greedy.cu)
        ids[0] = bi;                          // after hist, which may be ids
        posp[0] = pos + 1;
    }
#undef LP
}

#define FORGE_DECODE_MODEL(T, S)                                                               \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 1)                               \
        decode_model_##S(const int* g, const unsigned long long* tab, const T* wte,           \
                         const T* wpe, const T* lnf_w, const T* lnf_b, const T* head,          \
                         float* ws, unsigned long long* bar, int* ids, int* pos, int* hist,    \
                         int greedy, float eps, float* logits,                                 \
                         unsigned long long* tim) {                                            \
        decode_model_impl<T>(g, tab, wte, wpe, lnf_w, lnf_b, head, ws, bar, ids, pos, hist,    \
                             greedy, eps, logits, tim);                                        \
    }
FORGE_DECODE_MODEL(float, f32)
FORGE_DECODE_MODEL(bf16, bf16)
