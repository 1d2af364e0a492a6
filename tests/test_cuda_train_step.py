"""The training step on the GPU with its per-step values in device memory, captured once as a
CUDA graph and replayed (forge_ml.step.TrainStep): bit for bit the op-by-op trainer, with
dropout, gradient accumulation, bf16 and float32; a NaN step updates nothing; the kernels
that read step values from device memory (dropout_at, adamw_update_at, clip_scale) equal the
ones given host scalars."""
import math

import numpy as np
import pytest

import forge_ml as fm
from forge_ml import flags, ops, rng
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.optim import AdamW, clip_grad_norm, clip_on_device
from forge_ml.step import TrainStep
from forge_ml.train import Trainer

from _gpu_checks import cuda_or_skip
from test_train import _cfg, text_file  # noqa: F401 (the fixture)

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", autouse=True)
def gpu():
    cuda_or_skip()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_at_equals_dropout_with_the_mixed_seed(dtype):
    r = np.random.default_rng(0)
    x = fm.tensor(r.standard_normal((5, 333)).astype(np.float32), device="cuda").to(dtype)
    base = fm.tensor(np.array([2**64 - 3], np.uint64).view(np.int64), device="cuda")
    for site in (0, 7, 2**40):
        want = ops.dropout(x, 0.2, rng.mix(2**64 - 3, site)).to("float32").numpy()
        got = ops.dropout(x, 0.2, ops.SeedAt(base, site)).to("float32").numpy()
        np.testing.assert_array_equal(got, want)
        assert (got == 0).mean() > 0.1
    ops.assign(base, np.array([5], np.int64))         # a new seed in place: new masks
    assert not np.array_equal(ops.dropout(x, 0.2, ops.SeedAt(base, 0)).to("float32").numpy(),
                              ops.dropout(x, 0.2, rng.mix(2**64 - 3, 0)).to("float32").numpy())


@pytest.mark.parametrize("gdtype", ["float32", "bfloat16"])
def test_adamw_at_and_clip_scale_equal_the_host_scalar_step(gdtype):
    r = np.random.default_rng(1)
    shape = (7, 129)
    p0 = r.standard_normal(shape).astype(np.float32)
    grads = {"w": fm.tensor(r.standard_normal(shape).astype(np.float32) * 3, device="cuda").to(gdtype)}
    a = AdamW({"w": fm.tensor(p0, device="cuda")}, lr=1e-2, compute_dtype="bfloat16")
    b = AdamW({"w": fm.tensor(p0, device="cuda")}, lr=1e-2, compute_dtype="bfloat16")
    for step in range(3):
        norm, scale = clip_grad_norm(grads, 1.0, grad_scale=0.5)
        a.step(grads, lr=1e-3 * (step + 1), grad_scale=scale)
        s = b.prepare(lr=1e-3 * (step + 1), grad_scale=0.5)
        clip_on_device(grads, 1.0, s, grad_scale=0.5)
        b.update(grads, s)
        b.advance()
        got = s.numpy()
        assert got[3] == scale and got[4] == norm
        for opt_a, opt_b in ((a.params, b.params), (a.m, b.m), (a.v, b.v), (a.lowp, b.lowp)):
            np.testing.assert_array_equal(opt_a["w"].to("float32").numpy(), opt_b["w"].to("float32").numpy())
    s = b.prepare()
    clip_on_device(grads, 1.0, s, check=fm.tensor(np.array(np.inf, np.float32), device="cuda"))
    before = b.params["w"].numpy().copy()
    b.update(grads, s)
    assert math.isnan(s.numpy()[3])
    np.testing.assert_array_equal(b.params["w"].numpy(), before)


CFG = GPT2Config(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)


@pytest.mark.parametrize("dtype,accum", [("float32", 1), ("bfloat16", 1), ("bfloat16", 3)])
def test_the_captured_step_replays_the_op_by_op_step_bit_for_bit(dtype, accum):
    runs = []
    for graph in (False, True):
        model = GPT2.init(CFG, seed=1, device="cuda")
        opt = AdamW(model.params, lr=1e-3, compute_dtype=dtype)
        step = TrainStep(model, opt, batch=4, block=32, accum=accum, max_norm=0.3, graph=graph)
        r = np.random.default_rng(5)
        out, modes = [], []
        for s in range(6):
            batches = [(r.integers(0, 64, (4, 32)), r.integers(0, 64, (4, 32))) for _ in range(accum)]
            res = step.run(batches, [1000 * s + i for i in range(accum)], lr=1e-3 * (1 + s % 3))
            out.append((res.losses, res.norm, res.taken))
            modes.append(step.mode)
        runs.append((out, {k: t.numpy() for k, t in opt.params.items()}, modes, step.why_eager))
    (eager, p_eager, m_eager, _), (graph, p_graph, m_graph, why) = runs
    assert why is None and m_graph == ["eager"] + ["graph"] * 5 and set(m_eager) == {"eager"}
    assert eager == graph
    for k in p_eager:
        np.testing.assert_array_equal(p_graph[k], p_eager[k], err_msg=k)


def test_release_gives_the_graphs_memory_back_and_the_step_captures_again():
    # the trainer releases the step before an evaluation: the graph's pool must go back to
    # the device then (it once stayed held, and the next capture doubled the step's memory)
    model = GPT2.init(CFG, seed=3, device="cuda")
    opt = AdamW(model.params, lr=1e-3, compute_dtype="bfloat16")
    step = TrainStep(model, opt, batch=4, block=32, graph=True)
    r = np.random.default_rng(1)
    batch = lambda: [(r.integers(0, 64, (4, 32)), r.integers(0, 64, (4, 32)))]  # noqa: E731
    for s in range(2):
        step.run(batch(), [s], 1e-3)
    assert step.mode == "graph"
    captured = step._graph._captured
    pool = captured._pool
    held = pool.total_bytes() - pool.used_bytes()        # the intermediates' freed blocks
    assert held > 0
    step.release()
    # what goes back: every free block but those that share an allocation with a block in use
    assert pool.total_bytes() - pool.used_bytes() < held / 4
    with pytest.raises(fm.errors.CaptureError, match="released"):
        captured.replay()
    modes = []
    for s in range(2, 4):
        assert step.run(batch(), [s], 1e-3).taken
        modes.append(step.mode)
    assert modes == ["eager", "graph"]


def test_a_nan_replay_updates_nothing():
    model = GPT2.init(CFG, seed=2, device="cuda")
    opt = AdamW(model.params, lr=1e-3, compute_dtype="bfloat16")
    step = TrainStep(model, opt, batch=2, block=32, graph=True)
    r = np.random.default_rng(0)
    for s in range(3):
        assert step.run([(r.integers(0, 64, (2, 32)), r.integers(0, 64, (2, 32)))], [s], 1e-3).taken
    assert step.mode == "graph"
    before = {k: t.numpy().copy() for k, t in opt.params.items()}
    w = model.params["wpe.weight"].to("float32").numpy()
    w[0, 0] = np.nan
    ops.assign(model.params["wpe.weight"], w)      # the compute copy the graph reads, in place
    res = step.run([(r.integers(0, 64, (2, 32)), r.integers(0, 64, (2, 32)))], [9], 1e-3)
    assert not res.taken and opt.steps == 3
    for k, t in opt.params.items():
        np.testing.assert_array_equal(t.numpy(), before[k], err_msg=k)


def test_the_trainer_replays_its_step_and_logs_what_the_op_by_op_trainer_logs(text_file, tmp_path):
    # an evaluation at step 3 gives the graph's memory back; step 4 captures again
    kw = dict(device="cuda", dtype="bf16", dropout=0.1, grad_accum=2, max_steps=6, grad_clip=0.05,
              eval_interval=3)
    with flags.override(FORGE_TRAIN_GRAPH="off"):
        a = Trainer(_cfg(text_file, tmp_path / "a", **kw), log=None)
        out_a = a.train()
    b = Trainer(_cfg(text_file, tmp_path / "b", **kw), log=None)
    out_b = b.train()
    assert a._fast is None and b._fast is not None and b._fast.mode == "graph"
    assert out_a["losses"] == out_b["losses"] and out_a["val_loss"] == out_b["val_loss"]
    for k in a.opt.params:
        np.testing.assert_array_equal(a.opt.params[k].numpy(), b.opt.params[k].numpy(), err_msg=k)
