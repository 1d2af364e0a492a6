"""GPU tests of the LM head's loss over chunks of rows (backends/cuda/classifier.py, with
cross_entropy.cu's ``cross_entropy_fused_*`` writing each chunk's gradient over its logits):
several chunks with a partial last one, float32 and bf16, a padded vocabulary, int32 and int64
targets, against the float64 specification (``reference.linear_cross_entropy``); and GPT-2's
training step with the op against matmul + cross_entropy on the same GPU.

Before each test the CuPy pool is refilled with NaN bytes, so a row of dx or dw that a chunk
forgets to write shows up as NaN (``check`` requires every element finite).
"""
from __future__ import annotations

import numpy as np
import pytest

import forge_ml as fm
import reference as ref
from forge_ml import Tape
from forge_ml.models.gpt2 import GPT2, GPT2Config

from _gpu_checks import check, host, poison_device_memory, round_bf16
from test_cuda_flash import gpu, rs  # noqa: F401 (the fixtures: the GPU with bf16, a logged seed)

pytestmark = pytest.mark.cuda


@pytest.fixture
def small_chunks(gpu, monkeypatch):
    """Chunks of 70 rows of 64 float32 logits (128 rows of bf16 ones)."""
    from forge_ml.backends.cuda import classifier
    monkeypatch.setattr(classifier, "CHUNK_BYTES", 70 * 64 * 4)
    poison_device_memory(1 << 28)
    return classifier


def registers_only(monkeypatch, classifier):
    """No shared-memory room for the streaming kernel: bf16 rows go to the register kernel."""
    monkeypatch.setattr(classifier, "_set_max_shared", lambda *a: False)


@pytest.mark.parametrize("dtype,tol,tdt,Vp,kernel", [
    ("float32", 1e-5, "int64", 64, "generic"),
    ("bfloat16", 2e-2, "int32", 64, "stream"),      # rows streamed through shared memory
    ("bfloat16", 2e-2, "int32", 64, "registers"),   # the row in registers (Vp a multiple of 8)
    ("bfloat16", 2e-2, "int64", 60, "generic"),     # the two-pass kernel
    ("float64", 1e-12, "int64", 64, "generic")])
@pytest.mark.parametrize("grad", [True, False])
def test_chunks_equal_the_float64_spec(gpu, small_chunks, rs, monkeypatch, dtype, tol, tdt, Vp,
                                       kernel, grad):
    N, C, V = 300, 48, 50
    if kernel == "registers":
        registers_only(monkeypatch, small_chunks)
    sfx = {"float32": "f32", "bfloat16": "bf16", "float64": "f64"}[dtype]
    name = small_chunks._loss_kernel(gpu.from_host(np.zeros((1, 1)), dtype),
                                     gpu.from_host(np.zeros(1, int), tdt), Vp, 128)[0]
    assert name.startswith({"stream": "cross_entropy_fused_stream_bf16_", "registers":
                            "cross_entropy_fused_rows_bf16_"}.get(kernel, f"cross_entropy_fused_{sfx}_")), name
    item = {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
    assert small_chunks.chunk_rows(N, Vp, item) < N       # several chunks
    x = round_bf16(rs.standard_normal((N, C))).astype(np.float64)
    w = round_bf16(rs.standard_normal((Vp, C)) * 0.5).astype(np.float64)
    t = rs.integers(0, V, N)
    loss, dx, dw = gpu.linear_cross_entropy(gpu.from_host(x, dtype), gpu.from_host(w, dtype),
                                            gpu.from_host(t, tdt), V, grad)
    want = ref.linear_cross_entropy(x, w, t, V)
    check("loss", host(gpu, loss).reshape(1), np.reshape(want[0], 1), tol / 4)
    if not grad:
        assert dx is None and dw is None
        return
    check("dx", host(gpu, dx), want[1], tol)
    got_dw = host(gpu, dw)
    check("dw", got_dw, want[2], tol)
    assert np.all(got_dw[V:] == 0.0), "the padded rows of w got a gradient"


@pytest.mark.parametrize("Vp,kernel", [(50304, "stream"), (50304, "registers"), (50264, "generic")])
def test_gpt2_vocabulary_rows(gpu, rs, monkeypatch, Vp, kernel):
    """Rows of GPT-2's (padded) vocabulary in bf16: streamed through shared memory, several
    rows a block (300 rows: more than a GPU's SMs), 7 vectors a thread in registers (50304),
    and the two-pass kernel (50264, not a multiple of 8); padding columns get no gradient."""
    from forge_ml.backends.cuda import classifier
    if kernel == "registers":
        registers_only(monkeypatch, classifier)
    poison_device_memory(1 << 28)
    N, C, V = 300, 32, 50257
    x = round_bf16(rs.standard_normal((N, C))).astype(np.float64)
    w = round_bf16(rs.standard_normal((Vp, C)) * 0.3).astype(np.float64)
    t = rs.integers(0, V, N)
    t[0] = V - 1
    loss, dx, dw = gpu.linear_cross_entropy(gpu.from_host(x, "bfloat16"), gpu.from_host(w, "bfloat16"),
                                            gpu.from_host(t, "int64"), V, True)
    want = ref.linear_cross_entropy(x, w, t, V)
    check("loss", host(gpu, loss).reshape(1), np.reshape(want[0], 1), 5e-3)
    check("dx", host(gpu, dx), want[1], 2e-2)
    got_dw = host(gpu, dw)
    check("dw", got_dw, want[2], 2e-2)
    assert np.all(got_dw[V:] == 0.0)


@pytest.mark.parametrize("kernel", ["stream", "registers"])
def test_a_nan_logit_makes_the_loss_nan(gpu, rs, monkeypatch, kernel):
    """A NaN among a row's logits (one weight row NaN: that column of every row) makes the loss
    NaN, in both bf16 kernels; a NaN in the padding columns (>= V) does not."""
    from forge_ml.backends.cuda import classifier
    if kernel == "registers":
        registers_only(monkeypatch, classifier)
    N, C, V, Vp = 200, 16, 60, 64
    x = rs.standard_normal((N, C))
    t = gpu.from_host(rs.integers(0, V, N), "int64")
    for col, nan in ((7, True), (62, False)):
        w = rs.standard_normal((Vp, C))
        w[col] = np.nan
        loss, _, _ = gpu.linear_cross_entropy(gpu.from_host(x, "bfloat16"), gpu.from_host(w, "bfloat16"),
                                              t, V, True)
        assert np.isnan(host(gpu, loss)) == nan, (col, host(gpu, loss))


def test_scale_reads_the_value_on_the_device(gpu, rs):
    x = rs.standard_normal((1000, 7)).astype(np.float32)
    s = gpu.from_host(np.array(-0.75, np.float32), "float32")
    check("scale", host(gpu, gpu.scale(gpu.from_host(x, "float32"), s)), -0.75 * x, 1e-7)
    xb = gpu.from_host(x, "bfloat16")
    check("scale bf16", host(gpu, gpu.scale(xb, s)), -0.75 * host(gpu, xb), 1e-2)


def test_model_step_equals_matmul_then_cross_entropy(gpu, small_chunks):
    """GPT-2's loss and every gradient with the LM head's loss op (over chunks) and with the
    logits kept (matmul, cross_entropy), bf16 on the GPU."""
    cfg = GPT2Config(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=64)
    m = GPT2.init(cfg, seed=3, device="cuda", dtype="bfloat16")
    r = np.random.default_rng(4)
    ids = fm.tensor(r.integers(0, 50, (4, 32)), device="cuda")
    tg = fm.tensor(r.integers(0, 50, (4, 32)), device="cuda")
    out = []
    for fused in (True, False):
        tape = Tape()
        _, loss, leaves = m.forward(tape, ids, tg, fused_loss=fused)
        tape.backward(loss)
        out.append((loss.t.item(), {k: tape.grad(v).numpy() for k, v in leaves.items()}))
    (la, ga), (lb, gb) = out
    assert abs(la - lb) <= 1e-3 * abs(lb)
    for k in ga:
        check(k, ga[k], gb[k], 2e-2)
