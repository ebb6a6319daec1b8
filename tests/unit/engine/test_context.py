"""engine.context_length against the model's trained length (SGLang's --context-length rule)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import EngineSettings
from flywheel.engine.context import ALLOW_ENV, check_context_length, trained_context_length

LLAMA_2K = SimpleNamespace(max_position_embeddings=2048)


def test_the_trained_length_comes_from_the_config():
    assert trained_context_length(LLAMA_2K) == 2048
    assert trained_context_length(SimpleNamespace(n_positions=1024)) == 1024
    assert trained_context_length(SimpleNamespace()) is None


def test_a_window_above_the_trained_length_is_refused_saying_what_to_set(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    check_context_length(EngineSettings(context_length=2048), LLAMA_2K)  # equal: fine
    with pytest.raises(ConfigurationError) as err:
        check_context_length(EngineSettings(context_length=4096), LLAMA_2K)
    message = str(err.value)
    assert "engine.context_length (4096)" in message and "2048 tokens" in message
    assert "engine.context_length <= 2048" in message
    assert "engine.allow_longer_context = true" in message and ALLOW_ENV in message


@pytest.mark.parametrize("how", ["setting", "env"])
def test_asked_for_it_is_served_with_a_warning(monkeypatch, caplog, how):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    settings = EngineSettings(context_length=4096, allow_longer_context=how == "setting")
    if how == "env":
        monkeypatch.setenv(ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="flywheel.engine.context"):
        check_context_length(settings, LLAMA_2K)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "4096 is above the model's trained length 2048" in record.getMessage()


def test_a_misspelled_switch_is_refused_at_start():
    with pytest.raises(ValueError, match="allow_longer_contxt"):
        EngineSettings(allow_longer_contxt=True)  # type: ignore[call-arg]
