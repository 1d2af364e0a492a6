"""Backends: the kernels behind ``forge_ml.ops``, one folder per device type, and the
registry that loads them.

The contract a backend meets is code: ``backends/contract.py`` (memory, core kernels, fused
kernels, capabilities). The registry maps a device type to a loader; ``get(device)`` loads
the backend on first use (so ``import forge_ml`` never imports CuPy), checks it against the
contract (a missing core op is a DeviceError naming it), fills every fused op it lacks with
the composed default of ``backends/compose.py``, and returns a ``Backend``: an object whose
attributes are the backend's functions and capabilities.

Adding a device: a folder under ``backends/``, one ``register`` line, and a green
``tests/backends`` suite (``docs/architecture.md``, "Add a backend").

>>> from forge_ml.backends import get
>>> from forge_ml.device import CPU
>>> bk = get(CPU)
>>> bk.name, bk.host_memory, bk.graphs
('cpu', True, False)
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Dict

from ..errors import DeviceError, host_out_of_memory
from . import compose, contract

_LOADERS: Dict[str, Callable] = {}
_LOADED: dict = {}


class Backend:
    """A loaded backend: every contract function as an attribute (the backend's own, or the
    composed default of a fused op it lacks), its capabilities, and ``module`` (anything
    else the module holds is reachable as an attribute too: tests and benchmarks use it)."""

    def __init__(self, name: str, module):
        lacking = contract.missing(module)
        if lacking:
            raise DeviceError(f"backend {name!r} ({getattr(module, '__name__', module)}) does not "
                              f"meet the contract: it lacks {', '.join(lacking)} "
                              "(see forge_ml/backends/contract.py)")
        self.name = name
        self.module = module
        for n in contract.MEMORY + contract.CORE:
            setattr(self, n, getattr(module, n))
        self.composed = []   # fused ops running on their composed default
        for n in contract.FUSED:
            own = getattr(module, n, None)
            if callable(own):
                setattr(self, n, own)
            else:
                setattr(self, n, functools.partial(getattr(compose, n), self))
                self.composed.append(n)
        for cap, default in contract.CAPABILITIES.items():
            setattr(self, cap, bool(getattr(module, cap.upper(), default)))
        for n in contract.OPTIONAL + contract.GRAPH:
            setattr(self, n, getattr(module, n, None))
        if self.host_memory:   # NumPy's failed allocations: forge_ml's OutOfMemoryError
            for n in contract.MEMORY + contract.CORE + contract.FUSED + contract.OPTIONAL:
                fn = getattr(self, n, None)
                if callable(fn):
                    setattr(self, n, host_guarded(n, fn))
        if self.graphs and not callable(self.capture_graph):
            raise DeviceError(f"backend {name!r} says it captures graphs but has no capture_graph")
        lacking = [n for n in contract.GRAPH if not callable(getattr(self, n))]
        if self.graphs and not self.host_memory and lacking:
            raise DeviceError(f"backend {name!r} captures graphs of device memory but lacks "
                              f"{', '.join(lacking)} (contract.GRAPH)")

    def __getattr__(self, item):  # only for names not set above: the module's own helpers
        return getattr(self.module, item)

    def __repr__(self) -> str:
        return f"<forge-ml backend {self.name!r}>"


def host_guarded(op: str, fn: Callable) -> Callable:
    """``fn`` with NumPy's out-of-memory failures raised as OutOfMemoryError (which is still a
    MemoryError) saying what was asked (as ``op``) and what is free: every function of a
    host-memory backend, and ``tensor.full``'s host array."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (MemoryError, ValueError) as e:
            oom = host_out_of_memory(op, e)
            if oom is None or oom is e:
                raise
            raise oom from None
    return guarded


def register(name: str, loader: Callable) -> None:
    """Register device type ``name``: ``loader()`` returns the backend module (it may raise
    DeviceError when the device cannot be used here). A later registration replaces an
    earlier one that was not loaded yet.

    >>> import types
    >>> register("doc_example", lambda: types.SimpleNamespace())
    >>> "doc_example" in names()
    True
    >>> _LOADERS.pop("doc_example") is not None
    True
    """
    if not name or not name.isidentifier():
        raise DeviceError(f"register: a backend name must be an identifier, got {name!r}")
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def names() -> list:
    """The registered device types.

    >>> names()[:2]
    ['cpu', 'cuda']
    """
    return list(_LOADERS)


def _load_cuda():
    try:
        return importlib.import_module(".cuda", __name__)
    except DeviceError:
        raise
    except Exception as e:  # ImportError, CUDA driver errors, ...
        raise DeviceError(
            f"the CUDA backend cannot load: {e}. Install the extra with: pip install "
            "'forge-ml[cuda]', on a machine with an NVIDIA GPU and driver") from e


register("cpu", lambda: importlib.import_module(".cpu", __name__))
register("cuda", _load_cuda)


def load(name: str) -> Backend:
    """The backend of device type ``name``, loaded (and started) on first use."""
    b = _LOADED.get(name)
    if b is None:
        loader = _LOADERS.get(name)
        if loader is None:
            raise DeviceError(f"no backend for device type {name!r}; registered: "
                              f"{', '.join(_LOADERS)}")
        try:
            module = loader()
        except DeviceError as e:
            raise DeviceError(f"device {name} was asked for but its backend cannot load: {e}") from e
        b = Backend(name, module)
        if b.start is not None:
            b.start()
        _LOADED[name] = b
    return b


def get(device) -> Backend:
    """The backend for a Device, with that device made current (``select``)."""
    b = load(device.type)
    if b.select is not None:
        b.select(device.index)
    elif device.index != 0:
        raise DeviceError(f"device {device.type}:{device.index}: the {device.type} backend has one device, {device.type}:0")
    return b
