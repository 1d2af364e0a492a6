"""Convergence check: nanoGPT's CPU shakespeare_char run in forge-ml, target val loss <= 1.90.

The configuration of nanoGPT's README for a CPU ("4 layers, 4 heads, 128 channels, context
64, batch 12, 2000 iterations, dropout 0", which reaches about 1.88 there) with its
``config/train_shakespeare_char.py`` optimiser settings: lr 1e-3 decaying to 1e-4 by step
2000 after 100 warmup steps, AdamW betas (0.9, 0.99), weight decay 0.1, grad clip 1.0. The
text is ``../shared/data/tinyshakespeare.txt`` next to the repository (skipped with a message
if absent), character-level, 90% train / 10% val as nanoGPT splits it. The val loss held to
the target is nanoGPT's own figure, its ``estimate_loss``: the mean over ``--eval-iters``
batches of windows drawn at random from the validation shard (seeded). Printed beside it: the
trainer's last evaluation, over every window of the validation shard (what
``summary["val_loss"]`` holds), and the mean over the first ``--eval-iters`` batches, the
trainer's periodic estimate. (Until 2026-12-05 the target was held to that fixed subset,
1.8822 there, which reads low: nanoGPT's estimate gives 1.906 and the whole set 1.904.)

Its peer is ``converge_torch.py``: nanoGPT's model and training loop in PyTorch on the same
data, scored on the same random val windows. Six seeds each (2026-12-07, this VM): forge-ml
1.9048 +- 0.0036 (1.900-1.909), PyTorch without biases (nanoGPT's default) 1.9099 +- 0.0064,
with biases (forge-ml's GPT-2 layout) 1.8979 +- 0.0095 (1.881-1.908). The target's 1.90 sits
at the middle of both; nanoGPT's "about 1.88" is one seed's 20-batch estimate (+-0.015).

    python benchmarks/converge_shakespeare.py          # ~1 min on this 2-core VM
    python benchmarks/converge_shakespeare.py --seed 2 --result ''   # another seed, not recorded
    nohup python benchmarks/converge_shakespeare.py > /tmp/converge.log 2>&1 &

The result is also written to ``results/cpu-converge_shakespeare.txt``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from forge_ml.train import TrainConfig, Trainer  # noqa: E402

DEFAULT_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
TARGET = 1.90


def _random_estimate(trainer, iters: int, seed: int = 1337) -> float:
    """nanoGPT's ``estimate_loss`` on the validation shard: the mean loss of ``iters`` batches
    of windows drawn at random (seeded), with the run's batch size and context."""
    from forge_ml.data import DataLoader
    from forge_ml.tensor import tensor

    cfg = trainer.cfg
    loader = DataLoader(trainer.shards.val, cfg.batch_size, cfg.block_size, seed=seed)
    total = 0.0
    for _ in range(iters):
        x, y = loader.next_batch()
        total += trainer.model.loss(tensor(x, device=trainer.device), tensor(y, device=trainer.device)).item()
    return total / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_TEXT), help="tinyshakespeare.txt")
    ap.add_argument("--out", default=str(REPO / "runs" / "converge_shakespeare"), help="run folder")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--eval-iters", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1337, help="seed of init, batches (nanoGPT: 1337)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--result", default=str(REPO / "results" / "cpu-converge_shakespeare.txt"),
                    help="where to record the result ('' for nowhere)")
    args = ap.parse_args()

    if not Path(args.data).is_file():
        if args.data != str(DEFAULT_TEXT):   # a file the user named: an error, not a skip
            ap.error(f"--data {args.data}: not a file (expected tinyshakespeare.txt)")
        print(f"skipped: {args.data} not found (expected ../shared/data/tinyshakespeare.txt next to the repo)")
        return 0

    cfg = TrainConfig(
        data=args.data, tokenizer="char", val_fraction=0.1, out_dir=args.out,
        n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0,
        device=args.device, dtype=args.dtype,
        batch_size=12, grad_accum=1, max_steps=args.max_steps,
        lr=1e-3, min_lr=1e-4, warmup=100, lr_decay_steps=2000,
        weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0,
        eval_interval=500, eval_iters=args.eval_iters,
        sample_interval=0, sample_tokens=300, sample_prompt="ROMEO:",
        log_interval=100, progress=False, seed=args.seed, checkpoint_interval=0,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda s: print(s, flush=True), overwrite=True)  # a fresh run each time
    summary = trainer.train()
    wall = time.perf_counter() - t0
    full = summary["val_loss"]                   # the trainer's last evaluation: every val window
    fixed = trainer.evaluate(args.eval_iters)    # the trainer's periodic estimate: the first batches
    val = _random_estimate(trainer, args.eval_iters)   # nanoGPT's estimate_loss: random batches
    sample = trainer.sample(seed=0)
    verdict = "PASS" if val <= TARGET else "FAIL"
    report = (
        f"forge-ml convergence on tinyshakespeare (char), {datetime.datetime.now():%Y-%m-%d %H:%M}\n"
        f"model 4 layers x 4 heads x 128 channels, context 64, batch 12, dropout 0, "
        f"{trainer.model.num_params():,} parameters; {args.device} {args.dtype}\n"
        f"lr 1e-3 -> 1e-4 (warmup 100, decay to 2000), AdamW (0.9, 0.99) wd 0.1, clip 1.0, seed {args.seed}\n"
        f"steps {summary['step']}; final train loss {summary['loss']:.4f}; "
        f"val loss {val:.4f} over {args.eval_iters} random val batches, nanoGPT's estimate_loss "
        f"(target <= {TARGET}): {verdict}; over every window of the val shard ({summary['val_kind']}): "
        f"{full:.4f}; over the first {args.eval_iters} batches (the trainer's periodic estimate): {fixed:.4f}\n"
        f"wall {wall / 60:.1f} min ({1e3 * trainer.elapsed / max(1, summary['step']):.0f} ms/step in training); "
        f"{platform.machine()}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores, "
        f"python {platform.python_version()}\n"
        f"sample:\n{sample}\n"
    )
    print(report)
    if args.result:
        Path(args.result).write_text(report, encoding="utf-8")
    return 0 if val <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
