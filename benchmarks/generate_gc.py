"""What Python's garbage collector costs a batch generation that keeps its events: ``generate()``
of a tiny GPT-2 at batch 64 for 1,008 tokens, ``--runs`` times in a row (the
``list(generate(...))`` of ``generate_gpu.py --sampling``), in a process that has imported
torch and transformers (as that benchmark has), each run's time and the full (generation-2)
collections it paid and their time, read through ``gc.callbacks``. On the CPU; the effect is
the host's, so it is the same on a GPU machine.

    python benchmarks/generate_gc.py [--runs 10] [--collect] [--freeze]

``--collect``: ``gc.collect()`` before each run (every run starts from the same state);
``--freeze``: ``gc.freeze()`` after the setup (what a server can do once its model is loaded).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--collect", action="store_true")
    ap.add_argument("--freeze", action="store_true")
    a = ap.parse_args(argv)
    try:   # the heap of generate_gpu.py's process
        for name in ("torch", "transformers"):
            importlib.import_module(name)
    except ImportError:
        print("(torch or transformers missing: the heap is smaller than generate_gpu.py's)")
    from forge_ml.inference import generate
    from forge_ml.models import GPT2, GPT2Config

    model = GPT2.init(GPT2Config(vocab_size=512, block_size=1100, n_layer=1, n_head=1, n_embd=16), seed=0)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 512, 16)]
    full, start = [], [0.0]

    def timer(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                start[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - start[0])

    gc.callbacks.append(timer)
    if a.freeze:
        gc.collect()
        gc.freeze()
    print(f"objects the collector tracks: {len(gc.get_objects())}")
    for i in range(a.runs):
        if a.collect:
            gc.collect()
        full.clear()
        t0 = time.perf_counter()
        out = list(generate(model, [prompt] * a.batch, max_new_tokens=1008, temperature=0))
        t = time.perf_counter() - t0
        print(f"run {i}: {t:.3f} s, {len(out)} steps, full collections {len(full)} "
              f"({sum(full) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
