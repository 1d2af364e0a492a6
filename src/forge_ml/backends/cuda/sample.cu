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
// One block (1024 threads) owns one row; the weights are recomputed from the logits at each
// pass instead of kept (a row of 50,257 weights would not fit a block's registers).
#include "common.cuh"

#define SN_THREADS 1024

FORGE_D bool argmax_better(float v, int i, float best, int bi) {
    const bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > best || (v == best && i < bi);
}

struct Row {
    const float* z;
    const int* seen;
    float pen, m, inv_t;
    FORGE_D float logit(int j) const {
        float v = z[j];
        if (seen != nullptr && pen != 1.0f && seen[j]) v = v > 0.0f ? v / pen : v * pen;
        return v;
    }
    FORGE_D unsigned weight(int j) const {
        return (unsigned)(expf((logit(j) - m) * inv_t) * 16777216.0f);
    }
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
// 8 bits a pass, over a 256-bin histogram in shared memory.
FORGE_D unsigned radix_select(const Row& row, int V, unsigned floor_, unsigned long long need,
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
            const unsigned w = j < V ? row.weight(j) : 0u;
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

extern "C" __global__ void sample_next_f32(const float* logits, int V, int Vp,
                                           const float* knobs, const unsigned* keys,
                                           int* seen, int has_seen, int* ids,
                                           int* out, int* pos, int npos) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long red[32];
    __shared__ unsigned sel[4];
    const int b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
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

    // the maximum (and the argmax, numpy's order), with the penalty applied
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    for (int j = t; j < V; j += blockDim.x) {
        const float v = row.logit(j);
        if (argmax_better(v, j, best, bi)) {
            best = v;
            bi = j;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_better(v2, i2, best, bi)) {
            best = v2;
            bi = i2;
        }
    }
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (t == 0) {
        for (int w = 1; w < nw; ++w)
            if (argmax_better(sv[w], si[w], best, bi)) {
                best = sv[w];
                bi = si[w];
            }
        sv[0] = best;
        si[0] = bi;
    }
    __syncthreads();
    int token = si[0];
    if (temp > 0.0f && sv[0] == sv[0]) {  // sampled (a NaN row falls back to the argmax)
        row.m = sv[0];
        row.inv_t = 1.0f / temp;
        unsigned floor_ = 0;
        if (k > 0 && k < V) floor_ = radix_select(row, V, 0u, (unsigned long long)k, 0, hist, sel);
        if (ptop > 0.0f && ptop < 1.0f) {
            unsigned long long K = 0;
            for (int j = t; j < V; j += blockDim.x) {
                const unsigned w = row.weight(j);
                if (w >= floor_) K += w;
            }
            K = block_sum_u64(K, red);
            const unsigned long long need = (unsigned long long)ceil((double)ptop * (double)K);
            const unsigned tp = radix_select(row, V, floor_, need, 1, hist, sel);
            floor_ = max(floor_, tp);
        }
        if (pmin > 0.0f) floor_ = max(floor_, (unsigned)ceil((double)pmin * 16777216.0));
        // each warp owns a contiguous range of ids; its kept mass, then a scan over warps
        const int R = (V + nw - 1) / nw, lo = warp * R, hi = min(V, lo + R);
        unsigned long long mine = 0;
        for (int j = lo + lane; j < hi; j += 32) {
            const unsigned w = row.weight(j);
            if (w >= floor_) mine += w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
        if (lane == 0) red[warp] = mine;
        __syncthreads();
        if (t == 0) {
            unsigned long long total = 0;
            for (int w = 0; w < nw; ++w) total += red[w];
            const u32x4 r = philox4x32_10(u32x4{(unsigned)p_at, 0u, 0u, 0u}, keys[2 * b],
                                          keys[2 * b + 1]);
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
        if (warp == (int)sel[0]) {
            const unsigned long long goal = hist[0];
            unsigned long long run = 0;
            int found = -1;
            for (int j0 = lo; j0 < hi && found < 0; j0 += 32) {
                const int j = j0 + lane;
                unsigned long long w = 0;
                if (j < hi) {
                    const unsigned wj = row.weight(j);
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
        token = (int)sel[1];
    }
    if (t == 0) {
        ids[b] = token;
        out[b] = token;
        if (has_seen) seen[(long long)b * Vp + token] = 1;
        if (npos > 1) pos[b] += 1;
        else if (b == 0) *pos += 1;
    }
}
