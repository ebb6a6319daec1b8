import json

from flywheel.gateway.api.parsers import parse_reply
from flywheel.gateway.api.streaming import sse_chunks


def test_hermes_tool_call_parsed_and_text_kept_outside():
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 1}}\n</tool_call>'
    )
    parsed = parse_reply(text, tools_offered=True)
    assert parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 7, "b": 1}
    assert call["id"].startswith("call_")


def test_json_fallback_and_no_parsing_without_tools():
    text = '{"name": "lookup", "parameters": {"q": "x"}}'
    assert parse_reply(text, tools_offered=True).tool_calls[0]["function"]["name"] == "lookup"
    plain = parse_reply(text, tools_offered=False)
    assert plain.tool_calls == [] and plain.content == text


def test_malformed_block_is_left_as_content():
    text = "<tool_call>{not json}</tool_call>"
    parsed = parse_reply(text, tools_offered=True)
    assert parsed.tool_calls == [] and parsed.content == text


def test_reasoning_split_from_content():
    parsed = parse_reply("<think>7 plus 1</think>\n8", tools_offered=False)
    assert parsed.reasoning_content == "7 plus 1" and parsed.content == "8"


def test_sse_chunks_carry_tool_call_index_usage_and_done():
    completion = {
        "id": "c1",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    events = list(sse_chunks(completion, include_usage=True))
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    deltas = [b["choices"][0]["delta"] for b in bodies if b["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert deltas[1]["tool_calls"][0]["index"] == 0  # BUG-27: every tool-call delta has index
    assert bodies[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["total_tokens"] == 5
