"""A stack whose gateway serves clients without an API key says so on the console (the lines
`flywheel up` and `flywheel demo` print as it starts), with how to turn keys on; a gateway that
requires keys gets no such line. Real Redis and gateway processes (Stack, gateway only)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from flywheel.core.auth import KeyStore
from flywheel.core.redis_client import connect
from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _start(tmp_path, redis_server, model: str, prefix: str) -> tuple[list[str], str]:
    """Start a gateway-only stack on the `prefix` deployment; returns its console lines and
    the status of a request without a key, then stops it."""
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": prefix},
        engine={"model_path": model},
        state_dir=str(tmp_path / prefix),
    )
    lines: list[str] = []
    with Stack(settings, echo=lines.append, only=("gateway",)) as stack:
        gateway = stack.services[0].url
        status = httpx.get(f"{gateway}/v1/sessions/nope", timeout=10).status_code
    return lines, f"{gateway} {status}"


def test_a_gateway_without_keys_is_announced_on_the_console(tmp_path, redis_server, tiny_model_dir):
    prefix = f"open{uuid.uuid4().hex[:6]}"
    lines, answered = _start(tmp_path, redis_server, str(tiny_model_dir), prefix)
    gateway, status = answered.split()
    assert status == "404"  # served without a key (no such session)
    warnings = [line for line in lines if "authentication is off" in line]
    assert len(warnings) == 1, lines
    assert gateway in warnings[0]
    assert "`flywheel keys create --role admin`" in warnings[0]
    assert "gateway.security.auth" in warnings[0]


def test_a_gateway_that_requires_keys_is_not_announced(tmp_path, redis_server, tiny_model_dir):
    prefix = f"keyed{uuid.uuid4().hex[:6]}"
    KeyStore(connect(redis_server.url), prefix).create("admin", "ops")  # keys now required
    lines, answered = _start(tmp_path, redis_server, str(tiny_model_dir), prefix)
    assert answered.endswith(" 401")
    assert not [line for line in lines if "authentication is off" in line], lines
