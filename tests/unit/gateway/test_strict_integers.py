"""Integer request fields take JSON integers only: `"max_tokens": "10"` or `true` is a 400 in the
API's own error format naming the field (pydantic's lax mode would read them as 10 and 1), as
are more than 4 chat stop strings and Anthropic's `metadata` and `thinking` of the wrong shape;
nothing reaches the engine (fake engine, real Redis and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": U}

OPENAI = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": "10"}, "max_tokens", "a string"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "8"}, "max_completion_tokens", ""),
    ("/v1/chat/completions", {**CHAT, "n": "2"}, "n", "a string"),
    ("/v1/chat/completions", {**CHAT, "seed": False}, "seed", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "top_k": "5"}, "top_k", "a string"),
    ("/s/any/v1/chat/completions", {**CHAT, "max_tokens": "10"}, "max_tokens", "a string"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "4"}, "max_tokens", ""),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": True}, "logprobs", ""),
    (
        "/v1/responses",
        {"model": "m", "input": "hi", "max_output_tokens": "4"},
        "max_output_tokens",
        "",
    ),
    ("/v1/responses", {"model": "m", "input": "hi", "seed": "1"}, "seed", "a string"),
]


@pytest.mark.parametrize(("path", "body", "param", "got"), OPENAI)
def test_a_non_integer_is_an_openai_400_naming_the_field(
    redis_client, prefix, renderer, path, body, param, got
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"Invalid type for '{param}': expected an integer")
    if got:
        assert error["message"].endswith(f"but got {got} instead."), error["message"]
    assert engine.prompts == []


def test_chat_takes_at_most_four_stop_strings(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}),
    ]:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "stop"
        assert "maximum length 4" in error["message"], error
    assert engine.prompts == []
    ok = client.post("/v1/chat/completions", json={**CHAT, "stop": ["a", "b", "c", "d"]})
    assert ok.status_code == 200, ok.text


def test_messages_keep_anthropics_own_stop_sequence_bound(redis_client, prefix, renderer):
    """Chat's 4 stop strings do not bound Messages' `stop_sequences` (served as chat's `stop`)."""
    client, engine = _client(redis_client, prefix, renderer)
    stops = [f"#{i}" for i in range(6)]
    body = {"model": "m", "max_tokens": 8, "messages": U, "stop_sequences": stops}
    resp = client.post("/v1/messages", json=body)
    assert resp.status_code == 200, resp.text
    assert engine.prompts[-1][1]["stop"] == stops


MESSAGES = [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 8, "top_k": "5"}, "top_k"),
    ({"max_tokens": 8, "metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"max_tokens": 8, "metadata": {"user": "x"}}, "metadata.user"),
    ({"max_tokens": 8, "thinking": {"type": "wat"}}, "thinking"),
    ({"max_tokens": 8, "thinking": {"type": "enabled"}}, "thinking.enabled.budget_tokens"),
    (
        {"max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": "2048"}},
        "Invalid type for 'thinking.enabled.budget_tokens': expected an integer",
    ),
]


@pytest.mark.parametrize(("extra", "named"), MESSAGES)
def test_a_wrong_type_is_an_anthropic_400_naming_the_field(
    redis_client, prefix, renderer, extra, named
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post("/v1/messages", json={"model": "m", "messages": U, **extra})
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert named in answer["error"]["message"], answer
    assert "Input should" not in answer["error"]["message"], answer
    assert engine.prompts == []


def test_integers_and_the_documented_shapes_are_still_accepted(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 4, "n": 1, "seed": -3}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 4.0}),  # a JSON Schema integer
        ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}),
        (
            "/v1/messages",
            {
                "model": "m",
                "messages": U,
                "max_tokens": 8,
                "metadata": {"user_id": "u-1"},
                "thinking": {"type": "enabled", "budget_tokens": 2048},
            },
        ),
        (
            "/v1/messages",
            {"model": "m", "messages": U, "max_tokens": 8, "thinking": {"type": "disabled"}},
        ),
    ]:
        resp = client.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text)
    assert len(engine.prompts) == 6
