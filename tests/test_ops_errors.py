"""Bad input at the op boundary: every op names what it expected and what came, as a
ShapeError, DTypeError or DeviceError, never an opaque NumPy error. Property tests draw
random invalid shapes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import forge_ml as fm
from forge_ml import ops

f32 = lambda *s: fm.tensor(np.ones(s, np.float32))  # noqa: E731
i64 = lambda *v: fm.tensor(np.array(v, np.int64))   # noqa: E731
dims = st.integers(1, 6)


@settings(max_examples=40, deadline=None)
@given(m=dims, k=dims, k2=dims, n=dims)
def test_matmul_inner_dim_mismatch(m, k, k2, n):
    if k == k2:
        k2 += 1
    with pytest.raises(fm.ShapeError, match="inner dims must agree"):
        ops.matmul(f32(m, k), f32(k2, n))


@settings(max_examples=30, deadline=None)
@given(b1=dims, b2=dims, m=dims, k=dims)
def test_matmul_batch_mismatch(b1, b2, m, k):
    if b1 == b2:
        b2 += 1
    with pytest.raises(fm.ShapeError):
        ops.matmul(f32(b1, m, k), f32(b2, k, m))


@settings(max_examples=30, deadline=None)
@given(m=dims, k=dims, n=dims, nb=dims)
def test_matmul_bias_shape(m, k, n, nb):
    if nb == n:
        nb += 1
    with pytest.raises(fm.ShapeError, match="bias"):
        ops.matmul(f32(m, k), f32(k, n), f32(nb))


def test_matmul_rank_dtype_and_b_rows():
    with pytest.raises(fm.ShapeError):
        ops.matmul(f32(3), f32(3, 2))
    with pytest.raises(fm.ShapeError):
        ops.matmul(f32(2, 3, 4), f32(4, 2))
    with pytest.raises(fm.DTypeError):
        ops.matmul(f32(2, 2), fm.tensor(np.ones((2, 2))))     # float32 x float64
    with pytest.raises(fm.DTypeError):
        ops.matmul(f32(2, 2), i64(1, 2))
    with pytest.raises(fm.ShapeError, match="b_rows"):
        ops.matmul(f32(2, 3), f32(4, 3), trans_b=True, b_rows=5)
    with pytest.raises(fm.DTypeError):
        ops.matmul(np.ones((2, 2)), f32(2, 2))


@settings(max_examples=30, deadline=None)
@given(a=st.lists(dims, min_size=1, max_size=3), b=st.lists(dims, min_size=1, max_size=3))
def test_elementwise_shape_mismatch(a, b):
    if a == b:
        b = b + [2]
    for op in (ops.add, ops.gelu_bwd, ops.softmax_bwd):
        with pytest.raises(fm.ShapeError):
            op(f32(*a), f32(*b))


@settings(max_examples=30, deadline=None)
@given(t=dims, c=dims, cg=dims)
def test_layernorm_param_shapes(t, c, cg):
    if cg == c:
        cg += 1
    with pytest.raises(fm.ShapeError, match="gamma"):
        ops.layernorm(f32(t, c), f32(cg), f32(c))
    with pytest.raises(fm.ShapeError, match="beta"):
        ops.layernorm(f32(t, c), f32(c), f32(cg))


@settings(max_examples=30, deadline=None)
@given(t=dims, c=st.integers(1, 40), h=dims)
def test_split_heads_divisibility(t, c, h):
    if c % (3 * h) == 0:
        c += 1
    with pytest.raises(fm.ShapeError, match="n_head"):
        ops.split_heads(f32(t, c), h)


def test_heads_ranks_and_which():
    with pytest.raises(fm.ShapeError):
        ops.merge_heads(f32(4, 4))
    with pytest.raises(fm.ShapeError):
        ops.unsplit_head(f32(2, 3, 4), 3)
    with pytest.raises(fm.ShapeError):
        ops.unmerge_heads(f32(3, 10), 3)


def test_attention_shapes():
    with pytest.raises(fm.ShapeError):
        ops.attention(f32(2, 4, 8), f32(2, 4, 8), f32(2, 5, 8))
    q = f32(1, 2, 4, 8)
    out, lse = ops.attention(q, q, q)
    with pytest.raises(fm.ShapeError, match="lse"):
        ops.attention_bwd(q, q, q, out, f32(1, 2, 5), out)


def test_embedding_errors():
    wte, wpe = f32(10, 4), f32(8, 4)
    with pytest.raises(fm.ShapeError, match="token id 10"):
        ops.embedding(i64(1, 10), wte, wpe)
    with pytest.raises(fm.ShapeError, match="token id -1"):
        ops.embedding(i64(-1, 2), wte, wpe)
    with pytest.raises(fm.ShapeError, match="positions"):
        ops.embedding(i64(1, 2, 3), wte, wpe, pos=6)
    with pytest.raises(fm.DTypeError, match="int32 or int64"):
        ops.embedding(f32(3), wte, wpe)
    with pytest.raises(fm.ShapeError, match="channels"):
        ops.embedding(i64(1), wte, f32(8, 5))


@settings(max_examples=30, deadline=None)
@given(tmax=dims, tn=dims, pos=st.integers(0, 8))
def test_kv_append_bounds(tmax, tn, pos):
    cache = f32(2, tmax, 3)
    if pos + tn <= tmax:
        ops.kv_append(cache, f32(2, tn, 3), pos)
    else:
        with pytest.raises(fm.ShapeError, match="do not fit"):
            ops.kv_append(cache, f32(2, tn, 3), pos)


def test_scatter_add_and_kv_errors():
    with pytest.raises(fm.ShapeError, match="src"):
        ops.scatter_add_rows(f32(5, 3), i64(1, 2), f32(2, 4))
    with pytest.raises(fm.ShapeError, match="out of range"):
        ops.scatter_add_rows(f32(5, 3), i64(1, 5), f32(2, 3))
    with pytest.raises(fm.ShapeError, match="outside the row axis"):
        ops.kv_append(f32(2, 4, 3), f32(2, 1, 4), 0)


def test_dropout_and_softmax_arguments():
    with pytest.raises(fm.ShapeError, match="p must be"):
        ops.dropout(f32(3), 1.0, 0)
    with pytest.raises(fm.ShapeError, match="seed"):
        ops.dropout(f32(3), 0.5, -1)
    with pytest.raises(fm.ShapeError, match="off"):
        ops.softmax(f32(2, 2), True, -1)


def test_cross_entropy_errors():
    with pytest.raises(fm.ShapeError, match="targets"):
        ops.cross_entropy(f32(3, 5), i64(0, 1))
    with pytest.raises(fm.ShapeError, match="out of range"):
        ops.cross_entropy(f32(2, 5), i64(0, 4), vocab_size=4)
    with pytest.raises(fm.ShapeError, match="vocab_size"):
        ops.cross_entropy(f32(2, 5), i64(0, 1), vocab_size=6)



@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_entropy_of_no_rows_is_a_shape_error(dtype):
    """An empty batch has no mean loss: each loss op says so instead of an IndexError or a
    ZeroDivisionError from inside the backend."""
    none = fm.tensor(np.zeros(0, np.int64))
    with pytest.raises(fm.ShapeError, match="no rows"):
        ops.cross_entropy(fm.zeros((0, 5), dtype), none)
    with pytest.raises(fm.ShapeError, match="no rows"):
        ops.cross_entropy_bwd(fm.zeros((0, 5), dtype), none)
    with pytest.raises(fm.ShapeError, match="no rows"):
        ops.linear_cross_entropy(fm.zeros((0, 3), dtype), fm.zeros((5, 3), dtype), none)


def test_linear_cross_entropy_and_scale_errors():
    with pytest.raises(fm.ShapeError, match=r"w must be \(vocab, 3\)"):
        ops.linear_cross_entropy(f32(2, 3), f32(5, 4), i64(0, 1))
    with pytest.raises(fm.ShapeError, match="targets must be"):
        ops.linear_cross_entropy(f32(2, 3), f32(5, 3), i64(0, 1, 2))
    with pytest.raises(fm.ShapeError, match="out of range"):
        ops.linear_cross_entropy(f32(2, 3), f32(5, 3), i64(0, 4), vocab_size=4)
    with pytest.raises(fm.ShapeError, match="vocab_size"):
        ops.linear_cross_entropy(f32(2, 3), f32(5, 3), i64(0, 1), vocab_size=6)
    with pytest.raises(fm.DTypeError, match="token ids"):
        ops.linear_cross_entropy(f32(2, 3), f32(5, 3), f32(2))
    with pytest.raises(fm.ShapeError, match="one value"):
        ops.scale(f32(2, 3), f32(2))


def test_adamw_update_many_errors():
    p, g = f32(3, 2), f32(3, 2)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8)
    with pytest.raises(fm.ShapeError, match="2 parameters but 1 gradients"):
        ops.adamw_update_many([p, p], [g], [p, p], [p, p], weight_decays=[0, 0], steps=[1, 1], **kw)
    with pytest.raises(fm.ShapeError, match="g is"):
        ops.adamw_update_many([p], [f32(2, 3)], [f32(3, 2)], [f32(3, 2)], weight_decays=[0],
                              steps=[1], **kw)
    with pytest.raises(fm.ShapeError, match="steps must be"):
        ops.adamw_update_many([p], [g], [f32(3, 2)], [f32(3, 2)], weight_decays=[0], steps=[0], **kw)
    with pytest.raises(fm.ConfigError, match="lr and steps"):
        ops.adamw_update_many([p], [g], [f32(3, 2)], [f32(3, 2)], weight_decays=[0], beta1=0.9,
                              beta2=0.99, eps=1e-8)
    with pytest.raises(fm.ShapeError, match="scalars"):   # the device values' layout is checked
        ops.adamw_update_many([p], [g], [f32(3, 2)], [f32(3, 2)], weight_decays=[0], beta1=0.9,
                              beta2=0.99, eps=1e-8, scalars=f32(3))


def test_sumsq_total_errors():
    with pytest.raises(fm.ShapeError, match="at least one"):
        ops.sumsq_total([])
    with pytest.raises(fm.DTypeError):
        ops.sumsq_total([f32(2), fm.tensor(np.array([1, 2], np.int64))])
    got = ops.sumsq_total([f32(2, 3), f32(4)])
    assert got.shape == () and got.dtype.name == "float32"

def test_adamw_errors():
    p = f32(3, 2)
    with pytest.raises(fm.ShapeError, match="m is"):
        ops.adamw_update(p, f32(3, 2), f32(2, 3), f32(3, 2), lr=1e-3, beta1=0.9, beta2=0.99,
                         eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(fm.ShapeError, match="step"):
        ops.adamw_update(p, f32(3, 2), f32(3, 2), f32(3, 2), lr=1e-3, beta1=0.9, beta2=0.99,
                         eps=1e-8, weight_decay=0.0, step=0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ops_over_an_empty_axis_match_torch(dtype):
    """An op over an axis of length 0 gives torch's result (an empty tensor of the right shape),
    not a NumPy error from a reduction; a head size of 0 is a ShapeError."""
    torch = pytest.importorskip("torch")
    z = lambda *s: fm.zeros(s, dtype)                                      # noqa: E731
    tz = lambda *s: torch.zeros(s, dtype=getattr(torch, dtype))             # noqa: E731
    assert ops.softmax(z(2, 0)).shape == tuple(torch.softmax(tz(2, 0), -1).shape)
    ln = ops.layernorm(z(2, 0), z(0), z(0))
    assert ln.shape == tuple(torch.nn.functional.layer_norm(tz(2, 0), (0,)).shape)
    assert [t.shape for t in ops.layernorm_bwd(z(2, 0), z(0), z(2, 0))] == [(2, 0), (0,), (0,)]
    assert ops.sum_rows(z(2, 0)).shape == tuple(tz(2, 0).sum(0).shape)
    out, lse = ops.attention(z(1, 0, 4), z(1, 0, 4), z(1, 0, 4))
    ref = torch.nn.functional.scaled_dot_product_attention(tz(1, 0, 4), tz(1, 0, 4), tz(1, 0, 4),
                                                           is_causal=True)
    assert out.shape == tuple(ref.shape) and lse.shape == (1, 0)
    y, lse = ops.attention_qkv(z(1, 0, 6), 1)
    assert y.shape == (1, 0, 2) and lse.shape == (1, 1, 0)
    with pytest.raises(fm.ShapeError, match="head size"):
        ops.attention(z(1, 2, 0), z(1, 2, 0), z(1, 2, 0))
    with pytest.raises(fm.ShapeError, match="head size"):
        ops.attention_qkv(z(1, 2, 0), 1)


def test_plain_python_mistakes_get_forge_errors():
    """A new user's mistakes that came out as bare TypeError, ValueError or AttributeError from
    inside the library (or NaN with no error): each is one forge_ml error naming what came."""
    from forge_ml.errors import ConfigError, TokenizerError
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.tokenizer import CharTokenizer
    p, m, v = (f32(2, 2) for _ in range(3))
    with pytest.raises(ConfigError, match="expected lr and step"):
        ops.adamw_update(p, f32(2, 2), m, v, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                         step=1)
    with pytest.raises(fm.DTypeError, match="scale: s must be a number"):
        ops.scale(f32(2), "a")
    with pytest.raises(ConfigError, match="layernorm: eps must be >= 0, got -10"):
        ops.layernorm(f32(2, 3), f32(3), f32(3), eps=-10.0)     # NaN everywhere before
    with pytest.raises(ConfigError, match="layernorm_eps must be a number >= 0"):
        GPT2Config(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4, layernorm_eps=-1.0)
    model = GPT2.init(GPT2Config(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4))
    for call in (lambda: model.loss([[1, 2]], [[2, 3]]), lambda: model.grads([[1, 2]], [[2, 3]]),
                 lambda: model.loss(fm.tensor([[1, 2]]), [[2, 3]])):
        with pytest.raises(fm.DTypeError, match="must be a forge_ml Tensor of token ids"):
            call()
    with pytest.raises(TokenizerError, match="CharTokenizer.encode: expected a str, got int"):
        CharTokenizer("abc").encode(123)
