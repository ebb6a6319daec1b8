"""The gateway's HTTP API: OpenAI chat completions, sessions, health and metrics.

`create_app(deps)` builds the app from injected dependencies (deps.py, house style C8): tests
swap in fakes through `GatewayDeps`; `main.py` builds the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flywheel.core import http_errors
from flywheel.core.errors import PermissionDeniedError
from flywheel.gateway.access.principal import owner_of, principal
from flywheel.gateway.access.security import install as install_security
from flywheel.gateway.api import chat, completions, messages, responses
from flywheel.gateway.api.completions import CompletionRequest
from flywheel.gateway.api.disconnect import unless_disconnected
from flywheel.gateway.api.hot_path import HotPath
from flywheel.gateway.api.json_shapes import document_limits
from flywheel.gateway.api.messages_errors import AnthropicErrors
from flywheel.gateway.api.request_rules import check_model, served_models
from flywheel.gateway.api.schemas import (
    ChatCompletionRequest,
    RewardPost,
    SessionCreate,
    SessionFinish,
)
from flywheel.gateway.api.session_keys import SessionHeaders
from flywheel.gateway.dashboard import install as install_dashboard
from flywheel.gateway.deps import Deps, GatewayDeps, SessionHeader, TurnHeader
from flywheel.gateway.engines import fleet_routes
from flywheel.gateway.session import finish, sweep
from flywheel.gateway.session.owner import check_request_owner

log = logging.getLogger(__name__)


def create_app(deps: GatewayDeps) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep.run_sweeper(deps))  # idle sessions (sweep.py)
        tasks = [sweeper]
        if deps.retention is not None:  # consumed stream entries past streams.retention
            tasks.append(asyncio.create_task(deps.retention.run()))
        if deps.fleet is not None:  # the shared engine fleet (engines/fleet_watch.py)
            tasks.append(asyncio.create_task(deps.fleet.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            close = getattr(deps.engines, "aclose", None)
            if close is not None:  # the engine pool's HTTP connections
                await close()

    # redirect_slashes=False: a path with a trailing slash is a 404 in the API's error format,
    # never a redirect whose location is built from the request's Host header (an open redirect)
    app = FastAPI(title="Flywheel gateway", lifespan=lifespan, redirect_slashes=False)
    http_errors.install(app)
    app.state.deps = deps
    app.add_middleware(HotPath, deps=deps)  # chat completions (hot_path.py), inside security
    app.add_middleware(SessionHeaders, settings=deps.settings)  # gateway.session_headers
    install_security(app, deps)  # API keys, roles, session scoping, limits
    install_dashboard(app, deps)  # /dashboard (admin): curves, samples; stream gauges
    app.include_router(fleet_routes.router)  # /v1/admin/engines (admin): the engine fleet
    messages.install(app)  # Anthropic Messages (api/messages.py)
    responses.install(app, deps)  # OpenAI Responses (api/responses.py)
    app.add_middleware(AnthropicErrors)  # outermost: Anthropic error JSON on its paths

    instance = os.environ.get("FLYWHEEL_INSTANCE", "")
    """The nonce of the stack that started this process (stack.py checks it on /readyz)."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "instance": instance}

    @app.get("/readyz", response_model=None)
    async def readyz(d: Deps) -> dict[str, str] | JSONResponse:
        """200 when Redis answers and an engine is in service; 503 while no engine is (the
        fleet is empty, or its engines are pending: they do not serve its weights yet)."""
        await asyncio.to_thread(d.sessions.client.ping)  # never block the event loop
        in_service = getattr(d.engines, "urls", None)  # an EnginePool; a test fake has none
        if in_service is not None and not in_service:
            return JSONResponse(
                {
                    "status": "no engine in service",
                    "instance": instance,
                    "detail": "the fleet is empty or its engines do not serve its weights yet "
                    "(GET /v1/admin/engines, `flywheel engines list`)",
                },
                status_code=503,
            )
        return {"status": "ready", "instance": instance}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(d: Deps) -> dict[str, Any]:
        return _model_list(d)

    @app.get("/s/{session_id}/v1/models")
    async def session_models(session_id: str, d: Deps) -> dict[str, Any]:
        return _model_list(d)  # the same list in every session

    @app.post("/v1/sessions")
    async def create_session(
        request: Request, d: Deps, body: SessionCreate | None = None
    ) -> dict[str, Any]:
        body = body or SessionCreate()  # no body: every field has its default
        if not principal(request).train:
            raise PermissionDeniedError(
                "this API key is not for training: its requests are served without a session "
                "and never recorded; send them to /v1 without creating a session, or use a "
                "key marked for training",
                code="not_for_training",
            )
        if not body.eval:
            await chat.check_backlog(d)
        record = await d.sessions.acreate(
            owner=owner_of(request), **body.model_dump(exclude_none=True)
        )
        base = str(request.base_url).rstrip("/")
        return {
            "session_id": record.session_id,
            "group_id": record.group_id,
            "base_url": f"{base}/s/{record.session_id}/v1",
            "eval": record.eval,
        }

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, d: Deps) -> dict[str, Any]:
        record = await asyncio.to_thread(d.sessions.get, session_id)
        check_request_owner(record)
        seg = record.segment
        return {
            "session_id": record.session_id,
            "group_id": record.group_id,
            "status": record.status,
            "eval": record.eval,
            "mode": record.mode,
            "turns": record.turns,
            "segment_turns": seg.turns,
            "segment_index": seg.index,
            "samples_published": record.samples_published,
            "samples_held": record.held,
            "forks": record.forks,
            "fork_reasons": record.fork_reasons,
            "waiting_turns": int(bool(record.pending)) + len(record.branches),
            "finished_by": record.finished_by,
            "token_ids": seg.token_ids,
            "loss_mask": seg.loss_mask,
        }

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, body: SessionFinish, d: Deps) -> dict[str, Any]:
        following = [body.next_state.for_template()] if body.next_state else None
        return await finish.finish(d, session_id, body.reward, following)

    @app.post("/v1/sessions/{session_id}/reward")
    async def post_reward(session_id: str, body: RewardPost, d: Deps) -> dict[str, Any]:
        return await finish.post_reward(d, session_id, body.name, body.reward)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        d: Deps,
        x_session_id: SessionHeader = None,
        x_turn_type: TurnHeader = None,
    ) -> Response:
        return await chat.respond(
            d, body, None, x_session_id, x_turn_type, owner_of(request), request.receive
        )

    @app.post("/s/{session_id}/v1/chat/completions", response_model=None)
    async def session_chat(
        session_id: str,
        body: ChatCompletionRequest,
        request: Request,
        d: Deps,
        x_turn_type: TurnHeader = None,
    ) -> Response:
        return await chat.respond(d, body, session_id, None, x_turn_type, "", request.receive)

    @app.post("/v1/completions", response_model=None)
    async def text_completion(
        body: CompletionRequest, request: Request, d: Deps, x_session_id: SessionHeader = None
    ) -> JSONResponse | StreamingResponse:
        check_model(d.settings, body.model)
        session_id = await chat.header_session(d, x_session_id, owner_of(request))
        return await _complete(d, body, session_id, request)

    @app.post("/s/{session_id}/v1/completions", response_model=None)
    async def session_text_completion(
        session_id: str, body: CompletionRequest, request: Request, d: Deps
    ) -> JSONResponse | StreamingResponse:
        check_model(d.settings, body.model)
        return await _complete(d, body, session_id, request)

    generated = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document with this deployment's limits (api/json_shapes.py)."""
        if app.openapi_schema is None:
            document_limits(
                generated(),  # cached by FastAPI in app.openapi_schema, changed in place
                context_length=deps.context_length,
                vocab_size=len(deps.renderer.tokenizer),
                max_messages=deps.settings.security.max_messages,
                max_tools=deps.settings.security.max_tools,
                served_models=list(deps.settings.served_model_names),
            )
        return app.openapi_schema or generated()

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
    return app


def _model_list(d: GatewayDeps) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "flywheel"}
            for name in served_models(d.settings)
        ],
    }


async def _complete(
    d: GatewayDeps, body: CompletionRequest, session_id: str | None, request: Request
) -> JSONResponse | StreamingResponse:
    """A text completion, stopped unrecorded if the client disconnects first."""
    completion = await unless_disconnected(
        completions.complete(d, body, session_id), request.receive, session_id
    )
    return _stream_completion(body, completion)


def _stream_completion(
    body: CompletionRequest, completion: dict[str, Any]
) -> JSONResponse | StreamingResponse:
    if not body.stream:
        return JSONResponse(completion)  # plain JSON types: no jsonable_encoder pass
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(
        iter(completions.sse_chunks(completion, include_usage)), media_type="text/event-stream"
    )
