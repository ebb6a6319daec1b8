"""Engine unit-test fixtures."""

from __future__ import annotations

import pytest

from flywheel.engine.runner import ModelRunner


@pytest.fixture(scope="session")
def runner(tiny_model_dir) -> ModelRunner:
    """The tiny random model on CPU (tests must not change its weights)."""
    return ModelRunner(tiny_model_dir, device="cpu")
