"""Idle sessions finished by the gateway, so nothing a session holds is lost when it expires.

A session's record expires from Redis `gateway.session_ttl_s` after its last request. An
abandoned session may still hold unpublished data: a live turn waiting for its next state
(and other branches' turns), n > 1 choices never sent back, an episode's segment. Every gateway
replica runs `run_sweeper`, which every `sweep_interval_s` finishes the open sessions idle for
longer than `gateway.session_idle_finish_s` (validated to be below the TTL) as a finish request
without a reward would: live turns get an empty `next_state`.

Safe with several replicas: the index of open sessions is one Redis sorted set (session id ->
time of its last save, `SessionStore.touched_key`); each idle session is taken under its lock
without waiting (a session whose lock is held is in use, so not idle), re-read, and finished
only if still open and still idle, so exactly one replica publishes it. Each finished session
counts in `flywheel_gateway_sessions_finished_total{reason="idle"}` and is logged; a record that
expired before any gateway could finish it (all gateways down for longer than the TTL) counts
in `flywheel_gateway_sessions_expired_total` and is logged as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import redis
from prometheus_client import Counter

from flywheel.core.errors import NotFoundError
from flywheel.core.settings import GatewaySettings
from flywheel.gateway.session import finish

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

log = logging.getLogger(__name__)
EXPIRED = Counter(
    "flywheel_gateway_sessions_expired_total",
    "Open sessions whose Redis record expired before a gateway finished them "
    "(anything they held was lost)",
)
UNREADABLE = Counter(
    "flywheel_gateway_sessions_unreadable_total",
    "Open sessions whose stored record could not be read (its log does not add "
    "up, or it is not a record's JSON): left out of the idle sweep, not finished",
)
BATCH = 100
"""Sessions examined per Redis round trip of a sweep."""


def sweep_interval_s(settings: GatewaySettings) -> float:
    """Seconds between sweeps: a quarter of `session_idle_finish_s`, within [0.2, 30]."""
    return min(30.0, max(0.2, settings.session_idle_finish_s / 4))


def sweep_idle(d: GatewayDeps, now: float | None = None) -> int:
    """Finish every open session not saved for `session_idle_finish_s` seconds before `now`.

    Args:
        d: the gateway's dependencies (session store, publisher, settings).
        now: Unix time to measure idleness from (default: the current time).

    Returns:
        The number of sessions this call finished.
    """
    store = d.sessions
    cutoff = (time.time() if now is None else now) - d.settings.session_idle_finish_s
    finished = offset = 0
    while True:
        batch = store.idle(cutoff, BATCH, offset)
        if not batch:
            return finished
        for session_id in batch:
            outcome = _finish_if_idle(d, session_id, cutoff)
            finished += outcome == "finished"
            offset += outcome == "kept"  # the others left the index


def _finish_if_idle(d: GatewayDeps, session_id: str, cutoff: float) -> str:
    """ "finished", "removed" (finished or expired already) or "kept" (busy, or touched)."""
    store = d.sessions
    try:
        lease = store.try_acquire(session_id)  # the record is read under the lock
    except NotFoundError:
        _expired(d, session_id)
        return "removed"
    except ValueError as exc:  # one bad record must not stop the sweep of the others
        UNREADABLE.inc()
        log.error(
            "session %s cannot be read and is left out of the idle sweep (%s); what it "
            "holds is not published",
            session_id,
            exc,
        )
        store.forget(session_id)
        return "removed"
    if lease is None:
        return "kept"  # a request is running in it: not idle
    record, finished = lease.record, False
    try:
        touched = store.touched_at(session_id)
        if record.status != "open":
            store.forget(session_id)
            return "removed"
        if touched is None or touched > cutoff:
            return "kept"  # saved again since the sweep listed it
        samples = finish.finish_record(d, record, None, None, by="idle")
        finished = True
    finally:
        store.release(lease, record if finished else None)  # saved only when finished here
    log.warning(
        "session %s (%s mode) idle for %.0f s: finished by the gateway, %d Samples published",
        session_id,
        record.mode,
        time.time() - touched,
        len(samples),
    )
    return "finished"


def _expired(d: GatewayDeps, session_id: str) -> None:
    EXPIRED.inc()
    d.sessions.forget(session_id)
    log.error(
        "session %s expired from Redis before it was finished: what it held was lost "
        "(were all gateways down for longer than gateway.session_ttl_s?)",
        session_id,
    )


async def run_sweeper(d: GatewayDeps) -> None:
    """Sweep idle sessions every `sweep_interval_s` until cancelled (one per gateway); first
    index the sessions stored without a last-touch time (`SessionStore.index_existing`)."""
    period = sweep_interval_s(d.settings)
    try:
        added = await asyncio.to_thread(d.sessions.index_existing)
        if added:
            log.info(
                "indexed %d sessions stored without a last-touch time for the idle sweep", added
            )
    except redis.RedisError as exc:  # the sweep still covers every session saved from now on
        log.warning("indexing existing sessions for the idle sweep failed: %s", exc)
    while True:
        await asyncio.sleep(period)
        try:
            await asyncio.to_thread(sweep_idle, d)
        except redis.RedisError as exc:  # bounded: the next sweep retries
            log.warning("idle-session sweep failed (Redis): %s", exc)
        except Exception:  # the loop outlives one bad session; the error is logged
            log.exception("idle-session sweep failed")
