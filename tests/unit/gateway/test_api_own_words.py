"""Each API refuses a request in its own parameter shapes: a forced tool call without tools
names Anthropic's `tool_choice` on Messages and the Responses one on Responses (never the chat
form they are served as), a Messages server tool is refused as a server tool (not for its
missing `input_schema`), and a Responses request without `input` is told that `input` is
required (fake engine, real Redis and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
ADD = {"name": "add", "input_schema": {"type": "object"}}
RESPONSES_ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}}


def _anthropic_message(client, body):
    resp = client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": U, **body})
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    return answer["error"]["message"]


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ({"tool_choice": {"type": "tool", "name": "add"}}, '{"type": "tool", "name": "add"}'),
        ({"tool_choice": {"type": "any"}}, '{"type": "any"}'),
        ({"tool_choice": {"type": "tool", "name": "mul"}, "tools": [ADD]}, "tool 'mul'"),
    ],
)
def test_messages_tool_choice_is_refused_in_anthropic_shapes(
    redis_client, prefix, renderer, body, shown
):
    client, engine = _client(redis_client, prefix, renderer)
    message = _anthropic_message(client, body)
    assert message.startswith("tool_choice: "), message
    assert shown in message, message
    assert "function" not in message and "required" not in message, message
    assert engine.prompts == []


def test_messages_server_tool_is_refused_as_a_server_tool(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    message = _anthropic_message(
        client, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    )
    assert message.startswith("tools[0]: server tools are not supported"), message
    assert "web_search_20250305" in message and "input_schema: Field required" not in message
    assert engine.prompts == []


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (
            {"tool_choice": {"type": "function", "name": "add"}},
            '{"type": "function", "name": "add"}',
        ),
        ({"tool_choice": "required"}, "'required'"),
        ({"tool_choice": {"type": "function", "name": "mul"}, "tools": [RESPONSES_ADD]}, "'mul'"),
    ],
)
def test_responses_tool_choice_is_refused_in_responses_shapes(
    redis_client, prefix, renderer, body, shown
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post("/v1/responses", json={"model": "m", "input": "hi", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == ("tool_choice", "invalid_request_error")
    assert shown in error["message"], error
    assert "'function': {" not in error["message"], error
    assert engine.prompts == []


def test_responses_without_input_says_input_is_required(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    for path in ("/v1/responses", "/s/any/v1/responses"):
        resp = client.post(path, json={"model": "m"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error == {
            "message": "Missing required parameter: 'input'.",
            "type": "invalid_request_error",
            "param": "input",
            "code": None,
        }
    assert engine.prompts == []


def test_forced_calls_with_their_tools_are_still_served(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    ok = client.post(
        "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 8,
            "messages": U,
            "tools": [ADD],
            "tool_choice": {"type": "auto"},
        },
    )
    assert ok.status_code == 200, ok.text
