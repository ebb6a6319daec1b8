"""HTTP surface of the embedded engine: SGLang's native routes with SGLang's shapes.

`create_app(deps)` builds the FastAPI app around an `EngineLike` (the worker, or a fake in
tests). Routes: /generate (also PUT; `stream` = SSE with cumulative chunks, one per sampled
token), /update_weights_from_disk, /update_weight_version, /pause_generation,
/continue_generation, /abort_request, /flush_cache, /get_weights_by_name, /health,
/health_generate, /ready, /model_info (+ /get_model_info), /server_info (+ /get_server_info),
/healthz (liveness) and /metrics (Prometheus); the /v1 OpenAI routes (openai_routes.py), the
distributed weight-update routes (weight_routes.py) and /update_weights_from_delta (deltas.py).

Errors: a /generate body that fails schema validation (unknown sampling key, wrong type) answers
400 `{"error": "<text>"}` like SGLang's 0.5.22+ contract gate; every other error answers
`{"error": {"message": "..."}}` with the error's status. Control routes need a JSON body (a bodyless
POST is a 400, as in SGLang).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError

import flywheel
from flywheel.core.errors import PlatformError
from flywheel.core.settings import EngineSettings
from flywheel.engine.deltas import register_delta_routes
from flywheel.engine.metrics import EngineMetrics
from flywheel.engine.openai_routes import register_openai_routes
from flywheel.engine.protocol import (
    AbortRequest,
    GenerateRequest,
    RowSpec,
    UpdateWeightsFromDiskRequest,
    dumps,
    expand_generate,
    validation_message,
)
from flywheel.engine.sequence import Job
from flywheel.engine.weight_routes import register_weight_routes

_M = TypeVar("_M", bound=BaseModel)
DISCONNECT_POLL_S = 1.0
"""Seconds between checks for a client that went away while its rows decode."""

FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class EngineLike(Protocol):
    status: str
    weight_version: str
    metrics: EngineMetrics

    @property
    def paused(self) -> bool: ...
    def pause(self, mode: str = "abort") -> None: ...
    def resume(self) -> None: ...

    @property
    def tokenizer(self) -> Any: ...
    @property
    def generation_defaults(self) -> dict[str, Any]: ...

    def submit(
        self,
        specs: list[RowSpec],
        *,
        probe: bool = False,
        listeners: list[Callable[[dict[str, Any]], None]] | None = None,
    ) -> list[Job]: ...
    def abort(self, rid: str, abort_all: bool = False) -> int: ...
    def probe(self) -> bool: ...
    def set_weight_version(self, version: str) -> None: ...
    def model_info(self) -> dict[str, Any]: ...
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]: ...
    @property
    def weights(self) -> Any: ...
    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> tuple[bool, str]: ...


@dataclass
class EngineDeps:
    engine: EngineLike
    settings: EngineSettings
    model_path: Path
    """Resolved model folder (settings.model_path may be empty = the default model)."""


def get_deps(request: Request) -> EngineDeps:
    return request.app.state.deps  # type: ignore[no-any-return]  # set by create_app


async def _deps(request: Request) -> EngineDeps:
    """`get_deps` as a FastAPI dependency (async: a sync one runs in a worker thread)."""
    return get_deps(request)


Deps = Annotated[EngineDeps, Depends(_deps)]


class _BadRequest(Exception):
    def __init__(self, message: str, *, contract: bool = False):
        super().__init__(message)
        self.message = message
        self.contract = contract


class GetWeightsRequest(BaseModel):
    name: str
    truncate_size: int = Field(100, ge=1)


class PauseRequest(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionRequest(BaseModel):
    new_version: str
    abort_all_requests: bool = True


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    return _json({"error": {"message": message}}, status)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise _BadRequest("a JSON body is required (send {} at minimum)")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _BadRequest(f"invalid JSON body: {e}") from e
    if not isinstance(data, dict):
        raise _BadRequest("the JSON body must be an object")
    return data


def create_app(deps: EngineDeps) -> FastAPI:
    app = FastAPI(  # no Host-built redirect for a trailing slash: a 404
        title="flywheel engine", version=flywheel_version(), redirect_slashes=False
    )
    app.state.deps = deps

    @app.exception_handler(_BadRequest)
    async def bad_request(_: Request, exc: _BadRequest) -> Response:
        return _json({"error": exc.message}, 400) if exc.contract else _error(exc.message)

    @app.exception_handler(PlatformError)
    async def platform_error(_: Request, exc: PlatformError) -> Response:
        return _error(exc.message, exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return _error(validation_message(exc))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request, d: Deps) -> Response:
        t0 = time.perf_counter()
        try:
            req = GenerateRequest.model_validate(await _body(request))
            specs, is_batch = expand_generate(req)
        except ValidationError as e:
            raise _BadRequest(validation_message(e), contract=True) from e
        if req.stream:
            rows = open_stream(request, d.engine, specs)
            return StreamingResponse(_sse(rows, is_batch), media_type="text/event-stream")
        jobs = d.engine.submit(specs)
        results = await _wait(request, jobs)
        latency = time.perf_counter() - t0
        for r in results:
            r["meta_info"]["e2e_latency"] = latency
        return _json(results if is_batch else results[0])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request, d: Deps) -> Response:
        req = _parse(UpdateWeightsFromDiskRequest, await _body(request))
        ok, message = await asyncio.to_thread(
            d.engine.update_weights_from_disk,
            req.model_path,
            req.weight_version,
            abort_all_requests=req.abort_all_requests,
            load_format=req.load_format,
        )
        body = {"success": ok, "message": message, "num_paused_requests": 0}
        return _json(body, 200 if ok else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request, d: Deps) -> Response:
        req = _parse(UpdateWeightVersionRequest, await _body(request))
        if req.abort_all_requests:
            d.engine.abort("", abort_all=True)
        await asyncio.to_thread(d.engine.set_weight_version, req.new_version)
        message = f"Weight version updated to {req.new_version}"
        return _json({"success": True, "message": message, "new_version": req.new_version})

    @app.post("/pause_generation")
    async def pause_generation(request: Request, d: Deps) -> Response:
        req = _parse(PauseRequest, await _body(request))
        await asyncio.to_thread(d.engine.pause, req.mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request, d: Deps) -> Response:
        await _body(request)
        d.engine.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request, d: Deps) -> Response:
        req = _parse(GetWeightsRequest, await _body(request))
        try:
            values = await asyncio.to_thread(
                d.engine.get_weights_by_name, req.name, req.truncate_size
            )
        except KeyError:
            return _error("Get parameter by name failed")
        return _json(values)

    @app.post("/abort_request")
    async def abort_request(request: Request, d: Deps) -> Response:
        req = _parse(AbortRequest, await _body(request))
        d.engine.abort(req.rid, abort_all=req.abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return PlainTextResponse(FLUSH_MESSAGE)  # no prefix cache: nothing to flush

    @app.get("/health")
    @app.get("/health_generate")
    async def health(d: Deps) -> Response:
        if d.engine.status != "ready":
            return Response(status_code=503)
        ok = await asyncio.to_thread(d.engine.probe)
        return Response(status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready(d: Deps) -> Response:
        ok = d.engine.status == "ready" and not d.engine.paused
        return Response(status_code=200 if ok else 503)

    @app.get("/healthz")
    async def healthz(d: Deps) -> Response:
        """Liveness: 200 while loading or serving, 503 once loading the model failed."""
        return _json({"status": d.engine.status}, 503 if d.engine.status == "failed" else 200)

    @app.get("/metrics")
    async def metrics(d: Deps) -> Response:
        return Response(d.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(d: Deps) -> Response:
        return _json(model_info_body(d))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(d: Deps) -> Response:
        return _json(server_info_body(d))

    register_openai_routes(app, _wait, open_stream)
    register_weight_routes(app, _body, _parse)
    register_delta_routes(app, _body, _parse)
    return app


def open_stream(
    request: Request, engine: EngineLike, specs: list[RowSpec]
) -> AsyncIterator[tuple[int, dict[str, Any], bool]]:
    """Submit rows for streaming (errors raise here, before any byte is sent) and return an
    iterator of `(row index, cumulative response, final)`: one item per sampled token of each
    row, then the row's final response (with e2e_latency). A disconnect aborts the rows."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[int, Any, bool]] = asyncio.Queue()

    def listener(i: int) -> Callable[[dict[str, Any]], None]:
        def update(result: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, (i, result, False))

        return update

    def finished(i: int) -> Callable[[Future[dict[str, Any]]], None]:
        def done(future: Future[dict[str, Any]]) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, (i, future, True))

        return done

    t0 = time.perf_counter()
    jobs = engine.submit(specs, listeners=[listener(i) for i in range(len(specs))])
    for i, job in enumerate(jobs):
        job.future.add_done_callback(finished(i))
    return _stream_items(request, jobs, updates, t0)


async def _stream_items(
    request: Request,
    jobs: list[Job],
    updates: asyncio.Queue[tuple[int, Any, bool]],
    t0: float,
) -> AsyncIterator[tuple[int, dict[str, Any], bool]]:
    left = len(jobs)
    try:
        while left:
            try:
                i, item, final = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if final:
                left -= 1
                result = item.result()  # raises the row's error (PlatformError -> error chunk)
                result["meta_info"]["e2e_latency"] = time.perf_counter() - t0
                yield i, result, True
            elif _before_final(jobs[i], item) and _on_interval(jobs[i], item):
                yield i, item, False
    finally:
        if left:  # client went away or the consumer stopped early: abort the rest
            for job in jobs:
                job.aborted = True


def _on_interval(job: Job, item: dict[str, Any]) -> bool:
    """SGLang's `stream_interval` sampling param: a chunk every that many sampled tokens (the
    final chunk always comes)."""
    interval = job.spec.params.stream_interval or 1
    return item["meta_info"]["completion_tokens"] % interval == 0


def _before_final(job: Job, item: dict[str, Any]) -> bool:
    """Whether a per-token update still precedes the row's final response: always while the
    row runs; once it finished (a loaded event loop may read several queued updates after that),
    every update shorter than the final one, so the stream keeps one chunk per sampled token
    and the last token is sent once, in the final chunk."""
    future = job.future
    if not future.done():
        return True
    if future.cancelled() or future.exception() is not None:
        return False
    final = future.result()["meta_info"]["completion_tokens"]
    return item["meta_info"]["completion_tokens"] < final


async def _wait(request: Request, jobs: list[Job]) -> list[dict[str, Any]]:
    """Results of `jobs`; a client that disconnects aborts them (as SGLang does)."""
    gathered = asyncio.gather(*(asyncio.wrap_future(j.future) for j in jobs))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                for job in jobs:
                    job.aborted = True
                return await gathered
    except BaseException:  # cancelled, or a row was rejected: stop the rest of the batch
        for job in jobs:
            job.aborted = True
        raise


def _parse(model: type[_M], data: dict[str, Any]) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _BadRequest(validation_message(e)) from e


async def _sse(
    rows: AsyncIterator[tuple[int, dict[str, Any], bool]], is_batch: bool
) -> AsyncIterator[bytes]:
    """SGLang /generate streaming: one cumulative chunk per sampled token (text, output_ids and
    logprob arrays so far, finish_reason null), the final chunk, then [DONE]. Batch chunks
    carry "index". A row error becomes an error chunk, then [DONE]."""
    try:
        async for i, result, _final in rows:
            chunk = {**result, "index": i} if is_batch else result
            yield b"data: " + dumps(chunk) + b"\n\n"
    except PlatformError as e:
        error = {"message": e.message, "type": e.error_type, "code": e.http_status}
        yield b"data: " + dumps({"error": {**error, "retryable": False}}) + b"\n\n"
    except Exception as e:  # a failed decode step: tell the client instead of cutting the stream
        error = {"message": f"{type(e).__name__}: {e}", "type": "server_error", "code": 500}
        yield b"data: " + dumps({"error": {**error, "retryable": True}}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def flywheel_version() -> str:
    try:
        from importlib.metadata import version

        return version("flywheel")
    except Exception:  # not installed as a distribution (plain source checkout)
        return getattr(flywheel, "__version__", "0.0.0")


def model_info_body(d: EngineDeps) -> dict[str, Any]:
    return {
        "model_path": str(d.model_path),
        "tokenizer_path": str(d.model_path),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": d.engine.weight_version,
        "served_model_name": d.settings.served_model_name,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "load_format": "safetensors",
        **d.engine.model_info(),
    }


def server_info_body(d: EngineDeps) -> dict[str, Any]:
    s = d.settings
    return {
        **s.model_dump(mode="json"),
        **model_info_body(d),
        "status": d.engine.status,
        "tp_size": s.emulate_tp_size,  # the ranks it joins a weight-update group with
        "dp_size": 1,
        "max_running_requests": s.max_batch_size,
        "max_num_reqs": s.max_batch_size,
        "max_prefill_tokens": s.context_length * s.max_batch_size,
        "max_total_num_tokens": s.context_length * s.max_batch_size,
        "max_req_input_len": s.context_length - 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "internal_states": [{}],
        "frontend": "python",
        "version": flywheel_version(),
    }
