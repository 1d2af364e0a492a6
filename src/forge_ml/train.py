"""The training loop: data, model, AdamW, schedule, clipping, evaluation, samples, logs and
checkpoints that resume bit for bit.

``TrainConfig`` holds every knob (an unknown key is a ConfigError). ``Trainer`` prepares the
data (a text file, a folder of shards, or the standard library's own source when none is
given), builds or resumes the model and optimizer, and ``train()`` runs the loop:

- gradient accumulation: micro-batch gradients are summed with ``ops.add``; the 1/n that
  averages them and the clipping factor both ride in AdamW's ``grad_scale`` (no extra pass);
- the warmup + cosine schedule of ``optim.cosine_lr``; global-norm clipping;
- dropout masks seeded from ``(seed, step, micro-step)``, batches from the loader's saved
  PCG64 state: so N steps equal N/2 steps, a checkpoint, a resume and N/2 more, bit for bit;
- an eval loss on fixed validation windows every ``eval_interval`` steps, a sample every
  ``sample_interval``, a JSON-lines log (``log.jsonl``) of every step, ``loss.png`` at the end,
  and a checkpoint in ``<out_dir>/ckpt`` every ``checkpoint_interval`` steps and at the end;
- a NaN or infinite loss stops the run with a TrainingError naming the step and the last
  good checkpoint.

Mixed precision (``dtype="bf16"``, on a device with bf16 storage): AdamW keeps the float32
master weights and moments and puts bf16 compute copies in the model, which its fused update
rewrites (``AdamW(..., compute_dtype="bfloat16")``).

>>> import tempfile, os
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("hello world\\n" * 300)
>>> cfg = TrainConfig(data=p, out_dir=os.path.join(d, "run"), n_layer=1, n_head=2, n_embd=16,
...                   block_size=16, batch_size=4, max_steps=3, eval_interval=0, sample_interval=0,
...                   progress=False)
>>> summary = Trainer(cfg, log=None).train()
>>> summary["step"], os.path.isdir(os.path.join(d, "run", "ckpt"))
(3, True)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import ops
from .autograd import Tape
from .checkpoint import check_architecture, load_checkpoint, pack_tensors, save_checkpoint, unpack_tensors
from .data import DataLoader, default_corpus, prepare, read_shard
from .device import Device
from .errors import CheckpointError, ConfigError, DataError, TrainingError
from .inference.generate import stream_tokens
from .inference.load import CKPT_NAME
from .models.gpt2 import GPT2, GPT2Config, PRESETS, param_shapes
from .optim import AdamW, clip_grad_norm, cosine_lr
from .tensor import device_has, tensor
from .tokenizer import tokenizer_from_dict

DATA_NAME = "data"          # <out_dir>/data: shards prepared from a text file
LOG_NAME = "log.jsonl"
PLOT_NAME = "loss.png"
# The model used when neither a preset nor sizes are given: nanoGPT's CPU configuration.
DEFAULT_SIZES = dict(n_layer=4, n_head=4, n_embd=128)


@dataclass
class TrainConfig:
    """Every setting of a training run, with its default. Build from a dict with
    ``from_dict`` (an unknown key is a ConfigError).

    >>> TrainConfig(max_steps=10).lr
    0.001
    >>> TrainConfig.from_dict({"max_step": 10})
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: TrainConfig: unknown key 'max_step' (did you mean 'max_steps'?)
    """

    # data: a text file (prepared into <out_dir>/data), a folder holding train.bin, val.bin and
    # tokenizer.json, or "" for data.default_corpus() (the standard library's source)
    data: str = ""
    tokenizer: str = "char"          # how a text file is tokenized: "char" or "gpt2"
    val_fraction: float = 0.1
    corpus_bytes: int = 3_000_000    # size of the default corpus
    # model: a preset of models.gpt2.PRESETS, or sizes (0 = the preset's, else DEFAULT_SIZES)
    model: str = ""
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    block_size: int = 64
    dropout: float = 0.0
    # where and how
    device: str = "cpu"
    dtype: str = "float32"           # "float32", or "bf16" (GPU mixed precision)
    # optimisation (defaults: nanoGPT's shakespeare_char scaled for a CPU)
    batch_size: int = 12
    grad_accum: int = 1
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    lr_decay_steps: int = 0          # where the cosine reaches min_lr; 0 = max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99              # nanoGPT's choice for small char models (GPT-2 used 0.95)
    grad_clip: float = 1.0           # max global norm; 0 disables
    # monitoring
    eval_interval: int = 250         # 0 disables periodic eval (the final one still runs)
    eval_iters: int = 20
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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, f.type, getattr(self, f.name)))
        checks = [
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.grad_accum >= 1, "grad_accum must be >= 1"),
            (self.max_steps >= 0, "max_steps must be >= 0"),
            (self.lr >= 0 and self.min_lr >= 0, "lr and min_lr must be >= 0"),
            (self.warmup >= 0 and self.lr_decay_steps >= 0, "warmup and lr_decay_steps must be >= 0"),
            (0.0 <= self.dropout < 1.0, "dropout must be in [0, 1)"),
            (0.0 < self.val_fraction < 1.0, "val_fraction must be in (0, 1)"),
            (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0, "beta1 and beta2 must be in [0, 1)"),
            (self.weight_decay >= 0 and self.grad_clip >= 0, "weight_decay and grad_clip must be >= 0"),
            (self.eval_iters >= 1, "eval_iters must be >= 1"),
            (min(self.eval_interval, self.sample_interval, self.checkpoint_interval,
                 self.sample_tokens, self.log_interval, self.n_layer, self.n_head, self.n_embd) >= 0,
             "intervals, counts and sizes must be >= 0"),
            (self.tokenizer in ("char", "gpt2"), f"tokenizer must be 'char' or 'gpt2', got {self.tokenizer!r}"),
            (self.dtype in ("float32", "bf16", "bfloat16"), f"dtype must be 'float32' or 'bf16', got {self.dtype!r}"),
            (self.model == "" or self.model in PRESETS,
             f"unknown model preset {self.model!r}; expected one of {', '.join(PRESETS)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"TrainConfig: {msg}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Build from a dict; an unknown key is a ConfigError naming the nearest known key.

        >>> TrainConfig.from_dict({"lr": 3e-4}).lr
        0.0003
        """
        known = [f.name for f in dataclasses.fields(cls)]
        for k in d:
            if k not in known:
                import difflib
                near = difflib.get_close_matches(k, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(known)}"
                raise ConfigError(f"TrainConfig: unknown key {k!r}{hint}")
        return cls(**d)

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


def _coerce(name, typ, value):
    """Check a TrainConfig value against its annotated type (ints are accepted as floats)."""
    typ = typ if isinstance(typ, str) else typ.__name__
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
    raise ConfigError(f"TrainConfig: {name} must be {typ}, got {value!r}")


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


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """Builds (or resumes) a run from a ``TrainConfig`` and trains it with ``train()``.

    ``resume=True`` restores weights, moments, schedule position, step, data position and the
    dropout stream from ``<out_dir>/ckpt``. ``log``: where text lines go (``print`` by
    default; None for silence).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("ab\\n" * 500)
    >>> t = Trainer(TrainConfig(data=p, out_dir=d, n_layer=1, n_head=1, n_embd=8, block_size=8,
    ...                         max_steps=2, progress=False), log=None)
    >>> t.model.config.vocab_size, t.step
    (3, 0)
    """

    def __init__(self, config: TrainConfig, resume: bool = False, log: Optional[Callable] = print):
        if isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        cfg = self.cfg = config
        self._log = log
        self.device = Device.parse(cfg.device)
        self.bf16 = cfg.dtype in ("bf16", "bfloat16")
        if self.bf16 and not device_has(self.device, "bf16"):
            raise ConfigError(f"dtype bf16 is mixed precision on a device with bf16 storage; the "
                              f"{self.device.type} backend computes in float32 (use --device cuda)")
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / CKPT_NAME
        self.log_path = self.out_dir / LOG_NAME
        ckpt = None
        if resume:
            if not (self.ckpt_dir / "state.json").is_file() and not self.ckpt_dir.with_name(CKPT_NAME + ".old").is_dir():
                raise CheckpointError(f"cannot resume: no checkpoint in {self.ckpt_dir}; train without "
                                      f"--resume first (or point --out at the run to resume)")
            ckpt = load_checkpoint(self.ckpt_dir)

        # -- data -------------------------------------------------------------------------
        self.data_dir = self._data_dir(resume)
        tok_path = self.data_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise DataError(f"{self.data_dir} has no tokenizer.json; prepare the data with "
                            f"`forge-ml prepare TEXT --out {self.data_dir}`")
        self.tokenizer = tokenizer_from_dict(json.loads(tok_path.read_text(encoding="utf-8")))
        B, T = cfg.batch_size, cfg.block_size
        self.train_loader = DataLoader(self.data_dir / "train.bin", B, T, seed=cfg.seed)
        self.val_loader = DataLoader(self.data_dir / "val.bin", B, T, seed=cfg.seed)
        ids_max = int(np.max(read_shard(self.data_dir / "train.bin"), initial=0))
        if ids_max >= self.tokenizer.vocab_size:
            raise DataError(f"{self.data_dir}/train.bin holds token {ids_max} but the tokenizer has "
                            f"{self.tokenizer.vocab_size} ids; the shards and tokenizer.json disagree")

        # -- model and optimizer ----------------------------------------------------------
        want = GPT2Config(vocab_size=self.tokenizer.vocab_size, block_size=T, dropout=cfg.dropout,
                          **cfg.model_sizes())
        self.step = 0
        self.elapsed = 0.0          # training seconds before this process (from the checkpoint)
        self.last_ckpt_step = None
        self.losses: list = []        # this process's per-step training losses
        self.val_loss: Optional[float] = None
        if ckpt is None:
            self.model = GPT2.init(want, seed=cfg.seed, device=self.device)
        else:
            self.model = self._restore_model(ckpt, want)
        # bf16: the optimizer keeps the float32 masters and gives the model bf16 compute copies
        self.opt = AdamW(self.model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         weight_decay=cfg.weight_decay,
                         compute_dtype="bfloat16" if self.bf16 else None)
        if ckpt is not None:
            self._restore_state(ckpt)
        else:
            self._truncate_log(0)  # a new run in an old folder starts a new log
            if (self.ckpt_dir / "state.json").is_file():
                self._say(f"note: {self.ckpt_dir} holds an earlier run's checkpoint; this run starts over "
                          f"and will replace it (--resume continues it instead)")

    # -- setup helpers --------------------------------------------------------------------
    def _data_dir(self, resume: bool) -> Path:
        """The folder with train.bin / val.bin / tokenizer.json, preparing it if needed."""
        cfg = self.cfg
        if cfg.data and Path(cfg.data).is_dir():
            d = Path(cfg.data)
            missing = [f for f in ("train.bin", "val.bin", "tokenizer.json") if not (d / f).is_file()]
            if missing:
                raise DataError(f"data folder {d} lacks {', '.join(missing)}; expected the output of "
                                f"`forge-ml prepare TEXT --out {d}` (or give a text file)")
            return d
        d = self.out_dir / DATA_NAME
        if resume and all((d / f).is_file() for f in ("train.bin", "val.bin", "tokenizer.json")):
            return d  # the exact tokens the run started with
        if cfg.data:
            src = Path(cfg.data)
            if not src.is_file():
                raise DataError(f"text file not found: {src}")
        else:
            d.mkdir(parents=True, exist_ok=True)
            src = d / "corpus.txt"
            src.write_text(default_corpus(cfg.corpus_bytes), encoding="utf-8")
        info = prepare(src, d, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction)
        self._say(f"prepared {src}: {info['train_tokens']:,} train + {info['val_tokens']:,} val tokens, "
                  f"{info['vocab_size']} {info['tokenizer']} tokens in the vocabulary -> {d}")
        return d

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
        if meta.get("tokenizer") and meta["tokenizer"] != self.tokenizer.to_dict():
            raise CheckpointError(f"{self.ckpt_dir} was trained with another tokenizer than the one in "
                                  f"{self.data_dir}/tokenizer.json")
        return GPT2.from_state_dict(want, params, device=self.device)

    def _restore_state(self, ckpt) -> None:
        tensors, meta = ckpt
        _, m, v = unpack_tensors(tensors)
        self.opt.load_state_dict(dict(meta["optimizer"], m=m, v=v))
        self.opt.lr, self.opt.weight_decay = self.cfg.lr, self.cfg.weight_decay
        self.train_loader.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.elapsed = float(meta.get("elapsed", 0.0))
        self.last_ckpt_step = self.step
        self.val_loss = meta.get("val_loss")
        rng = meta.get("rng", {})
        if rng.get("seed", self.cfg.seed) != self.cfg.seed:
            raise CheckpointError(f"{self.ckpt_dir} was trained with seed {rng['seed']}, this run asks for "
                                  f"{self.cfg.seed}; resume with the same seed")
        self._truncate_log(self.step)

    # -- output helpers ---------------------------------------------------------------------
    def _say(self, msg: str) -> None:
        if self._log is None:
            return
        if getattr(self, "_bar", None) is not None:
            self._bar.write(msg)
        else:
            self._log(msg)

    def _truncate_log(self, step: int) -> None:
        """Drop log records past ``step`` (from a run that went on after its last checkpoint)."""
        if not self.log_path.is_file():
            return
        keep = [ln for ln in self.log_path.read_text(encoding="utf-8").splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.log_path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")

    def _write_log(self, record: dict) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- the pieces of a step -------------------------------------------------------------------
    def _batch(self):
        x, y = self.train_loader.next_batch()                     # (B, T) int64 each
        return tensor(x, device=self.device), tensor(y, device=self.device)

    def train_step(self) -> dict:
        """One optimizer step (``grad_accum`` micro-batches); returns its log record."""
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        lr = cosine_lr(step, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr)
        acc, loss_sum = None, 0.0
        for micro in range(cfg.grad_accum):
            x, y = self._batch()
            loss, grads = self.model.loss_and_grads(x, y, dropout_seed=dropout_seed(cfg.seed, step, micro))
            if not math.isfinite(loss):
                raise TrainingError(f"the loss is {loss} at step {step + 1}"
                                    + (f" (micro-step {micro + 1})" if cfg.grad_accum > 1 else "")
                                    + f"; stopping. {self._last_good()}")
            loss_sum += loss
            if cfg.grad_accum > 1 and self.bf16:
                grads = {k: g.to("float32") for k, g in grads.items()}  # accumulate in float32
            acc = grads if acc is None else {k: ops.add(acc[k], g) for k, g in grads.items()}
        loss = loss_sum / cfg.grad_accum
        norm, scale = clip_grad_norm(acc, cfg.grad_clip, grad_scale=1.0 / cfg.grad_accum)
        if not math.isfinite(norm):
            raise TrainingError(f"the gradient norm is {norm} at step {step + 1} (loss {loss:.4f}); "
                                f"stopping. {self._last_good()}")
        self.opt.step(acc, lr=lr, grad_scale=scale)
        self.step += 1
        dt = time.perf_counter() - t0
        self.elapsed += dt
        tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": tokens / dt, "time": round(self.elapsed, 4), "dt_ms": round(dt * 1e3, 3)}

    def _last_good(self) -> str:
        if self.last_ckpt_step is None:
            return f"No checkpoint was saved yet in {self.ckpt_dir}; lower --lr or raise --warmup and start again"
        return (f"The last good checkpoint is {self.ckpt_dir} (step {self.last_ckpt_step}); resume from "
                f"it with --resume, with a lower --lr or a larger --warmup")

    def evaluate(self, iters: Optional[int] = None) -> float:
        """Mean loss over ``iters`` fixed validation batches (no dropout); the same windows at
        every call, so evaluations are comparable across a run and across a resume."""
        iters = self.cfg.eval_iters if iters is None else iters
        total = 0.0
        for x, y in self.val_loader.eval_batches(iters):
            _, loss, _ = self.model.forward(Tape(), tensor(x, device=self.device),
                                            tensor(y, device=self.device), train=False)
            total += loss.t.item()
        return total / iters

    def sample(self, n_tokens: Optional[int] = None, prompt: Optional[str] = None, seed: int = 0) -> str:
        """Text the model writes after ``prompt`` (default: the config's, or a newline)."""
        n_tokens = self.cfg.sample_tokens if n_tokens is None else n_tokens
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        tok = self.tokenizer
        if prompt:
            ids = tok.encode(prompt)
        elif tok.kind == "gpt2":
            ids = [tok.eot_token]
        else:
            ids = tok.encode("\n") if "\n" in tok.chars else [0]
        # from the float32 masters, as a float32 run computes
        masters = GPT2(self.model.config, self.opt.params)
        out = list(stream_tokens(masters, ids, n_tokens, temperature=self.cfg.sample_temperature,
                                 top_k=40, seed=seed))
        return prompt + tok.decode(out)

    def save(self) -> Path:
        """Write the checkpoint of the current step to ``<out_dir>/ckpt`` (atomically)."""
        cfg = self.cfg
        opt_state = self.opt.state_dict()
        masters = {k: t.numpy() for k, t in self.opt.params.items()}   # float32, also in bf16 runs
        tensors = pack_tensors(masters, opt_state.pop("m"), opt_state.pop("v"))
        meta = {
            "kind": "forge-ml-train",
            "config": self.model.config.to_dict(),
            "train_config": cfg.to_dict(),
            "step": self.step,
            "optimizer": opt_state,
            "data": self.train_loader.state_dict(),
            "data_dir": str(self.data_dir.resolve()),
            "rng": {"seed": cfg.seed, "dropout_seed": "splitmix64(seed, step, micro_step)",
                    "next_step": self.step},
            "tokenizer": self.tokenizer.to_dict(),
            "elapsed": self.elapsed,
            "val_loss": self.val_loss,
        }
        save_checkpoint(self.ckpt_dir, tensors, meta)
        self.last_ckpt_step = self.step
        return self.ckpt_dir

    # -- the loop -------------------------------------------------------------------------------
    def train(self, until: Optional[int] = None) -> dict:
        """Train from the current step up to ``until`` (default ``max_steps``) steps, then
        evaluate, checkpoint and plot. Returns a summary (``step``, ``loss``, ``val_loss``,
        ``losses`` of this call, ``checkpoint``). Ctrl-C saves a checkpoint, then re-raises.
        """
        cfg = self.cfg
        until = cfg.max_steps if until is None else min(until, cfg.max_steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._say(f"model: {self.model.num_params():,} parameters ({_arch(self.model.config)}); "
                  f"{self.train_loader.n_tokens:,} train tokens; device {self.device}, {cfg.dtype}; "
                  f"steps {self.step} -> {until}; out {self.out_dir}")
        self._bar = self._make_bar(until)
        first = self.step
        try:
            while self.step < until:
                rec = self.train_step()
                self.losses.append(rec["loss"])
                self._write_log(rec)
                s = self.step
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                                          refresh=False)
                elif cfg.log_interval and (s % cfg.log_interval == 0 or s == first + 1):
                    self._say(f"step {s:>6}/{until}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                              f"norm {rec['grad_norm']:.3f}  {rec['tokens_per_s']:,.0f} tok/s  "
                              f"{rec['dt_ms']:.0f} ms/step")
                if cfg.eval_interval and s % cfg.eval_interval == 0 and s < until:
                    self._eval_and_log()
                if cfg.sample_interval and s % cfg.sample_interval == 0 and s < until:
                    self._sample_and_show()
                if cfg.checkpoint_interval and s % cfg.checkpoint_interval == 0 and s < until:
                    self.save()
        except KeyboardInterrupt:
            self._close_bar()
            if self.step > first:
                self.save()
                self._say(f"interrupted at step {self.step}; checkpoint saved to {self.ckpt_dir}")
            raise
        except BaseException:
            self._close_bar()
            raise
        self._close_bar()
        if self.step > first or self.val_loss is None:
            self._eval_and_log()
        if cfg.sample_interval and self.step > first:
            self._sample_and_show()
        self.save()
        plot = self.plot()
        self._say(f"done: step {self.step}, val loss {self.val_loss:.4f}; checkpoint {self.ckpt_dir}"
                  + (f"; loss curve {plot}" if plot else ""))
        return {"step": self.step, "loss": self.losses[-1] if self.losses else None,
                "val_loss": self.val_loss, "losses": list(self.losses), "checkpoint": str(self.ckpt_dir)}

    def _eval_and_log(self) -> None:
        self.val_loss = self.evaluate()
        self._write_log({"step": self.step, "val_loss": self.val_loss})
        self._say(f"step {self.step}: val loss {self.val_loss:.4f} (perplexity {math.exp(min(self.val_loss, 50)):.2f})")

    def _sample_and_show(self) -> None:
        text = self.sample(seed=self.cfg.seed + self.step)
        self._say(f"---- sample at step {self.step} ----\n{text}\n" + "-" * 36)

    def _make_bar(self, until: int):
        if not (self.cfg.progress and self._log is not None and sys.stderr.isatty()):
            return None
        from tqdm import tqdm
        return tqdm(total=until, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def _close_bar(self) -> None:
        if getattr(self, "_bar", None) is not None:
            self._bar.close()
        self._bar = None

    def plot(self) -> Optional[Path]:
        """Draw ``loss.png`` (train loss per step, val loss points) from the log; returns its
        path, or None when matplotlib is missing."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        train, val = [], []
        for ln in self.log_path.read_text(encoding="utf-8").splitlines():
            r = json.loads(ln)
            if "loss" in r:
                train.append((r["step"], r["loss"]))
            elif "val_loss" in r:
                val.append((r["step"], r["val_loss"]))
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), lw=0.8, label="train")
        if val:
            ax.plot(*zip(*val), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"forge-ml: {_arch(self.model.config)}")
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.out_dir / PLOT_NAME
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path


def _arch(c: GPT2Config) -> str:
    return f"{c.n_layer} layers, {c.n_head} heads, {c.n_embd} channels, context {c.block_size}, vocab {c.vocab_size}"


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
