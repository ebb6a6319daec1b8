"""Streamed chat answers sent as the engine samples them (`stream: true`, n = 1, no logprobs).

The turn runs as usual (session lock, checks, engine call, parsing, recording); its engine call
is streamed (`engine_stream.TEXT_SINK`) and the text is forwarded as content deltas while it
comes. What the client gets is a prefix of the reply the turn records:

- Text that could still become part of a stop string, of a `<tool_call>` (tools offered), of a
  leading `<think>` block, or of a JSON tool call (tools offered, text starting with `{`/`[`) is
  held back until the turn ends; so is an incomplete UTF-8 character. Reasoning and tool calls
  are sent, parsed, when the turn ends, with the rest of the content, the finish chunk, the
  usage chunk (`stream_options.include_usage`) and `[DONE]`.
- The HTTP answer starts with the first text: a request refused before that (a busy or finished
  session, the backlog, the context window, an engine that refuses) gets its usual status and
  error JSON. A failure after it is an `{"error": ...}` event then `[DONE]`; nothing is recorded.
- A client that leaves mid-stream stops the turn: the engine call is dropped, the session lock
  released without saving, nothing recorded (`flywheel_gateway_requests_abandoned_total`).

n > 1 and `logprobs` requests are answered whole (streaming.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

import redis
from fastapi.responses import StreamingResponse
from prometheus_client import Counter

from flywheel.core.errors import ClientClosedError, PlatformError
from flywheel.core.http_errors import error_body
from flywheel.gateway.api.disconnect import Receive, stop_abandoned, until_disconnected
from flywheel.gateway.api.json_text import dumps_str
from flywheel.gateway.api.schemas import ChatCompletionRequest
from flywheel.gateway.api.streaming import chunk_event
from flywheel.gateway.engines.stream import TEXT_SINK

log = logging.getLogger(__name__)
TOOL_CALL = "<tool_call>"
THINK = "<think>"
MISMATCHES = Counter(
    "flywheel_gateway_stream_mismatches_total",
    "Streamed answers whose content sent while sampling is not a prefix of "
    "the reply recorded (the rest of the content is then not sent)",
)


def eligible(body: ChatCompletionRequest, tool_parser: str) -> bool:
    """Whether a request is answered as it is sampled: `stream`, one choice, no logprobs, and
    not a JSON-only tool parser with tools offered (the whole text may become a call)."""
    return (
        body.stream
        and body.n == 1
        and not body.logprobs
        and not (body.tools_offered and tool_parser == "json")
    )


def streamable(text: str, stops: list[str], tools_offered: bool) -> int:
    """How many characters of the cumulative sampled `text` can be sent now.

    Held back: everything while the text is blank or starts like a `<think>` block (or, with
    tools offered, like a JSON call or with whitespace); from the first stop string or
    `<tool_call>`; a suffix that could begin one; trailing U+FFFD (a character whose bytes are
    not all sampled yet); with tools offered, the whitespace before the held part (a parsed
    call strips it).

    Example: stops ["###"], text "Hello ##" -> 6 ("Hello "): "##" could begin "###".
    """
    head = text.lstrip()
    if not head or THINK.startswith(head[: len(THINK)]) or head.startswith(THINK):
        return 0
    if tools_offered and len(head) != len(text):  # a parsed call strips leading whitespace
        return 0
    if tools_offered and head[0] in "{[":
        return 0
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    markers = [s for s in stops if s] + ([TOOL_CALL] if tools_offered else [])
    limit = end
    for marker in markers:
        found = text.find(marker, 0, end)
        if found >= 0:
            limit = min(limit, found)
            continue
        for k in range(min(len(marker) - 1, end), 0, -1):
            if text.endswith(marker[:k], 0, end):
                limit = min(limit, end - k)
                break
    if tools_offered:
        limit = len(text[:limit].rstrip())
    return limit


class TextFeed:
    """Turns the engine's cumulative text into content deltas that are safe to send."""

    def __init__(self, stops: list[str], tools_offered: bool):
        self.stops = stops
        self.tools_offered = tools_offered
        self.sent = ""
        """Content sent (or queued) so far."""
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    def push(self, text: str) -> None:
        """Queue the part of cumulative `text` not sent yet that `streamable` allows (nothing
        when the text no longer starts with what was sent)."""
        n = streamable(text, self.stops, self.tools_offered)
        if n > len(self.sent) and text.startswith(self.sent):
            self.queue.put_nowait(text[len(self.sent) : n])
            self.sent = text[:n]


Turn = asyncio.Future[dict[str, Any]]


class TurnStream(StreamingResponse):
    """The SSE answer of a turn streamed while it samples (chat, Responses, Messages).

    However the answer ends (sent whole, the client gone mid-stream, or cancelled before its
    first event was produced, when the events' own `finally` never runs), its events are
    closed, the wait for the first text is cancelled and a turn still running is stopped
    (`stop_abandoned`: nothing recorded): no task of the request outlives it.
    """

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        turn: Turn,
        first: asyncio.Future[str],
        session_id: str | None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events, self.turn, self.first, self.session_id = events, turn, first, session_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # its own `finally` runs if it had begun
            self.first.cancel()
            if not self.turn.done():
                with contextlib.suppress(BaseException):
                    await stop_abandoned(self.turn, self.session_id)


async def start(
    work: Coroutine[Any, Any, dict[str, Any]],
    feed: TextFeed,
    receive: Receive | None,
    session_id: str | None,
) -> tuple[Turn, asyncio.Future[str]] | dict[str, Any]:
    """Start the turn `work` (returning its `chat.completion` body) with its sampled text fed
    to `feed`, and wait for its first text: then (the running turn, the first text's future),
    to be streamed with `text_deltas`; or, when the turn ends first, its result. Shared by
    every API's streamed answer (chat, Responses, Messages).

    Raises:
        PlatformError: the turn failed before any text was sampled. ClientClosedError: the
            client disconnected before that (the turn stopped, nothing recorded).
    """
    token = TEXT_SINK.set(feed.push)
    try:
        turn = asyncio.ensure_future(work)  # the task runs in a copy of this context
    finally:
        TEXT_SINK.reset(token)
    first = asyncio.ensure_future(feed.queue.get())
    watcher = asyncio.ensure_future(until_disconnected(receive)) if receive else None
    waiting = {turn, first} | ({watcher} if watcher else set())
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for task in waiting:
            task.cancel()
        raise
    if watcher is not None:
        watcher.cancel()
    if turn.done():
        first.cancel()
        return turn.result()
    if watcher is not None and watcher.done():  # gone, even if its first text is ready
        first.cancel()
        await stop_abandoned(turn, session_id)
        raise ClientClosedError("the client closed the connection before the answer")
    return turn, first


async def text_deltas(
    turn: Turn, first: asyncio.Future[str], feed: TextFeed
) -> AsyncGenerator[str, None]:
    """The sampled text as it is fed, one delta per wake-up (text queued meanwhile joined),
    until the turn ends; then what was queued last. The caller formats each delta as its
    API's event and reads `turn.result()` afterwards.

    However it ends (also closed or cancelled because the client left mid-stream), the wait
    for the next text is cancelled: no `Queue.get` task outlives the stream."""
    pending = first
    try:
        while True:
            either: set[asyncio.Future[Any]] = {pending, turn}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                break
            yield pending.result() + drain(feed.queue)
            pending = asyncio.ensure_future(feed.queue.get())
    finally:
        pending.cancel()  # a no-op when it is done
    if rest := drain(feed.queue):
        yield rest


async def respond(
    body: ChatCompletionRequest,
    work: Coroutine[Any, Any, dict[str, Any]],
    receive: Receive | None,
    session_id: str | None,
    stops: list[str],
    model: str,
) -> StreamingResponse | dict[str, Any]:
    """Run the turn `work` (returning the `chat.completion` body) with its engine call
    streamed: the streamed answer as soon as its first text is sampled, or, when the turn
    ends first, its `chat.completion` body (to be answered whole, `chat.answer`).

    Raises:
        PlatformError: the turn failed before any text was sampled. ClientClosedError: the
            client disconnected before that (the turn stopped, nothing recorded).
    """
    feed = TextFeed(stops, body.tools_offered)
    started = await start(work, feed, receive, session_id)
    if isinstance(started, dict):
        return started
    turn, first = started
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return TurnStream(
        _events(turn, first, feed, base, include_usage, session_id), turn, first, session_id
    )


async def _events(
    turn: asyncio.Future[dict[str, Any]],
    first: asyncio.Future[str],
    feed: TextFeed,
    base: dict[str, Any],
    include_usage: bool,
    session_id: str | None,
) -> AsyncGenerator[str, None]:
    """The SSE events: role, content deltas while sampling, then the closing events."""
    try:
        yield chunk_event(base, {"role": "assistant", "content": ""})
        async with contextlib.aclosing(text_deltas(turn, first, feed)) as deltas:
            async for delta in deltas:
                yield chunk_event(base, {"content": delta})
        try:
            completion = turn.result()
        except Exception as exc:  # noqa: BLE001  (every failure ends the stream well-formed)
            yield _error_event(exc)
            yield "data: [DONE]\n\n"
            return
        for event in closing_events(base, completion, feed.sent, include_usage):
            yield event
    finally:
        first.cancel()  # closed before the deltas began: their first wait is not left pending
        if not turn.done():  # the client left mid-stream
            with contextlib.suppress(BaseException):
                await stop_abandoned(turn, session_id)


def _error_event(exc: Exception) -> str:
    """The `{"error": ...}` event of a turn that failed after its first text (nothing of it
    recorded): a PlatformError as its JSON error would be, Redis down as the 503's body, any
    other failure as a server error (logged with its traceback)."""
    if isinstance(exc, PlatformError):
        log.warning("streamed turn failed after its first text: %s", exc.message)
        error = error_body(exc.message, exc.error_type, exc.param, exc.code)
    elif isinstance(exc, redis.RedisError):
        log.error("streamed turn failed after its first text: Redis unavailable: %s", exc)
        error = error_body(
            "the session store (Redis) is unavailable; retry later", "service_unavailable_error"
        )
    else:
        log.error("streamed turn failed after its first text", exc_info=exc)
        error = error_body(f"internal error: {type(exc).__name__}", "server_error")
    return f"data: {dumps_str(error)}\n\n"


def drain(queue: asyncio.Queue[str]) -> str:
    """The deltas queued while the last event was being sent, as one (a client that reads
    slower than the engine samples gets fewer, larger events)."""
    parts = []
    while not queue.empty():
        parts.append(queue.get_nowait())
    return "".join(parts)


def closing_events(
    base: dict[str, Any], completion: dict[str, Any], sent: str, include_usage: bool
) -> list[str]:
    """The events after the streamed content: the rest of the content, reasoning and tool
    calls (each call a delta with its `index`), the finish chunk, usage, `[DONE]`."""
    (choice,) = completion["choices"]
    message = choice["message"]
    events = []
    if not sent and message.get("reasoning_content"):
        events.append(chunk_event(base, {"reasoning_content": message["reasoning_content"]}))
    content = message.get("content") or ""
    if content.startswith(sent):
        rest = content[len(sent) :]
    elif content.startswith(sent.lstrip()):  # a parsed tool call strips leading whitespace
        rest = content[len(sent.lstrip()) :]
    else:
        MISMATCHES.inc()
        log.warning("streamed content %r is not a prefix of the reply %r", sent[:80], content[:80])
        rest = ""
    if rest:
        events.append(chunk_event(base, {"content": rest}))
    for n, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk_event(base, {"tool_calls": [{"index": n, **call}]}))
    events.append(chunk_event(base, {}, finish=choice["finish_reason"]))
    if include_usage:
        body = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": completion["usage"],
        }
        events.append(f"data: {dumps_str(body)}\n\n")
    events.append("data: [DONE]\n\n")
    return events
