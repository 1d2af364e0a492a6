"""The loss curve of the trainer's fast path against the op-by-op path it replaced, on real
tokens: GPT-2 124M from the same random init, bf16, the same batches (the data loader's
seed), ``--steps`` steps each, each run in its own process.

- ``fast``: what ``forge-ml train`` runs today: the whole step captured as one CUDA graph
  (FORGE_TRAIN_GRAPH=on) and the LM head's loss as one op (FORGE_FUSED_LOSS=on).
- ``eager``: the path before them: op by op, the logits then cross_entropy (both off).

It prints the losses every 20 steps, the largest step-by-step difference, the largest
difference of 20-step means (bf16 rounds differently on the two paths, so single steps
wander; the curve should not) and the final 20-step means.

    python benchmarks/loss_curve.py --data shakespeare.txt [--steps 200] [--batch 8] [--tiny]
                                    [--json now.json] [--against earlier.json]

``--against``: a ``--json`` file of an earlier run (another commit, the same seed, batch and
steps): this run's fast curve is also compared with both of its curves, in 20-step means, so
a kernel change that moves the numbers (the wgmma attention's own rounding, say) is checked
against the path the earlier code ran.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"fast": {"FORGE_TRAIN_GRAPH": "on", "FORGE_FUSED_LOSS": "on"},
         "eager": {"FORGE_TRAIN_GRAPH": "off", "FORGE_FUSED_LOSS": "off"}}


def worker(a):
    """Train ``a.steps`` steps in this process's mode; print the losses as one JSON line."""
    from forge_ml.train import TrainConfig, Trainer
    from train_e2e import prepare_data
    data = prepare_data(a.data, "gpt2", a.cache)
    with tempfile.TemporaryDirectory() as out:
        size = (dict(block_size=64, device="cpu", dtype="float32", n_layer=2, n_head=2,
                     n_embd=64) if a.tiny else
                dict(block_size=1024, device="cuda", dtype="bf16", model="gpt2"))
        cfg = TrainConfig(data=str(data), batch_size=a.batch, max_steps=a.steps, warmup=20,
                          eval_interval=0, sample_interval=0, checkpoint_interval=0,
                          log_interval=1, progress=False, out_dir=out, seed=a.seed, **size)
        trainer = Trainer(cfg, log=lambda *_: None)
        losses = [float(trainer.train_step()["loss"]) for _ in range(a.steps)]
    print(json.dumps({"losses": losses}), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a text file (tinyshakespeare)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--cache", default=None, help="where the token shards go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write both curves here")
    ap.add_argument("--against", default=None, help="an earlier run's --json file to compare with")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer, 64-channel model on the CPU, T=64 (checks the script only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory() as tmp:
        cache = a.cache or tmp
        curves = {}
        for mode, env in MODES.items():
            cmd = [sys.executable, __file__, "--worker", "--data", a.data, "--steps", str(a.steps),
                   "--batch", str(a.batch), "--seed", str(a.seed), "--cache", cache] + (
                       ["--tiny"] if a.tiny else [])
            out = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"the {mode} run failed:\n{out.stderr[-3000:]}")
            curves[mode] = np.array(json.loads(out.stdout.strip().splitlines()[-1])["losses"])
    f, e = curves["fast"], curves["eager"]
    w = 20
    mf, me = means(f, w), means(e, w)
    what = "a 2-layer model on the CPU, float32, T=64" if a.tiny else "GPT-2 124M, bf16, T=1024"
    print(f"{what}, B={a.batch}, {a.steps} steps on real tokens; fast = one graph + the loss "
          "op, eager = op by op + logits and cross_entropy")
    print(" step    fast    eager    diff")
    for i in list(range(0, a.steps, 20)) + [a.steps - 1]:
        print(f"{i + 1:5d}  {f[i]:7.4f}  {e[i]:7.4f}  {f[i] - e[i]:+.4f}")
    print(f"largest step difference {np.abs(f - e).max():.4f}; largest difference of {w}-step "
          f"means {np.abs(mf - me).max():.4f}; final {w}-step means {mf[-1]:.4f} / {me[-1]:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps({k: v.tolist() for k, v in curves.items()}))
    if a.against:
        compare_with(a.against, f, w)


def means(curve: np.ndarray, w: int) -> np.ndarray:
    """The ``w``-step moving means of a curve."""
    return np.convolve(curve, np.ones(w) / w, "valid")


def compare_with(path: str, fast: np.ndarray, w: int) -> None:
    """This run's fast curve against each curve of an earlier run's --json file."""
    try:
        old = {k: np.asarray(v, dtype=np.float64) for k, v in json.loads(Path(path).read_text()).items()}
    except (OSError, ValueError) as e:
        raise SystemExit(f"--against {path}: not a --json file of this script ({e})")
    mf = means(fast, w)
    for k, c in sorted(old.items()):
        if len(c) != len(fast):
            raise SystemExit(f"--against {path}: its {k} curve has {len(c)} steps, this run {len(fast)}")
        mc = means(c, w)
        print(f"against {path}'s {k}: largest difference of {w}-step means {np.abs(mf - mc).max():.4f} "
              f"({np.abs(mf - mc).max() / mc[-1]:.2%} of its final mean); final {w}-step means "
              f"{mf[-1]:.4f} / {mc[-1]:.4f}")


if __name__ == "__main__":
    main()
