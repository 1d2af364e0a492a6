"""Causal attention on the GPU in bfloat16: forge-ml's fused (flash) kernels against its composed
("v1") path (cuBLAS + softmax kernels, T x T scores in memory) and against PyTorch's
``F.scaled_dot_product_attention(is_causal=True)`` pinned to its flash backend, measured in the
same run on the same inputs.

GPT-2 124M attention shapes: H=12, hs=64, T in --seq (default 1024), B in --batch (default
8,16,32). --torch-backend picks PyTorch's kernel (flash, cudnn, or default: what SDPA chooses
itself, as the trainer's peer gets it); --no-v1 skips the composed path (its T x T scores
dominate at long T). Two passes:
``fwd`` (out and lse) and ``fwd+bwd`` (then dq, dk, dv for a random dout). Timing: CUDA events
around one call, ``--warmup`` untimed calls first, median of ``--reps`` timed calls.

    PYTHONPATH=src python3 benchmarks/attention_cuda.py [--batch 8,16,32] [--reps 20]
    PYTHONPATH=src python3 benchmarks/attention_cuda.py --seq 4096 --batch 8 --no-v1 \
        --torch-backend default

Prints one row per batch and pass: milliseconds for each, TFLOP/s of the flash kernels and of
torch (causal FLOPs: 2 products of B H T^2 hs / 2 multiply-adds forward, 5 in the backward),
and the ratios flash/torch, v1/torch and v1/flash (above 1: flash is faster than v1). On
compute capability 9.0 "flash" is flash_attention.cu's mma.sync kernels (the switch held off)
and more lines per batch time flash_hopper.cu's wgmma forward (64 and 128 query rows a block)
and backward (its kernel variants; the backend's flash path there by default) beside them (and
torch's forward).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback

H, HS = 12, 64

# the CUDA-event timers are ops_cuda.py's (this folder is on sys.path when a script here runs)
from ops_cuda import time_cupy, time_torch  # noqa: E402


def causal_flops(B, T, passes):
    """Multiply-adds x 2 of the matrix products, counting only the unmasked half."""
    return passes * 2.0 * B * H * T * T * HS / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=1024, help="T, the sequence length")
    ap.add_argument("--torch-backend", choices=("flash", "cudnn", "default"), default="flash")
    ap.add_argument("--no-v1", action="store_true", help="skip the composed path")
    args = ap.parse_args(argv)
    T = args.seq

    import cupy
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from forge_ml import flags
    from forge_ml.backends import get
    from forge_ml.device import Device

    be = get(Device("cuda", 0))

    def rel_err(a, b):
        """||a - b|| / ||b|| of two device arrays, in float64 on the host."""
        a, b = (np.asarray(be.to_host(x), dtype=np.float64) for x in (a, b))
        return np.linalg.norm(a - b) / np.linalg.norm(b)
    scale = 1.0 / math.sqrt(HS)
    # torch's chosen backend; should this build lack it, its default choice, and say so
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    backends = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                "default": every}[args.torch_backend]
    try:
        x = torch.randn(1, 1, 64, HS, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(x, x, x, is_causal=True)
    except RuntimeError as e:
        print(f"note: torch's {args.torch_backend} backend is not usable here ({e}); "
              "torch picks its own")
        backends = every
    print(f"device: {be.device_name()}; cupy {cupy.__version__}; torch {torch.__version__}; "
          f"bfloat16, H={H} T={T} hs={HS}, causal, torch {args.torch_backend}; "
          f"median of {args.reps} after {args.warmup} "
          "warm-ups")
    rows = []
    failures = 0
    # "flash" is flash_attention.cu's kernels, whatever the environment says; flash_hopper.cu's
    # are timed on their own below
    with flags.override(FORGE_WGMMA_ATTENTION="off"):
        for B in (int(b) for b in args.batch.split(",") if b):
            shape = (B, H, T, HS)
            try:
                # the same bf16 values for both frameworks: rounded once on the device, then copied
                host = [be.to_host(be.cast(cupy.random.standard_normal(shape, dtype=cupy.float32),
                                           "bfloat16")) for _ in range(4)]
                q, k, v, dout = (be.from_host(a, "bfloat16") for a in host)
                tq, tk, tv, tdo = (torch.from_numpy(a).cuda().to(torch.bfloat16) for a in host)
                tq.requires_grad_(True)
                tk.requires_grad_(True)
                tv.requires_grad_(True)
                if not be._flash_wanted(q, k, v):
                    raise RuntimeError("the flash path is not taken "
                                       "(FORGE_ATTENTION=composed set?)")

                def flash_fwd():
                    return be.attention(q, k, v, scale)

                def flash_both():
                    out, lse = be.attention(q, k, v, scale)
                    return be.attention_bwd(q, k, v, out, lse, dout, scale)

                def v1_fwd():
                    return be._attention_composed(q, k, v, scale)

                def v1_both():
                    out, lse = be._attention_composed(q, k, v, scale)
                    return be._attention_bwd_composed(q, k, v, out, lse, dout, scale)

                def torch_fwd():
                    with torch.no_grad(), sdpa_kernel(backends):
                        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                              scale=scale)

                def torch_both():
                    with sdpa_kernel(backends):
                        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                             scale=scale)
                    return torch.autograd.grad(out, (tq, tk, tv), tdo)

                # agreement first, so a fast wrong kernel cannot pass unnoticed
                out_f = np.asarray(be.to_host(flash_fwd()[0]), dtype=np.float64)
                out_t = torch_fwd().float().cpu().numpy().astype(np.float64)
                grads_f = [np.asarray(be.to_host(g), dtype=np.float64) for g in flash_both()]
                grads_t = [g.float().cpu().numpy().astype(np.float64) for g in torch_both()]
                agree = [np.linalg.norm(a - b) / np.linalg.norm(b)
                         for a, b in zip([out_f] + grads_f, [out_t] + grads_t)]
                print(f"  B={B:3d} flash vs torch, relative error: out {agree[0]:.2e}  "
                      f"dq {agree[1]:.2e}  dk {agree[2]:.2e}  dv {agree[3]:.2e}", flush=True)
                del out_f, out_t, grads_f, grads_t

                for name, passes, ff, fv, ft in (("fwd", 2, flash_fwd, v1_fwd, torch_fwd),
                                                 ("fwd+bwd", 7, flash_both, v1_both, torch_both)):
                    f_ms = time_cupy(cupy, ff, args.reps, args.warmup)
                    v_ms = math.nan if args.no_v1 else time_cupy(cupy, fv, args.reps, args.warmup)
                    t_ms = time_torch(torch, ft, args.reps, args.warmup)
                    flops = causal_flops(B, T, passes)
                    rows.append((B, name, f_ms, v_ms, t_ms, flops / f_ms / 1e9, flops / t_ms / 1e9))
                    print(f"  B={B:3d} {name:8s} flash {f_ms:8.3f} ms  v1 {v_ms:8.3f} ms  "
                          f"torch {t_ms:8.3f} ms  flash/torch {f_ms / t_ms:5.2f}  "
                          f"v1/flash {v_ms / f_ms:5.2f}", flush=True)
                if be._hopper_ok():   # flash_hopper.cu's wgmma kernels (the flash path there)
                    try:
                        _, _, m_ms, _, t_ms = rows[-2][:5]   # this batch's fwd row, timed above
                        for r in (64, 128):   # query rows a block: one warpgroup or two
                            err = rel_err(be._attention_flash_hopper(q, k, v, scale, rows=r)[0],
                                          flash_fwd()[0])
                            h_ms = time_cupy(cupy, lambda: be._attention_flash_hopper(
                                q, k, v, scale, rows=r), args.reps, args.warmup)
                            print(f"  B={B:3d} fwd      wgmma r{r:<3d} {h_ms:8.3f} ms  mma.sync "
                                  f"{m_ms:8.3f} ms  torch {t_ms:8.3f} ms  wgmma/torch "
                                  f"{h_ms / t_ms:5.2f}  (out vs mma.sync {err:.2e})", flush=True)
                        o, lse = flash_fwd()
                        mb = time_cupy(cupy, lambda: be.attention_bwd(q, k, v, o, lse, dout, scale),
                                       args.reps, args.warmup)
                        want = be.attention_bwd(q, k, v, o, lse, dout, scale)
                        # the kernels' variants: operands in registers or shared memory (dq's q
                        # and dout, dk/dv's k and v), and 64 or 128 query rows a dq block
                        # (and the dk/dv kernel of 128 keys a block, FORGE_WGMMA_DKDV)
                        for qd, kv, r, dkdv, label in (
                                (False, False, 64, "r64", "registers"),
                                (True, False, 64, "r64", "q,dout shared"),
                                (False, True, 64, "r64", "k,v shared"),
                                (True, True, 64, "r64", "both shared"),
                                (True, True, 128, "r64", "both, dq r128"),
                                (True, True, 128, "r128h", "dq r128, dkdv r128h")):
                            def bwd():
                                return be._attention_bwd_flash_hopper(
                                    q, k, v, o, lse, dout, scale, qd_shared=qd, kv_shared=kv,
                                    rows=r, dkdv=dkdv)
                            errs = [rel_err(x, y) for x, y in zip(bwd(), want)]
                            sb = time_cupy(cupy, bwd, args.reps, args.warmup)
                            print(f"  B={B:3d} bwd      wgmma {label:20s} {sb:8.3f} ms  mma.sync "
                                  f"{mb:8.3f} ms  (dq, dk, dv vs mma.sync {errs[0]:.1e} "
                                  f"{errs[1]:.1e} {errs[2]:.1e})", flush=True)
                    except Exception as e:
                        print(f"  B={B:3d} wgmma ERROR {type(e).__name__}: {e}", flush=True)
            except Exception as e:  # keep measuring the other sizes
                failures += 1
                print(f"  B={B:3d} ERROR {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=4)
            finally:
                cupy.get_default_memory_pool().free_all_blocks()
                torch.cuda.empty_cache()

    print()
    print(f"{'B':>3s} {'pass':8s} {'flash ms':>9s} {'v1 ms':>9s} {'torch ms':>9s} "
          f"{'flash TF/s':>10s} {'torch TF/s':>10s} {'flash/torch':>11s} {'v1/torch':>9s} "
          f"{'v1/flash':>8s}")
    for B, name, f_ms, v_ms, t_ms, f_tf, t_tf in rows:
        print(f"{B:3d} {name:8s} {f_ms:9.3f} {v_ms:9.3f} {t_ms:9.3f} {f_tf:10.1f} {t_tf:10.1f} "
              f"{f_ms / t_ms:11.2f} {v_ms / t_ms:9.2f} {v_ms / f_ms:8.2f}")
    if rows:
        geo = math.exp(statistics.fmean(math.log(r[2] / r[4]) for r in rows))
        print(f"geometric mean of flash/torch over {len(rows)} rows: {geo:.2f}; "
              f"{failures} size(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
