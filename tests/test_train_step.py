"""The training step with its per-step values in device memory (forge_ml.step.TrainStep), run
eagerly on the CPU: bit for bit the trainer's op-by-op step, with dropout and gradient
accumulation; a non-finite step updates nothing; the device-scalar forms of dropout, AdamW
and clipping equal the host-scalar ones; the backend contract asks for them."""
import math
import types

import numpy as np
import pytest

import forge_ml as fm
from forge_ml import ops, rng
from forge_ml.backends import Backend
from forge_ml.errors import DeviceError, TrainingError
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.optim import AdamW, clip_grad_norm, clip_on_device
from forge_ml.step import TrainStep
from forge_ml.train import Trainer, dropout_seed

from test_train import _cfg, text_file  # noqa: F401 (the fixture)

CFG = GPT2Config(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


def _pair(seed=3):
    a, b = GPT2.init(CFG, seed=seed), GPT2.init(CFG, seed=seed)
    return (a, AdamW(a.params, lr=3e-3)), (b, AdamW(b.params, lr=3e-3))


def _batches(r, accum, B=3, T=8):
    return [(r.integers(0, CFG.vocab_size, (B, T)), r.integers(0, CFG.vocab_size, (B, T)))
            for _ in range(accum)]


@pytest.mark.parametrize("accum", [1, 3])
def test_step_equals_the_op_by_op_step_bit_for_bit(accum):
    (m1, o1), (m2, o2) = _pair()
    step = TrainStep(m2, o2, batch=3, block=8, accum=accum, max_norm=0.5)
    r = np.random.default_rng(0)
    for s in range(5):
        batches = _batches(r, accum)
        seeds = [dropout_seed(11, s, i) for i in range(accum)]
        lr = 1e-3 * (s + 1)
        # the trainer's op-by-op step
        losses, acc = [], None
        for (x, y), sd in zip(batches, seeds):
            loss, g = m1.loss_and_grads(fm.tensor(x), fm.tensor(y), dropout_seed=sd)
            losses.append(loss)
            acc = g if acc is None else {k: ops.add(acc[k], v) for k, v in g.items()}
        norm, scale = clip_grad_norm(acc, 0.5, grad_scale=1.0 / accum)
        o1.step(acc, lr=lr, grad_scale=scale)
        got = step.run(batches, seeds, lr)
        assert got.taken and got.losses == losses and got.norm == norm
        for k in m1.params:
            np.testing.assert_array_equal(m1.params[k].numpy(), m2.params[k].numpy(), err_msg=k)
            np.testing.assert_array_equal(o1.m[k].numpy(), o2.m[k].numpy(), err_msg=k)
    assert o1.steps == o2.steps == 5 and o2.param_steps == o1.param_steps
    assert norm > 0.5            # clipping was active, so the factor path was exercised


def test_a_non_finite_step_updates_nothing():
    (m, o), _ = _pair()
    step = TrainStep(m, o, batch=3, block=8, max_norm=1.0)
    r = np.random.default_rng(1)
    step.run(_batches(r, 1), [1], 1e-3)
    before = {k: v.numpy().copy() for k, v in m.params.items()}
    moments = {k: v.numpy().copy() for k, v in o.v.items()}
    bad = m.params["h.0.ln_1.weight"].numpy().copy()
    bad[3] = np.nan
    ops.assign(m.params["h.0.ln_1.weight"], bad)
    before["h.0.ln_1.weight"] = bad
    got = step.run(_batches(r, 1), [2], 1e-3)
    assert not got.taken and math.isnan(got.losses[0])
    assert o.steps == 1 and set(o.param_steps.values()) == {1}
    for k, v in m.params.items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
        np.testing.assert_array_equal(o.v[k].numpy(), moments[k], err_msg=k)


def _use_step(monkeypatch, target) -> list:
    """``target`` (a Trainer, or the class: every Trainer) takes its steps through a TrainStep;
    returns the list of the TrainSteps made."""
    made = []

    def fast_step(self):
        if self._fast is None:
            c = self.cfg
            self._fast = TrainStep(self.model, self.opt, c.batch_size, c.block_size, c.grad_accum, c.grad_clip)
            made.append(self._fast)
        return self._fast

    monkeypatch.setattr(target, "_fast_step", fast_step if isinstance(target, type)
                        else types.MethodType(fast_step, target))
    return made


def test_the_trainer_through_the_step_logs_what_the_op_by_op_trainer_logs(text_file, tmp_path, monkeypatch):
    kw = dict(dropout=0.1, grad_accum=2, max_steps=5, grad_clip=0.05)
    plain = Trainer(_cfg(text_file, tmp_path / "a", **kw), log=None)
    out_a = plain.train()
    fast = Trainer(_cfg(text_file, tmp_path / "b", **kw), log=None)
    made = _use_step(monkeypatch, fast)
    out_b = fast.train()
    assert made and out_a["losses"] == out_b["losses"] and out_a["val_loss"] == out_b["val_loss"]
    for k in plain.model.params:
        np.testing.assert_array_equal(plain.model.params[k].numpy(), fast.model.params[k].numpy())
    log = [ln for ln in (tmp_path / "b" / "log.jsonl").read_text().splitlines() if '"grad_norm"' in ln]
    assert len(log) == 5


def test_the_trainer_step_stops_on_a_nan_and_names_its_origin(text_file, tmp_path, monkeypatch):
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=3), log=None)
    monkeypatch.setattr(t, "_fast_step", lambda: t._fast or setattr(t, "_fast", TrainStep(
        t.model, t.opt, t.cfg.batch_size, t.cfg.block_size, 1, t.cfg.grad_clip)) or t._fast)
    t.train_step()
    w = t.model.params["wpe.weight"].numpy().copy()
    w[:] = np.inf
    ops.assign(t.model.params["wpe.weight"], w)
    with pytest.raises(TrainingError, match="at step 2.*wpe|at step 2"):
        t.train_step()
    assert t.step == 1 and t.opt.steps == 1


def test_device_scalar_forms_equal_the_host_forms():
    r = np.random.default_rng(2)
    x = fm.tensor(r.standard_normal(37).astype(np.float32))
    base = fm.tensor(np.array([2**63 + 12345], np.uint64).view(np.int64))
    for site in (0, 5):
        want = ops.dropout(x, 0.3, rng.mix(2**63 + 12345, site)).numpy()
        np.testing.assert_array_equal(ops.dropout(x, 0.3, ops.SeedAt(base, site)).numpy(), want)
    grads = {"a": fm.tensor(r.standard_normal((4, 3)).astype(np.float32)),
             "b": fm.tensor(r.standard_normal(5).astype(np.float32))}
    for max_norm, gs in ((0.7, 0.5), (100.0, 1.0), (0.0, 0.25)):
        opt = AdamW({"w": fm.zeros(2)})
        s = opt.prepare(grad_scale=gs)
        clip_on_device(grads, max_norm, s, grad_scale=gs)
        norm, scale = clip_grad_norm(grads, max_norm, grad_scale=gs)
        assert s.numpy()[3] == scale and s.numpy()[4] == norm
    s = opt.prepare(grad_scale=1.0)
    clip_on_device(grads, 1.0, s, check=fm.tensor(np.array(np.nan, np.float32)))
    assert math.isnan(s.numpy()[3]) and math.isfinite(s.numpy()[4])


def test_prepare_refuses_uneven_step_counts():
    opt = AdamW({"w": fm.zeros((2, 2)), "b": fm.zeros(2)})
    opt.step({"w": fm.zeros((2, 2)), "b": None})
    with pytest.raises(fm.errors.ConfigError, match="different numbers of steps"):
        opt.prepare()


def test_a_graph_backend_of_device_memory_must_read_step_values_from_it():
    import forge_ml.backends.cpu as cpu
    fake = types.SimpleNamespace(**{n: getattr(cpu, n) for n in dir(cpu) if not n.startswith("__")})
    fake.GRAPHS, fake.HOST_MEMORY, fake.capture_graph = True, False, lambda fn: None
    with pytest.raises(DeviceError, match="dropout_at, adamw_update_at, clip_scale"):
        Backend("fake", fake)
    fake.dropout_at = fake.adamw_update_at = fake.clip_scale = lambda *a: None
    assert Backend("fake", fake).graphs


def test_update_needs_every_gradient_and_says_which_is_missing():
    opt = AdamW({"w": fm.zeros((2, 2)), "b": fm.zeros(2)})
    s = opt.prepare()
    with pytest.raises(fm.errors.ConfigError, match="no gradient for b"):
        opt.update({"w": fm.zeros((2, 2))}, s)


def test_a_step_built_for_one_shape_refuses_another():
    (m, o), _ = _pair()
    step = TrainStep(m, o, batch=3, block=8)
    r = np.random.default_rng(0)
    with pytest.raises(fm.errors.ShapeError, match=r"built for \(3, 8\)"):
        step.run([(r.integers(0, 20, (2, 8)), r.integers(0, 20, (2, 8)))], [0], 1e-3)
    with pytest.raises(fm.errors.ShapeError, match="expected 1 micro-batches"):
        step.run(_batches(r, 2), [0, 1], 1e-3)
    assert o.steps == 0


# -- the trainer through the step: the host's work between steps runs while the device works ----


@pytest.fixture
def through_step(monkeypatch):
    """Every Trainer takes its steps through a TrainStep (on the CPU: the same step, run eagerly),
    as a GPU's trainer does through its captured graph."""
    return _use_step(monkeypatch, Trainer)


def _saves(monkeypatch):
    """Wrap Trainer.save: what the loader and the log held at each checkpoint."""
    seen, inner = [], Trainer.save

    def save(self):
        out = inner(self)
        from forge_ml.runs import read_log
        from forge_ml.checkpoint import load_checkpoint
        _, meta = load_checkpoint(self.ckpt_dir)
        steps = [r["step"] for r in read_log(self.log_path)[0] if "loss" in r]
        seen.append((self.step, meta["data"]["batches_drawn"], steps))
        return out

    monkeypatch.setattr(Trainer, "save", save)
    return seen


@pytest.mark.parametrize("extra", [dict(), dict(dropout=0.1, grad_accum=2)], ids=["plain", "dropout+accum"])
def test_the_step_path_resumes_bit_exact_with_the_loader_and_log_of_each_checkpoint(
        text_file, tmp_path, monkeypatch, through_step, extra):
    """The step draws the next step's batches while the device runs and writes the log one step
    late: every checkpoint still holds the loader as of its step (not after the batches drawn
    ahead) and a log through its step, and a resumed run equals an uninterrupted one."""
    n = 6
    full = Trainer(_cfg(text_file, tmp_path / "full", max_steps=n, **extra), log=None)
    full_losses = full.train()["losses"]
    seen = _saves(monkeypatch)
    half = Trainer(_cfg(text_file, tmp_path / "half", max_steps=n, checkpoint_interval=2, **extra), log=None)
    first = half.train(until=n // 2)["losses"]
    resumed = Trainer(_cfg(text_file, tmp_path / "half", max_steps=n, checkpoint_interval=2, **extra),
                      resume=True, log=None)
    second = resumed.train()["losses"]
    assert len(through_step) == 3 and all(s.mode == "eager" for s in through_step)
    assert first + second == full_losses
    for k in full.model.params:
        np.testing.assert_array_equal(full.model.params[k].numpy(), resumed.model.params[k].numpy(), err_msg=k)
    accum = extra.get("grad_accum", 1)
    assert [s for s, _, _ in seen] == [2, 3, 4, 6]
    for step, drawn, logged in seen:
        assert drawn == step * accum and logged == list(range(1, step + 1)), (step, drawn, logged)


def test_a_signal_stops_the_step_path_at_the_step_it_reached(text_file, tmp_path, monkeypatch, through_step):
    """SIGINT while the device runs a step: the step ends, the checkpoint is of that step with
    the loader as of it (the next step's batches, drawn already, are given back); a resume is
    exact."""
    import signal
    from forge_ml.checkpoint import load_checkpoint
    from forge_ml.train import Interrupted
    full = Trainer(_cfg(text_file, tmp_path / "full", max_steps=6), log=None)
    full_losses = full.train()["losses"]
    t = Trainer(_cfg(text_file, tmp_path / "cut", max_steps=6), log=None)
    inner = TrainStep.submit

    def submit(self, *a, **kw):
        out = inner(self, *a, **kw)
        if t.step == 2:                          # step 3 is on the device
            t._on_signal(signal.SIGINT, None)
        return out

    monkeypatch.setattr(TrainStep, "submit", submit)
    with pytest.raises(Interrupted) as e:
        t.train()
    assert e.value.step == 3
    _, meta = load_checkpoint(tmp_path / "cut" / "ckpt")
    assert meta["step"] == 3 and meta["data"]["batches_drawn"] == 3
    resumed = Trainer(_cfg(text_file, tmp_path / "cut", max_steps=6), resume=True, log=None)
    assert t.losses + resumed.train()["losses"] == full_losses


def test_the_step_path_loses_no_log_record_to_a_full_disk(text_file, tmp_path, monkeypatch, through_step):
    """A log write that fails while the device runs a step is tried again after the step and
    raises there; training on once there is room again loses no record."""
    import forge_ml.train as train_mod
    from forge_ml.runs import RunError, read_log
    from test_train_safety import _Filling
    real_open = open
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=6), log=None)
    t.train(until=2)
    with monkeypatch.context() as m:
        m.setattr(train_mod, "open", lambda p, mode="r", *a, **kw: _Filling(real_open(p, mode, *a, **kw), 20)
                  if str(p).endswith("log.jsonl") else real_open(p, mode, *a, **kw), raising=False)
        with pytest.raises(RunError, match="No space left on device"):
            t.train()
        assert t.step == 4          # the record of step 3 failed inside step 4, raised after it
        with pytest.raises(RunError, match="No space left on device"):
            t.train()
    t.train()
    records, bad = read_log(tmp_path / "r" / "log.jsonl")
    assert bad == [] and [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert t.train_loader.batches_drawn == 6


def test_a_step_that_is_not_taken_gives_back_the_batches_drawn_ahead(text_file, tmp_path, through_step):
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=4), log=None)
    t.train_step()
    w = t.model.params["wpe.weight"].numpy().copy()
    w[:] = np.inf
    ops.assign(t.model.params["wpe.weight"], w)
    with pytest.raises(TrainingError):
        t.train_step()
    assert t.step == 1 and t.train_loader.batches_drawn == 2 and t._staged is None


def test_preload_queues_the_next_steps_values_and_submit_then_writes_none(monkeypatch):
    """``preload`` behind a step in flight, then ``submit`` of the same batches: the same steps
    as ``run`` bit for bit, with no ``_load`` after the first; a preload that does not match
    what is submitted (or follows a step not taken) is not used."""
    (m1, o1), (m2, o2) = _pair()
    a, b = TrainStep(m1, o1, batch=3, block=8, accum=2, max_norm=0.5), \
        TrainStep(m2, o2, batch=3, block=8, accum=2, max_norm=0.5)
    r = np.random.default_rng(4)
    steps = [(_batches(r, 2), [dropout_seed(5, s, i) for i in range(2)], 1e-3 * (s + 1)) for s in range(4)]
    loads = []
    inner = TrainStep._load
    monkeypatch.setattr(TrainStep, "_load", lambda self, *x: (loads.append(self), inner(self, *x))[1])
    want = [a.run(*st) for st in steps]
    loads.clear()
    pending = b.submit(*steps[0])
    got = []
    for nxt in steps[1:]:
        b.preload(*nxt)
        got.append(pending.result())
        pending = b.submit(*nxt)
    got.append(pending.result())
    assert got == want and loads == [b]          # only the first step wrote its own values
    for k in m1.params:
        np.testing.assert_array_equal(m1.params[k].numpy(), m2.params[k].numpy(), err_msg=k)
    assert o1.param_steps == o2.param_steps
    b.preload(*steps[0])
    b.submit(steps[1][0], steps[1][1], steps[1][2])   # not what was preloaded: written again
    assert loads == [b, b]


def test_a_step_not_taken_drops_the_preload_of_the_next():
    (m, o), _ = _pair()
    step = TrainStep(m, o, batch=3, block=8, max_norm=1.0)
    r = np.random.default_rng(1)
    step.run(_batches(r, 1), [1], 1e-3)
    bad = m.params["h.0.ln_1.weight"].numpy().copy()
    bad[3] = np.nan
    ops.assign(m.params["h.0.ln_1.weight"], bad)
    pending = step.submit(_batches(r, 1), [2], 1e-3)
    nxt = _batches(r, 1)
    step.preload(nxt, [3], 1e-3)          # written as if the step in flight were taken
    assert not pending.result().taken and step._preloaded is None


def test_the_trainer_through_the_step_writes_each_steps_values_behind_the_step_before(
        text_file, tmp_path, monkeypatch, through_step):
    loads = []
    inner = TrainStep._load
    monkeypatch.setattr(TrainStep, "_load", lambda self, *x: (loads.append(1), inner(self, *x))[1])
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=6, checkpoint_interval=3, dropout=0.1), log=None)
    t.train()
    assert len(loads) == 2   # step 1, and step 4 (the checkpoint gave the drawn batches back)


def test_a_failure_drawing_ahead_leaves_the_step_counted_and_raises_at_the_next(
        text_file, tmp_path, monkeypatch, through_step):
    """The next step's batches drawn during a step fail to come (a shard unreadable): the step
    on the device still counts, and the error comes when the next step draws for itself."""
    from forge_ml.errors import DataError
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=4), log=None)
    t.train_step()

    def next_batch():
        raise DataError("shard unreadable")

    t.train_loader.next_batch = next_batch   # step 2's batches were drawn in step 1; step 3's fail
    t.train_step()
    assert t.step == 2 and t.opt.steps == 2 and t._staged is None and t.train_loader.batches_drawn == 2
    with pytest.raises(DataError, match="shard unreadable"):
        t.train_step()
    assert t.step == 2 and t.opt.steps == 2
