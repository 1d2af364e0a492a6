"""GPU tests of gemm_rows.cu: the decoding step's linear layers for a batch of 5-64 rows (bf16,
tensor cores, K split over a thread-block cluster, the layernorm's statistics merged over the
cluster's slices) against the float64 specification, every option and shape it takes, the
programmatic-launch wait, and the decoding step it serves against the cuBLASLt path.

The reference takes the bf16 inputs exactly and rounds the layernorm's output to bf16 (as
the kernel and layernorm.cu do), so the only differences left are float32 sums and the
output's rounding: 3e-3 of the output's norm."""
from __future__ import annotations

import numpy as np
import pytest

import reference
from _gpu_checks import check, cuda_or_skip, host, poison_device_memory, round_bf16

pytestmark = pytest.mark.cuda
TOL = 3e-3


@pytest.fixture(scope="module")
def be():
    be = cuda_or_skip(bf16=True)
    from forge_ml.backends.cuda import linear
    if not linear._launcher_ex():
        pytest.skip("gemm_rows.cu is for Hopper GPUs (thread-block clusters)")
    return be


@pytest.fixture(autouse=True)
def switched_on():
    """FORGE_GEMM_ROWS on (its default until measured is off)."""
    from forge_ml import flags
    with flags.override(FORGE_GEMM_ROWS=True):
        yield


@pytest.fixture
def rs():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def bf(rs, shape, scale=1.0, shift=0.0):
    """Random values exactly representable in bf16, as float64."""
    return round_bf16(rs.standard_normal(shape) * scale + shift).astype(np.float64)


def dev(be, a):
    return be.from_host(np.asarray(a), "bfloat16")


@pytest.fixture
def calls(monkeypatch):
    """The gemm_rows launches (each product that took the kernel) of the test."""
    from forge_ml.backends.cuda import linear
    seen, real = [], linear._gemm_rows

    def counted(*a, **k):
        out = real(*a, **k)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(linear, "_gemm_rows", counted)
    return seen


def _want(x, w, b, act, r, ln):
    xn = round_bf16(reference.layernorm(x, ln[0], ln[1], 1e-5)).astype(np.float64) if ln else x
    y = xn @ w + (0.0 if b is None else b)
    if act:
        y = reference.gelu(y)
    return y + (0.0 if r is None else r)


@pytest.mark.parametrize("M", [5, 17, 64])
@pytest.mark.parametrize("K,N", [(768, 2304), (768, 768), (3072, 768), (40, 24), (1600, 4800)])
@pytest.mark.parametrize("act,res,ln", [(None, False, True), ("gelu", False, True),
                                        (None, True, False), ("gelu", True, False)])
def test_linear_matches_float64(be, rs, calls, M, K, N, act, res, ln):
    """Every M, every shape GPT-2 asks of it (and one of a 40-row K whose last slice is half
    of 16 rows, 24 columns: a part tile), layernorm or not, bias, GELU, residual; the same
    bits on a second run (sums in a fixed order)."""
    poison_device_memory(1 << 28)
    x, w, b = bf(rs, (M, K), 2.0, 0.5), bf(rs, (K, N), 0.05), bf(rs, (N,))
    r = bf(rs, (M, N)) if res else None
    g = (bf(rs, (K,), 0.1, 1.0), bf(rs, (K,))) if ln else None
    args = lambda: (dev(be, x), dev(be, w), dev(be, b), act, None if r is None else dev(be, r),
                    None if g is None else (dev(be, g[0]), dev(be, g[1]), 1e-5))
    got = host(be, be.linear(*args()))
    assert calls == [True], "the product did not take gemm_rows.cu"
    check(f"gemm_rows M={M} K={K} N={N} act={act} res={res} ln={ln}", got,
          _want(x, w, b, act, r, g), TOL)
    assert np.array_equal(host(be, be.linear(*args())), got)


def test_the_rows_it_takes(be, rs, calls):
    """64 rows and 5 take the kernel; 4 rows (gemv.cu), 65 rows, float32 and a layernorm weight
    off a 16-byte boundary do not, and the FORGE_GEMM_ROWS switch off sends 64 rows to
    cuBLASLt: the same values within bf16's."""
    from forge_ml import flags
    w, b = bf(rs, (256, 128), 0.1), bf(rs, (128,))
    for M, takes in ((64, True), (5, True), (4, False), (65, False)):
        calls.clear()
        x = bf(rs, (M, 256))
        got = host(be, be.linear(dev(be, x), dev(be, w), dev(be, b), None, None, None))
        assert calls == ([True] if takes else []), M
        check(f"{M} rows", got, x @ w + b, TOL)
    calls.clear()
    be.linear(be.from_host(x[:64], "float32"), be.from_host(w, "float32"),
              be.from_host(b, "float32"), None, None, None)
    assert calls == []
    calls.clear()   # a layernorm weight off a 16-byte boundary: cuBLASLt's path, the same values
    x, g = bf(rs, (64, 256)), bf(rs, (257,), 0.1, 1.0)
    dg = dev(be, g)
    got = host(be, be.linear(dev(be, x), dev(be, w), dev(be, b), None, None,
                             (dg[1:], dg[:256], 1e-5)))
    assert calls == [False]
    check("gamma at an odd address", got, _want(x, w, b, None, None, (g[1:], g[:256])), TOL)
    calls.clear()
    x = bf(rs, (64, 256))
    with flags.override(FORGE_GEMM_ROWS=False):
        off = host(be, be.linear(dev(be, x), dev(be, w), dev(be, b), "gelu", None, None))
    assert calls == []
    on = host(be, be.linear(dev(be, x), dev(be, w), dev(be, b), "gelu", None, None))
    assert calls == [True]
    check("on against off", on, off, TOL)


def test_waits_for_weights_the_previous_kernel_wrote(be, rs):
    """Programmatic dependent launch: the kernel loads W, the bias, gamma and beta before the
    previous kernel has finished, unless that kernel wrote them. Here each is the previous
    product's output (different every round, over the last round's stale bits)."""
    x, w0, z = bf(rs, (64, 256)), bf(rs, (256, 512), 0.05), bf(rs, (16, 64))
    dw0, dz = dev(be, w0), dev(be, z)
    for i in range(1, 12):
        xi = round_bf16(x * (1 + i / 8)).astype(np.float64)
        y1 = be.linear(dev(be, xi), dw0, None, None, None, None)   # (64, 512)
        want1 = round_bf16(xi @ w0).astype(np.float64)
        assert be._pdl_wrote(y1)
        y2 = be.linear(dz, y1, y1[0], None, None, None)            # W and bias: y1's
        check(f"W and bias from the previous product, round {i}", host(be, y2),
              z @ want1 + want1[0], TOL)
        y1 = be.linear(dev(be, xi), dw0, None, None, None, None)
        zz = bf(rs, (8, 256))
        got = be.linear(dev(be, zz), dw0, None, None, None, (y1[1, :256], y1[2, :256], 1e-5))
        check(f"gamma and beta from the previous product, round {i}", host(be, got),
              _want(zz, w0, None, None, None, (want1[1, :256], want1[2, :256])), TOL)


@pytest.mark.parametrize("B", [8, 64])
def test_decoding_step_agrees_with_the_cublaslt_path(be, B):
    """A GPT-2 124M-shaped decoding step (bf16, graph replayed) at 8 and 64 rows, fed the same
    tokens: its logits with gemm_rows.cu and with FORGE_GEMM_ROWS off (a layernorm kernel and
    cuBLASLt) agree within bf16's precision at each of 24 positions."""
    import forge_ml as fm
    from forge_ml import flags
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    cfg = GPT2Config(n_layer=4, n_head=12, n_embd=768, vocab_size=1000, block_size=256)
    gpu = GPT2.init(cfg, seed=3).to("cuda", dtype="bfloat16")
    ids = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, 32))

    def run():
        cache = gpu.new_cache(B, 64)
        gpu.forward_cached(fm.tensor(ids[:, :8], device="cuda"), cache)
        step = DecodeStep(gpu, cache)
        assert not step.fused
        return np.stack([step(ids[:, t], t) for t in range(8, 32)])

    on = run()
    with flags.override(FORGE_GEMM_ROWS=False):
        off = run()
    for t in range(on.shape[0]):
        check(f"logits at position {8 + t}", on[t], off[t], 2e-2)
    assert np.isfinite(on).all() and on.std() > 0
