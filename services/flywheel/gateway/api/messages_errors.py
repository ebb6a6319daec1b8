"""Anthropic's error JSON on the Messages routes: `{"type": "error", "error": {"type", "message"}}`.

The rest of the gateway answers errors in OpenAI's format (core/http_errors.py), from the
routes, FastAPI's validation and the security middleware (keys, limits, body checks) alike.
`AnthropicErrors`, the outermost middleware, rewrites those answers on the Messages paths
(`/v1/messages` and every path under it, and their `/s/<id>/` forms, the id read from the raw
path as the security middleware reads it: `messages_request`): same status, same
message, Anthropic's error type for the status (`error_type`). Every other path and every
successful answer passes through untouched (a stream's body is never read).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from flywheel.gateway.session.raw_path import raw_path_session

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

PATHS = ("/v1/messages", "/v1/messages/count_tokens")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (Anthropic's API reference, "Errors"): other
    4xx -> invalid_request_error, other 5xx -> api_error.
    Example: 404 -> "not_found_error", 409 -> "invalid_request_error", 502 -> "api_error"."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error body Anthropic's API answers with `status`."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def is_messages_path(path: str) -> bool:
    """`/v1/messages` or any path under it (`/v1/messages/count_tokens`; one the gateway does
    not serve, such as `/v1/messages/batches`, gets Anthropic's 404), also under
    `/s/<session id>`."""
    if path.startswith("/s/"):
        path = path[path.find("/", 3) :] if path.find("/", 3) > 0 else ""
    return path in PATHS or path.startswith("/v1/messages/")


def messages_request(scope: Scope) -> bool:
    """Whether a request's path is a Messages path (`is_messages_path`). A session id in the raw
    path is one segment however it is encoded: `/s/a%2Fb/v1/messages` (decoded `/s/a/b/v1/...`)
    is a Messages path under the session id "a/b", which the security middleware refuses."""
    if is_messages_path(scope["path"]):
        return True
    named = raw_path_session(scope)
    return named is not None and scope["path"].startswith("/s/") and is_messages_path(named[1])


def _message_of(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace") or "error"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(data, dict) and isinstance(data.get("detail"), str):
        return data["detail"]
    return json.dumps(data)


class AnthropicErrors:
    """Pure ASGI middleware: error answers on Messages paths in Anthropic's format."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not messages_request(scope):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    await send(message)
                    return
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            status = start["status"]
            body = json.dumps(anthropic_error(status, _message_of(b"".join(chunks)))).encode()
            headers = [
                (k, v)
                for k, v in start.get("headers", [])
                if k.lower() not in (b"content-length", b"content-type")
            ]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
