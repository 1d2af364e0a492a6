"""AdamW, the cosine schedule and global-norm clipping against PyTorch's own."""
import math

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError
from forge_ml.optim import AdamW, clip_grad_norm, cosine_lr, grad_norm

torch = pytest.importorskip("torch")

SHAPES = {"w": (6, 5), "emb": (7, 3), "b": (5,), "gain": (3,)}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(rng):
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_adamw_matches_torch_with_decay_on_2d_only(grad_scale):
    lr, betas, eps, wd = 3e-3, (0.9, 0.95), 1e-8, 0.1
    host = _params()
    ours = {k: fm.tensor(v) for k, v in host.items()}
    theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in host.items()}
    opt = AdamW(ours, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    topt = torch.optim.AdamW(
        [{"params": [p for p in theirs.values() if p.ndim >= 2], "weight_decay": wd},
         {"params": [p for p in theirs.values() if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps)
    rng = np.random.default_rng(1)
    for step in range(6):
        g = _grads(rng)
        opt.step({k: fm.tensor(v) for k, v in g.items()}, grad_scale=grad_scale)
        for k, p in theirs.items():
            p.grad = torch.tensor(g[k] * np.float32(grad_scale))
        topt.step()
    for k in SHAPES:
        np.testing.assert_allclose(ours[k].numpy(), theirs[k].detach().numpy(), rtol=2e-6, atol=2e-7,
                                   err_msg=k)
        st = topt.state[theirs[k]]
        np.testing.assert_allclose(opt.m[k].numpy(), st["exp_avg"].numpy(), rtol=2e-6, atol=1e-8)
        np.testing.assert_allclose(opt.v[k].numpy(), st["exp_avg_sq"].numpy(), rtol=2e-6, atol=1e-10)
    assert opt.steps == 6


def test_weight_decay_spares_biases_and_gains():
    p = {"w": fm.tensor(np.ones((2, 2), np.float32)), "b": fm.tensor(np.ones(2, np.float32))}
    opt = AdamW(p, lr=0.1, weight_decay=0.5)
    zero = {"w": fm.zeros((2, 2)), "b": fm.zeros(2)}
    opt.step(zero)  # zero gradient: only decay moves a weight
    assert np.allclose(p["w"].numpy(), 1.0 - 0.1 * 0.5)
    assert np.array_equal(p["b"].numpy(), np.ones(2, np.float32))


def test_none_gradient_skips_its_parameter():
    p = {"w": fm.tensor(np.ones((2, 2), np.float32)), "b": fm.tensor(np.ones(2, np.float32))}
    opt = AdamW(p, lr=0.1)
    opt.step({"w": fm.tensor(np.ones((2, 2), np.float32)), "b": None})
    assert np.array_equal(p["b"].numpy(), np.ones(2, np.float32))
    assert not np.allclose(p["w"].numpy(), 1.0)


def test_a_gradient_under_an_unknown_name_is_refused():
    """A gradient keyed by a name the optimizer does not hold (a typo) is a ConfigError naming
    it, and nothing moves: before, it was dropped and its parameter silently not updated."""
    p = {"w": fm.tensor(np.ones((2, 2), np.float32))}
    opt = AdamW(p, lr=0.1)
    with pytest.raises(ConfigError, match="'W'"):
        opt.step({"W": fm.tensor(np.ones((2, 2), np.float32))})
    assert np.array_equal(p["w"].numpy(), np.ones((2, 2), np.float32))
    assert opt.steps == 0 and opt.param_steps == {"w": 0}
    with pytest.raises(ConfigError, match="'W'"):
        opt.update({"w": fm.zeros((2, 2)), "W": fm.zeros((2, 2))}, opt.prepare())


def test_state_dict_round_trip_continues_bit_for_bit():
    rng = np.random.default_rng(2)
    grads = [_grads(rng) for _ in range(6)]
    a = {k: fm.tensor(v) for k, v in _params().items()}
    opt_a = AdamW(a, lr=1e-2)
    for g in grads:
        opt_a.step({k: fm.tensor(v) for k, v in g.items()})
    b = {k: fm.tensor(v) for k, v in _params().items()}
    opt_b = AdamW(b, lr=1e-2)
    for g in grads[:3]:
        opt_b.step({k: fm.tensor(v) for k, v in g.items()})
    state = opt_b.state_dict()
    b2 = {k: fm.tensor(t.numpy()) for k, t in b.items()}
    opt_c = AdamW(b2, lr=1e-2)
    opt_c.load_state_dict(state)
    assert opt_c.steps == 3
    for g in grads[3:]:
        opt_c.step({k: fm.tensor(v) for k, v in g.items()})
    for k in SHAPES:
        assert np.array_equal(a[k].numpy(), b2[k].numpy())


def test_load_state_dict_rejects_mismatched_moments():
    opt = AdamW({"w": fm.zeros((2, 2))})
    state = opt.state_dict()
    state["m"] = {"w": np.zeros((3, 2), np.float32)}
    with pytest.raises(fm.ShapeError, match="m\\[w\\]"):
        opt.load_state_dict(state)
    with pytest.raises(ConfigError, match="missing"):
        opt.load_state_dict({"m": {}, "v": {}})


def test_load_state_dict_checks_everything_before_it_loads_anything():
    """A bad step count came after the moments were replaced (a bare ValueError from int(),
    the optimizer left half loaded), and None gave an AttributeError from deep inside."""
    opt = AdamW({"w": fm.tensor(np.ones((2, 2), np.float32))})
    good = opt.state_dict()
    m_before = opt.m["w"].numpy().copy()
    with pytest.raises(ConfigError, match="expected a dict from state_dict"):
        opt.load_state_dict(None)
    bad_moments = {"w": np.full((2, 2), 7.0, np.float32)}
    for bad, says in ((dict(good, m=bad_moments, step="x"), "step must be a step count"),
                      (dict(good, m=bad_moments, step=-1), "step must be a step count"),
                      (dict(good, m=bad_moments, param_steps={"w": 1.5}), "param_steps\\['w'\\]"),
                      (dict(good, m=bad_moments, param_steps=[3]), "param_steps must be a dict")):
        with pytest.raises(ConfigError, match=says):
            opt.load_state_dict(bad)
        assert np.array_equal(opt.m["w"].numpy(), m_before) and opt.steps == good["step"]
    opt.load_state_dict(dict(good, m=bad_moments, step=np.int64(4)))   # NumPy's int: a count
    assert opt.steps == 4 and opt.m["w"].numpy()[0, 0] == 7.0


def test_bad_hyper_parameters():
    with pytest.raises(ConfigError, match="betas"):
        AdamW({"w": fm.zeros((2, 2))}, betas=(0.9, 1.0))
    tied = fm.zeros((2, 2))
    with pytest.raises(ConfigError, match="same tensor"):
        AdamW({"wte": tied, "lm_head": tied})       # would be updated twice a step
    for betas in ((0.9,), (0.9, 0.95, 0.99), 0.9, ("a", 0.9)):
        with pytest.raises(ConfigError, match="betas must be two numbers"):
            AdamW({"w": fm.zeros((2, 2))}, betas=betas)
    with pytest.raises(ConfigError, match="empty"):
        AdamW({})


def test_non_finite_hyper_parameters_are_refused_not_turned_into_nan_weights():
    """A NaN or infinite lr, eps or weight decay (in the constructor, or as step()'s lr, or a
    non-finite grad_scale) is a ConfigError naming it; the weights are left as they were
    (torch.optim.AdamW refuses a NaN lr, eps or weight decay too)."""
    w = np.ones((2, 2), np.float32)
    for kw in ({"lr": math.nan}, {"lr": math.inf}, {"eps": math.nan}, {"eps": math.inf},
               {"weight_decay": math.nan}, {"weight_decay": math.inf}):
        name = next(iter(kw))
        with pytest.raises(ConfigError, match=name):
            AdamW({"w": fm.tensor(w)}, **kw)
    p = {"w": fm.tensor(w)}
    opt = AdamW(p, lr=0.1)
    g = {"w": fm.tensor(np.full((2, 2), 0.5, np.float32))}
    for kw in ({"lr": math.nan}, {"lr": math.inf}, {"lr": -0.1}, {"grad_scale": math.nan},
               {"grad_scale": math.inf}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            opt.step(g, **kw)
        with pytest.raises(ConfigError, match=next(iter(kw))):
            opt.prepare(**kw)
    assert opt.steps == 0 and opt.param_steps["w"] == 0
    np.testing.assert_array_equal(p["w"].numpy(), w)
    opt.step(g, lr=0.0)                 # lr 0 (a warmup's start) is fine
    np.testing.assert_array_equal(p["w"].numpy(), w)


def test_cosine_schedule_values():
    max_lr, min_lr, warmup, total = 1e-3, 1e-4, 10, 110
    lrs = [cosine_lr(s, max_lr, warmup, total, min_lr) for s in range(130)]
    # linear warmup: step s gives max_lr * (s + 1) / warmup
    for s in range(warmup):
        assert lrs[s] == pytest.approx(max_lr * (s + 1) / warmup, rel=1e-12)
    assert lrs[warmup - 1] == pytest.approx(max_lr)
    assert lrs[warmup] == pytest.approx(max_lr)            # the cosine starts at its top
    assert lrs[60] == pytest.approx(min_lr + 0.5 * (max_lr - min_lr))  # half way: cos(pi/2) = 0
    s = 35
    want = min_lr + 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))) * (max_lr - min_lr)
    assert lrs[s] == pytest.approx(want, rel=1e-12)
    assert all(a >= b for a, b in zip(lrs[warmup:total], lrs[warmup + 1:total + 1]))
    assert all(lr == min_lr for lr in lrs[total:])
    assert cosine_lr(0, 1.0, 0, 100, 0.1) == 1.0           # no warmup
    assert cosine_lr(5, 1.0, 10, 10, 0.1) == pytest.approx(0.6)  # warmup only: (5 + 1) / 10


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clipping_matches_torch(max_norm):
    rng = np.random.default_rng(3)
    g = _grads(rng)
    norm, scale = clip_grad_norm({k: fm.tensor(v) for k, v in g.items()}, max_norm)
    tp = [torch.nn.Parameter(torch.zeros(SHAPES[k])) for k in SHAPES]
    for p, k in zip(tp, SHAPES):
        p.grad = torch.tensor(g[k])
    tnorm = torch.nn.utils.clip_grad_norm_(tp, max_norm)
    assert norm == pytest.approx(float(tnorm), rel=1e-6)
    for p, k in zip(tp, SHAPES):
        np.testing.assert_allclose(g[k] * np.float32(scale), p.grad.numpy(), rtol=1e-6, atol=1e-8)
    if max_norm > norm:
        assert scale == 1.0


def test_clipping_of_accumulated_gradients_folds_the_average_in():
    rng = np.random.default_rng(4)
    g = {k: fm.tensor(v) for k, v in _grads(rng).items()}
    full_norm = grad_norm(g)
    norm, scale = clip_grad_norm(g, 1.0, grad_scale=0.25)   # sum of 4 micro-batches
    assert norm == pytest.approx(full_norm * 0.25, rel=1e-9)
    assert scale == pytest.approx(0.25 * min(1.0, 1.0 / (norm + 1e-6)), rel=1e-12)
    assert clip_grad_norm(g, 0.0) == (pytest.approx(full_norm), 1.0)     # 0 disables


def test_non_finite_norm_is_reported_as_nan():
    g = {"w": fm.tensor(np.array([[np.inf, 1.0]], np.float32))}
    norm, scale = clip_grad_norm(g, 1.0)
    assert math.isnan(norm) and scale == 1.0


@pytest.mark.parametrize("bad", [dict(betas=(0.9,)), dict(betas=(0.9, 1.5)), dict(eps=0.0),
                                 dict(lr=float("inf")), dict(weight_decay="x")])
def test_load_state_dict_checks_the_hyper_parameters_before_changing_anything(bad):
    """A state with one beta had loaded (and failed at the next step); now refused as the
    constructor refuses it, with the optimizer left as it was."""
    import forge_ml as fm
    opt = AdamW({"w": fm.zeros((2, 2))})
    state = opt.state_dict()
    state["m"] = {"w": np.ones((2, 2), np.float32)}
    state.update(bad)
    with pytest.raises(ConfigError, match="AdamW.load_state_dict"):
        opt.load_state_dict(state)
    assert opt.betas == (0.9, 0.95) and float(opt.m["w"].numpy().sum()) == 0.0
