"""The LM head and its loss as one op, ``linear_cross_entropy``, so the ``(N, Vp)`` logits are
never kept whole (at GPT-2 124M, B=32, T=1024 they are 3.3 GB in bf16, and their gradient as
much again). For each chunk of rows: the chunk's logits (cuBLAS), its loss and the gradient of
its logits written over them in one pass (cross_entropy.cu's ``cross_entropy_fused_*``), then
the chunk's rows of dx and its share of dw (cuBLAS; dw accumulates in float32 for bf16). This
is llm.c's fused classifier (the gradient in the forward, over the logits' own memory) taken
over chunks of rows, as Liger-Kernel's fused linear cross-entropy does. Kernels:
cross_entropy.cu (in bf16, one read and one write of the logits: persistent blocks that stream
the rows through two shared-memory buffers, each row's load overlapping the work on the one
before, where two rows fit in a block's shared memory (GPT-2's vocabulary does on an A100 or
H100); else a row of up to 65,536 logits held in registers), and reduce.cu's mean.
"""
from __future__ import annotations

from ...errors import ShapeError
from .cublas import _matmul_into
from .memory import _c, _ids, _like, cast
from .rows import _CE_THREADS, _sum_finish
from .runtime import (BF16, F32, _acc, _acc_dtype, _cc_major, _dev, _empty, _float_sfx, _guarded,
                      _i32, _i64, _launch, _set_max_shared, _sfx, _sm_count)

CHUNK_BYTES = 1 << 30
"""The logits of one chunk of rows at most (1 GiB: about 10,600 rows of GPT-2's vocabulary in
bf16). Fewer, larger chunks: dw's float32 sum is read and written once a chunk (308 MB at
GPT-2's vocabulary), and each chunk is three products; 256 MiB chunks cost about 1 ms a step
more at 124M, B=32, T=1024 on an H200 (benchmarks/RESULTS.md, tenth session)."""


_ROW_THREADS, _ROW_VECS = 1024, 8   # cross_entropy.cu: CE_ROW_THREADS, CE_ROW_VECS
_STREAM_THREADS = 1024               # cross_entropy.cu: CE_STREAM_THREADS


def _loss_kernel(x, targets, Vp: int, n_rows: int):
    """(kernel, grid, threads, shared bytes, whether it takes the row count) for a chunk of
    ``n_rows`` rows: the streaming bf16 kernel where two rows of ``Vp`` logits fit in a block's
    shared memory (sm_80+), else the register-row bf16 kernel, else the generic one."""
    t = _sfx(targets.dtype)
    if x.dtype == BF16 and Vp % 8 == 0:
        name = f"cross_entropy_fused_stream_bf16_{t}"
        if _cc_major(_dev()) >= 8 and _set_max_shared("cross_entropy", name, 4 * Vp):
            return name, min(n_rows, _sm_count(_dev())), _STREAM_THREADS, 4 * Vp, True
        if Vp <= _ROW_VECS * 8 * _ROW_THREADS:
            return f"cross_entropy_fused_rows_bf16_{t}", n_rows, _ROW_THREADS, 0, False
    return f"cross_entropy_fused_{_float_sfx(x)}_{t}", n_rows, _CE_THREADS, 0, False


def chunk_rows(n_rows: int, vp: int, itemsize: int) -> int:
    """Rows per chunk for ``n_rows`` rows of ``vp`` logits of ``itemsize`` bytes: as few
    chunks as ``CHUNK_BYTES`` allows, of equal size (a multiple of 128 rows where a chunk holds
    more than 128), so the last chunk is not a sliver.

    >>> chunk_rows(32768, 50304, 2), chunk_rows(100, 50304, 2), chunk_rows(16384, 65, 4)
    (8192, 100, 16384)
    >>> chunk_rows(20000, 50304, 2)     # two chunks of 10,000 rows, rounded up to 128
    10112
    """
    cap = max(1, min(n_rows, CHUNK_BYTES // max(1, vp * itemsize)))
    if cap == n_rows:
        return n_rows
    if cap >= 128:
        cap -= cap % 128
    chunks = -(-n_rows // cap)
    rows = -(-n_rows // chunks)
    if rows >= 128:
        rows = min(cap, -(-rows // 128) * 128)
    return rows


@_guarded
def linear_cross_entropy(x, w, targets, vocab_size, grad):
    """``(loss, dx, dw)``: the mean cross-entropy of ``x @ w^T`` over its first ``vocab_size``
    columns and, with ``grad``, its gradients for dloss = 1 (else None, None)."""
    x = _c(x)
    w = _like(_c(w), x.dtype)
    targets = _ids(targets).reshape(-1)
    N, C = x.shape
    Vp = w.shape[0]
    V = int(vocab_size)
    if w.shape[1] != C or targets.size != N or not 0 < V <= Vp:
        raise ShapeError(f"linear_cross_entropy: x {x.shape}, w {w.shape}, {targets.size} "
                         f"targets and vocab_size {V} do not fit together")
    acc = _acc_dtype(x.dtype)
    loss = _empty((), acc)
    dx = _empty((N, C), x.dtype) if grad else None
    dw_acc = None
    if grad:
        dw_acc = _empty((Vp, C), F32 if x.dtype == BF16 else x.dtype)
        if N == 0:
            dw_acc.fill(0)
    if N == 0:
        loss.fill(float("nan"))
    else:
        losses = _empty((N,), acc)
        rows = chunk_rows(N, Vp, x.itemsize)
        buf = _empty((rows, Vp), x.dtype)
        inv_n = _acc(acc, 1.0 / N)
        for r0 in range(0, N, rows):
            n = min(rows, N - r0)
            xs, lg = x[r0:r0 + n], buf[:n]
            _matmul_into(xs, w, lg, False, True, 1.0, None)                 # logits (n, Vp)
            kernel, grid, threads, shared, counted = _loss_kernel(x, targets, Vp, n)
            args = (lg, targets[r0:r0 + n], losses[r0:r0 + n]) + ((_i64(n),) if counted else ()) \
                + (_i32(Vp), _i32(V), inv_n)
            _launch("cross_entropy", kernel, (grid,), threads, args, shared=shared)
            if grad:                                                          # lg is dlogits now
                _matmul_into(lg, w, dx[r0:r0 + n], False, False, 1.0, None)  # (n, Vp) @ (Vp, C)
                _matmul_into(lg, xs, dw_acc, True, False, 1.0, None,         # (Vp, n) @ (n, C)
                             beta=0.0 if r0 == 0 else 1.0)
        _sum_finish(losses, loss, N, 1.0 / N)
    if not grad:
        return loss, None, None
    dw = dw_acc if dw_acc.dtype == x.dtype else cast(dw_acc, x.dtype.name)
    return loss, dx, dw

