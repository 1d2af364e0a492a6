"""Data-parallel training runs: rank 0 drives, the other ranks follow.

``train(config, comm, ...)`` is what every rank calls (the processes of ``forge-ml train
--gpus N``, or the threads of a test):

- rank 0 runs ``DistributedTrainer``: the ``train.Trainer`` (run folder and its lock, data
  preparation, log, evaluation, samples, checkpoints) with the data-parallel step. Once set
  up it sends the other ranks the run (configs, weights, optimizer state, data position),
  then one command before each phase that needs them: ``step``, ``save``, ``done`` (or
  ``abort`` with the reason);
- every other rank runs a ``Worker``: it builds the same model and optimizer from what
  rank 0 sent and follows the commands; it never touches the run folder. A worker ignores
  the first SIGINT / SIGTERM (rank 0 stops the run at a step boundary and saves), and gives
  up on a second.

The config describes the global batch: ``grad_accum`` (or ``total_batch_size /
batch_size``) is the number of micro-batches per step over all ranks, and each rank runs
``grad_accum / world_size`` of them (``ddp.rank_batches``), so the same config and checkpoint
train the same run on any number of ranks. Rank 0 writes the single-rank checkpoint format
(ZeRO shards gathered first): a run resumes on another number of ranks, or on one with the
plain ``Trainer``, and its loss curve continues.

Evaluation and samples run on rank 0 only, between steps; the others wait for the next
command, within the communicator's timeout.
"""
from __future__ import annotations

import dataclasses
import math
import signal
import time
from typing import Callable, Optional

from ..data import DataLoader
from ..errors import ConfigError, TrainingError
from ..models.gpt2 import GPT2, GPT2Config, param_shapes
from ..optim import AdamW, cosine_lr, counters
from ..tensor import tensor, zeros
from ..runs import give_back_signals, take_signals
from ..train import Interrupted, Trainer, TrainConfig, dropout_seed
from .comm import CommError, Communicator
from .ddp import DataParallel, rank_batches


def _step(dp: DataParallel, loader, cfg: TrainConfig, step: int, comm: Communicator) -> tuple:
    """The gradients half of data-parallel step ``step`` (0-based), as every rank runs it:
    ``(lr, mine, loss, norm, scale)``; ``mine`` is this rank's ``[(j, x, y)]``."""
    lr = cosine_lr(step, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr)
    mine = rank_batches(loader, cfg.grad_accum, comm.rank, comm.world_size)
    dev = comm.device
    batches = [(tensor(x, device=dev), tensor(y, device=dev), dropout_seed(cfg.seed, step, j)) for j, x, y in mine]
    loss, norm, scale = dp.gradients(batches, cfg.grad_clip)
    return lr, mine, loss, norm, scale


class DistributedTrainer(Trainer):
    """Rank 0's trainer: a ``Trainer`` whose step is the data-parallel step over ``comm``,
    driving the ``Worker``s of the other ranks. ``zero``: 0 (every rank holds the AdamW
    state) or 1 (sharded, ``ZeroAdamW``); ``bucket_mb``: gradient bucket size. The device is
    the communicator's. ``train()`` as ``Trainer.train()``; the other ranks must run
    ``Worker(comm).run()`` meanwhile (``train`` below does both).
    """

    _saves_after_error = False   # a save gathers from every rank: not after one rank's error

    TUNES_BLAS = False   # its processes share the machine's cores

    def __init__(self, config, comm: Communicator, *, zero: int = 0, bucket_mb: float = 25.0,
                 resume: bool = False, overwrite: bool = False, log: Optional[Callable] = print):
        if comm.rank != 0:
            raise ConfigError(f"DistributedTrainer runs on rank 0; rank {comm.rank} runs a Worker "
                              f"(distributed.trainer.train picks)")
        self.comm = comm
        self._workers_live = False
        try:
            if isinstance(config, dict):
                config = TrainConfig.from_dict(config)
            config = dataclasses.replace(config, device=str(comm.device))
            super().__init__(config, resume=resume, log=log, overwrite=overwrite)
            try:
                self._check_batch()
            except BaseException:
                self.close()
                raise
        except BaseException as e:
            self._send_quietly({"cmd": "abort", "reason": f"rank 0 could not set up the run: "
                                                         f"{type(e).__name__}: {e}"})
            raise
        try:
            self._share_run(zero, bucket_mb)
            self.dp = DataParallel(comm, self.model, self.opt, zero=zero, bucket_mb=bucket_mb)
        except BaseException:
            self.close()
            raise
        self.opt = self.dp.opt
        self._workers_live = True    # until they are sent "done" or "abort"

    def _check_batch(self) -> None:
        cfg, n = self.cfg, self.comm.world_size
        if n > cfg.grad_accum:
            raise ConfigError(f"{n} ranks need at least {n} micro-batches per step, but the global batch is "
                              f"{cfg.grad_accum} x {cfg.batch_size} sequences; give --total-batch-size a "
                              f"multiple of {n} x --batch-size (or fewer ranks)")
        if cfg.grad_accum % n:
            self._say(f"note: {cfg.grad_accum} micro-batches per step do not split evenly over {n} ranks; "
                      f"some ranks take one more")

    def _send(self, msg: dict) -> None:
        if msg["cmd"] in ("done", "abort"):
            self._workers_live = False
        self.comm.broadcast_object(msg, root=0)

    def _send_quietly(self, msg: dict) -> None:
        try:
            self._send(msg)
        except CommError:
            pass   # the group is broken already; the workers end on their own error

    def close(self) -> None:
        """Release the run folder, and the workers if no ``train()`` did (they end cleanly)."""
        if self._workers_live:
            self._send_quietly({"cmd": "done"})
        super().close()

    def _share_run(self, zero: int, bucket_mb: float) -> None:
        """Send the workers everything they build the run from (then the tensors, in order)."""
        opt = self.opt
        names = list(opt.params)
        self._send({
            "cmd": "run", "train_config": self.cfg.to_dict(), "model": self.model.config.to_dict(),
            "names": names, "dtype": opt.params[names[0]].dtype.name, "bf16": opt.lowp is not None,
            "data": [str(p.resolve()) for p in self.shards.train], "loader": self.train_loader.state_dict(),
            "step": self.step, "zero": zero, "bucket_mb": bucket_mb,
            "optimizer": counters(opt),
        })
        for name in names:
            for t in (opt.params[name], opt.m[name], opt.v[name]):
                self.comm.broadcast(t, root=0)

    # -- the overridden pieces of Trainer --------------------------------------------------
    def train_step(self) -> dict:
        """One data-parallel step over every rank; returns its log record (``tokens_per_s``
        counts every rank's tokens). A step is never given up half-way (every rank is inside
        it): a signal stops the run after it."""
        cfg, step = self.cfg, self.step
        self._within_max_steps()   # (before any rank is sent the step)
        t0 = time.perf_counter()
        self._send({"cmd": "step", "step": step})
        self._phase = "update"      # Trainer's signal handler never interrupts this phase
        try:
            lr, mine, loss, norm, scale = _step(self.dp, self.train_loader, cfg, step, self.comm)
            if not math.isfinite(loss):
                raise TrainingError(f"the loss is {loss} at step {step + 1} (the mean over {self.comm.world_size} "
                                    f"ranks); {self._rank0_origin(step, mine)}; stopping. {self._last_good()}")
            if not math.isfinite(norm):
                raise TrainingError(f"the gradient norm is {norm} at step {step + 1} (loss {loss:.4f}); "
                                    f"{self._rank0_origin(step, mine)}; stopping. {self._last_good()}")
            self.dp.update(lr, scale)
            self.step += 1
        finally:
            self._phase = None
        return dict(self._step_record(lr, loss, norm, t0), ranks=self.comm.world_size)

    def _rank0_origin(self, step: int, mine: list) -> str:
        for j, x, y in mine:
            why = self._origin(step, [(tensor(x, device=self.device), tensor(y, device=self.device))], j)
            if why.startswith("first non-finite"):
                return f"{why} (rank 0's micro-step {j + 1})"
        return "rank 0's micro-batches re-ran finite: the value came from another rank's"

    def _masters(self) -> dict:
        """keep_best: the master weights, gathered from every rank (collective, as ``save``)."""
        self._send({"cmd": "save"})
        return self.dp.gather_state(root=0)["params"]

    def save(self):
        """Gather the optimizer state from every rank (collective), then write the
        single-rank checkpoint format on rank 0."""
        self._send({"cmd": "save"})
        state = self.dp.gather_state(root=0)
        return self._write_checkpoint(state["params"], dict(state["optimizer"]))

    def train(self, until: Optional[int] = None) -> dict:
        """``Trainer.train``, then tell the workers the run is done (or why it stopped): one
        ``train()`` per run, the workers end with it."""
        try:
            summary = super().train(until)
        except Interrupted:
            self._send_quietly({"cmd": "done"})
            raise
        except (TrainingError, CommError):
            raise           # the workers saw the same numbers, or the group is broken already
        except BaseException as e:
            self._send_quietly({"cmd": "abort", "reason": f"rank 0 failed: {type(e).__name__}: {e}"})
            raise
        self._send({"cmd": "done"})
        return summary


class Worker:
    """A rank other than 0: builds the run rank 0 sends and follows its commands. ``run()``
    returns ``{"step", "losses"}`` when rank 0 says the run is done."""

    def __init__(self, comm: Communicator):
        if comm.rank == 0:
            raise ConfigError("rank 0 runs the DistributedTrainer, not a Worker")
        self.comm = comm
        plan = comm.broadcast_object(None, root=0)
        if plan.get("cmd") == "abort":
            raise CommError(f"rank {comm.rank}: {plan['reason']}")
        dev = comm.device
        self.cfg = TrainConfig.from_dict(dict(plan["train_config"], device=str(dev)))
        mcfg = GPT2Config.from_dict(plan["model"])
        masters, m, v = {}, {}, {}
        shapes = param_shapes(mcfg)
        for name in plan["names"]:
            for store in (masters, m, v):
                store[name] = zeros(shapes[name], plan["dtype"], dev)
                comm.broadcast(store[name], root=0)
        self.model = GPT2(mcfg, masters)
        opt = AdamW(self.model.params, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2),
                    weight_decay=self.cfg.weight_decay, compute_dtype="bfloat16" if plan["bf16"] else None)
        opt.load_state_dict(dict(plan["optimizer"], m={k: t.numpy() for k, t in m.items()},
                                 v={k: t.numpy() for k, t in v.items()}))
        self.loader = DataLoader(plan["data"], self.cfg.batch_size, self.cfg.block_size, seed=self.cfg.seed)
        self.loader.load_state_dict(plan["loader"])
        self.step = int(plan["step"])
        self.dp = DataParallel(comm, self.model, opt, zero=plan["zero"], bucket_mb=plan["bucket_mb"])
        self.losses: list = []
        self._signals = 0

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if self._signals > 1:
            raise KeyboardInterrupt

    def run(self) -> dict:
        """Follow rank 0's commands until ``done``; raises CommError on ``abort`` and
        TrainingError on a non-finite loss or norm (rank 0 raises it too, with its cause)."""
        # (a signal inherited as ignored stays ignored: nohup, a background job's SIGINT)
        old = take_signals(self._on_signal, (signal.SIGINT, signal.SIGTERM))
        try:
            while True:
                msg = self.comm.broadcast_object(None, root=0)
                cmd = msg.get("cmd")
                if cmd == "step":
                    if msg["step"] != self.step:
                        raise CommError(f"rank {self.comm.rank} is at step {self.step}, rank 0 at {msg['step']}")
                    lr, _, loss, norm, scale = _step(self.dp, self.loader, self.cfg, self.step, self.comm)
                    if not (math.isfinite(loss) and math.isfinite(norm)):
                        raise TrainingError(f"rank {self.comm.rank}: the loss is {loss} and the gradient norm {norm} "
                                            f"at step {self.step + 1}; rank 0 reports where it came from")
                    self.dp.update(lr, scale)
                    self.step += 1
                    self.losses.append(loss)
                elif cmd == "save":
                    self.dp.gather_state(root=0)
                elif cmd == "done":
                    return {"step": self.step, "losses": list(self.losses)}
                elif cmd == "abort":
                    raise CommError(f"rank {self.comm.rank}: rank 0 stopped the run: {msg.get('reason')}")
                else:
                    raise CommError(f"rank {self.comm.rank}: unknown command from rank 0: {msg!r}")
        finally:
            give_back_signals(old)


def train(config, comm: Communicator, *, zero: int = 0, bucket_mb: float = 25.0, resume: bool = False,
          overwrite: bool = False, log: Optional[Callable] = print):
    """Train ``config`` on every rank of ``comm``: rank 0 runs the ``DistributedTrainer``
    (and returns its summary), the others a ``Worker`` (and return ``{"step", "losses"}``).
    ``resume`` and ``overwrite`` as for ``Trainer``; the workers get everything from rank 0.
    One call per run: the workers end with it.

    >>> import tempfile, os
    >>> from forge_ml.distributed import launch
    >>> from forge_ml.train import TrainConfig
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("hello world\\n" * 300)
    >>> cfg = TrainConfig(data=p, out_dir=os.path.join(d, "run"), n_layer=1, n_head=2, n_embd=16, block_size=16,
    ...                   batch_size=2, grad_accum=2, max_steps=2, eval_interval=0, sample_interval=0, progress=False)
    >>> summary, worker = launch.threads(2, lambda comm: train(cfg, comm, zero=1, log=None))
    >>> summary["step"], worker["step"], summary["losses"] == worker["losses"]
    (2, 2, True)
    """
    if comm.rank == 0:
        return DistributedTrainer(config, comm, zero=zero, bucket_mb=bucket_mb, resume=resume,
                                  overwrite=overwrite, log=log).train()
    return Worker(comm).run()
