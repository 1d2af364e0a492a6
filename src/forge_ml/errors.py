"""Errors of forge-ml: one base class, one kind per boundary.

Every public function checks its inputs and raises one of these with a message that says
what it expected and what it got, e.g.
``ShapeError("matmul: a is (4, 3) but b is (5, 2); inner dims must agree")``.

>>> from forge_ml.errors import ShapeError, ForgeError
>>> issubclass(ShapeError, ForgeError)
True
"""
import contextvars
from typing import Optional

CLI_WORDS = contextvars.ContextVar("forge_ml_cli_words", default=False)
"""True where the ``forge-ml`` command line runs (it sets it for its process): the trainer's
errors then name the command's flags (``--max-steps``); else the library's names
(``max_steps``), which a notebook's user typed."""


class ForgeError(Exception):
    """Base class of every error forge-ml raises on purpose: ``except ForgeError`` catches
    bad input of every kind, and nothing else.

    >>> import forge_ml as fm
    >>> try:
    ...     fm.dtype.get("float16")
    ... except fm.ForgeError as e:
    ...     print(type(e).__name__)
    DTypeError
    """


class ShapeError(ForgeError, ValueError):
    """A tensor has the wrong rank or size for the op it was given to.

    >>> import forge_ml as fm
    >>> fm.ops.matmul(fm.zeros((2, 3)), fm.zeros((4, 5)))
    Traceback (most recent call last):
    ...
    forge_ml.errors.ShapeError: matmul: op(a) is (2, 3) but op(b) is (4, 5); inner dims must agree (a (2, 3), b (4, 5), trans_a=False, trans_b=False)
    """


class DTypeError(ForgeError, TypeError):
    """A tensor has a dtype the op does not accept (or dtypes that disagree).

    >>> import forge_ml as fm
    >>> fm.dtype.get("float16")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DTypeError: unknown dtype 'float16'; expected one of ['bfloat16', 'float32', 'float64', 'int32', 'int64']
    """


class DeviceError(ForgeError, RuntimeError):
    """A device is unknown or unavailable, or tensors sit on different devices.

    >>> import forge_ml as fm
    >>> fm.Device.parse("tpu")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DeviceError: unknown device 'tpu'; expected one of 'cpu', 'cuda', ...optionally with an index (e.g. 'cuda:1')
    """


class CaptureError(DeviceError):
    """A graph capture failed after ``run_first``'s real run: ``first`` holds what that run
    returned (its work is done), ``keep`` the memory it lives in."""

    def __init__(self, message: str, first=None, keep=None):
        super().__init__(message)
        self.first, self.keep = first, keep


class OutOfMemoryError(DeviceError, MemoryError):
    """The device could not hold an allocation; says how much was asked and how much is free.
    It is also a MemoryError, so code written for NumPy's out-of-memory catches it.

    >>> issubclass(OutOfMemoryError, MemoryError) and issubclass(OutOfMemoryError, DeviceError)
    True
    """


def host_available_bytes() -> Optional[int]:
    """The memory the host can give without swapping (Linux's MemAvailable, which counts the
    page cache it can drop, where MemFree does not), or None where it is not known.

    >>> host_available_bytes() is None or host_available_bytes() > 0
    True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(who: str, doing: str, need: int, advice) -> None:
    """Refuse, before it is allocated, work whose host memory ``need`` (bytes, an estimate a
    little above the peak) is more than the host has free: Linux hands the arrays out and then
    kills the process as they fill (exit 137, without a word). A ConfigError naming ``who``,
    what it was ``doing``, both amounts and ``advice`` (what to lower: a string, or a function
    of the free bytes); nothing where the free amount is unknown or FORGE_HOST_MEMORY_CHECK is
    off (where the estimate is wrong).

    >>> check_host_memory("f", "a tiny thing", 1, "use less")
    >>> check_host_memory("f", "x", 2 ** 70, "use less")
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: f: x would hold about ... GiB on the CPU, more than the ...
    """
    free = host_available_bytes()
    if free is None or need <= free:
        return
    from . import flags   # (flags imports this module)
    if flags.get("FORGE_HOST_MEMORY_CHECK") == "off":
        return
    said = advice(free) if callable(advice) else advice
    raise ConfigError(f"{who}: {doing} would hold about {need / 2 ** 30:,.1f} GiB on the CPU, "
                      f"more than the {free / 2 ** 30:,.1f} GiB this machine has free; {said}, "
                      f"or FORGE_HOST_MEMORY_CHECK=off where the estimate is wrong")


def host_out_of_memory(op: str, e: BaseException) -> Optional[OutOfMemoryError]:
    """The OutOfMemoryError for NumPy's failed host allocation ``e`` in ``op`` (its
    MemoryError, or the ValueError of a size past the address space), saying what was asked
    and how much memory is free; None where ``e`` is not such a failure.

    >>> import numpy as np
    >>> try:
    ...     np.zeros((2 ** 62, 4))
    ... except ValueError as e:
    ...     print(str(host_out_of_memory("zeros", e))[:44])
    out of host memory: zeros asked for an array
    """
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    too_big = ("array is too big", "Maximum allowed size")   # NumPy's words for past the space
    if not (isinstance(e, MemoryError) or isinstance(e, ValueError) and msg.startswith(too_big)):
        return None
    if isinstance(e, OutOfMemoryError):
        return e
    free = host_available_bytes()
    room = ("the free amount is unknown" if free is None else
            f"{free / 2 ** 30:,.1f} GiB of the host's memory are free")
    return OutOfMemoryError(f"out of host memory: {op} asked for an array NumPy could not allocate "
                            f"({msg}); {room}. Use a smaller batch, sequence length or model")


class CompileError(DeviceError):
    """A CUDA kernel failed to compile; the message carries the NVRTC log.

    >>> issubclass(CompileError, DeviceError)
    True
    """


class ConfigError(ForgeError, ValueError):
    """A configuration has an unknown key or a value out of range.

    >>> from forge_ml.models import GPT2Config
    >>> GPT2Config(vocab_size=65, n_embd=30, n_head=4)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: GPT2Config: n_embd 30 must be divisible by n_head 4
    """


class CheckpointError(ForgeError):
    """A checkpoint is missing, truncated, corrupted or of another architecture.

    >>> from forge_ml.checkpoint import load_checkpoint
    >>> load_checkpoint("/nonexistent/ckpt")
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: checkpoint not found: /nonexistent/ckpt does not exist
    """


class DataError(ForgeError, ValueError):
    """A token shard or text file is malformed (wrong magic, size mismatch, ...).

    >>> from forge_ml.data import read_shard
    >>> read_shard("/nonexistent/val.bin")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DataError: token shard not found: /nonexistent/val.bin
    """


class TokenizerError(ForgeError, ValueError):
    """Text or ids that a tokenizer cannot encode or decode.

    >>> from forge_ml.tokenizer import CharTokenizer
    >>> CharTokenizer.from_text("ab").encode("abc")
    Traceback (most recent call last):
    ...
    forge_ml.errors.TokenizerError: CharTokenizer: character 'c' at position 2 is not in the vocabulary of 2 characters
    """


class TapeError(ForgeError, RuntimeError):
    """The tape was misused: backward twice, a saved tensor modified in place, ...

    >>> import forge_ml as fm
    >>> tape = fm.Tape()
    >>> y = tape.gelu(tape.leaf(fm.tensor([1.0])))
    >>> _ = tape.backward(y, fm.tensor([1.0]))
    >>> tape.backward(y, fm.tensor([1.0]))
    Traceback (most recent call last):
    ...
    forge_ml.errors.TapeError: backward: this tape was already swept; record a new forward
    """


class ModelError(ForgeError, ValueError):
    """A model cannot run as it is: e.g. its weights hold NaN or inf, so its logits do and no
    token can be chosen from them. The message names the first such parameter.

    >>> issubclass(ModelError, ValueError)
    True
    """


class ModelTypeError(ForgeError, TypeError):
    """What was given as a model is not a forge-ml language model (None, a name, another
    library's model). A TypeError too, as Python's own for an argument of the wrong type, so
    ``except TypeError`` catches it; not a ModelError, which is about a model that is one.

    >>> from forge_ml.inference.generate import generate
    >>> generate("gpt2", [1, 2])
    Traceback (most recent call last):
    ...
    forge_ml.errors.ModelTypeError: generate: model must be a forge-ml language model (forge_ml.models.GPT2, e.g. from forge_ml.inference.load_model), got str
    """


class TrainingError(ForgeError, RuntimeError):
    """Training cannot go on, e.g. the loss became NaN or inf.

    >>> issubclass(TrainingError, RuntimeError)
    True
    """


def plural(n: int, noun: str, nouns: Optional[str] = None) -> str:
    """``noun`` for a count ``n`` of one, else its plural (``nouns``, or ``noun`` + "s"): for
    messages' counts, "1 token" and "2 tokens".

    >>> f"{1} {plural(1, 'token')}, {3} {plural(3, 'batch', 'batches')}, {0} {plural(0, 'window')}"
    '1 token, 3 batches, 0 windows'
    """
    return noun if n == 1 else (nouns if nouns is not None else noun + "s")


def check_fields(owner: str, known, given) -> None:
    """A ConfigError for the first of ``given`` (a config's keys or keyword arguments) that is
    not one of ``known`` (its fields), naming the nearest known one, else listing them: where
    a dataclass raises ``TypeError: unexpected keyword argument``.

    >>> check_fields("TrainConfig", ["lr", "max_steps"], ["lr"])
    >>> check_fields("TrainConfig", ["lr", "max_steps"], ["max_step"])
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: TrainConfig: unknown key 'max_step' (did you mean 'max_steps'?)
    """
    known = list(known)
    for k in given:
        if k not in known:
            import difflib
            near = difflib.get_close_matches(str(k), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{owner}: unknown key {k!r}{hint}")


class KnownFields:
    """A dataclass's base whose constructor refuses an unknown keyword with ``check_fields``'s
    ConfigError naming the nearest field (as ``from_dict``'s), where the dataclass's
    ``__init__`` raised a bare TypeError (GPT2Config, TrainConfig).

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Cfg(KnownFields):
    ...     n_layer: int = 2
    >>> Cfg(n_layers=3)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: Cfg: unknown key 'n_layers' (did you mean 'n_layer'?)
    """

    def __new__(cls, *args, **kwargs):
        import dataclasses
        check_fields(cls.__name__, (f.name for f in dataclasses.fields(cls)), kwargs)
        return super().__new__(cls)
