"""Device memory the server engine's prefill graphs keep (GPT-2 124M bf16, 64 slots, cuda): a
prompt of each padded length in turn, the pool's used bytes and the device's free bytes read
after each (cupy's pool counters and cudaMemGetInfo)."""
import gc
import cupy
import numpy as np
from forge_ml.inference.batch import BatchEngine
from forge_ml.inference.engine import SamplingParams
from forge_ml.models import GPT2, GPT2Config
from forge_ml.models.gpt2 import PRESETS

pool = cupy.get_default_memory_pool()
def mib(x): return x / 2**20
model = GPT2.init(GPT2Config(**PRESETS["gpt2"]), seed=0).to("cuda", dtype="bfloat16")
rng = np.random.default_rng(0)
with BatchEngine(model, slots=64) as eng:
    list(eng.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))
    gc.collect(); cupy.cuda.Device().synchronize()
    u0, f0 = pool.used_bytes(), cupy.cuda.runtime.memGetInfo()[0]
    print(f"engine warm (no prefill graph): pool used {mib(u0):8.1f} MiB, total {mib(pool.total_bytes()):8.1f}, device free {mib(f0):9.1f} MiB")
    for n in (40, 100, 200, 400, 800, 1000):
        list(eng.submit([int(t) for t in rng.integers(0, 50257, n)], SamplingParams(max_tokens=1, temperature=0)))
        gc.collect(); cupy.cuda.Device().synchronize()
        u, f = pool.used_bytes(), cupy.cuda.runtime.memGetInfo()[0]
        print(f"after prompt {n:5d}: graphs {sorted(eng._prefill_at)}: pool used +{mib(u - u0):7.1f} MiB, device free -{mib(f0 - f):7.1f} MiB", flush=True)
