"""Training throughput as users get it: forge-ml's trainer exactly as ``forge-ml train`` drives
it, against PyTorch eager and torch.compile in the same run, at the sizes people train.

    python benchmarks/train_e2e.py --data shakespeare.txt [--rows gpt2-b32,char] [--steps 30]

Each row runs three times, each in its own process (so peak memory is that process's):
- forge-ml: ``Trainer`` with real token shards through its data loader, gradient clipping,
  logging every step, eval and samples off (``forge-ml train --device cuda --dtype bf16
  --eval-interval 0 --sample-interval 0 --log-interval 1``); the time of a step is the wall
  time between the starts of consecutive trainer steps (so the loop's own work counts).
- torch eager / torch.compile: a compact GPT-2 (bf16 autocast, SDPA flash attention, fused
  AdamW, clip_grad_norm_, the loss read every step as a logging loop does), fed by the same
  data loader.
Printed per row: tokens/s (median step), peak device memory of the training loop as NVML
counts it for the process (what nvidia-smi shows; forge-ml's final evaluation, which the
trainer runs after the last step and the peers do not, is left out: ``peak_with_eval`` in the
JSON has it), MFU (nanoGPT's 6N + 12 L H Q T FLOPs per token against
989 TFLOP/s dense bf16), and forge-ml's ratio to each peer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # torch_gpt2, the PyTorch peer

PEAK_FLOPS = 989e12
ROWS = {
    # name: (preset or sizes, T, B, tokenizer, dropout)
    "gpt2-b32": (dict(model="gpt2"), 1024, 32, "gpt2", 0.0),
    "gpt2-b16": (dict(model="gpt2"), 1024, 16, "gpt2", 0.0),
    "gpt2-t4096": (dict(model="gpt2"), 4096, 8, "gpt2", 0.0),
    "medium": (dict(model="gpt2-medium"), 1024, 16, "gpt2", 0.0),
    "xl": (dict(model="gpt2-xl"), 1024, 8, "gpt2", 0.0),
    "char": (dict(n_layer=6, n_head=6, n_embd=384), 256, 64, "char", 0.2),
}


class PeakMemory:
    """The device memory NVML counts for this process, polled every 20 ms; ``peak`` in bytes."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nv = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:  # no NVML: say so rather than print a wrong figure
            print(f"(no NVML: {e}; peak memory not measured)", file=sys.stderr)
            self._nv = None
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()

    def current(self) -> int:
        """NVML's count for this process now, in bytes (0 without NVML)."""
        if self._nv is not None:
            try:
                for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self._h):
                    if p.pid == os.getpid() and p.usedGpuMemory:
                        return int(p.usedGpuMemory)
            except Exception:
                pass
        return 0

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def flops_per_token(n_params, n_layer, n_head, head, T):
    return 6 * n_params + 12 * n_layer * n_head * head * T


def prepare_data(text, tokenizer, out):
    from forge_ml.data import prepare
    d = Path(out) / tokenizer
    if not (d / "train.bin").is_file():
        prepare(text, d, tokenizer=tokenizer, val_fraction=0.1)
    return d


def forge_config(sizes, T, B, p, data_dir, out, max_steps):
    """The ``TrainConfig`` of ``forge-ml train --device cuda --dtype bf16 --eval-interval 0
    --sample-interval 0 --log-interval 1`` for ``sizes`` (a preset or the model's sizes)."""
    from forge_ml.train import TrainConfig
    return TrainConfig(data=str(data_dir), block_size=T, batch_size=B, dropout=p, device="cuda",
                       dtype="bf16", max_steps=max_steps, warmup=10, eval_interval=0,
                       sample_interval=0, checkpoint_interval=0, log_interval=1, progress=False,
                       out_dir=out, lr=3e-4, **sizes)


def torch_peer(sizes, T, B, p, data_dir, compile_):
    """The PyTorch peer: a compact GPT-2 (bf16 autocast, SDPA, fused AdamW), eager or under
    ``torch.compile``, fed by forge-ml's data loader. Returns ``(cfg, model, step)``; ``step()``
    runs one training step with clipping and returns its loss, read as a logging loop reads it."""
    import torch
    from torch_gpt2 import torch_gpt2

    from forge_ml.data import DataLoader
    from forge_ml.models.gpt2 import PRESETS, GPT2Config
    from forge_ml.tokenizer import tokenizer_from_dict
    tok = tokenizer_from_dict(json.loads((Path(data_dir) / "tokenizer.json").read_text()))
    dims = dict(PRESETS[sizes["model"]]) if "model" in sizes else dict(sizes)
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=T, dropout=p,
                     **{k: v for k, v in dims.items() if k in ("n_layer", "n_head", "n_embd")})
    torch.backends.cuda.matmul.allow_tf32 = True
    model = torch_gpt2(cfg, dropout=p).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1,
                            fused=True)
    fwd = torch.compile(model) if compile_ else model
    loader = DataLoader(Path(data_dir) / "train.bin", B, T, seed=1337)

    def step():
        x, y = loader.next_batch()
        x, y = torch.from_numpy(x).cuda(non_blocking=True), torch.from_numpy(y).cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()                       # the logging loop reads the loss every step
    return cfg, model, step


def run_forge(row, data_dir, steps, warmup):
    from forge_ml.train import Trainer
    sizes, T, B, _, p = ROWS[row]
    with tempfile.TemporaryDirectory() as out:
        cfg = forge_config(sizes, T, B, p, data_dir, out, warmup + steps)
        mem = PeakMemory()
        trainer = Trainer(cfg, log=lambda *_: None)
        starts, step_peak = [], []
        inner = trainer.train_step

        def timed_step():
            starts.append(time.perf_counter())
            out = inner()
            if len(starts) == warmup + steps:   # the last step: the training loop's peak
                time.sleep(0.05)                # (the poller's period), before the final eval
                step_peak.append(mem.peak)
            return out

        trainer.train_step = timed_step
        trainer.train(until=warmup + steps)
        starts.append(time.perf_counter())   # the loop's work after the last step counts too
        peak = mem.stop()
        c = trainer.model.config
        n = sum(t.numel for t in trainer.opt.params.values())
    dts = [b - a for a, b in zip(starts[warmup:-1], starts[warmup + 1:])]
    return dict(dt=statistics.median(dts), peak=step_peak[0] if step_peak else peak, peak_with_eval=peak,
                fpt=flops_per_token(n, c.n_layer, c.n_head, c.head_size, T), tokens=B * T,
                losses=list(trainer.losses[:3]))


def run_torch(row, data_dir, steps, warmup, compile_):
    import torch
    sizes, T, B, _, p = ROWS[row]
    mem = PeakMemory()
    cfg, model, train_step = torch_peer(sizes, T, B, p, data_dir, compile_)
    times, losses = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(train_step())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    peak = mem.stop()
    n = sum(q.numel() for q in model.parameters())
    return dict(dt=statistics.median(times), peak=peak, tokens=B * T, losses=losses[:3],
                fpt=flops_per_token(n, cfg.n_layer, cfg.n_head, cfg.head_size, T))


def worker(a):
    data_dir = prepare_data(a.data, ROWS[a.row][3], a.cache)
    if a.worker == "forge":
        res = run_forge(a.row, data_dir, a.steps, a.warmup)
    else:
        res = run_torch(a.row, data_dir, a.steps, a.warmup, a.worker == "compile")
    print("RESULT " + json.dumps(res), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a text file (tinyshakespeare)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peers", default="forge,eager,compile")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "forge_e2e_data"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    results = {}
    for row in a.rows.split(","):
        if row not in ROWS:
            raise SystemExit(f"unknown row {row!r}; expected one of {', '.join(ROWS)}")
        for who in a.peers.split(","):
            cmd = [sys.executable, __file__, "--data", a.data, "--worker", who, "--row", row,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--cache", a.cache]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                print(f"{row} {who}: failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(line[-1][7:])
            results[(row, who)] = res
            if a.json:   # as each result comes: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps({f"{r}/{w}": v for (r, w), v in results.items()},
                                                   indent=1))
            print(f"{row:11s} {who:8s} {res['tokens'] / res['dt']:>10,.0f} tok/s  "
                  f"{res['peak'] / 2**30:6.1f} GiB  MFU {res['fpt'] * res['tokens'] / res['dt'] / PEAK_FLOPS:5.1%}"
                  f"  losses {['%.3f' % v for v in res['losses']]}  ({time.time() - t0:.0f} s)", flush=True)
    print("\nrow         forge tok/s  GiB   MFU   | eager tok/s  GiB | compile tok/s  GiB | forge/eager forge/compile")
    for row in a.rows.split(","):
        f, e, c = (results.get((row, w)) for w in ("forge", "eager", "compile"))
        cell = lambda r: (f"{r['tokens'] / r['dt']:>11,.0f} {r['peak'] / 2**30:5.1f}" if r else f"{'-':>11s} {'-':>5s}")  # noqa: E731
        mfu = f"{f['fpt'] * f['tokens'] / f['dt'] / PEAK_FLOPS:5.1%}" if f else "   - "
        ratio = lambda p: f"{p['dt'] / f['dt']:.3f}" if (f and p) else "-"  # noqa: E731
        print(f"{row:11s} {cell(f)} {mfu} | {cell(e)} | {cell(c)} | {ratio(e):>11s} {ratio(c):>13s}")


if __name__ == "__main__":
    main()
