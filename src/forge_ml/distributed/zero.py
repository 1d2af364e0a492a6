"""ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", 2020), after llm.c's ``zero.cuh``: the AdamW moments, and the float32
master weights of a bf16 run, are sharded across the ranks.

The step, given gradients that ``DataParallel`` reduce-scattered (rank ``r`` holds the sum
over ranks of chunk ``r`` of every bucket):

1. each rank updates its shard only: one ``ops.adamw_update`` per piece of a parameter in
   its chunks (``Buckets.segments``), on windows of flat buffers, with that parameter's
   weight decay and step count: the same fused op and arithmetic as ``optim.AdamW``;
2. one all-gather per bucket of the updated parameters (the bf16 compute copies in a bf16
   run, half the bytes), into the flat buffer whose windows the model computes with.

Memory per rank: parameters and gradients whole, moments (and masters) ``1 / world_size``.
Checkpoints gather the shards (``gather_state``) into ``optim.AdamW.state_dict``'s format,
so a run saved with any number of ranks, or ZeRO stage, resumes with any other.
"""
from __future__ import annotations

from .. import ops
from ..errors import ConfigError
from ..optim import AdamW, _step_value, counters, grad_sumsq
from .buckets import Buckets, FlatBuffer
from .comm import Communicator


class ZeroAdamW:
    """AdamW sharded over ``comm``'s ranks. Built from an ``optim.AdamW`` (fresh, or
    restored from a checkpoint) whose state it takes over: hyper-parameters, step counts, and
    this rank's shard of the masters and moments. The model's parameter dict (``opt.compute``)
    is pointed at windows of one flat buffer that the all-gather fills. ``grads`` is the flat
    gradient buffer in ``buckets``' layout.

    >>> import numpy as np, forge_ml as fm
    >>> from forge_ml.distributed import launch
    >>> from forge_ml.distributed.buckets import Buckets, FlatBuffer
    >>> def fn(comm):
    ...     params = {"w": fm.tensor(np.ones((2, 2), np.float32))}
    ...     b = Buckets({"w": (2, 2)}, comm.world_size)
    ...     g = FlatBuffer(b.size, "float32", "cpu"); g.put(0, fm.tensor(np.ones(4, np.float32)))
    ...     z = ZeroAdamW(AdamW(params, lr=0.1, weight_decay=0.0), comm, b, g)
    ...     z.step()                  # rank 0 owns all of w (it fits its chunk); all-gather
    ...     return [round(x, 4) for x in params["w"].numpy().ravel().tolist()]
    >>> launch.threads(2, fn)
    [[0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    """

    def __init__(self, opt: AdamW, comm: Communicator, buckets: Buckets, grads: FlatBuffer):
        if not isinstance(opt, AdamW):
            raise ConfigError(f"ZeroAdamW: expected an optim.AdamW to shard, got {type(opt).__name__}")
        self.comm, self.buckets, self.grads = comm, buckets, grads
        self.lr, self.betas, self.eps, self.weight_decay = opt.lr, opt.betas, opt.eps, opt.weight_decay
        self.steps = opt.steps
        self.param_steps = dict(opt.param_steps)
        masters, lowp = opt.params, opt.lowp
        self.compute = opt.compute                  # the model's parameter dict
        first = next(iter(masters.values()))
        src = lowp if lowp is not None else masters
        # the whole parameters, flat; the model computes with windows of it
        self.flat = FlatBuffer(buckets.size, next(iter(src.values())).dtype, first.device)
        for name, (lo, hi) in buckets.offsets.items():
            self.flat.put(lo, src[name])
            self.compute[name] = self.flat.window(lo, hi, buckets.shapes[name])
        # this rank's shard: its chunk of every bucket, for the moments (and the masters in bf16)
        n = buckets.shard_size
        self.m = FlatBuffer(n, first.dtype, first.device)
        self.v = FlatBuffer(n, first.dtype, first.device)
        self._masters = FlatBuffer(n, first.dtype, first.device) if lowp is not None else None
        self.segments = buckets.segments(comm.rank)
        self._windows = []   # per segment: (master, grad, m, v, bf16 copy or None)
        for s in self.segments:
            stop = s.start + s.size
            self.m.put(s.shard, opt.m[s.name], s.start, stop)
            self.v.put(s.shard, opt.v[s.name], s.start, stop)
            if self._masters is not None:
                self._masters.put(s.shard, masters[s.name], s.start, stop)
                p, p_lowp = self._masters.window(s.shard, s.shard + s.size), self.flat.window(s.lo, s.hi)
            else:
                p, p_lowp = self.flat.window(s.lo, s.hi), None
            self._windows.append((p, grads.window(s.lo, s.hi), self.m.window(s.shard, s.shard + s.size),
                                  self.v.window(s.shard, s.shard + s.size), p_lowp))

    @property
    def params(self) -> dict:
        """The whole parameters this rank holds: the masters in a float32 run (the model's own
        tensors); in a bf16 run the bf16 compute copies (the float32 masters are sharded;
        ``gather_state`` collects them)."""
        return dict(self.compute)

    def grad_sumsq(self) -> float:
        """The sum of squares of this rank's shard of the (reduced) gradients, in float64 on
        the host (``optim.grad_sumsq`` over the segments; one device sync).

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     b = Buckets({"w": (4,)}, comm.world_size)          # w lies in rank 0's chunk
        ...     g = FlatBuffer(b.size, "float32", "cpu"); g.put(0, fm.tensor([1.0, 2.0, 3.0, 4.0]))
        ...     return ZeroAdamW(AdamW({"w": fm.tensor(np.ones(4, np.float32))}), comm, b, g).grad_sumsq()
        >>> launch.threads(2, fn)                                  # rank 1's chunk: padding only
        [30.0, 0.0]
        """
        host, dev = grad_sumsq({i: w[1] for i, w in enumerate(self._windows)})
        return host + (0.0 if dev is None else dev.item())

    def step(self, lr=None, grad_scale: float = 1.0) -> None:
        """Update this rank's shard from the reduce-scattered gradients (times ``grad_scale``),
        then all-gather the parameters bucket by bucket. Every rank must call it.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     b = Buckets({"w": (4,)}, comm.world_size)          # w lies in rank 0's chunk
        ...     g = FlatBuffer(b.size, "float32", "cpu"); g.put(0, fm.tensor([1.0, 2.0, 3.0, 4.0]))
        ...     w = {"w": fm.tensor(np.ones(4, np.float32))}
        ...     ZeroAdamW(AdamW(w, lr=0.1), comm, b, g).step(lr=0.5)   # Adam's first step: lr * sign(g)
        ...     return w["w"].numpy().round(4).tolist()
        >>> launch.threads(2, fn)                                  # rank 1 got rank 0's update
        [[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]
        """
        # checked before anything is counted or written, as AdamW.step checks them: a NaN or
        # infinite lr or factor would write NaN into every rank's shard, then every parameter
        lr = self.lr if lr is None else _step_value("step", "lr", lr)
        grad_scale = _step_value("step", "grad_scale", grad_scale, signed=True)
        self.steps += 1
        for k in self.param_steps:        # data parallelism gives every parameter a gradient
            self.param_steps[k] += 1
        b1, b2 = self.betas
        for s, (p, g, m, v, p_lowp) in zip(self.segments, self._windows):
            ops.adamw_update(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=self.eps,
                             weight_decay=self.weight_decay if len(self.buckets.shapes[s.name]) >= 2 else 0.0,
                             step=self.param_steps[s.name], grad_scale=float(grad_scale), p_lowp=p_lowp)
        for b in self.buckets.buckets:
            lo, hi = self.buckets.chunk(b, self.comm.rank)
            self.comm.all_gather(self.flat.data[lo:hi], self.flat.data[b.lo:b.hi])    # in place

    def gather_state(self, root: int = 0):
        """Collective: the whole optimizer state on rank ``root`` as ``{"params": name ->
        float32 master (NumPy), "optimizer": AdamW.state_dict()-format dict}``; None on the
        other ranks. One all-gather per bucket and sharded tensor, through one bucket-sized
        buffer.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.distributed import launch
        >>> def fn(comm):
        ...     b = Buckets({"w": (4,)}, comm.world_size)          # w lies in rank 0's chunk
        ...     g = FlatBuffer(b.size, "float32", "cpu"); g.put(0, fm.tensor([1.0, 2.0, 3.0, 4.0]))
        ...     z = ZeroAdamW(AdamW({"w": fm.tensor(np.ones(4, np.float32))}, lr=0.5), comm, b, g)
        ...     z.step()
        ...     s = z.gather_state(root=0)
        ...     return s and (s["params"]["w"].round(4).tolist(), s["optimizer"]["step"])
        >>> launch.threads(2, fn)
        [([0.5, 0.5, 0.5, 0.5], 1), None]
        """
        comm, bk = self.comm, self.buckets
        is_root = comm.rank == root
        out = {"m": {}, "v": {}, "params": {}}
        sharded = [("m", self.m), ("v", self.v)] + ([("params", self._masters)] if self._masters else [])
        whole = FlatBuffer(max(b.size for b in bk.buckets), self.m.dtype, self.m.device)
        for b in bk.buckets:
            for key, buf in sharded:
                comm.all_gather(buf.data[b.shard:b.shard + b.chunk], whole.data[:b.size])
                if is_root:
                    comm.synchronize()
                    host = whole.host(0, b.size)
                    for name in b.names:
                        lo, hi = bk.offsets[name]
                        out[key][name] = host[lo - b.lo:hi - b.lo].reshape(bk.shapes[name]).copy()
        comm.synchronize()
        if not is_root:
            return None
        if self._masters is None:
            out["params"] = {k: self.compute[k].numpy() for k in bk.shapes}
        return {"params": out["params"], "optimizer": dict(counters(self), m=out["m"], v=out["v"])}
