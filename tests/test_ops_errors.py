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


def test_numpy_integers_are_taken_and_bools_strings_floats_refused():
    """From a new user's test: np.int64 arguments (shape arithmetic) were refused with messages
    that contradicted themselves ('vocab_size must be in 1..3, got 3'), while True passed as
    vocab_size 1 (loss 0.0), off=True, alpha='2', p='0.5' and reshape(2.5, 3) went through,
    and a string eps or scale was a bare ValueError."""
    from forge_ml.models import GPT2Config
    n = np.int64
    logits = fm.tensor(np.array([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]], np.float32))
    want = ops.cross_entropy(logits, i64(0, 0), 3).item()
    assert ops.cross_entropy(logits, i64(0, 0), n(3)).item() == want
    assert ops.attention_qkv(f32(1, 2, 6), n(1))[0].shape == (1, 2, 2)
    cache = f32(3, 2)
    ops.kv_append(cache, fm.tensor(np.full((1, 2), 7.0, np.float32)), n(1))   # in place
    assert cache.numpy()[1].tolist() == [7.0, 7.0]
    assert ops.embedding(i64(0), f32(3, 2), f32(4, 2), n(1)).shape == (1, 2)
    t = fm.Tape()
    assert t.embedding(i64(0), t.leaf(f32(3, 2)), t.leaf(f32(4, 2)), n(0)).t.shape == (1, 2)
    assert GPT2Config(vocab_size=n(10), n_embd=8, n_head=n(2)).to_dict()["n_head"] == 2
    refused = [(lambda: ops.cross_entropy(logits, i64(0, 0), True), "vocab_size must be in 1..3, got True"),
               (lambda: ops.softmax(f32(2, 3), True, True), "off must be"),
               (lambda: ops.matmul(f32(1, 1), f32(1, 1), alpha="2"), "alpha must be a number"),
               (lambda: t.dropout(t.leaf(f32(4)), "0.5", 1), "p must be a number"),
               (lambda: fm.zeros((2, 3)).reshape(2.5, 3), "sizes must be whole numbers"),
               (lambda: ops.layernorm(f32(2, 3), f32(3), f32(3), "x"), "eps must be a number"),
               (lambda: ops.attention(f32(1, 2, 2), f32(1, 2, 2), f32(1, 2, 2), "x"), "scale must be a number"),
               (lambda: ops.sumsq_total(f32(2)), "a list of tensors, got one Tensor")]
    for fn, needle in refused:
        with pytest.raises(fm.ForgeError, match=needle):
            fn()


def test_optimizer_and_model_api_mistakes_are_forge_errors():
    """accumulate dropped a name a later micro-batch lacked (and a new name was a KeyError);
    clip_grad_norm and AdamW gave AttributeErrors for lists and NumPy gradients, and took a NaN
    max_norm as no clipping; a params dict missing a name failed at the first forward; a 0-d
    float64 parameter crashed AdamW inside NumPy."""
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.optim import AdamW, accumulate, clip_grad_norm
    one = lambda: fm.tensor(np.ones(2, np.float32))  # noqa: E731
    acc = accumulate(accumulate(None, {"w": one(), "b": one()}), {"w": one(), "c": one(), "d": None})
    assert sorted(acc) == ["b", "c", "w"] and acc["w"].numpy().tolist() == [2.0, 2.0]
    assert acc["b"].numpy().tolist() == [1.0, 1.0] and acc["c"].numpy().tolist() == [1.0, 1.0]
    for fn, needle in [(lambda: clip_grad_norm([one()], 1.0), "expected a dict"),
                       (lambda: clip_grad_norm({"g": np.ones(2)}, 1.0), "is a ndarray"),
                       (lambda: clip_grad_norm({"g": one()}, float("nan")), "max_norm must be a number"),
                       (lambda: clip_grad_norm({"g": one()}, None), "max_norm must be a number"),
                       (lambda: AdamW([one()]), "params must be a dict"),
                       (lambda: GPT2(GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4), {}),
                        "do not fit the config: 16 missing")]:
        with pytest.raises(fm.ForgeError, match=needle):
            fn()
    p = fm.tensor(np.array(1.0))                       # 0-d float64
    opt = AdamW({"scale": p}, lr=0.1, weight_decay=0.0)
    opt.step({"scale": fm.tensor(np.array(1.0))})
    assert p.numpy().shape == () and p.numpy() < 1.0


def test_trainstep_refuses_float_ids_and_odd_seeds():
    """Float ids were cast and trained on in silence (model.grads refuses them), a seed of 1.5
    became 1, -1 was an OverflowError, batch=2.5 became 2 and max_norm=nan turned clipping off."""
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.optim import AdamW
    from forge_ml.step import TrainStep
    model = GPT2.init(GPT2Config(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    step = TrainStep(model, AdamW(model.params, lr=1e-2), batch=2, block=8)
    x = np.arange(16).reshape(2, 8) % 16
    for batches, seeds, needle in [([(x + 0.9, x)], [1], "ids are float64; expected integer"),
                                   ([(x, x)], [1.5], "seed 0 must be a whole number"),
                                   ([(x, x)], [-1], "seed 0 must be a whole number")]:
        with pytest.raises(fm.ForgeError, match=needle):
            step.run(batches, seeds=seeds, lr=1e-2)
    assert step.run([(x, x)], seeds=[np.int64(3)], lr=1e-2).taken
    for kw, needle in [(dict(batch=2.5, block=8), "batch must be a whole number"),
                       (dict(batch=2, block=8, max_norm=float("nan")), "max_norm must be a number")]:
        with pytest.raises(fm.ForgeError, match=needle):
            TrainStep(model, AdamW(model.params, lr=1e-2), **kw)


def test_a_big_endian_float64_array_stays_float64():
    a = np.array([0.1, 1 / 3], dtype=">f8")
    for t in (fm.tensor(a), fm.from_numpy(a)):
        assert t.dtype == fm.float64 and t.numpy().tolist() == a.tolist()
    assert fm.tensor(np.array([0.5], np.float16)).dtype == fm.float32
