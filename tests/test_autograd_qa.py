"""QA of the tape autograd: its semantics at the edges (a flag of the wrong type, an integer
root, what a swept tape keeps), every tape method against central finite differences in
float64 through a random cotangent on odd shapes (size-1 and 0-size dims, one element, the
same TVar twice), float32's kernels against float64, and the forward ops against PyTorch."""
import gc
import weakref

import numpy as np
import pytest

import forge_ml as fm
from forge_ml import Tape, ops

torch = pytest.importorskip("torch")


def T(a):
    return fm.tensor(np.asarray(a))


def rnd(rs, *shape, dtype=np.float64):
    return rs.standard_normal(shape).astype(dtype)


# -- defects mended --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["no", "False", 1, None])
def test_tape_grad_must_be_true_or_false(bad):
    """Tape(grad="no") recorded every closure (a non-empty string is true), so the memory a
    no-grad tape frees was kept; a switch takes a bool, as the ops' flags do."""
    with pytest.raises(fm.ConfigError, match="grad must be True or False"):
        Tape(grad=bad)
    assert Tape(grad=np.False_).records is False and Tape(grad=True).records is True


def test_linear_cross_entropy_grad_must_be_true_or_false():
    """grad="no" was ``"no" and True``, True: the op's own bool check never saw the string."""
    rs = np.random.default_rng(0)
    tape = Tape()
    x, w = tape.leaf(T(rnd(rs, 2, 3))), tape.leaf(T(rnd(rs, 4, 3)))
    with pytest.raises(fm.ConfigError, match="grad must be True or False"):
        tape.linear_cross_entropy(x, w, T([1, 2]), grad="no")
    loss = tape.linear_cross_entropy(x, w, T([1, 2]), grad=False)   # the tape still records
    assert tape.backward(loss)[w.id].shape == (4, 3)


@pytest.mark.parametrize("how", ["leaf", "reshape"])
def test_backward_of_an_integer_root_is_refused(how):
    """An integer value has no gradient; backward gave its leaf integer ones as one."""
    tape = Tape()
    ids = tape.leaf(T(np.array([[1, 2, 3]], np.int64)))
    root = ids if how == "leaf" else tape.reshape(ids, 3)
    with pytest.raises(fm.DTypeError, match="int64 .*expected a float value"):
        tape.backward(root)
    with pytest.raises(fm.DTypeError, match="int64"):     # a seed of its dtype as well
        tape.backward(root, fm.tensor(np.ones(root.shape, np.int64)))
    y = Tape()
    v = y.leaf(T(np.ones(3)))
    assert y.backward(y.reshape(v, 1, 3))[v.id].dtype == fm.float64   # floats go on


def test_backward_drops_what_an_unreached_branch_saved():
    """A node below the root that the root does not use (an output kept for a metric) kept its
    rule, and the activations it saved, as long as the swept tape lived; backward dropped only
    the rules above the root."""
    rs = np.random.default_rng(1)
    tape = Tape()
    x = tape.leaf(T(rnd(rs, 8, 4)))
    h = tape.gelu(x)
    side = tape.gelu(h)                       # saves h; the loss below does not use it
    loss = tape.gelu(x)
    ref = weakref.ref(h.t)
    del h, side
    g = tape.backward(loss, T(rnd(rs, 8, 4)))
    gc.collect()
    assert ref() is None
    assert g[x.id] is not None and tape.grad(x) is g[x.id]


def test_a_failed_sweep_drops_the_rules_too():
    """A sweep stopped by an error (a saved tensor edited in place) leaves a swept tape that
    can never run its rules: what the rules not yet run saved is dropped, and a retry says the
    tape is swept."""
    rs = np.random.default_rng(2)
    tape = Tape()
    cache = T(rnd(rs, 1, 3, 2))
    c, x = tape.leaf(cache), tape.leaf(T(rnd(rs, 1, 3, 2)))
    h = tape.gelu(x)
    a = tape.gelu(h)                          # saves h; swept after b
    b = tape.gelu(c)                          # saves c, edited below: the sweep stops here
    y = tape.add(a, b)
    ref = weakref.ref(h.t)
    del h, a, b
    ops.kv_append(cache, T(rnd(rs, 1, 1, 2)), 0)
    with pytest.raises(fm.TapeError, match="modified in place"):
        tape.backward(y)
    gc.collect()
    assert ref() is None
    with pytest.raises(fm.TapeError, match="already swept"):
        tape.backward(y)


# -- every tape method against finite differences on odd shapes (float64) -------------------


def fd_check(build, shapes, seed, eps=1e-6, rtol=1e-6):
    """Every coordinate's d/dinput of sum(out * r), r a random cotangent (never a plain sum);
    a leaf the output does not reach must have no gradient or a zero one of its shape."""
    rs = np.random.default_rng(seed)
    inputs = [rnd(rs, *s) for s in shapes]
    tape = Tape()
    leaves = [tape.leaf(T(a)) for a in inputs]
    out = build(tape, leaves)
    r = rnd(rs, *out.shape)
    grads = tape.backward(out, T(r))

    def f(arrs):
        t2 = Tape()
        return float((build(t2, [t2.leaf(T(a)) for a in arrs]).t.numpy() * r).sum())

    for i, a in enumerate(inputs):
        g = grads[leaves[i].id]
        g = np.zeros_like(a) if g is None else g.numpy()
        assert g.shape == a.shape and g.dtype == np.float64, (i, g.shape, g.dtype)
        for j in range(a.size):
            plus, minus = [x.copy() for x in inputs], [x.copy() for x in inputs]
            plus[i].reshape(-1)[j] += eps
            minus[i].reshape(-1)[j] -= eps
            num = (f(plus) - f(minus)) / (2 * eps)
            assert abs(num - g.reshape(-1)[j]) <= rtol * max(1.0, abs(num)), (i, j, num)


def _ln_after_layer(t, v):      # a linear layer's output read by a layernorm and a gelu
    h = t.matmul_add(v[0], v[1], v[2], v[3])
    return t.add(t.layernorm(h, v[4], v[5]), t.gelu(h))


def _ln_through_reshape(t, v):  # the bias sums passed through two reshapes
    h = t.reshape(t.reshape(t.matmul_add(v[0], v[1], v[2], v[3]), 2, 3, 4), 6, 4)
    return t.layernorm(h, v[4], v[5])


ODD = {
    "add_0d": (lambda t, v: t.add(v[0], v[1]), [(), ()]),
    "add_0size": (lambda t, v: t.add(v[0], v[1]), [(0, 3), (0, 3)]),
    "add_x_x": (lambda t, v: t.add(v[0], v[0]), [(2, 3)]),
    "gelu_0d": (lambda t, v: t.gelu(v[0]), [()]),
    "gelu_0size": (lambda t, v: t.gelu(v[0]), [(2, 0)]),
    "matmul_1x1": (lambda t, v: t.matmul(v[0], v[1], v[2]), [(1, 1), (1, 1), (1,)]),
    "matmul_k0": (lambda t, v: t.matmul(v[0], v[1], v[2]), [(3, 0), (0, 2), (2,)]),
    "matmul_m0": (lambda t, v: t.matmul(v[0], v[1], v[2]), [(0, 3), (3, 2), (2,)]),
    "matmul_x_x": (lambda t, v: t.matmul(v[0], v[0]), [(3, 3)]),
    "matmul_x_xT": (lambda t, v: t.matmul(v[0], v[0], trans_b=True, alpha=0.3), [(3, 4)]),
    "matmul_batched_bias_T": (lambda t, v: t.matmul(v[0], v[1], v[2], trans_b=True),
                              [(2, 3, 4), (2, 5, 4), (5,)]),
    "matmul_bias_alpha": (lambda t, v: t.matmul(v[0], v[1], v[2], alpha=-1.5),
                          [(3, 4), (4, 5), (5,)]),
    "matmul_add_res_is_a": (lambda t, v: t.matmul_add(v[0], v[1], v[2], v[0]),
                            [(3, 4), (4, 4), (4,)]),
    "matmul_add_k0": (lambda t, v: t.matmul_add(*v), [(3, 0), (0, 5), (5,), (3, 5)]),
    "matmul_gelu_x_x": (lambda t, v: t.matmul_gelu(v[0], v[0], v[1]), [(4, 4), (4,)]),
    "mlp_one": (lambda t, v: t.mlp(*v), [(1, 1), (1, 1), (1,), (1, 1), (1,), (1, 1)]),
    "mlp_all_same": (lambda t, v: t.mlp(v[0], v[0], v[1], v[0], v[1], v[0]), [(4, 4), (4,)]),
    "layernorm_1d": (lambda t, v: t.layernorm(v[0], v[1], v[2]), [(5,), (5,), (5,)]),
    "layernorm_C1": (lambda t, v: t.layernorm(v[0], v[1], v[2]), [(3, 1), (1,), (1,)]),
    "layernorm_rows0": (lambda t, v: t.layernorm(v[0], v[1], v[2]), [(0, 4), (4,), (4,)]),
    "layernorm_x_x_x": (lambda t, v: t.layernorm(v[0], v[0], v[0]), [(5,)]),
    "layernorm_after_layer": (_ln_after_layer, [(3, 4), (4, 5), (5,), (3, 5), (5,), (5,)]),
    "layernorm_through_reshapes": (_ln_through_reshape,
                                   [(6, 4), (4, 4), (4,), (6, 4), (4,), (4,)]),
    "softmax_1d": (lambda t, v: t.softmax(v[0]), [(5,)]),
    "softmax_one_column": (lambda t, v: t.softmax(v[0]), [(3, 1)]),
    "softmax_causal_wide": (lambda t, v: t.softmax(v[0], causal=True, off=1), [(3, 5)]),
    "softmax_causal_tall": (lambda t, v: t.softmax(v[0], causal=True), [(4, 2)]),
    "split_heads_batched": (lambda t, v: t.split_heads(v[0], 2)[2], [(2, 1, 3, 12)]),
    "merge_heads_4d": (lambda t, v: t.merge_heads(v[0]), [(2, 3, 4, 5)]),
    "reshape_to_0d": (lambda t, v: t.gelu(t.reshape(v[0])), [(1, 1)]),
    "attention_T1": (lambda t, v: t.attention(*v), [(1, 1, 1)] * 3),
    "attention_q_q_q": (lambda t, v: t.attention(v[0], v[0], v[0], scale=0.3), [(2, 4, 3)]),
    "attention_qkv_twice": (lambda t, v: t.add(t.attention_qkv(v[0], 1),
                                               t.attention_qkv(v[0], 2)), [(1, 3, 12)]),
    "attention_qkv_dropout": (lambda t, v: t.attention_qkv(v[0], 2, p=0.3, seed=5),
                              [(2, 4, 12)]),
    "dropout_0d": (lambda t, v: t.dropout(v[0], 0.5, 3), [()]),
    "cross_entropy_1x1": (lambda t, v: t.cross_entropy(v[0], T([0])), [(1, 1)]),
    "linear_cross_entropy_x_x": (lambda t, v: t.linear_cross_entropy(v[0], v[0], T([0, 1, 2])),
                                 [(3, 2)]),
    "embedding_3d_ids": (lambda t, v: t.embedding(T([[[2, 1]], [[0, 0]]]), v[0], v[1]),
                         [(4, 3), (5, 3)]),
    "embedding_one_table": (lambda t, v: t.embedding(T([[2, 1]]), v[0], v[0], pos=1),
                            [(4, 3)]),
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_shapes_vs_finite_differences(name):
    build, shapes = ODD[name]
    fd_check(build, shapes, seed=sorted(ODD).index(name))


@pytest.mark.parametrize("name", sorted(ODD))
def test_float32_kernels_agree_with_float64(name):
    """The CPU's float32 C kernels (tails, single rows, fused backwards) against the float64
    path checked above, same inputs and cotangent."""
    build, shapes = ODD[name]
    rs = np.random.default_rng(100 + sorted(ODD).index(name))
    inputs = [rnd(rs, *s) for s in shapes]
    got = []
    for dt in (np.float64, np.float32):
        tape = Tape()
        leaves = [tape.leaf(T(a.astype(dt))) for a in inputs]
        out = build(tape, leaves)
        g = tape.backward(out, T(np.random.default_rng(7).standard_normal(out.shape).astype(dt)))
        got.append([out.t.numpy()] + [None if g[v.id] is None else g[v.id].numpy()
                                      for v in leaves])
    for a, b in zip(*got):
        assert (a is None) == (b is None)
        if a is not None:
            assert b.dtype == np.float32 and a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=0, atol=5e-5 * max(1.0, np.abs(a).max(initial=0)))


def test_a_tape_without_grad_computes_the_same_forward():
    for name, (build, shapes) in ODD.items():
        rs = np.random.default_rng(3)
        inputs = [rnd(rs, *s) for s in shapes]
        outs = []
        for grad in (True, False):
            tape = Tape(grad=grad)
            outs.append(build(tape, [tape.leaf(T(a)) for a in inputs]).t.numpy())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-13, atol=1e-300, err_msg=name)


# -- the forward ops against PyTorch -----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_ops_match_torch_at_large_values(dtype):
    F = torch.nn.functional
    rs = np.random.default_rng(4)
    x = np.array([-20, -3, -1e-8, 0, 1e-8, 3, 20, 100], dtype)
    # torch's own float64 (its float32 loses 1e-5 of gelu(-3) to 1 + tanh's cancellation)
    want = F.gelu(torch.tensor(x, dtype=torch.float64), approximate="tanh").numpy()
    np.testing.assert_allclose(ops.gelu(T(x)).numpy(), want, rtol=1e-6, atol=1e-30)
    s = np.array([[1e30, 1e30, -1e30], [1000, 1001, 999], [-1e4, 0, 1e4]], dtype)
    np.testing.assert_allclose(ops.softmax(T(s)).numpy(),
                               torch.softmax(torch.tensor(s), -1).numpy(), rtol=1e-6)
    ln = (rs.standard_normal((4, 33)) * 1e3 + 1e4).astype(dtype)
    g, b = rnd(rs, 33, dtype=dtype), rnd(rs, 33, dtype=dtype)
    want = F.layer_norm(torch.tensor(ln), (33,), torch.tensor(g), torch.tensor(b)).numpy()
    np.testing.assert_allclose(ops.layernorm(T(ln), T(g), T(b)).numpy(), want, rtol=1e-4,
                               atol=1e-4)
    lg, tg = np.array([[1e4, -1e4, 0], [80, 90, 100]], dtype), np.array([1, 0])
    np.testing.assert_allclose(ops.cross_entropy(T(lg), T(tg)).numpy(),
                               F.cross_entropy(torch.tensor(lg), torch.tensor(tg)).numpy(),
                               rtol=1e-6)
    q, k, v = ((rs.standard_normal((2, 7, 5)) * 20).astype(dtype) for _ in range(3))
    want = F.scaled_dot_product_attention(*map(torch.tensor, (q, k, v)), is_causal=True)
    np.testing.assert_allclose(ops.attention(T(q), T(k), T(v))[0].numpy(), want.numpy(),
                               rtol=1e-4, atol=1e-5)


def test_integer_and_bool_operands_are_refused_by_name():
    tape = Tape()
    ints = tape.leaf(T(np.array([[1, 2]], np.int64)))
    flags = tape.leaf(T(np.array([[True, False]])))
    for op in (lambda: tape.gelu(ints), lambda: tape.add(ints, ints),
               lambda: tape.softmax(flags), lambda: tape.matmul(ints, ints)):
        with pytest.raises(fm.DTypeError, match="must be a float tensor, got int"):
            op()
    x = tape.leaf(T(np.ones((2, 3))))
    with pytest.raises(fm.DTypeError, match="targets must hold int32 or int64"):
        tape.cross_entropy(x, T([0.0, 1.0]))
