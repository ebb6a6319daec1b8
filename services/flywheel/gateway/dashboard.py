"""The gateway's web dashboard at /dashboard (admin only): live reward, loss and KL curves, the
recent Samples with their tokens colored by loss mask and advantage, judge verdicts and hints.

Plain HTML + one JS file (gateway/static/), fed by JSON endpoints:

- `GET /dashboard/api/curves?since=N`: per-step series from the trainer's metrics JSONL
  (`trainer.logging.metrics_path`, shared with the gateway on the same machine or volume).
- `GET /dashboard/api/samples?limit=N`: the newest scored Samples (the trainer's input stream;
  the rollouts stream when nothing was scored yet), decoded token by token.
- `GET /dashboard/api/streams`: length, lag and pending of every stream and consumer group.

Access: the security middleware lets only admin keys reach /dashboard*. Browsers cannot send a
bearer header on navigation, so an outer middleware (`DashboardLogin`) answers the page's 401 or
403 with a small key form (saying why: the key is not valid, or not an admin key), checks the
key from `POST /dashboard/login` and opens a login (`DashboardSessions`, in Redis with a TTL):
the HttpOnly, SameSite=Strict cookie scoped to /dashboard (Secure over https) holds a random
token, never the key. For /dashboard requests the token is turned back into
`Authorization: Bearer`, so a revoked key ends its logins; `POST /dashboard/logout` deletes
the login. With authentication off (a loopback gateway with no keys) the page opens
directly. `install()` also registers the stream gauges
(flywheel.core.stream_stats.StreamStatsCollector) on the gateway's /metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import logging
import math
import secrets
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import redis
from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.responses import HTMLResponse, Response
from prometheus_client import REGISTRY

from flywheel.core.auth import KeyStore, hash_key
from flywheel.core.codec import decode_sample
from flywheel.core.errors import ContractError
from flywheel.core.http_errors import redis_unavailable
from flywheel.core.settings import FlywheelSettings, StreamSettings, load_settings
from flywheel.core.stream_stats import StreamStatsCollector, stream_stats
from flywheel.core.streams import FIELD
from flywheel.gateway.access.principal import require_role

log = logging.getLogger(__name__)

COOKIE = "flywheel_dashboard_session"
"""Holds a random login token (`DashboardSessions`), never the key."""
LOGIN_TTL_S = 8 * 3600
"""How long a dashboard login lasts (in Redis and in the browser)."""
CURVE_PREFIXES = ("reward/mean", "reward/std", "loss/", "kl/", "entropy/mean")
"""Trainer metrics (JSONL keys) the curves endpoint returns."""
CONTEXT_TOKENS = 48
"""Context tokens shown before a Sample's first sampled token."""
MAX_TOKENS = 1024
"""Tokens shown per Sample (the rest are counted in `omitted`)."""
STD_FLOOR = 1e-3
"""Group reward std below this is treated as 0 (advantages 0), as the trainer does."""

_collector: StreamStatsCollector | None = None


# ---------------------------------------------------------------- data


def group_advantages(groups: Sequence[str], rewards: Sequence[float | None]) -> list[float | None]:
    """GRPO advantages of the Samples shown, for coloring: A_i = (r_i - mean_g) / std_g over the
    Samples of the same group that have a reward (population std; 0 when std < STD_FLOOR or the
    group has one member; None without a reward). Shao et al. 2024 (DeepSeekMath), eq. 3.

    Example: rewards (1, 0) in one group: mean 0.5, std 0.5 -> A = (1, -1).
    """
    by_group: dict[str, list[float]] = defaultdict(list)
    for g, r in zip(groups, rewards, strict=True):
        if r is not None:
            by_group[g].append(r)
    out: list[float | None] = []
    for g, r in zip(groups, rewards, strict=True):
        values = by_group[g]
        if r is None:
            out.append(None)
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        out.append(0.0 if std < STD_FLOOR else (r - mean) / std)
    return out


def read_curves(path: Path | None, since: int = 0, max_lines: int = 5000) -> dict[str, Any]:
    """Per-step series from the trainer's JSONL (steps > `since`; skipped steps left out).

    Returns: {"steps": [int], "series": {metric: [float | None]}, "source": str}.
    """
    if path is None or not path.is_file():
        return {"steps": [], "series": {}, "source": str(path or ""), "missing": True}
    with path.open() as f:
        lines = deque(f, maxlen=max_lines)
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if row.get("step", 0) > since and not row.get("skip_reason"):
            rows.append(row)
    keys = sorted(
        {
            k
            for row in rows
            for k, v in row.items()
            if k.startswith(CURVE_PREFIXES) and isinstance(v, int | float)
        }
    )
    series = {k: [_num(row.get(k)) for row in rows] for k in keys}
    return {"steps": [row["step"] for row in rows], "series": series, "source": str(path)}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class DashboardData:
    """Reads what the dashboard shows. `decode(ids)` = one text piece per token id."""

    def __init__(
        self,
        client: Any,
        streams: StreamSettings,
        metrics_path: Path | None,
        decode: Callable[[list[int]], list[str]],
    ):
        self.client = client
        self.streams = streams
        self.metrics_path = metrics_path
        self.decode = decode

    def samples(self, limit: int) -> dict[str, Any]:
        source = self.streams.key("train")
        entries = self.client.xrevrange(source, count=max(limit * 4, 32))
        if not entries:
            source = self.streams.key("rollouts")
            entries = self.client.xrevrange(source, count=max(limit * 4, 32))
        samples = []
        for entry_id, fields in entries:
            try:
                samples.append((entry_id, decode_sample(fields[FIELD])))
            except (ContractError, KeyError) as exc:  # a poison entry must not break the page
                log.warning("dashboard: undecodable entry %s in %s: %s", entry_id, source, exc)
        rewards = [s.reward if s.has_reward else None for _, s in samples]
        advantages = group_advantages([s.group_id or s.sample_id for _, s in samples], rewards)
        shown = [self._sample_json(e, s, a) for (e, s), a in zip(samples, advantages, strict=True)][
            :limit
        ]
        return {"source": source, "samples": shown}

    def _sample_json(self, entry_id: Any, s: Any, advantage: float | None) -> dict[str, Any]:
        ids, mask = list(s.token_ids), list(s.loss_mask)
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        start = max(0, first - CONTEXT_TOKENS)
        end = min(len(ids), start + MAX_TOKENS)
        pieces = self.decode(ids[start:end])
        versions = [v for v in s.weight_versions if v >= 0]
        return {
            "entry_id": entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id),
            "sample_id": s.sample_id,
            "session_id": s.session_id,
            "group_id": s.group_id,
            "created_at": s.created_at,
            "finish_reason": s.finish_reason,
            "reward": s.reward if s.has_reward else None,
            "rewards": dict(s.rewards),
            "advantage": advantage,
            "error": s.error,
            "hint": s.hint,
            "teacher_status": s.teacher_status,
            "votes": [
                {
                    "judge": v.judge,
                    "value": v.value if v.has_value else None,
                    "explanation": v.explanation,
                }
                for v in s.votes
            ],
            "weight_version": max(versions) if versions else None,
            "tokens": [[p, m] for p, m in zip(pieces, mask[start:end], strict=True)],
            "omitted_before": start,
            "omitted_after": len(ids) - end,
        }

    def stream_table(self) -> dict[str, Any]:
        return {
            "streams": [
                {
                    "name": st.name,
                    "key": st.key,
                    "length": st.length,
                    "groups": [asdict(g) for g in st.groups],
                }
                for st in stream_stats(self.client, self.streams)
            ]
        }


# ---------------------------------------------------------------- login bridge


LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Flywheel dashboard</title>
<style>body{font:15px system-ui,sans-serif;margin:4em auto;max-width:28em}input{width:100%;
padding:.5em;margin:.5em 0}.error{color:#b00020}</style></head><body><h1>Flywheel dashboard</h1>
<p>This gateway requires an <b>admin</b> API key.</p><!--error-->
<form method="post" action="/dashboard/login"><input type="password" name="key"
placeholder="fwk-..." autofocus><button type="submit">Open the dashboard</button></form>
</body></html>"""
NOT_VALID = "that key is not valid (unknown or revoked); paste an admin key (fwk-...)"
NOT_ADMIN = (
    "that key is not an admin key: the dashboard needs an admin key "
    "(create one with `flywheel keys create --role admin`)"
)


def login_page(error: str = "") -> bytes:
    """The key form; `error` shown above it (HTML-escaped)."""
    shown = f'\n<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return LOGIN_PAGE.replace("<!--error-->", shown).encode()


class DashboardSessions:
    """Dashboard logins in Redis, shared by every gateway replica.

    The browser's cookie holds a random token (`secrets.token_urlsafe(32)`); Redis holds, under
    `<prefix>:dashboard:login:<sha256(token)>` with a TTL, the admin key's id and the key sealed
    with that token (XOR with SHAKE-256 of the token). Neither the cookie nor Redis alone yields
    the key; with both, the request is authenticated with the key as any bearer request is, so a
    revoked key ends its dashboard logins at once.
    """

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int = LOGIN_TTL_S):
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def _name(self, token: str) -> str:
        return f"{self.prefix}:dashboard:login:{hash_key(token)}"

    def open(self, secret: str, key_id: str) -> str:
        """Store a login for `secret` (an admin key, id `key_id`); returns the cookie's token."""
        token = secrets.token_urlsafe(32)
        sealed = _seal(secret.encode(), token).hex()
        record = json.dumps({"key_id": key_id, "sealed": sealed})
        self.client.set(self._name(token), record, ex=self.ttl_s)
        return token

    def key(self, token: str) -> str:
        """The key a login token stands for; "" when it is unknown, expired or logged out."""
        raw = self.client.get(self._name(token)) if token else None
        if raw is None:
            return ""
        try:
            sealed = bytes.fromhex(json.loads(raw)["sealed"])
            return _seal(sealed, token).decode()
        except (ValueError, KeyError, TypeError):
            return ""

    def close(self, token: str) -> None:
        """End a login (logout, or its key was refused)."""
        if token:
            self.client.delete(self._name(token))


def _seal(data: bytes, token: str) -> bytes:
    """XOR with a SHAKE-256 stream of the token (its own inverse)."""
    pad = hashlib.shake_256(b"flywheel-dashboard-login:" + token.encode()).digest(len(data))
    return bytes(a ^ b for a, b in zip(data, pad, strict=True))


class DashboardLogin:
    """ASGI middleware outside the security middleware, for /dashboard paths only: login cookie
    -> bearer header, `POST /dashboard/login` -> login cookie, `POST /dashboard/logout`, and a
    key form instead of the page's 401 or 403.

    Args:
        keys: the gateway's key store; the key typed into the form is checked against it.
        logins: where logins are kept (`DashboardSessions`).
    """

    def __init__(self, app: Any, keys: KeyStore, logins: DashboardSessions):
        self.app = app
        self.keys = keys
        self.logins = logins

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/dashboard"):
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        token = _cookie(headers, COOKIE)
        try:
            if path == "/dashboard/login" and scope["method"] == "POST":
                await self._login(scope, receive, send)
                return
            if path == "/dashboard/logout" and scope["method"] == "POST":
                await asyncio.to_thread(self.logins.close, token)
                await _send_redirect(send, _expired_cookie())
                return
            if token and not any(k == b"authorization" for k, _ in headers):
                key = await asyncio.to_thread(self.logins.key, token)
                if key:
                    bearer = (b"authorization", f"Bearer {key}".encode())
                    scope = dict(scope, headers=[*headers, bearer])
        except redis.RedisError as exc:
            await redis_unavailable(exc)(scope, receive, send)
            return
        if path != "/dashboard":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_login_on_refusal(message: dict) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] in (401, 403):
                replaced = True
                status = message["status"]
                if status == 401:  # no key, or the login's key was revoked
                    await asyncio.to_thread(self.logins.close, token)
                    await _send_page(send, 401, "", [_expired_cookie()])
                else:  # a valid key of another role
                    await _send_page(send, 403, NOT_ADMIN)
                return
            if not replaced:
                await send(message)

        await self.app(scope, receive, send_login_on_refusal)

    async def _login(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body") or len(body) > 4096:
                break
        key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
        record = await asyncio.to_thread(self.keys.verify, key) if key else None
        if record is None:
            await _send_page(send, 401, NOT_VALID, [_expired_cookie()])
            return
        if record.role != "admin":
            await _send_page(send, 403, NOT_ADMIN, [_expired_cookie()])
            return
        token = await asyncio.to_thread(self.logins.open, key, record.key_id)
        cookie = SimpleCookie()
        cookie[COOKIE] = token
        morsel = cookie[
            COOKIE
        ]  # typeshed's Morsel.update takes str values only; httponly/secure are flags
        morsel["path"] = "/dashboard"
        morsel["max-age"] = str(self.logins.ttl_s)
        morsel["httponly"] = True
        morsel["samesite"] = "Strict"
        if scope.get("scheme") == "https":  # uvicorn sets it from a trusted proxy's headers
            morsel["secure"] = True
        await _send_redirect(send, (b"set-cookie", morsel.OutputString().encode()))


async def _send_redirect(send: Any, cookie: tuple[bytes, bytes]) -> None:
    """303 to the dashboard page, setting or expiring the login cookie."""
    headers = [(b"location", b"/dashboard"), (b"content-length", b"0"), cookie]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _expired_cookie() -> tuple[bytes, bytes]:
    return (b"set-cookie", f"{COOKIE}=; Path=/dashboard; Max-Age=0".encode())


async def _send_page(
    send: Any, status: int, error: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = login_page(error)
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _cookie(headers: list[tuple[bytes, bytes]], name: str) -> str:
    for key, value in headers:
        if key == b"cookie":
            jar = SimpleCookie()
            jar.load(value.decode("latin-1"))
            if name in jar:
                return jar[name].value
    return ""


# ---------------------------------------------------------------- routes


def _static(name: str) -> str:
    return resources.files("flywheel.gateway").joinpath("static", name).read_text()


def dashboard_router(data: DashboardData) -> APIRouter:
    router = APIRouter(
        prefix="/dashboard", dependencies=[Depends(require_role("admin"))], include_in_schema=False
    )

    @router.get("")
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("dashboard.html"))

    @router.get("/app.js")
    async def script() -> Response:
        return Response(_static("dashboard.js"), media_type="text/javascript")

    @router.get("/api/curves")
    async def curves(since: int = Query(0, ge=0)) -> dict[str, Any]:
        return await asyncio.to_thread(read_curves, data.metrics_path, since)

    @router.get("/api/samples")
    async def samples(limit: int = Query(8, ge=1, le=50)) -> dict[str, Any]:
        return await asyncio.to_thread(data.samples, limit)

    @router.get("/api/streams")
    async def streams() -> dict[str, Any]:
        return await asyncio.to_thread(data.stream_table)

    return router


def install(app: FastAPI, deps: Any, settings: FlywheelSettings | None = None) -> None:
    """Mount /dashboard on the gateway app built from `deps` (GatewayDeps) and register the
    stream gauges. Call after the security middleware is installed (this one must wrap it).

    Args:
        settings: the deployment's settings (trainer.logging.metrics_path, stream names); None =
            parsed from the environment/`FLYWHEEL_CONFIG`, as the gateway's own were.
    """
    global _collector
    if settings is None:
        try:
            settings = load_settings()
        except (ValueError, OSError) as exc:  # main() parsed the same sources already; tests
            log.warning("dashboard: settings unreadable (%s); trainer curves disabled", exc)
            settings = FlywheelSettings.model_construct()  # defaults, no environment
            settings.trainer.logging.metrics_path = ""
    streams = settings.streams.model_copy(update={"prefix": deps.sessions.prefix})
    tokenizer = deps.renderer.tokenizer

    def decode(ids: list[int]) -> list[str]:
        return tokenizer.batch_decode([[i] for i in ids])

    metrics_file = settings.trainer.logging.metrics_path
    metrics_path = Path(metrics_file) if metrics_file else None
    data = DashboardData(deps.sessions.client, streams, metrics_path, decode)
    app.include_router(dashboard_router(data))
    client, prefix = deps.sessions.client, deps.sessions.prefix
    logins = DashboardSessions(client, prefix)
    app.add_middleware(DashboardLogin, keys=KeyStore(client, prefix), logins=logins)
    if _collector is not None:  # a second app in one process (tests): the newest one reports
        REGISTRY.unregister(_collector)
    _collector = StreamStatsCollector(deps.sessions.client, streams)
    REGISTRY.register(_collector)
