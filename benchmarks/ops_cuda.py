"""forge-ml's CUDA ops against the same ops in PyTorch CUDA, measured in the same run.

GPT-2 124M shapes: B=8, T=1024, C=768, H=12, V=50257 (50304 padded). Each op runs in float32
and bfloat16. Timing: CUDA events around one call, `--warmup` untimed calls first, median of
`--reps` timed calls. PyTorch's float32 matmuls run without TF32, like forge-ml's.

    PYTHONPATH=src python3 benchmarks/ops_cuda.py [--reps 20] [--only gelu,layernorm]

Prints one row per op and dtype: forge ms, torch ms, and forge / torch (lower is better).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback

import numpy as np

B, T, C, H, V, VP = 8, 1024, 768, 12, 50257, 50304
HS = C // H
N = B * T


def time_cupy(cupy, fn, reps, warmup):
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def time_torch(torch, fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_cases(be, cupy, torch, F):
    """name -> function(dtype) returning (forge callable, torch callable)."""

    def rnd(shape, dt, scale=1.0):
        x = cupy.random.standard_normal(shape, dtype=cupy.float32) * scale
        return x if dt == "float32" else be.cast(x, dt)

    def trnd(shape, dt, scale=1.0):
        tdt = torch.float32 if dt == "float32" else torch.bfloat16
        return torch.randn(shape, device="cuda", dtype=tdt) * scale

    cases = {}

    def case(fn):
        cases[fn.__name__] = fn
        return fn

    @case
    def matmul_qkv(dt):  # (N, C) @ (C, 3C) + b
        x, w, b = rnd((N, C), dt), rnd((C, 3 * C), dt, 0.02), rnd((3 * C,), dt)
        tx, tw, tb = trnd((N, C), dt), trnd((C, 3 * C), dt, 0.02), trnd((3 * C,), dt)
        return (lambda: be.matmul(x, w, b, False, False, 1.0, None),
                lambda: torch.addmm(tb, tx, tw))

    @case
    def matmul_fc(dt):  # (N, C) @ (C, 4C) + b
        x, w, b = rnd((N, C), dt), rnd((C, 4 * C), dt, 0.02), rnd((4 * C,), dt)
        tx, tw, tb = trnd((N, C), dt), trnd((C, 4 * C), dt, 0.02), trnd((4 * C,), dt)
        return (lambda: be.matmul(x, w, b, False, False, 1.0, None),
                lambda: torch.addmm(tb, tx, tw))

    @case
    def matmul_dW(dt):  # x^T dy: (4C, N) @ (N, C)
        x, dy = rnd((N, 4 * C), dt), rnd((N, C), dt)
        tx, tdy = trnd((N, 4 * C), dt), trnd((N, C), dt)
        return (lambda: be.matmul(x, dy, None, True, False, 1.0, None),
                lambda: tx.t() @ tdy)

    @case
    def matmul_lm_head(dt):  # (N, C) @ wte^T
        x, w = rnd((N, C), dt), rnd((VP, C), dt, 0.02)
        tx, tw = trnd((N, C), dt), trnd((VP, C), dt, 0.02)
        return (lambda: be.matmul(x, w, None, False, True, 1.0, None), lambda: tx @ tw.t())

    @case
    def add(dt):
        a, b = rnd((B, T, C), dt), rnd((B, T, C), dt)
        ta, tb = trnd((B, T, C), dt), trnd((B, T, C), dt)
        return lambda: be.add(a, b), lambda: ta + tb

    @case
    def gelu(dt):
        x, tx = rnd((B, T, 4 * C), dt), trnd((B, T, 4 * C), dt)
        return lambda: be.gelu(x), lambda: F.gelu(tx, approximate="tanh")

    @case
    def gelu_bwd(dt):
        x, dy = rnd((B, T, 4 * C), dt), rnd((B, T, 4 * C), dt)
        tx, tdy = trnd((B, T, 4 * C), dt), trnd((B, T, 4 * C), dt)
        return (lambda: be.gelu_bwd(x, dy),
                lambda: torch.ops.aten.gelu_backward(tdy, tx, approximate="tanh"))

    @case
    def layernorm_bwd_add(dt):  # layernorm's backward with the residual's gradient added
        x, g, dy, add = rnd((B, T, C), dt), rnd((C,), dt), rnd((B, T, C), dt), rnd((B, T, C), dt)
        tx, tg, tb, tdy = trnd((B, T, C), dt), trnd((C,), dt), trnd((C,), dt), trnd((B, T, C), dt)
        tadd = trnd((B, T, C), dt)
        _, mean, rstd = torch.ops.aten.native_layer_norm(tx, [C], tg, tb, 1e-5)

        def ref():
            dx, dgw, dgb = torch.ops.aten.native_layer_norm_backward(
                tdy, tx, [C], mean, rstd, tg, tb, [True, True, True])
            return tadd + dx, dgw, dgb
        return lambda: be.layernorm_bwd_add(x, g, dy, 1e-5, add), ref

    @case
    def matmul_dgelu(dt):  # the MLP's backward through GELU: (dY W^T) * gelu'(pre), its row sums
        dy, w, pre = rnd((N, C), dt), rnd((4 * C, C), dt, 0.02), rnd((N, 4 * C), dt)
        tdy, tw, tpre = trnd((N, C), dt), trnd((4 * C, C), dt, 0.02), trnd((N, 4 * C), dt)

        def ref():
            g = torch.ops.aten.gelu_backward(tdy @ tw.t(), tpre, approximate="tanh")
            return g, g.sum(0)
        return lambda: be.matmul_dgelu(dy, w, pre), ref

    @case
    def layernorm(dt):
        x, g, b = rnd((B, T, C), dt), rnd((C,), dt), rnd((C,), dt)
        tx, tg, tb = trnd((B, T, C), dt), trnd((C,), dt), trnd((C,), dt)
        return (lambda: be.layernorm(x, g, b, 1e-5),
                lambda: F.layer_norm(tx, (C,), tg, tb, 1e-5))

    @case
    def layernorm_bwd(dt):
        x, g, dy = rnd((B, T, C), dt), rnd((C,), dt), rnd((B, T, C), dt)
        tx, tg, tb, tdy = trnd((B, T, C), dt), trnd((C,), dt), trnd((C,), dt), trnd((B, T, C), dt)
        _, mean, rstd = torch.ops.aten.native_layer_norm(tx, [C], tg, tb, 1e-5)
        return (lambda: be.layernorm_bwd(x, g, dy, 1e-5),
                lambda: torch.ops.aten.native_layer_norm_backward(
                    tdy, tx, [C], mean, rstd, tg, tb, [True, True, True]))

    @case
    def softmax(dt):  # attention-sized rows, no mask on either side
        x, tx = rnd((B, H, T, T), dt), trnd((B, H, T, T), dt)
        return lambda: be.softmax(x, False, 0), lambda: torch.softmax(tx, -1)

    @case
    def softmax_causal(dt):  # torch: masked_fill + softmax, what a torch model does
        x, tx = rnd((B, H, T, T), dt), trnd((B, H, T, T), dt)
        mask = torch.ones(T, T, device="cuda", dtype=torch.bool).triu(1)
        return (lambda: be.softmax(x, True, 0),
                lambda: torch.softmax(tx.masked_fill(mask, float("-inf")), -1))

    @case
    def softmax_bwd(dt):
        y, dy = be.softmax(rnd((B, H, T, T), dt), False, 0), rnd((B, H, T, T), dt)
        ty, tdy = torch.softmax(trnd((B, H, T, T), dt), -1), trnd((B, H, T, T), dt)
        return (lambda: be.softmax_bwd(y, dy),
                lambda: torch.ops.aten._softmax_backward_data(tdy, ty, -1, ty.dtype))

    @case
    def split_heads(dt):
        qkv, tqkv = rnd((B, T, 3 * C), dt), trnd((B, T, 3 * C), dt)
        return (lambda: be.split_heads(qkv, H),
                lambda: tqkv.view(B, T, 3, H, HS).permute(2, 0, 3, 1, 4).contiguous())

    @case
    def merge_heads(dt):
        x, tx = rnd((B, H, T, HS), dt), trnd((B, H, T, HS), dt)
        return (lambda: be.merge_heads(x),
                lambda: tx.transpose(1, 2).contiguous().view(B, T, C))

    @case
    def attention(dt):
        q, k, v = (rnd((B, H, T, HS), dt) for _ in range(3))
        tq, tk, tv = (trnd((B, H, T, HS), dt) for _ in range(3))
        s = 1.0 / math.sqrt(HS)
        return (lambda: be.attention(q, k, v, s),
                lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True))

    @case
    def attention_fwd_bwd(dt):
        q, k, v, dout = (rnd((B, H, T, HS), dt) for _ in range(4))
        tq, tk, tv = (trnd((B, H, T, HS), dt).requires_grad_() for _ in range(3))
        tdout = trnd((B, H, T, HS), dt)
        s = 1.0 / math.sqrt(HS)

        def forge():
            out, lse = be.attention(q, k, v, s)
            return be.attention_bwd(q, k, v, out, lse, dout, s)

        def ref():
            tq.grad = tk.grad = tv.grad = None
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(tdout)
        return forge, ref

    @case
    def embedding(dt):
        ids = cupy.random.randint(0, V, (B, T)).astype(cupy.int64)
        wte, wpe = rnd((VP, C), dt), rnd((T, C), dt)
        tids = torch.randint(0, V, (B, T), device="cuda")
        twte, twpe = trnd((VP, C), dt), trnd((T, C), dt)
        return (lambda: be.embedding(ids, wte, wpe, 0),
                lambda: F.embedding(tids, twte) + twpe[:T])

    @case
    def scatter_add_rows(dt):
        ids = cupy.random.randint(0, V, (N,)).astype(cupy.int64)
        dst, src = rnd((VP, C), dt), rnd((N, C), dt)
        tids = torch.randint(0, V, (N,), device="cuda")
        tdst, tsrc = trnd((VP, C), dt), trnd((N, C), dt)
        return (lambda: be.scatter_add_rows(dst, ids, src),
                lambda: tdst.index_add_(0, tids, tsrc))

    @case
    def scatter_add_rows_text(dt):  # ids as text has them: a newline in every 10th row, Zipf
        r = np.random.default_rng(0)
        h = np.minimum(r.zipf(1.3, N) - 1, V - 1)
        h[::10] = 198
        ids, tids = cupy.asarray(h), torch.as_tensor(h, device="cuda")
        dst, src = rnd((VP, C), dt), rnd((N, C), dt)
        tdst, tsrc = trnd((VP, C), dt), trnd((N, C), dt)
        return (lambda: be.scatter_add_rows(dst, ids, src),
                lambda: tdst.index_add_(0, tids, tsrc))

    @case
    def linear_cross_entropy(dt):  # the LM head and its loss, forward and backward
        x, w = rnd((N, C), dt), rnd((VP, C), dt, 0.02)
        tx, tw = trnd((N, C), dt).requires_grad_(), trnd((VP, C), dt, 0.02).requires_grad_()
        t = cupy.random.randint(0, V, (N,)).astype(cupy.int64)
        tt = torch.randint(0, V, (N,), device="cuda")

        def ref():
            tx.grad = tw.grad = None
            F.cross_entropy((tx @ tw.t())[:, :V].float(), tt).backward()
        return lambda: be.linear_cross_entropy(x, w, t, V, True), ref

    @case
    def dropout(dt):
        x, tx = rnd((B, T, C), dt), trnd((B, T, C), dt)
        return lambda: be.dropout(x, 0.1, 1234), lambda: F.dropout(tx, 0.1, training=True)

    @case
    def cross_entropy(dt):
        logits, tl = rnd((N, V), dt, 2.0), trnd((N, V), dt, 2.0)
        t = cupy.random.randint(0, V, (N,)).astype(cupy.int64)
        tt = torch.randint(0, V, (N,), device="cuda")
        return (lambda: be.cross_entropy(logits, t, V),
                lambda: F.cross_entropy(tl.float() if dt == "float32" else tl, tt))

    @case
    def cross_entropy_fwd_bwd(dt):
        logits, tl = rnd((N, V), dt, 2.0), trnd((N, V), dt, 2.0).requires_grad_()
        t = cupy.random.randint(0, V, (N,)).astype(cupy.int64)
        tt = torch.randint(0, V, (N,), device="cuda")

        def forge():
            be.cross_entropy(logits, t, V)
            return be.cross_entropy_bwd(logits, t, 1.0, V)

        def ref():
            tl.grad = None
            F.cross_entropy(tl, tt).backward()
        return forge, ref

    @case
    def adamw_update(dt):  # 124M float32 master weights; g in dt (torch: float32)
        n = 124_439_808
        p, m = rnd((n,), "float32"), rnd((n,), "float32", 0.01)
        v = cupy.abs(rnd((n,), "float32", 0.001))
        g = rnd((n,), dt, 0.1)
        lowp = be.zeros((n,), "bfloat16") if dt == "bfloat16" else None
        tp, tg = trnd((n,), "float32"), trnd((n,), "float32", 0.1)
        tm, tv = trnd((n,), "float32", 0.01), trnd((n,), "float32", 0.001).abs()
        step = torch.tensor(7.0, device="cuda")

        def ref():
            torch._fused_adamw_([tp], [tg], [tm], [tv], [], [step], lr=3e-4, beta1=0.9,
                                beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
                                maximize=False)
        return (lambda: be.adamw_update(p, g, m, v, 3e-4, 0.9, 0.95, 1e-8, 0.1, 7, 1.0, lowp),
                ref)

    def replayed(fn):
        """fn captured once as a CUDA graph (after a real run that compiles its kernels and
        builds its tables): the timing is the device's, as in the trainer's captured step,
        without the host's checks of each tensor between the events."""
        fn()
        graph = be.capture_graph(fn)
        return graph.replay

    def gpt2_sizes():  # GPT-2 124M's 148 parameters, as the trainer updates them
        layer = [C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C]
        return [V * C, T * C] + layer * 12 + [C, C]

    @case
    def adamw_many(dt):  # AdamW over 148 tensors, one launch (many.cu), replayed; torch eager
        sizes = gpt2_sizes()
        ps = [rnd((n,), "float32") for n in sizes]
        ms = [rnd((n,), "float32", 0.01) for n in sizes]
        vs = [cupy.abs(rnd((n,), "float32", 0.001)) for n in sizes]
        gs = [rnd((n,), dt, 0.1) for n in sizes]
        lows = [be.zeros((n,), "bfloat16") for n in sizes] if dt == "bfloat16" else None
        wds = [0.1 if n > 4 * C else 0.0 for n in sizes]
        scal = cupy.asarray(np.array([3e-4, 1 - 0.9 ** 7, 1 - 0.95 ** 7, 1.0, 0.0, 7.0]))
        tps = [trnd((n,), "float32") for n in sizes]
        tgs = [trnd((n,), "float32", 0.1) for n in sizes]
        tms = [trnd((n,), "float32", 0.01) for n in sizes]
        tvs = [trnd((n,), "float32", 0.001).abs() for n in sizes]
        steps = [torch.tensor(7.0, device="cuda") for _ in sizes]

        def ref():
            torch._fused_adamw_(tps, tgs, tms, tvs, [], steps, lr=3e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        return (replayed(lambda: be.adamw_update_many_at(ps, gs, ms, vs, 0.9, 0.95, 1e-8, wds,
                                                         scal, lows)), ref)

    @case
    def sumsq_total(dt):  # the gradients' global sum of squares over 124M's 148 tensors
        sizes = gpt2_sizes()
        xs, txs = [rnd((n,), dt) for n in sizes], [trnd((n,), dt) for n in sizes]
        return (replayed(lambda: be.sumsq_total(xs)),
                lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(txs))))

    @case
    def sumsq(dt):
        x, tx = rnd((124_439_808,), dt), trnd((124_439_808,), dt)
        return lambda: be.sumsq(x), lambda: torch.linalg.vector_norm(tx, dtype=torch.float32)

    @case
    def sum_rows(dt):
        x, tx = rnd((N, 3 * C), dt), trnd((N, 3 * C), dt)
        return lambda: be.sum_rows(x), lambda: tx.sum(0)

    @case
    def kv_append(dt):
        cache, new = rnd((B, H, T, HS), dt), rnd((B, H, 1, HS), dt)
        tcache, tnew = trnd((B, H, T, HS), dt), trnd((B, H, 1, HS), dt)

        def ref():
            tcache[:, :, 500:501] = tnew
        return lambda: be.kv_append(cache, new, 500), ref

    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated op names")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F
    from forge_ml.backends import get
    from forge_ml.device import Device

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    be = get(Device("cuda", 0))
    print(f"device: {be.device_name()}; cupy {cupy.__version__}; torch {torch.__version__}; "
          f"B={B} T={T} C={C} H={H} V={V}; median of {args.reps} after {args.warmup} warm-ups")
    cases = build_cases(be, cupy, torch, F)
    only = [s for s in args.only.split(",") if s]
    names = [n for n in cases if not only or n in only]
    rows = []
    failures = 0
    for name in names:
        for dt in args.dtypes.split(","):
            try:
                forge_fn, torch_fn = cases[name](dt)
                f_ms = time_cupy(cupy, forge_fn, args.reps, args.warmup)
                t_ms = time_torch(torch, torch_fn, args.reps, args.warmup)
                rows.append((name, dt, f_ms, t_ms, f_ms / t_ms if t_ms > 0 else float("nan")))
                print(f"  {name:24s} {dt:9s} forge {f_ms:9.4f} ms  torch {t_ms:9.4f} ms  "
                      f"ratio {rows[-1][4]:6.2f}", flush=True)
            except Exception as e:  # keep measuring the other ops
                failures += 1
                print(f"  {name:24s} {dt:9s} ERROR {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=3)
            finally:
                cupy.get_default_memory_pool().free_all_blocks()
                torch.cuda.empty_cache()
    print()
    print(f"{'op':24s} {'dtype':9s} {'forge ms':>10s} {'torch ms':>10s} {'forge/torch':>11s}")
    for name, dt, f_ms, t_ms, ratio in rows:
        print(f"{name:24s} {dt:9s} {f_ms:10.4f} {t_ms:10.4f} {ratio:11.2f}")
    if rows:
        geo = math.exp(statistics.fmean(math.log(r[4]) for r in rows if r[4] > 0))
        print(f"geometric mean of forge/torch over {len(rows)} rows: {geo:.2f}; "
              f"{failures} op(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
