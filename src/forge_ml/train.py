"""The training loop: data, model, AdamW, schedule, clipping, evaluation, samples, logs and
checkpoints that resume bit for bit.

``TrainConfig`` holds every knob (an unknown key is a ConfigError). ``Trainer`` prepares the
data (a text file, a folder of shards, or the standard library's own source when none is
given), builds, resumes or fine-tunes (``init_from``) the model and optimizer, and
``train()`` runs the loop:

- gradient accumulation: micro-batch gradients are summed with ``ops.add``; the 1/n that
  averages them and the clipping factor both ride in AdamW's ``grad_scale`` (no extra pass);
  ``batch_size="auto"`` (GPU) measures the largest micro-batch that fits;
- the warmup + cosine schedule of ``optim.cosine_lr``; global-norm clipping;
- dropout masks seeded from ``(seed, step, micro-step)``, batches from the loader's saved
  PCG64 state: so N steps equal N/2 steps, a checkpoint, a resume and N/2 more, bit for bit;
- an eval loss every ``eval_interval`` steps on the first ``eval_iters`` validation batches
  (an estimate, ``"val_kind": "sampled"`` in the log) and, at the end, on every window of the
  validation shards (``"val_kind": "full"``, what ``forge-ml eval`` computes), or on their
  first ``final_eval_windows`` windows when they hold more (``"val_kind": "capped"``, with
  ``val_windows`` and ``val_windows_total``: a large val set is not read whole); a sample every
  ``sample_interval``; a JSON-lines log (``log.jsonl``) of every step, ``loss.png`` at the
  end, and a checkpoint in ``<out_dir>/ckpt`` every ``checkpoint_interval`` steps and at the end;
- SIGINT (Ctrl-C) and SIGTERM are handled at step boundaries: the step in flight finishes
  (a second signal gives it up), a checkpoint of exactly that step is saved, and ``train()``
  raises ``Interrupted`` (the command exits 130 / 143); ``--resume`` then continues as if
  nothing had happened;
- a NaN or infinite loss or gradient norm stops the run with a TrainingError naming the step,
  the first op, layer and tensor that produced it (the step is re-run with a check after
  every op), and the last good checkpoint.

The run folder is the run's: a trainer holds ``<out_dir>/train.lock`` (flock, so a dead
trainer's lock is free again) and refuses a folder another trainer holds; a folder that holds
a run (a checkpoint, ``log.jsonl`` or ``data/``) is continued only with ``resume=True`` and
started over only with ``overwrite=True``. ``log.jsonl`` is an append-only record: a damaged
line is dropped with one warning, and the log never decides whether training can go on. A
file that cannot be written (full disk, read-only folder) stops the run with one line naming
it and the cause; the last good checkpoint is kept.

Mixed precision (``dtype="bf16"``, on a device with bf16 storage): AdamW keeps the float32
master weights and moments and puts bf16 compute copies in the model, which its fused update
rewrites (``AdamW(..., compute_dtype="bfloat16")``).

>>> import tempfile, os
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("hello world\\n" * 300)
>>> cfg = TrainConfig(data=p, out_dir=os.path.join(d, "run"), n_layer=1, n_head=2, n_embd=16,
...                   block_size=16, batch_size=4, max_steps=3, eval_interval=0, sample_interval=0,
...                   progress=False)
>>> summary = Trainer(cfg, log=None).train()
>>> summary["step"], summary["val_kind"], os.path.isdir(os.path.join(d, "run", "ckpt"))
(3, 'full', True)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import uuid
import io
import json
import numbers
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import flags
from . import blas as _blas
from .autograd import Tape  # noqa: F401 (forge_ml.train.Tape: tests and older scripts import it here)
from .checkpoint import (check_architecture, check_checkpoint_target, interrupted_swap,
                         is_checkpoint_dir, is_inside, load_checkpoint, pack_tensors, read_meta,
                         read_state, save_checkpoint, unpack_tensors)
from .data import (DataLoader, ShardFolder, default_corpus, encode_array, file_fingerprint, is_shard_file,
                   load_text, read_shard, shard_folder, split_windows, write_prepared)
from .diagnose import CheckingTape
from .device import Device
from .errors import (CLI_WORDS, CheckpointError, ConfigError, DataError, ForgeError, OutOfMemoryError,
                     KnownFields, ModelError, TokenizerError, TrainingError, host_available_bytes,
                     plural)
from .inference.generate import stream_tokens
from .inference.load import CKPT_NAME
from .models.gpt2 import GPT2, GPT2Config, PRESETS, param_shapes
from .optim import AdamW, accumulate, clip_grad_norm, cosine_lr
from .runs import (ENDING_SIGNALS, LOCK_NAME, RunError, RunLock, cannot_write,  # noqa: F401 (LOCK_NAME: the old import path)
                   give_back_signals, holds_run, read_log, remove_stray_temps, remove_together,
                   remove_trash, replace_file, run_log, stray_temps, take_signals, trainer_locked,
                   trash_folders)
from .step import TrainStep
from .tensor import device_has, device_numerics, release_cached, synchronize, tensor
from .tokenizer import load_tokenizer, prompt_ids, same_ids, tokenizer_from_dict

DATA_NAME = "data"          # <out_dir>/data: shards prepared from a text file
DATA_FILES = ("train.bin", "val.bin", "tokenizer.json")
CORPUS_NAME = "corpus.txt"  # <out_dir>/data/corpus.txt: the default corpus, as trained on
LOG_NAME = "log.jsonl"
# val_kind of the final evaluation: "full" (every window of the val shards) or "capped" (the
# first final_eval_windows of them; the periodic estimates are "sampled")
FINAL_VAL_KINDS = ("full", "capped")
PLOT_NAME = "loss.png"
BEST_NAME = "best"          # <out_dir>/best: with keep_best, the model of the lowest val loss
_PLOT_MARK = b"forge-ml train"   # the PNG text (Software) of the loss curves a run draws

# The model used when neither a preset nor sizes are given: nanoGPT's CPU configuration.
DEFAULT_SIZES = dict(n_layer=4, n_head=4, n_embd=128)
DEFAULT_BLOCK = 64   # the context without a preset or a source


class Interrupted(KeyboardInterrupt):
    """``Trainer.train()`` stopped on SIGINT, SIGTERM or SIGHUP at a step boundary, or
    ``Trainer()`` on SIGTERM or SIGHUP during its setup (``setup``, which words the message:
    what it wrote is taken back, as a Ctrl-C's KeyboardInterrupt there does). ``signum``, ``step`` (the step
    reached), ``saved`` (whether a checkpoint of that step was written), ``reason`` (why not,
    where saving it failed); ``exit_status`` is the shell's 128 + signal number (130, 143,
    129).

    >>> Interrupted(signal.SIGTERM, 7, True).exit_status
    143
    >>> str(Interrupted(signal.SIGTERM, 0, False, setup=True))
    'interrupted by SIGTERM during setup, before the first step'
    """

    def __init__(self, signum: int, step: int, saved: bool, setup: bool = False, reason: str = ""):
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name} during setup, before the first step" if setup
                         else f"interrupted by {name} at step {step}" + (f": {reason}" if reason else ""))
        self.signum, self.step, self.saved = int(signum), int(step), bool(saved)
        self.reason = reason

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@dataclass
class TrainConfig(KnownFields):
    """Every setting of a training run, with its default. Build from a dict with
    ``from_dict`` (an unknown key is a ConfigError).

    >>> TrainConfig(max_steps=10).lr
    0.001
    >>> TrainConfig.from_dict({"max_step": 10})
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: TrainConfig: unknown key 'max_step' (did you mean 'max_steps'?)
    >>> TrainConfig(batch_size=8, total_batch_size=32).grad_accum
    4
    """

    # data: a text file (prepared into <out_dir>/data), a folder holding train.bin, val.bin and
    # tokenizer.json (`forge-ml prepare`), a folder of llm.c shards (the sorted *train*.bin and
    # *val*.bin; GPT-2 token ids unless a tokenizer.json is beside them), or "" for
    # data.default_corpus() (the standard library's source)
    data: str = ""
    # how a text file is tokenized: "char" or "gpt2"; None: the init_from source's, a folder's own
    # (its tokenizer.json, else GPT-2 for llm.c shards), else char. The run records the one it used.
    tokenizer: Optional[str] = None
    val_fraction: float = 0.1
    corpus_bytes: int = 3_000_000    # size of the default corpus
    # fine-tuning: a forge-ml checkpoint (or run folder) or a Hugging Face GPT-2 folder whose
    # weights, architecture and tokenizer start a new run (fresh optimizer, step 0)
    init_from: str = ""
    # model: a preset of models.gpt2.PRESETS, or sizes (0 = the preset's, else DEFAULT_SIZES)
    model: str = ""
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    block_size: Optional[int] = None  # context; None: --init-from's source's, the preset's, else 64
    dropout: float = 0.0
    # where and how
    device: str = "cpu"
    dtype: str = "float32"           # "float32", or "bf16" (GPU mixed precision)
    # optimisation (defaults: nanoGPT's shakespeare_char scaled for a CPU)
    batch_size: int = 12             # sequences per micro-batch, or "auto" (GPU: the largest that fits)
    grad_accum: int = 1
    total_batch_size: int = 0        # sequences per optimizer step (0: batch_size x grad_accum);
                                     # sets grad_accum = total_batch_size / batch_size
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: Optional[float] = None   # where the cosine ends; None: lr / 10 (nanoGPT's rule)
    warmup: int = 100
    lr_decay_steps: int = 0          # where the cosine reaches min_lr; 0 = max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99              # nanoGPT's choice for small char models (GPT-2 used 0.95)
    grad_clip: float = 1.0           # max global norm; 0 disables
    # monitoring
    eval_interval: int = 250         # 0 disables periodic eval (the final one still runs)
    eval_iters: int = 20
    # the final evaluation covers every window of the val shards when they hold at most this
    # many windows of block_size, else only the first this many ("val_kind": "capped"); 0: all
    final_eval_windows: int = 10_000
    sample_interval: int = 250       # 0 disables samples during training
    sample_tokens: int = 200
    sample_prompt: str = ""
    sample_temperature: float = 0.8
    log_interval: int = 10
    progress: bool = True            # a tqdm bar on a terminal
    # run
    seed: int = 1337
    out_dir: str = "runs/default"
    checkpoint_interval: int = 500   # 0: only at the end
    keep_best: bool = False          # also keep the model of the lowest val loss in <out_dir>/best

    def __post_init__(self):
        for name in ("min_lr", "block_size"):   # worked out from others before (dataclasses.replace
            if isinstance(getattr(self, name), (_DerivedFloat, _DerivedInt)):   # passes it on): again
                setattr(self, name, None)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, f.type, getattr(self, f.name)))
        auto = self.batch_size == "auto"
        if self.min_lr is None:
            self.min_lr = _DerivedFloat(self.lr / 10)
        if self.block_size is None and not self.init_from:   # a source's is read when it loads
            self.block_size = _DerivedInt(PRESETS.get(self.model, {}).get("block_size", DEFAULT_BLOCK))
        w = _field_word        # a field as forge-ml train's flag on the command line, else its name
        checks = [
            (auto or self.batch_size >= 1, f"{w('batch_size')} must be >= 1 (or 'auto' on a GPU)"),
            (self.block_size is None or self.block_size >= 1, f"{w('block_size')} must be >= 1"),
            (self.grad_accum >= 1, f"{w('grad_accum')} must be >= 1, got {self.grad_accum}"),
            (self.total_batch_size >= 0, f"{w('total_batch_size')} must be >= 0, got {self.total_batch_size}"),
            (self.max_steps >= 0, f"{w('max_steps')} must be >= 0, got {self.max_steps}"),
            # lr first: a min_lr not given is lr / 10, and an error about it named what was not typed
            (0 <= self.lr < math.inf, f"{w('lr')} must be a finite number >= 0, got {self.lr}"),
            (0 <= self.min_lr < math.inf, f"{w('min_lr')} must be a finite number >= 0, got {self.min_lr}"),
            (self.min_lr <= self.lr,
             f"{w('min_lr')} {self.min_lr} is above {w('lr')} {self.lr}: the cosine would raise the rate as it "
             f"goes; give a {w('min_lr')} <= {w('lr')} (or leave it out: {w('lr')} / 10)"),
            (self.warmup >= 0, f"{w('warmup')} must be >= 0, got {self.warmup}"),
            (self.lr_decay_steps >= 0, f"{w('lr_decay_steps')} must be >= 0, got {self.lr_decay_steps}"),
            (0.0 <= self.dropout < 1.0 and np.float32(self.dropout) < 1.0,   # (the kernels')
             f"{w('dropout')} must be in [0, 1) (as a float32), got {self.dropout}"),
            (0.0 < self.val_fraction < 1.0,
             f"{w('val_fraction')} must be in (0, 1), got {self.val_fraction}"),
            (0.0 <= self.beta1 < 1.0, f"{w('beta1')} must be in [0, 1), got {self.beta1}"),
            (0.0 <= self.beta2 < 1.0, f"{w('beta2')} must be in [0, 1), got {self.beta2}"),
            (0 <= self.weight_decay < math.inf,
             f"{w('weight_decay')} must be a finite number >= 0, got {self.weight_decay}"),
            (0 <= self.grad_clip < math.inf, f"{w('grad_clip')} must be a finite number >= 0, got {self.grad_clip}"),
            # 64 bits, as dropout_seed, rng.seed_key and generate keep (2**64 was seed 0's dropout)
            (0 <= self.seed < 1 << 64, f"{w('seed')} must be in [0, 2**64), got {self.seed}"),
            (bool(str(self.out_dir).strip()), f"{w('out_dir')} is empty ({self.out_dir!r}); give the run folder"),
            (self.corpus_bytes >= 1, f"{w('corpus_bytes')} must be >= 1, got {self.corpus_bytes}"),
            (self.eval_iters >= 1, f"{w('eval_iters')} must be >= 1 (the val batches of each estimate), "
                                   f"got {self.eval_iters}"),
            (self.final_eval_windows >= 0, f"{w('final_eval_windows')} must be >= 0 (0: every window)"),
            (self.sample_temperature >= 0 and math.isfinite(self.sample_temperature),
             f"{w('sample_temperature')} must be a number >= 0 (0 is greedy), got {self.sample_temperature}"),
            *((getattr(self, k) >= 0, f"{w(k)} must be >= 0{zero}, got {getattr(self, k)}")
              for k, zero in (("eval_interval", " (0: only the final evaluation)"),
                              ("sample_interval", " (0: no samples)"), ("checkpoint_interval", " (0: only at the end)"),
                              ("sample_tokens", ""), ("log_interval", " (0: only the first step's line)"),
                              *((k, " (0: the preset's or the default)") for k in _SIZES))),
            # "hf": recorded by a run whose --init-from folder has its own Hugging Face tokenizer
            (self.tokenizer in (None, "char", "gpt2", "hf"),
             f"{w('tokenizer')} must be 'char' or 'gpt2', got {self.tokenizer!r}"),
            (self.dtype in ("float32", "bf16", "bfloat16"),
             f"{w('dtype')} must be 'float32' or 'bf16', got {self.dtype!r}"),
            (self.model == "" or self.model in PRESETS,
             f"unknown model preset {self.model!r}; expected one of {', '.join(PRESETS)}"),
        ]
        where = "" if CLI_WORDS.get() else "TrainConfig: "
        for ok, msg in checks:
            if not ok:
                raise ConfigError(where + msg)
        if self.total_batch_size and not auto:
            accum, rest = divmod(self.total_batch_size, self.batch_size)
            if rest or accum < 1:
                raise ConfigError(f"{where}{w('total_batch_size')} {self.total_batch_size} is not a multiple "
                                  f"of {w('batch_size')} {self.batch_size}")
            if self.grad_accum not in (1, accum):
                raise ConfigError(f"{where}{w('grad_accum')} {self.grad_accum} x {w('batch_size')} {self.batch_size} "
                                  f"is not {w('total_batch_size')} {self.total_batch_size}; give one of "
                                  f"{w('grad_accum')} and {w('total_batch_size')}")
            self.grad_accum = accum

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Build from a dict; an unknown key is a ConfigError naming the nearest known key.

        >>> TrainConfig.from_dict({"lr": 3e-4}).lr
        0.0003
        """
        return cls(**d)   # (an unknown key: __new__'s ConfigError)

    def to_dict(self) -> dict:
        """All settings as a JSON-able dict (what checkpoints store).

        >>> TrainConfig().to_dict()["batch_size"]
        12
        """
        return dataclasses.asdict(self)

    @property
    def decay_steps(self) -> int:
        """Where the cosine reaches ``min_lr``: ``lr_decay_steps``, or ``max_steps`` when 0."""
        return self.lr_decay_steps or self.max_steps

    def model_sizes(self) -> dict:
        """``n_layer``, ``n_head``, ``n_embd`` after the preset and defaults are applied.

        >>> TrainConfig(model="gpt2-medium", n_layer=2).model_sizes()
        {'n_layer': 2, 'n_head': 16, 'n_embd': 1024}
        """
        base = dict(DEFAULT_SIZES)
        if self.model:
            base.update({k: v for k, v in PRESETS[self.model].items() if k in base})
        for k in base:
            if getattr(self, k):
                base[k] = getattr(self, k)
        return base


class _DerivedFloat(float):
    """A TrainConfig value worked out from others (``min_lr``: lr / 10), not given: a copy made
    with ``dataclasses.replace(cfg, lr=...)`` works it out again, as ``TrainConfig(lr=...)`` does.

    >>> c = dataclasses.replace(TrainConfig(), lr=3e-4, model="gpt2")
    >>> round(c.min_lr, 12), c.block_size
    (3e-05, 1024)
    """


class _DerivedInt(int):
    """``block_size`` worked out from the preset (see ``_DerivedFloat``)."""


def _coerce(name, typ, value):
    """Check a TrainConfig value against its annotated type (ints are accepted as floats;
    ``batch_size`` also takes "auto")."""
    typ = typ if isinstance(typ, str) else typ.__name__
    if typ.startswith("Optional["):          # None stands for a default worked out from others
        if value is None:
            return None
        typ = typ[len("Optional["):-1]
    if name == "batch_size" and value == "auto":
        return "auto"
    if typ == "bool":
        if isinstance(value, bool):
            return value
    elif typ == "int":
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
    elif typ == "float":
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return float(value)
    elif typ == "str":
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    raise ConfigError(f"TrainConfig: {name} must be {typ}" + (" or 'auto'" if name == "batch_size" else "")
                      + f", got {value!r}")


def dropout_seed(seed: int, step: int, micro: int) -> int:
    """The dropout seed of micro-step ``micro`` of 0-based step ``step``: splitmix64 applied
    in turn to the run seed, the step and the micro-step. A pure function, so a resumed run
    draws the masks the uninterrupted one would have drawn.

    >>> dropout_seed(1, 0, 0) == dropout_seed(1, 0, 0) != dropout_seed(1, 0, 1)
    True
    """
    mask = (1 << 64) - 1
    z = 0
    for word in (seed, step, micro):
        z = ((z ^ (int(word) & mask)) + 0x9E3779B97F4A7C15) & mask   # splitmix64 (Steele et al. 2014)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
    return z


def search_batch_size(trial: Callable[[int], None], total: int = 0, limit: int = 4096) -> int:
    """The largest micro-batch ``b`` for which ``trial(b)`` runs without OutOfMemoryError,
    measured: ``trial`` at 1, 2, 4, ... until a size fails (or ``total`` / ``limit`` is
    reached), then between the last size that ran and the first that failed, by bisection.
    With ``total`` > 0 only divisors of ``total`` are tried, so that ``total / b``
    micro-batches make exactly the asked global batch. Raises OutOfMemoryError when not even
    one sequence fits.

    >>> def trial(b):                 # a device that holds 37 sequences
    ...     if b > 37:
    ...         raise OutOfMemoryError(f"{b} sequences do not fit")
    >>> search_batch_size(trial), search_batch_size(trial, total=48), search_batch_size(trial, total=32)
    (37, 24, 32)
    """
    cands = [b for b in range(1, (total or limit) + 1) if not total or total % b == 0]  # ascending

    def fits(i: int) -> bool:
        try:
            trial(cands[i])
            return True
        except OutOfMemoryError:
            return False

    lo, hi, want = -1, len(cands), 1
    while True:  # doubling
        i = next((j for j, b in enumerate(cands) if b >= want), len(cands) - 1)
        if i <= lo:
            break
        if not fits(i):
            hi = i
            break
        lo, want = i, 2 * cands[i]
    if lo < 0:
        raise OutOfMemoryError(f"batch size auto: not even one sequence fits ({hi} sizes tried)")
    while hi - lo > 1:  # back off: bisect between the last fit and the first failure
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return cands[lo]


def host_step_bytes(config: GPT2Config, batch_size: int, block_size: int,
                    logits_chunk_bytes: int = 1 << 26) -> int:
    """About the bytes a float32 training step on the CPU holds at its peak: per token, the
    activations the tape keeps (about 14 x n_embd floats a layer and 6 x n_embd outside
    them); one chunk of the LM head's logits and their gradient (the CPU's
    ``linear_cross_entropy`` never holds more: ``logits_chunk_bytes``, its
    ``LCE_CHUNK_BYTES``, which a test holds equal); per parameter, its
    value, gradient and AdamW's two moments. Fitted to the peak RSS of ``forge-ml train`` on
    the CPU backend (2026-12-07), where the tokens dominate: 2 layers x 32 channels x 640K
    tokens and 4 x 128 x 128K, within 3% of it; it overstates small steps (a 4,096-token
    step of 512 channels by about 0.1 GB) and leaves out the process's own ~0.15 GB.

    >>> cfg = GPT2Config(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
    >>> round(host_step_bytes(cfg, 20000, 32) / 2 ** 30, 2)
    2.72
    """
    c, v, tokens = config.n_embd, config.padded_vocab_size, batch_size * block_size
    activations = 4 * tokens * (14 * config.n_layer * c + 6 * c)
    logits = 2 * min(4 * tokens * v, logits_chunk_bytes)
    params = config.n_layer * 12 * c * c + (v + config.block_size) * c
    return activations + logits + 16 * params


# ---------------------------------------------------------------------------------------------
# The trainer


def _is_number(v) -> bool:
    """A recorded setting that is a number (a damaged state.json's "abc" is not noted)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Errors speak forge-ml train's flags where the command line runs (errors.CLI_WORDS), else
# the library's names (TrainConfig's fields, Trainer's arguments), which a notebook user typed.
_FLAG_WORDS = {"--resume": "resume=True", "--overwrite": "overwrite=True"}
TRAIN_FLAGS = {"out_dir": "--out"}   # forge-ml train's flags named otherwise than their field


def train_flag(name: str) -> str:
    """forge-ml train's flag for the TrainConfig field ``name``.

    >>> train_flag("n_layer"), train_flag("out_dir")
    ('--n-layer', '--out')
    """
    return TRAIN_FLAGS.get(name, "--" + name.replace("_", "-"))


_SIZES = ("n_layer", "n_head", "n_embd")
_FLAG = re.compile(r"(?<![\w./~-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?: (?=[^\s]*[\d./~_A-Z])[^\s,;:)]+)?")


def library_words(msg: str) -> str:
    """``msg`` (an error written in forge-ml train's flags) in the library's names: each flag
    that is a TrainConfig field becomes the field (``field=VALUE`` where a value follows that
    is a number, a path or a placeholder), ``--resume`` and ``--overwrite`` Trainer's
    arguments, ``--out`` ``out_dir``; a flag inside a quoted command (``forge-ml train ...``)
    and any other flag stay as they are.

    >>> library_words("add --resume to go on, or --overwrite; drop --init-from (forge-ml train --resume)")
    'add resume=True to go on, or overwrite=True; drop init_from (forge-ml train --resume)'
    >>> library_words("start from it with --init-from runs/a --out NEW_FOLDER, or a --lr 3e-4: so")
    'start from it with init_from=runs/a out_dir=NEW_FOLDER, or a lr=3e-4: so'
    >>> library_words("text file not found: r/--data/x.txt")   # a path is no flag
    'text file not found: r/--data/x.txt'
    """
    fields = _config_fields()

    def word(m):
        before = msg[:m.start()]
        cmd = before.rfind("forge-ml ")
        if cmd >= 0 and not any(c in before[cmd:] for c in ");"):
            return m.group(0)          # part of a command line the message quotes
        flag, _, value = m.group(0).partition(" ")
        name = flag[2:].replace("-", "_")
        if flag in _FLAG_WORDS and not value:
            return _FLAG_WORDS[flag]
        name = next((f for f, fl in TRAIN_FLAGS.items() if fl == flag), name)
        if name not in fields:
            return m.group(0)
        return f"{name}={value}" if value else name

    return _FLAG.sub(word, msg)


def _field_word(name: str) -> str:
    """A TrainConfig field as errors name it: forge-ml train's flag where the command line
    runs (``CLI_WORDS``), else the field's own name.

    >>> _field_word("log_interval")
    'log_interval'
    """
    return train_flag(name) if CLI_WORDS.get() else name


@functools.lru_cache(maxsize=None)
def _config_fields() -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(TrainConfig))


def _library_errors(fn):
    """``fn``'s ForgeErrors in the library's names unless the command line runs it
    (``CLI_WORDS``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ForgeError as e:
            if not CLI_WORDS.get() and e.args and isinstance(e.args[0], str):
                e.args = (library_words(e.args[0]),) + e.args[1:]
            raise
    return wrapper


class Trainer:
    """Builds (or resumes) a run from a ``TrainConfig`` and trains it with ``train()``.

    ``resume=True`` restores weights, moments, schedule position, step, data position and the
    dropout stream from ``<out_dir>/ckpt``. Without it, a folder that already holds a run (a
    checkpoint, ``log.jsonl`` or ``data/``) is refused before anything is written, unless
    ``overwrite=True`` asks to start over (the run's own files are then replaced). The folder
    is locked (``RunLock``) from here until ``train()`` returns or ``close()``. ``log``: where
    text lines go (``print`` by default; None for silence).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
    >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8,
    ...                         max_steps=2, progress=False), log=None)
    >>> t.model.config.vocab_size, t.step
    (3, 0)
    >>> t.close()
    """

    _saves_after_error = True   # an error in the loop saves the steps since the last checkpoint

    @_library_errors
    def __init__(self, config: TrainConfig, resume: bool = False, log: Optional[Callable] = print,
                 overwrite: bool = False):
        if isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        if not isinstance(config, TrainConfig):   # (None gave 'NoneType' has no attribute 'device')
            raise ConfigError(f"Trainer: config must be a TrainConfig or a dict of its fields "
                              f"(a JSON file: TrainConfig.from_dict(json.load(f))), got {type(config).__name__}")
        # a copy, checked again: a field set after the config was built (tc.lr = 1e-5) is
        # checked as one given to it, and what was worked out from others (min_lr: lr / 10)
        # is worked out again; the trainer's own settings stay off the caller's object
        cfg = self.cfg = dataclasses.replace(config)
        flags.check_environment()   # a bad FORGE_* value fails here, not after the run
        for name, v in (("resume", resume), ("overwrite", overwrite)):
            # (overwrite="False", a string from a YAML file or the environment, removed the run)
            if not isinstance(v, (bool, np.bool_)):
                raise ConfigError(f"Trainer: {name} must be True or False, got {type(v).__name__} "
                                  f"{v!r:.40}")
        resume, overwrite = bool(resume), bool(overwrite)
        if log is not None and not callable(log):   # before data/ is written, not after
            raise ConfigError(f"Trainer: log must be a function of one line (print, a list's "
                              f"append) or None, got {type(log).__name__} {log!r:.40}")
        self._log = log
        self._bar = None
        self._stop: Optional[int] = None   # the signal that asked to stop
        self._phase: Optional[str] = None  # "step", "extra" (eval, sample) or "update"
        self.device = Device.parse(cfg.device)
        has_bf16 = device_has(self.device, "bf16")   # loads the backend: before any write
        self._numerics = device_numerics(self.device)   # recorded in checkpoints; a resume compares
        self.bf16 = cfg.dtype in ("bf16", "bfloat16")
        if self.bf16 and not has_bf16:
            raise ConfigError(f"dtype bf16 is mixed precision on a device with bf16 storage; the "
                              f"{self.device.type} backend computes in float32 (use --device cuda)")
        if resume and overwrite:
            raise ConfigError("resume continues the run in the folder and overwrite starts it over; ask for one")
        if cfg.batch_size == "auto":
            if device_has(self.device, "host_memory"):
                raise ConfigError(f"batch size auto measures the free memory of a GPU; on {self.device} "
                                  f"give a number (e.g. --batch-size 12)")
            if resume:
                raise ConfigError("a resumed run keeps the batch size it was started with; drop --batch-size auto")
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / CKPT_NAME
        self.best_dir = self.out_dir / BEST_NAME
        self.best_val: Optional[float] = None   # keep_best: the val loss of the model in best_dir
        # keep_best on resume: (step, val loss) of a best/ kept after the checkpoint (a stop
        # between the two saves), a model of steps the run trains again; None once replaced
        self._orphan_best: Optional[tuple] = None
        self.log_path = self.out_dir / LOG_NAME
        self.step = 0
        self.elapsed = 0.0          # training seconds before this process (from the checkpoint)
        self.last_ckpt_step = None
        self.losses: list = []        # the per-step training losses of this object's train() calls
        self._unlogged: list = []   # log records a failed write did not land, and where the log
        self._log_end: Optional[int] = None  # ended before it (``_write_log``)
        self.val_loss: Optional[float] = None
        self.val_kind: Optional[str] = None
        self._fast = None           # the captured step (step.TrainStep) on a graph-capable device
        self._staged = None         # (loader state, batches) drawn for the next captured step
        self._eval_due = False      # resumed at an eval step whose evaluation a signal cut short
        self._torn = False          # an error cut an optimizer update short: no checkpoint after it
        self._save_failed = False   # the last save raised (the after-error save does not retry it)
        self._pipe_closed = False   # stdout's reader went away (_say)
        self.tokens_sha256 = None   # their digest (tokens_digest), recorded in the checkpoints
        # the text file the run was prepared from: {"path", "size", "sha256"} (file_fingerprint),
        # recorded in the checkpoints; a resume says when the file has changed since
        self.data_file: Optional[dict] = None
        self.run_id = None          # the run's identity, kept across resumes (its best/ is its own)
        self._said_eager = False
        self._prepared = None       # what the lock made, once the setup prepared data/
        nest = _enclosing_run(self.out_dir)
        if nest is not None:   # before the folder is made: that run replaces its ckpt/ as it saves
            raise RunError(f"--out {cfg.out_dir} is inside the run in {nest[0]} (its {nest[1]}/ folder, which "
                           f"that run writes and replaces); choose a folder outside it")
        self.lock = RunLock(self.out_dir)
        self._trainer_was_here = trainer_locked(self.out_dir)   # (before this one's lock)
        # SIGTERM and SIGHUP (where they would end the process) do here what a Ctrl-C does:
        # they raise, and what the setup wrote (the shards' temporary files, the lock, the
        # folder it made) is taken back; a kill left them, the lock file too
        old = take_signals(self._on_setup_signal, ENDING_SIGNALS, default_only=True)
        try:
            self.lock.acquire()
            try:
                self._setup(resume, overwrite)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):   # (Interrupted too)
                    self._take_back_data()
                self.lock.release(undo=True)
                raise
            self.lock._made = []  # the folder is the run's now
        finally:
            give_back_signals(old)
        self._ckpt_seen = _ckpt_id(self.ckpt_dir)   # the checkpoint as this object knows it

    def close(self) -> None:
        """Release the run folder (``train()`` does when it returns)."""
        self.lock.release()

    def _take_back_data(self) -> None:
        """A stop during the setup, after it prepared ``data/``: those files go (all or none),
        and the lock file and folders made for them with the lock's undo, so the same command
        starts the run again (data/ and the lock left behind made it refused as a run stopped
        before its first checkpoint). A second stop as they go leaves them, with the lock."""
        if self._prepared is None:
            return
        d = self.out_dir / DATA_NAME
        try:
            remove_together(self.out_dir, dirs=[(d, DATA_FILES + (CORPUS_NAME,))])
        except BaseException:   # (a second Ctrl-C, an OSError: the files are put back)
            return
        self.lock._made, self._prepared = self._prepared, None

    def _hold_folder(self) -> None:
        """Take the run folder again (train() or save() after it was released), refusing when
        it has moved on meanwhile: an older Trainer object, run again in a notebook after a
        newer one trained the run further, rolled its checkpoint back and logged its steps
        twice."""
        if self.lock.held:
            return
        self.lock.acquire()
        now = _ckpt_id(self.ckpt_dir)
        if now != self._ckpt_seen:
            self.lock.release()
            where = (f"its checkpoint is now at step {now[1]}" if now is not None
                     else "its checkpoint is gone")
            raise RunError(f"the run in {self.out_dir} has moved on since this Trainer last held it "
                           f"({where}; this Trainer is at step {self.step}); make a new one with "
                           f"resume=True (forge-ml train --resume)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- setup ----------------------------------------------------------------------------
    def _setup(self, resume: bool, overwrite: bool) -> None:
        """Everything is checked before the first write: the folder, the checkpoint, the data
        and tokenizer, the prompt and the architecture."""
        cfg = self.cfg
        ckpt = source = None
        held = []
        self._check_in_the_way()
        if resume:
            if (not (self.ckpt_dir / "state.json").is_file()
                    and interrupted_swap(self.ckpt_dir) is None):
                raise CheckpointError(no_checkpoint(self.out_dir, self._run_files()))
            ckpt = load_checkpoint(self.ckpt_dir)
            meta = ckpt[1]
            if "optimizer" not in meta or "data" not in meta or "step" not in meta:
                raise RunError(f"{self.ckpt_dir} holds a model only (no optimizer state or data position, as "
                               f"`forge-ml convert` writes), so there is no run to resume; start a new run "
                               f"from it with --init-from {self.ckpt_dir} --out NEW_FOLDER")
            for key in ("optimizer", "data", "rng", "tokenizer", "train_config", "config"):
                if key in meta and not isinstance(meta[key], dict) and (
                        meta[key] is not None or key in ("optimizer", "data", "config")):
                    raise CheckpointError(f"{self.ckpt_dir}/state.json: meta.{key} is "
                                          f"{meta[key]!r:.40}; expected an object: the file was "
                                          f"altered or damaged")
            tc = meta.get("train_config") or {}   # the run's settings as recorded
            was_src = tc.get("init_from") or ""
            if cfg.init_from and not _same_path(str(cfg.init_from), str(was_src)):
                # the checkpoint's weights go on; another source would only be recorded
                raise ConfigError(f"--init-from {cfg.init_from}: the run in {self.out_dir} "
                                  + (f"fine-tunes {was_src}" if was_src else "was not started from a model")
                                  + ", which a resumed run keeps; drop --init-from")
            step = meta["step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise CheckpointError(f"{self.ckpt_dir / 'state.json'}: step must be an integer >= 0, got "
                                      f"{step!r:.40}; the file was altered or damaged")
            if isinstance(cfg.max_steps, int) and cfg.max_steps < step:
                raise ConfigError(f"--max-steps {cfg.max_steps}: the run in {self.out_dir} is at step {step} "
                                  f"already; give --max-steps {step + 1} or more to train on (eval and sample "
                                  f"read its checkpoint as it is)")
            was_b = meta["data"].get("batch_size") if isinstance(meta["data"], dict) else None
            if isinstance(was_b, int) and isinstance(cfg.batch_size, int) and cfg.batch_size != was_b:
                raise ConfigError(f"--batch-size {cfg.batch_size}: the run in {self.out_dir} draws batches of "
                                  f"{was_b} sequences, and its data position counts them; a resumed run keeps "
                                  f"--batch-size {was_b} (--grad-accum changes the batch of a step)")
            if cfg.block_size is None:   # an init_from run resumed: the context it was trained with
                was = tc.get("block_size")
                cfg.block_size = was if isinstance(was, int) and was >= 1 else \
                    (meta.get("config") or {}).get("block_size", DEFAULT_BLOCK)
            was_t = meta["data"].get("block_size") if isinstance(meta["data"], dict) else None
            if isinstance(was_t, int) and was_t != cfg.block_size:   # before any write, as the batch's
                raise ConfigError(f"--block-size {cfg.block_size}: the run in {self.out_dir} was trained on windows "
                                  f"of {was_t} tokens, which a resumed run keeps (its data position counts them); "
                                  f"drop --block-size")
            was = tc.get("tokenizer")
            if cfg.tokenizer is None:
                cfg.tokenizer = was
            if was and was != cfg.tokenizer and not (cfg.data and Path(cfg.data).is_dir()):
                raise ConfigError(f"the run in {self.out_dir} was trained with the {was} tokenizer; a resumed "
                                  f"run keeps it (drop --tokenizer {cfg.tokenizer}, or start a new run elsewhere)")
            was = tc.get("data", "")
            own = all((self.out_dir / DATA_NAME / f).is_file() for f in DATA_FILES)
            if not own and cfg.data and cfg.data == was and not os.path.exists(cfg.data):
                # the run's own --data, named relative to the folder it was started from
                data_dir = meta.get("data_dir")
                if isinstance(data_dir, str) and _is_shard_folder(data_dir):
                    cfg.data = data_dir
                else:
                    raise DataError(f"cannot resume: the run in {self.out_dir} was trained on --data {was}, which "
                                    f"is not found from {os.getcwd()}" + (f" (nor at {data_dir})" if data_dir else "")
                                    + "; give its place with --data PATH")
            if own and cfg.data and not Path(cfg.data).is_dir() and not self._same_text(cfg.data, was):
                raise ConfigError(f"the run in {self.out_dir} was trained on {was or 'the default corpus'}, whose "
                                  f"tokens in {self.out_dir / DATA_NAME} a resumed run keeps; drop --data "
                                  f"{cfg.data}, or train on the new text in a new run: --init-from "
                                  f"{self.out_dir} --data {cfg.data} --out NEW_FOLDER")
            # the split the run made (and the default corpus's size) are in its data folder: a
            # resume keeps them, so another value would only be recorded, falsely (the CLI
            # refused it; a library resume took it in silence)
            keys = []
            if own and not (cfg.data and Path(cfg.data).is_dir()):   # a shard folder has no split
                keys.append(("val_fraction", "split its tokens with"))
                if (self.out_dir / DATA_NAME / CORPUS_NAME).is_file():   # the default corpus: its size
                    keys.append(("corpus_bytes", "was trained on a default corpus of"))
            for key, did in keys:
                was, now = tc.get(key), getattr(cfg, key)
                if was is not None and was != now:
                    flag = train_flag(key)
                    raise ConfigError(f"{flag} {now}: the run in {self.out_dir} {did} {flag} {was}, whose "
                                      f"tokens {self.out_dir / DATA_NAME} holds, which a resumed run keeps; "
                                      f"give {flag} {was} (other tokens: a new run, --init-from "
                                      f"{self.out_dir} --out NEW_FOLDER)")
        else:
            held = self._run_files()
            if held and not overwrite:
                if CKPT_NAME + "/" not in held:   # stopped before its first checkpoint: --resume
                    # then refused it ("no checkpoint"): a way that was none
                    raise RunError(f"{self.out_dir} holds a run stopped before its first checkpoint "
                                   f"({', '.join(held)}), so there is nothing to resume; add --overwrite to "
                                   f"start it over (which replaces it), or choose another --out")
                raise RunError(f"{self.out_dir} holds a run ({', '.join(held)}); add --resume to continue it "
                               f"or --overwrite to start over (which replaces it)")
            if cfg.init_from and overwrite and self._cleared_by_overwrite(cfg.init_from):
                # --overwrite removes the folder's run (ckpt/, best/) before the source is read
                # again, and a stop after the removal left no model at all
                raise ConfigError(f"--init-from {cfg.init_from} is in the run folder that --overwrite clears "
                                  f"(--out {cfg.out_dir}), so it would remove the model it starts from; copy "
                                  f"the model elsewhere first and --init-from the copy, or pick another --out")
            if cfg.init_from:
                source = self._load_source()

        # -- data and tokenizer (nothing written yet) ---------------------------------------
        ckpt_tok = None
        if ckpt is not None and isinstance(ckpt[1].get("tokenizer"), dict):
            try:   # a resume that prepares the text again tokenizes it as the run did
                ckpt_tok = tokenizer_from_dict(ckpt[1]["tokenizer"])
            except TokenizerError as e:
                raise CheckpointError(f"{self.ckpt_dir}: its tokenizer cannot be read: {e}") from None
        self.shards, self.tokenizer, write_data, tokens = self._plan_data(resume, source, ckpt_tok)
        self.data_dir = self.shards.folder
        cfg.tokenizer = self.tokenizer.kind   # recorded in the checkpoint: what the run trains with
        if ckpt is not None and write_data is None:
            self._check_same_shards(ckpt[1])
        self._check_same_tokens(ckpt[1] if ckpt is not None else None, tokens)
        self._check_text_file(ckpt[1] if ckpt is not None else None)
        if cfg.sample_prompt:
            try:
                self.tokenizer.encode(cfg.sample_prompt)
            except TokenizerError as e:
                raise ConfigError(f"--sample-prompt {cfg.sample_prompt!r} cannot be encoded: {e}") from None
        want = self._architecture(ckpt, source)
        self._check_host_memory(want)
        # the checkpoint's place (a file or a user's folder at ckpt, or in the way at ckpt.tmp
        # or ckpt.old) is refused now, not at the first save after training to it
        check_checkpoint_target(self.ckpt_dir)
        self.run_id = (ckpt[1].get("run_id") if ckpt is not None else None) or uuid.uuid4().hex
        if cfg.keep_best:
            # best/ is replaced only when it is this run's (a training checkpoint copied there,
            # or another run's best, was replaced, or taken as this run's lowest val loss)
            check_checkpoint_target(self.best_dir, "forge-ml-model")
            if is_checkpoint_dir(self.best_dir, "forge-ml-model"):
                theirs = read_meta(self.best_dir)   # the meta alone, not the weights
                # --overwrite starts over from a keep_best model (a run id) of the run it
                # replaces, and removes it (it refused every run that had kept one)
                earlier = overwrite and not resume and self._kept_here(theirs)
                if not earlier and (not resume or theirs.get("run_id") != self.run_id):
                    raise RunError(f"{self.best_dir} holds a model that this run did not keep (another run's "
                                   f"best, copied here?); --keep-best writes this run's there: move it "
                                   f"away or choose another --out")
                if resume:
                    self.best_val = self._best_before(theirs, ckpt[1].get("step"))
        if resume:
            self._check_best_reached(step)
        self._check_plot_target(held=resume or bool(held))   # (--overwrite: only forge-ml's plot)

        # -- from here on, files are written ------------------------------------------------------
        # what a kill midway through a write left (.log.jsonl.XXXXXXXX.tmp, the plot's, the
        # shards'): the run's own scratch, never read
        remove_stray_temps(self.out_dir, (LOG_NAME, PLOT_NAME))
        remove_stray_temps(self.out_dir / DATA_NAME, DATA_FILES + (CORPUS_NAME,))
        if not resume:   # what an --overwrite stopped as it removed the earlier run left (no run)
            remove_trash(self.out_dir)
        if not resume and overwrite:
            self._clear_run()
        if write_data is not None:
            made = self.lock._made
            prepared = write_data()
            # a stop (Ctrl-C, SIGTERM) before a new run's setup ends takes this data back, with
            # the lock file and folder made for it (_take_back_data): the same command starts again
            self._prepared = None if resume else made
            self.lock._made = []   # a trainer's data: its lock file stays after an error
            self._say(prepared)

        # -- model and optimizer ------------------------------------------------------------
        if ckpt is not None:
            self.model = self._restore_model(ckpt, want)
        elif source is not None:
            self.model = GPT2(want, dict(source[0].params))
        else:
            self.model = GPT2.init(want, seed=cfg.seed, device=self.device)
        # bf16: the optimizer keeps the float32 masters and gives the model bf16 compute copies
        self.opt = AdamW(self.model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         weight_decay=cfg.weight_decay,
                         compute_dtype="bfloat16" if self.bf16 else None)
        if cfg.batch_size == "auto":
            self._auto_batch_size()
        B, T = cfg.batch_size, cfg.block_size
        self.shard_names = self.shards.fingerprint()   # as the loaders see them (checkpoints record it)
        self.train_loader = DataLoader(self.shards.train, B, T, seed=cfg.seed)
        self.val_loader = DataLoader(self.shards.val, B, T, seed=cfg.seed)
        if ckpt is not None:
            self._restore_state(ckpt)

    def _check_in_the_way(self) -> None:
        """A folder at the log's place, or a file at data/'s (where a text is prepared), is
        refused before any write: the write failed after --overwrite had removed the earlier
        run (a bare EEXIST, or --resume advising the --overwrite that failed the same way)."""
        log, data = self.log_path, self.out_dir / DATA_NAME
        if (log.exists() or log.is_symlink()) and not log.is_file():
            what = "a folder" if log.is_dir() else "not a regular file"
            raise RunError(f"{log} is {what}, where the run writes its log (a file); move it away or "
                           f"choose another --out")
        prepares = not (self.cfg.data and Path(self.cfg.data).is_dir())
        if prepares and (data.exists() or data.is_symlink()) and not data.is_dir():
            what = "a file" if data.is_file() else "not a folder"
            raise RunError(f"{data} is {what}, where the run keeps the data it prepares (a folder); move it "
                           f"away or choose another --out")

    def _check_plot_target(self, held: bool) -> None:
        """A ``loss.png`` that forge-ml did not draw (its PNG text says so) is a user's file:
        refused rather than replaced at the end of the run or removed by --overwrite; ``held``:
        a run's folder, where a plot with matplotlib's text alone (an older forge-ml's) counts
        as the run's."""
        path = self.out_dir / PLOT_NAME
        if not (path.exists() or path.is_symlink()):
            return
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        # (beside a run, a plot with matplotlib's own text: a curve an older forge-ml drew)
        ours = _PLOT_MARK in head or (held and b"Matplotlib" in head)
        if not ours:
            raise RunError(f"{path} is not a loss curve that forge-ml drew, and a run draws its own there; "
                           f"move it away or choose another --out")

    def _same_text(self, data: str, was: str) -> bool:
        """Whether the text file ``data`` is the text the run in the folder was prepared from:
        the path it recorded, or a file whose tokens are those of its shards."""
        if _same_path(data, was):
            return True
        d = self.out_dir / DATA_NAME
        try:
            ids = encode_array(self._read_tokenizer(d), load_text(data))
            train, val = read_shard(d / "train.bin"), read_shard(d / "val.bin")
        except (ForgeError, OSError):
            return False
        return len(ids) == len(train) + len(val) and np.array_equal(ids, np.concatenate([train, val]))

    def _run_files(self) -> list:
        """What of a run the folder holds: ``ckpt/``, ``log.jsonl``, ``data/``."""
        out = self.out_dir
        held = []
        ck = [out / CKPT_NAME, interrupted_swap(out / CKPT_NAME)]
        if any(p is not None and (is_checkpoint_dir(p) or p.is_dir()
                                  and (p / "state.json").exists()) for p in ck):
            held.append(CKPT_NAME + "/")     # (a user's file or folder there is refused as such)
        if is_checkpoint_dir(out / BEST_NAME, "forge-ml-model"):
            held.append(BEST_NAME + "/")
        if self.log_path.exists() or self.log_path.is_symlink():
            # a user's file: never a run's, never removed (a run's log torn by a full disk or a
            # kill still has the run's checkpoint or a trainer's lock beside it)
            if not (run_log(self.log_path) or held or self._trainer_was_here):
                raise RunError(f"{self.log_path} is not a log that forge-ml wrote (its first line is no "
                               f"step's record), and a run writes its own there; move it away or choose "
                               f"another --out")
            held.append(LOG_NAME)
        d = out / DATA_NAME
        given = self.cfg.data and Path(self.cfg.data).is_dir() and Path(self.cfg.data).resolve() == d.resolve()
        # (what a killed write left, .train.bin.XXXXXXXX.tmp, is no run's data)
        if d.is_dir() and not given and set(d.iterdir()) - set(stray_temps(d, DATA_FILES + (CORPUS_NAME,))):
            if not held and not self._trainer_was_here:
                # shards with no run beside them and no trainer ever here: a user's prepared
                # data (forge-ml prepare --out there), which --overwrite removed
                raise RunError(f"{d} holds data and {out} no run (no checkpoint, log or trainer's lock); "
                               f"train on it with --data {d}, or move it away or choose another --out")
            held.append(DATA_NAME + "/")
        return held

    def _kept_here(self, meta: Optional[dict] = None) -> bool:
        """Whether best/ (its ``meta``, else read) holds a model that keep_best kept for a run
        in this folder: a run id, and this folder as its source or the run id of the folder's
        checkpoint (a folder moved as a whole). A conversion written there has no run id;
        another run's best moved here names its own folder and run."""
        if meta is None:
            if not is_checkpoint_dir(self.out_dir / BEST_NAME, "forge-ml-model"):
                return False
            meta = read_meta(self.out_dir / BEST_NAME)
        if not (isinstance(meta, dict) and meta.get("run_id")):
            return False
        if meta.get("source") == str(self.out_dir.resolve()):
            return True
        ckpt = read_meta(self.out_dir / CKPT_NAME)
        return ckpt is not None and ckpt.get("run_id") == meta["run_id"]

    def _best_before(self, best_meta: dict, step) -> Optional[float]:
        """The lowest val loss a resumed run goes on from: best/'s, unless best/ was kept at a
        step after the checkpoint (a stop between that save and the step's checkpoint), which
        the run trains again: then the lowest the log marks up to the checkpoint (with best/'s,
        the replayed step did not beat it, and the log lost its "best" mark)."""
        was = best_meta.get("val_loss")
        at = best_meta.get("step")
        if not (isinstance(at, int) and isinstance(step, int) and at > step):
            return float(was) if isinstance(was, (int, float)) else None
        records, _ = read_log(self.log_path) if self.log_path.is_file() else ([], 0)
        kept = [r["val_loss"] for r in records if r.get("best") and isinstance(r.get("step"), int)
                and r["step"] <= step and isinstance(r.get("val_loss"), (int, float))]
        return float(min(kept)) if kept else None

    def _check_best_reached(self, step: int) -> None:
        """A resume from the checkpoint of ``step`` that ends (max_steps) before the step of the
        run's best/, kept after that checkpoint (a kill between the two saves), is refused: the
        run would not train that step again, and best/ would stay a model of abandoned steps,
        or be replaced by an earlier step's in silence. One the run trains past is noted
        (``_orphan_best``), to be said if none of its estimates replaces it."""
        meta = read_meta(self.best_dir) if is_checkpoint_dir(self.best_dir, "forge-ml-model") else None
        at = meta.get("step") if meta and meta.get("run_id") == self.run_id else None
        if isinstance(at, bool) or not isinstance(at, int) or at <= step:
            return
        if at <= self.cfg.max_steps:
            was = meta.get("val_loss")
            if self.cfg.keep_best and isinstance(was, (int, float)):
                self._orphan_best = (at, float(was))
            return
        loss = meta.get("val_loss")
        loss = f", val loss {loss:.4f}" if isinstance(loss, float) else ""
        raise ConfigError(f"--max-steps {self.cfg.max_steps}: {self.best_dir} holds the model of step {at}{loss}, "
                          f"kept by --keep-best after the run's last checkpoint (step {step}); a resumed run that "
                          f"ends at step {self.cfg.max_steps} never trains step {at} again, so that model would "
                          f"be from steps the run gave up. Resume with --max-steps {at} or more, or move "
                          f"{self.best_dir} away (a model of its own) to end the run at step {self.cfg.max_steps}")

    def _cleared_names(self) -> list:
        """The checkpoint folders of this run folder that --overwrite removes (``_clear_run``)."""
        names = [CKPT_NAME, CKPT_NAME + ".old", CKPT_NAME + ".tmp"]
        if self._kept_here():     # keep_best's in this folder, never a user's "best" or another run's
            names += [BEST_NAME, BEST_NAME + ".old", BEST_NAME + ".tmp"]
        return names

    def _cleared_by_overwrite(self, path) -> bool:
        """Whether the model ``path`` names (a run folder: its ckpt/) is one --overwrite removes;
        a model of the user's own elsewhere in the folder is not."""
        from .inference.load import resolve_checkpoint
        try:
            ckpt = resolve_checkpoint(path)
        except ForgeError:      # no model there: _load_source says so
            ckpt = Path(path)
        return any(is_inside(ckpt, self.out_dir / n) for n in self._cleared_names())

    def _clear_run(self) -> None:
        """--overwrite: remove the files an earlier run wrote (only those), all or none
        (``remove_together``: a Ctrl-C as they go leaves the earlier run whole)."""
        from .checkpoint import MODEL_FILE, STATE_FILE
        out = self.out_dir
        targets = [(out / n, (MODEL_FILE, STATE_FILE)) for n in self._cleared_names()]
        given = self.cfg.data and Path(self.cfg.data).is_dir() and Path(self.cfg.data).resolve() == (out / DATA_NAME).resolve()
        if not given:
            targets.append((out / DATA_NAME, DATA_FILES + (CORPUS_NAME,)))
        try:
            removed = remove_together(out, [self.log_path, out / PLOT_NAME], targets)
        except OSError as e:
            raise RunError(cannot_write(e.filename or out, e)) from None
        if removed:   # (a folder that held no run: nothing to say)
            self._say(f"--overwrite: removed the earlier run's checkpoint, log and data in {out}")

    def _load_source(self):
        """``(model, tokenizer, meta)`` of ``init_from``, with the sizes asked checked against it."""
        from .inference.load import check_tokenizer_fits, load_model
        cfg = self.cfg
        model, tok, meta = load_model(cfg.init_from, device=self.device)
        check_tokenizer_fits(model, tok, f"--init-from {cfg.init_from}")  # before any data is prepared
        from .diagnose import nonfinite_params
        n_bad, listed = nonfinite_params(model.params)
        if n_bad:   # (the first step's loss was NaN, and its advice was a lower --lr)
            raise ModelError(f"--init-from {cfg.init_from}: {n_bad} of its {len(model.params)} "
                             f"weight tensors hold NaN or inf ({listed}); a fine-tune would start "
                             f"from them (weights of a run that diverged, or a damaged file?)")
        src = model.config
        given = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd") if getattr(cfg, k)}
        asked = dict(given)
        if cfg.model:
            asked = dict({k: v for k, v in PRESETS[cfg.model].items() if k in DEFAULT_SIZES}, **given)
        for k, v in asked.items():
            if v != getattr(src, k):
                drop = [train_flag(k)] if k in given else []
                drop += ["--model"] if cfg.model else []
                raise ConfigError(f"--init-from {cfg.init_from} has {k} {getattr(src, k)}, but {v} was asked"
                                  + (f" (by --model {cfg.model})" if k not in given else "")
                                  + f"; the architecture comes from the source (drop {' and '.join(drop)})")
        if cfg.block_size is None:   # not given: the source's own context
            cfg.block_size = src.block_size
        elif cfg.block_size > src.block_size:  # windows longer than the source's context cannot be trained on
            self._say(f"note: block_size {cfg.block_size} is longer than the {src.block_size}-token context of "
                      f"{cfg.init_from}; training on windows of {src.block_size} tokens")
            cfg.block_size = src.block_size
        # recorded in the checkpoint, so that --resume rebuilds the same run
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.model = src.n_layer, src.n_head, src.n_embd, ""
        if cfg.tokenizer not in (None, tok.kind):
            raise ConfigError(f"--tokenizer {cfg.tokenizer}: --init-from {cfg.init_from} has a {tok.kind} tokenizer, "
                              f"which a fine-tune keeps (its embeddings are its tokens'); drop --tokenizer")
        cfg.tokenizer = tok.kind
        self._say(f"init from {cfg.init_from}: {_arch(src)}, {tok.kind} tokenizer; fresh optimizer, step 0")
        return model, tok, meta

    def _read_tokenizer(self, d: Path):
        p = d / "tokenizer.json"
        try:
            return tokenizer_from_dict(json.loads(p.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{p}: not a tokenizer file ({e}); prepare the data again") from None

    def _check_shards(self, sf: ShardFolder, tok) -> tuple:
        """Every shard of ``sf`` has a good header (``read_shard``) and a window of ``block_size``
        tokens, and its val shards and first train shard hold only ids of ``tok``; returns the
        train and val token counts.

        Only the first train shard's ids are checked: the largest id of every shard means
        reading all of them, 20 GB for llm.c's fineweb10B (100 shards of 100M tokens), minutes
        before the first step; shards made with another tokenizer show in their first shard."""
        counts = {}
        for which in ("train", "val"):
            counts[which] = 0
            for p in getattr(sf, which):
                n = len(read_shard(p))
                self._check_length(n, f"token shard {p}")
                counts[which] += n
        whose = f"{sf.tokenizer.name}" if sf.tokenizer is not None else "GPT-2's tokenizer"
        for p in sf.val + sf.train[:1]:
            ids_max = int(np.max(read_shard(p), initial=0))
            if ids_max >= tok.vocab_size:
                raise DataError(f"{p} holds token {ids_max} but the tokenizer ({whose}) has "
                                f"{tok.vocab_size} {plural(tok.vocab_size, 'id')}; the shards and {whose} disagree")
        return counts["train"], counts["val"]

    def _folder_tokenizer(self, sf: ShardFolder, src_tok, resume: bool = False):
        """The tokenizer of the shards in ``sf``: its tokenizer.json, else (llm.c's shards)
        GPT-2's; ``src_tok``: --init-from's, which must be the same, as must a tokenizer asked
        for a new run (a resumed one's is the one it recorded: before the tokenizer was worked
        out from the data, a run on a GPT-2 folder recorded the default, char)."""
        cfg, d = self.cfg, sf.folder
        if sf.tokenizer is not None:
            tok = self._read_tokenizer(d)
            if src_tok is None and not resume and cfg.tokenizer not in (None, tok.kind):
                raise ConfigError(f"--tokenizer {cfg.tokenizer}: data folder {d} holds token ids of its own "
                                  f"tokenizer ({sf.tokenizer}: {tok.kind}), which the run trains with; drop "
                                  f"--tokenizer, or give the text file to tokenize it with {cfg.tokenizer}")
            if src_tok is not None and not same_ids(tok.to_dict(), src_tok.to_dict()):
                raise DataError(f"{d}/tokenizer.json is not the tokenizer of --init-from {cfg.init_from} "
                                f"({src_tok.kind}); give a text file, which is tokenized with the source's tokenizer")
            return tok
        # no tokenizer.json: token shards as llm.c writes them, of GPT-2 ids
        if src_tok is not None:
            if src_tok.kind != "gpt2":
                raise DataError(f"data folder {d} has no tokenizer.json, so its shards are read as GPT-2 token ids "
                                f"(llm.c's), but --init-from {cfg.init_from} has a {src_tok.kind} tokenizer; "
                                f"give a text file, which is tokenized with the source's tokenizer")
            return src_tok
        if cfg.tokenizer == "char":
            raise ConfigError(f"--tokenizer char: data folder {d} holds token shards and no tokenizer.json, and a "
                              f"char tokenizer cannot be guessed from token ids; drop --tokenizer (shards without "
                              f"a tokenizer.json are read as GPT-2 ids, as llm.c writes them), or prepare a "
                              f"char run's shards with `forge-ml prepare TEXT --out FOLDER`")
        named = sorted(p.name for p in sf.train + sf.val if p.name in DATA_FILES)
        if named and cfg.tokenizer != "gpt2":
            raise DataError(f"data folder {d} lacks tokenizer.json beside {', '.join(named)}; expected the output "
                            f"of `forge-ml prepare TEXT --out {d}` (or give a text file); if the shards hold "
                            f"GPT-2 token ids, add --tokenizer gpt2")
        return load_tokenizer("gpt2")

    def _check_same_shards(self, meta: dict) -> None:
        """A resumed run sees the shards the checkpoint's run was trained on: the same file names
        and sizes (its data position indexes them)."""
        was = meta.get("shards")
        if not isinstance(was, dict):
            return   # a checkpoint from before shards were recorded: the loader's token count is checked
        now = self.shards.fingerprint()
        diffs = []
        for which in ("train", "val"):
            old = {n: z for n, z in was.get(which, [])}
            new = {n: z for n, z in now[which]}
            gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            resized = [f"{n} ({old[n]:,} -> {new[n]:,} bytes)" for n in sorted(set(old) & set(new)) if old[n] != new[n]]
            for what, names in (("missing", gone), ("new", added), ("changed size", resized)):
                if names:
                    more = f", ... ({len(names)})" if len(names) > 4 else ""
                    diffs.append(f"{which} shards {what}: {', '.join(names[:4])}{more}")
        if diffs:
            raise DataError(f"cannot resume: the shards in {self.data_dir} are not those the run in {self.out_dir} "
                            f"was trained on ({'; '.join(diffs)}); a resumed run must see the same shards to go on "
                            f"exactly. Put them back as they were, or start a new run from this one: --init-from "
                            f"{self.out_dir} --data {self.data_dir} --out NEW_FOLDER")

    def _check_same_tokens(self, meta: Optional[dict], tokens: Optional[tuple]) -> None:
        """The digest of the run's tokens (a text the trainer prepared, or a shard folder of at
        most DIGEST_MAX_BYTES; None for a larger one, whose shards' names and sizes are checked):
        recorded in the checkpoints, and on a resume compared with the run's, so that shards
        prepared again (from an edited text, the same length) or replaced (``prepare --force``)
        are refused rather than trained on."""
        self.tokens_sha256 = None if tokens is None else tokens_digest(*tokens)
        was = None if meta is None else meta.get("tokens_sha256")
        if not isinstance(was, str) or self.tokens_sha256 is None or was == self.tokens_sha256:
            return
        raise DataError(f"cannot resume: the tokens in {self.data_dir} are not those the run in {self.out_dir} was "
                        f"trained on (their digest differs; the text was edited, or the folder prepared again "
                        f"from another text); a resumed run must see the same tokens to go on exactly. Put the "
                        f"text or {self.data_dir} back as they were, or start a new run from this one: "
                        f"--init-from {self.out_dir} --data TEXT --out NEW_FOLDER")

    def _check_text_file(self, meta: Optional[dict]) -> None:
        """The fingerprint of the text file a run is prepared from (``data_file``): taken when
        the run starts, carried on by its resumes; a resume whose text file (the same path, or
        the --data given) is no longer the bytes recorded is warned about, as it trains on the
        tokens prepared then. A run that recorded none (an older forge-ml's) is not checked."""
        cfg = self.cfg
        text = bool(cfg.data) and Path(cfg.data).is_file()
        if meta is None:   # a new run: the text it prepares now
            if text:
                try:
                    self.data_file = {"path": str(cfg.data), **file_fingerprint(cfg.data)}
                except OSError:   # (it was read a moment ago: the run goes on, unrecorded)
                    self.data_file = None
            return
        was = meta.get("data_file")
        if not (isinstance(was, dict) and isinstance(was.get("size"), int) and isinstance(was.get("sha256"), str)):
            return
        self.data_file = was   # the text the run started from, whatever a resume finds now
        if not text:
            return
        try:
            size = os.path.getsize(cfg.data)
            now = {"size": size, "sha256": None} if size != was["size"] else file_fingerprint(cfg.data)
        except OSError:
            return
        if now["size"] == was["size"] and now["sha256"] == was["sha256"]:
            return
        how = (f"{was['size']:,} -> {now['size']:,} bytes" if now["size"] != was["size"]
               else "the same size, other bytes")
        self._say(f"warning: {cfg.data} has changed since the run in {self.out_dir} was prepared from it ({how}); "
                  f"the resumed run goes on with the tokens prepared then, in {self.data_dir}; to train on the "
                  f"new text, start a new run from this one: --init-from {self.out_dir} --data {cfg.data} "
                  f"--out NEW_FOLDER")

    def _check_length(self, n: int, what: str) -> None:
        T = self.cfg.block_size
        if n < T + 1:
            w = _field_word
            raise DataError(f"{what} holds {n} {plural(n, 'token')}; {w('block_size')} {T} needs at least "
                            f"{T + 1} (one window plus its next-token target): give a smaller "
                            f"{w('block_size')} or more tokens")

    def _plan_data(self, resume: bool, source, ckpt_tok=None):
        """``(shards, tokenizer, write, tokens)``: the data folder's ``ShardFolder``, its
        tokenizer, the function that prepares the shards (None when they exist), and the run's
        tokens for ``tokens_digest`` (train shards, val shards; None for a shard folder over
        DIGEST_MAX_BYTES). Reads, never writes: a
        text too short for a window of ``block_size`` in its train or val part is refused here."""
        cfg = self.cfg
        src_tok = source[1] if source is not None else None
        if cfg.data and Path(cfg.data).is_dir():
            sf = shard_folder(cfg.data)
            tok = self._folder_tokenizer(sf, src_tok, resume)
            n_train, n_val = self._check_shards(sf, tok)
            tokens = None   # (a larger folder's shards: their names and sizes are checked)
            if sum(p.stat().st_size for p in sf.train + sf.val) <= DIGEST_MAX_BYTES:
                tokens = ([read_shard(p) for p in sf.train], [read_shard(p) for p in sf.val])
            if not sf.prepared:
                whose = (f"{sf.tokenizer}" if sf.tokenizer is not None else
                         "GPT-2's BPE (no tokenizer.json in the folder: llm.c's shards hold GPT-2 ids)")
                self._say(f"data: {len(sf.train)} train {plural(len(sf.train), 'shard')} ({n_train:,} tokens) and "
                          f"{len(sf.val)} val {plural(len(sf.val), 'shard')} ({n_val:,} tokens) in {sf.folder}; "
                          f"tokenizer {whose}")
            return sf, tok, None, tokens
        if cfg.data and any(c in cfg.data for c in "*?[") and not os.path.exists(cfg.data):
            raise DataError(f"--data {cfg.data}: a pattern is not taken; give the folder that holds the shards "
                            f"(--data {os.path.dirname(cfg.data) or '.'}): its *train*.bin are the train shards "
                            f"and its *val*.bin the val shards")
        d = self.out_dir / DATA_NAME
        if resume and all((d / f).is_file() for f in DATA_FILES):
            sf = shard_folder(d)
            tok = self._read_tokenizer(d)
            self._check_shards(sf, tok)
            tokens = ([read_shard(d / "train.bin")], [read_shard(d / "val.bin")])
            return sf, tok, None, tokens  # the exact tokens the run started with
        if cfg.data:
            src = Path(cfg.data)
            if is_shard_file(src):
                raise DataError(f"--data {src} is a token shard; give the folder that holds the train and val "
                                f"shards (--data {src.parent}): its *train*.bin are the train shards and its "
                                f"*val*.bin the val shards")
            text = load_text(src)  # a missing file, a special file or bytes that are not UTF-8: one line each
        else:
            src = d / CORPUS_NAME
            text = default_corpus(cfg.corpus_bytes)
        what = src if cfg.data else "the default corpus"
        if not text:
            raise DataError(f"text file {src} is empty; expected text to train on")
        # a resume preparing the text again takes the run's tokenizer (a fine-tune's char
        # alphabet is its source's, not the text's: built from the text, the ids differed)
        given = src_tok if src_tok is not None else ckpt_tok
        tok = given if given is not None else load_tokenizer(cfg.tokenizer or "char", text=text)
        if given is not None and tok.kind == "char":
            extra = sorted(set(text) - set(tok.chars))
            if extra:
                whose = f"--init-from {cfg.init_from}" if src_tok is not None else f"the run in {self.out_dir}"
                raise DataError(f"{src if cfg.data else 'the default corpus'} holds {len(extra)} character(s) that the "
                                f"char tokenizer of {whose} lacks ({''.join(extra[:20])!r}); "
                                f"fine-tune on text written with its characters")
        train, val = split_windows(encode_array(tok, text), cfg.val_fraction, what)   # as prepare
        frac = f"the last {cfg.val_fraction:g} of {len(train) + len(val):,} tokens"
        self._check_length(len(train), f"the train part of {what} (all but {frac})")
        self._check_length(len(val), f"the val part of {what} ({frac}; see --val-fraction)")
        if given is None and cfg.tokenizer is None and tok.kind == "char" and cfg.model.startswith("gpt2"):
            # a GPT-2 preset over a char vocabulary, without a word: the default tokenizer is char
            self._say(f"note: --model {cfg.model} with no --tokenizer: {what} is tokenized by characters (char "
                      f"tokenizer, {tok.vocab_size} tokens in the vocabulary), not with GPT-2's BPE; add "
                      f"--tokenizer gpt2 for GPT-2's 50,257 tokens")

        def write():
            # what this write makes is taken back when it fails (a full disk), so that the
            # same command, run again, is not refused as a run that already holds data/
            # (the shards take themselves back: write_prepared's files are written together)
            fresh = [p for p in ((src, d) if not cfg.data else (d,)) if not p.exists()]
            try:
                if not cfg.data:
                    try:
                        d.mkdir(parents=True, exist_ok=True)
                        replace_file(src, text)
                    except OSError as e:
                        raise RunError(cannot_write(src, e)) from None
                info = write_prepared(d, train, val, tok)
            except BaseException:
                for p in fresh:  # the corpus first, then the folder (only when left empty)
                    try:
                        p.rmdir() if p == d else p.unlink()
                    except OSError:
                        pass
                raise
            # said by the caller once the folder is the run's: a log callable that raises here
            # left data/ without the trainer's lock, and the same call was then refused
            return (f"prepared {src}: {info['train_tokens']:,} train + {info['val_tokens']:,} val "
                    f"tokens, {info['vocab_size']} {info['tokenizer']} tokens in the vocabulary "
                    f"-> {d}")

        return (ShardFolder(d, [d / "train.bin"], [d / "val.bin"], d / "tokenizer.json", True), tok, write,
                ([train], [val]))

    def _check_host_memory(self, model: GPT2Config) -> None:
        """On the CPU, a batch whose step cannot fit the host's free memory is refused before
        anything is written: Linux hands out the arrays and then kills the process as they
        fill (a --batch-size of 300,000 ran 53 s and died, exit 137, without a word)."""
        if not device_has(self.device, "host_memory") or not isinstance(self.cfg.batch_size, int):
            return
        B, T = self.cfg.batch_size, self.cfg.block_size
        need, free = host_step_bytes(model, B, T), host_available_bytes()
        if free is None or need <= free or flags.get("FORGE_HOST_MEMORY_CHECK") == "off":
            return
        b = train_flag("batch_size")
        raise ConfigError(f"{b} {B} x {train_flag('block_size')} {T}: a training step on the "
                          f"CPU would hold about "
                          f"{need / 2 ** 30:,.1f} GiB (activations, logits and optimizer state), "
                          f"more than the {free / 2 ** 30:,.1f} GiB this machine has free; use a "
                          f"smaller {b} ({train_flag('total_batch_size')} keeps the global batch "
                          "through gradient accumulation), or FORGE_HOST_MEMORY_CHECK=off where "
                          "the estimate is wrong")

    def _architecture(self, ckpt, source) -> GPT2Config:
        """The model's config: the source's (init_from), the checkpoint's for a resumed
        fine-tuning run, else the config's sizes over the tokenizer's vocabulary."""
        cfg = self.cfg
        if source is not None:
            return dataclasses.replace(source[0].config, dropout=cfg.dropout)
        if ckpt is not None and cfg.init_from and "config" in ckpt[1]:
            saved = GPT2Config.from_dict(dict(ckpt[1]["config"], dropout=cfg.dropout))
            # the run recorded the source's sizes and no preset: a preset or another size is the
            # user's, which the checkpoint's model cannot take
            self._refuse_other_sizes({k: getattr(saved, k) for k in _SIZES}, "fine-tunes", "--model")
            return saved
        if ckpt is not None and isinstance(ckpt[1].get("config"), dict):
            # a size or a preset on a resumed run: its sizes must be the run's (a size given was
            # found out by the checkpoint's tensor shapes, a list of them; the run's own sizes
            # took precedence over a preset, whose name was recorded for a model it is not)
            self._refuse_other_sizes(ckpt[1]["config"], "trains", f"--model {cfg.model}")
        sizes = cfg.model_sizes()
        if sizes["n_embd"] % sizes["n_head"]:   # GPT2Config's own error named its fields
            w = _field_word

            def said(k):   # a size not given comes from the preset or the default
                where = ("" if getattr(cfg, k) else f" (from {w('model')} {cfg.model})" if cfg.model
                         else " (the default)")
                return f"{w(k)} {sizes[k]}{where}"
            raise ConfigError(f"{said('n_embd')} must be divisible by {said('n_head')} (each head "
                              f"takes an equal share of the {sizes['n_embd']} channels)")
        return GPT2Config(vocab_size=self.tokenizer.vocab_size, block_size=cfg.block_size, dropout=cfg.dropout,
                          **sizes)

    def _refuse_other_sizes(self, have: dict, verb: str, model_flag: str) -> None:
        """A resumed run keeps its model's sizes (``have``): the first size asked that is not
        the run's is refused, by its flag (``--n-layer`` ...) or by the preset's
        (``model_flag``, how the message names ``--model``)."""
        preset = PRESETS[self.cfg.model] if self.cfg.model else {}
        for k in _SIZES:
            for flag, asked in ((train_flag(k), getattr(self.cfg, k)), (model_flag, preset.get(k))):
                if asked and have.get(k) is not None and asked != have[k]:
                    raise ConfigError(f"{flag}: the run in {self.out_dir} {verb} a model with {k} {have[k]!r}, "
                                      f"not {asked!r} (another architecture), which a resumed run keeps; drop "
                                      f"{flag.split()[0]}")

    def _restore_model(self, ckpt, want: GPT2Config) -> GPT2:
        tensors, meta = ckpt
        if "config" not in meta:
            raise CheckpointError(f"{self.ckpt_dir}: no model config in the checkpoint's meta")
        saved = GPT2Config.from_dict(meta["config"])
        params, _, _ = unpack_tensors(tensors)
        try:
            check_architecture(param_shapes(want), params)
        except CheckpointError as e:
            raise CheckpointError(f"{self.ckpt_dir} holds another architecture than this run asks for "
                                  f"({_arch(saved)} vs {_arch(want)}): {e}") from None
        for k in ("n_head", "tied_head", "layernorm_eps", "padded_vocab_size"):
            if getattr(saved, k) != getattr(want, k):
                raise CheckpointError(f"{self.ckpt_dir} holds another architecture: its {k} is "
                                      f"{getattr(saved, k)}, this run asks for {getattr(want, k)}")
        if meta.get("tokenizer") and not same_ids(meta["tokenizer"], self.tokenizer.to_dict()):
            whose = (f"{self.shards.tokenizer}" if self.shards.tokenizer is not None else
                     f"GPT-2's, which {self.data_dir} (no tokenizer.json) is read with")
            raise CheckpointError(f"{self.ckpt_dir} was trained with another tokenizer "
                                  f"({meta['tokenizer'].get('kind')}) than the data's, {whose}")
        return GPT2.from_state_dict(want, params, device=self.device)

    def _restore_state(self, ckpt) -> None:
        tensors, meta = ckpt
        _, m, v = unpack_tensors(tensors)
        self.opt.load_state_dict(dict(meta["optimizer"], m=m, v=v))
        # the run's settings over the checkpoint's (the same unless a flag changed them on
        # resume): lr, weight decay and betas (betas were kept from the checkpoint, so a
        # --beta2 on resume did nothing while the new checkpoint recorded it)
        self.opt.lr, self.opt.weight_decay = self.cfg.lr, self.cfg.weight_decay
        self.opt.betas = (float(self.cfg.beta1), float(self.cfg.beta2))
        self.train_loader.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.elapsed = float(meta.get("elapsed", 0.0))
        self.last_ckpt_step = self.step
        self.val_loss = meta.get("val_loss")
        self.val_kind = meta.get("val_kind")
        rng = meta.get("rng", {})
        if rng.get("seed", self.cfg.seed) != self.cfg.seed:
            raise CheckpointError(f"{self.ckpt_dir} was trained with seed {rng['seed']}, this run asks for "
                                  f"{self.cfg.seed}; resume with the same seed")
        self._note_changed_settings(meta.get("train_config"))
        changed = numerics_changed(meta.get("numerics"), self._numerics)
        if changed:
            self._say(f"note: this resume computes with other kernels than the run so far ({'; '.join(changed)}); "
                      f"it goes on from step {self.step}, but not bit for bit as the uninterrupted run would")
        kept, went = self._truncate_log(self.step)
        if self.step < self.cfg.max_steps or (went is not None and went > self.step):
            # a kill (or a crash) after the checkpoint: the steps the log holds past it are
            # trained again, and the log's records of them are dropped
            n = went - self.step if went is not None and went > self.step else 0
            self._say(f"resuming the run in {self.out_dir} from its checkpoint of step {self.step}"
                      + (f"; its log had gone on to step {went}, so the {n} {plural(n, 'step')} after the "
                         f"checkpoint (lost when the run stopped) {'are' if n > 1 else 'is'} trained again"
                         if n else ""))
        # a signal during the periodic evaluation of this step stopped it before its record:
        # the resumed run evaluates first (the same windows), so that its log has every record
        # an uninterrupted run's has
        # (keep_best: the last step's estimate too, which a stop on its log line cut short)
        self._eval_due = bool(kept is not None and self._estimates_at(self.step, self.cfg.max_steps)
                              and not any(r["step"] == self.step and "val_loss" in r for r in kept))

    def _auto_batch_size(self) -> None:
        """--batch-size auto: the largest micro-batch that a measured trial step fits in the
        device's memory; grad_accum then keeps the asked global batch (total_batch_size)."""
        cfg = self.cfg
        total = cfg.total_batch_size
        tried = {}

        def trial(b):
            try:
                self._trial_step(b)
                tried[b] = True
            except OutOfMemoryError:
                tried[b] = False
                raise

        b = search_batch_size(trial, total)
        release_cached(self.device)   # the trials' cached blocks: the step's graph has its own pool
        failed = sorted(k for k, ok in tried.items() if not ok)
        cfg.batch_size = b
        cfg.grad_accum = total // b if total else cfg.grad_accum
        self._say(f"batch size auto: micro-batch {b} (measured on {self.device}"
                  + (f"; {failed[0]} did not fit" if failed else "") + f"), grad_accum {cfg.grad_accum} -> "
                  f"{b * cfg.grad_accum} sequences of {cfg.block_size} tokens per step")

    def _trial_step(self, b: int) -> None:
        """A training step's memory at micro-batch ``b``: two micro-batches' forward and
        backward with their gradients summed (the model and optimizer are not changed)."""
        cfg = self.cfg
        rs = np.random.default_rng(0)
        ids = rs.integers(0, self.model.config.vocab_size, (b, cfg.block_size + 1))
        x, y = tensor(ids[:, :-1], device=self.device), tensor(ids[:, 1:], device=self.device)
        acc = None
        for micro in range(2):
            _, grads = self.model.loss_and_grads(x, y, dropout_seed=dropout_seed(cfg.seed, 0, micro))
            acc = accumulate(acc, grads, self.bf16)
        synchronize(self.device)
        del acc, grads

    # -- output helpers ---------------------------------------------------------------------
    def _note_changed_settings(self, was: Optional[dict]) -> None:
        """A resume whose optimisation settings differ from the run's recorded ones trains on
        with the new ones (the CLI's flags, or a Trainer's config); say which, and where the
        learning rate jumps at this step (a longer --max-steps moves the cosine's end)."""
        if not isinstance(was, dict) or self.step >= self.cfg.max_steps:
            return   # (a finished run trains no step: refused, or only its end finished)
        cfg = self.cfg
        # grad_accum too: another one changes the batch of every step (--grad-accum or
        # --total-batch-size on resume), which went on unsaid
        keys = ("lr", "min_lr", "warmup", "lr_decay_steps", "max_steps", "weight_decay", "beta1",
                "beta2", "grad_clip", "dropout", "grad_accum")
        changed = [k for k in keys if _is_number(was.get(k)) and float(was[k]) != float(getattr(cfg, k))]
        if not changed:
            return
        # the run's schedule: this config with the recorded schedule settings, TrainConfig's
        # own rules deriving the rest (min_lr lr / 10 where none was recorded, the cosine's end)
        sched = {k: was[k] for k in ("lr", "warmup", "lr_decay_steps", "max_steps") if _is_number(was.get(k))}
        try:
            old = dataclasses.replace(cfg, **sched, min_lr=was["min_lr"] if _is_number(was.get("min_lr")) else None)
            before = cosine_lr(self.step, old.lr, old.warmup, old.decay_steps, old.min_lr)
        except ConfigError:
            before = None
        now = cosine_lr(self.step, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr)
        moved = ", ".join(f"{k} {was[k]:g} -> {getattr(cfg, k):g}" for k in changed)
        jump = ("" if before is None or before == now else
                f"; the learning rate at step {self.step} goes from {before:.2e} to {now:.2e}")
        self._say(f"note: this resume changes {moved} from the run's recorded settings; it trains on "
                  f"with the new ones{jump}")

    def _say(self, msg: str, verbatim: bool = False, library_only: bool = False) -> None:
        """A line to the log function; the trainer's own words (not ``verbatim``: a sample is
        the model's text) in the library's names where no command line runs. ``library_only``:
        a line that forge-ml train says in its own words (a signal's stop), left out there."""
        if self._log is None or (library_only and CLI_WORDS.get()):
            return
        if not verbatim and not CLI_WORDS.get():
            msg = library_words(msg)
        to_stdout = self._log is print
        try:
            if self._bar is not None and to_stdout:   # (a log function of the user's gets
                self._bar.write(msg)                  # every line, bar or not)
            else:
                self._log(msg)
        except BrokenPipeError:
            # stdout's reader is gone (`forge-ml train | head`): the run stops at the next step
            # boundary with a checkpoint, as on SIGPIPE's default, but nothing trained is lost
            # (the pipe's end was taken for a finished run, exit 0, the steps since the last
            # checkpoint lost)
            if self._stop is None:
                self._stop = signal.SIGPIPE
            if not to_stdout:
                return      # a log function of the user's: this run stops; stdout is not touched
            self._pipe_closed = True
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass

    def _kept(self) -> str:
        if self.last_ckpt_step is None:
            return f"no checkpoint was saved yet in {self.ckpt_dir}"
        return f"the last good checkpoint, {self.ckpt_dir} (step {self.last_ckpt_step}), is kept"

    def _truncate_log(self, step: int) -> tuple:
        """Drop log records past ``step`` (from a run that went on after its last checkpoint)
        and damaged lines (one warning); the log is rewritten atomically. Returns the records
        kept and the last step the log had reached (None, None when there is no log to read)."""
        if not self.log_path.is_file():
            return None, None
        try:
            records, bad = read_log(self.log_path)
        except OSError as e:
            self._say(f"warning: cannot read {self.log_path} ({e.strerror or e}); it is left as it is")
            return None, None
        reached = max((r["step"] for r in records), default=None)
        if bad:
            self._say(f"warning: {self.log_path}: dropped {len(bad)} damaged line(s) (line "
                      f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''}); the log is a record "
                      f"only, training goes on from the checkpoint")
        keep = [r for r in records if r["step"] <= step]
        if not bad and len(keep) == len(records):
            return keep, reached
        try:
            replace_file(self.log_path, "".join(json.dumps(r) + "\n" for r in keep))
        except OSError as e:
            raise RunError(cannot_write(self.log_path, e, self._kept())) from None
        return keep, reached

    def _write_log(self, record: dict, later: bool = False) -> None:
        """Append ``record`` to log.jsonl. A failed write (a full disk) raises a RunError and
        keeps the record: the next write (``train()`` called again) first takes back the torn
        part the failed one left, then writes the records that did not land. ``later``: the
        record may wait for the next write (the captured step writes it while the device runs
        the next step) unless others are waiting already."""
        later = later and not self._unlogged
        self._unlogged.append(record)
        if not later:
            self._flush_log()

    def _flush_log(self, quiet: bool = False) -> None:
        """Write the records ``_write_log`` holds (see there); nothing when none waits.
        ``quiet``: a failed write raises nothing; the records stay held, and the next write
        tries them first (and raises)."""
        if not self._unlogged:
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                if self._log_end is None:
                    self._log_end = f.tell()
                else:
                    f.truncate(self._log_end)
                f.write("".join(json.dumps(r) + "\n" for r in self._unlogged))
        except OSError as e:
            if quiet:
                return
            raise RunError(cannot_write(self.log_path, e, self._kept())) from None
        self._unlogged, self._log_end = [], None

    # -- the pieces of a step -------------------------------------------------------------------
    def _batch(self):
        x, y = self.train_loader.next_batch()                     # (B, T) int64 each
        return tensor(x, device=self.device), tensor(y, device=self.device)

    def train_step(self) -> dict:
        """One optimizer step (``grad_accum`` micro-batches); returns its log record.

        A KeyboardInterrupt while the gradients are computed gives the step up: the data
        loader goes back to where the step began, and the model is untouched. The optimizer
        update itself is never interrupted by ``train()``'s signal handlers. Through the
        captured step (a GPU) the loader has then drawn the next step's batches already;
        ``save()`` and the end of ``train()`` give them back, so a checkpoint's data position
        is this step's. Past ``max_steps`` it raises TrainingError and changes nothing.

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> rec = t.train_step(); rec["step"], t.step, rec["lr"]     # lr: the first warmup step's
        (1, 1, 1e-05)
        >>> sorted(rec)
        ['dt_ms', 'grad_norm', 'loss', 'lr', 'step', 'time', 'tokens_per_s']
        >>> t.close()
        """
        cfg, step = self.cfg, self.step
        self._within_max_steps()
        t0 = time.perf_counter()
        lr = cosine_lr(step, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr)
        fast = self._fast_step()
        if fast is not None:
            return self._graph_step(fast, lr, t0)
        loader_state = self.train_loader.state_dict()
        batches = []
        self._phase = "step"
        try:
            acc, loss_sum = None, 0.0
            for micro in range(cfg.grad_accum):
                x, y = self._batch()
                batches.append((x, y))
                loss, grads = self.model.loss_and_grads(x, y, dropout_seed=dropout_seed(cfg.seed, step, micro))
                if not math.isfinite(loss):
                    self._phase = None
                    raise self._bad_loss(loss, step, micro, batches[-1])
                loss_sum += loss
                acc = accumulate(acc, grads, cfg.grad_accum > 1 and self.bf16)
            loss = loss_sum / cfg.grad_accum
            norm, scale = clip_grad_norm(acc, cfg.grad_clip, grad_scale=1.0 / cfg.grad_accum)
            if not math.isfinite(norm):
                self._phase = None
                raise self._bad_norm(norm, loss, step, batches, acc)
        except BaseException:
            self.train_loader.load_state_dict(loader_state)   # the step is given up
            raise
        finally:
            self._phase = None
        self._phase = "update"
        opt_steps = self.opt.steps
        try:
            self.opt.step(acc, lr=lr, grad_scale=scale)
            self.step += 1
        except BaseException:
            # some tensors updated, others not: nothing may be saved; unless AdamW refused
            # before its first change (its own checks of lr and grad_scale: a NaN lr set on
            # the config after it was built), which leaves its count of steps as it was
            if self.opt.steps != opt_steps:
                self._torn = True
            else:   # the step is given up, as one that fails before its update
                self.train_loader.load_state_dict(loader_state)
            raise
        finally:
            self._phase = None
        return self._step_record(lr, loss, norm, t0)

    def _bad_loss(self, loss: float, step: int, micro: int, batch) -> TrainingError:
        """The error of a non-finite loss at micro-step ``micro``, naming where it came from."""
        return TrainingError(f"the loss is {loss} at step {step + 1}"
                             + (f" (micro-step {micro + 1})" if self.cfg.grad_accum > 1 else "")
                             + f"; {self._origin(step, [batch], micro)}; stopping. {self._last_good()}")

    def _bad_norm(self, norm: float, loss: float, step: int, batches: list, grads=None) -> TrainingError:
        """The error of a non-finite gradient norm, naming where it came from."""
        return TrainingError(f"the gradient norm is {norm} at step {step + 1} (loss {loss:.4f}); "
                             f"{self._origin(step, batches, 0, grads)}; stopping. {self._last_good()}")

    def _step_record(self, lr: float, loss: float, norm: float, t0: float) -> dict:
        """The log record of the step just taken (``self.step`` counts it already)."""
        cfg = self.cfg
        dt = time.perf_counter() - t0
        self.elapsed += dt
        tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": tokens / dt, "time": round(self.elapsed, 4), "dt_ms": round(dt * 1e3, 3)}

    def _fast_step(self):
        """The step as one device graph (``step.TrainStep``) where the device captures graphs
        and FORGE_TRAIN_GRAPH is on; None for the op-by-op step. Built at the first step, after
        setup has loaded any checkpoint (the tensors it captures stay the model's and the
        optimizer's from then on)."""
        if self._fast is None and device_has(self.device, "graphs") and flags.on("FORGE_TRAIN_GRAPH"):
            cfg = self.cfg
            self._fast = TrainStep(self.model, self.opt, cfg.batch_size, cfg.block_size,
                                   cfg.grad_accum, cfg.grad_clip, graph=True)
        return self._fast

    def _graph_step(self, fast, lr: float, t0: float) -> dict:
        """``train_step`` through ``fast``: the same step, its values written to the device
        first, replayed as one graph. A loss or norm that is not finite has updated nothing.

        While the device runs the step, the host does the work that would otherwise stand
        between two steps: it writes the last step's log record, draws the next step's
        batches (``_stage``; a checkpoint puts the loader back to before them first) and
        queues them, with that step's lr and seeds, behind this step (``TrainStep.preload``)."""
        cfg, step = self.cfg, self.step
        self._stage()   # this step's batches: drawn during the step before, or now
        (_, batches), self._staged = self._staged, None   # (the loader state: _unstage's)
        seeds = [dropout_seed(cfg.seed, step, micro) for micro in range(cfg.grad_accum)]
        self._phase = "update"
        try:
            pending = fast.submit(batches, seeds, lr)
            self._flush_log(quiet=True)   # a failure raises at the next write, after this step
            try:
                self._stage()
                nxt = step + 1   # its values queued behind this step: no copy between the two
                fast.preload(self._staged[1],
                             [dropout_seed(cfg.seed, nxt, m) for m in range(cfg.grad_accum)],
                             cosine_lr(nxt, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr))
            except Exception:
                # this step is on the device and counts; the next one draws its own batches
                # (and meets the same error there, with the model and the counters agreeing)
                self._unstage()
            res = pending.result()
        except BaseException:
            # the device may have run the update, or part of it (a capture after the step's
            # real run, say): nothing may be saved after this; a Trainer made with resume=True
            # goes on from the last checkpoint
            self._torn = True
            raise
        finally:
            self._phase = None
        if fast.why_eager and not self._said_eager:
            self._said_eager = True
            self._say(f"note: the training step runs op by op: {fast.why_eager}")
        loss = sum(res.losses) / cfg.grad_accum     # added in order, as the op-by-op step does
        if not res.taken:
            self._unstage()
            dev = [(tensor(x, device=self.device), tensor(y, device=self.device)) for x, y in batches]
            bad = [i for i, v in enumerate(res.losses) if not math.isfinite(v)]
            if bad:
                raise self._bad_loss(res.losses[bad[0]], step, bad[0], dev[bad[0]])
            raise self._bad_norm(res.norm, loss, step, dev)
        self.step += 1
        return self._step_record(lr, loss, res.norm, t0)

    def _stage(self) -> None:
        """Draw a step's batches unless drawn already (the loader's state before them kept
        with them): ``_graph_step`` takes them, drawn during the step before or just now."""
        if self._staged is None:
            state = self.train_loader.state_dict()
            try:
                batches = [self.train_loader.next_batch() for _ in range(self.cfg.grad_accum)]
            except BaseException:   # part-way: the loader goes back to before the step
                self.train_loader.load_state_dict(state)
                raise
            self._staged = (state, batches)

    def _unstage(self) -> None:
        """Give back batches drawn for a step that has not run: the loader goes back to before
        them (a checkpoint, the end of ``train()``, a step that stopped the run)."""
        if self._staged is not None:
            state, self._staged = self._staged[0], None
            self.train_loader.load_state_dict(state)

    def _origin(self, step: int, batches: list, micro0: int, grads: Optional[dict] = None) -> str:
        """Re-run the step's micro-batches with a check after every op, forward and backward:
        the first op, layer and tensor that produced a NaN or inf."""
        cfg = self.cfg
        names = {id(t): k for k, t in self.model.params.items()}
        try:
            for i, (x, y) in enumerate(batches):
                micro = micro0 + i
                tape = CheckingTape(names)
                _, loss, _ = self.model.forward(tape, x, y, dropout_seed=dropout_seed(cfg.seed, step, micro))
                if tape.found is None:
                    tape.backward(loss)
                if tape.found is not None:
                    return ("first non-finite value: " + tape.found
                            + (f" (micro-step {micro + 1})" if len(batches) > 1 else ""))
        except ForgeError as e:  # the check must not hide the error it explains
            return f"the checked re-run of the step failed ({e})"
        if grads:
            big = max(grads, key=lambda k: float(np.nanmax(np.abs(grads[k].numpy()), initial=0.0)))
            peak = float(np.nanmax(np.abs(grads[big].numpy()), initial=0.0))
            return (f"every op's output and gradient was finite; the norm overflowed (the largest gradient "
                    f"value is {peak:.3g}, in {big})")
        return "the checked re-run found every value finite (a nondeterministic kernel?)"

    def _last_good(self) -> str:
        if self.last_ckpt_step is None:
            return f"No checkpoint was saved yet in {self.ckpt_dir}; lower --lr or raise --warmup and start again"
        return (f"The last good checkpoint is {self.ckpt_dir} (step {self.last_ckpt_step}); resume from "
                f"it with --resume, with a lower --lr or a larger --warmup")

    def evaluate(self, iters: Optional[int] = None) -> float:
        """Mean loss over the first ``iters`` validation batches (no dropout): an estimate,
        the same windows at every call, so comparable across a run and across a resume.
        ``iters`` must be an int >= 1 (a ConfigError otherwise).

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> round(t.evaluate(2), 1), t.evaluate(2) == t.evaluate(2)     # untrained: ~ln(3), 3 characters
        (1.1, True)
        >>> t.close()
        """
        iters = self.cfg.eval_iters if iters is None else iters
        if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 1:
            raise ConfigError(f"Trainer.evaluate: iters must be an int >= 1 (validation batches), got {iters!r}")
        total = 0.0
        for x, y in self.val_loader.eval_batches(iters):
            total += self.model.loss(tensor(x, device=self.device), tensor(y, device=self.device)).item()
        return total / iters

    def evaluate_full(self, max_windows: Optional[int] = None) -> tuple:
        """``(mean loss, windows)`` over every window of ``block_size`` tokens of the validation
        shards (no dropout): the figure ``forge-ml eval`` gives for them; with ``max_windows``,
        over the first ``max_windows`` windows only (in order, the same at every call), an int
        >= 1 (a ConfigError otherwise).

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> loss, windows = t.evaluate_full(); round(loss, 1), windows
        (1.1, 18)
        >>> t.evaluate_full(max_windows=3)[1]
        3
        >>> t.close()
        """
        if max_windows is not None and (isinstance(max_windows, bool) or not isinstance(
                max_windows, (int, np.integer)) or max_windows < 1):
            raise ConfigError(f"Trainer.evaluate_full: max_windows must be None (every window) or an int >= 1, "
                              f"got {max_windows!r}")
        total, windows = 0.0, 0
        for x, y in self.val_loader.eval_batches(tail=True):
            if max_windows is not None:
                x, y = x[:max_windows - windows], y[:max_windows - windows]
            loss = self.model.loss(tensor(x, device=self.device), tensor(y, device=self.device))
            total += loss.item() * len(x)   # a batch's loss is the mean over its windows
            windows += len(x)
            if max_windows is not None and windows >= max_windows:
                break
        return total / windows, windows

    def _within_max_steps(self) -> None:
        """Refuse a step past ``max_steps``: it trained on in silence, into a checkpoint the
        run's own max_steps then refused (``train_step``, the data-parallel one too)."""
        if self.step >= self.cfg.max_steps:
            raise TrainingError(f"the run in {self.out_dir} is at step {self.step}, its max_steps "
                                f"({self.cfg.max_steps}), where its learning-rate schedule ends; to "
                                f"train on, resume it with a larger max_steps: Trainer(TrainConfig(..., "
                                f"max_steps=N), resume=True), or `forge-ml train --out {self.out_dir} "
                                f"--resume --max-steps N`")

    def sample(self, n_tokens: Optional[int] = None, prompt: Optional[str] = None, seed: int = 0) -> str:
        """Text the model writes after ``prompt`` (default: the config's, or a newline), drawn
        with ``seed`` (an int in [0, 2**64); the same seed, the same text).

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> text = t.sample(5, prompt="ab", seed=1)
        >>> text[:2], len(text), set(text) <= set("ab\\n"), text == t.sample(5, prompt="ab", seed=1)
        ('ab', 7, True, True)
        >>> t.close()
        """
        # checked here, in this method's name: stream_tokens' own check named stream_tokens,
        # which the caller never called
        seed = _seed("Trainer.sample", seed)
        n_tokens = self.cfg.sample_tokens if n_tokens is None else _count("Trainer.sample", "n_tokens",
                                                                          n_tokens)
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        tok = self.tokenizer
        ids = prompt_ids(tok, prompt)
        # from the float32 masters, as a float32 run computes
        masters = GPT2(self.model.config, self.opt.params)
        out = list(stream_tokens(masters, ids, n_tokens, temperature=self.cfg.sample_temperature,
                                 top_k=40, seed=seed))
        return prompt + tok.decode(out)

    def save(self) -> Path:
        """Write the checkpoint of the current step to ``<out_dir>/ckpt`` (atomically). A
        failed write (full disk, read-only folder) keeps the previous checkpoint and raises a
        one-line CheckpointError that says so.

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> _ = t.train_step(); path = t.save()
        >>> path.name, sorted(os.listdir(path))
        ('ckpt', ['model.safetensors', 'state.json'])
        >>> t.close()
        """
        self._refuse_if_torn("and is not saved")
        held = self.lock.held
        self._hold_folder()    # never beside another Trainer of the folder
        try:
            self._unstage()       # the loader's state is saved as of this step
            self._flush_log(quiet=True)   # a record the captured step held back (the
                                          # checkpoint matters more: a failed write raises at the next one)
            self._save_failed = True
            out = self._write_checkpoint(self._masters(), self.opt.state_dict())
            self._save_failed = False
            return out
        finally:
            if not held:
                self.lock.release()

    def _write_checkpoint(self, masters: dict, opt_state: dict) -> Path:
        """``save`` from host arrays: ``masters`` name -> float32 array, ``opt_state``
        ``AdamW.state_dict()``'s dict (its ``m`` and ``v`` are taken out of it)."""
        cfg = self.cfg
        tensors = pack_tensors(masters, opt_state.pop("m"), opt_state.pop("v"))
        meta = {
            "kind": "forge-ml-train",
            "config": self.model.config.to_dict(),
            "train_config": cfg.to_dict(),
            "step": self.step,
            "optimizer": opt_state,
            "data": self.train_loader.state_dict(),
            "data_dir": str(self.data_dir.resolve()),
            "shards": self.shard_names,
            "tokens_sha256": self.tokens_sha256,
            "data_file": self.data_file,
            "run_id": self.run_id,
            "rng": {"seed": cfg.seed, "dropout_seed": "splitmix64(seed, step, micro_step)",
                    "next_step": self.step},
            "tokenizer": self.tokenizer.to_dict(),
            "elapsed": self.elapsed,
            "val_loss": self.val_loss,
            "val_kind": self.val_kind,
            "numerics": self._numerics,
        }
        self._save(self.ckpt_dir, tensors, meta)
        self._ckpt_seen = _ckpt_id(self.ckpt_dir)
        self.last_ckpt_step = self.step
        return self.ckpt_dir

    def _save(self, folder: Path, tensors: dict, meta: dict) -> None:
        """``save_checkpoint`` of the run's: a failure is one line that says where training
        stopped and which checkpoint is kept."""
        try:
            save_checkpoint(folder, tensors, meta)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; training stopped at step {self.step}; {self._kept()}") from None
        except OSError as e:
            raise RunError(cannot_write(e.filename or folder, e, self._kept())) from None

    # -- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        """SIGINT / SIGTERM: ask to stop at the next step boundary. Eval and samples stop at
        once; a second signal gives up the step in flight; the optimizer update always ends."""
        again = self._stop is not None
        if not again:
            self._stop = signum
        if self._phase == "extra" or (self._phase == "step" and again):
            raise KeyboardInterrupt

    def _on_setup_signal(self, signum, frame) -> None:
        """SIGTERM / SIGHUP during the setup: raise, as SIGINT does there."""
        raise Interrupted(signum, self.step, False, setup=True)

    def _install_handlers(self) -> dict:
        # SIGHUP too: a dropped SSH session ends the run with a checkpoint, not killed mid-way
        return take_signals(self._on_signal, (signal.SIGINT,) + ENDING_SIGNALS)

    def _interruptible(self, fn):
        """Run eval or sampling work that a signal cuts short: fn()'s value, or None."""
        try:
            self._phase = "extra"
            if self._stop is not None:
                return None
            return fn()
        except KeyboardInterrupt:
            if self._stop is None:
                self._stop = signal.SIGINT
            return None
        finally:
            self._phase = None

    def _refuse_if_torn(self, what: str = "") -> None:
        """A RunError once an error cut this Trainer's optimizer update short: its model is
        half updated, so it neither saves nor trains on."""
        if self._torn:
            raise RunError(f"this Trainer's step {self.step + 1} was cut short inside the optimizer update, so its "
                           f"model is half updated{' ' + what if what else ''}; {self._kept()}: go on from it with a "
                           f"new Trainer and resume=True")

    def _save_after_error(self, e: Exception) -> None:
        """An error ended the loop (a user's log function, a sample, an op-by-op step that ran
        out of memory): the steps trained since the last checkpoint are saved, as a stop saves
        them, where the state is whole: not after a NaN (TrainingError names the last good
        checkpoint), not when the error cut an optimizer update short, not while the log
        cannot be written (a full disk: the checkpoint would be ahead of it), and not
        across processes (a DistributedTrainer's save is a collective that the others may not
        reach). A save that fails too is said, and the first error goes up."""
        if (isinstance(e, TrainingError) or self._torn or not self._saves_after_error
                or self.step == self.last_ckpt_step or self.step == 0 or self._save_failed):
            return
        self._flush_log(quiet=True)
        if self._unlogged:   # the log cannot be written: a checkpoint past it would resume a run
            return           # whose log lacks steps
        self._close_bar()
        try:
            self.save()
            line = (f"error at step {self.step}: {type(e).__name__}; the checkpoint of step {self.step} "
                    f"(the last one finished) saved in {self.ckpt_dir} (resume with --resume)")
        except Exception as e2:
            line = f"error at step {self.step}; the checkpoint could not be saved either ({e2}); {self._kept()}"
        try:
            self._say(line)
        except Exception:   # the user's log function was the error
            pass

    def _stopped(self) -> None:
        """After a signal: save the checkpoint of the step reached, say so, raise Interrupted."""
        name = signal.Signals(self._stop).name
        if self.last_ckpt_step != self.step:
            try:
                self.save()
            except ForgeError as e:   # a full disk: still the signal's stop, its exit status
                self._say(f"{name}: stopped at step {self.step}; its checkpoint could not be "
                          f"saved: {e}", library_only=True)
                raise Interrupted(self._stop, self.step, False, reason=str(e)) from None
        self._say(f"{name}: stopped at step {self.step}; checkpoint of step {self.step} saved in "
                  f"{self.ckpt_dir} (resume with --resume)", library_only=True)
        raise Interrupted(self._stop, self.step, True)

    # -- the loop -------------------------------------------------------------------------------
    @_library_errors
    def train(self, until: Optional[int] = None) -> dict:
        """Train from the current step up to ``until`` (default ``max_steps``) steps, then
        evaluate on the whole validation shard, checkpoint and plot. Returns a summary
        (``step``, ``loss``, ``val_loss``, ``val_kind``, ``losses`` of this call,
        ``checkpoint``). SIGINT, SIGTERM and SIGHUP (and a KeyboardInterrupt) stop at a step
        boundary with a checkpoint of that step and raise ``Interrupted``; one that the process
        ignores when this starts (nohup's SIGHUP) stays ignored. The run folder is released
        when this returns or raises.

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> t.train(until=1)["step"]
        1
        >>> s = t.train(); s["step"], s["val_kind"], len(s["losses"]), os.path.isdir(s["checkpoint"])
        (2, 'full', 1, True)
        >>> t.close()
        """
        if until is not None:
            until = _count("train", "until", until)   # not after taking the folder
            if until > self.cfg.max_steps:   # it was cut to max_steps without a word (nothing, at it)
                raise ConfigError(f"train(until={until}) is past max_steps {self.cfg.max_steps}, where the "
                                  f"run's learning-rate schedule ends; give until <= {self.cfg.max_steps}, "
                                  f"or train a run with a larger max_steps")
        self._refuse_if_torn()
        self._hold_folder()
        self._stop = signal.SIGPIPE if self._pipe_closed else None
        self._save_failed = False   # an earlier call's (or a direct save()'s) failure is not this call's
        old = self._install_handlers()
        try:
            return self._train(until)
        finally:
            self._unstage()
            give_back_signals(old)
            self._close_bar()
            self._flush_log(quiet=True)
            self.lock.release()

    def _train(self, until: Optional[int]) -> dict:
        cfg = self.cfg
        until = cfg.max_steps if until is None else min(until, cfg.max_steps)
        tuner = self._thread_tuner()
        blas_note = ""
        if tuner is not None:
            blas_note = f" (BLAS threads {' or '.join(map(str, tuner.counts))}, chosen from the steps' times)"
        elif device_has(self.device, "host_memory") and _blas.user_threads() is not None:
            var, asked = _blas.user_threads()
            n = _blas.get_threads()          # the count in use (OpenBLAS caps what it is asked)
            n = asked.split(",")[0] if n is None else str(n)
            blas_note = (f" ({n} BLAS thread{'s' if n != '1' else ''}"
                         + ("" if n == asked else f"; {var}={asked}") + ")")
        self._say(f"model: {self.model.num_params():,} parameters ({_arch(self.model.config)}); "
                  f"{self.train_loader.n_tokens:,} train tokens; device {self.device}" + blas_note
                  + f", {cfg.dtype}; batch {cfg.batch_size} x {cfg.grad_accum}; steps {self.step} -> {until}; "
                  f"out {self.out_dir}")
        if cfg.lr > 0 and cfg.warmup > cfg.max_steps > 0 and self.step == 0:
            # the ramp (lr (s + 1) / warmup at step s) is cut off by the run's end
            peak = cosine_lr(cfg.max_steps - 1, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr)
            self._say(f"note: --warmup {cfg.warmup} is longer than the run's {cfg.max_steps} {plural(cfg.max_steps, 'step')}: the learning "
                      f"rate climbs to {peak:.2e}, never to --lr {cfg.lr:g} (give a shorter --warmup, e.g. "
                      f"--warmup {max(1, cfg.max_steps // 10)})")
        vl = self.val_loader
        held = vl.windows // vl.B   # the val set's whole batches
        if cfg.eval_interval and self.step == 0 and 0 < held < cfg.eval_iters:
            # (eval_batches wraps to the start: the same windows read again, unevenly)
            self._say(f"note: --eval-iters {cfg.eval_iters} is more than the {held} batches the val set "
                      f"holds; each estimate reads it {cfg.eval_iters / held:.1f} times over "
                      f"(--eval-iters {held} reads every batch once)")
        elif cfg.eval_interval and self.step == 0 and held == 0:
            # fewer windows than one batch: every batch is those windows again (it was logged
            # as "an estimate on 20 val batches" with no word of it)
            n = vl.windows
            self._say(f"note: the val set holds {n} {plural(n, 'window')} of {vl.T} tokens, "
                      f"fewer than one batch of {vl.B}; each estimate of --eval-iters "
                      f"{cfg.eval_iters} reads {'it' if n == 1 else 'them'} "
                      f"{cfg.eval_iters * vl.B / n:.1f} times over (more val text, a larger "
                      f"--val-fraction, gives it more)")
        self._bar = self._make_bar(until)
        first = self.step
        mine = len(self.losses)   # where this call's losses begin
        try:
            if self._eval_due and (self.step < until or cfg.keep_best):
                self._eval_due = False
                self._eval_and_log(full=False)
            while self.step < until and self._stop is None:
                if tuner is not None:
                    tuner.before_step()
                rec = self.train_step()
                line = None
                if tuner is not None:
                    rec["blas_threads"] = tuner.threads or _blas.get_threads()
                    line = tuner.after_step(rec["dt_ms"] / 1e3)
                self.losses.append(rec["loss"])
                self._write_log(rec, later=self._fast is not None)
                if line is not None:   # after the step's record: a failing log function loses none
                    self._say(line)
                s = self.step
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                                          refresh=False)
                elif s == first + 1 or (cfg.log_interval and s % cfg.log_interval == 0):
                    self._say(f"step {s:>6}/{until}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                              f"norm {rec['grad_norm']:.3f}  {rec['tokens_per_s']:,.0f} tok/s  "
                              f"{rec['dt_ms']:.0f} ms/step")
                if self._stop is not None:
                    break
                # keep_best: the last step's model is estimated too, so that it competes (the
                # final evaluation over every window reads higher and does not compete)
                if self._estimates_at(s, until):
                    self._eval_and_log(full=False)
                if cfg.sample_interval and s % cfg.sample_interval == 0 and s < until:
                    self._sample_and_show()
                if cfg.checkpoint_interval and s % cfg.checkpoint_interval == 0 and s < until and self._stop is None:
                    self.save()
            if self._stop is None:
                self._close_bar()
                try:
                    if self.step > first or self.val_loss is None or self.val_kind not in FINAL_VAL_KINDS:
                        self._eval_and_log(full=True)
                    if cfg.sample_interval and self.step > first:
                        self._sample_and_show()
                except Exception:
                    # the final evaluation or sample failed (out of memory, say): the steps
                    # trained since the last checkpoint are saved before the error goes up
                    if self.step != self.last_ckpt_step:
                        self.save()
                    raise
        except Exception as e:
            self._save_after_error(e)
            raise
        except KeyboardInterrupt:
            # a step given up (a second signal), or an interrupt without our handler
            self._close_bar()
            if self._stop is None:
                self._stop = signal.SIGINT
            if self._torn:  # only without our handler: the model is half updated
                self._say(f"{signal.Signals(self._stop).name}: interrupted inside the optimizer update of step "
                          f"{self.step + 1}; nothing saved, {self._kept()}")
                raise Interrupted(self._stop, self.last_ckpt_step or 0, False) from None
        self._close_bar()
        if self._stop is not None:
            self._stopped()
        self.save()
        self._say_orphan_best()
        plot = self.plot()
        self._say(f"done: step {self.step}, val loss {self.val_loss:.4f} ({_val_words(self.val_kind)}); "
                  f"checkpoint {self.ckpt_dir}" + (f"; loss curve {plot}" if plot else ""))
        return {"step": self.step, "loss": self.losses[-1] if self.losses else None,
                "val_loss": self.val_loss, "val_kind": self.val_kind,
                "losses": self.losses[mine:],   # of this call (as documented)
                "checkpoint": str(self.ckpt_dir)}

    def _say_orphan_best(self) -> None:
        """keep_best: a best/ kept after the resumed checkpoint that the run trained past
        without keeping another (its steps went otherwise: another lr or schedule) is a model of
        the stopped attempt, not of this run's steps: said, not left to pass as this run's."""
        if self._orphan_best is None or self.step < self._orphan_best[0]:
            return
        at, was = self._orphan_best
        self._say(f"note: {self.best_dir} still holds the model of step {at} (val loss {was:.4f}) from the "
                  f"attempt that stopped before its checkpoint; this run trained those steps again and none "
                  f"of its estimates beat {self.best_val if self.best_val is not None else was:.4f}, so that "
                  f"model is not one of this run's: move it away to keep it as a model of its own")

    def _estimates_at(self, s: int, until: int) -> bool:
        """Whether step ``s`` (of a call training up to ``until``) ends with a periodic val
        estimate: every ``eval_interval`` steps before the call's last (the final evaluation
        follows that one), and with keep_best the run's last step too, so its model competes."""
        every = self.cfg.eval_interval
        return bool(every and s > 0 and ((s % every == 0 and s < until)
                                         or (s == until == self.cfg.max_steps and self.cfg.keep_best)))

    def _eval_and_log(self, full: bool) -> None:
        cfg = self.cfg
        if full:
            total = (self.val_loader.n_tokens - 1) // cfg.block_size
            cap = cfg.final_eval_windows if 0 < cfg.final_eval_windows < total else None
            got = self._off_graph(lambda: self.evaluate_full(cap))
            if got is None:
                return
            loss, windows = got
            rec = {"step": self.step, "val_loss": loss, "val_kind": "full" if cap is None else "capped",
                   "val_windows": windows, "val_tokens": windows * cfg.block_size}
            how = f"every window of the val shard: {windows:,} x {cfg.block_size} tokens"
            if cap is not None:
                rec["val_windows_total"] = total
                how = (f"the first {windows:,} of the val shards' {total:,} windows (--final-eval-windows): "
                       f"{windows:,} x {cfg.block_size} tokens")
        else:
            loss = self._off_graph(self.evaluate)
            if loss is None:
                return
            rec = {"step": self.step, "val_loss": loss, "val_kind": "sampled", "val_batches": cfg.eval_iters}
            how = f"an estimate on {cfg.eval_iters} val {plural(cfg.eval_iters, 'batch', 'batches')}"
        self.val_loss, self.val_kind = loss, rec["val_kind"]
        # the periodic estimates compete with each other (the final evaluation, over every
        # window, only where there are none: it reads higher than the first batches' estimate)
        best = (cfg.keep_best and math.isfinite(loss) and (not full or not cfg.eval_interval)
                and (self.best_val is None or loss < self.best_val))
        if best:   # best/ first: a record that says "best" always has its model kept
            rec["best"] = True
            self._save_best(loss, rec["val_kind"])
        self._write_log(rec)
        self._say(f"step {self.step}: val loss {loss:.4f} ({how}; perplexity {math.exp(min(loss, 50)):.2f})"
                  + (f"; the lowest so far: its model kept in {self.best_dir}" if best else ""))

    def _masters(self) -> dict:
        """Name -> float32 array of the master weights (also in bf16 runs; DistributedTrainer
        gathers them from its ranks)."""
        return {k: t.numpy() for k, t in self.opt.params.items()}

    def _save_best(self, loss: float, kind: str) -> None:
        """keep_best: the model (no optimizer state: a model checkpoint, as `forge-ml convert`
        writes) of the lowest val loss so far, to ``best_dir``, atomically."""
        meta = {"kind": "forge-ml-model", "config": self.model.config.to_dict(),
                "tokenizer": self.tokenizer.to_dict(), "step": self.step, "val_loss": loss, "val_kind": kind,
                "source": str(self.out_dir.resolve()), "run_id": self.run_id,
                "train_block_size": self.cfg.block_size}   # the windows its val loss was read on
        self._save(self.best_dir, self._masters(), meta)
        self.best_val = loss
        self._orphan_best = None

    TUNES_BLAS = True   # DistributedTrainer: False (its processes share the machine's cores)

    def _thread_tuner(self):
        """On the CPU, where forge-ml chose the BLAS thread count (``forge-ml train`` with no
        thread variable set): a ``forge_ml.blas.ThreadTuner`` over the default and every
        core, which keeps the count the steps run faster with. None elsewhere."""
        if not (self.TUNES_BLAS and device_has(self.device, "host_memory")):
            return None
        return _blas.tuner()

    def _off_graph(self, fn):
        """``_interruptible(fn)`` for work outside the training step (evaluation, samples): the
        captured step's memory is given back first and what ``fn`` cached after, so the two
        never hold memory side by side (the step is captured again at the next step)."""
        if self._fast is not None:
            self._fast.release()
        try:
            return self._interruptible(fn)
        finally:
            release_cached(self.device)

    def _sample_and_show(self) -> None:
        # wrapped into generate's [0, 2**64), as its windows' seeds are: seed 2**64 - 1 samples too
        text = self._off_graph(lambda: self.sample(seed=(self.cfg.seed + self.step) % (1 << 64)))
        if text is not None:
            self._say(f"---- sample at step {self.step} ----\n{text}\n" + "-" * 36, verbatim=True)

    def _make_bar(self, until: int):
        if not (self.cfg.progress and self._log is not None and sys.stderr.isatty()):
            return None
        from tqdm import tqdm
        return tqdm(total=until, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None

    def plot(self) -> Optional[Path]:
        """Draw ``loss.png`` (train loss per step, val loss points) from the log; returns its
        path, or None when matplotlib is missing or the file cannot be written (a warning).

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
        >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8, max_steps=2,
        ...                         eval_interval=0, sample_interval=0, progress=False), log=None)
        >>> _ = t.train(); path = t.plot()     # (train() drew it too; this redraws it from the log)
        >>> path.name, path.read_bytes()[1:4]
        ('loss.png', b'PNG')
        >>> t.close()
        """
        try:   # a Figure on its own canvas: pyplot's backend (a notebook's inline one) untouched
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return None
        records, _ = read_log(self.log_path)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        sampled = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r
                   and r.get("val_kind") not in FINAL_VAL_KINDS]
        full = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and r.get("val_kind") == "full"]
        capped = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and r.get("val_kind") == "capped"]
        fig = Figure(figsize=(7, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if train:
            ax.plot(*zip(*train), lw=0.8, label="train")
        if sampled:
            ax.plot(*zip(*sampled), "o-", label=f"val ({self.cfg.eval_iters} batches)")
        if full:
            ax.plot(*zip(*full), "s", label="val (whole shard)")
        if capped:
            ax.plot(*zip(*capped), "D", label=f"val (first {self.cfg.final_eval_windows:,} windows)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"forge-ml: {_arch(self.model.config)}")
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.out_dir / PLOT_NAME
        try:
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=100, bbox_inches="tight",
                        metadata={"Software": _PLOT_MARK.decode()})
            replace_file(path, png.getvalue())  # a failed write keeps the earlier plot whole
        except OSError as e:
            self._say(f"warning: {cannot_write(path, e)}; the checkpoint and log are saved")
            return None
        return path


def _count(what: str, name: str, v) -> int:
    """``v`` as a count (an int >= 0, a NumPy integer included), else a ConfigError.

    >>> _count("train", "until", -1)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: train: until must be an integer >= 0, got -1
    """
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ConfigError(f"{what}: {name} must be an integer >= 0, got {v!r:.40}")
    return int(v)


def _seed(what: str, v) -> int:
    """``v`` as a sampling seed (an int in [0, 2**64), as generate keeps, a NumPy integer
    included), else a ConfigError in ``what``'s name.

    >>> _seed("Trainer.sample", None)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: Trainer.sample: seed must be an int in [0, 2**64), got None
    """
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < 1 << 64:
        raise ConfigError(f"{what}: seed must be an int in [0, 2**64), got {v!r:.40}")
    return int(v)


def _ckpt_id(folder: Path):
    """``(model file sha256, step)`` of the checkpoint in ``folder`` as its state.json says,
    or None where there is none (a Trainer tells its own checkpoint from a newer one so)."""
    state = read_state(folder)
    try:
        return state["model_file"]["sha256"], state["meta"].get("step")
    except (KeyError, TypeError, AttributeError):
        return None


DIGEST_MAX_BYTES = 2 << 30   # a shard folder up to this size gets a token digest (about 1 s a GB)


def tokens_digest(train: list, val: list, chunk: int = 1 << 20) -> str:
    """sha256 of the train then val token ids, each as little-endian int64 (in chunks: a
    shard of uint16 ids is not widened whole); ``train`` and ``val`` are lists of id arrays
    (shards), joined in order.

    >>> tokens_digest([[1, 2]], [[3]]) == tokens_digest([np.array([1], np.uint16), np.array([2])], [[3]])
    True
    """
    h = hashlib.sha256()
    for part in (train, val):
        for a in part:
            a = np.asarray(a)
            for i in range(0, len(a), chunk):
                h.update(np.ascontiguousarray(a[i:i + chunk], dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def numerics_changed(was: Optional[dict], now: dict) -> list:
    """``"KEY: BEFORE before, AFTER now"`` for each entry of a checkpoint's ``numerics``
    (``was``; None for one written before they were recorded: nothing to compare) that
    differs from ``now``.

    >>> numerics_changed({"device": "cpu", "cpu_kernels": "c"}, {"device": "cpu", "cpu_kernels": "numpy"})
    ['cpu_kernels: c before, numpy now']
    """
    if not isinstance(was, dict):
        return []
    keys = sorted(set(was) | set(now), key=lambda k: (k != "device", k))
    return [f"{k}: {was.get(k, 'unset')} before, {now.get(k, 'unset')} now"
            for k in keys if was.get(k) != now.get(k)]


def no_checkpoint(out_dir, held) -> str:
    """Why a run in ``out_dir`` cannot be resumed when it has no checkpoint; ``held``: the
    run's files the folder holds (then training without --resume is refused too).

    >>> no_checkpoint("runs/a", ["log.jsonl"])  # doctest: +ELLIPSIS
    'cannot resume: runs/a holds a run (log.jsonl) but no checkpoint in runs/a/ckpt ...; start it over with --overwrite'
    """
    ckpt = Path(out_dir) / CKPT_NAME
    tmp = ckpt.with_name(CKPT_NAME + ".tmp")
    trash = trash_folders(out_dir)
    if trash and not ckpt.exists():
        return (f"cannot resume: no checkpoint in {ckpt}: an --overwrite was stopped as it removed the earlier "
                f"run (what was left of it is in {trash[0]}, which the next run removes); start over with "
                f"--overwrite")
    if (tmp / "state.json").is_file():
        # a first save stopped between writing its last file and its rename: its state.json is
        # written last and records the weights' sha256, which a load checks
        return (f"cannot resume: {out_dir} has no checkpoint in {ckpt}, but {tmp} holds one whose save stopped "
                f"before its last rename; to go on from it, rename it to {ckpt} and resume (the weights are "
                f"checked against the sha256 it recorded); --overwrite would remove it and start over")
    if held:
        return (f"cannot resume: {out_dir} holds a run ({', '.join(held)}) but no checkpoint in {ckpt} (it "
                f"stopped before saving one); start it over with --overwrite")
    return f"cannot resume: no checkpoint in {ckpt}; train without --resume first (or point --out at the run to resume)"


def _same_path(a: str, b: str) -> bool:
    """Whether two ``data`` settings name the same file ("" is the default corpus).

    >>> _same_path("t.txt", "./t.txt"), _same_path("t.txt", "")
    (True, False)
    """
    if not a or not b:
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


# the folders of a run that it writes and replaces: no place for another run
_RUN_PARTS = tuple(n + x for n in (CKPT_NAME, BEST_NAME) for x in ("", ".old", ".tmp")) + (DATA_NAME,)


def _enclosing_run(out) -> Optional[tuple]:
    """``(run folder, part)`` when ``out`` is in a run's ``ckpt/``, ``best/`` or ``data/``
    (``_RUN_PARTS``), as written or with its links resolved; else None."""
    p = Path(os.path.expanduser(str(out)))
    # as written (its ".." parts taken away: r/ckpt/../sub is r/sub) and with links resolved
    for path in (Path(os.path.normpath(p)), Path(os.path.realpath(p))):
        for child in (path, *path.parents):
            if child.parent == child:
                break
            if child.name in _RUN_PARTS and holds_run(child.parent):
                return child.parent, child.name
    return None


def _is_shard_folder(path) -> bool:
    """Whether ``path`` is a data folder ``data.shard_folder`` takes."""
    try:
        shard_folder(path)
        return True
    except DataError:
        return False


def _val_words(kind: Optional[str]) -> str:
    return {"full": "every window of the val shard", "sampled": "an estimate on a few val batches",
            "capped": "the first --final-eval-windows windows of the val shards"}.get(kind, "from the checkpoint")


def _arch(c: GPT2Config) -> str:
    """The model's sizes in words, for the trainer's messages.

    >>> _arch(GPT2Config(vocab_size=65, block_size=64, n_layer=1, n_head=1, n_embd=32))
    '1 layer, 1 head, 32 channels, context 64, vocab 65'
    """
    return (f"{c.n_layer} {plural(c.n_layer, 'layer')}, {c.n_head} {plural(c.n_head, 'head')}, "
            f"{c.n_embd} channels, context {c.block_size}, vocab {c.vocab_size}")


_MOVED = {"load_model": "load", "resolve_checkpoint": "load", "hf_tokenizer_dict": "load",
          "HF_TOKENIZER_FILE": "load"}


def __getattr__(name):
    # loading models moved to forge_ml.inference.load (one release of grace)
    if name in _MOVED:
        import importlib
        import warnings
        warnings.warn(f"forge_ml.train.{name} moved to forge_ml.inference.{_MOVED[name]}.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f".inference.{_MOVED[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
