// launched from backends/cuda/sampling.py
// greedy.cu: the greedy choice of a decoding step, made on the device so that steps chain
// without the host: ids[b] = the argmax of row b of the float32 logits (B, Vp) over its first
// V columns (the lowest id among equal maxima, a NaN counting as the largest, as
// numpy.argmax does), then *pos += 1: the next step's inputs. A row whose largest logit is not
// finite (a NaN, +inf, or every logit -inf: no token can be chosen from it) gets -1 in `out`
// (the host's sign to stop) and its argmax, an id in range, in `ids` (the next step reads it).
#include "common.cuh"

// greedy_next: block b owns row b; thread t scans columns t, t + blockDim.x, ...; the warps'
// winners meet in shared memory (block_argmax, common.cuh); the choice goes to ids (the next
// step's input) and out (a chain's record of its tokens; may be ids). Block 0 advances the
// shared position (npos 1), or block b row b's (npos B), once the row is chosen (every kernel
// of the step that reads it ran before this one).
extern "C" __global__ void greedy_next_f32(const float* logits, int V, int Vp, int* ids,
                                           int* out, int* pos, int npos) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = logits + (long long)blockIdx.x * Vp;
    float best = neg_inf<float>();
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < V; j += blockDim.x) argmax_take(r[j], j, best, bi);
    block_argmax(best, bi, sv, si);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = isfinite(best) ? bi : -1;
        ids[blockIdx.x] = bi;  // after out, which may be ids: the next step's input stays an id
        if (npos > 1) pos[blockIdx.x] += 1;        // one position per row
        else if (blockIdx.x == 0) *pos += 1;
    }
}
