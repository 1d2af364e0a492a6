"""generate() greedy bf16 at batch 1 and 64 (16 -> 1,024), with decode_attention's one-pass
kernel or (argv[1] == 'two') the two-pass one; run in its own process per variant."""
import sys, time
import numpy as np, cupy as cp
sys.path.insert(0, "src")
from forge_ml.backends.cuda import runtime
if sys.argv[1] == "two":
    src = "#define FORGE_DECODE_TWO_PASS 1\n" + runtime.kernel_source("attention")
    runtime._modules[(runtime._dev(), "attention")] = runtime.compile_source(src, "attention.cu")
from forge_ml.inference import generate
from forge_ml.models import GPT2, GPT2Config
cfg = GPT2Config()
model = GPT2.init(cfg, seed=0).to("cuda", dtype="bfloat16")
prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 16)]
n = 1008
for B in (1, 64):
    prompts = [prompt] * B if B > 1 else prompt
    run = lambda: list(generate(model, prompts, max_new_tokens=n, temperature=0))
    first = run()
    best = 1e9
    for _ in range(3):
        cp.cuda.Device().synchronize(); t0 = time.perf_counter(); run(); cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    print(f"{sys.argv[1]}-pass B={B:3d}: {B * n / best:10.1f} tok/s  first tokens {np.asarray(first).ravel()[:6].tolist()}", flush=True)
