"""Responses API stream events (`stream: true`), sent as the engine samples the reply.

Event sequence (OpenAI's; `sequence_number` counts from 0 over every event of a response):
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
for a message `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`; for a function call
`response.function_call_arguments.delta`, `response.function_call_arguments.done`; for a
reasoning item `response.content_part.added`, `response.reasoning_text.delta`,
`response.reasoning_text.done`, `response.content_part.done`; then `response.output_item.done`;
last `response.completed` (or `response.incomplete` when `max_output_tokens` cut the reply),
whose response carries the usage.

The turn is the chat turn (incremental.py's rules): text is sent as `output_text.delta` while it
is sampled, except what could still become a stop string, a tool call or a `<think>` block, which
is sent when the turn ends together with the reasoning and function-call items. A turn that ends
before its first text (or asks for logprobs) is answered with the whole sequence at once. A
failure after the first event is an `error` event then `response.failed` (a turn that failed
records nothing). A client that leaves mid-stream stops the turn: nothing recorded, nothing stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator
from typing import Any

import redis
from fastapi.responses import StreamingResponse

from flywheel.core.errors import PlatformError
from flywheel.gateway.api import incremental
from flywheel.gateway.api.disconnect import Receive, stop_abandoned
from flywheel.gateway.api.json_text import dumps_str

log = logging.getLogger(__name__)
Finish = Callable[[dict[str, Any], str | None], Awaitable[dict[str, Any]]]
"""Builds (and stores) the final `response` object from the chat completion and the text
already streamed (None: nothing was streamed)."""


class Events:
    """SSE events of one response, numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps_str(body)}\n\n"


def opening(ev: Events, started: dict[str, Any]) -> list[str]:
    """`response.created` and `response.in_progress` for the in-progress response object."""
    return [ev("response.created", response=started), ev("response.in_progress", response=started)]


def message_start(ev: Events, index: int, message_id: str) -> list[str]:
    """The added events of a message item whose text follows as deltas."""
    item = {"id": message_id, "type": "message", "role": "assistant", "status": "in_progress"}
    part = {"type": "output_text", "text": "", "annotations": []}
    return [
        ev("response.output_item.added", output_index=index, item={**item, "content": []}),
        ev(
            "response.content_part.added",
            item_id=message_id,
            output_index=index,
            content_index=0,
            part=part,
        ),
    ]


def text_delta(ev: Events, index: int, message_id: str, delta: str) -> str:
    return ev(
        "response.output_text.delta",
        item_id=message_id,
        output_index=index,
        content_index=0,
        delta=delta,
        logprobs=[],
    )


def message_end(ev: Events, index: int, item: dict[str, Any]) -> list[str]:
    """The done events of a message item (its one `output_text` part)."""
    (part,) = item["content"]
    ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        ev(
            "response.output_text.done",
            **ids,
            text=part["text"],
            logprobs=part.get("logprobs") or [],
        ),
        ev("response.content_part.done", **ids, part=part),
        ev("response.output_item.done", output_index=index, item=item),
    ]


def item_events(ev: Events, index: int, item: dict[str, Any]) -> Iterator[str]:
    """Every event of one finished output item (message, function_call or reasoning)."""
    kind = item["type"]
    if kind == "message":
        yield from message_start(ev, index, item["id"])
        text = item["content"][0]["text"]
        if text:
            yield text_delta(ev, index, item["id"], text)
        yield from message_end(ev, index, item)
        return
    if kind == "function_call":
        ids = {"item_id": item["id"], "output_index": index}
        yield ev(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        yield ev("response.function_call_arguments.delta", **ids, delta=item["arguments"])
        yield ev(
            "response.function_call_arguments.done",
            **ids,
            name=item["name"],
            arguments=item["arguments"],
        )
        yield ev("response.output_item.done", output_index=index, item=item)
        return
    # reasoning: its text as one reasoning_text part
    ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
    text = item["content"][0]["text"]
    yield ev("response.output_item.added", output_index=index, item={**item, "content": []})
    yield ev("response.content_part.added", **ids, part={"type": "reasoning_text", "text": ""})
    if text:
        yield ev("response.reasoning_text.delta", **ids, delta=text)
    yield ev("response.reasoning_text.done", **ids, text=text)
    yield ev("response.content_part.done", **ids, part=item["content"][0])
    yield ev("response.output_item.done", output_index=index, item=item)


def closing(ev: Events, response: dict[str, Any]) -> str:
    """`response.completed`, or `response.incomplete` for a reply cut by the token limit."""
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    return ev(kind, response=response)


def whole_events(started: dict[str, Any], response: dict[str, Any]) -> Iterator[str]:
    """The whole event sequence of a finished response."""
    ev = Events()
    yield from opening(ev, started)
    for index, item in enumerate(response["output"]):
        yield from item_events(ev, index, item)
    yield closing(ev, response)


def sse(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def respond(
    work: Coroutine[Any, Any, dict[str, Any]],
    receive: Receive | None,
    session_id: str | None,
    feed: incremental.TextFeed,
    started: dict[str, Any],
    message_id: str,
    finish: Finish,
) -> StreamingResponse | dict[str, Any]:
    """Run the chat turn `work` with its engine call streamed: the event stream as soon as
    its first text is sampled, or, when the turn ends first, its `chat.completion` body (for
    `whole_events`).

    Raises:
        PlatformError: the turn failed before any text was sampled. ClientClosedError: the
            client disconnected before that (the turn stopped, nothing recorded).
    """
    begun = await incremental.start(work, feed, receive, session_id)
    if isinstance(begun, dict):
        return begun
    turn, first = begun
    events = _events(turn, first, feed, started, message_id, finish, session_id)
    return incremental.TurnStream(events, turn, first, session_id)


async def _events(
    turn: asyncio.Future[dict[str, Any]],
    first: asyncio.Future[str],
    feed: incremental.TextFeed,
    started: dict[str, Any],
    message_id: str,
    finish: Finish,
    session_id: str | None,
) -> AsyncGenerator[str, None]:
    """The events: the opening ones, text deltas while sampling, then the closing ones."""
    ev = Events()
    try:
        for event in [*opening(ev, started), *message_start(ev, 0, message_id)]:
            yield event
        async with contextlib.aclosing(incremental.text_deltas(turn, first, feed)) as deltas:
            async for delta in deltas:
                yield text_delta(ev, 0, message_id, delta)
        try:
            response = await finish(turn.result(), feed.sent)
        except Exception as exc:  # noqa: BLE001  (every failure ends the stream well-formed)
            error = failure(exc)
            yield ev("error", **error)
            failed = {
                **started,
                "status": "failed",
                "error": {"code": error["code"] or "server_error", "message": error["message"]},
            }
            yield ev("response.failed", response=failed)
            return
        message, *calls = response["output"]
        text = message["content"][0]["text"]
        if text.startswith(feed.sent) and len(text) > len(feed.sent):
            yield text_delta(ev, 0, message_id, text[len(feed.sent) :])
        for event in message_end(ev, 0, message):
            yield event
        for index, item in enumerate(calls, start=1):
            for event in item_events(ev, index, item):
                yield event
        yield closing(ev, response)
    finally:
        first.cancel()  # closed before the deltas began: their first wait is not left pending
        if not turn.done():  # the client left mid-stream
            with contextlib.suppress(BaseException):
                await stop_abandoned(turn, session_id)


def failure(exc: Exception) -> dict[str, Any]:
    """`{"code", "message", "param"}` of a turn that failed after its first event (nothing of
    it recorded): a PlatformError as its JSON error would be, Redis down as the 503's, any
    other failure as a server error (logged with its traceback)."""
    if isinstance(exc, PlatformError):
        log.warning("streamed response failed after its first event: %s", exc.message)
        return {"code": exc.code or exc.error_type, "message": exc.message, "param": exc.param}
    if isinstance(exc, redis.RedisError):
        log.error("streamed response failed: Redis unavailable: %s", exc)
        message = "the session store (Redis) is unavailable; retry later"
        return {"code": "service_unavailable_error", "message": message, "param": None}
    log.error("streamed response failed after its first event", exc_info=exc)
    return {
        "code": "server_error",
        "message": f"internal error: {type(exc).__name__}",
        "param": None,
    }
