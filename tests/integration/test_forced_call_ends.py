"""A forced tool call ends when its call is complete, through the running stack (real gateway,
engine, Redis and SmolLM2) on chat completions, Responses and Anthropic Messages.

SmolLM2 pretty-prints the arguments and, sampled at temperature 1, sometimes goes on writing
newlines inside them; with whitespace unbounded by the grammar such a row ran to the token
limit (finish `length`, Responses `incomplete`, Anthropic `max_tokens`). The forced-call grammar
now caps each whitespace run at 10 characters, so every call completes; with one call allowed
the mask then leaves only EOS, which the engine samples and the row ends. Where one call is
allowed, the bound in the comment is the most the grammar lets through, so `< max_tokens` holds
by construction; with parallel calls how many calls follow is the model's choice.
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
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
IM_END = 2
"""SmolLM2's `<|im_end|>`: the EOS that ends an assistant turn."""


def _client(stack, sid: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.gateway}/v1",
        api_key="local",
        default_headers={"X-Session-Id": sid},
        max_retries=0,
    )


def _claude(stack, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=stack.gateway,
        api_key="local",
        default_headers={"X-Session-Id": sid},
        max_retries=0,
    )


def _recorded_turn_ends_with_eos(stack, sid: str) -> None:
    """The Sample's sampled ids end with the EOS the engine sampled, re-scored faithfully."""
    httpx.post(f"{stack.gateway}/v1/sessions/{sid}/finish", json={}).raise_for_status()
    (sample,) = stack.session_samples(sid)
    sampled = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert sampled[-1] == IM_END and IM_END not in sampled[:-1], sampled
    report = check_fidelity(sample, stack.engine)
    assert report.ids_match and report.ok(1e-3), report


def test_chat_single_and_named_calls_end_with_eos(smol_stack):
    """One call allowed, so at most: `<tool_call>\\n{"name": "get_weather", "arguments": ` (49
    characters) + `{"city": "London"}` (17 without whitespace) + `}\\n</tool_call>` (14) + 6
    whitespace runs of <= 10 characters (60) = 140 tokens (each >= 1 character) + EOS = 141."""
    bodies = [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ]
    for i, extra in enumerate(bodies):
        sid = f"forced-ends-single-{i}"
        out = _client(smol_stack, sid).chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
            temperature=1.0,
            seed=5,
            max_tokens=150,
            **extra,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert out.usage is not None and out.usage.completion_tokens < 150
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), CITY)
        _recorded_turn_ends_with_eos(smol_stack, sid)


def test_responses_required_one_call_is_completed(smol_stack):
    sid = "forced-ends-responses"
    response = _client(smol_stack, sid).responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=150,
    )
    assert response.status == "completed", response
    assert response.usage is not None and response.usage.output_tokens < 150
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    _recorded_turn_ends_with_eos(smol_stack, sid)


@pytest.mark.parametrize("parallel", [False, True])
def test_anthropic_any_stops_with_tool_use(smol_stack, parallel):
    """`any` (one call with `disable_parallel_tool_use`, else one or more) ends `tool_use`."""
    sid = f"forced-ends-any-{parallel}"
    choice: dict = {"type": "any"}
    if not parallel:
        choice["disable_parallel_tool_use"] = True
    message = _claude(smol_stack, sid).messages.create(
        model=MODEL,
        max_tokens=150,
        messages=ASK,
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice=choice,
        extra_body={"temperature": 1.0},
    )
    assert message.stop_reason == "tool_use", message
    assert message.usage.output_tokens < 150, message.usage
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and len(uses) == len(message.content), message.content
    for use in uses:
        jsonschema.validate(use.input, CITY)
    _recorded_turn_ends_with_eos(smol_stack, sid)
