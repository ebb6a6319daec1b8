"""Backpressure on live turns, decided before the engine is called.

A live turn's save adds the Samples it makes due (the previous turn with its next state, n > 1
choices not continued) to the train stream, and the save is refused while the stream is at its
high-water mark (`session/scripts.py`, answer 2). So the turn is checked first: when it has
Samples to add and the backlog is at the mark, `gateway.live_backpressure` decides, before any
generation:

- `refuse` (default): a 429 with Retry-After in the API's own error JSON; the engine is not
  called and the session is left as it was (the waiting turn still waits).
- `serve_unrecorded`: the turn is generated and answered but the session is not saved (the
  reply is not recorded; the waiting turn still waits, and a later request carrying this reply
  renders it as prompt text). Counted in `flywheel_gateway_live_turns_unrecorded_total`
  {reason="backpressure"} and logged.

Should the backlog reach the mark between the check and the save, the turn has been generated
already: it is answered unrecorded (same counter and log) whatever the setting, never refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import Counter

from flywheel.core.errors import BackpressureError

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0
REFUSED = Counter(
    "flywheel_gateway_live_turns_refused_total",
    "Live turns refused with 429 before generation because the train stream was at its "
    "high-water mark (gateway.live_backpressure = refuse)",
)
UNRECORDED = Counter(
    "flywheel_gateway_live_turns_unrecorded_total",
    "Live turns answered without being recorded, by reason (backpressure: the stream was at "
    "its high-water mark; not_for_training: the key or its tenant opted out of recording)",
    ["reason"],
)
for _reason in ("backpressure", "not_for_training"):
    UNRECORDED.labels(_reason)


async def backlog_full(d: GatewayDeps) -> bool:
    """True while the train stream's backlog is at its high-water mark (never with none set)."""
    p = d.publisher
    return bool(p.high_water) and await p.abacklog() >= p.high_water


def refused(session_id: str) -> BackpressureError:
    """Count and log a live turn refused before generation; returns the 429 to raise."""
    REFUSED.inc()
    log.warning(
        "session %s: the train stream is at its high-water mark; the live turn is refused "
        "(429) before generation",
        session_id,
    )
    return BackpressureError(
        "the training backlog is full, so this turn cannot be recorded; retry later",
        retry_after_s=RETRY_AFTER_S,
    )


def served_unrecorded(session_id: str | None, reason: str, tokens: int) -> None:
    """Count and log a live turn answered without being recorded (`reason`: backpressure or
    not_for_training; `tokens`: its sampled tokens over all choices)."""
    UNRECORDED.labels(reason).inc()
    log.info(
        "session %s: live turn served unrecorded (%s), %d sampled tokens not recorded",
        session_id or "-",
        reason,
        tokens,
    )
