"""A second gateway that requires API keys, for client tests that send one (pi, the schema fuzzer).

It serves from `smol_stack`'s engine with its own stream prefix and key store, so the keys made
here never turn authentication on for the other client tests (`auth = "auto"` requires keys as
soon as one exists), and no second model is loaded. Test modules import the fixture by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flywheel.core.auth import KeyStore
from flywheel.core.redis_client import connect
from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack

from .conftest import SmolStack


@dataclass
class KeyedGateway(SmolStack):
    """`gateway` requires a key; `engine` is the shared engine; Samples go to `settings`' prefix."""

    agent_key: str = ""
    admin_key: str = ""


@pytest.fixture(scope="session")
def keyed_gateway(
    tmp_path_factory, redis_server, smollm2_dir, smol_stack
) -> Iterator[KeyedGateway]:
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
