"""The PyTorch peer of the benchmarks: a compact GPT-2 (nanoGPT's layout and init: pre-LN
blocks, SDPA causal attention, tanh GELU, tied head, padded vocabulary), one definition for
``train_gpu.py``, ``train_e2e.py`` and ``train_ddp.py``. Not a benchmark itself.

    >>> import torch
    >>> from forge_ml.models.gpt2 import GPT2Config
    >>> m = torch_gpt2(GPT2Config(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> idx = torch.randint(0, 11, (2, 5)); m(idx, idx).shape
    torch.Size([])
"""
from __future__ import annotations


def torch_gpt2(cfg, dropout: float = 0.0):
    """An ``nn.Module`` GPT-2 of ``cfg``'s sizes whose ``forward(idx, targets)`` returns the
    mean cross-entropy over the first ``vocab_size`` logits; dropout as nanoGPT places it."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(s, C, H):
            super().__init__()
            s.H = H
            s.ln_1, s.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            s.c_attn, s.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            s.c_fc, s.c_proj2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            s.drop = nn.Dropout(dropout)

        def forward(s, x):
            B_, T_, C = x.shape
            q, k, v = s.c_attn(s.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B_, T_, s.H, C // s.H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=dropout if s.training else 0.0)
            x = x + s.drop(s.c_proj(y.transpose(1, 2).reshape(B_, T_, C)))
            return x + s.drop(s.c_proj2(F.gelu(s.c_fc(s.ln_2(x)), approximate="tanh")))

    class GPT(nn.Module):
        def __init__(s):
            super().__init__()
            s.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
            s.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            s.h = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
            s.ln_f = nn.LayerNorm(cfg.n_embd)
            s.drop = nn.Dropout(dropout)
            # GPT-2's init, as nanoGPT's _init_weights: N(0, 0.02) weights and embeddings, zero
            # biases, the residual projections scaled by 1/sqrt(2 n_layer)
            for name, p in s.named_parameters():
                if name.startswith("ln") or ".ln_" in name:
                    continue                                   # LayerNorm keeps ones and zeros
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    std = 0.02 / (2 * cfg.n_layer) ** 0.5 if name.endswith(("c_proj.weight", "c_proj2.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(s, idx, tg):
            x = s.drop(s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device)))
            for blk in s.h:
                x = blk(x)
            logits = s.ln_f(x) @ s.wte.weight.t()                       # tied head, as GPT-2
            return F.cross_entropy(logits[..., :cfg.vocab_size].float().reshape(-1, cfg.vocab_size),
                                   tg.reshape(-1))

    return GPT()
