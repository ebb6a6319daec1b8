"""Anthropic Messages stream events (`stream: true`), as server-sent events with `event:` lines.

Sequence (Anthropic's API reference, "Streaming messages"): `message_start` (the message with
empty `content`, `usage.input_tokens` = the prompt's tokens), `ping`, per content block
`content_block_start` / `content_block_delta`s (`text_delta`, `thinking_delta` then
`signature_delta`, `input_json_delta`) / `content_block_stop`, then `message_delta` (`stop_reason`,
`stop_sequence`, `usage` with the output tokens) and `message_stop`.

The text is sent as the engine samples it, by the same rules as the chat path (incremental.py:
text that could still become a stop sequence, a `<tool_call>` or a `<think>` block is held back
until the turn ends); thinking and tool-use blocks follow, whole, when the turn ends. The HTTP
answer starts with the first text: a turn refused or failed before it gets its status and
error JSON; one that ends before any text is answered with all its events at once
(`whole_events`). A failure after the first text is an `error` event; nothing is recorded.
A client that leaves mid-stream stops the turn: nothing is recorded (disconnect.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from typing import Any

import redis
from fastapi.responses import StreamingResponse

from flywheel.core.errors import PlatformError
from flywheel.gateway.api import incremental
from flywheel.gateway.api.disconnect import Receive, stop_abandoned
from flywheel.gateway.api.incremental import MISMATCHES, TextFeed
from flywheel.gateway.api.json_text import dumps_str
from flywheel.gateway.api.messages_errors import anthropic_error

log = logging.getLogger(__name__)
Finish = Callable[[dict[str, Any]], dict[str, Any]]
"""The Anthropic `message` for the turn's `chat.completion` (messages.py)."""


def sse(event: dict[str, Any]) -> str:
    """One server-sent event: `event: <type>` and its JSON data."""
    return f"event: {event['type']}\ndata: {dumps_str(event)}\n\n"


def message_start(msg_id: str, model: str, input_tokens: int) -> str:
    message: dict[str, Any] = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    return sse({"type": "message_start", "message": message})


PING = sse({"type": "ping"})


def _start(index: int, block: dict[str, Any]) -> str:
    return sse({"type": "content_block_start", "index": index, "content_block": block})


def _delta(index: int, delta: dict[str, Any]) -> str:
    return sse({"type": "content_block_delta", "index": index, "delta": delta})


def _stop(index: int) -> str:
    return sse({"type": "content_block_stop", "index": index})


def block_events(index: int, block: dict[str, Any]) -> list[str]:
    """start, delta(s), stop of one whole content block at `index`."""
    kind = block["type"]
    if kind == "text":
        return [
            _start(index, {"type": "text", "text": ""}),
            _delta(index, {"type": "text_delta", "text": block["text"]}),
            _stop(index),
        ]
    if kind == "thinking":
        return [
            _start(index, {"type": "thinking", "thinking": "", "signature": ""}),
            _delta(index, {"type": "thinking_delta", "thinking": block["thinking"]}),
            _delta(index, {"type": "signature_delta", "signature": block["signature"]}),
            _stop(index),
        ]
    start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
    return [
        _start(index, start),
        _delta(index, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}),
        _stop(index),
    ]


def end_events(message: dict[str, Any]) -> list[str]:
    """`message_delta` (stop reason, stop sequence, usage) and `message_stop`."""
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    return [
        sse({"type": "message_delta", "delta": delta, "usage": message["usage"]}),
        sse({"type": "message_stop"}),
    ]


def whole_events(message: dict[str, Any]) -> Iterator[str]:
    """Every event of a finished `message`, in order."""
    yield message_start(message["id"], message["model"], message["usage"]["input_tokens"])
    yield PING
    for i, block in enumerate(message["content"]):
        yield from block_events(i, block)
    yield from end_events(message)


def error_event(exc: Exception) -> str:
    """The `error` event of a turn that failed after its first text (nothing recorded)."""
    if isinstance(exc, PlatformError):
        log.warning("streamed message failed after its first text: %s", exc.message)
        body = anthropic_error(exc.http_status, exc.message)
    elif isinstance(exc, redis.RedisError):
        log.error("streamed message failed after its first text: Redis unavailable: %s", exc)
        body = anthropic_error(503, "the session store (Redis) is unavailable; retry later")
    else:
        log.error("streamed message failed after its first text", exc_info=exc)
        body = anthropic_error(500, f"internal error: {type(exc).__name__}")
    return sse(body)


async def respond(
    work: Coroutine[Any, Any, dict[str, Any]],
    receive: Receive | None,
    session_id: str | None,
    feed: TextFeed,
    head: Callable[[], str],
    finish: Finish,
) -> StreamingResponse | dict[str, Any]:
    """Run the turn `work` (returning its `chat.completion`) with its engine call streamed:
    the event stream as soon as its first text is sampled, or the finished `message` when the
    turn ends first (to be sent with `whole_events`).

    Args:
        feed: what may be sent of the sampled text (the request's stops, tools offered).
        head: the `message_start` event, called once the first text is out (the prompt's
            length is known by then).

    Raises:
        PlatformError: the turn failed before any text. ClientClosedError: the client left
            before that (the turn stopped, nothing recorded).
    """
    started = await incremental.start(work, feed, receive, session_id)
    if isinstance(started, dict):
        return finish(started)
    turn, first = started
    return incremental.TurnStream(
        _events(turn, first, feed, head(), finish, session_id), turn, first, session_id
    )


def _rest(text: str, sent: str) -> str:
    """What of the recorded `text` the client has not got yet ("" when what was sent is not
    its prefix: counted and logged)."""
    if text.startswith(sent):
        return text[len(sent) :]
    if text.startswith(sent.lstrip()):  # a parsed tool call strips leading whitespace
        return text[len(sent.lstrip()) :]
    MISMATCHES.inc()
    log.warning("streamed text %r is not a prefix of the reply %r", sent[:80], text[:80])
    return ""


async def _events(
    turn: asyncio.Future[dict[str, Any]],
    first: asyncio.Future[str],
    feed: TextFeed,
    head: str,
    finish: Finish,
    session_id: str | None,
) -> AsyncGenerator[str, None]:
    try:
        yield head
        yield PING
        yield _start(0, {"type": "text", "text": ""})
        async with contextlib.aclosing(incremental.text_deltas(turn, first, feed)) as deltas:
            async for text in deltas:
                yield _delta(0, {"type": "text_delta", "text": text})
        try:
            message = finish(turn.result())
        except Exception as exc:  # noqa: BLE001  (every failure ends the stream well-formed)
            yield error_event(exc)
            return
        text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
        if rest := _rest(text, feed.sent):
            yield _delta(0, {"type": "text_delta", "text": rest})
        yield _stop(0)
        others = [b for b in message["content"] if b["type"] != "text"]
        for i, block in enumerate(others, start=1):
            for event in block_events(i, block):
                yield event
        for event in end_events(message):
            yield event
    finally:
        first.cancel()  # closed before the deltas began: their first wait is not left pending
        if not turn.done():  # the client left mid-stream
            with contextlib.suppress(BaseException):
                await stop_abandoned(turn, session_id)
