"""The gateway's HTTP API: OpenAI chat completions, sessions, health and metrics.

`create_app(deps)` builds the app from injected dependencies (house style C8): tests swap in
fakes through `GatewayDeps`; `main.py` builds the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from flywheel._proto import sample_pb2
from flywheel.core import http_errors
from flywheel.core.errors import BackpressureError, ConflictError, InvalidRequestError
from flywheel.core.settings import GatewaySettings
from flywheel.gateway import completions, sweep, turns
from flywheel.gateway.completions import CompletionRequest
from flywheel.gateway.dashboard import install as install_dashboard
from flywheel.gateway.engine_pool import Generation
from flywheel.gateway.parsers import ParsedReply
from flywheel.gateway.request_rules import check_contents, check_model, served_models
from flywheel.gateway.schemas import (
    SESSION_ID_PATTERN,
    ChatCompletionRequest,
    RewardPost,
    SessionCreate,
    SessionFinish,
)
from flywheel.gateway.security import install as install_security
from flywheel.gateway.security import owner_of
from flywheel.gateway.sessions import SessionStore
from flywheel.gateway.streaming import sse_chunks
from flywheel.gateway.tokenization import ChatRenderer, render_call, text_size

log = logging.getLogger(__name__)
UNRECORDED = Counter("flywheel_gateway_unrecorded_requests_total", "Requests served unrecorded")


class Engines(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       affinity: str = "", top_logprobs_num: int = 0) -> Generation: ...


class Publisher(Protocol):
    def publish(self, sample: sample_pb2.Sample) -> str: ...
    def backlog(self) -> int: ...
    high_water: int


@dataclass
class GatewayDeps:
    settings: GatewaySettings
    renderer: ChatRenderer
    engines: Engines
    sessions: SessionStore
    publisher: Publisher
    context_length: int = 2048
    """Tokens (prompt + completion) the engine serves per request."""


async def get_deps(request: Request) -> GatewayDeps:
    """The app's dependencies (async: FastAPI runs a sync dependency in a worker thread)."""
    return request.app.state.deps


Deps = Annotated[GatewayDeps, Depends(get_deps)]
SessionHeader = Annotated[str | None, Header(description="Session id (live mode; created on "
                                                         "first use)")]
TurnHeader = Annotated[str | None, Header(description="main (recorded, default) | side "
                                                      "(served, not recorded)")]


def create_app(deps: GatewayDeps) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep.run_sweeper(deps))  # idle sessions (sweep.py)
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            close = getattr(deps.engines, "aclose", None)
            if close is not None:  # the engine pool's HTTP connections
                await close()

    app = FastAPI(title="Flywheel gateway", lifespan=lifespan)
    http_errors.install(app)
    app.state.deps = deps
    install_security(app, deps)  # API keys, roles, session scoping, limits
    install_dashboard(app, deps)  # /dashboard (admin): curves, samples; stream gauges

    instance = os.environ.get("FLYWHEEL_INSTANCE", "")
    """The nonce of the stack that started this process (stack.py checks it on /readyz)."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "instance": instance}

    @app.get("/readyz")
    async def readyz(d: Deps) -> dict[str, str]:
        await asyncio.to_thread(d.sessions.client.ping)  # never block the event loop
        return {"status": "ready", "instance": instance}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def models(d: Deps) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "flywheel"}
                                           for name in served_models(d.settings)]}

    @app.post("/v1/sessions")
    async def create_session(body: SessionCreate, request: Request, d: Deps) -> dict[str, Any]:
        if not body.eval:
            await _check_backlog(d)
        record = await asyncio.to_thread(d.sessions.create, owner=owner_of(request),
                                         **body.model_dump(exclude_none=True))
        base = str(request.base_url).rstrip("/")
        return {"session_id": record.session_id, "group_id": record.group_id,
                "base_url": f"{base}/s/{record.session_id}/v1", "eval": record.eval}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, d: Deps) -> dict[str, Any]:
        record = await asyncio.to_thread(d.sessions.get, session_id)
        seg = record.segment
        return {"session_id": record.session_id, "group_id": record.group_id,
                "status": record.status, "eval": record.eval, "mode": record.mode,
                "turns": record.turns, "segment_turns": seg.turns,
                "segment_index": seg.index, "samples_published": record.samples_published,
                "forks": record.forks, "fork_reasons": record.fork_reasons,
                "waiting_turns": int(bool(record.pending)) + len(record.branches),
                "finished_by": record.finished_by,
                "token_ids": seg.token_ids, "loss_mask": seg.loss_mask}

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, body: SessionFinish, d: Deps) -> dict[str, Any]:
        following = [body.next_state.for_template()] if body.next_state else None
        return await asyncio.to_thread(turns.finish, d, session_id, body.reward, following)

    @app.post("/v1/sessions/{session_id}/reward")
    async def post_reward(session_id: str, body: RewardPost, d: Deps) -> dict[str, Any]:
        return await asyncio.to_thread(turns.post_reward, d, session_id, body.name, body.reward)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request, d: Deps,
                   x_session_id: SessionHeader = None,
                   x_turn_type: TurnHeader = None) -> JSONResponse | StreamingResponse:
        _check_chat(d, body)
        session_id = await _header_session(d, x_session_id, owner_of(request))
        return _maybe_stream(body, await _chat(d, body, session_id, x_turn_type))

    @app.post("/s/{session_id}/v1/chat/completions", response_model=None)
    async def session_chat(session_id: str, body: ChatCompletionRequest, d: Deps,
                           x_turn_type: TurnHeader = None) -> JSONResponse | StreamingResponse:
        _check_chat(d, body)
        return _maybe_stream(body, await _chat(d, body, session_id, x_turn_type))

    @app.post("/v1/completions", response_model=None)
    async def text_completion(body: CompletionRequest, request: Request, d: Deps,
                              x_session_id: SessionHeader = None
                              ) -> JSONResponse | StreamingResponse:
        check_model(d.settings, body.model)
        session_id = await _header_session(d, x_session_id, owner_of(request))
        return _stream_completion(body, await completions.complete(d, body, session_id))

    @app.post("/s/{session_id}/v1/completions", response_model=None)
    async def session_text_completion(session_id: str, body: CompletionRequest, d: Deps
                                      ) -> JSONResponse | StreamingResponse:
        check_model(d.settings, body.model)
        return _stream_completion(body, await completions.complete(d, body, session_id))

    return app


def _check_chat(d: GatewayDeps, body: ChatCompletionRequest) -> None:
    """OpenAI's rules on the model name and message contents (request_rules.py)."""
    check_model(d.settings, body.model)
    check_contents(body.messages)


def _stream_completion(body: CompletionRequest, completion: dict[str, Any]
                       ) -> JSONResponse | StreamingResponse:
    if not body.stream:
        return JSONResponse(completion)  # plain JSON types: no jsonable_encoder pass
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(iter(completions.sse_chunks(completion, include_usage)),
                             media_type="text/event-stream")


def _maybe_stream(body: ChatCompletionRequest, completion: dict[str, Any]
                  ) -> JSONResponse | StreamingResponse:
    if not body.stream:
        return JSONResponse(completion)  # plain JSON types: no jsonable_encoder pass
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(sse_chunks(completion, include_usage),
                             media_type="text/event-stream")


async def _check_backlog(d: GatewayDeps) -> None:
    if d.publisher.high_water and (
        await asyncio.to_thread(d.publisher.backlog) >= d.publisher.high_water
    ):
        raise BackpressureError("the training backlog is full; retry later", retry_after_s=5)


async def _header_session(d: GatewayDeps, session_id: str | None, owner: str = ""
                          ) -> str | None:
    """The session named by `X-Session-Id`, created in live mode on first use."""
    if session_id is None:
        return None
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidRequestError(
            "X-Session-Id must be 1-128 characters of letters, digits and _ . : -",
            param="X-Session-Id")
    if not await asyncio.to_thread(d.sessions.exists, session_id):
        await _check_backlog(d)
        with contextlib.suppress(ConflictError):  # a concurrent request created it first
            await asyncio.to_thread(d.sessions.create, session_id=session_id, mode="live",
                                    owner=owner)
    return session_id


async def _chat(d: GatewayDeps, body: ChatCompletionRequest, session_id: str | None,
                turn_type: str | None = None) -> dict[str, Any]:
    messages = [m.for_template() for m in body.messages]
    sampling = body.sampling_params(d.settings.default_max_tokens)
    turn_type = (turn_type or "main").lower()
    if turn_type not in turns.TURN_TYPES:
        raise InvalidRequestError(
            f"X-Turn-Type must be one of {list(turns.TURN_TYPES)}, got {turn_type!r}",
            param="X-Turn-Type")
    if session_id is None:
        UNRECORDED.inc()
        prompt = await render_call(text_size(messages, body.tools), d.renderer.prompt_ids,
                                   messages, body.tools)
        turns.check_context(d, prompt, sampling)  # the same rule as in sessions
        gens = await turns.generate_n(d, prompt, sampling, body.n, turns.top_logprobs_num(body))
        return _response(d, body, gens, len(prompt),
                         [turns.parse_choice(d, body, g) for g in gens])
    gens, prompt_tokens, parsed = await turns.session_turn(
        d, body, session_id, messages, sampling, turn_type)
    return _response(d, body, gens, prompt_tokens, parsed)


def _response(d: GatewayDeps, body: ChatCompletionRequest, gens: list[Generation],
              prompt_tokens: int, parsed: list[ParsedReply]) -> dict[str, Any]:
    """The `chat.completion` body: one choice per generation, usage summed over choices."""
    choices = [_choice(d, body, i, gen, reply)
               for i, (gen, reply) in enumerate(zip(gens, parsed, strict=True))]
    completion = sum(len(gen.output_ids) for gen in gens)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model or served_models(d.settings)[0],
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion},
        "metadata": {"weight_version": str(max(gen.weight_version for gen in gens))},
    }


def _token_entry(d: GatewayDeps, token_id: int, logprob: float) -> dict[str, Any]:
    text = d.renderer.tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _logprobs(d: GatewayDeps, gen: Generation) -> list[dict[str, Any]]:
    """OpenAI `logprobs.content`: each sampled token, its logprob and its top alternatives."""
    tops = gen.output_top_logprobs or [[] for _ in gen.output_ids]
    return [{**_token_entry(d, t, lp), "top_logprobs": [_token_entry(d, i, x) for x, i in top]}
            for t, lp, top in zip(gen.output_ids, gen.output_logprobs, tops, strict=True)]


def _choice(d: GatewayDeps, body: ChatCompletionRequest, index: int, gen: Generation,
            parsed: ParsedReply) -> dict[str, Any]:
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
