"""Fixtures for the engine conformance suite: the engine as a real process on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def engine_process(model_dir: Path, **env_overrides: str) -> Iterator[str]:
    """`python -m flywheel.engine` serving `model_dir`; yields its URL once /health is 200."""
    port = free_port()
    env = {
        **os.environ,
        "FLYWHEEL_ENGINE__CONTEXT_LENGTH": "512",
        "FLYWHEEL_ENGINE__THREADS": "1",
        **{f"FLYWHEEL_ENGINE__{k.upper()}": v for k, v in env_overrides.items()},
    }
    cmd = [sys.executable, "-m", "flywheel.engine", "--model-path", str(model_dir),
           "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "engine did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


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
