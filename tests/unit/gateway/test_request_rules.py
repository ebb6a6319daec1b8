"""Request rules OpenAI enforces: message content may be null only on an assistant message that
carries tool calls, and with `gateway.served_model_names` set an unknown model is a 404
`model_not_found` (fake engine, real Redis and tokenizer)."""

import pytest
from fastapi.testclient import TestClient

from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import StreamProducer
from flywheel.gateway.app import GatewayDeps, create_app
from flywheel.gateway.sessions import SessionStore
from flywheel.gateway.tokenization import ChatRenderer

from .test_app import FakeEngine


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _client(redis_client, prefix, renderer, **settings):
    engine = FakeEngine(renderer)
    deps = GatewayDeps(settings=GatewaySettings(**settings), renderer=renderer, engines=engine,
                       sessions=SessionStore(redis_client, prefix, 3600),
                       publisher=StreamProducer(redis_client, f"{prefix}:rollouts"))
    return TestClient(create_app(deps)), engine


CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize(("messages", "index"), [
    ([{"role": "user", "content": None}], 0),
    ([{"role": "user"}], 0),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], 0),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], 1),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                          "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": None}], 2),
])
def test_null_content_is_a_400_naming_the_message(redis_client, prefix, renderer, messages,
                                                  index):
    client, engine = _client(redis_client, prefix, renderer)
    for path in ("/v1/chat/completions", "/s/nope/v1/chat/completions"):
        resp = client.post(path, json={"model": "m", "messages": messages})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == f"messages[{index}].content"
        assert error["type"] == "invalid_request_error"
    assert engine.prompts == []


def test_assistant_tool_call_message_may_have_null_content(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    messages = [{"role": "user", "content": "1 + 1?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert resp.status_code == 200, resp.text
    assert len(engine.prompts) == 1


def test_any_model_name_is_served_by_default(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    resp = client.post("/v1/chat/completions",
                       json={"model": "whatever", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 200 and resp.json()["model"] == "whatever"
    assert client.post("/v1/completions", json={"model": "gpt-x", "prompt": "1"}).status_code == 200


def test_served_model_names_are_listed_and_others_are_404(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer,
                             served_model_names=["policy", "policy-latest"])
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["policy", "policy-latest"]
    assert [m["id"] for m in client.get("/s/x/v1/models").json()["data"]] == [
        "policy", "policy-latest"]
    user = [{"role": "user", "content": "x"}]
    for path, body in [("/v1/chat/completions", {"messages": user}),
                       ("/s/abc/v1/chat/completions", {"messages": user}),
                       ("/v1/completions", {"prompt": "1"})]:
        resp = client.post(path, json={"model": "gpt-4o", **body})
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"]
    assert engine.prompts == []
    ok = client.post("/v1/chat/completions", json={"model": "policy-latest", "messages": user})
    assert ok.status_code == 200 and ok.json()["model"] == "policy-latest"
    assert client.post("/v1/completions", json={"model": "policy", "prompt": "1"}
                       ).status_code == 200
