"""The backend contract, as code: what a device folder under ``backends/`` must provide.

A backend is a module (or package) of plain functions that take and return arrays of its
own kind (NumPy on ``cpu``, CuPy on ``cuda``), never Tensors, and never know the tape.
``forge_ml.ops`` has checked shapes, dtypes and devices before a backend function runs, so
a backend only computes. Arrays are C-contiguous.

Six groups. Each is a name tuple at the end of this file (``CAPABILITIES`` a dict), and the
tuples are the contract: ``backends.Backend`` reads them and nothing else. The first four
are also written out below as ``Protocol`` classes, one docstring per member; those classes
are documentation, never read by the loader, so a new op goes into its tuple (and its class:
``tests/test_docs_contract.py`` checks that they agree).

- **memory** (``MEMORY``, ``Memory``): allocation, host copies, in-place assignment,
  ``synchronize``. Required;
- **core kernels** (``CORE``, ``CoreKernels``): the ops every backend computes itself (the
  fused ops' defaults are written with them), with the backward of each whose backward is
  not made of other ops (``add``'s, ``matmul``'s, ``embedding``'s and ``dropout``'s are).
  Required: loading a backend that lacks one is an error naming it, for every backend
  (``cpu``, ``cuda``, the contract suite's ``corenp``), so a new core op lands with every
  backend's kernel;
- **fused kernels** (``FUSED``, ``FusedKernels``): ops that a backend may run as one kernel
  (flash attention, a linear layer with its prologue and epilogue, the LM head with its loss,
  a decoding step's attention, the device-side argmax). Each has a composed default in
  ``backends/compose.py``, written with memory and core ops only; a backend that lacks a
  fused kernel gets that default;
- **capabilities** (``CAPABILITIES``, ``Capabilities``): attributes that code above the
  backends asks instead of testing a device's name (``bf16`` storage, CUDA-graph
  ``graphs``, ``host_memory``), each False where a backend does not declare it;
- **step values in device memory** (``GRAPH``): the forms a captured training step replays;
  required of a backend with ``graphs`` and without ``host_memory``;
- **optional members** (``OPTIONAL``): ``select``, ``start``, ``capture_graph``, the
  whole-model optimizer ops, ...; each is None on a backend that lacks it.

``docs/architecture.md`` ("Add an op") lists every file a new op touches.

The semantics of each op are its docstring in ``ops.py`` and ``tests/reference.py`` (the float64
specification); ``tests/backends/`` runs every op of every available backend against it.

>>> sorted(set(CORE) & set(FUSED))
[]
>>> "attention_qkv_bwd" in FUSED, "matmul" in CORE
(True, True)
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple, runtime_checkable

Array = Any  # a NumPy or CuPy array (or another backend's own array type)


@runtime_checkable
class Memory(Protocol):
    """Memory: where arrays live and how they reach the host."""

    def zeros(self, shape: tuple, dtype_name: str) -> Array:
        """A new zero-filled array; dtype_name in float32/float64/bfloat16/int32/int64."""

    def from_host(self, np_array, dtype_name: str) -> Array:
        """A copy of a NumPy array, cast to ``dtype_name``."""

    def to_host(self, array: Array):
        """A NumPy copy (bfloat16 comes back as float32)."""

    def cast(self, array: Array, dtype_name: str) -> Array:
        """A new array of another dtype."""

    def copy(self, array: Array) -> Array:
        """A new array with the same contents."""

    def assign(self, dst: Array, np_array) -> None:
        """``dst[...] = np_array``, in place (same shape), ordered with the kernels."""

    def synchronize(self) -> None:
        """Wait until every queued kernel has finished (a no-op where kernels are synchronous)."""

    def pinned_empty(self, shape: tuple, dtype):
        """A host NumPy array that device copies can fill asynchronously."""

    def to_host_async(self, array: Array, out):
        """Copy ``array`` into the host array ``out``; returns None when the copy is done
        already, else a handle whose ``synchronize()`` waits for it."""

    def from_host_async(self, dst: Array, src) -> None:
        """Copy the host array ``src`` (from ``pinned_empty``, ``dst``'s size and dtype, not
        bfloat16) into ``dst``, ordered with the kernels: queued behind the work before it
        (so ``dst`` may still be in use by that work), done before the work after it. The
        host must not write ``src`` until that later work has started; returns None."""


@runtime_checkable
class CoreKernels(Protocol):
    """Every op of the op set with its backward: float32 and float64, and bfloat16 storage
    with float32 accumulation where the backend has ``bf16``."""

    def matmul(self, a, b, bias, trans_a: bool, trans_b: bool, alpha: float,
               b_rows: Optional[int]) -> Array:
        """``alpha * op(a) @ op(b) [+ bias]``; 2-D x 2-D or batched (equal leading dims);
        ``b_rows`` uses the first rows of b as stored."""

    def add(self, a, b) -> Array:
        """Elementwise sum, same shape."""

    def sum_rows(self, x) -> Array:
        """Sum over every axis but the last: ``(..., C) -> (C,)``."""

    def sumsq(self, x) -> Array:
        """0-d sum of squares (float32; float64 for float64 input)."""

    def gelu(self, x) -> Array:
        """GPT-2's tanh GELU."""

    def gelu_bwd(self, x, dy) -> Array:
        """``dy * gelu'(x)``."""

    def layernorm(self, x, gamma, beta, eps: float) -> Array:
        """Layer norm over the last axis; a row whose variance passes the accumulation type's
        range (inf, or inf - inf) gives NaN, not beta (1 / sqrt(inf) would be 0), and so does
        its backward."""

    def layernorm_bwd(self, x, gamma, dy, eps: float) -> Tuple[Array, Array, Array]:
        """``(dx, dgamma, dbeta)``."""

    def softmax(self, x, causal: bool, off: int) -> Array:
        """Last axis; causal masks column j of row i when j > i + off; masked = 0.0."""

    def softmax_bwd(self, y, dy) -> Array:
        """``y * (dy - sum(y * dy))``."""

    def logsumexp(self, x, causal: bool, off: int) -> Array:
        """``(...,)``: log of the sum of exp over the last axis, masked as ``softmax``;
        float32 (float64 for float64 input)."""

    def split_heads(self, qkv, n_head: int) -> Tuple[Array, Array, Array]:
        """``(..., T, 3C) -> 3 x (..., H, T, hs)``."""

    def unsplit_head(self, dy, which: int) -> Array:
        """``(..., H, T, hs) -> (..., T, 3C)``, zeros outside the ``which`` third."""

    def merge_heads(self, x) -> Array:
        """``(..., H, T, hs) -> (..., T, H*hs)``."""

    def unmerge_heads(self, dy, h: int) -> Array:
        """``(..., T, C) -> (..., H, T, hs)``."""

    def embedding(self, ids, wte, wpe, pos) -> Array:
        """``wte[ids] + wpe[pos + t]``; pos an int or a one-element int32 array (a device
        position: past the table gives NaN rows)."""

    def scatter_add_rows(self, dst, ids, src) -> None:
        """``dst[ids[i]] += src[i]`` in place, repeats add."""

    def kv_append(self, cache, new, pos: int) -> None:
        """``cache[..., pos:pos+Tn, :] = new`` in place."""

    def dropout(self, x, p: float, seed: int) -> Array:
        """Inverted dropout with ``forge_ml.rng``'s Philox mask."""

    def cross_entropy(self, logits, targets, vocab_size: int) -> Array:
        """0-d mean over rows of ``logsumexp(l[:V]) - l[target]``."""

    def cross_entropy_bwd(self, logits, targets, dloss, vocab_size: int) -> Array:
        """``dloss * (softmax(l[:V]) - onehot) / N``, zero past V. ``dloss``: a float, or
        (a backend without ``host_memory``) a one-element array of the device, read there."""

    def adamw_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale, p_lowp=None) -> None:
        """One fused AdamW step in place on float32 p, m, v; ``p_lowp`` (bf16) receives the
        updated p rounded, where the backend has ``bf16``."""


@runtime_checkable
class FusedKernels(Protocol):
    """Ops a backend may fuse; ``backends.compose`` has the default of each."""

    def attention(self, q, k, v, scale: float) -> Tuple[Array, Array]:
        """Causal self-attention over ``(..., H, T, hs)``: ``(out, lse (..., H, T))``."""

    def attention_bwd(self, q, k, v, out, lse, dout, scale: float) -> Tuple[Array, Array, Array]:
        """``(dq, dk, dv)``."""

    def attention_qkv(self, qkv, n_head: int, scale: float) -> Tuple[Array, Array]:
        """The same from fused ``(B, T, 3C)`` rows: ``(y (B, T, C), lse (B, H, T))``."""

    def attention_qkv_bwd(self, qkv, y, lse, dy, n_head: int, scale: float) -> Array:
        """``dqkv (B, T, 3C)``."""

    def attention_qkv_bwd_sums(self, qkv, y, lse, dy, n_head: int,
                               scale: float) -> Tuple[Array, Array]:
        """``(dqkv, sum_rows(dqkv))``: the backward that writes qkv's whole gradient also sums
        it over rows, the bias gradient of the linear layer whose output qkv is (GPT-2's
        c_attn; on the GPU the kernels sum the dq, dk and dv they write, as rounded to qkv's
        dtype)."""

    def attention_qkv_dropout(self, qkv, n_head: int, scale: float, p: float,
                              seed) -> Tuple[Array, Array]:
        """``attention_qkv`` with inverted dropout at rate ``p`` on the probabilities: ``y =
        merge_heads(dropout(P, p, seed) v)``, P the causal softmax of the split heads
        ``(B, H, T, T)`` and the mask ``dropout``'s over it (``forge_ml.rng``, element
        ``((b H + h) T + t) T + s``); ``lse`` as ``attention_qkv``'s (before dropout). ``seed``:
        an int, or ``(base, site)``: ``base`` a one-element int64 array of the backend, the
        stream ``rng.mix(base[0], site)`` (``dropout_at``'s)."""

    def attention_qkv_dropout_bwd(self, qkv, y, lse, dy, n_head: int, scale: float, p: float,
                                  seed) -> Array:
        """``dqkv (B, T, 3C)`` of ``attention_qkv_dropout`` with the same ``p`` and ``seed``."""

    def linear(self, x, w, bias, act, residual, ln=None) -> Array:
        """``act(LN(x) @ w + bias) + residual`` (inference)."""

    def matmul_gelu(self, x, w, bias) -> Tuple[Array, Array]:
        """``(gelu(x @ w + bias), x @ w + bias)`` for 2-D ``x (M, K)``, ``w (K, N)``, ``bias
        (N,)``: a linear layer and its GELU with GELU's input kept for the backward (one
        product with its epilogue on the GPU)."""

    def layernorm_bwd_add(self, x, gamma, dy, eps: float, add) -> Tuple[Array, Array, Array]:
        """``layernorm_bwd``'s ``(dx, dgamma, dbeta)`` with ``add`` (x's shape) added to dx:
        the gradient x already has from its other uses, folded into the kernel's last pass
        (the residual stream's gradient in a pre-LN transformer)."""

    def layernorm_bwd_sums(self, x, gamma, dy, eps: float, add) -> Tuple[Array, Array, Array, Array]:
        """``(dx, dgamma, dbeta, sum_rows(dx))``, dx with ``add`` added where ``add`` is not
        None (``layernorm_bwd_add``'s): the backward that writes x's whole gradient also sums
        it over rows, the bias gradient of the linear layer whose output x is (the GPU sums
        the dx it writes, as rounded to x's dtype, in the same pass)."""

    def matmul_dgelu(self, dy, w, pre) -> Tuple[Array, Array]:
        """``(dpre, sum_rows(dpre))`` with ``dpre = gelu_bwd(pre, dy @ w^T)`` for ``dy (M, N)``,
        ``w (K, N)``, ``pre (M, K)``: the gradient at GELU's input of ``gelu(pre) @ w``, and
        the bias gradient of the layer that made ``pre`` (on the GPU the product, then one
        kernel that sums the bias gradient as it writes GELU's)."""

    def weight_grads(self, x, dy, alpha: float) -> Tuple[Array, Array]:
        """``(alpha x^T dy, sum_rows(dy))`` for ``x (M, K)``, ``dy (M, N)``: a linear layer's
        weight and bias gradients (on the GPU one product whose epilogue also sums dy's rows)."""

    def linear_cross_entropy(self, x, w, targets, vocab_size: int,
                             grad: bool) -> Tuple[Array, Optional[Array], Optional[Array]]:
        """The LM head and its loss: ``(loss, dx, dw)``, ``loss = cross_entropy(x @ w^T,
        targets, vocab_size)`` for ``x (N, C)``, ``w (Vp, C)``; with ``grad`` its gradients for
        dloss = 1, ``dx (N, C)`` and ``dw (Vp, C)`` in x's dtype, else None and None. A fused
        kernel may work over chunks of rows so the ``(N, Vp)`` logits are never kept whole."""

    def scale(self, x, s) -> Array:
        """``s * x`` in x's dtype; ``s`` a float or a one-element array of the backend (read
        where it is, like ``cross_entropy_bwd``'s dloss)."""

    def decode_attention(self, qkv, k_cache, v_cache, pos, n_head: int, scale: float) -> Array:
        """One decoding step: keys and values written at row ``pos``, ``y (B, C)``."""

    def greedy_next(self, logits, vocab_size: int, ids, pos, out=None) -> None:
        """``ids = argmax(logits[:, :V])`` (also into ``out``, -1 there for a row whose largest
        logit is not finite), then ``pos += 1``."""

    def sample_next(self, logits, vocab_size: int, ids, pos, knobs, keys, seen=None,
                    out=None) -> None:
        """A sampled choice per row (``forge_ml.sampling.sample_row``'s rule: temperature, top-k,
        top-p, min-p, repetition penalty, a Philox draw at the row's position), into ``ids``
        (and ``out``, -1 there for a row whose logit at its argmax is not finite);
        ``seen[b, token] += 2`` (``forge_ml.sampling.seen_row``'s marks); then ``pos += 1``."""

    def penalize_logits(self, logits, vocab_size: int, seen, penalties, bias=None) -> None:
        """In place, the first ``vocab_size`` logits of each row (float32 ``(B, Vp)``):
        ``forge_ml.sampling.adjusted``'s OpenAI adjustments, ``z + bias`` (float32 ``(B, Vp)``
        or None), then ``frequency * c`` and, where ``c > 0``, ``presence`` taken away, with
        ``penalties[b] = (presence, frequency)`` (float32 ``(B, 2)``) and ``c = seen >> 1``
        (int32 ``(B, Vp)``: the times the row generated the id); each operation rounded to
        float32 on its own."""


@runtime_checkable
class Capabilities(Protocol):
    """What code above the backends may ask instead of a device's name."""

    name: str            # the registry name ("cpu", "cuda", ...)
    bf16: bool           # bfloat16 storage (mixed-precision training)
    graphs: bool         # capture_graph(fn) records device work for replays
    host_memory: bool    # arrays live in host memory: reading a value costs no device wait


# The contract proper: the loader (backends.Backend) reads these names, not the Protocol
# classes above. A new op goes into CORE or FUSED here, and into its Protocol class and
# docs/architecture.md's contract table (tests/test_docs_contract.py checks all three).
MEMORY = ("zeros", "from_host", "to_host", "cast", "copy", "assign", "synchronize",
          "pinned_empty", "to_host_async", "from_host_async")
CORE = ("matmul", "add", "sum_rows", "sumsq", "gelu", "gelu_bwd", "layernorm", "layernorm_bwd",
        "softmax", "softmax_bwd", "logsumexp", "split_heads", "unsplit_head", "merge_heads",
        "unmerge_heads", "embedding", "scatter_add_rows", "kv_append", "dropout",
        "cross_entropy", "cross_entropy_bwd", "adamw_update")
FUSED = ("attention", "attention_bwd", "attention_qkv", "attention_qkv_bwd",
         "attention_qkv_bwd_sums", "attention_qkv_dropout", "attention_qkv_dropout_bwd",
         "linear", "matmul_gelu", "matmul_dgelu", "weight_grads", "layernorm_bwd_add",
         "layernorm_bwd_sums", "linear_cross_entropy", "scale", "decode_attention",
         "greedy_next", "sample_next", "penalize_logits")
CAPABILITIES = {"bf16": False, "graphs": False, "host_memory": False}
"""Capability -> the value a backend that does not declare it is taken to have."""
GRAPH = ("dropout_at", "adamw_update_at", "clip_scale")
"""What a training step captured as a graph reads from device memory instead of host scalars
(``ops.SeedAt``, ``ops.STEP_SCALARS``); a backend with ``graphs`` and without ``host_memory``
must have them (where arrays are host memory, ops read the values and call the plain op):
``dropout_at(x, p, base, site)``, ``adamw_update_at(p, g, m, v, beta1, beta2, eps,
weight_decay, scalars, p_lowp=None)``, ``clip_scale(sumsq, check, scalars, max_norm,
grad_scale)``."""
OPTIONAL = ("capture_graph", "select", "start", "release_cached", "adamw_update_many",
            "sumsq_many", "adamw_update_many_at", "sumsq_total", "decode_gpt2", "decode_gpt2_ok",
            "numerics")
"""Members only some backends have: ``capture_graph(fn, run_first=False)`` where ``graphs``;
``select(index)`` makes device ``index`` current (several devices of one type); ``start()``
runs once at load (the CPU backend's malloc tuning); ``release_cached()`` gives memory the
backend caches back to the device; ``adamw_update_many(ps, gs, ms, vs, lr, beta1, beta2, eps,
weight_decays, steps, grad_scale)`` and ``sumsq_many(xs)`` (a 1-D array of the sums) do an
optimizer's per-tensor ops over a whole model in one call, where each call costs host time
(``ops.adamw_update_many`` and ``optim.grad_sumsq`` loop over the one-tensor ops otherwise);
``adamw_update_many_at(ps, gs, ms, vs, beta1, beta2, eps, weight_decays, scalars,
p_lowps=None)`` and ``sumsq_total(xs)`` (0-d: the sum over every array) are the same for a
step whose values live in device memory, where each launch costs (``ops.adamw_update_many``
with ``scalars``, ``ops.sumsq_total``);
``decode_gpt2(...)`` and ``decode_gpt2_ok(dtype, n_embd, n_head, cache_len, batch)``: GPT-2's
whole decoding step for a few rows as one call (``ops.decode_gpt2``; elsewhere
``GPT2.decode_step`` runs it op by op); ``numerics()``: a dict of what decides the backend's
arithmetic besides an op's inputs (the CPU's kernels, a GPU's name, the switches that pick
kernels), which training checkpoints record so that a resume under others is said
(``tensor.device_numerics``)."""


def missing(module) -> list:
    """The memory and core members ``module`` lacks (fused ones have defaults).

    >>> import types
    >>> missing(types.SimpleNamespace(zeros=len))[:2]
    ['from_host', 'to_host']
    """
    return [n for n in MEMORY + CORE if not callable(getattr(module, n, None))]
