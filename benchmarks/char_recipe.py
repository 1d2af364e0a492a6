"""nanoGPT's shakespeare_char recipe end to end (issue 10): forge-ml's trainer, as
``forge-ml train`` drives it, against the same recipe in PyTorch (eager, and with
``--peers forge,eager,compile`` torch.compile), on the same machine and the same data split.

The recipe is nanoGPT's ``config/train_shakespeare_char.py``:
- 6 layers, 6 heads, 384 channels, context 256, batch 64, dropout 0.2;
- lr 1e-3 falling to 1e-4 at step 5000 after 100 warmup steps;
- AdamW betas (0.9, 0.99), weight decay 0.1, clip 1.0;
- val loss every 250 steps on 200 batches. nanoGPT reports a best val loss of 1.4697.

On the GPU both frameworks train in bf16 (forge-ml: float32 masters; PyTorch: autocast).

    python benchmarks/char_recipe.py --data tinyshakespeare.txt --device cuda
    python benchmarks/char_recipe.py --data t.txt --device cpu --smoke     (the plumbing, tiny sizes)

It prints, for each framework, the median time per iteration (evaluation steps excluded),
the best and final val loss, and forge-ml's time as a fraction of each peer's. Issue 10's
targets are forge-ml <= 0.5x torch eager's time per iteration, the same final val loss within
0.02, and a best val loss <= 1.48.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # torch_gpt2, the PyTorch peer

RECIPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2,
              lr=1e-3, min_lr=1e-4, warmup=100, weight_decay=0.1, beta1=0.9, beta2=0.99,
              grad_clip=1.0, seed=1337)


def run_forge(a, out: Path) -> dict:
    """The recipe through ``Trainer`` (what ``forge-ml train`` runs); times from its log."""
    from forge_ml.runs import read_log
    from forge_ml.train import TrainConfig, Trainer
    cfg = TrainConfig(data=a.data, device=a.device, dtype="bf16" if a.device.startswith("cuda") else "float32",
                      max_steps=a.max_steps, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
                      sample_interval=0, checkpoint_interval=0, log_interval=0, progress=False,
                      out_dir=str(out / "forge"), **RECIPE)
    with Trainer(cfg, log=None) as t:
        res = t.train()
    records, _ = read_log(Path(cfg.out_dir) / "log.jsonl")
    dts = [r["dt_ms"] for r in records if "dt_ms" in r][5:]       # after the capture and warm-up
    vals = [r["val_loss"] for r in records if r.get("val_kind") == "sampled"]
    return dict(ms=statistics.median(dts), best=min(vals + [res["val_loss"]]),
                final=res["val_loss"], data=str(Path(cfg.out_dir) / "data"))


def run_torch(a, data_dir: Path, compiled: bool) -> dict:
    """The same recipe in PyTorch on forge-ml's shards: one micro-batch per step, the loss read
    every step (as a logging loop does), val loss on ``eval_iters`` batches every
    ``eval_interval`` steps."""
    import numpy as np
    import torch
    from torch_gpt2 import torch_gpt2

    from forge_ml.data import DataLoader
    from forge_ml.models.gpt2 import GPT2Config
    from forge_ml.optim import cosine_lr
    from forge_ml.tokenizer import tokenizer_from_dict
    tok = tokenizer_from_dict(json.loads((data_dir / "tokenizer.json").read_text()))
    r = RECIPE
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=r["block_size"], n_layer=r["n_layer"],
                     n_head=r["n_head"], n_embd=r["n_embd"], dropout=r["dropout"])
    dev = "cuda" if a.device.startswith("cuda") else "cpu"
    torch.manual_seed(r["seed"])
    model = torch_gpt2(cfg, dropout=r["dropout"]).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=r["lr"],
                            betas=(r["beta1"], r["beta2"]), fused=dev == "cuda")
    fwd = torch.compile(model) if compiled else model
    train = DataLoader(data_dir / "train.bin", r["batch_size"], r["block_size"], seed=r["seed"])
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)

    def batch(loader):
        x, y = loader.next_batch()
        return torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)

    def evaluate():
        val = DataLoader(data_dir / "val.bin", r["batch_size"], r["block_size"], seed=0)
        model.eval()
        with torch.no_grad(), amp:
            losses = [float(fwd(*batch(val))) for _ in range(a.eval_iters)]
        model.train()
        return float(np.mean(losses))

    times, vals = [], []
    for step in range(a.max_steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, r["lr"], r["warmup"], a.max_steps, r["min_lr"])
        x, y = batch(train)
        with amp:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise SystemExit(f"torch: the loss is {loss_value} at step {step + 1}")
        times.append(time.perf_counter() - t0)
        if a.eval_interval and (step + 1) % a.eval_interval == 0 and step + 1 < a.max_steps:
            vals.append(evaluate())
    final = evaluate()
    return dict(ms=1e3 * statistics.median(times[5:]), best=min(vals + [final]), final=final)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="tinyshakespeare.txt (a text file)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-iters", type=int, default=200)
    ap.add_argument("--peers", default="forge,eager", help="of forge, eager, compile")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script on the CPU: 2 layers of 64 channels, T=32, B=4, 12 steps")
    a = ap.parse_args(argv)
    if a.smoke:
        RECIPE.update(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=4, warmup=2)
        a.max_steps, a.eval_interval, a.eval_iters = 12, 6, 2
    if not Path(a.data).is_file():
        raise SystemExit(f"--data: {a.data} is not a file (expected tinyshakespeare.txt)")
    peers = a.peers.split(",")
    unknown = set(peers) - {"forge", "eager", "compile"}
    if unknown or "forge" not in peers:
        raise SystemExit(f"--peers: expected forge and any of eager, compile; got {a.peers!r}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["forge"] = run_forge(a, Path(tmp))
        data_dir = Path(results["forge"].pop("data"))
        for who in [p for p in peers if p != "forge"]:
            results[who] = run_torch(a, data_dir, compiled=who == "compile")
    print(f"shakespeare_char recipe, {a.max_steps} steps on {a.device}")
    print(f"{'':8s} {'ms/iter':>9s} {'best val':>9s} {'final val':>10s}   forge time / peer time")
    f = results["forge"]
    for who, res in results.items():
        ratio = "" if who == "forge" else f"   {f['ms'] / res['ms']:.3f}"
        print(f"{who:8s} {res['ms']:9.2f} {res['best']:9.4f} {res['final']:10.4f}{ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
