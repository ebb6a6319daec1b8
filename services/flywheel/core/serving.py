"""Serve an HTTP service's ASGI app with uvicorn, stopping quietly (the gateway's and the
engine's `main`).

On SIGTERM or Ctrl-C uvicorn stops accepting connections and gives the requests in flight
`grace_s` seconds to end; then it cancels the ones left (a generation of thousands of tokens, a
chat turn waiting on it). Left to uvicorn, each cancelled request logs a traceback ("Exception in
ASGI application ... CancelledError") and is answered a plain-text 500, after an ERROR line
"Cancel N running task(s)". Here the cancelled requests are answered 503 in the services' error
JSON (a response already begun, such as a stream, is cut off: its connection closes), and the
log gets one WARNING line counting them:
`stopping: cancelled 26 in-flight request(s) still running 5 s after the stop began`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

from flywheel.core.http_errors import KEEP_ALIVE_S, error_body, error_json

STOP_GRACE_S = 5
"""Seconds the requests in flight get to end once the server is told to stop."""

_STOPPING_BODY = error_json(
    error_body(
        "the server is stopping: this request was cancelled before it ended; retry it "
        "once the service is back",
        "service_unavailable_error",
    )
)
_STOPPING_START = {
    "type": "http.response.start",
    "status": 503,
    "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_STOPPING_BODY)).encode()),
        (b"connection", b"close"),
    ],
}
_STOPPING_END = {"type": "http.response.body", "body": _STOPPING_BODY, "more_body": False}


class StopGuard:
    """ASGI wrapper of `app`: once `stopping` is set, a request cancelled (by the server that
    stops) is answered 503 instead of raising `CancelledError` into the server, which would
    log a traceback and answer 500. Before that, a cancellation propagates unchanged."""

    def __init__(self, app: Any):
        self.app = app
        self.stopping = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.stopping or scope["type"] != "http":
                raise
            # The server refuses a new start once a response began: that one is cut off.
            with contextlib.suppress(RuntimeError):
                await send(_STOPPING_START)
                await send(_STOPPING_END)


_CANCELLED = "stopping: cancelled %s in-flight request(s) still running %s s after the stop began"
"""The one line logged for the requests cancelled at a stop (their count, the grace period)."""


class _StopLog(logging.Filter):
    """On uvicorn's error logger: its "Cancel N running task(s)" ERROR becomes one WARNING line
    counting the cancelled requests, and, while stopping, its line on a response cut off
    ("returned without completing response") and any traceback of a cancellation are left
    out."""

    def __init__(self, guard: StopGuard, grace_s: int):
        super().__init__()
        self.guard = guard
        self.grace_s = grace_s

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Cancel %s running task(s)"):
            record.msg = _CANCELLED
            record.args = ((record.args or ("?",))[0], self.grace_s)  # type: ignore[index]
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        if not self.guard.stopping:
            return True
        if message.startswith("ASGI callable returned without completing response"):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    grace_s: int = STOP_GRACE_S,
    keep_alive_s: int = KEEP_ALIVE_S,
) -> None:
    """Serve `app` on `host:port` until SIGTERM or SIGINT (as `uvicorn.run`, quietly stopping:
    see the module's docstring). Exits with status 3, as `uvicorn.run` does, when the server
    could not start (its port taken)."""
    import uvicorn  # noqa: PLC0415

    guard = StopGuard(app)
    config = uvicorn.Config(
        guard,
        host=host,
        port=port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=grace_s,
        timeout_keep_alive=keep_alive_s,
    )
    logging.getLogger("uvicorn.error").addFilter(_StopLog(guard, grace_s))

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            guard.stopping = True
            await super().shutdown(sockets)

    server = Server(config)
    server.run()
    if not server.started:
        sys.exit(3)
