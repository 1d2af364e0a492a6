"""Checkpoints: one directory holding ``model.safetensors`` and ``state.json``.

``model.safetensors`` holds every tensor of the run under one flat namespace:

- model parameters under their forge-ml names (``wte.weight``, ``h.0.attn.c_attn.weight``, ...),
- AdamW's first moments under ``opt.m.<name>`` and second moments under ``opt.v.<name>``
  (``OPT_M_PREFIX`` / ``OPT_V_PREFIX``; ``pack_tensors`` / ``unpack_tensors`` build and split
  such a dict).

``state.json`` is ``{"format": "forge-ml-checkpoint", "format_version": 1, "model_file":
{"name", "bytes", "sha256", "tensors"}, "meta": {...}}``, where ``meta`` is whatever the caller
saved (config, step, optimizer hyper-parameters, data loader state, RNG state, tokenizer dict)
and comes back unchanged from ``load_checkpoint``.

Saving is crash-safe: both files are written and fsynced into ``<dir>.tmp`` next to the
target, then the old checkpoint is renamed to ``<dir>.old``, the new one renamed to ``<dir>``,
and the old one deleted. A crash at any point leaves either the previous checkpoint or the
new one complete; if it struck between the two renames, ``load_checkpoint`` (and the next
``save_checkpoint``) picks up ``<dir>.old``.

>>> import tempfile, os, numpy as np
>>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> save_checkpoint(d, {"w": np.ones((2, 3), np.float32)}, {"step": 7})
>>> t, meta = load_checkpoint(d)
>>> t["w"].shape, meta["step"]
((2, 3), 7)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .errors import CheckpointError

FORMAT_NAME = "forge-ml-checkpoint"
FORMAT_VERSION = 1
KNOWN_VERSIONS = (1,)
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.json"
OPT_M_PREFIX = "opt.m."
OPT_V_PREFIX = "opt.v."

_ALLOWED_KINDS = "fiub"  # float, signed int, unsigned int, bool: what safetensors stores


# ---------------------------------------------------------------------------------------------
# Atomic directory replacement (also used by hf.save_hf_gpt2)


def _fsync_path(path: Path, directory: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to disk; a no-op where the OS cannot
    open directories (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _side_paths(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def _recover(path: Path) -> None:
    """If a save died between its two renames, ``<dir>`` is missing and ``<dir>.old`` is the
    last complete checkpoint: put it back."""
    _, old = _side_paths(path)
    if not path.exists() and old.is_dir():
        os.rename(old, path)


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` by the complete directory ``tmp``: old aside, new in, old deleted."""
    _, old = _side_paths(path)
    if old.exists():
        shutil.rmtree(old)  # stale: ``path`` exists (``_recover`` ran), so ``old`` is outdated
    had_old = path.exists()
    if had_old:
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if had_old and not path.exists():
            os.rename(old, path)
        raise
    _fsync_path(path.parent, directory=True)
    if had_old:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path):
    """Yield an empty temporary directory next to ``path``; when the block ends normally it
    replaces ``path`` as a whole (see the module docstring), and when it raises, ``path`` is
    left as it was and the temporary directory is removed.

    >>> import tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "out")
    >>> with atomic_directory(d) as tmp:
    ...     _ = (tmp / "a.txt").write_text("x")
    >>> sorted(os.listdir(d))
    ['a.txt']
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; expected a checkpoint directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    tmp, _ = _side_paths(path)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that crashed before its swap
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            _fsync_path(f)
        _fsync_path(tmp, directory=True)
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks.

    >>> import tempfile; p = tempfile.mktemp(); _ = open(p, "wb").write(b"abc")
    >>> sha256_file(p)[:16]
    'ba7816bf8f01cfea'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Tensor naming


def pack_tensors(params: dict, m: dict | None = None, v: dict | None = None) -> dict:
    """One flat dict: params by name, AdamW moments under ``opt.m.<name>`` / ``opt.v.<name>``.

    >>> sorted(pack_tensors({"w": 1}, {"w": 2}, {"w": 3}))
    ['opt.m.w', 'opt.v.w', 'w']
    """
    out = dict(params)
    for prefix, moments in ((OPT_M_PREFIX, m), (OPT_V_PREFIX, v)):
        for name, a in (moments or {}).items():
            out[prefix + name] = a
    return out


def unpack_tensors(tensors: dict) -> tuple[dict, dict, dict]:
    """Inverse of ``pack_tensors``: ``(params, m, v)``.

    >>> unpack_tensors({"w": 1, "opt.m.w": 2, "opt.v.w": 3})
    ({'w': 1}, {'w': 2}, {'w': 3})
    """
    params, m, v = {}, {}, {}
    for name, a in tensors.items():
        if name.startswith(OPT_M_PREFIX):
            m[name[len(OPT_M_PREFIX):]] = a
        elif name.startswith(OPT_V_PREFIX):
            v[name[len(OPT_V_PREFIX):]] = a
        else:
            params[name] = a
    return params, m, v


# ---------------------------------------------------------------------------------------------
# Save / load


def _check_tensors(tensors: dict) -> dict:
    if not isinstance(tensors, dict):
        raise CheckpointError(f"save_checkpoint: tensors must be a dict name -> np.ndarray, got {type(tensors).__name__}")
    out = {}
    for name, a in tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"save_checkpoint: tensor names must be str, got {name!r}")
        if not isinstance(a, np.ndarray):
            raise CheckpointError(
                f"save_checkpoint: {name} is a {type(a).__name__}; expected a NumPy array "
                f"(convert Tensors with .numpy())"
            )
        if a.dtype.kind not in _ALLOWED_KINDS:
            raise CheckpointError(f"save_checkpoint: {name} has dtype {a.dtype}; expected a float, int or bool array")
        out[name] = np.ascontiguousarray(a)
    return out


def save_checkpoint(dir, tensors: dict, meta: dict) -> None:
    """Write ``tensors`` (name -> NumPy array) and ``meta`` (JSON-able) as a checkpoint in
    ``dir``, replacing any previous one there atomically.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"w": np.zeros(3, np.float32)}, {"config": {"n_layer": 2}})
    >>> sorted(os.listdir(d))
    ['model.safetensors', 'state.json']
    """
    from safetensors.numpy import save_file

    arrays = _check_tensors(tensors)
    if not isinstance(meta, dict):
        raise CheckpointError(f"save_checkpoint: meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint: meta is not JSON-able: {e}") from None

    with atomic_directory(dir) as tmp:
        model_path = tmp / MODEL_FILE
        save_file(arrays, str(model_path), metadata={"format": "np", "forge_ml_format_version": str(FORMAT_VERSION)})
        state = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model_file": {
                "name": MODEL_FILE,
                "bytes": model_path.stat().st_size,
                "sha256": sha256_file(model_path),
                "tensors": len(arrays),
            },
            "meta": meta,
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")


def _resolve_dir(dir) -> Path:
    path = Path(dir)
    if path.is_dir():
        return path
    _, old = _side_paths(path)
    if old.is_dir() and (old / STATE_FILE).is_file():
        return old  # a save died between its renames; this is the last complete checkpoint
    if path.exists():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    raise CheckpointError(f"checkpoint not found: {path} does not exist")


def _require(d: dict, key: str, where: Path):
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{where}: missing key {key!r}; the file is damaged or not a forge-ml checkpoint")
    return d[key]


def load_checkpoint(dir) -> tuple[dict, dict]:
    """Read and verify a checkpoint; returns ``(tensors, meta)``.

    Every problem (missing file, bad JSON, unknown format version, truncated or altered
    ``model.safetensors``) raises a CheckpointError naming the file.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"opt.m.w": np.ones(2, np.float32)}, {"step": 3})
    >>> t, meta = load_checkpoint(d); list(t), meta
    (['opt.m.w'], {'step': 3})
    """
    from safetensors.numpy import load_file

    path = _resolve_dir(dir)
    state_path = path / STATE_FILE
    model_path = path / MODEL_FILE
    if not state_path.is_file():
        raise CheckpointError(f"{state_path} is missing; expected {STATE_FILE} and {MODEL_FILE} in {path}")
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{state_path}: not UTF-8 text ({e.reason} at byte {e.start}); the file is corrupted") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{state_path}: bad JSON at line {e.lineno} column {e.colno} ({e.msg}); "
            f"the file is truncated or corrupted"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a JSON object, got {type(state).__name__}")
    fmt = _require(state, "format", state_path)
    if fmt != FORMAT_NAME:
        raise CheckpointError(f"{state_path}: expected format {FORMAT_NAME!r}, got {fmt!r}")
    version = _require(state, "format_version", state_path)
    if version not in KNOWN_VERSIONS:
        raise CheckpointError(
            f"{state_path}: format version {version!r} is unknown; this forge-ml reads versions "
            f"{list(KNOWN_VERSIONS)} (a newer forge-ml wrote it?)"
        )
    info = _require(state, "model_file", state_path)
    want_bytes = _require(info, "bytes", state_path)
    want_sha = _require(info, "sha256", state_path)
    meta = _require(state, "meta", state_path)

    if not model_path.is_file():
        raise CheckpointError(f"{model_path} is missing; {state_path} expects it ({want_bytes} bytes)")
    size = model_path.stat().st_size
    if size != want_bytes:
        raise CheckpointError(
            f"{model_path}: {size} bytes, but {STATE_FILE} recorded {want_bytes}; the file is "
            f"{'truncated' if size < want_bytes else 'longer than written'}"
        )
    got_sha = sha256_file(model_path)
    if got_sha != want_sha:
        raise CheckpointError(
            f"{model_path}: sha256 mismatch: file hashes to {got_sha}, {STATE_FILE} recorded {want_sha}; "
            f"the file was altered or corrupted"
        )
    try:
        tensors = load_file(str(model_path))
    except Exception as e:  # safetensors raises its own SafetensorError and OSError/ValueError
        raise CheckpointError(f"{model_path}: cannot read safetensors: {e}") from None
    return tensors, meta


# ---------------------------------------------------------------------------------------------
# Architecture check


def _shape_of(x) -> tuple:
    return tuple(int(d) for d in (x.shape if hasattr(x, "shape") else x))


def check_architecture(expected_shapes: dict, tensors: dict, ignore_prefixes=(OPT_M_PREFIX, OPT_V_PREFIX)) -> None:
    """Raise a CheckpointError listing every missing, unexpected and mis-shaped parameter.

    ``expected_shapes`` maps names to shapes (tuples or arrays); ``tensors`` maps names to
    arrays (or shapes). Names starting with ``ignore_prefixes`` (optimizer moments) are skipped.

    >>> import numpy as np
    >>> check_architecture({"w": (2, 3)}, {"w": np.zeros((2, 3))})
    >>> check_architecture({"w": (2, 3)}, {"w": np.zeros((3, 2))})
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: checkpoint does not fit the model: 1 mismatched shape(s): w: checkpoint has (3, 2), model expects (2, 3)
    """
    have = {k: _shape_of(v) for k, v in tensors.items() if not k.startswith(tuple(ignore_prefixes))}
    want = {k: _shape_of(v) for k, v in expected_shapes.items()}
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    mismatched = [
        f"{k}: checkpoint has {have[k]}, model expects {want[k]}"
        for k in want if k in have and have[k] != want[k]
    ]

    def listing(items, limit=12):
        shown = ", ".join(items[:limit])
        return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} mismatched shape(s): {listing(mismatched, 8)}")
    if problems:
        raise CheckpointError("checkpoint does not fit the model: " + "; ".join(problems))
