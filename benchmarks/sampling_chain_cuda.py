"""Each sampling mode's decoding chain against greedy's, per token, on GPT-2 124M (random init,
bf16) at batch 1 and 64: ``DecodeStep.greedy`` and ``DecodeStep.sample`` over 200 steps from
position 16 (each chain run once first, so its graphs are captured), and the choice kernels
alone on this model's own logits (20 calls captured in a CUDA graph). It separates what a
sampled step costs in the chain from what ``sampling_cuda.py`` measures on synthetic logits.

    python benchmarks/sampling_chain_cuda.py [--steps 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODES = {  # knobs: temperature, top_k, top_p, min_p, repetition penalty
    "temperature 0.8 + top-k 40": [0.8, 40, 1.0, 0.0, 1.0],
    "temperature 0.8 + top-p 0.9": [0.8, 0, 0.9, 0.0, 1.0],
    "min-p 0.05": [1.0, 0, 1.0, 0.05, 1.0],
    "repetition penalty 1.2": [0.8, 0, 1.0, 0.0, 1.2],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    import cupy as cp
    import forge_ml as fm
    from forge_ml import ops
    from forge_ml.backends import load
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.models import GPT2, GPT2Config

    bk = load("cuda")
    cfg = GPT2Config()
    V = cfg.vocab_size
    model = GPT2.init(cfg, seed=0, device="cuda", dtype="bfloat16")
    for B in (1, 64):
        cache = model.new_cache(B, cfg.block_size)
        prompt = np.random.default_rng(0).integers(0, V, (B, 16))
        model.forward_cached(fm.tensor(prompt, device="cuda"), cache)
        step = DecodeStep(model, cache)
        tok, keys = prompt[:, -1], [[1, r] for r in range(B)]

        def chain(knobs, n):
            if knobs is None:
                gen = step.greedy(tok, 16, n)
            else:
                seen = np.zeros((B, V), bool) if knobs[4] != 1.0 else None
                gen = step.sample(tok, 16, n, [knobs] * B, keys, seen)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in gen:
                pass
            return (time.perf_counter() - t0) / n * 1e6

        print(f"\nbatch {B}: us per token of the chain, positions 16..{16 + a.steps}")
        chain(None, 16)
        base = chain(None, a.steps)
        print(f"  {'greedy':30s} {base:8.1f}")
        for name, knobs in MODES.items():
            chain(knobs, 16)
            us = chain(knobs, a.steps)
            print(f"  {name:30s} {us:8.1f}  (+{us - base:.1f})")
        # the choice kernels alone on the model's logits at the chain's last position
        logits = step._logits(step._pos)
        z = logits.numpy()[:, :V]
        print(f"  the model's logits: std {z.std():.3f}, distinct values in a row "
              f"{np.mean([len(np.unique(row)) for row in z[:4]]):.0f} of {V}")
        ids = fm.zeros((B, 1), "int32", "cuda")
        pos = fm.tensor(np.zeros(1, np.int32), device="cuda")
        ky = fm.tensor(np.array(keys, np.int32), device="cuda")
        kernels = {"greedy_next": lambda: ops.greedy_next(logits, V, ids, pos)}
        for name, knobs in MODES.items():
            kn = fm.tensor(np.array([knobs] * B, np.float32), device="cuda")
            kernels[name] = lambda kn=kn: ops.sample_next(logits, V, ids, pos, kn, ky, None)
        for name, fn in kernels.items():
            fn()
            g = bk.capture_graph(lambda fn=fn: [fn() for _ in range(20)])
            g.replay()
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            print(f"  kernel alone: {name:30s} {cp.cuda.get_elapsed_time(s, e) / 20 * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
