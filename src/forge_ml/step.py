"""The training step as one piece of device work: every micro-batch's forward and backward,
the gradient clipping and the AdamW update, with each value that changes from one step to the
next (the batches, the dropout seeds, the learning rate, AdamW's bias corrections) written
into device memory first. The step then never waits for the device inside, and where the
backend captures graphs (``graph.capture``) it is recorded once and replayed: one launch per
step instead of a host call per kernel, which is what bounds small models.

The eager step (``Trainer.train_step`` without a ``TrainStep``, or ``TrainStep(graph=False)``)
computes the same thing bit for bit: the same ops in the same order, the kernels reading
from device memory the values the host would have passed. A step whose loss or gradient norm
is not finite updates nothing (``ops.clip_scale`` writes NaN as the factor, and the AdamW
kernels skip), so the caller can stop with the model untouched, as the eager step does.

>>> import numpy as np, forge_ml as fm
>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> model = GPT2.init(GPT2Config(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
>>> opt = fm.optim.AdamW(model.params, lr=1e-2)
>>> step = TrainStep(model, opt, batch=2, block=8, accum=1, max_norm=1.0)
>>> x = np.arange(16).reshape(2, 8) % 16
>>> out = step.run([(x, (x + 1) % 16)], seeds=[0], lr=1e-2)
>>> out.taken, opt.steps, step.mode
(True, 1, 'eager')

``submit`` queues a step and returns at once, so the host can prepare the next one while the
device works; its ``result()`` waits (``run`` is the two together):

>>> pending = step.submit([(x, (x + 1) % 16)], seeds=[1], lr=1e-2)
>>> pending.result().taken, opt.steps
(True, 2)

``preload`` queues the next step's values behind the step in flight, so that nothing is
copied between the two (``submit`` of the same batches then writes nothing):

>>> nxt = [(x, (x + 2) % 16)]
>>> pending = step.submit([(x, (x + 1) % 16)], seeds=[2], lr=1e-2)
>>> step.preload(nxt, seeds=[3], lr=1e-2)
>>> pending.result().taken, step.submit(nxt, seeds=[3], lr=1e-2).result().taken, opt.steps
(True, True, 4)
"""
from __future__ import annotations

import math
import numbers
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from . import graph as _graph
from . import ops
from .errors import CaptureError, ConfigError, DTypeError, ShapeError
from .optim import AdamW, accumulate, clip_on_device
from .tensor import host_buffer, zeros


class StepResult(NamedTuple):
    """What one step gives back: each micro-batch's loss, the gradient norm (of the averaged
    gradients, before clipping) and whether the update was taken.

    >>> import numpy as np
    >>> from forge_ml.models import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    >>> step = TrainStep(model, AdamW(model.params, lr=1e-2), batch=2, block=4)
    >>> ids = np.arange(8).reshape(2, 4) % 10
    >>> r = step.run([(ids, (ids + 1) % 10)], seeds=[0], lr=1e-2)
    >>> [round(x, 1) for x in r.losses], round(r.norm, 2), r.taken     # loss ~ ln(10) at init
    ([2.3], 1.25, True)
    """
    losses: List[float]
    norm: float
    taken: bool


class PendingStep:
    """A step queued on the device by ``TrainStep.submit``. ``result()`` waits for it, once:
    the losses and the step's norm and verdict were queued to host memory behind the step, so
    that is one wait for all of them. ``TrainStep.submit`` reads a step nobody read first.

    >>> import numpy as np
    >>> from forge_ml.models import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    >>> step = TrainStep(model, AdamW(model.params, lr=1e-2), batch=2, block=4)
    >>> ids = np.arange(8).reshape(2, 4) % 10
    >>> pending = step.submit([(ids, (ids + 1) % 10)], seeds=[0], lr=1e-2)
    >>> type(pending).__name__, pending.result() is pending.result()     # read once, kept
    ('PendingStep', True)
    """

    def __init__(self, owner: "TrainStep", losses, copies):
        self._owner, self._losses, self._copies = owner, losses, copies
        self._result: Optional[StepResult] = None

    def result(self) -> StepResult:
        """Wait for the step and read it: the ``StepResult``. A step taken counts in the
        optimizer's step counters from then on (``AdamW.advance``).

        >>> import numpy as np
        >>> from forge_ml.models import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> opt = AdamW(model.params, lr=1e-2)
        >>> step = TrainStep(model, opt, batch=2, block=4)
        >>> ids = np.arange(8).reshape(2, 4) % 10
        >>> pending = step.submit([(ids, (ids + 1) % 10)], seeds=[0], lr=1e-2)
        >>> opt.steps, pending.result().taken, opt.steps
        (0, True, 1)
        """
        if self._result is None:
            for c in self._copies:
                if c is not None:
                    c.synchronize()
            owner = self._owner
            values = [float(buf[0]) if buf is not None else float(t.item())
                      for t, buf in zip(self._losses, owner._loss_host)]
            s = owner._scalars_host
            taken = math.isfinite(float(s[3]))
            if taken:
                owner.opt.advance()
            else:   # a preload's values were for the step after a taken one
                owner._preloaded = None
            self._result = StepResult(values, float(s[4]), taken)
            if owner._pending is self:
                owner._pending = None
        return self._result


class TrainStep:
    """One optimizer step over ``accum`` micro-batches of ``(batch, block)`` token ids.

    ``graph``: capture the step as a graph where the device's backend can (the first ``run``
    runs for real, compiling every kernel, and is then captured; every later run replays).
    ``mode`` says which ran last (``"eager"`` or ``"graph"``); ``why_eager`` why a wanted
    graph is not used (a capture that failed: the step stays eager, nothing is lost).

    >>> import numpy as np
    >>> from forge_ml.models import GPT2, GPT2Config
    >>> from forge_ml.optim import AdamW
    >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8))
    >>> step = TrainStep(model, AdamW(model.params, lr=1e-2), batch=2, block=4)
    >>> ids = np.arange(8).reshape(2, 4) % 10
    >>> r = step.run([(ids, (ids + 1) % 10)], seeds=[0], lr=1e-2)
    >>> len(r.losses), r.taken, step.mode
    (1, True, 'eager')

    ``submit`` queues a step without waiting, and ``preload`` the next one's values behind it:

    >>> pending = step.submit([(ids, (ids + 1) % 10)], seeds=[1], lr=1e-2)
    >>> nxt = [(ids[::-1].copy(), ids)]
    >>> step.preload(nxt, seeds=[2], lr=1e-2)       # while the step runs
    >>> pending.result().taken, step.submit(nxt, seeds=[2], lr=1e-2).result().taken
    (True, True)
    """

    def __init__(self, model, opt: AdamW, batch: int, block: int, accum: int = 1,
                 max_norm: float = 1.0, graph: bool = False):
        for name, v in (("batch", batch), ("block", block), ("accum", accum)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ShapeError(f"TrainStep: {name} must be a whole number, got {v!r}")
        if batch < 1 or block < 1 or accum < 1:
            raise ShapeError(f"TrainStep: batch, block and accum must be >= 1, got {batch}, {block}, {accum}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or math.isnan(max_norm):
            raise ConfigError(f"TrainStep: max_norm must be a number (<= 0: no clipping), got {max_norm!r}")
        self.model, self.opt = model, opt
        self.shape, self.accum, self.max_norm = (int(batch), int(block)), int(accum), float(max_norm)
        dev = next(iter(opt.params.values())).device
        self.device = dev
        self.xs = [zeros(self.shape, "int64", dev) for _ in range(accum)]
        self.ys = [zeros(self.shape, "int64", dev) for _ in range(accum)]
        self.seeds = [zeros((1,), "int64", dev) for _ in range(accum)]
        self.want_graph = bool(graph) and _graph.available(dev)
        self.why_eager: Optional[str] = None if self.want_graph or not graph else \
            f"the {dev.type} backend cannot capture graphs"
        self._graph = None
        self.mode = "eager"
        self._keep = None      # the memory a failed capture's real run left its tensors in
        lowp = opt.lowp
        self._accum_f32 = self.accum > 1 and lowp is not None   # bf16 grads add up in float32
        # where the step's results land on the host (page-locked on the GPU: the copies run
        # behind the step, and one wait covers them); made at the first step, when the
        # losses' dtype is known. Only one step is in flight, so one set serves every step.
        self._loss_host: Optional[list] = None
        self._scalars_host = host_buffer((len(ops.STEP_SCALARS),), "float64", dev)
        self._pending: Optional[PendingStep] = None
        # preload's page-locked copies of a step's values, two sets used in turn: the set a
        # preload writes was last read by the copies before the step before the one in flight
        self._host_in: list = []
        self._preloaded = None   # (batches, seeds, lr) whose values are queued for the device

    # -- the work -----------------------------------------------------------------------------
    def _work(self):
        """Queue the whole step on the device; returns the micro-batches' 0-d losses."""
        scalars = self.opt.scalars
        acc, losses = None, []
        for i in range(self.accum):
            loss, grads = self.model.grads(self.xs[i], self.ys[i], dropout_seed=self.seeds[i])
            acc = accumulate(acc, grads, self._accum_f32)
            losses.append(loss)
        check = losses[0]
        for loss in losses[1:]:
            check = ops.add(check, loss)
        clip_on_device(acc, self.max_norm, scalars, grad_scale=1.0 / self.accum, check=check)
        self.opt.update(acc, scalars)
        return tuple(losses)

    def _arrays(self, batches: Sequence, seeds: Sequence[int]) -> list:
        """The micro-batches as ``(x, y, seed)`` int64 host arrays, checked against the step."""
        if len(batches) != self.accum or len(seeds) != self.accum:
            raise ShapeError(f"TrainStep.run: expected {self.accum} micro-batches and seeds, got "
                             f"{len(batches)} and {len(seeds)}")
        out = []
        for i, (x, y) in enumerate(batches):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != self.shape or y.shape != self.shape:
                raise ShapeError(f"TrainStep.run: micro-batch {i} is {x.shape}/{y.shape}; this "
                                 f"step was built for {self.shape}")
            for name, a in (("ids", x), ("targets", y)):
                if a.dtype.kind not in "iu":     # float ids were cast, and trained on, in silence
                    raise DTypeError(f"TrainStep.run: micro-batch {i}'s {name} are {a.dtype}; expected "
                                     f"integer token ids")
            seed = seeds[i]
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
                raise ConfigError(f"TrainStep.run: seed {i} must be a whole number in [0, 2**64), got {seed!r}")
            out.append((x, y, np.array([int(seed)], np.uint64).view(np.int64)))
        return out

    def _load(self, batches: Sequence, seeds: Sequence[int], lr: float) -> None:
        for i, (x, y, seed) in enumerate(self._arrays(batches, seeds)):
            ops.assign(self.xs[i], x)
            ops.assign(self.ys[i], y)
            ops.assign(self.seeds[i], seed)
        self.opt.prepare(lr, grad_scale=1.0 / self.accum)

    def preload(self, batches: Sequence, seeds: Sequence[int], lr: float) -> None:
        """Queue the next step's values (``submit``'s arguments) behind the step in flight:
        they reach the device as that step ends, with no wait on the host, and ``submit`` of
        the same ``batches`` object, seeds and lr then writes nothing. The values are those of
        the step after a taken one: a step in flight that is not taken drops the preload (its
        ``submit`` then writes the values itself). Example: the class docstring's.
        """
        arrays = self._arrays(batches, seeds)
        if self.opt.scalars is None:
            self.opt.prepare(lr, grad_scale=1.0 / self.accum)
        if not self._host_in:
            def one_set():
                def buf(shape, dtype):
                    return host_buffer(shape, dtype, self.device)
                return ([(buf(self.shape, "int64"), buf(self.shape, "int64"), buf((1,), "int64"))
                         for _ in range(self.accum)],
                        buf((len(ops.STEP_SCALARS),), "float64"))
            self._host_in = [one_set(), one_set()]
        self._host_in.reverse()
        micro, scalars = self._host_in[0]
        ahead = int(self._pending is not None and self._pending._result is None)
        np.copyto(scalars, self.opt._step_values(lr, 1.0 / self.accum, ahead))
        for (x, y, seed), (hx, hy, hs), tx, ty, ts in zip(arrays, micro, self.xs, self.ys,
                                                          self.seeds):
            np.copyto(hx, x)
            np.copyto(hy, y)
            np.copyto(hs, seed)
            tx.copy_from_host(hx)
            ty.copy_from_host(hy)
            ts.copy_from_host(hs)
        self.opt.scalars.copy_from_host(scalars)
        self._preloaded = self._key(batches, seeds, lr)

    @staticmethod
    def _key(batches, seeds, lr) -> tuple:
        """What a preload is matched on: the batches object itself, the seeds and the lr."""
        return batches, tuple(int(v) for v in seeds), float(lr)

    def submit(self, batches: Sequence, seeds: Sequence[int], lr: float) -> PendingStep:
        """Queue one step and return without waiting for the device: ``batches`` are
        ``accum`` pairs of host ``(ids, targets)`` arrays, ``seeds`` the micro-batches' dropout
        seeds (``train.dropout_seed``). The host is free while the step runs (the trainer draws
        the next batches then); ``result()`` of what comes back waits and reads the step. A
        step still unread when the next is submitted is read first (its optimizer count).
        Example: the class docstring's.
        """
        if self._pending is not None:
            self._pending.result()
        pre, self._preloaded = self._preloaded, None
        key = self._key(batches, seeds, lr)
        if pre is None or pre[0] is not batches or pre[1:] != key[1:]:
            self._load(batches, seeds, lr)
        if self._graph is not None:
            self._graph.replay()
            losses, self.mode = self._graph.outputs, "graph"
        elif self.want_graph:
            losses, self.mode = self._capture(), "eager"   # a real run, then captured
        else:
            losses, self.mode = self._work(), "eager"
        if self._loss_host is None:
            self._loss_host = [host_buffer((1,), t.dtype.name, self.device)
                               if t.dtype.name in ("float32", "float64") else None for t in losses]
        copies = [t.copy_to_host(buf) for t, buf in zip(losses, self._loss_host) if buf is not None]
        copies.append(self.opt.scalars.copy_to_host(self._scalars_host))
        self._pending = PendingStep(self, losses, copies)
        return self._pending

    def run(self, batches: Sequence, seeds: Sequence[int], lr: float) -> StepResult:
        """One step, waited for: ``submit(batches, seeds, lr).result()``. ``taken`` False: a
        loss or the norm was not finite and nothing was updated (the optimizer's step count
        too). Example: the class docstring's."""
        return self.submit(batches, seeds, lr).result()

    def _capture(self):
        """Run the step for real and capture it (``graph.capture(run_first=True)``); returns
        that run's losses. A capture that fails leaves the step eager from then on (why in
        ``why_eager``); the real run's work stands, so nothing is done twice."""
        try:
            self._graph = _graph.capture(self.device, self._work, run_first=True)
            return self._graph.first
        except CaptureError as e:   # e.g. an op that waits for the device
            cause = e.__cause__ or e
            self._keep, self.want_graph = e.keep, False
            self.why_eager = f"capture failed ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})"
            return e.first

    def release(self) -> None:
        """Drop the captured graph and give its memory back (before evaluation or sampling,
        which run op by op: they would otherwise hold a second copy beside the graph's). The
        next run captures again after one real run. (On the CPU, never a graph: nothing to drop.)

        >>> import numpy as np
        >>> from forge_ml.models import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = TrainStep(model, AdamW(model.params, lr=1e-2), batch=2, block=4, graph=True)
        >>> ids = np.arange(8).reshape(2, 4) % 10
        >>> step.run([(ids, (ids + 1) % 10)], seeds=[0], lr=1e-2).taken
        True
        >>> step.release()                  # e.g. before evaluating; the next run captures anew
        >>> step.run([(ids, (ids + 1) % 10)], seeds=[1], lr=1e-2).taken, step.why_eager
        (True, 'the cpu backend cannot capture graphs')
        """
        if self._pending is not None:   # a step still running reads the graph's memory
            self._pending.result()
        if self._graph is not None:
            self._graph.release()
        self._graph = None
        self._keep = None
