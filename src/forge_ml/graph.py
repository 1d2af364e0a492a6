"""Capture and replay: the device work of a function recorded once (a CUDA graph on the GPU)
and replayed with one launch. Above the backends and below any model, as tinygrad's JIT is:
the decoding runtime (``inference.decode``) uses it; a backend offers it when its
``graphs`` capability is true.

>>> from forge_ml.device import CPU
>>> available(CPU)
False
"""
from __future__ import annotations

from .device import Device
from .errors import DeviceError
from .tensor import Tensor, backend_of


def available(device) -> bool:
    """Whether ``device``'s backend can capture graphs."""
    return bool(backend_of(Device.parse(device)).graphs)


class Graph:
    """Work captured from a function: ``replay()`` runs it again; ``outputs`` are the Tensors
    the function returned during the capture, which every replay rewrites in place. Every
    tensor the captured work touched keeps its memory (the inputs it read: write new values
    into them with ``ops.assign`` before a replay)."""

    def __init__(self, captured, outputs):
        self._captured, self.outputs = captured, outputs

    def replay(self) -> None:
        """Run the captured work again, ordered with the device's other work."""
        self._captured.replay()


def capture(device, fn) -> Graph:
    """Capture the device work of ``fn()`` (which returns a Tensor, or a tuple of Tensors,
    and may not wait for the device or read a value back). Run ``fn`` once without capture
    first, so that every kernel it launches is compiled and loaded.
    """
    dev = Device.parse(device)
    bk = backend_of(dev)
    if not bk.graphs:
        raise DeviceError(f"graph capture: the {dev.type} backend cannot capture graphs")
    box = {}

    def work():
        out = fn()
        box["out"] = out
        return out.data if isinstance(out, Tensor) else tuple(t.data for t in out)

    captured = bk.capture_graph(work)
    return Graph(captured, box["out"])
