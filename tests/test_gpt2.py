"""GPT-2 model tests: the KV-cache forward against the full forward, training gradients
against central finite differences (float64, through a random cotangent), fused against
composed attention, dropout regenerated in backward, padded vocabulary, config and shape
errors."""
import dataclasses

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.autograd import Tape
from forge_ml.errors import ConfigError, ShapeError
from forge_ml.models.gpt2 import GPT2, GPT2Config, param_shapes

# vocab 37 padded to 48, so the padded columns are exercised everywhere
TINY = dict(vocab_size=37, padded_vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=16)


def random_params(cfg, seed, dtype=np.float64, scale=0.3):
    """Every parameter random (biases and layer-norm gains too, so that no gradient is
    trivially zero); padded vocab rows zero, as the model keeps them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        a = rng.standard_normal(shape) * scale
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            a += 1.0
        if name in ("wte.weight", "lm_head.weight"):
            a[cfg.vocab_size:] = 0.0
        out[name] = a.astype(dtype)
    return out


def model_of(cfg, host):
    return GPT2(cfg, {k: fm.tensor(v) for k, v in host.items()})


def random_ids(cfg, shape, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape)


# -- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[12], [1] * 12, [3, 1, 5, 2, 1]], ids=["prefill", "one-by-one", "mixed"])
@pytest.mark.parametrize("tied", [True, False])
def test_kv_cache_logits_equal_full_forward(chunks, tied):
    cfg = GPT2Config(**TINY, tied_head=tied)
    model = model_of(cfg, random_params(cfg, 0, np.float32, scale=0.1))
    ids = random_ids(cfg, (2, 12), 1)
    full = model.logits(fm.tensor(ids)).numpy()                              # (2, 12, V)
    cache = model.new_cache(2, 14)
    got, t = [], 0
    for n in chunks:
        got.append(model.forward_cached(fm.tensor(ids[:, t:t + n]), cache).numpy())
        t += n
        assert cache.pos == t
    got = np.concatenate(got, axis=1)                                        # (2, 12, Vp)
    assert got.shape == (2, 12, cfg.padded_vocab_size)
    np.testing.assert_allclose(got[..., :cfg.vocab_size], full, atol=1e-5, rtol=1e-5)
    assert np.all(got[..., cfg.vocab_size:] == 0.0)  # padded rows of the head are zero


def test_kv_cache_last_only_and_single_row_ids():
    cfg = GPT2Config(**TINY)
    model = model_of(cfg, random_params(cfg, 0, np.float32, scale=0.1))
    ids = random_ids(cfg, (7,), 2)
    full = model.logits(fm.tensor(ids)).numpy()                              # (1, 7, V)
    cache = model.new_cache(1)
    last = model.forward_cached(fm.tensor(ids[:5]), cache, last_only=True).numpy()
    assert last.shape == (1, 1, cfg.padded_vocab_size)
    np.testing.assert_allclose(last[0, 0, :cfg.vocab_size], full[0, 4], atol=1e-5)
    nxt = model.forward_cached(fm.tensor(ids[5:]), cache, last_only=True).numpy()
    np.testing.assert_allclose(nxt[0, 0, :cfg.vocab_size], full[0, 6], atol=1e-5)


def test_kv_cache_overflow_and_bad_sizes():
    cfg = GPT2Config(**TINY)
    model = GPT2.init(cfg)
    cache = model.new_cache(1, 4)
    model.forward_cached(fm.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ShapeError, match="exceed"):
        model.forward_cached(fm.tensor([[1, 2]]), cache)
    with pytest.raises(ShapeError, match="max_len"):
        model.new_cache(1, cfg.block_size + 1)
    with pytest.raises(ShapeError, match="rows"):
        model.forward_cached(fm.tensor([[1], [2]]), model.new_cache(1, 4))


# -- gradients -----------------------------------------------------------------------------


def _grads_and_objective(cfg, host, ids, targets, cot_seed, **fw):
    """Gradients of J, and a function computing J at other params. Where the forward keeps its
    logits (``fused_loss=False``), J = sum(logits * R) + loss; else (the LM head and the loss
    are one op, and no logits come out) J = c * loss. R and c are random."""
    vp = cfg.padded_vocab_size
    rs = np.random.default_rng(cot_seed)
    r = rs.standard_normal((ids.size, vp))
    r[:, cfg.vocab_size:] = 0.0     # padded logits are not part of the model's output
    c = float(rs.standard_normal()) * 3.0
    keep = fw.get("fused_loss") is False

    def objective(h):
        logits, loss, _ = model_of(cfg, h).forward(Tape(), fm.tensor(ids), fm.tensor(targets), **fw)
        if not keep:
            return c * loss.t.item()
        return float((logits.t.numpy() * r).sum() + loss.t.item())

    tape = Tape()
    logits, loss, leaves = model_of(cfg, host).forward(tape, fm.tensor(ids), fm.tensor(targets), **fw)
    if keep:   # one root: J = sum(logits * R) + loss, built on the tape from its own ops
        rt = tape.leaf(fm.tensor(r))
        prod = tape.matmul(tape.reshape(logits, 1, -1), tape.reshape(rt, -1, 1))   # (1, 1)
        tape.backward(tape.add(tape.reshape(prod, ()), loss))
    else:
        assert logits is None
        tape.backward(loss, fm.tensor(np.array(c, loss.t.numpy().dtype)))
    return {k: tape.grad(v).numpy() for k, v in leaves.items()}, objective


def _check_finite_differences(cfg, host, grads, objective, n_entries=2, h=1e-6, seed=0):
    rng = np.random.default_rng(seed)
    for name, g in grads.items():
        rows = g.shape[0] if name not in ("wte.weight", "lm_head.weight") else cfg.vocab_size
        for _ in range(n_entries):
            idx = (int(rng.integers(rows)),) + tuple(int(rng.integers(s)) for s in g.shape[1:])
            plus = {k: v.copy() for k, v in host.items()}
            minus = {k: v.copy() for k, v in host.items()}
            plus[name][idx] += h
            minus[name][idx] -= h
            fd = (objective(plus) - objective(minus)) / (2 * h)
            assert abs(g[idx] - fd) <= 1e-6 * max(1.0, abs(fd)), (name, idx, g[idx], fd)


@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_training_grads_match_finite_differences(fused, fused_loss):
    cfg = GPT2Config(**TINY)
    host = random_params(cfg, 3)
    ids, targets = random_ids(cfg, (2, 6), 4), random_ids(cfg, (2, 6), 5)
    grads, objective = _grads_and_objective(cfg, host, ids, targets, 6, fused_attention=fused,
                                            fused_loss=fused_loss)
    assert set(grads) == set(host)
    _check_finite_differences(cfg, host, grads, objective)


def test_grads_untied_head_match_finite_differences():
    cfg = GPT2Config(**TINY, tied_head=False)
    host = random_params(cfg, 7)
    ids, targets = random_ids(cfg, (1, 5), 8), random_ids(cfg, (1, 5), 9)
    grads, objective = _grads_and_objective(cfg, host, ids, targets, 10)
    _check_finite_differences(cfg, host, grads, objective, n_entries=1)
    grads, objective = _grads_and_objective(cfg, host, ids, targets, 10, fused_loss=False)
    _check_finite_differences(cfg, host, grads, objective, n_entries=1)


def test_fused_attention_equals_composed():
    cfg = GPT2Config(**TINY)
    host = random_params(cfg, 11)
    ids, targets = random_ids(cfg, (2, 9), 12), random_ids(cfg, (2, 9), 13)
    ga, _ = _grads_and_objective(cfg, host, ids, targets, 14, fused_attention=True,
                                 fused_loss=False)
    gb, _ = _grads_and_objective(cfg, host, ids, targets, 14, fused_attention=False,
                                 fused_loss=False)
    model = model_of(cfg, host)
    la = model.logits(fm.tensor(ids), fused_attention=True).numpy()
    lb = model.logits(fm.tensor(ids), fused_attention=False).numpy()
    np.testing.assert_allclose(la, lb, rtol=1e-12, atol=1e-12)
    for k in ga:
        np.testing.assert_allclose(ga[k], gb[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_dropout_forward_and_backward_are_consistent():
    """With dropout on, the seed fixes every mask; the backward regenerates those masks, so
    the gradient equals the finite differences of the same-seed forward."""
    cfg = GPT2Config(**dict(TINY, dropout=0.2))
    host = random_params(cfg, 15)
    ids, targets = random_ids(cfg, (2, 6), 16), random_ids(cfg, (2, 6), 17)
    model = model_of(cfg, host)

    def logits(seed):
        return model.forward(Tape(), fm.tensor(ids), dropout_seed=seed)[0].t.numpy()

    np.testing.assert_array_equal(logits(5), logits(5))
    assert not np.allclose(logits(5), logits(6))
    no_drop = model_of(dataclasses.replace(cfg, dropout=0.0), host)
    assert not np.allclose(logits(5), no_drop.forward(Tape(), fm.tensor(ids))[0].t.numpy())

    grads, objective = _grads_and_objective(cfg, host, ids, targets, 18, dropout_seed=5)
    _check_finite_differences(cfg, host, grads, objective)


# -- padded vocabulary ---------------------------------------------------------------------


def test_padded_vocab_ignored_by_loss_and_gets_no_gradient():
    cfg = GPT2Config(**TINY)
    host = random_params(cfg, 19, np.float32)
    ids, targets = random_ids(cfg, (2, 8), 20), random_ids(cfg, (2, 8), 21)
    loss0, grads = model_of(cfg, host).loss_and_grads(fm.tensor(ids), fm.tensor(targets))
    assert np.all(grads["wte.weight"].numpy()[cfg.vocab_size:] == 0.0)
    assert np.any(grads["wte.weight"].numpy()[: cfg.vocab_size] != 0.0)
    # Large values in the padded rows make large padded logits; the loss must not see them.
    noisy = {k: v.copy() for k, v in host.items()}
    noisy["wte.weight"][cfg.vocab_size:] = 50.0
    loss1, grads1 = model_of(cfg, noisy).loss_and_grads(fm.tensor(ids), fm.tensor(targets))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert np.all(grads1["wte.weight"].numpy()[cfg.vocab_size:] == 0.0)
    # the logits the model hands out drop the padded columns
    assert model_of(cfg, noisy).logits(fm.tensor(ids)).shape == (2, 8, cfg.vocab_size)


def test_loss_matches_numpy_cross_entropy():
    cfg = GPT2Config(**TINY)
    host = random_params(cfg, 22)
    ids, targets = random_ids(cfg, (2, 5), 23), random_ids(cfg, (2, 5), 24)
    model = model_of(cfg, host)
    loss, _ = model.loss_and_grads(fm.tensor(ids), fm.tensor(targets))
    z = model.logits(fm.tensor(ids)).numpy().reshape(-1, cfg.vocab_size)
    z = z - z.max(1, keepdims=True)
    nll = np.log(np.exp(z).sum(1)) - z[np.arange(z.shape[0]), targets.reshape(-1)]
    assert loss == pytest.approx(nll.mean(), rel=1e-12)
    # evaluation: the loss op on a tape without grad, and the logits kept on a recording tape
    for tape, fused in ((Tape(grad=False), True), (Tape(), False), (Tape(), None)):
        logits, ev, _ = model.forward(tape, fm.tensor(ids), fm.tensor(targets), train=False,
                                      fused_loss=fused)
        assert (logits is None) == bool(fused)
        assert ev.t.item() == pytest.approx(nll.mean(), rel=1e-12)


# -- config and shapes ---------------------------------------------------------------------


def test_config_unknown_key_and_bad_values():
    with pytest.raises(ConfigError, match="unknown key 'n_layr'"):
        GPT2Config.from_dict({"n_layr": 2})
    with pytest.raises(ConfigError):
        GPT2Config(n_embd=10, n_head=3)
    with pytest.raises(ConfigError):
        GPT2Config(vocab_size=100, padded_vocab_size=64)
    cfg = GPT2Config.from_dict(dict(TINY))
    assert GPT2Config.from_dict(cfg.to_dict()) == cfg
    assert GPT2Config().padded_vocab_size == 50304
    # (a library QA: a string dropout was a TypeError, tied_head="no" built a tied model)
    with pytest.raises(ConfigError, match="dropout must be a number in"):
        GPT2Config(dropout="0.1")
    with pytest.raises(ConfigError, match="tied_head must be True or False, got 'no'"):
        GPT2Config(tied_head="no")
    assert GPT2Config(tied_head=np.bool_(False)).tied_head is False


def test_the_model_api_names_its_bad_arguments():
    """(a library QA) GPT2.init with a dict config or a negative or fractional seed, loss
    without targets, logits of 0-d or 3-d ids: each a ConfigError or ShapeError in one line
    (they were an AttributeError or NumPy's, deep inside); .to() to the model's own device and
    dtype shares its tensors, as its docstring now says."""
    cfg = GPT2Config.from_dict(dict(TINY))
    with pytest.raises(ConfigError, match="config must be a GPT2Config .* got dict"):
        GPT2.init(cfg.to_dict())
    for seed in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="seed must be an int >= 0"):
            GPT2.init(cfg, seed=seed)
    model = GPT2.init(cfg, seed=np.int64(3))
    with pytest.raises(ShapeError, match="GPT2.loss: targets are required"):
        model.loss(fm.tensor([[1, 2]]), None)
    for ids in (np.array(3), np.zeros((1, 2, 3), np.int64)):
        with pytest.raises(ShapeError, match=r"GPT2.logits: ids must be \(T,\) or \(B, T\)"):
            model.logits(fm.tensor(ids))
    assert model.to("cpu").params["wte.weight"] is model.params["wte.weight"]
    assert model.to(dtype="float64").params["wte.weight"] is not model.params["wte.weight"]


def test_sequence_longer_than_context_is_a_shape_error():
    cfg = GPT2Config(**TINY)
    model = GPT2.init(cfg)
    ids = fm.tensor(np.zeros((1, cfg.block_size + 1), np.int64))
    with pytest.raises(ShapeError, match=r"17 tokens.*block_size 16"):
        model.forward(Tape(), ids)
    with pytest.raises(ShapeError):
        model.logits(ids)
    with pytest.raises(ShapeError):
        model.forward_cached(ids, model.new_cache(1))


def test_one_dimensional_ids_and_targets():
    cfg = GPT2Config(**TINY)
    model = model_of(cfg, random_params(cfg, 25, np.float32, scale=0.1))
    ids, targets = random_ids(cfg, (6,), 26), random_ids(cfg, (6,), 27)
    a, _ = model.loss_and_grads(fm.tensor(ids), fm.tensor(targets))
    b, _ = model.loss_and_grads(fm.tensor(ids[None]), fm.tensor(targets[None]))
    assert a == pytest.approx(b, rel=1e-6)


# -- ids inside the vocabulary padding -------------------------------------------------------

PADDED = dict(vocab_size=211, padded_vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8)


@pytest.mark.parametrize("entry", ["forward", "forward targets", "logits", "loss_and_grads",
                                   "loss_and_grads targets", "forward_cached"])
def test_ids_in_the_vocab_padding_are_refused(entry):
    """Vocabulary 211 padded to 256: id 220 has a row in wte (zeros) but is not a token; every
    entry point refuses it, naming the id and the range, as generate does."""
    cfg = GPT2Config(**PADDED)
    model = GPT2.init(cfg, seed=0)
    good = fm.tensor(np.array([[1, 2, 210]]))
    bad = fm.tensor(np.array([[1, 220, 3]]))
    calls = {
        "forward": lambda: model.forward(Tape(), bad),
        "forward targets": lambda: model.forward(Tape(), good, bad),
        "logits": lambda: model.logits(bad),
        "loss_and_grads": lambda: model.loss_and_grads(bad, good),
        "loss_and_grads targets": lambda: model.loss_and_grads(good, bad),
        "forward_cached": lambda: model.forward_cached(bad, model.new_cache(1, 8)),
    }
    with pytest.raises(ShapeError, match=r"220.*0\.\.210"):
        calls[entry]()
    model.loss_and_grads(good, good)  # the last real id, 210, is fine


def test_kv_cache_forwards_refuse_ids_that_are_not_a_tensor_or_hold_no_tokens():
    """A list of ids was an AttributeError ('list' object has no attribute 'ndim'); no tokens
    at position 0 an internal matmul message."""
    from forge_ml.errors import DTypeError
    model = GPT2.init(GPT2Config(**TINY))
    cache = model.new_cache(1, 4)
    for call in (lambda: model.forward_cached([[1, 2]], cache),
                 lambda: model.decode_step([[1]], 0, cache),
                 lambda: model.logits([[1, 2]])):
        with pytest.raises(DTypeError, match="ids must be a forge_ml Tensor of token ids"):
            call()
    with pytest.raises(ShapeError, match="hold no tokens"):
        model.forward_cached(fm.tensor(np.zeros((1, 0), np.int64)), cache)
    assert cache.pos == 0
    model.new_cache(np.int64(1), np.int32(4))           # NumPy integers are sizes too
