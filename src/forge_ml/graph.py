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
from .errors import CaptureError, DeviceError
from .tensor import Tensor, backend_of


def available(device) -> bool:
    """Whether ``device``'s backend can capture graphs (CUDA's can; the CPU's cannot).

    >>> available("cpu")
    False
    """
    return bool(backend_of(Device.parse(device)).graphs)


class Graph:
    """Work captured from a function: ``replay()`` runs it again; ``outputs`` are the Tensors
    the function returned during the capture, which every replay rewrites in place. Every
    tensor the captured work touched keeps its memory (the inputs it read: write new values
    into them with ``ops.assign`` before a replay). ``first``: with ``capture(run_first=True)``,
    what the function's real run before the capture returned.

    Example (a CUDA GPU; ``x`` a cuda Tensor, as in ``capture``'s example):
        g = capture("cuda", lambda: fm.ops.add(x, x), run_first=True)
        g.replay()    # g.first: the real run's x + x; g.outputs: rewritten by each replay
    """

    def __init__(self, captured, outputs, first=None):
        self._captured, self.outputs, self.first = captured, outputs, first

    def replay(self) -> None:
        """Run the captured work again, ordered with the device's other work.

        Example (a CUDA GPU; ``g`` from ``capture``):
            fm.ops.assign(x, [3.0, 4.0]); g.replay()    # g.outputs: x + x of the new x
        """
        self._captured.replay()

    def release(self) -> None:
        """Give the graph's memory back to the device now (not when the collector finds the
        last reference); the graph cannot be replayed after. Tensors still in use keep
        theirs.

        Example (a CUDA GPU; ``g`` from ``capture``):
            y = g.outputs.numpy(); g.release()    # read what it needs first, then free it
        """
        release = getattr(self._captured, "release", None)
        if release is not None:
            release()


def capture(device, fn, run_first: bool = False) -> Graph:
    """Capture the device work of ``fn()`` (which returns a Tensor, or a tuple of Tensors,
    and may not wait for the device or read a value back). Every kernel it launches must be
    compiled and loaded first: run ``fn`` once before, or pass ``run_first=True`` to have it
    run once for real just before the capture, its memory then reused by the graph (a
    training step's first step: no second copy of its activations). A capture that fails
    after that run raises ``errors.CaptureError`` carrying the run's outputs (``first``).
    A backend without graphs (the CPU's) is a DeviceError.

    >>> capture("cpu", lambda: None)
    Traceback (most recent call last):
    ...
    forge_ml.errors.DeviceError: graph capture: the cpu backend cannot capture graphs

    Example (a CUDA GPU):
        import forge_ml as fm
        x = fm.tensor([1.0, 2.0], device="cuda")
        g = capture("cuda", lambda: fm.ops.add(x, x), run_first=True)
        fm.ops.assign(x, [3.0, 4.0]); g.replay()
        g.outputs.numpy().tolist()    # [6.0, 8.0]
    """
    dev = Device.parse(device)
    bk = backend_of(dev)
    if not bk.graphs:
        raise DeviceError(f"graph capture: the {dev.type} backend cannot capture graphs")
    outs = []   # what fn returned: [the real run's,] the capture's

    def work():
        out = fn()
        outs.append(out)
        return out.data if isinstance(out, Tensor) else tuple(t.data for t in out)

    try:
        captured = bk.capture_graph(work, run_first=True) if run_first else bk.capture_graph(work)
    except CaptureError as e:   # the real run is done: hand back its outputs as Tensors
        e.first = outs[0]
        raise
    return Graph(captured, outs[-1], outs[0] if run_first else None)
