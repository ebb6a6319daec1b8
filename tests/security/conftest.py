"""A gateway app with a canned-token engine, the real tokenizer and real Redis, per test."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from flywheel.core.auth import KeyStore
from flywheel.core.settings import GatewaySettings, SecuritySettings
from flywheel.core.streams import StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore


class CannedEngine:
    """Answers every /generate with "8" + EOS; records the prompts it was sent."""

    def __init__(self, renderer: ChatRenderer):
        self.ids = renderer.encode("8") + [2]
        self.calls: list[list[int]] = []

    async def generate(self, input_ids, sampling_params, affinity=""):
        self.calls.append(list(input_ids))
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.25, -0.5],
            text="8",
            finish_type="stop",
            matched_eos=True,
            weight_version=1,
            prompt_tokens=len(input_ids),
        )


@dataclass
class Gateway:
    client: TestClient
    engine: CannedEngine
    keys: KeyStore
    sessions: SessionStore
    redis: object
    prefix: str
    secrets: dict[str, str] = field(default_factory=dict)

    def key(self, role: str, name: str = "") -> str:
        secret, _ = self.keys.create(role, name)
        return secret

    def auth(self, secret: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {secret}"} if secret else {}


@pytest.fixture(scope="session")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def build_gateway(redis_client, prefix, renderer, host="127.0.0.1", **security) -> Gateway:
    security.setdefault("key_cache_s", 0)
    settings = GatewaySettings(host=host, security=SecuritySettings(**security))
    engine = CannedEngine(renderer)
    sessions = SessionStore(redis_client, prefix, 3600)
    producer = StreamProducer(
        redis_client, f"{prefix}:rollouts", high_water=1000, watch_group="reward"
    )
    deps = GatewayDeps(
        settings=settings,
        renderer=renderer,
        engines=engine,
        sessions=sessions,
        publisher=producer,
        context_length=2048,
    )
    app = create_app(deps)
    return Gateway(
        TestClient(app), engine, KeyStore(redis_client, prefix), sessions, redis_client, prefix
    )


@pytest.fixture
def gateway(redis_client, prefix, renderer) -> Gateway:
    """Authentication on (as outside local mode), no rate limits."""
    return build_gateway(redis_client, prefix, renderer, auth="on")


@pytest.fixture
def make_gateway(redis_client, prefix, renderer):
    """Build a gateway with other security settings: `make_gateway(host=..., auth=...)`."""
    return lambda **kw: build_gateway(redis_client, prefix, renderer, **kw)
