"""The products with a cuBLASLt epilogue against the path before them, at GPT-2 124M's training
shapes (B*T = 32,768 rows) and at a batch-64 decoding step, bf16, on one GPU.

For each of a layer's four products it times (CUDA events, ``--reps`` calls back to back):
the forward (``matmul`` with a bias; + GELU for c_fc; + the residual add for the two
projections) with ``FORGE_CUBLASLT=off`` (bias_fill, cuBLAS with beta = 1, then gelu or add),
then as one cuBLASLt product; and, at the training shapes, the weight gradient with the bias
gradient (matmul + sum_rows, then one product with BGRADA). The relative error column compares
the two paths' outputs (the GPU tests check both against float64).

    python benchmarks/epilogues_cuda.py [--reps 20]
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    import cupy as cp
    from forge_ml import flags
    from forge_ml.backends import load
    lt = importlib.import_module("forge_ml.backends.cuda.cublaslt")
    bk = load("cuda")
    rs = np.random.default_rng(0)

    def timed(fn):
        fn()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        for _ in range(a.reps):
            fn()
        e.record()
        e.synchronize()
        return cp.cuda.get_elapsed_time(s, e) / a.reps

    def dev(shape, scale=1.0):
        return bk.from_host(rs.standard_normal(shape) * scale, "bfloat16")

    def rel(x, y):
        x, y = (bk.to_host(v).astype(np.float64) for v in (x, y))
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    print("bf16, ms per call: before -> one cuBLASLt product (relative difference)")
    total = [0.0, 0.0]
    for rows in (32768, 64):
        for name, K, N, act in (("c_attn", 768, 2304, "bias"), ("attn c_proj + add", 768, 768, "res"),
                                ("c_fc + gelu", 768, 3072, "gelu"), ("mlp c_proj + add", 3072, 768, "res")):
            X, W, B, R = dev((rows, K), 0.5), dev((K, N), 0.02), dev((N,), 0.1), dev((rows, N))
            out, aux = bk.zeros((rows, N), "bfloat16"), bk.zeros((rows, N), "bfloat16")

            def before():
                y = bk.matmul(X, W, B, False, False, 1.0, None)
                return bk.gelu(y) if act == "gelu" else bk.add(R, y) if act == "res" else y

            def after():
                if act == "gelu":
                    return lt.lt_matmul(X, W, out, bias=B, epilogue="gelu_aux_bias", aux=aux)
                return lt.lt_matmul(X, W, out, bias=B, epilogue="bias", c=R if act == "res" else None)
            with flags.override(FORGE_CUBLASLT=False, FORGE_GEMV=False):
                t0, want = timed(before), before()
            assert after(), f"cuBLASLt could not take {name}"
            t1 = timed(after)
            line = f"  {rows:6d} rows  {name:18s} fwd {t0:7.4f} -> {t1:7.4f} ({rel(out, want):.1e})"
            if rows > 64:
                DY = dev((rows, N), 0.1)
                dw, db = bk.zeros((K, N), "bfloat16"), bk.zeros((N,), "bfloat16")
                with flags.override(FORGE_CUBLASLT=False):
                    grads = lambda: (bk.matmul(X, DY, None, True, False, 1.0, None), bk.sum_rows(DY))  # noqa: E731
                    t2, (dw0, db0) = timed(grads), grads()
                fused = lambda: lt.lt_matmul(X, DY, dw, trans_a=True, bias=db, epilogue="bgrada")  # noqa: E731
                t3 = timed(fused)
                line += f"   dW+db {t2:7.4f} -> {t3:7.4f} ({rel(dw, dw0):.1e}, {rel(db, db0):.1e})"
                total[0] += t0 + t2
                total[1] += t1 + t3
            print(line, flush=True)
    print(f"training shapes, one layer: {total[0]:.3f} -> {total[1]:.3f} ms; "
          f"x12 layers: {12 * (total[0] - total[1]):.2f} ms a step")


if __name__ == "__main__":
    main()
