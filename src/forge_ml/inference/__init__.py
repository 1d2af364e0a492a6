"""The inference wing: loading models (``load``), the decoding runtime (``decode``: the KV
cache and the one-token step captured as a CUDA graph), generation (``generate``), and the
continuous-batching engine the server drives (``batch``, ``engine``).

>>> from forge_ml.inference import generate, load_model
>>> callable(generate), callable(load_model)
(True, True)
"""
from .beam import beam_search
from .decode import DecodeStep, KVCache, decoder, row_step
from .generate import (FINISH_REASONS, TokenEvent, apply_repetition_penalty, generate, generate_text,
                       next_token_probs, stream_tokens, token_logprobs)
from .load import hf_tokenizer_dict, load_model, resolve_checkpoint

__all__ = ["DecodeStep", "KVCache", "decoder", "row_step", "generate", "generate_text",
           "next_token_probs", "stream_tokens", "TokenEvent", "FINISH_REASONS", "beam_search",
           "token_logprobs", "apply_repetition_penalty", "load_model",
           "resolve_checkpoint", "hf_tokenizer_dict", "BatchEngine"]


def __getattr__(name):
    # BatchEngine on first use: it brings asyncio (about 20 ms) that generate does not need
    if name == "BatchEngine":
        from .batch import BatchEngine
        return BatchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
