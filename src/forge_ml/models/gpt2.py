"""GPT-2: config, parameters, the training forward on the tape, the KV-cache forward, and
the one-token decoding step (``GPT2.decode_step``, replayed as a CUDA graph by ``DecodeStep``).

Parameters use Hugging Face's names without the ``transformer.`` prefix, and linear weights
are stored ``(in, out)`` like HF's Conv1D, so a layer is ``x @ W + b`` (see notes/API.md).
The token embedding ``wte`` has ``padded_vocab_size`` rows (llm.c pads 50257 to 50304 so the
LM-head matmul tiles well); padded rows start at zero and the loss ignores their logits.

>>> cfg = GPT2Config(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=8)
>>> model = GPT2.init(cfg, seed=0)
>>> model.num_params()
1536
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import ops
from ..autograd import Tape
from ..device import Device
from ..errors import ConfigError, ShapeError
from ..tensor import Tensor, backend_of, tensor, zeros


@dataclass
class GPT2Config:
    """GPT-2 hyper-parameters. ``padded_vocab_size`` 0 means: ``vocab_size`` rounded up to a
    multiple of 128 when the vocab is large (50257 -> 50304), else ``vocab_size`` itself.

    >>> GPT2Config().padded_vocab_size
    50304
    >>> GPT2Config.from_dict({"n_layr": 2})
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: GPT2Config: unknown key 'n_layr'; known keys: block_size, dropout, layernorm_eps, n_embd, n_head, n_layer, padded_vocab_size, tied_head, vocab_size
    """

    vocab_size: int = 50257
    padded_vocab_size: int = 0
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    tied_head: bool = True
    layernorm_eps: float = 1e-5

    def __post_init__(self):
        if self.padded_vocab_size == 0:
            v = self.vocab_size
            self.padded_vocab_size = v if v < 1024 else (v + 127) // 128 * 128
        for k in ("vocab_size", "padded_vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            val = getattr(self, k)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ConfigError(f"GPT2Config: {k} must be a positive int, got {val!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"GPT2Config: padded_vocab_size {self.padded_vocab_size} < "
                              f"vocab_size {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Config: n_embd {self.n_embd} must be divisible by "
                              f"n_head {self.n_head}")
        if not (0.0 <= self.dropout < 1.0):
            raise ConfigError(f"GPT2Config: dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_dict(cls, d: dict) -> "GPT2Config":
        """Build from a dict; an unknown key is a ConfigError."""
        known = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in known:
                raise ConfigError(f"GPT2Config: unknown key {k!r}; known keys: "
                                  f"{', '.join(sorted(known))}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    # nanoGPT's CPU configuration (shakespeare_char on a laptop)
    "nano-cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65),
}


def param_shapes(cfg: GPT2Config) -> dict:
    """Name -> shape of every parameter, in a fixed order.

    >>> list(param_shapes(GPT2Config(n_layer=1)))[:3]
    ['wte.weight', 'wpe.weight', 'h.0.ln_1.weight']
    """
    c, vp = cfg.n_embd, cfg.padded_vocab_size
    shapes = {"wte.weight": (vp, c), "wpe.weight": (cfg.block_size, c)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (c,), p + "ln_1.bias": (c,),
            p + "attn.c_attn.weight": (c, 3 * c), p + "attn.c_attn.bias": (3 * c,),
            p + "attn.c_proj.weight": (c, c), p + "attn.c_proj.bias": (c,),
            p + "ln_2.weight": (c,), p + "ln_2.bias": (c,),
            p + "mlp.c_fc.weight": (c, 4 * c), p + "mlp.c_fc.bias": (4 * c,),
            p + "mlp.c_proj.weight": (4 * c, c), p + "mlp.c_proj.bias": (c,),
        })
    shapes["ln_f.weight"] = (c,)
    shapes["ln_f.bias"] = (c,)
    if not cfg.tied_head:
        shapes["lm_head.weight"] = (vp, c)
    return shapes


def init_params(cfg: GPT2Config, seed: int = 0) -> dict:
    """GPT-2's initialisation as NumPy float32: weights N(0, 0.02), residual projections
    (``c_proj``) N(0, 0.02 / sqrt(2 n_layer)), biases 0, layer-norm gains 1; padded vocab rows 0.
    Deterministic in ``seed`` (the GPT-2 paper, section 2.3; nanoGPT and llm.c do the same)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            a = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            a = np.zeros(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            a = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
            if name in ("wte.weight", "lm_head.weight"):
                a[cfg.vocab_size:] = 0.0
        out[name] = a
    return out


def _mix(seed: int, site: int) -> int:
    """A distinct 64-bit dropout stream per (step seed, dropout site): splitmix64's finalizer."""
    z = (seed * 0x9E3779B97F4A7C15 + site + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


@dataclass
class KVCache:
    """Per-layer key and value caches ``(B, H, Tmax, hs)``, allocated once; ``pos`` rows filled."""

    k: list
    v: list
    pos: int = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-2]


@dataclass
class GPT2:
    """A GPT-2 model: its config and its parameters (float32 master Tensors on one device)."""

    config: GPT2Config
    params: dict = field(default_factory=dict)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def init(cls, config: GPT2Config, seed: int = 0, device="cpu", dtype="float32") -> "GPT2":
        """A freshly initialised model (see ``init_params``).

        >>> GPT2.init(GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)).device
        Device('cpu')
        """
        host = init_params(config, seed)
        return cls(config, {k: tensor(v, dtype=dtype, device=device) for k, v in host.items()})

    @classmethod
    def from_state_dict(cls, config: GPT2Config, state: dict, device="cpu", dtype="float32") -> "GPT2":
        """A model from NumPy arrays; names and shapes must match the config exactly."""
        from ..checkpoint import check_architecture
        check_architecture(param_shapes(config), state)
        return cls(config, {k: tensor(np.asarray(state[k]), dtype=dtype, device=device)
                            for k in param_shapes(config)})

    def state_dict(self) -> dict:
        """Name -> NumPy float32 copy of every parameter."""
        return {k: v.numpy() for k, v in self.params.items()}

    @property
    def device(self) -> Device:
        return self.params["wte.weight"].device

    def to(self, device) -> "GPT2":
        return GPT2(self.config, {k: v.to(device) for k, v in self.params.items()})

    def num_params(self) -> int:
        """Parameter count (padded vocab rows included)."""
        return sum(v.numel for v in self.params.values())

    # -- training forward on the tape ----------------------------------------------------
    def forward(self, tape: Tape, ids: Tensor, targets: Optional[Tensor] = None, *,
                params: Optional[dict] = None, dropout_seed: int = 0,
                fused_attention: Optional[bool] = None):
        """The training forward over ``ids (B, T)``, recorded on ``tape``.

        ``params``: the tensors to compute with (default the model's; the trainer passes bf16
        copies for mixed precision). Returns ``(logits, loss, leaves)``: logits ``(B*T, Vp)``,
        the mean loss (None without ``targets``), and name -> leaf TVar of every parameter.
        ``fused_attention`` (default: on unless dropout > 0) picks the flash-style attention op
        over matmul + causal softmax + matmul; without dropout both compute the same function.
        The fused op has no dropout on the attention probabilities, so with dropout > 0 and
        ``fused_attention=True`` only the embedding and residual dropouts apply.
        """
        cfg = self.config
        P = self.params if params is None else params
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        if ids.ndim != 2:
            raise ShapeError(f"GPT2.forward: ids must be (B, T), got {ids.shape}")
        B, T = ids.shape
        if T > cfg.block_size:
            raise ShapeError(f"GPT2.forward: sequence of {T} tokens is longer than the context "
                             f"(block_size {cfg.block_size})")
        C, H, hs = cfg.n_embd, cfg.n_head, cfg.head_size
        eps, p_drop = cfg.layernorm_eps, cfg.dropout
        fused = (p_drop == 0.0) if fused_attention is None else fused_attention
        leaves = {k: tape.leaf(v) for k, v in P.items()}
        L = leaves
        site = iter(range(1 << 30))

        def drop(x):
            return tape.dropout(x, p_drop, _mix(dropout_seed, next(site))) if p_drop else x

        x = tape.embedding(ids, L["wte.weight"], L["wpe.weight"], 0)          # (B, T, C)
        x = drop(tape.reshape(x, B * T, C))                                    # (B*T, C)
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            h = tape.layernorm(x, L[p + "ln_1.weight"], L[p + "ln_1.bias"], eps)
            qkv = tape.matmul(h, L[p + "attn.c_attn.weight"], L[p + "attn.c_attn.bias"])
            qkv = tape.reshape(qkv, B, T, 3 * C)                               # (B, T, 3C)
            if fused:
                y = tape.attention_qkv(qkv, H, 1.0 / math.sqrt(hs))            # (B, T, C)
            else:
                q, k, v = tape.split_heads(qkv, H)                             # (B, H, T, hs)
                att = tape.matmul(q, k, trans_b=True, alpha=1.0 / math.sqrt(hs))  # (B, H, T, T)
                att = drop(tape.softmax(att, causal=True))
                y = tape.merge_heads(tape.matmul(att, v))                      # (B, T, C)
            y = tape.reshape(y, B * T, C)                                      # (B*T, C)
            y = drop(tape.matmul(y, L[p + "attn.c_proj.weight"], L[p + "attn.c_proj.bias"]))
            x = tape.add(x, y)
            h = tape.layernorm(x, L[p + "ln_2.weight"], L[p + "ln_2.bias"], eps)
            h = tape.matmul(h, L[p + "mlp.c_fc.weight"], L[p + "mlp.c_fc.bias"])  # (B*T, 4C)
            h = tape.gelu(h)
            h = drop(tape.matmul(h, L[p + "mlp.c_proj.weight"], L[p + "mlp.c_proj.bias"]))
            x = tape.add(x, h)
        x = tape.layernorm(x, L["ln_f.weight"], L["ln_f.bias"], eps)
        head = L["wte.weight"] if cfg.tied_head else L["lm_head.weight"]
        logits = tape.matmul(x, head, trans_b=True)                            # (B*T, Vp)
        loss = None
        if targets is not None:
            if targets.ndim == 1 and B == 1:
                targets = targets.reshape(1, -1)
            if targets.shape != (B, T):
                raise ShapeError(f"GPT2.forward: targets must be {(B, T)} like ids, got {targets.shape}")
            loss = tape.cross_entropy(logits, targets.reshape(B * T), cfg.vocab_size)
        return logits, loss, leaves

    def loss_and_grads(self, ids: Tensor, targets: Tensor, **kw):
        """One forward and backward: ``(loss as float, {name: grad Tensor})``."""
        tape = Tape()
        _, loss, leaves = self.forward(tape, ids, targets, **kw)
        tape.backward(loss)
        return loss.t.item(), {k: tape.grad(v) for k, v in leaves.items()}

    def logits(self, ids: Tensor, **kw) -> Tensor:
        """Full-sequence logits ``(B, T, V)`` (padding columns dropped), no KV cache."""
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        B, T = ids.shape
        logits, _, _ = self.forward(Tape(), ids, **kw)
        out = logits.t.reshape(B, T, self.config.padded_vocab_size)
        return _take_vocab(out, self.config.vocab_size)

    # -- inference with a KV cache ----------------------------------------------------------
    def new_cache(self, batch: int, max_len: Optional[int] = None, params: Optional[dict] = None) -> KVCache:
        """An empty KV cache for ``batch`` rows and up to ``max_len`` (<= block_size) tokens."""
        cfg = self.config
        max_len = cfg.block_size if max_len is None else max_len
        if not (0 < max_len <= cfg.block_size):
            raise ShapeError(f"new_cache: max_len must be in 1..{cfg.block_size}, got {max_len}")
        ref = (self.params if params is None else params)["wte.weight"]
        shape = (batch, cfg.n_head, max_len, cfg.head_size)
        mk = lambda: [zeros(shape, ref.dtype, ref.device) for _ in range(cfg.n_layer)]  # noqa: E731
        return KVCache(mk(), mk(), 0)

    def decoder(self, batch: int, max_len: Optional[int] = None,
                params: Optional[dict] = None) -> tuple:
        """``(cache, step)``: an empty KV cache (``new_cache``) and its ``DecodeStep``, for a
        generation loop. On cuda the pair, with the CUDA graphs its step has captured, is kept
        and handed out again (emptied: ``pos`` 0) to the next call with the same batch, length,
        and parameter buffers, so repeated generation pays the capture once; on the CPU every
        call makes a new pair.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> cache, step = GPT2.init(cfg).decoder(2, 8)
        >>> cache.capacity, type(step).__name__
        (8, 'DecodeStep')
        """
        P = self.params if params is None else params
        if P["wte.weight"].device.type != "cuda":
            cache = self.new_cache(batch, max_len, params)
            return cache, DecodeStep(self, cache, params)
        # the graphs hold the addresses of every parameter buffer: reuse only when they match
        key = (batch, max_len, os.environ.get("FORGE_CUDA_GRAPH", "1"),
               tuple((k, v.dtype.name, v.data.data.ptr) for k, v in P.items()))
        kept = getattr(self, "_decoder_kept", None)
        if kept is not None and kept[0] == key and kept[3] is P:
            kept[1].pos = 0
            return kept[1], kept[2]
        cache = self.new_cache(batch, max_len, params)
        step = DecodeStep(self, cache, params)
        self._decoder_kept = (key, cache, step, P)
        return cache, step

    def forward_cached(self, ids: Tensor, cache: KVCache, params: Optional[dict] = None, *,
                       last_only: bool = False) -> Tensor:
        """Logits ``(B, Tn, Vp)`` for ``ids (B, Tn)`` at positions ``cache.pos…``; appends the
        new keys and values to ``cache`` and advances ``cache.pos``. Equal to the full forward's
        logits at the same positions. ``last_only`` returns ``(B, 1, Vp)``, the last
        position's logits only (a prefill then skips the LM head of every other row).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> model = GPT2.init(cfg)
        >>> cache = model.new_cache(1, 8)
        >>> model.forward_cached(tensor([[1, 2, 3]]), cache).shape, cache.pos
        ((1, 3, 10), 3)
        """
        cfg = self.config
        P = self.params if params is None else params
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        if ids.ndim != 2:
            raise ShapeError(f"forward_cached: ids must be (B, Tn), got {ids.shape}")
        B, Tn = ids.shape
        if B != cache.k[0].shape[0]:
            raise ShapeError(f"forward_cached: ids have {B} rows but the cache was made for "
                             f"{cache.k[0].shape[0]}")
        pos = cache.pos
        if pos + Tn > cache.capacity:
            raise ShapeError(f"forward_cached: {pos} cached + {Tn} new tokens exceed the cache's "
                             f"{cache.capacity} rows (context {cfg.block_size})")
        C, H, hs, eps = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.layernorm_eps
        x = ops.embedding(ids, P["wte.weight"], P["wpe.weight"], pos).reshape(B * Tn, C)
        n = pos + Tn
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            h = ops.layernorm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
            qkv = ops.matmul(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
            q, k, v = ops.split_heads(qkv.reshape(B, Tn, 3 * C), H)           # (B, H, Tn, hs)
            ops.kv_append(cache.k[i], k, pos)
            ops.kv_append(cache.v[i], v, pos)
            att = ops.matmul(q, cache.k[i], trans_b=True, alpha=1.0 / math.sqrt(hs), b_rows=n)
            att = ops.softmax(att, causal=True, off=pos)                      # (B, H, Tn, n)
            y = ops.matmul(att, cache.v[i], b_rows=n)                         # (B, H, Tn, hs)
            y = ops.merge_heads(y).reshape(B * Tn, C)
            x = ops.add(x, ops.matmul(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"]))
            h = ops.layernorm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
            h = ops.gelu(ops.matmul(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
            x = ops.add(x, ops.matmul(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"]))
        if last_only and Tn > 1:
            x = Tensor(x.data.reshape(B, Tn, C)[:, -1].copy(), x.device)      # (B, C)
            Tn = 1
        x = ops.layernorm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
        head = P["wte.weight"] if cfg.tied_head else P["lm_head.weight"]
        logits = ops.matmul(x, head, trans_b=True)                            # (B*Tn, Vp)
        cache.pos = n
        return logits.reshape(B, Tn, cfg.padded_vocab_size)

    def decode_step(self, ids: Tensor, pos, cache: KVCache, params: Optional[dict] = None) -> Tensor:
        """Logits ``(B, Vp)`` for one new token per row, ``ids (B, 1)`` (or ``(B,)``), at
        position ``pos``; writes the tokens' keys and values at row ``pos`` of ``cache``
        (``cache.pos`` is left to the caller). ``pos``: an int, or a one-element int32 tensor
        on the model's device, read by the kernels, so the step has fixed shapes and no host
        values: ``DecodeStep`` captures it in a CUDA graph. Equal to ``forward_cached``'s
        logits for the same token at the same position (attention scores in float32).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> model = GPT2.init(cfg)
        >>> cache = model.new_cache(1, 8)
        >>> ref = model.forward_cached(tensor([[1, 2, 3]]), cache).numpy()[0, 2]
        >>> out = model.decode_step(tensor([[3]]), 2, cache).numpy()[0]
        >>> bool(np.allclose(out, ref, atol=1e-6))
        True
        """
        cfg = self.config
        P = self.params if params is None else params
        if ids.ndim == 1:
            ids = ids.reshape(-1, 1)
        if ids.ndim != 2 or ids.shape[1] != 1:
            raise ShapeError(f"decode_step: ids must be (B, 1), one token per row, got {ids.shape}")
        B = ids.shape[0]
        if B != cache.k[0].shape[0]:
            raise ShapeError(f"decode_step: ids have {B} rows but the cache was made for "
                             f"{cache.k[0].shape[0]}")
        C, H, eps = cfg.n_embd, cfg.n_head, cfg.layernorm_eps
        x = ops.embedding(ids, P["wte.weight"], P["wpe.weight"], pos).reshape(B, C)
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            # four linear layers, each one kernel on the GPU (layernorm folded into the first
            # and third, GELU and the residual adds into the epilogues), and the attention
            qkv = ops.linear(x, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"],
                             ln=(P[p + "ln_1.weight"], P[p + "ln_1.bias"]), eps=eps)
            y = ops.decode_attention(qkv, cache.k[i], cache.v[i], pos, H)        # (B, C)
            x = ops.linear(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"], residual=x)
            h = ops.linear(x, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"], act="gelu",
                           ln=(P[p + "ln_2.weight"], P[p + "ln_2.bias"]), eps=eps)
            x = ops.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"], residual=x)
        x = ops.layernorm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
        head = P["wte.weight"] if cfg.tied_head else P["lm_head.weight"]
        return ops.matmul(x, head, trans_b=True)                                 # (B, Vp)


class DecodeStep:
    """``GPT2.decode_step`` on fixed buffers, for a generation loop.

    ``step(tokens, pos)`` feeds one token per row (``tokens``: B ints) at position ``pos``
    (the cache must hold rows ``0..pos-1``), writes the new keys and values into ``cache``,
    sets ``cache.pos = pos + 1`` and returns the logits ``(B, vocab_size)`` as a float32
    NumPy array. The inputs live in fixed device buffers (the position too), so on cuda the
    step is captured once in a CUDA graph: the first call runs op by op (compiling and loading
    every kernel), the second captures, and from then on a call is two small host-to-device
    copies, one graph launch and one copy of the logits back. ``graph=False``, or the
    environment variable ``FORGE_CUDA_GRAPH=0``, keeps every call op by op; on the CPU there
    is no graph.

    >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
    >>> model = GPT2.init(cfg)
    >>> cache = model.new_cache(2, 8)
    >>> _ = model.forward_cached(tensor([[1, 2], [3, 4]]), cache)
    >>> step = DecodeStep(model, cache)
    >>> step([5, 6], 2).shape, cache.pos
    ((2, 10), 3)
    """

    def __init__(self, model: "GPT2", cache: KVCache, params: Optional[dict] = None,
                 graph: Optional[bool] = None):
        self.model, self.cache = model, cache
        self.params = model.params if params is None else params
        dev = self.params["wte.weight"].device
        B = cache.k[0].shape[0]
        self._ids = zeros((B, 1), "int32", dev)
        self._pos = zeros((1,), "int32", dev)
        self._bk = backend_of(dev)
        if graph is None:
            graph = os.environ.get("FORGE_CUDA_GRAPH", "1") != "0"
        self.graph = bool(graph) and hasattr(self._bk, "capture_graph")
        self._graphs = {}      # "logits": the step; ("greedy", k): k steps + greedy choices
        self._hist = {}        # k -> the (k, B) int32 device buffer of a k-step chain's tokens
        self._warm = False     # some step ran op by op: every kernel is compiled and loaded

    def _logits(self):
        """The step's device work; returns the float32 logits array (B, Vp) (the bf16 ->
        float32 cast is part of the captured work, so the host copies one array back)."""
        out = self.model.decode_step(self._ids, self._pos, self.cache, self.params)
        return (out if out.dtype.name == "float32" else out.to("float32")).data

    def __call__(self, tokens, pos: int) -> np.ndarray:
        B = self._ids.shape[0]
        V = self.model.config.vocab_size
        tokens = self._checked_tokens(tokens)
        if not (isinstance(pos, (int, np.integer)) and 0 <= pos < self.cache.capacity):
            raise ShapeError(f"DecodeStep: position {pos} does not fit the cache's "
                             f"{self.cache.capacity} rows")
        ops.assign(self._ids, tokens.astype(np.int32).reshape(B, 1))
        ops.assign(self._pos, np.array([pos], np.int32))
        out = self._run("logits", self._logits)
        self.cache.pos = int(pos) + 1
        return self._bk.to_host(out)[:, :V].astype(np.float32, copy=False)

    def _run(self, key, work):
        """``work()``'s device work: replayed from the CUDA graph kept under ``key``, or
        captured there first when graphs are on and some step ran op by op before (so every
        kernel ``work`` launches is compiled and loaded), else op by op. A capture that fails
        turns graphs off for this step, with one warning, and the work runs op by op."""
        g = self._graphs.get(key)
        if g is None and self.graph and self._warm:
            try:
                g = self._bk.capture_graph(work)
            except Exception as e:
                warnings.warn(f"DecodeStep: the CUDA graph capture failed ({type(e).__name__}: "
                              f"{e}); decoding goes on op by op", RuntimeWarning, stacklevel=3)
                self.graph = False
            else:
                self._graphs[key] = g
        if g is None:
            out = work()
            self._warm = True
            return out
        g.replay()
        return g.outputs

    @property
    def captured(self) -> bool:
        """Whether the step now replays a CUDA graph."""
        return "logits" in self._graphs

    def _greedy_work(self, k: int):
        """``k`` greedy steps on the device: each computes the logits, then ``ids = argmax``
        (also written to row i of the chain's token buffer) and ``pos += 1`` (the argmax ids are
        < vocab_size, so the range the embedding check cached stays true)."""
        hist = self._hist[k]
        for i in range(k):
            logits = self._logits()
            self._bk.greedy_next(logits, self.model.config.vocab_size, self._ids.data,
                                 self._pos.data, out=hist[i])
        return hist

    def greedy(self, tokens, pos: int, n: int, lookahead: int = 4, chunk: Optional[int] = None):
        """Yield ``n`` greedy steps with the host out of the loop: the first feeds ``tokens``
        at ``pos``, each next one feeds the previous step's choice at the next position; each
        yield is the (B,) int32 array of every row's argmax token (lowest id on ties, as
        ``np.argmax``). The choice is made on the device, ``chunk`` steps at a time (on cuda
        one replay of a CUDA graph of ``chunk`` x (step + argmax) and one copy of their tokens
        back; default 8 with graphs, else 1), and at least ``lookahead`` steps are queued
        ahead, so the host reads tokens while the GPU computes the next ones. Closing the
        generator early waits for the queued steps; ``cache.pos`` then counts every row they
        wrote.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> model = GPT2.init(cfg)
        >>> cache = model.new_cache(1, 8)
        >>> _ = model.forward_cached(tensor([[1, 2]]), cache)
        >>> [t.shape for t in DecodeStep(model, cache).greedy([3], 2, 3)], cache.pos
        ([(1,), (1,), (1,)], 5)
        """
        B = self._ids.shape[0]
        if not (isinstance(n, (int, np.integer)) and n >= 0):
            raise ShapeError(f"DecodeStep.greedy: n must be an int >= 0, got {n!r}")
        if n and not 0 <= pos <= pos + n - 1 < self.cache.capacity:
            raise ShapeError(f"DecodeStep.greedy: positions {pos}..{pos + n - 1} do not fit the "
                             f"cache's {self.cache.capacity} rows")
        if chunk is None:
            chunk = 8 if self.graph else 1
        if not (isinstance(chunk, (int, np.integer)) and chunk >= 1):
            raise ShapeError(f"DecodeStep.greedy: chunk must be an int >= 1, got {chunk!r}")
        if n == 0:
            return
        tokens = self._checked_tokens(tokens)
        ops.assign(self._ids, tokens.astype(np.int32).reshape(B, 1))
        ops.assign(self._pos, np.array([pos], np.int32))
        # whole chunks, then single steps: every launch writes only rows pos..pos+n-1
        sizes = [int(chunk)] * (n // chunk) + [1] * (n % chunk)
        dev = self._ids.device
        for k in set(sizes):
            if k not in self._hist:
                self._hist[k] = zeros((k, B), "int32", dev).data
        ahead = max(2, -(-int(lookahead) // int(chunk)))
        rings = {k: self._bk.pinned_empty((ahead, k, B), np.int32) for k in set(sizes)}
        pending = []    # (handle, host array) per launch in flight
        launched = 0    # launches queued
        done = 0        # steps of the queued launches

        def launch():
            nonlocal launched, done
            k = sizes[launched]
            out = self._run(("greedy", k), lambda: self._greedy_work(k))
            host = rings[k][launched % ahead]
            pending.append((self._bk.to_host_async(out, host), host))
            launched += 1
            done += k

        try:
            while launched < min(ahead, len(sizes)):
                launch()
            yielded = 0
            while pending:
                handle, host = pending.pop(0)
                if handle is not None:
                    handle.synchronize()
                toks = host.copy()
                if launched < len(sizes):
                    launch()
                for row in toks:
                    yielded += 1
                    self.cache.pos = pos + yielded
                    yield row
        finally:
            for handle, _ in pending:
                if handle is not None:
                    handle.synchronize()
            self.cache.pos = pos + done

    def _checked_tokens(self, tokens) -> np.ndarray:
        B = self._ids.shape[0]
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.shape != (B,):
            raise ShapeError(f"DecodeStep: expected {B} tokens (one per row), got {tokens.shape[0]}")
        V = self.model.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise ShapeError(f"DecodeStep: token ids must be in 0..{V - 1}, got "
                             f"{int(tokens.min())}..{int(tokens.max())}")
        return tokens


def _take_vocab(logits: Tensor, v: int) -> Tensor:
    """Drop padded vocab columns: ``(…, Vp) -> (…, V)`` (a copy)."""
    if logits.shape[-1] == v:
        return logits
    arr = logits.data[..., :v]
    xp_copy = arr.copy()
    return Tensor(xp_copy, logits.device)
