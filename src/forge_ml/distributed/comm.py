"""Communicators: the collectives data-parallel training needs, behind one interface.

``Communicator`` is the interface: ``rank``, ``world_size``, ``device``, and five
collectives, ``all_reduce`` (sum or avg), ``reduce_scatter``, ``all_gather``, ``broadcast``,
``barrier``; ``synchronize`` waits (with the timeout) for those still queued. Each works in
place, as data parallelism uses it, or into a separate ``out``, as NCCL allows.
Two implementations:

- ``ThreadCommunicator``: the ranks are threads of one process meeting at a ``ThreadGroup``
  (the rendezvous). Arrays are NumPy arrays or CPU Tensors. Sums are exact and deterministic:
  every rank adds the contributions in rank order, so every rank gets the same bits. Every
  meeting has a timeout, and a rank that fails (``ThreadGroup.abort``) ends the others at
  their next collective with a ``CommError`` naming it. The tests run on it.
- ``NcclCommunicator``: one process per GPU, NCCL through CuPy's ``cupy.cuda.nccl`` (imported
  on first use only). Collectives are queued on the current CUDA stream; ``synchronize``
  polls an event and aborts the NCCL communicator (``ncclCommAbort``) when the timeout
  passes, so a dead peer ends the run with an error instead of a hang. The one
  implementation used for real runs; ``launch.init_process_group`` builds it.

This module and ``ddp.FlatBuffer`` are the only code above ``ops`` that touches raw arrays:
NCCL takes device pointers, and the in-place collectives write slices of flat buffers.

>>> import numpy as np
>>> from forge_ml.distributed import launch
>>> def rank_fn(comm):
...     x = np.full(3, comm.rank + 1.0)
...     comm.all_reduce(x)                   # 1 + 2, on every rank
...     return x.tolist()
>>> launch.threads(2, rank_fn)
[[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np

from ..device import Device
from ..errors import ConfigError, DeviceError, DTypeError, ForgeError, ShapeError
from ..tensor import Tensor, backend_of

OPS = ("sum", "avg")


class CommError(ForgeError, RuntimeError):
    """A collective failed: a peer rank failed or was aborted, the ranks called different
    collectives, or NCCL reported an error.

    >>> g = ThreadGroup(2)
    >>> g.abort(1, "out of memory")           # rank 1 failed: rank 0's next collective says so
    >>> g.communicator(0).barrier()
    Traceback (most recent call last):
    ...
    forge_ml.distributed.comm.CommError: barrier on rank 0: the group was ended by rank 1: out of memory
    """


class CommTimeout(CommError, TimeoutError):
    """A collective did not complete within the communicator's timeout (a peer hung or died).

    >>> ThreadGroup(2, timeout=0.05).communicator(0).barrier()     # rank 1 never comes
    Traceback (most recent call last):
    ...
    forge_ml.distributed.comm.CommTimeout: barrier timed out after 0.05 s on rank 0: rank(s) 1 never reached it (hung or died)
    """


def _check_op(what: str, op: str) -> None:
    if op not in OPS:
        raise ConfigError(f"{what}: op must be one of {', '.join(OPS)}, got {op!r}")


def _same_layout(what: str, a, o) -> None:
    """``out`` of an all_reduce or broadcast: as many elements as ``x``, of its dtype."""
    if a.size != o.size or a.dtype != o.dtype:
        raise ShapeError(f"{what}: out is {o.size} x {o.dtype} but x is {a.size} x {a.dtype}; out must "
                         f"hold as many elements as x, of its dtype")


class Communicator:
    """The collectives of one rank of a group of ``world_size`` ranks.

    Every rank must call the same collectives in the same order with arrays of the same
    size and dtype. ``x`` and ``out`` are arrays of the communicator's kind (NumPy for
    ``ThreadCommunicator``, CuPy for ``NcclCommunicator``) or Tensors on ``device``; in-place
    forms (``out`` a slice of ``x``, as NCCL allows) are fine. Results are ready for later
    work on the device; the host sees them after ``synchronize()``.

    >>> from forge_ml.distributed import launch
    >>> launch.threads(2, lambda comm: (comm.rank, comm.world_size))
    [(0, 2), (1, 2)]
    """

    rank: int = 0
    world_size: int = 1
    device: Device = Device.parse("cpu")
    timeout: float = 600.0

    def all_reduce(self, x, op: str = "sum", out=None):
        """``x`` becomes the sum (``op="sum"``) or the mean (``"avg"``) of every rank's ``x``
        (in place); with ``out`` (as many elements of ``x``'s dtype), ``out`` becomes it and
        ``x`` is only read. Returns ``x`` (or ``out``).

        >>> import numpy as np; from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.all_reduce(np.full(2, c.rank + 1.0), "avg").tolist())
        [[1.5, 1.5], [1.5, 1.5]]
        """
        raise NotImplementedError

    def reduce_scatter(self, x, out, op: str = "sum"):
        """``x`` holds ``world_size * out.size`` elements; ``out`` becomes chunk ``rank`` of the
        sum (or mean) of every rank's ``x``. ``out`` may be that chunk of ``x`` itself.
        Returns ``out``.

        >>> import numpy as np; from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.reduce_scatter(np.arange(4.0), np.zeros(2)).tolist())
        [[0.0, 2.0], [4.0, 6.0]]
        """
        raise NotImplementedError

    def all_gather(self, x, out):
        """``out`` (``world_size * x.size`` elements) becomes every rank's ``x``, in rank
        order. ``x`` may be chunk ``rank`` of ``out`` itself. Returns ``out``.

        >>> import numpy as np; from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.all_gather(np.full(2, c.rank), np.zeros(4, int)).tolist())
        [[0, 0, 1, 1], [0, 0, 1, 1]]
        """
        raise NotImplementedError

    def broadcast(self, x, root: int = 0, out=None):
        """Every rank's ``x`` becomes ``root``'s (in place); with ``out`` (as many elements of
        ``x``'s dtype), every rank's ``out`` becomes ``root``'s ``x`` and ``x`` is only read
        on ``root``. Returns ``x`` (or ``out``).

        >>> import numpy as np; from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.broadcast(np.array([c.rank + 5]), root=1).tolist())
        [[6], [6]]
        """
        raise NotImplementedError

    def barrier(self) -> None:
        """Return when every rank has called it.

        >>> from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.barrier())
        [None, None]
        """
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until the collectives queued so far have completed (raises CommTimeout after
        ``timeout`` seconds). A no-op for communicators whose collectives are synchronous.

        >>> import numpy as np; from forge_ml.distributed import launch
        >>> def fn(c):
        ...     x = np.ones(1); c.all_reduce(x); c.synchronize()    # then the host reads x
        ...     return x.tolist()
        >>> launch.threads(2, fn)
        [[2.0], [2.0]]
        """

    def abort(self, reason: str = "") -> None:
        """End the group: the other ranks' collectives fail instead of waiting.

        >>> g = ThreadGroup(2)
        >>> g.communicator(1).abort("disk full")
        >>> g.communicator(0).barrier()
        Traceback (most recent call last):
        ...
        forge_ml.distributed.comm.CommError: barrier on rank 0: the group was ended by rank 1: disk full
        """

    def close(self) -> None:
        """Release the communicator's resources (a thread communicator holds none).

        >>> comm = ThreadGroup(1).communicator(0)
        >>> comm.close(); comm.rank, comm.world_size
        (0, 1)
        """

    # -- helpers built on the collectives --------------------------------------------------
    def _from_host(self, a: np.ndarray):
        """A host array as an array this communicator moves (a copy)."""
        return np.array(a, copy=True)

    def _to_host(self, a) -> np.ndarray:
        """An array of this communicator on the host, after the queued collectives ended."""
        self.synchronize()
        return np.asarray(a)

    def broadcast_object(self, obj=None, root: int = 0):
        """``root``'s JSON-able ``obj`` on every rank (two broadcasts: length, then bytes).

        >>> from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.broadcast_object({"step": 3} if c.rank == 0 else None))
        [{'step': 3}, {'step': 3}]
        """
        data = json.dumps(obj).encode() if self.rank == root else b""
        n = self._from_host(np.array([len(data)], np.int64))
        self.broadcast(n, root)
        size = int(self._to_host(n)[0])
        raw = np.frombuffer(data, np.uint8) if self.rank == root else np.zeros(size, np.uint8)
        buf = self._from_host(raw)
        self.broadcast(buf, root)
        return json.loads(self._to_host(buf).tobytes().decode())

    def all_reduce_floats(self, values) -> list:
        """The sums over ranks of a few host numbers, in float64 (losses, counts, squared
        norms); waits for the collectives queued before it.

        >>> from forge_ml.distributed import launch
        >>> launch.threads(2, lambda c: c.all_reduce_floats([1.5, c.rank]))
        [[3.0, 1.0], [3.0, 1.0]]
        """
        a = self._from_host(np.asarray(values, np.float64).reshape(-1))
        self.all_reduce(a, "sum")
        return self._to_host(a).tolist()


# ---------------------------------------------------------------------------------------------
# Ranks as threads


class ThreadGroup:
    """The rendezvous of ``world_size`` thread ranks: where they meet, leave their arrays and
    learn that one of them failed. ``communicator(rank)`` gives each thread its communicator;
    ``launch.threads`` does it all.

    Every meeting waits at most ``timeout`` seconds; the rank that times out names the ranks
    that never came and ends the group.

    >>> g = ThreadGroup(1, timeout=5)
    >>> import numpy as np; g.communicator(0).all_reduce(np.ones(2)).tolist()
    [1.0, 1.0]
    """

    def __init__(self, world_size: int, timeout: float = 60.0):
        if int(world_size) < 1:
            raise ConfigError(f"ThreadGroup: world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._gen = 0                 # meetings completed
        self._arrived: set = set()    # ranks at the current meeting
        self._slots: list = [None] * self.world_size
        self._failed = None           # (rank, reason, timed out) of the first failure

    def communicator(self, rank: int) -> "ThreadCommunicator":
        """The communicator of thread rank ``rank``.

        >>> c = ThreadGroup(2).communicator(1)
        >>> type(c).__name__, c.rank, c.world_size
        ('ThreadCommunicator', 1, 2)
        """
        return ThreadCommunicator(self, rank)

    def abort(self, rank: int, reason: str) -> None:
        """Rank ``rank`` failed: every rank's current and next collective raises CommError.

        >>> import numpy as np
        >>> g = ThreadGroup(2)
        >>> g.abort(0, "loss is NaN")
        >>> g.communicator(1).all_reduce(np.ones(2))
        Traceback (most recent call last):
        ...
        forge_ml.distributed.comm.CommError: all_reduce on rank 1: the group was ended by rank 0: loss is NaN
        """
        with self._cond:
            if self._failed is None:
                self._failed = (int(rank), str(reason), False)
            self._cond.notify_all()

    def _check_failed(self, rank: int, what: str) -> None:
        if self._failed is not None:
            who, reason, timed_out = self._failed
            kind = CommTimeout if timed_out else CommError
            raise kind(f"{what} on rank {rank}: the group was ended by rank {who}: {reason}")

    def _meet(self, rank: int, what: str) -> None:
        """Wait until every rank has arrived (or the group failed, or the timeout passed)."""
        with self._cond:
            self._check_failed(rank, what)
            gen = self._gen
            self._arrived.add(rank)
            if len(self._arrived) == self.world_size:
                self._arrived = set()
                self._gen += 1
                self._cond.notify_all()
                return
            deadline = time.monotonic() + self.timeout
            while self._gen == gen:
                self._check_failed(rank, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - self._arrived)
                    reason = (f"{what} timed out after {self.timeout:g} s on rank {rank}: rank(s) "
                              f"{', '.join(map(str, missing))} never reached it (hung or died)")
                    self._failed = (rank, reason, True)
                    self._cond.notify_all()
                    raise CommTimeout(reason)
                self._cond.wait(left)

    def _collective(self, rank: int, what: str, sig: tuple, payload, compute):
        """Leave ``payload``, meet, check that every rank called the same thing, compute this
        rank's result from every payload (in rank order), meet again (so nobody writes an
        array another rank still reads), and return the result for the caller to write."""
        self._slots[rank] = (sig, payload)
        self._meet(rank, what)
        slots = list(self._slots)
        if any(s[0] != slots[0][0] for s in slots):
            calls = "; ".join(f"rank {i}: {s[0]}" for i, s in enumerate(slots))
            raise CommError(f"{what} on rank {rank}: the ranks called different collectives "
                            f"or sizes ({calls}); every rank must make the same calls in the same order")
        result = compute([s[1] for s in slots])
        self._meet(rank, what)
        return result


class ThreadCommunicator(Communicator):
    """The communicator of one thread rank of a ``ThreadGroup``: NumPy arrays or CPU Tensors,
    exact sums in rank order, every call bounded by the group's timeout.

    >>> import numpy as np
    >>> from forge_ml.distributed import launch
    >>> def fn(c):
    ...     out = np.zeros(4)
    ...     c.all_gather(np.array([c.rank, c.rank + 0.5]), out)
    ...     return out.tolist()
    >>> launch.threads(2, fn)[1]
    [0.0, 0.5, 1.0, 1.5]
    """

    def __init__(self, group: ThreadGroup, rank: int):
        if not 0 <= int(rank) < group.world_size:
            raise ConfigError(f"ThreadCommunicator: rank must be in 0..{group.world_size - 1}, got {rank}")
        self.group = group
        self.rank = int(rank)
        self.world_size = group.world_size
        self.timeout = group.timeout
        self.device = Device.parse("cpu")

    def _arr(self, what: str, x, write: bool) -> np.ndarray:
        if isinstance(x, Tensor):
            if not backend_of(x.device).host_memory:
                raise DeviceError(f"{what}: the thread communicator moves CPU arrays; got a tensor on {x.device}")
            return x._prepare_write() if write else x.data
        if isinstance(x, np.ndarray):
            return x
        raise DTypeError(f"{what}: expected a NumPy array or a CPU Tensor, got {type(x).__name__}")

    def all_reduce(self, x, op: str = "sum", out=None):
        _check_op("all_reduce", op)
        a = self._arr("all_reduce", x, False)
        if out is not None:
            _same_layout("all_reduce", a, self._arr("all_reduce", out, False))
        n = self.world_size

        def total(parts):
            acc = np.array(parts[0], copy=True)
            for p in parts[1:]:
                acc += p                                    # rank order: the same bits everywhere
            if op == "avg":
                acc /= n
            return acc

        acc = self.group._collective(self.rank, "all_reduce", ("all_reduce", op, a.size, a.dtype.str), a, total)
        dst = x if out is None else out
        self._arr("all_reduce", dst, True)[...] = acc.reshape(a.shape)
        return dst

    def reduce_scatter(self, x, out, op: str = "sum"):
        _check_op("reduce_scatter", op)
        a, o = self._arr("reduce_scatter", x, False), self._arr("reduce_scatter", out, False)
        n, r, c = self.world_size, self.rank, o.size
        if a.size != n * c or a.dtype != o.dtype:
            # (as NCCL's: a float sum written into an int out was truncated in silence here only)
            raise ShapeError(f"reduce_scatter: x is {a.size} x {a.dtype}, out {c} x {o.dtype}; "
                             f"x must have world_size x out.size = {n * c} elements of out's "
                             f"dtype")

        def chunk(parts):
            acc = np.array(parts[0].reshape(-1)[r * c:(r + 1) * c], copy=True)
            for p in parts[1:]:
                acc += p.reshape(-1)[r * c:(r + 1) * c]
            if op == "avg":
                acc /= n
            return acc

        acc = self.group._collective(self.rank, "reduce_scatter", ("reduce_scatter", op, a.size, a.dtype.str),
                                     a, chunk)
        self._arr("reduce_scatter", out, True)[...] = acc.reshape(o.shape)
        return out

    def all_gather(self, x, out):
        a, o = self._arr("all_gather", x, False), self._arr("all_gather", out, False)
        n = self.world_size
        if o.size != n * a.size or a.dtype != o.dtype:
            # (NCCL moves the bytes: another dtype of as many bytes would come out reinterpreted,
            # and here it was cast in silence)
            raise ShapeError(f"all_gather: out is {o.size} x {o.dtype}, x {a.size} x {a.dtype}; "
                             f"out must have world_size x x.size = {n * a.size} elements of "
                             f"x's dtype")
        whole = self.group._collective(self.rank, "all_gather", ("all_gather", a.size, a.dtype.str), a,
                                       lambda parts: np.concatenate([p.reshape(-1) for p in parts]))
        self._arr("all_gather", out, True)[...] = whole.reshape(o.shape)
        return out

    def broadcast(self, x, root: int = 0, out=None):
        if not 0 <= root < self.world_size:
            raise ConfigError(f"broadcast: root must be in 0..{self.world_size - 1}, got {root}")
        a = self._arr("broadcast", x, False)
        if out is not None:
            _same_layout("broadcast", a, self._arr("broadcast", out, False))
        got = self.group._collective(self.rank, "broadcast", ("broadcast", root, a.size, a.dtype.str), a,
                                     lambda parts: None if self.rank == root and out is None
                                     else np.array(parts[root], copy=True))
        dst = x if out is None else out
        if out is not None or self.rank != root:
            self._arr("broadcast", dst, True)[...] = got.reshape(a.shape)
        return dst

    def barrier(self) -> None:
        self.group._meet(self.rank, "barrier")

    def abort(self, reason: str = "") -> None:
        self.group.abort(self.rank, reason or f"rank {self.rank} aborted")


# ---------------------------------------------------------------------------------------------
# NCCL

# ncclDataType_t and ncclRedOp_t values: NCCL's ABI (nccl.h), the same in every NCCL 2.x. CuPy
# exports most of them as NCCL_* constants, but not every build has NCCL_BFLOAT16 or NCCL_AVG
# (they need NCCL >= 2.10, at run time too: _NCCL_2_10).
_NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "avg": 4}
_NCCL_2_10 = 21000             # ncclGetVersion's code for 2.10.0 (major * 10000 + minor * 100)
_NCCL_ID_BYTES = 128           # NCCL_UNIQUE_ID_BYTES
_INT_MAX = 2 ** 31 - 1         # CuPy's NcclCommunicator.broadcast takes its count as a C int


def _cupy_nccl():
    """``(cupy, cupy.cuda.nccl)``, or a DeviceError saying what is missing."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise DeviceError(f"NCCL training needs CuPy with NCCL (pip install 'forge-ml[cuda]'); "
                          f"cannot import it here ({e})") from None
    if not getattr(nccl, "available", True):
        raise DeviceError("this CuPy cannot load NCCL (cupy.cuda.nccl.available is False): install NCCL "
                          "for its CUDA version (pip install nvidia-nccl-cu13, or nvidia-nccl-cu12 beside "
                          "cupy-cuda12x) to train on several GPUs")
    return cupy, nccl


def _unique_id(uid) -> bytes:
    """NCCL's unique id as the 128 bytes CuPy 14's ``NcclCommunicator`` takes (older CuPy took
    a tuple of 128 signed chars, which ``nccl.get_unique_id()`` returned there): bytes, and
    tuples of signed or unsigned values, are converted.

    >>> _unique_id((1, -1) + (0,) * 126)[:3]
    b'\\x01\\xff\\x00'
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        vals = list(bytes(uid))
    else:
        try:
            vals = [int(v) for v in uid]
        except (TypeError, ValueError):
            raise CommError(f"NCCL unique id: expected 128 bytes or small integers, got {type(uid).__name__}") from None
        vals = [v + 256 if -128 <= v < 0 else v for v in vals]
    if len(vals) != _NCCL_ID_BYTES or not all(0 <= v <= 255 for v in vals):
        raise CommError(f"NCCL unique id: expected {_NCCL_ID_BYTES} bytes (nccl.get_unique_id() on rank 0), "
                        f"got {len(vals)} values; every rank must get rank 0's id unchanged")
    return bytes(vals)


def _ptr(a) -> int:
    """The device address of a CuPy array's first element."""
    return a.data.ptr


class NcclCommunicator(Communicator):
    """One GPU's rank of an NCCL communicator (one process per GPU).

    ``unique_id`` is NCCL's id that rank 0 made with ``cupy.cuda.nccl.get_unique_id()`` and
    the rendezvous shared (``launch.init_process_group`` does both). Collectives are queued
    on the current CUDA stream, after the kernels that produced their inputs; in-place forms
    follow NCCL's rules (``reduce_scatter``'s ``out`` at chunk ``rank`` of ``x``,
    ``all_gather``'s ``x`` at chunk ``rank`` of ``out``). Counts go to NCCL in elements of the
    NCCL type passed: ``all_gather`` and ``broadcast`` move bytes (``ncclUint8``), so any dtype
    goes; reductions take the array's own type (float32, float64, bfloat16, the integers).
    ``avg`` and bfloat16 need NCCL >= 2.10. ``synchronize`` polls for the queued work and,
    after ``timeout`` seconds, aborts the communicator (``ncclCommAbort``) and raises
    CommTimeout. A world of one is a real NCCL communicator too (its collectives are copies).

    Usually built by ``launch.init_process_group()``; by hand, in each of ``n`` processes (it
    needs GPUs and one process per rank, so no doctest):

    Example:
        import cupy
        from cupy.cuda import nccl
        uid = nccl.get_unique_id()                 # on rank 0, then shared with the others
        comm = NcclCommunicator(rank, n, uid, device=f"cuda:{rank}")
        x = cupy.ones(4, cupy.float32)             # on cuda:rank, current once comm is built
        comm.all_reduce(x); comm.synchronize()     # x is n everywhere, on every rank
    """

    def __init__(self, rank: int, world_size: int, unique_id, device=None, timeout: float = 1800.0):
        self._cupy, self._nccl = _cupy_nccl()
        self._comm = None
        self.rank, self.world_size, self.timeout = int(rank), int(world_size), float(timeout)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"NcclCommunicator: rank must be in 0..{self.world_size - 1}, got {rank}")
        self.device = Device.parse(device if device is not None else "cuda:0")
        uid = _unique_id(unique_id)
        backend_of(self.device)                      # loads the GPU's backend, makes the GPU current
        try:
            self.nccl_version = int(self._nccl.get_version())
        except Exception:  # noqa: BLE001 - an old CuPy without get_version: assume a current NCCL
            self.nccl_version = _NCCL_2_10
        try:
            try:
                self._comm = self._nccl.NcclCommunicator(self.world_size, uid, self.rank)
            except TypeError:   # a CuPy before 14 takes the id as 128 signed chars
                signed = tuple(np.frombuffer(uid, np.int8).tolist())
                self._comm = self._nccl.NcclCommunicator(self.world_size, signed, self.rank)
        except self._nccl.NcclError as e:
            raise CommError(f"NCCL init on rank {self.rank} of {self.world_size} ({self.device}) failed: {e}") from None

    def _arr(self, what: str, x, write: bool):
        if isinstance(x, Tensor):
            if x.device != self.device:
                raise DeviceError(f"{what}: the communicator is on {self.device}, the tensor on {x.device}")
            x = x._prepare_write() if write else x.data
        elif not isinstance(x, self._cupy.ndarray):
            raise DTypeError(f"{what}: expected a CuPy array or a Tensor on {self.device}, got {type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ShapeError(f"{what}: NCCL needs contiguous memory; got a strided array of shape {x.shape}")
        return x

    def _type(self, what: str, a) -> int:
        name = np.dtype(a.dtype).name
        t = _NCCL_TYPES.get(name)
        if t is None:
            raise DTypeError(f"{what}: NCCL reduces float32, float64, bfloat16 or integer arrays, got {a.dtype}")
        if name == "bfloat16" and self.nccl_version < _NCCL_2_10:
            raise DTypeError(f"{what}: bfloat16 reductions need NCCL >= 2.10; this process has NCCL "
                             f"{self._version_text()}")
        return t

    def _op(self, what: str, op: str) -> int:
        _check_op(what, op)
        if op == "avg" and self.nccl_version < _NCCL_2_10:
            raise ConfigError(f"{what}: op='avg' (ncclAvg) needs NCCL >= 2.10; this process has NCCL "
                              f"{self._version_text()}; use op='sum' and scale")
        return _NCCL_OPS[op]

    def _version_text(self) -> str:
        v = self.nccl_version
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 20900 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"

    def _call(self, what: str, method: str, *args) -> None:
        """``self._comm.<method>(*args, stream)``: CuPy's NCCL calls all end with the stream."""
        if self._comm is None:
            raise CommError(f"{what} on rank {self.rank}: the communicator was aborted or closed")
        try:
            getattr(self._comm, method)(*args, self._cupy.cuda.get_current_stream().ptr)
        except self._nccl.NcclError as e:
            raise CommError(f"{what} on rank {self.rank} of {self.world_size}: {e}") from None

    def all_reduce(self, x, op: str = "sum", out=None):
        nop = self._op("all_reduce", op)
        a = self._arr("all_reduce", x, out is None)
        o = a
        if out is not None:
            o = self._arr("all_reduce", out, True)
            _same_layout("all_reduce", a, o)
        # count: elements of the array's type
        self._call("all_reduce", "allReduce", _ptr(a), _ptr(o), a.size, self._type("all_reduce", a), nop)
        return x if out is None else out

    def reduce_scatter(self, x, out, op: str = "sum"):
        nop = self._op("reduce_scatter", op)
        a, o = self._arr("reduce_scatter", x, False), self._arr("reduce_scatter", out, True)
        if a.size != self.world_size * o.size or a.dtype != o.dtype:
            raise ShapeError(f"reduce_scatter: x is {a.size} x {a.dtype}, out {o.size} x {o.dtype}; x must "
                             f"have world_size x out.size = {self.world_size * o.size} elements of out's dtype")
        # count: the elements each rank receives (recvcount)
        self._call("reduce_scatter", "reduceScatter", _ptr(a), _ptr(o), o.size,
                   self._type("reduce_scatter", a), nop)
        return out

    def all_gather(self, x, out):
        a, o = self._arr("all_gather", x, False), self._arr("all_gather", out, True)
        if o.nbytes != self.world_size * a.nbytes:
            raise ShapeError(f"all_gather: out has {o.nbytes} bytes, x {a.nbytes}; out must hold world_size "
                             f"x x = {self.world_size * a.nbytes} bytes")
        # count: the bytes each rank sends (sendcount, in ncclUint8 elements)
        self._call("all_gather", "allGather", _ptr(a), _ptr(o), a.nbytes, _NCCL_TYPES["uint8"])
        return out

    def broadcast(self, x, root: int = 0, out=None):
        if not 0 <= root < self.world_size:
            raise ConfigError(f"broadcast: root must be in 0..{self.world_size - 1}, got {root}")
        a = self._arr("broadcast", x, out is None and self.rank != root)
        o = a
        if out is not None:
            o = self._arr("broadcast", out, True)
            _same_layout("broadcast", a, o)
        send, recv, n = _ptr(a), _ptr(o), a.nbytes
        for lo in range(0, n, _INT_MAX):        # bytes, in pieces CuPy's int count can hold
            k = min(_INT_MAX, n - lo)
            self._call("broadcast", "broadcast", send + lo, recv + lo, k, _NCCL_TYPES["uint8"], root)
        return x if out is None else out

    def barrier(self) -> None:
        self.all_reduce(self._cupy.zeros(1, np.float32))
        self.synchronize()

    def synchronize(self) -> None:
        if self._comm is None:
            raise CommError(f"rank {self.rank}: the communicator was aborted or closed")
        ev = self._cupy.cuda.Event(disable_timing=True)
        ev.record()
        start = time.monotonic()
        pause = 0.0
        while not ev.done:
            try:
                self._comm.check_async_error()       # ncclCommGetAsyncError: a network error, a peer gone
            except self._nccl.NcclError as e:
                self.abort()
                raise CommError(f"rank {self.rank} of {self.world_size}: NCCL failed: {e}") from None
            if time.monotonic() - start > self.timeout:
                self.abort()
                raise CommTimeout(f"rank {self.rank} of {self.world_size}: a collective did not complete in "
                                  f"{self.timeout:g} s (a peer hung or died); NCCL communicator aborted")
            time.sleep(pause)
            pause = min(1e-3, pause + 2e-5)           # spin first, then back off to 1 ms

    def abort(self, reason: str = "") -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - ending a broken group must not raise a second error
                pass

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()

    def _from_host(self, a: np.ndarray):
        return self._cupy.asarray(a)

    def _to_host(self, a) -> np.ndarray:
        self.synchronize()
        return self._cupy.asnumpy(a)
