"""GPT-2: config, parameters, initialisation and the forwards: the training forward on the
tape, the KV-cache forward, and the one-token decoding step (``GPT2.decode_step``). The
decoding runtime around them (the KV cache, the step captured as a CUDA graph, sampling)
lives in ``forge_ml.inference``.

Parameters use Hugging Face's names without the ``transformer.`` prefix, and linear weights
are stored ``(in, out)`` like HF's Conv1D, so a layer is ``x @ W + b``; the forwards read
them through ``Layer``, a per-layer view (``layers(params, cfg)``), never by string keys.
Parameters are the compute copies: float32, or bf16 on the GPU (``GPT2.to(dtype=...)``, or
``AdamW(..., compute_dtype="bfloat16")`` in mixed-precision training, where the optimizer
keeps the float32 masters).
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
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from .. import dtype as _dtype
from .. import flags, ops, rng
from ..autograd import Tape
from ..device import Device
from ..errors import (ConfigError, DeviceError, DTypeError, ForgeError, KnownFields,
                      ShapeError, TapeError, check_host_memory)
from ..tensor import Tensor, device_has, tensor


@dataclass
class GPT2Config(KnownFields):
    """GPT-2 hyper-parameters. ``padded_vocab_size`` 0 means: ``vocab_size`` rounded up to a
    multiple of 128 when the vocab is large (50257 -> 50304), else ``vocab_size`` itself.

    >>> GPT2Config().padded_vocab_size
    50304
    >>> GPT2Config.from_dict({"n_layr": 2})
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: GPT2Config: unknown key 'n_layr' (did you mean 'n_layer'?)
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
        for k in ("vocab_size", "padded_vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            val = getattr(self, k)   # a NumPy integer (shape arithmetic) as the int it is
            if isinstance(val, numbers.Integral) and not isinstance(val, (bool, int)):
                setattr(self, k, int(val))
        for k in ("vocab_size", "padded_vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            val = getattr(self, k)   # (a type first: vocab_size "11" met `<` below as a TypeError)
            padded = k == "padded_vocab_size"   # 0: vocab_size rounded up
            if not isinstance(val, int) or isinstance(val, bool) or val < (0 if padded else 1):
                want = "an int >= 0 (0: vocab_size rounded up)" if padded else "a positive int"
                raise ConfigError(f"GPT2Config: {k} must be {want}, got {val!r}")
        if self.padded_vocab_size == 0:
            v = self.vocab_size
            self.padded_vocab_size = v if v < 1024 else (v + 127) // 128 * 128
        if self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"GPT2Config: padded_vocab_size {self.padded_vocab_size} < "
                              f"vocab_size {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Config: n_embd {self.n_embd} must be divisible by "
                              f"n_head {self.n_head}")
        d = self.dropout    # (a string "0.1" met `<=` as a TypeError)
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not (0.0 <= d < 1.0) \
                or np.float32(d) >= 1.0:   # (the kernels' p is float32: 1 - 1e-9 is 1 there)
            raise ConfigError(f"GPT2Config: dropout must be a number in [0, 1) (as a float32), "
                              f"got {d!r}")
        if not isinstance(d, (int, float)):   # a NumPy float32: to_dict() was no JSON then
            self.dropout = float(d)
        if not isinstance(self.tied_head, (bool, np.bool_)):   # "no" built a tied model
            raise ConfigError(f"GPT2Config: tied_head must be True or False, got {self.tied_head!r}")
        self.tied_head = bool(self.tied_head)
        eps = self.layernorm_eps   # (a NumPy float32 as the float it is, as dropout)
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) \
                or not (0.0 <= eps < math.inf):
            raise ConfigError(f"GPT2Config: layernorm_eps must be a number >= 0, got {eps!r}")
        if not isinstance(eps, (int, float)):
            self.layernorm_eps = float(eps)

    @classmethod
    def from_dict(cls, d: dict) -> "GPT2Config":
        """Build from a dict; an unknown key is a ConfigError.

        >>> GPT2Config.from_dict({"n_layer": 1, "n_head": 2, "n_embd": 8}).head_size
        4
        >>> GPT2Config.from_dict({"n_layers": 1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        forge_ml.errors.ConfigError: GPT2Config: unknown key 'n_layers' (did you mean 'n_layer'?)
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"GPT2Config.from_dict: expected a dict of its fields, got "
                              f"{type(d).__name__}")
        return cls(**d)   # (an unknown key: __new__'s ConfigError)

    def to_dict(self) -> dict:
        """Every field as a plain dict (what checkpoints store); ``from_dict`` reads it back.

        >>> cfg = GPT2Config(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
        >>> cfg.to_dict()["padded_vocab_size"], GPT2Config.from_dict(cfg.to_dict()) == cfg
        (11, True)
        """
        return dataclasses.asdict(self)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    # nanoGPT's CPU configuration (shakespeare_char on a laptop)
    "nano-cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65),
}


def _check_config(who: str, cfg) -> None:
    """``cfg`` must be a GPT2Config: a dict (a checkpoint's "config") or None met
    ``cfg.n_embd`` as an AttributeError.

    >>> _check_config("GPT2", {"n_layer": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: GPT2: config must be a GPT2Config ... got dict
    """
    if not isinstance(cfg, GPT2Config):
        raise ConfigError(f"{who}: config must be a GPT2Config (GPT2Config.from_dict(d) for a "
                          f"dict), got {type(cfg).__name__}")


def param_shapes(cfg: GPT2Config) -> dict:
    """Name -> shape of every parameter, in a fixed order.

    >>> list(param_shapes(GPT2Config(n_layer=1)))[:3]
    ['wte.weight', 'wpe.weight', 'h.0.ln_1.weight']
    """
    _check_config("param_shapes", cfg)
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


def config_params(cfg: GPT2Config) -> int:
    """The parameter count of a model of ``cfg`` (``GPT2.num_params``'s, padded vocabulary rows
    included), from the sizes alone: nothing is built.

    >>> config_params(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    324
    """
    _check_config("config_params", cfg)
    c, vp = cfg.n_embd, cfg.padded_vocab_size
    head = 0 if cfg.tied_head else vp * c
    return (vp + cfg.block_size) * c + cfg.n_layer * (12 * c * c + 13 * c) + 2 * c + head


def _check_init_memory(who: str, cfg: GPT2Config, itemsize: int = 0) -> None:
    """Refuse, before any is drawn, weights that cannot fit the host's free memory: Linux hands
    the arrays out and then kills the process as they fill (exit 137, without a word). Held at
    once: ``init_params``' float32 arrays, the model's copy of them (``itemsize`` bytes a
    value; 0 where it is not on the host), and a temporary of the largest (the embedding)."""
    n = config_params(cfg)
    need = (4 + itemsize) * n + 4 * max(cfg.padded_vocab_size, cfg.block_size) * cfg.n_embd
    check_host_memory(
        who, f"a model of {n:,} parameters (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, "
             f"padded_vocab_size {cfg.padded_vocab_size:,}, block_size {cfg.block_size:,})",
        need, "use a smaller n_layer, n_embd, vocab_size or block_size")


def init_params(cfg: GPT2Config, seed: int = 0) -> dict:
    """GPT-2's initialisation as NumPy float32: weights N(0, 0.02), residual projections
    (``c_proj``) N(0, 0.02 / sqrt(2 n_layer)), biases 0, layer-norm gains 1; padded vocab rows 0.
    Deterministic in ``seed`` (an int >= 0; the GPT-2 paper, section 2.3; nanoGPT and llm.c do
    the same).

    >>> cfg = GPT2Config(vocab_size=100, padded_vocab_size=128, block_size=4, n_layer=1, n_head=1, n_embd=4)
    >>> p = init_params(cfg, seed=1)
    >>> p["wte.weight"].shape, not p["wte.weight"][100:].any(), p["h.0.ln_1.weight"].tolist()
    ((128, 4), True, [1.0, 1.0, 1.0, 1.0])
    >>> np.array_equal(p["wte.weight"], init_params(cfg, seed=1)["wte.weight"])
    True
    """
    if not isinstance(cfg, GPT2Config):   # a dict met cfg.n_embd as an AttributeError
        raise ConfigError(f"init_params: config must be a GPT2Config (GPT2Config.from_dict(d) for "
                          f"a dict), got {type(cfg).__name__}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"init_params: seed must be an int >= 0, got {seed!r}")
    _check_init_memory("init_params", cfg)
    rng = np.random.Generator(np.random.PCG64(int(seed)))
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


class Layer(NamedTuple):
    """One transformer block's parameters (Tensors, or the TVars of a tape), by role.

    >>> cfg = GPT2Config(vocab_size=10, block_size=4, n_layer=2, n_head=1, n_embd=4)
    >>> blocks = layers(GPT2.init(cfg).params, cfg)
    >>> len(blocks), blocks[1].fc_w.shape
    (2, (4, 16))
    """

    ln1_w: object
    ln1_b: object
    qkv_w: object    # attn.c_attn: (C, 3C)
    qkv_b: object
    proj_w: object   # attn.c_proj: (C, C)
    proj_b: object
    ln2_w: object
    ln2_b: object
    fc_w: object     # mlp.c_fc: (C, 4C)
    fc_b: object
    out_w: object    # mlp.c_proj: (4C, C)
    out_b: object

    @classmethod
    def of(cls, params: dict, i: int) -> "Layer":
        """Block ``i``'s parameters from ``params`` (keys ``h.{i}.…``), by role.

        >>> cfg = GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)
        >>> L = Layer.of(GPT2.init(cfg).params, 0)
        >>> L.qkv_w.shape, L.out_b.shape
        ((4, 12), (4,))
        """
        p = f"h.{i}."
        return cls(*(params[p + k] for k in _LAYER_KEYS))


_LAYER_KEYS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
               "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
               "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")


def layers(params: dict, cfg: "GPT2Config") -> list:
    """The ``Layer`` views of every block of ``params`` (a dict of Tensors or of TVars).

    >>> cfg = GPT2Config(vocab_size=10, block_size=4, n_layer=2, n_head=1, n_embd=4)
    >>> params = GPT2.init(cfg).params
    >>> [L.qkv_w is params[f"h.{i}.attn.c_attn.weight"] for i, L in enumerate(layers(params, cfg))]
    [True, True]
    """
    return [Layer.of(params, i) for i in range(cfg.n_layer)]


def _head(params: dict, cfg: "GPT2Config"):
    """The LM head: the token embedding when tied, else ``lm_head.weight``."""
    return params["wte.weight"] if cfg.tied_head else params["lm_head.weight"]


def _seed(seed, site: int):
    """Dropout site ``site``'s seed: ``rng.mix(seed, site)``, or ``ops.SeedAt`` for a seed held in
    device memory (a captured training step's, rewritten before each replay)."""
    return ops.SeedAt(seed, site) if isinstance(seed, Tensor) else rng.mix(seed, site)


def _params_kw(where: str, kw: dict) -> None:
    """``params=`` left the signatures: a model's parameters are the compute copies."""
    if "params" in kw:
        raise TypeError(f"{where}: params= was removed; make a bf16 model with "
                        "model.to(dtype='bfloat16'), or let AdamW(..., compute_dtype='bfloat16') "
                        "keep the float32 masters in training")
    if kw:
        raise TypeError(f"{where}: unexpected keyword arguments {sorted(kw)}")


@dataclass
class GPT2:
    """A GPT-2 model: its config and its parameters (compute Tensors on one device).

    >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
    >>> GPT2.init(cfg).forward_cached(tensor([[1, 2]]), GPT2.init(cfg).new_cache(1)).shape
    (1, 2, 10)
    """

    config: GPT2Config
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        # a params dict missing a name (or of another size) failed at the first forward, deep
        # inside, with a KeyError or a shape error of some op
        _check_config("GPT2", self.config)
        if not isinstance(self.params, dict):
            raise ConfigError(f"GPT2: params must be a dict of name -> Tensor, got {type(self.params).__name__}")
        bad = next((k for k, v in self.params.items() if not isinstance(v, Tensor)), None)
        if bad is not None:
            raise ConfigError(f"GPT2: parameter {bad!r} is a {type(self.params[bad]).__name__}; expected a "
                              f"Tensor (GPT2.from_state_dict takes NumPy arrays)")
        bad = next((k for k, v in self.params.items() if not v.dtype.is_float), None)
        if bad is not None:   # an int dtype asked for at init or load truncated every weight
            raise DTypeError(f"GPT2: parameter {bad!r} is {self.params[bad].dtype.name}; a model computes in "
                             f"float32, float64 or bfloat16 (dtype=)")
        from ..checkpoint import check_architecture
        from ..errors import CheckpointError
        try:
            check_architecture(param_shapes(self.config), self.params)
        except CheckpointError as e:
            raise ConfigError(str(e).replace("checkpoint does not fit the model", "GPT2: the params do not "
                                             "fit the config").replace("checkpoint has", "params have")) from None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def init(cls, config: GPT2Config, seed: int = 0, device="cpu", dtype="float32") -> "GPT2":
        """A freshly initialised model (see ``init_params``).

        >>> GPT2.init(GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)).device
        Device('cpu')
        """
        if isinstance(config, GPT2Config):   # (init_params refuses anything else)
            try:   # the model's copy is host memory too on the CPU
                itemsize = (_dtype.get(dtype).itemsize if device_has(device, "host_memory")
                            else 0)
            except ForgeError:   # (an unknown dtype or device: tensor() says which)
                itemsize = 4
            _check_init_memory("GPT2.init", config, itemsize)
        host = init_params(config, seed)
        return cls(config, {k: tensor(v, dtype=dtype, device=device) for k, v in host.items()})

    @classmethod
    def from_state_dict(cls, config: GPT2Config, state: dict, device="cpu", dtype="float32") -> "GPT2":
        """A model from NumPy arrays (or forge-ml tensors, as ``params`` holds them); names and
        shapes must match the config exactly.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> state = GPT2.init(cfg, seed=1).state_dict()
        >>> model = GPT2.from_state_dict(cfg, state)
        >>> bool(np.array_equal(model.params["wpe.weight"].numpy(), state["wpe.weight"]))
        True
        """
        from ..checkpoint import check_architecture
        _check_config("GPT2.from_state_dict", config)
        if not isinstance(state, Mapping):   # (None: an AttributeError on .items())
            raise ConfigError(f"GPT2.from_state_dict: state must be a dict of name -> array "
                              f"(model.state_dict()), got {type(state).__name__}")
        state = {k: v.numpy() if isinstance(v, Tensor) else v for k, v in state.items()}
        bad = next((k for k, v in state.items() if not hasattr(v, "shape")), None)
        if bad is not None:   # (a list met int() deep in the shape check as a TypeError)
            raise ConfigError(f"GPT2.from_state_dict: {bad!r} is a {type(state[bad]).__name__}; "
                              f"expected a NumPy array or a forge_ml Tensor")
        check_architecture(param_shapes(config), state)
        return cls(config, {k: tensor(np.asarray(state[k]), dtype=dtype, device=device)
                            for k in param_shapes(config)})

    def state_dict(self) -> dict:
        """Name -> a NumPy copy of every parameter, in the model's dtype (float32, or float64;
        a bfloat16 model's as float32, NumPy having no bfloat16).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> sd = GPT2.init(cfg).state_dict()
        >>> len(sd), sd["wte.weight"].shape, sd["wte.weight"].dtype
        (16, (10, 4), dtype('float32'))
        """
        return {k: v.numpy() for k, v in self.params.items()}

    @property
    def device(self) -> Device:
        return self.params["wte.weight"].device

    @property
    def dtype(self):
        """The parameters' dtype (float32, or bfloat16 for a GPU model in bf16)."""
        return self.params["wte.weight"].dtype

    def to(self, device=None, dtype=None) -> "GPT2":
        """The model on another device and/or in another dtype (``"bfloat16"`` on the GPU):
        each tensor copied where its device or dtype changes, else the same tensor, as torch's
        ``Tensor.to`` (``model.to()``, or to its own device and dtype, shares the weights:
        training one trains both; ``GPT2(cfg, {k: v.clone() for k, v in model.params.items()})``
        is a copy).

        >>> cfg = GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)
        >>> GPT2.init(cfg).to("cpu", dtype="float64").dtype
        forge_ml.float64
        """
        params = self.params
        if device is not None:
            params = {k: v.to(device) for k, v in params.items()}
        if dtype is not None:
            params = {k: v.to(dtype) for k, v in params.items()}
        return GPT2(self.config, dict(params))

    def num_params(self) -> int:
        """Parameter count (padded vocab rows included).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> GPT2.init(cfg).num_params()
        324
        """
        return sum(v.numel for v in self.params.values())

    @staticmethod
    def _ids_tensor(where: str, ids) -> None:
        """``ids`` must be a Tensor (an AttributeError on ``.ndim`` otherwise)."""
        if not isinstance(ids, Tensor):
            raise DTypeError(f"{where}: ids must be a forge_ml Tensor of token ids "
                             f"(forge_ml.tensor([[...]])), got {type(ids).__name__}")

    def _check_ids(self, where: str, ids: Tensor) -> None:
        """Token ids must be real vocabulary entries: the padded rows of ``wte`` (ids
        ``vocab_size..padded_vocab_size-1``) are not tokens."""
        ops.check_ids(where, ids, self.config.vocab_size)

    def check_cache(self, where: str, cache) -> None:
        """``cache`` must be one made for this model (``new_cache``): one key and one value
        tensor per layer, each ``(B, n_head, T, head_size)`` with ``T <= block_size``, in the
        parameters' dtype and on their device; a ShapeError, DTypeError or DeviceError naming
        ``where`` otherwise (a cache of another model would be read out of step, or past its
        last layer).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=2, n_head=1, n_embd=4)
        >>> other = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> GPT2.init(cfg).check_cache("decode_step", other.new_cache(1))
        Traceback (most recent call last):
        ...
        forge_ml.errors.ShapeError: decode_step: the cache holds 1 layers of keys and 1 of values, but the model has 2 layers; make it with model.new_cache(...)
        """
        cfg = self.config
        k, v = getattr(cache, "k", None), getattr(cache, "v", None)
        if not (isinstance(k, list) and isinstance(v, list)):
            raise ShapeError(f"{where}: expected a KVCache (model.new_cache(...)), got "
                             f"{type(cache).__name__}")
        if len(k) != cfg.n_layer or len(v) != cfg.n_layer:
            raise ShapeError(f"{where}: the cache holds {len(k)} layers of keys and {len(v)} of "
                             f"values, but the model has {cfg.n_layer} layers; make it with "
                             f"model.new_cache(...)")
        first = k[0].shape if isinstance(k[0], Tensor) else None
        for t in k + v:
            if not isinstance(t, Tensor):
                raise ShapeError(f"{where}: the cache must hold Tensors, got {type(t).__name__}")
            shape = t.shape
            if (len(shape) != 4 or shape != first or shape[1] != cfg.n_head
                    or shape[3] != cfg.head_size or not 1 <= shape[2] <= cfg.block_size):
                raise ShapeError(f"{where}: the cache's keys and values must all be (B, "
                                 f"{cfg.n_head}, T <= {cfg.block_size}, {cfg.head_size}) for "
                                 f"this model (n_head {cfg.n_head}, head size {cfg.head_size}, "
                                 f"block_size {cfg.block_size}), got {shape}; make it with "
                                 f"model.new_cache(...)")
            if t.dtype != self.dtype:
                raise DTypeError(f"{where}: the cache is {t.dtype.name} but the model's "
                                 f"parameters are {self.dtype.name}; make it with "
                                 f"model.new_cache(...)")
            if t.device != self.device:
                raise DeviceError(f"{where}: the cache is on {t.device} but the model is on "
                                  f"{self.device}")

    # -- training forward on the tape ----------------------------------------------------
    def forward(self, tape: Tape, ids: Tensor, targets: Optional[Tensor] = None, *,
                train: bool = True, dropout_seed=0,
                fused_attention: Optional[bool] = None, fused_loss: Optional[bool] = None,
                **kw):
        """The forward over ``ids (B, T)``, recorded on ``tape``.

        ``train=False`` is evaluation: no dropout. Returns ``(logits, loss, leaves)``: logits
        ``(B*T, Vp)``, the mean loss (None without ``targets``), and name -> leaf TVar of
        every parameter. ``fused_attention`` (default on; ``False`` turns it off) picks the
        flash-style attention op over matmul + causal softmax + dropout + matmul. Both compute
        the same function with the same dropout masks: the fused op draws the attention
        dropout of the composed path's site (``ops.attention_qkv_dropout``), so every site's
        seed is the same either way. In training with ``targets`` the LM head and the loss are
        one op (``Tape.linear_cross_entropy``: the logits are never kept whole, and logits comes
        back None, as transformers' models skip them with labels in training);
        ``fused_loss=False`` (or the switch ``FORGE_FUSED_LOSS=off``) keeps the logits (matmul,
        then cross_entropy), as evaluation (``train=False``) does unless ``fused_loss=True``.

        >>> from forge_ml import tensor
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> logits, loss, _ = model.forward(Tape(), tensor([[1, 2]]), tensor([[2, 3]]))
        >>> logits is None, loss.shape
        (True, ())
        """
        _params_kw("GPT2.forward", kw)
        cfg = self.config
        if not isinstance(tape, Tape):   # (None: an AttributeError on .leaf)
            raise TapeError(f"GPT2.forward: tape must be a forge_ml Tape (fm.Tape()), got "
                            f"{type(tape).__name__}")
        train = ops._flag("GPT2.forward", "train", train)   # "no" was true: dropout on
        if not isinstance(dropout_seed, Tensor) and (
                isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral)):
            # 1.5 was seed 1 (1.9 too), None and "a" a TypeError or ValueError from rng.mix
            raise ConfigError(f"GPT2.forward: dropout_seed must be an int (or a one-element int64 "
                              f"Tensor: ops.SeedAt), got {type(dropout_seed).__name__} "
                              f"{dropout_seed!r:.40}")
        self._ids_tensor("GPT2.forward", ids)   # loss and grads come here with a list too
        if targets is not None:
            self._ids_tensor("GPT2.forward (targets)", targets)
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        if ids.ndim != 2:
            raise ShapeError(f"GPT2.forward: ids must be (B, T), got {ids.shape}")
        B, T = ids.shape
        if T > cfg.block_size:
            raise ShapeError(f"GPT2.forward: sequence of {T} tokens is longer than the context "
                             f"(block_size {cfg.block_size})")
        self._check_ids("GPT2.forward", ids)
        C, H, hs = cfg.n_embd, cfg.n_head, cfg.head_size
        eps = cfg.layernorm_eps
        p_drop = cfg.dropout if train else 0.0
        fused = fused_attention is not False
        leaves = {k: tape.leaf(v) for k, v in self.params.items()}
        site = iter(range(1 << 30))

        def drop(x):
            return tape.dropout(x, p_drop, _seed(dropout_seed, next(site))) if p_drop else x

        def residual(x, h, w, b):   # x + drop(h @ w + b); one node without dropout
            if p_drop:
                return tape.add(x, drop(tape.matmul(h, w, b)))
            return tape.matmul_add(h, w, b, x)

        x = tape.embedding(ids, leaves["wte.weight"], leaves["wpe.weight"], 0)  # (B, T, C)
        x = drop(tape.reshape(x, B * T, C))                                      # (B*T, C)
        for L in layers(leaves, cfg):
            h = tape.layernorm(x, L.ln1_w, L.ln1_b, eps)
            qkv = tape.reshape(tape.matmul(h, L.qkv_w, L.qkv_b), B, T, 3 * C)    # (B, T, 3C)
            if fused:   # attention dropout inside the op, at the site the composed path uses
                seed = _seed(dropout_seed, next(site)) if p_drop else None
                y = tape.attention_qkv(qkv, H, 1.0 / math.sqrt(hs), p_drop, seed)  # (B, T, C)
            else:
                q, k, v = tape.split_heads(qkv, H)                               # (B, H, T, hs)
                att = tape.matmul(q, k, trans_b=True, alpha=1.0 / math.sqrt(hs))  # (B, H, T, T)
                att = drop(tape.softmax(att, causal=True))
                y = tape.merge_heads(tape.matmul(att, v))                        # (B, T, C)
            y = tape.reshape(y, B * T, C)                                        # (B*T, C)
            x = residual(x, y, L.proj_w, L.proj_b)
            h = tape.layernorm(x, L.ln2_w, L.ln2_b, eps)
            if p_drop:
                h = tape.matmul_gelu(h, L.fc_w, L.fc_b)                          # (B*T, 4C)
                x = residual(x, h, L.out_w, L.out_b)
            else:   # the MLP and its residual add as one node
                x = tape.mlp(h, L.fc_w, L.fc_b, L.out_w, L.out_b, x)
        x = tape.layernorm(x, leaves["ln_f.weight"], leaves["ln_f.bias"], eps)
        if targets is None:
            return tape.matmul(x, _head(leaves, cfg), trans_b=True), None, leaves  # (B*T, Vp)
        if targets.ndim == 1 and B == 1:
            targets = targets.reshape(1, -1)
        if targets.shape != (B, T):
            raise ShapeError(f"GPT2.forward: targets must be {(B, T)} like ids, got {targets.shape}")
        self._check_ids("GPT2.forward (targets)", targets)
        if fused_loss is None:
            fused_loss = train and flags.on("FORGE_FUSED_LOSS")
        if fused_loss:   # the LM head and its loss in chunks: no logits kept
            return None, tape.linear_cross_entropy(x, _head(leaves, cfg), targets.reshape(B * T),
                                                   cfg.vocab_size, grad=train), leaves
        logits = tape.matmul(x, _head(leaves, cfg), trans_b=True)                # (B*T, Vp)
        return logits, tape.cross_entropy(logits, targets.reshape(B * T), cfg.vocab_size), leaves

    def loss_and_grads(self, ids: Tensor, targets: Tensor, **kw):
        """One forward and backward: ``(loss as float, {name: grad Tensor})`` (``grads``, with
        the one wait that reads the loss).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> loss, g = GPT2.init(cfg).loss_and_grads(tensor([[1, 2]]), tensor([[2, 3]]))
        >>> type(loss).__name__, round(loss, 1), g["wte.weight"].shape     # ~ ln(10) at init
        ('float', 2.3, (10, 4))
        """
        loss, grads = self.grads(ids, targets, **kw)
        return loss.item(), grads

    def grads(self, ids: Tensor, targets: Tensor, **kw):
        """One forward and backward that never waits for the device: ``(loss as a 0-d Tensor,
        {name: grad Tensor})``. ``kw`` as ``forward``'s (``dropout_seed`` may be a one-element
        int64 Tensor: see ``ops.SeedAt``).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> from forge_ml import tensor
        >>> loss, g = GPT2.init(cfg).grads(tensor([[1, 2]]), tensor([[2, 3]]))
        >>> loss.shape, g["wte.weight"].shape
        ((), (10, 4))
        """
        tape = Tape()
        _, loss, leaves = self.forward(tape, ids, targets, **kw)
        tape.backward(loss)
        return loss.t, {k: tape.grad(v) for k, v in leaves.items()}

    def loss(self, ids: Tensor, targets: Tensor, **kw) -> Tensor:
        """The mean loss without gradients (evaluation): a 0-d Tensor, no dropout, nothing kept
        for a backward (``Tape(grad=False)``), the LM head's loss op unless
        ``FORGE_FUSED_LOSS=off``. ``kw`` as ``forward``'s.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> from forge_ml import tensor
        >>> GPT2.init(cfg).loss(tensor([[1, 2]]), tensor([[2, 3]])).shape
        ()
        """
        if targets is None:   # (forward gives logits and no loss then)
            raise ShapeError("GPT2.loss: targets are required (each position's next token: the "
                             "ids shifted by one); for logits use GPT2.logits")
        kw.setdefault("fused_loss", flags.on("FORGE_FUSED_LOSS"))
        return self.forward(Tape(grad=False), ids, targets, train=False, **kw)[1].t

    def logits(self, ids: Tensor, **kw) -> Tensor:
        """Full-sequence logits ``(B, T, V)`` (padding columns dropped), no KV cache, no
        dropout: the reference the cached forwards equal.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> model = GPT2.init(cfg)
        >>> full = model.logits(tensor([[1, 2, 3]])).numpy()
        >>> cached = model.forward_cached(tensor([[1, 2, 3]]), model.new_cache(1)).numpy()
        >>> full.shape, bool(np.allclose(full, cached, atol=1e-6))
        ((1, 3, 10), True)
        """
        self._ids_tensor("GPT2.logits", ids)
        if ids.ndim not in (1, 2):
            raise ShapeError(f"GPT2.logits: ids must be (T,) or (B, T), got shape {ids.shape}")
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        B, T = ids.shape
        logits, _, _ = self.forward(Tape(grad=False), ids, train=False, **kw)
        out = logits.t.reshape(B, T, self.config.padded_vocab_size)
        return _take_vocab(out, self.config.vocab_size)

    # -- inference with a KV cache ----------------------------------------------------------
    def new_cache(self, batch: int, max_len: Optional[int] = None, **kw):
        """An empty KV cache (``forge_ml.inference.decode.KVCache``) for ``batch`` rows and up
        to ``max_len`` (<= block_size, its default) tokens, in the parameters' dtype.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=2, n_head=1, n_embd=4)
        >>> cache = GPT2.init(cfg).to(dtype="float64").new_cache(3)
        >>> cache.batch, cache.capacity, len(cache.k), cache.k[0].dtype
        (3, 8, 2, forge_ml.float64)
        """
        _params_kw("GPT2.new_cache", kw)
        from ..inference.decode import KVCache
        return KVCache.empty(self, batch, max_len)

    def decoder(self, batch: int, max_len: Optional[int] = None, **kw) -> tuple:
        """``(cache, step)`` for a generation loop: see ``forge_ml.inference.decode.decoder``.

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> cache, step = GPT2.init(cfg).decoder(2, 8)
        >>> cache.capacity, type(step).__name__
        (8, 'DecodeStep')
        """
        _params_kw("GPT2.decoder", kw)
        from ..inference.decode import decoder
        return decoder(self, batch, max_len)

    def forward_cached(self, ids: Tensor, cache, *, last_only: bool = False, **kw) -> Tensor:
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
        _params_kw("GPT2.forward_cached", kw)
        cfg = self.config
        P = self.params
        self._ids_tensor("forward_cached", ids)
        if ids.ndim == 1:
            ids = ids.reshape(1, -1)
        if ids.ndim != 2:
            raise ShapeError(f"forward_cached: ids must be (B, Tn), got {ids.shape}")
        B, Tn = ids.shape
        if Tn == 0:
            raise ShapeError(f"forward_cached: ids {ids.shape} hold no tokens; give at least "
                             f"one per row")
        self.check_cache("forward_cached", cache)
        if B != cache.batch:
            raise ShapeError(f"forward_cached: ids have {B} rows but the cache was made for "
                             f"{cache.batch}")
        pos = cache.pos
        if pos + Tn > cache.capacity:
            raise ShapeError(f"forward_cached: {pos} cached + {Tn} new tokens exceed the cache's "
                             f"{cache.capacity} rows (context {cfg.block_size})")
        self._check_ids("forward_cached", ids)
        C, H, hs, eps = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.layernorm_eps
        x = ops.embedding(ids, P["wte.weight"], P["wpe.weight"], pos).reshape(B * Tn, C)
        n = pos + Tn
        for i, L in enumerate(layers(P, cfg)):
            h = ops.layernorm(x, L.ln1_w, L.ln1_b, eps)
            qkv = ops.matmul(h, L.qkv_w, L.qkv_b)
            q, k, v = ops.split_heads(qkv.reshape(B, Tn, 3 * C), H)           # (B, H, Tn, hs)
            ops.kv_append(cache.k[i], k, pos)
            ops.kv_append(cache.v[i], v, pos)
            att = ops.matmul(q, cache.k[i], trans_b=True, alpha=1.0 / math.sqrt(hs), b_rows=n)
            att = ops.softmax(att, causal=True, off=pos)                      # (B, H, Tn, n)
            y = ops.matmul(att, cache.v[i], b_rows=n)                         # (B, H, Tn, hs)
            y = ops.merge_heads(y).reshape(B * Tn, C)
            x = ops.add(x, ops.matmul(y, L.proj_w, L.proj_b))
            h = ops.layernorm(x, L.ln2_w, L.ln2_b, eps)
            h = ops.gelu(ops.matmul(h, L.fc_w, L.fc_b))
            x = ops.add(x, ops.matmul(h, L.out_w, L.out_b))
        if last_only and Tn > 1:
            x = ops.take_rows(x.reshape(B, Tn, C), Tn - 1)                    # (B, C)
            Tn = 1
        x = ops.layernorm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
        logits = ops.matmul(x, _head(P, cfg), trans_b=True)                   # (B*Tn, Vp)
        cache.pos = n
        return logits.reshape(B, Tn, cfg.padded_vocab_size)

    def decode_step(self, ids: Tensor, pos, cache, **kw) -> Tensor:
        """Logits ``(B, Vp)`` for one new token per row, ``ids (B, 1)`` (or ``(B,)``), at
        position ``pos``; writes the tokens' keys and values at row ``pos`` of ``cache``
        (``cache.pos`` is left to the caller). ``pos``: an int, or an int32 tensor on the
        model's device (one element, or one per row: rows at different positions), read by
        the kernels, so the step has fixed shapes and no host values:
        ``inference.decode.DecodeStep`` captures it in a CUDA graph. Equal to
        ``forward_cached``'s logits for the same token at the same position (attention
        scores in float32).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
        >>> model = GPT2.init(cfg)
        >>> cache = model.new_cache(1, 8)
        >>> ref = model.forward_cached(tensor([[1, 2, 3]]), cache).numpy()[0, 2]
        >>> out = model.decode_step(tensor([[3]]), 2, cache).numpy()[0]
        >>> bool(np.allclose(out, ref, atol=1e-6))
        True
        """
        _params_kw("GPT2.decode_step", kw)
        cfg = self.config
        P = self.params
        self._ids_tensor("decode_step", ids)
        if ids.ndim == 1:
            ids = ids.reshape(-1, 1)
        if ids.ndim != 2 or ids.shape[1] != 1:
            raise ShapeError(f"decode_step: ids must be (B, 1), one token per row, got {ids.shape}")
        B = ids.shape[0]
        self.check_cache("decode_step", cache)
        if B != cache.batch:
            raise ShapeError(f"decode_step: ids have {B} rows but the cache was made for "
                             f"{cache.batch}")
        self._check_ids("decode_step", ids)
        C, H, eps = cfg.n_embd, cfg.n_head, cfg.layernorm_eps
        x = ops.embedding(ids, P["wte.weight"], P["wpe.weight"], pos).reshape(B, C)
        for i, L in enumerate(layers(P, cfg)):
            # four linear layers, each one kernel on the GPU (layernorm folded into the first
            # and third, GELU and the residual adds into the epilogues), and the attention
            qkv = ops.linear(x, L.qkv_w, L.qkv_b, ln=(L.ln1_w, L.ln1_b), eps=eps)
            y = ops.decode_attention(qkv, cache.k[i], cache.v[i], pos, H)        # (B, C)
            x = ops.linear(y, L.proj_w, L.proj_b, residual=x)
            h = ops.linear(x, L.fc_w, L.fc_b, act="gelu", ln=(L.ln2_w, L.ln2_b), eps=eps)
            x = ops.linear(h, L.out_w, L.out_b, residual=x)
        x = ops.layernorm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
        return ops.matmul(x, _head(P, cfg), trans_b=True)                        # (B, Vp)

    def fused_decode_ok(self, cache) -> bool:
        """Whether ``decode_step_fused`` runs for this model and ``cache``: the device has
        GPT-2's decoding step in a few kernels for the cache's batch (``ops.decode_gpt2_ok``:
        CUDA, float32 or bf16; 1-4 rows on a Hopper GPU with the layers step, the default).

        >>> cfg = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=64)
        >>> model = GPT2.init(cfg)
        >>> model.fused_decode_ok(model.new_cache(1, 8))     # on the CPU: no
        False
        """
        return ops.decode_gpt2_ok(self.params["wte.weight"], self.config.n_head, cache.k[0])

    def decode_step_fused(self, ids: Tensor, pos: Tensor, cache, logits: Tensor, out=None,
                          row=None, greedy: bool = False) -> None:
        """``decode_step`` in a few kernels (``ops.decode_gpt2``), where ``fused_decode_ok``:
        writes the float32 ``logits (B, Vp)`` of the tokens ``ids (B, 1)`` at the device
        position ``pos`` (one for every row) and their keys and values into ``cache``; with
        ``greedy`` also ``ops.greedy_next``'s choice (``ids``, ``out[row]``, ``pos += 1``).

        Example (on a GPU)::

            cache = model.new_cache(1, 1024)
            logits = zeros((1, model.config.padded_vocab_size), "float32", "cuda")
            model.decode_step_fused(ids, pos, cache, logits)
        """
        cfg, P = self.config, self.params
        ops.decode_gpt2(ids, pos, P["wte.weight"], P["wpe.weight"],
                        (P["ln_f.weight"], P["ln_f.bias"]), _head(P, cfg), layers(P, cfg),
                        list(zip(cache.k, cache.v)), cfg.n_head, cfg.layernorm_eps,
                        cfg.vocab_size, logits, out=out, row=row, greedy=greedy)


def _take_vocab(logits: Tensor, v: int) -> Tensor:
    """Drop padded vocab columns: ``(…, Vp) -> (…, V)`` (a copy)."""
    if logits.shape[-1] == v:
        return logits
    return ops.take_columns(logits, v)


def __getattr__(name):
    # KVCache and DecodeStep moved to forge_ml.inference.decode (one release of grace)
    if name in ("KVCache", "DecodeStep"):
        warnings.warn(f"forge_ml.models.gpt2.{name} moved to forge_ml.inference.decode.{name}",
                      DeprecationWarning, stacklevel=2)
        from ..inference import decode
        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
