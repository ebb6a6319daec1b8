"""Engine faults seen by a real gateway process: 500, a connection dropped mid-body, a non-JSON
200 and a hang. One retry on the other engine serves the turn, recorded once; when every engine
fails the client gets a clear 502 and the session is left exactly as it was."""

from __future__ import annotations

import socket

import httpx
import pytest

from flywheel.core.codec import decode_sample
from flywheel.core.streams import FIELD
from flywheel.gateway.engines.pool import EnginePool

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}
SESSIONS = 6  # the session-affine order puts the faulty engine first for some of them


def _session_ids(bad: str, good: str) -> list[str]:
    """SESSIONS ids, the first one's affinity trying the faulty engine first (the pool's own
    order), so the retry path runs every time, not by chance."""
    pool = EnginePool([bad, good], timeout_s=1.0, stop_token_ids=set())
    first = next(f"fault-{i}" for i in range(64) if pool.order(f"fault-{i}")[0] == bad)
    return [first] + [f"{first}-{i}" for i in range(1, SESSIONS)]


@pytest.mark.parametrize("fault", ["500", "drop", "garbage", "hang"])
def test_one_faulty_engine_is_retried_elsewhere_and_recorded_once(
    procs, inproc_gateway, redis_client, prefix, fault
):
    bad, good = procs.stub(fault), procs.stub("ok")
    gw = inproc_gateway([bad, good], request_timeout_s=1.0)
    with httpx.Client(base_url=gw, timeout=30) as client:
        for i, wanted in enumerate(_session_ids(bad, good)):
            sid = client.post(
                "/v1/sessions", json={"group_id": f"g{i}", "session_id": wanted}
            ).json()["session_id"]
            reply = client.post(f"/s/{sid}/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "8"
            assert client.post(f"/v1/sessions/{sid}/finish", json={}).status_code == 200
        metrics = client.get("/metrics").text
    assert procs.calls(bad) >= 1, "the faulty engine was never tried first"
    assert procs.calls(good) == SESSIONS
    samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]
    assert len(samples) == SESSIONS and len({s.sample_id for s in samples}) == SESSIONS
    for s in samples:  # the good engine's tokens, once: prompt + [28, 2]
        assert list(s.token_ids[-2:]) == [28, 2] and sum(s.loss_mask) == 2
    assert f'flywheel_gateway_engine_errors_total{{engine="{bad}"}}' in metrics


@pytest.mark.parametrize("fault", ["500", "drop", "garbage"])
def test_every_engine_failing_is_a_clear_502_and_records_nothing(
    procs, inproc_gateway, redis_client, prefix, fault
):
    engines = [procs.stub(fault), procs.stub(fault)]
    gw = inproc_gateway(engines)
    with httpx.Client(base_url=gw, timeout=30) as client:
        sid = client.post("/v1/sessions", json={}).json()["session_id"]
        reply = client.post(f"/s/{sid}/v1/chat/completions", json=CHAT)
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error["type"] == "upstream_error" and "no engine could serve" in error["message"]
        assert "Error(" not in error["message"]  # in words, not aiohttp's exception repr
        state = client.get(f"/v1/sessions/{sid}").json()
        assert state["turns"] == 0 and state["token_ids"] == []
        assert client.post(f"/v1/sessions/{sid}/finish", json={}).json()["samples_published"] == 0
    assert sum(procs.calls(e) for e in engines) == 2  # one try each: bounded
    assert redis_client.xlen(f"{prefix}:rollouts") == 0


def test_every_engine_hanging_is_a_504_naming_the_timeout_and_keeps_them_in_service(
    procs, inproc_gateway, redis_client, prefix
):
    """Slow is not broken: a call past gateway.request_timeout_s is a 504 that names the
    setting, and the engines stay in service (flywheel_gateway_engine_up 1)."""
    engines = [procs.stub("hang"), procs.stub("hang")]
    gw = inproc_gateway(engines, request_timeout_s=1.0)
    with httpx.Client(base_url=gw, timeout=30) as client:
        sid = client.post("/v1/sessions", json={}).json()["session_id"]
        reply = client.post(f"/s/{sid}/v1/chat/completions", json=CHAT)
        assert reply.status_code == 504, reply.text
        error = reply.json()["error"]
        assert error["type"] == "timeout_error" and error["code"] == "engine_timeout"
        assert "gateway.request_timeout_s" in error["message"]
        assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 0
        metrics = client.get("/metrics").text
    for engine in engines:
        assert f'flywheel_gateway_engine_up{{engine="{engine}"}} 0.0' not in metrics
        assert f'flywheel_gateway_engine_timeouts_total{{engine="{engine}"}} 1.0' in metrics
    assert redis_client.xlen(f"{prefix}:rollouts") == 0


def _closed_port_url() -> str:
    """An engine URL nothing listens on (a port bound, then closed): connection refused, as
    while `flywheel up` starts a killed engine again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("stream", [False, True])
def test_no_engine_running_is_a_503_with_retry_after_in_plain_words(
    inproc_gateway, redis_client, prefix, stream
):
    """Every engine refusing the connection (not running: stopped, or starting again) is a 503
    `engine_unavailable` with Retry-After, which SDK clients wait for and retry, not a 502 with
    aiohttp's repr of the connection key."""
    gw = inproc_gateway([_closed_port_url(), _closed_port_url()])
    with httpx.Client(base_url=gw, timeout=30) as client:
        sid = client.post("/v1/sessions", json={}).json()["session_id"]
        reply = client.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "stream": stream})
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "5"
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
        assert "connection refused: the engine is not running" in error["message"].lower()
        assert "ConnectionKey" not in error["message"] and "Error(" not in error["message"]
        assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 0
    assert redis_client.xlen(f"{prefix}:rollouts") == 0
