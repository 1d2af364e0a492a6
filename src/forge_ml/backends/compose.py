"""Fused ops written as the plain ops they fuse: what a backend runs where it has no fused
kernel for the case at hand (the CPU for every ``linear``; the GPU for more than a few rows,
or attention in a dtype or head size its flash kernels do not take). ``bk`` is the backend
module; every function here computes with its contract ops only, so both backends agree on
the meaning of the fused op by construction.

>>> import numpy as np
>>> from forge_ml.backends import cpu
>>> x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
>>> linear(cpu, x, w, None, None, None).tolist()[0]
[3.0, 3.0, 3.0, 3.0]
"""
from __future__ import annotations


def linear(bk, x, w, bias, act, residual, ln=None):
    """``act(LN(x) @ w + bias) + residual``: layernorm (``ln`` = (gamma, beta, eps) or None),
    matmul, gelu (``act`` "gelu" or None) and add, one after the other."""
    if ln is not None:
        x = bk.layernorm(x, ln[0], ln[1], ln[2])
    y = bk.matmul(x, w, bias)
    if act == "gelu":
        y = bk.gelu(y)
    return y if residual is None else bk.add(residual, y)


def attention_qkv(bk, qkv, n_head, scale):
    """Causal self-attention from fused rows ``qkv (B, T, 3C)``: split_heads, attention,
    merge_heads; returns ``(y (B, T, C), lse (B, H, T))``."""
    q, k, v = bk.split_heads(qkv, n_head)
    out, lse = bk.attention(q, k, v, scale)
    return bk.merge_heads(out), lse
