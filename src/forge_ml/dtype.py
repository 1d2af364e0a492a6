"""Data types of forge-ml tensors.

float32 and float64 compute on every device; int32 and int64 hold token ids; bfloat16 is
the GPU's storage type for mixed-precision training (float32 accumulation in every kernel).

>>> from forge_ml import dtype
>>> dtype.get("float32").itemsize
4
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import DTypeError


@dataclass(frozen=True)
class DType:
    """A named element type: its ``name``, ``itemsize`` in bytes and whether it ``is_float``;
    ``get`` turns a name or a NumPy dtype into one.

    >>> import forge_ml as fm
    >>> fm.bfloat16.name, fm.bfloat16.itemsize, fm.bfloat16.is_float, fm.int64.is_float
    ('bfloat16', 2, True, False)
    """

    name: str
    itemsize: int
    is_float: bool

    def __repr__(self) -> str:
        return f"forge_ml.{self.name}"


float32 = DType("float32", 4, True)
float64 = DType("float64", 8, True)
bfloat16 = DType("bfloat16", 2, True)
int32 = DType("int32", 4, False)
int64 = DType("int64", 8, False)

ALL = {d.name: d for d in (float32, float64, bfloat16, int32, int64)}
FLOATS = (float32, float64, bfloat16)
INTS = (int32, int64)


def get(d) -> DType:
    """Turn a DType, a name ("float32", "bf16") or a NumPy dtype into a DType; None is an
    error (NumPy would read it as float64).

    >>> get("bf16").name
    'bfloat16'
    """
    if isinstance(d, DType):
        return d
    if d is None:   # np.dtype(None) is float64: never a silent choice
        raise DTypeError(f"expected a dtype (one of {sorted(ALL)}), got None")
    if isinstance(d, str):
        name = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32",
                "fp64": "float64", "f64": "float64"}.get(d, d)
        if name in ALL:
            return ALL[name]
        raise DTypeError(f"unknown dtype {d!r}; expected one of {sorted(ALL)}")
    try:
        name = np.dtype(d).name
    except TypeError:
        name = str(d)
    if name in ALL:
        return ALL[name]
    raise DTypeError(f"unsupported dtype {d!r}; expected one of {sorted(ALL)}")


# NumPy/CuPy array dtype -> DType, filled on first sight: ``Tensor`` asks this on every new
# tensor (hundreds per training step), where ``get``'s general path costs ~7 us.
_BY_ARRAY_DTYPE: dict = {}


def of_array(array_dtype) -> DType:
    """The DType of an array's ``.dtype`` (a NumPy dtype object); as ``get``, but cached.

    >>> of_array(np.zeros(2, np.float64).dtype).name
    'float64'
    """
    d = _BY_ARRAY_DTYPE.get(array_dtype)
    if d is None:
        d = _BY_ARRAY_DTYPE[array_dtype] = get(array_dtype)
    return d

