"""CUDA graphs: ``capture_graph(fn)`` records the device work of ``fn()`` once, and
``CapturedGraph.replay()`` runs it again with one launch (the decoding step,
``models.gpt2.DecodeStep``, is replayed so). Kernels launched with programmatic dependent
launch become programmatic edges of the graph; cuBLAS products are captured because cublas.py
calls libcublas directly.
"""
from __future__ import annotations

from .runtime import _guarded, cupy


class CapturedGraph:
    """Work captured once from a Python function and replayed with one launch.

    ``outputs``: what the function returned during the capture (arrays the replays rewrite in
    place). Every array the captured work touches keeps its address: the inputs the function
    read (write new values into them before a replay) and its intermediates, which live in a
    memory pool of the graph's own, so no later allocation can land on them.
    """

    def __init__(self, graph, outputs, pool):
        self._graph, self.outputs, self._pool = graph, outputs, pool

    @_guarded
    def replay(self) -> None:
        """Run the captured work again, on the current stream (ordered with other ops)."""
        self._graph.launch(cupy.cuda.get_current_stream())


@_guarded
def capture_graph(fn) -> CapturedGraph:
    """Capture the GPU work of ``fn()`` into a CUDA graph (``CapturedGraph``).

    ``fn`` must queue device work only: nothing that waits for the GPU or reads a value back
    (that is an error during a capture). Run it once eagerly first, so every kernel it
    needs is compiled and loaded. The capture runs on a private stream in relaxed mode, its
    allocations from a private pool.
    """
    pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        try:
            outputs = fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # the capture may be invalid already; the first error is the one
                pass
            raise
        graph = stream.end_capture()
    return CapturedGraph(graph, outputs, pool)
