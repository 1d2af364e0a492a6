"""Hugging Face GPT-2 interchange: ``config.json`` + ``model.safetensors``, both ways.

Pure NumPy, json and safetensors: importing this module never imports torch or transformers.

Names: forge-ml's parameter names are HF's ``GPT2LMHeadModel`` names without the
``transformer.`` prefix. HF's ``Conv1D`` (transformers/pytorch_utils.py) keeps
its weight as ``(nx, nf)`` = (in, out) and computes ``addmm(bias, x, weight)``, i.e.
``x @ W + b``, which is exactly forge-ml's Linear layout, so c_attn, c_proj and c_fc weights
cross over without a transpose.

Vocabulary padding: forge-ml pads ``wte`` (and an untied ``lm_head``) to ``padded_vocab_size``
rows, the extra rows zero; HF files hold exactly ``vocab_size`` rows.

Dropout: HF's GPT-2 has four rates (``DROPOUT_KEYS``: ``resid_pdrop``, ``embd_pdrop``,
``attn_pdrop``, and ``summary_first_dropout`` of its classification heads, which forge-ml
lacks), forge-ml one (``GPT2Config.dropout``, at the embeddings, the attention probabilities
and the residual branches). An import maps the three rates of the model to forge-ml's one:
the rate they share, or ``resid_pdrop`` where they differ (a rate of 1, which forge-ml's config
cannot hold, as 0). The four as given are ``load_hf_dropout``'s, which ``forge-ml convert``
keeps in the checkpoint (``meta["hf_dropout"]``) and hands back to ``save_hf_gpt2``, so an
import followed by an export writes the rates it read.

>>> import tempfile, os, numpy as np
>>> cfg = {"vocab_size": 10, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 4}
>>> params = {k: np.random.rand(*s).astype(np.float32) for k, s in gpt2_param_shapes(cfg).items()}
>>> d = os.path.join(tempfile.mkdtemp(), "hf")
>>> save_hf_gpt2(d, cfg, params)
>>> cfg2, params2 = load_hf_gpt2(d, padded_vocab=16)
>>> cfg2["padded_vocab_size"], params2["wte.weight"].shape
(16, (16, 4))
"""
from __future__ import annotations

import copy
import dataclasses
import json
import numbers
import re
from pathlib import Path

import numpy as np

from .checkpoint import (_check_path, atomic_directory, check_architecture, is_own_output,
                         write_safetensors)
from .errors import CheckpointError, ConfigError, plural

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
HF_PREFIX = "transformer."
HF_TOKENIZER_FILE = "forge_ml_tokenizer.json"  # a non-GPT-2 tokenizer kept in an exported folder
# The tokenizer files transformers' AutoTokenizer reads: GPT-2's vocab.json + merges.txt, or a
# tokenizer.json (the tokenizers library's format) for a char or an "hf" tokenizer; tokenizer_config.json
# names the class.
TRANSFORMERS_TOKENIZER_FILES = ("tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.json")
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, HF_TOKENIZER_FILE, *TRANSFORMERS_TOKENIZER_FILES})
# The key save_hf_gpt2 writes into config.json, as transformers writes "transformers_version":
# it lets a later export replace this folder and nothing else. (Not in model.safetensors'
# metadata: safetensors writes a metadata dict in a random order, so the file would differ
# from one export of the same weights to the next.)
EXPORT_MARK = "forge_ml_version"

# HF GPT2Config's dropout rates, and its default for each (transformers' GPT2Config: 0.1).
DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")
HF_DEFAULT_DROPOUT = 0.1

# transformers' GPT2Config's settings that forge-ml's model holds nothing of, with its
# defaults: GPT2DoubleHeadsModel's summary head (its dropout rate is in DROPOUT_KEYS),
# cross-attention (an import refuses it true) and the padding id. GPT2LMHeadModel reads none of
# them, and neither the model config nor a checkpoint's meta keeps them from an import, so an
# export writes these defaults (what transformers takes where a key is absent: the model
# loads the same): its config.json has every key of GPT2Config, as save_pretrained's has.
HF_GPT2_DEFAULTS = {"add_cross_attention": False, "pad_token_id": None, "summary_activation": None,
                    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True}

# Non-parameter buffers that older GPT-2 checkpoints carry: the causal mask and its fill value.
_BUFFER_RE = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

# transformers' GPT2Config.attribute_map: a config.json may give a setting under either name.
_HF_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
               "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}

# Activations that are GPT-2's tanh-approximated GELU under another name in transformers.
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def default_padded_vocab(vocab_size: int) -> int:
    """The padding rule of ``models.gpt2.GPT2Config``: a large vocabulary rounds up to a
    multiple of 128 (aligned rows for the GPU's matmuls, as llm.c does), a small one stays.

    >>> default_padded_vocab(50257), default_padded_vocab(65)
    (50304, 65)
    """
    v = int(vocab_size)
    return v if v < 1024 else (v + 127) // 128 * 128


def gpt2_param_shapes(config: dict) -> dict:
    """forge-ml's GPT-2 parameter names and shapes for a config dict (forge-ml field names;
    ``padded_vocab_size`` defaults to ``vocab_size``, ``tied_head`` to True), in model order.

    >>> s = gpt2_param_shapes({"vocab_size": 50257, "padded_vocab_size": 50304, "block_size": 1024,
    ...                        "n_layer": 12, "n_head": 12, "n_embd": 768})
    >>> s["wte.weight"], s["h.0.attn.c_attn.weight"], len(s)
    ((50304, 768), (768, 2304), 148)
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"gpt2_param_shapes: expected a config dict, got "
                              f"{type(config).__name__}")
    missing = [k for k in ("vocab_size", "block_size", "n_layer", "n_embd") if k not in config]
    if missing:
        raise CheckpointError(f"gpt2_param_shapes: the config lacks {', '.join(missing)} (forge-ml's "
                              f"GPT2Config fields)")
    C = int(config["n_embd"])
    Vp = int(config.get("padded_vocab_size") or config["vocab_size"])
    shapes = {"wte.weight": (Vp, C), "wpe.weight": (int(config["block_size"]), C)}
    for i in range(int(config["n_layer"])):
        p = f"h.{i}."
        shapes[p + "ln_1.weight"] = (C,)
        shapes[p + "ln_1.bias"] = (C,)
        shapes[p + "attn.c_attn.weight"] = (C, 3 * C)
        shapes[p + "attn.c_attn.bias"] = (3 * C,)
        shapes[p + "attn.c_proj.weight"] = (C, C)
        shapes[p + "attn.c_proj.bias"] = (C,)
        shapes[p + "ln_2.weight"] = (C,)
        shapes[p + "ln_2.bias"] = (C,)
        shapes[p + "mlp.c_fc.weight"] = (C, 4 * C)
        shapes[p + "mlp.c_fc.bias"] = (4 * C,)
        shapes[p + "mlp.c_proj.weight"] = (4 * C, C)
        shapes[p + "mlp.c_proj.bias"] = (C,)
    shapes["ln_f.weight"] = (C,)
    shapes["ln_f.bias"] = (C,)
    if not config.get("tied_head", True):
        shapes["lm_head.weight"] = (Vp, C)
    return shapes


# ---------------------------------------------------------------------------------------------
# Reading


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a Hugging Face GPT-2 directory needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: bad JSON ({e}); the file is truncated or corrupted") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def _bf16_tensor(path: Path, name: str) -> np.ndarray:
    """Read one BF16 tensor by hand (NumPy has no bfloat16): safetensors is an 8-byte
    little-endian header length, a JSON header with each tensor's byte range, then the data.
    bfloat16 is the top half of a float32, so shifting its bits up 16 gives the exact value."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        begin, end = header[name]["data_offsets"]
        f.seek(8 + n + begin)
        raw = np.frombuffer(f.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])


def _read_weights(files: list[Path]) -> dict:
    """All tensors of the given safetensors files as float32 NumPy arrays, under HF's names
    minus the ``transformer.`` prefix, buffers skipped."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        try:  # safetensors reports any failure to open as a missing file: ask the OS first
            with open(path, "rb") as f:
                f.read(8)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read it: {e.strerror or e}") from None
        try:
            with safe_open(str(path), framework="np") as f:
                for key in f.keys():
                    name = key[len(HF_PREFIX):] if key.startswith(HF_PREFIX) else key
                    if _BUFFER_RE.match(name):
                        continue
                    dtype = f.get_slice(key).get_dtype()
                    if dtype == "BF16":
                        a = _bf16_tensor(path, key)
                    elif dtype in ("F32", "F16", "F64"):
                        a = f.get_tensor(key)
                    else:
                        raise CheckpointError(f"{path}: tensor {key} has dtype {dtype}; expected F32, F16, BF16 or F64")
                    if name in out:
                        raise CheckpointError(f"{path}: parameter {name} appears twice (with and without the prefix?)")
                    out[name] = np.ascontiguousarray(a, dtype=np.float32)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' SafetensorError, OSError, a bad header, ...
            raise CheckpointError(f"{path}: cannot read safetensors: {e}") from None
    return out


def _weight_files(d: Path) -> list[Path]:
    single = d / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = d / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing key 'weight_map'")
        bad = next(((k, f) for k, f in weight_map.items() if not isinstance(f, str) or not f), None)
        if bad is not None:   # (a number was a TypeError traceback from convert)
            raise CheckpointError(f"{index}: expected 'weight_map' to name a safetensors file for each "
                                  f"tensor, got {bad[1]!r} for {bad[0]!r}")
        return [d / f for f in sorted(set(weight_map.values()))]
    hint = ""
    found = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (d / f).is_file()]
    if found:
        hint = (f" (found {found[0]}: PyTorch's pickle format, which forge-ml does not read; re-save it "
                "as safetensors with transformers: GPT2LMHeadModel.from_pretrained(dir).save_pretrained(new_dir, "
                "safe_serialization=True))")
    raise CheckpointError(f"{single} is missing; expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}{hint}")


def _dropout_rates(given: dict, where) -> dict:
    """The four rates of ``DROPOUT_KEYS`` from ``given`` (a config.json's dict), transformers'
    default 0.1 for one it lacks; a rate that is not a number in [0, 1] (as torch's Dropout
    takes) is a CheckpointError naming ``where``."""
    rates = {}
    for key in DROPOUT_KEYS:
        r = given.get(key, HF_DEFAULT_DROPOUT)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise CheckpointError(f"{where}: expected a number in [0, 1] for {key!r}, got {r!r}")
        rates[key] = r
    return rates


def forge_dropout(rates: dict) -> float:
    """forge-ml's one dropout rate for HF's rates: resid_pdrop, which is the rate resid_pdrop,
    embd_pdrop and attn_pdrop share where they agree; 0.0 for a rate of 1 (GPT2Config takes
    [0, 1)).

    >>> forge_dropout({"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1})
    0.1
    >>> forge_dropout({"resid_pdrop": 0.05, "embd_pdrop": 0.15, "attn_pdrop": 0.25})
    0.05
    """
    r = float(rates["resid_pdrop"])
    return r if r < 1 else 0.0


def load_hf_dropout(dir) -> dict:
    """The dropout rates of a Hugging Face GPT-2 folder's config.json, as given (``DROPOUT_KEYS``;
    transformers' default 0.1 for one it lacks): what ``save_hf_gpt2(..., dropout_rates=)``
    writes back.

    >>> import tempfile, os, json
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "config.json"), "w").write(json.dumps({"attn_pdrop": 0.25}))
    >>> load_hf_dropout(d)["attn_pdrop"], load_hf_dropout(d)["resid_pdrop"]
    (0.25, 0.1)
    """
    _check_path("load_hf_dropout", dir)
    path = Path(dir) / CONFIG_FILE
    return _dropout_rates(_read_json(path), path)


HF_FLAGS = ("reorder_and_upcast_attn",)   # kept as given: float32 runs them alike


def load_hf_flags(dir) -> dict:
    """The switches of a Hugging Face GPT-2 folder's config.json that change nothing forge-ml
    computes but change transformers' numerics in half precision (``HF_FLAGS``:
    ``reorder_and_upcast_attn``, the attention's scores upcast to float32), as given (False
    where absent): what ``save_hf_gpt2(..., hf_flags=)`` writes back, so a round trip keeps
    them (an export wrote false).

    >>> import tempfile, os, json
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "config.json"), "w").write(json.dumps({"reorder_and_upcast_attn": True}))
    >>> load_hf_flags(d)
    {'reorder_and_upcast_attn': True}
    """
    _check_path("load_hf_flags", dir)
    path = Path(dir) / CONFIG_FILE
    return _flags(_read_json(path), path)


def _flags(hf: dict, where) -> dict:
    """``HF_FLAGS``' values in ``hf`` (False where absent); one that is not true or false is a
    CheckpointError naming ``where`` (a string "false" was read as true)."""
    for k in HF_FLAGS:
        if k in hf and not isinstance(hf[k], bool):
            raise CheckpointError(f"{where}: expected true or false for {k!r}, got {hf[k]!r}")
    return {k: hf.get(k, False) for k in HF_FLAGS}


def hf_meta(dir) -> dict:
    """What a checkpoint's meta keeps of a Hugging Face folder's config.json for an export
    to write back, from one read of it: ``{"hf_dropout": load_hf_dropout's, "hf_flags":
    load_hf_flags'}``.

    >>> import json, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = Path(d, "config.json").write_text(json.dumps({"embd_pdrop": 0.0}))
    ...     meta = hf_meta(d)
    >>> meta["hf_dropout"]["embd_pdrop"], meta["hf_dropout"]["resid_pdrop"], meta["hf_flags"]
    (0.0, 0.1, {'reorder_and_upcast_attn': False})
    """
    _check_path("hf_meta", dir)
    path = Path(dir) / CONFIG_FILE
    hf = _read_json(path)
    return {"hf_dropout": _dropout_rates(hf, path), "hf_flags": _flags(hf, path)}


def _forge_config(hf: dict, path: Path, padded_vocab: int | None) -> dict:
    """forge-ml GPT2Config fields from an HF config, refusing features forge-ml lacks."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise CheckpointError(
            f"{path}: unknown architecture: model_type is {model_type!r} (architectures "
            f"{hf.get('architectures')}); expected 'gpt2'"
        )
    for alias, key in _HF_ALIASES.items():
        if alias in hf:   # a num_attention_heads beside n_head was ignored: other heads than transformers'
            if key in hf and hf[key] != hf[alias]:
                raise CheckpointError(f"{path}: {key}={hf[key]!r} but {alias}={hf[alias]!r} (the same setting in "
                                      f"transformers, which takes {alias}'s); expected one value")
            hf = dict(hf, **{key: hf[alias]})
    for key in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf[key], bool) or hf[key] < 1:
            raise CheckpointError(f"{path}: expected a positive integer {key!r}, got {hf.get(key)!r}")
    for key in ("tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                "reorder_and_upcast_attn", "add_cross_attention"):
        if key in hf and not isinstance(hf[key], bool):  # a string "false" would read as true
            raise CheckpointError(f"{path}: expected true or false for {key!r}, got {hf[key]!r}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise CheckpointError(f"{path}: expected a number >= 0 for 'layer_norm_epsilon', got {eps!r}")
    C, H = hf["n_embd"], hf["n_head"]
    if C % H:
        raise CheckpointError(f"{path}: n_embd={C} is not divisible by n_head={H}")
    unsupported = []
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        unsupported.append(f"activation_function={act!r} (forge-ml has GPT-2's tanh GELU, 'gelu_new')")
    if hf.get("n_inner") not in (None, 4 * C):
        unsupported.append(f"n_inner={hf['n_inner']!r} (forge-ml's MLP is 4 * n_embd = {4 * C}, "
                           f"an int or null)")
    if not hf.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=false")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=true")
    if hf.get("add_cross_attention", False):
        unsupported.append("add_cross_attention=true")
    if unsupported:
        raise CheckpointError(f"{path}: GPT-2 variant forge-ml cannot run: " + "; ".join(unsupported))
    V = hf["vocab_size"]
    if padded_vocab is not None and (isinstance(padded_vocab, bool)
                                     or not isinstance(padded_vocab, numbers.Integral)):   # "x": a ValueError
        raise CheckpointError(f"padded_vocab: expected an int (or None), got {padded_vocab!r}")
    Vp = default_padded_vocab(V) if padded_vocab is None else int(padded_vocab)
    if Vp < V:
        raise CheckpointError(f"padded_vocab={Vp} is smaller than the checkpoint's vocab_size={V}")
    return {
        "vocab_size": V,
        "padded_vocab_size": Vp,
        "block_size": hf["n_positions"],
        "n_layer": hf["n_layer"],
        "n_head": H,
        "n_embd": C,
        "dropout": forge_dropout(_dropout_rates(hf, path)),
        "tied_head": bool(hf.get("tie_word_embeddings", True)),
        "layernorm_eps": float(eps),
    }


def load_hf_gpt2(dir, padded_vocab: int | None = None) -> tuple[dict, dict]:
    """Read a Hugging Face GPT-2 directory; returns ``(config, params)`` in forge-ml's names
    (float32 arrays, ``wte`` zero-padded to ``padded_vocab`` rows, by default
    ``default_padded_vocab(vocab_size)``, e.g. 50257 -> 50304).

    With tied embeddings the head is ``wte``; a stored ``lm_head.weight`` equal to it is dropped
    (one stored without ``wte``, as safetensors' ``save_model`` keeps a tied pair, is ``wte``),
    and one that differs is refused (transformers 4 ties the two and keeps ``wte``, 5 unties
    them and keeps the stored head: no single reading is the model's).

    >>> import tempfile, os, numpy as np
    >>> cfg = {"vocab_size": 5, "block_size": 4, "n_layer": 1, "n_head": 1, "n_embd": 2}
    >>> d = os.path.join(tempfile.mkdtemp(), "hf")
    >>> save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    >>> load_hf_gpt2(d)[0]["padded_vocab_size"], load_hf_gpt2(d, padded_vocab=64)[0]["padded_vocab_size"]
    (5, 64)
    """
    _check_path("load_hf_gpt2", dir)
    d = Path(dir)
    if not d.is_dir():
        raise CheckpointError(f"Hugging Face model directory not found: {d}")
    cfg_path = d / CONFIG_FILE
    if not cfg_path.exists() and any((d / sub / "state.json").is_file() for sub in (".", "ckpt")):
        raise CheckpointError(f"{d} is a forge-ml checkpoint (or a run folder holding one), not a Hugging "
                              f"Face folder ({CONFIG_FILE} + {WEIGHTS_FILE}); to write it as one: "
                              f"forge-ml convert --to-hf {d} --out NEW_FOLDER")
    config = _forge_config(_read_json(cfg_path), cfg_path, padded_vocab)
    raw = _read_weights(_weight_files(d))

    if config["tied_head"]:
        head, wte = raw.pop("lm_head.weight", None), raw.get("wte.weight")
        if head is not None and wte is not None and (
                np.shape(head) != np.shape(wte) or not np.array_equal(np.asarray(head), np.asarray(wte))):
            raise CheckpointError(f"{cfg_path} says tie_word_embeddings (the head is wte), but the weights "
                                  f"hold an lm_head.weight that differs from wte; transformers 4 would use wte "
                                  f"and transformers 5 the stored head, so the model is not one thing: set "
                                  f"tie_word_embeddings to false to keep the stored head, or drop lm_head.weight")
        if wte is None and head is not None:   # safetensors' save_model keeps the tied pair's first name
            raw["wte.weight"] = head
    # the layers the weights hold, before a table of the config's (n_layer 10**8 took minutes
    # and gigabytes to list its missing tensors)
    held = {int(m.group(1)) for k in raw if (m := re.match(r"h\.(\d+)\.", k))}
    if config["n_layer"] > len(held) + 1:
        raise CheckpointError(f"{d}: weights do not match {CONFIG_FILE}: it says n_layer "
                              f"{config['n_layer']:,}, the weights hold {len(held)} "
                              f"{plural(len(held), 'layer')}")
    unpadded = dict(config, padded_vocab_size=config["vocab_size"])
    try:
        check_architecture(gpt2_param_shapes(unpadded), raw, ignore_prefixes=())
    except CheckpointError as e:
        raise CheckpointError(f"{d}: weights do not match {CONFIG_FILE}: {e}") from None

    V, Vp = config["vocab_size"], config["padded_vocab_size"]
    params = {}
    for name in gpt2_param_shapes(config):
        a = raw[name]
        if name in ("wte.weight", "lm_head.weight") and Vp > V:
            a = np.concatenate([a, np.zeros((Vp - V, a.shape[1]), np.float32)])  # (Vp, C)
        params[name] = a
    return config, params


# ---------------------------------------------------------------------------------------------
# Writing


def _forge_version() -> str:
    from . import __version__
    return __version__


def is_hf_export(dir) -> bool:
    """Whether ``dir`` is a folder that ``save_hf_gpt2`` wrote (its files only, and its
    ``forge_ml_version`` in a ``config.json`` that transformers did not write): the only kind
    of non-empty folder an export may replace. A downloaded Hugging Face model is not one.

    >>> import tempfile, os, numpy as np
    >>> cfg = {"vocab_size": 5, "block_size": 4, "n_layer": 1, "n_head": 1, "n_embd": 2}
    >>> d = os.path.join(tempfile.mkdtemp(), "hf")
    >>> save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    >>> is_hf_export(d), is_hf_export(os.path.dirname(d))
    (True, False)
    """
    _check_path("is_hf_export", dir)
    return is_own_output(dir, EXPORT_FILES, _has_export_mark)


def _has_export_mark(d: Path) -> bool:
    try:
        with open(Path(d) / CONFIG_FILE, "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and EXPORT_MARK in cfg and "transformers_version" not in cfg


def transformers_tokenizer_files(tokenizer: dict, vocab_size: int, block_size: int) -> dict:
    """``{file name: text}``: the files that let transformers' ``AutoTokenizer.from_pretrained``
    (and so ``pipeline("text-generation", model=dir)``) load a forge-ml tokenizer offline, the
    same ids both ways. GPT-2's: its ``vocab.json`` and ``merges.txt`` (OpenAI's
    ``encoder.json`` and ``vocab.bpe``, as the Hugging Face ``gpt2`` repository holds them). A
    char tokenizer: a ``tokenizer.json`` of one word-level token per character. A Hugging Face
    tokenizer (kind "hf"): its ``tokenizer.json``, with a ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast`` and its special tokens (the eos token ...). Empty when the
    tokenizer has more ids than the model's ``vocab_size`` (it is not the model's).

    Without these, transformers builds an empty GPT-2 tokenizer for any ``model_type: gpt2``
    folder, which encodes every text as no ids at all.

    >>> files = transformers_tokenizer_files({"kind": "char", "chars": "ab"}, 2, 8)
    >>> sorted(files), json.loads(files["tokenizer.json"])["model"]["vocab"]
    (['tokenizer.json', 'tokenizer_config.json'], {'a': 0, 'b': 1})
    >>> transformers_tokenizer_files({"kind": "gpt2"}, 65, 8)
    {}
    """
    from .tokenizer import _CHAR_SPLIT, GPT2_EOT, tokenizer_from_dict

    tok = tokenizer_from_dict(tokenizer)
    if tok.vocab_size > int(vocab_size):
        return {}
    common = {"model_max_length": int(block_size), "clean_up_tokenization_spaces": False}
    if tok.kind == "gpt2":
        data = tok.data_dir
        eot = {"content": GPT2_EOT, "lstrip": False, "normalized": True, "rstrip": False,
               "single_word": False, "special": True}
        added = {str(r["id"]): dict(eot, content=c, normalized=False, lstrip=r["lstrip"], rstrip=r["rstrip"],
                                    single_word=r["single_word"], special=r["special"])
                 for c, r in tok.added.items()}
        cfg = dict(common, tokenizer_class="GPT2Tokenizer", add_prefix_space=tok.add_prefix_space,
                   bos_token=GPT2_EOT, eos_token=GPT2_EOT, unk_token=GPT2_EOT,
                   added_tokens_decoder={str(tok.eot_token): eot, **added}, **tok.roles)
        return {"vocab.json": (data / "encoder.json").read_text(encoding="utf-8"),
                "merges.txt": (data / "vocab.bpe").read_text(encoding="utf-8"),
                "tokenizer_config.json": json.dumps(cfg, indent=2) + "\n"}
    if tok.kind == "char":
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None,
            # every character its own piece (\s\S: newlines too), looked up whole
            "pre_tokenizer": copy.deepcopy(_CHAR_SPLIT),
            "post_processor": None,
            "decoder": {"type": "Fuse"},  # pieces joined with nothing between them
            "model": {"type": "WordLevel", "vocab": {c: i for i, c in enumerate(tok.chars)},
                      "unk_token": "<unk>"},
        }
        cfg = dict(common, tokenizer_class="PreTrainedTokenizerFast")
        return {"tokenizer.json": json.dumps(spec, ensure_ascii=False, indent=2) + "\n",
                "tokenizer_config.json": json.dumps(cfg, indent=2) + "\n"}
    if tok.kind == "hf":
        # the tokenizer.json as the import set it up (its special tokens added, no truncation),
        # which PreTrainedTokenizerFast runs as it is; the special tokens' roles named again
        clean = tokenizer.get("clean_up_tokenization_spaces") is True
        cfg = dict(common, tokenizer_class="PreTrainedTokenizerFast", **(tokenizer.get("roles") or {}),
                   clean_up_tokenization_spaces=clean)
        if clean:
            cfg["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
        if tokenizer.get("split_special_tokens") is True:
            cfg["split_special_tokens"] = True
        return {"tokenizer.json": json.dumps(tokenizer["tokenizer"], ensure_ascii=False) + "\n",
                "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"}
    return {}


def save_hf_gpt2(dir, config, params: dict, tokenizer: dict | None = None,
                 dropout_rates: dict | None = None, hf_flags: dict | None = None,
                 replace: bool = True) -> None:
    """Write ``params`` (forge-ml names, NumPy arrays) as a directory that transformers'
    ``GPT2LMHeadModel.from_pretrained`` loads: ``config.json`` and ``model.safetensors`` with
    the ``transformer.`` prefix, as transformers' own ``save_pretrained`` writes it, and the
    vocabulary padding removed. ``tokenizer`` (a tokenizer's ``to_dict()``), when given, is
    written as the files ``AutoTokenizer.from_pretrained`` reads (``transformers_tokenizer_files``),
    and one that is not GPT-2's also goes to ``forge_ml_tokenizer.json`` (transformers ignores
    it; forge-ml reads it). A Hugging Face tokenizer (kind "hf") gives ``config.json`` its
    ``eos_token_id`` and ``bos_token_id``, GPT-2's the ``eos_token_id`` it was read with (else
    GPT-2's 50256 where the vocabulary holds it).

    The directory is replaced atomically as a whole, and only when it is new, empty, or an
    earlier export (``is_hf_export``); anything else is a CheckpointError and is left alone.

    ``config`` is a dict or dataclass with forge-ml's GPT2Config fields (``vocab_size``,
    ``block_size``, ``n_layer``, ``n_head``, ``n_embd``; optional ``padded_vocab_size``,
    ``tied_head``, ``layernorm_eps``, ``dropout``; a field of None is one not given); other
    fields are ignored. The dropout rates written: ``dropout_rates`` where given (HF's names,
    ``DROPOUT_KEYS``, as ``load_hf_dropout`` read them; a key it lacks as below), else
    ``config``'s dropout as
    ``resid_pdrop``, ``embd_pdrop`` and ``attn_pdrop``, and transformers' default 0.1 as
    ``summary_first_dropout``. ``replace=False``: ``dir`` must be new or empty when written
    (an earlier export there is not replaced). ``hf_flags``: ``HF_FLAGS``' values as ``load_hf_flags`` read
    them (false where not given). The other keys of transformers' GPT2Config that forge-ml has
    no use for get transformers' defaults (``HF_GPT2_DEFAULTS``: the summary head's settings,
    ``add_cross_attention``, ``pad_token_id``), so that config.json has every key of GPT2Config.

    >>> import tempfile, os, numpy as np
    >>> cfg = {"vocab_size": 5, "block_size": 4, "n_layer": 1, "n_head": 1, "n_embd": 2}
    >>> d = os.path.join(tempfile.mkdtemp(), "hf")
    >>> save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    >>> sorted(os.listdir(d))
    ['config.json', 'model.safetensors']
    >>> written = json.load(open(os.path.join(d, "config.json")))
    >>> written["summary_type"], written["add_cross_attention"], written["pad_token_id"]
    ('cls_index', False, None)
    """
    _check_path("save_hf_gpt2", dir)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, dict):
        raise CheckpointError(f"save_hf_gpt2: config must be a dict or a dataclass, got {type(config).__name__}")
    # None: a field not given, as for padded_vocab_size (a dropout or layernorm_eps of None was
    # float()'s TypeError, a tied_head of None an untied head, a vocab_size of None int()'s)
    config = {k: v for k, v in config.items() if v is not None}
    missing = [k for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd") if k not in config]
    if missing:
        raise CheckpointError(f"save_hf_gpt2: config lacks {missing} (or gives None)")
    from .models.gpt2 import GPT2Config   # (the model's module, only when saving)
    try:   # GPT2Config's checks: n_head 3 of n_embd 4, a vocab_size 0, wrote a folder nothing loads
        GPT2Config.from_dict({f.name: config[f.name] for f in dataclasses.fields(GPT2Config)
                              if config.get(f.name) is not None})
    except ConfigError as e:
        raise CheckpointError(f"save_hf_gpt2: {e}") from None
    V = int(config["vocab_size"])
    Vp = int(config.get("padded_vocab_size") or V)
    tied = bool(config.get("tied_head", True))
    if Vp < V:
        raise CheckpointError(f"save_hf_gpt2: padded_vocab_size={Vp} is smaller than vocab_size={V}")
    shapes = gpt2_param_shapes(dict(config, padded_vocab_size=Vp, tied_head=tied))
    if not isinstance(params, dict):
        raise CheckpointError(f"save_hf_gpt2: params must be a dict of NumPy arrays, got {type(params).__name__}")
    for name, a in params.items():
        if not isinstance(a, np.ndarray):
            raise CheckpointError(f"save_hf_gpt2: {name} is a {type(a).__name__}; expected a NumPy array")
        if a.dtype.kind not in "fiub":   # (integers: check_architecture lists them) complex lost its imaginary part
            raise CheckpointError(f"save_hf_gpt2: {name} has dtype {a.dtype}; expected floating point")
    check_architecture(shapes, params, ignore_prefixes=())

    tensors = {}
    for name in shapes:
        a = params[name]
        if name in ("wte.weight", "lm_head.weight"):
            a = a[:V]  # (V, C): HF holds no padding rows
        key = name if name == "lm_head.weight" else HF_PREFIX + name
        tensors[key] = np.ascontiguousarray(a, dtype=np.float32)

    dropout = float(config.get("dropout", 0.0))
    if dropout_rates is not None and (not isinstance(dropout_rates, dict)
                                      or not set(dropout_rates) <= set(DROPOUT_KEYS)):
        raise CheckpointError(f"save_hf_gpt2: dropout_rates must be a dict of {', '.join(DROPOUT_KEYS)}, "
                              f"got {dropout_rates!r}")
    rates = _dropout_rates(dict({"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout},
                                **(dropout_rates or {})), "save_hf_gpt2")
    if hf_flags is not None and (not isinstance(hf_flags, dict) or not set(hf_flags) <= set(HF_FLAGS)
                                 or not all(isinstance(v, bool) for v in hf_flags.values())):
        raise CheckpointError(f"save_hf_gpt2: hf_flags must be a dict of {', '.join(HF_FLAGS)} "
                              f"(true or false), got {hf_flags!r}")
    if tokenizer is not None and not isinstance(tokenizer, dict):
        raise CheckpointError(f"save_hf_gpt2: tokenizer must be a dict (a tokenizer's to_dict()), "
                              f"got {type(tokenizer).__name__}")
    # a Hugging Face tokenizer's end of text and start (what generate stops on and starts from)
    special_ids = {k: tokenizer[k] for k in ("bos_token_id", "eos_token_id")
                   if tokenizer is not None and tokenizer.get("kind") in ("hf", "gpt2") and k in tokenizer}
    hf_config = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": rates["attn_pdrop"],
        "bos_token_id": special_ids.get("bos_token_id", 50256 if V > 50256 else None),
        "embd_pdrop": rates["embd_pdrop"],
        "eos_token_id": special_ids.get("eos_token_id", 50256 if V > 50256 else None),
        "initializer_range": 0.02,
        "layer_norm_epsilon": float(config.get("layernorm_eps", 1e-5)),
        "model_type": "gpt2",
        "n_embd": int(config["n_embd"]),
        "n_head": int(config["n_head"]),
        "n_inner": None,
        "n_layer": int(config["n_layer"]),
        "n_positions": int(config["block_size"]),
        "reorder_and_upcast_attn": bool((hf_flags or {}).get("reorder_and_upcast_attn", False)),
        "resid_pdrop": rates["resid_pdrop"],
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_first_dropout": rates["summary_first_dropout"],
        "tie_word_embeddings": tied,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": V,
        **HF_GPT2_DEFAULTS,
        EXPORT_MARK: _forge_version(),
    }
    tok_files = {} if tokenizer is None else transformers_tokenizer_files(tokenizer, V, config["block_size"])
    with atomic_directory(dir, EXPORT_FILES, _has_export_mark, "Hugging Face export", replace) as tmp:
        # The metadata save_pretrained writes; transformers 4.x refuses a file whose "format"
        # names no framework it knows.
        write_safetensors(tmp / WEIGHTS_FILE, tensors, {"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None and tokenizer.get("kind") != "gpt2":
            (tmp / HF_TOKENIZER_FILE).write_text(json.dumps(tokenizer), encoding="utf-8")
        for name, text in tok_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
