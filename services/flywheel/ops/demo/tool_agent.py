"""The tool-using agent: an ordinary `openai-agents` program with a calculator tool. It knows
nothing about RL.

It gets a base_url (a gateway session URL) and a question, runs the agent loop (model turn ->
tool call -> tool output -> model turn ...) with the SDK's `Runner`, and returns what happened:
the final reply, the tool calls that ran and the malformed ones. The model is the SDK's
`OpenAIChatCompletionsModel` (the gateway's `/v1/chat/completions` route).

SmolLM2-135M rarely calls a tool from the tool list alone: the instructions and one worked
example (a tool round trip as earlier conversation items) show it the call format.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import agents
import openai
from openai import AsyncOpenAI

from flywheel.ops.demo.cancel import openai_async_http_client

INSTRUCTIONS = (
    "You are a calculator assistant. You cannot add large numbers in your head. To add two "
    "numbers, call the add tool with them, then reply with just the sum the tool returned."
)
MAX_TURNS = 3
"""Model turns per episode: the call, the answer and one spare (a second call or a retry)."""

agents.set_tracing_disabled(True)


def worked_example(call_id: str = "call_example") -> list[dict[str, Any]]:
    """One tool round trip as Responses-style input items (user, call, output, answer)."""
    return [
        {"role": "user", "content": "What is 241563 + 572814?"},
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "add",
            "arguments": json.dumps({"a": 241563, "b": 572814}),
        },
        {"type": "function_call_output", "call_id": call_id, "output": "814377"},
        {"role": "assistant", "content": "814377"},
    ]


@dataclass
class AgentTrace:
    """What one episode did. `tool_calls`: calls the tool ran, as (a, b); `malformed_calls`:
    calls whose arguments failed validation or named an unknown tool (a call the gateway could
    not parse reaches the agent as reply text: `agent_tasks.has_call_markup` finds it)."""

    final_output: str = ""
    tool_calls: list[tuple[int, int]] = field(default_factory=list)
    malformed_calls: int = 0
    error: str = ""
    """"" or why the run stopped early: "max_turns", "model_behavior: ..." (counted as a
    malformed call) or "api: ..." (the gateway answered with an error)."""
    api_error: openai.APIError | None = None
    """The gateway's error that ended the episode ("api: ..."), else None."""


def _build_agent(trace: AgentTrace, client: AsyncOpenAI, model: str, settings: Any) -> Any:
    def add(a: int, b: int) -> str:
        """Add two integers and return their sum."""
        trace.tool_calls.append((a, b))
        return str(a + b)

    def failed(_ctx: Any, error: Exception) -> str:
        trace.malformed_calls += 1
        return f"error: {error}"

    tool = agents.function_tool(add, failure_error_function=failed)
    return agents.Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[tool],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=settings,
    )


async def run_episode_async(
    base_url: str,
    question: str,
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    api_key: str = "flywheel-local",
    max_turns: int = MAX_TURNS,
    example: bool = True,
    stopping: threading.Event | None = None,
) -> AgentTrace:
    """Run the agent on `question` through `base_url`; returns its trace. Never raises for the
    model's behavior or the server's errors: too many turns, an unknown tool or an error
    answer from the gateway end the episode with `error` set. Once `stopping` is set its
    requests raise `EpisodeCancelled` (`cancel.py`), which ends the run."""
    trace = AgentTrace()
    http = openai_async_http_client(stopping)
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=5, timeout=600, http_client=http
    )
    settings = agents.ModelSettings(temperature=temperature, max_tokens=max_tokens)
    agent = _build_agent(trace, client, model, settings)
    items = [*(worked_example() if example else []), {"role": "user", "content": question}]
    try:
        result = await agents.Runner.run(agent, items, max_turns=max_turns)  # type: ignore[arg-type]
        trace.final_output = str(result.final_output or "")
    except agents.MaxTurnsExceeded:
        trace.error = "max_turns"
    except agents.ModelBehaviorError as exc:  # e.g. a call to a tool that does not exist
        trace.malformed_calls += 1
        trace.error = f"model_behavior: {exc}"
    except openai.APIError as exc:  # the gateway or engine failed: no verdict on the model
        trace.error = f"api: {type(exc).__name__}: {exc}"
        trace.api_error = exc
    finally:
        await client.close()
    return trace


def run_episode(base_url: str, question: str, **kwargs: Any) -> AgentTrace:
    """`run_episode_async` from synchronous code (a worker thread of the demo runner)."""
    return asyncio.run(run_episode_async(base_url, question, **kwargs))
