"""The batch-64 decoding step's four products (GPT-2 124M, bf16, 64 rows), each launched
``--reps`` times on the GPU backend exactly as the step calls them (``linear``: the layernorm
kernel, then one cuBLASLt product with its epilogue), for Nsight Compute to profile without
the prompt's products in front (``call_ncu.sh``'s second half).

    ncu -k regex:"nvjet|gemm|layernorm" python3 step_products.py --reps 2
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from forge_ml.backends import load  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    be = load("cuda")
    rs = np.random.default_rng(0)

    def dev(*shape, scale=0.02):
        return be.from_host((rs.standard_normal(shape) * scale).astype(np.float32), "bfloat16")

    M, C = 64, 768
    x, x4 = dev(M, C, scale=1.0), dev(M, 4 * C, scale=1.0)
    ln = (dev(C, scale=1.0), dev(C), 1e-5)
    w = [dev(C, 3 * C), dev(C, C), dev(C, 4 * C), dev(4 * C, C)]
    b = [dev(3 * C), dev(C), dev(4 * C), dev(C)]
    steps = [("ln + c_attn", lambda: be.linear(x, w[0], b[0], None, None, ln)),
             ("attn c_proj + residual", lambda: be.linear(x, w[1], b[1], None, x)),
             ("ln + c_fc + gelu", lambda: be.linear(x, w[2], b[2], "gelu", None, ln)),
             ("mlp c_proj + residual", lambda: be.linear(x4, w[3], b[3], None, x))]
    for name, fn in steps:
        for _ in range(args.reps):
            fn()
        be.synchronize()
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
