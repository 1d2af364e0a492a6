"""Attention on GPT-2's fused (B, T, 3C) rows (``ops.attention_qkv``, ``Tape.attention_qkv``):
forward and backward against the float64 reference formulas, the tape node against finite
differences through a random cotangent, and the model's loss and gradients with it equal to
those of the unfused split / matmul / softmax / merge path."""
import math

import numpy as np
import pytest

import forge_ml as fm
import reference as ref
from forge_ml import Tape, ops
from forge_ml.errors import ShapeError
from forge_ml.models.gpt2 import GPT2, GPT2Config


def heads(x, n_head):
    """(B, T, C) -> (B, H, T, hs), float64."""
    B, T, C = x.shape
    return np.asarray(x, np.float64).reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def merged(x):
    """(B, H, T, hs) -> (B, T, C)."""
    B, H, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hs)


def rel(got, want):
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("B,T,H,hs", [(2, 7, 3, 4), (1, 33, 2, 8)])
def test_forward_and_backward_match_reference(dtype, tol, B, T, H, hs):
    rs = np.random.default_rng(T * H)
    C = H * hs
    qkv = rs.standard_normal((B, T, 3 * C)).astype(dtype)
    dy = rs.standard_normal((B, T, C)).astype(dtype)          # a random cotangent
    scale = 1.0 / math.sqrt(hs)
    q, k, v = (heads(qkv[..., i * C:(i + 1) * C], H) for i in range(3))
    want_out, want_lse = ref.attention(q, k, v, scale)
    y, lse = ops.attention_qkv(fm.tensor(qkv), H)
    assert y.shape == (B, T, C) and lse.shape == (B, H, T)
    assert rel(y.numpy(), merged(want_out)) < tol
    assert rel(lse.numpy(), want_lse) < tol
    dqkv = ops.attention_qkv_bwd(fm.tensor(qkv), y, lse, fm.tensor(dy), H)
    dq, dk, dv = ref.attention_bwd(q, k, v, heads(dy, H), scale)
    want = np.concatenate([merged(dq), merged(dk), merged(dv)], axis=-1)
    assert dqkv.shape == qkv.shape
    assert rel(dqkv.numpy(), want) < tol


def test_tape_node_against_finite_differences():
    rs = np.random.default_rng(5)
    B, T, H, hs = 1, 5, 2, 3
    qkv = rs.standard_normal((B, T, 3 * H * hs))
    r = rs.standard_normal((B, T, H * hs))                     # random cotangent

    def f(x):
        y, _ = ops.attention_qkv(fm.tensor(x), H)
        return float((y.numpy() * r).sum())

    tape = Tape()
    leaf = tape.leaf(fm.tensor(qkv))
    y = tape.attention_qkv(leaf, H)
    tape.backward(y, fm.tensor(r))
    got = tape.grad(leaf).numpy()
    eps = 1e-6
    fd = np.zeros_like(qkv)
    for i in np.ndindex(qkv.shape):
        a, b = qkv.copy(), qkv.copy()
        a[i] += eps
        b[i] -= eps
        fd[i] = (f(a) - f(b)) / (2 * eps)
    assert rel(got, fd) < 1e-7


def test_model_gradients_equal_unfused_path():
    cfg = GPT2Config(vocab_size=29, block_size=16, n_layer=2, n_head=2, n_embd=8)
    model = GPT2.init(cfg, seed=1)
    rs = np.random.default_rng(2)
    ids = fm.tensor(rs.integers(0, 29, (3, 12)))
    tg = fm.tensor(rs.integers(0, 29, (3, 12)))
    la, ga = model.loss_and_grads(ids, tg, fused_attention=True)
    lb, gb = model.loss_and_grads(ids, tg, fused_attention=False)
    assert abs(la - lb) < 1e-5 * abs(lb)
    for k in ga:
        assert rel(ga[k].numpy(), gb[k].numpy()) < 1e-5, k


def test_bad_input():
    with pytest.raises(ShapeError, match="not 3 \\* n_head"):
        ops.attention_qkv(fm.zeros((1, 4, 12)), 5)
    with pytest.raises(ShapeError, match="rank 3"):
        ops.attention_qkv(fm.zeros((4, 12)), 2)
    qkv = fm.zeros((1, 4, 12))
    y, lse = ops.attention_qkv(qkv, 2)
    with pytest.raises(ShapeError, match="lse must be"):
        ops.attention_qkv_bwd(qkv, y, fm.zeros((1, 4, 2)), y, 2)
    with pytest.raises(ShapeError, match="y must be"):
        ops.attention_qkv_bwd(qkv, fm.zeros((1, 4, 6)), lse, fm.zeros((1, 4, 6)), 2)
