// launched from backends/cuda/sampling.py
// greedy.cu: the greedy choice of a decoding step, made on the device so that steps chain
// without the host: ids[b] = the argmax of row b of the float32 logits (B, Vp) over its first
// V columns (the lowest id among equal maxima, a NaN counting as the largest, as
// numpy.argmax does), then *pos += 1: the next step's inputs.
#include "common.cuh"

// Whether (v, i) beats (best, bi) in numpy.argmax's order.
FORGE_D bool argmax_better(float v, int i, float best, int bi) {
    const bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > best || (v == best && i < bi);
}

// greedy_next: block b owns row b; thread t scans columns t, t + blockDim.x, ...; the warps'
// winners meet in shared memory; the choice goes to ids (the next step's input) and out (a
// chain's record of its tokens; may be ids). Block 0 advances the shared position (npos 1),
// or block b row b's (npos B), once the row is chosen (every kernel of the step that reads
// it ran before this one).
extern "C" __global__ void greedy_next_f32(const float* logits, int V, int Vp, int* ids,
                                           int* out, int* pos, int npos) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = logits + (long long)blockIdx.x * Vp;
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = r[j];
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
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; ++w)
            if (argmax_better(sv[w], si[w], best, bi)) {
                best = sv[w];
                bi = si[w];
            }
        ids[blockIdx.x] = bi;
        out[blockIdx.x] = bi;  // out may be ids
        if (npos > 1) pos[blockIdx.x] += 1;        // one position per row
        else if (blockIdx.x == 0) *pos += 1;
    }
}
