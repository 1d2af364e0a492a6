"""Index emulator of gemm_rows.cu (a review tool, CPU only): every block of every cluster and
every lane, with ldmatrix and mma.sync m16n8k16 fragments as the PTX ISA lays them out
(common.cuh's ldsm_x4 comment), the pushed partial sums and layernorm statistics, the
zero-filled edges; against x @ W (and LN(x) @ W) in float64. python gemm_rows_emulator.py"""
import numpy as np

GR_M, GR_NT, GR_WLD = 64, 64, 72

def share_of(S): return ((GR_NT + S - 1) // S + 7) // 8 * 8

def ldsm_x4(smem_rows, addrs, trans):
    """smem as a dict-free 2-D array view: addrs[l] = (row array, col) gives the 8 bf16 at
    row r, cols c..c+7 of lane l's row of matrix l//8. Returns regs[l][i] = (lo, hi)."""
    mats = []
    for i in range(4):
        m = np.array([smem_rows(*addrs[8 * i + r]) for r in range(8)])   # 8 x 8
        mats.append(m)
    regs = [[None] * 4 for _ in range(32)]
    for T in range(32):
        for i in range(4):
            m = mats[i]
            if not trans:
                regs[T][i] = (m[T // 4, 2 * (T % 4)], m[T // 4, 2 * (T % 4) + 1])
            else:
                regs[T][i] = (m[2 * (T % 4), T // 4], m[2 * (T % 4) + 1, T // 4])
    return regs

def mma(acc, a, b0, b1):
    """acc[T] (4,), a[T] 4 pairs, b0[T], b1[T] pairs: D = A B + C, m16n8k16."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for T in range(32):
        g, t = T // 4, T % 4
        A[g, 2*t:2*t+2] = a[T][0]; A[g+8, 2*t:2*t+2] = a[T][1]
        A[g, 2*t+8:2*t+10] = a[T][2]; A[g+8, 2*t+8:2*t+10] = a[T][3]
        B[2*t:2*t+2, g] = b0[T]; B[2*t+8:2*t+10, g] = b1[T]
    D = A @ B
    for T in range(32):
        g, t = T // 4, T % 4
        acc[T] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]

def run(x, W, M, K, N, kc, S, ln=None):
    tiles = -(-N // GR_NT)
    share = share_of(S)
    y = np.full((M, N), np.nan)
    for bx in range(tiles):
        n0 = bx * GR_NT
        recv = {to: np.full((S, GR_M, share), np.nan) for to in range(S)}
        stat_in = {to: np.full((S, GR_M, 2), np.nan) for to in range(S)}
        xs_all, ws_all, kn_all = {}, {}, {}
        for s in range(S):
            k0 = s * kc; kn = max(0, min(K, k0 + kc) - k0); assert kn % 8 == 0
            ws = np.zeros((kc, GR_WLD))
            for i in range(kc * 8):
                r, c = i // 8, (i % 8) * 8
                if r < kn and n0 + c < N: ws[r, c:c+8] = W[k0 + r, n0 + c:n0 + c + 8]
            xs = np.zeros((GR_M, kc + 8))
            for i in range(GR_M * (kc // 8)):
                m, c = i // (kc // 8), (i % (kc // 8)) * 8
                if m < M and c < kn: xs[m, c:c+8] = x[m, k0 + c:k0 + c + 8]
            xs_all[s], ws_all[s], kn_all[s] = xs, ws, kn
            if ln is not None:
                nc = kn // 8
                for warp in range(4):
                    for grp in range(4):
                        for r in range(warp * 16 + grp, warp * 16 + 16, 4):
                            vals = np.concatenate([xs[r, c*8:c*8+8] for gl in range(8) for c in range(gl, nc, 8)])
                            mean = vals.sum() / kn if kn else 0.0
                            q = ((vals - mean) ** 2).sum()
                            for to in range(S): stat_in[to][s, r] = (mean, q)
        for s in range(S):
            xs, ws, kn = xs_all[s], ws_all[s], kn_all[s]
            k0 = s * kc
            if ln is not None:
                g_, b_ = ln
                row_stat = {}
                for tid in range(M):
                    mean = sum(max(0, min(K, (r + 1) * kc) - r * kc) * stat_in[s][r, tid, 0] for r in range(S)) / K
                    m2 = sum(stat_in[s][r, tid, 1] + max(0, min(K, (r + 1) * kc) - r * kc) * (stat_in[s][r, tid, 0] - mean) ** 2 for r in range(S))
                    row_stat[tid] = (mean, 1 / np.sqrt(m2 / K + 1e-5))
                gb = np.zeros((2, kc))
                for i in range(2 * (kc // 8)):
                    which, c = i // (kc // 8), (i % (kc // 8)) * 8
                    if c < kn: gb[which, c:c+8] = (b_ if which else g_)[k0 + c:k0 + c + 8]
                nc = kn // 8
                for i in range(M * nc):
                    m, c = i // nc, (i - (i // nc) * nc) * 8
                    mu, rs = row_stat[m]
                    xs[m, c:c+8] = (xs[m, c:c+8] - mu) * rs * gb[0, c:c+8] + gb[1, c:c+8]
            for warp in range(4):
                wr = warp * 16
                if wr >= M: continue
                acc = [[np.zeros(4) for _ in range(32)] for _ in range(8)]
                for kk in range(0, kn, 16):
                    a = ldsm_x4(lambda r, c: xs[r, c:c+8],
                                [(wr + (l & 15), (l >> 4) * 8 + kk) for l in range(32)], False)
                    for j in range(0, 8, 2):
                        addrs = []
                        for l in range(32):
                            q = l >> 3
                            addrs.append(((q & 1) * 8 + (l & 7) + kk, (q >> 1) * 8 + j * 8))
                        b = ldsm_x4(lambda r, c: ws[r, c:c+8], addrs, True)
                        mma(acc[j], [a[T] for T in range(32)], [b[T][0] for T in range(32)], [b[T][1] for T in range(32)])
                        mma(acc[j + 1], [a[T] for T in range(32)], [b[T][2] for T in range(32)], [b[T][3] for T in range(32)])
                for T in range(32):
                    g, t = T >> 2, T & 3
                    for j in range(8):
                        to = (j * 8) // share; c = j * 8 - to * share + 2 * t
                        recv[to][s, wr + g, c:c+2] = acc[j][T][0:2]
                        recv[to][s, wr + g + 8, c:c+2] = acc[j][T][2:4]
        for s in range(S):
            c0 = s * share; cw = max(0, min(GR_NT, c0 + share) - c0)
            for i in range(M * cw):
                m, c = i // cw, i - (i // cw) * cw
                n = n0 + c0 + c
                if n >= N: continue
                a = sum(recv[s][r, m, c] for r in range(S))
                y[m, n] = a
    return y

def shape(K, N, sms=132):
    def shared(kc, S): return 64*(kc+8)*2 + kc*72*2 + 4*kc + S*64*share_of(S)*4
    tiles = -(-N // 64)
    for S in range(max(1, min(8, round(sms / tiles), -(-K // 16))), 9):
        kc = -(-K // (16 * S)) * 16; S = -(-K // kc)
        if shared(kc, S) <= 216 * 1024: return tiles, S, kc

rs = np.random.default_rng(0)
for (M, K, N, ln) in [(5, 40, 24, False), (17, 40, 24, True), (64, 768, 200, True), (33, 3072, 136, False),
                      (64, 96, 64, True), (9, 1600, 72, True), (64, 136, 64, False)]:
    tiles, S, kc = shape(K, N)
    x = rs.standard_normal((M, K)) * 2 + 0.5; W = rs.standard_normal((K, N)) * 0.05
    g = rs.standard_normal(K) * 0.1 + 1; b = rs.standard_normal(K)
    y = run(x, W, M, K, N, kc, S, (g, b) if ln else None)
    if ln:
        mu = x.mean(1, keepdims=True); var = x.var(1, keepdims=True)
        xn = (x - mu) / np.sqrt(var + 1e-5) * g + b
    else:
        xn = x
    want = xn @ W
    err = np.abs(y - want).max() / np.abs(want).max()
    print(f"M={M} K={K} N={N} ln={ln} S={S} kc={kc} tiles={tiles}: max rel err {err:.2e}, nan {np.isnan(y).sum()}")
