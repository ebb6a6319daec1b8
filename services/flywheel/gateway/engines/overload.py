"""An engine whose request queue is full: a fast 503 with Retry-After, not a 502 after the
engine call's timeout.

SGLang refuses a request beyond `--max-queued-requests` with 429 (Retry-After 0; 503 in older
versions), the embedded engine beyond `engine.max_queued_requests` with 503, and both answer
503 while loading. Such an engine is busy, not broken: the call goes to the next engine without
taking this one out of service, and when every engine tried refused, the client gets 503
`engine_overloaded` with `Retry-After` in its API's error format (OpenAI or Anthropic JSON).
"""

from __future__ import annotations

from prometheus_client import Counter

from flywheel.core.errors import OverloadedError

BUSY_STATUSES = (429, 503)
"""Engine statuses that mean "full or not ready, try elsewhere or later"."""
RETRY_AFTER_S = 1.0
"""Seconds the client is told to wait (`Retry-After`): a queue drains in about a batch's time."""
ENGINE_BUSY = Counter(
    "flywheel_gateway_engine_busy_total",
    "Engine calls refused by a full (or not ready) engine: 429 or 503",
    ["engine"],
)


def busy_error(refusals: list[str]) -> OverloadedError:
    """The client's 503 after every engine tried refused (`refusals`: one line per engine,
    with the engine's own reason): "the engine is busy (its request queue is full, or it is
    still loading); retry after 1 s (<refusals>)", never claiming a full queue for an engine
    that is loading."""
    return OverloadedError(
        "the engine is busy (its request queue is full, or it is still loading); retry after "
        f"{RETRY_AFTER_S:g} s ({'; '.join(refusals)})",
        retry_after_s=RETRY_AFTER_S,
    )
