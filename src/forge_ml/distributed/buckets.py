"""The flat layout data parallelism works on: every parameter (or gradient) at an offset of
one 1-D buffer, the buffer cut into buckets, each bucket cut into one equal chunk per rank.

- ``Buckets``: the layout. Parameters go in reverse order of registration (the order the
  backward sweep finishes their gradients, as in PyTorch DDP); a bucket closes once it holds
  ``bucket_mb`` MB (a larger parameter gets a bucket to itself; 0 gives one bucket per
  parameter) and is padded to a multiple of ``world_size * ALIGN`` elements, so that every
  rank's chunk has the same size and starts aligned. A bucket is the unit of one collective
  (all-reduce, or ZeRO-1's reduce-scatter and all-gather); rank ``r``'s shard is chunk ``r``
  of every bucket, and ``segments(r)`` lists the pieces of parameters inside it.
- ``FlatBuffer``: one 1-D array on a device and Tensor windows onto it.

>>> b = Buckets({"w": (4, 3), "b": (3,)}, world_size=2, bucket_mb=0)   # one bucket per parameter
>>> b.offsets, [(k.lo, k.hi, k.names) for k in b.buckets]
({'b': (0, 3), 'w': (128, 140)}, [(0, 128, ('b',)), (128, 256, ('w',))])
>>> [(s.name, s.lo, s.hi, s.start) for s in b.segments(0)]
[('b', 0, 3, 0), ('w', 128, 140, 0)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtype as _dt
from ..errors import ConfigError
from ..tensor import Tensor, zeros

ALIGN = 64  # elements: every rank's chunk of a bucket starts on a 256-byte boundary in float32


@dataclass(frozen=True)
class Bucket:
    """Flat range ``[lo, hi)`` holding the parameters ``names``; ``chunk`` elements per rank;
    ``shard``: where each rank's chunk of it starts inside that rank's shard."""

    lo: int
    hi: int
    names: tuple
    chunk: int
    shard: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Segment:
    """The piece ``[lo, hi)`` (flat offsets) of parameter ``name`` that lies in one rank's
    chunk of a bucket: it starts at element ``start`` of the flattened parameter and at
    ``shard`` in that rank's shard."""

    name: str
    lo: int
    hi: int
    start: int
    shard: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


class Buckets:
    """The flat, bucketed layout of parameters ``shapes`` (name -> shape, in registration
    order) for ``world_size`` ranks. ``offsets[name]`` is its flat range, ``buckets`` the
    buckets in flat order, ``size`` the padded total and ``shard_size`` one rank's share.

    >>> b = Buckets({"a": (10,), "b": (20,)}, world_size=4, bucket_mb=25)   # one bucket
    >>> b.size, b.shard_size, b.chunk(b.buckets[0], 1)
    (256, 64, (64, 128))
    """

    def __init__(self, shapes: dict, world_size: int, bucket_mb: float = 25.0, itemsize: int = 4):
        if int(world_size) < 1:
            raise ConfigError(f"Buckets: world_size must be >= 1, got {world_size}")
        if not bucket_mb >= 0 or not math.isfinite(bucket_mb):
            raise ConfigError(f"Buckets: bucket_mb must be a number >= 0, got {bucket_mb}")
        self.world_size = int(world_size)
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        cap = bucket_mb * 2 ** 20 / itemsize       # elements
        step = self.world_size * ALIGN
        self.offsets: dict = {}
        self.buckets: list = []
        pos = start = shard = 0
        names: list = []
        order = list(self.shapes)[::-1]
        for i, name in enumerate(order):
            n = math.prod(self.shapes[name])
            self.offsets[name] = (pos, pos + n)
            pos += n
            names.append(name)
            if pos - start >= cap or i == len(order) - 1:
                end = start + -(-(pos - start) // step) * step
                b = Bucket(start, end, tuple(names), (end - start) // self.world_size, shard)
                self.buckets.append(b)
                shard += b.chunk
                pos = start = end
                names = []
        self.size = pos
        self.shard_size = shard

    def chunk(self, b: Bucket, rank: int) -> tuple:
        """Rank ``rank``'s flat range of bucket ``b``.

        >>> b = Buckets({"w": (100,)}, world_size=2)        # one bucket, padded to 128
        >>> [b.chunk(b.buckets[0], r) for r in (0, 1)]
        [(0, 64), (64, 128)]
        """
        return b.lo + rank * b.chunk, b.lo + (rank + 1) * b.chunk

    def segments(self, rank: int) -> list:
        """The pieces of parameters in rank ``rank``'s shard, bucket by bucket (padding left out).

        >>> b = Buckets({"w": (100,)}, world_size=2)
        >>> [(s.lo, s.hi, s.start, s.shard) for r in (0, 1) for s in b.segments(r)]
        [(0, 64, 0, 0), (64, 100, 64, 0)]
        """
        segs = []
        for b in self.buckets:
            c_lo, c_hi = self.chunk(b, rank)
            for name in b.names:
                lo, hi = self.offsets[name]
                s_lo, s_hi = max(lo, c_lo), min(hi, c_hi)
                if s_lo < s_hi:
                    segs.append(Segment(name, s_lo, s_hi, s_lo - lo, b.shard + s_lo - c_lo))
        return segs


class FlatBuffer:
    """One zero-filled 1-D array of ``n`` elements on ``device``, and Tensor windows onto it.

    A window is a Tensor whose array is a slice of the buffer with a storage record of its
    own, so an in-place op on it (``ops.adamw_update``) writes through into the buffer: that
    is the point. (Copy-on-write guards the reshape views of one Tensor, not these windows;
    a window is never written by the tape, only by the optimizer and the collectives.)

    >>> import forge_ml as fm
    >>> f = FlatBuffer(6, "float32", "cpu")
    >>> f.put(2, fm.tensor([1.0, 2.0])); f.put(2, fm.tensor([10.0, 10.0]), add=True)
    >>> f.window(0, 4, (2, 2)).numpy().tolist()
    [[0.0, 0.0], [11.0, 12.0]]
    """

    def __init__(self, n: int, dtype, device):
        self.owner = zeros((int(n),), dtype, device)
        self.data = self.owner.data                # the raw array (NumPy or CuPy)
        self.dtype = self.owner.dtype
        self.device = self.owner.device
        self.size = int(n)

    def window(self, lo: int, hi: int, shape=None) -> Tensor:
        """A Tensor over elements ``[lo, hi)``, reshaped to ``shape``.

        >>> f = FlatBuffer(6, "float32", "cpu")
        >>> w = f.window(2, 6, (2, 2))
        >>> f.fill(3.0); w.shape, w.numpy().tolist()          # the buffer's memory: filled too
        ((2, 2), [[3.0, 3.0], [3.0, 3.0]])
        """
        a = self.data[lo:hi]
        return Tensor(a if shape is None else a.reshape(shape), self.device)

    def put(self, lo: int, t: Tensor, start: int = 0, stop=None, add: bool = False) -> None:
        """Write elements ``[start, stop)`` of the flattened Tensor ``t`` (cast to the buffer's
        dtype) at ``lo``; ``add=True`` adds them instead (float buffers).

        >>> import forge_ml as fm
        >>> f = FlatBuffer(4, "float32", "cpu")
        >>> f.put(1, fm.tensor([1.0, 2.0, 3.0]), start=1); f.put(0, fm.tensor([5.0]), add=True)
        >>> f.host(0, 4).tolist()
        [5.0, 2.0, 3.0, 0.0]
        """
        if t.dtype != self.dtype:
            t = t.to(self.dtype.name)
        src = t.data.reshape(-1)[start:stop]
        dst = self.data[lo:lo + src.size]
        if add:
            dst += src
        elif self.dtype == _dt.bfloat16:
            dst.view(np.uint16)[...] = src.view(np.uint16)   # bf16 moves as raw 2-byte words
        else:
            dst[...] = src

    def fill(self, value: float = 0.0) -> None:
        """Set every element to ``value``.

        >>> f = FlatBuffer(3, "float64", "cpu")
        >>> f.fill(0.5); f.host(0, 3).tolist()
        [0.5, 0.5, 0.5]
        """
        self.data.fill(value)

    def host(self, lo: int, hi: int) -> np.ndarray:
        """Elements ``[lo, hi)`` as a NumPy array (a host copy; waits for the device).

        >>> f = FlatBuffer(4, "int32", "cpu"); f.fill(7)
        >>> h = f.host(1, 3); h[0] = 0                         # the copy, not the buffer
        >>> h.tolist(), h.dtype, f.host(0, 4).tolist()
        ([0, 7], dtype('int32'), [7, 7, 7, 7])
        """
        return self.window(lo, hi).numpy()
