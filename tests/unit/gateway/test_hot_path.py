"""The hot path (hot_path.py) serves chat completions without FastAPI's routing layers and must
answer exactly as the FastAPI routes do. A content type of `application/x-chat+json` is JSON to
FastAPI but not taken by the hot path, so the same request goes through each path in turn and
the answers are compared; requests the hot path cannot take reach FastAPI's error answers."""

import json

import pytest
from fastapi.testclient import TestClient

from flywheel.core.codec import decode_sample
from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.gateway.api import hot_path
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore

from .test_app import FakeEngine

SLOW = {"content-type": "application/x-chat+json"}  # FastAPI parses it; the hot path passes
CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def env(redis_client, prefix, renderer, monkeypatch):
    served = []
    original = hot_path.HotPath._serve

    async def counting(self, *args, **kwargs):
        served.append(args[2])  # the session id
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(hot_path.HotPath, "_serve", counting)
    deps = GatewayDeps(
        settings=GatewaySettings(),
        renderer=renderer,
        engines=FakeEngine(renderer),
        sessions=SessionStore(redis_client, prefix, 3600),
        publisher=StreamProducer(redis_client, f"{prefix}:rollouts"),
    )
    return TestClient(create_app(deps)), served, redis_client, prefix


def _post(client, path, body, headers=None):
    return client.post(
        path, content=json.dumps(body), headers=headers or {"content-type": "application/json"}
    )


def _comparable(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/s/{sid}/v1/chat/completions"])
def test_hot_and_fastapi_paths_answer_alike(env, path):
    client, served, redis_client, prefix = env
    sids = [
        client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"] for _ in range(2)
    ]
    hot = _post(client, path.format(sid=sids[0]), CHAT)
    slow = _post(client, path.format(sid=sids[1]), CHAT, SLOW)
    assert hot.status_code == slow.status_code == 200
    assert served == [sids[0] if "{sid}" in path else None]  # only the first took the hot path
    assert _comparable(hot.json()) == _comparable(slow.json())
    assert hot.headers["content-type"] == slow.headers["content-type"]
    if "{sid}" in path:  # both recorded the same turn
        for sid in sids:
            assert client.post(f"/v1/sessions/{sid}/finish", json={}).status_code == 200
        samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]
        assert len(samples) == 2
        assert list(samples[0].token_ids) == list(samples[1].token_ids)
        assert list(samples[0].loss_mask) == list(samples[1].loss_mask)


def test_streams_alike(env):
    client, served, _, _ = env
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    hot, slow = (
        _post(client, "/v1/chat/completions", body),
        _post(client, "/v1/chat/completions", body, SLOW),
    )
    assert len(served) == 1 and hot.status_code == slow.status_code == 200

    def events(text):  # chunk bodies without their per-request id and time
        out = []
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(_comparable(json.loads(line[6:])))
        return out

    assert events(hot.text) == events(slow.text) and hot.text.endswith("data: [DONE]\n\n")


def test_platform_errors_are_the_same_json(env):
    client, served, _, _ = env
    missing = "/s/no-such-session/v1/chat/completions"
    hot, slow = _post(client, missing, CHAT), _post(client, missing, CHAT, SLOW)
    assert len(served) == 1
    assert hot.status_code == slow.status_code == 404
    assert hot.json() == slow.json()
    assert hot.json()["error"]["param"] == "session_id"
    bad_turn = {"content-type": "application/json", "x-turn-type": "other"}
    reply = _post(client, "/v1/chat/completions", CHAT, bad_turn)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "X-Turn-Type"


def test_what_the_hot_path_cannot_take_gets_fastapis_answer(env):
    client, served, _, _ = env
    invalid = {**CHAT, "temperature": "hot"}
    reply = _post(client, "/v1/chat/completions", invalid)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "temperature"
    broken = client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    listed = _post(client, "/v1/chat/completions", [CHAT])
    assert listed.status_code == 400
    text = client.post(
        "/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": "text/plain"}
    )
    assert text.status_code == 400
    for ctype in (None, "", "; charset=utf-8"):  # no media type: FastAPI refuses the body
        headers = {} if ctype is None else {"content-type": ctype}
        untyped = client.post(
            "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers
        )
        assert untyped.status_code == 400, ctype
    assert served == []  # none of them was served by the hot path


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/v1/chat/completions", (True, None)),
        ("/s/abc/v1/chat/completions", (True, "abc")),
        ("/s//v1/chat/completions", (False, None)),
        ("/s/a/b/v1/chat/completions", (False, None)),
        ("/v1/completions", (False, None)),
        ("/v1/chat/completions/", (False, None)),
    ],
)
def test_route_matching(path, expected):
    assert hot_path.route({"type": "http", "method": "POST", "path": path}) == expected
    assert hot_path.route({"type": "http", "method": "GET", "path": path}) == (False, None)
