// pasted into every backends/cuda/*.cu by runtime.kernel_source (backends/cuda/runtime.py)
// common.cuh: what every kernel file of forge-ml shares: the bf16 storage type and its
// conversions, the accumulation type of each storage type, float/double math overloads,
// warp and block reductions, the online (max, sum) pair of softmax, and Philox4x32-10.
//
// The Python loader pastes this file in place of the line `#include "common.cuh"`, so NVRTC
// needs no include path and CuPy's kernel cache key covers this text too. No system header is
// used: NVRTC has none, and the few bit casts we need are CUDA intrinsics.
#ifndef FORGE_COMMON_CUH
#define FORGE_COMMON_CUH

#define FORGE_HD __host__ __device__ __forceinline__
#define FORGE_D __device__ __forceinline__

// bf16 as raw bits: cupy stores ml_dtypes.bfloat16 arrays as 2-byte words, and doing the
// conversions ourselves keeps the kernels free of cuda_bf16.h.
struct bf16 {
    unsigned short bits;
};

FORGE_HD unsigned int f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    unsigned int u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}

FORGE_HD float bits_f32(unsigned int u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}

FORGE_HD float bf16_to_f32(bf16 h) { return bits_f32(((unsigned int)h.bits) << 16); }

// Round to nearest, ties to even (what ml_dtypes and PyTorch do); NaN stays a quiet NaN.
FORGE_HD bf16 f32_to_bf16(float f) {
    unsigned int u = f32_bits(f);
    bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x0040u);
        return h;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    h.bits = (unsigned short)(u >> 16);
    return h;
}

// Acc<T>::type: the type a kernel accumulates T in (float for float and bf16).
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

// ldf: widen a stored value to its accumulation type.
FORGE_D float ldf(float x) { return x; }
FORGE_D double ldf(double x) { return x; }
FORGE_D float ldf(bf16 x) { return bf16_to_f32(x); }

// One stored value read through L2 only (ld.global.cg, as Vec16::raw), widened to float: what
// another SM wrote during the kernel (decode_model.cu), or a weight loaded before pdl_wait
// (gemv.cu).
FORGE_D float ldcg_f(const float* p) { return __ldcg(p); }
FORGE_D float ldcg_f(const bf16* p) {
    bf16 h;
    h.bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return bf16_to_f32(h);
}

// To<T>::from(a): narrow an accumulated value back to storage type T (rounding once).
template <typename T> struct To;
template <> struct To<float> {
    static FORGE_D float from(float a) { return a; }
    static FORGE_D float from(double a) { return (float)a; }
};
template <> struct To<double> {
    static FORGE_D double from(float a) { return (double)a; }
    static FORGE_D double from(double a) { return a; }
};
template <> struct To<bf16> {
    static FORGE_D bf16 from(float a) { return f32_to_bf16(a); }
    static FORGE_D bf16 from(double a) { return f32_to_bf16((float)a); }
};

// Math overloads so one template body serves float and double.
FORGE_D float fm_exp(float x) { return expf(x); }
FORGE_D double fm_exp(double x) { return exp(x); }
FORGE_D float fm_log(float x) { return logf(x); }
FORGE_D double fm_log(double x) { return log(x); }
FORGE_D float fm_sqrt(float x) { return sqrtf(x); }
FORGE_D double fm_sqrt(double x) { return sqrt(x); }
FORGE_D float fm_tanh(float x) { return tanhf(x); }
FORGE_D double fm_tanh(double x) { return tanh(x); }
FORGE_D float fm_max(float a, float b) { return fmaxf(a, b); }
FORGE_D double fm_max(double a, double b) { return fmax(a, b); }

#define FORGE_LOG2E 1.4426950408889634f   // log2(e): exp(x) = exp2(x log2e)

template <typename A> FORGE_D A neg_inf();
template <> FORGE_D float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> FORGE_D double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }
template <typename A> FORGE_D A quiet_nan();
template <> FORGE_D float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> FORGE_D double quiet_nan<double>() { return __longlong_as_double(0x7ff8000000000000ULL); }

// GPT-2's GELU, tanh approximation: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))).
template <typename A> FORGE_D A gelu_f(A v) {
    const A k0 = A(0.7978845608028654), k1 = A(0.044715);
    return A(0.5) * v * (A(1) + fm_tanh(k0 * (v + k1 * v * v * v)));
}

// Sum over the 32 lanes of a warp; every lane gets the total (butterfly order, deterministic).
template <typename A> FORGE_D A warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets the
// total. `sh` is __shared__ scratch of 32 elements; safe to call several times in a row.
template <typename A> __device__ A block_sum(A v, A* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = (threadIdx.x < nwarps) ? sh[threadIdx.x] : A(0);
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// LayerNorm's corrected two-pass statistics (Chan, Golub and LeVeque), as the CPU backend's:
// m0 the plain mean of a row of C values, sd and ss the sums of d = x - m0 and of d^2 over the
// row. mean = m0 + sd / C and var = ss / C - (sd / C)^2 take m0's rounding error out of both,
// so that a constant row gets var = 0 exactly and its layernorm is beta (m0 alone left a residue
// that 1 / sqrt(eps) made 0.2 at values near 1000).
template <typename A> FORGE_D void ln_correct(A m0, A sd, A ss, int C, A eps, A& mean, A& rstd) {
    const A cd = sd / A(C);
    const A var = ss / A(C) - cd * cd;
    mean = m0 + cd;
    // a variance past A's range (inf, or inf - inf: rows of |x - mean| past ~1e19 / sqrt(C) in
    // float32) is none: NaN, so the row's output is NaN, not beta (1 / sqrt(inf) is 0)
    rstd = var < -neg_inf<A>() ? A(1) / fm_sqrt((var > A(0) ? var : A(0)) + eps) : quiet_nan<A>();
}

// numpy.argmax's order: whether (v, i) beats (best, bi). A NaN beats every number (the lowest
// id among NaNs), otherwise the larger value wins and the lowest id among equal values.
FORGE_D bool argmax_better(float v, int i, float best, int bi) {
    const bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > best || (v == best && i < bi);
}

// Fold (v, i) into a thread's running argmax (best, bi); start from (-inf, INT_MAX).
FORGE_D void argmax_take(float v, int i, float& best, int& bi) {
    if (argmax_better(v, i, best, bi)) {
        best = v;
        bi = i;
    }
}

// The argmax of a block (size a multiple of 32, at most 1024) from each thread's (best, bi):
// a butterfly within each warp, then thread 0 folds the winners of warps 1, 2, ... into warp
// 0's, in warp order; every thread gets the result. `sv`, `si`: __shared__ scratch of 32
// elements each; safe to call several times in a row.
FORGE_D void block_argmax(float& best, int& bi, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_take(v2, i2, best, bi);
    }
    __syncthreads();  // an earlier call's readers are done with sv[0], si[0]
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; ++w) argmax_take(sv[w], si[w], best, bi);
        sv[0] = best;
        si[0] = bi;
    }
    __syncthreads();
    best = sv[0];
    bi = si[0];
}

// The online softmax pair (m, s): s = sum of exp(x - m) over the values seen, m their max
// (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018).
template <typename A> FORGE_D void ms_add(A& m, A& s, A x) {
    if (x > m) {
        s = s * fm_exp(m - x) + A(1);
        m = x;
    } else if (!(x == neg_inf<A>())) {
        s += fm_exp(x - m);  // a NaN x lands here and makes s NaN
    }
}

template <typename A> FORGE_D void ms_merge(A& m, A& s, A m2, A s2) {
    const A M = fm_max(m, m2);
    const A a = (m == neg_inf<A>()) ? A(0) : s * fm_exp(m - M);
    const A b = (m2 == neg_inf<A>()) ? A(0) : s2 * fm_exp(m2 - M);
    m = M;
    s = a + b;
}

template <typename A> FORGE_D void warp_ms(A& m, A& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const A s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
    }
}

// (m, s) over a whole block (size a multiple of 32); every thread gets the result.
// `shm`, `shs`: __shared__ scratch of 32 elements each.
template <typename A> __device__ void block_ms(A& m, A& s, A* shm, A* shs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    warp_ms(m, s);
    __syncthreads();
    if (lane == 0) {
        shm[warp] = m;
        shs[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = (lane < nwarps) ? shm[lane] : neg_inf<A>();
        s = (lane < nwarps) ? shs[lane] : A(0);
        warp_ms(m, s);
        if (lane == 0) {
            shm[0] = m;
            shs[0] = s;
        }
    }
    __syncthreads();
    m = shm[0];
    s = shs[0];
}

// Philox4x32-10 (Salmon et al., SC'11), exactly as forge_ml/rng.py computes it.
struct u32x4 {
    unsigned int x, y, z, w;
};

FORGE_HD unsigned int mulhi32(unsigned int a, unsigned int b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return (unsigned int)(((unsigned long long)a * b) >> 32);
#endif
}

FORGE_HD u32x4 philox4x32_10(u32x4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = mulhi32(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned int hi1 = mulhi32(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        u32x4 n;
        n.x = hi1 ^ c.y ^ k0;
        n.y = lo1;
        n.z = hi0 ^ c.w ^ k1;
        n.w = lo0;
        c = n;
    }
    return c;
}

// A dropout site's stream from a seed held in device memory (ops.SeedAt): the splitmix64
// finalizer of (base * golden + site + 1) mod 2^64, forge_ml.rng.mix bit for bit.
FORGE_HD unsigned long long mix_seed(unsigned long long base, unsigned long long site) {
    unsigned long long z = base * 0x9E3779B97F4A7C15ULL + site + 1ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Four consecutive elements, loaded and stored as one vector (16 bytes for float32, 8 for
// bf16) when the pointers allow it; `aligned4` says whether they do.
template <typename T> struct alignas(4 * sizeof(T)) V4 {
    T v[4];
};

FORGE_D bool aligned4(const void* p, int elem_bytes) {
    return ((unsigned long long)p % (unsigned long long)(4 * elem_bytes)) == 0;
}

// Vec16<T>: one 16-byte load of Vec16<T>::N consecutive elements (4 float32, 2 float64, 8
// bf16), widened to the accumulation type; the pointer must be 16-byte aligned. raw() is the
// load alone and widen() the conversion, for a kernel that loads early and computes later.
// raw() reads through L2 only (ld.global.cg): a kernel launched with programmatic dependent
// launch may start before the previous kernel ends, and on the H200 loads through the
// read-only (texture) path then returned stale data even after pdl_wait().
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    enum { N = 4 };
    static FORGE_D uint4 raw(const float* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
    static FORGE_D void widen(uint4 v, float (&w)[4]) {
        w[0] = bits_f32(v.x);
        w[1] = bits_f32(v.y);
        w[2] = bits_f32(v.z);
        w[3] = bits_f32(v.w);
    }
    static FORGE_D void load(const float* p, float (&w)[4]) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    }
};
template <> struct Vec16<double> {
    enum { N = 2 };
    static FORGE_D uint4 raw(const double* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
    static FORGE_D void widen(uint4 v, double (&w)[2]) {
        w[0] = __hiloint2double((int)v.y, (int)v.x);
        w[1] = __hiloint2double((int)v.w, (int)v.z);
    }
    static FORGE_D void load(const double* p, double (&w)[2]) {
        const double2 v = *reinterpret_cast<const double2*>(p);
        w[0] = v.x;
        w[1] = v.y;
    }
};
template <> struct Vec16<bf16> {
    enum { N = 8 };
    static FORGE_D uint4 raw(const bf16* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
    static FORGE_D void widen(uint4 v, float (&w)[8]) {
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = bits_f32(u[i] << 16);
            w[2 * i + 1] = bits_f32(u[i] & 0xffff0000u);
        }
    }
    static FORGE_D void load(const bf16* p, float (&w)[8]) {
        widen(*reinterpret_cast<const uint4*>(p), w);
    }
};

// One round of the decoding attention's keys for a group of RK lanes (a power of two; lane r of
// the group holds elements [r V, (r + 1) V) of a row, V = Vec16<T>::N): the U key rows kr and
// value rows vr as loaded (16 bytes raw each; zeros where the group has no row), row u counted
// where first + u * stride < cnt. Each row's score against qr (the lane's part of q, scaled) is
// summed over the group by a butterfly (the caller's loop is uniform over the warp), and the
// group's running max mg, sum lg and outputs acc take the round in (online softmax, rescaled
// where the max grows). FAST: __expf (decode_layers.cu), else fm_exp (attention.cu).
template <bool FAST, typename A> FORGE_D A keys_exp(A x) {
    if constexpr (FAST) return __expf(x);
    else return fm_exp(x);
}
template <typename T, typename A, int U, bool FAST>
FORGE_D void decode_keys_round(const uint4 (&kr)[U], const uint4 (&vr)[U], int first, int stride,
                               int cnt, int RK, const A (&qr)[Vec16<T>::N], A& mg, A& lg,
                               A (&acc)[Vec16<T>::N]) {
    constexpr int V = Vec16<T>::N;
    A sc[U];
    A mx = mg;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        A w[V];
        Vec16<T>::widen(kr[u], w);
        A d = A(0);
#pragma unroll
        for (int i = 0; i < V; ++i) d += qr[i] * w[i];
        for (int off = RK >> 1; off > 0; off >>= 1)
            d += __shfl_xor_sync(0xffffffffu, d, off);
        sc[u] = (first + u * stride < cnt) ? d : neg_inf<A>();
        mx = fm_max(mx, sc[u]);
    }
    if (!(mx == neg_inf<A>())) {   // -inf: no key of this group yet
        const A c = (mg == neg_inf<A>()) ? A(0) : keys_exp<FAST>(mg - mx);
        lg *= c;
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] *= c;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const A pj = (sc[u] == neg_inf<A>()) ? A(0) : keys_exp<FAST>(sc[u] - mx);
            A w[V];
            Vec16<T>::widen(vr[u], w);
            lg += pj;
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += pj * w[i];
        }
        mg = mx;
    }
}

// sm_80+ (flash_attention.cu, cross_entropy.cu): asynchronous copies global -> shared
// (smem_u32 gives a shared-memory address as cp.async takes it), and bf16x2 rounding.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
FORGE_D unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared without a register round trip; when !valid nothing is read and
// the 16 bytes are zero-filled (src-size 0).
FORGE_D void cp_async16(unsigned dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

FORGE_D void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> FORGE_D void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats rounded to nearest-even bf16, `lo` in the low half (cvt puts its first source
// operand in the upper half).
FORGE_D unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Eight floats rounded to bf16, as one 16-byte vector (w[0] lowest).
FORGE_D uint4 pack8_bf16(const float (&w)[8]) {
    return make_uint4(pack_bf16x2(w[0], w[1]), pack_bf16x2(w[2], w[3]), pack_bf16x2(w[4], w[5]),
                      pack_bf16x2(w[6], w[7]));
}
#endif

// The row walk of the 16-byte column-sum kernels (gelu.cu's gelu_bwd_colsum8_bf16, reduce.cu's
// sum_rows8_partial_bf16): lane (tx, ty) of a (32 x 8) block owns the 8 columns from
// c0 = 8 (32 blockIdx.x + tx) of a row-major (R, K) array, over the rows ty, ty + 8, ... of the
// block's chunk [blockIdx.y chunk, + chunk). Two rows are in flight at a time: pair(o, o8) gets
// the element offsets of rows r and r + 8 (at column c0), one(o) a last row without its pair.
// The lane's rows reach pair and one in order, so sums taken there keep a fixed order.
template <class Pair, class One>
FORGE_D void colsum8_rows(long long R, int K, long long chunk, Pair pair, One one) {
    const int c0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    const long long r0 = (long long)blockIdx.y * chunk, r1 = min(R, r0 + chunk);
    if (c0 >= K) return;
    long long r = r0 + threadIdx.y;
    for (; r + 8 < r1; r += 16) {
        const long long o = r * K + c0;
        pair(o, o + 8LL * K);
    }
    if (r < r1) one(r * K + c0);
}

// The last step of the 16-byte column-sum kernels (gelu.cu's gelu_bwd_colsum8_bf16, reduce.cu's
// sum_rows8_partial_bf16): a (32 x 8) block whose lane (tx, ty) holds the sums s of columns
// 8 tx.. of 256 over its row group ty adds the 8 row groups in order, one thread a column, and
// writes the chunk's sums to part[blockIdx.y * K + column] (colsum_finish adds the chunks).
FORGE_D void colsum8_block_finish(const float (&s)[8], float* __restrict__ part, int K) {
    __shared__ float sh[8][257];
    const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
    for (int k = 0; k < 8; ++k) sh[ty][8 * tx + k] = s[k];
    __syncthreads();
    const int c = ty * 32 + tx, col = blockIdx.x * 256 + c;
    if (col < K) {
        float t = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) t += sh[j][c];
        part[(long long)blockIdx.y * K + col] = t;
    }
}

// Programmatic dependent launch (Hopper and later). A kernel launched with it (the backend's
// _launch(..., pdl=True)) may start while the previous kernel on the stream still runs: it must
// call pdl_wait() before it reads or writes anything that kernel (or an earlier one) may touch;
// what comes before may read only what no kernel of the stream writes (a model's weights).
// pdl_launch_dependents() lets the next kernel's blocks start; called after pdl_wait(), at most
// two kernels overlap. Both are no-ops for a plain launch and before sm_90.
FORGE_D void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
FORGE_D void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The GPU's global nanosecond clock (%globaltimer; comparable between SMs), for timings
FORGE_D unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread-block clusters (sm_90): cluster_sync() is a barrier of every thread of every block of
// the cluster (shared-memory writes before it are seen by the cluster's blocks after it);
// ld_cluster(p, r) reads the value at the shared-memory address of p in block r of the
// cluster (distributed shared memory). Only for kernels launched as clusters, on sm_90+.
FORGE_D void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
#endif
}
// The same barrier in two halves: cluster_arrive() after the last read of another block's
// shared memory, cluster_wait() before this block's shared memory may go (its exit), with work
// of the block's own between.
FORGE_D void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
FORGE_D void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
FORGE_D unsigned cluster_addr(const void* p, unsigned rank) {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
#endif
    return r;
}
// A generic address of the same shared-memory variable in block `rank` of the cluster (plain
// loads through it read that block's shared memory: structs, arrays).
template <class T> FORGE_D const T* cluster_map(const T* p, unsigned rank) {
    unsigned long long r = reinterpret_cast<unsigned long long>(p);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(r), "r"(rank));
#endif
    return reinterpret_cast<const T*>(r);
}
// This block's rank in its cluster (blockIdx.x % the cluster's size for clusters along x)
FORGE_D unsigned cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
FORGE_D float ld_cluster(const float* p, unsigned rank) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
#endif
    return v;
}
FORGE_D double ld_cluster(const double* p, unsigned rank) {
    double v = 0.0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(cluster_addr(p, rank)) : "memory");
#endif
    return v;
}

// st_cluster(p, r, v): v stored at the shared-memory address of p in block r of the cluster
// (seen there after a cluster barrier: its arrive releases the store); st_cluster4 four floats
// at a 16-byte aligned p.
FORGE_D void st_cluster(float* p, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr(p, rank)), "f"(v) : "memory");
#endif
}
FORGE_D void st_cluster4(float* p, unsigned rank, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(cluster_addr(p, rank)),
                 "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#endif
}

// Max over the 32 lanes of a warp; every lane gets it.
template <typename A> FORGE_D A warp_max(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fm_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Max over a block whose size is a multiple of 32 (at most 1024); every thread gets it.
// `sh`: __shared__ scratch of 32 elements; safe to call several times in a row (block_sum's
// pattern).
template <typename A> __device__ A block_max(A v, A* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = (threadIdx.x < nwarps) ? sh[threadIdx.x] : neg_inf<A>();
    if (warp == 0) v = warp_max(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// One element of an AdamW step (adamw.cu, many.cu; PyTorch's AdamW order of operations): the
// gradient scaled, the moments, the decoupled decay, then the step with bias corrections.
// The moments' products and sums are spelled out (fm_fma, fm_mul: never contracted again), as
// the compiler contracted them in adamw.cu's one-tensor kernel: left to it, the same
// expression inlined in many.cu's loop was contracted the other way round (v's fma took
// b2 v, not (1 - b2) g^2, as its product), and the two kernels' bits differed.
FORGE_D float fm_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
FORGE_D double fm_fma(double a, double b, double c) { return __fma_rn(a, b, c); }
FORGE_D float fm_mul(float a, float b) { return __fmul_rn(a, b); }
FORGE_D double fm_mul(double a, double b) { return __dmul_rn(a, b); }
template <typename P, typename G>
FORGE_D void adamw_step(P& p, P& m, P& v, G g, P lr, P b1, P b2, P eps, P wd, P bc1, P bc2,
                        P gscale) {
    const P gi = fm_mul(P(ldf(g)), gscale);
    m = fm_fma(m, b1, fm_mul(P(1) - b1, gi));              // b1 m + (1 - b1) g
    v = fm_fma(v, b2, fm_mul(gi, fm_mul(P(1) - b2, gi)));  // b2 v + (1 - b2) g^2
    p = p - lr * wd * p;
    p = p - lr * (m / bc1) / (fm_sqrt(v / bc2) + eps);
}

// ---- causal attention's per-thread pieces (flash_attention.cu, flash_hopper.cu) -----------
// Fragments are those of PTX's mma.m16n8k16 (g = lane / 4, t = lane % 4; a 32-bit register
// holds two bf16, the lower column in the low half), which wgmma's register operands share.

FORGE_D float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
FORGE_D float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// Where head bh's rows start in an operand of layout (sb, sh): head h of batch b at
// b * sb + h * sh (see flash_attention.cu's top).
FORGE_D long long head_base(long long bh, int H, long long sb, long long sh) {
    const int b = (int)bh / H, h = (int)bh - b * H;  // bh = blockIdx.x < 2^31
    return b * sb + h * sh;
}

// The A operands (16 rows from r0, all four 16-wide k-steps) of an (n, 64) bf16 matrix with
// row stride ld, read straight from global memory (once per block, so no staging); rows >= n
// are 0.
FORGE_D void load_a_frags(unsigned (&a)[4][4], const bf16* src, int r0, int n, int g, int t,
                          int ld) {
    const unsigned* lo = reinterpret_cast<const unsigned*>(src + (long long)(r0 + g) * ld);
    const unsigned* hi = lo + 8 * (long long)ld / 2;  // row r0 + g + 8
    const bool vlo = r0 + g < n, vhi = r0 + g + 8 < n;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        a[ks][0] = vlo ? lo[8 * ks + t] : 0u;  // columns 16ks + 2t, +1
        a[ks][1] = vhi ? hi[8 * ks + t] : 0u;
        a[ks][2] = vlo ? lo[8 * ks + 4 + t] : 0u;  // columns 16ks + 8 + 2t, +1
        a[ks][3] = vhi ? hi[8 * ks + 4 + t] : 0u;
    }
}

// Max and sum over the four lanes of a quad (one row's threads); every lane gets it.
FORGE_D float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

FORGE_D float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// (D_lo, D_hi) = rowsum(dout * out) of this thread's rows r0 + g and r0 + g + 8 (every lane of
// the quad gets them): dout's A fragments df of the warp's 16 rows against out (row stride ld,
// rows >= n zero) read at the same positions. The backward's dq kernels (flash_attention.cu,
// flash_hopper.cu): the same bits in both.
FORGE_D float2 frag_dsum(const unsigned (&df)[4][4], const bf16* out, int r0, int n, int g,
                         int t, int ld) {
    float d_lo = 0.f, d_hi = 0.f;
    unsigned of[4][4];
    load_a_frags(of, out, r0, n, g, t, ld);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
            d_lo += bf16_lo(of[ks][r]) * bf16_lo(df[ks][r]) +
                    bf16_hi(of[ks][r]) * bf16_hi(df[ks][r]);
            d_hi += bf16_lo(of[ks][r + 1]) * bf16_lo(df[ks][r + 1]) +
                    bf16_hi(of[ks][r + 1]) * bf16_hi(df[ks][r + 1]);
        }
    }
    return make_float2(quad_sum(d_lo), quad_sum(d_hi));
}

// The dq kernels' start on a lane's rows r_lo = w0 + g and r_hi = r_lo + 8 (flash_attention.cu,
// flash_hopper.cu): D = rowsum(dout * out) of each (frag_dsum), written to Dsum by the quad's
// lane t == 0 for the dk/dv kernel after, and each row's lse in log2 units (0 past Tq).
FORGE_D void dq_rows_d_lse(const unsigned (&df)[4][4], const bf16* out, const float* lse,
                           float* Dsum, long long bh, int w0, int Tq, int g, int t, int o_ld,
                           float& d_lo, float& d_hi, float& l2_lo, float& l2_hi) {
    const float2 dsum = frag_dsum(df, out, w0, Tq, g, t, o_ld);
    const int r_lo = w0 + g, r_hi = r_lo + 8;
    d_lo = dsum.x;
    d_hi = dsum.y;
    l2_lo = 0.f;
    l2_hi = 0.f;
    const float* L = lse + bh * Tq;
    float* D = Dsum + bh * Tq;
    if (r_lo < Tq) {
        l2_lo = L[r_lo] * FORGE_LOG2E;
        if (t == 0) D[r_lo] = d_lo;
    }
    if (r_hi < Tq) {
        l2_hi = L[r_hi] * FORGE_LOG2E;
        if (t == 0) D[r_hi] = d_hi;
    }
}

// Grid-stride loop over [0, n) with 64-bit indices.
#define FORGE_FOR(i, n)                                                          \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// The logits of an LM head: logits[n] = xs . head[n] for every row n < Vp of head (Vp, C)
// (16-byte rows), a warp per row, ROWS rows in flight, the block's WARPS warps and the grid's
// blocks taking rows in turn; the thread's running argmax over n < V (NumPy's ties) in best,
// bi (decode_model.cu, decode_layers.cu).
template <typename T, int ROWS, int WARPS>
__device__ void lm_head_rows(const float* xs, const T* head, int C, int Vp, int V, float* logits,
                             float& best, int& bi) {
    constexpr int VEC = Vec16<T>::N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nv = C / VEC;
    const int gw = blockIdx.x * WARPS + warp, nw = gridDim.x * WARPS;
    for (int n0 = gw * ROWS; n0 < Vp; n0 += nw * ROWS) {
        float a[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) a[r] = 0.f;
        for (int i = lane; i < nv; i += 32) {
            uint4 w16[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                w16[r] = n0 + r < Vp
                             ? __ldg(reinterpret_cast<const uint4*>(head + (long long)(n0 + r) * C) + i)
                             : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float w[VEC];
                Vec16<T>::widen(w16[r], w);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[r] += xs[i * VEC + e] * w[e];
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(a[r]);
            const int n = n0 + r;
            if (lane == 0 && n < Vp) {
                __stcg(logits + n, v);
                if (n < V) argmax_take(v, n, best, bi);
            }
        }
    }
}

#endif  // FORGE_COMMON_CUH
