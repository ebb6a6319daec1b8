"""OpenAI chat-completion SSE chunks from a finished completion.

The engine result arrives whole; it is sent as the chunk sequence OpenAI clients expect: a role
chunk, a content chunk, one chunk per tool call (each delta with its `index`, BUG-27), the
finish chunk, an optional usage chunk (`stream_options.include_usage`), then `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish: str | None = None,
           index: int = 0) -> str:
    body = {**base, "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                         "logprobs": None}]}
    return f"data: {json.dumps(body)}\n\n"


def sse_chunks(completion: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """SSE events for a `chat.completion` dict (every choice, in index order)."""
    base = {k: completion[k] for k in ("id", "created", "model")}
    for choice in completion["choices"]:
        i, message = choice["index"], choice["message"]
        yield _chunk(base, {"role": "assistant", "content": ""}, index=i)
        if message.get("reasoning_content"):
            yield _chunk(base, {"reasoning_content": message["reasoning_content"]}, index=i)
        if message.get("content"):
            yield _chunk(base, {"content": message["content"]}, index=i)
        for n, call in enumerate(message.get("tool_calls") or []):
            yield _chunk(base, {"tool_calls": [{"index": n, **call}]}, index=i)
        yield _chunk(base, {}, finish=choice["finish_reason"], index=i)
    if include_usage:
        body = {**base, "object": "chat.completion.chunk", "choices": [],
                "usage": completion["usage"]}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
