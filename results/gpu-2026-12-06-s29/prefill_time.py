"""Time to first token of a request alone in a BatchEngine (GPT-2 124M bf16, cuda): prompts of
N tokens, max_tokens 1, one after another; median over 10 after 3 warm-ups, per prompt length."""
import sys, time
import numpy as np
from forge_ml.inference.batch import BatchEngine
from forge_ml.inference.engine import SamplingParams
from forge_ml.models import GPT2, GPT2Config
from forge_ml.models.gpt2 import PRESETS

model = GPT2.init(GPT2Config(**PRESETS["gpt2"]), seed=0).to("cuda", dtype="bfloat16")
rng = np.random.default_rng(0)
with BatchEngine(model, slots=64) as eng:
    for n in (64, 200, 512, 1000):
        ts = []
        for i in range(13):
            pr = [int(t) for t in rng.integers(0, 50257, n)]
            t0 = time.perf_counter()
            out = list(eng.submit(pr, SamplingParams(max_tokens=1, temperature=0)))
            ts.append(time.perf_counter() - t0)
        print(f"prompt {n:5d}: first token alone {1e3 * np.median(ts[3:]):7.2f} ms (median of 10)", flush=True)
    print("prefills", eng.prefills, "graphs", sorted(getattr(eng, "_prefill_at", {})))
