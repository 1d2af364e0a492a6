"""A/B of the layers step's L2 hints for the next kernel's weights (decoder.PREFETCH):
generate() batch 1 greedy, GPT-2 124M random weights, a 16-token prompt to position 1,024, each
mode its own copy of the model (its own captured graph), rounds alternating the modes; tokens
checked equal across modes."""
import sys, time
import numpy as np
import cupy as cp
from forge_ml.backends.cuda import decoder
from forge_ml.inference import generate
from forge_ml.models import GPT2, GPT2Config
from forge_ml.models.gpt2 import PRESETS

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
name = sys.argv[2] if len(sys.argv) > 2 else "gpt2"
dtypes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["float32", "bfloat16"]
cfg = GPT2Config(**PRESETS[name])
cpu = GPT2.init(cfg, seed=0)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 16)]
for dtype, modes in [d for d in (("float32", ("off", "auto")), ("bfloat16", ("off", "on"))) if d[0] in dtypes]:
    models = {m: cpu.to("cuda", dtype=None if dtype == "float32" else dtype) for m in modes}
    toks, res = {}, {m: [] for m in modes}
    for m in modes:   # warm-up: the eager step, then the capture, in this mode
        decoder.PREFETCH = m
        print(dtype, m, "prefetch (mlp, attn):", decoder._prefetching(
            np.float32 if dtype == "float32" else decoder.BF16, cfg.n_embd, cfg.n_head,
            type("P", (), {"B": 1, "grid_mlp": cfg.n_embd // (4 if dtype == "float32" else 8)})()), flush=True)
        for _ in range(2):
            toks[m] = list(generate(models[m], prompt, max_new_tokens=1008, temperature=0))
    for r in range(rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            decoder.PREFETCH = m
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            out = list(generate(models[m], prompt, max_new_tokens=1008, temperature=0))
            cp.cuda.Device().synchronize()
            res[m].append(1008 / (time.perf_counter() - t0))
            assert out == toks[modes[0]], f"{dtype} {m}: tokens differ"
    for m in modes:
        print(f"{name} {dtype:9s} prefetch {m:4s}: " + " / ".join(f"{x:8.1f}" for x in res[m])
              + f" tok/s   (mean {np.mean(res[m]):8.1f})", flush=True)
    print(f"{dtype:9s} {modes[1]} / {modes[0]}: {np.mean(res[modes[1]]) / np.mean(res[modes[0]]):.4f}", flush=True)
