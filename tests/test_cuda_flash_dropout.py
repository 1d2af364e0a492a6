"""GPU tests of dropout inside the fused attention (backends/cuda/flash_attention.cu, the DROP
instances: ``attention_qkv_dropout``, ``attention_qkv_dropout_bwd``) on GPT-2's fused rows,
bfloat16 at head size 64: the mask must be the composed path's (``dropout`` after the softmax,
forge_ml.rng's Philox stream over the (B, H, T, T) probabilities) bit for bit, so flash and the
composed path with the same seed compute the same function.

Against a float64 reference (the mask from ``rng.dropout_keep``) and against the composed
default (``backends.compose``) on the GPU, in bf16 and in float32, with the same seed, forward
y, lse and backward dqkv; T = 64, 200, 256 and T not a multiple of 4 (130, 131: each element
draws its own Philox call there) or of the tile; an int seed and a seed in device memory
(``(base, site)``, ``ops.SeedAt``), also inside a CUDA graph replayed with a new base; p = 0
gives the mma.sync kernels without dropout bit for bit (and the default within tolerance);
GPT-2 with dropout 0.2, fused against ``fused_attention=False``.

Every test skips where CuPy or a GPU is missing. Outputs are allocated from a pool refilled with
NaN bytes, so an element a kernel forgets to write shows up. Tolerances (‖got - ref‖ / ‖ref‖)
as tests/test_cuda_flash.py's: 2e-2 for y and dqkv, lse within 1e-3 absolute.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import forge_ml as fm
from forge_ml import flags, rng
from forge_ml.backends import compose
from forge_ml.models import GPT2, GPT2Config

from _gpu_checks import check, host, round_bf16
from test_cuda_flash import be, gpu, rs  # noqa: F401 (the fixtures: the GPU, poisoned memory, a logged seed)

pytestmark = pytest.mark.cuda

HS = 64
TOL = 2e-2
LSE_TOL = 1e-3
P = 0.2


def bf16_values(rs, shape):
    """Random values exactly representable in bf16, as float64."""
    return round_bf16(rs.standard_normal(shape)).astype(np.float64)


def dev(be, a, dtype="bfloat16"):
    return be.from_host(np.asarray(a), dtype)


def device_seed(be, base, site):
    """The backend form of ``ops.SeedAt(base, site)``: (one int64 on the device, site)."""
    return dev(be, np.array([base], np.uint64).view(np.int64), "int64"), site


def ref_qkv_dropout(qkv, dy, H, scale, p, seed):
    """float64 y, lse, dqkv of attention with dropout on GPT-2's fused rows: split heads,
    P = causal softmax, M = rng's keep mask over P's (B, H, T, T) elements times
    float32(1/(1-p)), y = merge((P * M) v); dV = (P M)^T dO, dS = P * (M * dO V^T - rowsum),
    dQ = scale dS K, dK = scale dS^T Q."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // H
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, hs).transpose(0, 2, 1, 3)
               for i in range(3))
    dout = dy.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    s = scale * q @ np.swapaxes(k, -1, -2)
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
    pr = np.exp(s - lse)
    keep = rng.dropout_keep(seed, B * H * T * T, p).reshape(B, H, T, T)
    mask = keep * float(rng.dropout_scale(p))
    out = (pr * mask) @ v
    dv = np.swapaxes(pr * mask, -1, -2) @ dout
    dp = (dout @ np.swapaxes(v, -1, -2)) * mask
    ds = pr * (dp - (pr * dp).sum(-1, keepdims=True))
    dq, dk = scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q
    merge = lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, C)  # noqa: E731
    return merge(out), lse[..., 0], np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


def _err(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


# (B, T, H): whole tiles; T = 200 (a partial tile, a multiple of 4); 256 (the shakespeare_char
# recipe's T); 131 (odd) and 130 (even, not a multiple of 4): no Philox block is shared by the
# lanes there; a single token.
SHAPES = [(2, 64, 3), (1, 200, 4), (2, 256, 3), (1, 131, 2), (2, 130, 2), (3, 1, 2)]


@pytest.mark.parametrize("B,T,H", SHAPES)
def test_flash_dropout_vs_reference_and_composed(be, rs, B, T, H):
    C = H * HS
    scale = 1.0 / math.sqrt(HS)
    base, site = int(rs.integers(0, 1 << 64, dtype=np.uint64)), 3
    seed = rng.mix(base, site)
    qkv, dy = bf16_values(rs, (B, T, 3 * C)), bf16_values(rs, (B, T, C))
    ry, rlse, rdqkv = ref_qkv_dropout(qkv, dy, H, scale, P, seed)
    x, ddy = dev(be, qkv), dev(be, dy)
    assert be._qkv_flash_ok(x, H), "bf16 at head size 64 should take the flash path"

    y, lse = be.attention_qkv_dropout(x, H, scale, P, seed)
    assert y.shape == (B, T, C) and lse.shape == (B, H, T) and str(y.dtype) == "bfloat16"
    check("flash y", host(be, y), ry, TOL)
    assert np.all(np.isfinite(host(be, lse)))
    assert np.max(np.abs(host(be, lse) - rlse)) <= LSE_TOL, "flash lse"
    dqkv = be.attention_qkv_dropout_bwd(x, y, lse, ddy, H, scale, P, seed)
    assert dqkv.shape == qkv.shape
    check("flash dqkv", host(be, dqkv), rdqkv, TOL)
    if T > 1:   # the mask matters: another seed's output is far off
        other, _ = be.attention_qkv_dropout(x, H, scale, P, rng.mix(base, site + 1))
        assert _err(host(be, other), ry) > 10 * TOL

    # the composed path, same seed: bf16 (what fused_attention=False computes) and float32
    y1, _ = compose.attention_qkv_dropout(be, x, H, scale, P, seed)
    check("flash y vs composed bf16", host(be, y), host(be, y1), TOL)
    d1 = compose.attention_qkv_dropout_bwd(be, x, y1, lse, ddy, H, scale, P, seed)
    check("flash dqkv vs composed bf16", host(be, dqkv), host(be, d1), TOL)
    xf, dyf = dev(be, qkv, "float32"), dev(be, dy, "float32")
    assert not be._qkv_flash_ok(xf, H)
    yf, lsef = be.attention_qkv_dropout(xf, H, scale, P, seed)
    check("flash y vs composed float32", host(be, y), host(be, yf), TOL)
    assert np.max(np.abs(host(be, lse) - host(be, lsef))) <= LSE_TOL
    df = be.attention_qkv_dropout_bwd(xf, yf, lsef, dyf, H, scale, P, seed)
    check("flash dqkv vs composed float32", host(be, dqkv), host(be, df), TOL)

    # the seed read on the device: the same bits
    at = device_seed(be, base, site)
    y2, lse2 = be.attention_qkv_dropout(x, H, scale, P, at)
    assert np.array_equal(host(be, y2), host(be, y))
    assert np.array_equal(host(be, lse2), host(be, lse))
    d2 = be.attention_qkv_dropout_bwd(x, y, lse, ddy, H, scale, P, at)
    assert np.array_equal(host(be, d2), host(be, dqkv))


@pytest.mark.parametrize("T", [256, 131])
def test_p0_is_the_kernel_without_dropout_bit_for_bit(be, rs, T):
    B, H = 2, 3
    C = H * HS
    x, ddy = dev(be, bf16_values(rs, (B, T, 3 * C))), dev(be, bf16_values(rs, (B, T, C)))
    # the dropout kernels are the mma.sync ones; on Hopper the default is the wgmma kernels,
    # whose softmax rounds differently (flash_hopper.cu), so compare against mma.sync bitwise
    # and against the default within the flash tolerance
    with flags.override(FORGE_WGMMA_ATTENTION="off"):
        y0, lse0 = be.attention_qkv(x, H, 0.125)
        d0 = be.attention_qkv_bwd(x, y0, lse0, ddy, H, 0.125)
    yw, lsew = be.attention_qkv(x, H, 0.125)
    check("default y vs mma.sync", host(be, yw), host(be, y0), TOL)
    assert np.max(np.abs(host(be, lsew) - host(be, lse0))) <= LSE_TOL
    dw = be.attention_qkv_bwd(x, yw, lsew, ddy, H, 0.125)
    check("default dqkv vs mma.sync", host(be, dw), host(be, d0), TOL)
    for seed in (12345, device_seed(be, 7, 1)):
        y, lse = be.attention_qkv_dropout(x, H, 0.125, 0.0, seed)
        assert np.array_equal(host(be, y), host(be, y0))
        assert np.array_equal(host(be, lse), host(be, lse0))
        d = be.attention_qkv_dropout_bwd(x, y, lse, ddy, H, 0.125, 0.0, seed)
        assert np.array_equal(host(be, d), host(be, d0))


def test_flash_dropout_is_deterministic(be, rs):
    B, T, H = 2, 333, 2
    C = H * HS
    x, ddy = dev(be, bf16_values(rs, (B, T, 3 * C))), dev(be, bf16_values(rs, (B, T, C)))
    runs = []
    for _ in range(2):
        y, lse = be.attention_qkv_dropout(x, H, 0.125, 0.1, 99)
        runs.append([host(be, a) for a in (y, lse, be.attention_qkv_dropout_bwd(
            x, y, lse, ddy, H, 0.125, 0.1, 99))])
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_a_captured_graph_reads_the_seed_when_replayed(be, rs):
    """(base, site): the kernels read base when they run, so a graph replayed after a new base
    is written draws that base's masks."""
    B, T, H, site = 2, 192, 2, 4
    C = H * HS
    x = dev(be, bf16_values(rs, (B, T, 3 * C)))
    base, _ = device_seed(be, 11, site)
    g = be.capture_graph(lambda: be.attention_qkv_dropout(x, H, 0.125, P, (base, site)),
                         run_first=True)
    for new in (2**64 - 1, 5):
        be.assign(base, np.array([new], np.uint64).view(np.int64))
        g.replay()
        want, _ = be.attention_qkv_dropout(x, H, 0.125, P, rng.mix(new, site))
        assert np.array_equal(host(be, g.outputs[0]), host(be, want))


@pytest.mark.parametrize("seed_form", ["int", "tensor"])
def test_gpt2_with_dropout_fused_equals_composed(be, seed_form):
    """The shakespeare_char shape of model (heads of 64, dropout 0.2) in bf16: the fused path
    (flash with the attention dropout) and fused_attention=False (matmul, softmax, dropout,
    matmul) draw the same masks at every site, so loss and gradients agree to bf16's error."""
    cfg = GPT2Config(vocab_size=65, block_size=256, n_layer=2, n_head=2, n_embd=128, dropout=0.2)
    m = GPT2.init(cfg, seed=3).to("cuda", dtype="bfloat16")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 201))
    x, y = (fm.tensor(a, device="cuda") for a in (ids[:, :-1], ids[:, 1:]))
    seed = 2**63 + 9 if seed_form == "int" else fm.tensor(np.array([-9], np.int64), device="cuda")
    lf, gf = m.loss_and_grads(x, y, dropout_seed=seed)
    lc, gc = m.loss_and_grads(x, y, dropout_seed=seed, fused_attention=False)
    assert abs(lf - lc) <= 1e-2 * abs(lc), (lf, lc)
    for k in gc:
        a, b = gf[k].to("float32").numpy(), gc[k].to("float32").numpy()
        assert np.all(np.isfinite(a)), k
        assert np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) < 5e-2, k
