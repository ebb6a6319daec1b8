"""Idle sessions are finished by the gateway before their Redis record expires: what they hold
is published (live turns with an empty next state, episode segments), counted and logged, once
even with several gateway replicas sweeping at the same time (real Redis, real tokenizer,
scripted fake engine)."""

import json
import logging
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from pydantic import ValidationError

from flywheel.core.codec import decode_sample
from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore
from flywheel.gateway.session.sweep import sweep_idle

from .test_live import U1, U2, ScriptEngine

IDLE_S = 600.0


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _deps(redis_client, prefix, renderer, **settings):
    settings = {"session_idle_finish_s": IDLE_S, **settings}
    return GatewayDeps(
        settings=GatewaySettings(**settings),
        renderer=renderer,
        engines=ScriptEngine(renderer, ["Paris.", "Lyon.", "Nice."]),
        sessions=SessionStore(redis_client, prefix, 3600),
        publisher=StreamProducer(redis_client, f"{prefix}:rollouts"),
    )


def _samples(redis_client, prefix):
    return [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]


def _metric(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _post(client, sid, messages):
    resp = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"model": "m", "messages": messages},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def test_idle_finish_must_come_before_the_ttl():
    with pytest.raises(ValidationError, match="session_idle_finish_s"):
        GatewaySettings(session_ttl_s=600, session_idle_finish_s=600)
    assert GatewaySettings(session_ttl_s=600, session_idle_finish_s=599).session_ttl_s == 600
    assert GatewaySettings().session_idle_finish_s < GatewaySettings().session_ttl_s


def test_sweep_publishes_what_idle_sessions_hold_once(redis_client, prefix, renderer, caplog):
    deps = _deps(redis_client, prefix, renderer)
    client = TestClient(create_app(deps))
    r0 = _post(client, "live-idle", [U1])  # turn 0: waits
    _post(client, "live-idle", [U1, r0, U2])  # turn 0 published; turn 1 waits
    _post(client, "live-idle", [U1, r0, {"role": "user", "content": "Other branch"}])
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": [U1]})
    empty = client.post("/v1/sessions", json={}).json()["session_id"]
    assert len(_samples(redis_client, prefix)) == 1
    before = _metric("flywheel_gateway_sessions_finished_total", reason="idle")
    # Not idle yet: nothing happens.
    assert sweep_idle(deps) == 0 and len(_samples(redis_client, prefix)) == 1
    with caplog.at_level(logging.WARNING, logger="flywheel.gateway.session.sweep"):
        assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 3
    assert _metric("flywheel_gateway_sessions_finished_total", reason="idle") == before + 3
    assert sum("finished by the gateway" in r.getMessage() for r in caplog.records) == 3
    published = _samples(redis_client, prefix)
    live = [s for s in published if s.session_id == "live-idle"]
    assert sorted(s.turn_index for s in live) == [0, 1, 2]
    for s in live[1:]:  # both waiting turns, with an empty next state
        assert not s.HasField("next_state") and s.mode == "live"
    assert json.loads(live[0].next_state.content_json) == U2["content"]
    (episode,) = [s for s in published if s.session_id == sid]
    assert episode.mode == "episode" and sum(episode.loss_mask) > 0
    for session in ("live-idle", sid, empty):
        info = client.get(f"/v1/sessions/{session}").json()
        assert info["status"] == "finished" and info["finished_by"] == "idle"
    # Swept again: nothing twice; a later request or finish is refused and says why.
    assert sweep_idle(deps, now=time.time() + 2 * IDLE_S) == 0
    assert len(_samples(redis_client, prefix)) == len(published)
    late = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": "live-idle"},
        json={"model": "m", "messages": [U1]},
    )
    assert late.status_code == 409 and "idle" in late.json()["error"]["message"]
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1}).status_code == 409


def test_busy_and_recent_sessions_are_left_alone(redis_client, prefix, renderer):
    deps = _deps(redis_client, prefix, renderer)
    client = TestClient(create_app(deps))
    _post(client, "busy", [U1])
    _post(client, "recent", [U1])
    lock = deps.sessions.acquire("busy")  # a request is running in it
    try:
        assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 1
    finally:
        deps.sessions.release(lock)
    assert client.get("/v1/sessions/busy").json()["status"] == "open"
    _post(client, "recent2", [U1])
    assert sweep_idle(deps, now=time.time() + IDLE_S / 2) == 0
    assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 2


def test_replicas_sweeping_together_publish_each_session_once(redis_client, prefix, renderer):
    replicas = [_deps(redis_client, prefix, renderer) for _ in range(3)]
    client = TestClient(create_app(replicas[0]))
    for k in range(12):
        _post(client, f"s{k}", [U1])
    later = time.time() + IDLE_S + 1
    counts = []
    threads = [
        threading.Thread(target=lambda d=d: counts.append(sweep_idle(d, now=later)))
        for d in replicas
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sum(counts) == 12
    published = _samples(redis_client, prefix)
    assert sorted(s.session_id for s in published) == sorted(f"s{k}" for k in range(12))


def test_an_expired_record_is_counted_and_logged(redis_client, prefix, renderer, caplog):
    deps = _deps(redis_client, prefix, renderer)
    client = TestClient(create_app(deps))
    _post(client, "gone", [U1])
    redis_client.delete(f"{prefix}:session:gone")  # what a TTL expiry does
    before = _metric("flywheel_gateway_sessions_expired_total")
    with caplog.at_level(logging.ERROR, logger="flywheel.gateway.session.sweep"):
        assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 0
    assert _metric("flywheel_gateway_sessions_expired_total") == before + 1
    assert any("gone" in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)
    assert deps.sessions.idle(time.time() + 2 * IDLE_S) == []


def test_an_unreadable_record_is_counted_and_the_others_still_swept(
    redis_client, prefix, renderer, caplog
):
    deps = _deps(redis_client, prefix, renderer)
    client = TestClient(create_app(deps))
    _post(client, "bad", [U1])
    _post(client, "good", [U1])
    redis_client.rpush(f"{prefix}:session-log:bad", json.dumps({"token_ids": [1]}))
    before = _metric("flywheel_gateway_sessions_unreadable_total")
    with caplog.at_level(logging.ERROR, logger="flywheel.gateway.session.sweep"):
        assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 1  # "good"
    assert _metric("flywheel_gateway_sessions_unreadable_total") == before + 1
    assert any(
        "bad" in r.getMessage() and "cannot be read" in r.getMessage() for r in caplog.records
    )
    assert [s.session_id for s in _samples(redis_client, prefix)] == ["good"]
    assert deps.sessions.idle(time.time() + 2 * IDLE_S) == []


def test_the_gateway_sweeps_in_the_background(redis_client, prefix, renderer):
    deps = _deps(redis_client, prefix, renderer, session_idle_finish_s=0.5)
    with TestClient(create_app(deps)) as client:  # runs the app's lifespan (the sweeper)
        _post(client, "background", [U1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _samples(redis_client, prefix):
            time.sleep(0.1)
        (turn,) = _samples(redis_client, prefix)
        assert turn.session_id == "background" and not turn.HasField("next_state")
        assert client.get("/v1/sessions/background").json()["finished_by"] == "idle"


def test_sessions_stored_without_the_index_are_swept_too(redis_client, prefix, renderer):
    deps = _deps(redis_client, prefix, renderer)
    client = TestClient(create_app(deps))
    _post(client, "old", [U1])
    lock = deps.sessions.acquire("old")  # its lock key exists while the index is rebuilt
    redis_client.delete(deps.sessions.touched_key)  # as stored by a gateway without the index
    try:
        assert deps.sessions.index_existing() == 1
    finally:
        deps.sessions.release(lock)
    assert deps.sessions.index_existing() == 0
    assert sweep_idle(deps, now=time.time() + IDLE_S + 1) == 1
    (turn,) = _samples(redis_client, prefix)
    assert turn.session_id == "old" and not turn.HasField("next_state")
