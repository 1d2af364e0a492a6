"""GPT-2 124M data-parallel training throughput on 1, 2, 4 and 8 GPUs: forge-ml (``DataParallel``
over NCCL, bf16 mixed precision, ZeRO-0 or ZeRO-1) against PyTorch DDP (``torchrun``, bf16
autocast, SDPA flash attention, fused AdamW; ``ZeroRedundancyOptimizer`` with ``--zero 1``)
measured in the same run on the same machine.

    python benchmarks/train_ddp.py --gpus 1,2,4,8 --batch 32 --steps 20 [--zero 1] [--skip-torch]

A step is what the data-parallel trainer runs: forward and backward of one micro-batch of
``--batch`` sequences of T=1024 per GPU, the bucketed gradient all-reduce (reduce-scatter with
ZeRO-1), global-norm clipping at 1.0 and AdamW (then the parameter all-gather with ZeRO-1).
Inputs are random token ids, fresh each step (compute and communication are timed, not data
loading). tokens/s = GPUs x batch x T / (median step time on rank 0; every step ends in a
collective, so the ranks finish together). Scaling efficiency at n GPUs = tok/s(n) / (n x
tok/s(1)).

Targets (issue 14): >= 90% scaling efficiency at 8 GPUs; per-GPU tok/s at least llm.c's
(~468K tok/s per H100 on 8 GPUs) and at least PyTorch DDP's on the same machine.

forge-ml's ranks are started by ``forge_ml.distributed.launch.spawn`` (what ``forge-ml train
--gpus N`` runs), PyTorch's by ``torchrun --standalone``. The script stops with exit status 2
and a message when the machine has fewer GPUs than asked, or lacks CuPy.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # torch_gpt2, the PyTorch peer


def fail(msg: str) -> None:
    """Stop with ``msg`` on stderr and exit status 2."""
    print(f"train_ddp: {msg}", file=sys.stderr)
    sys.exit(2)


def gpu_count() -> int:
    """GPUs CUDA sees, or exit 2 saying why none can be counted."""
    try:
        import cupy
    except ImportError:
        fail("needs CuPy and NVIDIA GPUs (pip install 'forge-ml[cuda]'); CuPy is not installed here")
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # no driver, no device
        fail(f"no CUDA device is usable here ({type(e).__name__}: {e})")


# ---------------------------------------------------------------------------------------------
# forge-ml: one process per GPU


def forge_worker(a) -> None:
    import cupy as cp

    import forge_ml as fm
    from forge_ml.distributed import DataParallel, init_process_group
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.optim import AdamW

    comm = init_process_group()
    dev = str(comm.device)
    cfg = GPT2Config(n_layer=a.layers, block_size=max(1024, a.seq))
    model = GPT2.init(cfg, seed=0, device=dev)
    opt = AdamW(model.params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, compute_dtype="bfloat16")
    dp = DataParallel(comm, model, opt, zero=a.zero, bucket_mb=a.bucket_mb)
    rs = np.random.default_rng(1000 + comm.rank)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        ids = rs.integers(0, cfg.vocab_size, (a.batch, a.seq + 1))
        x, y = fm.tensor(ids[:, :-1], device=dev), fm.tensor(ids[:, 1:], device=dev)
        comm.barrier()                       # every rank starts the step together
        t0 = time.perf_counter()
        loss, norm, scale = dp.gradients([(x, y, 0)], max_norm=1.0)
        dp.update(3e-4, scale)
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
            losses.append(loss)
    if comm.rank == 0:
        Path(a.out).write_text(json.dumps({"times": times, "losses": losses}))
    comm.close()


# ---------------------------------------------------------------------------------------------
# PyTorch DDP: one process per GPU, started by torchrun


def torch_worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch_gpt2 import torch_gpt2
    from torch.nn.parallel import DistributedDataParallel as DDP

    from forge_ml.models import GPT2Config

    cfg = GPT2Config(n_layer=a.layers, block_size=max(1024, a.seq))
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = torch_gpt2(cfg).cuda()
    ddp = DDP(model, device_ids=[local], bucket_cap_mb=a.bucket_mb, gradient_as_bucket_view=True)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4,
                                      betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        idx = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
            losses.append(loss.item())
    if rank == 0:
        Path(a.out).write_text(json.dumps({"times": times, "losses": losses}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The driver


def _worker_args(a, kind: str, out: str) -> list:
    return [str(Path(__file__).resolve()), "--worker", kind, "--out", out, "--batch", str(a.batch),
            "--seq", str(a.seq), "--layers", str(a.layers), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--zero", str(a.zero), "--bucket-mb", str(a.bucket_mb)]


def _run(kind: str, n: int, a) -> dict | None:
    from forge_ml.distributed.launch import spawn

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, f"{kind}-{n}.json")
        if kind == "forge":
            rc = spawn(n, [sys.executable, *_worker_args(a, kind, out)])
        else:
            rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={n}", *_worker_args(a, kind, out)]).returncode
        if rc != 0 or not os.path.exists(out):
            print(f"{kind} on {n} GPU(s): failed (exit status {rc})", flush=True)
            return None
        res = json.loads(Path(out).read_text())
    t = statistics.median(res["times"])
    tok_s = n * a.batch * a.seq / t
    print(f"{kind:5s} {n} GPU(s): {t * 1e3:7.1f} ms/step  {tok_s:12,.0f} tok/s  loss {res['losses'][0]:.3f} -> "
          f"{res['losses'][-1]:.3f}", flush=True)
    return {"ms": t * 1e3, "tok_s": tok_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts to measure, e.g. 1,2,4,8")
    ap.add_argument("--batch", type=int, default=32, help="sequences per GPU per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--zero", type=int, choices=(0, 1), default=0)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--worker", choices=("forge", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker == "forge":
        forge_worker(a)
        return 0
    if a.worker == "torch":
        torch_worker(a)
        return 0
    try:
        counts = sorted({int(g) for g in a.gpus.split(",") if g.strip()})
    except ValueError:
        fail(f"--gpus takes GPU counts separated by commas, e.g. 1,2,4,8; got {a.gpus!r}")
    if not counts or counts[0] < 1:
        fail(f"--gpus takes counts >= 1, got {a.gpus!r}")
    have = gpu_count()
    if counts[-1] > have:
        fits = ",".join(str(c) for c in counts if c <= have) or "none"
        fail(f"{counts[-1]} GPUs asked (--gpus {a.gpus}) but this machine has {have}; run it on a machine "
             f"with {counts[-1]} GPUs, or measure what fits here (--gpus {fits})")
    peers = ["forge"]
    if not a.skip_torch:
        if importlib.util.find_spec("torch") is not None:
            peers.append("torch")
        else:
            print("train_ddp: torch is not installed; measuring forge-ml alone (--skip-torch to silence)")
    rows = {}
    for n in counts:
        for kind in peers:
            rows[(kind, n)] = _run(kind, n, a)
    print(f"\nGPT-2 {a.layers}-layer data-parallel step, {a.batch} x {a.seq} tokens per GPU, ZeRO-{a.zero}, "
          f"buckets of {a.bucket_mb:g} MB")
    print(f"{'GPUs':>4s} {'forge tok/s':>13s} {'per GPU':>10s} {'scaling':>8s} {'torch tok/s':>13s} "
          f"{'per GPU':>10s} {'scaling':>8s} {'forge / torch':>14s}")
    base = {k: (rows.get((k, 1)) or {}).get("tok_s") for k in peers}
    for n in counts:
        cells = []
        for kind in ("forge", "torch"):
            r = rows.get((kind, n))
            if r is None:
                cells += ["-", "-", "-"]
                continue
            eff = f"{r['tok_s'] / (n * base[kind]):.1%}" if base.get(kind) else "-"
            cells += [f"{r['tok_s']:,.0f}", f"{r['tok_s'] / n:,.0f}", eff]
        f, t = rows.get(("forge", n)), rows.get(("torch", n))
        ratio = f"{f['tok_s'] / t['tok_s']:.3f}" if f and t else "-"
        print(f"{n:4d} {cells[0]:>13s} {cells[1]:>10s} {cells[2]:>8s} {cells[3]:>13s} {cells[4]:>10s} "
              f"{cells[5]:>8s} {ratio:>14s}")
    return 0 if all(rows.get(("forge", n)) for n in counts) else 1


if __name__ == "__main__":
    sys.exit(main())
