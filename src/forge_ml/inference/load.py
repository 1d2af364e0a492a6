"""Loading a model for inference: a forge-ml checkpoint (or a run folder holding one) or a
Hugging Face GPT-2 folder, with its tokenizer. Nothing here imports the trainer.

>>> resolve_checkpoint("runs/none")
Traceback (most recent call last):
...
forge_ml.errors.CheckpointError: checkpoint not found: runs/none does not exist
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os  # (the doctests use it)
from pathlib import Path

from ..checkpoint import (check_architecture, interrupted_swap, is_path, load_checkpoint,
                          unpack_tensors)
from ..errors import CheckpointError, ConfigError, TokenizerError
from ..hf import HF_TOKENIZER_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE  # (HF_TOKENIZER_FILE: a non-GPT-2 tokenizer kept in an exported HF folder)
from ..models.gpt2 import GPT2, GPT2Config, param_shapes
from ..tokenizer import HF_GPT2_CLASSES, _id_form, tokenizer_from_dict

CKPT_NAME = "ckpt"          # <run>/ckpt: a run's latest checkpoint


def resolve_checkpoint(path) -> Path:
    """A checkpoint folder from a path that is one, or a run folder holding ``ckpt/``, also
    in the half-renamed state an interrupted save can leave (``ckpt`` gone, ``ckpt.old``
    complete: the path returned is then ``.../ckpt``, which ``load_checkpoint`` reads from
    ``ckpt.old``).

    >>> import tempfile, os, numpy as np
    >>> from forge_ml.checkpoint import save_checkpoint
    >>> run = tempfile.mkdtemp(); save_checkpoint(os.path.join(run, "ckpt.old"), {}, {})
    >>> _ = open(os.path.join(run, ".ckpt.swap"), "w").close()     # ckpt's save died midway
    >>> resolve_checkpoint(run).name, resolve_checkpoint(os.path.join(run, "ckpt")).name
    ('ckpt', 'ckpt')
    """
    p = Path(path)
    hf_weights = any((p / f).is_file() for f in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE))
    if (p / "state.json").is_file() or ((p / "config.json").is_file() and hf_weights):
        return p
    if (old := interrupted_swap(p)) is not None and (old / "state.json").is_file():
        return p                   # load_checkpoint recovers the previous one from <p>.old
    if (p / CKPT_NAME / "state.json").is_file():
        return p / CKPT_NAME       # (a config.json of the user's beside it was read as a Hugging Face folder)
    if (old := interrupted_swap(p / CKPT_NAME)) is not None and (old / "state.json").is_file():
        return p / CKPT_NAME       # load_checkpoint recovers the previous one from ckpt.old
    if (p / "config.json").is_file():
        return p                   # a Hugging Face folder without weights: load_hf_gpt2 says so
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p} does not exist")
    for d in (p, p / CKPT_NAME):
        if (d / "model.safetensors").is_file():     # its state.json deleted or lost
            raise CheckpointError(f"{d / 'state.json'} is missing; a forge-ml checkpoint holds state.json "
                                  f"and model.safetensors (a Hugging Face folder: config.json)")
    if (p / "log.jsonl").is_file() or (p / "data" / "train.bin").is_file():
        raise CheckpointError(f"{p} is a run folder without a checkpoint yet ({CKPT_NAME}/ is written every "
                              f"--checkpoint-interval steps and when training ends); train it further, or give "
                              f"another checkpoint")
    raise CheckpointError(f"{p} is neither a forge-ml checkpoint (state.json + model.safetensors), "
                          f"a run folder with {CKPT_NAME}/ inside, nor a Hugging Face GPT-2 "
                          "folder (config.json)")


def load_model(path, device="cpu", dtype="float32", tokenizer=True):
    """``(model, tokenizer, meta)`` from a forge-ml checkpoint (or a run folder holding one) or
    a Hugging Face GPT-2 folder (``config.json`` + ``model.safetensors``; its forge-ml export's
    tokenizer, else its own ``tokenizer.json`` where that is not GPT-2's, else GPT-2's, which
    may have more ids than the model: ``check_tokenizer_fits`` says so before text is turned
    into ids; ``hf_tokenizer_dict``). The model has no dropout (``meta["config"]`` keeps the
    rate recorded, and ``meta["hf_dropout"]`` a Hugging Face folder's four, ``meta["hf_flags"]``
    its switches that only half precision reads, ``hf.load_hf_flags``). ``dtype="bfloat16"``
    gives a bf16 model on the GPU (weights rounded once at load). ``tokenizer=False``: a Hugging Face folder whose
    tokenizer forge-ml cannot read, or a checkpoint whose recorded tokenizer cannot be read,
    gives None for it instead of an error (token ids alone: eval of a shard). A checkpoint whose
    recorded config is not valid or does not fit its weights is a CheckpointError naming it.

    >>> import tempfile, numpy as np
    >>> from forge_ml.checkpoint import save_checkpoint
    >>> cfg = GPT2Config(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=8)
    >>> d = tempfile.mkdtemp()
    >>> save_checkpoint(d, GPT2.init(cfg).state_dict(), {"config": cfg.to_dict(),
    ...                 "tokenizer": {"kind": "char", "chars": "abc\\n"}, "step": 1})
    >>> model, tok, meta = load_model(d)
    >>> tok.vocab_size, meta["step"]
    (4, 1)
    """
    if not is_path(path):
        raise ConfigError(f"load_model: path must be a checkpoint, run or Hugging Face folder "
                          f"(a str or a Path), got {path!r:.60}")
    p = resolve_checkpoint(path)
    if (p / "state.json").is_file() or not p.exists():  # not there: the ``.old`` state
        tensors, meta = load_checkpoint(p)
        if not isinstance(meta.get("config"), dict):
            raise CheckpointError(f"{p}: the checkpoint's meta has no model 'config' (an object of "
                                  f"GPT2Config's fields), got {type(meta.get('config')).__name__}; not "
                                  f"a forge-ml model checkpoint, or a damaged one")
        # a damaged record is the checkpoint's error, naming it (these named no file: "GPT2Config:
        # n_embd 16 must be divisible by n_head 3", "checkpoint does not fit the model: ...")
        try:
            cfg = GPT2Config.from_dict(dict(meta["config"], dropout=0.0))
        except ConfigError as e:
            raise CheckpointError(f"{p}: the model config its state.json records is not valid: "
                                  f"{e}") from None
        params, _, _ = unpack_tensors(tensors)
        try:
            check_architecture(param_shapes(cfg), params)
        except CheckpointError as e:
            raise CheckpointError(f"{p}: its weights do not match the model config its state.json "
                                  f"records: {e}") from None
        model = GPT2.from_state_dict(cfg, params, device=device, dtype=dtype)
        try:
            tok = tokenizer_from_dict(meta.get("tokenizer") or {"kind": "gpt2"})
        except TokenizerError as e:   # (it named no file: "the dict has no 'chars' key")
            if not tokenizer:         # token ids alone, as for a Hugging Face folder
                return model, None, dict(meta, tokenizer=None)
            raise CheckpointError(f"{p}: the tokenizer its state.json records cannot be read: "
                                  f"{e}") from None
        return model, tok, meta
    from ..hf import hf_meta, load_hf_gpt2
    config, params = load_hf_gpt2(p)
    # no dropout in the model, as for a checkpoint; the folder's rates are the meta's (convert)
    cfg = GPT2Config.from_dict(config)
    meta = {"config": cfg.to_dict(), **hf_meta(p)}
    model = GPT2.from_state_dict(dataclasses.replace(cfg, dropout=0.0), params, device=device, dtype=dtype)
    try:
        tok, built = _hf_tokenizer_built(p)
    except CheckpointError:
        if tokenizer:
            raise
        return model, None, dict(meta, tokenizer=None)
    return model, built, dict(meta, tokenizer=tok)


def check_tokenizer_fits(model, tok, where) -> None:
    """A ConfigError when ``tok`` has more ids than ``model``'s vocabulary (``model``: a model,
    or its vocabulary size): its ids would not be the model's (a Hugging Face folder without a
    tokenizer of its own is read with GPT-2's, so a model with a smaller vocabulary gets one
    that does not fit; the message says so for a gpt2 tokenizer). What ``forge-ml sample``,
    ``serve`` and ``convert --from-hf`` check before they turn text into ids or keep them.

    >>> from forge_ml.tokenizer import tokenizer_from_dict
    >>> model = GPT2.init(GPT2Config(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=8))
    >>> check_tokenizer_fits(model, tokenizer_from_dict({"kind": "char", "chars": "abc\\n"}), "m")
    >>> check_tokenizer_fits(model, tokenizer_from_dict({"kind": "gpt2"}), "m")
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: m: the model has 4 tokens but its tokenizer (gpt2) has 50257; ...
    """
    n = model if isinstance(model, int) else model.config.vocab_size
    if tok.vocab_size > n:
        why = (" (a Hugging Face folder without a tokenizer of its own is read with GPT-2's)" if tok.kind == "gpt2"
               else "")
        raise ConfigError(f"{where}: the model has {n} tokens but its tokenizer "
                          f"({tok.kind}) has {tok.vocab_size}; the ids would not be the model's{why}")


def hf_tokenizer_dict(hf_dir) -> dict:
    """The tokenizer of a Hugging Face GPT-2 folder: the one forge-ml exported with it
    (``forge_ml_tokenizer.json``); else GPT-2's (kind "gpt2", tiktoken) where the folder holds
    GPT-2's vocabulary or none; else the folder's own (kind "hf", run by the ``tokenizers``
    package): its ``tokenizer.json``, or a byte-level BPE of its ``vocab.json`` and
    ``merges.txt``, set up as transformers' ``AutoTokenizer`` sets it up (``hf_tokenizer_spec``).

    >>> import tempfile
    >>> hf_tokenizer_dict(tempfile.mkdtemp())
    {'kind': 'gpt2'}
    """
    return _hf_tokenizer(hf_dir)[0]


def _hf_tokenizer(hf_dir) -> tuple:
    """``(hf_tokenizer_dict(hf_dir), tokenizer)``: the tokenizer built to check the dict (a
    folder's own "hf" one is not built here: None, built by whoever uses it)."""
    f = Path(hf_dir) / HF_TOKENIZER_FILE
    if f.is_file():
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable tokenizer file ({e})") from None
        try:
            tok = tokenizer_from_dict(d)  # checked here, not when a checkpoint converted from it is used
        except TokenizerError as e:
            raise CheckpointError(f"{f}: not a forge-ml tokenizer ({e})") from None
        return d, tok
    own = _not_gpt2_file(Path(hf_dir))
    if own is not None:
        return _hf_own_tokenizer(Path(hf_dir), *own), None
    d = {"kind": "gpt2"}
    added, roles = _hf_added_tokens(Path(hf_dir))
    if added:
        d["added"] = added
    if roles:
        d["roles"] = roles
    if _hf_prefix_space(Path(hf_dir)):
        d["add_prefix_space"] = True
    try:
        tok = tokenizer_from_dict(d)
        eos = _hf_eos(Path(hf_dir), tok.vocab_size)
        if eos and tuple(eos) != tok.stop_tokens:   # (GPT-2's 50256 alone is the default)
            d["eos_token_id"] = _id_form(eos)
            tok = tokenizer_from_dict(d)
    except TokenizerError as e:
        raise CheckpointError(f"{hf_dir}: its tokenizer cannot be read: {e}") from None
    return d, tok


def _hf_tokenizer_built(hf_dir) -> tuple:
    """``_hf_tokenizer(hf_dir)`` with the tokenizer always built (a folder's own "hf" one
    too): what a model's user needs (load_model, convert)."""
    d, tok = _hf_tokenizer(hf_dir)
    return d, (tokenizer_from_dict(d) if tok is None else tok)


def _tokenizer_file(f: Path):
    """The JSON of a tokenizer file of a Hugging Face folder, or None when the folder has
    none; a CheckpointError names a file that cannot be read or parsed."""
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable tokenizer file ({e})") from None


def _hf_eos(d: Path, n: int) -> list:
    """The ids a Hugging Face model's ``generate`` stops on: ``generation_config.json``'s
    ``eos_token_id``, else ``config.json``'s (an int or a list), those below ``n`` (an id past
    the vocabulary is never generated); [] where neither names one. With GPT-2's vocabulary
    only 50256 was taken: a model whose generation config adds "." (13) ran on past it. (A
    ``generation_config.json`` that names none, or null, falls back to ``config.json``'s, as a
    folder's own tokenizer does here; transformers 5.25 stops on none then.)

    >>> import tempfile, json
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text(json.dumps({"eos_token_id": 13}))
    >>> _hf_eos(d, 50257), _hf_eos(Path(tempfile.mkdtemp()), 50257)
    ([13], [])
    """
    from ..tokenizer import _config_ids

    def read(name):
        try:
            return _tokenizer_file(d / name)
        except CheckpointError:     # unreadable: transformers goes on to config.json too
            return None
    return _config_ids("eos_token_id", [read("generation_config.json"), read("config.json")], n) or []


def _hf_prefix_space(d: Path) -> bool:
    """A Hugging Face GPT-2 tokenizer's ``add_prefix_space``, read as transformers reads it:
    a ``tokenizer_config.json`` whose ``tokenizer_class`` is GPT-2's passes its own setting on
    (False when it has none) over ``tokenizer.json``'s; another class (``PreTrainedTokenizerFast``)
    takes ``tokenizer.json``'s ByteLevel pre-tokenizer's; with no ``tokenizer_config.json``, or
    one that names no class, the class is GPT-2's (``config.json``'s model type), whose default
    is False. It was not read:
    such a folder's text got GPT-2's plain ids ("Hello" 15496 where HF gives " Hello" 18435)."""
    specs = {}
    for name in ("tokenizer_config.json", "tokenizer.json"):
        spec = _tokenizer_file(d / name)
        specs[name] = spec if isinstance(spec, dict) else None
    cfg, fast = specs["tokenizer_config.json"], specs["tokenizer.json"]
    if cfg is None:
        return False
    if fast is None or cfg.get("tokenizer_class") in (None, *HF_GPT2_CLASSES):   # none: GPT-2's
        return cfg.get("add_prefix_space") is True
    pre = fast.get("pre_tokenizer")
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    for p in steps:
        if isinstance(p, dict) and p.get("type") == "ByteLevel":
            return bool(p.get("add_prefix_space", False))
    return False


def _hf_added_tokens(d: Path) -> tuple:
    """``(added, roles)`` of a Hugging Face GPT-2 tokenizer: its added tokens as
    ``GPT2Tokenizer(added=...)`` takes them (``tokenizer.json``'s ``added_tokens``,
    ``tokenizer_config.json``'s ``added_tokens_decoder``, ``added_tokens.json``, with their
    ``lstrip``/``rstrip``/``single_word``/``special``), and the special-token roles
    (``pad_token`` ...) that name one of them. <|endoftext|> is left out (a literal one in a
    text stays text, as documented), and so is a token whose text is a GPT-2 token of another
    id (transformers does not use it). Before, added tokens were ignored."""
    from ..tokenizer import GPT2_EOT, GPT2Tokenizer, _role_text

    base = GPT2Tokenizer()._enc
    found: dict = {}

    def take(content, i, flags):
        if not (isinstance(content, str) and content and isinstance(i, int) and not isinstance(i, bool)) \
                or content == GPT2_EOT or i < 0:
            return
        try:
            own = base.encode_single_token(content.encode("utf-8"))
        except KeyError:
            own = None
        if own is not None and own != i:
            return
        if content in found:
            if found[content]["id"] != i:
                raise CheckpointError(f"{d}: the added token {content!r} has two ids ({found[content]['id']} and "
                                      f"{i}) in the tokenizer's files")
            return          # the first file's flags (tokenizer.json, what transformers loads)
        found[content] = {"id": i, **{f: bool(flags.get(f, False)) for f in ("lstrip", "rstrip", "single_word",
                                                                              "special")}}

    roles = {}
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
        spec = _tokenizer_file(d / name)
        if not isinstance(spec, dict):
            continue
        if name == "tokenizer.json":
            for t in spec.get("added_tokens") or []:
                if isinstance(t, dict):
                    take(t.get("content"), t.get("id"), t)
        elif name == "tokenizer_config.json":
            dec = spec.get("added_tokens_decoder") or {}
            if not isinstance(dec, dict):
                raise CheckpointError(f"{d / name}: added_tokens_decoder is a JSON "
                                      f"{type(dec).__name__}; expected an object of id -> token "
                                      f"(as transformers writes it)")
            for i, t in dec.items():
                if isinstance(t, dict) and str(i).isdecimal():     # "²".isdigit(), and int() fails
                    take(t.get("content"), int(i), t)
            for k, v in spec.items():   # an empty text is no added token: _role_text's None
                if k.endswith("_token") and (c := _role_text(v)) is not None:
                    roles[k] = c
                elif k in ("additional_special_tokens", "extra_special_tokens") and isinstance(v, list):
                    roles[k] = [c for c in map(_role_text, v) if c is not None]
        else:
            for content, i in spec.items():
                take(content, i, {})
    kept = {k: v for k, v in roles.items() if isinstance(v, str) and v in found}
    kept.update({k: [t for t in v if t in found] for k, v in roles.items() if isinstance(v, list)
                 and any(t in found for t in v)})
    return found, kept


def _not_gpt2_file(d: Path):
    """``(file, its parsed JSON)`` of the folder's tokenizer file (``tokenizer.json``, else
    ``vocab.json``: transformers' ``AutoTokenizer`` reads the first) that does not tokenize
    as GPT-2's, or None where it does (tokens added after GPT-2's 50257 allowed) or there is
    none: a GPT-2 model trained with another vocabulary (another language's BPE) read with
    GPT-2's tokenizer would give wrong text. A ``tokenizer.json`` of GPT-2's vocabulary whose
    pipeline adds to GPT-2's (``_gpt2_pipeline_differs``) is the folder's own too: it was read
    as GPT-2's, its lowercasing or its <|endoftext|> before every text left out in silence.

    >>> import tempfile, json, os
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "vocab.json"), "w").write('{"a": 0}')
    >>> _not_gpt2_file(Path(d))[0].name, _not_gpt2_file(Path(tempfile.mkdtemp()))
    ('vocab.json', None)
    """
    for name in ("tokenizer.json", "vocab.json"):
        f = d / name
        spec = _tokenizer_file(f)
        if spec is None:
            continue
        vocab = spec
        if name == "tokenizer.json":
            model = spec.get("model") if isinstance(spec, dict) else None
            vocab = model.get("vocab") if isinstance(model, dict) else None
        from ..tokenizer import gpt2_data_dir
        gpt2 = json.loads((gpt2_data_dir() / "encoder.json").read_text(encoding="utf-8"))
        ok = isinstance(vocab, dict) and all(vocab.get(t) == i for t, i in gpt2.items())
        if ok and name == "tokenizer.json":
            cfg = _tokenizer_file(d / "tokenizer_config.json")
            cls = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
            ok = _gpt2_pipeline_differs(spec, cls in (None, *HF_GPT2_CLASSES)) is None
        elif ok and (d / "merges.txt").is_file():
            # GPT-2's vocabulary with other merges (fewer, another order, garbage) is not GPT-2's
            # tokenizer: transformers reads the folder's merges (or refuses them)
            ok = [tuple(m.split(" ")) for m in _merge_lines(d / "merges.txt")] == _gpt2_merges()
        return None if ok else (f, spec)
    return None


def _merge_lines(f: Path) -> list:
    """The merges of a BPE merges file (``merges.txt``, GPT-2's ``vocab.bpe``): its lines but
    the ``#version`` one and blank ones; a CheckpointError names a file that cannot be read."""
    try:
        lines = f.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable tokenizer file ({e})") from None
    return [ln for ln in lines if ln.strip() and not ln.startswith("#version")]


@functools.lru_cache(maxsize=1)
def _gpt2_merges() -> list:
    """GPT-2's merges, as ``(left, right)`` pairs in order (read once)."""
    from ..tokenizer import gpt2_data_dir
    return [tuple(m.split(" ")) for m in _merge_lines(gpt2_data_dir() / "vocab.bpe")]


def _gpt2_pipeline_differs(spec: dict, gpt2_class: bool):
    """Why a ``tokenizer.json`` of GPT-2's vocabulary does not tokenize as GPT-2's does, or
    None where it does. ``gpt2_class``: the folder's ``tokenizer_class`` is GPT-2's (or none:
    a GPT-2 model's), whose transformers class builds GPT-2's normalizer, pre-tokenizer and
    decoder itself and keeps only the file's vocabulary, merges and post-processor (transformers
    5.25: a lowercasing normalizer is left out there, an <|endoftext|> before the text kept);
    another class (``PreTrainedTokenizerFast``) runs the whole file as written.

    >>> _gpt2_pipeline_differs({"model": {"type": "WordPiece"}}, True)
    'not a BPE model'
    """
    post = spec.get("post_processor")
    if isinstance(post, dict):
        if post.get("type") == "TemplateProcessing":
            if post.get("single") != [{"Sequence": {"id": "A", "type_id": 0}}]:
                return "a post-processor that adds tokens"
        elif post.get("type") != "ByteLevel":
            return f"post-processor {post.get('type')}"
    elif post is not None:
        return "post-processor"
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        return "not a BPE model"
    if (model.get("dropout") not in (None, 0, 0.0) or model.get("byte_fallback")
            or model.get("continuing_subword_prefix") not in (None, "")
            or model.get("end_of_word_suffix") not in (None, "")):
        return "BPE options"
    merges = model.get("merges")
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) if isinstance(m, list) else m
             for m in (merges if isinstance(merges, list) else [None])]
    if pairs != _gpt2_merges():
        return "merges"
    if gpt2_class:
        return None
    norm = spec.get("normalizer")
    if norm is not None:
        return f"normalizer {norm.get('type') if isinstance(norm, dict) else norm!r:.20}"
    pre = spec.get("pre_tokenizer")
    if not (isinstance(pre, dict) and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)):
        return "pre-tokenizer"
    dec = spec.get("decoder")
    if dec is not None and not (isinstance(dec, dict) and dec.get("type") == "ByteLevel"):
        return "decoder"
    return None


def _hf_own_tokenizer(d: Path, own: Path, own_json=None) -> dict:
    """The "hf" tokenizer dict of a folder whose vocabulary (in ``own``) is not GPT-2's: its
    ``tokenizer.json``, else its ``vocab.json`` + ``merges.txt`` as the byte-level BPE that
    transformers' GPT2Tokenizer builds of them; a CheckpointError says what is missing.
    ``own_json``: ``own`` parsed already (not read again).

    >>> import tempfile, os
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "vocab.json").write_text('{"a": 0}')
    >>> _hf_own_tokenizer(d, d / "vocab.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: .../vocab.json: this model's tokenizer is not GPT-2's (1 tokens, ...
    """
    from ..tokenizer import hf_tokenizer_spec

    def read(f: Path):
        return own_json if own_json is not None and f == own else _tokenizer_file(f)

    cfg = _tokenizer_file(d / "tokenizer_config.json")
    cfg = dict(cfg) if isinstance(cfg, dict) else {}
    if not isinstance(cfg.get("added_tokens_decoder"), dict):
        # transformers' legacy special_tokens_map.json (read where added_tokens_decoder is not)
        smap = _tokenizer_file(d / "special_tokens_map.json")
        cfg.update(smap if isinstance(smap, dict) else {})
    spec = read(d / "tokenizer.json")
    where = d / "tokenizer.json"
    if spec is None:
        vocab, merges = read(d / "vocab.json"), d / "merges.txt"
        cls = cfg.get("tokenizer_class")
        if not (isinstance(vocab, dict) and merges.is_file()) or cls not in (None, *HF_GPT2_CLASSES):
            n = len(vocab) if isinstance(vocab, (dict, list)) else "?"
            why = (f"no tokenizer.json to read it from, and its tokenizer_config.json names the "
                   f"class {cls!r:.40}: vocab.json and merges.txt are read as GPT-2's class only"
                   if isinstance(vocab, dict) and merges.is_file() else
                   "no tokenizer.json (nor a GPT-2 style merges.txt beside vocab.json) to read it from")
            raise CheckpointError(
                f"{own}: this model's tokenizer is not GPT-2's ({n} tokens, not GPT-2's ids for the same tokens), "
                f"and the folder has {why}; add the tokenizer files the model was trained with "
                f"(transformers writes them: AutoTokenizer.from_pretrained(...).save_pretrained(\"{d}\"))")
        lines = _merge_lines(merges)
        extra = _tokenizer_file(d / "added_tokens.json")
        added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": True, "special": False}
                 for c, i in (extra.items() if isinstance(extra, dict) else ()) if isinstance(i, int)]
        spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                "pre_tokenizer": None, "post_processor": None, "decoder": None,
                "model": {"type": "BPE", "vocab": vocab,
                          "merges": lines}}
        where = merges
    try:
        return hf_tokenizer_spec(spec, cfg, _tokenizer_file(d / "config.json"),
                                 _tokenizer_file(d / "generation_config.json"), where=str(where))
    except TokenizerError as e:
        raise CheckpointError(f"{d}: its own tokenizer (not GPT-2's) cannot be read: {e}") from None
