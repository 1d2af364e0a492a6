// launched from backends/cuda/decoder.py
// decode_layers.cu: GPT-2's decoding step for a few rows (batch 1 to 4) in two kernels a layer
// and one for the head (FORGE_FUSED_DECODE=layers), 2 L + 1 kernels where the kernel-per-op
// step has 5 L + 3. Row b of the batch is blockIdx.y = b of every kernel: the rows' blocks
// run side by side, each with its own copy of the weights in shared memory (the later rows'
// loads mostly from L2), its own workspace rows, cache rows and token; every row is at the
// one position posp[0]. At batch 1 every kernel of the step waits on latency, not on
// bandwidth (about 5 us each for a few MB of weights), so the step's time follows the number
// of dependent stages.
//
// Every block loads its weights into shared memory (cp.async) before it waits for the previous
// kernel (programmatic dependent launch, common.cuh's pdl_wait): they arrive under that
// kernel's tail, the small vectors (biases, layernorm weights) as a group of their own that is
// waited for first. Vectors between kernels are float32 in a workspace; sums over blocks are
// partial rows summed by the consumer in a fixed order (no atomics: the same bits every run).
// Within a cluster, a block stores what another block sums straight into that block's shared
// memory (st.shared::cluster) before the cluster meets, so each meeting is the last touch of
// that data. benchmarks/decode_gpu.py --trace times each phase (the DL_TRACE build below).
//
//   layer_attn (H clusters of 8 blocks, one cluster a head):
//     x = the embedding (layer 0), else x' + c_proj bias of the MLP + the rows of partB;
//     LN1(x); block p: the head's q, k, v over its eighth of the rows of c_attn's weight,
//     summed over the cluster (distributed shared memory) and rounded to the weights' type as
//     the kernel-per-op step's qkv is; block 0 writes k and v at row pos of the caches;
//     attention over the keys 0..pos, block p the p-th eighth of them (the new row from the
//     cluster's sums, not the cache); each block's (m, l, outputs) stored into every block,
//     the 8 parts merged (online softmax) in every block, y rounded; block p: y @ c_proj's
//     weight for its eighth of the columns -> partA[head].
//   layer_mlp (C / VEC blocks in clusters of 8, block b owning 4 VEC columns of c_fc):
//     x' = x + c_proj bias + the H rows of partA; LN2(x'); its columns of GELU(LN2 @ W_fc +
//     b), rounded; their rows of the MLP's projection -> a partial row of C, each eighth of it
//     stored into the cluster's block that sums it -> partB[cluster].
//   head: x'' = x' + bias + partB's rows; LN_f; the logits (float32, every padded column);
//     with `greedy`, the argmax (NumPy's ties) over the row's blocks by its last block to
//     finish: ids[row], hist[row] (-1 there for a row with no finite largest logit, as
//     greedy.cu); pos[0] += 1 by the last row's (a counter of rows done).
#include "common.cuh"

#define DL_THREADS 256
#define DL_WARPS 8
#define DL_P 8          // blocks of a cluster
#define DL_HS 64        // head size
#define DL_XPT 8        // x values a thread holds (C <= DL_XPT * DL_THREADS)
#define DL_HEAD_WARPS 8  // with __launch_bounds__(256, 2): 128 registers a thread; 16 warps
                         // (64 registers, float32 spilling) were 2-3% slower a token
#define DL_HEAD_SLOTS 3  // the LM head's slots a warp streams its rows through (dl_head_*)
#define DL_HEAD_ROWS 8   // bf16: LM head rows a warp has in flight (no slots)
#define DL_KU 4         // keys a lane group of the attention has in flight
#define DL_MR (4 + DL_HS)   // a block's (m, l, 2 unused, 64 outputs) in layer_attn's mr
#define DL_CMAX 1600

FORGE_D int dl_cdiv(int a, int b) { return (a + b - 1) / b; }

// Under DL_TRACE (benchmarks/decode_gpu.py --trace compiles its own copy with it; the
// package's build leaves every mark out), thread 0 of each block notes the global clock at each
// dl_mark(i) in shared memory and dl_trace_out writes the marks into the slot of the block's
// next launch of its kind (0 layer_attn, 1 layer_mlp, 2 decode_head): dl_trace_buf[kind][block]
// [launch % DL_TRACE_RUNS][mark], 0 for a mark not reached.
#ifdef DL_TRACE
#define DL_TRACE_MARKS 16
#define DL_TRACE_RUNS 64
#define DL_TRACE_BLOCKS 512
__device__ unsigned dl_trace_count[3 * DL_TRACE_BLOCKS];
__device__ unsigned long long dl_trace_buf[3 * DL_TRACE_BLOCKS * DL_TRACE_RUNS * DL_TRACE_MARKS];
__shared__ unsigned long long dl_marks[DL_TRACE_MARKS];
FORGE_D void dl_mark(int i) {
    if (threadIdx.x == 0) {
        if (i == 0)
            for (int k = 1; k < DL_TRACE_MARKS; ++k) dl_marks[k] = 0ull;
        dl_marks[i] = global_ns();
    }
}
FORGE_D void dl_trace_out(int kind) {
    if (threadIdx.x != 0 || blockIdx.x >= DL_TRACE_BLOCKS) return;
    const unsigned at = kind * DL_TRACE_BLOCKS + blockIdx.x;
    const unsigned run = atomicAdd(&dl_trace_count[at], 1u) % DL_TRACE_RUNS;
    for (int k = 0; k < DL_TRACE_MARKS; ++k)
        dl_trace_buf[((unsigned long long)at * DL_TRACE_RUNS + run) * DL_TRACE_MARKS + k] = dl_marks[k];
}
#else
FORGE_D void dl_mark(int) {}
FORGE_D void dl_trace_out(int) {}
#endif

// 16 bytes of T at p (global or shared), widened
template <typename T> FORGE_D void dl_load(const T* p, float (&w)[Vec16<T>::N]) {
    Vec16<T>::widen(*reinterpret_cast<const uint4*>(p), w);
}

// v rounded to T and widened back: where the kernel-per-op step stores a bf16 tensor
template <typename T> FORGE_D float dl_round(float v) { return ldf(To<T>::from(v)); }

// The sum of v over a block of NW warps with one barrier: each warp's total into its slot of
// sh (NW floats, written once a kernel), then every thread adds the slots in order (the same
// bits in every thread), where block_sum has a second round of shuffles and two more barriers
// on the path of every kernel of the step.
template <int NW = DL_WARPS> FORGE_D float dl_block_sum(float v, float* sh) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) t += sh[w];
    return t;
}

// mean and rstd of the C values x[i] (thread t holds x[t + i * DL_THREADS]) whose sum over
// the block is `sum` (from the barrier that published them: dl_gather's, each thread's four
// adjacent columns), float32; the variance a second pass over the values, as layernorm.cu's;
// every thread gets both. sh: DL_WARPS floats, once a kernel.
FORGE_D void dl_stats(const float (&x)[DL_XPT], int C, float eps, float sum, float* sh,
                      float& mean, float& rstd) {
    mean = sum / float(C);
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < DL_XPT; ++i)
        if (threadIdx.x + i * DL_THREADS < C) {
            const float d = x[i] - mean;
            v += d * d;
        }
    const float var = dl_block_sum(v, sh) / float(C);
    rstd = var < -neg_inf<float>() ? 1.f / sqrtf(var + eps) : quiet_nan<float>();  // ln_correct's
}

// xs[c] = base[c] + bias[c] + the sum over s < S of P[s][c], for every c < C, in shared
// memory (a __syncthreads later, every thread may read any of it). A thread takes a column of
// four (16-byte loads) and asks for base's and all its S rows at once, 16 at a time: one round
// trip to L2 for S <= 16 (base read after the rows' loop was a second one), where a thread's
// DL_XPT columns one after the other, eight rows at a time, made six (S = 12). The sum's order is fixed: row s into accumulator s % 8, in order, then the
// accumulators 0..7, then base + bias + that: the same bits every run. NT: the block's threads.
// Returns the thread's sum of the values it wrote (the layernorm's mean needs their sum).
template <typename T, int NT = DL_THREADS>
FORGE_D float dl_gather_rows(float* xs, const float* base, const T* bias, const float* P, int S,
                             int C) {
    const float4* P4 = reinterpret_cast<const float4*>(P);
    const int G = C / 4;
    float part = 0.f;
    for (int g = threadIdx.x; g < G; g += NT) {
        const float4 b = __ldcg(reinterpret_cast<const float4*>(base) + g);   // with the rows
        float4 acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < S; s0 += 16) {
            float4 v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j)
                v[j] = s0 + j < S ? __ldcg(P4 + (long long)(s0 + j) * G + g) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < 16; ++j)
                if (s0 + j < S) {
                    float4& a = acc[j & 7];
                    a.x += v[j].x; a.y += v[j].y; a.z += v[j].z; a.w += v[j].w;
                }
        }
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            a.x += acc[j].x; a.y += acc[j].y; a.z += acc[j].z; a.w += acc[j].w;
        }
        const int c = 4 * g;
        const float v0 = b.x + ldf(bias[c]) + a.x, v1 = b.y + ldf(bias[c + 1]) + a.y;
        const float v2 = b.z + ldf(bias[c + 2]) + a.z, v3 = b.w + ldf(bias[c + 3]) + a.w;
        xs[c] = v0;
        xs[c + 1] = v1;
        xs[c + 2] = v2;
        xs[c + 3] = v3;
        part += v0 + v1 + v2 + v3;
    }
    return part;
}

// vs[0 .. 3 C) = a, b, c (C each, 16-byte aligned) by cp.async, NT threads (the caller commits)
template <typename T, int NT>
FORGE_D void dl_stage3(T* vs, const T* a, const T* b, const T* c, int C) {
    constexpr int PER = 16 / (int)sizeof(T);
    for (int i = threadIdx.x; i < 3 * (C / PER); i += NT) {
        const int v = i / (C / PER), sg = i % (C / PER);
        cp_async16(smem_u32(vs + v * C + sg * PER), (v == 0 ? a : v == 1 ? b : c) + sg * PER, true);
    }
}

// dl_gather_rows into xs, then each thread's x[i] = xs[tid + i * DL_THREADS] (0 past C);
// returns the C values' sum over the block, whose barrier publishes xs (sh: DL_WARPS floats,
// once a kernel)
template <typename T>
FORGE_D float dl_gather(float (&x)[DL_XPT], float* xs, const float* base, const T* bias,
                        const float* P, int S, int C, float* sh) {
    const float sum = dl_block_sum(dl_gather_rows<T>(xs, base, bias, P, S, C), sh);
#pragma unroll
    for (int i = 0; i < DL_XPT; ++i) {
        const int c = threadIdx.x + i * DL_THREADS;
        x[i] = c < C ? xs[c] : 0.f;
    }
    return sum;
}

// ------------------------------------------------------------------------------------------
// layer_attn. Dynamic shared memory, in this order (dl_attn_shared gives the byte offsets;
// decoder.py's _attn_shared the same total):
//   wq  T[KQ][3 * 64]   c_attn's weight, rows [p KQ, (p + 1) KQ), the head's q, k, v columns
//   wp  T[64][NP]       c_proj's weight, the head's 64 rows, columns [p NP, (p + 1) NP)
//   kn, vn T[64] each   the new key and value row, as the cache holds them
//   bpv T[C]            the previous MLP's projection bias (layers after the first)
//   g1s, b1s T[KQ]      LN1's weight and bias, this block's rows
//   bq  T[192]          c_attn's bias, the head's q, k, v columns
//   xs  float[KQ]       LN1(x), this block's rows
//   part float[192]     this block's partial q, k, v (read by the cluster)
//   qkv float[192]      q (times 1/8), k, v
//   yv  float[64]       the head's attention output
//   gm, gl float[32]    the warps' m and l
//   scr float[SCR]      scratch: x (xf, until LN1), the row groups' qkv sums, the warps'
//                       outputs, the proj sums
//   mr  float[8][DL_MR] block q's m, l and 64 unnormalised outputs at slot q, stored there by
//                       block q: wq's room (every block is done with wq once the cluster has
//                       met after the qkv rows, and only then does any block store here)
//   sh  float[32]
// KQ = NP = C / 8 (C a multiple of 64).
struct AttnSm {
    int wq, wp, kn, vn, bpv, g1s, b1s, bq, xf, xs, part, qkv, mr, yv, gm, gl, scr, sh, total;
};

template <typename T> FORGE_D AttnSm dl_attn_shared(int C) {
    constexpr int VEC = Vec16<T>::N;
    const int KQ = C / DL_P, NP = C / DL_P;
    const int nv = 3 * DL_HS / VEC, rg = DL_THREADS / nv;           // qkv: row groups
    const int nvp = NP / VEC, dg = DL_THREADS / nvp;                 // proj: row groups
    const int scr = max(max(rg * 3 * DL_HS, DL_WARPS * DL_HS), max(dg * NP, C));
    AttnSm s;
    int at = 0;
    s.wq = at; at += KQ * 3 * DL_HS * (int)sizeof(T);
    s.wp = at; at += DL_HS * NP * (int)sizeof(T);
    s.kn = at; at += DL_HS * (int)sizeof(T);
    s.vn = at; at += DL_HS * (int)sizeof(T);
    s.bpv = at; at += C * (int)sizeof(T);
    s.g1s = at; at += KQ * (int)sizeof(T);
    s.b1s = at; at += KQ * (int)sizeof(T);
    s.bq = at; at += 3 * DL_HS * (int)sizeof(T);
    at = (at + 15) & ~15;
    s.xs = at; at += KQ * 4;
    s.part = at; at += 3 * DL_HS * 4;
    s.qkv = at; at += 3 * DL_HS * 4;
    s.yv = at; at += DL_HS * 4;
    s.gm = at; at += 32 * 4;
    s.gl = at; at += 32 * 4;
    s.scr = at; at += scr * 4;
    s.xf = s.scr;
    s.mr = s.wq;
    s.sh = at; at += 32 * 4;
    s.total = at;
    return s;
}

template <typename T>
__device__ void layer_attn_impl(const int* ids, const int* posp, const T* wte, const T* wpe,
                                int first, const float* xres, const T* bprev, const float* partB,
                                int SB, const T* g1, const T* b1, const T* Wqkv, const T* bqkv,
                                const T* Wproj, T* kc, T* vc, float* xa, float* partA, int C,
                                int Tmax, float eps) {
    constexpr int VEC = Vec16<T>::N;
    extern __shared__ __align__(16) unsigned char dl_raw[];
    const AttnSm L = dl_attn_shared<T>(C);
    {   // this block's row of the batch: its token, cache rows and workspace rows
        const int row = blockIdx.y, nh = gridDim.x / DL_P;
        ids += row;
        kc += (long long)row * nh * Tmax * DL_HS;
        vc += (long long)row * nh * Tmax * DL_HS;
        xres += (long long)row * C;
        partB += (long long)row * SB * C;
        xa += (long long)row * C;
        partA += (long long)row * nh * C;
    }
    T* wq = reinterpret_cast<T*>(dl_raw + L.wq);
    T* wp = reinterpret_cast<T*>(dl_raw + L.wp);
    T* kn = reinterpret_cast<T*>(dl_raw + L.kn);
    T* vn = reinterpret_cast<T*>(dl_raw + L.vn);
    T* bpv = reinterpret_cast<T*>(dl_raw + L.bpv);
    T* g1s = reinterpret_cast<T*>(dl_raw + L.g1s);
    T* b1s = reinterpret_cast<T*>(dl_raw + L.b1s);
    T* bq = reinterpret_cast<T*>(dl_raw + L.bq);
    float* xf = reinterpret_cast<float*>(dl_raw + L.xf);
    float* xs = reinterpret_cast<float*>(dl_raw + L.xs);
    float* part = reinterpret_cast<float*>(dl_raw + L.part);
    float* qkv = reinterpret_cast<float*>(dl_raw + L.qkv);
    float* mr = reinterpret_cast<float*>(dl_raw + L.mr);
    float* yv = reinterpret_cast<float*>(dl_raw + L.yv);
    float* gm = reinterpret_cast<float*>(dl_raw + L.gm);
    float* gl = reinterpret_cast<float*>(dl_raw + L.gl);
    float* scr = reinterpret_cast<float*>(dl_raw + L.scr);
    float* sh = reinterpret_cast<float*>(dl_raw + L.sh);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x / DL_P, p = blockIdx.x % DL_P;
    const int KQ = C / DL_P, NP = C / DL_P, k0 = p * KQ, n0 = p * NP;
    dl_mark(0);
    // 1. the block's weights into shared memory, and an L2 hint for its keys and values,
    //    before the previous kernel ends (weights only: no kernel writes them). The vectors
    //    read first after the wait (the gather's bias, LN1's, c_attn's bias) are a group of
    //    their own, waited for then; the matrices' group is waited for after LN1.
    {
        constexpr int PER = 16 / (int)sizeof(T);   // elements a 16-byte copy
        const int segs = DL_HS / PER;              // copies a row of one of q, k, v
        if (!first)
            for (int i = tid; i < C / PER; i += DL_THREADS)
                cp_async16(smem_u32(bpv + i * PER), bprev + i * PER, true);
        for (int i = tid; i < 2 * (KQ / PER); i += DL_THREADS) {
            const int half = i / (KQ / PER), sg = i % (KQ / PER);
            cp_async16(smem_u32((half ? b1s : g1s) + sg * PER), (half ? b1 : g1) + k0 + sg * PER,
                       true);
        }
        for (int i = tid; i < 3 * segs; i += DL_THREADS) {
            const int w = i / segs, sg = i % segs;
            cp_async16(smem_u32(bq + w * DL_HS + sg * PER),
                       bqkv + (long long)w * C + h * DL_HS + sg * PER, true);
        }
        cp_async_commit();
        for (int i = tid; i < KQ * 3 * segs; i += DL_THREADS) {
            const int r = i / (3 * segs), w = (i / segs) % 3, sg = i % segs;
            cp_async16(smem_u32(wq + (long long)r * 3 * DL_HS + w * DL_HS + sg * PER),
                       Wqkv + (long long)(k0 + r) * 3 * C + w * C + h * DL_HS + sg * PER, true);
        }
        const int psegs = NP / PER;
        for (int i = tid; i < DL_HS * psegs; i += DL_THREADS) {
            const int r = i / psegs, sg = i % psegs;
            cp_async16(smem_u32(wp + (long long)r * NP + sg * PER),
                       Wproj + (long long)(h * DL_HS + r) * C + n0 + sg * PER, true);
        }
        cp_async_commit();
        // a hint only: pos read without waiting (a stale value asks for other lines)
        const int hint = min(max(__ldcg(posp), 0), Tmax - 1) + 1;
        const int ch = dl_cdiv(hint, DL_P), j0 = p * ch, cnt = max(0, min(hint, j0 + ch) - j0);
        const int lines = DL_HS * (int)sizeof(T) / 128;   // 128-byte lines a row (1 or 2)
        const long long hb = (long long)h * Tmax * DL_HS;
        for (int i = tid; i < cnt * lines; i += DL_THREADS) {
            const long long at = hb + (long long)(j0 + i / lines) * DL_HS +
                                 (i % lines) * (128 / (int)sizeof(T));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + at));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + at));
        }
    }
    dl_mark(1);
    pdl_wait();
    dl_mark(2);
    pdl_launch_dependents();
    const int pos_raw = __ldcg(posp);
    const bool bad = pos_raw < 0 || pos_raw >= Tmax;   // outputs NaN, nothing written
    const int pos = bad ? 0 : pos_raw;
    cp_async_wait<1>();   // the vectors (every group but the matrices')
    __syncthreads();
    // 2. x, its layernorm, this block's rows of it
    float x[DL_XPT], sum;
    if (first) {
        const int id = __ldcg(ids);
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < DL_XPT; ++i) {
            const int c = tid + i * DL_THREADS;
            x[i] = c < C ? ldf(wte[(long long)id * C + c]) + ldf(wpe[(long long)pos * C + c]) : 0.f;
            if (c < C) xf[c] = x[i];
            a += x[i];
        }
        sum = dl_block_sum(a, sh);   // its barrier publishes xf
    } else {
        sum = dl_gather<T>(x, xf, xres, bpv, partB, SB, C, sh);
    }
    if (blockIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < DL_XPT; ++i)
            if (tid + i * DL_THREADS < C) __stcg(xa + tid + i * DL_THREADS, x[i]);
    }
    dl_mark(3);
    float mean, rstd;
    dl_stats(x, C, eps, sum, sh + DL_WARPS, mean, rstd);
    for (int k = tid; k < KQ; k += DL_THREADS)
        xs[k] = (xf[k0 + k] - mean) * rstd * ldf(g1s[k]) + ldf(b1s[k]);
    dl_mark(4);
    cp_async_wait<0>();
    __syncthreads();
    dl_mark(5);
    // 3. q, k, v over this block's rows: nv column vectors, rg row groups
    {
        const int nv = 3 * DL_HS / VEC, rg = DL_THREADS / nv;
        const int cv = tid % nv, g = tid / nv;
        if (g < rg) {
            float acc[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
            for (int k = g; k < KQ; k += rg) {
                float w[VEC];
                dl_load<T>(wq + (long long)k * 3 * DL_HS + cv * VEC, w);
                const float xv = xs[k];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] += xv * w[e];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) scr[g * 3 * DL_HS + cv * VEC + e] = acc[e];
        }
        __syncthreads();
        if (tid < 3 * DL_HS) {
            float a = 0.f;
            for (int r = 0; r < rg; ++r) a += scr[r * 3 * DL_HS + tid];
            part[tid] = a;
        }
    }
    dl_mark(6);
    cluster_sync();   // every block's part is written
    dl_mark(7);
    if (tid < 3 * DL_HS) {
        const int w = tid / DL_HS, d = tid % DL_HS;
        float pr[DL_P];
#pragma unroll
        for (int r = 0; r < DL_P; ++r) pr[r] = ld_cluster(&part[tid], (unsigned)r);
        float a = ldf(bq[tid]);
#pragma unroll
        for (int r = 0; r < DL_P; ++r) a += pr[r];
        const T t = To<T>::from(a);
        qkv[tid] = w == 0 ? ldf(t) * 0.125f : ldf(t);   // 1 / sqrt(64)
        if (w == 1) kn[d] = t;
        if (w == 2) vn[d] = t;
        if (w > 0 && p == 0 && !bad)
            (w == 1 ? kc : vc)[(long long)h * Tmax * DL_HS + (long long)pos * DL_HS + d] = t;
    }
    __syncthreads();
    dl_mark(8);
    // 4. attention over this block's keys [j0, j0 + cnt): groups of RK lanes read a key and a
    //    value row together (16-byte loads), DL_KU keys a group at once (every load of a round
    //    in flight before any is used: one round at GPT-2's 1,024 positions in bf16), online
    //    softmax per group; the groups of a warp meet by shuffles, the warps in shared memory
    {
        constexpr int RK = DL_HS / VEC, GPW = 32 / RK, G1 = DL_WARPS * GPW, U = DL_KU;
        const int n = pos + 1, ch = dl_cdiv(n, DL_P), j0 = p * ch;
        const int cnt = max(0, min(n, j0 + ch) - j0);
        const int g = warp * GPW + lane / RK, r = lane % RK;
        const long long hb = (long long)h * Tmax * DL_HS;
        float qr[VEC], acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            qr[e] = qkv[r * VEC + e];
            acc[e] = 0.f;
        }
        float mg = neg_inf<float>(), lg = 0.f;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (int jb = 0; jb < cnt; jb += U * G1) {   // uniform over the warp: shuffles are safe
            uint4 kr[U], vr[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = jb + u * G1 + g, jj = j0 + j;
                kr[u] = vr[u] = zero;
                if (j < cnt) {
                    if (jj == pos) {
                        kr[u] = *reinterpret_cast<const uint4*>(kn + r * VEC);
                        vr[u] = *reinterpret_cast<const uint4*>(vn + r * VEC);
                    } else {
                        const long long at = hb + (long long)jj * DL_HS + r * VEC;
                        kr[u] = Vec16<T>::raw(kc + at);
                        vr[u] = Vec16<T>::raw(vc + at);
                    }
                }
            }
            decode_keys_round<T, float, U, true>(kr, vr, jb + g, G1, cnt, RK, qr, mg, lg, acc);
        }
        // the warp's groups to the warp's max, summed by shuffles (lanes r of each group)
        const float mw = warp_max(mg);
        const float f = mg == neg_inf<float>() ? 0.f : __expf(mg - mw);
        lg *= f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] *= f;
#pragma unroll
        for (int off = RK; off < 32; off <<= 1) {
            lg += __shfl_xor_sync(0xffffffffu, lg, off);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
        }
        if (lane < RK) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) scr[warp * DL_HS + r * VEC + e] = acc[e];
        }
        if (lane == 0) {
            gm[warp] = mw;
            gl[warp] = lg;
        }
        __syncthreads();
        if (tid < DL_HS) {   // the warps, in order
            float m = neg_inf<float>(), wf[DL_WARPS];
#pragma unroll
            for (int w = 0; w < DL_WARPS; ++w) m = fmaxf(m, gm[w]);
            float o = 0.f, l = 0.f;
#pragma unroll
            for (int w = 0; w < DL_WARPS; ++w) {
                wf[w] = gm[w] == neg_inf<float>() ? 0.f : __expf(gm[w] - m);
                o += scr[w * DL_HS + tid] * wf[w];
                l += gl[w] * wf[w];
            }
            float* to = mr + p * DL_MR;   // this block's slot in every block of the cluster
#pragma unroll
            for (int q = 0; q < DL_P; ++q) st_cluster(to + 4 + tid, (unsigned)q, o);
            if (tid == 0) {
#pragma unroll
                for (int q = 0; q < DL_P; ++q) {
                    st_cluster(to, (unsigned)q, m);
                    st_cluster(to + 1, (unsigned)q, l);
                }
            }
        }
    }
    dl_mark(9);
    cluster_sync();   // every block's m, l and outputs are in every block's mr (the last meeting:
                      // no block touches another's shared memory after it)
    dl_mark(10);
    if (tid < DL_HS) {   // the 8 parts merged, in block order; every part's values read first
                         // (a branch on each part's m made each wait for the one before)
        float mp[DL_P], lp[DL_P], yp[DL_P];
#pragma unroll
        for (int r = 0; r < DL_P; ++r) {
            mp[r] = mr[r * DL_MR];
            lp[r] = mr[r * DL_MR + 1];
            yp[r] = mr[r * DL_MR + 4 + tid];
        }
        float M = neg_inf<float>();
#pragma unroll
        for (int r = 0; r < DL_P; ++r) M = fmaxf(M, mp[r]);
        float Ls = 0.f, y = 0.f;
#pragma unroll
        for (int r = 0; r < DL_P; ++r) {
            if (mp[r] == neg_inf<float>()) continue;   // a part with no keys
            const float w = __expf(mp[r] - M);
            Ls += w * lp[r];
            y += w * yp[r];
        }
        yv[tid] = bad ? quiet_nan<float>() : dl_round<T>(y / Ls);
    }
    __syncthreads();
    dl_mark(11);
    // 5. y @ c_proj's weight, this block's NP columns -> partA[h][n0 ..)
    {
        const int nvp = NP / VEC, dg = DL_THREADS / nvp;
        const int cv = tid % nvp, g = tid / nvp;
        if (g < dg) {
            float acc[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
            for (int d = g; d < DL_HS; d += dg) {
                float w[VEC];
                dl_load<T>(wp + (long long)d * NP + cv * VEC, w);
                const float yd = yv[d];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] += yd * w[e];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) scr[g * NP + cv * VEC + e] = acc[e];
        }
        __syncthreads();
        for (int c = tid; c < NP; c += DL_THREADS) {
            float a = 0.f;
            for (int r = 0; r < dg; ++r) a += scr[r * NP + c];
            __stcg(partA + (long long)h * C + n0 + c, a);
        }
    }
    dl_mark(12);
    dl_trace_out(0);
}

// ------------------------------------------------------------------------------------------
// layer_mlp. Dynamic shared memory (dl_mlp_shared; decoder.py's _mlp_shared):
//   wf  T[C][NH]   c_fc's weight, the block's NH = 4 VEC columns
//   w2  T[NH][C]   the MLP projection's weight, the same NH rows
//   vs  T[3][C]    the attention's projection bias, LN2's weight and bias
//   bfs T[NH]      c_fc's bias, the block's columns
//   xs  float[C]   LN2(x')
//   red float[DL_WARPS][NH]
//   hv  float[NH]  GELU(...), rounded
//   rv  float[8][C / 8]  the eighth of the MLP's output row this block sums: block q's
//                  partial at slot q, stored there by block q
//   sh  float[32]
struct MlpSm {
    int wf, w2, vs, bfs, xs, red, hv, rv, sh, total;
};

template <typename T> FORGE_D MlpSm dl_mlp_shared(int C) {
    constexpr int NH = 4 * Vec16<T>::N;
    MlpSm s;
    int at = 0;
    s.wf = at; at += C * NH * (int)sizeof(T);
    s.w2 = at; at += NH * C * (int)sizeof(T);
    s.vs = at; at += 3 * C * (int)sizeof(T);
    s.bfs = at; at += NH * (int)sizeof(T);
    s.xs = at; at += C * 4;
    s.red = at; at += DL_WARPS * NH * 4;
    s.hv = at; at += NH * 4;
    s.rv = at; at += C * 4;
    s.sh = at; at += 32 * 4;
    s.total = at;
    return s;
}

template <typename T>
__device__ void layer_mlp_impl(const float* xa, const T* bproj, const float* partA, int H,
                               const T* g2, const T* b2, const T* Wfc, const T* bfc,
                               const T* Wfc2, float* xb, float* partB, int C, float eps) {
    constexpr int VEC = Vec16<T>::N, NH = 4 * VEC, PER = 16 / (int)sizeof(T);
    {   // this block's row of the batch: its workspace rows
        const int row = blockIdx.y;
        xa += (long long)row * C;
        partA += (long long)row * H * C;
        xb += (long long)row * C;
        partB += (long long)row * (gridDim.x / DL_P) * C;
    }
    extern __shared__ __align__(16) unsigned char dl_raw[];
    const MlpSm L = dl_mlp_shared<T>(C);
    T* wf = reinterpret_cast<T*>(dl_raw + L.wf);
    T* w2 = reinterpret_cast<T*>(dl_raw + L.w2);
    T* vs = reinterpret_cast<T*>(dl_raw + L.vs);
    T* bfs = reinterpret_cast<T*>(dl_raw + L.bfs);
    float* xs = reinterpret_cast<float*>(dl_raw + L.xs);
    float* red = reinterpret_cast<float*>(dl_raw + L.red);
    float* hv = reinterpret_cast<float*>(dl_raw + L.hv);
    float* rv = reinterpret_cast<float*>(dl_raw + L.rv);
    float* sh = reinterpret_cast<float*>(dl_raw + L.sh);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x;
    const int F = 4 * C, c0 = b * NH;   // this block's columns of c_fc: [c0, c0 + NH)
    dl_mark(0);
    cluster_arrive();   // started: with the cluster_wait before step 4's stores into other
                        // blocks (a block's shared memory is there to store into once it runs)
    // 1. the block's weights, before the previous kernel ends: the vectors (read first after
    //    the wait) a group of their own, then the matrices (waited for after LN2)
    dl_stage3<T, DL_THREADS>(vs, bproj, g2, b2, C);
    if (tid < NH / PER) cp_async16(smem_u32(bfs + tid * PER), bfc + c0 + tid * PER, true);
    cp_async_commit();
    for (int i = tid; i < C * (NH / PER); i += DL_THREADS) {
        const int k = i / (NH / PER), sg = i % (NH / PER);
        cp_async16(smem_u32(wf + (long long)k * NH + sg * PER),
                   Wfc + (long long)k * F + c0 + sg * PER, true);
    }
    for (int i = tid; i < NH * (C / PER); i += DL_THREADS) {
        const int j = i / (C / PER), sg = i % (C / PER);
        cp_async16(smem_u32(w2 + (long long)j * C + sg * PER),
                   Wfc2 + (long long)(c0 + j) * C + sg * PER, true);
    }
    cp_async_commit();
    dl_mark(1);
    pdl_wait();
    dl_mark(2);
    pdl_launch_dependents();
    cp_async_wait<1>();   // the vectors
    __syncthreads();
    // 2. x' and its layernorm
    float x[DL_XPT];
    const float sum = dl_gather<T>(x, xs, xa, vs, partA, H, C, sh);
    dl_mark(3);
    if (b == 0) {
#pragma unroll
        for (int i = 0; i < DL_XPT; ++i)
            if (tid + i * DL_THREADS < C) __stcg(xb + tid + i * DL_THREADS, x[i]);
    }
    float mean, rstd;
    dl_stats(x, C, eps, sum, sh + DL_WARPS, mean, rstd);
#pragma unroll
    for (int i = 0; i < DL_XPT; ++i) {
        const int c = tid + i * DL_THREADS;
        if (c < C) xs[c] = (x[i] - mean) * rstd * ldf(vs[C + c]) + ldf(vs[2 * C + c]);
    }
    dl_mark(4);
    cp_async_wait<0>();
    __syncthreads();
    dl_mark(5);
    // 3. the block's NH columns of c_fc: 4 column vectors, 64 row groups (the lanes of a warp
    //    with the same column vector meet by shuffles, the warps in shared memory)
    {
        const int cv = tid & 3, g = tid >> 2;
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
        for (int k = g; k < C; k += DL_THREADS / 4) {
            float w[VEC];
            dl_load<T>(wf + (long long)k * NH + cv * VEC, w);
            const float xv = xs[k];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += xv * w[e];
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
        if (lane < 4) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) red[warp * NH + cv * VEC + e] = acc[e];
        }
        __syncthreads();
        if (tid < NH) {
            float a = ldf(bfs[tid]);
            for (int w = 0; w < DL_WARPS; ++w) a += red[w * NH + tid];
            hv[tid] = dl_round<T>(gelu_f(a));
        }
        __syncthreads();
    }
    dl_mark(6);
    // 4. those NH rows of the projection: a partial row of C, each eighth of it stored straight
    //    into the block of the cluster that sums that eighth (its rv, at this block's slot)
    const int rank = b % DL_P, w8 = C / DL_P;   // w8 a multiple of 8: a vector is in one eighth
    cluster_wait();   // every block of the cluster has started (long since: no wait in practice)
    for (int cv = tid; cv < C / VEC; cv += DL_THREADS) {
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
#pragma unroll 4
        for (int j = 0; j < NH; ++j) {
            float w[VEC];
            dl_load<T>(w2 + (long long)j * C + cv * VEC, w);
            const float hj = hv[j];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += hj * w[e];
        }
        const int c = cv * VEC, q = c / w8;
        float* to = rv + rank * w8 + (c - q * w8);
#pragma unroll
        for (int e = 0; e < VEC; e += 4)
            st_cluster4(to + e, (unsigned)q, acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
    }
    dl_mark(7);
    cluster_sync();   // every block's eighths are in (the last meeting: no block touches another's
                      // shared memory after it)
    dl_mark(8);
    // 5. this block's eighth, columns [rank C / 8, (rank + 1) C / 8), summed over the cluster's
    //    8 blocks in block order -> partB[cluster]
    {
        const int cl = b / DL_P;
        for (int c = tid; c < w8; c += DL_THREADS) {
            float a = 0.f;
#pragma unroll
            for (int q = 0; q < DL_P; ++q) a += rv[q * w8 + c];
            __stcg(partB + (long long)cl * C + rank * w8 + c, a);
        }
    }
    dl_mark(9);
    dl_trace_out(1);
}

// ------------------------------------------------------------------------------------------
// head: LN_f of x'' and the logits, then with `greedy` the argmax by the last block to finish
// (each block's (best, index) in argp, a counter that the last block resets to 0).
// decoder.py's _head_grid sizes the grid, _head_rows and _head_shared the slots.
//
// float32 (DL_HEAD_STREAM): the head's rows (154 MB at GPT-2's vocabulary, three times L2)
// stream through shared memory: warp w of the grid (gw of nw) owns the groups of G rows q =
// gw, gw + nw, ... and copies each into one of its DL_HEAD_SLOTS slots (cp.async, one commit
// group a slot), DL_HEAD_SLOTS groups ahead of the one it reduces; its first DL_HEAD_SLOTS
// groups are asked for before the wait, under the last layer's kernel (the weights are no
// kernel's output). lm_head_rows (bf16) loads 8 rows into registers a warp, reduces them and
// only then asks for the next 8: 4 KB a warp in flight, a quarter of a float32 row each. The
// sums are lm_head_rows's (lane l adds columns VEC i .. VEC i + VEC - 1 for i = l, l + 32, ...
// in order, then the warp's sum): the same arithmetic either way. Batch-1 greedy generate() (H100,
// 2026-12-07, three rounds against lm_head_rows): float32 +2.6%, +1.3%, +1.8%; bf16 -0.7%,
// -0.2%, -2.4% (the head's rows 4 us faster in the trace, the last layer's kernel and the
// release slower by as much under the early copies), so bf16 keeps lm_head_rows.
template <typename T> constexpr bool DL_HEAD_STREAM = sizeof(T) == 4;

// The copy of group q (rows q G .. q G + G - 1, those below Vp) into `slot`, by the warp's 32
// lanes, 16 bytes a copy. The caller commits.
template <typename T>
FORGE_D void dl_head_fetch(T* slot, const T* head, int q, int G, int C, int Vp, int lane) {
    const int r0 = q * G, rows = min(G, Vp - r0);
    if (rows <= 0) return;
    const int n16 = rows * C * (int)sizeof(T) / 16;
    const char* src = reinterpret_cast<const char*>(head + (long long)r0 * C);
    for (int c = lane; c < n16; c += 32)
        cp_async16(smem_u32(reinterpret_cast<char*>(slot) + 16 * c), src + 16 * c, true);
}

// The warp's slots: DL_HEAD_SLOTS of G C elements each, after the slots of the warps before
// it in the block's dynamic shared memory.
template <typename T> FORGE_D T* dl_head_slots(unsigned char* raw, int G, int C) {
    return reinterpret_cast<T*>(raw) + (long long)(threadIdx.x >> 5) * DL_HEAD_SLOTS * G * C;
}

// Before the wait: the warp's first DL_HEAD_SLOTS groups, a commit group each (empty where the
// warp has fewer groups: every thread's count of groups stays the loop's).
template <typename T>
FORGE_D void dl_head_prefetch(unsigned char* raw, const T* head, int G, int C, int Vp) {
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nw = gridDim.x * (blockDim.x >> 5);
    T* slots = dl_head_slots<T>(raw, G, C);
#pragma unroll
    for (int k = 0; k < DL_HEAD_SLOTS; ++k) {
        dl_head_fetch(slots + k * G * C, head, gw + k * nw, G, C, Vp, lane);
        cp_async_commit();
    }
}

// The logits of the warp's groups (xs: LN_f(x''), C floats in shared memory), each group
// reduced once its slot has arrived, the group DL_HEAD_SLOTS ahead then asked for into that
// slot; logits[n] and the lane-0 argmax as lm_head_rows (the same sums). G <= 4.
template <typename T>
FORGE_D void dl_head_rows(unsigned char* raw, const float* xs, const T* head, int G, int C,
                          int Vp, int V, float* logits, float& best, int& bi) {
    constexpr int VEC = Vec16<T>::N;
    const int lane = threadIdx.x & 31, nv = C / VEC;
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nw = gridDim.x * (blockDim.x >> 5), ng = (Vp + G - 1) / G;
    T* slots = dl_head_slots<T>(raw, G, C);
    for (int k = 0, q = gw; q < ng; ++k, q += nw) {
        T* slot = slots + (k % DL_HEAD_SLOTS) * G * C;
        cp_async_wait<DL_HEAD_SLOTS - 1>();   // group q's copies, this lane's
        __syncwarp();                         // and every lane's
        float a[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = 0.f;
        for (int i = lane; i < nv; i += 32) {
            uint4 w16[4];
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (r < G) w16[r] = *reinterpret_cast<const uint4*>(slot + r * C + i * VEC);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                if (r < G) {
                    float w[VEC];
                    Vec16<T>::widen(w16[r], w);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) a[r] += xs[i * VEC + e] * w[e];
                }
            }
        }
        __syncwarp();   // every lane is done with the slot before it is refilled
        dl_head_fetch(slot, head, q + DL_HEAD_SLOTS * nw, G, C, Vp, lane);
        cp_async_commit();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            if (r < G) {
                const float v = warp_sum(a[r]);
                const int n = q * G + r;
                if (lane == 0 && n < Vp) {
                    __stcg(logits + n, v);
                    if (n < V) argmax_take(v, n, best, bi);
                }
            }
        }
    }
}
template <typename T>
__device__ void decode_head_impl(const float* xb, const T* bias, const float* partB, int SB,
                                 const T* gf, const T* bf, const T* head, float* logits, int C,
                                 int Vp, int V, float eps, int greedy, int* ids, int* posp,
                                 int* hist, float* argp, unsigned* counter, int G) {
    constexpr int NT = DL_HEAD_WARPS * 32;
    extern __shared__ __align__(16) unsigned char dl_raw[];   // the warps' slots
    // this block's row of the batch (the greedy choice's rows below)
    xb += (long long)blockIdx.y * C;
    partB += (long long)blockIdx.y * SB * C;
    logits += (long long)blockIdx.y * Vp;
    __shared__ float xs[DL_CMAX];
    __shared__ __align__(16) T vs[3 * DL_CMAX];   // the MLP's projection bias, LN_f's weight, bias
    __shared__ float sh[32], sv[32];
    __shared__ int si[32];
    __shared__ int last;
    const int tid = threadIdx.x;
    dl_mark(0);
    dl_stage3<T, NT>(vs, bias, gf, bf, C);   // weights: before the wait
    cp_async_commit();
    if constexpr (DL_HEAD_STREAM<T>) dl_head_prefetch<T>(dl_raw, head, G, C, Vp);
    dl_mark(1);
    pdl_wait();
    dl_mark(2);
    pdl_launch_dependents();
    if constexpr (DL_HEAD_STREAM<T>) cp_async_wait<DL_HEAD_SLOTS>();   // the vectors, not rows
    else cp_async_wait<0>();
    __syncthreads();
    // the mean from the gather's own sums; their barrier publishes xs
    const float mean =
        dl_block_sum<DL_HEAD_WARPS>(dl_gather_rows<T, NT>(xs, xb, vs, partB, SB, C), sh) / float(C);
    dl_mark(3);
    float v = 0.f;
    for (int c = tid; c < C; c += NT) {
        const float d = xs[c] - mean;
        v += d * d;
    }
    const float var = dl_block_sum<DL_HEAD_WARPS>(v, sh + DL_HEAD_WARPS) / float(C);
    const float rstd = var < -neg_inf<float>() ? 1.f / sqrtf(var + eps) : quiet_nan<float>();
    for (int c = tid; c < C; c += NT) xs[c] = (xs[c] - mean) * rstd * ldf(vs[C + c]) + ldf(vs[2 * C + c]);
    __syncthreads();
    dl_mark(4);
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    if constexpr (DL_HEAD_STREAM<T>)
        dl_head_rows<T>(dl_raw, xs, head, G, C, Vp, V, logits, best, bi);
    else
        lm_head_rows<T, DL_HEAD_ROWS, DL_HEAD_WARPS>(xs, head, C, Vp, V, logits, best, bi);
    dl_mark(5);
    if (!greedy) {
        dl_trace_out(2);
        return;
    }
    // the row's (best, index) slots, its counter; counter[gridDim.y] counts the rows whose
    // choice is made (the last one moves the position)
    const int row = blockIdx.y;
    unsigned* rows_done = counter + gridDim.y;
    argp += 2LL * row * gridDim.x;
    counter += row;
    block_argmax(best, bi, sv, si);
    if (tid == 0) {
        __stcg(argp + 2 * blockIdx.x, best);
        __stcg(reinterpret_cast<int*>(argp) + 2 * blockIdx.x + 1, bi);
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    dl_mark(6);
    if (!last) {
        dl_trace_out(2);
        return;
    }
    __threadfence();
    best = neg_inf<float>();
    bi = 0x7fffffff;
    for (int k = tid; k < (int)gridDim.x; k += NT)
        argmax_take(__ldcg(argp + 2 * k), __ldcg(reinterpret_cast<const int*>(argp) + 2 * k + 1),
                    best, bi);
    block_argmax(best, bi, sv, si);
    if (tid == 0) {
        hist[row] = isfinite(best) ? bi : -1;   // -1: no finite largest logit (greedy.cu)
        ids[row] = bi;                          // after hist, which may be ids
        *counter = 0u;
        if (gridDim.y == 1) {
            posp[0] = __ldcg(posp) + 1;
        } else {                           // moved once, by the last row to choose
            __threadfence();
            if (atomicAdd(rows_done, 1u) == gridDim.y - 1) {
                posp[0] = __ldcg(posp) + 1;
                *rows_done = 0u;
            }
        }
    }
    dl_mark(7);
    dl_trace_out(2);
}

#define FORGE_DECODE_LAYERS(T, S)                                                              \
    extern "C" __global__ void __launch_bounds__(DL_THREADS, 2)                               \
        layer_attn_##S(const int* ids, const int* posp, const T* wte, const T* wpe, int first, \
                       const float* xres, const T* bprev, const float* partB, int SB,          \
                       const T* g1, const T* b1, const T* Wqkv, const T* bqkv,                 \
                       const T* Wproj, T* kc, T* vc, float* xa, float* partA, int C,           \
                       int Tmax, float eps) {                                                  \
        layer_attn_impl<T>(ids, posp, wte, wpe, first, xres, bprev, partB, SB, g1, b1, Wqkv,   \
                           bqkv, Wproj, kc, vc, xa, partA, C, Tmax, eps);                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(DL_THREADS, 2)                               \
        layer_mlp_##S(const float* xa, const T* bproj, const float* partA, int H,             \
                      const T* g2, const T* b2, const T* Wfc, const T* bfc, const T* Wfc2,     \
                      float* xb, float* partB, int C, float eps) {                             \
        layer_mlp_impl<T>(xa, bproj, partA, H, g2, b2, Wfc, bfc, Wfc2, xb, partB, C, eps);     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(DL_HEAD_WARPS * 32, 2)                       \
        decode_head_##S(const float* xb, const T* bias, const float* partB, int SB,           \
                        const T* gf, const T* bf, const T* head, float* logits, int C,         \
                        int Vp, int V, float eps, int greedy, int* ids, int* posp, int* hist,  \
                        float* argp, unsigned* counter, int G) {                               \
        decode_head_impl<T>(xb, bias, partB, SB, gf, bf, head, logits, C, Vp, V, eps, greedy, \
                            ids, posp, hist, argp, counter, G);                                \
    }
FORGE_DECODE_LAYERS(float, f32)
FORGE_DECODE_LAYERS(bf16, bf16)
