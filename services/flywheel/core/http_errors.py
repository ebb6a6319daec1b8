"""OpenAI-style error JSON for every FastAPI service: one handler set, installed by `install`.

Body: `{"error": {"message", "type", "param", "code"}}`; status from the PlatformError class,
400 for validation errors (as OpenAI and SGLang answer them), worded as OpenAI words them
(core/validation_messages.py; on the Messages routes a missing or unknown field as Anthropic
words it: "max_tokens: Field required").
"""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.core.errors import PlatformError, RetryLaterError
from flywheel.core.validation_messages import anthropic_message, openai_message

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 75
"""Seconds an idle keep-alive connection stays open on our HTTP servers. Longer than the idle
expiry of pooling clients (httpx, hence the openai SDK: 5 s), so a client never reuses a
connection the server is closing at that instant (a POST then fails with ECONNRESET and is not
retried); uvicorn's own default is also 5 s."""


MISSING_MODEL = "you must provide a model parameter"
"""OpenAI's message for a request body without `model` (400, param `model`)."""


def not_json(content_type: str) -> str:
    """The message for a body the route did not read as JSON because its `Content-Type` is not
    JSON (`curl -d` sends `application/x-www-form-urlencoded`): OpenAI's and Anthropic's APIs
    take JSON bodies only, sent as `application/json`."""
    given = f"'{content_type}'" if content_type else "missing"
    return (
        "the request body must be JSON, sent with the header `Content-Type: application/json` "
        f"(this request's Content-Type is {given})"
    )


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_WHERE = frozenset({"body", "query", "path"})
"""The part of the request FastAPI's error locations start with; OpenAI's `param` names the
parameter alone ("limit", not "query.limit")."""


def param_of(loc: tuple | list) -> str | None:
    """OpenAI's `param` for a pydantic error location: ("body", "messages", 0, "content",
    "str") -> "messages[0].content", ("query", "limit") -> "limit" (list indexes in brackets;
    the union-branch labels pydantic adds, such as "str" or "list[dict[str,any]]", left out);
    None for the body as a whole."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (part in _WHERE and not out) or "[" in str(part) or str(part).lower() in _TYPE_LABELS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(body: dict) -> bytes:
    """An error body as bytes, written as every `JSONResponse` here writes it (compact UTF-8
    JSON), for an ASGI middleware that answers without one."""
    return bytes(JSONResponse(body).body)


def redis_unavailable(exc: redis.RedisError) -> JSONResponse:
    """503 with Retry-After for a request that needed Redis while it is down."""
    log.error("Redis unavailable: %s", exc)
    return JSONResponse(
        error_body(
            "the session store (Redis) is unavailable; retry later", "service_unavailable_error"
        ),
        status_code=503,
        headers={"Retry-After": "5"},
    )


def platform_error(exc: PlatformError) -> JSONResponse:
    """The error response of a PlatformError (its status; Retry-After for backpressure and
    overload)."""
    headers = {}
    if isinstance(exc, RetryLaterError):
        headers["Retry-After"] = str(int(round(exc.retry_after_s)))
    if exc.http_status >= 500:
        log.error("request failed: %s", exc.message)
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code),
        status_code=exc.http_status,
        headers=headers,
    )


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""

    @app.exception_handler(PlatformError)
    async def _platform(_: Request, exc: PlatformError) -> JSONResponse:
        return platform_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            where = first.get("loc", ("body", "?"))[-1]
            return JSONResponse(
                error_body(
                    f"the request body is not valid JSON (error at character {where})",
                    "invalid_request_error",
                ),
                status_code=400,
            )
        if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes):
            # FastAPI hands the raw bytes to the model when the media type is not JSON
            ctype = request.headers.get("content-type", "")
            return JSONResponse(
                error_body(not_json(ctype), "invalid_request_error"), status_code=400
            )
        param = param_of(first.get("loc", ()))
        if "/v1/messages" in request.url.path:  # "max_tokens: Field required", as Anthropic
            message = anthropic_message(first, param)
        elif param == "model" and first.get("type") == "missing":
            message = MISSING_MODEL
        else:
            message = openai_message(first, param)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(redis.RedisError)
    async def _redis(_: Request, exc: redis.RedisError) -> JSONResponse:
        return redis_unavailable(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Errors raised in middleware (auth, limits) reach only this handler.
        if isinstance(exc, redis.RedisError):
            return redis_unavailable(exc)
        log.exception("unhandled error")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)
