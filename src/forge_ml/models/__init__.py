"""Models built on the tape: GPT-2 (``forge_ml.models.gpt2``)."""
import warnings

from .gpt2 import GPT2, GPT2Config, Layer

__all__ = ["GPT2", "GPT2Config", "Layer"]


def __getattr__(name):
    # KVCache moved to forge_ml.inference.decode (one release of grace)
    if name == "KVCache":
        warnings.warn("forge_ml.models.KVCache moved to forge_ml.inference.KVCache",
                      DeprecationWarning, stacklevel=2)
        from ..inference.decode import KVCache
        return KVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
