"""An in-process gateway app over a real Redis and a scripted engine, plus a reader of the
Samples it published: the fixture body the gateway unit tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from fastapi.testclient import TestClient

from flywheel._proto import sample_pb2
from flywheel.core.codec import decode_sample
from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore


def gateway_app(
    redis_client: redis.Redis, prefix: str, renderer: ChatRenderer, engine: Any
) -> tuple[TestClient, GatewayDeps, Callable[[], list[sample_pb2.Sample]]]:
    """(test client, the app's deps, a function returning the published Samples in order)."""
    deps = GatewayDeps(
        settings=GatewaySettings(),
        renderer=renderer,
        engines=engine,
        sessions=SessionStore(redis_client, prefix, 3600),
        publisher=StreamProducer(redis_client, f"{prefix}:rollouts"),
    )

    def samples() -> list[sample_pb2.Sample]:
        return [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]

    return TestClient(create_app(deps)), deps, samples
