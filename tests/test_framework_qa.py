"""QA of forge-ml as a framework for a model of one's own: tensors, the tape, AdamW and its
schedule and clipping against torch, and the GPT2 / GPT2Config API used from Python."""
import json

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError, ShapeError, TapeError
from forge_ml.models.gpt2 import GPT2, GPT2Config, config_params, param_shapes
from forge_ml.optim import AdamW, clip_grad_norm, cosine_lr, grad_norm

torch = pytest.importorskip("torch")

@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # tiny tensors: torch's pool of 2 threads cost ~16 ms a backward on a shared 2-core host
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])   # its first one imports dynamo: ~3 s
    yield
    torch.set_num_threads(old)


TINY = dict(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)


def _mlp_init(rs):
    return {"w1": (rs.randn(3, 16) * 0.5).astype(np.float32),
            "b1": np.full(16, 0.1, np.float32),
            "w2": (rs.randn(16, 1) * 0.5).astype(np.float32),
            "b2": np.zeros(1, np.float32)}


def test_a_hand_written_mlp_trains_as_torch_step_for_step():
    """A two-layer GELU MLP on a toy regression, written on the tape, trained with AdamW
    (decay on the 2-D weights), the warmup + cosine rate and global-norm clipping: each step's
    loss, norm and weights equal torch's AdamW with the same groups within float32 rounding,
    and the loss falls to a small fraction of where it starts."""
    rs = np.random.RandomState(0)
    x = rs.randn(64, 3).astype(np.float32)
    y = np.sin(x).sum(1, keepdims=True).astype(np.float32)
    init = _mlp_init(rs)
    params = {k: fm.tensor(v) for k, v in init.items()}
    opt = AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    topt = torch.optim.AdamW([{"params": [ref["w1"], ref["w2"]], "weight_decay": 0.1},
                              {"params": [ref["b1"], ref["b2"]], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    xt, steps, losses = fm.tensor(x), 100, []
    for step in range(steps):
        tape = fm.Tape()
        leaves = {k: tape.leaf(v) for k, v in params.items()}
        h = tape.gelu(tape.matmul(tape.leaf(xt), leaves["w1"], leaves["b1"]))
        out = tape.matmul(h, leaves["w2"], leaves["b2"])
        diff = out.t.numpy() - y
        losses.append(float((diff ** 2).mean()))
        tape.backward(out, fm.tensor((2 * diff / diff.size).astype(np.float32)))
        grads = {k: tape.grad(v) for k, v in leaves.items()}
        lr = cosine_lr(step, 1e-2, 10, steps, 1e-3)
        norm, scale = clip_grad_norm(grads, 0.5)
        opt.step(grads, lr=lr, grad_scale=scale)

        for g in topt.param_groups:
            g["lr"] = lr
        topt.zero_grad()
        th = torch.nn.functional.gelu(torch.tensor(x) @ ref["w1"] + ref["b1"], approximate="tanh")
        tloss = ((th @ ref["w2"] + ref["b2"] - torch.tensor(y)) ** 2).mean()
        tloss.backward()
        tnorm = torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
        topt.step()
        assert losses[-1] == pytest.approx(tloss.item(), rel=1e-5, abs=1e-7)
        assert norm == pytest.approx(tnorm.item(), rel=1e-4)
        gap = max(float(np.abs(params[k].numpy() - ref[k].detach().numpy()).max()) for k in ref)
        assert gap < 2e-6, (step, gap)
    assert losses[-1] < 0.05 * losses[0], losses[::10]
    assert opt.steps == steps and set(opt.param_steps.values()) == {steps}


def test_load_state_dict_refuses_moments_that_would_turn_the_weights_into_nan():
    """None, NaN or a negative second moment loaded without a word, and the next step wrote
    NaN into every weight; strings in v failed with a bare ValueError after the m had been
    replaced (half loaded)."""
    opt = AdamW({"w": fm.tensor(np.ones((2, 2), np.float32))}, lr=0.1)
    opt.step({"w": fm.tensor(np.ones((2, 2), np.float32))})
    good = opt.state_dict()
    m_before, v_before = opt.m["w"].numpy(), opt.v["w"].numpy()
    new_m = {"w": np.full((2, 2), 7.0, np.float32)}
    for v, says in ((-np.ones((2, 2), np.float32), r"v\[w\] must hold finite numbers >= 0"),
                    (np.full((2, 2), np.nan, np.float32), r"v\[w\] must hold finite"),
                    (np.array([[None, None], [None, None]]), r"v\[w\] must be an array of numbers"),
                    (np.array([["a", "b"], ["c", "d"]]), r"v\[w\] must be an array of numbers")):
        with pytest.raises(ConfigError, match=says):
            opt.load_state_dict(dict(good, m=new_m, v={"w": v}))
        assert np.array_equal(opt.m["w"].numpy(), m_before)      # nothing loaded
        assert np.array_equal(opt.v["w"].numpy(), v_before)
    with pytest.raises(ConfigError, match=r"m\[w\] must hold finite numbers"):
        opt.load_state_dict(dict(good, m={"w": np.full((2, 2), np.inf)}))
    opt.load_state_dict(dict(good, m=new_m))                      # a good state still loads
    assert opt.m["w"].numpy()[0, 0] == 7.0
    opt.step({"w": fm.tensor(np.ones((2, 2), np.float32))})
    assert np.isfinite(opt.params["w"].numpy()).all()


def test_grad_norm_checks_its_gradients_as_clip_grad_norm_does():
    """grad_norm of a list or of NumPy arrays was an AttributeError from inside (NumPy's
    "'str' object has no attribute 'type'"); a grad_scale of "x" a bare ValueError."""
    g = fm.tensor(np.array([3.0, 4.0], np.float32))
    assert grad_norm({"g": g}) == 5.0 and grad_norm({"g": g}, 2.0) == 10.0
    with pytest.raises(ConfigError, match="grad_norm: expected a dict"):
        grad_norm([g])
    with pytest.raises(ConfigError, match="grad_norm: gradient 'g' is a ndarray"):
        grad_norm({"g": np.array([3.0, 4.0])})
    for fn in (grad_norm, lambda grads, s: clip_grad_norm(grads, 1.0, s)):
        for bad in ("x", float("nan"), None):
            with pytest.raises(ConfigError, match="grad_scale must be a finite number"):
                fn({"g": g}, bad)


def test_cosine_lr_refuses_counts_and_rates_it_cannot_mean():
    """A negative warmup moved the cosine (0.775 at step 0 of warmup -5), a step before 0 gave
    a negative rate, a string step met `<` as a TypeError."""
    assert cosine_lr(0, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert cosine_lr(np.int64(9), 1.0, 10, 110, 0.1) == pytest.approx(1.0)
    for args, name in (((0, 1.0, -5, 10, 0.1), "warmup"), ((-2, 1.0, 10, 100, 0.1), "step"),
                       (("1", 1.0, 10, 100, 0.1), "step"), ((1.5, 1.0, 10, 100, 0.1), "step"),
                       ((1, 1.0, 10, -1, 0.1), "max_steps"), ((1, None, 10, 100, 0.1), "max_lr"),
                       ((1, 1.0, 10, 100, float("nan")), "min_lr")):
        with pytest.raises(ConfigError, match=f"cosine_lr: {name} must be"):
            cosine_lr(*args)


def test_gpt2_names_a_config_that_is_no_gpt2config():
    """GPT2(dict, ...), GPT2.from_state_dict(dict, ...), param_shapes(dict) and
    config_params(dict) were AttributeErrors on cfg.n_embd; from_state_dict(cfg, None) one on
    .items(), and a state of lists a TypeError from int() deep in the shape check."""
    cfg = GPT2Config(**TINY)
    model = GPT2.init(cfg)
    for call in (lambda: GPT2(cfg.to_dict(), model.params), lambda: GPT2(None),
                 lambda: GPT2.from_state_dict(cfg.to_dict(), model.state_dict()),
                 lambda: param_shapes(cfg.to_dict()), lambda: config_params(cfg.to_dict())):
        with pytest.raises(ConfigError, match="config must be a GPT2Config"):
            call()
    with pytest.raises(ConfigError, match="state must be a dict"):
        GPT2.from_state_dict(cfg, None)
    with pytest.raises(ConfigError, match="'wte.weight' is a list; expected a NumPy array"):
        GPT2.from_state_dict(cfg, {k: v.tolist() for k, v in model.state_dict().items()})
    again = GPT2.from_state_dict(cfg, model.state_dict())
    assert np.array_equal(again.params["wte.weight"].numpy(), model.params["wte.weight"].numpy())


def test_gpt2_config_with_numpy_floats_can_be_saved():
    """GPT2Config(dropout=np.float32(0.1)) was taken as it came, and its to_dict() (what a
    checkpoint's meta holds) was no JSON; layernorm_eps=np.float32 was refused though
    np.float64 was taken."""
    cfg = GPT2Config(**TINY, dropout=np.float32(0.25), layernorm_eps=np.float32(1e-5))
    back = GPT2Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.dropout == 0.25
    assert back.layernorm_eps == pytest.approx(1e-5, rel=1e-6)


def test_gpt2_forward_checks_its_tape_train_switch_and_dropout_seed():
    """forward(None, ...) was an AttributeError on .leaf; dropout_seed 1.5 was seed 1 (1.9
    too), None and "a" a TypeError or ValueError from rng.mix; train="no" was true (dropout
    on) and then named linear_cross_entropy's grad."""
    model = GPT2.init(GPT2Config(**TINY, dropout=0.5))
    ids, tg = fm.tensor([[1, 2, 3]]), fm.tensor([[2, 3, 4]])
    with pytest.raises(TapeError, match="tape must be a forge_ml Tape"):
        model.forward(None, ids, tg)
    for seed in (1.5, None, "a", True):
        with pytest.raises(ConfigError, match="dropout_seed must be an int"):
            model.loss_and_grads(ids, tg, dropout_seed=seed)
    with pytest.raises(ConfigError, match="GPT2.forward: train must be True or False"):
        model.loss_and_grads(ids, tg, train="no")
    a = model.loss_and_grads(ids, tg, dropout_seed=np.int64(3))[0]
    assert a == model.loss_and_grads(ids, tg, dropout_seed=3)[0]
    assert a != model.loss_and_grads(ids, tg, dropout_seed=4)[0]


def test_gpt2_config_and_ids_errors_say_what_came():
    """The documented refusals, from Python: n_embd not divisible by n_head, a sequence past
    block_size, ids and targets outside the vocabulary (the padded rows are no tokens)."""
    with pytest.raises(ConfigError, match="n_embd 10 must be divisible by n_head 3"):
        GPT2Config(vocab_size=11, n_embd=10, n_head=3)
    model = GPT2.init(GPT2Config(**TINY, padded_vocab_size=16))
    with pytest.raises(ShapeError, match="5 tokens is longer than the context .block_size 4"):
        model.loss_and_grads(fm.tensor([[1, 2, 3, 4, 5]]), fm.tensor([[1, 2, 3, 4, 5]]))
    for ids, tg in (([[1, 11]], [[1, 2]]), ([[1, -1]], [[1, 2]]), ([[1, 2]], [[1, 15]])):
        with pytest.raises(ShapeError, match=r"out of range; ids must be in 0\.\.10"):
            model.loss_and_grads(fm.tensor(ids), fm.tensor(tg))
