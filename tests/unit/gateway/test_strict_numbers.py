"""Number request fields take JSON numbers only: `"temperature": "0.5"` or `true` is a 400 in the
API's own error format naming the field (pydantic's lax mode would read them as 0.5 and 1.0), as
OpenAI's and Anthropic's APIs refuse them; a neutral-only penalty sent as `"0"` or `false` is
refused the same way. Integers and decimals are still served, and nothing refused reaches the
engine (fake engine, real Redis and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": U}
TEXT = {"model": "m", "prompt": "hi"}
RESP = {"model": "m", "input": "hi"}

OPENAI = [
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature", "a string"),
    ("/v1/chat/completions", {**CHAT, "temperature": True}, "temperature", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "top_p": "1"}, "top_p", "a string"),
    ("/v1/chat/completions", {**CHAT, "min_p": "0.1"}, "min_p", "a string"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": "0"}, "frequency_penalty", "a string"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": False}, "presence_penalty", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": "1"}, "repetition_penalty", ""),
    ("/s/any/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature", "a string"),
    ("/v1/completions", {**TEXT, "temperature": "0.5"}, "temperature", "a string"),
    ("/v1/completions", {**TEXT, "top_p": True}, "top_p", "a boolean"),
    ("/v1/completions", {**TEXT, "frequency_penalty": "0.0"}, "frequency_penalty", "a string"),
    ("/v1/responses", {**RESP, "temperature": "0.5"}, "temperature", "a string"),
    ("/v1/responses", {**RESP, "top_p": False}, "top_p", "a boolean"),
    ("/v1/responses", {**RESP, "min_p": "0"}, "min_p", "a string"),
]


@pytest.mark.parametrize(("path", "body", "param", "got"), OPENAI)
def test_a_non_number_is_an_openai_400_naming_the_field(
    redis_client, prefix, renderer, path, body, param, got
):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"Invalid type for '{param}': expected a decimal"), error
    if got:
        assert error["message"].endswith(f"but got {got} instead."), error["message"]
    assert engine.prompts == []


@pytest.mark.parametrize(
    "extra", [{"temperature": "0.5"}, {"temperature": True}, {"top_p": "0.9"}, {"top_p": True}]
)
def test_a_non_number_is_an_anthropic_400_naming_the_field(redis_client, prefix, renderer, extra):
    client, engine = _client(redis_client, prefix, renderer)
    for path in ("/v1/messages", "/s/any/v1/messages"):
        body = {"model": "m", "max_tokens": 8, "messages": U, **extra}
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        answer = resp.json()
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
        assert message.startswith(f"Invalid type for '{next(iter(extra))}'"), answer
    assert engine.prompts == []


@pytest.mark.parametrize("reward", ["1", True])
def test_a_session_reward_is_a_number(redis_client, prefix, renderer, reward):
    client, _ = _client(redis_client, prefix, renderer)
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    for path in (f"/v1/sessions/{sid}/reward", f"/v1/sessions/{sid}/finish"):
        resp = client.post(path, json={"reward": reward})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "reward" and "expected a decimal" in error["message"], error
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1}).status_code == 200


def test_integers_and_decimals_are_still_accepted(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "temperature": 1, "top_p": 0.5, "min_p": 0}),
        ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0, "presence_penalty": 0.0}),
        ("/v1/completions", {**TEXT, "max_tokens": 4, "temperature": 0.5, "top_p": 1}),
        ("/v1/responses", {**RESP, "temperature": 0, "top_p": 0.25}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": U, "temperature": 1}),
    ]:
        resp = client.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text)
    assert len(engine.prompts) == 5
    assert engine.prompts[0][1]["temperature"] == 1.0 and engine.prompts[0][1]["top_p"] == 0.5
