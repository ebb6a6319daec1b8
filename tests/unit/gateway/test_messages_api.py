"""`POST /v1/messages` and `/v1/messages/count_tokens` through the gateway app: a scripted engine,
real Redis, the real SmolLM2 tokenizer and chat template. Answers, stream events, sessions
stitched from Anthropic histories, and Anthropic-format errors."""

import dataclasses
import json
import re

import pytest

from flywheel.core.auth import KeyStore
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


class ScriptEngine:
    """Replies with the scripted texts in order (+ EOS id 2 unless the text is cut by a stop)."""

    def __init__(self, renderer, replies):
        self.renderer, self.replies, self.calls = renderer, list(replies), []

    async def generate(self, input_ids, sampling_params, affinity="", **_):
        text = self.replies[len(self.calls) % len(self.replies)]
        self.calls.append((list(input_ids), dict(sampling_params)))
        ids = self.renderer.encode(text) + [2]
        return Generation(
            output_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            text=text,
            finish_type="stop",
            matched_eos=True,
            weight_version=1,
            prompt_tokens=len(input_ids),
        )


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _env(redis_client, prefix, renderer, replies):
    engine = ScriptEngine(renderer, replies)
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    return client, engine, samples


def _post(client, body, sid=None, path="/v1/messages"):
    headers = {"anthropic-version": "2023-06-01"}
    if sid:
        headers["X-Session-Id"] = sid
    return client.post(path, json={"model": "m", "max_tokens": 20, **body}, headers=headers)


def test_text_answer_is_an_anthropic_message_with_usage(redis_client, prefix, renderer):
    client, engine, _ = _env(redis_client, prefix, renderer, ["Paris."])
    resp = _post(client, {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200, resp.text
    msg = resp.json()
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["id"].startswith("msg_")
    assert msg["content"] == [{"type": "text", "text": "Paris."}]
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    prompt = engine.calls[0][0]
    # input_tokens = the prompt the engine got; output_tokens = "Paris." ids + EOS
    assert msg["usage"] == {
        "input_tokens": len(prompt),
        "output_tokens": len(renderer.encode("Paris.")) + 1,
    }
    expected = renderer.prompt_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert prompt == expected
    assert engine.calls[0][1]["max_new_tokens"] == 20


def test_tool_use_round_trip_stays_one_segment(redis_client, prefix, renderer):
    client, engine, samples = _env(redis_client, prefix, renderer, [CALL, "It is sunny."])
    user = {"role": "user", "content": "Weather in Paris?"}
    first = _post(client, {"messages": [user], "tools": TOOLS}, sid="m-tools").json()
    assert first["stop_reason"] == "tool_use"
    (block,) = first["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {"city": "Paris"}
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", block["id"]), block["id"]  # Anthropic's form
    history = [
        user,
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}],
        },
    ]
    second = _post(client, {"messages": history, "tools": TOOLS}, sid="m-tools").json()
    assert second["content"] == [{"type": "text", "text": "It is sunny."}]
    info = client.get("/v1/sessions/m-tools").json()
    assert info["forks"] == 0 and info["segment_index"] == 0 and info["turns"] == 2
    # the second prompt is the first prompt + its sampled ids + only the new messages' tokens
    prompt0, prompt1 = engine.calls[0][0], engine.calls[1][0]
    out0 = renderer.encode(CALL) + [2]
    assert prompt1[: len(prompt0) + len(out0)] == prompt0 + out0
    (turn0,) = samples()  # live: turn 0 published when its next state (the tool result) came
    assert turn0.next_state.role == "tool"
    recorded = json.loads(turn0.messages[-1].extra_json)["tool_calls"][0]
    assert recorded["id"] == "call_" + block["id"].removeprefix("toolu_")  # the gateway's form
    assert recorded["function"]["arguments"] == json.dumps(block["input"])


def test_edited_history_forks_and_is_counted(redis_client, prefix, renderer):
    client, _, _ = _env(redis_client, prefix, renderer, ["Paris.", "Lyon."])
    user = {"role": "user", "content": "Capital?"}
    _post(client, {"messages": [user]}, sid="m-fork")
    edited = [user, {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "?"}]
    _post(client, {"messages": edited}, sid="m-fork")
    info = client.get("/v1/sessions/m-fork").json()
    assert info["forks"] == 1 and info["fork_reasons"] == {"assistant_edited": 1}


def test_thinking_is_a_block_and_sent_back_extends_the_session(redis_client, prefix, renderer):
    reply = "<think>Paris is the capital.</think>Paris."
    client, _, _ = _env(redis_client, prefix, renderer, [reply, "Yes."])
    user = {"role": "user", "content": "Capital?"}
    first = _post(client, {"messages": [user]}, sid="m-think").json()
    thinking, text = first["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Paris is the capital."
    assert thinking["signature"].startswith("sha256:")
    assert text == {"type": "text", "text": "Paris."}
    history = [user, {"role": "assistant", "content": first["content"]}]
    history.append({"role": "user", "content": "Sure?"})
    _post(client, {"messages": history}, sid="m-think")
    info = client.get("/v1/sessions/m-think").json()
    assert info["forks"] == 0 and info["turns"] == 2


def test_stop_sequence_sets_stop_reason_and_stop_sequence(redis_client, prefix, renderer):
    client, engine, _ = _env(redis_client, prefix, renderer, ["one, two, three"])
    body = {"messages": [{"role": "user", "content": "Count"}], "stop_sequences": [", three"]}
    msg = _post(client, body).json()
    assert engine.calls[0][1]["stop"] == [", three"]
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == ", three"
    assert msg["content"] == [{"type": "text", "text": "one, two"}]


def _events(text):
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[6:])
        assert event["type"] == name[7:]
        out.append(event)
    return out


def test_stream_events_in_anthropic_order(redis_client, prefix, renderer):
    client, _, _ = _env(redis_client, prefix, renderer, [CALL])
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True}
    resp = _post(client, body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.text)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2]["content_block"]["type"] == "tool_use"
    assert json.loads(events[3]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[5]["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_is_the_rendered_prompt_length(redis_client, prefix, renderer):
    client, engine, _ = _env(redis_client, prefix, renderer, ["Paris."])
    body = {"system": "S", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
    counted = client.post("/v1/messages/count_tokens", json={"model": "m", **body})
    assert counted.status_code == 200, counted.text
    msg = _post(client, body).json()
    assert counted.json() == {"input_tokens": len(engine.calls[0][0])}
    assert msg["usage"]["input_tokens"] == len(engine.calls[0][0])


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"max_tokens": None}, 400, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "reads text only",
        ),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, 400, "prefill"),
        ({"output_config": {"format": {"type": "text"}}}, 400, "format"),
        ({"tools": [{**TOOLS[0], "type": "web_search_20250305"}]}, 400, "server tool"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]}
                ]
            },
            400,
            "redacted_thinking",
        ),
        ({"top_k": 0}, 400, "top_k"),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}],
                "tool_choice": {"type": "any"},
            },
            400,
            "tools[0].input_schema is not a valid JSON Schema",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
            400,
            "output_config.format.schema is not a valid JSON Schema",
        ),
        # recorded in the Sample as int32: 481134667759 > 2**31 - 1 = 2147483647
        ({"top_k": 481134667759}, 400, "top_k"),
        ({"bogus": 1}, 400, "bogus"),
    ],
)
def test_bad_requests_get_anthropic_errors(redis_client, prefix, renderer, body, status, words):
    client, engine, _ = _env(redis_client, prefix, renderer, ["x"])
    data = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    data.update(body)
    data = {k: v for k, v in data.items() if v is not None}
    resp = client.post("/v1/messages", json=data)
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"]
    assert engine.calls == []


def test_auth_errors_are_anthropic_errors_and_x_api_key_is_accepted(redis_client, prefix, renderer):
    client, _, _ = _env(redis_client, prefix, renderer, ["Hi."])
    key, _ = KeyStore(redis_client, prefix).create("agent", name="t")
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    bad = client.post("/v1/messages", json=body, headers={"x-api-key": "fwk-wrong"})
    assert bad.status_code == 401
    assert bad.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or revoked API key"},
    }
    assert client.post("/v1/messages", json=body, headers={"x-api-key": key}).status_code == 200
    bearer = {"Authorization": f"Bearer {key}"}
    assert client.post("/v1/messages", json=body, headers=bearer).status_code == 200
    # a Messages path the gateway does not serve is Anthropic's 404 (Message Batches)
    batches = client.post("/v1/messages/batches", json={"requests": []}, headers=bearer)
    assert batches.status_code == 404
    assert batches.json()["type"] == "error"
    assert batches.json()["error"]["type"] == "not_found_error"
    # other routes keep OpenAI's error format
    chat = client.post("/v1/chat/completions", json={"messages": []}, headers=bearer)
    assert set(chat.json()) == {"error"} and chat.json()["error"]["type"] == "invalid_request_error"


def test_output_config_format_constrains_the_reply_to_the_schema(redis_client, prefix, renderer):
    client, engine, _ = _env(redis_client, prefix, renderer, ['{"fruit": "apple"}'])
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}}}
    body = {
        "messages": [{"role": "user", "content": "A fruit as JSON."}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    }
    msg = _post(client, body).json()
    assert json.loads(engine.calls[0][1]["json_schema"]) == schema  # the engine's grammar
    assert msg["content"] == [{"type": "text", "text": '{"fruit": "apple"}'}]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_choice_any_and_tool_force_a_call(redis_client, prefix, renderer, choice):
    client, engine, _ = _env(redis_client, prefix, renderer, [CALL])
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "tool_choice": choice}
    msg = _post(client, body).json()
    tag = json.loads(engine.calls[0][1]["structural_tag"])  # the engine got the call grammar
    assert "get_weather" in json.dumps(tag)
    assert msg["stop_reason"] == "tool_use" and msg["content"][0]["input"] == {"city": "Paris"}


def test_the_access_checks_message_limit_applies_in_anthropic_format(
    redis_client, prefix, renderer
):
    client, engine, _ = _env(redis_client, prefix, renderer, ["x"])
    many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 512
    body = {"messages": [*many, {"role": "user", "content": "c"}]}  # 1025 > max_messages 1024
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = _post(client, body, path=path)
        assert resp.status_code == 400
        assert resp.json() == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "1025 messages; at most 1024 per request",
            },
        }
    assert engine.calls == []


@pytest.mark.parametrize(
    ("content", "words"),
    [
        # the block type (text) is in the path before the field
        ([{"type": "text"}], "messages[0].content[0].text.text: Field required"),
        ([{"type": "text", "text": "a", "bogus": 1}], "content[0].text.bogus: Extra inputs"),
        ([{"text": "x"}], "block 0 must be an object with a 'type'"),
        ([5], "block 0 must be an object with a 'type'"),
        (5, "content must be a string or a list of blocks of type"),
        ({"type": "text", "text": "x"}, "content must be a string or a list of blocks of type"),
    ],
)
def test_a_rejected_content_names_the_real_problem(redis_client, prefix, renderer, content, words):
    """Not the first union branch's "Input should be a valid string" for a list of blocks."""
    client, engine, _ = _env(redis_client, prefix, renderer, ["x"])
    data = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    resp = client.post("/v1/messages", json=data)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert words in message and "valid string" not in message, message
    assert engine.calls == []


def test_deps_with_other_engines_leave_the_original_as_it_was(redis_client, prefix, renderer):
    """`GatewayDeps.with_engines` (the Messages route's engine probe): a copy whose only
    difference is the engines; the app's own deps keep theirs."""
    _, deps, _ = gateway_app(redis_client, prefix, renderer, ScriptEngine(renderer, ["a"]))
    probe = ScriptEngine(renderer, ["b"])
    probed = deps.with_engines(probe)
    assert probed.engines is probe and deps.engines is not probe
    for f in dataclasses.fields(deps):
        if f.name != "engines":
            assert getattr(probed, f.name) is getattr(deps, f.name), f.name


def test_a_missing_key_names_both_headers_the_gateway_reads(redis_client, prefix, renderer):
    """An Anthropic client sends its key as `x-api-key`, an OpenAI one as a bearer token: the
    refusal of a request with neither names both, so either reader knows what to send."""
    client, engine, _ = _env(redis_client, prefix, renderer, ["Hi."])
    KeyStore(redis_client, prefix).create("agent", name="t")  # keys are now required
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    for path, data in (("/v1/messages", body), ("/v1/chat/completions", body)):
        resp = client.post(path, json=data)
        assert resp.status_code == 401, resp.text
        err = resp.json()
        message = err["error"]["message"]
        assert "`Authorization: Bearer <key>`" in message and "`x-api-key: <key>`" in message
    assert engine.calls == []
