"""Moved: ``forge_ml.inference.generate``. This module re-exports it for one release, with a
DeprecationWarning."""
import warnings

warnings.warn("forge_ml.generate moved to forge_ml.inference.generate (and forge_ml.inference)",
              DeprecationWarning, stacklevel=2)

from .inference.generate import *  # noqa: E402,F401,F403
from .inference.generate import (FINISH_REASONS, TokenEvent, generate, generate_text,  # noqa: E402,F401
                                 next_token_probs, stream_tokens)
