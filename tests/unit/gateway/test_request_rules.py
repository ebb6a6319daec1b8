"""Request rules OpenAI enforces: message content may be null only on an assistant message that
carries tool calls; malformed tool calls, tools, content parts and tool messages are a 400
naming the field, as are options the engine cannot honor; with `gateway.served_model_names` set
an unknown model is a 404 `model_not_found` (fake engine, real Redis and tokenizer)."""

import pytest
from fastapi.testclient import TestClient

from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore

from .test_app import FakeEngine


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _client(redis_client, prefix, renderer, **settings):
    engine = FakeEngine(renderer)
    deps = GatewayDeps(
        settings=GatewaySettings(**settings),
        renderer=renderer,
        engines=engine,
        sessions=SessionStore(redis_client, prefix, 3600),
        publisher=StreamProducer(redis_client, f"{prefix}:rollouts"),
    )
    return TestClient(create_app(deps)), engine


CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "index"),
    [
        ([{"role": "user", "content": None}], 0),
        ([{"role": "user"}], 0),
        ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], 0),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], 1),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": None},
            ],
            2,
        ),
    ],
)
def test_null_content_is_a_400_naming_the_message(redis_client, prefix, renderer, messages, index):
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
    messages = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert resp.status_code == 200, resp.text
    assert len(engine.prompts) == 1


def test_any_model_name_is_served_by_default(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "whatever", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status_code == 200 and resp.json()["model"] == "whatever"
    assert client.post("/v1/completions", json={"model": "gpt-x", "prompt": "1"}).status_code == 200


def test_served_model_names_are_listed_and_others_are_404(redis_client, prefix, renderer):
    client, engine = _client(
        redis_client, prefix, renderer, served_model_names=["policy", "policy-latest"]
    )
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["policy", "policy-latest"]
    assert [m["id"] for m in client.get("/s/x/v1/models").json()["data"]] == [
        "policy",
        "policy-latest",
    ]
    user = [{"role": "user", "content": "x"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": user}),
        ("/s/abc/v1/chat/completions", {"messages": user}),
        ("/v1/completions", {"prompt": "1"}),
    ]:
        resp = client.post(path, json={"model": "gpt-4o", **body})
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"]
    assert engine.prompts == []
    ok = client.post("/v1/chat/completions", json={"model": "policy-latest", "messages": user})
    assert ok.status_code == 200 and ok.json()["model"] == "policy-latest"
    assert (
        client.post("/v1/completions", json={"model": "policy", "prompt": "1"}).status_code == 200
    )


def test_a_body_without_model_is_refused_as_openai_and_anthropic_refuse_it(
    redis_client, prefix, renderer
):
    client, engine = _client(redis_client, prefix, renderer)
    user = [{"role": "user", "content": "x"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": user}),
        ("/s/abc/v1/chat/completions", {"messages": user, "stream": True}),
        ("/v1/responses", {"input": "x"}),
        ("/v1/completions", {"prompt": "1"}),
    ]:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json() == {
            "error": {
                "message": "you must provide a model parameter",
                "type": "invalid_request_error",
                "param": "model",
                "code": None,
            }
        }
    anthropic = client.post(
        "/v1/messages", json={"max_tokens": 5, "messages": user}, headers={"anthropic-version": "1"}
    )
    assert anthropic.status_code == 400
    assert anthropic.json()["error"] == {
        "type": "invalid_request_error",
        "message": "model: Field required",
    }
    assert engine.prompts == []  # nothing was sampled


U = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _then(assistant: dict) -> list[dict]:
    return [
        *U,
        {"role": "assistant", "content": "x", **assistant},
        {"role": "user", "content": "y"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": _then({"tool_calls": "oops"})}, "messages[1].tool_calls"),
        ({"model": "m", "messages": _then({"tool_calls": [1]})}, "messages[1].tool_calls[0]"),
        ({"model": "m", "messages": _then({"tool_calls": {"a": 1}})}, "messages[1].tool_calls"),
        (
            {
                "model": "m",
                "messages": _then(
                    {"tool_calls": [{"id": "a", "type": "function", "function": "f"}]}
                ),
            },
            "messages[1].tool_calls",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
            },
            "messages[0].content",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            },
            "messages[0].content",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ],
            },
            "messages[0].content",
        ),
        (
            {
                "model": "m",
                "messages": [
                    *U,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "2"},
                ],
            },
            "messages[2].tool_call_id",
        ),
        (
            {
                "model": "m",
                "messages": U,
                "tools": [{"type": "function", "function": {"parameters": {}}}],
            },
            "tools",
        ),
        ({"model": "m", "messages": U, "tools": [TOOL], "tool_choice": "bogus"}, "tool_choice"),
        (
            {"model": "m", "messages": U, "tool_choice": "required"},
            "tool_choice",
        ),  # no tools to call
        (
            {
                "model": "m",
                "messages": U,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "not_a_tool"}},
            },
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "messages": U,
                "tools": [TOOL],
                "tool_choice": "required",
                "regex": "a+",
            },
            "regex",
        ),
        (
            {"model": "m", "messages": U, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ({"model": "m", "messages": U, "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": "m", "messages": U, "max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
        ),
    ],
)
def test_malformed_or_unsupported_fields_are_a_400_naming_them(
    redis_client, prefix, renderer, body, param
):
    client, engine = _client(redis_client, prefix, renderer)
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    for path in ("/v1/chat/completions", f"/s/{sid}/v1/chat/completions"):
        resp = client.post(path, json={"model": "m", **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert engine.prompts == []  # nothing reached the engine, nothing was recorded
    assert client.get(f"/v1/sessions/{sid}").json()["token_ids"] == []


def test_null_n_and_stream_mean_their_defaults(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": U, "n": None, "stream": None}
    )
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1 and len(engine.prompts) == 1


def test_text_and_refusal_parts_are_read_as_their_text(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer)
    parts = [{"type": "text", "text": "1 + "}, {"type": "input_text", "text": "1?"}]
    said = [{"type": "refusal", "refusal": "I cannot."}]
    as_parts = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "ok"},
    ]
    as_text = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "I cannot."},
        {"role": "user", "content": "ok"},
    ]
    for messages in (as_parts, as_text):
        assert (
            client.post(
                "/v1/chat/completions", json={"model": "m", "messages": messages}
            ).status_code
            == 200
        )
    assert engine.prompts[0] == engine.prompts[1]


def test_unset_max_tokens_takes_what_is_left_of_the_context(redis_client, prefix, renderer):
    client, engine = _client(redis_client, prefix, renderer, default_max_tokens=256)
    long = [{"role": "user", "content": "word " * 1900}]
    prompt = len(renderer.prompt_ids(long))
    assert 2048 - 256 < prompt < 2048  # the default no longer fits, the prompt does
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": long})
    assert resp.status_code == 200, resp.text
    # the rest of the window, less the one token SGLang keeps (context - input - 1)
    assert engine.prompts[-1][1]["max_new_tokens"] == 2048 - prompt - 1
    short = client.post("/v1/chat/completions", json={"model": "m", "messages": U})
    assert short.status_code == 200 and engine.prompts[-1][1]["max_new_tokens"] == 256
    # A cap the client chose is never lowered: it does not fit, so it is a 400.
    capped = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": long, "max_tokens": 256}
    )
    error = capped.json()["error"]
    assert capped.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "max_tokens (256)" in error["message"] and error["param"] == "messages"
    too_long = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "word " * 2100}]},
    )
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_a_session_can_be_created_without_a_body(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    created = client.post("/v1/sessions")
    assert created.status_code == 200, created.text
    info = client.get(f"/v1/sessions/{created.json()['session_id']}").json()
    assert (info["mode"], info["group_id"], info["status"]) == ("episode", "", "open")
    bad = client.post("/v1/sessions", json={"mode": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


def test_null_arguments_and_parameters_and_an_unnamed_next_state_tool_result_are_accepted(
    redis_client, prefix, renderer
):
    client, engine = _client(redis_client, prefix, renderer)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": None}}
    messages = [
        *U,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": None}}]
    resp = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": messages, "tools": tools}
    )
    assert resp.status_code == 200, resp.text
    sid = client.post("/v1/sessions", json={"mode": "live"}).json()["session_id"]
    client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": U})
    done = client.post(
        f"/v1/sessions/{sid}/finish", json={"next_state": {"role": "tool", "content": "result"}}
    )
    assert done.status_code == 200 and done.json()["samples_published"] == 1
