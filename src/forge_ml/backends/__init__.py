"""Backends: the kernels behind ``forge_ml.ops``, one module per device type.

A backend takes and returns arrays (NumPy on ``cpu``, CuPy on ``cuda``), never Tensors, and
never knows the tape. ``forge_ml.ops`` has already checked shapes, dtypes and devices when
a backend function runs, so a backend only computes. All arrays are C-contiguous.

The contract (every backend module defines each name):

Memory
    zeros(shape, dtype_name) -> array            dtype_name in float32/float64/bfloat16/int32/int64
    from_host(np_array, dtype_name) -> array     copy of a NumPy array, cast to dtype_name
    to_host(array) -> np.ndarray                 a copy on the host (bf16 comes back as float32)
    cast(array, dtype_name) -> array             a new array
    copy(array) -> array
    assign(dst, np_array) -> None                dst[...] = np_array, in place (same shape)

Forward and backward kernels (float32, float64; bfloat16 on cuda with float32 accumulation)
    matmul(a, b, bias, trans_a, trans_b, alpha, b_rows) -> out
        alpha * op(a) @ op(b)[+ bias]; 2-D x 2-D, or batched: both rank >= 3 with equal
        leading dims. b_rows: use only the first b_rows rows of b (before trans_b is applied,
        i.e. rows of b as stored).
    add(a, b) -> out                              same shape
    linear(x, w, bias, act, residual) -> y        act(x @ w + bias) + residual, act None or
                                                   "gelu", x (M, K), w (K, N); inference only
    sum_rows(x) -> (C,)                           sum over every axis but the last
    sumsq(x) -> 0-d float32 (float64 for float64 input): sum of squares, for grad clipping
    gelu(x) -> y ; gelu_bwd(x, dy) -> dx          tanh approximation
    layernorm(x, gamma, beta, eps) -> y           over the last axis
    layernorm_bwd(x, gamma, dy, eps) -> (dx, dgamma, dbeta)
    softmax(x, causal, off) -> y                  last axis; causal masks j > i + off (row i
                                                   of the second-to-last axis); masked = 0.0
    softmax_bwd(y, dy) -> dx
    split_heads(qkv, n_head) -> (q, k, v)         (..., T, 3C) -> 3 x (..., H, T, hs)
    unsplit_head(dy, which) -> (..., T, 3C)       zeros outside the `which` third
    merge_heads(x) -> (..., T, C)                 (..., H, T, hs) -> (..., T, H*hs)
    unmerge_heads(dy, h) -> (..., H, T, hs)
    attention(q, k, v, scale) -> (out, lse)       causal self-attention (..., H, T, hs);
                                                   lse (..., H, T) float32 log-sum-exp of
                                                   the scaled masked scores per query row
    attention_bwd(q, k, v, out, lse, dout, scale) -> (dq, dk, dv)
    attention_qkv(qkv, n_head, scale) -> (y, lse) the same from fused (B, T, 3C) rows:
                                                   y (B, T, C) heads merged, lse (B, H, T)
    attention_qkv_bwd(qkv, y, lse, dy, n_head, scale) -> dqkv (B, T, 3C)
    embedding(ids, wte, wpe, pos) -> (..., T, C)  wte[ids] + wpe[pos + t]; pos an int or a
                                                   one-element int32 array (read by the kernel;
                                                   past the table -> NaN rows)
    scatter_add_rows(dst, ids, src) -> None       dst[ids[i]] += src[i], in place, repeats add
    kv_append(cache, new, pos) -> None            cache[..., pos:pos+Tn, :] = new, in place
    decode_attention(qkv, k_cache, v_cache, pos, n_head, scale) -> y (B, C)
        one decoding step: qkv (B, 3C) -> keys/values written at row pos of the caches
        (B, H, Tmax, hs), then per head softmax(scale q k^T) v over rows 0..pos, float32
        scores; pos an int or a one-element int32 array; outside 0..Tmax-1 -> nothing
        written, y NaN
    dropout(x, p, seed) -> y                      y = x * keep * float32(1/(1-p)), keep from
                                                   forge_ml.rng.dropout_keep (Philox4x32-10)
    cross_entropy(logits, targets, vocab_size) -> 0-d float32 (float64 for float64 logits)
        mean over rows of logsumexp(l[:V]) - l[target]; V = vocab_size (columns >= V ignored)
    cross_entropy_bwd(logits, targets, dloss, vocab_size) -> dlogits
        dloss * (softmax(l[:V]) - onehot(target)) / N; zeros in columns >= V
    adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                 p_lowp=None) -> None
        in place on float32 p, m, v; g may be bf16; g is multiplied by grad_scale first;
        bias-corrected with step (1-based); decoupled weight decay p -= lr * wd * p;
        if p_lowp is given (a bf16 array) it receives the updated p rounded to bf16.

Decoding helpers
    greedy_next(logits, vocab_size, ids, pos, out=None) -> None
        in place: ids[b] = argmax of float32 logits[b, :vocab_size] (numpy's ties and NaNs),
        also into out[b] when given, then pos += 1 (int32 arrays)
    pinned_empty(shape, dtype) -> np.ndarray     host memory device copies can fill async
    to_host_async(array, out) -> handle or None  copy into out; handle.synchronize() waits

Optional: capture_graph(fn) -> object with .replay() and .outputs (cuda only): the device
work of fn() recorded once (a CUDA graph) and replayed with one launch.

``get(device)`` returns the module for a Device; the CUDA one is imported on first use so that
``import forge_ml`` never imports CuPy.

>>> from forge_ml.backends import get
>>> from forge_ml.device import CPU
>>> get(CPU).__name__
'forge_ml.backends.cpu'
"""
from __future__ import annotations

from ..device import Device
from ..errors import DeviceError


def get(device: Device):
    """The backend module for ``device`` (imports the CUDA backend on first use)."""
    if device.type == "cpu":
        from . import cpu
        return cpu
    if device.type == "cuda":
        try:
            from . import cuda
        except DeviceError:
            raise
        except Exception as e:  # ImportError, CUDA driver errors, ...
            raise DeviceError(
                f"device {device} was asked for but the CUDA backend cannot load: {e}. "
                "Install the extra with: pip install 'forge-ml[cuda]', on a machine with an "
                "NVIDIA GPU and driver") from e
        cuda.use_device(device.index)
        return cuda
    raise DeviceError(f"no backend for device {device}")
