"""forge-ml: a small, fast deep-learning framework that trains and runs GPT-2 class
transformers on the CPU (NumPy) and NVIDIA GPUs (CuPy, NVRTC kernels, cuBLAS), with a
define-by-run tape autograd.

>>> import forge_ml as fm
>>> fm.zeros((2, 3)).shape
(2, 3)
"""
from . import dtype, ops, rng
from .autograd import Tape, TVar
from .device import Device
from .dtype import bfloat16, float32, float64, int32, int64
from .errors import (CheckpointError, CompileError, ConfigError, DataError, DeviceError,
                     DTypeError, ForgeError, ModelError, ModelTypeError, OutOfMemoryError,
                     ShapeError, TapeError, TokenizerError, TrainingError)
from .tensor import Tensor, from_numpy, full, ones_like, tensor, zeros

__version__ = "0.1.0"

__all__ = [
    "Tape", "TVar", "Tensor", "Device", "tensor", "from_numpy", "zeros", "full", "ones_like",
    "ops", "rng", "dtype", "float32", "float64", "bfloat16", "int32", "int64",
    "ForgeError", "ShapeError", "DTypeError", "DeviceError", "OutOfMemoryError",
    "CompileError", "ConfigError", "CheckpointError", "DataError", "TokenizerError",
    "TapeError", "TrainingError", "ModelError", "ModelTypeError", "__version__",
]
