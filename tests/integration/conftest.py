"""A local stack serving the real SmolLM2-135M-Instruct, shared by the gateway client tests.

The trainer is configured never to step (its groups never fill), so the engine keeps the weights
that produced every recorded Sample and fidelity checks compare like with like.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flywheel.core.auth import KeyStore
from flywheel.core.redis_client import connect
from flywheel.core.settings import FlywheelSettings, load_settings
from flywheel.ops.stack import Stack


@dataclass
class SmolStack:
    gateway: str
    engine: str
    settings: FlywheelSettings

    def rollouts(self) -> list:
        """Every Sample published to the rollouts stream so far, oldest first."""
        from flywheel.core.codec import decode_sample  # noqa: PLC0415
        from flywheel.core.streams import FIELD  # noqa: PLC0415

        client = connect(self.settings.redis_url())
        key = self.settings.streams.key("rollouts")
        return [decode_sample(fields[FIELD]) for _, fields in client.xrange(key)]

    def session_samples(self, session_id: str) -> list:
        return [s for s in self.rollouts() if s.session_id == session_id]


@pytest.fixture(scope="session")
def smol_stack(tmp_path_factory, redis_server, smollm2_dir) -> Iterator[SmolStack]:
    state = tmp_path_factory.mktemp("smol_state")
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "clients", "block_ms": 200},
        engine={"model_path": str(smollm2_dir), "port": 31100, "batch_wait_ms": 5},
        gateway={
            "port": 8810,
            "default_max_tokens": 48,
            "session_headers": ["x-conversation-id"],
        },
        reward={"port": 50161, "metrics_port": 9211},
        trainer={
            "port": 8910,
            "batch": {"groups_per_step": 1000, "group_size": 8},
            "checkpoint": {"dir": str(state / "ckpt")},
            "logging": {"metrics_path": str(state / "trainer_metrics.jsonl")},
        },
        state_dir=str(state),
    )
    with Stack(settings, echo=lambda _: None) as running:
        urls = {s.name: s.url for s in running.services}
        yield SmolStack(gateway=urls["gateway"], engine=urls["engine"], settings=settings)


@dataclass
class KeyedGateway(SmolStack):
    """`gateway` requires a key; `engine` is the shared engine; Samples go to `settings`' prefix."""

    agent_key: str = ""
    admin_key: str = ""


@pytest.fixture(scope="session")
def keyed_gateway(
    tmp_path_factory, redis_server, smollm2_dir, smol_stack
) -> Iterator[KeyedGateway]:
    """A second gateway that requires API keys, for client tests that send one (pi, the schema
    fuzzer). It serves from `smol_stack`'s engine with its own stream prefix and key store, so
    its keys never turn authentication on for the other client tests (`auth = "auto"` requires
    keys as soon as one exists), and no second model is loaded."""
    state = tmp_path_factory.mktemp("keyed_state")
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "keyed", "block_ms": 200},
        engine={"model_path": str(smollm2_dir)},
        gateway={
            "port": 8811,
            "default_max_tokens": 48,
            "engine_urls": [smol_stack.engine],
            "security": {"auth": "on"},
        },
        state_dir=str(state),
    )
    keys = KeyStore(connect(redis_server.url), settings.streams.prefix)
    agent_key, _ = keys.create("agent", "clients")
    admin_key, _ = keys.create("admin", "fuzz")
    with Stack(settings, echo=lambda _: None, only=("gateway",)) as running:
        yield KeyedGateway(
            gateway=running.services[0].url,
            engine=smol_stack.engine,
            settings=settings,
            agent_key=agent_key,
            admin_key=admin_key,
        )
