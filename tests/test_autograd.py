"""The tape: its semantics (after the Rust original), every tape method against central finite
differences in float64 through a random cotangent, and a two-layer GPT block against PyTorch
autograd."""
import math
import zlib

import numpy as np
import pytest

import forge_ml as fm
from forge_ml import Tape, ops

torch = pytest.importorskip("torch")


def T(a):
    return fm.tensor(np.asarray(a))


def rnd(rs, *shape, dtype=np.float64):
    return rs.standard_normal(shape).astype(dtype)


# -- tape semantics -------------------------------------------------------------------------


def test_fan_out_accumulates():
    rs = np.random.default_rng(0)
    tape = Tape()
    x = tape.leaf(T(rnd(rs, 3, 4)))
    y = tape.add(x, x)
    z = tape.add(y, x)                                  # z = 3x
    r = rnd(rs, 3, 4)
    grads = tape.backward(z, T(r))
    np.testing.assert_allclose(grads[x.id].numpy(), 3 * r, rtol=0, atol=0)


def test_interior_grads_freed_leaves_kept():
    rs = np.random.default_rng(1)
    tape = Tape()
    x = tape.leaf(T(rnd(rs, 2, 3)))
    w = tape.leaf(T(rnd(rs, 3, 5)))
    h = tape.matmul(x, w)
    g = tape.gelu(h)
    out = tape.add(g, g)
    grads = tape.backward(out, T(rnd(rs, 2, 5)))
    assert grads[x.id] is not None and grads[w.id] is not None
    for node in (h, g, out):
        assert grads[node.id] is None
    assert tape.grad(w) is grads[w.id]


def test_backward_from_an_interior_node_and_only_once():
    rs = np.random.default_rng(2)
    tape = Tape()
    x = tape.leaf(T(rnd(rs, 4)))
    h = tape.gelu(x)
    tape.gelu(h)                                         # recorded after h; never reached
    r = rnd(rs, 4)
    grads = tape.backward(h, T(r))
    want = ops.gelu_bwd(T(x.t.numpy()), T(r)).numpy()
    np.testing.assert_allclose(grads[x.id].numpy(), want, rtol=1e-14)
    with pytest.raises(fm.TapeError):
        tape.backward(h, T(r))


def test_dropout_backward_regenerates_the_forward_mask():
    rs = np.random.default_rng(3)
    x = rs.standard_normal((64, 32)) + 3.0               # no exact zeros
    tape = Tape()
    xv = tape.leaf(T(x))
    y = tape.dropout(xv, 0.25, seed=1234)
    kept = y.t.numpy() != 0
    assert 0.6 < kept.mean() < 0.9
    r = rnd(rs, 64, 32)
    g = tape.backward(y, T(r))[xv.id].numpy()
    np.testing.assert_array_equal(g != 0, kept)
    np.testing.assert_allclose(g[kept], r[kept] * float(fm.rng.dropout_scale(0.25)), rtol=1e-15)
    assert tape.dropout(xv, 0.0, seed=5) is xv          # p = 0 records nothing


def test_in_place_edit_of_a_saved_tensor_is_caught():
    rs = np.random.default_rng(4)
    tape = Tape()
    cache = fm.tensor(rnd(rs, 1, 4, 3))
    c = tape.leaf(cache)
    y = tape.gelu(c)
    ops.kv_append(cache, fm.tensor(rnd(rs, 1, 1, 3)), 0)
    with pytest.raises(fm.TapeError, match="modified in place"):
        tape.backward(y, T(rnd(rs, 1, 4, 3)))



def test_a_tape_without_grad_keeps_nothing():
    """Tape(grad=False) computes the same values, keeps no activation for a backward (the
    intermediate below is freed as soon as the forward drops it) and refuses backward."""
    import gc
    import weakref
    rs = np.random.default_rng(6)
    xs = rnd(rs, 3, 4)
    outs, kept = [], []
    for grad in (True, False):
        tape = Tape(grad=grad)
        x = tape.leaf(T(xs))
        h = tape.gelu(x)
        ref = weakref.ref(h.t)
        y = tape.gelu(h)
        del h
        gc.collect()
        kept.append(ref() is not None)
        outs.append(y.t.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    assert kept == [True, False]
    with pytest.raises(fm.TapeError, match="grad=False"):
        tape.backward(y)

def test_foreign_values_are_rejected():
    tape = Tape()
    with pytest.raises(fm.TapeError):
        tape.leaf(np.zeros(3))
    with pytest.raises(fm.TapeError):
        tape.gelu(fm.tensor([1.0]))


# -- every tape method against central finite differences (float64) --------------------------


def fd_check(build, inputs, rs, eps=1e-6, n_probe=12, rtol=1e-6):
    """``build(tape, leaves) -> TVar``; checks d/dinput of sum(out * r) at random coordinates."""
    tape = Tape()
    leaves = [tape.leaf(T(a)) for a in inputs]
    out = build(tape, leaves)
    r = rnd(rs, *out.t.shape)
    grads = tape.backward(out, T(r))

    def f(arrs):
        t2 = Tape()
        lv = [t2.leaf(T(a)) for a in arrs]
        return float((build(t2, lv).t.numpy() * r).sum())

    for i, a in enumerate(inputs):
        g = grads[leaves[i].id].numpy()
        flat = a.reshape(-1)
        for j in rs.choice(flat.size, size=min(n_probe, flat.size), replace=False):
            plus = [x.copy() for x in inputs]
            minus = [x.copy() for x in inputs]
            plus[i].reshape(-1)[j] += eps
            minus[i].reshape(-1)[j] -= eps
            num = (f(plus) - f(minus)) / (2 * eps)
            ana = g.reshape(-1)[j]
            assert abs(num - ana) <= rtol * max(1.0, abs(num)) + 1e-8, (i, j, num, ana)


CASES = {
    "add": (lambda t, v: t.add(v[0], v[1]), [(3, 4), (3, 4)]),
    "matmul": (lambda t, v: t.matmul(v[0], v[1], v[2], alpha=0.7), [(3, 4), (4, 5), (5,)]),
    "matmul_trans_b": (lambda t, v: t.matmul(v[0], v[1], trans_b=True), [(3, 4), (6, 4)]),
    "matmul_batched": (lambda t, v: t.matmul(v[0], v[1], trans_b=True, alpha=0.5),
                       [(2, 3, 5, 4), (2, 3, 6, 4)]),
    "gelu": (lambda t, v: t.gelu(v[0]), [(4, 6)]),
    "matmul_gelu": (lambda t, v: t.matmul_gelu(v[0], v[1], v[2]), [(3, 4), (4, 5), (5,)]),
    "matmul_add": (lambda t, v: t.matmul_add(v[0], v[1], v[2], v[3]), [(3, 4), (4, 5), (5,), (3, 5)]),
    "mlp": (lambda t, v: t.mlp(*v), [(3, 4), (4, 6), (6,), (6, 4), (4,), (3, 4)]),
    "layernorm": (lambda t, v: t.layernorm(v[0], v[1], v[2], 1e-5), [(2, 3, 8), (8,), (8,)]),
    # x feeds the layernorm and, after it, a gelu (swept first): the layernorm's rule adds
    # that gradient in its own pass (GPT-2's residual stream)
    "layernorm_residual": (lambda t, v: t.add(t.layernorm(v[0], v[1], v[2], 1e-5), t.gelu(v[0])),
                           [(3, 8), (8,), (8,)]),
    "softmax": (lambda t, v: t.softmax(v[0]), [(3, 7)]),
    "softmax_causal": (lambda t, v: t.softmax(v[0], causal=True, off=2), [(2, 4, 6)]),
    "split_merge": (lambda t, v: t.merge_heads(t.split_heads(v[0], 2)[1]), [(2, 3, 12)]),
    "split_all": (lambda t, v: t.add(t.add(*t.split_heads(v[0], 2)[:2]), t.split_heads(v[0], 2)[2]),
                  [(3, 12)]),
    "reshape": (lambda t, v: t.gelu(t.reshape(v[0], 6, 2)), [(3, 4)]),
    "attention": (lambda t, v: t.attention(v[0], v[1], v[2]), [(2, 2, 5, 4)] * 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tape_method_vs_finite_differences(name):
    build, shapes = CASES[name]
    rs = np.random.default_rng(zlib.crc32(name.encode()))   # hash(str) differs per process
    fd_check(build, [rnd(rs, *s) for s in shapes], rs)


def test_tape_embedding_vs_finite_differences():
    rs = np.random.default_rng(11)
    ids = fm.tensor(np.array([[1, 3, 1], [0, 3, 2]], np.int64))
    fd_check(lambda t, v: t.embedding(ids, v[0], v[1], pos=2),
             [rnd(rs, 5, 4), rnd(rs, 8, 4)], rs)


def test_tape_cross_entropy_vs_finite_differences():
    rs = np.random.default_rng(12)
    tg = fm.tensor(np.array([0, 4, 2, 2], np.int64))
    fd_check(lambda t, v: t.cross_entropy(v[0], tg, vocab_size=5), [rnd(rs, 4, 7)], rs)



@pytest.mark.parametrize("grad", [True, False])
def test_tape_linear_cross_entropy_vs_finite_differences(grad):
    """The LM head's loss op, gradients computed in the forward (grad) or in the backward
    (evaluation's forward), through a random cotangent; padded rows of w get no gradient."""
    rs = np.random.default_rng(13)
    tg = fm.tensor(np.array([0, 4, 2, 2, 1], np.int64))
    fd_check(lambda t, v: t.linear_cross_entropy(v[0], v[1], tg, vocab_size=5, grad=grad),
             [rnd(rs, 5, 3), rnd(rs, 7, 3)], rs)
    tape = Tape()
    x, w = tape.leaf(T(rnd(rs, 5, 3))), tape.leaf(T(rnd(rs, 7, 3)))
    g = tape.backward(tape.linear_cross_entropy(x, w, tg, vocab_size=5, grad=grad), T(np.array(2.5)))
    assert np.all(g[w.id].numpy()[5:] == 0.0) and np.any(g[w.id].numpy()[:5] != 0.0)


def test_tape_linear_cross_entropy_equals_matmul_then_cross_entropy():
    rs = np.random.default_rng(14)
    xs, ws = rnd(rs, 6, 4), rnd(rs, 9, 4)
    tg = fm.tensor(rs.integers(0, 8, 6))
    cot = T(np.array(-0.7))
    grads = []
    for fused in (True, False):
        tape = Tape()
        x, w = tape.leaf(T(xs)), tape.leaf(T(ws))
        if fused:
            loss = tape.linear_cross_entropy(x, w, tg, vocab_size=8)
        else:
            loss = tape.cross_entropy(tape.matmul(x, w, trans_b=True), tg, vocab_size=8)
        g = tape.backward(loss, cot)
        grads.append((loss.t.item(), g[x.id].numpy(), g[w.id].numpy()))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)



def test_linear_cross_entropy_from_the_default_seed():
    """backward(loss) (the seed is ones: the rule skips its scale) gives what an explicit
    seed of one gives (the rule scales by it)."""
    rs = np.random.default_rng(16)
    xs, ws, tg = rnd(rs, 5, 3), rnd(rs, 7, 3), fm.tensor(np.array([0, 4, 2, 2, 1]))
    got = []
    for seed in (None, T(np.array(1.0))):
        tape = Tape()
        x, w = tape.leaf(T(xs)), tape.leaf(T(ws))
        g = tape.backward(tape.linear_cross_entropy(x, w, tg, vocab_size=5), seed)
        got.append((g[x.id].numpy(), g[w.id].numpy()))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)

def test_linear_cross_entropy_sees_an_in_place_edit_of_w():
    rs = np.random.default_rng(15)
    tape = Tape()
    wt = T(rnd(rs, 6, 3))
    x, w = tape.leaf(T(rnd(rs, 4, 3))), tape.leaf(wt)
    loss = tape.linear_cross_entropy(x, w, fm.tensor([1, 2, 3, 4]))
    ops.assign(wt, rnd(rs, 6, 3))
    with pytest.raises(fm.TapeError, match="modified in place"):
        tape.backward(loss)

def test_tape_dropout_vs_finite_differences():
    rs = np.random.default_rng(13)
    fd_check(lambda t, v: t.dropout(t.gelu(v[0]), 0.4, seed=99), [rnd(rs, 6, 5)], rs)


# -- a two-layer GPT block on the tape against PyTorch autograd --------------------------------


def block_params(rs, C, dtype):
    def w(*s, std=0.2):
        return (rs.standard_normal(s) * std).astype(dtype)
    p = {}
    for l in range(2):
        p.update({
            f"{l}.ln1.g": 1 + w(C), f"{l}.ln1.b": w(C), f"{l}.attn.w": w(C, 3 * C),
            f"{l}.attn.b": w(3 * C), f"{l}.proj.w": w(C, C), f"{l}.proj.b": w(C),
            f"{l}.ln2.g": 1 + w(C), f"{l}.ln2.b": w(C), f"{l}.fc.w": w(C, 4 * C),
            f"{l}.fc.b": w(4 * C), f"{l}.fc2.w": w(4 * C, C), f"{l}.fc2.b": w(C),
        })
    return p


def forge_block(tape, x, P, B, Tn, C, H, fused):
    hs = C // H
    for l in range(2):
        h = tape.layernorm(x, P[f"{l}.ln1.g"], P[f"{l}.ln1.b"], 1e-5)
        qkv = tape.reshape(tape.matmul(h, P[f"{l}.attn.w"], P[f"{l}.attn.b"]), B, Tn, 3 * C)
        q, k, v = tape.split_heads(qkv, H)
        if fused:
            y = tape.attention(q, k, v)
        else:
            att = tape.softmax(tape.matmul(q, k, trans_b=True, alpha=1 / math.sqrt(hs)), causal=True)
            att = tape.dropout(att, 0.0, seed=0)
            y = tape.matmul(att, v)
        y = tape.reshape(tape.merge_heads(y), B * Tn, C)
        if fused:   # the linear layers with their GELU or residual add as one node
            x = tape.matmul_add(y, P[f"{l}.proj.w"], P[f"{l}.proj.b"], x)
            h = tape.layernorm(x, P[f"{l}.ln2.g"], P[f"{l}.ln2.b"], 1e-5)
            h = tape.matmul_gelu(h, P[f"{l}.fc.w"], P[f"{l}.fc.b"])
            x = tape.matmul_add(h, P[f"{l}.fc2.w"], P[f"{l}.fc2.b"], x)
        else:
            x = tape.add(x, tape.matmul(y, P[f"{l}.proj.w"], P[f"{l}.proj.b"]))
            h = tape.layernorm(x, P[f"{l}.ln2.g"], P[f"{l}.ln2.b"], 1e-5)
            h = tape.gelu(tape.matmul(h, P[f"{l}.fc.w"], P[f"{l}.fc.b"]))
            x = tape.add(x, tape.matmul(h, P[f"{l}.fc2.w"], P[f"{l}.fc2.b"]))
    return x


def torch_block(x, P, B, Tn, C, H):
    F = torch.nn.functional
    hs = C // H
    mask = torch.ones(Tn, Tn, dtype=torch.bool).tril()
    for l in range(2):
        h = F.layer_norm(x, (C,), P[f"{l}.ln1.g"], P[f"{l}.ln1.b"], 1e-5)
        qkv = (h @ P[f"{l}.attn.w"] + P[f"{l}.attn.b"]).view(B, Tn, 3, H, hs)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))   # (B, H, T, hs)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B * Tn, C)
        x = x + y @ P[f"{l}.proj.w"] + P[f"{l}.proj.b"]
        h = F.layer_norm(x, (C,), P[f"{l}.ln2.g"], P[f"{l}.ln2.b"], 1e-5)
        h = F.gelu(h @ P[f"{l}.fc.w"] + P[f"{l}.fc.b"], approximate="tanh")
        x = x + h @ P[f"{l}.fc2.w"] + P[f"{l}.fc2.b"]
    return x


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("fused", [False, True])
def test_two_layer_gpt_block_matches_torch(dtype, tol, fused):
    rs = np.random.default_rng(7)
    B, Tn, C, H = 2, 6, 16, 4
    params = block_params(rs, C, dtype)
    x0 = rnd(rs, B * Tn, C, dtype=dtype)
    r = rnd(rs, B * Tn, C, dtype=dtype)

    tape = Tape()
    P = {k: tape.leaf(T(v)) for k, v in params.items()}
    xv = tape.leaf(T(x0))
    out = forge_block(tape, xv, P, B, Tn, C, H, fused)
    grads = tape.backward(out, T(r))

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x0, requires_grad=True)
    tout = torch_block(tx, tp, B, Tn, C, H)
    (tout * torch.tensor(r)).sum().backward()

    def rel(a, b):
        return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)

    assert rel(out.t.numpy(), tout.detach().numpy()) < tol
    assert rel(grads[xv.id].numpy(), tx.grad.numpy()) < tol
    for k in params:
        assert rel(grads[P[k].id].numpy(), tp[k].grad.numpy()) < tol, k


# -- a TVar belongs to the tape that recorded it -----------------------------------------------


def test_a_tvar_of_another_tape_is_a_tape_error():
    """Node ids are per tape: tape 1's leaf 0 used on tape 2 would name tape 2's node 0, and
    its gradient would be credited to that leaf."""
    TapeError = fm.TapeError
    rs = np.random.default_rng(0)
    t1, t2 = Tape(), Tape()
    x1 = t1.leaf(T(rnd(rs, 2, 3)))           # id 0 on tape 1
    w2 = t2.leaf(T(rnd(rs, 2, 3)))           # id 0 on tape 2
    b2 = t2.leaf(T(rnd(rs, 2, 3)))           # id 1 on tape 2
    with pytest.raises(TapeError, match="another Tape"):
        t2.add(x1, b2)
    with pytest.raises(TapeError, match="another Tape"):
        t2.matmul(b2, x1, trans_b=True)
    y1 = t1.gelu(x1)
    with pytest.raises(TapeError, match="another Tape"):
        t2.backward(y1)
    y2 = t2.add(w2, b2)
    t2.backward(y2)
    with pytest.raises(TapeError, match="another Tape"):
        t2.grad(x1)
    assert t2.grad(w2) is not None and t2.grad(b2) is not None
    with pytest.raises(TapeError, match="expected a TVar"):
        t2.gelu(w2.t)                        # a bare Tensor is not a TVar either


def test_layernorm_takes_in_the_gradient_its_input_already_has(monkeypatch):
    """A layernorm whose input has a later use gets that use's gradient handed to its rule
    (``ops.layernorm_bwd(add=...)``), once, and the input's gradient equals the sum of the
    two uses' gradients computed apart."""
    import forge_ml.ops as fops
    rs = np.random.default_rng(3)
    x, g, b = (T(rs.standard_normal(s)) for s in ((4, 8), (8,), (8,)))
    real, seen = fops.layernorm_bwd, []

    def spy(*a, add=None, **k):
        seen.append(add is not None)
        return real(*a, add=add, **k)
    monkeypatch.setattr(fops, "layernorm_bwd", spy)
    t = Tape()
    xv, gv, bv = t.leaf(x), t.leaf(g), t.leaf(b)
    y = t.add(t.layernorm(xv, gv, bv), t.gelu(xv))
    dx = t.backward(y)[xv.id].numpy()
    assert seen == [True]
    ones = np.ones((4, 8))
    ln_dx = real(x, g, T(ones))[0].numpy()
    gelu_dx = fops.gelu_bwd(x, T(ones)).numpy()
    np.testing.assert_allclose(dx, ln_dx + gelu_dx, rtol=1e-12, atol=1e-12)


def _bias_sums_case(first_use_is_layernorm):
    """A linear layer with a residual (``matmul_add``) whose output a layernorm reads, and a
    gelu of that output recorded before the layernorm (``first_use_is_layernorm`` False) or
    after it. Returns the gradients of every leaf for a random cotangent, and the ``dy_sums``
    each ``weight_grads`` call was handed."""
    import forge_ml.ops as fops
    rs = np.random.default_rng(5)
    a, w, bias, res = (T(rs.standard_normal(s)) for s in ((6, 4), (4, 8), (8,), (6, 8)))
    g, b = T(rs.standard_normal(8)), T(rs.standard_normal(8))
    cot = T(rs.standard_normal((6, 8)))
    t = Tape()
    leaves = [t.leaf(v) for v in (a, w, bias, res, g, b)]
    av, wv, biasv, resv, gv, bv = leaves
    y = t.matmul_add(av, wv, biasv, resv)
    if first_use_is_layernorm:
        h = t.layernorm(y, gv, bv)
        out = t.add(h, t.gelu(y))
    else:
        z = t.gelu(y)
        out = t.add(t.layernorm(y, gv, bv), z)
    handed = []
    real = fops.weight_grads

    def spy(x, dy, alpha=1.0, dy_sums=None):
        handed.append(dy_sums)
        return real(x, dy, alpha, dy_sums=dy_sums)
    fops.weight_grads = spy
    try:
        grads = t.backward(out, cot)
    finally:
        fops.weight_grads = real
    return [grads[v.id].numpy() for v in leaves], handed


@pytest.mark.parametrize("first_use_is_layernorm", [True, False])
def test_a_layernorm_sums_the_bias_gradient_of_the_layer_before_it(first_use_is_layernorm):
    """The layernorm backward that writes a linear layer's whole output gradient also sums it
    over rows, and the sweep hands that sum to the layer as its bias gradient; where another
    use's gradient is added after the layernorm's (a use recorded before it), the layer sums
    its own. Every gradient equals the switch-off tape's (the layer summing dy itself) and the
    bias gradient equals the row sums of the output's whole gradient, float64 by hand."""
    from forge_ml import flags
    with flags.override(FORGE_BIAS_SUMS="on"):
        got, handed = _bias_sums_case(first_use_is_layernorm)
    with flags.override(FORGE_BIAS_SUMS="off"):
        want, handed_off = _bias_sums_case(first_use_is_layernorm)
    assert handed_off == [None]
    assert (handed[0] is not None) == first_use_is_layernorm
    for gv, wv in zip(got, want):
        np.testing.assert_allclose(gv, wv, rtol=1e-12, atol=1e-12)
    # the bias gradient is the row sums of y's gradient; y's gradient is the residual's
    np.testing.assert_allclose(got[2], got[3].sum(axis=0), rtol=1e-12, atol=1e-12)


def test_matmul_gelu_without_grad_equals_gelu_of_the_product():
    """On a tape that keeps nothing, matmul_gelu takes the inference op (no GELU input
    written) and gives the same values as gelu(matmul)."""
    rs = np.random.default_rng(7)
    x, w, b = rnd(rs, 5, 6), rnd(rs, 6, 4), rnd(rs, 4)
    t = Tape(grad=False)
    got = t.matmul_gelu(t.leaf(T(x)), t.leaf(T(w)), t.leaf(T(b))).t.numpy()
    want = ops.gelu(ops.matmul(T(x), T(w), T(b))).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [
    lambda: np.ones((2, 3), np.float32),                       # a NumPy array, not a Tensor
    lambda: fm.tensor(np.ones((2, 3), np.float64)),            # another dtype than the root's
    lambda: fm.tensor(np.ones((2, 3), np.int64)),              # an integer cotangent
])
def test_a_bad_seed_grad_is_refused_before_the_sweep(bad):
    """A seed_grad that does not match the root is a clear TapeError naming backward, and the
    tape is left unswept: the same backward with a good seed still works."""
    rs = np.random.default_rng(11)
    x = rs.standard_normal((2, 3)).astype(np.float32)
    r = rs.standard_normal((2, 3)).astype(np.float32)
    tape = Tape()
    xv = tape.leaf(fm.tensor(x))
    y = tape.gelu(xv)
    with pytest.raises(fm.TapeError, match="backward: seed_grad"):
        tape.backward(y, bad())
    g = tape.backward(y, fm.tensor(r))[xv.id].numpy()
    np.testing.assert_allclose(g, ops.gelu_bwd(fm.tensor(x), fm.tensor(r)).numpy(), rtol=0, atol=0)


def _edit_ids(t):
    ops.assign(t, np.zeros(t.shape, np.int64))


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "linear_cross_entropy_eval",
                                "embedding", "dropout_seed_at"])
def test_in_place_edit_of_targets_ids_or_a_seed_is_caught(op):
    """The integer inputs a backward reads again (targets, token ids, a SeedAt's base) are
    watched like the saved activations: rewritten between forward and backward, the backward
    is a TapeError, not a gradient of another loss."""
    rs = np.random.default_rng(12)
    tape = Tape()
    if op == "embedding":
        ids = fm.tensor(np.array([[1, 2, 3]]))
        y = tape.embedding(ids, tape.leaf(T(rnd(rs, 5, 2))), tape.leaf(T(rnd(rs, 4, 2))))
        watched = ids
    elif op == "dropout_seed_at":
        watched = fm.tensor(np.array([7], np.int64))
        y = tape.dropout(tape.leaf(T(rnd(rs, 16))), 0.5, ops.SeedAt(watched, 3))
    else:
        watched = fm.tensor(np.array([1, 2, 3, 4]))
        if op == "cross_entropy":
            y = tape.cross_entropy(tape.leaf(T(rnd(rs, 4, 5))), watched)
        else:
            y = tape.linear_cross_entropy(tape.leaf(T(rnd(rs, 4, 3))), tape.leaf(T(rnd(rs, 5, 3))),
                                          watched, grad=op == "linear_cross_entropy")
    _edit_ids(watched)
    cot = fm.tensor(np.asarray(rs.standard_normal(y.shape)))
    with pytest.raises(fm.TapeError, match="modified in place"):
        tape.backward(y, cot)


def test_embedding_with_a_device_position_and_a_missing_root_are_tape_errors():
    """The tape's embedding backward places dwpe at an int position: a tensor position is
    refused at the forward (it used to pass and fail mid-backward with a TypeError, the tape
    left swept); a Tape(grad=False) still takes one. backward(None) is a TapeError."""
    pos = fm.tensor(np.array([1], np.int32))
    ids = fm.tensor(np.array([[1, 2]]))
    tape = Tape()
    wte, wpe = tape.leaf(fm.zeros((5, 2))), tape.leaf(fm.zeros((4, 2)))
    with pytest.raises(fm.TapeError, match="int position"):
        tape.embedding(ids, wte, wpe, pos=pos)
    with pytest.raises(fm.TapeError, match="root must be a TVar"):
        tape.backward(None)
    ev = Tape(grad=False)
    y = ev.embedding(ids, ev.leaf(fm.zeros((5, 2))), ev.leaf(fm.zeros((4, 2))), pos=pos)
    assert y.shape == (1, 2, 2)


def test_tape_shape_errors_come_from_the_ops_checks():
    """The tape read shapes before the op checked them: merge_heads of a 2-D input raised an
    IndexError, attention with a head size of 0 a ZeroDivisionError, with 0-d inputs an
    IndexError. Now the ops' own ShapeErrors; no positions (T = 0) is empty both ways."""
    tape = Tape()
    with pytest.raises(fm.ShapeError, match="merge_heads"):
        tape.merge_heads(tape.leaf(fm.zeros((4, 6))))
    with pytest.raises(fm.ShapeError, match="attention"):
        tape.attention(*(tape.leaf(fm.zeros(())) for _ in range(3)))
    with pytest.raises(fm.ShapeError, match="head size of 0"):
        tape.attention(*(tape.leaf(fm.zeros((2, 3, 0))) for _ in range(3)))
    tape = Tape()
    q, k, v = (tape.leaf(fm.zeros((2, 0, 4))) for _ in range(3))
    y = tape.attention(q, k, v)
    g = tape.backward(y, fm.zeros((2, 0, 4)))
    assert y.shape == (2, 0, 4) and g[q.id].shape == g[v.id].shape == (2, 0, 4)


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
def test_embedding_of_no_ids_has_zero_gradients(shape):
    """ids of shape (2, 0) or (0, 3) passed the forward, then the backward failed on a reshape
    the user never called, the tape left swept; torch gives zero gradients."""
    tape = Tape()
    rng = np.random.default_rng(0)
    wte = tape.leaf(fm.tensor(rng.standard_normal((5, 2))))
    wpe = tape.leaf(fm.tensor(rng.standard_normal((4, 2))))
    y = tape.embedding(fm.tensor(np.zeros(shape, np.int64)), wte, wpe)
    assert y.shape == shape + (2,)
    g = tape.backward(y, fm.zeros(shape + (2,), "float64"))
    assert g[wte.id].numpy().tolist() == [[0.0, 0.0]] * 5
    assert g[wpe.id].numpy().tolist() == [[0.0, 0.0]] * 4


def test_gpt2_gradients_with_the_layernorm_bias_sums_equal_the_layers_own():
    """A GPT-2 block stack on the tape with FORGE_BIAS_SUMS on (the layernorm backwards sum
    the projections' bias gradients, the attention backward c_attn's) gives every gradient the
    switch-off tape gives, and the sums were handed to the layers (3 a layer: c_attn through
    the reshape to (B, T, 3C), attention's projection and the MLP's). Those three biases'
    gradients are the same sums taken in another order (the CPU's C kernels add rows in double
    as they write them; sum_rows is one float32 product): equal within float32's rounding of
    the sum; every other gradient is the same bits."""
    import forge_ml.ops as fops
    from forge_ml import flags
    from forge_ml.models import GPT2, GPT2Config
    cfg = GPT2Config(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT2.init(cfg, seed=1)
    rs = np.random.default_rng(2)
    ids = fm.tensor(rs.integers(0, 50, (2, 8)))
    tgt = fm.tensor(rs.integers(0, 50, (2, 8)))
    real, handed = fops.weight_grads, []

    def spy(x, dy, alpha=1.0, dy_sums=None):
        handed.append(dy_sums is not None)
        return real(x, dy, alpha, dy_sums=dy_sums)
    fops.weight_grads = spy
    try:
        with flags.override(FORGE_BIAS_SUMS="on"):
            _, on = model.loss_and_grads(ids, tgt)
        assert sum(handed) == 3 * cfg.n_layer
        handed.clear()
        with flags.override(FORGE_BIAS_SUMS="off"):
            _, off = model.loss_and_grads(ids, tgt)
        assert not any(handed)
    finally:
        fops.weight_grads = real
    for k in on:
        a, b = on[k].numpy(), off[k].numpy()
        if k.endswith(("c_attn.bias", "c_proj.bias")):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(a, b, err_msg=k)


@pytest.mark.parametrize("shape,through", [((2, 2, 6), True), ((2, 12), False)])
def test_bias_sums_pass_a_reshape_only_when_it_keeps_the_last_axis(shape, through):
    """A layer's output reshaped, then a layernorm: its backward's row sums reach the layer's
    weight_grads through a reshape that keeps the last axis (the same rows, grouped), and not
    through one that changes it (other columns: the sums would be another vector). The
    gradients equal the switch-off tape's either way."""
    import forge_ml.ops as fops
    from forge_ml import flags
    rs = np.random.default_rng(5)
    a0, w0, b0 = (rs.standard_normal(s).astype(np.float32) for s in ((4, 3), (3, 6), (6,)))
    g0, be0 = rs.standard_normal(shape[-1:]).astype(np.float32), np.zeros(shape[-1:], np.float32)
    dy0 = rs.standard_normal(shape).astype(np.float32)
    real, handed = fops.weight_grads, []

    def spy(x, dy, alpha=1.0, dy_sums=None):
        handed.append(dy_sums is not None)
        return real(x, dy, alpha, dy_sums=dy_sums)

    def grads(switch):
        with flags.override(FORGE_BIAS_SUMS=switch):
            t = Tape()
            a, w, b, g, be = (t.leaf(fm.tensor(v)) for v in (a0, w0, b0, g0, be0))
            y = t.layernorm(t.reshape(t.matmul(a, w, b), *shape), g, be)
            got = t.backward(y, fm.tensor(dy0))
            return [got[v.id].numpy() for v in (a, w, b)]
    fops.weight_grads = spy
    try:
        on = grads("on")
        assert handed == [through]
        off = grads("off")
    finally:
        fops.weight_grads = real
    for x, y in zip(on, off):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_swept_tape_refuses_to_record_where_the_op_is_called():
    """After backward, an op (or a leaf) on the tape was recorded as a node no sweep could
    reach, and only a second backward said the tape was swept; the op itself says it now.
    Reading gradients (tape.grad) still works."""
    t = Tape()
    x = t.leaf(fm.tensor([0.5, -1.0]))
    y = t.gelu(x)
    t.backward(y, fm.tensor([1.0, 2.0]))
    g = t.grad(x).numpy().copy()
    for record in (lambda: t.gelu(x), lambda: t.add(x, y), lambda: t.leaf(fm.zeros((2,)))):
        with pytest.raises(fm.TapeError, match="already swept by backward; record a new forward"):
            record()
    assert np.array_equal(t.grad(x).numpy(), g) and len(t) == 2
