"""The ``forge-ml`` command: train | sample | eval | prepare | convert | bench | serve | check.

``forge-ml train`` with no argument trains a small character-level GPT for a few minutes on
the CPU, on the Python standard library's own source, printing samples as it learns and
checkpointing to ``./runs/default``. Every subcommand has ``--help`` with an example.

Bad input (a missing file, an unknown key, a prompt longer than the context, characters
outside a character vocabulary, a checkpoint of another architecture, ...) prints one line on
stderr and exits with status 2; no traceback.

>>> main(["prepare", "--help"])  # doctest: +ELLIPSIS
usage: forge-ml prepare ...
0
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib.util
import itertools
import json
import math
import os
import re
import runpy
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

from . import blas as _blas
from . import flags
from .errors import CLI_WORDS, ConfigError, DataError, ForgeError, TrainingError, plural

PROG = "forge-ml"


_TRAIN_HELP = {
    "data": "text file to train on (prepared into OUT/data), a folder from `forge-ml prepare`, or a folder "
            "of llm.c token shards (its sorted *train*.bin and *val*.bin; GPT-2 ids unless a tokenizer.json "
            "is beside them; shards named exactly train.bin and val.bin are taken for a prepare folder, "
            "which needs its tokenizer.json or --tokenizer gpt2); default: the Python standard library's "
            "source",
    "tokenizer": "tokenizer for a text file: char or gpt2 (default: the --init-from source's; a data "
                 "folder's own: its tokenizer.json, else GPT-2 for llm.c shards, where char is refused; "
                 "else char)",
    "model": "a preset: nano-cpu, gpt2, gpt2-medium, gpt2-large, gpt2-xl (default: none; the sizes below)",
    "n_layer": "transformer blocks (default: the preset's, else 4)",
    "n_head": "attention heads (default: the preset's, else 4)",
    "n_embd": "channels (default: the preset's, else 128)",
    "block_size": "context length in tokens (default: --init-from's context, the preset's: 1024 for gpt2*, else 64)",
    "val_fraction": "share of a text file's tokens kept for validation",
    "corpus_bytes": "size of the default corpus, at least (whole standard-library files are taken until "
                    "it is reached)", "dropout": "dropout probability",
    "batch_size": "sequences per micro-batch, or auto: the largest that fits the GPU, measured at the start "
                  "(default: 12)",
    "total_batch_size": "sequences per optimizer step; sets grad-accum to this / batch-size (with "
                        "--batch-size auto, the micro-batch is the largest divisor of it that fits) "
                        "(default: batch-size x grad-accum)",
    "init_from": "start a new run (fresh optimizer, step 0) from a forge-ml checkpoint or run folder, or a "
                 "Hugging Face GPT-2 folder: its weights, architecture and tokenizer (default: none)",
    "weight_decay": "AdamW weight decay (2-D weights only)",
    "beta1": "AdamW beta1", "beta2": "AdamW beta2",
    "eval_iters": "val batches of the periodic estimate: the first ones, the same at every evaluation "
                  "(nanoGPT draws random ones; none at step 0); the final evaluation covers every window, "
                  "up to --final-eval-windows",
    "final_eval_windows": "the final evaluation covers every window of the val shards up to this many, "
                          "else the first this many (val_kind capped in log.jsonl); 0: every window "
                          "(default: 10000)",
    "sample_tokens": "tokens per sample", "sample_prompt": "text each sample starts from",
    "sample_temperature": "sampling temperature",
    "log_interval": "steps between log lines (0: none; the first step's is always printed; on a terminal "
                    "the progress bar shows the steps instead: add --no-progress for the lines)",
    "progress": "show a progress bar on a terminal", "seed": "seed of init, data order and dropout",
    "device": "cpu, cuda or cuda:N", "dtype": "float32, or bf16 (GPU mixed precision)",
    "max_steps": "optimizer steps to train for (nanoGPT's max_iters N runs N + 1)",
    "grad_accum": "micro-batches per step",
    "lr": "peak learning rate",
    "min_lr": "final learning rate of the cosine (default: lr / 10; a resumed run keeps the min-lr it "
              "recorded)",
    "warmup": "linear warmup steps: step s (from 0) runs at lr (s + 1) / warmup (llm.c's; nanoGPT's "
              "divides by warmup + 1)",
    "lr_decay_steps": "step where the cosine ends (0: max-steps; fix it to extend a run by --resume "
                      "--max-steps as one longer run would have trained)",
    "grad_clip": "max global gradient norm (0: off)", "eval_interval": "steps between val evals (0: only the final evaluation)",
    "sample_interval": "steps between samples (0: off)", "checkpoint_interval": "steps between checkpoints (0: only at the end)",
    "out_dir": "run folder for checkpoints, log.jsonl and loss.png",
    "keep_best": "also keep the model of the lowest val loss so far in OUT/best (a model checkpoint: "
                 "sample, eval, convert and --init-from read it), as nanoGPT's always_save_checkpoint=False "
                 "does; the periodic val loss is over the first --eval-iters batches (default: off)",
}


def _batch_size_arg(text: str):
    """``--batch-size``: a whole number or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.HelpFormatter):
    """Fills descriptions to the width; keeps an epilog of examples as written."""

    def _fill_text(self, text, width, indent):
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _fmt():
    return lambda prog: _Formatter(prog, max_help_position=34, width=100)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``forge-ml`` (all subcommands).

    >>> build_parser().parse_args(["sample", "--ckpt", "runs/default"]).max_new_tokens
    200
    """
    from .train import TrainConfig, train_flag

    p = _Parser(prog=PROG, formatter_class=_fmt(),
                description="forge-ml: train and run GPT-2 class models on the CPU and NVIDIA GPUs.",
                epilog="examples:\n  forge-ml train                 # a small char GPT on the stdlib source\n"
                       "  forge-ml sample --ckpt runs/default --prompt 'def '\n"
                       "  forge-ml SUBCOMMAND --help")
    from . import __version__
    p.add_argument("--version", action="version", version=f"forge-ml {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="SUBCOMMAND", parser_class=_Parser)

    # -- train ----------------------------------------------------------------------------------
    t = sub.add_parser(
        "train", help="train a GPT (default: a small char model on the stdlib source)",
        formatter_class=_fmt(),
        description="Train a GPT-2 class model. With no argument: a small character-level GPT on the "
                    "Python standard library's own source, 1-2.5 minutes on a 2-core CPU, samples "
                    "printed as it learns, checkpoints in ./runs/default. Every TrainConfig key is a "
                    "flag.",
        epilog="examples:\n"
               "  forge-ml train\n"
               "  forge-ml train --data shakespeare.txt --out runs/shakespeare --max-steps 2000\n"
               "  forge-ml train --out runs/shakespeare --resume --max-steps 4000\n"
               "  forge-ml train --data book.txt --tokenizer gpt2 --model gpt2 --block-size 256 "
               "--device cuda --dtype bf16\n"
               "  forge-ml train --init-from ~/gpt2 --data my.txt --out runs/ft --lr 1e-4 --max-steps 500\n"
               "  forge-ml train --data dev/data/fineweb10B --model gpt2 --block-size 1024 --device cuda  "
               "# llm.c shards\n"
               "  forge-ml train --device cuda --batch-size auto --total-batch-size 64\n"
               "  forge-ml train --model gpt2 --gpus 8 --zero 1 --dtype bf16 --data book.txt --tokenizer gpt2\n"
               "Ctrl-C (or SIGTERM) finishes the step in flight, saves a checkpoint and exits 130 (143);\n"
               "--resume then goes on exactly as if the run had not stopped.")
    again = t.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in OUT from its checkpoint (exactly where it stopped)")
    again.add_argument("--overwrite", action="store_true",
                       help="start over in an OUT that holds a run (its checkpoint, log and data are replaced)")
    t.add_argument("--config", metavar="JSON", help="a JSON file of TrainConfig keys (flags override it)")
    t.add_argument("--gpus", type=int, default=0, metavar="N",
                   help="data-parallel training on N GPUs of this machine (one process each, NCCL); "
                        "launched by torchrun or mpirun, the processes need no flag")
    t.add_argument("--zero", type=int, choices=[0, 1], default=0,
                   help="with several GPUs: 1 shards the AdamW state and master weights (ZeRO-1)")
    t.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB",
                   help="with several GPUs: gradients are all-reduced in buckets of this size "
                        "(0: one bucket per parameter; default 25)")
    for f in dataclasses.fields(TrainConfig):
        flag = train_flag(f.name)
        ftype = f.type if isinstance(f.type, str) else f.type.__name__
        ftype = ftype[len("Optional["):-1] if ftype.startswith("Optional[") else ftype
        hlp = _TRAIN_HELP.get(f.name, "")
        if "default:" not in hlp:
            hlp += f" (default: {f.default!r})"
        if ftype == "bool":
            t.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=hlp)
        elif f.name == "batch_size":
            t.add_argument(flag, dest=f.name, default=None, metavar="N|auto", type=_batch_size_arg, help=hlp)
        else:
            t.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper() if ftype == "str" else ftype.upper(),
                           type={"int": int, "float": float, "str": str}[ftype], help=hlp)

    # -- sample ---------------------------------------------------------------------------------
    s = sub.add_parser(
        "sample", help="generate text from a checkpoint (streams tokens as they come)",
        formatter_class=_fmt(),
        description="Generate text from a forge-ml checkpoint, a run folder, or a Hugging Face GPT-2 "
                    "folder (config.json + model.safetensors). Past the context length, generation goes "
                    "on from the last half context (not with --logprobs or --num-beams, which stop "
                    "there, with a note on stderr).",
        epilog="examples:\n"
               "  forge-ml sample --ckpt runs/default --prompt 'def main(' --max-new-tokens 300\n"
               "  forge-ml sample --ckpt ~/gpt2 --prompt 'Hello, I am' --top-k 40 --seed 1\n"
               "  forge-ml sample --ckpt ~/gpt2 --prompt 'The' --temperature 0.9 --min-p 0.05 "
               "--repetition-penalty 1.2 --logprobs 3\n"
               "  forge-ml sample --ckpt ~/gpt2 --prompt 'The' --frequency-penalty 0.5 "
               "--logit-bias 50256:-100\n"
               "  forge-ml sample --ckpt ~/gpt2 --prompt 'The' --num-beams 4 --num-return-sequences 2 "
               "--max-new-tokens 30\n"
               "  forge-ml sample --ckpt runs/default --prompt-file prompt.txt --num-samples 3")
    s.add_argument("--ckpt", required=True, help="checkpoint folder, run folder or HF GPT-2 folder")
    s.add_argument("--prompt", default="", help="text to continue (default: a newline / end-of-text)")
    s.add_argument("--prompt-file", metavar="PATH", default=None,
                   help="read the prompt from a UTF-8 text file, as it is (nanoGPT's start='FILE:...'); "
                        "'-' reads standard input, and a pipe (<(cmd), /dev/stdin) is read as one")
    s.add_argument("--num-samples", type=int, metavar="N", default=1,
                   help="N samples, the i-th drawn with --seed + i, each after a '---' line when N > 1 "
                        "(default 1)")
    s.add_argument("--max-new-tokens", type=int, metavar="N", default=200, help="tokens to generate (default 200)")
    s.add_argument("--temperature", type=float, metavar="T", default=None,   # None: not given (0.8)
                   help="0 is greedy (default 0.8)")
    s.add_argument("--top-k", type=int, metavar="K", default=None, help="sample among the k most likely tokens (0: all, as without it)")
    s.add_argument("--top-p", type=float, metavar="P", default=None, help="nucleus sampling probability")
    s.add_argument("--min-p", type=float, metavar="P", default=None,
                   help="drop tokens less likely than P times the most likely one (0..1)")
    s.add_argument("--repetition-penalty", type=float, metavar="R", default=1.0,
                   help="penalise tokens already in the context: a positive logit is divided by R, a "
                        "negative one multiplied by R (transformers' rule; > 1 discourages repeats; 1 "
                        "is off, the default)")
    s.add_argument("--presence-penalty", type=float, metavar="P", default=0.0,
                   help="OpenAI's presence penalty: P is taken from the logit of every token "
                        "generated at least once so far (-2..2; > 0 favours new tokens; 0, the "
                        "default, is off)")
    s.add_argument("--frequency-penalty", type=float, metavar="F", default=0.0,
                   help="OpenAI's frequency penalty: F times the number of times a token was "
                        "generated so far is taken from its logit (-2..2; 0, the default, is off)")
    s.add_argument("--logit-bias", metavar="ID:BIAS", action="append", default=None,
                   help="OpenAI's logit bias: add BIAS (-100..100) to token ID's logit before "
                        "sampling (100 all but forces it, -100 all but bans it); repeat for more "
                        "tokens")
    s.add_argument("--logprobs", type=int, metavar="N", default=None,
                   help="after the text, each token's log-probability and the N most likely "
                        "alternatives (of the distribution drawn from: at --temperature, "
                        "--repetition-penalty and the OpenAI penalties and bias, before top-k, "
                        "top-p and min-p)")
    s.add_argument("--num-beams", type=int, metavar="K", default=None,
                   help="beam search with K beams (deterministic: refuses the sampling flags "
                        "--temperature, --top-k, --top-p, --min-p, --repetition-penalty and the "
                        "OpenAI penalties and bias but at their off values, --temperature 0 "
                        "being greedy)")
    s.add_argument("--length-penalty", type=float, metavar="L", default=1.0,
                   help="with --num-beams: scores are divided by length**L (> 0 favours longer sequences; "
                        "default 1.0)")
    s.add_argument("--early-stopping", choices=["false", "true", "never"], default="false",
                   help="with --num-beams: when to stop, as in transformers (default false)")
    s.add_argument("--num-return-sequences", type=int, metavar="N", default=1,
                   help="with --num-beams: print the N best sequences (default 1)")
    s.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bf16", "bfloat16"],
                   help="float32, or bf16 weights on the GPU (default float32)")

    # -- eval -----------------------------------------------------------------------------------
    e = sub.add_parser(
        "eval", help="loss and perplexity of a checkpoint on a token shard or a text file",
        formatter_class=_fmt(),
        description="Mean next-token loss and perplexity over consecutive, non-overlapping windows of "
                    "one context length. DATA is an llm.c .bin shard, a data folder (its val shards: "
                    "val.bin, or llm.c's *val*.bin) or a text file (tokenized with the checkpoint's tokenizer).",
        epilog="example:\n  forge-ml eval --ckpt runs/default --data runs/default/data/val.bin")
    e.add_argument("--ckpt", required=True, help="checkpoint folder, run folder or HF GPT-2 folder")
    e.add_argument("--data", required=True, help="a .bin token shard, a data folder (its val shards) or a text file")
    e.add_argument("--block-size", type=int, default=None, metavar="T",
                   help="tokens a window, at most the model's context (default: the windows the run was "
                        "trained on where the checkpoint records them, else the model's context)")
    e.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows per batch (default 8)")
    e.add_argument("--max-batches", type=int, metavar="N", default=None,
                   help="stop after this many batches (>= 1; default: every window)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")

    # -- prepare --------------------------------------------------------------------------------
    pr = sub.add_parser(
        "prepare", help="tokenize a text file into train.bin / val.bin / tokenizer.json",
        formatter_class=_fmt(),
        description="Tokenize TEXT into llm.c shards: OUT/train.bin, OUT/val.bin (the last "
                    "val-fraction of the tokens) and OUT/tokenizer.json.",
        epilog="example:\n  forge-ml prepare shakespeare.txt --out data/shakespeare --tokenizer char")
    pr.add_argument("text", help="a UTF-8 text file")
    pr.add_argument("--out", required=True, help="output folder")
    pr.add_argument("--tokenizer", default="char", choices=["char", "gpt2"], help="char (default) or gpt2")
    pr.add_argument("--val-fraction", type=float, metavar="F", default=0.1, help="share of tokens for val (default 0.1)")
    pr.add_argument("--force", action="store_true",
                    help="replace the shards OUT already holds (without it, such an OUT is refused)")

    # -- convert --------------------------------------------------------------------------------
    c = sub.add_parser(
        "convert", help="Hugging Face GPT-2 <-> forge-ml checkpoint",
        formatter_class=_fmt(),
        description="Convert a Hugging Face GPT-2 folder (config.json + model.safetensors) into a "
                    "forge-ml checkpoint, or a forge-ml checkpoint into a folder that "
                    "transformers' GPT2LMHeadModel.from_pretrained loads, with its tokenizer's files "
                    "for AutoTokenizer (and so pipeline(\"text-generation\", model=OUT)).",
        epilog="examples:\n  forge-ml convert --from-hf ~/gpt2 --out ckpt/gpt2\n"
               "  forge-ml convert --to-hf runs/default --out hf/default --force   # replace an earlier export")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--from-hf", metavar="HF_DIR", help="Hugging Face GPT-2 folder to import")
    g.add_argument("--to-hf", metavar="CKPT", help="forge-ml checkpoint (or run folder) to export")
    c.add_argument("--out", required=True,
                   help="the folder to write: new or empty (never the folder read from)")
    c.add_argument("--force", action="store_true",
                   help="replace an earlier conversion of the same kind in OUT (nothing else is ever replaced)")

    # -- bench ----------------------------------------------------------------------------------
    b = sub.add_parser(
        "bench", help="run a benchmark from benchmarks/ or a built-in training-step timing",
        formatter_class=_fmt(),
        description="Without NAME: time forge-ml training steps of nanoGPT's CPU model (4 layers, "
                    "128 channels, context 64, batch 12). With NAME: run benchmarks/NAME.py, with "
                    "the arguments after NAME (NAME --help lists its own).",
        epilog="examples:\n  forge-ml bench\n  forge-ml bench train_cpu\n"
               "  forge-ml bench train_cpu --steps 5 --rounds 1\n  forge-ml bench --list")
    b.add_argument("name", nargs="?", help="a benchmark in benchmarks/ (e.g. train_cpu)")
    b.add_argument("--list", action="store_true", help="list the benchmarks found")
    b.add_argument("--steps", type=int, metavar="N", default=None, help="timed steps of the built-in timing (default 20)")
    b.add_argument("--device", default=None, help="device of the built-in timing (default cpu)")
    b.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="after NAME: the arguments of benchmarks/NAME.py")

    # -- serve ----------------------------------------------------------------------------------
    from .serve.cli import add_parser as _add_serve
    _add_serve(sub)

    # -- check ----------------------------------------------------------------------------------
    ck = sub.add_parser(
        "check", help="check the install: a small GPT's loss and gradients on every device",
        formatter_class=_fmt(),
        description="Runs a small GPT-2 forward and backward in float64 on the CPU (the reference) "
                    "and in float32 on every device present (cpu, and cuda when CuPy sees a GPU), "
                    "and compares the loss and every gradient. Says why cuda is not available "
                    "when it is not. Exit status 0 when every device agrees.",
        epilog="examples:\n  forge-ml check\n  forge-ml check --device cuda:1")
    ck.add_argument("--device", action="append", metavar="DEVICE",
                    help="check only this device (repeatable; default: cpu and cuda if present)")
    return p


# ---------------------------------------------------------------------------------------------
# Subcommands


def _rel_error(got, want) -> float:
    """The largest difference of ``got`` from ``want``, relative to ``want``'s largest value;
    inf where ``got`` holds a NaN or an infinity (a NaN must never pass as a small error).

    >>> import numpy as np
    >>> _rel_error(np.array([1.0, 2.0]), np.array([1.0, 4.0])), _rel_error(np.array([np.nan, 1.0]), np.ones(2))
    (0.5, inf)
    """
    import numpy as np
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))


def _cpu_kernels_note(dev) -> str:
    """For a CPU device, which kernels ``forge-ml check`` just checked: the C kernels, or
    NumPy and why (a failed build must not pass as a checked install)."""
    from .device import Device
    from .tensor import device_has
    if not device_has(Device.parse(dev), "host_memory"):
        return ""
    return "; " + _blas.cpu_kernels()


def _cmd_check(args) -> int:
    """Compare a small GPT's float32 loss and gradients on each device with float64 on the CPU,
    the float64 loss and gradients first held to plain NumPy's GPT-2 (``check_reference``)."""
    import numpy as np

    from .diagnose import check_reference
    from .errors import DeviceError
    from .models.gpt2 import GPT2, GPT2Config
    from .tensor import tensor

    cfg = GPT2Config(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)
    rs = np.random.default_rng(0)
    ids = rs.integers(0, cfg.vocab_size, (2, 25))
    x, y = ids[:, :-1], ids[:, 1:]
    # biases and layer-norm gains away from init's 0 and 1 (a kernel that dropped them agreed)
    state = {k: v + rs.normal(0, 0.1, v.shape) if np.ptp(v) == 0 else v
             for k, v in GPT2.init(cfg, seed=1, dtype="float64").state_dict().items()}
    ref = GPT2.from_state_dict(cfg, state, dtype="float64")
    l64, g64 = ref.loss_and_grads(tensor(x), tensor(y))
    # the float64 run is itself held to plain NumPy (it shares the NumPy kernels a CPU without
    # the C kernels runs in float32: wrong there, it agreed with itself)
    wrong = check_reference(cfg, state, x, y, l64, {k: g.numpy() for k, g in g64.items()})
    bad = int(wrong is not None)
    if wrong is not None:
        print(f"float64  FAIL {wrong}")
    devices = args.device or ["cpu", "cuda"]
    for dev in devices:
        try:
            model = GPT2.from_state_dict(cfg, ref.state_dict(), device=dev)
            loss, grads = model.loss_and_grads(tensor(x, device=dev), tensor(y, device=dev))
        except DeviceError as e:
            if args.device:
                raise
            # why the backend cannot load, not the registry's "device cuda was asked for" around
            # it (nobody named the device)
            why = e.__cause__ if isinstance(e.__cause__, DeviceError) else e
            print(f"{dev:8s} not available: {why}")
            continue
        errs = {k: _rel_error(grads[k].numpy(), g64[k].numpy()) for k in g64}
        worst_k = max(errs, key=errs.get)
        worst = errs[worst_k]
        ok = abs(loss - l64) / abs(l64) < 1e-5 and worst < 1e-3   # False for a NaN loss
        bad += not ok
        print(f"{dev:8s} {'ok  ' if ok else 'FAIL'} loss {loss:.6f} (float64 {l64:.6f}), "
              f"worst gradient relative error {worst:.1e} ({worst_k})" + _cpu_kernels_note(dev))
    return 0 if bad == 0 else 1


# the launchers' variables, each rank's before its world's size: torchrun's, Open MPI's, PMI's
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                "PMI_SIZE")


def _cmd_train(args) -> int:
    from .tensor import device_has
    from .runs import RunLock
    from .train import (CKPT_NAME, DATA_NAME, FINAL_VAL_KINDS, LOG_NAME, PLOT_NAME, Interrupted, TrainConfig,
                        Trainer, no_checkpoint, train_flag)

    comm = None
    if args.gpus < 0:
        raise ConfigError(f"--gpus must be >= 0, got {args.gpus}")
    env = None
    # any launcher variable, even empty: process_env says what is wrong with a partial set
    # (RANK=1 with an empty WORLD_SIZE, or RANK alone, trained one process in silence)
    if args.gpus or any(k in os.environ for k in _LAUNCH_VARS):
        from .distributed import launch
        env = launch.process_env()
        sizes = [(k, os.environ.get(k, "").strip()) for k in _LAUNCH_VARS[1::2]]
        big = [(k, v) for k, v in sizes if v not in ("", "1")]
        if env.launcher == "single" and big:
            # (it ran one process, in silence: NCCL on cuda:0 of a world of 1, or no NCCL)
            raise ConfigError(f"{big[0][0]} is {big[0][1]} but no rank is set (RANK, "
                              f"OMPI_COMM_WORLD_RANK or PMI_RANK): a launch of several processes "
                              f"sets both (torchrun, mpirun, or forge-ml train --gpus N)")
    if env is not None and (args.gpus or env.launcher != "single"):
        if args.device is not None and device_has(args.device, "host_memory"):
            # the ranks train on cuda:LOCAL_RANK: --device cpu was replaced by a GPU in silence
            # (or, without CuPy, refused as a missing NCCL)
            how, out = ((f"--gpus {args.gpus}", f"drop --device, or drop --gpus to train one "
                         f"process on {args.device}") if args.gpus else
                        (f"this {env.launcher} launch", "drop --device"))
            raise ConfigError(f"--device {args.device}: {how} trains on GPUs, one process each "
                              f"(NCCL, cuda:LOCAL_RANK); {out}")
    elif env is not None:
        env = None   # WORLD_SIZE=1 and no launcher: one process, on --device (no NCCL)
    if env is not None:
        if args.gpus > 1 and env.launcher == "single":   # start the N processes here
            launch.preflight(args.gpus)
            return launch.spawn(args.gpus, [sys.executable, "-m", "forge_ml", *sys.argv[1:]])
        comm = launch.init_process_group()
        if comm.rank > 0:                                 # rank 0 drives; the others follow
            from .distributed.trainer import Worker
            Worker(comm).run()
            return 0

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    explicit = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    # an empty path (`--data "$DATA"` with the variable unset) is TrainConfig's "not given":
    # the run trained on the default corpus, from scratch, or without the file, in silence
    for flag, v, unset in (
            ("--data", explicit.get("data"), "the default corpus (the Python standard library's source)"),
            ("--init-from", explicit.get("init_from"), "a new model from scratch"),
            ("--config", args.config, "no config file")):
        if v is not None and not v.strip():
            raise ConfigError(f"{flag} is empty ({v!r}); give a path, or leave {flag} out for "
                              f"{unset}")
    if explicit.get("sample_prompt"):
        try:
            explicit["sample_prompt"] = _argv_text(explicit["sample_prompt"])
        except UnicodeDecodeError:
            pass              # not UTF-8: the trainer says it cannot encode it
    for k in ("n_layer", "n_head", "n_embd"):     # 0 is TrainConfig's "not given": not a size
        if explicit.get(k) is not None and explicit[k] < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be >= 1, got {explicit[k]}")
    if not args.bucket_mb >= 0 or math.isinf(args.bucket_mb):
        # 0 is one bucket per parameter (Buckets' meaning; the GPU suite's torchrun run uses it)
        raise ConfigError(f"--bucket-mb must be a size in MB >= 0 (0: one bucket per "
                          f"parameter), got {args.bucket_mb}")
    dp_note = None   # said once the run is set up (an error before it stays the one line)
    # the data-parallel flags away from the parser's defaults (0, 25.0)
    what = ([f"--zero {args.zero}"] if args.zero != 0 else []) \
        + ([f"--bucket-mb {args.bucket_mb:g}"] if args.bucket_mb != 25.0 else [])
    if comm is None and what:
        # one process has no gradients to all-reduce or state to shard: the flags did nothing,
        # in silence. A note, not a refusal: a single-process run with --bucket-mb 0 is taken
        # (tests/test_train_safety.py), as the same command line under torchrun
        dp_note = (f"{PROG}: note: {' and '.join(what)} {'apply' if len(what) > 1 else 'applies'} only to "
                   f"data-parallel training over N processes (--gpus N, or a torchrun or mpirun launch); this "
                   f"run is one process, where {'they do' if len(what) > 1 else 'it does'} nothing")

    if "val_fraction" in explicit and explicit.get("data") and Path(explicit["data"]).is_dir():
        raise ConfigError(f"--val-fraction splits a text file; the data folder {explicit['data']} holds its "
                          f"train and val shards already (drop --val-fraction, or give the text file)")
    if "corpus_bytes" in explicit and explicit.get("data"):   # (it was dropped in silence)
        raise ConfigError(f"--corpus-bytes sizes the default corpus, which a run with --data does not "
                          f"read; drop --corpus-bytes (or --data {explicit['data']})")
    values: dict = {}
    from_file = _read_json_config(args.config) if args.config else {}
    # the run folder: the flag's, else the config file's (a --resume --config FILE resumed
    # runs/default with the file's other settings laid over that run's), else the default
    out_dir = explicit.get("out_dir", from_file.get("out_dir", TrainConfig.out_dir))
    if not str(out_dir).strip():
        raise ConfigError(f"--out is empty ({out_dir!r}); give the run folder (e.g. --out runs/mine)")
    meta = None
    if args.resume:
        from .checkpoint import interrupted_swap, load_checkpoint
        if "init_from" in explicit:
            raise ConfigError("--init-from starts a new run and --resume continues one; give one of them")
        ckpt = Path(out_dir) / CKPT_NAME
        if not ckpt.exists() and interrupted_swap(ckpt) is None:
            if (Path(out_dir) / "state.json").is_file() or (Path(out_dir) / "config.json").is_file():
                raise ConfigError(f"{out_dir} is a model (a checkpoint or a Hugging Face folder), not a run folder; "
                                  f"fine-tune it in a new run with --init-from {out_dir} --out NEW_FOLDER")
            if Path(out_dir).is_dir():   # a trainer still before its first checkpoint: say so
                probe = RunLock(out_dir)
                probe.acquire()
                probe.release(undo=True)   # a lock file the probe made goes again
            data = Path(out_dir) / DATA_NAME
            held = ([LOG_NAME] if (Path(out_dir) / LOG_NAME).exists() else []) \
                + ([DATA_NAME + "/"] if data.is_dir() and any(data.iterdir()) else [])
            raise ConfigError(no_checkpoint(out_dir, held))
        _, meta = load_checkpoint(ckpt)
        if "optimizer" not in meta or "train_config" not in meta:
            raise ConfigError(f"{ckpt} holds a model only (no optimizer state or data position, as `forge-ml "
                              f"convert` writes), so there is no run to resume; start a new run from it with "
                              f"--init-from {ckpt} --out NEW_FOLDER")
        values.update(meta.get("train_config", {}))
    values.update(from_file)
    values.update(explicit)
    if meta is not None and "grad_accum" in explicit and "total_batch_size" not in from_file \
            and "total_batch_size" not in explicit:
        # the run's recorded total_batch_size only set its grad_accum: a --grad-accum on resume
        # replaces both (it was refused as not matching a --total-batch-size nobody gave)
        values["total_batch_size"] = 0
    b = values.get("batch_size", TrainConfig.batch_size)
    if "grad_accum" in explicit and values.get("total_batch_size") and isinstance(b, int) \
            and explicit["grad_accum"] * b != values["total_batch_size"]:
        # (TrainConfig takes grad_accum 1 as "not given", so an explicit 1 was overridden)
        raise ConfigError(f"--grad-accum {explicit['grad_accum']} x --batch-size {b} is not --total-batch-size "
                          f"{values['total_batch_size']}; give one of --grad-accum and --total-batch-size")
    if "val_fraction" in from_file and values.get("data") and Path(values["data"]).is_dir():
        raise ConfigError(f"val_fraction (in {args.config}) splits a text file; the data folder {values['data']} "
                          f"holds its train and val shards already (drop val_fraction from the file)")
    # what the user set for this call, on the command line or in --config's file, and how to
    # name it: a resumed run's own values are the checkpoint's, not the user's
    given = dict(from_file, **explicit)

    def said(k):
        return train_flag(k) if k in explicit else f"{k} (in {args.config})"

    def drop(k):
        return f"drop {train_flag(k)}" if k in explicit else f"drop it from {args.config}"

    was_min = (meta or {}).get("train_config", {}).get("min_lr")
    if (meta is not None and "lr" in given and values.get("min_lr") == was_min and isinstance(was_min, (int, float))
            and isinstance(values.get("lr"), (int, float)) and was_min > values["lr"]):
        raise ConfigError(f"{said('lr')} {values['lr']:g}: the run in {out_dir} has min_lr {was_min:g} (recorded in "
                          f"its checkpoint), above the new lr, so the cosine would raise the rate as it goes; give "
                          f"--min-lr too (e.g. --min-lr {values['lr'] / 10:g})")
    cfg = TrainConfig.from_dict(values)
    if meta is not None:
        was = meta["train_config"].get("tokenizer")
        if "tokenizer" in given and was and given["tokenizer"] != was:
            raise ConfigError(f"{said('tokenizer')} {given['tokenizer']}: the run in {out_dir} was trained with "
                              f"the {was} tokenizer, which a resumed run keeps; {drop('tokenizer')}")
        was = meta["train_config"].get("val_fraction")
        if "val_fraction" in given and was is not None and given["val_fraction"] != was:
            raise ConfigError(f"{said('val_fraction')} {given['val_fraction']:g}: the run in {out_dir} split its "
                              f"text with --val-fraction {was:g}, and a resumed run keeps its shards; {drop('val_fraction')}")
        was = meta["train_config"].get("corpus_bytes")
        if ("corpus_bytes" in given and not meta["train_config"].get("data") and was is not None
                and given["corpus_bytes"] != was):
            # it was recorded and not used: the run goes on over its shards of the corpus it
            # took, and a resume that prepares them again takes the recorded size
            raise ConfigError(f"{said('corpus_bytes')} {given['corpus_bytes']}: the run in {out_dir} trains on "
                              f"{was} bytes of the default corpus, whose tokens a resumed run keeps; "
                              f"{drop('corpus_bytes')} (another size is another run: --out NEW_FOLDER)")
    try:
        if comm is not None:
            from .distributed.trainer import DistributedTrainer
            trainer = DistributedTrainer(cfg, comm, zero=args.zero, bucket_mb=args.bucket_mb,
                                         resume=args.resume, overwrite=args.overwrite)
        else:
            trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite)
    except Interrupted as e:   # SIGTERM or SIGHUP during the setup (a Ctrl-C there says 130 in main)
        print(f"{PROG}: stopped by {signal.Signals(e.signum).name} during setup, before the first step; "
              f"the same command starts it again", file=sys.stderr)
        return e.exit_status
    if dp_note:
        print(dp_note, file=sys.stderr)
    # a signal during the final evaluation, or after it (the final sample), or a crash before
    # the loss curve was drawn: the resume finishes what is left
    no_plot = not (Path(out_dir) / PLOT_NAME).is_file() and importlib.util.find_spec("matplotlib") is not None
    unfinished = trainer.val_kind not in FINAL_VAL_KINDS or no_plot
    if args.resume and trainer.step >= cfg.max_steps and unfinished:
        left = "its final evaluation" if trainer.val_kind not in FINAL_VAL_KINDS else "its loss curve"
        print(f"{PROG}: the run in {out_dir} reached step {trainer.step} of --max-steps {cfg.max_steps}; "
              f"finishing it: {left}", file=sys.stderr)
    elif args.resume and trainer.step >= cfg.max_steps:  # checked after the checkpoint fits the config
        trainer.close()
        done = trainer.step
        raise ConfigError(f"the run in {out_dir} is finished: it reached step {done} of --max-steps "
                          f"{cfg.max_steps}; raise --max-steps (e.g. --max-steps {max(2 * done, done + 1)}) "
                          f"to train it further")
    try:
        trainer.train()
    except Interrupted as e:
        if e.saved:
            say = (f"{PROG}: stopped by {signal.Signals(e.signum).name} at step {e.step}; checkpoint of "
                   f"step {e.step} saved in {trainer.ckpt_dir}; continue with: {PROG} train --out "
                   f"{cfg.out_dir} --resume")
        elif e.reason:
            go_on = (f"; continue from the kept one with: {PROG} train --out {cfg.out_dir} --resume"
                     if trainer.last_ckpt_step is not None else "")
            say = (f"{PROG}: stopped by {signal.Signals(e.signum).name} at step {e.step}; its checkpoint "
                   f"could not be saved: {e.reason}{go_on}")
        else:
            say = f"{PROG}: stopped by {signal.Signals(e.signum).name}; the last checkpoint in {cfg.out_dir} is kept"
        try:
            print(say, file=sys.stderr)
        except OSError:   # stderr is the closed pipe too (`train 2>&1 | head`): the status says it
            pass
        return e.exit_status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted at step {trainer.step}; resume with: {PROG} train --out {cfg.out_dir} --resume",
              file=sys.stderr)
        return 130
    return 0


_CONFIG_KINDS = {".py": "a Python file", ".yaml": "a YAML file", ".yml": "a YAML file", ".toml": "a TOML file"}


def _config_kind(p: Path, text: str) -> str | None:
    """What a --config file that is not JSON looks like: its suffix's kind (.py, .yaml, .yml,
    .toml), else "a Python file" where its first line of code is ``key = value`` (nanoGPT's
    config/*.py, named otherwise), else None."""
    kind = _CONFIG_KINDS.get(p.suffix.lower())
    if kind is None:
        code = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if code and re.match(r"\s*[A-Za-z_]\w*\s*=[^=]", code[0]):
            kind = "a Python file"
    return kind


def _read_json_config(path) -> dict:
    """``--config``'s JSON object of TrainConfig keys; a ConfigError that says what the file is
    where it is not one (a folder; a nanoGPT Python config, YAML or TOML: --config reads JSON)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config {p} is a folder, not a config file; give a JSON file of TrainConfig keys")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")   # a byte-order mark (Notepad's) is not JSON's
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON (it is not UTF-8 text: {e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        kind = _config_kind(p, text)
        verb = "is" if p.suffix.lower() in _CONFIG_KINDS else "looks like"
        if kind == "a Python file":
            raise ConfigError(
                f"{p} {verb} a Python file, but --config reads JSON only (an object of TrainConfig keys); a nanoGPT "
                f"config's `key = value` lines map to forge-ml train's flags (learning_rate is --lr, max_iters "
                f"--max-steps; the README's \"Coming from nanoGPT\" lists them): give them as flags, or as a "
                f"JSON object such as {{\"lr\": 0.001, \"max_steps\": 5000}}") from None
        if kind is not None:
            raise ConfigError(f"{p} {verb} {kind}, but --config reads JSON only (an object of TrainConfig keys); "
                              f"write its settings as JSON, e.g. {{\"lr\": 0.001, \"max_steps\": 5000}}") from None
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected a JSON object of TrainConfig keys, got {type(d).__name__}")
    return d



class _Detok:
    """Turns a stream of ids into text pieces, the text ``decode`` gives after the prompt's
    (``tokenizer.TextStream``: a character split across byte-level tokens prints whole, a
    Metaspace token keeps its space); an id past the tokenizer has no text (said once)."""

    def __init__(self, tok, prefix=()):
        from .tokenizer import TextStream
        self.tok = tok
        self.text = TextStream(tok, prefix)
        self.said = False

    def __call__(self, t: int) -> str:
        if t >= self.tok.vocab_size:
            # an embedding row past the tokenizer (a vocabulary padded to a multiple of 64):
            # no text, as transformers decodes it; said once (sample failed here, code 2)
            if not self.said:
                self.said = True
                print(f"{PROG} sample: note: the model chose id {t}, an embedding row past its tokenizer's "
                      f"{self.tok.vocab_size} {plural(self.tok.vocab_size, 'token')}; it has no text",
                      file=sys.stderr)
            return ""
        return self.text.feed(t)

    def flush(self) -> str:
        return self.text.flush()


def _prompt_text(path: str) -> str:
    """``--prompt-file``'s text: a file through ``data.load_text``; ``-``, or a pipe (``<(cmd)``,
    ``/dev/stdin`` fed by one), read to its end (load_text refuses what is not a regular file:
    a training corpus is read more than once)."""
    import stat
    from .data import load_text
    if path != "-":
        try:
            piped = stat.S_ISFIFO(os.stat(path).st_mode)
        except OSError:
            piped = False
        if not piped:
            return load_text(path)
    try:
        if path == "-":
            raw = sys.stdin.buffer.read() if sys.stdin is not None else b""
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except OSError as e:
        raise DataError(f"--prompt-file {path}: cannot read it: {e.strerror or e}") from None
    where = "standard input" if path == "-" else path
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-file {where}: not UTF-8 text (byte {e.start}: "
                        f"{raw[e.start:e.start + 1]!r})") from None


def _argv_text(value: str) -> str:
    """A command-line argument's text: the bytes Python kept as U+DC80-U+DCFF (argv read under
    an ASCII locale) decoded as UTF-8 (they went to the model as U+FFFD, or were refused by a
    char vocabulary); a UnicodeDecodeError where they are not UTF-8. Other lone surrogates
    (``main()`` called from Python) stay as they are.

    >>> _argv_text("H\\udcc3\\udca9"), _argv_text("plain")
    ('Hé', 'plain')
    """
    if not any("\udc80" <= c <= "\udcff" for c in value):
        return value
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value
    return raw.decode("utf-8")


def _check_sample_args(args) -> None:
    """``sample``'s options, checked before any work (and before the prompt is printed)."""
    if args.prompt_file is not None:
        if args.prompt:
            raise ConfigError("give --prompt or --prompt-file, not both")
        args.prompt = _prompt_text(args.prompt_file)
    elif args.prompt:
        try:
            args.prompt = _argv_text(args.prompt)
        except UnicodeDecodeError as e:   # the model would be given U+FFFD in their place
            raise DataError(f"--prompt: not UTF-8 text (byte {e.start}: "
                            f"{e.object[e.start:e.start + 1]!r}); give the prompt in UTF-8, or "
                            f"its file with --prompt-file") from None
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.num_samples > 1 and args.num_beams is not None:
        raise ConfigError("--num-samples draws samples; beam search (--num-beams) is deterministic: "
                          "use --num-return-sequences for its best sequences")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    temperature_given = args.temperature is not None     # (beam search refuses one given)
    if not temperature_given:
        args.temperature = 0.8
    # NaN fails >= too; past float32 (1e308) the library refused it in stream_tokens' name
    if not 0 <= args.temperature <= 3.4028234663852886e38:
        raise ConfigError(f"--temperature must be a number >= 0 (0 is greedy) and at most 3.4e38 "
                          f"(float32's largest), got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 is off), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 1 << 64:
        raise ConfigError(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.num_samples > 1 << 64:     # no seed fits (the advice was a negative --seed)
        raise ConfigError(f"--num-samples must be at most 2**64 (one seed each, in [0, 2**64)), "
                          f"got {args.num_samples}")
    if args.seed + args.num_samples - 1 >= 1 << 64:       # sample i draws with seed + i
        raise ConfigError(f"--seed {args.seed} with --num-samples {args.num_samples} would draw with "
                          f"seeds up to {args.seed + args.num_samples - 1}; seeds must be in "
                          f"[0, 2**64): give --seed <= {(1 << 64) - args.num_samples}")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise ConfigError(f"--min-p must be in [0, 1], got {args.min_p}")
    if not args.repetition_penalty > 0 or math.isinf(args.repetition_penalty):
        raise ConfigError(f"--repetition-penalty must be > 0 (1 is off), got {args.repetition_penalty}")
    if args.logprobs is not None and args.logprobs < 0:
        raise ConfigError(f"--logprobs must be >= 0, got {args.logprobs}")
    if args.num_beams is not None and args.num_beams < 1:
        raise ConfigError(f"--num-beams must be >= 1, got {args.num_beams}")
    if args.num_return_sequences > 1 and args.num_beams is None:
        raise ConfigError(f"--num-return-sequences {args.num_return_sequences} returns beam search's best "
                          f"sequences; add --num-beams K (K >= {args.num_return_sequences})")
    if args.num_return_sequences < 1 or args.num_return_sequences > (args.num_beams or 1):
        raise ConfigError(f"--num-return-sequences must be in 1..--num-beams ({args.num_beams or 1}), "
                          f"got {args.num_return_sequences}")
    if not math.isfinite(args.length_penalty):   # (beam_search's "length_penalty", after the load)
        raise ConfigError(f"--length-penalty must be a finite number, got {args.length_penalty}")
    if args.num_beams is None and (args.length_penalty != 1.0 or args.early_stopping != "false"):
        given = "--length-penalty" if args.length_penalty != 1.0 else "--early-stopping"
        raise ConfigError(f"{given} applies to beam search; add --num-beams K")
    if args.num_beams is not None and args.logprobs is not None:
        raise ConfigError("--logprobs reports sampled or greedy tokens; beam search (--num-beams) "
                          "scores whole sequences: use one or the other")
    from .sampling import openai_penalty
    for flag, name in (("--presence-penalty", "presence_penalty"),
                       ("--frequency-penalty", "frequency_penalty")):
        openai_penalty(flag, getattr(args, name), None)
    args.logit_bias_map = _logit_bias_flags(args.logit_bias)
    adjusting = [f for f, on in (("--presence-penalty", args.presence_penalty),
                                 ("--frequency-penalty", args.frequency_penalty),
                                 ("--logit-bias", args.logit_bias)) if on]
    if args.num_beams is not None and adjusting:
        one = len(adjusting) == 1
        raise ConfigError(f"{' and '.join(adjusting)} {'applies' if one else 'apply'} to sampled "
                          f"or greedy tokens; beam search (--num-beams) does not take "
                          f"{'it' if one else 'them'}: drop one or the other")
    if args.num_beams is not None and args.repetition_penalty != 1.0:
        raise ConfigError(f"--repetition-penalty applies to sampled or greedy tokens; beam search "
                          f"(--num-beams) does not take it: drop one or the other, got "
                          f"--repetition-penalty {args.repetition_penalty}")
    # beam search draws nothing (transformers' num_beams without do_sample): a sampling flag it
    # would ignore is refused, as --repetition-penalty is; each flag's off value is taken
    sampling = [(flag, v) for flag, v, off in (
        ("--temperature", args.temperature if temperature_given else None, 0), ("--top-k", args.top_k, 0),
        ("--top-p", args.top_p, 1), ("--min-p", args.min_p, 0)) if v is not None and v != off]
    if args.num_beams is not None and sampling:
        names = " and ".join(flag for flag, _ in sampling)
        one = len(sampling) == 1
        raise ConfigError(f"{names} {'applies' if one else 'apply'} to sampled tokens; beam search (--num-beams) "
                          f"is deterministic and does not take {'it' if one else 'them'}: drop "
                          f"{'one or the other' if one else 'them or --num-beams'}, got "
                          + " ".join(f"{flag} {v}" for flag, v in sampling))


def _logit_bias_flags(values) -> Optional[dict]:
    """``--logit-bias ID:BIAS`` flags (repeated) as ``{id: bias}``; a malformed one is a
    ConfigError saying the form (the range and the ids are checked with the model).

    >>> _logit_bias_flags(["50256:-100", "11:2.5"])
    {50256: -100.0, 11: 2.5}
    """
    if not values:
        return None
    from .sampling import logit_bias_row, token_id_key
    out = {}
    for v in values:
        key, sep, bias = v.partition(":")
        tid = token_id_key(key)
        try:
            if tid is None or not sep:
                raise ValueError
            out_bias = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias must be ID:BIAS (a token id and a number, e.g. "
                              f"50256:-100), got {v!r}") from None
        if tid in out:
            raise ConfigError(f"--logit-bias gives token {tid} twice ({out[tid]:g} and "
                              f"{out_bias:g}); give each id once")
        out[tid] = out_bias
    logit_bias_row(out, None, "--logit-bias")   # the range; the ids with the model
    return out


def _check_ckpt_arg(ckpt: str) -> None:
    """``--ckpt`` of sample and eval: a ConfigError for an empty one (``--ckpt "$CKPT"`` with
    the variable unset), which load_model refused in its own name.

    >>> _check_ckpt_arg("runs/my")
    """
    if not ckpt.strip():
        raise ConfigError(f"--ckpt is empty ({ckpt!r}); give a checkpoint folder, a run folder "
                          f"or a Hugging Face GPT-2 folder (e.g. --ckpt runs/default)")


def _cmd_sample(args) -> int:
    from .errors import ShapeError, TokenizerError
    from .inference import load_model
    from .inference.load import check_tokenizer_fits
    from .tokenizer import prompt_ids

    _check_ckpt_arg(args.ckpt)
    _check_sample_args(args)
    dtype = "bfloat16" if args.dtype in ("bf16", "bfloat16") else "float32"
    model, tok, _ = load_model(args.ckpt, device=args.device, dtype=dtype)
    check_tokenizer_fits(model, tok, args.ckpt)
    from .sampling import logit_bias_row
    logit_bias_row(args.logit_bias_map, model.config.vocab_size, "--logit-bias")
    try:
        ids = prompt_ids(tok, args.prompt)
    except TokenizerError as e:   # (it named neither the flag nor the checkpoint)
        where = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
        raise TokenizerError(f"{where} cannot be tokenized with {args.ckpt}'s tokenizer: "
                             f"{e}") from None
    block = model.config.block_size
    what = "--num-beams" if args.num_beams is not None else "--logprobs"   # (with no sliding window)
    if len(ids) > block:
        if args.num_beams is not None or args.logprobs is not None:
            raise ShapeError(f"the prompt is {len(ids)} tokens, longer than the model's context of {block} "
                             f"{plural(block, 'token')}; {what} has no sliding window (without it, sample starts "
                             f"from the prompt's last {block} {plural(block, 'token')})")
        # as nanoGPT's sample.py crops its context: the model sees the last block tokens
        print(f"forge-ml sample: note: the prompt is {len(ids)} tokens, longer than the model's context "
              f"of {block}: generation starts from its last {block} {plural(block, 'token')}",
              file=sys.stderr, flush=True)
    if args.logprobs is not None and args.logprobs > model.config.vocab_size:
        raise ConfigError(f"--logprobs must be in 0..{model.config.vocab_size} (the model's vocabulary), "
                          f"got {args.logprobs}")
    stop = tuple(tok.stop_tokens)
    if (args.num_beams is not None or args.logprobs is not None) and args.max_new_tokens > block - len(ids):
        if args.num_beams is not None and len(ids) == block:
            raise ShapeError(f"the prompt's {len(ids)} {plural(len(ids), 'token fills', 'tokens fill')} the "
                             f"model's context of {block} {plural(block, 'token')}; "
                             f"{what} has no sliding window and needs room for at least one new token")
        print(f"forge-ml sample: note: {what} has no sliding window: the model's context of {block} "
              f"{plural(block, 'token')} holds {block - len(ids)} new {plural(block - len(ids), 'token')} "
              f"after the prompt's {len(ids)}, not the "
              f"{args.max_new_tokens} asked", file=sys.stderr, flush=True)
    out = sys.stdout if sys.stdout is not None else open(os.devnull, "w")   # `>&-`: print's silence
    if args.num_beams is not None:
        return _sample_beams(args, model, tok, ids, stop, out)
    for i in range(args.num_samples):
        head = (f"--- sample {i + 1} of {args.num_samples} (seed {args.seed + i}) ---\n"
                if args.num_samples > 1 else "")
        _sample_one(args, model, tok, ids, stop, out, args.seed + i, head)
    return 0


def _started(tokens) -> Iterator:
    """The iterator ``tokens`` with its first item already drawn: the prompt's forward pass
    runs (and a model that cannot generate, e.g. one with NaN weights, fails) before anything
    is printed."""
    tokens = iter(tokens)
    return itertools.chain(list(itertools.islice(tokens, 1)), tokens)


def _sample_one(args, model, tok, ids, stop, out, seed: int, head: str) -> None:
    """One sample of ``sample``: ``head``, the prompt, the tokens as they come (and the
    log-probabilities)."""
    from .inference import stream_tokens
    from .tokenizer import hides_stop
    block = model.config.block_size
    detok = _Detok(tok, ids)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
              logit_bias=args.logit_bias_map)
    if args.logprobs is not None:    # the batch form reports them; no sliding window past the context
        from .inference import generate
        from .inference.engine import shown_logprob
        n_new = min(args.max_new_tokens, block - len(ids))
        events = []
        steps = _started(generate(model, [ids], n_new, stop_tokens=stop, logprobs=args.logprobs, **kw))
        out.write(head + args.prompt)
        out.flush()
        for step in steps:
            for e in step:
                events.append(e)
                if not hides_stop(tok, e.token, stop):
                    out.write(detok(e.token))
                    out.flush()
        out.write(detok.flush() + "\n")
        most = f", the {args.logprobs} most likely" if args.logprobs else ""
        out.write(f"--- log-probabilities: token, its log-probability{most} ---\n")
        for e in events:
            text = lambda i: tok.decode([i]) if i < tok.vocab_size else f"<id {i}>"   # noqa: E731
            # as the server writes them: at a vanishing temperature the tokens not chosen are
            # -1e30 or -inf, said -9999 as OpenAI does
            alts = " | ".join(f"{text(i)!r} {shown_logprob(lp):.3f}" for i, lp in (e.top_logprobs or ()))
            out.write(f"{text(e.token)!r:>16} {shown_logprob(e.logprob):9.3f}" + (f"   {alts}" if alts else "") + "\n")
        out.flush()
        return
    tokens = _started(stream_tokens(model, ids, args.max_new_tokens, stop_tokens=stop, **kw))
    out.write(head + args.prompt)
    out.flush()
    for t in tokens:
        if hides_stop(tok, t, stop):
            break
        out.write(detok(t))     # a stop token that is not special (a ".") is text, as in transformers
        out.flush()
        if t in stop:
            break
    out.write(detok.flush() + "\n")
    out.flush()


def _sample_beams(args, model, tok, ids, stop, out) -> int:
    """``sample --num-beams``: the best sequences of a beam search, each with its score."""
    from .inference import beam_search
    from .inference.beam import candidates_per_beam
    from .tokenizer import hides_stop
    early = {"false": False, "true": True, "never": "never"}[args.early_stopping]
    n_new = min(args.max_new_tokens, model.config.block_size - len(ids))
    per_beam = candidates_per_beam(len(stop))
    if args.num_beams * per_beam > model.config.vocab_size:
        raise ConfigError(f"--num-beams {args.num_beams}: beam search keeps "
                          f"{args.num_beams * per_beam} candidates each step ({per_beam} a beam), "
                          f"more than the model's {model.config.vocab_size} tokens; give at most "
                          f"{model.config.vocab_size // per_beam}")
    if n_new < 1:       # nothing to search: the prompt, as a sample of 0 new tokens prints it
        out.write(args.prompt + "\n")
        out.flush()
        return 0
    seqs, scores = beam_search(model, ids, n_new, args.num_beams, length_penalty=args.length_penalty,
                               early_stopping=early, eos_token_id=list(stop) or None,
                               num_return_sequences=args.num_return_sequences)
    said = False    # the note on an id past the tokenizer, once
    for i, (seq, score) in enumerate(zip(seqs, scores)):
        # the text decode gives after the prompt's, as a sample prints it (decoded alone, a
        # Metaspace tokenizer's first "▁is" lost its space: "Hello worldis")
        detok = _Detok(tok, ids)
        detok.said = said
        text = "".join(detok(t) for t in seq if not hides_stop(tok, t, stop)) + detok.flush()
        said = detok.said
        if len(seqs) > 1:
            out.write(f"--- sequence {i + 1} of {len(seqs)}, score {score:.4f} ---\n")
        out.write(args.prompt + text + "\n")
    out.flush()
    return 0


def _cmd_eval(args) -> int:
    import numpy as np

    from .data import DataLoader, is_shard_file, load_text, read_shard, shard_folder
    from .inference import load_model
    from .tensor import tensor

    _check_ckpt_arg(args.ckpt)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_batches is not None and args.max_batches < 1:
        raise ConfigError(f"--max-batches must be >= 1 (leave it out to evaluate every window), "
                          f"got {args.max_batches}")
    if not args.data.strip():
        raise DataError(f"--data is empty ({args.data!r}); give a text file, a .bin token shard or a data folder")
    path = Path(args.data)
    if not path.exists():
        raise DataError(f"--data {path}: no such file")
    shards = folder = None
    if path.is_dir():  # a data folder: its val shards
        folder = shard_folder(path, need=("val",))
        shards = folder.val
        for p in shards:
            read_shard(p)  # every header, before the model loads
    elif not path.is_file():
        raise DataError(f"--data {path}: expected a .bin token shard, a data folder or a text file, got a "
                        f"special file")
    else:
        try:  # before the model loads: a file that cannot be read is said at once
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise DataError(f"--data {path}: cannot read it: {e.strerror or e}") from None
    shard = shards is None and (path.suffix == ".bin" or is_shard_file(path))  # one named *.dat too
    # a loose shard is ids alone: a Hugging Face folder whose tokenizer forge-ml cannot read
    # still evaluates on it (its tokenizer is never used)
    loose = shard and not (path.parent / "tokenizer.json").is_file()   # (shard: no data folder)
    model, tok, meta = load_model(args.ckpt, device=args.device, tokenizer=not loose)
    cfg = model.config
    # a run's own windows (a fine-tune may train on fewer tokens than the model's context), so
    # that eval of its checkpoint gives the run's final val loss
    run_cfg = (meta or {}).get("train_config")
    trained_t = ((run_cfg.get("block_size") if isinstance(run_cfg, dict) else None)
                 or (meta or {}).get("train_block_size"))   # a run's ckpt/, or its best/
    window = args.block_size or (trained_t if isinstance(trained_t, int) and 0 < trained_t < cfg.block_size
                                 else cfg.block_size)
    if args.block_size is not None and not 1 <= args.block_size <= cfg.block_size:
        raise ConfigError(f"--block-size must be in 1..{cfg.block_size} (the model's context), got {args.block_size}")
    if folder is not None:
        _check_shards_tokenizer(folder.folder, folder.tokenizer, tok, args.ckpt, cfg.vocab_size)
    elif shard and not loose:
        # one shard of a prepared folder: the tokenizer.json beside it counts as the folder's (a
        # loose shard with none beside it is taken as it is: only its ids' range is checked)
        _check_shards_tokenizer(path.parent, path.parent / "tokenizer.json", tok, args.ckpt,
                                cfg.vocab_size, what=f"the shard {path}")
    ids = None
    if shards is None and not shard:  # a text file: tokenize it with the checkpoint's tokenizer
        from .inference.load import check_tokenizer_fits
        check_tokenizer_fits(model, tok, args.ckpt)   # as sample and serve do: else a loss over wrong ids
        try:
            text = load_text(path)
        except OSError as e:
            raise DataError(f"--data {path}: cannot read it: {e.strerror or e}") from None
        from .data import encode_array
        from .errors import TokenizerError
        try:
            ids = encode_array(tok, text)
        except TokenizerError as e:   # (it named neither the file nor the checkpoint)
            raise DataError(f"--data {path} cannot be tokenized with {args.ckpt}'s tokenizer: {e}") from None
    # a text's ids stay in memory (no temporary shard: they need not fit a shard's uint16)
    paths = shards if shards is not None else [path]
    arrays = [ids] if ids is not None else [read_shard(p) for p in paths]
    n_tokens = sum(len(a) for a in arrays)
    if n_tokens < 2:
        raise DataError(f"{args.data} holds {n_tokens} {plural(n_tokens, 'token')}; evaluation "
                        f"needs at least 2")
    for p, a in zip(paths, arrays):
        hi = int(np.max(a, initial=0))
        if hi >= cfg.vocab_size:
            v = cfg.vocab_size
            raise DataError(f"{p if shards is not None else args.data} holds token {hi} but the "
                            f"model's vocabulary has {v} {plural(v, 'token')}; the shard was made "
                            f"with another tokenizer")
    T = min(window, n_tokens - 1)
    B = max(1, min(args.batch_size, (n_tokens - 1) // T))
    _check_eval_memory(model, B, T)
    loader = (DataLoader(paths, B, T) if ids is None else
              DataLoader.from_tokens(ids, B, T, name=str(args.data)))
    batches_capped = not (args.max_batches is None or args.max_batches > (n_tokens - 1) // T // B)
    if not batches_capped:
        # every window: those past the last whole batch come as a smaller one (a cap past
        # the whole batches changes nothing)
        batches = loader.eval_batches(tail=True)
    else:
        batches = loader.eval_batches(args.max_batches)
    total, windows, n, t0 = 0.0, 0, 0, time.perf_counter()
    for x, y in batches:  # a batch's loss is the mean over its windows
        b = len(x)
        total += model.loss(tensor(x, device=args.device), tensor(y, device=args.device)).item() * b
        windows += b
        n += 1
    loss = total / windows
    if not math.isfinite(loss):   # (it printed "loss nan" and exited 0; sample refuses such a model)
        from .errors import ModelError
        from .inference.decode import nonfinite_cause
        raise ModelError(f"the loss over {args.data} is {loss}, not a loss a model gives: "
                         f"{nonfinite_cause(model)}")
    where = "" if shards is None else f" of {len(shards)} val {plural(len(shards), 'shard')} in {path}"
    print(f"loss {loss:.4f}  perplexity {math.exp(min(loss, 700)):.3f}  "
          f"({windows * T:,} {plural(windows * T, 'token')}{where}: "
          f"{windows:,} {plural(windows, 'window')} of {T} in {n} "
          f"{plural(n, 'batch', 'batches')} of {B}, "
          f"{time.perf_counter() - t0:.1f} s)"
          + ("; the windows are shorter than "
             + (f"the model's context of {cfg.block_size}" if window == cfg.block_size
                else f"{window} {plural(window, 'token')}")
             + f": the data holds {n_tokens:,} {plural(n_tokens, 'token')}, so this loss is not comparable "
               f"with a run's val loss"
             if T < window else "")
          + _unscored(n_tokens, windows * T, T, capped=batches_capped))
    return 0


def _check_eval_memory(model, B: int, T: int) -> None:
    """On the CPU, refuse a --batch-size whose forward pass cannot fit the host's free memory,
    before it runs (a batch of B x T tokens goes through the model at once: Linux would hand
    the arrays out and then kill the process, exit 137, without a word). Per token about 16
    n_embd floats of a layer's activations and a row of its attention scores, and the LM
    head's two chunks of logits (the CPU's linear_cross_entropy, train.host_step_bytes's):
    1.1-1.6x the traced peaks of forward passes of 2K-33K tokens (2026-12-07)."""
    from .errors import check_host_memory
    from .tensor import device_has
    if not device_has(model.device, "host_memory"):
        return
    cfg, tokens = model.config, B * T
    need = (4 * tokens * (16 * cfg.n_embd + cfg.n_head * T)
            + 2 * min(4 * tokens * cfg.padded_vocab_size, 1 << 26))
    check_host_memory(
        "forge-ml eval", f"batches of {B:,} windows of {T:,} tokens", need,
        lambda free: f"use at most about {max(1, free * B // need):,} (--batch-size)")


def _unscored(n_tokens: int, scored: int, T: int, capped: bool) -> str:
    """eval's word on the targets no window reaches: the tail after the last whole window
    (every window holds T targets; the first token is never one), said where it is a tenth of
    the data or more (a file just short of two windows lost half its tokens unsaid).

    >>> _unscored(63, 32, 32, False)
    '; the last 30 tokens, short of a window of 32, are not scored (48% of the data)'
    >>> _unscored(6000, 5984, 32, False), _unscored(63, 32, 32, True)
    ('', '')
    """
    left = n_tokens - 1 - scored
    if capped or left <= 0 or left * 10 < n_tokens:
        return ""
    return (f"; the last {left:,} {plural(left, 'token')}, short of a window of {T}, are not "
            f"scored ({left / n_tokens:.0%} of the data)")


def _check_shards_tokenizer(folder, tokenizer_file, tok, ckpt, model_vocab: int, what=None) -> None:
    """A DataError when the shards of the data folder ``folder`` (``what`` names one shard of
    it) were made with another tokenizer than the checkpoint's: ``tokenizer_file``, or (None:
    llm.c's shards) GPT-2's. Ids that fit the model's vocabulary would otherwise be read as
    other tokens and give a wrong loss."""
    from .tokenizer import same_ids, tokenizer_from_dict

    what = what or f"the shards in {folder}"
    # the way out: a text file, unless the checkpoint's tokenizer does not fit its model either
    # (eval refuses a text file then)
    advice = ("give a text file, which is tokenized with the checkpoint's tokenizer"
              if tok.vocab_size <= model_vocab else
              f"and the checkpoint's own tokenizer ({tok.kind}, {tok.vocab_size} {plural(tok.vocab_size, 'id')}) "
              f"does not fit its "
              f"{model_vocab}-token model either: give shards made for this model")
    if tokenizer_file is None:
        if tok.kind != "gpt2":
            raise DataError(f"{what}: GPT-2 ids (llm.c's; {folder} has no tokenizer.json), but "
                            f"{ckpt} has a {tok.kind} tokenizer; {advice}")
        return
    try:
        theirs = tokenizer_from_dict(json.loads(tokenizer_file.read_text(encoding="utf-8")))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{tokenizer_file}: not a tokenizer file ({e}); prepare the data again") from None
    if not same_ids(theirs.to_dict(), tok.to_dict()):
        raise DataError(f"{what}: made with another tokenizer ({tokenizer_file}: "
                        f"{theirs.kind}, {theirs.vocab_size} {plural(theirs.vocab_size, 'id')}) than "
                        f"{ckpt}'s ({tok.kind}, "
                        f"{tok.vocab_size} {plural(tok.vocab_size, 'id')}), so their ids are other tokens; {advice}")


def _cmd_prepare(args) -> int:
    from .data import prepare
    from .runs import RunError, run_log, running_trainer
    from .train import DATA_NAME

    if not args.out.strip():
        raise DataError(f"--out is empty ({args.out!r}); give the folder for train.bin, val.bin and "
                        f"tokenizer.json (e.g. --out data/mine)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a folder; expected a folder for train.bin, val.bin "
                        f"and tokenizer.json")
    if not 0.0 < args.val_fraction < 1.0:   # (prepare() says its parameter's name)
        raise DataError(f"--val-fraction must be a number in (0, 1), got {args.val_fraction}")
    held = [f for f in ("train.bin", "val.bin", "tokenizer.json") if (out / f).exists()]
    # a run's own data: even --force may not replace it under a trainer using it. The probe
    # reads the trainer's flocks, not its lock file: a user may have deleted train.lock (it
    # stays after a run and looks stale) while the trainer runs
    holder = running_trainer(out.parent) if held and out.name == DATA_NAME else None
    if holder:
        raise RunError(f"{out} is the data of the run in {out.parent}, whose trainer is running ({holder}); "
                       f"even --force does not replace a running trainer's data: wait for it to finish or "
                       f"stop it, or give another --out")
    if held and not args.force:
        run = " (the prepared data of the run in " + str(out.parent) + ")" \
            if out.name == DATA_NAME and run_log(out.parent / "log.jsonl") else ""
        raise DataError(f"{out} already holds {', '.join(held)}{run}; give another --out, or "
                        f"--force to replace them")
    # SIGTERM and SIGHUP end it as Ctrl-C does: the shards' temporary files are removed (a
    # kill midway through the write left them in OUT, each as large as its shard)
    try:
        with _ending_signals():
            info = prepare(args.text, args.out, tokenizer=args.tokenizer,
                           val_fraction=args.val_fraction)
    except _Ending as e:
        print(f"{PROG} prepare: stopped by {signal.Signals(e.signum).name} before it finished; "
              f"run it again to prepare {args.out}", file=sys.stderr)
        return 128 + int(e.signum)
    print(f"{info['train_tokens']:,} train tokens -> {info['train_path']}")
    print(f"{info['val_tokens']:,} val tokens -> {info['val_path']}")
    print(f"{info['tokenizer']} tokenizer, vocabulary {info['vocab_size']:,} -> {info['tokenizer_path']}")
    return 0


def _kept_by_a_run(folder) -> bool:
    """Whether the model checkpoint in ``folder`` is one a trainer kept (its meta names a run)."""
    from .checkpoint import read_meta
    return bool((read_meta(folder) or {}).get("run_id"))


class _Ending(BaseException):
    """SIGTERM or SIGHUP while ``convert`` writes: raised where the process is, so that the
    write's clean-up runs (its scratch folder and lock removed, the output as it was)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _ending_signals():
    """SIGTERM and SIGHUP raise ``_Ending`` inside the block (the handlers before are back
    after it), so that a write's clean-up runs as under Ctrl-C."""
    from .runs import ENDING_SIGNALS, give_back_signals, take_signals

    def end(signum, frame):
        raise _Ending(signum)
    old = take_signals(end, ENDING_SIGNALS)
    try:
        yield
    finally:
        give_back_signals(old)


def _cmd_convert(args) -> int:
    """``convert``, with SIGTERM and SIGHUP ending it as Ctrl-C does: the output as it was,
    nothing left beside it (they killed it midway, leaving ``<out>.tmp`` and the lock)."""
    try:
        with _ending_signals():
            return _convert(args)
    except _Ending as e:
        print(f"{PROG} convert: stopped by {signal.Signals(e.signum).name}; {args.out} is as it "
              f"was", file=sys.stderr)
        return 128 + int(e.signum)


def _convert(args) -> int:
    from .checkpoint import check_output_dir, interrupted_swap, is_checkpoint_dir, save_checkpoint
    from .errors import CheckpointError
    from .hf import (HF_FLAGS, HF_TOKENIZER_FILE, TRANSFORMERS_TOKENIZER_FILES, hf_meta,
                     is_hf_export, load_hf_gpt2, save_hf_gpt2)
    from .inference.load import _hf_tokenizer_built, check_tokenizer_fits, load_model, resolve_checkpoint

    # Every check before any work: the output folder is new, empty, or (with --force) an
    # earlier conversion of the same kind, and never the folder read from nor inside it.
    for flag, v in (("--from-hf", args.from_hf), ("--to-hf", args.to_hf), ("--out", args.out)):
        if v is not None and not str(v).strip():   # ('' took the --to-hf branch: a traceback)
            raise CheckpointError(f"{flag} is empty; expected a folder")
    if args.from_hf is not None:
        src = Path(args.from_hf)
        if not src.is_dir():
            raise CheckpointError(f"Hugging Face model directory not found: {src}"
                                  if not src.exists() else f"--from-hf {src}: expected a folder")
        # never a run's checkpoint, nor the model a run kept with --keep-best (a run id in it)
        if any(is_checkpoint_dir(d, kind="forge-ml-model") and _kept_by_a_run(d)
               for d in (args.out, interrupted_swap(os.path.abspath(args.out)))
               if d is not None):
            raise CheckpointError(f"{args.out} holds the model a training run kept (--keep-best); "
                                  f"--force replaces only an earlier conversion: write into a new or "
                                  f"empty folder")
        check_output_dir(args.out, reads=[src], is_own=lambda d: is_checkpoint_dir(d, kind="forge-ml-model"),
                         force=args.force, what="forge-ml checkpoint", within=[src])
        config, params = load_hf_gpt2(src)
        _warn_nonfinite(params, f"--from-hf {src}")
        tok_dict, tok = _hf_tokenizer_built(src)
        check_tokenizer_fits(config["vocab_size"], tok, f"--from-hf {src}")   # as sample and serve
        # HF's four dropout rates as given (the config holds forge-ml's one): the export's
        meta = {"kind": "forge-ml-model", "config": config, "tokenizer": tok_dict,
                "source": str(src.resolve()), **hf_meta(src)}
        save_checkpoint(args.out, params, meta, replace=args.force)
        print(f"imported {len(params)} tensors ({config['n_layer']} {plural(config['n_layer'], 'layer')}, "
              f"{config['n_embd']} channels) "
              f"from {args.from_hf} -> {args.out}")
        return 0
    ckpt = Path(os.path.abspath(resolve_checkpoint(args.to_hf)))
    reads = [args.to_hf, ckpt] + [p for p in [interrupted_swap(ckpt)] if p is not None]
    check_output_dir(args.out, reads=reads,
                     is_own=is_hf_export, force=args.force, what="Hugging Face export", within=[ckpt])
    model, tok, meta = load_model(args.to_hf)
    # the recorded dropout rate (load_model's model has none) and, from an import or a Hugging
    # Face folder, HF's four rates
    config = dict(model.config.to_dict(), dropout=meta["config"].get("dropout", 0.0))
    state = model.state_dict()
    flags = meta.get("hf_flags") or {}
    if not isinstance(flags, dict):   # (a hand-edited state.json: a list was an AttributeError)
        raise CheckpointError(f"{ckpt / 'state.json'}: expected meta 'hf_flags' to be an object of "
                              f"{', '.join(HF_FLAGS)} (true or false), got {flags!r:.60}")
    _warn_nonfinite(state, args.to_hf)
    save_hf_gpt2(args.out, config, state, tokenizer=tok.to_dict(),
                 dropout_rates=meta.get("hf_dropout"),
                 hf_flags={k: v for k, v in flags.items() if k in HF_FLAGS},
                 replace=args.force)
    tok_files = [f for f in TRANSFORMERS_TOKENIZER_FILES if (Path(args.out) / f).is_file()]
    print(f"exported {args.to_hf} -> {args.out} (config.json + model.safetensors"
          + (f" + {HF_TOKENIZER_FILE}: a {tok.kind} tokenizer, not GPT-2's" if tok.kind != "gpt2" else "")
          + (f"; {' + '.join(tok_files)} for transformers' AutoTokenizer)" if tok_files else
             f"; no tokenizer for transformers: the {tok.kind} tokenizer has {tok.vocab_size} "
             f"{plural(tok.vocab_size, 'id')}, "
             f"the model {model.config.vocab_size})"))
    return 0


def _warn_nonfinite(params: dict, source) -> None:
    """convert's warning for weights that hold NaN or inf: they are converted as they are (a
    diverged run's weights may be wanted for a look), but sample, eval and serve refuse the
    model's output, so the user hears it now, not from the next tool."""
    from .diagnose import nonfinite_params
    n_bad, listed = nonfinite_params(params)
    if n_bad:
        warnings.warn(f"{source}: {n_bad} {plural(n_bad, 'tensor')} of {len(params)} hold "
                      f"NaN or inf ({listed}); converted as they are, but sample, eval and serve "
                      f"will refuse this model's output (weights of a run that diverged, or a "
                      f"damaged file?)", stacklevel=2)


def _bench_dirs() -> list:
    here = Path(__file__).resolve()
    return [Path.cwd() / "benchmarks", here.parents[2] / "benchmarks"]


def _runnable(path: Path) -> bool:
    """Whether the benchmarks' file ``path`` runs something: a statement at its top level other
    than imports, definitions, assignments and its docstring (an ``if __name__ == "__main__"``
    block, a call). A module the benchmarks share (torch_gpt2.py) only defines: not listed, and
    refused by name. A file that cannot be read or parsed counts as one (running it says why)."""
    import ast
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return True
    quiet = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
             ast.Assign, ast.AnnAssign)
    return any(not isinstance(n, quiet) and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                                  and isinstance(n.value.value, str))
               for n in tree.body)


def _cmd_bench(args) -> int:
    found = {}
    for d in _bench_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.py")):
                found.setdefault(f.stem, f)
    where = " nor ".join(str(d) for d in _bench_dirs())
    none_found = (f"no benchmarks folder: neither {where} exists (the benchmarks come with a "
                  f"clone of forge-ml's repository, not with the installed package: run "
                  f"forge-ml bench from the clone)")
    if args.list:
        for name, f in found.items():
            if _runnable(f):   # (not a module the benchmarks share, e.g. torch_gpt2.py)
                print(f"{name:<28} {f}")
        if not found:
            print(none_found)
        return 0
    if args.name:
        name = args.name[:-3] if args.name.endswith(".py") else args.name
        if not found:
            raise ConfigError(f"unknown benchmark {args.name!r}: {none_found}")
        if name not in found:
            raise ConfigError(f"unknown benchmark {args.name!r}; available: "
                              f"{', '.join(n for n, f in found.items() if _runnable(f))}")
        if not _runnable(found[name]):
            raise ConfigError(f"{found[name]} is a module the benchmarks import, not a benchmark (it "
                              f"runs nothing); forge-ml bench --list lists the benchmarks")
        mine = [o for o, v in (("--steps", args.steps), ("--device", args.device)) if v is not None]
        if mine:
            raise ConfigError(f"{' and '.join(mine)} before {name} set the built-in timing, which "
                              f"does not run with a NAME; give {name}'s own arguments after it "
                              f"(forge-ml bench {name} --help lists them)")
        argv, sys.argv = sys.argv, [str(found[name]), *args.script_args]
        path0 = list(sys.path)
        sys.path.insert(0, str(found[name].parent))   # its sibling modules, as `python SCRIPT` has them
        try:
            runpy.run_path(str(found[name]), run_name="__main__")
        except SystemExit as e:    # the script's sys.exit, or its --help: its status
            if e.code is None or isinstance(e.code, int):
                return e.code or 0
            print(e.code, file=sys.stderr)   # sys.exit("message"): shown, status 1, as Python does
            return 1
        except ModuleNotFoundError as e:
            missing = (e.name or str(e)).split(".")[0]
            if missing == "forge_ml":
                raise
            extra = ("CuPy comes with the cuda extra: pip install -e '.[cuda]' (CUDA 13; '.[cuda12]' for CUDA 12)" if missing == "cupy" else
                     "the benchmarks' peers come with the test extra: pip install -e '.[test]'")
            raise ConfigError(f"benchmark {name} needs the Python module {missing!r}, which is not "
                              f"installed; install it ({extra})") from None
        finally:
            sys.argv = argv
            sys.path[:] = path0
        return 0
    return _builtin_bench(20 if args.steps is None else args.steps, args.device or "cpu")


def _builtin_bench(steps: int, device: str) -> int:
    """Median time of a forge-ml training step (forward + backward + AdamW) on nanoGPT's CPU
    model. On the CPU the thread count is chosen first as ``forge-ml train`` chooses it (a
    ``ThreadTuner`` over the untimed first steps, where forge-ml set the count)."""
    import numpy as np

    from .models.gpt2 import GPT2, GPT2Config
    from .optim import AdamW, clip_grad_norm
    from .tensor import device_has, synchronize, tensor

    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    cfg = GPT2Config(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT2.init(cfg, seed=0, device=device)
    opt = AdamW(model.params, lr=1e-3)
    rng = np.random.default_rng(0)
    B, T = 12, 64

    def step():
        x = tensor(rng.integers(0, 65, (B, T)), device=device)
        y = tensor(rng.integers(0, 65, (B, T)), device=device)
        t0 = time.perf_counter()
        loss, grads = model.loss_and_grads(x, y)
        _, scale = clip_grad_norm(grads, 1.0)
        opt.step(grads, grad_scale=scale)
        synchronize(device)  # the step's kernels may still run on a GPU
        return time.perf_counter() - t0, loss

    tuner = _blas.tuner(skip=1) if device_has(device, "host_memory") else None
    if tuner is not None:        # untimed steps until the tuner has chosen, as the trainer does
        for _ in range(1 + tuner.trials * len(tuner.counts)):
            tuner.before_step()
            line = tuner.after_step(step()[0])
            if line:
                print(line)
    for _ in range(2):
        step()
    times, loss = [], None
    for _ in range(steps):
        dt, loss = step()
        times.append(dt)
    med = float(np.median(times))
    threads = ""
    if device_has(device, "host_memory"):
        n_threads = _blas.get_threads()
        threads = f", {n_threads} {plural(n_threads, 'thread')}"
    print(f"forge-ml training step, 4 layers x 128 channels, batch {B} x {T}, {device}{threads}: "
          f"median {med * 1e3:.1f} ms over {steps} {plural(steps, 'step')} ({B * T / med:,.0f} tokens/s); "
          f"loss {loss:.3f}")
    return 0


def _cmd_serve(args) -> int:
    from .serve.cli import run
    return run(args)


_COMMANDS = {"serve": _cmd_serve, "train": _cmd_train, "sample": _cmd_sample, "eval": _cmd_eval, "prepare": _cmd_prepare,
             "convert": _cmd_convert, "bench": _cmd_bench, "check": _cmd_check}


# the arguments that name files or folders (a leading ~ is the home folder in each)
_PATH_ARGS = ("out", "out_dir", "data", "ckpt", "init_from", "text", "config", "from_hf", "to_hf",
              "prompt_file")


def _unprefixed(e: Exception, cmd: str) -> str:
    """An error's message without the library function's own name where it is the command's
    (``prepare: x is empty`` under ``forge-ml prepare: error:``).

    >>> _unprefixed(ValueError("prepare: t.txt is empty"), "prepare")
    't.txt is empty'
    """
    msg = str(e)
    return msg[len(cmd) + 2:] if msg.startswith(cmd + ": ") else msg


def _os_error(cmd: str, e: OSError) -> int:
    """An OSError (a full disk, a read-only filesystem, a pipe that closed) as one line on
    stderr, its errno's name and file where it has them; status 2."""
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = f": {e.filename}" if e.filename else ""
    print(f"{PROG} {cmd}: error: {e.strerror or e}" + (f" ({code})" if code else "") + where,
          file=sys.stderr)
    return 2


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (its write end polls as an
    error or a hang-up): the BrokenPipeError of `| head`, as against one from another pipe or
    socket. Where poll cannot say (no poll, no descriptor), True: the status of SIGPIPE.

    >>> import os, sys
    >>> r, w = os.pipe(); os.close(r)
    >>> saved = sys.__stdout__
    >>> sys.__stdout__ = os.fdopen(w, "w")
    >>> _stdout_reader_gone()
    True
    >>> sys.__stdout__.close(); sys.__stdout__ = saved
    """
    try:
        import select
        fd = sys.__stdout__.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, ValueError, OSError):
        return True


def main(argv=None) -> int:
    """Run the ``forge-ml`` command line; returns the exit status (0 ok, 1 training failure,
    2 bad input or a file that cannot be written, 130 / 143 / 129 stopped by SIGINT / SIGTERM /
    SIGHUP, 141 a command whose stdout's reader went away). The
    BLAS thread count is set first (``forge_ml.blas.limit_default``).

    >>> main(["bench", "--steps", "0"])
    2
    """
    formatted = warnings.formatwarning
    warnings.formatwarning = _format_warning   # one line, not Python's path and source line
    try:
        return _main(argv)
    except KeyboardInterrupt:   # before the command runs (its own handler says more there)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatted


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the command line says it: ``forge-ml: warning: ...`` on one line (Python's
    default showed the file, the line number and the line of code, like a traceback); one of
    another library's keeps its category. Recording (``catch_warnings(record=True)``) is as
    before."""
    msg = str(message)
    if msg.startswith(PROG + ": "):
        return f"{PROG}: warning: {msg[len(PROG) + 2:]}\n"
    ours = filename.startswith(os.path.dirname(os.path.abspath(__file__)))   # the package's
    return f"{PROG}: warning: {msg}\n" if ours else f"{PROG}: warning: {category.__name__}: {msg}\n"


def _unrecognized(parser, cmd, extra, argv) -> None:
    """argparse's "forge-ml: error: unrecognized arguments: --reusme", said by the subcommand
    that was given them, with its nearest flag: "forge-ml train: error: unrecognized argument
    --reusme (did you mean --resume?)". Exits 2."""
    import difflib

    sub = parser._subparsers._group_actions[0].choices.get(cmd) if cmd else None
    if sub is not None and cmd in argv and extra[0] in argv[:argv.index(cmd)]:
        sub = None   # given before the subcommand: forge-ml's own
    target = sub if sub is not None else parser
    flags_ = [o for o in target._option_string_actions if o.startswith("--")]
    first = extra[0]
    near = difflib.get_close_matches(first.split("=", 1)[0], flags_, n=1, cutoff=0.8) \
        if first.startswith("-") else []
    hint = f" (did you mean {near[0]}?)" if near else f" (see {target.prog} --help)"
    what = f"argument {first}" if len(extra) == 1 else f"arguments {' '.join(extra)}"
    target.error(f"unrecognized {what}{hint}")


def _main(argv) -> int:
    """``main``'s body: parse, check the environment, run the command."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unrecognized(parser, args.cmd, extra, sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # --help, --version, or a usage error (already printed)
        return e.code if isinstance(e.code, int) else 2
    if args.cmd is None:
        parser.print_help()
        return 0
    for stream in (sys.stdout, sys.stderr):
        # a stream that cannot encode all text (PYTHONIOENCODING=ascii, a POSIX locale): what
        # it cannot carry is written as escapes, not a UnicodeEncodeError that ended a run
        try:
            if (stream.encoding or "").lower().replace("-", "").replace("_", "") != "utf8":
                stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
    for name in _PATH_ARGS:      # --out=~/x reaches us unexpanded (the shell expands ~ only
        v = getattr(args, name, None)        # at a word's start)
        if isinstance(v, str) and v.startswith("~"):
            setattr(args, name, os.path.expanduser(v))
    try:
        flags.check_environment(warn=False)   # a bad FORGE_* value fails before any work, not midway
        for name, near in flags.unreported_misspellings():
            print(f"{PROG}: warning: {name} is not a forge-ml switch and is ignored; did you mean {near}?",
                  file=sys.stderr)
        if not (args.cmd == "bench" and args.name):   # a benchmark script sets its own threads
            _blas.limit_default()   # and its peer's (torch read OMP_NUM_THREADS set here: 1 thread)
        words = CLI_WORDS.set(True)   # the trainer's errors name this command's flags
        try:
            return _COMMANDS[args.cmd](args)
        finally:   # main() called from Python (a test, a notebook): the library's names again
            CLI_WORDS.reset(words)
    except TrainingError as e:
        print(f"{PROG} {args.cmd}: error: {_unprefixed(e, args.cmd)}", file=sys.stderr)
        return 1
    except ForgeError as e:
        print(f"{PROG} {args.cmd}: error: {_unprefixed(e, args.cmd)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"{PROG} {args.cmd}: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except MemoryError as e:   # NumPy's _ArrayMemoryError on the CPU: one line, no traceback
        print(f"{PROG} {args.cmd}: error: out of memory: {e or 'the host could not allocate more'}; use a "
              f"smaller --batch-size, --block-size or model", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if not _stdout_reader_gone():   # another pipe or socket: an error like any other
            return _os_error(args.cmd, e)
        try:   # `forge-ml sample ... | head`: the status of SIGPIPE, as train's
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    except OSError as e:  # a full disk, a read-only filesystem, ...: one line, no traceback
        return _os_error(args.cmd, e)
