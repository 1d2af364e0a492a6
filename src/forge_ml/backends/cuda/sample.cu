// launched from backends/cuda/sampling.py
// sample.cu: a decoding step's sampled choice, made on the device so that sampled steps chain
// without the host (temperature, top-k, top-p, min-p, repetition penalty), bit for bit the
// rule of forge_ml/sampling.py (sample_row; the CPU runs it through compose.sample_next):
//   z_j   = logits[b, j] for j < V; a token seen before (seen[b, j]) gets z/penalty when z > 0,
//           z*penalty otherwise;
//   T = 0: the argmax (numpy's order: a NaN first, then the lowest id among equal maxima);
//   w_j   = (uint32)(expf((z_j - max z) / T) * 2^24): integer weights, the top token's 2^24;
//   top-k (0 < k < V): keep w >= the k-th largest w (equal weights at the cut all kept);
//   top-p (0 < p < 1): keep w >= the largest t whose kept mass sum(w >= t) reaches
//           ceil(p * K), K the mass kept by top-k;
//   min-p (p > 0): keep w >= ceil(min_p * 2^24);
//   draw: word = Philox4x32-10((pos + 1, 0, 0, 0), key[b]).x (pos + 1: the position of the
//           token chosen, pos the one fed), target = floor(total * word / 2^32)
//           over the kept mass `total`; the token is the first id whose running kept mass
//           passes target.
// All sums are integers, so the choice does not depend on the order threads add in.
// Then ids[b] = out[b] = the token, seen[b, token] = 1, and the position goes up by one.
// seen: int32 (B, Vp), 1 where the row has seen the token (the penalty's context).
//
// One block (1024 threads) owns one row. Two kernels run the same passes with the same
// arithmetic and the same reductions, so they choose the same token:
//   sample_next_smem_f32: the row is read from global memory once (pass 1), each thread
//     keeping its logits in dynamic shared memory (4 V bytes: 201 KB for GPT-2's 50,257,
//     which an H100/H200 block may take once opted in); pass 2 turns them into their weights
//     in place, and every later pass reads the weights from there (no expf, no global load);
//   sample_next_f32: where 4 V bytes do not fit (a large vocabulary, a smaller GPU), every
//     pass reads the logits from global memory and recomputes the weights (a row of 50,257
//     weights does not fit a block's registers).
// sampling.py picks the kernel. The passes over a sampled row (V elements each):
//   1      the max and the argmax of z (global memory; staged, z is also kept);
//   2      staged only: z_j -> w_j, in place in shared memory;
//   3-6    top-k: the k-th largest weight, a radix descent of 4 passes of 8 bits;
//   7      top-p: K, the mass the top-k cut keeps;
//   8-11   top-p: the cut, 4 more radix passes;
//   12     the kept mass of each warp's range of ids;
//   13     the chosen warp alone scans its range (1/32 of the row) for the token.
// A cut that is off skips its passes; T = 0 (or a NaN) stops after pass 1.
#include "common.cuh"

#define SN_THREADS 1024

// w_j, the integer weight of a logit z (the penalty applied): (uint32)(exp((z - m) / T) * 2^24),
// m the row's maximum, inv_t = 1 / T. Both kernels compute it here and only here, so the
// weight staged in shared memory has the bits that each pass of the fallback recomputes.
FORGE_D unsigned weight_of(float z, float m, float inv_t) {
    return (unsigned)(expf((z - m) * inv_t) * 16777216.0f);
}

// A row in global memory: its logits with the penalty applied, and their weights recomputed
// at every call (every pass of sample_next_f32).
struct Row {
    const float* z;
    const int* seen;
    float pen, m, inv_t;
    FORGE_D bool penalized() const { return seen != nullptr && pen != 1.0f; }
    // the logit z of a token with the penalty applied when the row has seen it (s != 0)
    FORGE_D float penalty(float v, int s) const {
        if (s) v = v > 0.0f ? v / pen : v * pen;
        return v;
    }
    FORGE_D float logit(int j) const { return penalized() ? penalty(z[j], seen[j]) : z[j]; }
    FORGE_D unsigned weight(int j) const { return weight_of(logit(j), m, inv_t); }
};

// A row staged in shared memory (sample_next_smem_f32): the weights themselves, from pass 2.
struct StagedRow {
    const unsigned* w;
    FORGE_D unsigned weight(int j) const { return w[j]; }
};

FORGE_D unsigned long long block_sum_u64(unsigned long long v, unsigned long long* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    unsigned long long s = 0;
    for (int w = 0; w < nw; ++w) s += sh[w];
    __syncthreads();
    return s;
}

// The largest value v of the kept weights (w >= floor_) such that the kept weights >= v
// count at least `need` (by_mass 0) or weigh at least `need` (by_mass 1): a radix descent,
// 8 bits a pass (4 passes over src's weights), over a 256-bin histogram in shared memory.
template <class Src>
FORGE_D unsigned radix_select(const Src& src, int V, unsigned floor_, unsigned long long need,
                              int by_mass, unsigned long long* hist, unsigned* shared_sel) {
    unsigned prefix = 0, mask = 0;
    unsigned long long remaining = need;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        // Most weights share a digit (the small ones: digit 0), so the lanes of a warp with
        // one digit add their counts or masses first and one of them adds to shared memory:
        // one atomic per digit per warp instead of one per element (the block's 32 warps x
        // 50 iterations, not 50,257 atomics on one address).
        for (int j0 = 0; j0 < V; j0 += blockDim.x) {  // every thread takes every iteration
            const int j = j0 + threadIdx.x;
            const unsigned w = j < V ? src.weight(j) : 0u;
            const bool cand = j < V && w >= floor_ && (w & mask) == prefix;
            const unsigned key = cand ? (w >> shift) & 255u : 0xffffffffu;
            const unsigned peers = __match_any_sync(0xffffffffu, key);
            const unsigned part = by_mass ? __reduce_add_sync(peers, cand ? w : 0u)  // < 2^29
                                          : (unsigned)__popc(peers);
            if (cand && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
                atomicAdd(&hist[key], (unsigned long long)part);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long above = 0;
            int d = 255;
            for (; d > 0; --d) {
                if (above + hist[d] >= remaining) break;
                above += hist[d];
            }
            shared_sel[0] = (unsigned)d;
            shared_sel[1] = (unsigned)(above & 0xffffffffull);
            shared_sel[2] = (unsigned)(above >> 32);
        }
        __syncthreads();
        const unsigned d = shared_sel[0];
        remaining -= ((unsigned long long)shared_sel[2] << 32) | shared_sel[1];
        prefix |= d << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// Passes 3 to 13 of a sampled row: the cuts (top-k, top-p, min-p) and the draw over the
// weights src.weight(j), j < V; `key`: the row's two Philox key words. Every thread of the
// block returns the token.
template <class Src>
FORGE_D int draw_token(const Src& src, int V, int k, float ptop, float pmin, int p_at,
                       const unsigned* key, unsigned long long* hist, unsigned long long* red,
                       unsigned* sel) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    unsigned floor_ = 0;
    // passes 3-6, top-k: the k-th largest weight
    if (k > 0 && k < V) floor_ = radix_select(src, V, 0u, (unsigned long long)k, 0, hist, sel);
    if (ptop > 0.0f && ptop < 1.0f) {
        // pass 7, top-p: K, the mass the top-k cut keeps
        unsigned long long K = 0;
        for (int j = t; j < V; j += blockDim.x) {
            const unsigned w = src.weight(j);
            if (w >= floor_) K += w;
        }
        K = block_sum_u64(K, red);
        // passes 8-11: the largest cut whose kept mass reaches ceil(p K)
        const unsigned long long need = (unsigned long long)ceil((double)ptop * (double)K);
        const unsigned tp = radix_select(src, V, floor_, need, 1, hist, sel);
        floor_ = max(floor_, tp);
    }
    if (pmin > 0.0f) floor_ = max(floor_, (unsigned)ceil((double)pmin * 16777216.0));
    // pass 12: each warp owns a contiguous range of ids; its kept mass, then a scan over warps
    const int R = (V + nw - 1) / nw, lo = warp * R, hi = min(V, lo + R);
    unsigned long long mine = 0;
    for (int j = lo + lane; j < hi; j += 32) {
        const unsigned w = src.weight(j);
        if (w >= floor_) mine += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    if (lane == 0) red[warp] = mine;
    __syncthreads();
    if (t == 0) {
        unsigned long long total = 0;
        for (int w = 0; w < nw; ++w) total += red[w];
        const u32x4 r = philox4x32_10(u32x4{(unsigned)p_at, 0u, 0u, 0u}, key[0], key[1]);
        const unsigned long long word = r.x, th = total >> 32, tl = total & 0xffffffffull;
        const unsigned long long target = th * word + ((tl * word) >> 32);
        unsigned long long base = 0;
        int wsel = nw - 1;
        for (int w = 0; w < nw; ++w) {
            if (base + red[w] > target) {
                wsel = w;
                break;
            }
            base += red[w];
        }
        sel[0] = (unsigned)wsel;
        hist[0] = target - base;  // the target within the chosen warp's range
    }
    __syncthreads();
    // pass 13: the chosen warp scans its range, 32 ids at a time, for the first id whose
    // running kept mass passes the target
    if (warp == (int)sel[0]) {
        const unsigned long long goal = hist[0];
        unsigned long long run = 0;
        int found = -1;
        for (int j0 = lo; j0 < hi && found < 0; j0 += 32) {
            const int j = j0 + lane;
            unsigned long long w = 0;
            if (j < hi) {
                const unsigned wj = src.weight(j);
                w = wj >= floor_ ? wj : 0u;
            }
            unsigned long long inc = w;  // inclusive scan over the lanes
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += n;
            }
            const bool past = run + inc > goal && w > 0;
            const unsigned hit = __ballot_sync(0xffffffffu, past);
            if (hit) found = j0 + __ffs(hit) - 1;
            run += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (lane == 0) sel[1] = (unsigned)(found < 0 ? lo : found);
    }
    __syncthreads();
    return (int)sel[1];
}

// Row b = blockIdx.x's choice. STAGED: the row goes through `sw`, V words of dynamic shared
// memory (sample_next_smem_f32); else every pass reads global memory (sw unused).
template <bool STAGED>
FORGE_D void sample_block(const float* logits, int V, int Vp, const float* knobs,
                          const unsigned* keys, int* seen, int has_seen, int* ids, int* out,
                          int* pos, int npos, unsigned* sw) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long red[32];
    __shared__ unsigned sel[4];
    const int b = blockIdx.x, t = threadIdx.x;
    const float* kn = knobs + (long long)b * 5;
    const float temp = kn[0], ptop = kn[2], pmin = kn[3];
    const int k = (int)kn[1];
    Row row;
    row.z = logits + (long long)b * Vp;
    row.seen = has_seen ? seen + (long long)b * Vp : nullptr;
    row.pen = kn[4];
    row.m = 0.0f;
    row.inv_t = 1.0f;
    const int p_at = pos[npos == 1 ? 0 : b] + 1;  // the position of the token chosen
    const bool stage = STAGED && temp > 0.0f;      // a greedy row needs no weights

    // pass 1 (global memory): the maximum and the argmax (numpy's order) of the logits with
    // the penalty applied; staged, each thread also keeps its logits' bits for pass 2. Thread
    // t takes ids t, t + blockDim.x, ... in that order, P at a time: their loads first, all
    // in flight together (one block reads the row, so latency, not bandwidth, bounds this
    // pass), the ids past V reading id V - 1 and then skipped.
    constexpr int P = 4;
    const int nt = blockDim.x;
    const bool pen_on = row.penalized();
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    for (int j0 = t; j0 < V; j0 += P * nt) {
        float v[P];
        int s[P];
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const int j = min(j0 + u * nt, V - 1);
            v[u] = row.z[j];
            s[u] = pen_on ? row.seen[j] : 0;
        }
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const int j = j0 + u * nt;
            if (j < V) {
                const float x = row.penalty(v[u], s[u]);  // row.logit(j)
                if (stage) sw[j] = __float_as_uint(x);
                argmax_take(x, j, best, bi);
            }
        }
    }
    block_argmax(best, bi, sv, si);  // every thread gets the row's (max, argmax)
    int token = bi;
    if (temp > 0.0f && best == best) {  // sampled (a NaN row falls back to the argmax)
        row.m = best;
        row.inv_t = 1.0f / temp;
        if constexpr (STAGED) {
            // pass 2 (shared memory): each thread turns the logits it kept (the same ids as
            // in pass 1) into their weights, in place; then the block reads them all
            for (int j = t; j < V; j += blockDim.x)
                sw[j] = weight_of(__uint_as_float(sw[j]), row.m, row.inv_t);
            __syncthreads();
            token = draw_token(StagedRow{sw}, V, k, ptop, pmin, p_at, keys + 2 * b, hist, red, sel);
        } else {
            token = draw_token(row, V, k, ptop, pmin, p_at, keys + 2 * b, hist, red, sel);
        }
    }
    if (t == 0) {
        ids[b] = token;
        out[b] = token;
        if (has_seen) seen[(long long)b * Vp + token] = 1;
        if (npos > 1) pos[b] += 1;
        else if (b == 0) *pos += 1;
    }
}

// The fallback: every pass over the row reads the logits from global memory.
extern "C" __global__ void sample_next_f32(const float* logits, int V, int Vp,
                                           const float* knobs, const unsigned* keys,
                                           int* seen, int has_seen, int* ids,
                                           int* out, int* pos, int npos) {
    sample_block<false>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos,
                        nullptr);
}

// The row staged in shared memory: launched with 4 V bytes of dynamic shared memory (the
// launcher opts the kernel in above the default 48 KB).
extern "C" __global__ void sample_next_smem_f32(const float* logits, int V, int Vp,
                                                const float* knobs, const unsigned* keys,
                                                int* seen, int has_seen, int* ids,
                                                int* out, int* pos, int npos) {
    extern __shared__ unsigned row_smem[];
    sample_block<true>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos,
                       row_smem);
}
