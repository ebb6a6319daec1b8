"""An engine call past `gateway.request_timeout_s`: a 504 naming that setting, not a 502.

A slow answer (a long generation, a queue on a loaded engine) says nothing about the engine's
health, so a timed-out engine stays in service (a connection error still takes it out,
pool.py). The call is tried once more on another engine as any failed call is; when the
request was not served, the client gets 504 `engine_timeout` in its API's error format.
"""

from __future__ import annotations

import logging

import aiohttp
from prometheus_client import Counter

from flywheel.core.errors import EngineTimeoutError
from flywheel.gateway.engines.client_text import without_urls

log = logging.getLogger(__name__)
ENGINE_TIMEOUTS = Counter(
    "flywheel_gateway_engine_timeouts_total",
    "Engine calls that took longer than gateway.request_timeout_s (engine kept in service)",
    ["engine"],
)


def is_timeout(exc: BaseException) -> bool:
    """True for a call that ran out of time (aiohttp's total or read timeout); False for a
    connection that could not be made in time (`ConnectionTimeoutError`: the engine is
    unreachable) and for every other transport error."""
    return isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)


def note_timeout(url: str, timeout_s: float) -> str:
    """Count and log one timed-out call; the line for the client's message."""
    ENGINE_TIMEOUTS.labels(url).inc()
    log.warning("engine %s did not answer within %g s (gateway.request_timeout_s)", url, timeout_s)
    return f"{url}: no answer within {timeout_s:g} s"


def timeout_error(failures: list[str], timeout_s: float) -> EngineTimeoutError:
    """The client's 504 when a call timed out and no engine served the request."""
    return EngineTimeoutError(
        f"the engine did not answer within gateway.request_timeout_s ({timeout_s:g} s); ask "
        "for fewer tokens, retry, or raise gateway.request_timeout_s (with "
        f"gateway.security.request_timeout_s) ({'; '.join(failures)})",
        code="engine_timeout",
    )


def stream_timeout_error(url: str, timeout_s: float) -> EngineTimeoutError:
    """The client's 504 when a streamed call ran past `gateway.request_timeout_s` after its
    first chunk (its text already sent, so no other engine is tried): counted and logged as
    any timed-out call, the message naming the setting."""
    (failure,) = without_urls([note_timeout(url, timeout_s)])  # the URL is in the log line
    return EngineTimeoutError(
        f"the engine's stream ran past gateway.request_timeout_s ({timeout_s:g} s) after it "
        "started; nothing was recorded: ask for fewer tokens, send the request again, or raise "
        f"gateway.request_timeout_s (with gateway.security.request_timeout_s) ({failure})",
        code="engine_timeout",
    )
