"""The official `anthropic` SDK against the running stack (`POST /v1/messages`): `messages.create`
with a tool over several turns, `messages.stream`, thinking blocks passed back, `count_tokens`,
and a client that leaves mid-stream. Each conversation is one live session (`X-Session-Id`
through `default_headers`); its recorded Samples stay in one segment and re-score on the engine
to the same ids and logprobs (fidelity check).

SmolLM2-135M rarely calls tools on its own: a worked example in the history and greedy decoding
steer it, as in test_clients_openai_agents.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from flywheel.ops.fidelity import check_fidelity

anthropic = pytest.importorskip("anthropic")
pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
EXAMPLE = [
    {"role": "user", "content": "Call get_weather for Rome."},
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Rome"}}
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "rainy"}],
    },
    {"role": "assistant", "content": "It is rainy in Rome."},
]


def _client(smol_stack, sid: str):
    return anthropic.Anthropic(
        base_url=smol_stack.gateway, api_key="local", default_headers={"X-Session-Id": sid}
    )


def _finish_and_check(smol_stack, sid: str, turns: int) -> list:
    """Finish the session; its `turns` Samples are one segment, unforked, and faithful."""
    httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={}).raise_for_status()
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}").json()
    assert info["forks"] == 0 and info["segment_index"] == 0 and info["turns"] == turns, info
    samples = smol_stack.session_samples(sid)
    assert [s.turn_index for s in samples] == list(range(turns))
    assert {s.segment_index for s in samples} == {0}
    for sample in samples:
        report = check_fidelity(sample, smol_stack.engine)
        assert report.ids_match and report.logprobs_compared and report.ok(1e-3), report
    return samples


def _reply(sample) -> dict:
    last = sample.messages[-1]
    assert last.role == "assistant"
    return {"content": json.loads(last.content_json), **json.loads(last.extra_json or "{}")}


def test_create_with_a_tool_over_several_turns(smol_stack):
    sid = "anthropic-tools"
    client = _client(smol_stack, sid)
    history = [*EXAMPLE, {"role": "user", "content": "Call get_weather for Paris."}]
    kwargs = {
        "model": MODEL,
        "max_tokens": 40,
        "extra_body": {"temperature": 0.0},  # the SDK no longer declares sampling fields
        "system": "You answer by calling one tool.",
        "tools": TOOLS,
    }
    first = client.messages.create(messages=history, **kwargs)
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    second = client.messages.create(messages=history, **kwargs)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and second.content[0].type == "text" and second.content[0].text.strip()
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
        {"role": "user", "content": "Thanks. And in Rome?"},
    ]
    third = client.messages.create(messages=history, **kwargs)
    assert third.content
    turn0, turn1, turn2 = _finish_and_check(smol_stack, sid, 3)
    recorded = _reply(turn0)["tool_calls"][0]
    assert call.id.startswith("toolu_")  # Anthropic's form of the recorded call id
    assert recorded["id"] == "call_" + call.id.removeprefix("toolu_")
    assert json.loads(recorded["function"]["arguments"]) == call.input
    assert turn0.next_state.role == "tool"
    assert _reply(turn1)["content"] == second.content[0].text
    assert first.usage.input_tokens == turn0.prompt_length
    assert first.usage.output_tokens == sum(turn0.loss_mask)


def test_stream_equals_whole_with_thinking_passed_back(smol_stack):
    sid = "anthropic-stream"
    client = _client(smol_stack, sid)
    thought = {"type": "thinking", "thinking": "Apples are fruit.", "signature": "sha256:0"}
    history = [
        {"role": "user", "content": "Name one fruit."},
        {"role": "assistant", "content": [thought, {"type": "text", "text": "An apple."}]},
        {"role": "user", "content": "Name another fruit, in one sentence."},
    ]
    replies = []
    for follow_up in ("Now a vegetable.", "And a colour?"):
        with client.messages.stream(
            model=MODEL, max_tokens=24, messages=history, extra_body={"temperature": 1.0}
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.text for e in events if e.type == "text"]
        (start,) = [e for e in events if e.type == "message_start"]
        assert start.message.usage.input_tokens == final.usage.input_tokens
        assert len(deltas) >= 1 and final.stop_reason in ("end_turn", "max_tokens")
        text = "".join(b.text for b in final.content if b.type == "text")
        assert "".join(deltas) == text
        replies.append((text, final.usage))
        history += [
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {"role": "user", "content": follow_up},
        ]
    turn0, turn1 = _finish_and_check(smol_stack, sid, 2)
    for sample, (text, usage) in zip((turn0, turn1), replies, strict=True):
        assert _reply(sample)["content"] == text  # streamed == recorded reply
        assert usage.input_tokens == sample.prompt_length
        assert usage.output_tokens == sum(sample.loss_mask)
    # the client's thinking block is part of the recorded history, as sent
    assistant = [json.loads(m.extra_json or "{}") for m in turn0.messages if m.role == "assistant"]
    assert assistant[0]["reasoning_content"] == "Apples are fruit."


def test_count_tokens_equals_the_prompt_the_engine_got(smol_stack):
    sid = "anthropic-count"
    client = _client(smol_stack, sid)
    body = {
        "model": MODEL,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}],
        "tools": TOOLS,
    }
    counted = client.messages.count_tokens(**body)
    answer = client.messages.create(max_tokens=8, extra_body={"temperature": 0.0}, **body)
    (turn0,) = _finish_and_check(smol_stack, sid, 1)
    assert counted.input_tokens == turn0.prompt_length == answer.usage.input_tokens
    assert counted.input_tokens > 100  # the tool signatures are in the prompt


def _abandoned_total(gateway: str) -> float:
    """`flywheel_gateway_requests_abandoned_total{kind="session"}` of the gateway."""
    for line in httpx.get(f"{gateway}/metrics").text.splitlines():
        if line.startswith('flywheel_gateway_requests_abandoned_total{kind="session"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_leaves_mid_stream_records_nothing(smol_stack):
    sid = "anthropic-leaves"
    before = _abandoned_total(smol_stack.gateway)
    body = {
        "model": MODEL,
        "max_tokens": 400,
        "temperature": 1.0,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    }
    headers = {"X-Session-Id": sid, "x-api-key": "local", "anthropic-version": "2023-06-01"}
    seen = []
    with httpx.stream(
        "POST", f"{smol_stack.gateway}/v1/messages", json=body, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("event: "):
                seen.append(line[7:])
            if "content_block_delta" in seen:
                break  # leave after the first text
    assert seen[:3] == ["message_start", "ping", "content_block_start"]
    assert "message_stop" not in seen
    deadline = time.monotonic() + 30
    while _abandoned_total(smol_stack.gateway) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _abandoned_total(smol_stack.gateway) == before + 1
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}").json()
    assert info["turns"] == 0 and info["token_ids"] == []
    finished = httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={}).json()
    assert finished["samples_published"] == 0
    assert smol_stack.session_samples(sid) == []
