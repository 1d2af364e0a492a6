"""Every core and fused op of every available backend against tests/reference.py, the one
float64 specification. Backends: ``cpu``, ``corenp`` (core ops only: every fused op runs
its composed default) and ``cuda`` where a GPU is present. Each fused op is checked twice:
the backend's own (kernel or default) and the composed default run on that backend. The
optional members (``adamw_update_many``, ``sumsq_many``, ``sumsq_total``) and the graph ones
(``dropout_at``, ``adamw_update_at``, ``adamw_update_many_at``, ``clip_scale``) are checked
where the backend has them.

Tolerances are element by element: ``|got - want| <= (u + u64) * bound``, u the unit roundoff
of the dtype (2^-24 for float32, 2^-53 for float64), u64 the reference's own, and ``bound``
the op's forward error bound in units of u, derived from its arithmetic and the float64
reference (``error_bounds.py``: the rounding steps on the longest chain times the magnitude of
the terms rounded there). An elementwise float32 result is so held to 1e-7 (one rounding: add,
scale, dropout) to 1e-6 (gelu) of its magnitude. Each op also runs at a second, larger shape
that reaches its kernels' main paths (several row chunks of attention, layernorm's vector
lanes, several chunks of the LM head, several blocks of gelu_bwd, ...); the sums over many
terms use equal terms, rounding's worst case for a running sum.

Inputs are fresh random values each run and each test prints its seed; the environment
variable ``FORGE_TEST_SEED`` fixes it, to replay a failure (every test then draws from it):
``FORGE_TEST_SEED=1234 pytest -q tests/backends -k layernorm``.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest

import error_bounds as eb
import reference as ref
from core_numpy import register_backend
from forge_ml import rng
from forge_ml.backends import compose, contract, load, names
from forge_ml.device import Device
from forge_ml.ops import clip_from_sumsq

register_backend()


def _available():
    out = ["cpu", "corenp"]
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            out.append("cuda")
    except Exception:
        pass
    return out


BACKENDS = _available()
U = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
"""The unit roundoff of each dtype: a correctly rounded result is within u of its value."""
SEED_VAR = "FORGE_TEST_SEED"


@pytest.fixture(params=BACKENDS)
def bk(request):
    if request.param == "cuda":
        pytest.importorskip("cupy")
    from forge_ml.backends import get
    return get(Device.parse(request.param))


@pytest.fixture(params=["float32", "float64"])
def dt(request):
    return request.param


@pytest.fixture
def rs():
    given = os.environ.get(SEED_VAR, "").strip()
    if given and not given.isdigit():
        pytest.fail(f"{SEED_VAR} must be a non-negative integer (a printed seed), got {given!r}")
    seed = int(given) if given else int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"random seed {seed} (replay: {SEED_VAR}={seed})")
    return np.random.default_rng(seed)


def dev(bk, a, dt=None):
    a = np.asarray(a)
    return bk.from_host(a, dt or a.dtype.name)


def host(bk, x):
    return np.asarray(bk.to_host(x), np.float64)


def close(got, want, dt, what="", bound=None):
    """Element by element: ``|got - want| <= (u(dt) + u64) bound``, ``bound`` in units of the
    unit roundoff (``error_bounds`` has each op's; by default 2 |want|: one correctly rounded
    operation, as add, scale, a dropout multiplier, with margin). NaN exactly where want is."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bound = 2 * np.abs(want) if bound is None else np.broadcast_to(np.asarray(bound, np.float64),
                                                                   want.shape)
    nan = np.isnan(want)
    wrong_nan = np.argwhere(np.isnan(got) != nan)
    assert not wrong_nan.size, (f"{what}: NaN where the reference has none or none where it has "
                                f"one, first at {wrong_nan[0].tolist()}")
    lim = np.where(nan, np.inf, (U[dt] + U["float64"]) * bound)
    err = np.where(nan, 0.0, np.abs(got - want))
    bad = ~(err <= lim)
    if bad.any():
        ratio = np.where(bad, err / np.maximum(lim, 1e-300), 0.0)
        i = np.unravel_index(np.argmax(ratio), ratio.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {want.size} elements past the bound; the worst at "
            f"{tuple(int(j) for j in i)}: got {got[i]!r}, want {want[i]!r}, error {err[i]:.3g}, "
            f"{ratio[i]:.3g} x the bound {lim[i]:.3g} ({bound[i]:.3g} u)")


def exact(got, want, what=""):
    """Copies and placements (heads, caches): bit for bit."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert np.array_equal(got, want, equal_nan=True), f"{what}: not the same values"


def r(rs, *shape, dt="float32", scale=1.0):
    return (rs.standard_normal(shape) * scale).astype(dt)


def equal_magnitude(rs, n, dt):
    """n values of one magnitude (in [0.5, 1), random signs): every square, and every block of
    rows that repeats, is the same, so a running sum rounds the same way at each addition."""
    c = np.asarray(rs.uniform(0.5, 1.0), dt)
    return (c * rs.choice(np.array([-1, 1], dt), n)).astype(dt)


def both(bk, name):
    """The op as the backend has it, and its composed default on the same backend."""
    yield "backend", getattr(bk, name)
    yield "composed", functools.partial(getattr(compose, name), bk)


def optional(bk, name):
    """A member of contract.OPTIONAL or contract.GRAPH, or a skip where the backend lacks it."""
    fn = getattr(bk, name, None)
    if fn is None:
        pytest.skip(f"the {bk.name} backend has no {name}")
    return fn


# -- the contract itself ---------------------------------------------------------------------
def test_every_backend_meets_the_contract(bk):
    assert contract.missing(bk.module) == []
    for n in contract.FUSED:
        assert callable(getattr(bk, n))
    for cap in contract.CAPABILITIES:
        assert isinstance(getattr(bk, cap), bool)


def test_from_host_async_is_ordered_behind_the_work_before_it(bk, dt, rs):
    """A copy from host memory queued after a kernel that reads the array: the kernel sees the
    old values, the work after the copy the new ones (a training step's next batch is queued
    behind the step that still reads the last)."""
    old, new = r(rs, 512, 256, dt=dt), r(rs, 512, 256, dt=dt)
    x = dev(bk, old)
    src = bk.pinned_empty(old.shape, np.dtype(dt))
    src[...] = new
    y = bk.add(x, x)                   # reads x before the copy lands
    bk.from_host_async(x, src)
    z = bk.add(x, x)
    close(host(bk, y), 2 * old.astype(np.float64), dt, "before")
    close(host(bk, z), 2 * new.astype(np.float64), dt, "after")
    assert np.array_equal(host(bk, x), new.astype(np.float64))


def test_corenp_has_only_core_ops():
    bk = load("corenp")
    assert sorted(bk.composed) == sorted(contract.FUSED)
    assert "corenp" in names()


def test_a_backend_missing_a_core_op_is_refused():
    import types

    from forge_ml.backends import Backend
    from forge_ml.errors import DeviceError
    module = types.SimpleNamespace(**{n: (lambda *a: None) for n in contract.MEMORY + contract.CORE
                                      if n != "layernorm_bwd"})
    with pytest.raises(DeviceError, match="lacks layernorm_bwd"):
        Backend("broken", module)


# -- core ops ----------------------------------------------------------------------------------

MATMUL = {   # a's shape, b's shape, keywords (bias: its length)
    "plain": ((5, 7), (7, 3), {}),
    "trans_a": ((7, 5), (7, 3), dict(trans_a=True)),
    "trans_b": ((5, 7), (3, 7), dict(trans_b=True, alpha=0.5)),
    "bias": ((5, 7), (7, 3), dict(bias=3)),
    "alpha_bias": ((5, 7), (7, 3), dict(bias=3, alpha=-0.75)),
    "batched": ((2, 3, 5, 7), (2, 3, 7, 4), {}),
    "batched_alpha_bias": ((2, 3, 5, 7), (2, 3, 4, 7), dict(trans_b=True, bias=4, alpha=0.5)),
    "b_rows": ((2, 1, 4), (2, 9, 4), dict(b_rows=6, trans_b=True)),
    # the products' main path: blocks of rows and columns of the CPU's gemm, several k panels
    "large": ((67, 129), (129, 45), dict(bias=45, alpha=0.5)),
    "large_trans": ((129, 67), (45, 129), dict(trans_a=True, trans_b=True, bias=45, alpha=1.5)),
}


@pytest.mark.parametrize("case", sorted(MATMUL))
def test_matmul(bk, dt, rs, case):
    a_shape, b_shape, given = MATMUL[case]
    kw = dict(bias=None, trans_a=False, trans_b=False, alpha=1.0, b_rows=None) | given
    a, b = r(rs, *a_shape, dt=dt), r(rs, *b_shape, dt=dt)
    if kw["bias"] is not None:
        kw["bias"] = r(rs, kw["bias"], dt=dt)
    got = bk.matmul(dev(bk, a), dev(bk, b), None if kw["bias"] is None else dev(bk, kw["bias"]),
                    kw["trans_a"], kw["trans_b"], kw["alpha"], kw["b_rows"])
    close(host(bk, got), ref.matmul(a, b, **kw), dt, f"matmul {case}", eb.matmul(a, b, **kw))


def test_add_and_sum_rows(bk, dt, rs):
    a, b = r(rs, 6, 10, dt=dt), r(rs, 6, 10, dt=dt)
    close(host(bk, bk.add(dev(bk, a), dev(bk, b))), ref.add(a, b), dt, "add")  # one rounding
    x = r(rs, 3, 4, 10, dt=dt)
    close(host(bk, bk.sum_rows(dev(bk, x))), ref.sum_rows(x), dt, "sum_rows", eb.sum_rows(x))


@pytest.mark.parametrize("n", [120, 300_007])
def test_sumsq(bk, dt, rs, n):
    """A small array of random values, and 300,007 values of one magnitude (rounding's worst
    case for a running float32 sum: see error_bounds.ACC_K)."""
    x = r(rs, n, dt=dt) if n < 1000 else equal_magnitude(rs, n, dt)
    got = host(bk, bk.sumsq(dev(bk, x.reshape(-1, 10) if n < 1000 else x)))
    close(got, ref.sumsq(x), dt, "sumsq", eb.sumsq(x, dt))


def _sumsq_arrays(rs, dt):
    return [equal_magnitude(rs, 200_003, dt), r(rs, 4, 5, dt=dt), r(rs, 37, dt=dt),
            r(rs, 3, 7, 11, dt=dt)]


def test_sumsq_many(bk, dt, rs):
    many = optional(bk, "sumsq_many")
    xs = _sumsq_arrays(rs, dt)
    got = host(bk, many([dev(bk, x) for x in xs]))
    close(got, [ref.sumsq(x) for x in xs], dt, "sumsq_many", [eb.sumsq(x, dt) for x in xs])


def test_sumsq_total(bk, dt, rs):
    """The backend's sumsq_total where it has one, and the composed default (sumsq each, added
    in order): each array's bound, and the additions of the sums."""
    xs = _sumsq_arrays(rs, dt)
    want = sum(ref.sumsq(x) for x in xs)
    bound = sum(eb.sumsq(x, dt) for x in xs) + eb.sum_k(len(xs)) * want
    fns = [("composed", functools.partial(compose.sumsq_total, bk))]
    if getattr(bk, "sumsq_total", None) is not None:
        fns.append(("backend", bk.sumsq_total))
    for how, fn in fns:
        close(host(bk, fn([dev(bk, x) for x in xs])), want, dt, f"sumsq_total ({how})", bound)


@pytest.mark.parametrize("n", [60, 300_007])
def test_gelu(bk, dt, rs, n):
    """gelu and gelu_bwd: 60 values, and 300,007 (several blocks of every kernel: the CPU's C
    chunks of 16,384 elements, the NumPy path's 65,536 and 262,144); inputs to |x| ~ 8."""
    shape = (6, 10) if n == 60 else (n,)
    x, dy = r(rs, *shape, dt=dt, scale=2.0), r(rs, *shape, dt=dt)
    close(host(bk, bk.gelu(dev(bk, x))), ref.gelu(x), dt, "gelu", eb.gelu(x))
    close(host(bk, bk.gelu_bwd(dev(bk, x), dev(bk, dy))), ref.gelu_bwd(x, dy), dt, "gelu_bwd",
          eb.gelu_bwd(x, dy))


LN_SHAPES = [(4, 3, 16), (5, 8, 80)]   # the second: the C kernel's 32-float vector loops and a tail


def _ln_inputs(rs, shape, dt):
    """x with rows of three spreads (std 1, 0.05, 3: at 0.05 eps moves rstd by 2e-3), gamma,
    beta, and a random cotangent."""
    c = shape[-1]
    spread = np.resize(np.array([1.0, 0.05, 3.0]), shape[:-1])[..., None]
    x = (rs.standard_normal(shape) * spread).astype(dt)
    return x, r(rs, c, dt=dt), r(rs, c, dt=dt), r(rs, *shape, dt=dt)


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm(bk, dt, rs, shape):
    x, g, b, dy = _ln_inputs(rs, shape, dt)
    close(host(bk, bk.layernorm(dev(bk, x), dev(bk, g), dev(bk, b), 1e-5)),
          ref.layernorm(x, g, b, 1e-5), dt, "layernorm", eb.layernorm(x, g, b, 1e-5))
    got = bk.layernorm_bwd(dev(bk, x), dev(bk, g), dev(bk, dy), 1e-5)
    for name, gv, wv, bv in zip(("dx", "dgamma", "dbeta"), got, ref.layernorm_bwd(x, g, dy, 1e-5),
                                eb.layernorm_bwd(x, g, dy, 1e-5, dt)):
        close(host(bk, gv), wv, dt, f"layernorm_bwd {name}", bv)


def test_layernorm_rows_whose_variance_overflows_are_nan_on_every_backend(bk, dt, rs):
    """A row whose sum of squared deviations passes the type's range (|x - mean| past ~1e19 /
    sqrt(C) in float32) has no variance: rstd = 1 / sqrt(inf) was 0, so every output was beta
    and every gradient 0, in silence (and the CPU's two paths differed past that: NumPy NaN,
    the C kernel beta). Such a row is NaN now, forward and backward, on every backend (bf16
    storage too, where the GPU has it); the other rows keep their values."""
    c = 80
    huge = {"float32": 1e20, "float64": 1e160}[dt]
    x = rs.standard_normal((3, c)).astype(dt)
    x[1] *= huge                                   # finite in dt; its squares are not
    g, b, dy = r(rs, c, dt=dt), r(rs, c, dt=dt), r(rs, 3, c, dt=dt)
    y = host(bk, bk.layernorm(dev(bk, x), dev(bk, g), dev(bk, b), 1e-5))
    assert np.isnan(y[1]).all(), y[1][:4]
    keep = [0, 2]
    close(y[keep], ref.layernorm(x[keep], g, b, 1e-5), dt, "layernorm, the other rows",
          eb.layernorm(x[keep], g, b, 1e-5))
    dx = host(bk, bk.layernorm_bwd(dev(bk, x), dev(bk, g), dev(bk, dy), 1e-5)[0])
    assert np.isnan(dx[1]).all() and np.isfinite(dx[keep]).all()
    if dt == "float32" and getattr(bk, "bf16", False):   # the GPU's bf16 kernels (vec path)
        yb = host(bk, bk.layernorm(dev(bk, x, "bfloat16"), dev(bk, g, "bfloat16"),
                                   dev(bk, b, "bfloat16"), 1e-5))
        assert np.isnan(yb[1]).all() and np.isfinite(yb[keep]).all()


def test_layernorm_bwd_many_rows_accumulates_accurately(bk, dt, rs):
    """dgamma over 65,536 rows: a block of 16 rows repeated 4,096 times, so every block's
    partial sums are equal and a float32 running sum over the blocks rounds the same way at
    each addition (its error grows with the number of blocks: ~1000u), where partial sums added
    in double (the CPU) or in a tree (the GPU) stay near the blocks' own (error_bounds.ACC_K).
    dbeta is held to the any-order bound only: the CPU's NumPy path sums it in float32."""
    c, blk, reps = 16, 16, 4096
    base = rs.permutation(np.linspace(-1.5, 1.5, c))       # one sign per column: little cancels
    xb = (base + 0.3 * rs.standard_normal((blk, c))).astype(dt)
    dyb = (rs.standard_normal(c) + 0.1 * rs.standard_normal((blk, c))).astype(dt)
    g = r(rs, c, dt=dt)
    x, dy = np.tile(xb, (reps, 1)), np.tile(dyb, (reps, 1))
    dxb, dgb, dbb = ref.layernorm_bwd(xb, g, dyb, 1e-5)
    want = (np.tile(dxb, (reps, 1)), dgb * reps, dbb * reps)       # reps is a power of 2: exact
    got = bk.layernorm_bwd(dev(bk, x), dev(bk, g), dev(bk, dy), 1e-5)
    for name, gv, wv, bv in zip(("dx", "dgamma", "dbeta"), got, want,
                                eb.layernorm_bwd(x, g, dy, 1e-5, dt)):
        close(host(bk, gv), wv, dt, f"layernorm_bwd {name} over {blk * reps} rows", bv)


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_bwd_add(bk, dt, rs, shape):
    x, g, _, dy = _ln_inputs(rs, shape, dt)
    add = r(rs, *shape, dt=dt)
    want = ref.layernorm_bwd(x, g, dy, 1e-5)
    bound = eb.layernorm_bwd(x, g, dy, 1e-5, dt)
    for how, fn in both(bk, "layernorm_bwd_add"):
        got = fn(dev(bk, x), dev(bk, g), dev(bk, dy), 1e-5, dev(bk, add))
        close(host(bk, got[0]), add + want[0], dt, f"layernorm_bwd_add dx ({how})",
              bound[0] + 2 * np.abs(add + want[0]))                 # and the addition
        close(host(bk, got[1]), want[1], dt, f"layernorm_bwd_add dgamma ({how})", bound[1])
        close(host(bk, got[2]), want[2], dt, f"layernorm_bwd_add dbeta ({how})", bound[2])


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("with_add", [False, True])
def test_layernorm_bwd_sums(bk, dt, rs, with_add, shape):
    """dx (+ add) and the parameters' gradients as layernorm_bwd(_add)'s, and the row sums of
    the dx returned (the bias gradient of the layer before the layernorm)."""
    x, g, _, dy = _ln_inputs(rs, shape, dt)
    add = r(rs, *shape, dt=dt)
    want = ref.layernorm_bwd(x, g, dy, 1e-5)
    bound = eb.layernorm_bwd(x, g, dy, 1e-5, dt)
    want_dx = want[0] + (add if with_add else 0.0)
    bound_dx = bound[0] + (2 * np.abs(want_dx) if with_add else 0.0)
    for how, fn in both(bk, "layernorm_bwd_sums"):
        got = fn(dev(bk, x), dev(bk, g), dev(bk, dy), 1e-5, dev(bk, add) if with_add else None)
        close(host(bk, got[0]), want_dx, dt, f"layernorm_bwd_sums dx ({how})", bound_dx)
        close(host(bk, got[1]), want[1], dt, f"layernorm_bwd_sums dgamma ({how})", bound[1])
        close(host(bk, got[2]), want[2], dt, f"layernorm_bwd_sums dbeta ({how})", bound[2])
        close(host(bk, got[3]), ref.sum_rows(want_dx), dt, f"layernorm_bwd_sums sums ({how})",
              eb.sum_rows(want_dx, bound_dx))


@pytest.mark.parametrize("causal,off", [(False, 0), (True, 0), (True, 3)])
def test_softmax_and_logsumexp(bk, dt, rs, causal, off):
    x, dy = r(rs, 2, 5, 8, dt=dt, scale=3.0), r(rs, 2, 5, 8, dt=dt)
    y = ref.softmax(x, causal, off)
    close(host(bk, bk.softmax(dev(bk, x), causal, off)), y, dt, "softmax",
          eb.softmax(x, causal, off))                           # masked: exactly 0
    close(host(bk, bk.logsumexp(dev(bk, x), causal, off)), ref.logsumexp(x, causal, off), dt,
          "logsumexp", eb.logsumexp(x, causal, off))
    yd = y.astype(dt)
    close(host(bk, bk.softmax_bwd(dev(bk, yd), dev(bk, dy))), ref.softmax_bwd(yd, dy), dt,
          "softmax_bwd", eb.softmax_bwd(yd, dy))


def test_heads(bk, dt, rs):
    qkv = r(rs, 2, 5, 3 * 12, dt=dt)
    for got, want in zip(bk.split_heads(dev(bk, qkv), 3), ref.split_heads(qkv, 3)):
        exact(host(bk, got), want, "split_heads")
    dy = r(rs, 2, 3, 5, 4, dt=dt)
    for which in range(3):
        exact(host(bk, bk.unsplit_head(dev(bk, dy), which)), ref.unsplit_head(dy, which),
              "unsplit_head")
    exact(host(bk, bk.merge_heads(dev(bk, dy))), ref.merge_heads(dy), "merge_heads")
    y = r(rs, 2, 5, 12, dt=dt)
    exact(host(bk, bk.unmerge_heads(dev(bk, y), 3)), ref.unmerge_heads(y, 3), "unmerge_heads")


@pytest.mark.parametrize("shape_of", ["one head", "one position", "both"])
def test_heads_give_arrays_of_their_own(bk, dt, rs, shape_of):
    """split_heads, merge_heads and unmerge_heads return arrays of their own at every shape:
    with one head or one position the CPU's permutation was no copy in NumPy, so a write into
    the output (kv_append, assign) changed the input unseen (no version bump, a tape's saved
    tensor changed: a library user's report)."""
    H, T = {"one head": (1, 5), "one position": (3, 1), "both": (1, 1)}[shape_of]
    qkv = r(rs, 2, T, 3 * 4 * H, dt=dt)
    x = dev(bk, qkv)
    for part in bk.split_heads(x, H):
        bk.assign(part, np.full(part.shape, 7.0))
    exact(host(bk, x), qkv, "split_heads' input after writing its outputs")
    y = r(rs, 2, H, T, 4, dt=dt)
    yd = dev(bk, y)
    merged = bk.merge_heads(yd)
    bk.assign(merged, np.full(merged.shape, 7.0))
    exact(host(bk, yd), y, "merge_heads' input after writing its output")
    z = r(rs, 2, T, 4 * H, dt=dt)
    zd = dev(bk, z)
    heads = bk.unmerge_heads(zd, H)
    bk.assign(heads, np.full(heads.shape, 7.0))
    exact(host(bk, zd), z, "unmerge_heads' input after writing its output")


def test_embedding(bk, dt, rs):
    """wte[ids] + wpe[pos + t] (one correctly rounded addition): at a host position, at a device
    position, and at one position per row with T > 1 (each token of row b at pos[b] + t; a row
    past the table is NaN, the others are not)."""
    wte, wpe = r(rs, 11, 6, dt=dt), r(rs, 12, 6, dt=dt)
    ids = rs.integers(0, 11, (3, 4)).astype(np.int64)
    close(host(bk, bk.embedding(dev(bk, ids), dev(bk, wte), dev(bk, wpe), 3)),
          ref.embedding(ids, wte, wpe, 3), dt, "embedding")
    dpos = dev(bk, np.array([2], np.int32))
    close(host(bk, bk.embedding(dev(bk, ids), dev(bk, wte), dev(bk, wpe), dpos)),
          ref.embedding(ids, wte, wpe, 2), dt, "embedding at a device position")
    starts = (1, 8, 9)                                              # 9 + 4 > 12: row 2 is NaN
    want = np.concatenate([ref.embedding(ids[:2][b:b + 1], wte, wpe, p)
                           for b, p in enumerate(starts[:2])] + [np.full((1, 4, 6), np.nan)])
    rows = dev(bk, np.array(starts, np.int32))
    close(host(bk, bk.embedding(dev(bk, ids), dev(bk, wte), dev(bk, wpe), rows)), want, dt,
          "embedding, a position per row")
    one = ids[:, :1]
    want = np.concatenate([ref.embedding(one[b:b + 1], wte, wpe, p) for b, p in enumerate(starts)])
    close(host(bk, bk.embedding(dev(bk, one), dev(bk, wte), dev(bk, wpe), rows)), want, dt,
          "embedding, a position per row, one token each")


@pytest.mark.parametrize("rows,n", [(11, 8), (97, 3000)])
def test_scatter_add_rows(bk, dt, rs, rows, n):
    """dst[ids[i]] += src[i], repeated ids adding: ids always repeat (three rows share one id;
    3,000 ids over 97 rows for the kernels' groups spread over threads)."""
    ids = rs.integers(0, rows, n).astype(np.int64)
    ids[[1, 4, n - 1]] = ids[0]
    ids = ids.reshape(2, n // 2)
    dst, src = r(rs, rows, 6, dt=dt), r(rs, 2, n // 2, 6, dt=dt)
    d = dev(bk, dst)
    bk.scatter_add_rows(d, dev(bk, ids), dev(bk, src))
    close(host(bk, d), ref.scatter_add_rows(dst, ids, src), dt, "scatter_add_rows",
          eb.scatter_add_rows(dst, ids, src))


def test_kv_append(bk, dt, rs):
    cache, new = r(rs, 2, 3, 8, 4, dt=dt), r(rs, 2, 3, 2, 4, dt=dt)
    c = dev(bk, cache)
    bk.kv_append(c, dev(bk, new), 5)
    exact(host(bk, c), ref.kv_append(cache, new, 5), "kv_append")


@pytest.mark.parametrize("shape", [(3, 37), (5, 10_007)])
def test_dropout_mask_is_the_spec(bk, dt, rs, shape):
    """The mask element by element (50,035 elements: the CPU's chunks of 16,384 and the tail of
    its 16 counters at a time); a kept element is x times the float32 1/(1 - p), rounded once,
    a dropped one exactly 0."""
    x = r(rs, *shape, dt=dt)
    seed = int(rs.integers(0, 1 << 63))
    close(host(bk, bk.dropout(dev(bk, x), 0.3, seed)), ref.dropout(x, 0.3, seed), dt, "dropout")


def test_dropout_at(bk, dt, rs):
    """dropout with its seed in device memory (contract.GRAPH): rng.mix(base[0], site)."""
    fn = optional(bk, "dropout_at")
    x = r(rs, 3, 37, dt=dt)
    base = int(rs.integers(0, 1 << 64, dtype=np.uint64))
    at = dev(bk, np.array([base], np.uint64).view(np.int64))
    close(host(bk, fn(dev(bk, x), 0.3, at, 5)), ref.dropout(x, 0.3, rng.mix(base, 5)), dt,
          "dropout_at")


@pytest.mark.parametrize("padded", [False, True])
def test_cross_entropy(bk, dt, rs, padded):
    V = 13
    logits = r(rs, 6, 16 if padded else V, dt=dt, scale=2.0)
    t = rs.integers(0, V, 6).astype(np.int64)
    close(host(bk, bk.cross_entropy(dev(bk, logits), dev(bk, t), V)),
          ref.cross_entropy(logits, t, V), dt, "cross_entropy", eb.cross_entropy(logits, t, V))
    close(host(bk, bk.cross_entropy_bwd(dev(bk, logits), dev(bk, t), 0.7, V)),
          ref.cross_entropy_bwd(logits, t, 0.7, V), dt, "cross_entropy_bwd",
          eb.cross_entropy_bwd(logits, t, 0.7, V))              # exactly 0 past V


ADAMW = dict(beta1=0.9, beta2=0.95, eps=1e-8)


def _adamw_state(rs, shape, dt):
    p, g, m = r(rs, *shape, dt=dt), r(rs, *shape, dt=dt), r(rs, *shape, dt=dt, scale=0.1)
    return p, g, m, np.abs(r(rs, *shape, dt=dt, scale=0.1))


def _adamw_check(bk, dt, arrs, want, bound, what):
    for name, got, w, b in zip("pmv", (arrs[0], arrs[2], arrs[3]), want, bound):
        close(host(bk, got), w, dt, f"{what} {name}", b)


@pytest.mark.parametrize("lr", [1e-2, 0.0])
def test_adamw_update(bk, dt, rs, lr):
    """One step (lr 0: the moments move, p does not)."""
    state = _adamw_state(rs, (4, 5), dt)
    args = (lr, ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], 0.1, 3, 0.5)
    arrs = [dev(bk, a) for a in state]
    bk.adamw_update(*arrs, *args)
    _adamw_check(bk, dt, arrs, ref.adamw_update(*state, *args), eb.adamw_update(*state, *args),
                 "adamw")


MANY = [((4, 5), 0.1, 3), ((130, 257), 0.0, 1), ((37,), 0.05, 7)]   # shape, weight decay, step


def test_adamw_update_many(bk, dt, rs):
    """Every tensor its own weight decay and step (the second one several of the CPU's chunks)."""
    fn = optional(bk, "adamw_update_many")
    states = [_adamw_state(rs, shape, dt) for shape, _, _ in MANY]
    arrs = [[dev(bk, a) for a in s] for s in states]
    fn(*([a[i] for a in arrs] for i in range(4)), 1e-2, ADAMW["beta1"], ADAMW["beta2"],
       ADAMW["eps"], [wd for _, wd, _ in MANY], [st for _, _, st in MANY], 0.5)
    for k, (s, a, (_, wd, st)) in enumerate(zip(states, arrs, MANY)):
        args = (1e-2, ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], wd, st, 0.5)
        _adamw_check(bk, dt, a, ref.adamw_update(*s, *args), eb.adamw_update(*s, *args),
                     f"adamw_update_many [{k}]")


def _scalars(bk, lr, step, grad_scale):
    """ops.STEP_SCALARS in device memory: lr, bc1, bc2, grad_scale, norm, step."""
    b1, b2 = ADAMW["beta1"], ADAMW["beta2"]
    return dev(bk, np.array([lr, 1 - b1 ** step, 1 - b2 ** step, grad_scale, 0.0, step]))


@pytest.mark.parametrize("grad_scale", [0.5, float("nan")])
def test_adamw_update_at(bk, dt, rs, grad_scale):
    """AdamW with lr, the bias corrections and grad_scale read from device memory (contract.
    GRAPH); a NaN grad_scale (clip_scale's verdict on a bad step) writes nothing."""
    fn = optional(bk, "adamw_update_at")
    state = _adamw_state(rs, (4, 5), dt)
    arrs = [dev(bk, a) for a in state]
    fn(*arrs, ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], 0.1, _scalars(bk, 1e-2, 3, grad_scale))
    if math.isnan(grad_scale):
        for name, i in zip("pmv", (0, 2, 3)):
            exact(host(bk, arrs[i]), state[i], f"adamw_update_at {name} after a skipped step")
        return
    args = (1e-2, ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], 0.1, 3, grad_scale)
    _adamw_check(bk, dt, arrs, ref.adamw_update(*state, *args), eb.adamw_update(*state, *args),
                 "adamw_update_at")


def test_adamw_update_many_at(bk, dt, rs):
    fn = optional(bk, "adamw_update_many_at")
    states = [_adamw_state(rs, shape, dt) for shape, _, _ in MANY]
    arrs = [[dev(bk, a) for a in s] for s in states]
    fn(*([a[i] for a in arrs] for i in range(4)), ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"],
       [wd for _, wd, _ in MANY], _scalars(bk, 1e-2, 4, 0.5))
    for k, (s, a, (_, wd, _)) in enumerate(zip(states, arrs, MANY)):
        args = (1e-2, ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], wd, 4, 0.5)
        _adamw_check(bk, dt, a, ref.adamw_update(*s, *args), eb.adamw_update(*s, *args),
                     f"adamw_update_many_at [{k}]")


@pytest.mark.parametrize("sumsq,check,max_norm,grad_scale", [
    (25.0, None, 1.0, 1.0), (0.25, None, 1.0, 0.5), (25.0, None, 0.0, 2.0),
    (float("inf"), None, 1.0, 1.0), (25.0, float("nan"), 1.0, 1.0), (25.0, 3.0, 1.0, -0.5)])
def test_clip_scale(bk, dt, sumsq, check, max_norm, grad_scale):
    """The norm and the clip factor written into the step's scalars (contract.GRAPH) as
    ops.clip_from_sumsq computes them on the host (a few float64 roundings of each); NaN for a
    non-finite norm or check; the other values untouched."""
    fn = optional(bk, "clip_scale")
    scalars = np.array([1e-2, 0.1, 0.05, 7.0, 9.0, 3.0])
    s = dev(bk, scalars)
    fn(dev(bk, np.array(sumsq, dt)), None if check is None else dev(bk, np.array(check, dt)), s,
       max_norm, grad_scale)
    norm, scale = clip_from_sumsq(sumsq, max_norm, grad_scale)
    if not math.isfinite(norm) or (check is not None and not math.isfinite(check)):
        scale = float("nan")
    got = host(bk, s)
    close(got[3:5], [scale, norm], "float64", "clip_scale (grad_scale, norm)",
          8 * np.abs(np.nan_to_num([scale, norm])))
    exact(got[[0, 1, 2, 5]], scalars[[0, 1, 2, 5]], "clip_scale: the other values")
# -- fused ops, both ways ------------------------------------------------------------------------

ATTENTION = [(2, 3, 7, 4), (1, 2, 320, 16)]
"""(B, H, T, hs): odd sizes (the CPU kernel's zero-padded copies), and T = 320 with hs = 16
(its in-place tiles; the NumPy path's three row chunks of 128; rows past the first 8 keys)."""


@pytest.mark.parametrize("shape", ATTENTION)
def test_attention(bk, dt, rs, shape):
    q, k, v, dout = (r(rs, *shape, dt=dt) for _ in range(4))
    scale = 1 / math.sqrt(shape[-1])
    out_ref, lse_ref = ref.attention(q, k, v, scale)
    grads_ref = ref.attention_bwd(q, k, v, dout, scale)
    b_out, b_lse, *b_grads = eb.attention(q, k, v, scale, eb.causal(shape[-2]), dout)
    for how, fn in both(bk, "attention"):
        out, lse = fn(dev(bk, q), dev(bk, k), dev(bk, v), scale)
        close(host(bk, out), out_ref, dt, f"attention ({how})", b_out)
        close(host(bk, lse), lse_ref, dt, f"attention lse ({how})", b_lse)
    out, lse = bk.attention(dev(bk, q), dev(bk, k), dev(bk, v), scale)
    for how, fn in both(bk, "attention_bwd"):
        got = fn(dev(bk, q), dev(bk, k), dev(bk, v), out, lse, dev(bk, dout), scale)
        for name, gv, wv, bv in zip(("dq", "dk", "dv"), got, grads_ref, b_grads):
            close(host(bk, gv), wv, dt, f"attention_bwd {name} ({how})", bv)


def _qkv_reference(qkv, dy, h, scale, p=0.0, stream=0):
    """(y, lse, dqkv) of fused rows and their bounds, with dropout at rate p if p."""
    q, k, v = ref.split_heads(qkv, h)
    dout = ref.unmerge_heads(dy, h)
    t = q.shape[-2]
    if p:
        out, lse = ref.attention_dropout(q, k, v, scale, p, stream)
        grads = ref.attention_dropout_bwd(q, k, v, dout, scale, p, stream)
        drop = ref.dropout(np.ones(q.shape[:-1] + (t,)), p, stream)       # mask / (1 - p)
    else:
        out, lse = ref.attention(q, k, v, scale)
        grads, drop = ref.attention_bwd(q, k, v, dout, scale), None
    b_out, b_lse, *b_grads = eb.attention(q, k, v, scale, eb.causal(t), dout, drop)
    return (ref.merge_heads(out), lse, eb.unsplit(*grads)), (ref.merge_heads(b_out), b_lse,
                                                              eb.unsplit(*b_grads))


QKV = [(2, 6, 2, 4), (1, 304, 2, 16)]   # (B, T, H, hs): padded copies; the in-place tiles


@pytest.mark.parametrize("shape", QKV)
def test_attention_qkv(bk, dt, rs, shape):
    B, T, H, hs = shape
    scale = 1 / math.sqrt(hs)
    qkv, dy = r(rs, B, T, 3 * H * hs, dt=dt), r(rs, B, T, H * hs, dt=dt)
    (y_ref, lse_ref, dqkv_ref), (b_y, b_lse, b_dqkv) = _qkv_reference(qkv, dy, H, scale)
    for how, fn in both(bk, "attention_qkv"):
        y, lse = fn(dev(bk, qkv), H, scale)
        close(host(bk, y), y_ref, dt, f"attention_qkv ({how})", b_y)
        close(host(bk, lse), lse_ref, dt, f"attention_qkv lse ({how})", b_lse)
    y, lse = bk.attention_qkv(dev(bk, qkv), H, scale)
    for how, fn in both(bk, "attention_qkv_bwd"):
        close(host(bk, fn(dev(bk, qkv), y, lse, dev(bk, dy), H, scale)), dqkv_ref, dt,
              f"attention_qkv_bwd ({how})", b_dqkv)
    # with the row sums of dqkv (the bias gradient of the layer that made qkv)
    for how, fn in both(bk, "attention_qkv_bwd_sums"):
        got = fn(dev(bk, qkv), y, lse, dev(bk, dy), H, scale)
        close(host(bk, got[0]), dqkv_ref, dt, f"attention_qkv_bwd_sums dqkv ({how})", b_dqkv)
        close(host(bk, got[1]), ref.sum_rows(dqkv_ref), dt,
              f"attention_qkv_bwd_sums sums ({how})", eb.sum_rows(dqkv_ref, b_dqkv))


@pytest.mark.parametrize("seed_form", ["int", "at"])
def test_attention_qkv_dropout(bk, dt, rs, seed_form):
    """Dropout on the attention probabilities: the mask is dropout's over the (B, H, T, T)
    probabilities (the reference draws it element by element); the seed an int or, as a
    captured step passes it, (a one-element int64 array, site) mixed as rng.mix; dqkv of a
    random cotangent against the reference's chain rule."""
    B, T, H, hs, p, site = 2, 7, 2, 4, 0.3, 5
    qkv, dy = r(rs, B, T, 3 * H * hs, dt=dt), r(rs, B, T, H * hs, dt=dt)
    base = int(rs.integers(0, 1 << 64, dtype=np.uint64))
    stream = rng.mix(base, site)

    def seed():
        if seed_form == "int":
            return stream
        return dev(bk, np.array([base], np.uint64).view(np.int64)), site

    (y_ref, lse_ref, dqkv_ref), (b_y, b_lse, b_dqkv) = _qkv_reference(qkv, dy, H, 0.5, p, stream)
    no_drop = ref.merge_heads(ref.attention(*ref.split_heads(qkv, H), 0.5)[0])
    assert not np.allclose(y_ref, no_drop)   # some are dropped
    for how, fn in both(bk, "attention_qkv_dropout"):
        y, lse = fn(dev(bk, qkv), H, 0.5, p, seed())
        close(host(bk, y), y_ref, dt, f"attention_qkv_dropout ({how})", b_y)
        close(host(bk, lse), lse_ref, dt, f"attention_qkv_dropout lse ({how})", b_lse)
    y, lse = bk.attention_qkv_dropout(dev(bk, qkv), H, 0.5, p, seed())
    for how, fn in both(bk, "attention_qkv_dropout_bwd"):
        close(host(bk, fn(dev(bk, qkv), y, lse, dev(bk, dy), H, 0.5, p, seed())), dqkv_ref, dt,
              f"attention_qkv_dropout_bwd ({how})", b_dqkv)


def test_attention_qkv_dropout_at_zero_is_attention_qkv(bk, dt, rs):
    """At p = 0 the results are attention_qkv's: each within its bound of the reference, so
    the two within twice it."""
    qkv, dy = r(rs, 1, 5, 3 * 8, dt=dt), r(rs, 1, 5, 8, dt=dt)
    _, (b_y, b_lse, b_dqkv) = _qkv_reference(qkv, dy, 2, 0.5)
    y0, lse0 = bk.attention_qkv(dev(bk, qkv), 2, 0.5)
    y, lse = bk.attention_qkv_dropout(dev(bk, qkv), 2, 0.5, 0.0, 9)
    close(host(bk, y), host(bk, y0), dt, "y at p = 0", 2 * b_y)
    close(host(bk, lse), host(bk, lse0), dt, "lse at p = 0", 2 * b_lse)
    close(host(bk, bk.attention_qkv_dropout_bwd(dev(bk, qkv), y, lse, dev(bk, dy), 2, 0.5, 0.0, 9)),
          host(bk, bk.attention_qkv_bwd(dev(bk, qkv), y0, lse0, dev(bk, dy), 2, 0.5)), dt,
          "dqkv at p = 0", 2 * b_dqkv)


LINEAR = [(3, 16, 8), (40, 64, 48)]   # (M, K, N)


@pytest.mark.parametrize("mkn", LINEAR)
@pytest.mark.parametrize("act,res,ln", [(None, False, False), ("gelu", False, True),
                                        (None, True, False)])
def test_linear(bk, dt, rs, act, res, ln, mkn):
    """act(LN(x) @ w + bias) + residual: the layernorm's error carried through the product, the
    product's own, GELU's slope on both and its own, the residual's addition."""
    M, K, N = mkn
    x, w, b = r(rs, M, K, dt=dt), r(rs, K, N, dt=dt), r(rs, N, dt=dt)
    g, beta, resid = r(rs, K, dt=dt), r(rs, K, dt=dt), r(rs, M, N, dt=dt)
    xn = ref.layernorm(x, g, beta, 1e-5) if ln else x
    want = ref.matmul(xn, w, b)
    bound = eb.matmul(xn, w, b) + (eb.layernorm(x, g, beta, 1e-5) @ np.abs(w) if ln else 0.0)
    if act:
        bound = eb.gelu_slope(want) * bound + eb.gelu(want)
        want = ref.gelu(want)
    if res:
        want = want + resid
        bound = bound + 2 * np.abs(want)
    for how, fn in both(bk, "linear"):
        got = fn(dev(bk, x), dev(bk, w), dev(bk, b), act, dev(bk, resid) if res else None,
                 (dev(bk, g), dev(bk, beta), 1e-5) if ln else None)
        close(host(bk, got), want, dt, f"linear ({how})", bound)


@pytest.mark.parametrize("M", [3, 40])
def test_linear_with_ln_a_row_whose_variance_overflows_is_nan(bk, dt, rs, M):
    """linear(x, w, ln=...) folds the layernorm into the product (on Hopper, few rows: the
    cluster gemv's own statistics, which kept 1 / sqrt(inf) = 0 after the other layernorms
    took the NaN rule): the overflowing row is NaN, the others as the reference."""
    K, N = 64, 32
    x, w, b = r(rs, M, K, dt=dt), r(rs, K, N, dt=dt), r(rs, N, dt=dt)
    x[1] *= {"float32": 1e20, "float64": 1e160}[dt]
    g, beta = r(rs, K, dt=dt), r(rs, K, dt=dt)
    keep = [i for i in range(M) if i != 1]
    want = ref.matmul(ref.layernorm(x[keep], g, beta, 1e-5), w, b)
    dts = [dt] + (["bfloat16"] if dt == "float32" and getattr(bk, "bf16", False) else [])
    for d in dts:
        got = host(bk, bk.linear(dev(bk, x, d), dev(bk, w, d), dev(bk, b, d), None, None,
                                 (dev(bk, g, d), dev(bk, beta, d), 1e-5)))
        assert np.isnan(got[1]).all(), (d, got[1][:4])
        if d == dt:
            close(got[keep], want, dt, "linear with ln, the other rows",
                  eb.matmul(ref.layernorm(x[keep], g, beta, 1e-5), w, b)
                  + eb.layernorm(x[keep], g, beta, 1e-5) @ np.abs(w))
        else:
            assert np.isfinite(got[keep]).all()


@pytest.mark.parametrize("M,K,N", [(3, 16, 8), (40, 24, 32)])
def test_matmul_gelu(bk, dt, rs, M, K, N):
    x, w, b = r(rs, M, K, dt=dt), r(rs, K, N, dt=dt, scale=0.3), r(rs, N, dt=dt)
    pre = ref.matmul(x, w, b)
    b_pre = eb.matmul(x, w, b)
    for how, fn in both(bk, "matmul_gelu"):
        y, got_pre = fn(dev(bk, x), dev(bk, w), dev(bk, b))
        close(host(bk, got_pre), pre, dt, f"matmul_gelu pre ({how})", b_pre)
        close(host(bk, y), ref.gelu(pre), dt, f"matmul_gelu y ({how})",
              eb.gelu_slope(pre) * b_pre + eb.gelu(pre, eb.gelu_k(bk, how)))


@pytest.mark.parametrize("M,K,N", [(3, 16, 8), (40, 32, 24)])
def test_matmul_dgelu(bk, dt, rs, M, K, N):
    dy, w, pre = r(rs, M, N, dt=dt), r(rs, K, N, dt=dt, scale=0.3), r(rs, M, K, dt=dt)
    h = ref.matmul(dy, w.T)
    want = ref.gelu_bwd(pre, h)
    for how, fn in both(bk, "matmul_dgelu"):
        bound = (eb.gelu_bwd(pre, h, eb.gelu_k(bk, how))
                 + eb.gelu_slope(pre) * eb.matmul(dy, w, trans_b=True))
        dpre, db = fn(dev(bk, dy), dev(bk, w), dev(bk, pre))
        close(host(bk, dpre), want, dt, f"matmul_dgelu dpre ({how})", bound)
        close(host(bk, db), want.sum(axis=0), dt, f"matmul_dgelu db ({how})",
              eb.sum_rows(want, bound))


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_weight_grads(bk, dt, rs, alpha):
    x, dy = r(rs, 37, 12, dt=dt), r(rs, 37, 24, dt=dt)
    want_dw = alpha * x.astype(np.float64).T @ dy.astype(np.float64)
    for how, fn in both(bk, "weight_grads"):
        dw, db = fn(dev(bk, x), dev(bk, dy), alpha)
        close(host(bk, dw), want_dw, dt, f"weight_grads dw ({how})",
              eb.matmul(x, dy, trans_a=True, alpha=alpha))
        close(host(bk, db), ref.sum_rows(dy), dt, f"weight_grads db ({how})", eb.sum_rows(dy))


LCE = {"plain": (7, 8, 11, 11), "padded": (7, 8, 11, 16),
       # N rows past two of the CPU's 64 MiB chunks of float32 logits (three chunks, five in
       # float64), a vocabulary padded by 37 columns
       "chunks": (520, 8, 65536 - 37, 65536)}   # N, C, V, Vp


@pytest.mark.parametrize("case", sorted(LCE))
def test_linear_cross_entropy(bk, dt, rs, case):
    N, C, V, Vp = LCE[case]
    if case == "chunks" and "linear_cross_entropy" in bk.composed:
        pytest.skip("the composed default keeps the logits whole: the small cases cover it")
    x, w = r(rs, N, C, dt=dt), r(rs, Vp, C, dt=dt)
    t = rs.integers(0, V, N).astype(np.int64)
    want = ref.linear_cross_entropy(x, w, t, V)
    bound = eb.linear_cross_entropy(x, w, t, V)
    fns = both(bk, "linear_cross_entropy") if case != "chunks" else [
        ("backend", bk.linear_cross_entropy)]
    for how, fn in fns:
        loss, dx, dw = fn(dev(bk, x), dev(bk, w), dev(bk, t), V, True)
        for name, got, w_, b_ in zip(("loss", "dx", "dw"), (loss, dx, dw), want, bound):
            close(host(bk, got), w_, dt, f"linear_cross_entropy {name} ({how})", b_)
        if case == "chunks":
            continue
        loss, dx, dw = fn(dev(bk, x), dev(bk, w), dev(bk, t), V, False)
        assert dx is None and dw is None
        close(host(bk, loss), want[0], dt, f"linear_cross_entropy loss alone ({how})", bound[0])


def test_scale(bk, dt, rs):
    x = r(rs, 5, 3, dt=dt)
    for how, fn in both(bk, "scale"):          # one correctly rounded product
        close(host(bk, fn(dev(bk, x), -1.5)), -1.5 * x.astype(np.float64), dt, f"scale by a float ({how})")
        got = fn(dev(bk, x), dev(bk, np.array(0.25, dt)))
        close(host(bk, got), 0.25 * x.astype(np.float64), dt, f"scale by a device value ({how})")


@pytest.mark.parametrize("pos", [0, 5, "rows"])
def test_decode_attention(bk, dt, rs, pos):
    B, H, Tmax, hs = 3, 2, 8, 4
    qkv = r(rs, B, 3 * H * hs, dt=dt)
    kc, vc = r(rs, B, H, Tmax, hs, dt=dt), r(rs, B, H, Tmax, hs, dt=dt)
    at = np.array([0, 6, 3], np.int32) if pos == "rows" else pos
    want, kw, vw = ref.decode_attention(qkv, kc, vc, at, H, 0.5)
    q = ref.split_heads(qkv[:, None, :], H)[0]                         # (B, H, 1, hs)
    keep = np.arange(Tmax) <= np.broadcast_to(np.asarray(at).reshape(-1), (B,))[:, None, None, None]
    b_y = eb.attention(q, kw, vw, 0.5, keep)[0][:, :, 0, :].reshape(B, H * hs)
    for how, fn in both(bk, "decode_attention"):
        k_, v_ = dev(bk, kc), dev(bk, vc)
        p = dev(bk, at) if pos == "rows" else pos
        close(host(bk, fn(dev(bk, qkv), k_, v_, p, H, 0.5)), want, dt, f"decode_attention ({how})",
              b_y)
        exact(host(bk, k_), kw, f"k cache ({how})")
        exact(host(bk, v_), vw, f"v cache ({how})")


def test_greedy_next(bk, rs):
    logits = r(rs, 3, 20, dt="float32")
    logits[1, 4] = logits[1, 7] = 50.0                    # a tie: the lower id wins
    for how, fn in both(bk, "greedy_next"):
        ids, out = dev(bk, np.zeros(3, np.int32)), dev(bk, np.zeros(3, np.int32))
        pos = dev(bk, np.array([4], np.int32))
        fn(dev(bk, logits), 18, ids, pos, out)
        want = np.argmax(logits[:, :18], axis=1)
        assert host(bk, ids).tolist() == want.tolist(), how
        assert host(bk, out).tolist() == want.tolist(), how
        assert host(bk, pos).tolist() == [5], how


def _lost_rows(rs):
    """Logits (6, 20) whose rows 1-3 have no finite largest value (a NaN past the argmax, a
    +inf, every logit -inf) and rows 0, 4, 5 do (row 4 holds one -inf: it is never chosen,
    and row 5 a large finite value); and the rows' expected argmax (a NaN first)."""
    logits = r(rs, 6, 20, dt="float32")
    logits[1, 9] = np.nan
    logits[2, 3] = np.inf
    logits[3, :] = -np.inf
    logits[4, 2] = -np.inf
    logits[5, 6] = 3e38
    return logits, np.array([np.argmax(logits[0]), 9, 3, 0, np.argmax(logits[4]), 6])


def test_greedy_next_marks_a_row_with_no_finite_largest_logit(bk, rs):
    """A row of NaN or inf logits has no token: out gets -1 there (generate's device chain
    stops on it rather than going on from id 0, or from the NaN's id, in silence), while ids
    get the argmax, an id the next step can read."""
    logits, want = _lost_rows(rs)
    for how, fn in both(bk, "greedy_next"):
        ids, out = dev(bk, np.zeros(6, np.int32)), dev(bk, np.zeros(6, np.int32))
        fn(dev(bk, logits), 20, ids, dev(bk, np.array([0], np.int32)), out)
        assert host(bk, ids).tolist() == want.tolist(), how
        assert host(bk, out).tolist() == [want[0], -1, -1, -1, want[4], 6], how


def test_sample_next_marks_a_row_with_no_finite_largest_logit(bk, rs):
    """sample_next's sign as greedy_next's, sampled or not; a penalty that overflows a finite
    logit (row 0's 1e9 divided by 1e-30) is no lost row: the argmax, as sample_row takes it."""
    logits, want = _lost_rows(rs)
    logits[0, 5] = 1e9
    knobs = np.array([[1.0, 0, 1, 0, 1e-30]] + [[t, 0, 0.9, 0, 1] for t in (0.8, 0.0, 1.0, 0.7, 1.5)],
                     np.float32)
    seen = np.zeros((6, 20), np.int32)
    seen[0, 5] = 1
    for how, fn in both(bk, "sample_next"):
        ids, out = dev(bk, np.zeros(6, np.int32)), dev(bk, np.zeros(6, np.int32))
        fn(dev(bk, logits), 20, ids, dev(bk, np.arange(6, dtype=np.int32)), dev(bk, knobs),
           dev(bk, np.ones((6, 2), np.int32)), dev(bk, seen), out)
        got, marks = host(bk, ids).astype(int), host(bk, out).astype(int)
        assert got[:4].tolist() == [5, 9, 3, 0], how          # the argmax where no draw is made
        assert 0 <= got[4] < 20 and logits[4, got[4]] > -np.inf and got[5] == 6, how
        assert marks.tolist() == [5, -1, -1, -1, got[4], 6], how


@pytest.mark.parametrize("V,Vp", [(50, 64), (50257, 50304)])
def test_sample_next_follows_the_sampling_rule(bk, rs, V, Vp):
    """Every backend's sampled choice is forge_ml.sampling.sample_row's, row by row (the
    GPU kernel too: integer weights, Philox at the chosen token's position)."""
    from forge_ml.sampling import sample_row
    if V > 1000 and bk.name == "corenp":
        pytest.skip("the composed default is the rule itself: the small vocabulary covers it")
    knob_rows = [[0.0, 0, 1, 0, 1], [1.0, 0, 1, 0, 1], [0.7, 5, 1, 0, 1], [1.3, 0, 0.8, 0, 1],
                 [1.0, 0, 1, 0.05, 1], [0.9, 20, 0.9, 0.01, 1.3], [1.0, 3, 0.5, 0, 2.0], [2.0, 0, 1, 0, 1]]
    B = len(knob_rows)
    agree = total = 0
    for trial in range(6):
        logits = (rs.standard_normal((B, Vp)) * 3).astype(np.float32)
        seen = (rs.random((B, Vp)) < 0.1).astype(np.int32)
        keys = rs.integers(0, 1 << 32, (B, 2)).astype(np.uint32).view(np.int32)
        pos = rs.integers(0, 1000, B).astype(np.int32)
        ids, out = dev(bk, np.zeros(B, np.int32)), dev(bk, np.zeros(B, np.int32))
        p, s = dev(bk, pos), dev(bk, seen)
        bk.sample_next(dev(bk, logits), V, ids, p, dev(bk, np.array(knob_rows, np.float32)),
                       dev(bk, keys), s, out)
        got = np.asarray(bk.to_host(ids)).astype(np.int64)
        want = [sample_row(logits[b, :V], knob_rows[b], tuple(int(k) for k in keys[b].view(np.uint32)),
                           int(pos[b]) + 1, seen[b, :V]) for b in range(B)]
        agree += int((got == np.array(want)).sum())
        total += B
        assert (np.asarray(bk.to_host(out)).astype(np.int64) == got).all()
        assert (np.asarray(bk.to_host(p)) == pos + 1).all()
        s_host = np.asarray(bk.to_host(s))
        marked = seen.copy()
        marked[np.arange(B), got] += 2     # the chosen id counted (sampling.seen_row's marks)
        assert (s_host == marked).all()
    # the composed default is the rule; a kernel may differ in expf's last bit, rarely
    assert agree == total if bk.name != "cuda" else agree >= total - 1, (agree, total)


@pytest.mark.parametrize("with_bias", [False, True])
def test_penalize_logits(bk, rs, with_bias):
    """OpenAI's presence and frequency penalties and logit bias: every backend's bits are
    forge_ml.sampling.adjusted's (each operation rounded on its own), within float32's
    rounding of the float64 formula z + bias - frequency c - presence [c > 0]; the padded
    columns and a row with neither penalty nor bias are left as they were; -inf and NaN go
    through as they are."""
    from forge_ml.sampling import adjusted
    B, V, Vp = 5, 300, 320
    logits = (rs.standard_normal((B, Vp)) * 4).astype(np.float32)
    logits[1, 7], logits[2, 8] = -np.inf, np.nan
    counts = rs.integers(0, 5, (B, Vp)) * (rs.random((B, Vp)) < 0.3)
    seen = (rs.integers(0, 2, (B, Vp)) + 2 * counts).astype(np.int32)
    pen = np.array([[0.5, 0.25], [-1.5, 2.0], [2.0, -0.7], [0.0, 0.0], [1e-3, 1.9]], np.float32)
    bias = (rs.uniform(-100, 100, (B, Vp)) * (rs.random((B, Vp)) < 0.05)).astype(np.float32)
    if not with_bias:
        bias = None
    want = logits.copy()
    for b in range(B):
        want[b, :V] = adjusted(logits[b, :V], seen[b], pen[b, 0], pen[b, 1],
                               None if bias is None else bias[b])
    c = (seen >> 1).astype(np.float64)
    f64 = (logits.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))
           - pen[:, 1:2].astype(np.float64) * c - pen[:, 0:1].astype(np.float64) * (c > 0))
    scale = (np.abs(logits) + (0 if bias is None else np.abs(bias)) + np.abs(pen[:, 1:2]) * c
             + np.abs(pen[:, 0:1])).astype(np.float64)
    ok = np.isfinite(f64[:, :V])
    assert np.all(np.abs(want[:, :V][ok] - f64[:, :V][ok]) <= 4 * 2.0 ** -24 * scale[:, :V][ok])
    assert np.isneginf(want[1, 7]) and np.isnan(want[2, 8])
    if bias is None:
        assert (want[3] == logits[3]).all()          # neither penalty: the row as it was
    for how, fn in both(bk, "penalize_logits"):
        z = dev(bk, logits)
        fn(z, V, dev(bk, seen), dev(bk, pen), None if bias is None else dev(bk, bias))
        got = np.asarray(bk.to_host(z), np.float32)
        nan = np.isnan(want[:, :V])        # (a GPU's NaN has its own payload: NaN is enough)
        assert (np.isnan(got[:, :V]) == nan).all(), how
        assert got[:, :V][~nan].tobytes() == want[:, :V][~nan].tobytes(), how
        assert (got[:, V:] == logits[:, V:]).all(), how   # the padding untouched


# -- the op boundary of the fused dropout attention ------------------------------------------------

def test_ops_attention_qkv_dropout_seed_forms_and_checks(bk, rs):
    """ops.attention_qkv_dropout(_bwd) on each backend: a SeedAt draws the mask of the int
    seed rng.mix(base, site) (read on the host where arrays are host memory, on the device
    elsewhere); bad p, seeds and shapes are refused with the op's name."""
    import forge_ml as fm
    from forge_ml import Tape, ops
    from forge_ml.errors import ShapeError, TapeError
    qkv = fm.tensor(r(rs, 2, 6, 24), device=bk.name)
    dy = fm.tensor(r(rs, 2, 6, 8), device=bk.name)
    at = ops.SeedAt(fm.tensor(np.array([3], np.int64), device=bk.name), 4)
    y, lse = ops.attention_qkv_dropout(qkv, 2, 0.25, at)
    y1, lse1 = ops.attention_qkv_dropout(qkv, 2, 0.25, rng.mix(3, 4))
    assert np.array_equal(y.numpy(), y1.numpy()) and np.array_equal(lse.numpy(), lse1.numpy())
    assert np.array_equal(ops.attention_qkv_dropout_bwd(qkv, y, lse, dy, 2, 0.25, at).numpy(),
                          ops.attention_qkv_dropout_bwd(qkv, y, lse, dy, 2, 0.25,
                                                        rng.mix(3, 4)).numpy())
    for p in (1.0, -0.1):
        with pytest.raises(ShapeError, match="attention_qkv_dropout: p"):
            ops.attention_qkv_dropout(qkv, 2, p, 1)
    for seed in (-1, 1 << 64, 1.5, ops.SeedAt(fm.tensor(np.zeros(1, np.float32)), 0),
                 ops.SeedAt(at.base, -1)):
        with pytest.raises(ShapeError, match="attention_qkv_dropout"):
            ops.attention_qkv_dropout(qkv, 2, 0.25, seed)
    with pytest.raises(ShapeError, match="lse must be"):
        ops.attention_qkv_dropout_bwd(qkv, y, fm.zeros((2, 6), device=bk.name), dy, 2, 0.25, 1)
    with pytest.raises(TapeError, match="needs a seed"):
        tape = Tape()
        tape.attention_qkv(tape.leaf(qkv), 2, p=0.25)
