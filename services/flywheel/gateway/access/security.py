"""Gateway access control and request limits: API keys, roles, session scoping, size/rate limits.

`install(app, deps)` adds one ASGI middleware and the key-management routes. For every request
the middleware, before any route runs:

1. authenticates the bearer key (`Authorization: Bearer <key>`), or serves everyone as the local
   admin when authentication is off (`SecuritySettings.auth`; logged loudly);
2. authorizes by path: health is public; control paths (`/v1/admin/...`, `/dashboard...`, and
   `/metrics` when `metrics_require_admin`) need `admin`; a session named by URL
   (`/s/<id>/...`, `/v1/sessions/<id>...`) or by `X-Session-Id` must belong to the key (admin:
   any); a per-session key is routed to its own session and can do nothing else;
3. applies per-key rate (token bucket) and concurrency limits (429 with Retry-After), shared
   by every gateway replica through Redis (`flywheel.gateway.access.limits`);
4. bounds the body (413), checks UTF-8, JSON nesting depth and chat-request shape (messages,
   tools, tool-schema bytes), answering in OpenAI error JSON;
5. bounds the whole request in time (504).

A session owned by another key, or created without a key (no owner: only admin keys use it), is
answered exactly like a missing one (404, `not_for_this_key`, whose message names all three
cases), so keys cannot probe which session ids exist. Routes use `require_role("admin")` as a
dependency for their own checks (e.g. the dashboard):
`dependencies=[Depends(require_role("admin"))]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from fastapi import FastAPI
from prometheus_client import Counter

from flywheel.core.auth import KeyRecord, KeyStore, hash_key
from flywheel.core.errors import (
    AuthenticationError,
    BackpressureError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    PlatformError,
)
from flywheel.core.http_errors import error_body, error_json, redis_unavailable
from flywheel.core.settings import SecuritySettings, is_loopback
from flywheel.gateway.access.keys import router as key_routes
from flywheel.gateway.access.limits import Lease, RedisLimiter
from flywheel.gateway.access.principal import ANONYMOUS, LOCAL_ADMIN, Principal
from flywheel.gateway.api.schemas import SESSION_ID_PATTERN
from flywheel.gateway.session.owner import REQUEST_OWNER, REQUEST_TRAIN, not_for_this_key
from flywheel.gateway.session.raw_path import raw_path_session
from flywheel.gateway.session.store import SessionStore

log = logging.getLogger(__name__)
REJECTED = Counter(
    "flywheel_gateway_rejected_requests_total",
    "Requests refused before reaching a route",
    ["reason"],
)

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
"""Served to anyone, without a key lookup: `/healthz` answers even while Redis is down."""
ADMIN_PREFIXES = ("/v1/admin", "/dashboard", "/admin")
SESSION_KEY_DENIED = ("/v1/sessions", "/v1/admin")
JSON_BODY = "json_body"
"""Request state key: the JSON object body as this middleware parsed it (read by hot_path.py)."""

ASGIApp = Callable[
    [dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]
]


class TooLargeError(PlatformError, ValueError):
    http_status = 413
    error_type = "invalid_request_error"


class TimeoutError_(PlatformError, TimeoutError):
    http_status = 504
    error_type = "timeout_error"


class SecurityMiddleware:
    """Pure ASGI middleware (streams pass through untouched); see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyStore,
        sessions: SessionStore,
        settings: SecuritySettings,
        bind_host: str,
    ):
        self.app = app
        self.keys = keys
        self.sessions = sessions
        self.settings = settings
        self.loopback = is_loopback(bind_host)
        self.limiter = RedisLimiter(sessions.client, sessions.prefix, settings)
        self._key_cache: dict[str, tuple[KeyRecord | None, float]] = {}
        self._required: tuple[bool, float] = (False, 0.0)
        self._announced: bool | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lease: Lease | None = None
        try:
            try:
                who = await self._authenticate(scope)
                _check_path_session(scope)
                scope = await self._authorize(scope, who)
                if self.limiter.enabled and scope["path"] not in PUBLIC_PATHS:
                    lease = await self._admit(who)
                receive = await self._checked_body(scope, receive)
            except PlatformError as exc:
                await _send_error(send, exc)
                return
            except redis.RedisError as exc:  # keys or limits unreadable: 503, as routes answer
                await redis_unavailable(exc)(scope, receive, send)
                return
            scope.setdefault("state", {})["principal"] = who
            REQUEST_OWNER.set(who.key_id if who.role == "agent" else None)
            REQUEST_TRAIN.set(who.train)
            await self._run(scope, receive, send)
        finally:
            await self.limiter.give_back(lease)

    async def _admit(self, who: Principal) -> Lease | None:
        try:
            return await self.limiter.acquire(who.limit_id)
        except PlatformError:
            REJECTED.labels("rate_limited").inc()
            raise

    async def _run(self, scope: dict, receive: Callable, send: Callable) -> None:
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        limit = self.settings.request_timeout_s
        try:
            async with asyncio.timeout(limit or None):
                await self.app(scope, receive, tracking_send)
        except TimeoutError:
            if started:
                raise
            REJECTED.labels("timeout").inc()
            await _send_error(
                send,
                TimeoutError_(
                    f"the request took longer than {limit:g} s and was stopped; retry, or ask for "
                    "fewer tokens",
                    code="timeout",
                ),
            )

    # -- authentication -------------------------------------------------------------------

    async def _auth_required(self) -> bool:
        mode = self.settings.auth
        if mode != "auto":
            required = mode == "on"
        elif not self.loopback:
            required = True
        else:
            cached, until = self._required
            if time.monotonic() < until:
                return cached
            required = await asyncio.to_thread(self.keys.any_keys)
            self._required = (required, time.monotonic() + self.settings.key_cache_s)
        if required is not self._announced:
            self._announced = required
            if required:
                log.info("API keys required (gateway.security.auth=%s)", mode)
            else:
                (log.error if not self.loopback else log.warning)(
                    "AUTHENTICATION IS OFF: every client is served as admin (auth=%s, "
                    "loopback=%s, no API keys). Create one with `flywheel keys create --role "
                    'admin` or set gateway.security.auth = "on".',
                    mode,
                    self.loopback,
                )
        return required

    async def _lookup(self, secret: str) -> KeyRecord | None:
        now = time.monotonic()
        digest = hash_key(secret)  # the cache, like Redis, never holds the secret itself
        hit = self._key_cache.get(digest)
        if hit is not None and now < hit[1]:
            return hit[0]
        record = await asyncio.to_thread(self.keys.verify, secret)
        if len(self._key_cache) > 10_000:
            self._key_cache.clear()
        self._key_cache[digest] = (record, now + self.settings.key_cache_s)
        return record

    async def _authenticate(self, scope: dict) -> Principal:
        if scope["path"] in PUBLIC_PATHS:  # probes need no key, so no key lookup (no Redis)
            return ANONYMOUS
        secret = _bearer(scope)
        required = await self._auth_required()
        if not required and not secret.startswith(("fwk-", "fws-")):
            return LOCAL_ADMIN
        record = await self._lookup(secret) if secret else None
        if not required:
            # Session keys still route to their session; other keys change nothing.
            return Principal.of(record) if record and record.role == "session" else LOCAL_ADMIN
        if record is not None:
            return Principal.of(record)
        if scope["path"] == "/metrics" and not self.settings.metrics_require_admin:
            return ANONYMOUS
        REJECTED.labels("unauthenticated").inc()
        raise AuthenticationError(
            "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` (create "
            "keys with `flywheel keys create`)"
            if not secret
            else "invalid or revoked API key",
            code="invalid_api_key",
        )

    # -- authorization --------------------------------------------------------------------

    async def _authorize(self, scope: dict, who: Principal) -> dict:
        path = scope["path"]
        if path in PUBLIC_PATHS:
            return scope
        if path.startswith(ADMIN_PREFIXES) or (
            path == "/metrics" and self.settings.metrics_require_admin
        ):
            if who.role != "admin":
                REJECTED.labels("forbidden").inc()
                raise PermissionDeniedError(f"{path} needs an admin key")
            return scope
        if who.role == "session":
            return self._route_session_key(scope, who)
        header = _header(scope, b"x-session-id").strip()
        named = _named_sessions(scope)
        for session_id in named:
            # only a session named by the header alone is created by the route (live chat)
            await self._check_owner(
                session_id, who, may_create=session_id == header and named.count(session_id) == 1
            )
        return scope

    def _route_session_key(self, scope: dict, who: Principal) -> dict:
        """A session key reaches only its session; `/v1/...` is rewritten to `/s/<id>/v1/...`."""
        path = scope["path"]
        if path.startswith(SESSION_KEY_DENIED):
            REJECTED.labels("forbidden").inc()
            raise PermissionDeniedError(
                "a session key can only chat in its own session; "
                "use an agent key to create, read or finish sessions"
            )
        foreign = [sid for sid in _named_sessions(scope) if sid != who.session_id]
        if foreign:
            REJECTED.labels("foreign_session").inc()
            raise not_for_this_key(foreign[0])
        if path.startswith("/v1/"):
            scope = dict(scope)
            scope["path"] = f"/s/{who.session_id}{path}"
            scope["raw_path"] = scope["path"].encode()
        return scope

    async def _check_owner(self, session_id: str, who: Principal, may_create: bool) -> None:
        """A non-admin key may use only its own sessions; another key's session is answered
        like a missing one. `may_create`: a missing session named by `X-Session-Id` passes (the
        route creates it in live mode, owned by this key)."""
        if who.role == "admin":
            return
        try:
            owner = await self.sessions.aowner(session_id)
        except NotFoundError:
            if may_create:
                return
            raise not_for_this_key(session_id) from None
        if owner != who.key_id:
            REJECTED.labels("foreign_session").inc()
            log.warning(
                "key %s refused access to session %s of %s",
                who.key_id,
                session_id,
                "another key" if owner else "no key (created without authentication)",
            )
            raise not_for_this_key(session_id)

    # -- body limits ----------------------------------------------------------------------

    async def _checked_body(self, scope: dict, receive: Callable) -> Callable:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive
        limit = self.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _too_large(size, limit)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body:
            parsed = self._check_json(scope["path"], body)
            if isinstance(parsed, dict):  # the hot path (hot_path.py) validates it as is
                scope.setdefault("state", {})[JSON_BODY] = parsed
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def _check_json(self, path: str, body: bytes) -> Any:
        """The parsed body (None when it is not JSON: the route's parser answers that).

        Raises:
            InvalidRequestError: not UTF-8, nested too deep, or over the chat limits.
        """
        try:  # utf-8-sig: a leading BOM is skipped, as the route's JSON parser skips it
            text = body.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            REJECTED.labels("bad_body").inc()
            raise InvalidRequestError(
                f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
            ) from None
        try:
            data = json.loads(text)
        except RecursionError:
            data = None
            depth = math.inf
        except ValueError:
            return None  # the route's parser answers with the position of the JSON error
        else:
            depth = _scan(data, self.settings.max_json_depth)
        if depth > self.settings.max_json_depth:
            REJECTED.labels("bad_body").inc()
            raise InvalidRequestError(
                f"the JSON body nests deeper than {self.settings.max_json_depth} levels",
                code="json_too_deep",
            )
        if isinstance(data, dict) and path.endswith(
            ("/chat/completions", "/responses", "/v1/messages", "/v1/messages/count_tokens")
        ):
            self._check_chat(data, "input" if path.endswith("/responses") else "messages")
        return data

    def _check_chat(self, data: dict[str, Any], field: str = "messages") -> None:
        """Chat limits on `field` (chat `messages`, Responses `input` items) and `tools`."""
        s = self.settings
        messages, tools = data.get(field), data.get("tools")
        if isinstance(messages, list) and len(messages) > s.max_messages:
            raise InvalidRequestError(
                f"{len(messages)} {'messages' if field == 'messages' else 'input items'}; at "
                f"most {s.max_messages} per request",
                param=field,
                code="too_many_messages",
            )
        if isinstance(tools, list):
            if len(tools) > s.max_tools:
                raise InvalidRequestError(
                    f"{len(tools)} tools; at most {s.max_tools} per request",
                    param="tools",
                    code="too_many_tools",
                )
            size = len(json.dumps(tools, separators=(",", ":")).encode())
            if size > s.max_tools_bytes:
                raise InvalidRequestError(
                    f"tool definitions take {size} bytes; at most {s.max_tools_bytes}",
                    param="tools",
                    code="tools_too_large",
                )


def _scan(data: Any, cap: int) -> int:
    """Nesting depth of arrays/objects in `data` (a scalar is 0), counted up to `cap` + 1.

    Raises:
        InvalidRequestError: a string holds an unpaired UTF-16 surrogate (`"\\ud800"`), which
            is valid JSON but no text: the tokenizer cannot encode it; or a number is not finite
            (Python's json reads `NaN`, `Infinity` and `1e999`, which JSON does not have: stored
            records would turn them into null).
    """
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > cap:
            return deepest
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, level + 1))
            elif isinstance(child, str):
                try:
                    child.encode("utf-8")
                except UnicodeEncodeError:
                    REJECTED.labels("bad_body").inc()
                    raise InvalidRequestError(
                        "a string in the body holds an unpaired UTF-16 surrogate escape "
                        "(e.g. \\ud800); send valid Unicode text",
                        code="invalid_encoding",
                    ) from None
            elif isinstance(child, float) and not math.isfinite(child):
                REJECTED.labels("bad_body").inc()
                raise InvalidRequestError(
                    "the body holds a number that is not finite (NaN, Infinity or one beyond "
                    "a double's range); JSON numbers must be finite",
                    code="invalid_number",
                )
    return deepest


def _too_large(size: int, limit: int) -> TooLargeError:
    REJECTED.labels("too_large").inc()
    return TooLargeError(
        f"the request body has {size} bytes; at most {limit} are accepted", code="request_too_large"
    )


def _header(scope: dict, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


def _bearer(scope: dict) -> str:
    value = _header(scope, b"authorization")
    if value[:7].lower() == "bearer ":
        return value[7:].strip()
    return _header(scope, b"x-api-key").strip()


def _check_path_session(scope: dict) -> None:
    """Refuse a session id in the URL (`/s/<id>/...`, `/v1/sessions/<id>...`) that is not one:
    read from the raw path, so `a%2Fb` is the id "a/b" (refused), not the session "a" with
    "/b" after it, as the decoded path would have it.

    Raises:
        InvalidRequestError: 400 (param `session_id`): not 1-128 letters, digits and `_ . : -`.
    """
    named = raw_path_session(scope)
    if named is None:
        return  # no session in the URL, or the decoded path is the raw one
    session_id = named[0]
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        REJECTED.labels("bad_session_id").inc()
        raise InvalidRequestError(
            f"invalid session id {session_id!r}: a session id is 1-128 characters of letters, "
            "digits and _ . : -",
            param="session_id",
            code="invalid_session_id",
        )


def _named_sessions(scope: dict) -> list[str]:
    """Session ids a request names: URL `/s/<id>/...`, `/v1/sessions/<id>...`, `X-Session-Id`."""
    parts = scope["path"].split("/")
    found = []
    if len(parts) > 2 and parts[1] == "s":
        found.append(parts[2])
    elif len(parts) > 3 and parts[1] == "v1" and parts[2] == "sessions" and parts[3]:
        found.append(parts[3])
    header = _header(scope, b"x-session-id").strip()
    if header:
        found.append(header)
    return found


async def _send_error(send: Callable, exc: PlatformError) -> None:
    body = error_json(error_body(exc.message, exc.error_type, exc.param, exc.code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if isinstance(exc, BackpressureError):
        headers.append((b"retry-after", str(max(1, math.ceil(exc.retry_after_s))).encode()))
    if isinstance(exc, AuthenticationError):
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install(app: FastAPI, deps: Any) -> None:
    """Add the security middleware and key routes to the gateway app built from `deps`
    (a GatewayDeps: `settings` with `.security` and `.host`, `sessions` a SessionStore)."""
    store = KeyStore(deps.sessions.client, deps.sessions.prefix)
    app.state.key_store = store
    app.include_router(key_routes)
    app.add_middleware(
        SecurityMiddleware,
        keys=store,
        sessions=deps.sessions,
        settings=deps.settings.security,
        bind_host=deps.settings.host,
    )
