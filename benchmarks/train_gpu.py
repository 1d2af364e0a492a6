"""GPT-2 124M training throughput on one GPU: forge-ml (bf16 mixed precision) against
PyTorch eager (bf16 autocast, SDPA flash attention, fused AdamW) in the same run, optionally
torch.compile too. Random init, T=1024; tokens/s = B*T / median step time.

    python benchmarks/train_gpu.py --batch 32 --steps 20 [--compile] [--layers 12] [--profile]

``--profile`` adds, after the timing, where one step's GPU time goes: forge-ml's per backend
call (CUDA events around each outermost call) and torch eager's per kernel (torch.profiler).

A step is forward + backward + AdamW on every parameter, no grad accumulation. Inputs are
random token ids (fresh each step; what is timed is compute, not data loading).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # torch_gpt2, the PyTorch peer


class _OpTimer:
    """CUDA events around every outermost call of the CUDA backend's public functions."""

    def __init__(self):
        import cupy as cp
        from forge_ml.backends import load
        bk = load("cuda")   # the loaded backend: ops call its attributes, so they are wrapped
        self.cp, self.bk, self.saved, self.records, self.depth = cp, bk, {}, [], 0
        for name in ("matmul", "add", "gelu", "gelu_bwd", "layernorm", "layernorm_bwd",
                     "softmax", "softmax_bwd", "split_heads", "unsplit_head", "merge_heads",
                     "unmerge_heads", "attention", "attention_bwd", "attention_qkv",
                     "attention_qkv_bwd", "attention_qkv_dropout", "attention_qkv_dropout_bwd",
                     "embedding", "dropout_at", "adamw_update_at", "clip_scale",
                     "scatter_add_rows", "cross_entropy", "cross_entropy_bwd", "adamw_update",
                     "sum_rows", "sumsq", "cast", "copy", "zeros", "dropout"):
            fn = getattr(bk, name)
            self.saved[name] = fn
            setattr(bk, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            key = name
            if name == "matmul":
                a, b = args[0], args[1]
                key = (f"matmul {tuple(a.shape)}x{tuple(b.shape)}"
                       f"{' tA' if kw.get('trans_a') or (len(args) > 3 and args[3]) else ''}"
                       f"{' tB' if kw.get('trans_b') or (len(args) > 4 and args[4]) else ''}"
                       f"{' +bias' if (kw.get('bias') is not None or (len(args) > 2 and args[2] is not None)) else ''}")
            e0, e1 = self.cp.cuda.Event(), self.cp.cuda.Event()
            e0.record()
            self.depth += 1
            try:
                return fn(*args, **kw)
            finally:
                self.depth -= 1
                e1.record()
                self.records.append((key, e0, e1))
        return timed

    def report(self, wall_ms):
        self.cp.cuda.Device().synchronize()
        tot: dict = {}
        cnt: dict = {}
        for key, e0, e1 in self.records:
            tot[key] = tot.get(key, 0.0) + self.cp.cuda.get_elapsed_time(e0, e1)
            cnt[key] = cnt.get(key, 0) + 1
        for name, fn in self.saved.items():
            setattr(self.bk, name, fn)
        total = sum(tot.values())
        print(f"\nforge-ml: one step's backend calls, by GPU time (events; sum {total:.1f} ms, "
              f"step wall time {wall_ms:.1f} ms)")
        for key, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  x{cnt[key]:<4d} {key}")


def forge_steps(cfg, B, T, steps, warmup, profile=False):
    import cupy as cp
    import forge_ml as fm
    from forge_ml import Tape
    from forge_ml.models import GPT2
    from forge_ml.optim import AdamW

    model = GPT2.init(cfg, seed=0, device="cuda")
    # the float32 masters stay with the optimizer; the model computes in bf16
    opt = AdamW(model.params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                compute_dtype="bfloat16")
    rs = np.random.default_rng(0)
    times, losses = [], []
    timer = None
    for step in range(1, warmup + steps + 1 + int(profile)):
        if step == warmup + steps + 1:  # the extra profiled step
            timer = _OpTimer()
        ids_np = rs.integers(0, cfg.vocab_size, (B, T + 1))
        ids = fm.tensor(ids_np[:, :-1], device="cuda")
        tg = fm.tensor(ids_np[:, 1:], device="cuda")
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        tape = Tape()
        _, loss, leaves = model.forward(tape, ids, tg)
        tape.backward(loss)
        opt.step({k: tape.grad(leaf) for k, leaf in leaves.items()})
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        if timer is not None:
            timer.report(dt * 1e3)
        elif step > warmup:
            times.append(dt)
            losses.append(loss.t.item())
    return statistics.median(times), losses


def torch_steps(cfg, B, T, steps, warmup, compile_, profile=False):
    import torch
    from torch_gpt2 import torch_gpt2

    torch.backends.cuda.matmul.allow_tf32 = True
    model = torch_gpt2(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model) if compile_ else model
    times = []

    def step_():
        idx = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for step in range(warmup + steps):
        dt = step_()
        if step >= warmup:
            times.append(dt)
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            step_()
        print(f"\n{'torch.compile' if compile_ else 'torch eager'}: one step's kernels by GPU time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--profile", action="store_true", help="where one step's GPU time goes")
    a = ap.parse_args(argv)
    from forge_ml.models import GPT2Config
    cfg = GPT2Config(n_layer=a.layers, block_size=max(1024, a.seq))
    B, T = a.batch, a.seq
    toks = B * T
    rows = []
    t_f, losses = forge_steps(cfg, B, T, a.steps, a.warmup, a.profile)
    print(f"forge-ml losses (first, last): {losses[0]:.4f} {losses[-1]:.4f}  (ln V = {math.log(cfg.vocab_size):.4f})")
    print(f"forge-ml bf16: {t_f * 1e3:.1f} ms/step, {toks / t_f:.0f} tok/s", flush=True)
    rows.append(("forge-ml bf16", t_f))
    peers = [] if a.skip_torch else [("torch eager bf16 + SDPA", False)]
    if a.compile and not a.skip_torch:
        peers.append(("torch.compile bf16 + SDPA", True))
    for name, comp in peers:
        try:
            rows.append((name, torch_steps(cfg, B, T, a.steps, a.warmup, comp,
                                           a.profile and not comp)))
        except Exception as e:  # a peer that fails must not hide forge-ml's figure
            print(f"{name}: failed: {type(e).__name__}: {e}")
    print(f"\nGPT-2 {a.layers}-layer training step, B={B}, T={T}")
    print(f"{'impl':28s} {'ms/step':>9s} {'tok/s':>10s} {'forge speed / this':>19s}")
    for name, t in rows:
        print(f"{name:28s} {t * 1e3:9.1f} {toks / t:10.0f} {t / t_f:19.3f}")


if __name__ == "__main__":
    main()
