"""Every CPU backend op against the same computation in PyTorch (CPU, eager), in the same run.

Shapes are GPT-2 124M's for one sequence: T=1024, C=768, H=12, hs=64, V=50257 (cross-entropy
over N=1024 rows), MLP width 4C. ``--preset char`` uses nanoGPT's shakespeare-char CPU config
instead (B=12, T=64, C=128, H=4, V=65), where per-call overhead matters more than FLOPs.
Each op runs forge and torch alternately; the table shows the median of the repetitions, in
float32, with torch limited to as many threads as NumPy's BLAS uses.

    python benchmarks/ops_cpu.py            # full run, GPT-2 shapes
    python benchmarks/ops_cpu.py --quick    # fewer repetitions
    python benchmarks/ops_cpu.py --preset char
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from forge_ml.backends import cpu

PRESETS = {
    "gpt2": dict(B=1, T=1024, C=768, H=12, V=50257),
    "char": dict(B=12, T=64, C=128, H=4, V=65),
}


def numpy_threads() -> int:
    """The thread count NumPy's OpenBLAS runs with (its env override, else every usable core)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return len(os.sched_getaffinity(0))


SETTLE_S = 0.3
"""Seconds of quiet before each library's block of calls: OpenBLAS's and torch's OpenMP worker
threads spin for a while after their last job, and on a small machine a spinning pool of one
library takes the cores the other's threads need (calls alternating one by one measured up to
10x slow for both)."""


def time_ms(forge_fn, torch_fn, reps: int, stat=statistics.median, blocks: int = 3) -> tuple[float, float]:
    """Milliseconds per call of each thunk (median by default). The two run in alternating
    blocks (``blocks`` of each, ``reps`` calls in all), so that drift and noisy neighbours hit
    both alike, each block after ``SETTLE_S`` of quiet so that neither library's idle spinning
    threads slow the other."""
    forge_fn()  # warm-up: first-touch page faults, lazy initialisation
    torch_fn()
    times = ([], [])
    per_block = max(1, -(-reps // blocks))
    for _ in range(blocks):
        for fn, out in ((forge_fn, times[0]), (torch_fn, times[1])):
            time.sleep(SETTLE_S)
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return stat(times[0]) * 1e3, stat(times[1]) * 1e3


def cases(B, T, C, H, V):
    """(name, forge thunk, torch thunk) for every backend op, float32 inputs."""
    g = np.random.default_rng(0)
    hs = C // H
    lead = (B,)
    n_rows = B * T

    def r(*shape, scale=1.0):
        return (g.standard_normal(shape) * scale).astype(np.float32)

    def tt(a):
        return torch.from_numpy(a)

    x, dx = r(n_rows, C), r(n_rows, C)
    h, dh = r(n_rows, 4 * C), r(n_rows, 4 * C)
    w_attn, b_attn = r(C, 3 * C, scale=0.02), r(3 * C)
    w_fc, b_fc = r(C, 4 * C, scale=0.02), r(4 * C)
    w_proj, b_proj = r(4 * C, C, scale=0.02), r(C)
    wte, wpe = r(V, C, scale=0.02), r(max(T, 1024), C, scale=0.02)
    gamma, beta = r(C), r(C)
    qkv = r(*lead, T, 3 * C)
    q, k, v, do = (r(*lead, H, T, hs) for _ in range(4))
    scores, dscores = r(*lead, H, T, T), r(*lead, H, T, T)
    ids = g.integers(0, V, size=(*lead, T)).astype(np.int64)
    logits = r(n_rows, V, scale=2.0)
    targets = g.integers(0, V, size=n_rows).astype(np.int64)
    cache, new = r(*lead, H, T, hs), r(*lead, H, 1, hs)
    scale = 1.0 / math.sqrt(hs)

    # torch twins (sharing memory where the op does not write)
    tx, tdx, th, tdh = tt(x), tt(dx), tt(h), tt(dh)
    tw_attn, tb_attn, tw_fc, tb_fc = tt(w_attn), tt(b_attn), tt(w_fc), tt(b_fc)
    tw_proj, tb_proj, twte, twpe = tt(w_proj), tt(b_proj), tt(wte), tt(wpe)
    tgamma, tbeta, tqkv = tt(gamma), tt(beta), tt(qkv)
    tq, tk, tv, tdo = tt(q), tt(k), tt(v), tt(do)
    tscores, tdscores, tids = tt(scores), tt(dscores), tt(ids)
    tlogits, ttargets = tt(logits), tt(targets)
    tcache, tnew = tt(cache.copy()), tt(new)

    y_soft = cpu.softmax(scores, True, 0)
    ty_soft = tt(y_soft)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(tx, [C], tgamma, tbeta, 1e-5)
    out, lse = cpu.attention(q, k, v, scale)
    t_out, t_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        tq, tk, tv, 0.0, True, scale=scale)[:2]
    tlogits_req = tlogits.clone().requires_grad_(True)
    t_loss = F.cross_entropy(tlogits_req, ttargets)
    heads4 = (*lead, T, 3, H, hs)

    dst = np.zeros((V, C), np.float32)
    tdst = torch.zeros(V, C)
    p_np = {n: r(C, 4 * C, scale=0.02) for n in ("p", "g")}
    m_np, v_np = np.zeros_like(p_np["p"]), np.zeros_like(p_np["p"])
    tp = torch.tensor(p_np["p"].copy(), requires_grad=True)
    tp.grad = tt(p_np["g"])
    opt = torch.optim.AdamW([tp], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step = [0]

    def forge_adamw():
        step[0] += 1
        cpu.adamw_update(p_np["p"], p_np["g"], m_np, v_np, 3e-4, 0.9, 0.95, 1e-8, 0.1,
                         step[0], 1.0)

    return [
        ("zeros (T,4C)", lambda: cpu.zeros(h.shape, "float32"), lambda: torch.zeros(th.shape)),
        ("copy (T,4C)", lambda: cpu.copy(h), lambda: th.clone()),
        ("cast f32->f64 (T,4C)", lambda: cpu.cast(h, "float64"), lambda: th.to(torch.float64)),
        ("matmul x@W_attn+b", lambda: cpu.matmul(x, w_attn, b_attn, False, False, 1.0, None),
         lambda: torch.addmm(tb_attn, tx, tw_attn)),
        ("matmul x@W_fc+b", lambda: cpu.matmul(x, w_fc, b_fc, False, False, 1.0, None),
         lambda: torch.addmm(tb_fc, tx, tw_fc)),
        ("matmul h@W_proj+b", lambda: cpu.matmul(h, w_proj, b_proj, False, False, 1.0, None),
         lambda: torch.addmm(tb_proj, th, tw_proj)),
        ("matmul dh@W_fc^T", lambda: cpu.matmul(dh, w_fc, None, False, True, 1.0, None),
         lambda: tdh @ tw_fc.t()),
        ("matmul x^T@dh", lambda: cpu.matmul(x, dh, None, True, False, 1.0, None),
         lambda: tx.t() @ tdh),
        ("matmul lm_head x@wte^T", lambda: cpu.matmul(x, wte, None, False, True, 1.0, None),
         lambda: tx @ twte.t()),
        ("matmul q@k^T batched", lambda: cpu.matmul(q, k, None, False, True, scale, None),
         lambda: torch.matmul(tq, tk.transpose(-1, -2)) * scale),
        ("add (T,C)", lambda: cpu.add(x, dx), lambda: tx + tdx),
        ("sum_rows (T,4C)", lambda: cpu.sum_rows(dh), lambda: tdh.sum(0)),
        ("sumsq (V,C)", lambda: cpu.sumsq(wte), lambda: torch.linalg.vector_norm(twte) ** 2),
        ("gelu (T,4C)", lambda: cpu.gelu(h), lambda: F.gelu(th, approximate="tanh")),
        ("dropout 0.2 (H,T,T)", lambda: cpu.dropout(scores, 0.2, 7),
         lambda: F.dropout(tscores, 0.2, training=True)),
        ("gelu_bwd (T,4C)", lambda: cpu.gelu_bwd(h, dh),
         lambda: torch.ops.aten.gelu_backward(tdh, th, approximate="tanh")),
        ("layernorm (T,C)", lambda: cpu.layernorm(x, gamma, beta, 1e-5),
         lambda: F.layer_norm(tx, (C,), tgamma, tbeta, 1e-5)),
        ("layernorm_bwd (T,C)", lambda: cpu.layernorm_bwd(x, gamma, dx, 1e-5),
         lambda: torch.ops.aten.native_layer_norm_backward(
             tdx, tx, [C], t_mean, t_rstd, tgamma, tbeta, [True, True, True])),
        ("layernorm_bwd_sums (T,C)", lambda: cpu.layernorm_bwd_sums(x, gamma, dx, 1e-5),
         lambda: torch.ops.aten.native_layer_norm_backward(
             tdx, tx, [C], t_mean, t_rstd, tgamma, tbeta, [True, True, True])[0].sum(0)),
        ("softmax causal (H,T,T)", lambda: cpu.softmax(scores, True, 0),
         lambda: torch.softmax(tscores.masked_fill(causal, float("-inf")), -1)),
        ("softmax_bwd (H,T,T)", lambda: cpu.softmax_bwd(y_soft, dscores),
         lambda: torch.ops.aten._softmax_backward_data(tdscores, ty_soft, -1, torch.float32)),
        ("split_heads (T,3C)", lambda: cpu.split_heads(qkv, H),
         lambda: tqkv.view(heads4).movedim(-3, 0).transpose(-3, -2).contiguous().unbind(0)),
        ("unsplit_head (H,T,hs)", lambda: cpu.unsplit_head(q, 1),
         lambda: torch.zeros(heads4).select(-3, 1).copy_(tq.transpose(-3, -2))),
        ("merge_heads (H,T,hs)", lambda: cpu.merge_heads(q),
         lambda: tq.transpose(-3, -2).contiguous().view(*lead, T, C)),
        ("unmerge_heads (T,C)", lambda: cpu.unmerge_heads(x.reshape(*lead, T, C), H),
         lambda: tx.view(*lead, T, H, hs).transpose(-3, -2).contiguous()),
        ("attention (H,T,hs)", lambda: cpu.attention(q, k, v, scale),
         lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
             tq, tk, tv, 0.0, True, scale=scale)),
        ("attention_bwd (H,T,hs)", lambda: cpu.attention_bwd(q, k, v, out, lse, do, scale),
         lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
             tdo, tq, tk, tv, t_out, t_lse, 0.0, True, scale=scale)),
        ("embedding (T,)", lambda: cpu.embedding(ids, wte, wpe, 0),
         lambda: F.embedding(tids, twte) + twpe[:T]),
        ("scatter_add_rows (V,C)", lambda: cpu.scatter_add_rows(dst, ids, x),
         lambda: tdst.index_add_(0, tids.reshape(-1), tx)),
        ("kv_append (H,1,hs)", lambda: cpu.kv_append(cache, new, T // 2),
         lambda: tcache[..., T // 2:T // 2 + 1, :].copy_(tnew)),
        ("dropout p=0.1 (T,C)", lambda: cpu.dropout(x, 0.1, 1234),
         lambda: F.dropout(tx, 0.1, training=True)),
        (f"cross_entropy ({n_rows},{V})", lambda: cpu.cross_entropy(logits, targets, None),
         lambda: F.cross_entropy(tlogits, ttargets)),
        (f"cross_entropy_bwd ({n_rows},{V})",
         lambda: cpu.cross_entropy_bwd(logits, targets, 1.0, None),
         lambda: torch.autograd.grad(t_loss, tlogits_req, retain_graph=True)),
        ("adamw_update (C,4C)", forge_adamw, opt.step),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of 15")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    parser.add_argument("--only", default="", help="run ops whose name contains this text")
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="min is steadier on a shared machine")
    args = parser.parse_args(argv)
    stat = statistics.median if args.stat == "median" else min
    threads = numpy_threads()
    torch.set_num_threads(threads)
    reps = 3 if args.quick else 15
    shape = PRESETS[args.preset]
    print(f"forge-ml cpu backend vs torch {torch.__version__} (eager, CPU), float32, "
          f"{threads} thread(s), numpy {np.__version__}")
    print(f"preset {args.preset}: " + ", ".join(f"{k}={v}" for k, v in shape.items())
          + f"; {args.stat} of {reps} runs")
    print(f"{'op':34s} {'forge ms':>10s} {'torch ms':>10s} {'ratio':>7s}")
    ratios = []
    for name, forge_fn, torch_fn in cases(**shape):
        if args.only not in name:
            continue
        t_forge, t_torch = time_ms(forge_fn, torch_fn, reps, stat)
        ratios.append(t_forge / t_torch)
        print(f"{name:34s} {t_forge:10.3f} {t_torch:10.3f} {t_forge / t_torch:7.2f}", flush=True)
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{'geometric mean of ratios':34s} {'':10s} {'':10s} {geo:7.2f}")


if __name__ == "__main__":
    main()
