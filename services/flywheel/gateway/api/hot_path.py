"""The chat completion, Responses and Messages routes without FastAPI's routing and dependency
layers.

`POST /v1/chat/completions` and `/s/<id>/v1/chat/completions` are most of a gateway's traffic
(`POST /v1/responses`, `POST /v1/messages` and their `/s/<id>/` forms are served here the same
way; Messages errors are rewritten to Anthropic's JSON outside, messages_errors.py).
Through FastAPI each request pays for route matching, dependency solving, a `Request` object and
the exception middleware: more CPU than the chat template and tokenization together
(`bench/gateway.py`). This ASGI layer sits inside the security middleware (authentication,
limits and the body checks have run, and the body is parsed once there) and serves those two
routes with the same request models, the same handlers (chat.py, responses.py, messages.py)
and the same error bodies.

Whatever it cannot take as is goes to the FastAPI app, which answers it exactly as before: a
body that is not a JSON object, a media type other than `application/json` (none at all
included: FastAPI refuses that), a body that fails validation (FastAPI's error message names
the field). The FastAPI routes stay the documented API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError

from flywheel.core import http_errors
from flywheel.core.errors import PlatformError
from flywheel.gateway.access.security import JSON_BODY
from flywheel.gateway.api import chat, messages, responses
from flywheel.gateway.api.messages_schema import MessagesRequest
from flywheel.gateway.api.responses_schema import ResponsesRequest
from flywheel.gateway.api.schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
TAIL = "/v1/chat/completions"
MODELS: dict[str, type[ChatCompletionRequest | ResponsesRequest | MessagesRequest]] = {
    "chat/completions": ChatCompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
}
"""A hot route's request model by what follows the path's last `/v1/`."""
TAILS = {model: "/v1/" + last for last, model in MODELS.items()}
"""A hot route's path tail by its request model."""


def route(scope: Scope, tail: str = TAIL) -> tuple[bool, str | None]:
    """(is the hot route ending in `tail`, the session id of `/s/<id>/...` or None)."""
    if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
        return False, None
    path: str = scope["path"]
    if path == tail:
        return True, None
    if path.startswith("/s/") and path.endswith(tail):
        session_id = path[3 : -len(tail)]
        if session_id and "/" not in session_id:
            return True, session_id
    return False, None


def _headers(scope: Scope) -> dict[bytes, str]:
    out: dict[bytes, str] = {}
    for key, value in scope.get("headers", ()):
        if key in (b"content-type", b"x-session-id", b"x-turn-type") and key not in out:
            out[key] = value.decode("latin-1")
    return out


class HotPath:
    """ASGI middleware: serves the hot routes itself, passes everything else to `app`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], deps: GatewayDeps):
        self.app = app
        self.deps = deps
        self.responses = responses.store_for(deps)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = MODELS.get(scope.get("path", "")[-20:].rpartition("/v1/")[2])  # by its tail
        hot, session_id = (False, None) if model is None else route(scope, TAILS[model])
        if model is None or not hot:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(b"".join(chunks), message, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body_bytes = b"".join(chunks)
        replay = _replay(body_bytes, None, receive)
        headers = _headers(scope)
        ctype = headers.get(b"content-type", "").split(";")[0].strip().lower()
        data = scope.get("state", {}).get(JSON_BODY)
        if ctype != "application/json" or not isinstance(data, dict):
            await self.app(scope, replay, send)
            return
        try:
            body = model.model_validate(data)
        except ValidationError:
            await self.app(scope, replay, send)  # FastAPI's answer names the field
            return
        try:
            if isinstance(body, ResponsesRequest):
                response = await self._serve_responses(scope, body, session_id, headers, receive)
            elif isinstance(body, MessagesRequest):
                response = await messages.create_message(
                    self.deps,
                    body,
                    session_id,
                    None if session_id else headers.get(b"x-session-id"),
                    headers.get(b"x-turn-type"),
                    _owner(scope),
                    receive,
                )
            else:
                response = await self._serve(scope, body, session_id, headers, receive)
        except PlatformError as exc:
            response = http_errors.platform_error(exc)
        except redis.RedisError as exc:
            response = http_errors.redis_unavailable(exc)
        await response(scope, replay, send)

    async def _serve(
        self,
        scope: Scope,
        body: ChatCompletionRequest,
        session_id: str | None,
        headers: dict[bytes, str],
        receive: Receive,
    ) -> Any:
        return await chat.respond(
            self.deps,
            body,
            session_id,
            headers.get(b"x-session-id"),
            headers.get(b"x-turn-type"),
            _owner(scope),
            receive,
        )

    async def _serve_responses(
        self,
        scope: Scope,
        body: ResponsesRequest,
        session_id: str | None,
        headers: dict[bytes, str],
        receive: Receive,
    ) -> Any:
        return await responses.respond(
            self.deps,
            self.responses,
            body,
            _owner(scope),
            receive,
            session_id,
            None if session_id else headers.get(b"x-session-id"),
            headers.get(b"x-turn-type"),
        )


def _owner(scope: Scope) -> str:
    principal = scope.get("state", {}).get("principal")
    return principal.key_id if principal else ""


def _replay(body: bytes, then: dict[str, Any] | None, receive: Receive) -> Receive:
    """A receive that gives the already-read body once (then `then`, if given), then defers
    to the server's receive (disconnect notices)."""
    queue = [{"type": "http.request", "body": body, "more_body": False}]
    if then is not None:
        queue.append(then)

    async def replayed() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
