"""Forced tool calls and structured output through the running stack (real gateway, engine,
Redis and SmolLM2), on chat completions, Responses and Anthropic Messages.

The gateway sends a forced call (`tool_choice` required / named, Responses' `required`,
Anthropic's `any` / `tool`) and `response_format` json_schema to the engine as SGLang grammar
params; the engine masks every decode step. The replies must be well-formed tool calls whose
arguments are valid for the tool's schema (or JSON valid for the response schema), and the
recorded Samples must pass the fidelity check under the documented rule: the recorded logprob
of a constrained token is the model's UNMASKED logprob, which is what a prefill re-scoring
(and the trainer) computes. Temperature 1 makes the draws real samples, not argmax, and lets
the fidelity check compare logprobs.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from flywheel.ops.fidelity import check_fidelity

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "utc": {"type": "boolean"}},
    "required": ["city", "utc"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _faithful(stack, sid: str, turns: int) -> list:
    """Finish the session; every turn's Sample re-scores to the recorded ids and logprobs."""
    httpx.post(f"{stack.gateway}/v1/sessions/{sid}/finish", json={}).raise_for_status()
    samples = stack.session_samples(sid)
    assert len(samples) == turns, samples
    for sample in samples:
        report = check_fidelity(sample, stack.engine)
        assert report.ids_match and report.logprobs_compared and report.ok(1e-3), report
        # the embedded engine says its constrained logprobs are unmasked: nothing is marked
        assert not sample.logprob_renormalized and report.renormalized_tokens == 0
    return samples


def _chat(stack, sid: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.gateway}/v1",
        api_key="local",
        default_headers={"X-Session-Id": sid},
        max_retries=0,
    )


def test_required_tool_choice_returns_a_valid_call_recorded_faithfully(smol_stack):
    sid = "forced-required"
    client = _chat(smol_stack, sid)
    calls = []
    for seed in (1, 2):  # two sampled turns: both must be calls, whatever the draw
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append(call)
    # the second request is a fork of the first (same messages), each one faithful
    samples = _faithful(smol_stack, sid, 2)
    for sample, call in zip(samples, calls, strict=True):
        recorded = json.loads(sample.messages[-1].extra_json)["tool_calls"][0]
        assert recorded["function"]["name"] == call.function.name
        assert json.loads(recorded["function"]["arguments"]) == json.loads(call.function.arguments)


def test_a_named_function_is_the_one_called(smol_stack):
    sid = "forced-named"
    out = _chat(smol_stack, sid).chat.completions.create(
        model=MODEL,
        messages=ASK,  # about weather, yet get_time is forced
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=3,
        max_tokens=80,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_PARAMS)
    _faithful(smol_stack, sid, 1)


def test_response_format_json_schema_returns_valid_json(smol_stack):
    sid = "forced-json"
    schema = {
        "type": "object",
        "properties": {
            "fruit": {"type": "string", "maxLength": 20},
            "color": {"enum": ["red", "yellow", "green"]},
        },
        "required": ["fruit", "color"],
        "additionalProperties": False,
    }
    out = _chat(smol_stack, sid).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit and its color as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema}},
        temperature=1.0,
        seed=4,
        max_tokens=60,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    _faithful(smol_stack, sid, 1)


def test_responses_required_forces_a_call(smol_stack):
    responses = _chat(smol_stack, "forced-responses").responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=80,
    )
    (call,) = [item for item in responses.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    _faithful(smol_stack, "forced-responses", 1)


def test_anthropic_named_tool_forces_that_call(smol_stack):
    claude = anthropic.Anthropic(
        base_url=smol_stack.gateway,
        api_key="local",
        default_headers={"X-Session-Id": "forced-anthropic"},
        max_retries=0,
    )
    message = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=ASK,
        tools=[
            {"name": "get_weather", "input_schema": WEATHER_PARAMS},
            {"name": "get_time", "input_schema": TIME_PARAMS},
        ],
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body={"temperature": 1.0},
    )
    assert message.stop_reason == "tool_use", message
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_time"
    jsonschema.validate(use.input, TIME_PARAMS)
    _faithful(smol_stack, "forced-anthropic", 1)


ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def test_anthropic_any_with_parallel_calls_ends_after_the_call(smol_stack):
    """A forced call with parallel calls allowed ends (EOS) after a complete call: stop_reason
    tool_use and only tool_use blocks, not a newline-forced second call cut at max_tokens."""
    claude = anthropic.Anthropic(
        base_url=smol_stack.gateway,
        api_key="local",
        default_headers={"X-Session-Id": "forced-any"},
        max_retries=0,
    )
    message = claude.messages.create(
        model=MODEL,
        max_tokens=200,  # room for a few parallel calls: the model may add some
        messages=[{"role": "user", "content": "Use add to add 2 and 3"}],
        tools=[{"name": "add", "input_schema": ADD_PARAMS}],
        tool_choice={"type": "any"},
    )
    assert message.stop_reason == "tool_use", message
    assert {b.type for b in message.content} == {"tool_use"}, message.content
    for use in message.content:
        jsonschema.validate(use.input, ADD_PARAMS)
    _faithful(smol_stack, "forced-any", 1)


def test_responses_required_with_parallel_calls_gives_only_function_calls(smol_stack):
    """The row ends after the model's last complete call: only function_call items, no
    message item (a newline after a call used to force one more call until the token limit)."""
    sid = "forced-responses-parallel"
    responses = _chat(smol_stack, sid).responses.create(
        model=MODEL,
        input="Use add to add 2 and 3",
        tools=[{"type": "function", "name": "add", "parameters": ADD_PARAMS}],
        tool_choice="required",
        max_output_tokens=200,  # room for a few parallel calls: the model may add some
    )
    assert responses.status == "completed", responses.output
    assert {item.type for item in responses.output} == {"function_call"}, responses.output
    _faithful(smol_stack, sid, 1)
