"""An engine call that failed, in words a client can act on, and the client's error when every
engine tried failed that way.

aiohttp's exception reprs (`ClientConnectorError(ConnectionKey(host=..., ...), ...)`) say
little to a client; `describe` names what happened. An engine that refuses the connection is
not running (stopped, or `flywheel up` is starting it again); when every engine tried refused,
the client gets `EngineUnavailableError`, a 503 with `Retry-After` in its API's error format,
instead of a 502, so SDK clients that retry a 503 after Retry-After wait for it.
"""

from __future__ import annotations

import errno
import logging

import aiohttp

from flywheel.core.errors import EngineUnavailableError, PlatformError, UpstreamError
from flywheel.gateway.engines.client_text import without_urls
from flywheel.gateway.engines.overload import busy_error
from flywheel.gateway.engines.timeouts import timeout_error

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0
"""Seconds the client is told to wait: an engine that starts again loads in seconds."""


def is_refused(exc: BaseException) -> bool:
    """True when the call never reached an engine process (connection refused, no route)."""
    return isinstance(exc, aiohttp.ClientConnectorError)


RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})
"""A connection the engine's side dropped: what a call in flight sees when the engine exits."""


def describe(exc: BaseException) -> str:
    """One phrase in words for a failed engine call, e.g. "connection refused: the engine is not
    running (stopped, or starting again)" for `ClientConnectorError(..., ConnectionRefusedError(
    111, ...))`, "the engine reset the connection (did it exit?)" for `ClientOSError(104,
    'Connection reset by peer')`. No exception's type name or repr: the phrase reaches the
    client; an exception of a kind not named here is logged with its repr."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            reason = "connection refused"
        else:
            reason = f"cannot connect ({exc.os_error.strerror or 'no reason given'})"
        return f"{reason}: the engine is not running (stopped, or starting again)"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "no connection within the timeout: the engine is unreachable"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the engine closed the connection before answering (did it exit?)"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the engine's answer broke off before its end (did it exit?)"
    if isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError) or (
        isinstance(exc, OSError) and exc.errno in RESET_ERRNOS
    ):
        return "the engine reset the connection (did it exit?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"the connection to the engine failed ({exc.strerror})"
    log.warning("engine call failed: %r", exc)
    return "the call to the engine failed (the gateway's log has the details)"


def unavailable_error(refusals: list[str]) -> EngineUnavailableError:
    """The client's 503 when every engine tried refused the connection (`refusals`: one line per
    engine) or none is in service."""
    return EngineUnavailableError(
        f"no engine is running to serve the request; retry after {RETRY_AFTER_S:g} s "
        f"({'; '.join(refusals)})",
        retry_after_s=RETRY_AFTER_S,
    )


def no_engine_served(
    busy: list[str], timeouts: list[str], refused: list[str], errors: list[str], timeout_s: float
) -> PlatformError:
    """The client's error when no engine tried served a call (plain or streamed), each list one
    line per engine: any busy -> 503 busy (overload.py); else any timeout -> 504
    (timeouts.py); else every failure a refused connection, or no engine tried at all -> 503
    unavailable with Retry-After; else 502 naming each failure (`errors` holds `refused` too).
    The lines name the engines by URL: they are logged as they are, and the client's message
    names them "engine 1", "engine 2" (client_text.py)."""
    failures = [*busy, *timeouts, *errors]
    if failures:
        log.warning("no engine served the call: %s", "; ".join(failures))
    shown = without_urls([*busy, *timeouts, *refused, *errors])
    b, t, r = len(busy), len(busy) + len(timeouts), len(busy) + len(timeouts) + len(refused)
    busy, timeouts, refused, errors = shown[:b], shown[b:t], shown[t:r], shown[r:]
    if busy:
        return busy_error(busy + errors + timeouts)
    if timeouts:
        return timeout_error(timeouts + errors, timeout_s)
    if len(refused) == len(errors):
        return unavailable_error(refused or ["none is in service (GET /v1/admin/engines)"])
    return UpstreamError("no engine could serve the request: " + "; ".join(errors))
