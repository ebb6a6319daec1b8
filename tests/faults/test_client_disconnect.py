"""A client that gives up on a request (its timeout, a cancelled agent) closes the connection:
the gateway stops the turn, drops its engine call and records nothing, so the client's retry
is the one turn recorded, not a second branch beside a reply nobody received."""

from __future__ import annotations

import asyncio
import gc
import re
import time

import httpx
import pytest

from flywheel.core.codec import decode_sample
from flywheel.core.streams import FIELD
from flywheel.gateway.session.store import SessionStore

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}
HOT = {"content-type": "application/json"}
ROUTED = {"content-type": "application/vnd.api+json"}
"""A JSON media type the hot path leaves to the FastAPI route (hot_path.py)."""


def _abandoned(client: httpx.Client, kind: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf'flywheel_gateway_requests_abandoned_total{{kind="{kind}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def _dropped_by_engine(stub: str, want: int) -> int:
    deadline = time.monotonic() + 10
    while (
        dropped := httpx.get(f"{stub}/stats").json()["dropped"]
    ) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return dropped


def _waiting_for_text() -> set[int]:
    """ids of the tasks in this process (the in-process gateway's loop included) still waiting
    on an `asyncio.Queue.get`: a streamed answer's wait for its next text."""
    return {
        id(obj)
        for obj in gc.get_objects()
        if isinstance(obj, asyncio.Task)
        and not obj.done()
        and getattr(obj.get_coro(), "__qualname__", "") == "Queue.get"
    }


@pytest.mark.parametrize("mode", ["episode", "live-stream", "episode-routed"])
def test_an_abandoned_turn_is_stopped_and_only_its_retry_is_recorded(
    procs, inproc_gateway, redis_client, prefix, mode
):
    stub = procs.stub("slow")  # answers after 3 s
    gw = inproc_gateway([stub])
    headers = ROUTED if mode == "episode-routed" else HOT
    with httpx.Client(base_url=gw, timeout=30) as client:
        before = _abandoned(client, "session")
        if mode == "live-stream":
            sid, path = "live-1", "/v1/chat/completions"
            headers = {**headers, "X-Session-Id": sid}
            body = {**CHAT, "stream": True}
        else:
            sid = client.post("/v1/sessions", json={}).json()["session_id"]
            path, body = f"/s/{sid}/v1/chat/completions", CHAT
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s
            client.post(path, json=body, headers=headers, timeout=1.0)
        assert _dropped_by_engine(stub, 1) == 1  # the engine call was dropped too
        retry = client.post(path, json=body, headers=headers)  # what the openai SDK does
        assert retry.status_code == 200, retry.text
        assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
        assert _abandoned(client, "session") == before + 1
    record = SessionStore(redis_client, prefix, 60).get(sid)
    assert record.turns == 1 and record.forks == 0 and record.branches == []
    samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]
    assert len(samples) == 1 and sum(samples[0].loss_mask) == 2  # the retry's [28, 2] only
    assert procs.calls(stub) == 2


def test_an_abandoned_unrecorded_request_drops_its_engine_call(procs, inproc_gateway):
    stub = procs.stub("slow")
    gw = inproc_gateway([stub])
    with httpx.Client(base_url=gw, timeout=30) as client:
        before = _abandoned(client, "unrecorded")
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=CHAT, timeout=1.0)
        assert _dropped_by_engine(stub, 1) == 1
        assert _abandoned(client, "unrecorded") == before + 1


@pytest.mark.parametrize("mode", ["episode", "live"])
def test_a_client_leaving_mid_stream_stops_the_turn_unrecorded(
    procs, inproc_gateway, redis_client, prefix, mode
):
    stub = procs.stub("trickle")  # the first token at once, the rest after 3 s
    gw = inproc_gateway([stub])
    with httpx.Client(base_url=gw, timeout=30) as client:
        before = _abandoned(client, "session")
        if mode == "live":
            sid, path, headers = "live-2", "/v1/chat/completions", {**HOT, "X-Session-Id": "live-2"}
        else:
            sid = client.post("/v1/sessions", json={}).json()["session_id"]
            path, headers = f"/s/{sid}/v1/chat/completions", HOT
        waiting = _waiting_for_text()
        with client.stream("POST", path, json={**CHAT, "stream": True}, headers=headers) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():  # the first token's text arrives while sampling
                if line.startswith("data: ") and '"content": "8"' in line:
                    break
            else:
                pytest.fail("no content before the turn ended")
        assert _dropped_by_engine(stub, 1) == 1  # leaving dropped the engine call
        deadline = time.monotonic() + 10
        while _abandoned(client, "session") < before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _abandoned(client, "session") == before + 1
        # The stream's wait for its next text was cancelled, not left for the garbage
        # collector ("Task was destroyed but it is pending!" some 30 s later).
        assert _waiting_for_text() - waiting == set()
        assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    record = SessionStore(redis_client, prefix, 60).get(sid)
    assert record.turns == 0 and record.forks == 0
    assert redis_client.xlen(f"{prefix}:rollouts") == 0
