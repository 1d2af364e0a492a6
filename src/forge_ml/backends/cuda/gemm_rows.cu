// launched from backends/cuda/linear.py
// gemm_rows.cu: the linear layer of a decoding step for a batch of rows (GEMV_M < M <= 64),
// bf16 on the tensor cores:
//   y (M, N) = act(alpha * LN(x) (M, K) @ W (K, N) + bias) + residual
// W row-major (in, out); LN optional (x's layernorm with gamma, beta, computed here, rounded
// to bf16 as layernorm.cu's output is); act none (0) or GPT-2's GELU (1); bias and residual
// optional. At M = 64 a product reads 1-5 MB of W and does next to no arithmetic: what costs is
// latency (a layernorm kernel and a cuBLASLt product ran batch 64's GPT-2 124M products at
// about 0.6 TB/s, RESULTS.md's seventeenth-session profile), so the grid splits K over a
// thread-block cluster, one block about an SM, and the layernorm's statistics come from the
// cluster's slices. Hopper (sm_90) and later: clusters and programmatic dependent launch.
//
// Grid (column tiles, S), launched as clusters of (1, S, 1) blocks (S <= 8): the S blocks of a
// cluster share a tile of GR_NT columns and split K into S slices of kc rows (kc a multiple
// of 16), block s taking [s kc, (s + 1) kc). 4 warps; warp w owns rows 16w..16w+15.
//   1. W's slice (kc x 64, zeros past K and N) and the slice's gamma and beta: cp.async before
//      the wait (pdl_wait, common.cuh), so they stream while the previous kernel ends; `early`
//      = 0 (W, the bias or gamma may be what the previous kernel wrote) waits first.
//   2. x's slice (64 x kc, zeros past M and K). With LN: each block's per-row (mean, M2) over
//      its slice, stored into every block of the cluster (st.shared::cluster: a store does not
//      wait, a load from another block would), one cluster barrier, and each block merges the
//      S slices' in rank order (Chan's update: the same bits on every run); then the slice
//      normalised in place and rounded to bf16.
//   3. mma.sync m16n8k16 (bf16 in, float32 sums): warp w's 16 rows x 64 columns; A through
//      ldmatrix, B through ldmatrix.trans from the row-major slice. Padded row strides put the
//      8 rows of each ldmatrix on distinct 16-byte bank groups.
//   4. Block s finishes `share` columns of the tile (a multiple of 8: [s share, (s + 1)
//      share)): every block stores its partial sums of those columns straight into that
//      block's receiving slots (recv[source][row][column], a region no other step uses, so
//      the stores need not wait for its products); one cluster barrier; the block adds its S
//      slots in rank order, then alpha, the bias, GELU, the residual, rounded once to bf16.
//      (A cluster arrive at the start and its wait before the first remote store make sure
//      every block of the cluster runs before another writes into it.)
#include "common.cuh"

#define GR_M 64                // rows at most
#define GR_NT 64               // columns of a tile
#define GR_WARPS 4
#define GR_THREADS (GR_WARPS * 32)
#define GR_WLD (GR_NT + 8)     // W slice row stride, bf16 (144 bytes: 16 x an odd number)
#define GR_CLUSTER 8           // blocks of a cluster at most
#define GR_EPF 8               // epilogue passes whose bias and residual are loaded early

// Columns of the tile each block finishes (a multiple of 8) and the dynamic shared bytes for
// slices of kc rows: x's and W's slices, gamma and beta, the receiving slots (linear.py's
// _rows_share and _rows_shared: the same sums).
FORGE_HD int gr_share(int S) { return ((GR_NT + S - 1) / S + 7) / 8 * 8; }
FORGE_HD int gr_shared(int kc, int S) {
    return GR_M * (kc + 8) * 2 + kc * GR_WLD * 2 + 2 * kc * 2 + S * GR_M * gr_share(S) * 4;
}

extern "C" __global__ void __launch_bounds__(GR_THREADS)
    gemm_rows_bf16(const bf16* x, const bf16* W, const bf16* gamma, const bf16* beta,
                   int has_ln, float eps, const bf16* bias, int has_bias, const bf16* res,
                   int has_res, int act, bf16* y, int M, int K, int N, int kc, float alpha,
                   int early) {
    extern __shared__ __align__(16) unsigned char gr_smem[];
    __shared__ float2 stat_in[GR_CLUSTER][GR_M];   // each slice's (mean, M2) of each row
    __shared__ float2 row_stat[GR_M];              // the whole row's (mean, rstd)
    const int xld = kc + 8;               // x slice row stride, bf16 (16 x an odd number bytes)
    const int S = gridDim.y, s = blockIdx.y, share = gr_share(S);
    bf16* xs = reinterpret_cast<bf16*>(gr_smem);   // [GR_M][xld]
    bf16* ws = xs + GR_M * xld;                     // [kc][GR_WLD]
    bf16* gb = ws + kc * GR_WLD;                    // gamma, beta of the slice: [2][kc]
    float* recv = reinterpret_cast<float*>(gb + 2 * kc);   // [S][GR_M][share]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int k0 = s * kc, kn = max(0, min(K, k0 + kc) - k0);   // kn: a multiple of 8
    const int n0 = blockIdx.x * GR_NT;
    // the columns this block finishes in step 4: [c0, c0 + cw) of the tile
    const int c0 = s * share, cw = max(0, min(GR_NT, c0 + share) - c0);
    if (S > 1) cluster_arrive();   // this block runs; its wait comes before the first remote store

    // 1. W's slice, gamma and beta, the bias of the finished columns
    if (!early) pdl_wait();
    for (int i = tid; i < kc * (GR_NT / 8); i += GR_THREADS) {
        const int r = i / (GR_NT / 8), c = (i % (GR_NT / 8)) * 8;
        const bool valid = r < kn && n0 + c < N;
        cp_async16(smem_u32(ws + r * GR_WLD + c), valid ? W + (long long)(k0 + r) * N + n0 + c : W,
                   valid);
    }
    if (has_ln) {
        for (int i = tid; i < 2 * (kc / 8); i += GR_THREADS) {
            const int which = i / (kc / 8), c = (i % (kc / 8)) * 8;
            const bf16* src = (which ? beta : gamma) + k0 + c;
            cp_async16(smem_u32(gb + which * kc + c), c < kn ? src : gamma, c < kn);
        }
    }
    cp_async_commit();
    float biasv[GR_EPF], resv[GR_EPF];
#pragma unroll
    for (int j = 0; j < GR_EPF; ++j) {
        const int i = tid + j * GR_THREADS, n = n0 + c0 + (cw > 0 ? i % cw : 0);
        biasv[j] = (has_bias && cw > 0 && i < M * cw && n < N) ? ldf(bias[n]) : 0.f;
    }
    pdl_wait();
    pdl_launch_dependents();
    // 2. x's slice; the residual values of the finished columns (written by earlier kernels)
    for (int i = tid; i < GR_M * (kc / 8); i += GR_THREADS) {
        const int m = i / (kc / 8), c = (i % (kc / 8)) * 8;
        const bool valid = m < M && c < kn;
        cp_async16(smem_u32(xs + m * xld + c), valid ? x + (long long)m * K + k0 + c : x, valid);
    }
    cp_async_commit();
#pragma unroll
    for (int j = 0; j < GR_EPF; ++j) {
        const int i = tid + j * GR_THREADS;
        resv[j] = 0.f;
        if (has_res && cw > 0 && i < M * cw) {
            const int m = i / cw, n = n0 + c0 + i % cw;
            if (n < N) resv[j] = ldf(res[(long long)m * N + n]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    if (S > 1) cluster_wait();   // every block of the cluster runs: remote stores may start
    if (has_ln) {
        // the slice's (mean, M2) of each row: a group of 8 lanes per row, 16-byte reads
        const int grp = lane >> 3, gl = lane & 7, nc = kn / 8;
        for (int r = warp * 16 + grp; r < warp * 16 + 16; r += 4) {
            float a = 0.f;
            for (int c = gl; c < nc; c += 8) {
                float v[8];
                Vec16<bf16>::widen(*reinterpret_cast<const uint4*>(xs + r * xld + c * 8), v);
#pragma unroll
                for (int e = 0; e < 8; ++e) a += v[e];
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            const float mean = kn > 0 ? a / float(kn) : 0.f;
            float q = 0.f;
            for (int c = gl; c < nc; c += 8) {
                float v[8];
                Vec16<bf16>::widen(*reinterpret_cast<const uint4*>(xs + r * xld + c * 8), v);
#pragma unroll
                for (int e = 0; e < 8; ++e) q += (v[e] - mean) * (v[e] - mean);
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
            if (gl == 0) {   // into slot s of every block of the cluster (this one's too)
                float* slot = reinterpret_cast<float*>(&stat_in[s][r]);
                if (S > 1) {
                    for (int to = 0; to < S; ++to) st_cluster2(slot, (unsigned)to, mean, q);
                } else {
                    stat_in[0][r] = make_float2(mean, q);
                }
            }
        }
        if (S > 1) cluster_sync(); else __syncthreads();
        // the whole row's: Chan's merge of the S slices in rank order
        if (tid < M) {
            float mean = 0.f;
            for (int r = 0; r < S; ++r)
                mean += float(max(0, min(K, (r + 1) * kc) - r * kc)) * stat_in[r][tid].x;
            mean /= float(K);
            float m2 = 0.f;
            for (int r = 0; r < S; ++r) {
                const float2 st = stat_in[r][tid];
                const float d = st.x - mean;
                m2 += st.y + float(max(0, min(K, (r + 1) * kc) - r * kc)) * d * d;
            }
            row_stat[tid] = make_float2(mean, 1.f / sqrtf(m2 / float(K) + eps));
        }
        __syncthreads();
        // normalise the slice in place: (x - mean) rstd gamma + beta, rounded to bf16
        for (int i = tid; i < M * nc; i += GR_THREADS) {
            const int m = i / nc, c = (i - m * nc) * 8;
            uint4* p = reinterpret_cast<uint4*>(xs + m * xld + c);
            float v[8], g[8], b[8];
            Vec16<bf16>::widen(*p, v);
            Vec16<bf16>::widen(*reinterpret_cast<const uint4*>(gb + c), g);
            Vec16<bf16>::widen(*reinterpret_cast<const uint4*>(gb + kc + c), b);
            const float2 st = row_stat[m];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = (v[e] - st.x) * st.y * g[e] + b[e];
            *p = pack8_bf16(v);
        }
        __syncthreads();
    }
    // 3. the products: warp w's rows x the tile's 8 column groups
    float acc[GR_NT / 8][4];
#pragma unroll
    for (int j = 0; j < GR_NT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    const int wr = warp * 16;
    if (wr < M) {
        // ldmatrix row addresses: A rows wr + lane % 16 at column (lane / 16) 8; B (x4.trans)
        // matrix q = lane / 8: k rows (q % 2) 8 + lane % 8, columns (q / 2) 8 of the pair
        const unsigned xa = smem_u32(xs + (wr + (lane & 15)) * xld + (lane >> 4) * 8);
        const int q = lane >> 3;
        const unsigned wa = smem_u32(ws + ((q & 1) * 8 + (lane & 7)) * GR_WLD + (q >> 1) * 8);
        for (int kk = 0; kk < kn; kk += 16) {
            unsigned a[4];
            ldsm_x4(a, xa + kk * 2);
#pragma unroll
            for (int j = 0; j < GR_NT / 8; j += 2) {
                unsigned b[4];
                ldsm_x4_t(b, wa + (kk * GR_WLD + j * 8) * 2);
                mma_bf16(acc[j], a, b[0], b[1]);
                mma_bf16(acc[j + 1], a, b[2], b[3]);
            }
        }
    }
    // 4. each 8-column group's partial sums into the receiving slots of the block that
    // finishes it (slot s: this block's), then one barrier
    if (wr < M) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < GR_NT / 8; ++j) {
            const int to = (j * 8) / share, c = j * 8 - to * share + 2 * t;
            float* p = recv + ((long long)s * GR_M + wr + g) * share + c;
            if (S > 1) {
                st_cluster2(p, (unsigned)to, acc[j][0], acc[j][1]);
                st_cluster2(p + 8 * share, (unsigned)to, acc[j][2], acc[j][3]);
            } else {
                p[0] = acc[j][0];
                p[1] = acc[j][1];
                p[8 * share] = acc[j][2];
                p[8 * share + 1] = acc[j][3];
            }
        }
    }
    if (S > 1) cluster_sync(); else __syncthreads();
    auto finish = [&](int i, float bias_v, float res_v) {
        const int m = i / cw, c = i - m * cw, n = n0 + c0 + c;
        if (n >= N) return;
        float a = 0.f;
        for (int r = 0; r < S; ++r) a += recv[((long long)r * GR_M + m) * share + c];
        y[(long long)m * N + n] =
            linear_epilogue<bf16>(a, alpha, has_bias, bias_v, act, has_res, res_v);
    };
#pragma unroll
    for (int j = 0; j < GR_EPF; ++j) {   // the passes whose bias and residual came early
        const int i = tid + j * GR_THREADS;
        if (cw > 0 && i < M * cw) finish(i, biasv[j], resv[j]);
    }
    for (int i = tid + GR_EPF * GR_THREADS; i < M * cw; i += GR_THREADS) {
        const int m = i / cw, n = n0 + c0 + (i - m * cw);
        const bool in = n < N;
        finish(i, has_bias && in ? ldf(bias[n]) : 0.f,
               has_res && in ? ldf(res[(long long)m * N + n]) : 0.f);
    }
}
