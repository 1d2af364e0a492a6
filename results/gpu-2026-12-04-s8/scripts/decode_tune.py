"""decode_attention's one-pass kernel: rows in flight U (2, 4, 8) x threads (128, 256), batch 64 and 1."""
import sys, importlib
import numpy as np, cupy
sys.path.insert(0, "src")
from forge_ml.backends.cuda import runtime
from forge_ml.backends import get
from forge_ml.device import Device
att = importlib.import_module("forge_ml.backends.cuda.attention")
be = get(Device("cuda", 0))

def use(U, threads):
    src = f"#define DECODE_ROWS_IN_FLIGHT {U}\n" + runtime.kernel_source("attention")
    runtime._modules[(runtime._dev(), "attention")] = runtime.compile_source(src, "attention.cu")
    for k in list(runtime._functions):
        if k[1] == "attention":
            del runtime._functions[k]
    att._DECODE_THREADS = threads

H, hs, Tmax = 12, 64, 1024
data = {}
for B in (64, 1):
    rs = cupy.random.RandomState(0)
    kc, vc, qkv = (be.cast(rs.standard_normal(sh, dtype=cupy.float32), "bfloat16")
                   for sh in ((B, H, Tmax, hs), (B, H, Tmax, hs), (B, 3 * H * hs)))
    data[B] = (kc, vc, qkv)
ref = {}
for U, threads in ((4, 256), (2, 256), (8, 256), (4, 128), (8, 128), (2, 128)):
    use(U, threads)
    line = f"U={U} threads={threads}:"
    for B in (64, 1):
        kc, vc, qkv = data[B]
        for pos in ((256, 512, 1000) if B == 64 else (200, 1000)):
            p = cupy.asarray(np.array([pos], np.int32))
            y = att.decode_attention(qkv, kc, vc, p, H, 0.125)
            yh = np.asarray(be.to_host(y), np.float64)
            key = (B, pos)
            diff = 0.0 if key not in ref else np.abs(yh - ref[key]).max()
            ref.setdefault(key, yh)
            # a CUDA graph of 20 calls: GPU time, not the host's launch cost
            st = cupy.cuda.Stream(non_blocking=True)
            with st:
                att.decode_attention(qkv, kc, vc, p, H, 0.125)
                st.begin_capture()
                for _ in range(20):
                    att.decode_attention(qkv, kc, vc, p, H, 0.125)
                g = st.end_capture()
                g.launch(st); st.synchronize()
                s, e = cupy.cuda.Event(), cupy.cuda.Event()
                s.record(st)
                for _ in range(10):
                    g.launch(st)
                e.record(st); e.synchronize()
            us = cupy.cuda.get_elapsed_time(s, e) * 1000 / 200
            tb = 2 * B * H * (pos + 1) * hs * 2 / us / 1e6
            line += f"  B{B}/p{pos} {us:6.1f}us {tb:4.2f}TB/s d{diff:.0e}"
    print(line, flush=True)
