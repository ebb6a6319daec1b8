"""Backpressure on a live session is decided before generation (gateway.live_backpressure):
a real Redis, an in-process gateway and a stub engine process whose `/stats` counts the
`/generate` calls it received. `refuse`: the turn that would publish while the stream is at its
high-water mark gets a 429 with Retry-After in the API's own JSON and the engine is never
called; `serve_unrecorded`: the turn is answered, nothing is added to the stream or the
session, and the turn is counted."""

from __future__ import annotations

import httpx
from prometheus_client import REGISTRY

HIGH = 1


def _chat(history: list[dict]) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": history}


def _turns(http: httpx.Client, sid: str, n: int) -> tuple[list[dict], httpx.Response]:
    """`n` turns of one conversation in session `sid`, each extending the one before (so each
    from the second on publishes the previous turn); returns the history and the last answer."""
    history: list[dict] = []
    resp = None
    for i in range(n):
        history.append({"role": "user", "content": f"question {i}"})
        resp = http.post(f"/s/{sid}/v1/chat/completions", json=_chat(history))
        if resp.status_code != 200:
            return history, resp
        history.append(resp.json()["choices"][0]["message"])
    return history, resp


def _unrecorded(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "flywheel_gateway_live_turns_unrecorded_total", {"reason": reason}
    )
    return value or 0.0


def _setup(redis_client, prefix) -> str:
    rollouts = f"{prefix}:rollouts"
    redis_client.xgroup_create(rollouts, "reward", id="0", mkstream=True)
    return rollouts


def test_refused_live_turn_never_reaches_the_engine(procs, inproc_gateway, redis_client, prefix):
    rollouts = _setup(redis_client, prefix)
    engine = procs.stub("ok")
    gw = inproc_gateway([engine], high_water=HIGH)
    with httpx.Client(base_url=gw, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"mode": "live"}).json()["session_id"]
        history, resp = _turns(http, sid, 2)  # turn 2 publishes turn 1: backlog 1 = HIGH
        assert resp.status_code == 200, resp.text
        assert redis_client.xlen(rollouts) == HIGH
        calls = procs.calls(engine)
        assert calls == 2
        record_before = http.get(f"/v1/sessions/{sid}").json()

        history.append({"role": "user", "content": "question 2"})
        refused = http.post(f"/s/{sid}/v1/chat/completions", json=_chat(history))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "backpressure"  # OpenAI error JSON
        assert procs.calls(engine) == calls  # the engine was never asked
        assert redis_client.xlen(rollouts) == HIGH
        assert http.get(f"/v1/sessions/{sid}").json() == record_before  # nothing changed

        # Anthropic Messages on a new live session (X-Session-Id): its own error JSON
        msg = http.post(
            "/v1/messages",
            headers={"X-Session-Id": "bp-messages"},
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert msg.status_code == 429, msg.text
        assert msg.json()["type"] == "error"
        assert msg.json()["error"]["type"] == "rate_limit_error"
        assert int(msg.headers["retry-after"]) >= 1
        assert procs.calls(engine) == calls

        # the trainer side catches up: the same turn is served and recorded
        redis_client.xreadgroup("reward", "r1", {rollouts: ">"})
        redis_client.xack(rollouts, "reward", *[e for e, _ in redis_client.xrange(rollouts)])
        again = http.post(f"/s/{sid}/v1/chat/completions", json=_chat(history))
        assert again.status_code == 200, again.text
        assert procs.calls(engine) == calls + 1
        assert redis_client.xlen(rollouts) == HIGH + 1  # turn 2 published with its next state


def test_serve_unrecorded_answers_and_records_nothing(procs, inproc_gateway, redis_client, prefix):
    rollouts = _setup(redis_client, prefix)
    engine = procs.stub("ok")
    gw = inproc_gateway([engine], high_water=HIGH, live_backpressure="serve_unrecorded")
    with httpx.Client(base_url=gw, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"mode": "live"}).json()["session_id"]
        history, resp = _turns(http, sid, 2)
        assert resp.status_code == 200, resp.text
        record_before = http.get(f"/v1/sessions/{sid}").json()
        counted = _unrecorded("backpressure")

        history.append({"role": "user", "content": "question 2"})
        served = http.post(f"/s/{sid}/v1/chat/completions", json=_chat(history))
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["role"] == "assistant"
        assert procs.calls(engine) == 3  # generated ...
        assert redis_client.xlen(rollouts) == HIGH  # ... but nothing published
        assert http.get(f"/v1/sessions/{sid}").json() == record_before  # nor recorded
        assert _unrecorded("backpressure") == counted + 1

        # a new live session named by X-Session-Id is served without being created
        new = http.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": "bp-unrecorded"},
            json=_chat([{"role": "user", "content": "hi"}]),
        )
        assert new.status_code == 200, new.text
        assert _unrecorded("backpressure") == counted + 2
        assert http.get("/v1/sessions/bp-unrecorded").status_code == 404
        assert redis_client.xlen(rollouts) == HIGH
