"""The engine's context window against the model's trained length (SGLang `--context-length`).

SGLang refuses a `--context-length` above the length the model was trained for unless
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, and then only warns. The engine does the same with
`engine.context_length` and `engine.allow_longer_context` (or that variable).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import EngineSettings

log = logging.getLogger(__name__)

ALLOW_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
"""SGLang's switch; "1" / "true" allows a longer context like `engine.allow_longer_context`."""

_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
"""Hugging Face config attributes that give a model's trained length, first found wins."""


def trained_context_length(config: Any) -> int | None:
    """The model's trained length in tokens from its Hugging Face config, or None if unknown."""
    for key in _LENGTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def longer_context_allowed(settings: EngineSettings) -> bool:
    """`engine.allow_longer_context`, or SGLang's environment switch set to 1 / true."""
    env = os.environ.get(ALLOW_ENV, "").strip().lower()
    return settings.allow_longer_context or env in ("1", "true")


def check_context_length(settings: EngineSettings, config: Any) -> None:
    """Refuse (or, when allowed, warn about) a context window above the trained length.

    Args:
        settings: the engine section (`context_length`, `allow_longer_context`).
        config: the model's Hugging Face config (`max_position_embeddings`, ...).

    Raises:
        ConfigurationError: `context_length` exceeds the trained length and a longer context
            was not allowed; the message says both values and what to set.
    """
    trained = trained_context_length(config)
    if trained is None or settings.context_length <= trained:
        return
    if longer_context_allowed(settings):
        log.warning(
            "engine.context_length %d is above the model's trained length %d "
            "(max_position_embeddings); positions past %d were never trained and outputs "
            "there may degrade",
            settings.context_length,
            trained,
            trained,
        )
        return
    raise ConfigurationError(
        f"engine.context_length ({settings.context_length}) is above the model's trained "
        f"length ({trained} tokens, max_position_embeddings in config.json): set "
        f"engine.context_length <= {trained} (FLYWHEEL_ENGINE__CONTEXT_LENGTH), or set "
        f"engine.allow_longer_context = true ({ALLOW_ENV}=1) to serve it anyway"
    )
