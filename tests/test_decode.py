"""The one-token decoding step: ``ops.decode_attention`` against the float64 loops of
``reference.decode_attention``, positions given as device tensors (``embedding`` too),
``GPT2.decode_step`` against ``forward_cached``, and ``DecodeStep`` (the fixed-buffer step that
the CUDA backend captures in a graph; here on the CPU, where it runs op by op)."""
import numpy as np
import pytest

import forge_ml as fm
import reference as ref
from forge_ml import ops
from forge_ml.errors import DeviceError, DTypeError, ShapeError
from forge_ml.inference.decode import DecodeStep
from forge_ml.models.gpt2 import GPT2, GPT2Config


def rel(got, want):
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def caches(rs, B, H, tmax, hs, filled, dtype=np.float32):
    """Caches whose rows below ``filled`` hold random keys/values and the rest garbage (NaN
    rows must never be read: a step at position p reads rows 0..p only)."""
    k = rs.standard_normal((B, H, tmax, hs)).astype(dtype)
    v = rs.standard_normal((B, H, tmax, hs)).astype(dtype)
    k[:, :, filled:] = np.nan
    v[:, :, filled:] = np.nan
    return k, v


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("B,H,hs,tmax,pos", [(2, 3, 8, 16, 0), (2, 3, 8, 16, 9), (1, 12, 64, 64, 63)])
def test_decode_attention_matches_reference(dtype, tol, B, H, hs, tmax, pos):
    rs = np.random.default_rng(pos * 7 + H)
    k0, v0 = caches(rs, B, H, tmax, hs, pos, dtype)
    qkv = rs.standard_normal((B, 3 * H * hs)).astype(dtype)
    scale = 0.3
    want_y, want_k, want_v = ref.decode_attention(qkv, k0, v0, pos, H, scale)
    kc, vc = fm.tensor(k0), fm.tensor(v0)
    y = ops.decode_attention(fm.tensor(qkv), kc, vc, pos, n_head=H, scale=scale)
    assert y.shape == (B, H * hs) and y.dtype == kc.dtype
    assert rel(y.numpy(), want_y) < tol
    # row pos written, rows before it untouched, rows after it still the garbage they were
    np.testing.assert_array_equal(kc.numpy()[:, :, :pos + 1], want_k[:, :, :pos + 1].astype(dtype))
    np.testing.assert_array_equal(vc.numpy()[:, :, :pos + 1], want_v[:, :, :pos + 1].astype(dtype))
    assert np.isnan(kc.numpy()[:, :, pos + 1:]).all()


def test_decode_attention_position_tensor_and_default_scale():
    rs = np.random.default_rng(1)
    k0, v0 = caches(rs, 2, 2, 10, 4, 6)
    qkv = rs.standard_normal((2, 24)).astype(np.float32)
    want_y, _, _ = ref.decode_attention(qkv, k0, v0, 6, 2, 0.5)       # 1/sqrt(4)
    y = ops.decode_attention(fm.tensor(qkv), fm.tensor(k0), fm.tensor(v0),
                             fm.tensor(np.array([6], np.int32)), n_head=2)
    assert rel(y.numpy(), want_y) < 1e-5


def test_decode_attention_copy_on_write():
    rs = np.random.default_rng(2)
    k0, v0 = caches(rs, 1, 1, 4, 2, 0)
    kc, vc = fm.tensor(k0), fm.tensor(v0)
    view = kc.reshape(4, 2)
    ops.decode_attention(fm.tensor(np.ones((1, 6), np.float32)), kc, vc, 0, n_head=1)
    assert np.isnan(view.numpy()[0]).all()           # the view keeps the old values
    assert kc.numpy()[0, 0, 0].tolist() == [1.0, 1.0]


def test_decode_attention_bad_input():
    k = fm.zeros((2, 2, 8, 4))
    qkv = fm.zeros((2, 24))
    with pytest.raises(ShapeError, match="position 8 does not fit a cache of 8 rows"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4)), 8, n_head=2)
    with pytest.raises(ShapeError, match="position -1"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4)), fm.tensor(np.array([-1], np.int32)), n_head=2)
    with pytest.raises(ShapeError, match="qkv must be"):
        ops.decode_attention(fm.zeros((2, 12)), k, fm.zeros((2, 2, 8, 4)), 0, n_head=2)
    with pytest.raises(ShapeError, match="2 heads but n_head is 4"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4)), 0, n_head=4)
    with pytest.raises(ShapeError, match="v_cache"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 7, 4)), 0, n_head=2)
    with pytest.raises(ShapeError, match=r"int32 with one element, or one per row \(2\), got int32 of shape \(3,\)"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4)), fm.tensor(np.array([1, 2, 3], np.int32)), n_head=2)
    # per-row positions: a row out of range gives NaN and writes nothing; the others go on
    y = ops.decode_attention(fm.tensor(np.ones((2, 24), np.float32)), k, fm.zeros((2, 2, 8, 4)),
                             fm.tensor(np.array([1, 9], np.int32)), n_head=2).numpy()
    assert np.isnan(y[1]).all() and np.isfinite(y[0]).all() and not k.numpy()[1].any()
    with pytest.raises(ShapeError, match="int32 with one element, or one per row \\(2\\), got int64"):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4)), fm.tensor(np.array([1])), n_head=2)
    with pytest.raises(DTypeError):
        ops.decode_attention(qkv, k, fm.zeros((2, 2, 8, 4), "float64"), 0, n_head=2)


def test_embedding_position_tensor_equals_int():
    rs = np.random.default_rng(3)
    wte = fm.tensor(rs.standard_normal((11, 5)).astype(np.float32))
    wpe = fm.tensor(rs.standard_normal((9, 5)).astype(np.float32))
    ids = fm.tensor(np.array([[3], [7]], np.int32))
    a = ops.embedding(ids, wte, wpe, 4).numpy()
    b = ops.embedding(ids, wte, wpe, fm.tensor(np.array([4], np.int32))).numpy()
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ShapeError, match="positions 9..9 do not fit"):
        ops.embedding(ids, wte, wpe, fm.tensor(np.array([9], np.int32)))


def test_assign_fills_in_place_and_checks_shape():
    t = fm.zeros((2, 1), "int32")
    ops.assign(t, np.array([[4], [5]]))
    assert t.numpy().tolist() == [[4], [5]] and t.dtype is fm.int32
    with pytest.raises(ShapeError, match=r"dst is \(2, 1\) but the values are \(2,\)"):
        ops.assign(t, [1, 2])


# -- the model's decoding step -------------------------------------------------------------

CFG = GPT2Config(vocab_size=37, padded_vocab_size=40, block_size=20, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model():
    m = GPT2.init(CFG, seed=5)
    rs = np.random.default_rng(9)   # GPT-2's init is near-uniform; make the logits differ
    for k, v in m.params.items():
        m.params[k] = fm.tensor(v.numpy() + 0.3 * rs.standard_normal(v.shape).astype(np.float32))
    return m


def test_decode_step_equals_forward_cached(model):
    rs = np.random.default_rng(4)
    ids = rs.integers(0, CFG.vocab_size, (3, 12))
    a, b = model.new_cache(3, 16), model.new_cache(3, 16)
    model.forward_cached(fm.tensor(ids[:, :5]), a)
    model.forward_cached(fm.tensor(ids[:, :5]), b)
    for t in range(5, 12):
        want = model.forward_cached(fm.tensor(ids[:, t:t + 1]), a).numpy()[:, 0]
        pos = t if t % 2 else fm.tensor(np.array([t], np.int32))      # int and tensor positions
        got = model.decode_step(fm.tensor(ids[:, t:t + 1]), pos, b).numpy()
        assert rel(got, want) < 1e-5, t
        for i in range(CFG.n_layer):
            assert rel(b.k[i].numpy()[:, :, :t + 1], a.k[i].numpy()[:, :, :t + 1]) < 1e-6
            assert rel(b.v[i].numpy()[:, :, :t + 1], a.v[i].numpy()[:, :, :t + 1]) < 1e-6


def test_decode_step_runner_on_cpu(model):
    rs = np.random.default_rng(6)
    ids = rs.integers(0, CFG.vocab_size, (2, 9))
    a, b = model.new_cache(2, 9), model.new_cache(2, 9)
    model.forward_cached(fm.tensor(ids[:, :4]), a)
    model.forward_cached(fm.tensor(ids[:, :4]), b)
    step = DecodeStep(model, b)
    assert not step.graph and not step.captured       # no graphs on the CPU
    for t in range(4, 9):
        want = model.forward_cached(fm.tensor(ids[:, t:t + 1]), a).numpy()[:, 0, :CFG.vocab_size]
        got = step(ids[:, t], t)
        assert got.shape == (2, CFG.vocab_size) and got.dtype == np.float32
        assert rel(got, want) < 1e-5 and b.pos == t + 1
    with pytest.raises(ShapeError, match="expected 2 tokens"):
        step([1, 2, 3], 5)
    with pytest.raises(ShapeError, match="token ids must be in 0..36"):
        step([1, 37], 5)
    with pytest.raises(ShapeError, match="position 9 does not fit"):
        step([1, 2], 9)


def test_decode_step_bad_ids(model):
    cache = model.new_cache(2, 8)
    with pytest.raises(ShapeError, match="ids must be \\(B, 1\\)"):
        model.decode_step(fm.tensor(np.zeros((2, 2), np.int64)), 0, cache)
    with pytest.raises(ShapeError, match="ids have 3 rows"):
        model.decode_step(fm.tensor(np.zeros((3, 1), np.int64)), 0, cache)


def test_device_position_on_another_device_is_refused():
    pytest.importorskip("cupy")
    try:
        pos = fm.tensor(np.array([0], np.int32), device="cuda")
    except DeviceError:
        pytest.skip("no CUDA GPU")
    with pytest.raises(DeviceError, match="position is on cuda:0"):
        ops.decode_attention(fm.zeros((1, 6)), fm.zeros((1, 1, 4, 2)), fm.zeros((1, 1, 4, 2)), pos, n_head=1)


@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_ln", [False, True])
def test_linear_matches_reference(act, with_residual, with_ln):
    rs = np.random.default_rng(11)
    x, w = rs.standard_normal((3, 16)), rs.standard_normal((16, 24))
    b, r = rs.standard_normal(24), rs.standard_normal((3, 24))
    g, beta = 1 + 0.1 * rs.standard_normal(16), rs.standard_normal(16)
    f = lambda a: fm.tensor(a.astype(np.float32))  # noqa: E731
    got = ops.linear(f(x), f(w), f(b), act=act, residual=f(r) if with_residual else None,
                     ln=(f(g), f(beta)) if with_ln else None, eps=1e-5)
    if with_ln:
        x = ref.layernorm(x, g, beta, 1e-5)
    want = ref.matmul(x, w, b)
    if act:
        want = ref.gelu(want)
    if with_residual:
        want = want + r
    assert rel(got.numpy(), want) < 1e-5


def test_linear_bad_input():
    x, w = fm.zeros((2, 4)), fm.zeros((4, 6))
    with pytest.raises(ShapeError, match="inner dims"):
        ops.linear(x, fm.zeros((5, 6)))
    with pytest.raises(ShapeError, match="bias must be"):
        ops.linear(x, w, fm.zeros((5,)))
    with pytest.raises(ShapeError, match="residual must be"):
        ops.linear(x, w, residual=fm.zeros((2, 5)))
    with pytest.raises(ShapeError, match="act must be"):
        ops.linear(x, w, act="relu")
    with pytest.raises(ShapeError, match="gamma must be"):
        ops.linear(x, w, ln=(fm.zeros((3,)), fm.zeros((4,))))


def test_greedy_chain_equals_step_by_step_argmax(model):
    rs = np.random.default_rng(12)
    ids = rs.integers(0, CFG.vocab_size, (2, 5))
    a, b = model.new_cache(2, 16), model.new_cache(2, 16)
    model.forward_cached(fm.tensor(ids), a)
    model.forward_cached(fm.tensor(ids), b)
    first = ids[:, -1]
    ref_step, chain_step = DecodeStep(model, a), DecodeStep(model, b)
    want, tok = [], first
    for t in range(5, 14):               # feeds at 5..13, tokens for 6..14
        tok = np.argmax(ref_step(tok, t), axis=1)
        want.append(tok)
    got = list(chain_step.greedy(first, 5, 9, lookahead=3))
    assert len(got) == 9 and all(g.dtype == np.int32 for g in got)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert b.pos == a.pos == 14
    # k steps per launch (9 = 2 x 4 + 1 x 1): the same tokens, the same rows written
    c = model.new_cache(2, 16)
    model.forward_cached(fm.tensor(ids), c)
    got = list(DecodeStep(model, c).greedy(first, 5, 9, chunk=4))
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert c.pos == 14
    np.testing.assert_array_equal(c.k[0].numpy(), a.k[0].numpy())


def test_greedy_chain_closed_early_and_bad_arguments(model):
    cache = model.new_cache(1, 10)
    model.forward_cached(fm.tensor([[1, 2, 3]]), cache)
    step = DecodeStep(model, cache)
    chain = step.greedy([4], 3, 6, lookahead=2)
    next(chain)                          # 2 queued, then a third launched before this yield
    chain.close()                        # the steps queued ahead still wrote their rows
    assert cache.pos == 3 + 3
    with pytest.raises(ShapeError, match="positions 8..10 do not fit"):
        list(step.greedy([4], 8, 3))
    with pytest.raises(ShapeError, match="n must be an int"):
        list(step.greedy([4], 3, -1))
    assert list(step.greedy([4], 3, 0)) == []
    with pytest.raises(ShapeError, match="chunk must be"):
        list(step.greedy([4], 3, 2, chunk=0))


def test_greedy_next_cpu_matches_numpy_argmax():
    from forge_ml.backends import cpu
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 9.0], [np.nan, 1.0, np.nan, 2.0, 0.0],
                       [-np.inf, -np.inf, -np.inf, -np.inf, 5.0]], np.float32)
    ids, pos = np.zeros((3, 1), np.int32), np.array([7], np.int32)
    cpu.greedy_next(logits, 4, ids, pos)          # column 4 is padding: never chosen
    assert ids[:, 0].tolist() == [1, 0, 0] == np.argmax(logits[:, :4], axis=1).tolist()
    assert pos.tolist() == [8]


def test_decode_step_refuses_an_id_in_the_vocab_padding():
    """Vocabulary 211 padded to 256: id 220 is a padding row of wte, not a token."""
    m = GPT2.init(GPT2Config(vocab_size=211, padded_vocab_size=256, block_size=8, n_layer=1,
                             n_head=2, n_embd=8), seed=0)
    cache = m.new_cache(2, 8)
    with pytest.raises(ShapeError, match=r"220.*0\.\.210"):
        m.decode_step(fm.tensor(np.array([[5], [220]])), 0, cache)
    assert m.decode_step(fm.tensor(np.array([[5], [210]])), 0, cache).shape == (2, 256)


@pytest.mark.parametrize("other", [dict(n_layer=1), dict(n_layer=3), dict(n_head=4),
                                   dict(n_embd=32, n_head=4), dict(block_size=40)])
def test_a_cache_of_another_model_is_refused(model, other):
    """A cache made for another model (fewer layers: an IndexError; more layers: silently
    the first ones; other heads or widths: a kernel's message) is refused by every entry."""
    cfg = GPT2Config(**{**CFG.to_dict(), "padded_vocab_size": 0, **other})
    cache = GPT2.init(cfg).new_cache(2, cfg.block_size)
    ids = fm.tensor(np.array([[1], [2]]))
    for call in (lambda: model.forward_cached(ids, cache),
                 lambda: model.decode_step(ids, 0, cache),
                 lambda: DecodeStep(model, cache)):
        with pytest.raises(ShapeError, match="make it with model.new_cache"):
            call()
    assert cache.pos == 0


def test_a_cache_of_another_dtype_is_refused(model):
    cache = model.to(dtype="float64").new_cache(2, 8)
    with pytest.raises(DTypeError, match="the cache is float64 but the model's parameters are float32"):
        model.forward_cached(fm.tensor([[1], [2]]), cache)
    with pytest.raises(DTypeError, match="the cache is float64"):
        DecodeStep(model, cache)


def test_decode_step_refuses_float_tokens_and_positions(model):
    """Float tokens and positions were truncated to ints (1.5 fed token 1, greedy from
    position 1.5 overwrote row 1 and left cache.pos 2.5); a string was a ValueError."""
    cache = model.new_cache(2, 8)
    model.forward_cached(fm.tensor([[1, 2], [3, 4]]), cache)
    step = DecodeStep(model, cache)
    before = cache.k[0].numpy().copy()
    with pytest.raises(DTypeError, match="token ids must be integers"):
        step([1.5, 2], 2)
    with pytest.raises(DTypeError, match="token ids must be integers"):
        step(["a", 2], 2)
    with pytest.raises(DTypeError, match="positions must be integers"):
        step.rows([1, 2], [1.5, 2])
    with pytest.raises(ShapeError, match="position True does not fit"):
        step([1, 2], True)
    with pytest.raises(ShapeError, match="pos must be an int, got 1.5"):
        list(step.greedy([1, 2], 1.5, 2))
    with pytest.raises(ShapeError, match="knobs must be \\(2, 5\\)"):
        list(step.sample([1, 2], 2, 2, [[0.8, 0, 1, 0, 1]], [[1, 2], [3, 4]]))
    with pytest.raises(ShapeError, match="keys must be \\(2, 2\\)"):
        list(step.sample([1, 2], 2, 2, [[0.8, 0, 1, 0, 1]] * 2, [[1, 2]]))
    with pytest.raises(ShapeError, match="must fit int64"):     # was an OverflowError
        step([2**70, 1], 2)
    np.testing.assert_array_equal(cache.k[0].numpy(), before)
    assert cache.pos == 2
    # NumPy integers and an integer Tensor are ids like ints
    want = step([1, 2], 2)
    np.testing.assert_array_equal(step(np.array([1, 2], np.uint8), np.int32(2)), want)
    np.testing.assert_array_equal(step(fm.tensor([1, 2]), 2), want)


def test_a_step_past_the_filled_cache_is_refused():
    """DecodeStep at a position past the cache's filled rows attended over rows that hold
    nothing and returned logits of no context, in silence (a library user's report); it is
    refused, and positions fed in order (or again, from an earlier one) still work."""
    import forge_ml as fm
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8))
    cache = model.new_cache(1, 16)
    st = DecodeStep(model, cache)
    with pytest.raises(ShapeError, match="position 3 is past the cache's 0 filled rows"):
        st([5], 3)
    with pytest.raises(ShapeError, match="past the cache's 0 filled rows"):
        list(st.greedy([5], 2, 3))
    model.forward_cached(fm.tensor(np.array([[1, 2, 3]])), cache)
    assert cache.pos == 3
    st([4], 3)
    st([4], 3)                 # the same position again: its rows rewritten
    assert len(list(st.greedy([4], 4, 3))) == 3 and cache.pos == 7


@pytest.mark.parametrize("row,name", [([-1.0, 0, 1, 0, 1], "temperature"), ([float("nan"), 0, 1, 0, 1], "temperature"),
                                      ([1.0, 2.5, 1, 0, 1], "top_k"), ([1.0, 0, -0.1, 0, 1], "top_p"),
                                      ([1.0, 0, 1, -1, 1], "min_p"), ([1.0, 0, 1, 0, 0], "repetition_penalty")])
def test_decode_step_knobs_are_checked_on_the_host(row, name):
    """The knobs go to the device, where nothing checks them: a negative or NaN temperature was
    taken as greedy, a top_p below 0 as no cut (a library user's report)."""
    import forge_ml as fm
    from forge_ml.errors import ConfigError
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8))
    st = DecodeStep(model, model.new_cache(1, 16))
    with pytest.raises(ConfigError, match=f"knobs row 0 has {name}"):
        st.choose(fm.tensor(np.zeros((1, 16), np.float32)), 1, [row], [[1, 2]])
