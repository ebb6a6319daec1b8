"""Responses API <-> chat turn translation (api/responses_translate.py), worked examples both
ways, and the bad inputs that are a 400 naming the offending parameter."""

from __future__ import annotations

import re

import pytest

from flywheel.core.errors import InvalidRequestError
from flywheel.gateway.api.responses_schema import ResponsesRequest
from flywheel.gateway.api.responses_translate import (
    chat_request,
    chat_tool_choice,
    chat_tools,
    input_messages,
    new_id,
    new_ids,
    output_items,
    response_format,
)

CALL = {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_a_string_input_is_one_user_message_and_instructions_a_system_message():
    body = ResponsesRequest(model="m", input="Hi", instructions="Be brief.", max_output_tokens=7)
    chat, conversation = chat_request(body, [])
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert conversation == [{"role": "user", "content": "Hi"}]  # stored without instructions
    assert chat["max_completion_tokens"] == 7 and chat["logprobs"] is False


def test_message_items_with_every_role_and_text_parts():
    items = [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "sys"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        },
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "dev"},  # developer is a system message, as in chat
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},  # parts joined, as chat joins them
        {"role": "assistant", "content": "ok"},
    ]


def test_one_turns_output_items_sent_back_rebuild_the_recorded_assistant_message():
    recorded = {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [CALL, {**CALL, "id": "call_def"}],
        "reasoning_content": "think",
    }
    items = output_items(recorded, "tool_calls", "msg_1")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert [i["call_id"] for i in items[2:]] == ["call_abc", "call_def"]
    assert items[2]["arguments"] == '{"x": 1}'  # the string as sampled
    back = [*items, {"type": "function_call_output", "call_id": "call_abc", "output": "1"}]
    messages = input_messages([{"role": "user", "content": "q"}, *back])
    assert messages[1] == recorded
    assert messages[2] == {"role": "tool", "tool_call_id": "call_abc", "content": "1"}


def test_a_tool_call_only_reply_has_no_message_item_and_comes_back_with_null_content():
    recorded = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    items = output_items(recorded, "tool_calls", "msg_1")
    assert [i["type"] for i in items] == ["function_call"]
    assert input_messages(items) == [recorded]


def test_a_reasoning_only_reply_comes_back_with_empty_text():
    recorded = {"role": "assistant", "content": "", "reasoning_content": "hmm"}
    items = output_items(recorded, "length", "msg_1", with_encrypted=True)
    assert items[0]["encrypted_content"] == "hmm"
    assert items[1]["status"] == "incomplete"  # cut by max_output_tokens
    assert input_messages(items) == [recorded]
    # A client that keeps only encrypted_content still gives the reasoning back.
    assert input_messages(
        [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "hmm"}]
    ) == [recorded]


def test_two_assistant_messages_in_a_row_stay_two_messages():
    items = [
        {"role": "assistant", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "three"},
    ]
    out = input_messages(items)
    assert [m.get("content") for m in out] == ["one", "two", "three"]
    assert out[1]["tool_calls"][0]["id"] == "c"  # a call joins the message before it


def test_function_tools_tool_choice_and_text_format_become_chat_shapes():
    tool = {
        "type": "function",
        "name": "f",
        "description": "d",
        "parameters": {"type": "object"},
        "strict": True,
    }
    assert chat_tools([tool]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert chat_tool_choice("required") == "required"
    fmt = {
        "format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    }
    assert response_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
    }


def test_previous_conversation_goes_before_the_new_input():
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    body = ResponsesRequest(
        model="m",
        input=[{"type": "function_call_output", "call_id": "call_abc", "output": "1"}],
        instructions="sys",
    )
    chat, conversation = chat_request(body, history)
    assert chat["messages"][0] == {"role": "system", "content": "sys"}
    assert chat["messages"][1:3] == history
    assert conversation[-1] == {"role": "tool", "tool_call_id": "call_abc", "content": "1"}


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
            "input[0].content[0].type",
        ),
        ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        (["just a string"], "input[0]"),
    ],
)
def test_bad_items_are_refused_naming_the_item(items, param):
    with pytest.raises(InvalidRequestError) as err:
        input_messages(items)
    assert err.value.param == param


@pytest.mark.parametrize(
    "kind", ["web_search", "file_search", "computer_use_preview", "code_interpreter", "mcp"]
)
def test_built_in_tools_are_refused(kind):
    with pytest.raises(InvalidRequestError) as err:
        chat_tools([{"type": kind}])
    assert err.value.param == "tools[0].type" and "runs no built-in tools" in err.value.message


def test_built_in_tool_choice_is_refused():
    with pytest.raises(InvalidRequestError) as err:
        chat_tool_choice({"type": "web_search_preview"})
    assert err.value.param == "tool_choice"


def test_new_ids_are_the_prefix_and_32_fresh_hex_digits():
    ids = {new_id("resp") for _ in range(1000)}
    assert len(ids) == 1000  # 128 random bits each: no repeats
    assert all(re.fullmatch(r"resp_[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"fc_[0-9a-f]{32}", new_id("fc"))


def test_new_ids_are_distinct_ids_of_128_random_bits_each():
    resp, msg = new_ids("resp", "msg")
    assert re.fullmatch(r"resp_[0-9a-f]{32}", resp) and re.fullmatch(r"msg_[0-9a-f]{32}", msg)
    assert resp[5:] != msg[4:]  # two halves of 32 random bytes: equal with chance 2**-128
    assert len({new_ids("a")[0] for _ in range(100)}) == 100
