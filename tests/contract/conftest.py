"""Fixtures for the engine conformance suite: the engine as a real process on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..engine_process import engine_process


@pytest.fixture(scope="session")
def start_engine():
    """`engine_process` itself, for modules that need an engine of their own."""
    return engine_process


@pytest.fixture(scope="session")
def shared_live_engine(tiny_model_dir) -> Iterator[str]:
    """One engine process on the tiny model for read-only tests."""
    with engine_process(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir) -> Iterator[str]:
    """The real SmolLM2-135M-Instruct served by an engine process (read-only tests)."""
    with engine_process(smollm2_dir, served_model_name="SmolLM2-135M-Instruct") as url:
        yield url


@pytest.fixture(scope="module")
def client(tiny_engine, tiny_model_dir):
    """The engine app in process (FastAPI TestClient) around the shared tiny worker."""
    from fastapi.testclient import TestClient

    from flywheel.engine.app import EngineDeps, create_app

    deps = EngineDeps(engine=tiny_engine, settings=tiny_engine.settings, model_path=tiny_model_dir)
    return TestClient(create_app(deps))
