"""Data parallelism as a torch DDP / ZeRO user drives it, on thread ranks: bad input is refused
with a clear error on every rank, nothing hangs, nothing goes silently wrong."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.distributed import CommError, CommTimeout, DataParallel, launch
from forge_ml.distributed.launch import process_env
from forge_ml.errors import ConfigError, ShapeError
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.optim import AdamW

CFG = GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8)


def _dp(comm, zero=0, seed=0, lr=1e-2, cfg=CFG):
    model = GPT2.init(cfg, seed=seed)
    return model, DataParallel(comm, model, AdamW(model.params, lr=lr), zero=zero)


def _batch(comm):
    ids = fm.tensor(np.arange(4).reshape(1, 4) + comm.rank)
    return [(ids, ids, 0)]


@pytest.mark.parametrize("lr, scale", [(float("nan"), 0.5), (-1.0, 0.5), (1e-2, float("inf"))])
def test_zero_step_refuses_a_non_finite_lr_or_scale_as_adamw_does(lr, scale):
    # AdamW.step (zero=0) refused them; ZeroAdamW wrote NaN into every parameter
    def rank(comm):
        model, dp = _dp(comm, zero=1)
        before = model.params["wte.weight"].numpy()
        dp.gradients(_batch(comm))
        with pytest.raises(ConfigError, match="AdamW.step: (lr|grad_scale) must be a finite"):
            dp.update(lr, scale)
        assert dp.opt.steps == 0 and set(dp.opt.param_steps.values()) == {0}   # nothing counted
        assert np.array_equal(model.params["wte.weight"].numpy(), before)

    launch.threads(2, rank, timeout=10)


def test_threads_returns_when_a_rank_hangs_outside_any_collective():
    # the others time out naming it; launch.threads then joined the hung thread forever
    release = threading.Event()

    def rank(comm):
        if comm.rank == 2:
            release.wait(8)           # a deadlock in the rank's own code: no collective
            return None
        comm.all_reduce(np.ones(2))

    t0 = time.monotonic()
    try:
        with pytest.raises(CommTimeout, match=r"rank\(s\) 2 never reached it"):
            launch.threads(3, rank, timeout=0.3)
        assert time.monotonic() - t0 < 4
    finally:
        release.set()


@pytest.mark.parametrize("env, match", [
    ({"MASTER_PORT": "99999"}, "MASTER_PORT must be a TCP port in 1..65535"),
    ({"MASTER_PORT": "-5"}, "MASTER_PORT must be a TCP port"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT must be a TCP port"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ({"RANK": "1_0"}, "RANK must be an integer, got '1_0'"),
    ({"WORLD_SIZE": "\u0662"}, "WORLD_SIZE must be an integer"),      # an Arabic-Indic 2
    ({"LOCAL_RANK": "1.0"}, "LOCAL_RANK must be an integer"),
])
def test_process_env_refuses_a_rendezvous_the_ranks_cannot_meet_at(env, match):
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match=match):
        process_env(dict(base, **env))
    assert process_env(base).master_port == 29500 and process_env(dict(base, RANK=" 1 ")).rank == 1


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("what, kw, match", [
    ("seed", {"seed": 1}, "sum of squares of parameter wte.weight"),
    ("lr", {"lr": 2e-2}, "AdamW's lr is 0.02 on rank 1, 0.01 on rank 0"),
    ("n_head", {"cfg": GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)},
     "the model config's n_head is 2 on rank 1, 1 on rank 0"),
    ("zero", {}, "zero is"),
])
def test_ranks_built_differently_are_refused_on_every_rank(zero, what, kw, match):
    # rank 1 built from another seed (or lr, or n_head): with zero=0 the ranks trained apart in
    # silence, with zero=1 the model became a patchwork of every rank's shard
    errors = {}

    def rank(comm):
        mine = dict(kw) if comm.rank == 1 else {}
        if what == "zero":
            mine = {"zero": 1 - zero} if comm.rank == 1 else {}
        try:
            model, dp = _dp(comm, **dict({"zero": zero}, **mine))
        except ConfigError as e:
            errors[comm.rank] = str(e)
            raise
        dp.update(1e-2, dp.gradients(_batch(comm))[2])
        return model.params["wte.weight"].numpy()

    with pytest.raises(ConfigError, match="rank 1 was not built like rank 0"):
        launch.threads(2, rank, timeout=10)
    assert set(errors) == {0, 1} and errors[0] == errors[1]
    assert match in errors[0]


def test_thread_collectives_refuse_another_dtype_as_nccl_does():
    # a float sum written into an int out was truncated in silence (NCCL refuses it)
    def rank(comm):
        with pytest.raises(ShapeError, match="elements of out's dtype"):
            comm.reduce_scatter(np.full(4, 1.6), np.zeros(2, np.int64))
        with pytest.raises(ShapeError, match="elements of x's dtype"):
            comm.all_gather(np.array([comm.rank + 0.7]), np.zeros(2, np.int32))
        out = np.zeros(2)
        return comm.all_gather(np.array([comm.rank + 0.5]), out).tolist()

    assert launch.threads(2, rank, timeout=10) == [[0.5, 1.5], [0.5, 1.5]]


def test_a_gradient_of_another_shape_or_name_is_refused():
    # the flat buffer took a larger gradient over its neighbours', and a renamed one in silence
    class Model:
        def __init__(self, fault):
            self.params = {k: fm.tensor(np.ones(3, np.float32)) for k in "ab"}
            self.fault = fault

        def loss_and_grads(self, x, y, dropout_seed=None):
            g = {"a": fm.tensor(np.ones(3, np.float32)), "b": fm.tensor(np.ones(3, np.float32))}
            if self.fault == "shape":
                g["b"] = fm.tensor(np.ones(5, np.float32))
            elif self.fault == "name":
                g["c"] = g["b"]
            return 1.0, g

    def rank(comm, fault):
        model = Model(fault)
        dp = DataParallel(comm, model, AdamW(model.params), zero=0)
        dp.gradients([(None, None, 0)])
        return dp.grads.host(0, dp.buckets.size).tolist()

    for fault, err, match in [("shape", ShapeError, r"gradient of b has shape \(5,\), the param"),
                              ("name", ConfigError, r"not parameters of the optimizer: \['c'\]")]:
        with pytest.raises((err, CommError), match=match):
            launch.threads(2, lambda c: rank(c, fault), timeout=10)
    assert sum(launch.threads(2, lambda c: rank(c, None), timeout=10)[0]) == 12.0
