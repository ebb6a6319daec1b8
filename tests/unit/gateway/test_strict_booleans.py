"""Boolean request fields take JSON true/false only: `"stream": "yes"`, `1` or `"false"` is a
400 in the API's own error format naming the field (pydantic would otherwise coerce them), and
nothing reaches the engine (fake engine, real Redis and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

OPENAI = [
    ("/v1/chat/completions", {"model": "m", "messages": U, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "m", "messages": U, "stream": 1}, "stream"),
    ("/v1/chat/completions", {"model": "m", "messages": U, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": U, "store": "false"}, "store"),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": U, "tools": [TOOL], "parallel_tool_calls": "no"},
        "parallel_tool_calls",
    ),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "echo": 0}, "echo"),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": "yes"}, "stream"),
    ("/v1/responses", {"model": "m", "input": "hi", "store": "true"}, "store"),
    (
        "/v1/responses",
        {"model": "m", "input": "hi", "parallel_tool_calls": 1},
        "parallel_tool_calls",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), OPENAI)
def test_a_non_boolean_is_an_openai_400_naming_the_field(
    redis_client, prefix, renderer, path, body, param
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(path, json={"model": "m", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert engine.prompts == []


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_a_non_boolean_stream_is_an_anthropic_400_naming_the_field(
    redis_client, prefix, renderer, value
):
    client, engine = _client(redis_client, prefix, renderer)
    body = {"model": "m", "max_tokens": 8, "messages": U, "stream": value}
    resp = client.post("/v1/messages", json=body)
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "stream" in answer["error"]["message"]
    assert engine.prompts == []


def test_real_booleans_are_still_accepted(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    for path, body in [
        ("/v1/chat/completions", {"model": "m", "messages": U, "stream": False, "logprobs": True}),
        ("/v1/completions", {"model": "m", "prompt": "hi", "echo": False}),
    ]:
        resp = client.post(path, json={"model": "m", **body})
        assert resp.status_code == 200, resp.text
