"""The official `openai` SDK's `client.responses.create` and `openai-agents` (its default
Responses model class) against the running stack (real gateway, engine, Redis and SmolLM2):
well-formed responses and events, and recorded Samples that re-score on the engine to the same
ids and logprobs (fidelity check) with one segment per conversation.

Sessions are named as an unmodified harness names them: `X-Session-Id`, the header the stack
lists in `gateway.session_headers` (`x-conversation-id`), or `prompt_cache_key`.

SmolLM2-135M rarely calls tools on its own: a worked tool round trip in the input steers it,
and greedy decoding makes the runs repeatable."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from flywheel.ops.fidelity import check_fidelity

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {**WEATHER, "name": "get_time", "description": "Current time in a city."}


def _example() -> list[dict]:
    """One worked tool round trip, as Responses input items."""
    return [
        {"role": "user", "content": "Call get_time for Rome."},
        {
            "type": "function_call",
            "call_id": "call_0",
            "name": "get_time",
            "arguments": json.dumps({"city": "Rome"}),
        },
        {"type": "function_call_output", "call_id": "call_0", "output": "10:00"},
        {"role": "assistant", "content": "It is 10:00 in Rome."},
    ]


def _finish_and_check(stack, sid: str, turns: int) -> list:
    """Finish the live session; every turn's Sample is faithful, all in one segment."""
    assert httpx.post(f"{stack.gateway}/v1/sessions/{sid}/finish", json={}).status_code == 200
    info = httpx.get(f"{stack.gateway}/v1/sessions/{sid}").json()
    assert info["forks"] == 0 and info["turns"] == turns, info
    samples = stack.session_samples(sid)
    assert [s.turn_index for s in samples] == list(range(turns))
    assert {s.segment_index for s in samples} == {0}
    for sample in samples:
        report = check_fidelity(sample, stack.engine)
        assert report.ids_match and report.logprobs_compared and report.ok(1e-3), report
    return samples


def test_plain_and_streamed_responses_are_well_formed_and_recorded_as_sent(smol_stack):
    client = openai.OpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="local")
    plain = client.responses.create(
        model=MODEL, input="Name one fruit.", max_output_tokens=16, temperature=0
    )
    assert plain.status in ("completed", "incomplete") and plain.output_text.strip()
    assert plain.usage.output_tokens >= 1
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens

    sid = "responses-stream"
    events = list(
        client.responses.create(
            model=MODEL,
            input="Tell me about the sea.",
            instructions="You are a poet.",
            max_output_tokens=40,
            temperature=1.0,
            stream=True,
            extra_headers={"X-Session-Id": sid},
        )
    )
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text and deltas.strip()
    (sample,) = _finish_and_check(smol_stack, sid, 1)
    assert json.loads(sample.messages[-1].content_json) == deltas  # streamed == recorded
    assert sum(sample.loss_mask) == final.usage.output_tokens


def test_function_tools_over_several_stateless_turns_in_a_header_named_session(smol_stack):
    """The whole input every turn (store: false), the session named by the configured
    `x-conversation-id` header: the model's output items sent back extend the recording."""
    conversation = "conv-stateless-1"
    client = openai.OpenAI(
        base_url=f"{smol_stack.gateway}/v1",
        api_key="local",
        default_headers={"x-conversation-id": conversation},
    )
    items = [*_example(), {"role": "user", "content": "Call get_weather for Paris."}]
    calls = []
    for _ in range(4):  # tool call, answer, tool call, answer
        r = client.responses.create(
            model=MODEL,
            input=items,
            tools=[WEATHER, TIME],
            instructions="You answer by calling one tool.",
            max_output_tokens=40,
            temperature=0,
            store=False,
        )
        items += [item.model_dump(exclude_none=True) for item in r.output]
        fn = [o for o in r.output if o.type == "function_call"]
        if fn:
            calls.append((fn[0].name, json.loads(fn[0].arguments)))
            items.append(
                {"type": "function_call_output", "call_id": fn[0].call_id, "output": "sunny"}
            )
        else:
            assert r.output_text.strip()
            items.append({"role": "user", "content": "Call get_time for Paris."})
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]
    _finish_and_check(smol_stack, conversation, 4)


def test_previous_response_id_chain_in_a_prompt_cache_key_session(smol_stack):
    """`store: true` + `previous_response_id`, streamed, session named by `prompt_cache_key`."""
    client = openai.OpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="local")
    key = "pck-chain-1"
    previous = None
    new_input: list[dict] = [
        *_example(),
        {"role": "user", "content": "Call get_weather for Paris."},
    ]
    kinds = []
    for _ in range(3):
        events = list(
            client.responses.create(
                model=MODEL,
                input=new_input,
                tools=[WEATHER, TIME],
                instructions="You answer by calling one tool.",
                max_output_tokens=40,
                temperature=0,
                previous_response_id=previous,
                prompt_cache_key=key,
                stream=True,
            )
        )
        assert events[-1].type in ("response.completed", "response.incomplete")
        r = events[-1].response
        previous = r.id
        fn = [o for o in r.output if o.type == "function_call"]
        kinds.append("call" if fn else "text")
        if fn:
            new_input = [
                {"type": "function_call_output", "call_id": fn[0].call_id, "output": "sunny"}
            ]
        else:
            new_input = [{"role": "user", "content": "Call get_time for Paris."}]
    assert kinds[0] == "call"
    _finish_and_check(smol_stack, key, 3)


def test_retrieve_and_delete_through_the_sdk_against_the_stack(smol_stack):
    """`client.responses.retrieve` gives the stored response as answered; after
    `client.responses.delete` it, and a `previous_response_id` naming it, are 404s."""
    client = openai.OpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="local")
    made = client.responses.create(
        model=MODEL, input="Name one fruit.", max_output_tokens=8, temperature=0
    )
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    assert got.usage.output_tokens == made.usage.output_tokens
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model=MODEL, input="And another?", max_output_tokens=8, previous_response_id=made.id
        )
    assert err.value.body["param"] == "previous_response_id"


def test_concurrent_chains_send_each_next_turn_the_moment_a_reply_arrives(smol_stack):
    """Eight conversations at once through `openai.AsyncOpenAI`, each turn sent with the
    previous reply's `previous_response_id` as soon as that reply is read (no pause between
    them): every lookup finds the stored response (no 404), and each turn's prompt holds the
    whole chain: its input tokens exceed the previous turn's input plus output tokens (the
    earlier turns, then the new user message), and `retrieve` gives the last reply as sent."""
    client = openai.AsyncOpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="local")

    async def chain(i: int) -> list:
        made, previous = [], None
        for turn in range(3):
            r = await client.responses.create(
                model=MODEL,
                input=f"Chain {i}, turn {turn}: name a number.",
                max_output_tokens=4,
                temperature=0,
                previous_response_id=previous,
            )
            made.append(r)
            previous = r.id
        return made

    async def run() -> list[list]:
        try:
            return await asyncio.gather(*(chain(i) for i in range(8)))
        finally:
            await client.close()

    for made in asyncio.run(run()):
        for before, after in zip(made, made[1:], strict=False):
            assert after.previous_response_id == before.id
            grown = before.usage.input_tokens + before.usage.output_tokens
            assert after.usage.input_tokens > grown, (before.usage, after.usage)
        last = openai.OpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="local")
        got = last.responses.retrieve(made[-1].id)
        assert got.output_text == made[-1].output_text


def _abandoned(gateway: str) -> float:
    text = httpx.get(f"{gateway}/metrics").text
    found = re.search(r'flywheel_gateway_requests_abandoned_total{kind="session"} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_client_leaving_mid_stream_records_nothing(smol_stack):
    sid = "responses-left"
    before = _abandoned(smol_stack.gateway)
    body = {
        "model": MODEL,
        "input": "Write a long story about a dragon.",
        "max_output_tokens": 200,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{smol_stack.gateway}/v1/responses", json=body, headers={"X-Session-Id": sid}
        ) as reply,
    ):
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if '"response.output_text.delta"' in line:
                break  # leave after the first text
    deadline = time.monotonic() + 30
    while _abandoned(smol_stack.gateway) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _abandoned(smol_stack.gateway) == before + 1  # the turn was stopped
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}").json()
    assert info["turns"] == 0, info
    assert httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={}).status_code == 200
    assert smol_stack.session_samples(sid) == []


agents = pytest.importorskip("agents")


def test_openai_agents_with_the_responses_model_and_a_function_tool(smol_stack):
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return "sunny"

    @agents.function_tool
    def get_time(city: str) -> str:
        """Current time in a city."""
        return "12:00"

    sid = "agents-responses"
    client = openai.AsyncOpenAI(
        base_url=f"{smol_stack.gateway}/v1", api_key="local", default_headers={"X-Session-Id": sid}
    )
    agent = agents.Agent(
        name="weather",
        instructions="You answer by calling one tool.",
        tools=[get_weather, get_time],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=64, store=False),
    )
    items = [*_example(), {"role": "user", "content": "Call get_weather for Paris."}]
    result = asyncio.run(agents.Runner.run(agent, items, max_turns=4))
    assert calls == ["Paris"]
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and result.final_output.strip()
    _finish_and_check(smol_stack, sid, len([k for k in kinds if k != "tool_call_output_item"]))
