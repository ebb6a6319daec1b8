"""Per-key rate and concurrency limits hold across gateway replicas (state in one real Redis),
and a replica killed mid-request gives its concurrency slot back when the slot's lease expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from flywheel.core.redis_server import free_port
from flywheel.gateway.engines.generation import Generation

from ..faults.conftest import Procs, wait_http
from .conftest import build_gateway

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}]}


def test_rate_limit_is_shared_by_two_replicas(redis_client, prefix, renderer):
    a = build_gateway(redis_client, prefix, renderer, auth="on", rate_per_minute=6, rate_burst=2)
    b = build_gateway(redis_client, prefix, renderer, auth="on", rate_per_minute=6, rate_burst=2)
    key, other = a.key("agent"), a.key("agent")
    refused_before = (
        REGISTRY.get_sample_value(
            "flywheel_gateway_rejected_requests_total", {"reason": "rate_limited"}
        )
        or 0.0
    )
    # burst 2, 6 per minute (one token per 10 s): two requests pass in all, whichever replica
    # serves them; per-replica buckets would pass 2 + 2 = 4.
    codes = [
        gw.client.post(CHAT, json=BODY, headers=gw.auth(key)).status_code for gw in (a, b, a, b)
    ]
    assert codes == [200, 200, 429, 429]
    limited = b.client.post(CHAT, json=BODY, headers=b.auth(key))
    assert limited.status_code == 429
    assert 1 <= int(limited.headers["retry-after"]) <= 10  # the next token is <= 10 s away
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert (
        REGISTRY.get_sample_value(
            "flywheel_gateway_rejected_requests_total", {"reason": "rate_limited"}
        )
        >= refused_before + 3
    )
    assert b.client.post(CHAT, json=BODY, headers=b.auth(other)).status_code == 200  # per key


class GatedEngine:
    """Holds every generation until `release` is set; counts generations entered."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def generate(self, input_ids, sampling_params, affinity="", **_):
        self.entered += 1
        await self.release.wait()
        return Generation(
            output_ids=[2],
            output_logprobs=[-0.1],
            text="",
            finish_type="stop",
            matched_eos=True,
            weight_version=0,
            prompt_tokens=len(input_ids),
        )


async def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrency_limit_is_shared_by_two_replicas(redis_client, prefix, renderer):
    a = build_gateway(redis_client, prefix, renderer, auth="on", max_concurrent=1)
    b = build_gateway(redis_client, prefix, renderer, auth="on", max_concurrent=1)
    gated = GatedEngine()
    a.client.app.state.deps.engines = gated
    key, other = a.key("agent"), a.key("agent")

    async def scenario() -> tuple[httpx.Response, ...]:
        def client(gw):
            return httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gw.client.app), base_url="http://gw", timeout=60
            )

        async with client(a) as ca, client(b) as cb:
            held = asyncio.create_task(ca.post(CHAT, json=BODY, headers=a.auth(key)))
            await _until(lambda: gated.entered == 1)  # replica a holds the key's one slot
            refused = await cb.post(CHAT, json=BODY, headers=b.auth(key))
            other_key = await cb.post(CHAT, json=BODY, headers=b.auth(other))
            gated.release.set()
            first = await held
            after = await cb.post(CHAT, json=BODY, headers=b.auth(key))
            return refused, other_key, first, after

    refused, other_key, first, after = asyncio.run(scenario())
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "this key already has 1 requests in flight; wait for one to finish",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert other_key.status_code == 200  # slots are per key
    assert first.status_code == 200 and after.status_code == 200  # released on completion
    leftover = redis_client.keys(f"{prefix}:limit:inflight:*")
    assert all(redis_client.zcard(k) == 0 for k in leftover)


LEASE_S = 6.0


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def test_a_killed_replica_gives_its_slot_back_after_the_lease(
    procs, tmp_path, redis_server, redis_client, prefix, renderer, smollm2_dir
):
    hang = procs.stub("hang")  # the engine never answers: the request stays in flight
    port = free_port()
    cfg = {
        "redis": {"url": redis_server.url},
        "streams": {"prefix": prefix},
        "gateway": {
            "port": port,
            "engine_urls": [hang],
            "tokenizer_path": str(smollm2_dir),
            "security": {"auth": "off", "max_concurrent": 1, "concurrency_lease_s": LEASE_S},
        },
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    replica = procs.spawn(
        [sys.executable, "-m", "flywheel.gateway", "--config", str(path)],
        "gateway-short-lease",
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", 60)

    def stuck_request() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the replica is killed under it
            httpx.post(f"{url}{CHAT}", json=BODY, timeout=300)

    thread = threading.Thread(target=stuck_request, daemon=True)
    thread.start()
    slots = f"{prefix}:limit:inflight:local"  # auth off: every request counts as "local"
    deadline = time.monotonic() + 60
    while Procs.calls(hang) < 1:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    ((member, expiry),) = redis_client.zrange(slots, 0, -1, withscores=True)
    # The lease is renewed while the request runs (every LEASE_S / 3 = 2 s): wait for a renewal
    # (a later expiry), so the slot demonstrably outlives its first lease while the replica lives.
    while redis_client.zscore(slots, member) == expiry:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.1)

    other = build_gateway(redis_client, prefix, renderer, auth="off", max_concurrent=1)
    refused = other.client.post(CHAT, json=BODY)
    assert refused.status_code == 429, refused.text  # the live replica's slot counts here too

    procs.kill(replica)  # SIGKILL: no release, no more renewals
    deadline = time.monotonic() + 60
    while (served := other.client.post(CHAT, json=BODY)).status_code == 429:
        assert time.monotonic() < deadline, "the dead replica's slot never came back"
        time.sleep(0.5)
    assert served.status_code == 200, served.text
    assert redis_client.zscore(slots, member) is None  # expired and swept, not released
    thread.join(timeout=30)


def test_limits_with_redis_down_are_503_not_500(prefix, renderer):
    from flywheel.core.redis_client import connect  # noqa: PLC0415

    down = connect("redis://127.0.0.1:1/0")  # nothing listens there
    gw = build_gateway(down, prefix, renderer, auth="off", rate_per_minute=60, max_concurrent=4)
    # the error is raised in middleware: the app answers it, TestClient must not re-raise it
    client = TestClient(gw.client.app, raise_server_exceptions=False)
    reply = client.post(CHAT, json=BODY)
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == "5"
    assert reply.json()["error"]["type"] == "service_unavailable_error"
