"""A/B: decode_attention one-pass (default) vs the two-pass kernel (-DFORGE_DECODE_TWO_PASS)."""
import sys
import numpy as np, cupy
sys.path.insert(0, "src")
import importlib
from forge_ml.backends.cuda import runtime
att = importlib.import_module("forge_ml.backends.cuda.attention")

def use(two_pass):
    src = runtime.kernel_source("attention")
    if two_pass:
        src = "#define FORGE_DECODE_TWO_PASS 1\n" + src
    mod = runtime.compile_source(src, "attention.cu")
    runtime._modules[(runtime._dev(), "attention")] = mod
    for k in list(runtime._functions):
        if k[1] == "attention":
            del runtime._functions[k]

def run(B, pos, dt, reps=100):
    H, hs, Tmax = 12, 64, 1024
    rs = cupy.random.RandomState(0)
    res = {}
    for two in (False, True):
        use(two)
        kc = rs.standard_normal((B, H, Tmax, hs), dtype=cupy.float32)
        vc = rs.standard_normal((B, H, Tmax, hs), dtype=cupy.float32)
        qkv = rs.standard_normal((B, 3 * H * hs), dtype=cupy.float32)
        if dt == "bf16":
            from forge_ml.backends import get
            from forge_ml.device import Device
            be = get(Device("cuda", 0))
            kc, vc, qkv = (be.cast(x, "bfloat16") for x in (kc, vc, qkv))
        p = cupy.asarray(np.array([pos], np.int32))
        y = att.decode_attention(qkv, kc, vc, p, H, 1 / 8)
        cupy.cuda.Device().synchronize()
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(5):
            att.decode_attention(qkv, kc, vc, p, H, 1 / 8)
        s.record()
        for _ in range(reps):
            att.decode_attention(qkv, kc, vc, p, H, 1 / 8)
        e.record(); e.synchronize()
        us = cupy.cuda.get_elapsed_time(s, e) * 1000 / reps
        yh = np.asarray(y.astype(cupy.float32).get() if dt != "bf16" else be.to_host(y), np.float64)
        res[two] = (us, yh)
    bytes_ = 2 * B * H * (pos + 1) * hs * (2 if dt == "bf16" else 4)
    err = np.abs(res[False][1] - res[True][1]).max() / np.abs(res[True][1]).max()
    print(f"B={B:3d} pos={pos:4d} {dt:5s} one-pass {res[False][0]:7.1f} us ({bytes_/res[False][0]/1e6:5.2f} TB/s)  "
          f"two-pass {res[True][0]:7.1f} us ({bytes_/res[True][0]/1e6:5.2f} TB/s)  ratio {res[False][0]/res[True][0]:.3f}  max rel diff {err:.1e}", flush=True)

for dt in ("bf16", "f32"):
    for B, pos in ((64, 512), (64, 1000), (64, 100), (16, 512), (1, 200), (1, 1000)):
        run(B, pos, dt)
# a stream-read reference: the same bytes summed by CuPy
for B, pos in ((64, 512),):
    x = cupy.zeros((2, B, 12, pos + 1, 64), cupy.uint16)
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    x.view(cupy.float32).sum(); s.record()
    for _ in range(20): x.view(cupy.float32).sum()
    e.record(); e.synchronize(); us = cupy.cuda.get_elapsed_time(s, e) * 1000 / 20
    print(f"cupy sum over the same {x.nbytes/1e6:.0f} MB: {us:.1f} us ({x.nbytes/us/1e6:.2f} TB/s)")
