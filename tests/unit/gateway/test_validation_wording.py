"""A request that fails validation is a 400 worded as the official API words it: OpenAI's
sentences on chat, completions, Responses and the session routes ("Invalid type for
'max_tokens': expected an integer, but got a string instead.", `param` the field path), never
pydantic's ("Input should be a valid integer", "Field required", loc tuples); Anthropic's error
JSON on Messages (fake engine, real Redis and tokenizer, the gateway app over ASGI)."""

from __future__ import annotations

import pytest

from flywheel.core.validation_messages import openai_message
from flywheel.gateway.render.tokenization import ChatRenderer

from .test_request_rules import _client


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


U = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": U}
PYDANTIC_WORDS = ("Input should", "Field required", "Extra inputs", "('body'", "List should")


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": "abc"},
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
            "max_tokens",
        ),
        (
            "/s/some-session/v1/chat/completions",
            {**CHAT, "temperature": "hot"},
            "Invalid type for 'temperature': expected a decimal, but got a string instead.",
            "temperature",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "temperature": 2.5},
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got "
            "2.5 instead.",
            "temperature",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "n": 0},
            "Invalid 'n': number below minimum value. Expected a value >= 1, but got 0 instead.",
            "n",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "bogus": 1},
            "Unrecognized request argument supplied: bogus",
            "bogus",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"content": "x"}]},
            "Missing required parameter: 'messages[0].role'.",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "Invalid value: 'wizard'. Supported values are: 'system', 'developer', 'user', "
            "'assistant' or 'tool'.",
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": "hi"},
            "Invalid type for 'messages': expected an array, but got a string instead.",
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "m"},
            "Missing required parameter: 'messages'.",
            "messages",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "max_tokens": "abc"},
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
            "max_tokens",
        ),
        (
            "/v1/completions",
            {"model": "m"},
            "Missing required parameter: 'prompt'.",
            "prompt",
        ),
        (
            "/v1/responses",
            {"model": "m", "input": "x", "max_output_tokens": "abc"},
            "Invalid type for 'max_output_tokens': expected an integer, but got a string instead.",
            "max_output_tokens",
        ),
        (
            "/v1/responses",
            {"model": "m", "input": "x", "stream": "yes"},
            "Invalid type for 'stream': expected a boolean, but got a string instead.",
            "stream",
        ),
        (
            "/v1/sessions",
            {"group_id": 5},
            "Invalid type for 'group_id': expected a string, but got an integer instead.",
            "group_id",
        ),
        (
            "/v1/sessions",
            {"task": 5},
            "Invalid type for 'task': expected an object, but got an integer instead.",
            "task",
        ),
    ],
)
def test_openai_routes_word_validation_errors_as_openai(
    redis_client, prefix, renderer, path, body, message, param
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    assert not any(words in resp.text for words in PYDANTIC_WORDS), resp.text
    assert engine.prompts == []


def test_messages_answers_in_anthropic_error_json_with_a_field_path(redis_client, prefix, renderer):
    """Anthropic's error JSON, the field a path, never a tuple, the reason in words (a missing
    field as Anthropic's API words it: "max_tokens: Field required")."""
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post("/v1/messages", json={**CHAT, "max_tokens": "abc"})
    assert resp.status_code == 400
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == (
        "Invalid type for 'max_tokens': expected an integer, but got a string instead."
    )
    assert "('body'" not in resp.text and "loc" not in body["error"]
    assert engine.prompts == []


@pytest.mark.parametrize(
    ("error", "param", "message"),
    [
        (
            {"type": "int_parsing", "input": "abc"},
            "max_tokens",
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
        ),
        (
            {"type": "string_type", "input": None},
            "user",
            "Invalid type for 'user': expected a string, but got null instead.",
        ),
        (
            {"type": "dict_type", "input": [1]},
            "tools[0]",
            "Invalid type for 'tools[0]': expected an object, but got an array instead.",
        ),
        (
            {"type": "too_long", "input": [1, 2, 3], "ctx": {"max_length": 2}},
            "stop",
            "Invalid 'stop': array too long. Expected an array with maximum length 2, but got an "
            "array with length 3 instead.",
        ),
        (
            {"type": "string_too_long", "input": "abcd", "ctx": {"max_length": 3}},
            "user",
            "Invalid 'user': string too long. Expected a string with maximum length 3, but got a "
            "string with length 4 instead.",
        ),
        (
            {"type": "value_error", "msg": "Value error, stop must hold at most 4 strings"},
            "stop",
            "stop must hold at most 4 strings",
        ),
        ({"type": "missing"}, None, "the request body must be a JSON object"),
        (
            {"type": "value_error", "msg": "Value error, at most 4 strings"},
            "stop",
            "stop: at most 4 strings",
        ),
    ],
)
def test_openai_message_worked_examples(error, param, message):
    assert openai_message(error, param) == message
