"""Anthropic Messages <-> chat translation (api/messages_convert.py), both ways, on worked
examples; stream events of a whole message; the Anthropic error mapping."""

import hashlib
import json

import pytest

from flywheel.core.errors import InvalidRequestError
from flywheel.gateway.api import messages_convert as mc
from flywheel.gateway.api.messages_errors import anthropic_error, error_type, is_messages_path
from flywheel.gateway.api.messages_schema import CountTokensRequest, MessagesRequest
from flywheel.gateway.api.messages_stream import whole_events
from flywheel.gateway.api.parsers import parse_reply
from flywheel.gateway.recording.history import extends

TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def _req(**body):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})


def test_a_conversation_with_tools_becomes_these_chat_messages():
    body = _req(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "days": 2},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no such city"}],
                    },
                    {"type": "text", "text": "And "},
                    {"type": "text", "text": "tomorrow?"},
                ],
            },
        ],
        tools=[{**TOOL, "description": "Weather."}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["###"],
        temperature=0.5,
        top_k=40,
    )
    chat = mc.chat_request(body)
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": {"type": "object"},
            },
        }
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop) == ("auto", False, ["###"])
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.top_p) == (8, 0.5, 40, None)


def test_tool_choice_mapping():
    assert mc.chat_tool_choice(None) is None
    for kind, chat in (("auto", "auto"), ("none", "none")):
        body = _req(
            messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice={"type": kind}
        )
        assert mc.chat_request(body).tool_choice == chat
    from flywheel.gateway.api.messages_schema import ToolChoice

    assert mc.chat_tool_choice(ToolChoice(type="any")) == "required"
    assert mc.chat_tool_choice(ToolChoice(type="tool", name="f")) == {
        "type": "function",
        "function": {"name": "f"},
    }


def test_the_reply_becomes_blocks_and_sent_back_is_the_recorded_message():
    # what the parser records for this sampled text, and what the client gets for it
    text = (
        '<think>Rain?</think>Let me look.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Nice", "when": [1, 2.5]}}\n</tool_call>'
    )
    recorded = parse_reply(text, tools_offered=True).message()
    completion = {
        "id": "chatcmpl-abc",
        "model": "m",
        "choices": [{"index": 0, "message": recorded, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42},
    }
    msg = mc.message(completion, None)
    call_id = recorded["tool_calls"][0]["id"]  # call_<24 hex>, parsers.py
    tool_id = "toolu_" + call_id.removeprefix("call_")  # what an Anthropic client sees
    assert msg == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {
                "type": "thinking",
                "thinking": "Rain?",
                "signature": "sha256:" + hashlib.sha256(b"Rain?").hexdigest(),
            },
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": tool_id,
                "name": "get_weather",
                "input": {"city": "Nice", "when": [1, 2.5]},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 12},
    }
    # the client sends the blocks back (as JSON) with the tool's result
    sent = json.loads(json.dumps(msg["content"]))
    user = {"role": "user", "content": "Weather?"}
    body = _req(
        messages=[
            user,
            {"role": "assistant", "content": sent},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "wet"}],
            },
        ]
    )
    back = [m.for_template() for m in mc.chat_request(body).messages]
    assert back[1] == recorded  # the same message: text, reasoning, call id, arguments string
    assert back[2]["tool_call_id"] == call_id
    assert mc.anthropic_tool_id("toolu_01A09q90qw90lq917835lq9") == "toolu_01A09q90qw90lq917835lq9"
    assert mc.chat_call_id("toolu_01A09q90qw90lq917835lq9") == "toolu_01A09q90qw90lq917835lq9"
    assert extends([user, recorded], back)


def test_stop_reasons():
    assert mc.stop_reason("length", None) == "max_tokens"
    assert mc.stop_reason("tool_calls", None) == "tool_use"
    assert mc.stop_reason("stop", None) == "end_turn"
    assert mc.stop_reason("stop", "###") == "stop_sequence"


def test_tool_input_of_arguments_that_are_not_an_object():
    assert mc.tool_input('{"a": 1}') == {"a": 1}
    assert mc.tool_input('"Paris"') == {"arguments": "Paris"}
    assert mc.tool_input("not json") == {"arguments": "not json"}


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "assistant", "content": "Hi"}], "prefilling"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {}}],
                }
            ],
            "cannot hold a tool_use",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "c"}]},
                {"role": "user", "content": "q"},
            ],
            "cannot hold a tool_result",
        ),
    ],
)
def test_misplaced_blocks_are_refused(messages, words):
    with pytest.raises(InvalidRequestError, match=words):
        mc.chat_request(_req(messages=messages))


def test_tool_choice_any_is_passed_to_the_chat_rules():
    body = _req(
        messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice={"type": "any"}
    )
    try:
        chat = mc.chat_request(body)
    except InvalidRequestError as exc:  # the chat path refuses forced calls (no grammar)
        assert exc.param == "tool_choice"
    else:
        assert chat.tool_choice == "required"


def test_count_tokens_request_has_no_sampling_fields():
    body = CountTokensRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TOOL],
            "tool_choice": {"type": "any"},
        }
    )
    chat = mc.chat_request(body, sampling=False)
    assert chat.tool_choice is None and chat.max_tokens is None and chat.tools


def test_whole_message_stream_events():
    msg = {
        "id": "msg_1",
        "model": "m",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3},
        "content": [
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}},
        ],
    }
    events = [json.loads(e.split("\ndata: ")[1]) for e in whole_events(msg)]
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert events[3]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[5]["index"] == 1 and events[5]["content_block"]["input"] == {}
    assert events[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[8]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_error_mapping_and_paths():
    assert [error_type(s) for s in (400, 401, 403, 404, 409, 413, 429, 500, 502, 503, 504)] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "invalid_request_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "api_error",
        "overloaded_error",
        "timeout_error",
    ]
    assert anthropic_error(401, "bad key") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "bad key"},
    }
    assert is_messages_path("/v1/messages") and is_messages_path("/s/x/v1/messages/count_tokens")
    assert is_messages_path("/v1/messages/batches")
    assert not is_messages_path("/v1/chat/completions") and not is_messages_path("/s/x")
    assert not is_messages_path("/v1/messagesx")
