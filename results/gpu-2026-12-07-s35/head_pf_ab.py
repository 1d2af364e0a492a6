"""A/B of the layers step's head prefetch (decoder.HEAD_PREFETCH: rows of its first eight each
warp of decode_head asks L2 for before its wait): generate() batch 1 greedy, GPT-2 124M random
weights, a 16-token prompt to position 1,024; each setting its own copy of the model (its own
captured graph), rounds alternating the settings; the tokens checked equal across settings.

    python head_pf_ab.py ROUNDS DTYPE=ROWS,ROWS,... [DTYPE=...]
    python head_pf_ab.py 3 bfloat16=0,4,8 float32=0,2,4
"""
import sys
import time

import cupy as cp
import numpy as np

from forge_ml.backends.cuda import decoder
from forge_ml.inference import generate
from forge_ml.models import GPT2, GPT2Config
from forge_ml.models.gpt2 import PRESETS

rounds = int(sys.argv[1])
cfg = GPT2Config(**PRESETS["gpt2"])
cpu = GPT2.init(cfg, seed=0)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 16)]
for spec in sys.argv[2:]:
    dtype, rows = spec.split("=")
    rows = [int(r) for r in rows.split(",")]
    sfx = "f32" if dtype == "float32" else "bf16"
    models = {r: cpu.to("cuda", dtype=None if dtype == "float32" else dtype) for r in rows}
    toks, res = {}, {r: [] for r in rows}
    for r in rows:   # warm-up: the eager step, then the capture, with this setting
        decoder.HEAD_PREFETCH[sfx] = r
        for _ in range(2):
            toks[r] = list(generate(models[r], prompt, max_new_tokens=1008, temperature=0))
    for k in range(rounds):
        for r in (rows if k % 2 == 0 else rows[::-1]):
            decoder.HEAD_PREFETCH[sfx] = r
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            out = list(generate(models[r], prompt, max_new_tokens=1008, temperature=0))
            cp.cuda.Device().synchronize()
            res[r].append(1008 / (time.perf_counter() - t0))
            assert out == toks[rows[0]], f"{dtype} {r}: tokens differ"
    for r in rows:
        print(f"gpt2 {dtype:9s} head prefetch {r}: " + " / ".join(f"{x:8.1f}" for x in res[r])
              + f" tok/s   (mean {np.mean(res[r]):8.1f}, "
              f"{np.mean(res[r]) / np.mean(res[rows[0]]):.4f} of {rows[0]})", flush=True)
