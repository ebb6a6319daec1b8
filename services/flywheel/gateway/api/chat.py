"""Chat completions: check the request, serve it (recorded in a session, or not), and build
the OpenAI answer. Called by the FastAPI routes (app.py) and the hot path (hot_path.py) alike.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from flywheel.core.errors import (
    BackpressureError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
)
from flywheel.core.validation_messages import one_of
from flywheel.gateway.api import incremental
from flywheel.gateway.api.disconnect import Receive, unless_disconnected
from flywheel.gateway.api.json_text import dumps
from flywheel.gateway.api.parsers import ParsedReply
from flywheel.gateway.api.request_rules import check_contents, check_model, served_models
from flywheel.gateway.api.schemas import SESSION_ID_PATTERN, ChatCompletionRequest, stop_list
from flywheel.gateway.api.streaming import sse_chunks
from flywheel.gateway.engines import calls
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import render_call, text_size
from flywheel.gateway.session import turns
from flywheel.gateway.session.backpressure import backlog_full, served_unrecorded
from flywheel.gateway.session.owner import REQUEST_TRAIN

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

UNRECORDED = Counter("flywheel_gateway_unrecorded_requests_total", "Requests served unrecorded")


def check_chat(d: GatewayDeps, body: ChatCompletionRequest) -> None:
    """OpenAI's rules on the model name and message contents (request_rules.py)."""
    check_model(d.settings, body.model)
    check_contents(body.messages)


def answer(body: ChatCompletionRequest, completion: dict[str, Any]) -> Response:
    """The HTTP response: the completion as JSON (orjson, json_text.py), or as SSE chunks when
    `stream` is set."""
    if not body.stream:
        return Response(dumps(completion), media_type="application/json")
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(sse_chunks(completion, include_usage), media_type="text/event-stream")


async def check_backlog(d: GatewayDeps) -> None:
    """Raises: BackpressureError (429, Retry-After) while the training backlog is full."""
    if d.publisher.high_water and await d.publisher.abacklog() >= d.publisher.high_water:
        raise BackpressureError("the training backlog is full; retry later", retry_after_s=5)


def session_header(session_id: str | None) -> str | None:
    """The session id an `X-Session-Id` header names (None without the header).

    Raises:
        InvalidRequestError: not 1-128 letters, digits and `_ . : -`.
    """
    if session_id is not None and not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidRequestError(
            "X-Session-Id must be 1-128 characters of letters, digits and _ . : -",
            param="X-Session-Id",
        )
    return session_id


async def create_live(d: GatewayDeps, session_id: str, owner: str) -> None:
    """Create the live-mode session an `X-Session-Id` names, on its first request (a concurrent
    first request may have created it meanwhile: the turn then checks whose it is under the
    session lock, `locks.locked`).

    Raises:
        BackpressureError: the training backlog is full (no new sessions then).
    """
    await check_backlog(d)
    with contextlib.suppress(ConflictError):  # a concurrent request created it first
        await d.sessions.acreate(session_id=session_id, mode="live", owner=owner)


async def header_session(d: GatewayDeps, session_id: str | None, owner: str = "") -> str | None:
    """The session named by `X-Session-Id`, created in live mode on first use (checked with
    one EXISTS; chat requests skip it, see `serve`)."""
    session_id = session_header(session_id)
    if session_id is not None and not await d.sessions.aexists(session_id):
        await create_live(d, session_id, owner)
    return session_id


async def respond(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    session_id: str | None,
    header_id: str | None,
    turn_type: str | None,
    owner: str,
    receive: Receive | None = None,
) -> Response:
    """One chat request end to end, as the routes and the hot path serve it: OpenAI's rules,
    the session (the URL's `session_id`, else the `X-Session-Id` value `header_id`, created in
    live mode for `owner` on first use), the turn and the HTTP answer. With the ASGI `receive`
    (body already read) the turn is stopped, unrecorded, if the client disconnects first.

    Raises:
        PlatformError: see `check_chat`, `session_header` and `serve`. ClientClosedError: the
            client disconnected before the answer was ready (disconnect.py).
    """
    check_chat(d, body)
    create_owner = None
    if session_id is None:
        session_id = session_header(header_id)
        create_owner = None if session_id is None else owner
    work = serve(d, body, session_id, turn_type, create_owner=create_owner)
    if incremental.eligible(body, d.settings.tool_parser):
        streamed = await incremental.respond(
            body,
            work,
            receive,
            session_id,
            stop_list(body.stop),
            body.model or served_models(d.settings)[0],
        )
        if isinstance(streamed, StreamingResponse):
            return streamed
        return answer(body, streamed)  # the turn ended before its first text
    completion = await unless_disconnected(work, receive, session_id)
    return answer(body, completion)


async def serve(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    session_id: str | None,
    turn_type: str | None = None,
    *,
    create_owner: str | None = None,
) -> dict[str, Any]:
    """Serve one chat request, recorded when `session_id` names a session; returns the
    `chat.completion` body.

    `create_owner` (the session comes from `X-Session-Id`): a session the turn finds missing
    is created in live mode for this owner and the turn served in it, so a request of an
    existing session costs no extra Redis round trip.

    Raises:
        InvalidRequestError: a bad X-Turn-Type, or a prompt longer than the context window.
        NotFoundError, ConflictError: see `turns.session_turn`. UpstreamError: no engine served.
        BackpressureError: a new session while the training backlog is full.
    """
    messages = [m.for_template() for m in body.messages]
    sampling = body.sampling_params(d.settings.default_max_tokens, d.settings.tool_parser)
    turn_type = (turn_type or "main").lower()
    if turn_type not in turns.TURN_TYPES:
        raise InvalidRequestError(
            f"X-Turn-Type must be one of {one_of(turns.TURN_TYPES)}, got {turn_type!r}",
            param="X-Turn-Type",
        )
    if session_id is None:
        UNRECORDED.inc()
        return await _unrecorded(d, body, messages, sampling)
    if not REQUEST_TRAIN.get():  # a key not for training: served outside its session
        completion = await _unrecorded(d, body, messages, sampling)
        tokens = completion["usage"]["completion_tokens"]
        served_unrecorded(session_id, "not_for_training", tokens)
        return completion
    try:
        gens, prompt_tokens, parsed = await turns.session_turn(
            d, body, session_id, messages, sampling, turn_type
        )
    except NotFoundError:
        if create_owner is None:
            raise
        if d.settings.live_backpressure == "serve_unrecorded" and await backlog_full(d):
            completion = await _unrecorded(d, body, messages, sampling)
            tokens = completion["usage"]["completion_tokens"]
            served_unrecorded(session_id, "backpressure", tokens)
            return completion
        await create_live(d, session_id, create_owner)
        gens, prompt_tokens, parsed = await turns.session_turn(
            d, body, session_id, messages, sampling, turn_type
        )
    return _response(d, body, gens, prompt_tokens, parsed)


async def _unrecorded(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """A chat request served outside any session: nothing recorded; the `chat.completion`."""
    prompt = await render_call(
        text_size(messages, body.tools), d.renderer.prompt_ids, messages, body.tools
    )
    calls.check_context(
        d,
        prompt,
        sampling,  # the same rule as in sessions
        capped_by_default=turns.default_cap(body),
    )
    gens = await calls.generate_n(d, prompt, sampling, body.n, turns.top_logprobs_num(body))
    return _response(d, body, gens, len(prompt), [turns.parse_choice(d, body, g) for g in gens])


def _response(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    gens: list[Generation],
    prompt_tokens: int,
    parsed: list[ParsedReply],
) -> dict[str, Any]:
    """The `chat.completion` body: one choice per generation, usage summed over choices."""
    choices = [
        _choice(d, body, i, gen, reply)
        for i, (gen, reply) in enumerate(zip(gens, parsed, strict=True))
    ]
    completion = sum(len(gen.output_ids) for gen in gens)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model or served_models(d.settings)[0],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
        "metadata": {"weight_version": str(max(gen.weight_version for gen in gens))},
    }


def _token_entry(d: GatewayDeps, token_id: int, logprob: float) -> dict[str, Any]:
    text = cast(str, d.renderer.tokenizer.decode([token_id]))  # one sequence: one string
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _logprobs(d: GatewayDeps, gen: Generation) -> list[dict[str, Any]]:
    """OpenAI `logprobs.content`: each sampled token, its logprob and its top alternatives."""
    tops = gen.output_top_logprobs or [[] for _ in gen.output_ids]
    return [
        {**_token_entry(d, t, lp), "top_logprobs": [_token_entry(d, i, x) for x, i in top]}
        for t, lp, top in zip(gen.output_ids, gen.output_logprobs, tops, strict=True)
    ]


def _choice(
    d: GatewayDeps, body: ChatCompletionRequest, index: int, gen: Generation, parsed: ParsedReply
) -> dict[str, Any]:
    finish = gen.finish_type
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    choice: dict[str, Any] = {
        "index": index,
        "message": parsed.message(),
        "finish_reason": finish,
        "logprobs": None,
    }
    if body.logprobs:
        choice["logprobs"] = {"content": _logprobs(d, gen)}
    return choice
