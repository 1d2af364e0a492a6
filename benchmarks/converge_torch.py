"""PyTorch reference for ``converge_shakespeare.py``: nanoGPT's model and training loop, re-written.

A compact re-implementation of nanoGPT's ``model.py`` (GPT with pre-LayerNorm blocks, causal
``scaled_dot_product_attention``, exact GELU MLP, tied ``wte``/``lm_head``, init normal(0.02)
with the residual projections ``c_proj.weight`` at normal(0.02 / sqrt(2 * n_layer)), LayerNorm
and Linear without biases unless ``--bias``) and of its ``train.py`` loop (AdamW, fused=False,
betas (0.9, 0.99), weight decay 0.1 on the parameters of dim >= 2 only; lr 1e-3 with linear
warmup ``lr * (it + 1) / (warmup + 1)`` over 100 iterations, then cosine to 1e-4 at iteration
2000; grad clip 1.0; every batch ``torch.randint(len(data) - block_size, (batch,))`` windows
from the global generator seeded with ``--seed``), at nanoGPT's README CPU configuration of
shakespeare_char: 4 layers, 4 heads, 128 channels, context 64, batch 12, 2000 iterations,
dropout 0, float32.

The data are those of ``converge_shakespeare.py``: the characters of the text sorted for the
vocabulary (65 for tinyshakespeare), the last floor(0.1 * N) characters for validation
(forge-ml's split; nanoGPT's ``int(0.9 * N)`` puts one more character into val here).

Printed at the end, after ``--max-steps`` updates (nanoGPT's own eval at iter 2000 also comes
after 2000 updates):

* val loss as nanoGPT's ``estimate_loss`` computes it (``model.eval()``, mean of the batch
  losses over ``--eval-iters`` random val batches). The windows are drawn exactly as
  ``converge_shakespeare.py``'s ``_random_estimate`` draws them (NumPy PCG64 seeded 1337,
  offsets in ``[0, len(val) - block_size)``), so the two frameworks are scored on the same
  windows;
* val loss over every non-overlapping window of the val shard (window k: tokens
  [k*T, k*T + T] with their targets), as forge-ml's ``Trainer.evaluate_full``;
* train loss, ``estimate_loss`` style over ``--eval-iters`` random train batches (same seeded
  PCG64 draw on the train shard);
* wall time.

    python benchmarks/converge_torch.py                       # seed 1337, no biases, 2 threads
    python benchmarks/converge_torch.py --seed 1 --bias --threads 2
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"   # as converge_shakespeare.py


# ---------------------------------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm whose bias is optional (``nn.LayerNorm`` of torch < 2.1 had no ``bias=False``)."""

    def __init__(self, n: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight   # tied, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):             # residual projections, GPT-2's scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters less the position embedding, as nanoGPT counts them."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizer(self, weight_decay, lr, betas):
        params = [p for p in self.parameters() if p.requires_grad]   # the tied weight once
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=False)


# ----------------------------------------------------------------------------------------- data

def load_data(path):
    """(train, val, vocab size): int64 tensors of character ids, val the last floor(0.1 N)."""
    text = Path(path).read_bytes().decode("utf-8")
    if text.startswith("\ufeff"):      # a byte-order mark, dropped as forge-ml's load_text does
        text = text[1:]
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    n_val = math.floor(round(len(ids) * 0.1, 6))
    return ids[:len(ids) - n_val], ids[len(ids) - n_val:], len(chars)


def windows(data, starts, T):
    x = torch.stack([data[i:i + T] for i in starts])
    y = torch.stack([data[i + 1:i + 1 + T] for i in starts])
    return x, y


def get_batch(data, B, T):
    """nanoGPT's get_batch: B start offsets from the global torch generator."""
    return windows(data, torch.randint(len(data) - T, (B,)).tolist(), T)


@torch.no_grad()
def estimate(model, data, B, T, iters, seed=1337):
    """nanoGPT's estimate_loss on one split: the mean of ``iters`` batch losses, the windows
    drawn as converge_shakespeare.py's _random_estimate draws them (NumPy PCG64, seeded)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    total = 0.0
    for _ in range(iters):
        total += model(*windows(data, rng.integers(0, len(data) - T, size=B).tolist(), T)).item()
    return total / iters


@torch.no_grad()
def full_val(model, data, B, T):
    """Mean loss over every non-overlapping window of T tokens (window k: [kT, kT + T])."""
    n = (len(data) - 1) // T
    total = 0.0
    for lo in range(0, n, B):
        starts = [k * T for k in range(lo, min(n, lo + B))]
        total += model(*windows(data, starts, T)).item() * len(starts)
    return total / n


# ------------------------------------------------------------------------------------- training

def get_lr(it, lr=1e-3, min_lr=1e-4, warmup=100, decay_iters=2000):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_TEXT), help="tinyshakespeare.txt")
    ap.add_argument("--seed", type=int, default=1337, help="torch.manual_seed (nanoGPT: 1337)")
    ap.add_argument("--bias", action="store_true", help="biases in Linear and LayerNorm, as GPT-2")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--eval-iters", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--log-interval", type=int, default=100)
    args = ap.parse_args()

    if not Path(args.data).is_file():
        ap.error(f"--data {args.data}: not a file (expected tinyshakespeare.txt)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B, T = 12, 64
    train, val, vocab = load_data(args.data)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=T, bias=args.bias))
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-3, betas=(0.9, 0.99))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; seed {args.seed}, bias {args.bias}; "
          f"{model.num_params():,} parameters; vocab {vocab}; {len(train):,} train / {len(val):,} val tokens",
          flush=True)

    model.train()
    x, y = get_batch(train, B, T)
    t0 = time.perf_counter()
    running = 0.0
    for it in range(args.max_steps):
        for group in opt.param_groups:
            group["lr"] = get_lr(it)
        loss = model(x, y)
        x, y = get_batch(train, B, T)        # the next batch drawn before backward, as nanoGPT
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if args.log_interval and (it + 1) % args.log_interval == 0:
            print(f"step {it + 1}: train loss {running / args.log_interval:.4f} (mean of the last "
                  f"{args.log_interval}), lr {get_lr(it):.2e}, {time.perf_counter() - t0:.0f} s", flush=True)
            running = 0.0
    train_time = time.perf_counter() - t0

    model.eval()
    val_est = estimate(model, val, B, T, args.eval_iters)
    val_full = full_val(model, val, B, T)
    train_est = estimate(model, train, B, T, args.eval_iters)
    wall = time.perf_counter() - t0
    print(f"RESULT torch seed={args.seed} bias={args.bias} steps={args.max_steps} "
          f"val_est={val_est:.4f} val_full={val_full:.4f} train_est={train_est:.4f} "
          f"train_s={train_time:.0f} wall_s={wall:.0f}")
    print(f"val loss {val_est:.4f} over {args.eval_iters} random val batches (nanoGPT's estimate_loss); "
          f"{val_full:.4f} over every window of the val shard ({(len(val) - 1) // T:,}); "
          f"train loss {train_est:.4f} over {args.eval_iters} random train batches; "
          f"{train_time / 60:.1f} min training ({1e3 * train_time / max(1, args.max_steps):.0f} ms/step), "
          f"{wall / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
