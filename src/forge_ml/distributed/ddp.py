"""Data-parallel training of one model over a communicator, with gradient buckets and an
optional ZeRO-1 optimizer.

One step of ``DataParallel`` on every rank:

1. ``gradients(batches)``: forward and backward of this rank's micro-batches, each gradient
   added into one flat float32 (float64) buffer laid out in ``Buckets``; then one collective
   per bucket, an all-reduce (``zero=0``) or a reduce-scatter (``zero=1``); then the loss,
   the micro-batch count and the gradient norm summed over ranks;
2. ``update(lr, scale)``: AdamW over the whole gradients on every rank (``zero=0``), or on
   this rank's shard followed by an all-gather of the parameters (``zero=1``,
   ``zero.ZeroAdamW``).

Averaging: gradients are summed across ranks, and ``1 / (micro-batches over all ranks)``
rides in AdamW's ``grad_scale`` with the clip factor, where the single-rank trainer puts its
``1 / grad_accum``: the mean without an extra pass over the gradients, and a step that
equals the single-rank step on the same global batch up to the order of the additions.

Overlap: the tape's ``backward`` returns every gradient at the end of its sweep, so the
bucket collectives start after the backward of the last micro-batch (post-backward), in
bucket order. The layout is the one overlap needs (parameters in the order the sweep
finishes them); with a "gradient final" hook in ``Tape.backward`` each bucket would start as
its last gradient lands, on a communication stream ordered by a CUDA event.

Batches (``rank_batches``): every rank's DataLoader has the same seed and state and walks
the same stream of micro-batches; micro-batch ``j`` of a step goes to rank ``j % world_size``
(the others' are drawn and dropped). So the global batch, the dropout seeds (from ``j``) and
the data position a checkpoint stores do not depend on the number of ranks.
"""
from __future__ import annotations

import json
import math

from .. import ops
from ..errors import ConfigError, DeviceError, ShapeError, TrainingError
from ..ops import clip_from_sumsq
from ..optim import AdamW, clip_grad_norm, counters
from .buckets import Buckets, FlatBuffer
from .comm import Communicator
from .zero import ZeroAdamW


def _run_difference(mine: dict, ref: dict, rank: int) -> str:
    """The first way ``mine`` (rank ``rank``'s summary from ``DataParallel._check_same_run``)
    differs from rank 0's ``ref``, in words; "" when it does not.

    >>> _run_difference({"zero": 1, "sumsq": [2.0]}, {"zero": 0, "sumsq": [2.0]}, 3)
    'zero is 1 on rank 3, 0 on rank 0'
    """
    def says(what, a, b) -> str:
        return f"{what} is {str(a)[:100]} on rank {rank}, {str(b)[:100]} on rank 0"

    for key in ("parameters", "model", "bf16", "zero", "bucket_mb"):
        a, b = mine.get(key), ref.get(key)
        if a == b:
            continue
        if key == "parameters":
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                return says("the number of parameters", len(a), len(b))
            return says(f"parameter {i + 1} (name, shape, dtype)", a[i], b[i])
        if key == "model":
            a, b = a or {}, b or {}
            k = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            return says(f"the model config's {k}", a.get(k), b.get(k))
        return says(key, a, b)
    for key, b in ref["optimizer"].items():
        if mine["optimizer"].get(key) != b:
            return says(f"AdamW's {key}", mine["optimizer"].get(key), b)
    for (name, _, _), a, b in zip(mine["parameters"], mine["sumsq"], ref["sumsq"]):
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30):    # NaN differs too
            return says(f"the sum of squares of parameter {name}", f"{a:.7g}", f"{b:.7g}")
    return ""


def rank_batches(loader, n: int, rank: int, world_size: int) -> list:
    """The next ``n`` micro-batches of ``loader``'s stream, keeping those of ``rank``:
    micro-batch ``j`` goes to rank ``j % world_size``. Returns ``[(j, x, y), ...]``. Every
    rank's loader must have the same seed and state (the stream is global).

    >>> import tempfile, os
    >>> from forge_ml.data import DataLoader, write_shard
    >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(100))
    >>> [j for j, x, y in rank_batches(DataLoader(p, 2, 4), 5, 1, 2)]
    [1, 3]
    """
    out = []
    for j in range(n):
        x, y = loader.next_batch()
        if j % world_size == rank:
            out.append((j, x, y))
    return out


class DataParallel:
    """Data-parallel steps of ``model`` (a ``GPT2``, or anything with ``loss_and_grads``) with
    the AdamW ``opt`` that owns its parameters, over ``comm``. Every rank builds it from the
    same weights and optimizer state. ``zero=1`` shards the optimizer (``ZeroAdamW``, which
    then becomes ``self.opt`` and points the model at its flat parameter buffer);
    ``bucket_mb`` is the bucket size in MB (0: one bucket per parameter).

    >>> import numpy as np, forge_ml as fm
    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml.distributed import launch
    >>> def rank_fn(comm):
    ...     model = GPT2.init(GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8), seed=0)
    ...     dp = DataParallel(comm, model, AdamW(model.params, lr=1e-2), zero=1)
    ...     ids = np.arange(8).reshape(2, 4) + comm.rank          # each rank: its own micro-batch
    ...     loss, norm, scale = dp.gradients([(fm.tensor(ids), fm.tensor(ids + 1), 0)], max_norm=1.0)
    ...     dp.update(1e-2, scale)
    ...     state = dp.gather_state(root=0)                       # a checkpoint's content, on rank 0
    ...     return round(loss, 6), round(norm, 6), state is None or state["optimizer"]["step"]
    >>> a, b = launch.threads(2, rank_fn)
    >>> a[:2] == b[:2], a[2], b[2]
    (True, 1, True)
    """

    def __init__(self, comm: Communicator, model, opt: AdamW, *, zero: int = 0, bucket_mb: float = 25.0):
        if zero not in (0, 1):
            raise ConfigError(f"DataParallel: zero must be 0 (replicated AdamW) or 1 (sharded AdamW), got {zero!r}")
        if not isinstance(opt, AdamW):
            raise ConfigError(f"DataParallel: expected an optim.AdamW, got {type(opt).__name__}")
        masters = opt.params
        first = next(iter(masters.values()))
        if first.device != comm.device:
            raise DeviceError(f"DataParallel: the parameters are on {first.device} but the communicator "
                              f"moves data on {comm.device}")
        self.comm, self.model, self.zero = comm, model, zero
        if comm.world_size > 1:
            self._check_same_run(opt, zero, bucket_mb)
        shapes = {k: p.shape for k, p in masters.items()}
        self.buckets = Buckets(shapes, comm.world_size, bucket_mb, itemsize=first.dtype.itemsize)
        self.grads = FlatBuffer(self.buckets.size, first.dtype, first.device)   # float32 (float64) sums
        self.grad_views = {k: self.grads.window(lo, hi, shapes[k]) for k, (lo, hi) in self.buckets.offsets.items()}
        self.opt = ZeroAdamW(opt, comm, self.buckets, self.grads) if zero == 1 else opt

    def _check_same_run(self, opt: AdamW, zero: int, bucket_mb: float) -> None:
        """Collective: every rank holds what rank 0 holds (parameter names, shapes and dtype,
        a sum of squares of each parameter, AdamW's hyper-parameters and step counts, ``zero``
        and ``bucket_mb``), or every rank raises the same ConfigError naming the first rank
        that differs and how. Ranks built from different seeds (or checkpoints, or learning
        rates) would otherwise train apart in silence with ``zero=0``, and with ``zero=1``
        stitch one model from every rank's shard of its own. (Weights are checked, not
        broadcast from rank 0 as torch's DDP does: a bf16 run's compute copies come from them.)
        """
        comm = self.comm
        mine = {"parameters": [[k, list(p.shape), p.dtype.name] for k, p in opt.params.items()],
                "zero": zero, "bucket_mb": bucket_mb, "bf16": opt.lowp is not None,
                "optimizer": counters(opt),
                "sumsq": [float(ops.sumsq(p).item()) for p in opt.params.values()]}
        config = getattr(self.model, "config", None)
        if hasattr(config, "to_dict"):          # GPT2Config: n_head or dropout change no shape
            mine["model"] = config.to_dict()
        mine = json.loads(json.dumps(mine))          # as rank 0's comes: tuples are lists
        ref = comm.broadcast_object(mine, root=0)
        why = "" if comm.rank == 0 else _run_difference(mine, ref, comm.rank)
        flags = [0.0] * comm.world_size
        flags[comm.rank] = 1.0 if why else 0.0
        bad = [r for r, f in enumerate(comm.all_reduce_floats(flags)) if f]
        if bad:
            why = comm.broadcast_object(why if comm.rank == bad[0] else None, root=bad[0])
            more = f" (and rank(s) {', '.join(map(str, bad[1:]))})" if bad[1:] else ""
            raise ConfigError(f"data parallel: rank {bad[0]}{more} was not built like rank 0: "
                              f"{why}; every rank must build the model and its AdamW from the same "
                              f"config, weights (seed or checkpoint) and optimizer state, with the "
                              f"same zero and bucket_mb")

    def _accumulate(self, grads: dict, first: bool) -> None:
        for name, (lo, _) in self.buckets.offsets.items():
            g = grads.get(name)
            if g is None:
                raise TrainingError(f"data parallel: parameter {name} got no gradient; every parameter must "
                                    f"take part in the loss (its bucket would hold stale values)")
            if tuple(g.shape) != self.buckets.shapes[name]:
                # (a larger one was written over its neighbours' gradients in the flat buffer)
                raise ShapeError(f"data parallel: the gradient of {name} has shape "
                                 f"{tuple(g.shape)}, the parameter {self.buckets.shapes[name]}")
            self.grads.put(lo, g, add=not first)
        unknown = [k for k in grads if k not in self.buckets.offsets]
        if unknown:   # (AdamW.step refuses them: a renamed gradient left its parameter unchanged)
            raise ConfigError(f"data parallel: gradients for {len(unknown)} name(s) that are not "
                              f"parameters of the optimizer: {sorted(map(str, unknown))[:5]}")

    def _reduce(self) -> None:
        """One collective per bucket, in bucket order (the same on every rank)."""
        comm = self.comm
        for b in self.buckets.buckets:
            whole = self.grads.data[b.lo:b.hi]
            if self.zero == 0:
                comm.all_reduce(whole, "sum")
            else:
                lo, hi = self.buckets.chunk(b, comm.rank)
                comm.reduce_scatter(whole, self.grads.data[lo:hi], "sum")       # in place
        comm.synchronize()  # bounded by the timeout; no host read may wait on a collective unbounded

    def gradients(self, batches, max_norm: float = 0.0) -> tuple:
        """Forward and backward of this rank's micro-batches ``[(x, y, dropout_seed), ...]``,
        gradients summed across ranks. Returns ``(loss, norm, scale)``, the same on every
        rank: the mean loss over every rank's micro-batches, the global gradient norm of
        their mean, and the ``grad_scale`` for ``update`` (the mean's 1/n times the clip
        factor of ``optim.clip_grad_norm``; ``max_norm <= 0`` does not clip). Collective.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     model = GPT2.init(GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8), seed=0)
        ...     dp = DataParallel(comm, model, AdamW(model.params, lr=1e-2))
        ...     ids = fm.tensor(np.arange(4).reshape(1, 4) + comm.rank)   # each rank: its own batch
        ...     return dp.gradients([(ids, ids, 0)])
        >>> (loss_a, norm_a, scale_a), (loss_b, norm_b, scale_b) = launch.threads(2, fn)
        >>> loss_a == loss_b, norm_a == norm_b, scale_a             # 1 / (2 micro-batches in all)
        (True, True, 0.5)
        """
        n_local, loss_sum = 0, 0.0
        for x, y, seed in batches:
            loss, grads = self.model.loss_and_grads(x, y, dropout_seed=seed)
            self._accumulate(grads, first=n_local == 0)
            del grads
            loss_sum += loss
            n_local += 1
        if n_local == 0:
            self.grads.fill(0.0)
        self._reduce()
        sq_local = self.opt.grad_sumsq() if self.zero == 1 else 0.0
        loss_total, n_total, sq = self.comm.all_reduce_floats([loss_sum, n_local, sq_local])
        n_total = int(round(n_total))
        if n_total < 1:
            raise ConfigError("data parallel: no rank had a micro-batch in this step")
        inv = 1.0 / n_total
        if self.zero == 0:
            norm, scale = clip_grad_norm(self.grad_views, max_norm, grad_scale=inv)
        else:   # the shards' squares, summed over the ranks
            norm, scale = clip_from_sumsq(sq, max_norm, grad_scale=inv)
        return loss_total / n_total, norm, scale

    def update(self, lr: float, scale: float) -> None:
        """The AdamW step with ``grad_scale=scale`` (from ``gradients``). Collective.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     model = GPT2.init(GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8), seed=0)
        ...     dp = DataParallel(comm, model, AdamW(model.params, lr=1e-2), zero=1)
        ...     ids = fm.tensor(np.arange(4).reshape(1, 4) + comm.rank)
        ...     w0 = model.params["wte.weight"].numpy()
        ...     dp.update(1e-2, dp.gradients([(ids, ids, 0)])[2])
        ...     return w0, model.params["wte.weight"].numpy()
        >>> (w0, a), (_, b) = launch.threads(2, fn)
        >>> np.array_equal(a, b), np.array_equal(a, w0)              # one step, the same on every rank
        (True, False)
        """
        if self.zero == 0:
            self.opt.step(self.grad_views, lr=lr, grad_scale=scale)
        else:
            self.opt.step(lr=lr, grad_scale=scale)
            self.comm.synchronize()

    def gather_state(self, root: int = 0):
        """Collective: ``{"params": name -> float32 master (NumPy), "optimizer":
        AdamW.state_dict()}`` on rank ``root`` (what a checkpoint stores, whatever the number
        of ranks or the ZeRO stage), None on the others.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     model = GPT2.init(GPT2Config(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8), seed=0)
        ...     return DataParallel(comm, model, AdamW(model.params, lr=1e-2), zero=1).gather_state(root=1)
        >>> a, b = launch.threads(2, fn)
        >>> a, b["params"]["wte.weight"].shape, b["optimizer"]["step"]
        (None, (11, 8), 0)
        """
        if self.zero == 1:
            return self.opt.gather_state(root)
        if self.comm.rank != root:
            return None
        return {"params": {k: p.numpy() for k, p in self.opt.params.items()}, "optimizer": self.opt.state_dict()}
