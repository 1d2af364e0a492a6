"""One training step (forward + backward + clip + AdamW) of nanoGPT's CPU model in forge-ml vs
the same model in PyTorch eager, measured in the same run.

Model: nanoGPT's ``shakespeare_char`` on a laptop: 4 layers, 4 heads, 128 channels, context
64, batch 12, vocabulary 65, dropout 0, tied head, tanh GELU. Both frameworks start from the
same weights (forge-ml's init copied into torch) and see the same batches; torch gets
``torch.set_num_threads`` = the cores this process may run on (``OPENBLAS_NUM_THREADS`` if
set). Steps run in rounds, forge-ml then torch, then torch then forge-ml (``--rounds`` in
all), so that a load change on a shared machine hits both alike; each side's turn comes after
two seconds of quiet (so that neither library's idle worker threads, which spin for a while
after their last job, slow the other). The figures: the median step time over all rounds after
the warm-up, and the median over rounds of the two sides' ratio within a round.

    python benchmarks/train_cpu.py              # ~30 timed steps each
    python benchmarks/train_cpu.py --profile    # + where forge-ml's step time goes, per op
    python benchmarks/train_cpu.py --cli-threads   # forge-ml with forge-ml train's BLAS threads
    python benchmarks/train_cpu.py --dropout 0.2   # the same with nanoGPT's dropout sites
                                                   # (masks differ: the losses are not compared)
"""
from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import forge_ml as fm  # noqa: E402
from forge_ml.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from forge_ml.optim import AdamW, clip_grad_norm  # noqa: E402

B, T, V = 12, 64, 65
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128
LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.99), 0.1, 1.0
SETTLE_S = 2.0   # seconds of quiet before each turn (see the loop; 0.5 s left an order effect)


# -- PyTorch eager: a minimal GPT-2 with the same shapes and layout ---------------------------


def torch_gpt(torch, init: dict, p_drop: float = 0.0):
    """A torch GPT-2 whose parameters are copies of forge-ml's ``init`` (same names and
    ``(in, out)`` linear layout); returns ``(params, loss_fn)``. ``p_drop``: dropout where
    nanoGPT (and forge-ml) put it: embeddings, attention probabilities, both residual branches."""
    import torch.nn.functional as F

    def drop(t):
        return F.dropout(t, p_drop, training=True) if p_drop else t

    P = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    hs = N_EMBD // N_HEAD

    def loss_fn(idx, tgt):
        x = drop(P["wte.weight"][idx] + P["wpe.weight"][: idx.shape[1]])         # (B, T, C)
        for i in range(N_LAYER):
            p = f"h.{i}."
            h = F.layer_norm(x, (N_EMBD,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], 1e-5)
            qkv = torch.addmm(P[p + "attn.c_attn.bias"], h.view(-1, N_EMBD), P[p + "attn.c_attn.weight"])
            q, k, v = qkv.view(B, T, 3, N_HEAD, hs).permute(2, 0, 3, 1, 4)         # 3 x (B, H, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p_drop)  # (B, H, T, hs)
            y = y.transpose(1, 2).reshape(-1, N_EMBD)                              # (B*T, C)
            x = x + drop(torch.addmm(P[p + "attn.c_proj.bias"], y, P[p + "attn.c_proj.weight"]).view(B, T, N_EMBD))
            h = F.layer_norm(x, (N_EMBD,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], 1e-5)
            h = F.gelu(torch.addmm(P[p + "mlp.c_fc.bias"], h.view(-1, N_EMBD), P[p + "mlp.c_fc.weight"]),
                       approximate="tanh")
            x = x + drop(torch.addmm(P[p + "mlp.c_proj.bias"], h, P[p + "mlp.c_proj.weight"]).view(B, T, N_EMBD))
        x = F.layer_norm(x, (N_EMBD,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
        logits = x.view(-1, N_EMBD) @ P["wte.weight"].t()                          # (B*T, V)
        return F.cross_entropy(logits, tgt.view(-1))

    return P, loss_fn


def make_trainer_step(args):
    """The Trainer's step as ``forge-ml train`` runs it (the CLI's BLAS start, the run's
    ThreadTuner), on ``args.trainer`` tokenized by characters: a function returning its loss."""
    import tempfile
    from forge_ml import blas
    from forge_ml.train import TrainConfig, Trainer
    blas.limit_default()                   # as the CLI does first (unless a thread variable is set)
    out = tempfile.mkdtemp(prefix="train_cpu_")
    cfg = TrainConfig(data=args.trainer, tokenizer="char", n_layer=N_LAYER, n_head=N_HEAD,
                      n_embd=N_EMBD, block_size=T, batch_size=B, dropout=args.dropout, lr=LR,
                      beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, grad_clip=CLIP,
                      eval_interval=0, sample_interval=0, checkpoint_interval=0, progress=False,
                      out_dir=out, max_steps=10 ** 6)
    trainer = Trainer(cfg, log=lambda *_: None)
    tuner = trainer._thread_tuner()
    print("forge-ml: the Trainer's step; BLAS threads "
          + (f"tuned among {tuner.counts}" if tuner else f"fixed ({blas.get_threads()})"))

    def step():
        if tuner is not None:
            tuner.before_step()
        rec = trainer.train_step()
        if tuner is not None:
            line = tuner.after_step(rec["dt_ms"] / 1e3)
            if line:
                print(f"forge-ml: {line}")
        return rec["loss"]
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--profile", action="store_true", help="profile forge-ml's step by op")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout rate (default 0, nanoGPT's CPU run)")
    ap.add_argument("--cli-threads", action="store_true",
                    help="forge-ml with the BLAS threads `forge-ml train` starts with (half the "
                         "cores), torch with all of them (a default PyTorch script)")
    ap.add_argument("--trainer", metavar="TEXT", default=None,
                    help="forge-ml's side is the Trainer's step as `forge-ml train` runs it on this "
                         "text file (char tokens; tinyshakespeare gives the 65-token vocabulary), "
                         "its BLAS threads chosen by the run's ThreadTuner")
    args = ap.parse_args()
    for flag, v, least in (("--rounds", args.rounds, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if v < least:
            ap.error(f"{flag} must be >= {least}, got {v}")

    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # OPENBLAS_NUM_THREADS=1 (read by NumPy's BLAS at import) runs torch on one thread too.
    torch.set_num_threads(int(os.environ.get("OPENBLAS_NUM_THREADS", cores)))
    if args.cli_threads:
        from forge_ml import blas
        blas.set_threads(blas.default_threads(cores))   # NumPy's OpenBLAS only
        print(f"forge-ml BLAS threads: {blas.default_threads(cores)} (as forge-ml train starts); "
              f"torch threads: {torch.get_num_threads()}")
    trainer_step = make_trainer_step(args) if args.trainer else None

    cfg = GPT2Config(vocab_size=V, block_size=T, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD,
                     dropout=args.dropout)
    model = GPT2.init(cfg, seed=0)
    init = model.state_dict()
    opt = AdamW(model.params, lr=LR, betas=BETAS, weight_decay=WD)

    tp, tloss = torch_gpt(torch, init, args.dropout)
    topt = torch.optim.AdamW([{"params": [p for p in tp.values() if p.ndim >= 2], "weight_decay": WD},
                              {"params": [p for p in tp.values() if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, betas=BETAS)

    rng = np.random.default_rng(0)
    n_batches = args.warmup + args.rounds * args.steps
    batches = [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))) for _ in range(n_batches)]

    seeds = iter(range(1 << 30))

    def forge_step(x, y):
        if trainer_step is not None:       # the Trainer reads its own batches
            return trainer_step()
        loss, grads = model.loss_and_grads(fm.tensor(x), fm.tensor(y), dropout_seed=next(seeds))
        _, scale = clip_grad_norm(grads, CLIP)
        opt.step(grads, grad_scale=scale)
        return loss

    def torch_step(x, y):
        loss = tloss(torch.from_numpy(x), torch.from_numpy(y))
        topt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tp.values(), CLIP)
        topt.step()
        return loss.item()

    losses = {"forge-ml": [], "torch": []}
    times = {"forge-ml": [], "torch": []}
    steps = {"forge-ml": forge_step, "torch": torch_step}

    def run(name, idx, timed):
        x, y = batches[idx]
        t0 = time.perf_counter()
        loss = steps[name](x, y)
        dt = time.perf_counter() - t0
        losses[name].append(loss)
        if timed:
            times[name].append(dt)

    for name in steps:                                  # warm-up: same batches for both
        for i in range(args.warmup):
            run(name, i, False)
    round_ms = {"forge-ml": [], "torch": []}
    for r in range(args.rounds):
        # ABBA: forge-ml first in even rounds, torch first in odd ones, so a load that rises
        # or falls during a round does not always favour the same side
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            # quiet first: OpenBLAS's and torch's worker threads spin for a while after their
            # last job and, on a small machine, take the cores the other library's threads need
            time.sleep(SETTLE_S)
            for i in range(args.steps):
                run(name, args.warmup + r * args.steps + i, True)
            round_ms[name].append(1e3 * float(np.median(times[name][-args.steps:])))

    f_ms = 1e3 * float(np.median(times["forge-ml"]))
    t_ms = 1e3 * float(np.median(times["torch"]))
    print(f"nanoGPT CPU model: {N_LAYER} layers, {N_HEAD} heads, {N_EMBD} channels, batch {B} x {T}, "
          f"dropout {args.dropout}, "
          f"vocab {V}; {model.num_params():,} parameters; {cores} cores "
          f"(torch threads {torch.get_num_threads()}), torch {torch.__version__}, numpy {np.__version__}")
    print(f"first-step loss: forge-ml {losses['forge-ml'][0]:.5f}  torch {losses['torch'][0]:.5f}  "
          f"(ln V = {math.log(V):.5f}); after {len(losses['torch'])} steps: "
          f"forge-ml {losses['forge-ml'][-1]:.4f}  torch {losses['torch'][-1]:.4f}"
          + ("  (not comparable: the Trainer reads the text's batches, torch uniform random "
             "tokens of the same shape)" if args.trainer else ""))
    print(f"forge-ml : median {f_ms:8.2f} ms/step  ({B * T / f_ms * 1e3:,.0f} tokens/s)  over {len(times['forge-ml'])} steps")
    print(f"torch    : median {t_ms:8.2f} ms/step  ({B * T / t_ms * 1e3:,.0f} tokens/s)  over {len(times['torch'])} steps")
    print(f"ratio forge-ml / torch = {f_ms / t_ms:.3f}  ({'forge-ml faster or equal' if f_ms <= t_ms else 'forge-ml slower'})")
    paired = [a / b for a, b in zip(round_ms["forge-ml"], round_ms["torch"])]
    print(f"per round (each side's median, the two adjacent in time): ratio median {np.median(paired):.3f}, "
          f"range {min(paired):.3f}-{max(paired):.3f} over {len(paired)} rounds")

    if args.profile:
        profile(forge_step, batches[:args.steps])


def profile(step, batches):
    """cProfile of forge-ml steps, summarised per backend kernel and per layer above it."""
    pr = cProfile.Profile()
    pr.enable()
    t0 = time.perf_counter()
    for x, y in batches:
        step(x, y)
    wall = time.perf_counter() - t0
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append((file, fn, nc, tt, ct))
    n = len(batches)
    print(f"\nprofile of {n} forge-ml steps: {1e3 * wall / n:.1f} ms/step under the profiler")
    print("backend kernels (backends/cpu/), cumulative time per step:")
    # the ops of backends/cpu/__init__.py (C calls) and reference.py (NumPy); "op" is the
    # native-or-reference wrapper around each fused op, whose time its callee shows already
    kernel_files = tuple(os.path.join("backends", "cpu", f) for f in ("__init__.py", "reference.py"))
    kern = sorted((r for r in rows if r[0].endswith(kernel_files)
                   and not r[1].startswith("_") and r[1] != "op"),
                  key=lambda r: -r[4])
    for file, fn, nc, tt, ct in kern[:15]:
        print(f"  {fn:<22} {1e3 * ct / n:7.2f} ms  {nc / n:6.1f} calls/step  {1e6 * ct / nc:8.1f} us/call")
    kern_total = sum(r[4] for r in kern)
    print(f"  {'all kernels':<22} {1e3 * kern_total / n:7.2f} ms  of {1e3 * wall / n:.2f} ms/step; the rest is "
          f"Python (ops checks, Tensor wrappers, the tape, the optimizer loop)")
    print("top self-time functions:")
    for file, fn, nc, tt, ct in sorted(rows, key=lambda r: -r[3])[:12]:
        print(f"  {Path(file).name}:{fn:<28} {1e3 * tt / n:7.2f} ms/step  {nc / n:7.1f} calls/step")


if __name__ == "__main__":
    main()
