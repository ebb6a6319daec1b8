"""`POST /v1/responses` streamed, and the client leaves after the first text: the gateway stops
the turn (the engine call dropped), records nothing and stores no response; the same request
sent again is the one turn recorded (real gateway over HTTP, a stub engine process, Redis)."""

from __future__ import annotations

import json
import re
import time

import httpx

from flywheel.gateway.session.store import SessionStore

BODY = {"model": "m", "input": "What is 7 + 1?", "max_output_tokens": 8, "stream": True}


def _abandoned(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    found = re.search(r'flywheel_gateway_requests_abandoned_total{kind="session"} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def _dropped_by_engine(stub: str, want: int) -> int:
    deadline = time.monotonic() + 10
    while (
        dropped := httpx.get(f"{stub}/stats").json()["dropped"]
    ) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return dropped


def test_a_client_leaving_a_streamed_response_stops_the_turn_unrecorded(
    procs, inproc_gateway, redis_client, prefix
):
    stub = procs.stub("trickle")  # the first token at once, the rest after 3 s
    gw = inproc_gateway([stub])
    headers = {"X-Session-Id": "resp-left"}
    with httpx.Client(base_url=gw, timeout=30) as client:
        before = _abandoned(client)
        with client.stream("POST", "/v1/responses", json=BODY, headers=headers) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():  # the first text arrives while sampling
                if '"response.output_text.delta"' in line:
                    break
            else:
                raise AssertionError("no text before the turn ended")
        assert _dropped_by_engine(stub, 1) == 1  # leaving dropped the engine call
        deadline = time.monotonic() + 10
        while _abandoned(client) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _abandoned(client) == before + 1
        assert redis_client.keys(f"{prefix}:response:*") == []  # nothing stored
        retry = client.post("/v1/responses", json=BODY, headers=headers)  # read to its end
        assert retry.status_code == 200, retry.text
        last = json.loads(retry.text.strip().rsplit("data: ", 1)[1])
        assert last["type"] == "response.completed", last
        stored = redis_client.keys(f"{prefix}:response:*")
        assert [k.decode().rsplit(":", 1)[1] for k in stored] == [last["response"]["id"]]
        assert client.post("/v1/sessions/resp-left/finish", json={}).status_code == 200
    record = SessionStore(redis_client, prefix, 60).get("resp-left")
    assert record.turns == 1 and record.forks == 0
    assert redis_client.xlen(f"{prefix}:rollouts") == 1  # the retry's turn only
