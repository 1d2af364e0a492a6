"""Models built on the tape: GPT-2 (``forge_ml.models.gpt2``)."""
from .gpt2 import GPT2, GPT2Config, KVCache

__all__ = ["GPT2", "GPT2Config", "KVCache"]
