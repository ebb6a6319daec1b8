"""Sessions from what harnesses already send (docs/sessions.md, "Session keys").

Besides `X-Session-Id`, a request's live session may be named by

- one of the headers listed in `gateway.session_headers` (the first present, in list order),
  on every model route under `/v1/` (chat, completions, responses, messages): `SessionHeaders`
  copies its value into `X-Session-Id` before the route runs, so every API treats it alike;
- a Responses request's `prompt_cache_key` (with `gateway.session_from_prompt_cache_key`),
  when no header names one (responses.py).

A value that is not a valid session id (1-128 letters, digits and `_ . : -`) names the session
`k-` + the first 40 hex digits of its SHA-256, so any conversation id a harness sends works. A
header-named session belongs to the key of its first request, like an `X-Session-Id` one (the
turn checks it under the session lock: another key's session is a 404).
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from flywheel.core.settings import GatewaySettings
from flywheel.gateway.api.schemas import SESSION_ID_PATTERN

X_SESSION_ID = b"x-session-id"
NOT_KEYED = ("/v1/sessions", "/v1/admin", "/v1/models")
"""Paths under /v1/ whose requests are not turns (a session named there is the URL's)."""


def as_session_id(value: str) -> str:
    """`value` itself when it is a valid session id, else `k-` + 40 hex digits of its SHA-256.

    Example: "conv_1" -> "conv_1"; "a b" (space) -> "k-" + sha256(b"a b").hexdigest()[:40].
    """
    if SESSION_ID_PATTERN.fullmatch(value):
        return value
    return "k-" + hashlib.sha256(value.encode()).hexdigest()[:40]


def session_id_of(settings: GatewaySettings, prompt_cache_key: str | None) -> str | None:
    """The session a Responses `prompt_cache_key` names (None: none, or the rule is off)."""
    if not prompt_cache_key or not settings.session_from_prompt_cache_key:
        return None
    return as_session_id(prompt_cache_key)


class SessionHeaders:
    """ASGI middleware: a `/v1/...` POST without `X-Session-Id` that carries one of
    `gateway.session_headers` gets `X-Session-Id: as_session_id(its value)`.

    Runs inside the security middleware (a per-session key's request is already routed to
    `/s/<id>/...` then, and keeps its session)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings):
        self.app = app
        self.names = [name.lower().encode() for name in settings.session_headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.names and scope["type"] == "http" and _keyed(scope):
            scope = _with_session(scope, self.names)
        await self.app(scope, receive, send)


def _keyed(scope: Scope) -> bool:
    path: str = scope["path"]
    return scope["method"] == "POST" and path.startswith("/v1/") and not path.startswith(NOT_KEYED)


def _with_session(scope: Scope, names: list[bytes]) -> Scope:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    found: dict[bytes, bytes] = {}
    for key, value in headers:
        if key == X_SESSION_ID and value.strip():
            return scope  # the explicit header wins
        if key in names and key not in found and value.strip():
            found[key] = value.strip()
    for name in names:
        if name in found:
            session_id = as_session_id(found[name].decode("latin-1"))
            out: dict[str, Any] = dict(scope)
            out["headers"] = [*headers, (X_SESSION_ID, session_id.encode())]
            return out
    return scope
