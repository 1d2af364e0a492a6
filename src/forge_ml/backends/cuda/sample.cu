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
//   min-p (p > 0): keep w >= ceil(min(min_p, 1) * 2^24) (the top token always kept);
//   draw: word = Philox4x32-10((pos + 1, 0, 0, 0), key[b]).x (pos + 1: the position of the
//           token chosen, pos the one fed), target = floor(total * word / 2^32)
//           over the kept mass `total`; the token is the first id whose running kept mass
//           passes target.
// All sums are integers, so the choice does not depend on the order threads add in.
// Then ids[b] = out[b] = the token, seen[b, token] += 2, and the position goes up by one
// (a position shared by several rows: by sample_advance_pos, after every row has read it). A
// row whose logit at its argmax is not finite (a NaN, +inf, or every logit -inf: no token can
// be chosen from it) gets that argmax in ids (an id the next step can read) and -1 in out; a
// penalty that only overflows finite logits is the argmax's fallback below, not a lost row.
// seen: int32 (B, Vp), not 0 where the row has seen the token (the penalty's context): bit 0
// for the prompt's ids, plus 2 for each time the row chose the id (sampling.seen_row), whose
// count penalize_logits_f32 reads.
//
// Three kernels run the same passes with the same arithmetic and the same integer sums, so
// they choose the same token:
//   sample_next_smem_f32: one block (1024 threads) a row, read from global memory once (pass
//     1), each thread keeping its logits in dynamic shared memory (4 V bytes: 201 KB for
//     GPT-2's 50,257, which an H100/H200 block may take once opted in); pass 2 turns them into
//     their weights in place, and every later pass reads the weights from there (no expf, no
//     global load);
//   sample_next_f32: where 4 V bytes do not fit (a large vocabulary, a smaller GPU), every
//     pass reads the logits from global memory and recomputes the weights (a row of 50,257
//     weights does not fit a block's registers);
//   sample_next_cluster_f32 (Hopper, small batches): a cluster of 8 blocks a row, each with an
//     eighth of the row staged; the blocks meet once a cut's digit (see the teams below).
// sampling.py picks the kernel. The passes over a sampled row (V elements each):
//   1      the max and the argmax of z (global memory; staged, z is also kept);
//   2      staged only: z_j -> w_j, in place in shared memory;
//   3-5    top-k: the k-th largest weight, a radix descent of 3 passes (radix_select);
//   6-8    top-p: the cut, 3 more radix passes, the first also weighing K (the mass the top-k
//          cut keeps), which the cut's need is made of at the first pick;
//   9      the kept mass of each thread's contiguous ids, scanned over the threads (and the
//          cluster's blocks);
//   10     the one thread whose ids hold the target scans them for the token.
// A cut that is off skips its passes; T = 0 (or a NaN) stops after pass 1.
// sample_weights_f32 (tests only) writes the weights w_j that the passes from 2 on read.
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
    // w[u] = the weight of id j + u, u < 4 (0 past V)
    FORGE_D void weights4(int j, int V, unsigned (&w)[4]) const {
#pragma unroll
        for (int u = 0; u < 4; ++u) w[u] = j + u < V ? weight(j + u) : 0u;
    }
};

// A row staged in shared memory (sample_next_smem_f32): the weights themselves, from pass 2.
struct StagedRow {
    const unsigned* w;
    FORGE_D unsigned weight(int j) const { return w[j]; }
    // w[u] = the weight of id j + u, u < 4 (0 past V); j is a multiple of 4, so the four
    // words are one 16-byte load where they are all inside the row
    FORGE_D void weights4(int j, int V, unsigned (&out)[4]) const {
        if (j + 3 < V) {
            const uint4 q = *reinterpret_cast<const uint4*>(w + j);
            out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
        } else {
#pragma unroll
            for (int u = 0; u < 4; ++u) out[u] = j + u < V ? w[j + u] : 0u;
        }
    }
};

FORGE_D unsigned long long block_sum_u64(unsigned long long v, unsigned long long* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    unsigned long long s = 0;
    for (int w = 0; w < nw; ++w) s += sh[w];
    __syncthreads();
    return s;
}

// ---------------------------------------------------------------------------------------------
// radix_select: an exact cut (top-k's k-th largest weight, top-p's threshold) by a radix
// descent over the weights' bits, one pass over the row per digit.
//
// A weight is at most 2^24 (expf of a value <= 0, times 2^24): 25 bits. The three digits are
// bits 16-24 (the values 0..256: bit 24 is set only for w = 2^24, so the first digit takes it
// with bits 16-23 instead of spending a pass of 8 bits on it), bits 8-15 and bits 0-7.
//
// Each pass counts (or weighs) the candidates by digit into a shared-memory histogram, then
// picks the largest digit whose bins, from it up, reach what the cut still needs. That pick
// never reads bin 0 (when no digit from 1 up reaches, the digit is 0), so a pass does not
// count digit 0 at all: the small weights, most of a peaked row, all have digit 0, and
// adding them up on that one bin (with 64-bit compare-and-swap loops, 4 passes of 8 bits)
// was what the selection cost before.
// ---------------------------------------------------------------------------------------------

#define SN_BINS 288  // 9 warps' lanes, a bin each, in pick_digit; a digit uses 257 at most

// The histogram of one pass: bin d's count n[d], and for a pass by mass the sum of its
// weights' bits below the digit, (hi[d] << 32) + lo[d]. Every weight of bin d shares the bits
// from the digit up (the prefix picked before and d itself: the bin's base), so its mass is
// n[d] base + that sum, made exact at the pick (`mass`). Counting and adding low bits are
// one-instruction shared-memory atomics that return nothing (a 64-bit atomicAdd on shared
// memory is a compare-and-swap loop on sm_90); the high word takes carries only where the
// low bits of one block's part could pass 2^32 (a part of more than 65,537 ids, pass 0).
struct Hist {
    unsigned n[SN_BINS];
    unsigned lo[SN_BINS];
    unsigned hi[SN_BINS];
};

// bin d's low sum += low, exactly: the low word's atomicAdd returns what it held, and an add
// that wraps it carries one into the high word
FORGE_D void mass_add(Hist& h, unsigned d, unsigned low) {
    const unsigned old = atomicAdd(&h.lo[d], low);
    if (old + low < old) atomicAdd(&h.hi[d], 1u);
}

// Counts each lane with `counted` in bin d and, by mass, adds `low` (its weight's bits below
// the digit) to the bin's low sum (`carry`: through mass_add). A 32-bit atomicAdd of 1
// compiles to ATOMS.POPC.INC, which adds the lanes of one address together; the low bits'
// adds return nothing, so nothing waits on them. (Until 2026-12-07 a pass by mass added each
// weight whole, a returning add with a carry check a lane, or a warp's sum where all its lanes
// shared a digit: a chain of warp votes and shuffles per call, top-p's passes 1.4-2.2x
// top-k's at batch 1 and 64. sampling_cuda.py on an H100, flat logits, a call: top-p 0.9
// 21.8 -> 20.9 us at batch 1, 50.8 -> 44.1 at batch 64; top-k 40 17.6 -> 16.8 at batch 1, its
// cluster pick reading one word a block and bin where it read two.)
template <bool BY_MASS>
FORGE_D void bin_add(Hist& h, bool counted, unsigned d, unsigned low, bool carry) {
    if (!counted) return;
    atomicAdd(&h.n[d], 1u);
    if constexpr (BY_MASS) {
        if (low == 0u) return;
        if (carry) mass_add(h, d, low);
        else atomicAdd(&h.lo[d], low);
    }
}

// Bin t's count (a pass by count) or mass (by mass: base = the bits from the digit up of
// every weight in it) from its count and its weights' low bits.
FORGE_D unsigned long long bin_value(bool by_mass, unsigned long long n, unsigned long long low,
                                     unsigned base) {
    return by_mass ? n * base + low : n;
}

// The digit a pass picked and what the bins above it hold (pick_digit's answer).
struct Pick {
    unsigned long long above;
    unsigned digit;
};

#define SN_PICK_WARPS (SN_BINS / 32)   // 9: warp w holds bins 32 w .. 32 w + 31, a bin a lane

// The largest digit d >= 1 whose bins d, d + 1, ... hold at least `remaining` (>= 1), and what
// the bins above d hold; the digit is 0 when none does (bin 0 is never counted, so it holds 0
// and "above" is then every counted bin). Every thread calls it; a thread of warps 0..8 brings
// v, the count or mass of bin 32 warp + lane (the others 0). Each warp sums its bins from each
// lane's up (a suffix scan), warp w adds the warps above it (wsum: SN_PICK_WARPS words of
// shared memory), and the one bin where the running sum first reaches `remaining` writes the
// answer to `out`. Two __syncthreads; every thread returns the answer.
FORGE_D Pick pick_digit(unsigned long long v, unsigned long long remaining,
                        unsigned long long* wsum, Pick& out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long suf = v;   // bins 32 warp + lane .. 32 warp + 31
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_down_sync(0xffffffffu, suf, o);
        if (lane + o < 32) suf += n;
    }
    if (warp < SN_PICK_WARPS && lane == 0) wsum[warp] = suf;
    __syncthreads();
    if (warp < SN_PICK_WARPS) {
        unsigned long long at = suf;   // bins from this lane's up, over every warp
        for (int w = warp + 1; w < SN_PICK_WARPS; ++w) at += wsum[w];
        const unsigned long long above = at - v;
        const int d = 32 * warp + lane;
        if ((d >= 1 && at >= remaining && above < remaining) || (d == 0 && at < remaining)) {
            out.digit = d >= 1 ? (unsigned)d : 0u;
            out.above = d >= 1 ? above : at;
        }
    }
    __syncthreads();
    return out;
}

// A block's exclusive scan of one value a thread, in thread order (thread t's `excl`: threads
// 0..t-1), and the block's total; `sh` holds 32 words of shared memory. Two __syncthreads.
FORGE_D unsigned long long block_scan_u64(unsigned long long v, unsigned long long& excl,
                                          unsigned long long* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned long long inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();   // an earlier call's readers are done with sh
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    unsigned long long before = 0, total = 0;
    for (int w = 0; w < nw; ++w) {
        const unsigned long long x = sh[w];
        before += w < warp ? x : 0ull;
        total += x;
    }
    excl = before + inc - v;
    return total;
}

// ---------------------------------------------------------------------------------------------
// Teams: the blocks that share one row, and how they meet. Every pass below runs over the ids
// [0, n) of this block's part of the row (src.weight(j): the weight of id `first + j`); a team
// adds the parts up.
//   Solo: one block owns the whole row (first 0, n = V); its meetings are __syncthreads.
//   Cluster: a thread-block cluster of SC_BLOCKS blocks owns the row, block r the ids from
//     r * part on; each block counts its part into its own histogram, and after a cluster
//     barrier every block reads every block's bins (distributed shared memory) and picks the
//     same digit from the same sums. A pass's histogram is one of two, taken in turn: a block
//     clears the one the next pass counts into once the barrier says every block has read it
//     (the pass before), so a pass needs one cluster barrier.
// A team's pick may also sum a value over the row at the same meeting (top-p's K, the mass its
// first pass weighs: `need` gives the cut's need from it).
// ---------------------------------------------------------------------------------------------

struct Solo {
    Hist* h;
    unsigned long long* red;   // 32 words: block sums and scans
    Pick* pk;
    int first, n;              // this block's ids: all of the row
    static constexpr int ranks = 1;
    FORGE_D unsigned rank() const { return 0u; }
    FORGE_D Hist& hist() { return *h; }
    FORGE_D void argmax(float&, int&) {}   // the block's argmax is the row's
    // the pass's digit once every thread has counted; with K (mine: this thread's part of
    // it), `remaining` becomes need(the row's K) first. The bins are cleared as read.
    // (by_mass: bin t's base is prefix | t << shift)
    template <class Need>
    FORGE_D Pick pick(unsigned long long& remaining, bool with_k, unsigned long long mine,
                      const Need& need, bool by_mass, unsigned prefix, int shift) {
        if (with_k) remaining = need(block_sum_u64(mine, red));
        else __syncthreads();
        const int t = threadIdx.x;
        unsigned long long v = 0;
        if (t < SN_BINS) {
            v = bin_value(by_mass, h->n[t], ((unsigned long long)h->hi[t] << 32) | h->lo[t],
                          prefix | (unsigned)t << shift);
            h->n[t] = 0u;   // the next pass counts into it
            h->lo[t] = 0u;
            h->hi[t] = 0u;
        }
        return pick_digit(v, remaining, red, *pk);
    }
    // the kept mass of the parts before this block's, and the row's (one part: 0 and mine)
    FORGE_D unsigned long long parts(unsigned long long mine, unsigned long long& before) {
        before = 0;
        return mine;
    }
    FORGE_D void done() {}
};

#define SC_BLOCKS 8     // sample_next_cluster_f32: the blocks of a row's cluster
#define SC_THREADS 512  // and their threads (16 warps: 9 read the bins, 1 a sum, 6 clear)

// What the blocks of a cluster read from each other, and the block's own meeting results.
struct ClusterShared {
    Hist h[2];                     // the passes' histograms, in turn
    Pick pk;
    unsigned long long K, mass;    // this block's part of top-p's K, of the kept mass
    unsigned long long total;      // the row's K, for the whole block
    float best, row_best;          // this block's (max, argmax) of the row, and the row's
    int bi, row_bi;
};

struct Cluster {
    ClusterShared* s;
    unsigned long long* red;
    int first, n, pass;
    static constexpr int ranks = SC_BLOCKS;
    FORGE_D unsigned rank() const { return cluster_rank(); }
    FORGE_D Hist& hist() { return s->h[pass & 1]; }
    // every block gets the row's (max, argmax): warp 0's lane r brings block r's, and a
    // butterfly folds them (numpy's order is a total order: any fold gives the same)
    FORGE_D void argmax(float& best, int& bi) {
        if (threadIdx.x == 0) {
            s->best = best;
            s->bi = bi;
        }
        cluster_sync();
        if (threadIdx.x < 32) {
            const unsigned lane = threadIdx.x;
            float b = neg_inf<float>();
            int i = 0x7fffffff;
            if (lane < SC_BLOCKS) {
                b = *cluster_map(&s->best, lane);
                i = *cluster_map(&s->bi, lane);
            }
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) {
                const float b2 = __shfl_xor_sync(0xffffffffu, b, o);
                const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
                argmax_take(b2, i2, b, i);
            }
            if (lane == 0) {
                s->row_best = b;
                s->row_bi = i;
            }
        }
        __syncthreads();
        best = s->row_best;
        bi = s->row_bi;
    }
    template <class Need>
    FORGE_D Pick pick(unsigned long long& remaining, bool with_k, unsigned long long mine,
                      const Need& need, bool by_mass, unsigned prefix, int shift) {
        if (with_k) {
            mine = block_sum_u64(mine, red);
            if (threadIdx.x == 0) s->K = mine;
        }
        cluster_sync();   // every block's counts of this pass (and its K) are in
        const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
        unsigned long long v = 0;
        if (warp < SN_PICK_WARPS) {   // bin t over every block: its words in flight at once
            unsigned n[SC_BLOCKS], lo[SC_BLOCKS], hi[SC_BLOCKS];
#pragma unroll
            for (int r = 0; r < SC_BLOCKS; ++r) {
                const Hist* rh = cluster_map(&s->h[pass & 1], (unsigned)r);
                n[r] = rh->n[t];
                lo[r] = by_mass ? rh->lo[t] : 0u;
                hi[r] = by_mass ? rh->hi[t] : 0u;
            }
            unsigned long long cnt = 0, low = 0;
#pragma unroll
            for (int r = 0; r < SC_BLOCKS; ++r) {
                cnt += n[r];
                low += ((unsigned long long)hi[r] << 32) | lo[r];
            }
            v = bin_value(by_mass, cnt, low, prefix | (unsigned)t << shift);
        } else if (warp == SN_PICK_WARPS) {   // the row's K
            if (with_k) {
                const unsigned long long x =
                    warp_sum(lane < SC_BLOCKS ? *cluster_map(&s->K, (unsigned)lane) : 0ull);
                if (lane == 0) s->total = x;
            }
        } else {   // the others clear the next pass's histogram: every block has read it
            Hist& nx = s->h[(pass + 1) & 1];
            for (int i = t - 32 * (SN_PICK_WARPS + 1); i < SN_BINS; i += SC_THREADS - 32 * (SN_PICK_WARPS + 1))
                nx.n[i] = nx.lo[i] = nx.hi[i] = 0u;
        }
        ++pass;
        if (!with_k) return pick_digit(v, remaining, red, s->pk);
        __syncthreads();
        remaining = need(s->total);
        return pick_digit(v, remaining, red, s->pk);
    }
    // every block's kept mass: lane r of each warp brings block r's (every thread needs both
    // sums); the parts before this block's and the row's
    FORGE_D unsigned long long parts(unsigned long long mine, unsigned long long& before) {
        if (threadIdx.x == 0) s->mass = mine;
        cluster_sync();
        const unsigned lane = threadIdx.x & 31, me = rank();
        const unsigned long long m = lane < SC_BLOCKS ? *cluster_map(&s->mass, lane) : 0ull;
        before = warp_sum(lane < me ? m : 0ull);
        return warp_sum(m);
    }
    // no block leaves while another may still read its shared memory
    FORGE_D void done() { cluster_sync(); }
};

// The largest value v of the kept weights (w >= floor_) such that the kept weights >= v
// count at least `need` (BY_MASS false: top-k) or weigh at least `need` (BY_MASS true: top-p),
// over the row's weights; this block counts its part, src.weight(j) for j < team.n. Three
// passes; the team's histogram comes in cleared (and goes out cleared). Top-p (ptop > 0):
// `need` is ceil(ptop K), K the kept mass, which the first pass weighs as it counts. Every
// thread returns v.
template <bool BY_MASS, class Src, class Team>
FORGE_D unsigned radix_select(const Src& src, unsigned floor_, unsigned long long need,
                              float ptop, Team& team) {
    const int n = team.n;
    unsigned prefix = 0;                   // the digits picked so far, in their bits
    unsigned long long remaining = need;   // what the candidates still have to provide
#pragma unroll
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = 16 - 8 * pass;   // the digit: bits 16-24, then 8-15, then 0-7
        const unsigned fixed = pass == 0 ? 0u : ~0u << (shift + 8);  // the bits picked before
        const unsigned below = (1u << shift) - 1u;                   // the bits after the digit
        const bool with_k = BY_MASS && pass == 0 && ptop > 0.0f;
        // whether the low bits' sum of one bin could pass 32 bits (see Hist)
        const bool carry = BY_MASS && (unsigned long long)n * below > 0xffffffffull;
        unsigned long long kmass = 0;      // with_k: this thread's kept mass
        Hist& h = team.hist();
        // count: every kept weight that agrees with the prefix on the bits picked before adds
        // 1 or itself to the bin of its digit (digit 0 skipped: pick_digit does not read it).
        // Thread t takes ids 4t..4t+3, then 4(t + blockDim.x)..; a warp with nothing to count
        // in its 128 ids moves on after one vote.
        for (int j0 = 0; j0 < n; j0 += 4 * blockDim.x) {  // every thread takes every iteration
            const int j = j0 + 4 * threadIdx.x;
            unsigned w[4], d[4];
            bool counted[4], some = false;
            src.weights4(j, n, w);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                // min(): w <= 2^24 always; the clamp only keeps a bad weight in the histogram
                d[u] = pass == 0 ? min(w[u] >> 16, 256u) : (w[u] >> shift) & 255u;
                const bool kept = j + u < n && w[u] >= floor_;
                if (with_k && kept) kmass += w[u];
                counted[u] = kept && (w[u] & fixed) == prefix && d[u] != 0u;
                some = some || counted[u];
            }
            if (__any_sync(0xffffffffu, some)) {
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    bin_add<BY_MASS>(h, counted[u], d[u], w[u] & below, carry);
            }
        }
        // pick: the digit of v, and what the candidates above it provide
        const Pick pk = team.pick(remaining, with_k, kmass, [ptop](unsigned long long K) {
            return (unsigned long long)ceil((double)ptop * (double)K);
        }, BY_MASS, prefix, shift);
        prefix |= pk.digit << shift;
        remaining -= pk.above;
    }
    return prefix;
}

// Passes 3 to 10 of a sampled row: the cuts (top-k, top-p, min-p) and the draw over the
// row's weights (this block's part: src.weight(j), id team.first + j, j < team.n); `key`: the
// row's two Philox key words. The team's histogram comes in cleared. Returns the token in the
// block whose part holds it (every thread of it), -1 in the others.
template <class Src, class Team>
FORGE_D int draw_token(const Src& src, int V, int k, float ptop, float pmin, int p_at,
                       const unsigned* key, Team& team, unsigned* sel) {
    const int t = threadIdx.x, n = team.n;
    unsigned floor_ = 0;
    // passes 3-5, top-k: the k-th largest weight
    if (k > 0 && k < V) floor_ = radix_select<false>(src, 0u, (unsigned long long)k, 0.0f, team);
    // passes 6-8, top-p: the largest cut whose kept mass reaches ceil(p K), K the mass the
    // top-k cut keeps (weighed by pass 6)
    if (ptop > 0.0f && ptop < 1.0f) floor_ = max(floor_, radix_select<true>(src, floor_, 0ull, ptop, team));
    // min_p above 1 (not checked on the device) keeps the top token still: the floor is 2^24 at most
    if (pmin > 0.0f) floor_ = max(floor_, (unsigned)ceil(fmin((double)pmin, 1.0) * 16777216.0));
    // pass 9: thread t owns the contiguous ids [t c, t c + c) of the block's part; its kept
    // mass, a scan over the block's threads, and (a cluster) over the blocks' parts
    const int c = (n + (int)blockDim.x - 1) / (int)blockDim.x, lo = min(n, t * c), hi = min(n, lo + c);
    unsigned long long mine = 0;
    for (int j = lo; j < hi; ++j) {
        const unsigned w = src.weight(j);
        if (w >= floor_) mine += w;
    }
    unsigned long long excl;
    const unsigned long long block_mass = block_scan_u64(mine, excl, team.red);
    unsigned long long before;
    const unsigned long long total = team.parts(block_mass, before);
    // the draw, over the row's kept mass: the part (block) that holds the target, in it the
    // thread, which scans its ids (pass 10) for the first whose running kept mass passes it
    const u32x4 x = philox4x32_10(u32x4{(unsigned)p_at, 0u, 0u, 0u}, key[0], key[1]);
    const unsigned long long word = x.x, th = total >> 32, tl = total & 0xffffffffull;
    const unsigned long long target = th * word + ((tl * word) >> 32);
    if (t == 0) sel[1] = 0xffffffffu;
    __syncthreads();
    if (mine > 0 && before + excl <= target && target < before + excl + mine) {
        unsigned long long run = before + excl;
        int found = hi - 1;
        for (int j = lo; j < hi; ++j) {
            const unsigned w = src.weight(j);
            if (w >= floor_) {
                run += w;
                if (run > target) {
                    found = j;
                    break;
                }
            }
        }
        sel[1] = (unsigned)(team.first + found);
    }
    __syncthreads();
    return (int)sel[1];
}

// Row b's logits, seen tokens and penalty (knobs (B, 5): temperature, top_k, top_p, min_p,
// penalty); the max and the temperature are set once pass 1 has run.
FORGE_D Row row_of(const float* logits, int Vp, const float* knobs, const int* seen,
                   int has_seen, int b) {
    Row row;
    row.z = logits + (long long)b * Vp;
    row.seen = has_seen ? seen + (long long)b * Vp : nullptr;
    row.pen = knobs[(long long)b * 5 + 4];
    row.m = 0.0f;
    row.inv_t = 1.0f;
    return row;
}

// Pass 1 (global memory): the maximum and the argmax (numpy's order) of this block's part of
// the row, ids first .. first + n - 1, with the penalty applied, into every thread's (best,
// bi); with `sw`, each logit's bits are also kept in sw[j - first] for pass 2. Thread t takes
// ids first + t, first + t + blockDim.x, ... in that order, P at a time: their loads first, all
// in flight together (one block reads its part, so latency, not bandwidth, bounds this pass),
// the ids past the part reading its last id and then skipped.
FORGE_D void row_argmax(const Row& row, int first, int n, unsigned* sw, float& best, int& bi,
                        float* sv, int* si) {
    constexpr int P = 8;
    const int t = threadIdx.x, nt = blockDim.x;
    const bool pen_on = row.penalized();
    best = neg_inf<float>();
    bi = 0x7fffffff;
    for (int j0 = t; j0 < n; j0 += P * nt) {
        float v[P];
        int s[P];
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const int j = first + min(j0 + u * nt, n - 1);
            v[u] = row.z[j];
            s[u] = pen_on ? row.seen[j] : 0;
        }
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const int j = j0 + u * nt;
            if (j < n) {
                const float x = row.penalty(v[u], s[u]);  // row.logit(first + j)
                if (sw != nullptr) sw[j] = __float_as_uint(x);
                argmax_take(x, first + j, best, bi);
            }
        }
    }
    block_argmax(best, bi, sv, si);  // every thread gets the part's (max, argmax)
}

// Row b's choice by this block's team (its part of the row: team.first, team.n). STAGED: the
// part goes through `sw`, team.n words of dynamic shared memory; else every pass reads global
// memory (sw unused; Solo only). The block whose part holds the token writes it; rank 0
// advances the position once the team is done.
template <bool STAGED, class Team>
FORGE_D void sample_row(const float* logits, int V, int Vp, const float* knobs,
                        const unsigned* keys, int* seen, int has_seen, int* ids, int* out,
                        int* pos, int npos, unsigned* sw, int b, Team& team) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned sel[2];
    const int t = threadIdx.x, n = team.n;
    pdl_wait();   // the logits (and ids, pos, seen) come from the kernels before
    pdl_launch_dependents();
    const float* kn = knobs + (long long)b * 5;
    const float temp = kn[0], ptop = kn[2], pmin = kn[3];
    const int k = (int)kn[1];
    Row row = row_of(logits, Vp, knobs, seen, has_seen, b);
    const int p_at = pos[npos == 1 ? 0 : b] + 1;  // the position of the token chosen

    // pass 1; staged, each thread also keeps its logits for pass 2 (a greedy row needs no
    // weights)
    float best;
    int bi;
    row_argmax(row, team.first, n, STAGED && temp > 0.0f ? sw : nullptr, best, bi, sv, si);
    team.argmax(best, bi);
    int token = team.rank() == 0 ? bi : -1;
    // sampled, unless a NaN row or one past float32's range (1 / T or the largest logit
    // infinite): those fall back to the argmax (sampling.sample_row's step 2)
    if (temp > 0.0f && best == best && isfinite(best) && isfinite(1.0f / temp)) {
        row.m = best;
        row.inv_t = 1.0f / temp;
        if constexpr (STAGED) {
            // pass 2 (shared memory): each thread turns the logits it kept (the same ids as
            // in pass 1) into their weights, in place; then the block reads them all
            for (int j = t; j < n; j += blockDim.x)
                sw[j] = weight_of(__uint_as_float(sw[j]), row.m, row.inv_t);
            __syncthreads();
            token = draw_token(StagedRow{sw}, V, k, ptop, pmin, p_at, keys + 2 * b, team, sel);
        } else {
            token = draw_token(row, V, k, ptop, pmin, p_at, keys + 2 * b, team, sel);
        }
    }
    if (t == 0 && token >= 0) {
        out[b] = isfinite(row.z[bi]) ? token : -1;   // -1: the host's sign the row is lost
        ids[b] = token;                         // after out, which may be ids
        if (has_seen) seen[(long long)b * Vp + token] += 2;
    }
    team.done();
    // the position: a row's own (npos B) here; a shared one (npos 1) here only when this
    // team is the grid's only one, else by sample_advance_pos after this kernel (a team that
    // advanced it could do so before a later one read it: rows past the blocks the GPU holds
    // at once start when earlier ones end)
    if (t == 0 && team.rank() == 0) {
        if (npos > 1) pos[b] += 1;
        else if (gridDim.x == Team::ranks) *pos += 1;
    }
}

// One block a row (row b = blockIdx.x): the whole row's passes in one block.
template <bool STAGED>
FORGE_D void sample_solo(const float* logits, int V, int Vp, const float* knobs,
                         const unsigned* keys, int* seen, int has_seen, int* ids, int* out,
                         int* pos, int npos, unsigned* sw) {
    __shared__ Hist hist;
    __shared__ unsigned long long red[32];
    __shared__ Pick pk;
    // radix_select's histogram starts cleared (the barriers of pass 1 order this before it)
    for (int i = threadIdx.x; i < SN_BINS; i += blockDim.x)
        hist.n[i] = hist.lo[i] = hist.hi[i] = 0u;
    Solo team{&hist, red, &pk, 0, V};
    sample_row<STAGED>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos, sw,
                       (int)blockIdx.x, team);
}

// The fallback: every pass over the row reads the logits from global memory.
extern "C" __global__ void __launch_bounds__(SN_THREADS) sample_next_f32(const float* logits, int V, int Vp,
                                           const float* knobs, const unsigned* keys,
                                           int* seen, int has_seen, int* ids,
                                           int* out, int* pos, int npos) {
    sample_solo<false>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos,
                       nullptr);
}

// The row staged in shared memory: launched with 4 V bytes of dynamic shared memory (the
// launcher opts the kernel in above the default 48 KB).
extern "C" __global__ void __launch_bounds__(SN_THREADS) sample_next_smem_f32(const float* logits, int V, int Vp,
                                                const float* knobs, const unsigned* keys,
                                                int* seen, int has_seen, int* ids,
                                                int* out, int* pos, int npos) {
    extern __shared__ __align__(16) unsigned row_smem[];  // 16: weights4 reads 4 words at once
    sample_solo<true>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos,
                      row_smem);
}

// A cluster of SC_BLOCKS blocks (SC_THREADS threads each) a row: row b = blockIdx.x /
// SC_BLOCKS; block r of the cluster stages ids r * part .. (r + 1) * part - 1 (part: V /
// SC_BLOCKS rounded up to a multiple of 4) in 4 part bytes of dynamic shared memory (25 KB for
// GPT-2's 50,257 ids). Every pass then reads an eighth of the row per block, and each cut's
// digit costs one cluster barrier; the same token as one block a row (the same integer sums,
// and the parts in id order).
extern "C" __global__ void __launch_bounds__(SC_THREADS)
sample_next_cluster_f32(const float* logits, int V, int Vp, const float* knobs,
                        const unsigned* keys, int* seen, int has_seen, int* ids, int* out,
                        int* pos, int npos) {
    extern __shared__ __align__(16) unsigned cl_smem[];   // 16: weights4 reads 4 words at once
    __shared__ ClusterShared cs;
    __shared__ unsigned long long red[32];
    for (int i = threadIdx.x; i < SN_BINS; i += blockDim.x)
        cs.h[0].n[i] = cs.h[0].lo[i] = cs.h[0].hi[i] = cs.h[1].n[i] = cs.h[1].lo[i] =
            cs.h[1].hi[i] = 0u;
    Cluster team{&cs, red, 0, 0, 0};
    const int part = ((V + SC_BLOCKS - 1) / SC_BLOCKS + 3) & ~3;
    team.first = (int)team.rank() * part;
    team.n = max(0, min(V, team.first + part) - team.first);
    sample_row<true>(logits, V, Vp, knobs, keys, seen, has_seen, ids, out, pos, npos, cl_smem,
                     (int)(blockIdx.x / SC_BLOCKS), team);
}

// The shared position (one int32) of a batch of rows: sample_next advances it once every row
// has read it, with this one-thread kernel after the sampling kernel.
extern "C" __global__ void sample_advance_pos(int* pos) { *pos += 1; }

// For tests: w (B, V) uint32 = the weights w_j that row b's cuts and draw read (pass 1, then
// weight_of: the same arithmetic as both kernels), 0 for a row that is not sampled (T = 0 or
// a NaN). One block per row. With them, the host checks the integer part of the rule exactly.
extern "C" __global__ void sample_weights_f32(const float* logits, int V, int Vp,
                                              const float* knobs, const int* seen,
                                              int has_seen, unsigned* w) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int b = blockIdx.x;
    const float temp = knobs[(long long)b * 5];
    Row row = row_of(logits, Vp, knobs, seen, has_seen, b);
    float best;
    int bi;
    row_argmax(row, 0, V, nullptr, best, bi, sv, si);
    const bool sampled = temp > 0.0f && best == best && isfinite(best) && isfinite(1.0f / temp);
    row.m = best;
    row.inv_t = sampled ? 1.0f / temp : 1.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        w[(long long)b * V + j] = sampled ? row.weight(j) : 0u;
}

// OpenAI's logit adjustments before a sampled choice (sampling.adjusted, ops.penalize_logits),
// in place over the first V logits of row b = blockIdx.y, one a thread: z + bias (has_bias),
// then frequency * c and, where c > 0, presence taken away, c = seen >> 1 (the times the row
// chose the id) and pen[b] = (presence, frequency). Each operation rounded on its own (no
// fused multiply-add), as NumPy's float32 arithmetic, so the host's choice matches.
extern "C" __global__ void penalize_logits_f32(float* logits, int V, int Vp, const int* seen,
                                               const float* pen, const float* bias,
                                               int has_bias) {
    pdl_wait();   // the logits (and seen) come from the kernels before
    pdl_launch_dependents();
    const int b = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= V) return;
    const long long at = (long long)b * Vp + j;
    float z = logits[at];
    if (has_bias) z = __fadd_rn(z, bias[at]);
    const float presence = pen[2 * b], frequency = pen[2 * b + 1];
    if (presence != 0.0f || frequency != 0.0f) {
        const int c = seen[at] >> 1;
        z = __fsub_rn(z, __fmul_rn(frequency, (float)c));
        if (c > 0) z = __fsub_rn(z, presence);
    }
    logits[at] = z;
}
