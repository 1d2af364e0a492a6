"""Tensor: an array on a device, with a dtype and a shape.

A Tensor wraps a C-contiguous NumPy array (``cpu``) or CuPy array (``cuda``). ``reshape``
returns a view that shares memory; in-place ops (``kv_append``, ``scatter_add_rows``) write
copy-on-write, so a view taken before the write keeps the old values and no tensor is ever
changed through a hidden alias.

>>> import forge_ml as fm
>>> t = fm.tensor([[1.0, 2.0], [3.0, 4.0]])
>>> t.shape, t.dtype, t.device
((2, 2), forge_ml.float32, Device('cpu'))
>>> t.reshape(4).numpy().tolist()
[1.0, 2.0, 3.0, 4.0]
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import dtype as _dt
from .backends import get as _backend
from .backends import host_guarded
from .device import Device
from .errors import DeviceError, DTypeError, ShapeError

_BACKENDS: dict = {}


def backend_of(device: Device):
    """The (cached) backend of a device (``forge_ml.backends.Backend``), with the device made
    current where its type has several.

    >>> bk = backend_of(Device("cpu"))
    >>> bk.name, bk.graphs, backend_of(Device("cpu")) is bk
    ('cpu', False, True)
    """
    b = _BACKENDS.get(device)
    if b is None:
        b = _BACKENDS[device] = _backend(device)
    elif b.select is not None:
        b.select(device.index)
    return b


class _Storage:
    """The memory a tensor and its reshape views share; ``live`` counts those tensors.

    ``id_range`` caches ``(min, max)`` of integer data known without a device round trip
    (ids made from host data), so the ops' token-id range checks cost no GPU sync; any
    in-place write clears it. ``shared``: ``Tensor.data`` has handed the raw array out, and
    its holder may write it unseen, so the cache is no longer trusted (``Tensor._id_range``).
    """

    __slots__ = ("live", "id_range", "shared")

    def __init__(self):
        self.live = 0
        self.id_range = None
        self.shared = False


class Tensor:
    """An n-d array on a device. Build one with ``tensor``, ``from_numpy`` or ``zeros``.

    >>> t = tensor([[1.0, 2.0, 3.0]])
    >>> t.shape, t.ndim, t.numel, t.dtype.name, t.numpy().tolist()
    ((1, 3), 2, 3, 'float32', [[1.0, 2.0, 3.0]])
    """

    __slots__ = ("_data", "_device", "_dtype", "_storage", "_version", "__weakref__")
    # NumPy's operators and ufuncs refuse a Tensor (``t * np.float32(2)`` stays the TypeError it
    # was on every device), though ``np.asarray`` reads one through ``__array__``
    __array_ufunc__ = None

    def __init__(self, data, device: Device, _views=None):
        if type(data) is np.ndarray and not (data.flags.c_contiguous and data.dtype.isnative):
            # the CPU kernels read a tensor's memory as a C-ordered, native-endian block: a
            # Fortran-ordered or big-endian array given here is copied into that form (it gave
            # wrong values silently)
            data = np.require(data, data.dtype.newbyteorder("="), "C")   # 0-d stays 0-d
        # Every live tensor sharing this memory (the tensor and its reshape views) is counted
        # in one _Storage; __del__ uncounts it. (A WeakSet per tensor cost ~3 us each.)
        if type(device) is not Device:   # Tensor(data, "cpu"): parsed here, not failed in an op later
            device = Device.parse(device)
        storage = _views if _views is not None else _Storage()
        storage.live += 1
        self._storage = storage
        self._data = data
        self._device = device
        try:
            self._dtype = _dt.of_array(data.dtype)
        except AttributeError:
            raise DTypeError(f"Tensor(data, device) takes a NumPy or CuPy array, got "
                             f"{type(data).__name__}; build a tensor from other data with "
                             f"forge_ml.tensor(data, device=...)") from None
        self._version = 0

    def __del__(self):
        try:
            self._storage.live -= 1
        except AttributeError:   # __init__ refused its data
            pass

    # -- properties -------------------------------------------------------------------
    @property
    def data(self):
        """The raw NumPy/CuPy array. Read it; write only through ops (copy-on-write). Handing
        it out ends the trust in the cached integer range (a write here goes unseen): checks
        look at the values again. The ops read ``_data``."""
        self._storage.shared = True
        return self._data

    @property
    def shape(self) -> tuple:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> _dt.DType:
        return self._dtype

    @property
    def device(self) -> Device:
        return self._device

    @property
    def ndim(self) -> int:
        return self._data.ndim

    @property
    def numel(self) -> int:
        return int(self._data.size)

    @property
    def version(self) -> int:
        """How many in-place writes this tensor has had (the tape checks it)."""
        return self._version

    # -- views and copies ---------------------------------------------------------------
    def reshape(self, *shape) -> "Tensor":
        """A view with a new shape (one dim may be -1); shares memory copy-on-write.

        >>> zeros((2, 3)).reshape(3, -1).shape
        (3, 2)
        """
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if not all(type(s) is int for s in shape):   # (the ops' plain ints skip the ABC checks)
            if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in shape):
                raise ShapeError(f"reshape: sizes must be whole numbers, got {shape} for a tensor "
                                 f"of shape {self.shape}")
            shape = tuple(int(s) for s in shape)
        n = self.numel
        if shape.count(-1) > 1 or any(s < -1 for s in shape):
            raise ShapeError(f"reshape: bad shape {shape} for a tensor of shape {self.shape}")
        if -1 in shape:
            rest = math.prod(s for s in shape if s != -1)
            if rest == 0 or n % rest:
                raise ShapeError(f"reshape: cannot reshape {self.shape} ({n} elements) to {shape}")
            shape = tuple(n // rest if s == -1 else s for s in shape)
        if math.prod(shape) != n:
            raise ShapeError(f"reshape: cannot reshape {self.shape} ({n} elements) to {shape}")
        return Tensor(self._data.reshape(shape), self._device, _views=self._storage)

    def clone(self) -> "Tensor":
        """A copy with its own memory.

        >>> a = tensor([1.0]); b = a.clone()
        >>> b.memory() is a.memory(), b.numpy().tolist()
        (False, [1.0])
        """
        return Tensor(backend_of(self._device).copy(self._data), self._device)

    def to(self, target) -> "Tensor":
        """A copy on another device ("cpu", "cuda:0") or of another dtype ("bfloat16").

        >>> tensor([1.5]).to("float64").dtype
        forge_ml.float64
        """
        from .backends import names
        is_device = isinstance(target, Device) or (
            isinstance(target, str) and target.strip().lower().split(":")[0] in names())
        if target is None or (isinstance(target, str) and not is_device):
            aliases = ("bf16", "fp32", "f32", "fp64", "f64")
            if target is None or (target not in _dt.ALL and target not in aliases):
                raise DeviceError(f"to: expected a device ({', '.join(names())}, 'cuda:N') or a "
                                  f"dtype ({', '.join(sorted(_dt.ALL))}), got {target!r}")
        if not is_device:
            dt = _dt.get(target)
            if dt == self._dtype:
                return self
            if not dt.is_float and self.numel and (
                    self._dtype.is_float or np.iinfo(dt.name).max < np.iinfo(self._dtype.name).max):
                # as tensor(...) checks: NaN, inf or a value past the integer type's range
                # would wrap silently (one look at the values, or the cached id range; on a
                # GPU, a wait); int64 to int32 too
                known = None if self._dtype.is_float else self._id_range()
                _check_fits(np.array(known) if known else self.numpy(), dt, "to")
            return Tensor(backend_of(self._device).cast(self._data, dt.name), self._device)
        dev = Device.parse(target)
        if dev == self._device:
            return self
        host = self.numpy()
        return Tensor(backend_of(dev).from_host(host, self._dtype.name), dev)

    def numpy(self) -> np.ndarray:
        """A host copy as a NumPy array (bfloat16 comes back as float32).

        >>> tensor([[1, 2]]).numpy()
        array([[1, 2]])
        """
        return backend_of(self._device).to_host(self._data)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """NumPy's array protocol (NumPy 2's form): ``np.asarray(t)`` and ``np.array(t)`` of a
        tensor in host memory (``cpu``). Without a dtype or a copy asked for, the result is a
        read-only view of the tensor's memory: no copy, and no write that would go past the
        ops' copy-on-write (an in-place op on the tensor later shows through it; ``t.numpy()``
        is a copy of the values now). ``dtype`` other than the tensor's, or ``copy=True``,
        gives a copy of its own; ``copy=False`` where a copy is needed is a ValueError, as
        NumPy's protocol says. bfloat16 comes back as float32 (a copy), as ``numpy()`` gives it.

        A tensor in device memory (``cuda``) is a TypeError, as in PyTorch: a silent device wait
        and copy behind an ``np.asarray``; ``t.numpy()`` or ``t.to("cpu")`` makes the copy.

        >>> t = tensor([[1.0, 2.0]])
        >>> a = np.asarray(t)
        >>> a, np.shares_memory(a, t.memory()), a.flags.writeable
        (array([[1., 2.]], dtype=float32), True, False)
        >>> np.asarray(t, dtype=np.float64).dtype, np.array(t).flags.writeable
        (dtype('float64'), True)
        >>> np.array(t, dtype=np.float64, copy=False)
        Traceback (most recent call last):
        ...
        ValueError: Tensor.__array__: a float32 tensor as float64 needs a copy, and copy=False was given
        """
        if not backend_of(self._device).host_memory:
            raise TypeError(f"can't convert a {self._device} tensor to NumPy implicitly (its memory "
                            f"is on the device); use t.numpy() for a host copy, or t.to('cpu')")
        a = self._data
        if dtype is not None:
            want = np.dtype(dtype)
        else:   # bfloat16 as numpy() gives it: NumPy has no bfloat16 of its own
            want = np.dtype(np.float32) if self._dtype.name == "bfloat16" else a.dtype
        if want == a.dtype:
            if copy:
                return a.copy()
            view = a.view()
            # read-only: a write through it would change the tensor and every view unseen
            # (copy-on-write, the id range cache); np.array(t) copies, and that copy is writable
            view.flags.writeable = False
            return view
        if copy is False:
            raise ValueError(f"Tensor.__array__: a {self._dtype.name} tensor as {want} needs a "
                             f"copy, and copy=False was given")
        return a.astype(want)

    def item(self) -> float:
        """The value of a one-element tensor as a Python number.

        >>> tensor([[2.5]]).item(), tensor([7]).item()
        (2.5, 7)
        """
        if self.numel != 1:
            raise ShapeError(f"item: expected a tensor with one element, got shape {self.shape}")
        v = self.numpy().reshape(-1)[0]
        return v.item()

    def _id_range(self):
        """The cached ``(min, max)`` of integer data, or None: not known, or the raw array has
        been handed out (``data``) and may have been written since."""
        s = self._storage
        return None if s.shared else s.id_range

    # -- in-place writes go through here (ops only) ---------------------------------------
    def _prepare_write(self):
        """Copy-on-write: detach from views before an in-place op writes this tensor."""
        if self._storage.live > 1:
            data = backend_of(self._device).copy(self._data)
            storage = _Storage()
            storage.live = 1
            self._storage.live -= 1
            self._storage, self._data = storage, data
        self._storage.id_range = None
        self._version += 1
        return self._data

    def copy_to_host(self, out: np.ndarray):
        """Start copying this tensor into the host array ``out`` (same size and dtype; one
        from ``host_buffer`` lets the copy run while the host goes on). Returns None when the
        copy is done already, else a handle whose ``synchronize()`` waits for it.

        >>> out = np.empty(2, np.float32)
        >>> tensor([1.0, 2.0]).copy_to_host(out); out.tolist()
        [1.0, 2.0]
        """
        if out.size != self.numel or np.dtype(out.dtype).name != self._dtype.name:
            raise ShapeError(f"copy_to_host: a {self._dtype.name} tensor of {self.shape} does "
                             f"not fit a host array of {out.dtype} {out.shape}")
        return backend_of(self._device).to_host_async(self._data, out)

    def copy_from_host(self, src: np.ndarray) -> None:
        """Queue a copy of the host array ``src`` (from ``host_buffer``: this tensor's size
        and dtype) into this tensor, in place, behind the device work queued before it: the
        host goes on at once, and may write ``src`` again once the work after the copy has
        started (a later step's wait). Not for bfloat16 tensors (``ops.assign`` rounds those).

        >>> t = zeros((2,), "int64"); src = host_buffer((2,), "int64"); src[:] = [3, 4]
        >>> t.copy_from_host(src); t.numpy().tolist()
        [3, 4]
        """
        if src.size != self.numel or np.dtype(src.dtype).name != self._dtype.name:
            raise ShapeError(f"copy_from_host: a host array of {src.dtype} {src.shape} does not "
                             f"fit a {self._dtype.name} tensor of {self.shape}")
        backend_of(self._device).from_host_async(self._prepare_write(), src)
        if self._dtype in _dt.INTS and src.size:
            self._storage.id_range = (int(src.min()), int(src.max()))

    def memory(self):
        """An opaque handle on the memory this tensor holds now, for identity checks only: a
        CUDA graph captured while ``t.memory() is h`` may be replayed while that still holds
        (an in-place op keeps the memory; copy-on-write moves it).

        >>> t = zeros((2,)); t.memory() is t.memory(), t.clone().memory() is t.memory()
        (True, False)
        """
        return self._data

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self._dtype.name}, device='{self._device}')"

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        """The truth of a one-element tensor's value, as in PyTorch and NumPy; any other size
        is a ShapeError. (Without it Python asked ``__len__``: ``if fm.tensor([0.0])`` was
        True, ``if fm.tensor(0.0)`` a TypeError about ``len()``.)

        >>> bool(tensor([0.0])), bool(tensor(2.5))
        (False, True)
        """
        if self.numel != 1:
            raise ShapeError(f"bool: the truth of a tensor of shape {self.shape} is ambiguous: "
                             f"expected one element, got {self.numel}")
        return bool(self.item())


def _default_dtype(a: np.ndarray, given) -> _dt.DType:
    if given is not None:
        return _dt.get(given)
    if a.dtype.kind == "f":   # by width: a big-endian float64 (>f8) is float64 too
        return _dt.float64 if a.dtype.itemsize >= 8 else _dt.float32
    if a.dtype.kind in "iub":   # uint32 into int64: int32 cannot hold its upper half
        return _dt.int64 if a.dtype.itemsize > 4 or (a.dtype.kind == "u" and a.dtype.itemsize == 4) \
            else _dt.int32
    raise DTypeError(f"tensor: cannot make a tensor from data of dtype {a.dtype}")


def _numbers_array(values, op: str, expected: str) -> np.ndarray:
    """``values`` (a nested list, a number, an array) as a NumPy array of numbers, else a
    DTypeError that says ``op`` expected ``expected``: a ragged list, a list of Tensors, strings
    or a Python int past 64 bits.

    >>> _numbers_array([[1, 2], [3, 4]], "tensor", "numbers").shape
    (2, 2)
    >>> _numbers_array([[1], [2, 3]], "tensor", "numbers of one shape")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DTypeError: tensor: expected numbers of one shape, got [[1], [2, 3]]
    """
    try:
        a = np.asarray(values)
    except (OverflowError, ValueError, TypeError):   # (TypeError: a list of Tensors)
        a = None
    if a is None or a.dtype.kind not in "fiub":
        raise DTypeError(f"{op}: expected {expected}, got {str(values):.60}")
    return a


def tensor(data, dtype=None, device="cpu") -> Tensor:
    """A new tensor holding a copy of ``data`` (a list, a number or an array).

    Python floats become float32, Python ints int64; NumPy arrays and scalars, and other
    arrays (a torch tensor, say) keep their dtype unless ``dtype`` is given (float16, which
    forge-ml has no kernels for, becomes float32; int8, int16 and uint16 int32; uint32 and
    uint64 int64).

    >>> tensor([1, 2, 3]).dtype, tensor(np.float64(0.1)).dtype
    (forge_ml.int64, forge_ml.float64)
    """
    if isinstance(data, Tensor):
        data = data.numpy()
    if isinstance(data, np.generic) or (
            not isinstance(data, (list, tuple, numbers.Number)) and hasattr(data, "__array__")):
        # a NumPy scalar or a foreign array: its dtype kept, as for an ndarray (a float64 one
        # became float32)
        try:
            data = np.asarray(data)
        except Exception as e:       # e.g. a torch tensor that requires grad
            raise DTypeError(f"tensor: cannot read a {type(data).__name__} as an array: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if isinstance(data, np.ndarray):
        a = data
        dt = _default_dtype(a, dtype)
    else:
        a = _numbers_array(data, "tensor", "numbers of one shape (ints within 64 bits)")
        if dtype is None and a.dtype.kind == "f":
            dt = _dt.float32
        elif dtype is None and a.dtype.kind in "iub":
            dt = _dt.int64
        else:
            dt = _default_dtype(a, dtype)
    dev = Device.parse(device)
    a = np.asarray(a, order="C")
    ints = None
    if not dt.is_float and a.size:
        _check_fits(a, dt, "tensor")
        ints = a if a.dtype == np.dtype(dt.name) else a.astype(dt.name)   # the values kept
    t = Tensor(backend_of(dev).from_host(a, dt.name), dev)
    if ints is not None:
        t._storage.id_range = (int(ints.min()), int(ints.max()))
    return t


def from_numpy(a: np.ndarray, device="cpu") -> Tensor:
    """A tensor holding a copy of a NumPy array, in the dtype ``tensor`` gives it (float32 and
    float64 kept, float16 widened to float32, small integers and bool to int32, uint32 to int64).

    >>> from_numpy(np.zeros((2, 3), np.float32)).shape
    (2, 3)
    """
    if not isinstance(a, np.ndarray):
        raise DTypeError(f"from_numpy: expected a numpy.ndarray, got {type(a).__name__}")
    return tensor(a, dtype=_default_dtype(a, None), device=device)


def zeros(shape, dtype="float32", device="cpu") -> Tensor:
    """A tensor of zeros (``dtype=None``: float32, the default).

    >>> float(zeros((2, 3)).numpy().sum()), zeros((1,), dtype=None).dtype
    (0.0, forge_ml.float32)
    """
    shape = _shape("zeros", shape)
    dev = Device.parse(device)
    dt = _dt.float32 if dtype is None else _dt.get(dtype)
    return Tensor(backend_of(dev).zeros(shape, dt.name), dev)


def _shape(op: str, shape) -> tuple:
    """``shape`` (an int or a sequence of ints, NumPy's included) as a tuple of non-negative
    ints, or a ShapeError naming what came: a float or bool size is refused, not truncated."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise ShapeError(f"{op}: shape must be an int or a sequence of ints, got {shape!r}") from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in dims):
        raise ShapeError(f"{op}: shape must hold ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ShapeError(f"{op}: negative dimension in shape {dims}")
    return dims


def _check_fits(a: np.ndarray, dt, what: str) -> None:
    """A DTypeError where the host values ``a`` cannot become the integer dtype ``dt``: NaN or
    inf, or a value past its range (which would wrap silently); floats are truncated toward 0,
    as torch does.

    >>> _check_fits(np.array([7.9, -3.0]), _dt.int32, "to")
    >>> _check_fits(np.array([np.nan]), _dt.int32, "to")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DTypeError: to: cannot store NaN or inf as int32
    """
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise DTypeError(f"{what}: cannot store NaN or inf as {dt.name}")
    if a.dtype.kind in "iuf":
        info = np.iinfo(dt.name)
        lo, hi = a.min(), a.max()
        if a.dtype.kind == "f":      # truncated toward 0: inside (min - 1, max + 1)
            bad = float(lo) <= float(info.min) - 1 or float(hi) >= float(info.max) + 1
        else:
            bad = int(lo) < info.min or int(hi) > info.max
        if bad:
            raise DTypeError(f"{what}: values {lo}..{hi} do not fit {dt.name} "
                             f"({info.min}..{info.max})")


def full(shape, value, dtype="float32", device="cpu") -> Tensor:
    """A tensor filled with ``value`` (``dtype=None``: float32, the default).

    >>> full((2,), 3.0).numpy().tolist()
    [3.0, 3.0]
    """
    dt = _dt.float32 if dtype is None else _dt.get(dtype)
    if not isinstance(value, numbers.Number) or isinstance(value, complex):
        raise DTypeError(f"full: value must be a number, got {type(value).__name__} {value!r:.40}")
    # an integer dtype: the value as NumPy reads it, so that tensor() checks it (NaN, range)
    host = host_guarded("full", np.full)(_shape("full", shape), value, dtype=np.float32
                                         if dt.name == "bfloat16" else dt.name if dt.is_float
                                         else None)
    return tensor(host, dtype=dt, device=device)


def ones_like(t: Tensor) -> Tensor:
    """A tensor of ones with the shape, dtype and device of ``t``.

    >>> ones_like(zeros((2,), "float64")).numpy().tolist(), ones_like(zeros((1,))).dtype
    ([1.0, 1.0], forge_ml.float32)
    """
    if not isinstance(t, Tensor):
        raise DTypeError(f"ones_like: expected a forge_ml Tensor, got {type(t).__name__} "
                         "(fm.tensor(x) makes one)")
    return full(t.shape, 1.0, t.dtype, t.device)


def host_buffer(shape, dtype, device="cpu") -> np.ndarray:
    """A host NumPy array that ``Tensor.copy_to_host`` of ``device`` fills asynchronously
    (page-locked memory on the GPU).

    >>> host_buffer((2, 3), "int32").shape
    (2, 3)
    """
    return backend_of(Device.parse(device)).pinned_empty(tuple(shape), np.dtype(_dt.get(dtype).name))


def device_has(device, capability: str) -> bool:
    """Whether ``device``'s backend has a capability of the contract (``bf16``, ``graphs``,
    ``host_memory``): what code above the backends asks instead of a device's name.

    >>> device_has("cpu", "bf16"), device_has("cpu", "host_memory")
    (False, True)
    """
    from .backends.contract import CAPABILITIES
    if capability not in CAPABILITIES:
        raise DeviceError(f"device_has: unknown capability {capability!r}; expected one of "
                          f"{', '.join(CAPABILITIES)}")
    return bool(getattr(backend_of(Device.parse(device)), capability))


def device_numerics(device) -> dict:
    """What decides ``device``'s arithmetic besides an op's inputs: its type and what its
    backend's optional ``numerics()`` says (the CPU's kernels, a GPU's name, the switches that
    pick kernels). Two runs with the same values compute the same bits.

    >>> sorted(device_numerics("cpu"))
    ['FORGE_BIAS_SUMS', 'FORGE_CPU_GEMM', 'cpu_kernels', 'device', 'gemm', 'numpy']
    """
    dev = Device.parse(device)
    bk = backend_of(dev)
    return dict({"device": dev.type}, **(bk.numerics() if bk.numerics is not None else {}))


def release_cached(device) -> None:
    """Give the device memory a backend caches for reuse back to the device (CuPy's pool on the
    GPU; nothing on the CPU).

    >>> release_cached("cpu")
    """
    bk = backend_of(Device.parse(device))
    if bk.release_cached is not None:
        bk.release_cached()


def synchronize(device) -> None:
    """Wait until every kernel queued on ``device`` has finished (timing, benchmarks).

    >>> synchronize("cpu")
    """
    backend_of(Device.parse(device)).synchronize()
