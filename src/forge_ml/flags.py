"""The switchboard: every ``FORGE_*`` environment switch, declared once and parsed once.

Each switch has a type (a set of named values, or a path), a default and a one-line meaning.
The environment is read the first time a switch is asked for (``forge-ml`` and a Trainer ask
for every one before any work: ``check_environment``), checked (a value outside the
switch's choices is a ConfigError that lists them), and kept: code on a hot path asks
``flags.get`` and pays a dict lookup. Tests and benchmarks change a switch for a block with
``flags.override``, never by writing ``os.environ``.

>>> from forge_ml import flags
>>> flags.get("FORGE_ATTENTION") in ("flash", "composed")
True
>>> with flags.override(FORGE_ATTENTION="composed"):
...     flags.get("FORGE_ATTENTION")
'composed'
>>> flags.get("FORGE_NOPE")
Traceback (most recent call last):
...
forge_ml.errors.ConfigError: unknown switch 'FORGE_NOPE'; known: FORGE_API_KEY, FORGE_ATTENTION, FORGE_BIAS_SUMS, FORGE_BLAS_TUNE, FORGE_CACHE_DIR, FORGE_CPU_GEMM, FORGE_CPU_KERNELS, FORGE_CPU_MALLOC, FORGE_CUBLASLT, FORGE_CUDA_GRAPH, FORGE_CUDA_LINEINFO, FORGE_FUSED_DECODE, FORGE_FUSED_LOSS, FORGE_GEMM_TUNE, FORGE_GEMV, FORGE_HOST_MEMORY_CHECK, FORGE_PDL, FORGE_TRAIN_GRAPH, FORGE_WGMMA_ATTENTION, FORGE_WGMMA_BWD_SHARED, FORGE_WGMMA_DKDV, FORGE_WGMMA_ROWS
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import ConfigError

_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """One ``FORGE_*`` switch: ``choices`` lists its values (None: any string, e.g. a path);
    ``aliases`` maps an older spelling to its value; ``meaning`` is the line the README shows.

    >>> sw = SWITCHES["FORGE_ATTENTION"]
    >>> sw.default, sw.choices, sw.aliases
    ('flash', ('flash', 'composed'), (('v1', 'composed'),))
    """

    name: str
    default: str
    meaning: str
    choices: Optional[tuple] = None
    aliases: tuple = ()

    def parse(self, raw: str) -> str:
        """The value ``raw`` (an environment string) names: 1/0, true/false, yes/no as on/off,
        an alias as its value; one outside ``choices`` is a ConfigError.

        >>> SWITCHES["FORGE_PDL"].parse(" Yes "), SWITCHES["FORGE_ATTENTION"].parse("V1")
        ('on', 'composed')
        >>> SWITCHES["FORGE_ATTENTION"].parse("fast")
        Traceback (most recent call last):
        ...
        forge_ml.errors.ConfigError: FORGE_ATTENTION='fast' is not one of flash|composed
        """
        v = raw.strip().lower() if self.choices is not None else raw.strip()
        if self.choices is None:
            return v
        if {"on", "off"} <= set(self.choices):   # 1/0, true/false, yes/no for every on/off switch
            if v in _ON:
                return "on"
            if v in _OFF:
                return "off"
        v = dict(self.aliases).get(v, v)
        if v not in self.choices:
            raise ConfigError(f"{self.name}={raw!r} is not one of {'|'.join(self.choices)}"
                              + (" (or 1/0)" if {"on", "off"} <= set(self.choices) else ""))
        return v


_SWITCHES = (
    Switch("FORGE_ATTENTION", "flash",
           "causal attention on the GPU: the fused flash kernels, or the composed path "
           "(cuBLAS products around a softmax)",
           ("flash", "composed"), aliases=(("v1", "composed"),)),
    Switch("FORGE_CUDA_GRAPH", "on",
           "replay the decoding step as a CUDA graph (off: op by op)", ("on", "off")),
    Switch("FORGE_TRAIN_GRAPH", "on",
           "run the trainer's whole step (forward, backward, clipping, AdamW) as one replayed "
           "CUDA graph (off: op by op)", ("on", "off")),
    Switch("FORGE_BIAS_SUMS", "on",
           "a linear layer's bias gradient summed by the backward that writes its output's "
           "whole gradient, as it writes it: the layernorm's, and the attention's for c_attn "
           "(off: by the layer's own weight-gradient pass, cuBLASLt's BGRADA epilogue on the "
           "GPU)",
           ("on", "off")),
    Switch("FORGE_FUSED_LOSS", "on",
           "the LM head and the training loss as one op over chunks of rows, the logits never "
           "kept whole (off: the logits, then cross_entropy)", ("on", "off")),
    Switch("FORGE_WGMMA_ATTENTION", "on",
           "causal bf16 attention without dropout on Hopper (compute capability 9.0) through "
           "flash_hopper.cu's wgmma kernels (off: flash_attention.cu's mma.sync kernels, which "
           "other GPUs and dropout always run)", ("on", "off")),
    Switch("FORGE_WGMMA_BWD_SHARED", "both",
           "the wgmma attention backward's kernels that read their block's own operands from "
           "shared memory (more blocks an SM, the same bits): dq's q and dout (qd), dk/dv's k "
           "and v (kv), both, or none (the register kernels)", ("none", "qd", "kv", "both")),
    Switch("FORGE_WGMMA_DKDV", "r128h",
           "keys a block of the wgmma attention's dk/dv kernel with k and v shared: 64 (one "
           "warpgroup), or 128 (r128h: two warpgroups on each q and dout tile, its scores in "
           "halves, two blocks an SM)", ("r64", "r128h")),
    Switch("FORGE_WGMMA_ROWS", "128",
           "query rows a block of the wgmma attention's forward and dq kernels: 128 runs two "
           "warpgroups on each k and v tile (half the k and v reads; the dq kernel with "
           "FORGE_WGMMA_BWD_SHARED qd or both)", ("64", "128")),
    Switch("FORGE_FUSED_DECODE", "layers",
           "GPT-2's decoding step for 1-4 rows on a GPU with thread-block clusters (Hopper): two "
           "CUDA kernels a layer and one for the head (layers, the default: about 2x the "
           "kernel-per-op step at one row in bf16 on an H100, 4,501 against 2,212 tok/s in one "
           "run), the kernel-per-op step (off), or the "
           "experimental whole step for one row as one kernel (on, not faster than off)",
           ("on", "off", "layers")),
    Switch("FORGE_GEMV", "on",
           "few-row products (decoding) on forge-ml's cluster gemv kernel on Hopper (off: cuBLAS)",
           ("on", "off")),
    Switch("FORGE_CUBLASLT", "on",
           "matrix products with a bias, GELU, a residual or the bias gradient fused into "
           "cuBLASLt's epilogue on the GPU (off: cuBLAS, then separate kernels)", ("on", "off")),
    Switch("FORGE_PDL", "on",
           "launch the decoding kernels with Hopper's programmatic dependent launch",
           ("on", "off")),
    Switch("FORGE_CUDA_LINEINFO", "off",
           "compile forge-ml's CUDA kernels with NVRTC's -lineinfo, so a profiler (Nsight "
           "Compute's source page) maps its samples to lines of the .cu files (on: for "
           "profiling only; the kernels are otherwise the same)", ("on", "off")),
    Switch("FORGE_GEMM_TUNE", "on",
           "on the GPU, each training-sized cuBLASLt product's algorithm (at least 4,096 "
           "rows and 2^33 multiply-adds) chosen by timing the heuristic's first 8 candidates "
           "once (kept in the cache folder's gemm/lt_algos.json, per GPU and CUDA version, so "
           "later runs and resumes take the same ones; off: the heuristic's first)",
           ("on", "off")),
    Switch("FORGE_BLAS_TUNE", "on",
           "on the CPU, forge-ml train picks its threads (kernels and products; half the "
           "cores or all of them) from its own step times (off: half the cores, as it starts)",
           ("on", "off")),
    Switch("FORGE_CPU_KERNELS", "auto",
           "CPU kernels: the fused C kernels if they build (auto), NumPy only (numpy), or the "
           "C kernels or an error (c)", ("auto", "numpy", "c")),
    Switch("FORGE_CPU_GEMM", "pool",
           "CPU float32 matrix products: on the C kernels' thread pool, a block of C each, by "
           "forge-ml's own kernel where the CPU has AVX-512 (blocks of 64 rows or more; else "
           "OpenBLAS) (pool), by one single-threaded OpenBLAS call per block (pool-openblas), or "
           "by OpenBLAS's own threads (openblas)",
           ("pool", "pool-openblas", "openblas")),
    Switch("FORGE_CPU_MALLOC", "tuned",
           "glibc malloc thresholds raised at CPU backend start-up so activations reuse freed "
           "memory (tuned), or left alone (default)", ("tuned", "default")),
    Switch("FORGE_HOST_MEMORY_CHECK", "on",
           "on the CPU, work whose estimated memory is more than the host has free is "
           "refused before it is allocated (on): forge-ml train's batch (before anything is "
           "written), serve's --slots, eval's --batch-size, prepare's text, generate's and "
           "beam search's batches, GPT2.init's config, a KV cache; or trusted (off)",
           ("on", "off")),
    Switch("FORGE_CACHE_DIR", "",
           "where built C kernels, sm_90a CUDA kernels and the tuned cuBLASLt algorithms "
           "(gemm/lt_algos.json) are kept (default: $XDG_CACHE_HOME/forge-ml, ~/.cache/forge-ml)"),
    Switch("FORGE_API_KEY", "",
           "the key `forge-ml serve` requires as `Authorization: Bearer KEY` (as --api-key)"),
)

SWITCHES = {s.name: s for s in _SWITCHES}
"""Name -> Switch, for every switch forge-ml reads."""

_lock = threading.Lock()
_values: dict = {}
_overrides: list = []   # stack of dicts, innermost last


def get(name: str) -> str:
    """The value of switch ``name`` (an override, else the environment's, else the default).

    >>> get("FORGE_CUDA_GRAPH") in ("on", "off")
    True
    """
    for layer in reversed(_overrides):
        if name in layer:
            return layer[name]
    v = _values.get(name)
    if v is None:
        sw = _switch(name)
        raw = os.environ.get(name)
        v = sw.default if raw is None or raw.strip() == "" else sw.parse(raw)
        with _lock:
            _values[name] = v
    return v


def given(name: str) -> bool:
    """Whether switch ``name`` is set at all: by an override, or in the environment even when
    empty (``get`` gives the default for both unset and empty; ``forge-ml serve`` refuses a
    ``FORGE_API_KEY`` set but empty, where an unset one means no key).

    >>> with override(FORGE_API_KEY=""):
    ...     given("FORGE_API_KEY")
    True
    """
    _switch(name)
    return any(name in layer for layer in _overrides) or name in os.environ


def check_environment(warn: bool = True) -> None:
    """Read and check every switch now: a value outside a switch's list is a ConfigError before
    any work starts, not when (or whether) a code path first asks for it. ``forge-ml`` calls
    it before running a command, a Trainer when it is made.

    A ``FORGE_*`` variable that is not a switch but nearly names one (``FORGE_CUDA_GRAPHS``)
    gets a RuntimeWarning naming the switch: a typo would otherwise change nothing, silently.
    Other ``FORGE_*`` names (another tool's) are left alone. ``warn=False``: no warning (the
    command line prints its own line from ``unreported_misspellings()``).

    >>> check_environment()
    """
    for name in SWITCHES:
        get(name)
    for name, near in unreported_misspellings() if warn else ():
        warnings.warn(f"{name} is not a forge-ml switch and is ignored; did you mean {near}?",
                      RuntimeWarning, stacklevel=2)


def unreported_misspellings() -> list:
    """``misspelled()``'s pairs not yet reported in this process, marked reported: each typo
    is said once, by the command line or by the first Trainer.

    >>> before, os.environ["FORGE_PDLL"] = set(_reported), "on"     # a typo of FORGE_PDL
    >>> try:
    ...     said = [unreported_misspellings() for _ in range(2)]
    ... finally:
    ...     del os.environ["FORGE_PDLL"]; _reported.intersection_update(before)
    >>> [("FORGE_PDLL", "FORGE_PDL") in pairs for pairs in said]
    [True, False]
    """
    with _lock:
        new = [(n, near) for n, near in misspelled() if n not in _reported]
        _reported.update(n for n, _ in new)
    return new


_reported: set = set()


def misspelled(environ=None) -> list:
    """``(variable, switch)`` for each ``FORGE_*`` variable set that is no switch but close to
    one (difflib's ratio >= 0.85).

    >>> misspelled({"FORGE_CUDA_GRAPHS": "off", "FORGE_EMAIL": "a@b", "FORGE_PDL": "on"})
    [('FORGE_CUDA_GRAPHS', 'FORGE_CUDA_GRAPH')]
    """
    import difflib
    environ = os.environ if environ is None else environ
    known = set(SWITCHES) | _OTHER_NAMES
    out = []
    for name in sorted(environ):
        if name.startswith("FORGE_") and name not in known:
            near = difflib.get_close_matches(name, sorted(SWITCHES), n=1, cutoff=0.85)
            if near:
                out.append((name, near[0]))
    return out


_OTHER_NAMES = frozenset({"FORGE_NVRTC"})   # read by scripts/nvrtc_check.py, not a switch


def on(name: str) -> bool:
    """Whether an on/off switch is on.

    >>> on("FORGE_PDL") in (True, False)
    True
    """
    return get(name) == "on"


def cache_root(sub: str):
    """The folder ``sub`` of forge-ml's build cache: ``$FORGE_CACHE_DIR/sub``, else
    ``$XDG_CACHE_HOME/forge-ml/sub`` (an absolute one: the XDG spec says to ignore a relative
    one), else ``~/.cache/forge-ml/sub`` (not created here), else, with no home folder,
    ``forge-ml-cache-<uid>`` in the temporary folder where it is this user's alone (see
    ``_private_temp_cache``). A leading ``~`` of FORGE_CACHE_DIR is the home folder (as in a
    shell, which does not expand it inside a .env file or a Dockerfile's ENV); a relative one
    is taken from the working folder.

    >>> cache_root("cpu").name
    'cpu'
    >>> with override(FORGE_CACHE_DIR="~/kernels"):
    ...     cache_root("cpu") == Path.home() / "kernels" / "cpu"
    True
    """
    root = get("FORGE_CACHE_DIR")
    if root:
        return Path(os.path.abspath(os.path.expanduser(root))) / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "forge-ml" / sub
    try:
        return Path.home() / ".cache" / "forge-ml" / sub
    except RuntimeError:   # no HOME and no passwd entry (a container's arbitrary uid, env -i)
        return _private_temp_cache() / sub


_process_cache: list = []


def _private_temp_cache() -> Path:
    """The cache with no home folder: ``forge-ml-cache-<uid>`` in the temporary folder, made
    ``0700`` here, used only while it is a folder of this user's that no one else may write
    (forge-ml loads the code it finds in its cache: a folder another user made first in a
    shared /tmp would let them plant a library). Otherwise a folder of this process's own,
    removed at exit, or where none can be made, a place no folder can be (under os.devnull:
    the builds then say to set FORGE_CACHE_DIR).

    >>> _private_temp_cache().name.startswith("forge-ml-cache-")
    True
    """
    import stat
    import tempfile
    if not hasattr(os, "getuid"):
        return Path(tempfile.gettempdir()) / "forge-ml-cache-user"
    uid = os.getuid()
    shared = Path(tempfile.gettempdir()) / f"forge-ml-cache-{uid}"
    try:
        shared.mkdir(mode=0o700, exist_ok=True)
        st = shared.lstat()                  # lstat: a link planted there is not followed
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
            return shared
    except OSError:
        pass
    if not _process_cache:
        import atexit
        import shutil
        try:
            own = tempfile.mkdtemp(prefix="forge-ml-cache-")
        except OSError:
            return Path(os.devnull) / "forge-ml-cache"
        atexit.register(shutil.rmtree, own, ignore_errors=True)
        _process_cache.append(Path(own))
    return _process_cache[0]


def _switch(name: str) -> Switch:
    sw = SWITCHES.get(name)
    if sw is None:
        raise ConfigError(f"unknown switch {name!r}; known: {', '.join(sorted(SWITCHES))}")
    return sw


@contextlib.contextmanager
def override(**values):
    """Set switches for the duration of a ``with`` block (tests, benchmarks).

    Values are checked like the environment's; booleans become on/off. None is an error
    (its text "None" would pass as a path or a key).

    >>> with override(FORGE_GEMV=False):
    ...     on("FORGE_GEMV")
    False
    """
    layer = {}
    for name, v in values.items():
        sw = _switch(name)
        if v is None:
            want = "|".join(sw.choices) if sw.choices else "a string"
            raise ConfigError(f"flags.override: {name}=None; expected {want}")
        if isinstance(v, bool):
            v = "on" if v else "off"
        layer[name] = sw.parse(str(v))
    _overrides.append(layer)
    try:
        yield
    finally:
        _overrides.remove(layer)


def table() -> str:
    """The switches as Markdown rows (``| name | values | default | meaning |``), the form
    the README's list takes (a test checks the two agree).

    >>> table().splitlines()[0].startswith("| `FORGE_ATTENTION`")
    True
    """
    rows = []
    for s in _SWITCHES:
        vals = " / ".join(s.choices) if s.choices else ("a path" if "DIR" in s.name else "a string")
        rows.append(f"| `{s.name}` | `{vals}` | `{s.default or '(unset)'}` | {s.meaning} |")
    return "\n".join(rows)
