"""The engine alone (no HTTP): 128 requests (32-token prompts, 128 new, half greedy, half
temperature 1) through 64 slots, GPT-2 124M bf16 random weights; steps/s, tokens/s, and a
cProfile of the loop thread's steps."""
import cProfile, pstats, sys, threading, time
import numpy as np
sys.path.insert(0, "src")
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.inference.batch import BatchEngine
from forge_ml.inference.engine import SamplingParams

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, block_size=1024)
m = GPT2.init(cfg, seed=0).to(dev, dtype="bfloat16" if dev == "cuda" else None)
eng = BatchEngine(m, slots=64)
rng = np.random.default_rng(0)

def run(n=128, new=128, prof=None):
    ss = [eng.submit(rng.integers(0, 50257, 32).tolist(),
                     SamplingParams(max_tokens=new, temperature=0 if i % 2 else 1.0, seed=i))
          for i in range(n)]
    st0, t0 = eng.steps, time.perf_counter()
    got = [0]
    def eat(s):
        for _ in s:
            got[0] += 1
    ts = [threading.Thread(target=eat, args=(s,)) for s in ss]
    for t in ts: t.start()
    for t in ts: t.join()
    dt = time.perf_counter() - t0
    return got[0] / dt, (eng.steps - st0) / dt

print("warm", run(64, 16))
for r in range(2):
    tps, sps = run()
    print(f"round {r}: {tps:,.0f} tok/s, {sps:,.1f} steps/s ({1e3 / sps:.2f} ms a step)")
pr = cProfile.Profile()
orig = eng._step_once
def prof(b):
    pr.enable(); orig(b); pr.disable()
eng._step_once = prof
print("profiled", run())
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
eng.close()
