"""`openai-agents` (an Agent with two function tools, the chat-completions model class) against
the running stack through an episode session: the agent's tool call is parsed out of the
model's sampled text, the tool runs, the model answers, and the recorded Sample re-scores on the
engine to the same ids and logprobs with no forked (re-rendered) segment.

SmolLM2-135M rarely calls tools on its own: the instructions and one worked example in the
input steer it, and greedy decoding makes the run repeatable."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI

from flywheel.ops.fidelity import check_fidelity

agents = pytest.importorskip("agents")
pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"


def _example(call_id: str) -> list[dict]:
    """One worked tool round trip, as Responses-style input items."""
    return [
        {"role": "user", "content": "Call get_time for Rome."},
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "get_time",
            "arguments": json.dumps({"city": "Rome"}),
        },
        {"type": "function_call_output", "call_id": call_id, "output": "10:00"},
        {"role": "assistant", "content": "It is 10:00 in Rome."},
    ]


def test_agent_with_two_function_tools_over_several_turns(smol_stack):
    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(("get_weather", city))
        return "sunny"

    @agents.function_tool
    def get_time(city: str) -> str:
        """Current time in a city."""
        calls.append(("get_time", city))
        return "12:00"

    session = httpx.post(f"{smol_stack.gateway}/v1/sessions", json={"group_id": "agents"}).json()
    client = AsyncOpenAI(base_url=session["base_url"], api_key="local")
    agent = agents.Agent(
        name="weather",
        instructions="You answer by calling one tool.",
        tools=[get_weather, get_time],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=40),
    )
    items = [*_example("call_0"), {"role": "user", "content": "Call get_weather for Paris."}]

    async def conversation():
        first = await agents.Runner.run(agent, items, max_turns=4)
        # A second user turn in the same session continues from the agent's history.
        more = [*first.to_input_list(), {"role": "user", "content": "Call get_time for Paris."}]
        return first, await agents.Runner.run(agent, more, max_turns=4)

    result, second = asyncio.run(conversation())
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # Real tool calls parsed from sampled text, one per user turn, both tools used.
    assert calls == [("get_weather", "Paris"), ("get_time", "Paris")]
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(second.final_output, str) and second.final_output.strip()
    assert [i.type for i in second.new_items][:2] == ["tool_call_item", "tool_call_output_item"]
    finished = httpx.post(
        f"{smol_stack.gateway}/v1/sessions/{session['session_id']}/finish", json={}
    )
    assert finished.json()["samples_published"] == 1
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{session['session_id']}").json()
    assert info["forks"] == 0 and info["turns"] == 4
    (sample,) = smol_stack.session_samples(session["session_id"])
    assert sample.finish_reason == "stop"
    called = [
        json.loads(m.extra_json)["tool_calls"][0]["function"]["name"]
        for m in sample.messages
        if m.role == "assistant" and "tool_calls" in m.extra_json
    ]
    assert called == ["get_time", "get_weather", "get_time"]  # the example's call, then both
    report = check_fidelity(sample, smol_stack.engine)
    assert report.ids_match and report.ok(1e-3), report
