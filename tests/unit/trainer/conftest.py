"""Fixtures for trainer unit tests."""

from __future__ import annotations

import pytest
from transformers import LlamaForCausalLM

from .factories import tiny_model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_model()
