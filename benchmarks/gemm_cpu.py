"""The CPU float32 products on the kernels' pool (``gemm_f32``): gemm.c's own AVX-512 kernel
against one OpenBLAS sgemm a block (``FORGE_CPU_GEMM=pool-openblas``, the product before it)
and PyTorch's ``mm`` (MKL), alternated in one process, at the pool's thread count. Shapes:
every product of the nanoGPT CPU training step (4 layers, 128 channels, B x T = 12 x 64 rows:
each 4 times a step but the head's), or with ``--preset gpt2`` GPT-2 124M's for 1,024 rows.
Each line: median us a call and GFLOP/s, the own kernel's speed-up over OpenBLAS, and both
results' largest error against float64. Products with A transposed (the weight gradients) are
OpenBLAS's in both columns: gemm.c leaves them to sgemm.

    python benchmarks/gemm_cpu.py [--preset char|gpt2] [--threads 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from forge_ml import blas
from forge_ml.backends import cpu
from forge_ml.backends.cpu import native

# (m, n, k, trans_a, trans_b, what) of C = op(A) op(B)
PRESETS = {
    "char": [(768, 384, 128, 0, 0, "x @ W_attn"), (768, 128, 128, 0, 0, "y @ W_proj"),
             (768, 512, 128, 0, 0, "x @ W_fc"), (768, 128, 512, 0, 0, "h @ W_proj"),
             (768, 128, 65, 0, 0, "head: dlogits @ wte"), (768, 65, 128, 0, 1, "head: x @ wte^T"),
             (768, 512, 128, 0, 1, "dh @ W_proj^T"), (768, 128, 512, 0, 1, "dh @ W_fc^T"),
             (768, 128, 384, 0, 1, "dqkv @ W_attn^T"), (768, 128, 128, 0, 1, "dy @ W_proj^T"),
             (128, 512, 768, 1, 0, "dW_fc = x^T dh"), (512, 128, 768, 1, 0, "dW_proj = h^T dy"),
             (128, 384, 768, 1, 0, "dW_attn = x^T dqkv"), (128, 128, 768, 1, 0, "dW_proj (attn)"),
             (65, 128, 768, 1, 0, "dwte = dlogits^T x")],
    "gpt2": [(1024, 2304, 768, 0, 0, "x @ W_attn"), (1024, 3072, 768, 0, 0, "x @ W_fc"),
             (1024, 768, 3072, 0, 0, "h @ W_proj"), (1024, 768, 3072, 0, 1, "dh @ W_fc^T"),
             (768, 3072, 1024, 1, 0, "dW_fc = x^T dh"), (3072, 768, 1024, 1, 0, "dW_proj")],
}


def timed(fn, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="char", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args(argv)
    lib = cpu._gemm_lib()
    if lib is None or not native.own_product():
        raise SystemExit("gemm.c's own product is not in this build (it needs the C kernels, "
                         "OpenBLAS's sgemm and a CPU with AVX-512; FORGE_CPU_GEMM=pool)")
    import torch
    blas.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"{a.threads} threads; us a call (GFLOP/s), median of {a.rounds} alternated rounds")
    print(f"{'product':<22} {'m x n x k':>16} {'own':>15} {'OpenBLAS':>15} {'torch':>15} "
          f"{'own/OB':>6}  err own / OB")
    total = {"own": 0.0, "openblas": 0.0, "torch": 0.0}
    for m, n, k, ta, tb, what in PRESETS[a.preset]:
        x = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        y = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        tx, ty = (tx.t() if ta else tx), (ty.t() if tb else ty)
        runs = {"own": [], "openblas": [], "torch": []}
        outs = {}
        for _ in range(a.rounds):
            for name, own in (("own", 1), ("openblas", 0)):
                lib.forge_gemm_own(own)
                fn = lambda: cpu._gemm(lib, x, y, bool(ta), bool(tb))   # noqa: E731
                runs[name].append(timed(fn, a.reps))
                outs[name] = fn()
            runs["torch"].append(timed(lambda: tx @ ty, a.reps))
        lib.forge_gemm_own(1)
        want = (x.T if ta else x).astype(np.float64) @ (y.T if tb else y).astype(np.float64)
        flop = 2.0 * m * n * k
        med = {name: statistics.median(v) for name, v in runs.items()}
        for name in total:
            total[name] += med[name]
        cell = lambda name: f"{1e6 * med[name]:7.1f} ({flop / med[name] / 1e9:4.0f})"  # noqa: E731
        err = " / ".join(f"{np.abs(outs[name] - want).max():.1e}" for name in ("own", "openblas"))
        print(f"{what:<22} {f'{m}x{n}x{k}':>16} {cell('own'):>15} {cell('openblas'):>15} "
              f"{cell('torch'):>15} {med['openblas'] / med['own']:6.2f}  {err}")
    print(f"{'all (one of each)':<39} {1e6 * total['own']:7.1f}         {1e6 * total['openblas']:7.1f}"
          f"         {1e6 * total['torch']:7.1f}       {total['openblas'] / total['own']:6.2f}")


if __name__ == "__main__":
    main()
