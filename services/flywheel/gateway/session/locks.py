"""The session lock as an async context: taken with the record read, released with it saved.

A turn, a finish and a posted reward each hold their session's lock for their whole run
(`locked`), so concurrent requests on one session run one after another; a request waits up to
`LOCK_WAIT_S` (600 s) for the lock, then is a 409 `session <id> is busy`. The lease is renewed
while they run, so a crashed gateway's lock expires after `LOCK_LEASE_S` and a long generation
keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis

from flywheel.core.errors import ConflictError, NotFoundError
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.session.owner import check_request_owner
from flywheel.gateway.session.store import LOCK_LEASE_S, SessionLease, SessionStore

log = logging.getLogger(__name__)
LOCK_WAIT_S = 600.0
"""Seconds a request waits for its session's lock (another turn, reward or finish of the same
session holding it) before a 409 `session <id> is busy` (docs/sessions.md)."""


@asynccontextmanager
async def locked(
    store: SessionStore, session_id: str, timeout_s: float = LOCK_WAIT_S
) -> AsyncIterator[SessionRecord]:
    """Async form of `SessionStore.locked`: saved on normal exit, untouched on error.

    The lock is taken and the record read in one Redis round trip, and saved and released in
    one more, both on the event loop (no thread hop); while another request holds the session
    this waits on the event loop (5 ms doubling to 100 ms between tries, each +-50% at random).

    Raises:
        NotFoundError: no such session, or one of another key than the request's
            (`REQUEST_OWNER`). ConflictError: busy for `timeout_s` seconds, or the lease
            expired while the turn ran (nothing saved).
    """
    deadline, pause = time.monotonic() + timeout_s, 0.005
    while (lease := await store.atry_acquire(session_id, LOCK_LEASE_S)) is None:
        if time.monotonic() >= deadline:
            raise ConflictError(f"session {session_id} is busy", param="session_id")
        await asyncio.sleep(pause * random.uniform(0.5, 1.5))  # waiters spread their tries
        pause = min(pause * 2, 0.1)
    try:
        check_request_owner(lease.record)
    except NotFoundError:
        await asyncio.shield(store.arelease(lease))
        raise
    renewal = asyncio.create_task(_renew(store, lease))
    try:
        yield lease.record
    except BaseException:
        renewal.cancel()
        await asyncio.shield(store.arelease(lease))
        raise
    renewal.cancel()
    # shielded: a request cancelled meanwhile (its client gone, its time limit) still ends
    # its one-round-trip save or unlock, never leaving the lock to expire with its lease
    await asyncio.shield(store.arelease(lease, lease.record))


async def _renew(store: SessionStore, lease: SessionLease) -> None:
    """Renew the session lock's lease while a turn runs (a long generation keeps it; a crashed
    gateway's lock expires after `LOCK_LEASE_S`)."""
    while True:
        await asyncio.sleep(LOCK_LEASE_S / 3)
        try:
            held = await store.arenew(lease)
        except redis.RedisError as exc:  # bounded: the next renewal retries
            log.warning("renewing the lock of session %s failed: %s", lease.session_id, exc)
            continue
        if not held:
            log.error("lost the lock of session %s while a turn was running", lease.session_id)
            return
