"""A/B of the layers step's LM head variants (head_variants.py): generate() batch 1 greedy,
GPT-2 124M random weights, a 16-token prompt to position 1,024, bf16 and float32; each variant
its own build of decode_layers.cu and its own copy of the model (its own captured graph),
rounds alternating the variants, the tokens checked equal to main's.

    python head_ab.py ROUNDS [VARIANT ...]
"""
import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import head_variants as hv   # noqa: E402
from forge_ml.backends.cuda import decoder, runtime   # noqa: E402
from forge_ml.inference import generate   # noqa: E402
from forge_ml.models import GPT2, GPT2Config   # noqa: E402
from forge_ml.models.gpt2 import PRESETS   # noqa: E402

rounds = int(sys.argv[1])
names = sys.argv[2:] or list(hv.VARIANTS)
dev = runtime._dev()
mods = {n: runtime.compile_source(hv.source(n, runtime.kernel_source("decode_layers")),
                                  f"decode_layers.cu ({n})", runtime._compile_options())
        for n in names}


def use(n):
    """decode_layers' kernels from variant n's build, decoder's head block as n's."""
    warps, rows = hv.VARIANTS[n][:2]
    runtime._modules[(dev, "decode_layers")] = mods[n]
    for cache in (runtime._functions, runtime._shared_room):
        for k in [k for k in cache if k[1] == "decode_layers"]:
            del cache[k]
    for name in ("layer_attn_bf16", "layer_attn_f32", "layer_mlp_bf16", "layer_mlp_f32"):
        runtime._set_max_shared("decode_layers", name, 0)   # the new build's functions opt in
        runtime._set_max_shared("decode_layers", name,       # to all the room there is
                                runtime._shared_room[(dev, "decode_layers", name)][0])
    decoder._DL_HEAD_THREADS = warps * 32
    decoder._DL_HEAD_BLOCK_ROWS = warps * rows


cfg = GPT2Config(**PRESETS["gpt2"])
cpu = GPT2.init(cfg, seed=0)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 16)]
for dtype in ("bfloat16", "float32"):
    models, toks, res, grids = {}, {}, {n: [] for n in names}, {}
    for n in names:   # warm-up: the eager step, then the capture, with this variant
        use(n)
        grids[n] = decoder._head_grid(50304, decoder._sm_count(dev))
        models[n] = cpu.to("cuda", dtype=None if dtype == "float32" else dtype)
        for _ in range(2):
            toks[n] = list(generate(models[n], prompt, max_new_tokens=1008, temperature=0))
    for k in range(rounds):
        for n in (names if k % 2 == 0 else names[::-1]):
            use(n)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            out = list(generate(models[n], prompt, max_new_tokens=1008, temperature=0))
            cp.cuda.Device().synchronize()
            res[n].append(1008 / (time.perf_counter() - t0))
            assert out == toks[names[0]], f"{dtype} {n}: tokens differ from {names[0]}'s"
    for n in names:
        print(f"gpt2 {dtype:9s} head {n:10s}: " + " / ".join(f"{x:8.1f}" for x in res[n])
              + f" tok/s  (mean {np.mean(res[n]):8.1f}, {np.mean(res[n]) / np.mean(res[names[0]]):.4f}"
              f" of {names[0]}; {grids[n]} blocks)", flush=True)
    del models
