"""Streamed `/generate` calls: the engine's text as it is sampled, then the whole Generation.

SGLang streams cumulative chunks (`stream: true`, server flag `--incremental-streaming-output`
off, its default): every `data:` event holds the text, `output_ids` and logprob rows so far, the
last one the finish reason; a mid-stream failure is an `{"error": ...}` event; `data: [DONE]`
ends it (an engine that answers `stream` with one JSON body is read as a plain call). Only
the cumulative text of each chunk is passed on while it runs; the Generation is
parsed from the final chunk alone (`parse_generation`, the same checks as a plain call), so
nothing is concatenated from the chunks.

A failure before the first chunk tries the next engine once, as a plain call does; after the
first chunk the text is already on its way to the client, so a failure is an UpstreamError (a
stream past `gateway.request_timeout_s`: a 504 `engine_timeout` naming it) and nothing is
recorded. A generation the engine aborts (a weight update) continues from its tokens
(partial.py) and its text runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import aiohttp
import orjson

from flywheel.core.errors import InvalidRequestError, UpstreamError
from flywheel.gateway.engines.call_errors import describe, is_refused, no_engine_served
from flywheel.gateway.engines.generation import Generation, parse_generation
from flywheel.gateway.engines.overload import BUSY_STATUSES, ENGINE_BUSY
from flywheel.gateway.engines.partial import generate_partial
from flywheel.gateway.engines.timeouts import (
    is_timeout,
    note_timeout,
    stream_timeout_error,
)

OnText = Callable[[str], None]
"""Called with the cumulative text of each chunk, in order."""
TEXT_SINK: ContextVar[OnText | None] = ContextVar("flywheel_text_sink", default=None)
"""Set by a request answered as the text is sampled (incremental.py): its engine call is
streamed into this sink (`calls.generate_n`, one choice only)."""

log = logging.getLogger(__name__)


class Engines(Protocol):
    """What a streamed call needs of the engine pool (pool.py `EnginePool`)."""

    stop_token_ids: set[int]
    timeout_s: float
    """Seconds per engine call (`gateway.request_timeout_s`)."""

    def order(self, affinity: str) -> list[str]:
        """Engine URLs to try for `affinity`, healthy ones first."""
        ...

    def mark_down(self, url: str, why: str) -> None:
        """Take an engine out of service after a failed call."""
        ...

    def mark_up(self, url: str) -> None:
        """Put an engine back in service after a good answer."""
        ...

    def _session(self) -> aiohttp.ClientSession:
        """The pool's HTTP client session."""
        ...


class _Failed(Exception):
    """The call failed before its first chunk (another engine may serve it); `refused`: the
    connection was refused (no engine process runs there)."""

    def __init__(self, why: str, *, refused: bool = False):
        super().__init__(why)
        self.refused = refused


class _TimedOut(Exception):
    """No first chunk within the call's timeout: try another engine, keep this one in."""


class _Busy(Exception):
    """The engine refused the call as full or not ready (429/503): try another, keep it in."""


async def generate_stream(
    pool: Engines, body: dict[str, Any], affinity: str, on_text: OnText
) -> Generation:
    """One streamed `/generate` (`body` without `stream`, with `input_ids`), on the session's
    engine or, when it fails before its first chunk, the next one. A generation the engine
    aborts continues from its tokens (partial.py): `on_text` goes on with the text so far
    followed by the new part's, so the client's stream runs on as if nothing happened.

    Raises:
        InvalidRequestError: the engine rejected the request (4xx).
        UpstreamError: every tried engine failed, the stream broke or reported an error after
            its first chunk, or the engine aborted the generation more than
            `partial.MAX_ABORTS` times (or once, when it has a grammar or output penalty).
        EngineTimeoutError: no engine sent a first chunk within `gateway.request_timeout_s`,
            or the stream ran past it after its first chunk (504 `engine_timeout`).
    """
    shown = ""

    async def call(ids: list[int], params: dict[str, Any]) -> tuple[str, Generation]:
        nonlocal shown
        prefix = shown
        url, gen = await _stream_once(
            pool,
            {**body, "input_ids": ids, "sampling_params": params},
            affinity,
            lambda text: on_text(prefix + text),
        )
        shown = prefix + gen.text
        return url, gen

    gen, _ = await generate_partial(call, body["input_ids"], body["sampling_params"], restart=False)
    return gen


async def _stream_once(
    pool: Engines, body: dict[str, Any], affinity: str, on_text: OnText
) -> tuple[str, Generation]:
    """One streamed call and the engine that answered (the next one on a failure before the
    first chunk)."""
    errors, busy, timeouts, refused = [], [], [], []
    for url in pool.order(affinity)[:2]:
        try:
            gen = await _one(pool, url, {**body, "stream": True}, on_text)
        except _Busy as exc:  # full or loading: busy, not broken (overload.py)
            busy.append(f"{url}: {exc}")
            continue
        except _TimedOut:  # slow, not broken: kept in service (timeouts.py)
            timeouts.append(note_timeout(url, pool.timeout_s))
            continue
        except _Failed as exc:
            errors.append(f"{url}: {exc}")
            if exc.refused:
                refused.append(errors[-1])
            pool.mark_down(url, errors[-1])
            continue
        pool.mark_up(url)
        return url, gen
    raise no_engine_served(busy, timeouts, refused, errors, pool.timeout_s)


async def _one(pool: Engines, url: str, body: dict[str, Any], on_text: OnText) -> Generation:
    last: dict[str, Any] | None = None
    try:
        async with pool._session().post(
            f"{url}/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status in BUSY_STATUSES:
                ENGINE_BUSY.labels(url).inc()
                raw = await resp.read()
                raise _Busy(f"HTTP {resp.status} {raw[:200].decode(errors='replace')}")
            if 400 <= resp.status < 500:
                raw = await resp.read()
                raise InvalidRequestError(
                    f"engine rejected the request: {raw[:500].decode(errors='replace')}"
                )
            if resp.status != 200:
                raise _Failed(f"HTTP {resp.status}")
            if resp.content_type != "text/event-stream":  # an engine that answers whole
                try:
                    gen = parse_generation(
                        orjson.loads(await resp.read()),
                        pool.stop_token_ids,
                        body["sampling_params"],
                    )
                except (ValueError, TypeError, AttributeError, UpstreamError) as exc:
                    raise _Failed(f"unusable response ({exc})") from exc
                on_text(gen.text)
                return gen
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise _fail(last, f"unreadable stream event ({exc})") from exc
                if "error" in chunk:
                    message = (chunk["error"] or {}).get("message", chunk["error"])
                    raise _fail(last, f"engine error: {message}")
                last = chunk
                on_text(str(chunk.get("text", "")))
    except (aiohttp.ClientError, TimeoutError) as exc:
        if is_timeout(exc):
            if last is None:
                raise _TimedOut(repr(exc)) from exc
            raise stream_timeout_error(url, pool.timeout_s) from exc
        if last is None and is_refused(exc):
            raise _Failed(describe(exc), refused=True) from exc
        raise _fail(last, describe(exc)) from exc
    if last is None:
        raise _Failed("the stream ended without a chunk")
    try:
        return parse_generation(last, pool.stop_token_ids, body["sampling_params"])
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("engine %s: unusable final stream chunk (%s)", url, exc)
        raise UpstreamError(f"the engine's final stream chunk is unusable ({exc})") from exc


def _fail(last: dict[str, Any] | None, why: str) -> Exception:
    """Before the first chunk another engine may serve the request; after it, an UpstreamError."""
    if last is None:
        return _Failed(why)
    return UpstreamError(
        f"the engine's stream broke after it started: {why}; nothing was "
        "recorded, send the request again"
    )
