"""Errors of forge-ml: one base class, one kind per boundary.

Every public function checks its inputs and raises one of these with a message that says
what it expected and what it got, e.g.
``ShapeError("matmul: a is (4, 3) but b is (5, 2); inner dims must agree")``.

>>> from forge_ml.errors import ShapeError, ForgeError
>>> issubclass(ShapeError, ForgeError)
True
"""


class ForgeError(Exception):
    """Base class of every error forge-ml raises on purpose."""


class ShapeError(ForgeError, ValueError):
    """A tensor has the wrong rank or size for the op it was given to."""


class DTypeError(ForgeError, TypeError):
    """A tensor has a dtype the op does not accept (or dtypes that disagree)."""


class DeviceError(ForgeError, RuntimeError):
    """A device is unknown or unavailable, or tensors sit on different devices."""


class CaptureError(DeviceError):
    """A graph capture failed after ``run_first``'s real run: ``first`` holds what that run
    returned (its work is done), ``keep`` the memory it lives in."""

    def __init__(self, message: str, first=None, keep=None):
        super().__init__(message)
        self.first, self.keep = first, keep


class OutOfMemoryError(DeviceError, MemoryError):
    """The device could not hold an allocation; says how much was asked and how much is free."""


class CompileError(DeviceError):
    """A CUDA kernel failed to compile; the message carries the NVRTC log."""


class ConfigError(ForgeError, ValueError):
    """A configuration has an unknown key or a value out of range."""


class CheckpointError(ForgeError):
    """A checkpoint is missing, truncated, corrupted or of another architecture."""


class DataError(ForgeError, ValueError):
    """A token shard or text file is malformed (wrong magic, size mismatch, ...)."""


class TokenizerError(ForgeError, ValueError):
    """Text or ids that a tokenizer cannot encode or decode."""


class TapeError(ForgeError, RuntimeError):
    """The tape was misused: backward twice, a saved tensor modified in place, ..."""


class TrainingError(ForgeError, RuntimeError):
    """Training cannot go on, e.g. the loss became NaN or inf."""
