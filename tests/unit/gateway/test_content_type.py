"""A JSON body sent without `Content-Type: application/json` (`curl -d` sends
`application/x-www-form-urlencoded`) is a 400 that says to send JSON with that header, in the
API's own error format, on every route that takes a body; nothing reaches the engine (fake
engine, real Redis and tokenizer)."""

import json

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
OPENAI = [
    ("/v1/chat/completions", {"model": "m", "messages": U}),
    ("/s/any/v1/chat/completions", {"model": "m", "messages": U}),
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
]
ANTHROPIC = [
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": U}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": U}),
]
FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize("ctype", [FORM, "text/plain", None])
@pytest.mark.parametrize(("path", "body"), OPENAI)
def test_openai_routes_ask_for_a_json_content_type(
    redis_client, prefix, renderer, path, body, ctype
):
    client, engine = _client(redis_client, prefix, renderer)
    headers = {} if ctype is None else {"content-type": ctype}
    resp = client.post(path, content=json.dumps(body).encode(), headers=headers)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in error["message"], error
    assert (ctype or "missing") in error["message"]
    assert "expected an object, but got an object" not in error["message"]
    assert engine.prompts == []


@pytest.mark.parametrize(("path", "body"), ANTHROPIC)
def test_messages_routes_ask_for_a_json_content_type(redis_client, prefix, renderer, path, body):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(path, content=json.dumps(body).encode(), headers={"content-type": FORM})
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in answer["error"]["message"], answer
    assert "valid dictionary" not in answer["error"]["message"]
    assert engine.prompts == []


def test_a_json_content_type_is_still_served(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    for ctype in ("application/json", "application/json; charset=utf-8"):
        body = json.dumps({"model": "m", "messages": U, "max_tokens": 4}).encode()
        resp = client.post("/v1/chat/completions", content=body, headers={"content-type": ctype})
        assert resp.status_code == 200, resp.text
