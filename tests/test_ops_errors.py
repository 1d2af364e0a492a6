"""Bad input at the op boundary: every op names what it expected and what came, as a
ShapeError, DTypeError or DeviceError, never an opaque NumPy error. Property tests draw
random invalid shapes."""
import re

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


def _elsewhere(arr):
    """A tensor that says it lives on cuda:0 (its memory is NumPy's): the ops' device checks
    come before any read, so a CPU-only run can test them."""
    from forge_ml.device import Device
    from forge_ml.tensor import Tensor
    return Tensor(np.asarray(arr), Device("cuda", 0))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_qkv_dropout_over_no_tokens_is_empty_as_without_dropout(dtype):
    """T = 0 with dropout was a NumPy 'zero-size array to reduction' ValueError (forward,
    backward and GPT-2's forward), where attention_qkv returns empty outputs."""
    from forge_ml.models import GPT2, GPT2Config
    qkv = fm.zeros((2, 0, 6), dtype)
    y, lse = ops.attention_qkv_dropout(qkv, 1, 0.1, 1)
    y0, lse0 = ops.attention_qkv(qkv, 1)
    assert (y.shape, y.dtype, lse.shape, lse.dtype) == (y0.shape, y0.dtype, lse0.shape, lse0.dtype)
    dqkv = ops.attention_qkv_dropout_bwd(qkv, y, lse, fm.zeros((2, 0, 2), dtype), 1, 0.1, 1)
    assert dqkv.shape == (2, 0, 6) and dqkv.dtype == qkv.dtype
    with pytest.raises(fm.ShapeError, match="p must be"):        # still checked at T = 0
        ops.attention_qkv_dropout(qkv, 1, 1.5, 1)
    t = fm.Tape()
    q = t.leaf(qkv)
    out = t.attention_qkv(q, n_head=1, p=0.1, seed=3)
    assert out.shape == (2, 0, 2) and t.backward(out, fm.zeros((2, 0, 2), dtype))[q.id].shape == (2, 0, 6)
    m = GPT2.init(GPT2Config(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    assert m.forward(fm.Tape(), fm.zeros((2, 0), "int64"))[0].shape == (0, 11)
    y, lse = ops.attention_qkv_dropout(fm.tensor(np.ones((1, 3, 6), dtype)), 1, 0.5, 7)   # T > 0
    assert y.shape == (1, 3, 2) and lse.dtype.name == ("float64" if dtype == "float64" else "float32")


def test_attention_backwards_check_lse_dtype_type_and_device():
    """lse was checked for its shape only: an int64 lse was taken, a NumPy array was an
    AttributeError ('memoryview' object has no attribute 'dtype'), the device was unchecked."""
    o = f32(1, 2, 3)
    with pytest.raises(fm.DTypeError, match="attention_bwd: lse must be float32 .*got int64"):
        ops.attention_bwd(o, o, o, o, fm.tensor([[1, 1]]), o)
    with pytest.raises(fm.DTypeError, match="attention_bwd: lse must be float32 .*got float64"):
        ops.attention_bwd(o, o, o, o, fm.tensor(np.ones((1, 2))), o)
    with pytest.raises(fm.DTypeError, match="attention_bwd: lse must be a forge_ml Tensor, got ndarray"):
        ops.attention_bwd(o, o, o, o, np.ones((1, 2)), o)
    with pytest.raises(fm.DeviceError, match="attention_bwd: q is on cpu but lse is on cuda:0"):
        ops.attention_bwd(o, o, o, o, _elsewhere(np.ones((1, 2), np.float32)), o)
    with pytest.raises(fm.ShapeError, match="lse must be"):
        ops.attention_bwd(o, o, o, o, f32(1, 3), o)
    out, lse = ops.attention(o, o, o)
    assert ops.attention_bwd(o, o, o, out, lse, o)[0].shape == (1, 2, 3)
    q64 = fm.tensor(np.ones((1, 2, 3)))
    out64, lse64 = ops.attention(q64, q64, q64)
    assert lse64.dtype == fm.float64 and ops.attention_bwd(q64, q64, q64, out64, lse64, q64)[0].shape == (1, 2, 3)

    qkv = fm.tensor(np.random.default_rng(0).standard_normal((1, 3, 6)).astype(np.float32))
    y, lse = ops.attention_qkv(qkv, 1)
    dy = f32(1, 3, 2)
    calls = {"attention_qkv_bwd": lambda l: ops.attention_qkv_bwd(qkv, y, l, dy, 1),
             "attention_qkv_bwd_sums": lambda l: ops.attention_qkv_bwd(qkv, y, l, dy, 1, sums=True),
             "attention_qkv_dropout_bwd": lambda l: ops.attention_qkv_dropout_bwd(qkv, y, l, dy, 1, 0.5, 7)}
    for name, call in calls.items():
        op = name.replace("_sums", "")
        with pytest.raises(fm.DTypeError, match=f"{op}: lse must be float32 .*got int64"):
            call(fm.tensor(np.ones((1, 1, 3), np.int64)))
        with pytest.raises(fm.DTypeError, match=f"{op}: lse must be a forge_ml Tensor, got ndarray"):
            call(np.ones((1, 1, 3), np.float32))
        with pytest.raises(fm.DeviceError, match=f"{op}: qkv is on cpu but lse is on cuda:0"):
            call(_elsewhere(np.ones((1, 1, 3), np.float32)))
        got = call(lse)                                           # the forward's lse still works
        assert (got[0] if isinstance(got, tuple) else got).shape == (1, 3, 6)


def test_unsplit_head_refuses_a_bool_and_takes_a_numpy_int():
    """True passed `which in (0, 1, 2)` (True == 1) and became a NumPy broadcast ValueError."""
    with pytest.raises(fm.ShapeError, match="unsplit_head: which must be 0, 1 or 2, got True"):
        ops.unsplit_head(f32(1, 2, 2), True)
    with pytest.raises(fm.ShapeError, match="which must be 0, 1 or 2, got 1.0"):
        ops.unsplit_head(f32(1, 2, 2), 1.0)
    assert ops.unsplit_head(f32(1, 2, 2), np.int64(1)).numpy().tolist() == \
        ops.unsplit_head(f32(1, 2, 2), 1).numpy().tolist()


def test_linear_ln_must_be_a_pair():
    """ln=(gamma,) was a bare 'not enough values to unpack' ValueError."""
    x, w = f32(2, 2), f32(2, 3)
    with pytest.raises(fm.ShapeError, match=r"linear: ln must be None or \(gamma, beta\), got a tuple of 1"):
        ops.linear(x, w, ln=(f32(2),))
    with pytest.raises(fm.ShapeError, match=r"linear: ln must be None or \(gamma, beta\), got Tensor"):
        ops.linear(x, w, ln=f32(2))
    with pytest.raises(fm.DTypeError, match="linear: gamma must be a forge_ml Tensor"):
        ops.linear(x, w, ln=(np.ones(2, np.float32), f32(2)))
    with pytest.raises(fm.DTypeError, match="linear: beta must be a forge_ml Tensor"):
        ops.linear(x, w, ln=(f32(2), None))          # (an AttributeError: a review's find)
    assert ops.linear(x, w, ln=(f32(2), fm.zeros((2,)))).shape == (2, 3)
    assert ops.linear(x, w, ln=[f32(2), fm.zeros((2,))]).shape == (2, 3)


def test_take_columns_of_a_0d_tensor_is_a_shape_error():
    """A 0-d x was an IndexError (tuple index out of range)."""
    with pytest.raises(fm.ShapeError, match=r"take_columns: x must have rank >= 1, got shape \(\)"):
        ops.take_columns(fm.tensor(1.0), 1)
    assert ops.take_columns(f32(4), 2).shape == (2,)


def test_cross_entropy_bwd_dloss_is_checked_as_scale_s():
    """dloss=None was a TypeError from float(), and dloss="1" was taken as 1.0 where
    scale(x, "2") is a DTypeError."""
    logits, t = f32(2, 3), i64(0, 0)
    for bad, shown in ((None, "NoneType None"), ("1", "str '1'"), ([1.0], "list")):
        with pytest.raises(fm.DTypeError,
                           match=f"cross_entropy_bwd: dloss must be a number or a one-element Tensor, got {shown}"):
            ops.cross_entropy_bwd(logits, t, bad)
    with pytest.raises(fm.DTypeError, match="scale: s must be a number or a one-element Tensor, got str '2'"):
        ops.scale(f32(2), "2")
    want = ops.cross_entropy_bwd(logits, t, 2.0).numpy()
    for ok in (2, np.float32(2.0), fm.tensor(2.0), fm.tensor([2.0])):
        assert np.allclose(ops.cross_entropy_bwd(logits, t, ok).numpy(), want)
    assert ops.scale(f32(2), np.float64(3.0)).numpy().tolist() == [3.0, 3.0]


def test_adamw_hyperparameters_must_be_numbers():
    """lr="a" was a bare ValueError from float(); "0.1" was taken as 0.1."""
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    for name, bad in (("lr", "a"), ("lr", "0.1"), ("beta1", None), ("weight_decay", "0"),
                      ("grad_scale", "1")):
        with pytest.raises(fm.ConfigError, match=f"adamw_update: {name} must be a number"):
            ops.adamw_update(f32(2), f32(2), fm.zeros((2,)), fm.zeros((2,)), **{**kw, name: bad})
    mkw = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, steps=[1])
    with pytest.raises(fm.ConfigError, match="adamw_update_many: lr must be a number"):
        ops.adamw_update_many([f32(2)], [f32(2)], [fm.zeros((2,))], [fm.zeros((2,))],
                              weight_decays=[0.0], **{**mkw, "lr": "a"})
    with pytest.raises(fm.ConfigError, match=r"adamw_update_many: weight_decays\[0\] must be a number"):
        ops.adamw_update_many([f32(2)], [f32(2)], [fm.zeros((2,))], [fm.zeros((2,))],
                              weight_decays=["x"], **mkw)
    p = f32(2)
    ops.adamw_update(p, f32(2), fm.zeros((2,)), fm.zeros((2,)), **{**kw, "lr": np.float32(0.5)})
    assert np.allclose(p.numpy(), 0.5)


def test_layernorm_bwd_refuses_a_negative_eps_as_the_forward():
    """The backward gave NaN silently for eps = -1 where the forward refuses it."""
    x, g, dy = fm.tensor(np.array([[1.0, 2.0, 4.0]], np.float32)), f32(3), f32(1, 3)
    for kw in ({}, {"sums": True}, {"add": f32(1, 3)}):
        with pytest.raises(fm.ConfigError, match="layernorm_bwd: eps must be >= 0, got -1.0"):
            ops.layernorm_bwd(x, g, dy, eps=-1.0, **kw)
    with pytest.raises(fm.ConfigError, match="layernorm: eps must be >= 0, got -1.0"):
        ops.layernorm(x, g, f32(3), eps=-1.0)
    with pytest.raises(fm.ConfigError, match="linear: eps must be >= 0, got -1.0"):
        ops.linear(x, f32(3, 2), ln=(g, f32(3)), eps=-1.0)
    assert all(np.isfinite(t.numpy()).all() for t in ops.layernorm_bwd(x, g, dy, eps=0.0))


def test_linear_refuses_an_integer_bias_as_matmul():
    """An int64 bias went through linear where matmul refuses it with a DTypeError."""
    x, w = f32(2, 2), f32(2, 3)
    with pytest.raises(fm.DTypeError, match="matmul: bias must be a float tensor, got int64"):
        ops.matmul(x, w, fm.tensor([1, 2, 3]))
    with pytest.raises(fm.DTypeError, match="linear: bias must be a float tensor, got int64"):
        ops.linear(x, w, fm.tensor([1, 2, 3]))
    with pytest.raises(fm.DTypeError, match="linear: residual must be a float tensor, got int64"):
        ops.linear(x, w, residual=fm.tensor(np.ones((2, 3), np.int64)))
    assert ops.linear(x, w, fm.tensor([1.0, 2.0, 3.0])).numpy()[0].tolist() == [3.0, 4.0, 5.0]


def test_a_scalar_tensor_on_another_device_is_a_device_error():
    """dloss and s on another device raised ShapeError ('must be one value on cpu'); the
    device is what is wrong. A tensor of several values stays a ShapeError."""
    one = _elsewhere(np.array(2.0, np.float32))
    with pytest.raises(fm.DeviceError, match=r"cross_entropy_bwd: dloss must be one value on cpu, got \(\) on cuda:0"):
        ops.cross_entropy_bwd(f32(2, 3), i64(0, 0), one)
    with pytest.raises(fm.DeviceError, match=r"scale: s must be one value on cpu, got \(\) on cuda:0"):
        ops.scale(f32(2), one)
    with pytest.raises(fm.ShapeError, match="scale: s must be one value on cpu"):
        ops.scale(f32(2), f32(2))
    with pytest.raises(fm.ShapeError, match="cross_entropy_bwd: dloss must be one value on cpu"):
        ops.cross_entropy_bwd(f32(2, 3), i64(0, 0), f32(2))


def test_clip_grad_norm_refuses_integer_gradients_as_sumsq():
    """Integer gradients were summed by clip_grad_norm where ops.sumsq refuses ints."""
    from forge_ml.optim import clip_grad_norm
    with pytest.raises(fm.DTypeError, match="sumsq: x must be a float tensor"):
        ops.sumsq(fm.tensor([1, 2]))
    with pytest.raises(fm.DTypeError, match="clip_grad_norm: gradient 'g' must be a float tensor, got int64"):
        clip_grad_norm({"f": f32(2), "g": fm.tensor([1, 2])}, 1.0)
    norm, scale = clip_grad_norm({"f": fm.tensor(np.array([3.0, 4.0], np.float32)), "n": None}, 1.0)
    assert norm == 5.0 and abs(scale - 0.2) < 1e-6


def test_qa_core_api_bad_inputs_get_the_libraries_errors():
    """(QA of the core API, session 31) each of these escaped as NumPy's or Python's own error
    from inside the library, or named the wrong cause; now a ForgeError saying what came."""
    from forge_ml.errors import ConfigError, DTypeError, ShapeError
    z = fm.zeros
    cases = [
        (lambda: ops.sample_next(z((1, 3)), 3, z((1, 1), "int32"), z((1,), "int32"),
                                 np.zeros((1, 5), np.float32), z((1, 2), "int32")),
         DTypeError, "knobs must be a forge_ml Tensor, got ndarray"),
        (lambda: ops.softmax_bwd(fm.tensor(1.0), fm.tensor(1.0)), ShapeError, "rank >= 1"),
        (lambda: ops.decode_attention(z((1, 0)), z((1, 2, 4, 0)), z((1, 2, 4, 0)), 0, 2),
         ShapeError, "head size of 0"),
        (lambda: ops.linear(z((2, 0)), z((0, 4)), ln=(z((0,)), z((0,)))), ShapeError, "0 channels"),
        (lambda: ops.embedding(fm.tensor([[1]]), z((5, 4)), z((6, 4)), pos=1.0), ShapeError,
         "pos must be an int, got float 1.0"),
        (lambda: ops.kv_append(z((3, 2)), z((1, 2)), 1.0), ShapeError, "pos must be an int"),
        (lambda: ops.decode_attention(z((1, 6)), z((1, 2, 4, 1)), z((1, 2, 4, 1)), 0, "2"),
         ShapeError, "n_head must be an int, got str '2'"),
        (lambda: ops.attention_qkv(z((1, 3, 12)), "2"), ShapeError, "n_head must be an int"),
        (lambda: ops.cross_entropy(z((2, 0)), fm.tensor([0, 0])), ShapeError, "has no columns"),
        (lambda: ops.clip_scale(fm.tensor(np.array(4.0, np.float32)), z((6,), "float64"), None),
         ConfigError, "max_norm must be a number, got None"),
        (lambda: ops.greedy_next(z((1, 3)), 3, z((1, 1), "int32"), z((1,), "int32"),
                                 out=z((2, 1), "int32"), row=1.0), ShapeError, "row must be an int"),
        (lambda: ops.assign(z((1,)), ["a"]), DTypeError, "expected numbers of one shape"),
        (lambda: ops.assign(z((2,)), [[1.0], [2.0, 3.0]]), DTypeError, "expected numbers of one shape"),
        (lambda: fm.full((2,), "a"), DTypeError, "value must be a number, got str 'a'"),
        (lambda: fm.tensor([fm.tensor(1.0), fm.tensor(2.0)]), DTypeError, "expected numbers of one shape"),
        (lambda: ops.adamw_update_many([z((2,))], [z((2,))], [z((2,))], [z((2,))], lr=0.1, beta1=0.9,
                                       beta2=0.95, eps=1e-8, weight_decays=0.1, steps=[1]),
         ConfigError, "weight_decays must be a list"),
    ]
    for f, err, said in cases:
        with pytest.raises(err, match=re.escape(said)):
            f()
    # Tensor(data, "cpu") (a device as a string) works as Tensor(data, Device) does
    assert ops.gelu(fm.Tensor(np.zeros(2, np.float32), "cpu")).numpy().tolist() == [0.0, 0.0]


def test_zero_width_gradients_are_empty_not_numpys_reshape_error():
    """An (M, 0) gradient (a linear layer of 0 outputs, an MLP of hidden size 0) went through
    ``reshape(-1, 0)``, which NumPy cannot infer: "cannot reshape array of size 0 into shape
    (0)" from weight_grads, matmul_dgelu, scatter_add_rows and the tape. They are empty."""
    dw, db = fm.ops.weight_grads(fm.zeros((3, 4)), fm.zeros((3, 0)))
    assert dw.shape == (4, 0) and db.shape == (0,)
    dpre, dbf = fm.ops.matmul_dgelu(fm.zeros((3, 5)), fm.zeros((0, 5)), fm.zeros((3, 0)))
    assert dpre.shape == (3, 0) and dbf.shape == (0,)
    dst = fm.zeros((3, 0))
    fm.ops.scatter_add_rows(dst, fm.tensor([1, 2]), fm.zeros((2, 0)))   # (in place)
    assert dst.shape == (3, 0)
    t = fm.Tape()
    x = t.leaf(fm.tensor(np.ones((3, 4), np.float32)))
    w, b = t.leaf(fm.zeros((4, 0))), t.leaf(fm.zeros((0,)))
    g = t.backward(t.matmul(x, w, b), fm.zeros((3, 0)))
    assert g[x.id].numpy().tolist() == [[0.0] * 4] * 3 and g[w.id].shape == (4, 0)


def test_layernorm_names_a_missing_beta():
    """layernorm(x, gamma, None) raised AttributeError ('NoneType' has no attribute 'data')."""
    with pytest.raises(fm.DTypeError, match="layernorm: beta must be a forge_ml Tensor, got None"):
        fm.ops.layernorm(fm.zeros((2, 4)), fm.ones_like(fm.zeros((4,))), None)


def test_dropout_p_that_rounds_to_one_in_float32_is_refused():
    """The kernels take p as float32: p within 6e-8 of 1 passed the p < 1 check and became 1
    there, every element dropped (the output all 0) with the scale 1 / (1 - p) about 1e11."""
    x = fm.tensor(np.ones((4, 4), np.float32))
    p = float(np.nextafter(1.0, 0.0))                        # < 1 in double, 1 in float32
    with pytest.raises(fm.ShapeError, match="p must be in \\[0, 1\\) as a float32"):
        fm.ops.dropout(x, p, 0)
    assert fm.ops.dropout(x, 0.5, 0).shape == (4, 4)


def test_configs_refuse_a_dropout_that_is_one_in_float32():
    """TrainConfig and GPT2Config took dropout=0.99999999 (1 in float32, the kernels' type):
    the run prepared its data and took its folder's lock before the first step's dropout op
    refused it (a review's finding). Both configs refuse it now."""
    from forge_ml.models import GPT2Config
    from forge_ml.train import TrainConfig
    says = "dropout must be a number in \\[0, 1\\) \\(as a float32\\)"
    with pytest.raises(fm.ConfigError, match=says):
        GPT2Config(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4, dropout=0.99999999)
    with pytest.raises(fm.ConfigError, match="dropout must be in \\[0, 1\\) \\(as a float32\\)"):
        TrainConfig(dropout=0.99999999)
    assert TrainConfig(dropout=0.5).dropout == 0.5
