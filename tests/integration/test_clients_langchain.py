"""`langchain-openai` (`ChatOpenAI` with `bind_tools`) against the running stack through an
episode session: the tool call comes back parsed into `AIMessage.tool_calls`, the tool's
`ToolMessage` goes back in, the model answers, and the recorded Sample is token-faithful (the
fidelity check passes, no forked segment). A worked example in the history and greedy
decoding steer SmolLM2-135M to a repeatable tool call."""

from __future__ import annotations

import httpx
import pytest

from flywheel.ops.fidelity import check_fidelity

lc_openai = pytest.importorskip("langchain_openai")
messages_mod = pytest.importorskip("langchain_core.messages")
tools_mod = pytest.importorskip("langchain_core.tools")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@tools_mod.tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return "sunny"


@tools_mod.tool
def get_time(city: str) -> str:
    """Current time in a city."""
    return "12:00"


def test_chat_openai_bind_tools_round_trip(smol_stack):
    m = messages_mod
    session = httpx.post(f"{smol_stack.gateway}/v1/sessions", json={"group_id": "lc"}).json()
    llm = lc_openai.ChatOpenAI(
        model="SmolLM2-135M-Instruct",
        base_url=session["base_url"],
        api_key="local",
        temperature=0,
        max_tokens=40,
        max_retries=0,
    )
    bound = llm.bind_tools([get_weather, get_time])
    history = [
        m.SystemMessage("You answer by calling one tool."),
        m.HumanMessage("Call get_time for Rome."),
        m.AIMessage(
            "",
            tool_calls=[
                {"name": "get_time", "args": {"city": "Rome"}, "id": "call_0", "type": "tool_call"}
            ],
        ),
        m.ToolMessage("10:00", tool_call_id="call_0"),
        m.AIMessage("It is 10:00 in Rome."),
        m.HumanMessage("Call get_weather for Paris."),
    ]
    first = bound.invoke(history)
    assert isinstance(first, m.AIMessage)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert first.response_metadata["finish_reason"] == "tool_calls"
    call = first.tool_calls[0]
    result = {"get_weather": get_weather, "get_time": get_time}[call["name"]].invoke(call)
    assert isinstance(result, m.ToolMessage) and result.tool_call_id == call["id"]
    second = bound.invoke([*history, first, result])
    assert isinstance(second, m.AIMessage) and second.content.strip()
    assert second.usage_metadata["output_tokens"] > 0
    sid = session["session_id"]
    httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={})
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}").json()
    assert info["forks"] == 0 and info["turns"] == 2
    (sample,) = smol_stack.session_samples(sid)
    assert sum(sample.loss_mask) == (
        first.usage_metadata["output_tokens"] + second.usage_metadata["output_tokens"]
    )
    report = check_fidelity(sample, smol_stack.engine)
    assert report.ids_match and report.ok(1e-3), report
