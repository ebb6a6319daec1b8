"""A request over the context window, and a forced call naming no tool, are refused before
generation in each API's own error format (chat / completions / Responses: OpenAI's error JSON;
Messages: Anthropic's), and nothing reaches the engine."""

from __future__ import annotations

import pytest

from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app

LONG = "word " * 200  # about 200 tokens, over a 64-token window


class NoEngine:
    """Fails the test if anything is generated."""

    def __init__(self) -> None:
        self.calls: list = []

    async def generate(self, input_ids, sampling_params, affinity="", **_) -> Generation:
        self.calls.append(list(input_ids))
        raise AssertionError("nothing over the window may reach the engine")


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def app(redis_client, prefix, renderer):
    engine = NoEngine()
    client, deps, _ = gateway_app(redis_client, prefix, renderer, engine)
    deps.context_length = 64
    return client, engine


def _openai_error(resp) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": LONG}]},
            "messages",
        ),
        ("/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 4}, "prompt"),
        ("/v1/responses", {"model": "m", "input": LONG}, None),
    ],
)
def test_openai_apis_refuse_an_over_long_prompt_in_openai_format(app, path, body, param):
    client, engine = app
    error = _openai_error(client.post(path, json={"model": "m", **body}))
    assert error["code"] == "context_length_exceeded"
    assert "context window of 64 tokens" in error["message"]
    if param:
        assert error["param"] == param
    assert engine.calls == []


def test_messages_refuses_an_over_long_prompt_in_anthropic_format(app):
    client, engine = app
    resp = client.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": LONG}]},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context window of 64 tokens" in body["error"]["message"]
    assert engine.calls == []


def test_a_forced_call_of_a_missing_tool_is_refused_in_each_format(app):
    client, engine = app
    ask = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": ask,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "mul"}},
        },
    )
    assert _openai_error(chat)["param"] == "tool_choice"
    messages = client.post(
        "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 8,
            "messages": ask,
            "tools": [{"name": "add", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "mul"},
        },
        headers={"anthropic-version": "2023-06-01"},
    )
    assert messages.status_code == 400, messages.text
    body = messages.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "tool_choice: tool 'mul' is not in tools ('add')"
    assert engine.calls == []
