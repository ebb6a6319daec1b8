"""OpenAI chat-completion SSE chunks from a finished completion.

For answers sent when the turn ends (n > 1, `logprobs`, or a turn that ended before its
first text; incremental.py streams the others as sampled): the chunk sequence OpenAI clients
expect: a role chunk, a content chunk, one chunk per tool call (each delta with its `index`,
BUG-27), the finish chunk, an optional usage chunk (`stream_options.include_usage`), then
`data: [DONE]`. With `logprobs`, the first chunk after the role carries the choice's whole
`logprobs.content` (the per-token rows of every delta of the choice; BUG-06: logprobs stay on
with a tool parser).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def chunk_event(
    base: dict[str, Any],
    delta: dict[str, Any],
    finish: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> str:
    body = {
        **base,
        "object": "chat.completion.chunk",
        "choices": [
            {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        ],
    }
    return f"data: {json.dumps(body)}\n\n"


def _deltas(message: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The deltas of one choice after its role chunk: reasoning, content, each tool call."""
    if message.get("reasoning_content"):
        yield {"reasoning_content": message["reasoning_content"]}
    if message.get("content"):
        yield {"content": message["content"]}
    for n, call in enumerate(message.get("tool_calls") or []):
        yield {"tool_calls": [{"index": n, **call}]}


def sse_chunks(completion: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """SSE events for a `chat.completion` dict (every choice, in index order)."""
    base = {k: completion[k] for k in ("id", "created", "model")}
    for choice in completion["choices"]:
        i, message = choice["index"], choice["message"]
        logprobs = choice.get("logprobs")  # sent once, with the choice's first delta
        yield chunk_event(base, {"role": "assistant", "content": ""}, index=i)
        for delta in _deltas(message):
            yield chunk_event(base, delta, index=i, logprobs=logprobs)
            logprobs = None
        yield chunk_event(base, {}, finish=choice["finish_reason"], index=i, logprobs=logprobs)
    if include_usage:
        body = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": completion["usage"],
        }
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
