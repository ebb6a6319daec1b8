"""Client messages show the request's values as JSON and lists in words, never Python reprs
(`{'type': 'tool'}`, `['a', 'b']`), and say what a parameter accepts (fake engine, real Redis
and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
REPRS = ("{'", "['", "': '")


def _error(resp, status=400):
    assert resp.status_code == status, resp.text
    answer = resp.json()
    message = answer["error"]["message"]
    assert not any(r in message for r in REPRS), message
    return message


def test_messages_tool_choice_without_tools_shows_json(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    body = {"model": "m", "max_tokens": 8, "messages": U}
    body["tool_choice"] = {"type": "tool", "name": "nope"}
    message = _error(client.post("/v1/messages", json=body))
    assert '{"type": "tool", "name": "nope"}' in message, message
    assert engine.prompts == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tool_choice": {"type": "function", "name": "f"}}, '{"type": "function", "name": "f"}'),
        ({"tools": [{"type": "web_search"}]}, "declare a function tool"),
        ({"tool_choice": {"type": "file_search"}}, '{"type": "file_search"}'),
        ({"input": [{"role": "wizard", "content": "x"}]}, "'user', 'system'"),
        ({"include": ["bogus"]}, "is not one of '"),
        ({"input": 5}, "expected a string or an array of input items"),
        ({"background": True}, "background is not supported: responses are served"),
    ],
)
def test_responses_messages_are_words(redis_client, prefix, renderer, body, words):
    client, engine = _client(redis_client, prefix, renderer)
    message = _error(client.post("/v1/responses", json={"model": "m", "input": "hi", **body}))
    assert words in message, message
    assert "background: background" not in message, message
    assert engine.prompts == []


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/v1/messages"])
def test_an_empty_body_is_told_it_must_be_a_json_object(redis_client, prefix, renderer, path):
    client, _ = _client(redis_client, prefix, renderer)
    resp = client.post(path, headers={"content-type": "application/json"})
    message = _error(resp)
    assert "the request body must be a JSON object" in message, message
    assert "'body'" not in message, message


def test_chat_tool_choice_and_turn_type_are_words(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    bad = {"model": "m", "messages": U, "tool_choice": {"type": "x"}}
    message = _error(client.post("/v1/chat/completions", json=bad))
    assert '{"type": "x"}' in message, message
    ok = {"model": "m", "messages": U}
    message = _error(client.post("/v1/chat/completions", json=ok, headers={"x-turn-type": "wat"}))
    assert "'main'" in message, message


def test_input_items_limit_is_a_number_in_the_message(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    created = client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
    message = _error(client.get(f"/v1/responses/{created['id']}/input_items?limit=0"))
    assert "but got 0 instead" in message, message


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/chat/completions", {"messages": U, "logit_bias": {"50256": -100}}, '{"50256": -100'),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 5}}, '{"1": 5'),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
            '{"a": 1}',
        ),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": ["x"]}]}]}, '["x"]'),
        (
            "/v1/messages",
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": ["x"]}]}]},
            '{"type": ["x"]}',
        ),
    ],
)
def test_a_non_string_value_is_shown_as_json(redis_client, prefix, renderer, path, body, words):
    client, engine = _client(redis_client, prefix, renderer)
    message = _error(client.post(path, json={"model": "m", **body}))
    assert words in message, message
    assert "=" not in message, message
    assert engine.prompts == []
