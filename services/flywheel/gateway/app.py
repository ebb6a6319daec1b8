"""The gateway's HTTP API: OpenAI chat completions, sessions, health and metrics.

`create_app(deps)` builds the app from injected dependencies (house style C8): tests swap in
fakes through `GatewayDeps`; `main.py` builds the real ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from flywheel._proto import sample_pb2
from flywheel.core import http_errors
from flywheel.core.errors import BackpressureError, ConflictError, InvalidRequestError
from flywheel.core.settings import GatewaySettings
from flywheel.gateway.engine_pool import Generation
from flywheel.gateway.parsers import ParsedReply, parse_reply
from flywheel.gateway.recording import build_sample, prepare_prompt, record_generation
from flywheel.gateway.schemas import ChatCompletionRequest, SessionCreate, SessionFinish
from flywheel.gateway.security import install as install_security
from flywheel.gateway.security import owner_of
from flywheel.gateway.sessions import SessionRecord, SessionStore
from flywheel.gateway.streaming import sse_chunks
from flywheel.gateway.tokenization import ChatRenderer

log = logging.getLogger(__name__)
PUBLISHED = Counter("flywheel_gateway_samples_published_total", "Samples published")
UNRECORDED = Counter("flywheel_gateway_unrecorded_requests_total", "Requests served unrecorded")


class Engines(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       affinity: str = "") -> Generation: ...


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


def get_deps(request: Request) -> GatewayDeps:
    return request.app.state.deps


Deps = Annotated[GatewayDeps, Depends(get_deps)]


def create_app(deps: GatewayDeps) -> FastAPI:
    app = FastAPI(title="Flywheel gateway")
    http_errors.install(app)
    app.state.deps = deps
    install_security(app, deps)  # API keys, roles, session scoping, limits

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(d: Deps) -> dict[str, str]:
        d.sessions.client.ping()
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def models(d: Deps) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": d.settings.model_name, "object": "model",
                                            "created": 0, "owned_by": "flywheel"}]}

    @app.post("/v1/sessions")
    async def create_session(body: SessionCreate, request: Request, d: Deps) -> dict[str, Any]:
        if not body.eval and d.publisher.high_water and (
            await asyncio.to_thread(d.publisher.backlog) >= d.publisher.high_water
        ):
            raise BackpressureError("the training backlog is full; retry later", retry_after_s=5)
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
                "status": record.status, "eval": record.eval, "turns": seg.turns,
                "segment_index": seg.index, "samples_published": record.samples_published,
                "token_ids": seg.token_ids, "loss_mask": seg.loss_mask}

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, body: SessionFinish, d: Deps) -> dict[str, Any]:
        return await asyncio.to_thread(_finish, d, session_id, body.reward)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, d: Deps) -> dict[str, Any] | StreamingResponse:
        return _maybe_stream(body, await _chat(d, body, None))

    @app.post("/s/{session_id}/v1/chat/completions", response_model=None)
    async def session_chat(session_id: str, body: ChatCompletionRequest, d: Deps
                           ) -> dict[str, Any] | StreamingResponse:
        return _maybe_stream(body, await _chat(d, body, session_id))

    return app


def _maybe_stream(body: ChatCompletionRequest, completion: dict[str, Any]
                  ) -> dict[str, Any] | StreamingResponse:
    if not body.stream:
        return completion
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(sse_chunks(completion, include_usage),
                             media_type="text/event-stream")


def _finish(d: GatewayDeps, session_id: str, reward: float | None) -> dict[str, Any]:
    with d.sessions.locked(session_id) as record:
        if record.status == "finished":
            raise ConflictError(f"session {session_id} is already finished")
        record.status = "finished"
        published = 0
        if not record.eval and record.segment.sampled_tokens:
            _publish(d, record, build_sample(record, record.segment, reward))
            published = 1
    return {"session_id": session_id, "status": "finished", "samples_published": published}


def _publish(d: GatewayDeps, record: SessionRecord, sample: sample_pb2.Sample) -> None:
    d.publisher.publish(sample)
    record.samples_published += 1
    PUBLISHED.inc()
    log.info("published sample %s of session %s (%d tokens)", sample.sample_id,
             record.session_id, len(sample.token_ids))


async def _chat(d: GatewayDeps, body: ChatCompletionRequest, session_id: str | None
                ) -> dict[str, Any]:
    messages = [m.for_template() for m in body.messages]
    sampling = body.sampling_params(d.settings.default_max_tokens)
    if session_id is None:
        UNRECORDED.inc()
        prompt = await asyncio.to_thread(d.renderer.prompt_ids, messages, body.tools)
        gens = await asyncio.gather(*[d.engines.generate(prompt, _nth(sampling, i))
                                      for i in range(body.n)])
        return _response(d, body, gens, len(prompt), [_parse(d, body, g) for g in gens])
    if body.n > 1:
        raise InvalidRequestError(
            "n > 1 is not recorded in a session yet: create one session per sample (same "
            "group_id) or send n > 1 without a session", param="n")
    return await _session_turn(d, body, session_id, messages, sampling)


def _nth(sampling: dict[str, Any], i: int) -> dict[str, Any]:
    """Sampling params of choice i: a given seed is offset so the n choices differ."""
    if i and "sampling_seed" in sampling:
        return {**sampling, "sampling_seed": (sampling["sampling_seed"] + i) % 2**63}
    return sampling


@asynccontextmanager
async def _locked(store: SessionStore, session_id: str) -> AsyncIterator[SessionRecord]:
    """Async form of `SessionStore.locked`: saved on normal exit, untouched on error."""
    lock = await asyncio.to_thread(store.acquire, session_id)
    try:
        record = await asyncio.to_thread(store.get, session_id)
        yield record
        await asyncio.to_thread(store.save, record)
    finally:
        await asyncio.to_thread(store.release, lock)


async def _session_turn(d: GatewayDeps, body: ChatCompletionRequest, session_id: str,
                        messages: list[dict[str, Any]], sampling: dict[str, Any]
                        ) -> dict[str, Any]:
    async with _locked(d.sessions, session_id) as record:
        if record.status != "open":
            raise ConflictError(f"session {session_id} is finished; create a new session")
        prompt, closed = await asyncio.to_thread(
            prepare_prompt, record, d.renderer, messages, body.tools)
        limit = d.context_length
        if len(prompt) + sampling["max_new_tokens"] > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling['max_new_tokens']}) "
                f"exceeds the context window of {limit} tokens; shorten the conversation or "
                "lower max_tokens", param="messages", code="context_length_exceeded")
        gen = await d.engines.generate(prompt, sampling, affinity=session_id)
        parsed = _parse(d, body, gen)
        record_generation(record, gen, sampling, parsed.message())
        # The closed segment is published only once the turn succeeded: a failed request leaves
        # the stored record (and so the segment) untouched, and a retry must not publish twice.
        if closed is not None and not record.eval:
            await asyncio.to_thread(_publish, d, record, build_sample(record, closed))
        return _response(d, body, [gen], len(prompt), [parsed])


def _parse(d: GatewayDeps, body: ChatCompletionRequest, gen: Generation) -> ParsedReply:
    offered = bool(body.tools) and body.tool_choice != "none"
    return parse_reply(gen.text, tools_offered=offered, tool_parser=d.settings.tool_parser)


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
        "model": body.model or d.settings.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion},
        "metadata": {"weight_version": str(max(gen.weight_version for gen in gens))},
    }


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
        toks = [d.renderer.tokenizer.decode([t]) for t in gen.output_ids]
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(toks, gen.output_logprobs, strict=True)]}
    return choice
