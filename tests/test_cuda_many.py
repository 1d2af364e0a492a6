"""many.cu: the gradients' global sum of squares and AdamW over a whole model in a few
launches (backends/cuda/many.py). The sum against float64 and with the same bits every run;
the multi-tensor AdamW bit for bit the one-tensor adamw_update_at; both inside a captured
graph whose table is built during the capture (a copy node from pinned memory)."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml import ops
from forge_ml.optim import AdamW

from _gpu_checks import cuda_or_skip

pytestmark = pytest.mark.cuda

# sizes around the 16384-element chunk, a GPT-2 bias and a few odd ones
SIZES = [1, 7, 768, 16383, 16384, 16385, 3 * 16384 + 5, 50257 * 3, 2304 * 768]


@pytest.fixture(scope="module")
def be():
    return cuda_or_skip(bf16=True)


def _arrays(r, dtype, sizes=SIZES, scale=1.0):
    host = [(r.standard_normal(n) * scale).astype(np.float32) for n in sizes]
    dev = [fm.tensor(h, device="cuda").to(dtype) for h in host]
    # the values the device holds (bf16-rounded), in float64
    return [d.to("float32").numpy().astype(np.float64) for d in dev], dev


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sumsq_total_against_float64(be, dtype):
    r = np.random.default_rng(3)
    host, dev = _arrays(r, dtype, scale=0.01)
    want = sum(float((h * h).sum()) for h in host)
    got = ops.sumsq_total(dev)
    assert got.dtype.name == "float32" and got.shape == ()
    assert abs(got.item() - want) <= 1e-6 * want
    # the same bits on every run, and the one-tensor path agrees to float32 rounding
    assert ops.sumsq_total(dev).numpy().tobytes() == got.numpy().tobytes()
    chain = sum(float(ops.sumsq(d).item()) for d in dev)
    assert abs(chain - got.item()) <= 1e-5 * want


def test_sumsq_total_falls_back_for_float64_and_mixed(be):
    r = np.random.default_rng(4)
    a = fm.tensor(r.standard_normal(1000), device="cuda")                 # float64
    b = fm.tensor(r.standard_normal(33).astype(np.float32), device="cuda")
    want = float((a.numpy() ** 2).sum())
    got = ops.sumsq_total([a])
    assert got.dtype.name == "float64" and abs(got.item() - want) <= 1e-12 * want
    hb = b.numpy().astype(np.float64)
    hb16 = b.to("bfloat16").to("float32").numpy().astype(np.float64)
    mixed = ops.sumsq_total([b, b.to("bfloat16")])
    assert mixed.dtype.name == "float32"
    assert abs(mixed.item() - ((hb * hb).sum() + (hb16 * hb16).sum())) <= 1e-5 * (hb * hb).sum()
    wide = ops.sumsq_total([b, a])
    assert wide.dtype.name == "float64"
    assert abs(wide.item() - (want + (hb * hb).sum())) <= 1e-6 * want


def test_sumsq_total_rejects_two_devices_and_nothing(be):
    with pytest.raises(fm.ShapeError):
        ops.sumsq_total([])
    with pytest.raises(fm.DeviceError):
        ops.sumsq_total([fm.zeros(3, device="cuda"), fm.zeros(3)])


def _opt_pair(r, gdtype, sizes):
    """Two AdamWs over the same masters (two of each shape: rank 2 decays, rank 1 does not),
    bf16 compute copies, and gradients in gdtype."""
    shapes = [(n,) if i % 2 else (1, n) for i, n in enumerate(sizes)]
    p0 = {f"p{i}": r.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    grads = {k: fm.tensor(r.standard_normal(v.shape).astype(np.float32) * 2, device="cuda").to(gdtype)
             for k, v in p0.items()}
    make = lambda: AdamW({k: fm.tensor(v, device="cuda") for k, v in p0.items()}, lr=1e-2,
                         weight_decay=0.1, compute_dtype="bfloat16")
    return make(), make(), grads


@pytest.mark.parametrize("gdtype", ["bfloat16", "float32"])
def test_adamw_many_at_is_the_one_tensor_kernel_bit_for_bit(be, gdtype):
    r = np.random.default_rng(5)
    a, b, grads = _opt_pair(r, gdtype, SIZES)
    bk = be
    for step in range(3):
        sa = a.prepare(lr=1e-3 * (step + 1), grad_scale=0.7)
        sb = b.prepare(lr=1e-3 * (step + 1), grad_scale=0.7)
        a.update(grads, sa)                    # ops.adamw_update_many: one launch
        for name, p in b.params.items():       # the one-tensor kernel, one launch each
            bk.adamw_update_at(p.data, grads[name].data, b.m[name].data, b.v[name].data,
                               0.9, 0.95, 1e-8, b._weight_decay(name), sb.data,
                               b.lowp[name].data)
        a.advance()
        b.advance()
    for name in a.params:
        for x, y in ((a.params[name], b.params[name]), (a.m[name], b.m[name]),
                     (a.v[name], b.v[name]), (a.lowp[name], b.lowp[name])):
            assert x.numpy().tobytes() == y.numpy().tobytes(), name


def test_adamw_many_at_skips_on_a_nan_factor(be):
    r = np.random.default_rng(6)
    a, _, grads = _opt_pair(r, "bfloat16", [100, 20000])
    before = {k: p.numpy().copy() for k, p in a.params.items()}
    s = a.prepare(lr=1e-2)
    vals = s.numpy().copy()
    vals[3] = np.nan        # the gradient factor a step reads from device memory (prepare refuses NaN)
    ops.assign(s, vals)
    a.update(grads, s)
    for k, p in a.params.items():
        assert np.array_equal(p.numpy(), before[k])
        assert not a.m[k].numpy().any()


def test_many_in_a_graph_whose_table_is_built_while_capturing(be):
    """The tables are cleared before the capture, so the capture itself records the copy of
    each table from pinned memory; replays with new gradient values give what the same ops
    give op by op."""
    from forge_ml.backends.cuda import many
    r = np.random.default_rng(7)
    a, b, src = _opt_pair(r, "bfloat16", [5, 16385, 40000])
    out = {}

    def work():
        g = {k: ops.scale(v, 1.5) for k, v in src.items()}   # fresh arrays from the graph's pool
        out["sq"] = ops.sumsq_total(list(g.values()))
        a.update(g, a.scalars)
        return out["sq"]

    a.prepare(lr=1e-3)
    work()                       # compiles every kernel (and takes a step)
    a.advance()
    many._clear_tables()
    graph = be.capture_graph(work)
    assert any(v[3] for v in many._tables.values())   # made while capturing: kept for good
    # b catches up with a's first step op by op
    g = {k: ops.scale(v, 1.5) for k, v in src.items()}
    b.update(g, b.prepare(lr=1e-3))
    b.advance()
    for step in range(2):
        for v in src.values():   # new gradients in place
            ops.assign(v, (r.standard_normal(v.shape) * 2).astype(np.float32))
        a.prepare(lr=2e-3)
        graph.replay()
        a.advance()
        g = {k: ops.scale(v, 1.5) for k, v in src.items()}
        want_sq = ops.sumsq_total(list(g.values()))
        b.update(g, b.prepare(lr=2e-3))
        b.advance()
        assert graph.outputs.numpy().tobytes() == want_sq.numpy().tobytes()
        for k in a.params:
            assert a.params[k].numpy().tobytes() == b.params[k].numpy().tobytes(), k
    graph.release()


def test_clearing_the_tables_waits_for_their_copies(be):
    """many._clear_tables, the tests' way to empty the cache, waits for the tables' copies: a
    table's host buffer goes back to CuPy's pinned pool, whose next allocation of its size
    takes it at once, so a copy still queued behind other work would read the next table's
    rows (the GPU suite's cudaErrorIllegalAddress of 2026-12-07, under eight workers: the
    test above emptied the cache with the op-by-op step's copies still queued, and the
    capture's tables took their buffers)."""
    import cupy
    from forge_ml.backends.cuda import many
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        const long long t0 = clock64();
        while (clock64() - t0 < n) {}
    }''', "spin")
    rows = [(11, 12, 13), (21, 22, 23), (31, 32, 33)]
    many._clear_tables()
    spin((1,), (1,), (np.int64(100_000_000),))   # the stream busy for about 50 ms
    dev = many._table(rows)                       # its copy queued behind the spin
    many._clear_tables()
    many._table([(-1, -2, -3)] * 3)               # a table of the same size
    assert dev.get().tolist() == [list(r) for r in rows]


def test_a_table_a_graph_uses_is_never_evicted(be):
    """A table made op by op and then used by a capture is kept for good, however many other
    tables come after it (the graph reads it at every replay)."""
    from forge_ml.backends.cuda import many
    r = np.random.default_rng(10)
    xs = [fm.tensor(r.standard_normal(n).astype(np.float32), device="cuda") for n in (5, 70000)]
    many._clear_tables()
    ops.sumsq_total(xs)                               # made op by op
    graph = be.capture_graph(lambda: ops.sumsq_total(xs))
    assert len(many._tables) == 1 and all(v[3] for v in many._tables.values())
    for i in range(many._KEEP + 5):                   # enough others to evict it if it could be
        ops.sumsq_total([fm.tensor(r.standard_normal(10 + i).astype(np.float32), device="cuda")])
    want = sum(float((x.numpy().astype(np.float64) ** 2).sum()) for x in xs)
    graph.replay()
    assert abs(graph.outputs.item() - want) <= 1e-6 * want
    graph.release()


def test_table_cache_stays_bounded(be):
    from forge_ml.backends.cuda import many
    r = np.random.default_rng(8)
    for i in range(many._KEEP + 10):
        x = fm.tensor(r.standard_normal(10 + i).astype(np.float32), device="cuda")
        want = float((x.numpy().astype(np.float64) ** 2).sum())
        assert abs(ops.sumsq_total([x]).item() - want) <= 1e-5 * want
    assert sum(1 for v in many._tables.values() if not v[3]) <= many._KEEP


def test_sumsq_total_on_unaligned_views(be):
    """Views that start off a 16-byte boundary take the element-by-element path."""
    r = np.random.default_rng(9)
    host, dev = _arrays(r, "bfloat16", sizes=[40000, 16384 * 2 + 8])
    views = [d.data[1:] for d in dev] + [d.data[3:-3] for d in dev]
    want = sum(float((h[1:] ** 2).sum()) for h in host) + sum(float((h[3:-3] ** 2).sum()) for h in host)
    got = float(be.sumsq_total(views).get())
    assert abs(got - want) <= 1e-6 * want
