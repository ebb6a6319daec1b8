"""Tool-call edge cases on every wire API, in-process (scripted engine, real Redis, the real
SmolLM2 tokenizer, the official SDKs where they parse the answer):

- a reply cut off by the token limit inside a `<tool_call>` block: the unterminated markup is
  never content (streamed or not), the complete calls are served, the finish stays `length` /
  `incomplete` / `max_tokens`; the recorded ids stay as sampled and the history the client
  sends back extends the session without a fork;
- a tool result answering no earlier tool call is a 400 in each API's error format;
- Responses refusals name Responses fields (`max_output_tokens`, `input`).
"""

from __future__ import annotations

import dataclasses

import openai
import pytest

from flywheel.gateway.api.parsers import parse_reply
from flywheel.gateway.api.request_rules import stale_tool_result
from flywheel.gateway.session.store import SessionStore

from .test_responses_api import EOS, TOOL, ScriptEngine, gw, renderer, sdk  # noqa: F401

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CUT = f'{CALL}\n<tool_call>\n{{"name": "'  # a second call cut off by max_tokens
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": TOOL["parameters"]},
}
ANTHROPIC_TOOL = {"name": "add", "input_schema": TOOL["parameters"]}


class CutEngine(ScriptEngine):
    """The scripted engine; replies listed in `cut` (by index) end at the token limit: no EOS,
    finish `length`."""

    def __init__(self, renderer, replies, cut):
        super().__init__(renderer, replies)
        self.cut = set(cut)

    def _next(self, input_ids):
        text, ids = super()._next(input_ids)
        return text, ids[:-1] if len(self.prompts) - 1 in self.cut else ids

    def _gen(self, text, ids, n_prompt):
        gen = super()._gen(text, ids, n_prompt)
        if len(self.prompts) - 1 in self.cut:
            gen = dataclasses.replace(gen, finish_type="length", matched=None, matched_eos=False)
        return gen


def test_parse_reply_drops_an_unterminated_call_only_at_a_length_finish():
    cut = parse_reply(CUT, tools_offered=True, truncated=True)
    assert cut.content is None and len(cut.tool_calls) == 1
    assert cut.tool_calls[0]["function"]["arguments"] == '{"a": 2, "b": 3}'
    lone = parse_reply('Sure. <tool_call>\n{"name": "ad', tools_offered=True, truncated=True)
    assert lone.content == "Sure." and lone.tool_calls == []
    # not cut off (or no tools offered): the text is left as it is
    assert "<tool_call>" in (parse_reply(CUT, tools_offered=True).content or "")
    assert parse_reply(CUT, tools_offered=False, truncated=True).content == CUT


def _chat_env(gw, replies, cut):
    make, samples, deps = gw
    client, _ = make(["unused"])
    deps.engines = CutEngine(deps.renderer, replies, cut)
    return client, deps.engines


def test_chat_stream_cut_inside_a_tool_call_serves_the_complete_call(gw, redis_client, prefix):
    client, engine = _chat_env(gw, [CUT, "It is 5."], cut=[0])
    api = sdk(client, **{"X-Session-Id": "cut-1"})
    messages = [{"role": "user", "content": "add 2 and 3"}]
    chunks = list(
        api.chat.completions.create(
            model="m",
            messages=messages,
            tools=[CHAT_TOOL],
            tool_choice="required",
            max_tokens=48,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert "<tool_call>" not in content and content == ""
    assert [(t.function.name, t.function.arguments) for t in calls] == [("add", '{"a": 2, "b": 3}')]
    assert finish == ["length"]
    # The client sends back what it was served; the session extends without a fork.
    served = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}
        ],
    }
    messages += [served, {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
    second = api.chat.completions.create(model="m", messages=messages, tools=[CHAT_TOOL])
    assert second.choices[0].message.content == "It is 5."
    record = SessionStore(redis_client, prefix, 60).get("cut-1")
    assert record.forks == 0 and record.segment.turns == 2
    # turn 0's ids are recorded exactly as sampled (the cut markup included, no EOS)
    first_ids = engine.prompts[0] + engine.renderer.encode(CUT)
    assert engine.prompts[1][: len(first_ids)] == first_ids


def test_responses_cut_inside_a_tool_call_is_incomplete_without_markup(gw):
    client, _ = _chat_env(gw, [CUT, CUT], cut=[0, 1])
    api = sdk(client)
    for stream in (False, True):
        kwargs = {"model": "m", "input": "add 2 and 3", "tools": [TOOL], "tool_choice": "required"}
        if stream:
            response = list(api.responses.create(**kwargs, stream=True))[-1].response
        else:
            response = api.responses.create(**kwargs)
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert "<tool_call>" not in response.output_text and response.output_text == ""
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "add" and call.arguments == '{"a": 2, "b": 3}'


def test_messages_cut_inside_a_tool_call_is_max_tokens_with_the_tool_use(gw):
    client, _ = _chat_env(gw, [CUT], cut=[0])
    reply = client.post(
        "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 48,
            "tools": [ANTHROPIC_TOOL],
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "add 2 and 3"}],
        },
        headers={"anthropic-version": "2023-06-01"},
    ).json()
    assert reply["stop_reason"] == "max_tokens"
    assert [b["type"] for b in reply["content"]] == ["tool_use"]
    assert reply["content"][0]["input"] == {"a": 2, "b": 3}


def test_stale_tool_result_finds_the_first_unanswered_id():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1"}]
    assert stale_tool_result(ok) is None
    assert stale_tool_result([*ok, {"role": "tool", "tool_call_id": "c9"}]) == (2, "c9")
    # a result before its call does not answer it
    assert stale_tool_result(ok[::-1]) == (0, "c1")


def test_messages_tool_result_for_no_tool_use_is_an_anthropic_400(gw):
    client, engine = _chat_env(gw, ["never"], cut=[])
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_stale", "content": "5"}],
        },
    ]
    reply = client.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 8, "tools": [ANTHROPIC_TOOL], "messages": messages},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "toolu_stale" in body["error"]["message"]
    assert engine.prompts == []


def test_responses_function_call_output_for_no_call_is_a_400(gw):
    client, engine = _chat_env(gw, ["It is 5.", "never"], cut=[])
    api = sdk(client)
    stale = {"type": "function_call_output", "call_id": "call_stale", "output": "5"}
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model="m", input=[{"role": "user", "content": "hi"}, stale])
    assert err.value.body["param"] == "input"
    assert err.value.body["message"] == (
        "No tool call found for function call output with call_id call_stale."
    )
    # nor does a previous_response_id chain without that call make it valid
    first = api.responses.create(model="m", input="hi")
    with pytest.raises(openai.BadRequestError):
        api.responses.create(model="m", input=[stale], previous_response_id=first.id)
    assert len(engine.prompts) == 1


def test_responses_context_refusal_names_max_output_tokens(gw):
    client, engine = _chat_env(gw, ["never"], cut=[])
    for stream in (False, True):
        reply = client.post(
            "/v1/responses",
            json={"model": "m", "input": "hi", "max_output_tokens": 99999, "stream": stream},
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "input" and error["code"] == "context_length_exceeded"
        assert "max_output_tokens (99999)" in error["message"]
        assert "max_tokens" not in error["message"]
    assert engine.prompts == []


def test_messages_context_refusal_names_anthropic_fields(gw):
    client, engine = _chat_env(gw, ["never"], cut=[])
    reply = client.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 99999, "messages": [{"role": "user", "content": "hi"}]},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens (99999)" in body["error"]["message"]
    assert "max_completion_tokens" not in body["error"]["message"]
    assert engine.prompts == []
