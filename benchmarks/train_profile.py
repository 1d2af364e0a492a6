"""Where the trainer's step goes on the GPU, kernel by kernel, beside torch.compile's step:
the table every change to the training kernels starts from (benchmarks/RESULTS.md, sixth
session, was made with it).

    python benchmarks/train_profile.py --data shakespeare.txt [--model gpt2] [--batch 32]
                                       [--block 1024] [--who forge,compile] [--top 40]

For each side, in its own process:
- ``forge``: forge-ml's ``Trainer`` as ``forge-ml train`` drives it (real token shards, bf16,
  clipping, eval off). First the step as users run it (captured as one graph): the wall time
  of ``train_step`` and the GPU time of the graph's replay alone (their difference is what the
  host adds between steps). Then the step op by op (``FORGE_TRAIN_GRAPH=off``, so that every
  kernel is its own activity) under ``torch.profiler`` (CUPTI sees CuPy's kernels too).
  With ``--gaps``, the graph's replays are profiled too (CUPTI records the kernels inside a
  graph one by one): their kernel table, and the GPU's idle time between kernels, summed by
  the pair of kernels around each gap (what the graph loses beyond its kernels' time).
- ``compile``: the PyTorch peer of ``train_e2e.py`` under ``torch.compile``, the same batches.
Printed: the GPU kernel time a step, the kernels by their time a step (name, ms, calls a
step), and those times summed by kind (``KINDS``: the attention's backward and forward, the
products, cross-entropy, layernorm, the optimizer, other), as RESULTS.md's tables read them.
The graph's kernels are the op-by-op step's: the two profiles differ only in launch gaps.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


# The kinds of kernel a training step's time is read by, first match wins: a name part that
# marks each (forge-ml's kernels, cuBLAS(Lt)'s, cuDNN's and Inductor's); the rest is "other".
KINDS = (("attention backward", ("flash_bwd", "bprop", "dot_do_o", "convert_dq")),
         ("attention forward", ("flash_fwd", "fprop")),
         ("products", ("nvjet", "xmma", "gemm", "splitkreduce", "cutlass")),
         ("cross-entropy", ("cross_entropy", "softmax", "nll_loss")),
         ("layernorm", ("layernorm", "layer_norm")),
         ("optimizer", ("adamw", "multi_tensor_apply")))


def by_kind(times: dict) -> dict:
    """``{name: ms a step}`` summed into ``KINDS`` (and "other"), in KINDS' order.

    >>> by_kind({"flash_fwd_x": 1.0, "nvjet_a": 2.0, "memset": 0.5, "triton_gelu": 0.25})
    {'attention backward': 0.0, 'attention forward': 1.0, 'products': 2.0, 'cross-entropy': 0.0, \
'layernorm': 0.0, 'optimizer': 0.0, 'other': 0.75}
    """
    out = {kind: 0.0 for kind, _ in KINDS}
    out["other"] = 0.0
    for name, ms in times.items():
        low = name.lower()
        kind = next((k for k, parts in KINDS if any(p in low for p in parts)), "other")
        out[kind] += ms
    return out


def kernel_table(prof, steps: int, top: int, tag: str) -> None:
    """The CUDA activities of ``prof`` summed by name, per step, largest first, then by kind."""
    import torch
    agg = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name][0] += getattr(ev, "device_time_total", 0.0)
            agg[ev.name][1] += 1
    total = sum(v[0] for v in agg.values()) / steps
    print(f"== {tag}: GPU kernel time {total / 1000:.2f} ms a step, {len(agg)} kernel names")
    for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / steps / 1000:8.3f} ms {n / steps:6.1f}x  {name[:140]}")
    kinds = by_kind({name: us / steps / 1000 for name, (us, _) in agg.items()})
    print(f"== {tag}, by kind (ms a step): "
          + ", ".join(f"{kind} {ms:.2f}" for kind, ms in kinds.items()))


def gap_table(prof, steps: int, top: int, tag: str) -> None:
    """Where the GPU waits inside ``steps`` replays of a graph: the CUDA activities of ``prof``
    in start order (one stream: the graph is a chain), the idle time before each kernel summed
    by the pair (the kernel before, the kernel that started late), per step, largest first.
    Busy plus idle is the replays' span; the kernel table of the same profile comes first."""
    import torch
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
                  and not ev.name.startswith("Memcpy")),
                 key=lambda ev: ev.time_range.start)
    if not evs:
        print(f"== {tag}: the profiler saw no kernel inside the graph's replays")
        return
    pairs = collections.defaultdict(lambda: [0.0, 0])
    busy, end = 0.0, evs[0].time_range.start
    for prev, ev in zip([None] + evs[:-1], evs):
        start, stop = ev.time_range.start, ev.time_range.end
        if prev is not None and start > end:
            key = (prev.name[:48], ev.name[:48])
            pairs[key][0] += start - end
            pairs[key][1] += 1
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - evs[0].time_range.start
    print(f"== {tag}: {span / steps / 1000:.2f} ms a step from the first kernel to the last, "
          f"{busy / steps / 1000:.2f} busy, {(span - busy) / steps / 1000:.2f} idle "
          f"({len(evs) / steps:.0f} kernels a step)")
    print("idle ms a step   gaps a step   us a gap   after -> before")
    for (a_, b_), (us, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / steps / 1000:14.3f} {n / steps:13.1f} {us / n:10.2f}   {a_} -> {b_}")


def forge(a, data) -> None:
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from train_e2e import forge_config

    from forge_ml import flags
    from forge_ml.train import Trainer
    for mode in ("on", "off"):
        with flags.override(FORGE_TRAIN_GRAPH=mode), tempfile.TemporaryDirectory() as out:
            cfg = forge_config(dict(model=a.model), a.block, a.batch, 0.0, data, out, 10 ** 6)
            tr = Trainer(cfg, log=lambda *_: None)
            for _ in range(a.warmup):
                tr.train_step()
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                tr.train_step()
            cp.cuda.Device().synchronize()
            wall = (time.perf_counter() - t0) / a.steps
            tokens = a.batch * a.block
            if mode == "on":
                fast = tr._fast
                if fast is None or fast.mode != "graph":
                    print(f"forge-ml: the step is not a graph here ({getattr(fast, 'why_eager', None)})")
                    continue
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                for _ in range(a.steps):
                    fast._graph.replay()
                e.record()
                e.synchronize()
                replay = cp.cuda.get_elapsed_time(s, e) / a.steps
                print(f"forge-ml, the step as one graph: train_step {wall * 1e3:.2f} ms "
                      f"({tokens / wall:,.0f} tok/s); the replay alone {replay:.2f} ms; the host "
                      f"adds {wall * 1e3 - replay:.2f} ms")
                if a.gaps:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(a.steps):
                            fast._graph.replay()
                        cp.cuda.Device().synchronize()
                    kernel_table(prof, a.steps, a.top, "forge-ml, the graph's replays")
                    gap_table(prof, a.steps, a.top, "forge-ml, the graph's replays")
                continue
            print(f"forge-ml, op by op: train_step {wall * 1e3:.2f} ms ({tokens / wall:,.0f} tok/s)")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    tr.train_step()
                cp.cuda.Device().synchronize()
            kernel_table(prof, a.steps, a.top, "forge-ml, op by op")


def compiled(a, data) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from train_e2e import torch_peer

    _, _, step = torch_peer(dict(model=a.model), a.block, a.batch, 0.0, data, compile_=True)
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / a.steps
    print(f"torch.compile: step {wall * 1e3:.2f} ms ({a.batch * a.block / wall:,.0f} tok/s)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    kernel_table(prof, a.steps, a.top, "torch.compile")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a text file (tinyshakespeare)")
    ap.add_argument("--model", default="gpt2", help="a GPT-2 preset (gpt2, gpt2-medium, ...)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--top", type=int, default=40, help="kernels listed per side")
    ap.add_argument("--who", default="forge,compile")
    ap.add_argument("--gaps", action="store_true",
                    help="also profile the graph's replays: their kernels, and the GPU's idle "
                         "time between two kernels by the pair")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "forge_e2e_data"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from train_e2e import prepare_data
    data = prepare_data(a.data, "gpt2", a.cache)
    if a.worker:
        return (forge if a.worker == "forge" else compiled)(a, data)
    for who in a.who.split(","):
        if who not in ("forge", "compile"):
            raise SystemExit(f"--who takes forge and compile, got {who!r}")
        args = [sys.executable, __file__, "--worker", who] + [x for x in (argv or sys.argv[1:])]
        subprocess.run(args, env=dict(os.environ), check=False)


if __name__ == "__main__":
    main()
