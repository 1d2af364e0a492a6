"""The CUDA backend: CuPy arrays, forge-ml's own kernels (``backends/cuda/*.cu``, compiled by
NVRTC on first use and cached by CuPy, in memory and on disk), and cuBLAS for the matrix
products (called through ctypes, so that they can be captured in a CUDA graph; on Hopper,
products of at most four rows go to ``gemv.cu`` instead, the layers of a decoding step).
``capture_graph`` records the device work of a function once for replays
(``models.gpt2.DecodeStep`` uses it). On Hopper the decoding kernels (gemv, decode attention)
run as thread-block clusters and with programmatic dependent launch (``cuLaunchKernelEx``
through NVIDIA's ``cuda.bindings``), so each starts loading its weights while the previous
kernel finishes.

The rooms, each a module beside the ``.cu`` files it launches:

- ``runtime``: CuPy and the device (``select``), errors, NVRTC and the kernel cache, the
  launchers (CuPy's, and ``cuLaunchKernelEx`` for clusters and programmatic dependent
  launch), dtypes and kernel scalars; ``memory``: allocation, host copies, casts;
  ``cublas``: the matrix products; ``graph``: CUDA graphs;
- ``linear`` (gemv.cu, and ``cublaslt`` for the products with an epilogue): matmul, linear,
  matmul_gelu, matmul_dgelu, weight_grads; ``pointwise`` (elementwise.cu, gelu.cu, dropout.cu,
  adamw.cu): add, scale, gelu, dropout, adamw_update; ``many`` (many.cu): an optimizer
  step's per-tensor ops over a whole model in a few launches, sumsq_total and
  adamw_update_many_at; ``classifier`` (cross_entropy.cu): the
  LM head and its loss over chunks of rows, linear_cross_entropy; ``rows`` (reduce.cu, layernorm.cu, softmax.cu,
  cross_entropy.cu): sum_rows, sumsq, layernorm, softmax, logsumexp, cross_entropy;
  ``layout`` (heads.cu, embedding.cu): the head permutations, embedding, scatter_add_rows;
  ``attention`` (attention.cu, flash_attention.cu): flash and composed attention, the KV
  cache, decode_attention; ``sampling`` (greedy.cu, sample.cu): greedy_next, sample_next,
  penalize_logits;
  ``decoder`` (decode_model.cu, decode_layers.cu): GPT-2's batch-1 decoding step as one kernel
  or two a layer,
  decode_gpt2.

Dtypes: float32, float64 and bfloat16 (stored as 2-byte words, ``ml_dtypes.bfloat16`` on the
CuPy side; every kernel accumulates bf16 in float32). Each kernel file holds one layer's
forward and backward side by side; ``common.cuh`` is pasted into each before NVRTC sees it.
Errors: no CuPy or no GPU -> DeviceError at import; an unknown device index -> DeviceError
from ``select``; NVRTC failures -> CompileError with the compiler's log; an allocation the
GPU cannot hold -> OutOfMemoryError (the process can go on).

The contract is ``forge_ml/backends/contract.py``; this package only computes (``ops`` has
checked shapes, dtypes and devices already), but it keeps a few cheap checks of its own so
that a direct call with bad shapes fails with a ShapeError rather than a wild kernel.
"""
from __future__ import annotations

from . import runtime as _runtime
from .attention import (_attention_bwd_composed, _attention_bwd_flash_hopper,
                        _attention_composed, _attention_flash_hopper, _flash_wanted, _hopper_ok,
                        _qkv_flash_bwd_hopper, _qkv_flash_fwd_hopper, _qkv_flash_ok, attention, attention_bwd, attention_qkv,
                        attention_qkv_bwd, attention_qkv_bwd_sums, attention_qkv_dropout,
                        attention_qkv_dropout_bwd,
                        decode_attention, kv_append)
from .classifier import linear_cross_entropy
from .decoder import decode_gpt2, decode_gpt2_ok
from .graph import CapturedGraph, capture_graph
from .layout import (embedding, merge_heads, scatter_add_rows, split_heads, unmerge_heads,
                     unsplit_head)
from .linear import linear, matmul, matmul_dgelu, matmul_gelu, weight_grads
from .many import adamw_update_many_at, sumsq_total
from .memory import (assign, cast, copy, from_host, from_host_async, pinned_empty, release_cached,
                     to_host, to_host_async, zeros)
from .pointwise import (adamw_update, adamw_update_at, add, clip_scale, dropout, dropout_at, gelu,
                        gelu_bwd, scale)
from .rows import (cross_entropy, cross_entropy_bwd, layernorm, layernorm_bwd, layernorm_bwd_add,
                   layernorm_bwd_sums,
                   logsumexp, softmax, softmax_bwd, sum_rows, sumsq)
from .runtime import (_pdl_wrote, compile_source, device_name, kernel_source, select,
                      synchronize, use_device)
from .sampling import greedy_next, penalize_logits, sample_next

# the switches that pick a training step's kernels (or the order of their sums)
_NUMERIC_SWITCHES = ("FORGE_ATTENTION", "FORGE_FUSED_LOSS", "FORGE_TRAIN_GRAPH",
                     "FORGE_WGMMA_ATTENTION", "FORGE_WGMMA_BWD_SHARED", "FORGE_WGMMA_DKDV",
                     "FORGE_WGMMA_ROWS",
                     "FORGE_CUBLASLT", "FORGE_GEMM_TUNE", "FORGE_BIAS_SUMS")


def numerics() -> dict:
    """What decides this backend's arithmetic besides an op's inputs: the GPU (its kernels and
    cuBLAS's choices differ by model) and the switches that pick kernels. Training
    checkpoints record it."""
    from ... import flags
    try:   # cuBLAS's choices come with its CUDA version (a record: what cannot be read is left out)
        libs = {"cupy": str(_runtime.cupy.__version__),
                "cuda_runtime": int(_runtime.cupy.cuda.runtime.runtimeGetVersion())}
    except Exception:
        libs = {}
    return dict({"gpu": device_name()}, **libs, **{k: flags.get(k) for k in _NUMERIC_SWITCHES})


NAME = "cuda"
BF16 = _runtime.BF16 is not None   # bfloat16 storage: CuPy can hold it (ml_dtypes)
GRAPHS = True                      # capture_graph
HOST_MEMORY = False                # arrays live on the GPU: reading one back waits for it

__all__ = [  # what the package holds: the contract's functions and a few more
    "NAME", "BF16", "GRAPHS", "HOST_MEMORY", "select", "use_device", "device_name",
    "synchronize", "compile_source", "kernel_source", "CapturedGraph", "capture_graph",
    "zeros", "from_host", "to_host", "cast", "copy", "assign", "pinned_empty", "to_host_async",
    "from_host_async",
    "release_cached",
    "matmul", "add", "sum_rows", "sumsq", "gelu", "gelu_bwd", "layernorm", "layernorm_bwd",
    "softmax", "softmax_bwd", "logsumexp", "split_heads", "unsplit_head", "merge_heads",
    "unmerge_heads", "embedding", "scatter_add_rows", "kv_append", "dropout", "cross_entropy",
    "cross_entropy_bwd", "adamw_update", "attention", "attention_bwd", "attention_qkv",
    "attention_qkv_bwd", "attention_qkv_bwd_sums", "attention_qkv_dropout",
    "attention_qkv_dropout_bwd", "linear",
    "matmul_gelu", "matmul_dgelu", "weight_grads", "layernorm_bwd_add", "layernorm_bwd_sums",
    "decode_attention", "greedy_next", "sample_next", "penalize_logits",
    "linear_cross_entropy", "scale",
    "dropout_at", "adamw_update_at", "clip_scale", "decode_gpt2", "decode_gpt2_ok",
    "adamw_update_many_at", "sumsq_total", "numerics",
    # private, for the GPU tests and benchmarks
    "_attention_composed", "_attention_bwd_composed", "_flash_wanted", "_qkv_flash_ok",
    "_pdl_wrote", "_attention_flash_hopper", "_qkv_flash_fwd_hopper", "_hopper_ok",
    "_attention_bwd_flash_hopper", "_qkv_flash_bwd_hopper",
]
