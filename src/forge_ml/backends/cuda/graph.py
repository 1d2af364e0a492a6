"""CUDA graphs: ``capture_graph(fn)`` records the device work of ``fn()`` once, and
``CapturedGraph.replay()`` runs it again with one launch (the decoding step,
``models.gpt2.DecodeStep``, is replayed so). Kernels launched with programmatic dependent
launch become programmatic edges of the graph; cuBLAS products are captured because cublas.py
calls libcublas directly.
"""
from __future__ import annotations

from ...errors import CaptureError
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
        self.first = None   # capture_graph(run_first=True): what the eager run returned

    @_guarded
    def replay(self) -> None:
        """Run the captured work again, on the current stream (ordered with other ops)."""
        if self._graph is None:
            raise CaptureError("this graph was released; capture the work again")
        self._graph.launch(cupy.cuda.get_current_stream())

    def release(self) -> None:
        """Drop the graph and give its pool's memory back to the device now. Dropping the
        last reference to the graph is not enough: a tensor of the pool that lives on (a
        step's first losses, a cached buffer) keeps the pool, and CuPy's pool holds on to
        every freed block (a training step's 9.7 GiB at GPT-2 124M, B=32) until it is told to
        let go. The graph cannot be replayed after. Memory still in use stays valid."""
        self._graph = None
        self._pool.free_all_blocks()


@_guarded
def capture_graph(fn, run_first: bool = False) -> CapturedGraph:
    """Capture the GPU work of ``fn()`` into a CUDA graph (``CapturedGraph``).

    ``fn`` must queue device work only: nothing that waits for the GPU or reads a value back
    (that is an error during a capture). Every kernel it launches must be compiled and loaded
    first: run it once eagerly before, or ask for ``run_first``, which runs it once for real
    in the graph's own memory pool and then captures it (``first``: what that run returned),
    so the warm-up's memory is the graph's, not held twice. The capture runs on a private
    stream in relaxed mode, its allocations from a private pool.
    """
    pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    first = None
    with cupy.cuda.using_allocator(pool.malloc):
        if run_first:
            stream.wait_event(cupy.cuda.get_current_stream().record())
            with stream:
                first = fn()
        with stream:
            stream.begin_capture()
            try:
                outputs = fn()
            except BaseException as e:
                try:
                    stream.end_capture()
                except Exception:  # the capture may be invalid already; the first error is the one
                    pass
                if not run_first or not isinstance(e, Exception):
                    raise
                cupy.cuda.get_current_stream().wait_event(stream.record())
                raise CaptureError(f"graph capture failed after the real run: {type(e).__name__}: {e}",
                                   first=first, keep=pool) from e
            graph = stream.end_capture()
        if run_first:   # the current stream's next work (reading `first`) follows the run
            cupy.cuda.get_current_stream().wait_event(stream.record())
    captured = CapturedGraph(graph, outputs, pool)
    captured.first = first
    return captured
